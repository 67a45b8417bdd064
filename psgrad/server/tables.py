"""A shard's tables: the unit of parameters a shard holds, each with its own layout, optimizer state
and apply rule. A *dense* table is a contiguous range of the job's flat space (its trainable prefix
takes the optimizer, the synchronized buffers after it take deltas), updated as one vector; a
*sparse* table holds the rows of an embedding placed on this shard, stored at their first update
(read before it as their computed initial values) and updated row by row; the *frozen* table holds
the shard's range of the model's frozen parameters, which no push touches (a space of their own, so
a step's push and pull never carry them). All answer the same interface: snapshot and restore, say
what they hold. Not thread-safe on their own: the shard core calls them under its lock."""
from __future__ import annotations

import contextlib
import operator
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import numpy as np
import torch

from psgrad.config import JobSpec
from psgrad.core.optimizers import ShardOptimizer, UpdateRule, make_optimizer
from psgrad.core import rows
from psgrad.core.optimizers.base import axpy_backend
from psgrad.core.optimizers.rows import RowOptimizer, RowState
from psgrad.core.optimizers.segments import Segment, SegmentedOptimizer
from psgrad.core.status import DelayStatus, TableStatus
from psgrad.core.unused import Ranges
from psgrad.errors import InvalidRequestError, MemoryBudgetError
from psgrad.server import kernels, transfers  # (they register the axpy rule's split and checked backends)
from psgrad.server.delay_comp import DelayCompensation
from psgrad.server.row_index import DenseIndex, HashIndex, Sightings, storage
from psgrad.server.transfers import apply_checked, count_nonfinite

#: The name of the dense table: the job's flat space (every shard of a job holds one).
DENSE = "dense"
#: The name of the frozen table: the shard's range of the frozen space (a job with frozen
#: parameters on the servers: every shard holds one, perhaps empty).
FROZEN = "frozen"

Tensors = dict[str, torch.Tensor]
Scalars = dict[str, float | int]

# A row never stored is drawn (rows.initial_rows: a function of the table and the row id alone) when
# a read reaches it, and drawn again when an update makes it, most often one step later. A table
# keeps what its last DRAWN_READS reads drew, up to DRAWN_BYTES in all, and an update takes the
# rows it finds there instead of drawing them twice (the same values, copied).
DRAWN_READS = 4
DRAWN_BYTES = 1 << 20

# What a table with a row lifetime did to ids besides updating them (SparseTable.take_lifetime; a
# replica record says so, in order, and a standby does the same): counted them in the admission
# counts (min_count), stored their rows (in this order: the arena's layout, which decides ties among
# the rows eviction may drop), or dropped their rows at the memory budget (evict) or after ttl
# updates untouched.
SIGHTED, MADE, EVICTED, EXPIRED = "sighted", "made", "evicted", "expired"


# The scalars of a sparse table that an update changes and an undo puts back (see RowJournal).
_UNDONE_SCALARS = ("version", "staleness_max", "staleness_sum", "pushes", "dropped")
_undone_scalars = operator.attrgetter(*_UNDONE_SCALARS)  # (a table's, as one tuple: once per table per apply)


class RowJournal:
    """What the row updates of one apply overwrote, kept as they write, so that an apply that fails
    part way (a row kernel's error, an allocation refused while rows were made) is undone and its
    retry applies once: each table's scalars (its version, staleness figures), the values, versions
    and optimizer state of the slots written (copies of those rows only: O(rows updated), which the
    row kernels take in the pass that writes the rows, where they apply the update), the
    admission counters an update counted, and the row-lifetime events taken for the replica's
    record (given back, so the retry's record still carries them). Rows made by the apply (stored
    at their initial values, which a read of a row never stored gives too) stay made; the budget
    keeps their charge. Recorded by SparseTable.apply while the journal is active (record()) on the
    applying thread."""

    _active = threading.local()

    def __init__(self) -> None:
        self._scalars: dict[int, tuple[SparseTable, tuple[int, ...]]] = {}
        self._writes: list[tuple[SparseTable, int, torch.Tensor, torch.Tensor, torch.Tensor, Tensors]] = []
        self._sighted: list[tuple[Sightings, torch.Tensor, torch.Tensor]] = []
        self._taken: list[tuple[SparseTable, list[tuple[str, torch.Tensor]]]] = []

    @staticmethod
    def current() -> RowJournal | None:
        """The journal recording on this thread (None: none)."""
        return getattr(RowJournal._active, "journal", None)

    @contextlib.contextmanager
    def record(self) -> Iterator[RowJournal]:
        """Record the row updates made on this thread in the block."""
        held = RowJournal.current()
        RowJournal._active.journal = self
        try:
            yield self
        finally:
            RowJournal._active.journal = held

    def keep(self, table: SparseTable) -> None:
        """Keep table's scalars as they are before the update (once per table)."""
        if id(table) not in self._scalars:
            self._scalars[id(table)] = (table, _undone_scalars(table))

    def wrote(self, table: SparseTable, slots: torch.Tensor) -> None:
        """Rows at `slots` of table's arena are about to be written: copies of them."""
        self.keep(table)
        # (a copy of the slots too: the caller's tensor may be a view it reuses)
        slots = slots[slots >= 0] if slots.numel() and int(slots.min()) < 0 else slots.clone()
        # (index_select: a row copy each, several times faster than indexing with a tensor of slots)
        self._writes.append((table, table._moved, slots, table._values.index_select(0, slots),
                             table._versions.index_select(0, slots),
                             {k: v.index_select(0, slots) for k, v in table._state.items()}))

    def kept(self, table: SparseTable, slots: torch.Tensor, kept: Tensors) -> None:
        """Rows at `slots` (all stored) of table's arena were written by a row kernel, which copied
        what it overwrote into `kept` (RowKernels.apply) in the same pass: those copies, as wrote
        takes them (the state it did not write is unchanged)."""
        self.keep(table)
        self._writes.append((table, table._moved, slots.clone(), kept["values"], kept["versions"],
                             {k[len("state."):]: v for k, v in kept.items() if k.startswith("state.")}))

    def sighted(self, sightings: Sightings, ids: torch.Tensor) -> None:
        """ids are about to be counted in `sightings`: the counters they touch, as they are."""
        cells = sightings._cells(ids)
        self._sighted.append((sightings, cells, torch.stack([sightings.counts[d].index_select(0, cells[d])
                                                             for d in range(Sightings.DEPTH)])))

    def took(self, table: SparseTable, events: list[tuple[str, torch.Tensor]]) -> None:
        """Row-lifetime events were taken from table for the replica's record."""
        if events:
            self._taken.append((table, events))

    def undo(self) -> bool:
        """Put back what the recorded updates changed, newest first. Returns False where that
        cannot be done exactly (rows moved in the arena since they were written, as a ttl's expiry
        moves them): then nothing is put back and the caller must not let the apply be retried."""
        if any(table._moved != moved for table, moved, *_ in self._writes):
            return False
        for table, _, slots, values, versions, state in reversed(self._writes):
            table._values.index_copy_(0, slots, values)
            table._versions.index_copy_(0, slots, versions)
            for k, v in state.items():
                table._state[k].index_copy_(0, slots, v)
        for sightings, cells, old in reversed(self._sighted):
            for d in range(Sightings.DEPTH):
                sightings.counts[d].index_copy_(0, cells[d], old[d])
        for table, scalars in self._scalars.values():
            for k, value in zip(_UNDONE_SCALARS, scalars):
                setattr(table, k, value)
        for table, events in reversed(self._taken):
            table._lifetime[:0] = events
        self._writes, self._sighted, self._taken, self._scalars = [], [], [], {}
        return True


@dataclass(frozen=True)
class TableSnapshot:
    """A table's state as a checkpoint keeps it: its kind, named tensors (copies) and scalars."""

    kind: str
    tensors: Tensors
    scalars: Scalars = field(default_factory=dict)


class _LearningRate(Protocol):
    lr: float  # the job's: set on every table's optimizer when the chief's schedule moves it


class Table(Protocol):
    """What the shard core, checkpoints, replication and status need of any table."""

    kind: ClassVar[str]

    @property
    def optimizer(self) -> _LearningRate: ...

    def snapshot(self) -> TableSnapshot:
        """A copy of the table's state (its weights and optimizer state)."""

    def load(self, snap: TableSnapshot) -> None:
        """Take the state a snapshot holds (tensors are copied in)."""

    def status(self, name: str) -> TableStatus:
        """What it holds, for `psgrad status` and metrics."""

    def forget_workers(self, live: set[int]) -> None:
        """Drop per-worker state of workers that are no longer live."""


class DenseTable:
    """A contiguous range of the flat space: fp32 master weights, the optimizer on its trainable
    prefix, deltas added as they are to the buffers after it, and (with --dc-asgd) each worker's
    copy of the weights it pulled, against which its gradients are compensated."""

    kind: ClassVar[str] = "dense"

    def __init__(self, spec: JobSpec, weights: torch.Tensor, trainable: int,
                 segments: Sequence[Segment] = ()) -> None:
        self.weights = weights
        self.trainable = trainable
        self.num_workers = spec.num_workers
        # Parameter groups: an optimizer per segment of settings (one of the job's: the plain one).
        grouped = [s for s in segments if not s.default]
        self.optimizer: ShardOptimizer = (SegmentedOptimizer.build(spec, segments) if grouped
                                          else make_optimizer(spec, trainable))
        self.dc = DelayCompensation.for_job(spec, trainable)  # DC-ASGD (None: off)
        #: staged updates: the block rule of the optimizer's element-wise form, computed as a push
        #: arrives (see configure)
        self.rule: UpdateRule | None = None

    @property
    def numel(self) -> int:
        return self.weights.numel()

    def configure(self, applies_on_arrival: bool, exact_wire: bool, push_buffers: int) -> None:
        """Decide whether pushes are staged: the next weights computed into the receive buffer while
        the gradient arrives. That takes a push applied on arrival (not a sync mean), an exact wire,
        one receive buffer, an optimizer with an element-wise form (plain SGD), no buffers in the
        range (they take deltas) and no delay compensation (it rewrites the gradient first)."""
        staged = applies_on_arrival and exact_wire and push_buffers == 1
        staged = staged and self.trainable == self.numel and self.dc is None
        form = self.optimizer.elementwise() if staged else None
        self.rule = None if form is None else form.block

    def may_borrow(self) -> bool:
        """Whether a push may be applied from the worker's own memory (a same-host segment): an
        update rule that only reads the gradient, on weights without buffers, and no compensation
        (which rewrites the gradient before the apply)."""
        return self.optimizer.reads_grad_only() and self.trainable == self.numel and self.dc is None

    # ----------------------------------------------------------------- updates
    def on_pull(self, rank: int, version: int) -> None:
        """A worker was served the weights of `version` (DC-ASGD keeps its copy of them)."""
        if self.dc is not None:
            self.dc.record(rank, version, self.weights)

    def forget_workers(self, live: set[int]) -> None:
        if self.dc is not None:
            self.dc.keep_only(live)

    def prepare(self, rank: int, base_version: int, grad: torch.Tensor, averaged: bool) -> None:
        """Make one worker's pushed gradient the update to apply (in place): its buffer deltas count
        1/num_workers unless `averaged` (a sync mean already is), and DC-ASGD compensates it for
        the updates since its pull."""
        n = self.trainable
        if not averaged and n < grad.numel() and self.num_workers > 1:
            grad[n:].div_(self.num_workers)
        if self.dc is not None:
            self.dc.compensate(rank, base_version, self.weights, grad)

    def apply(self, grad: torch.Tensor, lr_scale: float = 1.0, lr: float | None = None, skip: Ranges = ()) -> None:
        """Apply one update (grad is scratch the optimizer may overwrite): the optimizer to the
        trainable prefix, with the learning rate `lr` (None: the job's) times lr_scale, leaving
        the ranges `skip` (parameters the update's workers left unused: core/unused.py) as they
        are; the buffers' part of grad, their deltas, is added as it is."""
        n = self.trainable
        if n == self.numel:
            self._step(self.weights, grad, lr_scale, lr, skip)
            return
        if n:
            self._step(self.weights[:n], grad[:n], lr_scale, lr, skip)
        self.weights[n:].add_(grad[n:])

    def _step(self, weights: torch.Tensor, grad: torch.Tensor, lr_scale: float, lr: float | None, skip: Ranges) -> None:
        if skip:
            self.optimizer.apply_skipping(weights, grad, skip, lr_scale, lr)
        else:
            self.optimizer.apply(weights, grad, lr_scale, lr)

    def apply_checked(self, grad: torch.Tensor, lr_scale: float, lr: float | None, restore: torch.Tensor) -> int:
        """Apply an element-wise update that only reads grad (plain SGD), checking grad as it goes:
        by the axpy rule's checked backend (one fused pass) where it can, else piece by piece
        (transfers.apply_checked); a non-finite gradient (or an error) restores the weights from
        `restore`, an exact copy of them. Returns the non-finite values (0: applied)."""
        weights, rule = self.weights, self.optimizer
        bad = -1
        try:
            # (a shard of one piece or less gains nothing worth loading numba for)
            form = rule.elementwise() if grad.numel() > transfers.PIECE else None
            alpha = None if form is None else form.alpha(rule.step_lr(lr, lr_scale))
            checked = axpy_backend("checked")
            finite = None if alpha is None or checked is None else checked(weights, grad, alpha)
            if finite is None:
                bad = apply_checked(grad, lambda a, b: rule.apply(weights[a:b], grad[a:b], lr_scale, lr))
            else:
                bad = 0 if finite else count_nonfinite(grad)
        finally:
            if bad:  # undone, exactly: the copy holds the weights as they were
                weights.copy_(restore)
        return bad

    # ----------------------------------------------------------------- state
    def snapshot(self) -> TableSnapshot:
        tensors: Tensors = {"weights": self.weights.clone()}
        scalars: Scalars = {}
        for key, value in self.optimizer.state_dict().items():
            if isinstance(value, torch.Tensor):
                tensors["optimizer." + key] = value
            else:
                scalars[key] = value
        return TableSnapshot(self.kind, tensors, scalars)

    def load(self, snap: TableSnapshot) -> None:
        weights = snap.tensors["weights"]
        if weights.dtype != torch.float32 or weights.numel() != self.numel:
            raise InvalidRequestError(f"a dense table of {self.numel} float32 values cannot take {weights.numel()} {weights.dtype}")
        self.weights.copy_(weights)
        state: dict[str, torch.Tensor | float | int] = dict(snap.scalars)
        state.update({k[len("optimizer."):]: v for k, v in snap.tensors.items() if k.startswith("optimizer.")})
        self.optimizer.load_state_dict(state)

    def status(self, name: str) -> TableStatus:
        return TableStatus(name, self.kind, self.numel, self.numel * 4, self.optimizer.state_bytes())

    def delay_status(self) -> DelayStatus:
        return self.dc.status() if self.dc is not None else DelayStatus()



class _Fixed:
    """The optimizer of a table nothing updates: it only keeps the job's lr, as every table's does."""

    def __init__(self) -> None:
        self.lr = 0.0


class FrozenTable:
    """The shard's range of the frozen space: float32 values the chief wrote at Init, never
    updated by a push, with a version that moves only when they are written (Init, a restore):
    a worker reads them at join, and again only when that version moved."""

    kind: ClassVar[str] = "frozen"

    def __init__(self, numel: int) -> None:
        self.values = torch.zeros(numel)
        self.version = 0  # 0: not written yet
        self.optimizer = _Fixed()

    @property
    def numel(self) -> int:
        return self.values.numel()

    def write(self, values: torch.Tensor) -> None:
        """Take the frozen values (the chief's): the table's version moves.

        Raises:
            InvalidRequestError: values of another size or dtype.
        """
        if values.dtype != torch.float32 or values.numel() != self.numel:
            raise InvalidRequestError(f"the frozen table of {self.numel} float32 values cannot take "
                                      f"{values.numel()} {values.dtype}")
        self.values.copy_(values.reshape(-1))
        self.version += 1

    def forget_workers(self, live: set[int]) -> None:
        """Nothing per worker here."""

    def snapshot(self) -> TableSnapshot:
        return TableSnapshot(self.kind, {"values": self.values.clone()}, {"version": self.version})

    def load(self, snap: TableSnapshot) -> None:
        values = snap.tensors["values"]
        if values.dtype != torch.float32 or values.numel() != self.numel:
            raise InvalidRequestError(f"a frozen table of {self.numel} float32 values cannot take "
                                      f"{values.numel()} {values.dtype}")
        self.values.copy_(values)
        self.version = int(snap.scalars.get("version", 1))

    def status(self, name: str) -> TableStatus:
        return TableStatus(name, self.kind, self.numel, self.numel * 4, 0, updates=self.version)


def _reservable_rows(row_bytes: int) -> int:
    """The most rows of `row_bytes` an arena reserves storage for ahead of its growth: those of a
    quarter of this machine's memory (the storage is given pages only as rows are written)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4 // row_bytes
    except (OSError, ValueError):
        return 0


def memory_budget_bytes(mb: float | None) -> int | None:
    """The bytes --memory-budget-mb allows (None: 3/4 of this machine's physical memory; 0: no limit)."""
    if mb is None:
        try:
            return int(0.75 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (ValueError, OSError):
            return None
    return None if mb == 0 else int(mb * 2**20)


#: What a refusal of the memory budget advises besides more memory, where nothing closer applies.
SMALLER = "or make the table smaller"


def _mib(nbytes: int) -> str:
    """nbytes for a message: in MiB, or KiB under a tenth of one (where "0.0 MiB" would say nothing)."""
    return f"{nbytes / 2**20:,.1f} MiB" if nbytes >= 2**20 // 10 else f"{nbytes / 2**10:,.1f} KiB"


class MemoryBudget:
    """The bytes a shard's sparse tables may hold in all (their row index, rows and row state): a
    table that would grow past it refuses the rows that would not fit, naming the budget."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit  # None: no limit
        self.used = 0

    def charge(self, nbytes: int, what: str, advice: str = SMALLER) -> None:
        """Take nbytes more for `what`.

        Raises:
            MemoryBudgetError: they would not fit (nothing is taken); its message ends with `advice`.
        """
        if self.limit is not None and self.used + nbytes > self.limit:
            raise self.refusal(nbytes, what, advice)
        self.used += nbytes

    def refusal(self, nbytes: int, what: str, advice: str = SMALLER) -> MemoryBudgetError:
        """The error refusing nbytes more for `what`: the budget and what it holds, then what to
        do (more memory, or `advice`)."""
        mb = (self.limit or 0) / 2**20  # (as given: 0.1 stays 0.1, 4096 reads 4,096)
        return MemoryBudgetError(
            f"{what} needs {_mib(nbytes)} more, but this server's sparse tables already hold {_mib(self.used)} "
            f"of its --memory-budget-mb {f'{mb:,.0f}' if mb.is_integer() else f'{mb:g}'}: give the servers more "
            f"memory (a larger budget, or more shards: each holds 1/S of every table), {advice}")

    def fits(self, nbytes: int) -> bool:
        """Whether nbytes more would fit (charge would take them: the limit is not passed)."""
        return self.limit is None or self.used + nbytes <= self.limit

    def release(self, nbytes: int) -> None:
        self.used = max(0, self.used - nbytes)

    def free(self) -> int | None:
        """The bytes left (None: no limit)."""
        return None if self.limit is None else max(0, self.limit - self.used)


# A sparse table's storage capacity as a snapshot's scalars name it: its arena's rows (an arena's,
# for tables stored together), a dynamic table's row index's places.
CAPACITY, INDEX_CAPACITY = "capacity", "index_capacity"
# A sparse table's staleness so far as a snapshot's scalars name it: scalar -> attribute.
STALENESS_SCALARS = {"staleness_max": "staleness_max", "staleness_sum": "staleness_sum", "staleness_pushes": "pushes"}


class SparseTable:
    """The rows of an embedding table (num_embeddings x dim) that live on this shard (row id r on
    shard r mod S): a row's initial value is computed from (seed, table, row id); a row is stored
    at its first update (a push's reserve), in an arena that grows by doubling, each with the table
    version of its last update and its row-wise optimizer state. Reads store nothing (rows never
    updated are computed again), so only updates charge the memory budget. A row never stored
    costs its 8 bytes in the row index; a snapshot holds the stored rows only."""

    kind: ClassVar[str] = "sparse"
    sightings: Sightings | None  # (admission's counts: with min_count > 1)

    def __init__(self, name: str, num_embeddings: int, dim: int, index: int, num_shards: int, seed: int,
                 optimizer: RowOptimizer, std: float = 1.0, budget: MemoryBudget | None = None,
                 lr_scale: float = 1.0, lifetime: tuple[int, int, bool] = (0, 0, False)) -> None:
        if num_embeddings < 0 or dim < 1 or not 0 <= index < num_shards:
            raise InvalidRequestError(f"table {name!r}: {num_embeddings} x {dim} on shard {index} of {num_shards} is not a table")
        self._name_it(name, num_embeddings, dim, index, num_shards, seed, std, optimizer, lr_scale,
                      budget or MemoryBudget(None))
        self._index: DenseIndex | HashIndex
        if self.dynamic:
            self._index = HashIndex()
            self.budget.charge(self._index.nbytes, f"the row index of dynamic table {name!r} on shard {index}")
        else:
            placed = rows.rows_on_shard(num_embeddings, index, num_shards)
            what = f"the row index of table {name!r} ({placed:,} rows on shard {index})"
            self.budget.charge(DenseIndex.bytes_for(placed), what)  # (before it is made: 8 bytes a row)
            try:
                self._index = DenseIndex(num_embeddings, index, num_shards)
            except (RuntimeError, OverflowError):  # (no budget set: the allocator refused it)
                self.budget.release(DenseIndex.bytes_for(placed))
                raise MemoryBudgetError(
                    f"{what} needs {DenseIndex.bytes_for(placed) / 2**20:,.1f} MiB, which this server cannot "
                    "allocate: give the table fewer rows, more servers, or make it dynamic (num_embeddings=None: "
                    "any 64-bit id, memory for the rows stored only)") from None
        self._charged = self._index.nbytes
        # Row lifetime (TableSpec.lifetime): admission after min_count sightings, expiry after ttl
        # updates untouched, eviction at the budget; and what each has done so far.
        self.min_count, self.ttl, self.evict = lifetime
        if self.min_count > 1:
            self.sightings = Sightings()
            self.budget.charge(self.sightings.nbytes, f"the admission counts of table {name!r} on shard {index}")
            self._charged += self.sightings.nbytes
        self.touched = 0  # rows made so far (arena slots in use)
        self._ids = torch.empty(0, dtype=torch.int64)
        self._values = torch.empty(0, dim)
        self._versions = torch.empty(0, dtype=torch.int64)
        self._state: RowState = optimizer.new_state(0, dim)
        self._room: dict[str, torch.Tensor] | None = None  # the storage the arena's tensors begin (see _grow)
        self._row_bytes: int | None = None

    def _name_it(self, name: str, num_embeddings: int, dim: int, index: int, num_shards: int, seed: int, std: float,
                 optimizer: RowOptimizer, lr_scale: float, budget: MemoryBudget) -> None:
        """What the table is, whatever holds its rows: its shape and place, optimizer, version and
        counters (no row lifetime yet: __init__ sets one)."""
        self.name, self.num_embeddings, self.dim = name, num_embeddings, dim
        self.index, self.num_shards, self.seed, self.std = index, num_shards, seed, std
        self.optimizer = optimizer
        self.lr_scale = lr_scale  # its param group's multiple of the job's lr (1.0: none)
        self.key = rows.table_key(seed, name)
        self.version = 0  # updates applied to the table
        self.staleness_max, self.staleness_sum, self.pushes = 0, 0, 0  # table updates between pull and push
        self.budget = budget
        self.dynamic = num_embeddings == rows.DYNAMIC
        self.min_count, self.ttl, self.evict = 0, 0, False
        self.sightings = None
        self.admitted = self.expired = self.evicted = self.dropped = 0
        self._lifetime: list[tuple[str, torch.Tensor]] = []  # what the row lifetime did since take_lifetime
        self._charged = 0
        self._moved = 0  # times stored rows were dropped or moved: slots a reserve gave before are stale
        self._drawn: list[tuple[torch.Tensor, torch.Tensor]] = []  # recent reads' drawn rows: (ids sorted, values)

    # ----------------------------------------------------------------- rows
    def check(self, ids: torch.Tensor) -> None:
        """Row ids of this table that live on this shard.

        Raises:
            InvalidRequestError: wrong dtype or shape, out of range, or placed on another shard.
        """
        rows.check_ids(ids, self.num_embeddings, f"table {self.name!r}")
        if ids.numel() and self.num_shards > 1:
            where = rows.shard_of(ids, self.num_shards, self.dynamic)
            elsewhere = where != self.index
            if bool(elsewhere.any()):
                bad = int(ids[elsewhere][0])
                raise InvalidRequestError(
                    f"table {self.name!r}: row {bad} lives on shard {int(where[elsewhere][0])}, not on shard {self.index}"
                )

    def locate_ids(self, ids: torch.Tensor, ascending: bool) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """This table's row ids checked (see check; ascending: an update's, each above the one
        before) and found in its row index, in one pass of the row kernels: (the ids as int64,
        their slots (-1 where never stored), how many are never stored), valid under this lock,
        as reserve and read_at take them. None: the kernels are not compiled here, the table's
        index is not dense (a dynamic table's), the ids are not int64, or the check failed, or
        found them not in increasing order (ascending) — the caller's own check then runs (and
        says what is wrong, where something is)."""
        if not isinstance(self._index, DenseIndex) or ids.dtype != torch.int64 or ids.dim() != 1 or not ids.numel():
            return None
        found = self.locate_rows(ids, [ids.numel()], [self.num_embeddings], [0], ascending)
        return None if found is None or found[0] >= 0 else (found[1], found[2], found[3])

    def locate_rows(self, flat: torch.Tensor, counts: Sequence[int], sizes: Sequence[int] | np.ndarray,
                    bases: Sequence[int] | np.ndarray, ascending: bool,
                    find: bool = True) -> tuple[int, torch.Tensor, torch.Tensor, int] | None:
        """The row kernels' locate over this table's dense index (kernels.RowKernels.locate): ids of
        tables of counts[k] ids each, sizes[k] rows, their rows at index ids bases[k] + row, joined
        in `flat` (int64). Returns (the position of the first bad id, -1 for none; the ids as the
        index's; their slots; the count never stored: with find=False, the ids joined and no
        slots), or None where the kernels are not compiled here."""
        fused = kernels.rows(start=int(flat.numel()) * self.dim >= kernels.ROW_KERNEL_MIN)
        if fused is None:
            return None
        index = self._index
        assert isinstance(index, DenseIndex)
        flat = flat.contiguous()
        bad, new, at, slots = fused.locate(flat, np.array(counts, dtype=np.int64), np.asarray(sizes, dtype=np.int64),
                                           np.asarray(bases, dtype=np.int64), self.num_shards, self.index, ascending,
                                           index.slots, find)
        if at is None or slots is None:  # (find=False: checked, nothing found)
            return bad, flat, torch.empty(0, dtype=torch.int64), 0
        return bad, at, slots, new

    def placement(self) -> int:
        """A count that changes whenever stored rows are dropped or moved: the slots a reserve gave
        stay valid while it is the same (rows made since go to new slots; growth keeps the slots)."""
        return self._moved

    def _initial(self, ids: torch.Tensor) -> torch.Tensor:
        """The initial values of rows `ids` (int64): computed from (seed, table, row id)."""
        return rows.initial_rows(self.key, ids, self.dim, self.std)

    def _draw(self, ids: torch.Tensor) -> torch.Tensor:
        """The initial values of rows `ids` (int64, none stored) for a read, kept for the update
        that makes them (see DRAWN_READS)."""
        values = self._initial(ids)
        if self.std != 0.0 and 0 < values.numel() * 4 <= DRAWN_BYTES:  # (a larger read is not kept)
            order = torch.argsort(ids)
            kept = [*self._drawn, (ids[order], values[order])][-DRAWN_READS:]
            while kept and sum(v.numel() * 4 for _, v in kept) > DRAWN_BYTES:
                kept.pop(0)
            self._drawn = kept
        return values

    def _recall(self, ids: torch.Tensor) -> torch.Tensor:
        """The initial values of rows `ids` (int64) that an update makes: those a recent read
        drew, copied; the others drawn."""
        if not self._drawn:
            return self._initial(ids)
        out = torch.empty(ids.numel(), self.dim)
        missing = torch.ones(ids.numel(), dtype=torch.bool)
        for drawn_ids, drawn in self._drawn:
            at = torch.searchsorted(drawn_ids, ids).clamp_(max=drawn_ids.numel() - 1)
            found = missing & (drawn_ids[at] == ids)
            if bool(found.any()):
                out[found] = drawn[at[found]]
                missing &= ~found
        if bool(missing.any()):
            out[missing] = self._initial(ids[missing])
        return out

    def _slots(self, ids: torch.Tensor) -> torch.Tensor:
        """The arena slots of rows `ids` (checked), making the rows never touched."""
        slots = self._index.lookup(ids)
        if int(slots.min()) < 0:  # (one reduction: most pulls find every row made)
            fresh = slots < 0
            new_ids = torch.unique(ids[fresh].long())
            self._make(new_ids)
            slots = self._index.lookup(ids)
        return slots

    def _make(self, ids: torch.Tensor, protect: torch.Tensor | None = None, may_evict: bool = False) -> None:
        """Store rows `ids` (unique, not stored) at their initial values; the arena grows by
        doubling, or where the budget refuses that, to the most rows the budget has room for; where
        even `need` rows do not fit and the table evicts (may_evict), the least recently updated
        rows but `protect` (stored rows) make room (see _plan).

        Raises:
            MemoryBudgetError: they do not fit (nothing is made).
        """
        n = ids.numel()
        capacity, extra, evicting = self._plan(n, 0 if protect is None else protect.numel(), may_evict)
        if evicting:
            made_room = self._make_room(evicting, ids, protect)
            assert made_room  # (planned: there are that many rows the update does not touch)
        elif extra:
            self.budget.charge(extra, f"table {self.name!r} growing to {self.touched + n:,} rows on shard {self.index}",
                               self._budget_advice())
        need = self.touched + n
        self._charged += extra
        if capacity > self._ids.numel():
            self._grow(capacity, charged=True)
        at = slice(self.touched, need)
        self._ids[at] = ids
        if self.std == 0.0:  # (rows that start at zero: filled, nothing drawn or allocated)
            self._values[at] = 0.0
        else:
            self._values[at] = self._recall(ids)
        self._versions[at] = 0
        for name, fresh in self.optimizer.new_state(1, self.dim).items():  # (every row starts alike: one row's state,
            self._state[name][at] = fresh                                    # broadcast, where n rows' would be allocated)
        self._index.assign(ids, torch.arange(self.touched, need))
        self.touched = need
        self.admitted += n
        if self.min_count > 1 or self.ttl or self.evict:  # (a layout a standby must keep: see MADE)
            self._lifetime.append((MADE, ids))

    def _plan(self, n: int, protected: int, may_evict: bool, spent: int = 0) -> tuple[int, int, int]:
        """How storing n new rows goes, changing nothing: (the arena's capacity then, the bytes the
        budget is charged, the rows evicted first). The arena grows by doubling, or where the budget
        refuses that, to the most rows the budget has room for; where even the rows needed do not
        fit and the table evicts (may_evict), it keeps the rows it has room for without growing,
        the least recently updated of the rows it stores but the `protected` ones (stored rows the
        update touches) making room. spent: bytes of the budget taken as if charged already (a plan
        of several tables' rows).

        Raises:
            MemoryBudgetError: they do not fit.
        """
        need = self.touched + n
        def growth(capacity: int) -> int:  # the arena's and the index's, charged at once
            return (capacity - self._ids.numel()) * self.row_bytes() + self._index.growth_bytes(need)

        capacity = max(need, 2 * self._ids.numel(), 1024) if need > self._ids.numel() else self._ids.numel()
        if self.budget.fits(spent + growth(capacity)):
            return capacity, growth(capacity), 0
        fitting = self._fitting_capacity(need, spent)
        if fitting is not None:  # (a doubling past the budget would leave up to half of it unused)
            return fitting, growth(fitting), 0
        room = min(self._ids.numel(), self._index.room)  # rows that fit with neither growing
        evicting = need - room
        if may_evict and self.evict and evicting <= self.touched - protected:
            return self._ids.numel(), 0, max(evicting, 0)
        # (naming what these rows need, not the doubling tried first: the budget that holds that
        # much more takes them)
        raise self.budget.refusal(growth(max(need, self._ids.numel())),
                                  f"table {self.name!r} growing to {need:,} rows on shard {self.index}",
                                  self._budget_advice())

    def check_room(self, ids: torch.Tensor, spent: int = 0) -> int:
        """That an update of `ids` (checked, unique) could store the rows it would make, evicting
        where the table evicts, as reserve(ids, may_evict=True) would now with `spent` bytes more
        of the budget taken; returns the bytes it would charge. It changes nothing (a sync push
        checks so the rows its iteration will make, which are made only then).

        Raises:
            MemoryBudgetError: they would not fit (as reserve words it).
        """
        if not ids.numel():
            return 0
        unstored = self._index.lookup(ids) < 0
        fresh = ids[unstored].long()
        if self.sightings is not None:  # (as reserve admits them)
            fresh = fresh[self.sightings.count(fresh) + 1 >= self.min_count]
        if not fresh.numel():
            return 0
        return self._plan(fresh.numel(), int((~unstored).sum()) if self.evict else 0, True, spent)[1]

    def _budget_advice(self) -> str:
        """What a refusal of the memory budget advises for this table besides more memory: a
        dynamic table, which grows with every new id, names the options that bound its rows."""
        if not self.dynamic:
            return SMALLER
        if self.evict:
            return (f"or fewer distinct new ids an update: dynamic table {self.name!r} evicts (evict=True), but the "
                    "rows of this update do not fit even with every row it does not touch dropped")
        return (f"or bound the rows dynamic table {self.name!r} stores, with its module's options (psgrad.Embedding, "
                f"EmbeddingBag, EmbeddingBagCollection; now min_count={self.min_count}, ttl={self.ttl}, evict=False): "
                "evict=True drops the least recently updated rows at the budget instead of refusing, ttl=T drops rows "
                "no update touched in T updates, min_count=N stores an id only once N updates named it")

    def _fitting_capacity(self, need: int, spent: int = 0) -> int | None:
        """The largest arena of at least `need` rows whose growth (and the index's, to `need` rows)
        the budget has room for (less `spent` bytes); None where `need` rows do not fit."""
        free = self.budget.free()
        if free is None:
            return None
        free -= spent
        rows_more = (free - self._index.growth_bytes(need)) // self.row_bytes()
        capacity = self._ids.numel() + max(0, rows_more)
        return capacity if capacity >= need > self._ids.numel() else None

    def _make_room(self, k: int, making: torch.Tensor, protect: torch.Tensor | None) -> bool:
        """Drop the k least recently updated rows (by the table version of their last update; ties:
        the older slot) that the update does not touch; False where there are not k such rows."""
        n = self.touched
        if k > n:
            return False
        versions = self._versions[:n].clone()
        if protect is not None and protect.numel():
            kept = self._index.lookup(protect)
            versions[kept[kept >= 0]] = torch.iinfo(torch.int64).max
        order = torch.argsort(versions, stable=True)[:k]
        if bool((versions[order] == torch.iinfo(torch.int64).max).any()):
            return False
        dropped = self._ids[:n][order].clone()
        self._drop(dropped)
        self._lifetime.append((EVICTED, dropped))
        self.evicted += k
        return True

    def _drop(self, ids: torch.Tensor) -> None:
        """Rows `ids` (stored) are no longer stored: they read as new again. The arena stays dense:
        the last rows move into the holes."""
        if not ids.numel():
            return
        self._moved += 1
        n, k = self.touched, ids.numel()
        holes = self._index.lookup(ids)
        gone = torch.zeros(n, dtype=torch.bool)
        gone[holes] = True
        targets = holes[holes < n - k].sort().values  # holes below the new end, filled from the tail
        movers = (~gone[n - k:]).nonzero().squeeze(1) + (n - k)
        self._index.remove(ids)
        if movers.numel():
            moved_ids = self._ids[movers].clone()
            self._ids[targets] = self._ids[movers]
            self._values[targets] = self._values[movers]
            self._versions[targets] = self._versions[movers]
            for t in self._state.values():
                t[targets] = t[movers]
            self._index.move(moved_ids, targets)
        self.touched = n - k

    def remove(self, ids: torch.Tensor, expired: bool = False) -> None:
        """Drop the stored rows among `ids` (a standby applying its primary's record), counted as
        the primary counted them: expired (by the ttl), else evicted."""
        slots = self._index.lookup(ids)
        self._drop(ids[slots >= 0])
        if expired:
            self.expired += ids.numel()
        else:
            self.evicted += ids.numel()

    def make(self, ids: torch.Tensor) -> None:
        """Store rows `ids` (unique) at their initial values, in this order, as the primary made
        them (a standby applying its primary's record); those stored already are left as they are
        (rows a primary made before the snapshot that started this standby)."""
        fresh = ids[self._index.lookup(ids) < 0]
        if fresh.numel():
            self._make(fresh)

    def sight(self, ids: torch.Tensor) -> None:
        """Count one sighting of each of `ids` (unique, not stored) in the admission counts, as an
        update of them did on the primary (a standby applying its primary's record: the ids its
        apply counted); those counted fewer than min_count times were dropped from that update."""
        if self.sightings is not None and ids.numel():
            self.dropped += int((self.sightings.add(ids) < self.min_count).sum())

    def take_lifetime(self) -> list[tuple[str, torch.Tensor]]:
        """What the row lifetime did since the last call, in order: (SIGHTED, ids counted in the
        admission counts), (MADE, rows stored: a table with a row lifetime only), (EVICTED or
        EXPIRED, rows dropped)."""
        out, self._lifetime = self._lifetime, []
        journal = RowJournal.current()
        if journal is not None:
            journal.took(self, out)
        return out

    def row_bytes(self) -> int:
        """Bytes a made row costs: its values, id, version and optimizer state."""
        if self._row_bytes is None:  # (an optimizer's state per row is fixed: measured once)
            state = sum(t[0].numel() * t.element_size() for t in self.optimizer.new_state(1, self.dim).values())
            self._row_bytes = 4 * self.dim + 16 + state
        return self._row_bytes

    def _grow(self, capacity: int, charged: bool = False) -> None:
        """The arena at `capacity` rows (charged: the budget was charged for it already)."""
        if not charged:
            extra = (capacity - self._ids.numel()) * self.row_bytes()
            self.budget.charge(extra, f"table {self.name!r} growing to {capacity:,} rows on shard {self.index}")
            self._charged += extra

        # The arena's tensors are the first `capacity` rows of storage reserved for the most rows it
        # may come to hold: the OS gives its pages as rows are first written (_make), so growing
        # copies nothing and no page is touched twice (doubling into fresh storage faulted every
        # page in again: 0.4-0.8 ms a push in the DLRM benchmark). Rows past `touched` hold
        # anything: _make writes a row's values, version and state as it makes it.
        names = ("ids", "values", "versions", *(f"state.{k}" for k in self._state))
        if self._room is None or self._room["ids"].numel() < capacity:
            rows_ = max(capacity, min(self._index.room if isinstance(self._index, DenseIndex) else 0,
                                      _reservable_rows(self.row_bytes())))
            now = [self._ids, self._values, self._versions, *self._state.values()]
            try:
                room = {name: storage((rows_, *t.shape[1:]), t.dtype) for name, t in zip(names, now)}
            except RuntimeError:  # (a machine that commits memory as it is reserved: just what is charged)
                room = {name: storage((capacity, *t.shape[1:]), t.dtype) for name, t in zip(names, now)}
            for name, t in zip(names, now):
                room[name][: self.touched] = t[: self.touched]
            self._room = room
        ids, values, versions, *state = (self._room[name][:capacity] for name in names)
        self._ids, self._values, self._versions = ids, values, versions
        self._state = dict(zip(self._state, state))

    def load_rows(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        """Start rows `ids` from `values` [n, dim] instead of their initial values (the chief's model
        loaded them): the table's first update, so the table is at version 1 and those rows count as
        updated (exports and checkpoints hold them).

        Raises:
            InvalidRequestError: ids repeated, out of range or on another shard; values of another
                shape; a table updated already.
            MemoryBudgetError: the rows would not fit the server's budget.
        """
        if self.version:
            raise InvalidRequestError(f"table {self.name!r}: rows are loaded into a new table only (it is at version {self.version})")
        self.check_update(ids, values)
        if not ids.numel():
            return
        slots = self._slots(ids)
        self._values.index_copy_(0, slots, values)
        self.version = 1
        self._versions.index_fill_(0, slots, 1)

    def reserve(self, ids: torch.Tensor, may_evict: bool = False, slots: torch.Tensor | None = None,
                new: int | None = None) -> torch.Tensor:
        """Make the rows of an update of `ids` (checked: unique) that it will store, charging the memory
        budget, so the update cannot fail for it later; returns their arena slots (-1: an id its
        update will not admit yet, see min_count), valid until rows are made or dropped again (an
        apply under the same lock may use them). may_evict: with evict, make room by dropping the
        least recently updated other rows (only as the update is applied: a push refused after its
        header must change nothing); else, with evict, the rows that do not fit are left for then.
        slots, new: the ids' slots and the count never stored, as a lookup under this lock found
        them (RowArena.locate, which also found the ids in increasing order; None: looked up here).

        Raises:
            MemoryBudgetError: they would not fit, and no room may be made (nothing is made).
        """
        if not ids.numel():
            return torch.empty(0, dtype=torch.int64)
        if slots is None:
            slots = self._index.lookup(ids)
        if new == 0:
            return slots
        fused = kernels.rows() if new is not None and self.sightings is None and not self.evict else None
        if fused is not None:
            # (located by the row kernels: the ids increase, so the new rows are made in their order,
            # at the next slots, and nothing else moves: their slots and ids in one pass, then made)
            claimed, fresh = fused.claimed(slots, ids, self.touched)
            if fresh.numel():
                self._make(fresh)
            return claimed
        unstored = slots < 0
        if new is None and not bool(unstored.any()):
            return slots
        fresh = ids[unstored].long()
        if self.sightings is not None:  # would this update's sighting admit them?
            fresh = fresh[self.sightings.count(fresh) + 1 >= self.min_count]
        if fresh.numel():
            try:
                # (ids are unique, a checked update's: sorted, not made unique again, so the rows
                # are laid out as a standby makes them; only a table that evicts protects the others)
                self._make(torch.sort(fresh).values, protect=ids[~unstored] if self.evict else None,
                           may_evict=may_evict)
            except MemoryBudgetError:
                if not self.evict or may_evict:
                    raise
            slots = self._index.lookup(ids)
        return slots

    def pull(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [n, dim], the table version of each row's last update [n]: 0 for a row never
        stored) for row ids (a copy). A read stores nothing: a row never stored reads as its
        initial value, computed (see rows)."""
        self.check(ids)
        values, slots = self._read(ids)
        versions = torch.zeros(ids.numel(), dtype=torch.int64)
        stored = slots >= 0
        versions[stored] = self._versions.index_select(0, slots[stored])
        return values, versions

    def rows(self, ids: torch.Tensor, checked: bool = False) -> torch.Tensor:
        """Rows [n, dim] for row ids (a copy): pull without the versions; checked: the caller
        checked the ids already (check). Reads never make rows, so they never charge the memory
        budget: a row is stored at its first update (reserve)."""
        if not checked:
            self.check(ids)
        return self._read(ids)[0]

    def read_at(self, ids: torch.Tensor, slots: torch.Tensor, new: int) -> torch.Tensor:
        """Rows [n, dim] of checked ids whose slots (and count never stored) a lookup under this
        lock found (RowArena.locate): rows, as rows(ids) reads them."""
        return self._read(ids, slots, new)[0]

    def _read(self, ids: torch.Tensor, slots: torch.Tensor | None = None,
              new: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [n, dim], their arena slots, -1 where never stored) for checked ids: stored rows
        gathered, the others computed from (seed, table, row id) as they would be made. slots,
        new: as a lookup under this lock found them (None: looked up here)."""
        if not ids.numel():
            return self._values[:0].clone(), torch.empty(0, dtype=torch.int64)
        if slots is None:
            slots = self._index.lookup(ids)
        if new == 0 or self.std == 0.0:
            fused = kernels.rows()  # (one pass, zeros where never stored; compiled by a table's update)
            if fused is not None:
                return fused.gather(self._values, slots), slots
        if new == 0 or (new is None and int(slots.min()) >= 0):  # (one reduction: most reads find every row stored)
            # (index_select: a gather several times faster than indexing with a tensor of slots)
            return self._values.index_select(0, slots), slots
        stored = slots >= 0
        if not self.touched:  # (nothing stored yet: every row computed)
            return self._draw(ids.long()), slots
        out = self._values.index_select(0, slots.clamp(min=0))  # (a never-stored row's place: replaced below)
        if self.std == 0.0:  # (rows that start at zero: one select, where a mask would copy twice)
            return torch.where(stored.unsqueeze(1), out, 0.0), slots
        fresh = ~stored
        out[fresh] = self._draw(ids[fresh].long())
        return out, slots

    def updated_rows(self, from_id: int, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, rows) of at most `limit` rows updated at least once whose ids are >= from_id, in
        order of id (copies): an export reads a table in such pages."""
        n = self.touched
        made = self._versions[:n] > 0
        ids = self._ids[:n][made]
        keep = ids >= from_id
        ids, slots = ids[keep], made.nonzero().squeeze(1)[keep]
        order = torch.argsort(ids)[:limit]
        return ids[order].clone(), self._values[slots[order]]

    def check_update(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """An update's row ids (see check) and gradients.

        Raises:
            InvalidRequestError: repeated ids, or gradients of another shape or dtype.
        """
        self.check(ids)
        if grads.dtype != torch.float32 or tuple(grads.shape) != (ids.numel(), self.dim):
            raise InvalidRequestError(
                f"table {self.name!r}: gradients must be float32 [{ids.numel()}, {self.dim}], got {grads.dtype} {list(grads.shape)}"
            )
        increasing = ids.numel() < 2 or bool((ids[1:] > ids[:-1]).all())  # (as workers send them: no sort)
        if not increasing and torch.unique(ids).numel() != ids.numel():
            raise InvalidRequestError(f"table {self.name!r}: row ids of one update must be unique (coalesce them)")

    def release(self) -> None:
        """The table is dropped (a restore replaces it): give its bytes back to the budget."""
        self.budget.release(self._charged)
        self._charged = 0

    def apply(self, ids: torch.Tensor, grads: torch.Tensor, lr: float | None = None, base_version: int | None = None,
              checked: bool = False, slots: torch.Tensor | None = None, step: int | None = None,
              replicated: bool = False, versions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply one update to rows `ids` (unique: coalesced per id) with their gradients [n, dim]
        at lr (None: the job's) times the table's lr_scale; base_version: the table version they
        were pulled at (its staleness is recorded); checked: the caller checked them already
        (check_update); slots: their arena slots, from a reserve under the same lock; step: the
        dense rule's step number of this update (the shard's updates that used the table:
        ShardState.table_step; None: the table's
        version after it), which Adagrad's lr_decay counts. With min_count, the ids not stored are
        counted, and those not seen in min_count updates yet are left out (dropped); with ttl, rows
        untouched in ttl updates are dropped after it. replicated: a standby applying its primary's
        record, which admitted, expired and evicted already (and says so); versions: the version
        each row is stamped with (an arena's: its own table's), None: the table's after this
        update. The rows are updated by the row kernels (kernels.rows) where the rule has a fused
        form and they are compiled, else by the rule's torch ops, bit for bit the same. Returns
        the (ids, gradients) applied.

        Raises:
            InvalidRequestError: repeated ids, or gradients of another shape or dtype.
            MemoryBudgetError: rows to store do not fit (only where no reserve made them).
        """
        if not checked:
            self.check_update(ids, grads)
        journal = RowJournal.current()
        if journal is not None:
            journal.keep(self)
        if self.sightings is not None and not replicated and ids.numel():
            stored = self._index.lookup(ids) >= 0
            admit = stored.clone()
            sighted = ids[~stored].long()
            if journal is not None:
                journal.sighted(self.sightings, sighted)
            admit[~stored] = self.sightings.add(sighted) >= self.min_count
            self._lifetime.append((SIGHTED, sighted))
            if not bool(admit.all()):
                self.dropped += int((~admit).sum())
                ids, grads = ids[admit], grads[admit]
                slots = None if slots is None else slots[admit]
                versions = None if versions is None else versions[admit]
        if not ids.numel():
            return ids, grads
        if self.min_count > 1 or self.evict or slots is None:  # (rows may have been made or moved since a reserve)
            slots = self.reserve(ids, may_evict=not replicated) if not replicated else self._slots(ids)
        if self.lr_scale != 1.0:
            lr = self.optimizer.step_lr(lr) * self.lr_scale
        step = self.version + 1 if step is None else step
        form = self.optimizer.fused(lr, step)
        fused = None if form is None else kernels.rows(start=grads.numel() >= kernels.ROW_KERNEL_MIN)
        if versions is None:
            versions = torch.full((ids.numel(),), self.version + 1, dtype=torch.int64)
        kept: Tensors | None = None if journal is None else {}  # (the kernel's copies of what it overwrites)
        if fused is not None and form is not None and fused.apply(form, self._values, self._state, slots, grads,
                                                                  self._versions, versions, kept):
            if journal is not None and kept is not None:
                journal.kept(self, slots, kept)
        else:
            if journal is not None:
                journal.wrote(self, slots)
            self.optimizer.apply_at(self._values, self._state, slots, grads, lr, step)  # (grads: read only)
            self._versions.index_copy_(0, slots, versions)
        self.updated(base_version)
        if self.ttl and not replicated and self.version % max(1, self.ttl // 8) == 0:
            self._expire()
        return ids, grads

    def updated(self, base_version: int | None) -> None:
        """Count one update of the table, of rows pulled at base_version (None: not a worker's)."""
        if base_version is not None:
            stale = max(0, self.version - base_version)
            self.staleness_max = max(self.staleness_max, stale)
            self.staleness_sum += stale
            self.pushes += 1
        self.version += 1

    def _expire(self) -> None:
        """Drop the rows no update touched in the last ttl updates of the table (checked every
        ttl/8 updates, so a row lives ttl to 1.125 ttl updates untouched)."""
        n = self.touched
        stale = self._versions[:n] <= self.version - self.ttl
        if bool(stale.any()):
            ids = self._ids[:n][stale].clone()
            self._drop(ids)
            self._lifetime.append((EXPIRED, ids))
            self.expired += ids.numel()

    def forget_workers(self, live: set[int]) -> None:
        """Nothing per worker here."""

    # ----------------------------------------------------------------- state
    def snapshot(self) -> TableSnapshot:
        n = self.touched
        tensors: Tensors = {"ids": self._ids[:n].clone(), "values": self._values[:n].clone(),
                            "versions": self._versions[:n].clone()}
        tensors.update({"state." + k: v[:n].clone() for k, v in self._state.items()})
        if self.sightings is not None:
            tensors["sightings"] = self.sightings.counts.clone()
        scalars = self._scalars()
        scalars.update({k: getattr(self, k) for k in ("admitted", "expired", "evicted", "dropped") if getattr(self, k)})
        return TableSnapshot(self.kind, tensors, scalars)

    def _scalars(self) -> Scalars:
        """A snapshot's scalars: the table's shape and version, its staleness so far (where there
        is some: what `psgrad status` shows of it, which a restart continues), and the capacity of
        its storage (see adopt_capacity)."""
        return {"num_embeddings": self.num_embeddings, "dim": self.dim, "index": self.index,
                "num_shards": self.num_shards, "seed": self.seed, "std": self.std, "version": self.version,
                **{key: getattr(self, name) for key, name in STALENESS_SCALARS.items() if getattr(self, name)},
                **self._capacities()}

    def _capacities(self) -> Scalars:
        """The capacity of the table's storage as a snapshot keeps it: its arena's rows, and a
        dynamic table's row index's places (where they are more than a fresh one's)."""
        out: Scalars = {CAPACITY: self._ids.numel()}
        if isinstance(self._index, HashIndex) and self._index.capacity > HashIndex.INITIAL:
            out[INDEX_CAPACITY] = self._index.capacity
        return out

    def adopt_capacity(self, snap: TableSnapshot, stored: int) -> None:
        """Grow the storage to the capacity a snapshot says its table had (its arena's rows, a
        dynamic table's row index), charging the budget as that table was charged, where the
        budget has room for all of it (else it is left to grow as the rows come, as before): a
        standby attached mid-run, or a server restarted from a checkpoint, then grows as the table
        did (a smaller arena doubles to other sizes than its primary's and charges the budget
        more: near the budget it refused an update its primary had applied, and was dropped).
        stored: the rows it holds once loaded (their room is counted in what must fit)."""
        if CAPACITY not in snap.scalars and INDEX_CAPACITY not in snap.scalars:
            return  # (an older psgrad's snapshot: loaded as it was)
        rows_ = max(int(snap.scalars.get(CAPACITY, 0)), stored, 1024)
        more = max(0, rows_ - self._ids.numel()) * self.row_bytes()
        places = 0
        if isinstance(self._index, HashIndex):
            places = int(snap.scalars.get(INDEX_CAPACITY, 0))
            more += max(16 * (places - self._index.capacity), self._index.growth_bytes(stored))
        if not self.budget.fits(more):
            return
        if rows_ > self._ids.numel():
            self._grow(rows_)
        if isinstance(self._index, HashIndex) and places > self._index.capacity:
            extra = 16 * (places - self._index.capacity)
            self.budget.charge(extra, f"the row index of dynamic table {self.name!r} on shard {self.index}")
            self._charged += extra
            self._index.reserve(places)

    def _load_staleness(self, snap: TableSnapshot) -> None:
        """The staleness so far a snapshot kept (none: 0, as in a checkpoint of an older psgrad)."""
        for key, name in STALENESS_SCALARS.items():
            setattr(self, name, int(snap.scalars.get(key, 0)))

    def _check_fits(self, snap: TableSnapshot) -> None:
        """Raises InvalidRequestError where `snap` is a snapshot of a table of another shape."""
        shape = tuple(snap.scalars.get(k) for k in ("num_embeddings", "dim", "index", "num_shards", "seed"))
        if shape != (self.num_embeddings, self.dim, self.index, self.num_shards, self.seed):
            raise InvalidRequestError(f"table {self.name!r}: a snapshot of {shape} does not fit this table")

    def load(self, snap: TableSnapshot) -> None:
        self._check_fits(snap)
        ids = snap.tensors["ids"]
        self._index.clear()
        self._moved += 1
        self.touched = 0
        freed = self._ids.numel() * self.row_bytes()  # a fresh arena, sized for the snapshot's rows
        self.budget.release(freed)
        self._charged -= freed
        self._ids, self._values = torch.empty(0, dtype=torch.int64), torch.empty(0, self.dim)
        self._versions, self._state = torch.empty(0, dtype=torch.int64), self.optimizer.new_state(0, self.dim)
        self._room = None
        self.adopt_capacity(snap, ids.numel())  # (the snapshot's table's capacity, where the budget holds it)
        if self._ids.numel() < max(ids.numel(), 1024):
            self._grow(max(ids.numel(), 1024))
        n = ids.numel()
        self._ids[:n], self._values[:n], self._versions[:n] = ids, snap.tensors["values"], snap.tensors["versions"]
        for name in self._state:
            self._state[name][:n] = snap.tensors["state." + name]
        grow_index = self._index.growth_bytes(n)
        self.budget.charge(grow_index, f"the row index of dynamic table {self.name!r} on shard {self.index}")
        self._charged += grow_index
        self._index.assign(ids, torch.arange(n))
        self.touched = n
        self.version = int(snap.scalars["version"])
        if self.sightings is not None and "sightings" in snap.tensors:
            self.sightings.counts.copy_(snap.tensors["sightings"])
        for k in ("admitted", "expired", "evicted", "dropped"):
            setattr(self, k, int(snap.scalars.get(k, 0)))
        self._load_staleness(snap)
        self._lifetime = []

    def status(self, name: str) -> TableStatus:
        n = self.touched
        state = sum(t[:n].numel() * t.element_size() for t in self._state.values())
        mean = self.staleness_sum / self.pushes if self.pushes else 0.0
        placed = 0 if isinstance(self._index, HashIndex) else self._index.rows  # (dynamic: no fixed count)
        return TableStatus(name, self.kind, n * self.dim, n * self.dim * 4, state, rows=placed, rows_touched=n,
                           admitted=self.admitted, expired=self.expired, evicted=self.evicted, dropped=self.dropped,
                           updates=self.version, staleness_max=self.staleness_max, staleness_mean=mean,
                           capacity=self._ids.numel())
