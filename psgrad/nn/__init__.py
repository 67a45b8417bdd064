"""Modules users put in their models that live partly on the servers: psgrad.Embedding and
psgrad.EmbeddingBag (embedding tables whose rows the job's shards hold)."""
from psgrad.nn.embedding import Embedding, EmbeddingBag, SparseEmbedding, sparse_modules

__all__ = ["Embedding", "EmbeddingBag", "SparseEmbedding", "sparse_modules"]
