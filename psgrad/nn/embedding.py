"""Embedding tables whose rows live on the servers: psgrad.Embedding and psgrad.EmbeddingBag, drop-ins
for torch.nn.Embedding and torch.nn.EmbeddingBag. The module holds no weight: `ps.optimizer(model)`
binds each one to the job as a sparse table (named by its place in the model), a forward pulls
only the rows of the batch's unique ids (one call per shard that holds some), and the optimizer's
step pushes their gradients, coalesced per id, before the dense gradient of the same step. Rows
start as N(0, std²) draws made on the servers from (seed, table, row id), so an untouched row costs
its server 8 bytes of index, and every row is the same on every server after every restart."""
from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from psgrad.core import rows
from psgrad.errors import ConfigError, InvalidRequestError, WorkerStateError

EMBEDDING_BAG_MODES = ("sum", "mean")


class RowSource(Protocol):
    """Where a bound table's rows come from (the job's shards; see ParameterClient.pull_tables)."""

    def pull_tables(self, lookups: Mapping[str, torch.Tensor], observe: bool) -> dict[str, torch.Tensor]:
        """Rows [len(ids), dim] (float32, CPU) of row ids (unique, int64, CPU), by table: one call
        per shard for all of them."""


class SparseEmbedding(nn.Module):
    """What psgrad.Embedding and psgrad.EmbeddingBag share: the table's shape and initialisation,
    the binding to a job, the forward's pull and the rows a backward gave gradients to."""

    def __init__(self, num_embeddings: int, embedding_dim: int, std: float = 1.0, seed: int = 0) -> None:
        super().__init__()
        if not (isinstance(num_embeddings, int) and num_embeddings >= 1):
            raise ConfigError(f"num_embeddings must be an integer >= 1, got {num_embeddings!r}")
        if not (isinstance(embedding_dim, int) and embedding_dim >= 1):
            raise ConfigError(f"embedding_dim must be an integer >= 1, got {embedding_dim!r}")
        if not (std == std and 0 <= std < float("inf")):
            raise ConfigError(f"std must be a finite number >= 0, got {std!r}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.std, self.seed = float(std), int(seed)
        self.table: str | None = None  # its name in the job, once bound
        self._source: RowSource | None = None
        self._observe = False  # after the worker left: read-only pulls
        self._touched: list[tuple[torch.Tensor, torch.Tensor]] = []  # (unique ids, their rows as leaves)
        # the last input's unique ids: (the input, its version counter, unique ids, each id's index)
        self._last_unique: tuple[weakref.ref[torch.Tensor], int, torch.Tensor, torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        """The whole table's bytes in float32 (what replicating it would cost every worker)."""
        return self.num_embeddings * self.embedding_dim * 4

    def extra_repr(self) -> str:
        where = f", table={self.table!r}" if self.table else ", unbound"
        return f"{self.num_embeddings}, {self.embedding_dim}, std={self.std:g}{where}"

    def bind(self, table: str, source: RowSource) -> None:
        """Make this module table `table` of a job (PSOptimizer does this; a model given to a new
        job's optimizer is bound to that one)."""
        self.table, self._source, self._observe = table, source, False
        self._touched.clear()

    def read_only(self) -> None:
        """The worker left its job: forwards still read the rows (evaluation), nothing is pushed."""
        self._observe = True
        self._touched.clear()

    def initial_weight(self) -> torch.Tensor:
        """The whole table as the servers make it before any update ([num_embeddings, dim]): for a
        local copy of a small table (tests, a dense baseline); a large one costs its full size."""
        key = rows.table_key(self.seed, self.table or "")
        return rows.initial_rows(key, torch.arange(self.num_embeddings), self.embedding_dim, self.std)

    def _rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inverse, rows): each id's index into rows, which are the batch's unique ids' rows
        pulled from the servers (a leaf that records its gradient when training)."""
        source = self._bound_source()
        unique, inverse = self.unique_ids(ids)
        training = self._training()
        got = source.pull_tables({self.table or "": unique}, not training)
        return inverse, self.attach_rows(unique, got[self.table or ""], ids.device, training)

    def _bound_source(self) -> RowSource:
        if self._source is None:
            raise WorkerStateError(
                f"{type(self).__name__}({self.num_embeddings}, {self.embedding_dim}) is not bound to a job: "
                "its rows live on the servers; build ps.optimizer(model) (or psgrad.connect(...).optimizer) first"
            )
        return self._source

    def _training(self) -> bool:
        """Whether a forward now is a training step's (its rows take gradients and may be served
        from what the step prefetched), not an evaluation's read-only read."""
        return self.training and torch.is_grad_enabled() and not self._observe

    def unique_ids(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the unique ids of a forward's input, sorted, int64 on the CPU; each id's index into them).

        Raises:
            InvalidRequestError: not an integer tensor, or an id out of range.
        """
        last = self._last_unique  # a prefetch and the forward it serves look at the same tensor
        if last is not None and last[0]() is ids and last[1] == ids._version:
            return last[2], last[3]
        if ids.dtype not in (torch.int64, torch.int32):
            raise InvalidRequestError(f"{self.table}: row ids must be an integer tensor (int64 or int32), got {ids.dtype}")
        unique, inverse = torch.unique(ids.reshape(-1), sorted=True, return_inverse=True)
        unique = unique.to("cpu", torch.int64)
        rows.check_ids(unique, self.num_embeddings, f"table {self.table!r}")
        inverse = inverse.view(ids.shape)
        self._last_unique = (weakref.ref(ids), ids._version, unique, inverse)
        return unique, inverse

    def lookup(self, input: torch.Tensor) -> dict[str, torch.Tensor]:
        """The rows a forward of `input` reads, by table (what a prefetch asks the servers for)."""
        return {self.table or "": self.unique_ids(input)[0]}

    def attach_rows(self, unique: torch.Tensor, weight: torch.Tensor, device: torch.device, training: bool) -> torch.Tensor:
        """The pulled rows of `unique` as this forward uses them: on the input's device and, when
        training, a leaf that records its gradient (taken by take_gradients)."""
        weight = weight.to(device)
        if training:
            weight.requires_grad_(True)
            self._touched.append((unique, weight))
        return weight

    def take_gradients(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The gradients of the rows the forwards since the last call touched, coalesced per id:
        (unique ids [n] int64, their gradients [n, dim] float32, CPU); None when none was touched.
        Rows a forward pulled but no backward reached count as zero gradients."""
        touched, self._touched = self._touched, []
        parts = [(ids, w.grad) for ids, w in touched if w.grad is not None]
        if not parts:
            return None
        if len(parts) == 1:
            ids, grad = parts[0]
            return ids, grad.detach().to("cpu", torch.float32).contiguous()
        all_ids = torch.cat([ids for ids, _ in parts])
        grads = torch.cat([g.detach().to("cpu", torch.float32) for _, g in parts])
        unique, inverse = torch.unique(all_ids, sorted=True, return_inverse=True)
        summed = torch.zeros(unique.numel(), self.embedding_dim).index_add_(0, inverse, grads)
        return unique, summed


class Embedding(SparseEmbedding):
    """torch.nn.Embedding(num_embeddings, embedding_dim) with its rows on the parameter servers.

    Rows start as N(0, std²) (torch's default: std 1), drawn from (seed, the table's name, row id).
    padding_idx: that row's output is zeros and it takes no gradient, as in torch (its row on the
    servers keeps its initial value, unused).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 std: float = 1.0, seed: int = 0) -> None:
        super().__init__(num_embeddings, embedding_dim, std, seed)
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        if padding_idx is not None and not 0 <= padding_idx < num_embeddings:
            raise ConfigError(f"padding_idx must be within num_embeddings ({num_embeddings}), got {padding_idx}")
        self.padding_idx = padding_idx

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        inverse, weight = self._rows(input)
        out = F.embedding(inverse, weight)
        if self.padding_idx is not None:
            out = out * (input != self.padding_idx).unsqueeze(-1).to(out.dtype)
        return out


class EmbeddingBag(SparseEmbedding):
    """torch.nn.EmbeddingBag(num_embeddings, embedding_dim, mode) with its rows on the parameter
    servers: the sum or mean of each bag's rows (a 2-D input: one bag per row; a 1-D input with
    offsets: bags starting at each offset), optionally weighted per sample (mode "sum")."""

    def __init__(self, num_embeddings: int, embedding_dim: int, mode: str = "mean",
                 std: float = 1.0, seed: int = 0) -> None:
        super().__init__(num_embeddings, embedding_dim, std, seed)
        if mode not in EMBEDDING_BAG_MODES:
            raise ConfigError(f"mode must be one of {', '.join(EMBEDDING_BAG_MODES)}, got {mode!r}")
        self.mode = mode

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        inverse, weight = self._rows(input)
        return F.embedding_bag(inverse, weight, offsets, mode=self.mode, per_sample_weights=per_sample_weights)


def sparse_modules(model: nn.Module) -> list[tuple[str, SparseEmbedding]]:
    """The model's psgrad embeddings with their names in it (each module once), in module order.

    Raises:
        ConfigError: an embedding without a name (the model itself is one).
    """
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, SparseEmbedding)]
    for name, _ in found:
        if not name:
            raise ConfigError("the model itself is a psgrad embedding: wrap it in a module (its tables are named by "
                              "their place in the model)")
    return found
