"""A shard's state: what a checkpoint saves, a standby holds and a restart restores (the layout,
its tables with their weights and optimizer state, the version, and every worker's clocks), apart
from the short-lived transfer machinery. Not thread-safe on its own: the shard core calls it under
its lock."""
from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from psgrad.config import JobSpec
from psgrad.core import rows
from psgrad.core.layout import Layout
from psgrad.core.sharding import TableSpec
from psgrad.core.optimizers import ShardOptimizer
from psgrad.errors import InvalidRequestError
from psgrad.server.membership import Member, Membership
from psgrad.core.optimizers.rows import RowOptimizer, make_row_optimizer
from psgrad.core.optimizers.segments import segments_of
from psgrad.server.table_groups import CallTables, GroupedTable, RowArena, group_key
from psgrad.server.tables import DENSE, FROZEN, DenseTable, FrozenTable, MemoryBudget, SparseTable, Table, TableSnapshot

OptimizerState = dict[str, torch.Tensor | float | int]
# Keys of a snapshot's job scalars: the job's lr and the chief's clock that set it.
JOB_LR, JOB_LR_CLOCK = "job_lr", "job_lr_clock"
#: a snapshot's job entry "table_skips.<table>": the updates that did not use that table (kept where > 0)
TABLE_SKIPS = "table_skips."
NOT_INITIALIZED_HINT = (
    "shard is not initialized: start worker rank 0 (the chief) against these servers first; "
    "it sends the job spec and the initial weights"
)
_UIDS = itertools.count(1)


@dataclass(frozen=True)
class MemberRecord:
    """A worker's clocks as a snapshot keeps them; `last_push_clock` is what makes a retried push
    a no-op after a restore."""

    rank: int
    clock: int
    last_push_clock: int
    pushes: int
    state: str


@dataclass(frozen=True)
class ShardSnapshot:
    """A copy of a shard's state, taken at once under the shard's lock; shares no memory with it.
    `tables` holds each table's state by name; `job` the job's lr and the clock that set it."""

    layout: Layout
    tables: dict[str, TableSnapshot]
    version: int
    members: tuple[MemberRecord, ...]
    job: dict[str, float | int] = field(default_factory=dict)
    #: the shard's counters (ledger.Counters.saved: pushes applied, the staleness histogram, ...), which
    #: a restart continues; empty: none kept (an older checkpoint's, or a standby's copy)
    counters: dict[str, Any] = field(default_factory=dict)

    @property
    def weights(self) -> torch.Tensor:
        """The dense table's weights."""
        return self.tables[DENSE].tensors["weights"]

    @property
    def optimizer(self) -> OptimizerState:
        """The dense table's optimizer state and the job's lr (as the state of one optimizer)."""
        dense = self.tables[DENSE]
        state: OptimizerState = {k[len("optimizer."):]: v for k, v in dense.tensors.items() if k.startswith("optimizer.")}
        return {**dense.scalars, **state, **self.job}


@dataclass
class ShardState:
    """The state of an initialized shard: its tables (today the dense one: the shard's range of the
    flat space), the version, the job's lr, and its members. The dense table's `weights` are
    replaced (not only written) by staged updates; `membership` also holds each member's lease,
    which a snapshot leaves out."""

    layout: Layout
    tables: dict[str, Table]
    membership: Membership
    version: int = 0
    #: The chief's clock whose push set the job's lr (every table's optimizer.lr); -1: still the spec's.
    job_lr_clock: int = -1
    #: Tells this state from any other the process held: (uid, version) names one set of weights.
    uid: int = field(default_factory=lambda: next(_UIDS), compare=False)
    #: What its sparse tables may hold in all (the server's --memory-budget-mb).
    budget: MemoryBudget = field(default_factory=lambda: MemoryBudget(None), compare=False)
    #: The arenas of its sparse tables stored together, by what they share (server/table_groups.py).
    arenas: dict[Hashable, RowArena] = field(default_factory=dict, compare=False)
    #: Per sparse table, the shard's updates that did not use it (no worker's forward of it got a
    #: backward): its own step number is the shard's update number less these (table_step).
    table_skips: dict[str, int] = field(default_factory=dict)
    #: tables_of's answers, by tuple of names (a sparse table, once held, is held for good)
    _calls: dict[tuple[str, ...], CallTables] = field(default_factory=dict, init=False, compare=False, repr=False)

    def table_step(self, name: str) -> int:
        """The step number table `name` takes in the update being applied (the shard's next version
        less the updates that skipped it): what a dense twin's Adagrad counts for its lr_decay."""
        return self.version + 1 - self.table_skips.get(name, 0)

    def skip_tables(self, names: Iterable[str]) -> None:
        """The update being applied did not use these tables: their step counts stay."""
        for name in names:
            self.table_skips[name] = self.table_skips.get(name, 0) + 1

    def sparse(self, name: str, rank: int) -> SparseTable:
        """Sparse table `name`.

        Raises:
            InvalidRequestError: the job has no sparse table of that name (those it has are named).
        """
        table = self.tables.get(name)
        if not isinstance(table, SparseTable):
            have = ", ".join(repr(n) for n, t in self.tables.items() if isinstance(t, SparseTable)) or "none"
            raise InvalidRequestError(f"worker rank {rank} asked for sparse table {name!r}; the job's are: {have}")
        return table

    def tables_of(self, names: tuple[str, ...], rank: int) -> CallTables:
        """The sparse tables `names` (each as sparse() gives it), with what the row path asks of
        them (CallTables), kept per tuple of names.

        Raises:
            InvalidRequestError: as sparse() words it.
        """
        got = self._calls.get(names)
        if got is None:
            got = CallTables.of(names, [self.sparse(name, rank) for name in names])
            if len(self._calls) >= 64:  # (a job names a few tuples, step after step; others come and go)
                self._calls.clear()
            self._calls[names] = got
        return got

    @property
    def dense(self) -> DenseTable:
        table = self.tables[DENSE]
        assert isinstance(table, DenseTable)
        return table

    @property
    def weights(self) -> torch.Tensor:
        """The dense table's weights."""
        return self.dense.weights

    @weights.setter
    def weights(self, value: torch.Tensor) -> None:
        self.dense.weights = value

    @property
    def optimizer(self) -> ShardOptimizer:
        """The dense table's optimizer (its lr is the job's)."""
        return self.dense.optimizer

    @property
    def job_lr(self) -> float:
        return self.dense.optimizer.lr

    @property
    def key(self) -> tuple[int, int]:
        """(uid, version): the weights as they are now, as a publication of them is labelled."""
        return self.uid, self.version

    @classmethod
    def create(cls, layout: Layout, weights: torch.Tensor, membership: Membership,
               budget_bytes: int | None = None) -> ShardState:
        """A new shard of the job `layout` describes, at version 0 with the chief's weights and its
        rows of the job's sparse tables (none made yet); budget_bytes: what those may hold in all.

        Raises:
            InvalidRequestError: the weights do not fit the shard's range.
            MemoryBudgetError: the sparse tables' row index alone is over budget_bytes.
        """
        if weights.dtype != torch.float32 or weights.numel() != layout.numel:
            raise InvalidRequestError(
                f"initial weights of shard {layout.index} must be {layout.numel} float32 values, "
                f"got {weights.numel()} {weights.dtype}"
            )
        segments = segments_of(layout.params, layout.start, layout.end)
        tables: dict[str, Table] = {DENSE: DenseTable(layout.spec, weights, layout.trainable, segments)}
        state = cls(layout, tables, membership, budget=MemoryBudget(budget_bytes))
        state.add_sparse_tables([(t.name, t.num_embeddings, t.dim, t.seed, t.std, t) for t in layout.tables])
        if layout.frozen:  # the shard's range of the frozen space (written by the chief's Init)
            if FROZEN in state.tables:
                raise InvalidRequestError(f"a sparse table is named {FROZEN!r}, the name of the frozen parameters' "
                                          "table: rename that embedding module, or pass frozen='local'")
            start, end = layout.frozen_range
            state.tables[FROZEN] = FrozenTable(end - start)
        return state

    @property
    def frozen(self) -> FrozenTable | None:
        """The shard's range of the frozen space (None: the job keeps no frozen parameters here)."""
        table = self.tables.get(FROZEN)
        return table if isinstance(table, FrozenTable) else None

    def _group_of(self, name: str, num_embeddings: int, dim: int, group: TableSpec | None) -> Hashable | None:
        """What a table stored with others shares with them (table_groups.group_key); None: alone."""
        optimizer = _row_optimizer(self.layout.spec, group, name)
        return group_key(optimizer, dim, 1.0 if group is None else group.lr_scale,
                         (0, 0, False) if group is None else group.lifetime, num_embeddings == rows.DYNAMIC)

    def add_sparse_tables(self, tables: Sequence[tuple[str, int, int, int, float, TableSpec | None]]) -> None:
        """add_sparse_table for each (name, num_embeddings, dim, seed, std, group): those that share
        their shape with another of them, or with a table stored together already, are stored
        together (one table alone in an arena would cost more than on its own)."""
        keys = [self._group_of(name, n, dim, group) for name, n, dim, _, _, group in tables]
        count = Counter(keys)
        for (name, n, dim, seed, std, group), key in zip(tables, keys):
            together = key is not None and (count[key] > 1 or key in self.arenas)
            self.add_sparse_table(name, n, dim, seed, std, group, together)

    def add_sparse_table(self, name: str, num_embeddings: int, dim: int, seed: int = 0, std: float = 1.0,
                         group: TableSpec | None = None, together: bool = False) -> SparseTable:
        """Hold the rows of embedding table `name` that live on this shard, updated by the job's
        optimizer in its row-wise form, with the settings of the table's parameter group (`group`:
        its TableSpec; None: the job's); together: stored with the job's other tables of its shape
        (server/table_groups.py), where it has one (see add_sparse_tables).

        Raises:
            InvalidRequestError: the name is taken, or the table's shape is not a table.
            ConfigError: the job's optimizer has no row-wise form, or a setting it cannot take.
        """
        if name in self.tables:
            raise InvalidRequestError(f"shard {self.layout.index} already holds a table {name!r}")
        spec = self.layout.spec
        optimizer = _row_optimizer(spec, group, name)
        lr_scale = 1.0 if group is None else group.lr_scale
        lifetime = (0, 0, False) if group is None else group.lifetime
        key = self._group_of(name, num_embeddings, dim, group) if together else None
        table: SparseTable
        if key is None:
            table = SparseTable(name, num_embeddings, dim, self.layout.index, spec.num_shards, seed, optimizer, std,
                                self.budget, lr_scale, lifetime)
        else:
            arena = self.arenas.get(key)
            if arena is None:
                arena = self.arenas[key] = RowArena(dim, self.layout.index, spec.num_shards, optimizer, self.budget,
                                                    lr_scale)
            table = GroupedTable(name, num_embeddings, dim, self.layout.index, spec.num_shards, seed, std, arena)
        table.optimizer.lr = self.job_lr
        _draw_as(table, group)
        self.tables[name] = table
        return table

    def _add_tables_of(self, snaps: dict[str, TableSnapshot]) -> None:
        """Empty tables of the kinds and shapes snapshots hold (tables the layout does not name: an
        older checkpoint's; their state is loaded after): this shard's sparse tables as
        add_sparse_tables stores them, any other as the snapshot says.

        Raises:
            InvalidRequestError: a kind this psgrad does not know, or a sparse table without its shape.
        """
        mine = []
        for name, snap in snaps.items():
            s = snap.scalars
            if snap.kind == SparseTable.kind and (s.get("index"), s.get("num_shards")) == (
                    self.layout.index, self.layout.spec.num_shards) and all(k in s for k in ("num_embeddings", "dim", "seed", "std")):
                mine.append((name, int(s["num_embeddings"]), int(s["dim"]), int(s["seed"]), float(s["std"]),
                             self.layout.table(name)))
            else:
                self.tables[name] = _table_from(name, snap, self.layout, self.budget)
        self.add_sparse_tables(mine)

    def apply(self, grad: torch.Tensor, lr_scale: float = 1.0, lr: float | None = None) -> None:
        """Apply one update to the dense table (see DenseTable.apply)."""
        self.dense.apply(grad, lr_scale, lr)

    def apply_checked(self, grad: torch.Tensor, lr_scale: float, lr: float | None, restore: torch.Tensor) -> int:
        """Apply a plain SGD update to the dense table, checking grad as it goes (see DenseTable.apply_checked)."""
        return self.dense.apply_checked(grad, lr_scale, lr, restore)

    def resolve_lr(self, rank: int, clock: int, lr: float | None) -> float:
        """The learning rate a push is applied with: the one it carries, else the job's. The chief's
        (rank 0's) pushes set the job's lr, which the other workers of an async or ssp job follow
        (their pushes carry none): one schedule for the job, versioned by the chief's clock, so a
        retried or late push of an older clock never turns it back."""
        if lr is None:
            return self.job_lr
        if rank == 0 and clock >= self.job_lr_clock:
            self._set_lr(lr, clock)
        return lr

    def set_job_lr(self, lr: float, clock: int) -> None:
        """Take the job's lr a primary (or a snapshot) says was set at the chief's `clock`."""
        if clock >= self.job_lr_clock:
            self._set_lr(lr, clock)

    def _set_lr(self, lr: float, clock: int) -> None:
        for table in self.tables.values():
            table.optimizer.lr = lr
        self.job_lr_clock = clock

    def forget_workers(self, live: set[int]) -> None:
        """Drop the per-worker state tables keep (DC-ASGD's copies) of workers no longer live."""
        for table in self.tables.values():
            table.forget_workers(live)

    def snapshot(self, pending_ranks: frozenset[int] = frozenset(),
                 counters: dict[str, Any] | None = None) -> ShardSnapshot:
        """Copy the state. `pending_ranks` (sync) pushed gradients the current iteration still
        buffers: the snapshot is taken at the iteration's start, where they still owe them.
        counters: the shard's counters to keep with it (see ShardSnapshot.counters)."""
        records = self.member_records(pending_ranks)
        tables = {name: table.snapshot() for name, table in self.tables.items()}
        job: dict[str, float | int] = {JOB_LR: self.job_lr, JOB_LR_CLOCK: self.job_lr_clock}
        job.update({TABLE_SKIPS + name: n for name, n in sorted(self.table_skips.items()) if n})
        return ShardSnapshot(self.layout, tables, self.version, records, job, dict(counters or {}))

    def member_records(self, pending_ranks: frozenset[int] = frozenset()) -> tuple[MemberRecord, ...]:
        """Every worker's clocks as a snapshot (or a replicated update) keeps them, by rank."""
        records = []
        for m in sorted(self.membership.members.values(), key=lambda m: m.rank):
            clock, last = m.clock, m.last_push_clock
            if m.rank in pending_ranks:
                clock, last = self.version, self.version - 1
            records.append(MemberRecord(m.rank, clock, last, m.pushes - (m.rank in pending_ranks), m.state))
        return tuple(records)

    def set_members(self, records: tuple[MemberRecord, ...], now: float) -> None:
        """Take the members a replicated update carries (or a backup taking over), with leases
        starting at `now`."""
        self.membership.members = {
            r.rank: Member(r.rank, now, r.clock, r.pushes, r.state, r.last_push_clock) for r in records
        }

    @classmethod
    def restore(cls, snap: ShardSnapshot, membership: Membership, now: float, budget_bytes: int | None = None) -> ShardState:
        """The state a snapshot holds, with fresh copies of its tensors; members' leases start at
        `now` (a live worker that does not come back is evicted one lease later).

        Raises:
            InvalidRequestError: the snapshot's tables do not fit its layout.
        """
        state = cls.create(snap.layout, torch.empty(snap.layout.numel), membership, budget_bytes)
        kinds = {n: t.kind for n, t in snap.tables.items()}
        if kinds.get(DENSE) != DenseTable.kind:
            raise InvalidRequestError(f"a snapshot with tables {kinds} has no dense table")
        state._add_tables_of({name: t for name, t in snap.tables.items() if name not in state.tables})
        for name, table_snap in snap.tables.items():
            state.tables[name].load(table_snap)
        lr, lr_clock = snap.job.get(JOB_LR), snap.job.get(JOB_LR_CLOCK)
        if lr is not None and lr_clock is not None:  # (checkpoints of older versions have none)
            state.set_job_lr(float(lr), int(lr_clock))
        state.version = snap.version
        state.table_skips = {k[len(TABLE_SKIPS):]: int(v) for k, v in snap.job.items() if k.startswith(TABLE_SKIPS)}
        state.set_members(snap.members, now)
        return state


def _table_from(name: str, snap: TableSnapshot, layout: Layout, budget: MemoryBudget) -> Table:
    """An empty table of the kind and shape a snapshot holds (its state is loaded after).

    Raises:
        InvalidRequestError: a kind this psgrad does not know, or a sparse table without its shape.
    """
    if snap.kind != SparseTable.kind:
        raise InvalidRequestError(f"a snapshot's table {name!r} is of kind {snap.kind!r}, which this psgrad does not know")
    try:
        s = snap.scalars
        group = layout.table(name)
        table = SparseTable(name, int(s["num_embeddings"]), int(s["dim"]), int(s["index"]), int(s["num_shards"]),
                            int(s["seed"]), _row_optimizer(layout.spec, group, name), float(s["std"]), budget,
                            1.0 if group is None else group.lr_scale, (0, 0, False) if group is None else group.lifetime)
    except KeyError as exc:
        raise InvalidRequestError(f"a snapshot's sparse table {name!r} lacks its {exc.args[0]}") from None
    _draw_as(table, group)
    return table


def _draw_as(table: SparseTable, group: TableSpec | None) -> None:
    """Draw the table's initial rows under the name its spec says (TableSpec.drawn_as: a loaded
    state's, where the chief's model loaded it under another prefix), not its own."""
    if group is not None and group.drawn_as:
        table.key = rows.table_key(table.seed, group.drawn_as)


def _row_optimizer(spec: JobSpec, group: TableSpec | None, name: str) -> RowOptimizer:
    """The row form of the job's optimizer for table `name`, with its parameter group's settings.

    Raises:
        ConfigError: no row form, or a setting it cannot take (named).
    """
    own = spec if group is None else group.job_spec(spec)
    return make_row_optimizer(own.optimizer, own, name)
