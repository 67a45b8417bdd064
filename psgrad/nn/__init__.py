"""Modules users put in their models that live partly on the servers: psgrad.Embedding and
psgrad.EmbeddingBag (embedding tables whose rows the job's shards hold), and psgrad.clip_grad_norm_,
whose norm covers their rows' gradients too."""
from psgrad.nn.embedding import Embedding, EmbeddingBag, SparseEmbedding, clip_grad_norm_, sparse_modules

__all__ = ["Embedding", "EmbeddingBag", "SparseEmbedding", "clip_grad_norm_", "sparse_modules"]
