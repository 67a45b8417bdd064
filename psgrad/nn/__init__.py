"""Modules users put in their models that live partly on the servers: psgrad.Embedding,
psgrad.EmbeddingBag and psgrad.EmbeddingBagCollection (embedding tables whose rows the job's shards hold)."""
from psgrad.nn.collection import EmbeddingBagCollection
from psgrad.nn.embedding import Embedding, EmbeddingBag, SparseEmbedding, sparse_modules

__all__ = ["Embedding", "EmbeddingBag", "EmbeddingBagCollection", "SparseEmbedding", "sparse_modules"]
