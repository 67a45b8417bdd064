"""Modules users put in their models that live partly on the servers: psgrad.Embedding,
psgrad.EmbeddingBag and psgrad.EmbeddingBagCollection (embedding tables whose rows the job's shards
hold), and psgrad.clip_grad_norm_, whose norm covers their rows' gradients too."""
from psgrad.nn.collection import EmbeddingBagCollection
from psgrad.nn.embedding import (Embedding, EmbeddingBag, SparseEmbedding, clip_grad_norm_, sparse_aliases,
                                  sparse_modules)

__all__ = ["Embedding", "EmbeddingBag", "EmbeddingBagCollection", "SparseEmbedding", "clip_grad_norm_", "sparse_aliases",
           "sparse_modules"]
