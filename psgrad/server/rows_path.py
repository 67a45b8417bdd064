"""The sparse-table path of a shard: reads of rows by id (several tables in one call), and the row
gradients that travel inside a push: checked in full before anything of the push is applied, then
applied with its dense gradient — at once (async, ssp), or (sync) with the iteration: summed over its
workers in rank order and divided by their number, like the dense mean, so the update does not
depend on the order pushes arrived in. A collaborator of the shard core, acting under its lock; it
tells the replica when rows changed."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import accumulate

import numpy as np
import torch

from psgrad.core.codecs import joined
from psgrad.errors import InvalidRequestError
from psgrad.server import aggregation, kernels
from psgrad.server.read_limit import ReadLimit
from psgrad.server.replica_path import Replica
from psgrad.server.shard_core import ShardCore
from psgrad.server.state import ShardState
from psgrad.server.table_groups import CallTables, GroupedTable, Located, RowArena, in_arena, next_versions, per_row
from psgrad.server.tables import RowJournal, SparseTable
from psgrad.server.transfers import count_nonfinite
from psgrad.wire.protocol import MAX_MESSAGE_BYTES
from psgrad.wire.rows import BlockGradients, BlockLookups, RowBlock

# table -> (row ids [n] int64, their gradients [n, dim] float32, the table version they were pulled at):
# a push's rows as its RowBlock gives them (BlockGradients, wire/rows.py: views of the block's buffers)
RowGradients = Mapping[str, tuple[torch.Tensor, torch.Tensor, int]]
# (table, row ids [n] int64): rows a call reads
Lookup = tuple[str, torch.Tensor]


class Slots(dict[str, torch.Tensor]):
    """The arena slots a reserve made, by table; and, per arena, all of its tables' at once with
    their arena ids ((its tables in its order, arena ids, slots, the arena's placement count then,
    each table's count of ids)), which the apply takes as they are where it updates those tables
    (no arena ids made again, no slots joined again, none looked up again). A table of an arena
    held whole gets its own part when asked (split then). uid: the shard state's they were made
    in; count: the tables they are for. A sync push's are kept with it until its iteration is
    applied (apply_round), and used there where they still hold (the same state, no row of the
    arena dropped or moved since)."""

    def __init__(self, uid: int = 0, count: int = 0) -> None:
        super().__init__()
        self.uid = uid
        self.count = count
        self.whole: dict[RowArena, tuple[tuple[str, ...], torch.Tensor, torch.Tensor, int, Sequence[int]]] = {}

    def __missing__(self, name: str) -> torch.Tensor:
        for names, _, made, _, counts in self.whole.values():
            if name in names:
                self.update(zip(names, made.split_with_sizes(list(counts))))
                return dict.__getitem__(self, name)
        raise KeyError(name)


# What a push's check reserved: (the uid of the shard state it was made in, its tables' placement
# counts (SparseTable.placement), the arena slots made, by table). A plain tuple: the push's writer
# (server/transfers.py, below this module) carries it to the apply.
Reserved = tuple[int, tuple[int, ...], dict[str, torch.Tensor]]


# The rows one reply may carry: a gRPC message's limit less room for the rest of the reply (the
# dense weights of a Step travel beside it in frames or shared memory, not in this message).
REPLY_ROWS_MAX_BYTES = MAX_MESSAGE_BYTES - (1 << 20)


def _check_reply_size(tables: Sequence[SparseTable], lookups: Sequence[Lookup], reads: ReadLimit) -> int:
    """Refuse a read whose reply would be too large to send, or larger than all the server lets
    the replies to reads hold at once (--max-read-mb), from its request alone (ids x dim x 4
    bytes), before a byte of it is built. tables: the lookups' tables, in their order. Returns
    those bytes.

    Raises:
        InvalidRequestError: it would pass REPLY_ROWS_MAX_BYTES (named, with the count of ids) or
            the server's --max-read-mb (named, with the value it would need).
    """
    count = nbytes = 0
    for t, (_, ids) in zip(tables, lookups):
        n = ids.numel()
        count += n
        nbytes += n * 4 * t.dim
    if nbytes > REPLY_ROWS_MAX_BYTES:
        raise InvalidRequestError(
            f"a read of {count:,} rows would make a reply of {nbytes:,} bytes, more than the {REPLY_ROWS_MAX_BYTES:,} "
            "one call may carry: give the step fewer distinct ids (a smaller batch), more servers (each reads "
            "its share of the rows), or narrower rows")
    reads.check(nbytes, f"a read of {count:,} rows")
    return nbytes


class Rows:
    """Sparse-table calls of one shard."""

    def __init__(self, core: ShardCore, replica: Replica) -> None:
        self._core = core
        self._replica = replica

    def pull(self, rank: int, fingerprint: str, lookups: Sequence[Lookup],
             checked: bool = False, observe: bool = False, sized: bool = False) -> list[tuple[int, torch.Tensor]]:
        """Per lookup (table, ids): (the table's version, rows [len(ids), dim]). No gate: a worker
        pulls a step's rows after its dense pull passed the mode's (a Step call once its gate
        holds); checked: check_reads checked the ids already; sized: check_reads(ids=False)
        checked the reply's size (which depends on the ids' count and the tables' widths alone);
        observe: a read-only read (any caller), else a worker's, from a rank that joined (see
        ShardCore.require_reader).

        Raises:
            InvalidRequestError: no such table; ids out of range, of another dtype or shard; or a
                reply too large to send (refused before it is built). Reads store no rows, so
                they never charge the memory budget.
            UnknownWorkerError: a worker's read (not observe) from a rank that never joined.
        """
        core = self._core
        with core.cond:
            state = core.require_reader(fingerprint, rank, observe, "a read of rows")
            call = state.tables_of(tuple(table for table, _ in lookups), rank)
            tables = call.tables
            located: dict[SparseTable, Located] = {}
            flat = lookups.flat if isinstance(lookups, BlockLookups) else None  # (the ids of a RowBlock, joined)
            if not checked:
                if not sized:
                    _check_reply_size(tables, lookups, core.reads)
                located = _check_tables(tables, [ids for _, ids in lookups], flat=flat)
            read: list[torch.Tensor | None] = [None] * len(lookups)
            for arena, places in call.arenas.items():  # tables stored together: one gather for them all
                members, ids_ = [_grouped(tables[i]) for i in places], [lookups[i][1] for i in places]
                whole = _whole(flat, places, len(tables))
                # (what the check found of their rows, or, checked before, found now: one pass of the
                # row kernels over their ids)
                found = located.get(arena) or arena.locate(members, ids_, ascending=False, flat=whole)
                if found is None:
                    got = arena.rows(arena.ids_of(members, ids_), checked=True)
                else:
                    got = arena.read_at(found[0], found[1], found[2])
                parts = got.split_with_sizes([i.numel() for i in ids_])
                for i, part in zip(places, parts):
                    read[i] = part
            out = []
            for t, (_, ids), values in zip(tables, lookups, read):
                if values is None:
                    values = t.rows(ids, checked=True)
                core.counters.bytes_out += values.numel() * 4
                out.append((t.version, values))
            return out

    def check_reads(self, rank: int, fingerprint: str, lookups: Sequence[Lookup], ids: bool = True) -> int:
        """Check the tables and ids of a read (see SparseTable.check; ids=False: its size and
        tables alone, which pull checks again) without reading. Returns the bytes of its reply
        (what it takes of --max-read-mb: see ReadLimit).

        Raises:
            InvalidRequestError: no such table; ids out of range, of another dtype or shard; or a
                reply too large to send, or larger than the server's --max-read-mb.
        """
        with self._core.cond:
            state = self._core.require(fingerprint, rank)
            tables = state.tables_of(tuple(table for table, _ in lookups), rank).tables
            nbytes = _check_reply_size(tables, lookups, self._core.reads)
            if ids:
                _check_tables(tables, [ids for _, ids in lookups],
                              flat=lookups.flat if isinstance(lookups, BlockLookups) else None, find=False)
            return nbytes

    def updated_page(self, rank: int, fingerprint: str, table: str, limit: int,
                     observe: bool = False) -> tuple[int, int]:
        """(the most rows, their bytes) a page of at most `limit` updated rows of `table` holds:
        `limit`, or fewer where the table stores fewer rows now (at least 1): a read of the page
        with that limit makes a reply of at most those bytes, which it takes of --max-read-mb, and
        tells the reader the same (a page shorter than the limit it asked for is the last).

        Raises:
            InvalidRequestError: no such table, a limit of 0, or a page that could pass the bytes a
                reply may carry or the server's --max-read-mb (named, with what to ask for).
            UnknownWorkerError: a worker's read (not observe) from a rank that never joined.
        """
        if limit < 1:
            raise InvalidRequestError(f"a read of updated rows needs a limit >= 1, got {limit}")
        core = self._core
        with core.cond:
            t = core.require_reader(fingerprint, rank, observe, "a read of updated rows").sparse(table, rank)
            per_row = 4 * t.dim + 8
            rows_ = max(1, min(limit, t.touched))
            if rows_ * per_row > REPLY_ROWS_MAX_BYTES:
                raise InvalidRequestError(
                    f"a read of up to {limit:,} updated rows of table {table!r} ({per_row} bytes each) could pass the "
                    f"{REPLY_ROWS_MAX_BYTES:,} bytes a reply may carry: ask for at most "
                    f"{REPLY_ROWS_MAX_BYTES // per_row:,} rows a call")
            core.reads.check(rows_ * per_row, f"a read of up to {rows_:,} updated rows of table {table!r} "
                                              f"({per_row} bytes each)")
            return rows_, rows_ * per_row

    def updated(self, rank: int, fingerprint: str, table: str, from_id: int, limit: int,
                observe: bool = False) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(the table's version, ids, rows) of a page of the rows of `table` updated at least once
        (see SparseTable.updated_rows); observe: a read-only read (any caller), else a worker's,
        from a rank that joined.

        Raises:
            InvalidRequestError: no such table, a limit of 0, or a page too large (see updated_page).
            UnknownWorkerError: a worker's read (not observe) from a rank that never joined.
        """
        self.updated_page(rank, fingerprint, table, limit, observe)
        core = self._core
        with core.cond:
            t = core.require_reader(fingerprint, rank, observe, "a read of updated rows").sparse(table, rank)
            if from_id >= 1 << 63:  # (the request's uint64 carries a dynamic table's int64 ids bit for bit)
                from_id -= 1 << 64
            ids, values = t.updated_rows(from_id, limit)
            core.counters.bytes_out += values.numel() * 4 + ids.numel() * 8
            return t.version, ids, values

    def check(self, state: ShardState, rank: int, rows: RowGradients,
              pending: Sequence[RowGradients] | None = None) -> tuple[int, Reserved]:
        """Check a push's row gradients in full (tables, ids, shapes) and make the rows they touch,
        so that applying them can no longer fail (the memory budget is charged here, before any
        part of the push is applied). Returns their non-finite values (the push's non-finite
        policy decides for the whole push) and the slots made, for the apply (see reserve). Under
        the lock. pending: a sync push, with the rows of the pushes of its iteration buffered so
        far; the rows of tables that evict are not made here but by the iteration (see
        check_round).

        Raises:
            InvalidRequestError: no such table; ids repeated, out of range or on another shard;
                gradients of another shape; a base version outside the table's (see check_bases).
            MemoryBudgetError: the rows would not fit the server's budget.
        """
        call = state.tables_of(rows.names if isinstance(rows, BlockGradients) else tuple(rows), rank)
        self.check_bases(rank, rows, call.tables)
        block = rows.block if isinstance(rows, BlockGradients) else None
        located = None if block is None else _located_block(call, block)
        if located is None:
            located = _check_tables(call.tables, [ids for ids, _, _ in rows.values()],
                                    [grads for _, grads, _ in rows.values()], None if block is None else block.ids)
        if block is not None and block.grads is not None:
            bad = count_nonfinite(block.grads)  # (one sum for all its tables)
        else:
            bad = sum(count_nonfinite(grads) for _, grads, _ in rows.values())
        sync = pending is not None
        if pending is not None:
            self.check_round(state, rows, pending)
        slots = self.reserve(state, rows, located=located, sync=sync, call=call)
        return bad, (state.uid, call.placements(sync), slots)

    def check_bases(self, rank: int, rows: RowGradients, tables: Sequence[SparseTable]) -> None:
        """Check each table's base version, the table version its rows were pulled at (a table's
        version on this shard counts the updates applied to it, and a read answers it): from 0 to
        the table's version now, which never goes back but by a restore or a roll-back. A shard
        restored from a checkpoint (or rolled back), or a backup that took over (a read of rows
        waits for no backup, so a worker may have read versions the former primary never
        replicated), is behind what its workers read: there the version is not bounded above, as
        a push's dense base version is not either. The versions only feed the tables' staleness
        figures, which a bogus one corrupted (negative: a huge staleness; past the table: none).

        Raises:
            InvalidRequestError: a negative base version, or (see above) one past the table's.
        """
        behind = self._core.marks.restored or self._core.took_over
        for name, base, t in zip(rows, _bases(rows), tables):
            if base < 0 or (base > t.version and not behind):
                raise InvalidRequestError(
                    f"push from worker rank {rank}: table {name!r}'s rows claim base version {base}, but the table is at "
                    f"version {t.version} on this shard: a base version is the table version its rows were read at, "
                    f"0 to {t.version}")

    def check_round(self, state: ShardState, rows: RowGradients, pending: Sequence[RowGradients]) -> None:
        """Check that the rows of a sync push's tables that evict will fit when its iteration is
        applied, changing nothing (SparseTable.check_room): the union of its ids and those of the
        pushes buffered for the iteration (`pending`). Those rows are made by the iteration's
        apply (apply_round), in order of id, evicting as the iteration's rows decide, not as
        pushes arrive: which rows an iteration makes and evicts depends on its gradients alone.
        Under the lock.

        Raises:
            MemoryBudgetError: they would not fit even with every row the iteration does not touch
                dropped (nothing is made or dropped).
        """
        evicting = [name for name, t in state.tables.items() if isinstance(t, SparseTable) and t.evict]
        if not evicting:  # (most jobs: nothing to look at, where each table was looked up in turn)
            return
        spent = 0  # (the tables share the budget: each is checked with what those made before it take)
        named = {name for p in (rows, *pending) for name in p}
        for name in sorted(name for name in evicting if name in named):  # (in apply_round's order)
            t = state.sparse(name, -1)
            parts = [p[name][0] for p in (rows, *pending) if name in p]
            spent += t.check_room(parts[0] if len(parts) == 1 else torch.unique(torch.cat(parts).long()), spent)

    def reserve(self, state: ShardState, rows: RowGradients, may_evict: bool = False,
                made: Reserved | None = None, located: dict[SparseTable, Located] | None = None,
                sync: bool = False, call: CallTables | None = None) -> dict[str, torch.Tensor]:
        """Make the rows a push touches (checked already), charging the memory budget; returns their
        arena slots by table (for an apply under the same lock). may_evict: the push is being
        applied (tables that evict make room now; see SparseTable.reserve). made: what the push's
        check reserved; its slots are returned as they are where they still hold (the same state,
        no row of those tables dropped or moved since, no table that admits or evicts, whose rows
        the apply may make or drop). located: what a check under this lock found of their rows
        (_check_tables), by arena. sync: a sync push's, whose tables that evict are left out (their
        rows are made by its iteration: see check_round). call: the tables of `rows`
        (state.tables_of), where the caller has them.

        Raises:
            MemoryBudgetError: they would not fit.
        """
        if call is None:
            call = state.tables_of(tuple(rows), -1)
        names: Sequence[str] = call.names
        tables: Sequence[SparseTable] = call.tables
        arenas, changes_rows = call.arenas, call.changes_rows
        if sync and changes_rows:
            kept = [i for i, t in enumerate(tables) if not t.evict]
            names, tables = [names[i] for i in kept], [tables[i] for i in kept]
            arenas, changes_rows = in_arena(tables), any(t.min_count > 1 for t in tables)
        if made is not None:
            uid, placements, slots = made
            if uid == state.uid and isinstance(slots, Slots) and slots.count == len(names) \
                    and placements == call.placements(sync) and not changes_rows:
                return slots
        out = Slots(state.uid, len(names))
        # (a block whose tables are one arena's, all of them with ids: its counts as it holds them)
        block = rows.block if isinstance(rows, BlockGradients) and rows.whole and call.arena is not None else None
        for arena, places in arenas.items():  # tables stored together: their rows made at once (each
            # table's slots split off when asked: see Slots)
            found = None if located is None else located.get(arena)
            if found is None:
                arena_ids = arena.ids_of([_grouped(tables[i]) for i in places], [rows[names[i]][0] for i in places])
                made_ = arena.reserve(arena_ids, may_evict)
            else:
                arena_ids = found[0]
                made_ = arena.reserve(arena_ids, may_evict, slots=found[1], new=found[2])
            counts = block.counts if block is not None else [int(rows[names[i]][0].numel()) for i in places]
            out.whole[arena] = (tuple(names[i] for i in places), arena_ids, made_, arena.placement(), counts)
        for name, t in zip(names, tables):
            if not isinstance(t, GroupedTable):
                found = None if located is None else located.get(t)
                at, new = (None, None) if found is None else (found[1], found[2])
                out[name] = t.reserve(rows[name][0], may_evict, slots=at, new=new)
        return out

    def apply(self, state: ShardState, rows: RowGradients, lr: float | None, lr_scale: float = 1.0,
              slots: dict[str, torch.Tensor] | None = None) -> None:
        """Apply one worker's row gradients (async, ssp) with the push's lr (None: the job's); slots:
        their arena slots by table, from a reserve under the same lock."""
        # (a block whose tables all have ids: their counts and base versions as it holds them)
        block = rows.block if isinstance(rows, BlockGradients) and rows.whole else None
        call = state.tables_of(rows.names if isinstance(rows, BlockGradients) else
                               tuple(n for n in rows if rows[n][0].numel()), -1)
        names, tables = call.names, call.tables
        _keep(tables)
        alone: set[str] = set()  # tables of an arena whose step numbers differ: each updated on its own
        for arena, places in call.arenas.items():  # tables stored together: one update for them all
            if state.table_skips and len({state.table_step(names[i]) for i in places}) > 1:
                alone.update(names[i] for i in places)
                continue
            step_lr = _scaled(lr, arena.optimizer.lr, lr_scale)
            if arena is call.arena:  # (the push's tables are the arena's, in its order)
                members, order = call.members, names
                counts = None if block is None else block.counts
            else:
                members, order, counts = tuple(_grouped(tables[i]) for i in places), tuple(names[i] for i in places), None
            whole = rows.flat(order) if isinstance(rows, BlockGradients) else None  # (the push's block: no copy)
            at: torch.Tensor | None
            made = slots.whole.get(arena) if isinstance(slots, Slots) else None
            if made is not None and made[0] == order:  # (what the reserve made of these tables)
                _, ids, at, _, _ = made
            else:
                ids = arena.ids_of(members, [rows[name][0] for name in order], None if whole is None else whole[0])
                at = None if slots is None else joined([slots[name] for name in order])
            grads = torch.cat([rows[name][1] for name in order]) if whole is None else whole[1]
            versions = next_versions(members, counts if counts is not None else [rows[name][0] for name in order])
            arena.apply(ids, grads, step_lr, None, checked=True, slots=at, step=state.table_step(order[0]),
                        versions=versions)
            recording = self._replica.recording  # (an arena's members have no row lifetime to report)
            bases = block.base_versions if counts is not None and block is not None else [rows[n][2] for n in order]
            for name, member, base in zip(order, members, bases):  # (in the arena's order: a standby makes their rows so)
                member.updated(base)
                if recording:
                    self._report(name, member, rows[name][0], rows[name][1], base, step_lr)
        for i in call.order:  # (by name)
            name, t = names[i], tables[i]
            if not isinstance(t, GroupedTable) or name in alone:
                ids, grads, base = rows[name]
                step_lr = _scaled(lr, t.optimizer.lr, lr_scale)
                ids, grads = t.apply(ids, grads, step_lr, base, checked=True,
                                     slots=None if slots is None else slots[name], step=state.table_step(name))
                self._report(name, t, ids, grads, base, step_lr)

    def apply_round(self, state: ShardState, per_rank: Sequence[RowGradients], workers: int, lr: float | None,
                    reserved: Sequence[Mapping[str, torch.Tensor] | None] = ()) -> None:
        """Apply a sync iteration's row gradients (one dict per worker, in rank order): per table and
        row, their sum over the workers divided by `workers` (the iteration's gradients: rows a
        worker did not touch count as its zero gradient, as in the mean of the workers' losses).
        reserved: what each push's reserve gave (its Slots, in the same order), where kept: the arena
        ids and slots of its rows, used where they still hold (see _reserved_in)."""
        names = sorted({name for rows in per_rank for name in rows if rows[name][0].numel()})
        call = state.tables_of(tuple(names), -1)
        tables = call.tables
        _keep(tables)
        alone: set[str] = set()  # tables of an arena whose step numbers differ: each updated on its own
        for arena, places in call.arenas.items():  # tables stored together: one sum, one update
            members = [names[i] for i in places]
            if len({state.table_step(name) for name in members}) > 1:
                alone.update(members)
                continue
            mine = [[(name, rows[name]) for name in members if name in rows and rows[name][0].numel()] for rows in per_rank]
            parts = [part for rank in mine for part in rank]
            found = _reserved_in(state, arena, mine, reserved)
            ids, at = found if found is not None else (
                arena.ids_of([_grouped(state.sparse(name, -1)) for name, _ in parts], [p[0] for _, p in parts]), None)
            rank_ends = list(accumulate(sum(p[0].numel() for _, p in rank) for rank in mine))
            unique, total, slots = round_mean(ids, rank_ends, _rank_gradients(per_rank, mine), workers, at)
            group = [_grouped(tables[i]) for i in places]
            # (each member's rows: a run of the unique ids, which are sorted and the members' bases
            # increasing; the runs' ends found, and each row's version and own id made, in a few
            # calls: each costs several times in a server's step, cold, what it does in a loop)
            ends = np.searchsorted(unique.numpy(), np.array([m.base + m.num_embeddings for m in group],
                                                            dtype=np.int64)).tolist()
            counts = [b - a for a, b in zip([0, *ends[:-1]], ends)]  # (np.diff's prepend costs ~30 us here)
            versions = next_versions(group, counts)
            arena.apply(unique, total, lr, None, checked=True, slots=slots, step=state.table_step(members[0]),
                        versions=versions)
            bases: dict[str, int] = {}
            for name, p in parts:
                bases[name] = min(bases.get(name, p[2]), p[2])
            # (the record's rows, each member's own ids: only where a standby takes records; an
            # arena's members have no row lifetime to report)
            local = unique - per_row([m.base for m in group], counts) if self._replica.recording else None
            start = 0
            for name, member, end in zip(members, group, ends):
                if end > start:
                    member.updated(bases[name])
                    if local is not None:
                        self._report(name, member, local[start:end], total[start:end], bases[name], lr)
                start = end
        for name, t in zip(names, tables):
            if isinstance(t, GroupedTable) and name not in alone:
                continue
            parts_ = [rows[name] for rows in per_rank if name in rows and rows[name][0].numel()]
            rank_ends = list(accumulate(p[0].numel() for p in parts_))
            unique, total, _ = round_mean(torch.cat([p[0] for p in parts_]).long(), rank_ends,
                                          torch.cat([p[1] for p in parts_]), workers)
            base = min(p[2] for p in parts_)
            unique, total = t.apply(unique, total, lr, base, checked=True, step=state.table_step(name))  # (checked pushes' ids)
            self._report(name, t, unique, total, base, lr)

    def _report(self, name: str, t: SparseTable, ids: torch.Tensor, grads: torch.Tensor, base: int,
                lr: float | None) -> None:
        """Tell the replica what an update did to table `name`: what its row lifetime did (the ids
        counted for admission, the rows dropped: evicted or expired), then the rows it updated, in
        that order, as the standby must apply them."""
        for what, changed in t.take_lifetime():
            if changed.numel():
                self._replica.rows_lifetime(name, what, changed)
        if ids.numel():
            self._replica.rows_applied(name, ids, grads, base, lr)


def _located_block(call: CallTables, block: RowBlock) -> dict[SparseTable, Located] | None:
    """What _check_tables finds of a push's rows, checked and found in one pass of the row kernels,
    where its block is one arena's (call.arena: every table of it with ids, of its width); None
    for any other block, or where something is amiss (_check_tables then says what)."""
    arena = call.arena
    if arena is None or block.grads is None or len(block.tables) != len(call.names) or block.widths != call.widths:
        return None
    found = arena.locate_call(call, block.ids, block.counts, ascending=True)
    return None if found is None else {arena: found}


def _check_tables(tables: Sequence[SparseTable], ids: Sequence[torch.Tensor],
                  grads: Sequence[torch.Tensor] | None = None, flat: torch.Tensor | None = None,
                  find: bool = True) -> dict[SparseTable, Located]:
    """Check a call's row ids of `tables` (and, for an update, their gradients; see
    SparseTable.check and check_update): those stored together at once, per arena, the others
    each on its own. flat: all the ids joined in the tables' order, where the call brought them
    so (a RowBlock). Returns what the arenas' checks found of their rows, where the row kernels
    found it (RowArena.locate: valid under this lock); find=False: nothing (the check alone,
    which reads none of the row index: a read checked before it is made).

    Raises:
        InvalidRequestError: as the table concerned words it.
    """
    found: dict[SparseTable, Located] = {}
    for arena, places in in_arena(tables).items():
        whole = _whole(flat, places, len(tables))
        located = arena.check_members([_grouped(tables[i]) for i in places], [ids[i] for i in places],
                                      None if grads is None else [grads[i] for i in places], whole, find)
        if located is not None:
            found[arena] = located
    for k, t in enumerate(tables):
        if isinstance(t, GroupedTable):
            continue
        if grads is None:
            t.check(ids[k])
            continue
        g = grads[k]
        # (an update's ids checked and found in one pass of the row kernels, as an arena's are;
        # where they cannot, or something is amiss, the table's own check runs and says what)
        located = t.locate_ids(ids[k], ascending=True) if (
            find and g.dtype == torch.float32 and tuple(g.shape) == (ids[k].numel(), t.dim)) else None
        if located is None:
            t.check_update(ids[k], g)
        else:
            found[t] = located
    return found


def _whole(flat: torch.Tensor | None, places: Sequence[int], count: int) -> torch.Tensor | None:
    """A call's ids joined (flat, its RowBlock's) where they are those of an arena's tables in its
    order (`places`: the arena's tables' places among the call's `count` tables), else None."""
    return flat if flat is not None and len(places) == count and list(places) == sorted(places) else None


def round_mean(ids: torch.Tensor, ends: Sequence[int], grads: torch.Tensor, workers: int,
               slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(unique ids, sorted; their gradients summed in the order given (rank order) and divided by
    `workers`; where slots gives each id's row slot, each unique id's, else None): a sync round's
    row gradients, one per row. ids and grads hold each worker's rows in turn, worker k's ending
    at ends[k]: where each worker's ids increase (as workers send them), the row kernels merge
    them in one pass, else torch sorts them (the same bits either way; no slots then)."""
    fused = kernels.rows(start=grads.numel() >= kernels.ROW_KERNEL_MIN)
    merged = None if fused is None else fused.merge(ids, ends, grads, workers, slots)
    return merged if merged is not None else (*aggregation.rows_mean(ids, grads, workers), None)


def _reserved_in(state: ShardState, arena: RowArena,
                 mine: Sequence[Sequence[tuple[str, tuple[torch.Tensor, torch.Tensor, int]]]],
                 reserved: Sequence[Mapping[str, torch.Tensor] | None]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The arena ids and slots of a sync round's rows of `arena` (mine: each rank's (table, rows)
    of it, in the arena's order), joined rank after rank, as the pushes' reserves made them
    (reserved, by rank); None where one of them is not kept, or no longer holds: made in another
    shard state, for other tables, or before a row of the arena was dropped or moved."""
    if len(reserved) != len(mine):
        return None
    ids, slots = [], []
    for rank, made in zip(mine, reserved):
        if not rank:
            continue
        whole = made.whole.get(arena) if isinstance(made, Slots) and made.uid == state.uid else None
        if whole is None or whole[3] != arena.placement():
            return None
        names = tuple(name for name, _ in rank)
        if tuple(name for name in whole[0] if name in names) != names or \
                whole[1].numel() != sum(int(p[0].numel()) for _, p in rank):
            return None
        ids.append(whole[1])
        slots.append(whole[2])
    return (joined(ids), joined(slots)) if ids else None


def _rank_gradients(per_rank: Sequence[RowGradients],
                    mine: Sequence[Sequence[tuple[str, tuple[torch.Tensor, torch.Tensor, int]]]]) -> torch.Tensor:
    """The row gradients of an arena's tables in a sync round, rank after rank (mine: each rank's
    (table, rows) of it, in the arena's order): a rank's push block whole where its tables are
    those, in that order (BlockGradients.flat: no copy of its part), else its tables' joined."""
    pieces: list[torch.Tensor] = []
    for rows, rank in zip(per_rank, mine):
        whole = rows.flat([name for name, _ in rank]) if rank and isinstance(rows, BlockGradients) else None
        pieces.extend([whole[1]] if whole is not None else [p[1] for _, p in rank])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _bases(rows: RowGradients) -> Sequence[int]:
    """Each table's base version, in the order of `rows` (a block's as it holds them: no part of
    it made for them)."""
    if isinstance(rows, BlockGradients) and rows.whole:
        return rows.block.base_versions
    return [base for _, _, base in rows.values()]


def _keep(tables: Sequence[SparseTable]) -> None:
    """Where an apply is journaled (RowJournal), keep the scalars of the tables it updates first."""
    journal = RowJournal.current()
    if journal is not None:
        for t in tables:
            journal.keep(t)


def _grouped(table: SparseTable) -> GroupedTable:
    assert isinstance(table, GroupedTable)
    return table


def _scaled(lr: float | None, job_lr: float, scale: float) -> float | None:
    if scale == 1.0:
        return lr
    return (job_lr if lr is None else lr) * scale
