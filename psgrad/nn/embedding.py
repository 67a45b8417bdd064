"""Embedding tables whose rows live on the servers: psgrad.Embedding and psgrad.EmbeddingBag, drop-ins
for torch.nn.Embedding and torch.nn.EmbeddingBag. The module holds no weight: `ps.optimizer(model)`
binds each one to the job as a sparse table (named by its place in the model), a forward pulls
only the rows of the batch's unique ids (one call per shard that holds some), and the optimizer's
step pushes their gradients, coalesced per id, before the dense gradient of the same step. Rows
start as N(0, std²) draws made on the servers from (seed, table, row id), so an untouched row costs
its server 8 bytes of index, and every row is the same on every server after every restart.

torch's options work with torch's semantics (padding_idx, scale_grad_by_freq, sparse, and for bags
include_last_offset and mode "max"), or are refused naming why (max_norm)."""
from __future__ import annotations

from typing import Protocol

import torch
from torch import nn
from torch.nn import functional as F

from psgrad.core import rows
from psgrad.errors import ConfigError, InvalidRequestError, WorkerStateError

EMBEDDING_BAG_MODES = ("sum", "mean", "max")


class RowSource(Protocol):
    """Where a bound table's rows come from (the job's shards; see ParameterClient.pull_rows)."""

    def pull_rows(self, table: str, ids: torch.Tensor, observe: bool) -> torch.Tensor:
        """Rows [len(ids), dim] (float32, CPU) of row ids (unique, int64, CPU)."""


class SparseEmbedding(nn.Module):
    """What psgrad.Embedding and psgrad.EmbeddingBag share: the table's shape and initialisation,
    torch's options, the binding to a job, the forward's pull and the rows a backward gave gradients
    to."""

    def __init__(self, num_embeddings: int, embedding_dim: int, std: float = 1.0, seed: int = 0, *,
                 max_norm: float | None = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False) -> None:
        super().__init__()
        if not (isinstance(num_embeddings, int) and num_embeddings >= 1):
            raise ConfigError(f"num_embeddings must be an integer >= 1, got {num_embeddings!r}")
        if not (isinstance(embedding_dim, int) and embedding_dim >= 1):
            raise ConfigError(f"embedding_dim must be an integer >= 1, got {embedding_dim!r}")
        if not (std == std and 0 <= std < float("inf")):
            raise ConfigError(f"std must be a finite number >= 0, got {std!r}")
        if max_norm is not None:
            raise ConfigError(
                f"max_norm={max_norm!r} is not supported by psgrad embeddings: torch renormalizes each row a forward "
                "looks up in place, in the weight, and these rows live on the servers, which a forward does not write. "
                "Leave max_norm out, and bound what the model sees in its forward instead (out * (max_norm / "
                "out.norm(dim=-1, keepdim=True)).clamp(max=1))"
            )
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.std, self.seed = float(std), int(seed)
        # torch's options: max_norm is refused above (norm_type is only read with it, as in torch);
        # sparse changes nothing, the gradients pushed being per row always.
        self.max_norm: float | None = None
        self.norm_type = float(norm_type)
        self.scale_grad_by_freq, self.sparse = bool(scale_grad_by_freq), bool(sparse)
        self.table: str | None = None  # its name in the job, once bound
        self._source: RowSource | None = None
        self._observe = False  # after the worker left: read-only pulls
        self._touched: list[tuple[torch.Tensor, torch.Tensor]] = []  # (unique ids, their rows as leaves)

    @property
    def nbytes(self) -> int:
        """The whole table's bytes in float32 (what replicating it would cost every worker)."""
        return self.num_embeddings * self.embedding_dim * 4

    def extra_repr(self) -> str:
        where = f", table={self.table!r}" if self.table else ", unbound"
        options = "".join(f", {name}=True" for name in ("scale_grad_by_freq", "sparse") if getattr(self, name))
        return f"{self.num_embeddings}, {self.embedding_dim}, std={self.std:g}{options}{where}"

    def _padding_index(self, padding_idx: int | None) -> int | None:
        """torch's padding_idx, checked and made non-negative.

        Raises:
            ConfigError: outside [-num_embeddings, num_embeddings).
        """
        if padding_idx is not None and padding_idx < 0:
            padding_idx += self.num_embeddings
        if padding_idx is not None and not 0 <= padding_idx < self.num_embeddings:
            raise ConfigError(f"padding_idx must be within num_embeddings ({self.num_embeddings}), got {padding_idx}")
        return padding_idx

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

    def _rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(inverse, rows, unique): each id's index into rows, which are the rows of the batch's
        unique ids (sorted, CPU) pulled from the servers (a leaf that records its gradient when
        training)."""
        if self._source is None:
            raise WorkerStateError(
                f"{type(self).__name__}({self.num_embeddings}, {self.embedding_dim}) is not bound to a job: "
                "its rows live on the servers; build ps.optimizer(model) (or psgrad.connect(...).optimizer) first"
            )
        if ids.dtype not in (torch.int64, torch.int32):
            raise InvalidRequestError(f"{self.table}: row ids must be an integer tensor (int64 or int32), got {ids.dtype}")
        flat = ids.reshape(-1)
        unique, inverse = torch.unique(flat, sorted=True, return_inverse=True)
        unique = unique.to("cpu", torch.int64)
        rows.check_ids(unique, self.num_embeddings, f"table {self.table!r}")
        # Training pulls are the step's (a row cache may serve them; their versions are what the
        # push says it computed on); evaluation's are read-only reads of the servers' rows.
        training = self.training and torch.is_grad_enabled() and not self._observe
        weight = self._source.pull_rows(self.table or "", unique, not training)
        weight = weight.to(ids.device)
        if training:
            weight.requires_grad_(True)
            self._touched.append((unique, weight))
        return inverse.view(ids.shape), weight, unique

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
    servers keeps its initial value, unused). scale_grad_by_freq: each row's gradient is divided by
    how often its id occurs in the forward's input, as in torch. sparse: accepted, changes nothing
    (the rows' gradients are pushed per row always). max_norm: refused (ConfigError naming why).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 std: float = 1.0, seed: int = 0, *, max_norm: float | None = None, norm_type: float = 2.0,
                 scale_grad_by_freq: bool = False, sparse: bool = False) -> None:
        super().__init__(num_embeddings, embedding_dim, std, seed, max_norm=max_norm, norm_type=norm_type,
                         scale_grad_by_freq=scale_grad_by_freq, sparse=sparse)
        self.padding_idx = self._padding_index(padding_idx)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        inverse, weight, _ = self._rows(input)
        out = F.embedding(inverse, weight, scale_grad_by_freq=self.scale_grad_by_freq)
        if self.padding_idx is not None:
            out = out * (input != self.padding_idx).unsqueeze(-1).to(out.dtype)
        return out


class EmbeddingBag(SparseEmbedding):
    """torch.nn.EmbeddingBag(num_embeddings, embedding_dim, mode) with its rows on the parameter
    servers: the sum, mean or max of each bag's rows (a 2-D input: one bag per row; a 1-D input with
    offsets: bags starting at each offset), optionally weighted per sample (mode "sum").

    torch's options, with torch's semantics: include_last_offset (offsets has one more entry, the
    end of the last bag), padding_idx (that id takes no part in its bag, mean's count included, and
    no gradient), scale_grad_by_freq (not with mode "max", which torch refuses too), sparse
    (accepted, changes nothing: the rows' gradients are pushed per row always). max_norm: refused.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, mode: str = "mean",
                 std: float = 1.0, seed: int = 0, *, max_norm: float | None = None, norm_type: float = 2.0,
                 scale_grad_by_freq: bool = False, sparse: bool = False, include_last_offset: bool = False,
                 padding_idx: int | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim, std, seed, max_norm=max_norm, norm_type=norm_type,
                         scale_grad_by_freq=scale_grad_by_freq, sparse=sparse)
        if mode not in EMBEDDING_BAG_MODES:
            raise ConfigError(f"mode must be one of {', '.join(EMBEDDING_BAG_MODES)}, got {mode!r}")
        if mode == "max" and scale_grad_by_freq:
            raise ConfigError("scale_grad_by_freq does not go with mode 'max' (torch refuses it at the forward too): "
                              "use mode 'sum' or 'mean', or leave scale_grad_by_freq out")
        self.mode = mode
        self.include_last_offset = bool(include_last_offset)
        self.padding_idx = self._padding_index(padding_idx)

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        inverse, weight, unique = self._rows(input)
        padding = None  # the padding id's index among the pulled rows, where the input has it
        if self.padding_idx is not None:
            at = int(torch.searchsorted(unique, self.padding_idx))
            padding = at if at < unique.numel() and int(unique[at]) == self.padding_idx else None
        return F.embedding_bag(inverse, weight, offsets, mode=self.mode, per_sample_weights=per_sample_weights,
                               scale_grad_by_freq=self.scale_grad_by_freq,
                               include_last_offset=self.include_last_offset, padding_idx=padding)


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
