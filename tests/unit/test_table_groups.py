"""Sparse tables of one shape stored together in one arena (server/table_groups.py): which tables share
one, and that a push, a sync round, a read, a snapshot and a restore of tables stored together give
what the same tables on their own give, bit for bit, through the shard's sparse-table path."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from psgrad.config import JobSpec, ServerConfig
from psgrad.core.sharding import TableSpec
from psgrad.errors import InvalidRequestError, MemoryBudgetError
from psgrad.server import checkpoint
from psgrad.server.shard import Shard
from psgrad.server.row_index import DenseIndex
from psgrad.server.state import ShardState
from psgrad.server.table_groups import GroupedTable
from psgrad.server.tables import SparseTable
from psgrad.wire.rows import BlockGradients, RowBlock
from test_shard import make_layout, weights_for

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("row_kernels")]

# (rows, dim, std): a and b start at zero, c is drawn (its initial rows are its own in the arena too)
TABLES = {"a": (1000, 4, 0.0), "b": (37, 4, 0.0), "c": (5000, 4, 0.5)}


def shard(apart: bool = False, budget_mb: float | None = None) -> Shard:
    """Shard 1 of 2 of an Adagrad job with TABLES (apart: each stored on its own, as before groups)."""
    layout = make_layout(JobSpec(optimizer="adagrad", lr=0.1, num_shards=2, num_workers=2), index=1)
    s = Shard(ServerConfig(memory_budget_mb=budget_mb))
    s.initialize(0, layout, weights_for(layout))
    state = s.core.state
    assert state is not None
    state.add_sparse_tables([(name, n, dim, 3, std, None) for name, (n, dim, std) in TABLES.items()])
    for name, (n, dim, std) in TABLES.items():
        if apart:
            t = state.tables[name]
            assert isinstance(t, SparseTable)
            state.tables[name] = SparseTable(name, n, dim, 1, 2, 3, t.optimizer, std, state.budget)
    return s


def pushes(seed: int, count: int) -> list[dict[str, tuple[torch.Tensor, torch.Tensor, int]]]:
    """Row gradients of `count` pushes: shard 1's ids (odd), unique and sorted, some tables absent."""
    g = torch.Generator().manual_seed(seed)
    out = []
    done = dict.fromkeys(TABLES, 0)  # each table's pushes so far: its version (a base is one behind it)
    for k in range(count):
        rows = {}
        for name, (n, dim, _) in TABLES.items():
            if k % 3 == 2 and name == "b":
                continue
            ids = torch.unique(torch.randint(0, n // 2, (12,), generator=g) * 2 + 1)
            rows[name] = (ids, torch.randn(ids.numel(), dim, generator=g), max(0, done[name] - 1))
            done[name] += 1
        out.append(rows)
    return out


def state_of(s: Shard) -> ShardState:
    assert s.core.state is not None
    return s.core.state


def as_block(rows: dict[str, tuple[torch.Tensor, torch.Tensor, int]]) -> BlockGradients:
    """The rows as a push's RowBlock brings them (views of its two buffers), tables in this order."""
    names = list(rows)
    return RowBlock.of([(n, rows[n][0]) for n in names], [rows[n][1] for n in names],
                       [rows[n][2] for n in names]).updates()


def push(s: Shard, rows: dict[str, tuple[torch.Tensor, torch.Tensor, int]]) -> None:
    state = state_of(s)
    _, made = s.rows.check(state, 0, rows)
    slots = s.rows.reserve(state, rows, may_evict=True, made=made)
    s.rows.apply(state, rows, None, 1.0, slots)


def assert_same_tables(mine: Shard, theirs: Shard, staleness: bool = True) -> None:
    """Rows, snapshots and statuses equal (staleness False: not the staleness seen since the start,
    which a snapshot does not keep)."""
    probe = torch.arange(1, 1000, 2)
    for name in TABLES:
        a, b = state_of(mine).tables[name], state_of(theirs).tables[name]
        assert isinstance(a, SparseTable) and isinstance(b, SparseTable)
        ids = probe[probe < b.num_embeddings]
        assert torch.equal(a.rows(ids), b.rows(ids)), name
        sa, sb = a.snapshot(), b.snapshot()
        assert sa.scalars == sb.scalars, name
        assert sa.tensors.keys() == sb.tensors.keys(), name
        for key in sa.tensors:
            assert torch.equal(sa.tensors[key], sb.tensors[key]), (name, key)
        ka, kb = a.status(name), b.status(name)
        if not staleness:
            ka, kb = (dataclasses.replace(k, staleness_max=0, staleness_mean=0.0) for k in (ka, kb))
        assert ka == kb, name


def test_tables_of_one_width_share_an_arena_and_others_keep_their_own() -> None:
    s = shard()
    state = state_of(s)
    state.add_sparse_tables([("wide", 100, 8, 0, 1.0, None), ("wide2", 50, 8, 0, 1.0, None),
                             ("lonely", 100, 16, 0, 1.0, None),  # the only one of its width
                             ("any_id", 0, 4, 0, 1.0, None),  # dynamic: any int64 id
                             ("aging", 100, 4, 0, 1.0, TableSpec("aging", 100, 4, ttl=50)),  # a row lifetime
                             ("late", 10, 4, 0, 1.0, None)])  # joins the arena of a, b and c
    arena_of = {n: t.arena for n, t in state.tables.items() if isinstance(t, GroupedTable)}
    assert sorted(arena_of) == ["a", "b", "c", "late", "wide", "wide2"]
    assert arena_of["a"] is arena_of["b"] is arena_of["c"] is arena_of["late"] and arena_of["wide"] is arena_of["wide2"]
    assert arena_of["a"] is not arena_of["wide"] and len(state.arenas) == 2
    assert all(isinstance(state.tables[n], SparseTable) for n in ("lonely", "any_id", "aging"))
    bases = [arena_of["a"].members[i].base for i in range(4)]
    assert bases == [0, 1000, 1038, 6038]  # multiples of the shard count: a row's shard is its table's row's


def test_the_places_of_tables_in_their_arenas_are_kept_per_list_and_right_in_any_order() -> None:
    """in_arena: each arena's tables' places in the list, in the arena's order (by base); the same
    answer, kept, for the same list again; another order or list gets its own."""
    from psgrad.server.table_groups import in_arena

    s = shard()
    state = state_of(s)
    state.add_sparse_tables([("wide", 100, 8, 0, 1.0, None), ("lonely", 100, 16, 0, 1.0, None),
                             ("wide2", 50, 8, 0, 1.0, None)])
    t = state.tables
    first = [t["c"], t["wide2"], t["a"], t["lonely"], t["wide"], t["b"]]
    got = in_arena(first)
    assert {a.members[0].name: places for a, places in got.items()} == {"a": [2, 5, 0], "wide": [4, 1]}
    assert in_arena(list(first)) is got  # (kept)
    again = in_arena([t["b"], t["a"], t["wide"]])
    assert {a.members[0].name: places for a, places in again.items()} == {"a": [1, 0], "wide": [2]}
    assert in_arena([t["lonely"]]) == {}


def test_pushes_reads_and_sync_rounds_equal_tables_on_their_own() -> None:
    together, apart = shard(), shard(apart=True)
    assert isinstance(state_of(together).tables["a"], GroupedTable)
    assert not isinstance(state_of(apart).tables["a"], GroupedTable)
    for rows in pushes(0, 6):  # async: each push applied as it comes
        push(together, rows)
        push(apart, rows)
    assert_same_tables(together, apart)
    for first, second in zip(pushes(1, 3), pushes(2, 3)):  # sync: a round of two workers' rows
        for s in (together, apart):
            state = state_of(s)
            for rows in (first, second):
                s.rows.check(state, 0, rows)
            s.rows.apply_round(state, [first, second], 2, None)
    assert_same_tables(together, apart)
    # a read of several tables (one gather from the arena), in any order, stored rows and new ones
    reads = [("c", torch.tensor([1, 4999, 7])), ("a", torch.tensor([999, 1])), ("b", torch.tensor([35])),
             ("a", torch.tensor([3]))]
    for checked in (False, True):
        got = together.rows.pull(0, state_of(together).layout.fingerprint, reads, checked)
        want = apart.rows.pull(0, state_of(apart).layout.fingerprint, reads, checked)
        assert [v for v, _ in got] == [v for v, _ in want]
        for (_, a), (_, b) in zip(got, want):
            assert torch.equal(a, b)
    with pytest.raises(InvalidRequestError, match="table 'b'.*row 36 lives on shard 0"):
        together.rows.pull(0, state_of(together).layout.fingerprint, [("b", torch.tensor([36]))])


@pytest.mark.parametrize("apart", [False, True])
def test_a_pushs_apply_takes_the_slots_its_check_made_unless_rows_moved_since(apart: bool) -> None:
    """The apply does not make a checked push's rows again; where rows were dropped in between (the
    tail of the arena moves into their places), it looks them up again and updates the right rows."""
    first, second = pushes(5, 2)
    s, reference = shard(apart), shard(apart)
    for x in (s, reference):
        push(x, first)
        state_of(x).tables["a"].remove(first["a"][0][:2])
        x.rows.check(state_of(x), 0, second)
    state = state_of(s)
    _, made = s.rows.check(state, 0, second)
    assert s.rows.reserve(state, second, may_evict=True, made=made) is made[2]  # nothing moved: as made
    dropped = first["a"][0][2:5]
    for x in (s, reference):
        state_of(x).tables["a"].remove(dropped)  # (as a standby applies its primary's drops)
    again = s.rows.reserve(state, second, may_evict=True, made=made)
    assert again is not made[2]
    s.rows.apply(state, second, None, 1.0, again)
    # the reference made the same rows, and looks their slots up afresh after the drop
    reference.rows.apply(state_of(reference), second, None, 1.0,
                         reference.rows.reserve(state_of(reference), second, may_evict=True))
    assert_same_tables(s, reference)
    assert not torch.equal(state.tables["a"].rows(second["a"][0]), state_of(shard(apart)).tables["a"].rows(second["a"][0]))


@pytest.mark.parametrize("moved", [False, True], ids=["kept", "rows-dropped-between"])
def test_a_sync_round_takes_the_slots_its_pushes_reserved_unless_rows_moved_since(
        moved: bool, row_kernels: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The iteration's apply does not look up again the rows its pushes' reserves found (their arena
    ids and slots, carried through the row kernels' merge of the workers' rows); where rows of the
    arena were dropped in between (the tail of the arena moves into their places), or torch's ops
    merge them (which carry no slots), it looks them up afresh. Either way the tables end as
    those of a round applied without what the reserves gave."""
    s, reference = shard(), shard()
    for x in (s, reference):
        push(x, pushes(11, 1)[0])
    first, second = pushes(12, 2)  # two workers' rows of one iteration
    reserved = []
    for x in (s, reference):
        state = state_of(x)
        for rows in (first, second):
            _, made = x.rows.check(state, 0, rows)
            slots = x.rows.reserve(state, rows, may_evict=True, sync=True, made=made)
            if x is s:
                reserved.append(slots)
        if moved:  # (as a standby applies its primary's drops)
            state.tables["a"].remove(pushes(11, 1)[0]["a"][0][:3])
    looked_up = []
    original = DenseIndex.lookup
    monkeypatch.setattr(DenseIndex, "lookup", lambda self, ids: looked_up.append(ids.numel()) or original(self, ids))
    s.rows.apply_round(state_of(s), [first, second], 2, None, reserved)
    assert bool(looked_up) == (moved or row_kernels == "torch-ops"), looked_up
    reference.rows.apply_round(state_of(reference), [first, second], 2, None)
    assert_same_tables(s, reference)


@pytest.mark.parametrize("apart", [False, True], ids=["arena", "alone"])
def test_a_pushs_check_gives_each_id_the_slot_the_index_holds_for_it(apart: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows a check makes get their slots without a second lookup where the row kernels found
    the ids (in order), in an arena and in a table on its own alike; either way each id's slot is
    the one the index holds for it after, new rows and stored ones alike, and the pushes end as the
    same pushes do when the kernels find nothing (each table checked and looked up by torch's ops)."""
    s, reference = shard(apart), shard(apart)
    found = []
    original = SparseTable.locate_rows
    monkeypatch.setattr(SparseTable, "locate_rows", lambda self, *a, **k: found.append(self) or original(self, *a, **k))
    for rows in pushes(7, 4):  # (the same ids again and again: rows stored and rows new)
        state = state_of(s)
        _, made = s.rows.check(state, 0, rows)
        for name, (ids, _, _) in rows.items():
            table = state.tables[name]
            if apart:
                assert type(table) is SparseTable
                assert torch.equal(made[2][name], table._index.lookup(ids))
            else:
                assert isinstance(table, GroupedTable)
                assert torch.equal(made[2][name], table.arena._index.lookup(table.to_arena(ids)))
        s.rows.apply(state, rows, None, 1.0, s.rows.reserve(state, rows, may_evict=True, made=made))
        with monkeypatch.context() as m:
            m.setattr(SparseTable, "locate_rows", lambda *a, **k: None)
            push(reference, rows)
    assert len(found) == (sum(len(r) for r in pushes(7, 4)) if apart else 4)  # (alone: one pass a table; arena: a push)
    assert_same_tables(s, reference)


def test_a_snapshot_of_tables_stored_together_restores_them_exactly(tmp_path: Path) -> None:
    s = shard()
    for rows in pushes(3, 4):
        push(s, rows)
    path = checkpoint.save(s.snapshot(), tmp_path)
    back = Shard(ServerConfig())
    back.restore(checkpoint.load(path))
    assert all(isinstance(state_of(back).tables[n], GroupedTable) for n in TABLES)
    assert_same_tables(back, s, staleness=False)
    for rows in pushes(4, 2):  # the optimizer state and versions came back too
        push(s, rows)
        push(back, rows)
    assert_same_tables(back, s, staleness=False)


BAD_PUSHES = {  # b's part of a push -> what the refusal says (b has 37 rows; this is shard 1 of 2)
    "out of range": (lambda ids, g: (torch.cat([ids, torch.tensor([37])]), torch.cat([g, torch.ones(1, 4)])),
                     "table 'b': row id 37 is out of range"),
    "negative": (lambda ids, g: (torch.cat([torch.tensor([-1]), ids]), torch.cat([torch.ones(1, 4), g])),
                 "table 'b': row id -1 is out of range"),
    "another shard's": (lambda ids, g: (torch.cat([ids, torch.tensor([36])]), torch.cat([g, torch.ones(1, 4)])),
                        "table 'b': row 36 lives on shard 0"),
    "repeated": (lambda ids, g: (torch.cat([ids, ids[:1]]), torch.cat([g, g[:1]])), "table 'b'.*must be unique"),
    "narrow": (lambda ids, g: (ids, g[:, :3].contiguous()), "table 'b': gradients must be float32"),
    "int32": (lambda ids, g: (ids.int(), g), None),  # (accepted: the tables' own check takes int32 ids)
    "unsorted": (lambda ids, g: (ids.flip(0), g.flip(0)), None),  # (accepted: unique, in any order)
}


@pytest.mark.parametrize("block", [False, True], ids=["dict", "block"])
@pytest.mark.parametrize("case", list(BAD_PUSHES))
def test_a_push_is_checked_as_each_table_checks_it(case: str, block: bool) -> None:
    """Also as a RowBlock of the arena's tables in its order, whose ids are checked in one pass for
    them all (CallTables.arena): refused with the table's own words, or applied as on their own."""
    s, reference = shard(), shard(apart=True)
    rows = pushes(5, 1)[0]
    change, refusal = BAD_PUSHES[case]
    ids, grads, base = rows["b"]
    bad: dict[str, tuple[torch.Tensor, torch.Tensor, int]] = {**rows, "b": (*change(ids, grads), base)}
    if block:
        bad = as_block(bad)
    if refusal is None:  # accepted, and applied as tables on their own apply it
        push(s, bad)
        push(reference, bad)
    else:  # refused, naming the table, and nothing of it applied
        with pytest.raises(InvalidRequestError, match=refusal):
            push(s, bad)
        with pytest.raises(InvalidRequestError, match=refusal):
            push(reference, bad)
    assert_same_tables(s, reference)


def test_a_push_block_of_an_arenas_tables_in_its_order_is_handled_whole_and_equals_tables_on_their_own(
        monkeypatch: pytest.MonkeyPatch, row_kernels: str) -> None:
    """A push whose RowBlock holds tables of one arena in the arena's order (all of them, or some:
    b is absent from every third push) is checked, found, made and applied as the arena's block
    (no per-table check, where the row kernels run); in another order, per table. Both give what
    tables on their own give, bit for bit, and each table keeps its own version."""
    from psgrad.server import rows_path

    checked_per_table = []
    each = rows_path._check_tables
    monkeypatch.setattr(rows_path, "_check_tables", lambda *a, **k: checked_per_table.append(1) or each(*a, **k))
    ordered, shuffled, apart = shard(), shard(), shard(apart=True)
    state = state_of(ordered)
    assert state.tables_of(("a", "b", "c"), 0).arena is not None and state.tables_of(("a", "c"), 0).arena is not None
    assert state.tables_of(("c", "a"), 0).arena is None
    assert state.tables_of(("a", "b"), 0) is state.tables_of(("a", "b"), 0)  # (kept)
    for k, rows in enumerate(pushes(7, 6)):
        push(ordered, as_block(rows))
        assert bool(checked_per_table) is (row_kernels == "torch-ops"), k  # (the torch ops check each table)
        checked_per_table.clear()
        push(shuffled, as_block(dict(reversed(list(rows.items())))))
        assert checked_per_table, k
        push(apart, rows)
        checked_per_table.clear()
    assert_same_tables(ordered, apart)
    assert_same_tables(shuffled, apart)
    assert [state.tables[n].version for n in TABLES] == [6, 4, 6]
    with pytest.raises(InvalidRequestError, match="asked for sparse table 'nope'; the job's are: 'a', 'b', 'c'"):
        state.tables_of(("a", "nope"), 0)


def test_a_read_is_checked_as_each_table_checks_it() -> None:
    s = shard()
    fingerprint = state_of(s).layout.fingerprint
    s.rows.check_reads(0, fingerprint, [("a", torch.tensor([5, 1, 3])), ("b", torch.tensor([35]))])  # any order
    for ids, refusal in ((torch.tensor([1, 37]), "row id 37 is out of range"), (torch.tensor([2]), "lives on shard 0"),
                         (torch.tensor([1.0]), "must be a 1-D int64 tensor")):
        with pytest.raises(InvalidRequestError, match=f"table 'b'.*{refusal}"):
            s.rows.check_reads(0, fingerprint, [("a", torch.tensor([1])), ("b", ids)])


def test_a_push_over_the_memory_budget_changes_no_table_of_the_arena() -> None:
    # 100 KiB: the tables' row index (24 KiB) and an arena of 1,024 rows (48 bytes each), then room
    # for ~650 rows more; a push of 3,000 new rows does not fit
    s, reference = shard(budget_mb=0.1), shard(budget_mb=0.1)
    for rows in pushes(6, 3):
        push(s, rows)
        push(reference, rows)
    g = torch.Generator().manual_seed(7)
    big = {name: (ids, torch.randn(ids.numel(), 4, generator=g), 0)
           for name, ids in (("a", torch.arange(1, 1000, 2)), ("c", torch.arange(1, 5000, 2)))}
    with pytest.raises(MemoryBudgetError, match=r"table 'a\+b\+c' growing to 3,015 rows"):
        push(s, big)
    assert_same_tables(s, reference)
    for rows in pushes(8, 2):  # and the next pushes are applied as before
        push(s, rows)
        push(reference, rows)
    assert_same_tables(s, reference)


def test_a_table_loaded_from_a_snapshot_takes_the_capacity_its_table_had_where_the_budget_holds_it() -> None:
    """A standby attached mid-run (or a server restarted from a checkpoint) lays a table's storage
    out as the table it copies: its arena's rows (1,500 stored, room for 2,048 after doubling; it
    made room for 1,500 alone before), a dynamic table's row index's places (kept after rows were
    dropped), and the arena of tables stored together; charging the budget the same. Where the
    budget cannot hold that capacity, as many rows as the snapshot has (as before); a snapshot
    that says none (an older psgrad's) loads as before."""
    from psgrad.core import rows as rows_
    from psgrad.core.optimizers.rows import RowSGD
    from psgrad.server.tables import CAPACITY, INDEX_CAPACITY, MemoryBudget, TableSnapshot

    def made(dynamic: bool, budget: MemoryBudget) -> SparseTable:
        return SparseTable("emb", rows_.DYNAMIC if dynamic else 100_000, 4, 0, 1, 7, RowSGD(0.5), budget=budget)

    for dynamic in (False, True):
        budget = MemoryBudget(None)
        t = made(dynamic, budget)
        for k in range(5):
            ids = torch.arange(300 * k, 300 * (k + 1))
            t.apply(ids, torch.ones(300, 4))
        if dynamic:
            t.remove(torch.arange(0, 1500, 2))  # (750 rows left; the index keeps its 4,096 places)
        snap = t.snapshot()
        stored = 750 if dynamic else 1500
        assert snap.scalars[CAPACITY] == 2048 and t.status("emb").capacity == 2048 and t.touched == stored
        assert snap.scalars.get(INDEX_CAPACITY) == (4096 if dynamic else None)
        copy = made(dynamic, MemoryBudget(None))
        copy.load(snap)
        assert copy.status("emb") == t.status("emb") and copy.budget.used == budget.used, dynamic
        ids = torch.arange(1500, 1500 + 2101 - stored)  # and they grow alike, past 2,048
        for table in (t, copy):
            table.apply(ids, torch.ones(ids.numel(), 4))
        assert copy.status("emb").capacity == t.status("emb").capacity == 4096 and copy.budget.used == budget.used
        tight = made(dynamic, MemoryBudget(made(dynamic, MemoryBudget(None)).budget.used
                                           + max(stored, 1024) * t.row_bytes() + (16 * 1024 if dynamic else 0)))
        tight.load(snap)  # (room for the rows, not for the capacity: loaded as before)
        assert tight.status("emb").capacity == max(stored, 1024) and tight.touched == stored
        older = made(dynamic, MemoryBudget(None))
        older.load(TableSnapshot(snap.kind, snap.tensors, {k: v for k, v in snap.scalars.items()
                                                           if k not in (CAPACITY, INDEX_CAPACITY)}))
        assert older.status("emb").capacity == max(stored, 1024) and older.touched == stored
    s = shard()  # tables stored together: the arena's capacity
    for rows in pushes(3, 120):
        push(s, rows)
    arena = state_of(s).tables["a"].arena  # type: ignore[attr-defined]
    assert arena.touched > 1024 and arena.status("x").capacity == 2048
    back = Shard(ServerConfig())
    back.restore(s.snapshot())
    assert state_of(back).tables["a"].arena.status("x").capacity == 2048  # type: ignore[attr-defined]
    assert state_of(back).budget.used == state_of(s).budget.used
