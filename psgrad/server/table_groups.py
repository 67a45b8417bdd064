"""Sparse tables of one shape stored together: where two or more tables of a job have the same row
width and the same row-wise optimizer settings (and no row lifetime: admission, expiry, eviction), a
shard keeps their rows in one arena, as TorchRec's table-batched embeddings keep a worker's tables
in one buffer. Each table is still a table of its own to everything outside the shard core — its
name, ids, checks, version, staleness, snapshot and status are its own, and a checkpoint holds it
as a table on its own, the same bytes as before — but a push or a read that touches several of
them makes, gathers, updates and scatters all their rows with one set of tensor operations, where
one set per table costs its overhead once per table (benchmarks/dlrm.py: the servers' CPU for 8
tables fell by a fifth; docs/benchmarks/dlrm.md).

How: the arena is a SparseTable over one id space in which table t's row r is row base_t + r (bases
multiples of the shard count, so a row's shard is the same in both spaces), its initial value still
table t's own (computed from the table's name and r, as a table on its own computes it)."""
from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple, TypeVar

import numpy as np
import torch

from psgrad.core import rows
from psgrad.core.codecs import joined
from psgrad.core.optimizers.rows import RowOptimizer
from psgrad.core.status import TableStatus
from psgrad.errors import InvalidRequestError
from psgrad.server.row_index import DenseIndex
from psgrad.server.tables import MemoryBudget, SparseTable, TableSnapshot, Tensors

# What RowArena.locate finds of a call's ids: (their arena ids, their slots (-1: never stored), the
# count of ids never stored)
Located = tuple[torch.Tensor, torch.Tensor, int]


def group_key(optimizer: RowOptimizer, dim: int, lr_scale: float, lifetime: tuple[int, int, bool],
              dynamic: bool) -> Hashable | None:
    """What tables stored together share (their row width, row-wise optimizer and its settings, the
    multiple of the job's lr); None: a table stored on its own (a dynamic table, whose ids are any
    int64, or one with a row lifetime, whose rows come and go by its own versions)."""
    min_count, ttl, evict = lifetime
    if dynamic or min_count > 1 or ttl or evict:
        return None
    settings = tuple(sorted((k, repr(v)) for k, v in vars(optimizer).items() if k != "lr"))
    return dim, type(optimizer).__name__, settings, lr_scale


class RowArena(SparseTable):
    """The rows of the tables of one group on this shard (see the module doc): a SparseTable whose
    ids are the group's, each row initially its own table's."""

    def __init__(self, dim: int, index: int, num_shards: int, optimizer: RowOptimizer, budget: MemoryBudget,
                 lr_scale: float) -> None:
        # (made as a table of one row, for a dense index; its tables' rows are placed as they join)
        super().__init__(f"<tables of width {dim}>", 1, dim, index, num_shards, 0, optimizer, std=0.0, budget=budget,
                         lr_scale=lr_scale)
        self.num_embeddings = 0
        self.members: list[GroupedTable] = []  # in the order of their bases
        self._bases = torch.empty(0, dtype=torch.int64)
        self._member_bounds: dict[tuple[GroupedTable, ...], tuple[np.ndarray, np.ndarray]] = {}
        self._placed: dict[tuple[SparseTable, ...], dict[RowArena, list[int]]] = {}  # (in_arena's)

    def join(self, table: GroupedTable) -> int:
        """Hold `table`'s rows from now on; returns its base (a multiple of the shard count).

        Raises:
            MemoryBudgetError: the row index for its rows does not fit the budget.
        """
        base = -(-self.num_embeddings // self.num_shards) * self.num_shards
        end = base + table.num_embeddings
        index = self._index
        assert isinstance(index, DenseIndex)
        more = rows.rows_on_shard(end, self.index, self.num_shards) - index.rows
        self.budget.charge(8 * max(more, 0), f"the row index of table {table.name!r} ({more:,} rows on shard {self.index})")
        self._charged += index.extend(end)
        self.num_embeddings = end
        self.members.append(table)
        self._bases = torch.tensor([m.base for m in self.members[:-1]] + [base], dtype=torch.int64)
        names = [m.name for m in self.members]  # (what a refusal of the budget names)
        self.name = "+".join(names[:4]) + (f"+{len(names) - 4} more" if len(names) > 4 else "")
        if table.std:
            self.std = 1.0  # (not all rows start at zero: a read of rows never stored computes them)
        return base

    def _initial(self, ids: torch.Tensor) -> torch.Tensor:
        """Each row's initial value as its own table computes it."""
        if self.std == 0.0 or not ids.numel():
            return torch.zeros(ids.numel(), self.dim)
        which = (torch.searchsorted(self._bases, ids, right=True) - 1).numpy()  # (each row's table: one draw for all)
        keys = np.array([m.key for m in self.members], dtype=np.uint64)[which]
        stds = np.array([m.std for m in self.members], dtype=np.float64)[which]
        return rows.initial_rows(keys, ids - self._bases[torch.from_numpy(which)], self.dim, stds)

    def ids_of(self, members: Sequence[GroupedTable], ids: Sequence[torch.Tensor],
               flat: torch.Tensor | None = None) -> torch.Tensor:
        """The arena ids of member tables' row ids (checked), concatenated in the members' order
        (flat: that concatenation, where the caller has it): one offset for all of them, where
        each table's to_arena is one per table."""
        if len(members) == 1:
            return members[0].to_arena(ids[0])
        return (joined(list(ids)) if flat is None else flat).long() + per_row([m.base for m in members], ids)

    def check_members(self, members: Sequence[GroupedTable], ids: Sequence[torch.Tensor],
                      grads: Sequence[torch.Tensor] | None = None, flat: torch.Tensor | None = None,
                      find: bool = True) -> Located | None:
        """Check member tables' row ids (and, for an update, their gradients) as each one's check
        (check_update) does, with one pass of the row kernels for all of them (locate), or one set
        of tensor operations, where everything is in order (members in the order of their bases,
        as in_arena gives them); where something is not, the members' own checks run and name it.
        flat: the ids joined, where the caller has them so. Returns what locate found (None: it
        did not run, or not find: the check alone, which reads none of the row index).

        Raises:
            InvalidRequestError: as SparseTable.check (check_update) words it.
        """
        if flat is not None:  # (a RowBlock's: int64 ids one after another, each table's gradients [count, width])
            fine = grads is None or all(g.dtype == torch.float32 and g.dim() == 2 and g.shape[1] == self.dim
                                        for g in grads)
        else:
            fine = all(i.dtype in (torch.int64, torch.int32) and i.dim() == 1 for i in ids)
            if fine and grads is not None:
                fine = all(g.dtype == torch.float32 and tuple(g.shape) == (i.numel(), self.dim)
                           for i, g in zip(ids, grads))
        if fine and (flat.numel() if flat is not None else any(i.numel() for i in ids)):
            found = self.locate(members, ids, ascending=grads is not None, flat=flat, find=find)
            if found is not None:
                return found if find else None
            local = (joined(list(ids)) if flat is None else flat).long()
            wrong = (local < 0) | (local >= per_row([m.num_embeddings for m in members], ids))
            if self.num_shards > 1:
                wrong |= torch.remainder(local, self.num_shards) != self.index
            fine = not bool(wrong.any())
            if fine and grads is not None and local.numel() > 1:  # (in range: arena ids increase with the bases)
                at = local + per_row([m.base for m in members], ids)
                fine = bool((at[1:] > at[:-1]).all())  # (as workers send them: unique, sorted)
        if not fine:
            self._check_each(members, ids, grads)
        return None

    def _check_each(self, members: Sequence[GroupedTable], ids: Sequence[torch.Tensor],
                    grads: Sequence[torch.Tensor] | None) -> None:
        for k, member in enumerate(members):
            if grads is None:
                member.check(ids[k])
            else:
                member.check_update(ids[k], grads[k])

    def locate(self, members: Sequence[GroupedTable], ids: Sequence[torch.Tensor], ascending: bool,
               flat: torch.Tensor | None = None, find: bool = True) -> Located | None:
        """Member tables' row ids (members in the order of their bases) checked, and found in the
        arena (flat: the ids joined, where the caller has them so), in one pass of the row
        kernels: (their arena ids, concatenated; their slots, -1
        where never stored; how many are never stored), valid under this lock. None: the kernels
        are not compiled here, the ids are not int64, or (ascending: an update's) they are not
        in increasing order, which the members' own checks allow (the torch ops go on).
        find=False: checked only (a read checked before its call's push: its rows are found
        when they are read); what it returns then holds the ids joined and no slots (empty).

        Raises:
            InvalidRequestError: an id out of range or on another shard, as the member's check
                words it.
        """
        if flat is None and not all(i.dtype == torch.int64 for i in ids):
            return None
        sizes, bases = self._bounds(members)
        found = self.locate_rows(joined(list(ids)) if flat is None else flat, [i.numel() for i in ids],
                                 sizes, bases, ascending, find)
        if found is None:
            return None
        bad, arena_ids, slots, new = found
        if bad >= 0:
            self._check_each(members, ids, None)  # (raises where an id is out of range or elsewhere)
            return None
        return arena_ids, slots, new

    def locate_call(self, call: CallTables, flat: torch.Tensor, counts: Sequence[int], ascending: bool) -> Located | None:
        """locate() of a call's rows of tables all of this arena, in its order (call.arena is
        this one), their ids joined in `flat` (int64), counts[k] of them table k's. None also
        where an id is out of range or elsewhere: the members' own checks then say which."""
        found = self.locate_rows(flat, counts, call.sizes, call.bases, ascending)
        return None if found is None or found[0] >= 0 else (found[1], found[2], found[3])

    def _bounds(self, members: Sequence[GroupedTable]) -> tuple[np.ndarray, np.ndarray]:
        """(rows, base) of each of `members` as int64 arrays (what locate_rows takes), kept per
        tuple of members: a member's rows and base are set when it joins, for good."""
        return _kept(self._member_bounds, tuple(members), lambda: (
            np.array([m.num_embeddings for m in members], dtype=np.int64),
            np.array([m.base for m in members], dtype=np.int64)))

    def mine(self, table: GroupedTable) -> torch.Tensor:
        """The arena slots of `table`'s stored rows, in slot order."""
        ids = self._ids[:self.touched]
        return ((ids >= table.base) & (ids < table.base + table.num_embeddings)).nonzero().squeeze(1)


class GroupedTable(SparseTable):
    """A sparse table whose rows live in its group's arena (see the module doc): everything a table
    answers, its own, translated to the arena's ids."""

    def __init__(self, name: str, num_embeddings: int, dim: int, index: int, num_shards: int, seed: int,
                 std: float, arena: RowArena) -> None:
        if num_embeddings < 1 or dim != arena.dim:
            raise InvalidRequestError(f"table {name!r}: {num_embeddings} x {dim} does not go in an arena of width {arena.dim}")
        # (no SparseTable.__init__: the rows, their index and the budget's charges are the arena's)
        self._name_it(name, num_embeddings, dim, index, num_shards, seed, std, arena.optimizer, arena.lr_scale,
                      arena.budget)
        self.arena = arena
        self.base = arena.join(self)

    # ----------------------------------------------------------------- rows
    def to_arena(self, ids: torch.Tensor) -> torch.Tensor:
        """Ids (checked) as the arena's."""
        return ids.long() + self.base if self.base else ids.long()

    @property
    def touched(self) -> int:  # type: ignore[override]
        """Rows of this table stored."""
        return int(self.arena.mine(self).numel())

    def row_bytes(self) -> int:
        return self.arena.row_bytes()

    def placement(self) -> int:
        return self.arena.placement()

    def reserve(self, ids: torch.Tensor, may_evict: bool = False, slots: torch.Tensor | None = None,
                new: int | None = None) -> torch.Tensor:
        return self.arena.reserve(self.to_arena(ids), may_evict, slots, new)

    def rows(self, ids: torch.Tensor, checked: bool = False) -> torch.Tensor:
        if not checked:
            self.check(ids)
        return self.arena.rows(self.to_arena(ids), checked=True)

    def pull(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.check(ids)
        return self.arena.pull(self.to_arena(ids))

    def apply(self, ids: torch.Tensor, grads: torch.Tensor, lr: float | None = None, base_version: int | None = None,
              checked: bool = False, slots: torch.Tensor | None = None, step: int | None = None,
              replicated: bool = False, versions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if not checked:
            self.check_update(ids, grads)
        if ids.numel():
            at = self.to_arena(ids)
            self.arena.apply(at, grads, lr, None, checked=True, slots=slots,
                             step=self.version + 1 if step is None else step, replicated=replicated,
                             versions=torch.full((ids.numel(),), self.version + 1, dtype=torch.int64)
                             if versions is None else versions)
            self.updated(base_version)
        return ids, grads

    def load_rows(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        if self.version:
            raise InvalidRequestError(f"table {self.name!r}: rows are loaded into a new table only (it is at version {self.version})")
        self.check_update(ids, values)
        if not ids.numel():
            return
        arena = self.arena
        slots = arena._slots(self.to_arena(ids))
        arena._values.index_copy_(0, slots, values)
        arena._versions.index_fill_(0, slots, 1)
        self.version = 1

    def updated_rows(self, from_id: int, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, values = self.arena.updated_rows(self.base + max(from_id, 0), limit)
        keep = ids < self.base + self.num_embeddings
        return ids[keep] - self.base, values[keep]

    def remove(self, ids: torch.Tensor, expired: bool = False) -> None:
        self.arena.remove(self.to_arena(ids), expired)

    def take_lifetime(self) -> list[tuple[str, torch.Tensor]]:
        return []  # (no row lifetime: no ids sighted, no rows dropped)

    def release(self) -> None:
        """Nothing of its own to give back: the arena's charges are the group's."""

    # ----------------------------------------------------------------- state
    def snapshot(self) -> TableSnapshot:
        arena = self.arena
        slots = arena.mine(self)
        tensors: Tensors = {"ids": arena._ids.index_select(0, slots) - self.base,
                            "values": arena._values.index_select(0, slots),
                            "versions": arena._versions.index_select(0, slots)}
        tensors.update({"state." + k: v.index_select(0, slots) for k, v in arena._state.items()})
        scalars = self._scalars()
        if slots.numel():  # (rows made so far: every row stored, as a table on its own counts them)
            scalars["admitted"] = int(slots.numel())
        return TableSnapshot(self.kind, tensors, scalars)

    def _capacities(self) -> dict[str, float | int]:
        return self.arena._capacities()  # (the arena's: every table stored in it says the same)

    def adopt_capacity(self, snap: TableSnapshot, stored: int) -> None:
        self.arena.adopt_capacity(snap, self.arena.touched + stored)

    def load(self, snap: TableSnapshot) -> None:
        self._check_fits(snap)
        arena = self.arena
        arena._drop(arena._ids.index_select(0, arena.mine(self)))
        # (the snapshot's arena's capacity, where the budget holds it: see SparseTable.adopt_capacity)
        arena.adopt_capacity(snap, arena.touched + snap.tensors["ids"].numel())
        ids = self.to_arena(snap.tensors["ids"])
        if ids.numel():
            arena._make(ids)
            slots = arena._index.lookup(ids)
            arena._values.index_copy_(0, slots, snap.tensors["values"])
            arena._versions.index_copy_(0, slots, snap.tensors["versions"])
            for name, t in arena._state.items():
                t.index_copy_(0, slots, snap.tensors["state." + name])
        self.version = int(snap.scalars["version"])
        self._load_staleness(snap)

    def status(self, name: str) -> TableStatus:
        n = self.touched
        state = n * (self.arena.row_bytes() - 4 * self.dim - 16)
        mean = self.staleness_sum / self.pushes if self.pushes else 0.0
        placed = rows.rows_on_shard(self.num_embeddings, self.index, self.num_shards)
        return TableStatus(name, self.kind, n * self.dim, n * self.dim * 4, state, rows=placed, rows_touched=n,
                           admitted=n, updates=self.version, staleness_max=self.staleness_max, staleness_mean=mean,
                           capacity=self.arena._ids.numel())


class CallTables(NamedTuple):
    """The sparse tables a call names (by name, in its order) as a shard state holds them, with
    what its row path asks of them each time (ShardState.tables_of keeps one per tuple of names:
    a job's calls name the same few tuples step after step, and a table's arena and base are set
    for good when it joins). Where the tables are all one arena's, in its order (`arena`), a
    call's rows of them lie as the arena's block (one width, arena ids increasing with the
    tables' bases): its ids are checked, found, made and updated as one, where each table's
    part otherwise costs its lookups, checks and places in turn."""

    names: tuple[str, ...]
    tables: tuple[SparseTable, ...]
    arenas: dict[RowArena, list[int]]  # in_arena(tables)
    arena: RowArena | None  # every table stored in this one arena, in the arena's order
    members: tuple[GroupedTable, ...]  # the tables as the arena's members (arena's), else ()
    sizes: np.ndarray  # (arena's) each member's rows and base, as locate_rows takes them
    bases: np.ndarray
    widths: tuple[int, ...]  # (arena's) each table's row width: the arena's
    changes_rows: bool  # some table admits rows (min_count) or evicts them: an apply may make or drop rows
    order: tuple[int, ...]  # the tables' places, sorted by name (the order an update applies them in)

    @classmethod
    def of(cls, names: Sequence[str], tables: Sequence[SparseTable]) -> CallTables:
        tables = tuple(tables)
        arenas = _places(tables)
        arena = None
        if len(arenas) == 1 and all(isinstance(t, GroupedTable) for t in tables):
            (only, places), = arenas.items()
            arena = only if places == list(range(len(tables))) else None
        members = tuple(t for t in tables if isinstance(t, GroupedTable)) if arena is not None else ()
        return cls(tuple(names), tables, arenas, arena, members,
                   np.array([m.num_embeddings for m in members], dtype=np.int64),
                   np.array([m.base for m in members], dtype=np.int64),
                   tuple(m.dim for m in members),
                   any(t.evict or t.min_count > 1 for t in tables),
                   tuple(sorted(range(len(tables)), key=lambda i: names[i])))

    def placements(self, sync: bool = False) -> tuple[int, ...]:
        """The tables' placement counts (SparseTable.placement), those that evict left out in sync
        (their rows are made by the iteration): one for an arena's (its members share it)."""
        if self.arena is not None:
            return (self.arena.placement(),)
        return tuple(t.placement() for t in self.tables if not (sync and t.evict))


def in_arena(tables: Sequence[SparseTable]) -> dict[RowArena, list[int]]:
    """The places in `tables` of those stored in an arena, by arena (in their order there): not
    to be changed (kept, for these very tables, by the first one's arena: a call's tables are the
    same few lists step after step, and a table's arena and base are set for good when it joins)."""
    first = next((t for t in tables if isinstance(t, GroupedTable)), None)
    if first is None:
        return {}
    return _kept(first.arena._placed, tuple(tables), lambda: _places(tables))


def _places(tables: Sequence[SparseTable]) -> dict[RowArena, list[int]]:
    out: dict[RowArena, list[int]] = {}
    for i, t in enumerate(tables):
        if isinstance(t, GroupedTable):
            out.setdefault(t.arena, []).append(i)
    for places in out.values():
        places.sort(key=lambda i: tables[i].base)  # type: ignore[attr-defined]
    return out


K = TypeVar("K")
V = TypeVar("V")


def _kept(kept: dict[K, V], key: K, make: Callable[[], V]) -> V:
    """kept[key], made by make() the first time (an arena's answers for the few lists of tables a
    job's calls name, step after step; at 64 the others, which come and go, are dropped)."""
    got = kept.get(key)
    if got is None:
        if len(kept) >= 64:
            kept.clear()
        got = kept[key] = make()
    return got


def per_row(values: Sequence[int], ids: Sequence[torch.Tensor] | Sequence[int]) -> torch.Tensor:
    """values[k] for each of the ids[k] (or counts[k] times, where ids are counts), concatenated
    (int64; numpy's repeat: a fraction of torch's repeat_interleave on a few tables)."""
    counts = [i if isinstance(i, int) else i.numel() for i in ids]
    return torch.from_numpy(np.repeat(np.array(values, dtype=np.int64), counts))


def next_versions(members: Sequence[SparseTable], ids: Sequence[torch.Tensor] | Sequence[int]) -> torch.Tensor:
    """Each row's stamp in an update of member tables' rows (ids[k] of members[k], or counts):
    its table's next version (one fill where all the members have the same)."""
    next_ = [m.version + 1 for m in members]
    if next_.count(next_[0]) == len(next_):
        return torch.full((sum(i if isinstance(i, int) else i.numel() for i in ids),), next_[0], dtype=torch.int64)
    return per_row(next_, ids)
