"""A sparse table's rows over their lifetime: admission (an id's updates applied once it was seen in
min_count updates, counted in a fixed-size sketch), expiry (a row no update touched in ttl updates
dropped), eviction at the memory budget (the least recently updated rows dropped instead of a
refusal); every drop reads as new again, is counted, survives a snapshot, and a standby that applies
its primary's drops and updates holds the same table."""
from __future__ import annotations

import os

import pytest
import torch

from psgrad.core import rows
from psgrad.core.optimizers.rows import RowSGD
from psgrad.errors import MemoryBudgetError
from psgrad.server.row_index import Sightings
from psgrad.server.tables import EXPIRED, MADE, SIGHTED, MemoryBudget, SparseTable

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("row_kernels")]
DIM, LR = 4, 0.5


def table(lifetime: tuple[int, int, bool] = (0, 0, False), budget: int | None = None, dynamic: bool = True) -> SparseTable:
    return SparseTable("emb", rows.DYNAMIC if dynamic else 10_000, DIM, 0, 1, seed=3, optimizer=RowSGD(LR),
                       budget=MemoryBudget(budget), lifetime=lifetime)


def initial(ids: list[int]) -> torch.Tensor:
    return rows.initial_rows(rows.table_key(3, "emb"), torch.tensor(ids), DIM)


def update(t: SparseTable, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return t.apply(torch.tensor(ids), torch.ones(len(ids), DIM))


def test_an_id_is_admitted_at_its_min_count_th_update_and_stored_ones_always_are() -> None:
    t = table((3, 0, False))
    assert update(t, [5, 7])[0].tolist() == [] and update(t, [5])[0].tolist() == []  # seen 2 and 1 times
    assert t.touched == 0 and t.dropped == 3 and torch.equal(t.rows(torch.tensor([5])), initial([5]))
    applied, _ = update(t, [5, 7])  # 5: the third sighting, admitted; 7: the second
    assert applied.tolist() == [5] and t.admitted == 1 and t.dropped == 4
    assert torch.equal(t.rows(torch.tensor([5])), initial([5]) - LR)  # only the admitting update, not the dropped two
    assert update(t, [5])[0].tolist() == [5]  # stored: every update applies
    assert t.status("emb").dropped == 4 and t.status("emb").admitted == 1


def test_rows_untouched_for_ttl_updates_expire_and_read_as_new() -> None:
    t = table((0, 8, False), dynamic=False)
    update(t, [1, 2])
    for _ in range(10):
        update(t, [3])
    assert t.expired == 2 and t.touched == 1  # 1 and 2 untouched in 10 updates: dropped; 3 kept
    assert torch.equal(t.rows(torch.tensor([1, 2])), initial([1, 2]))
    assert torch.equal(t.rows(torch.tensor([3])), initial([3]) - 10 * LR)
    update(t, [1])  # new again: from its initial value
    assert torch.equal(t.rows(torch.tensor([1])), initial([1]) - LR)


def _charged_for(n: int, dynamic: bool = True) -> int:
    """The bytes a table without a limit charged for n rows (its arena, row index)."""
    probe = table(dynamic=dynamic)
    update(probe, list(range(n)))
    used = probe.budget.used
    assert used > 0
    return used


def test_at_the_budget_the_least_recently_updated_rows_make_room() -> None:
    # room for the first arena (1,024 rows) and its index, and less than a row more: neither the
    # arena nor the index can grow
    budget = _charged_for(1024) + 16
    refusing = table(budget=budget)
    update(refusing, list(range(1024)))
    with pytest.raises(MemoryBudgetError):
        update(refusing, [5000, 5001])
    t = table((0, 0, True), budget=budget)
    for lo in range(0, 1024, 128):
        update(t, list(range(lo, lo + 128)))  # rows 0-127 updated first (oldest)
    update(t, [0, 1])  # now the most recent
    applied, _ = update(t, [2, 5000, 5001, 5002])  # three new rows: evict the 3 least recently updated others
    assert applied.tolist() == [2, 5000, 5001, 5002] and t.evicted == 3 and t.touched == 1024
    assert t.status("emb").evicted == 3
    gone = torch.tensor([3, 4, 5])  # the oldest rows but those this update and the last one touched
    assert torch.equal(t.rows(gone), initial([3, 4, 5]))
    assert torch.equal(t.rows(torch.tensor([0, 1])), initial([0, 1]) - 2 * LR)
    assert torch.equal(t.rows(torch.tensor([6, 1023])), initial([6, 1023]) - LR)


def test_a_refusal_names_what_the_rows_need_and_for_a_dynamic_table_the_options_that_bound_them() -> None:
    # Before: it named the doubling it tried first (twice what the rows need, or more) and advised
    # only "make the table smaller", which a dynamic table, growing with every new id, cannot.
    budget = _charged_for(1024) + 16  # the first arena and its index, and less than a row more
    t = table(budget=budget)
    update(t, list(range(1024)))
    needed = 2 * t.row_bytes() + t._index.growth_bytes(1026)  # two rows, and the index that holds them
    with pytest.raises(MemoryBudgetError) as refused:
        update(t, [5000, 5001])
    message = str(refused.value)
    assert f"growing to 1,026 rows on shard 0 needs {needed / 1024:.1f} KiB more" in message, message
    for option in ("now min_count=0, ttl=0, evict=False", "evict=True drops", "ttl=T", "min_count=N"):
        assert option in message, message
    for more, fits in ((needed - 1, False), (needed, True)):  # the figure is just enough
        other = table(budget=t.budget.used + more)
        update(other, list(range(1024)))
        if fits:
            assert update(other, [5000, 5001])[0].tolist() == [5000, 5001]
        else:
            with pytest.raises(MemoryBudgetError):
                update(other, [5000, 5001])
    fixed = table(budget=_charged_for(1024, dynamic=False) + 16, dynamic=False)
    update(fixed, list(range(1024)))
    with pytest.raises(MemoryBudgetError, match="or make the table smaller$"):
        update(fixed, [5000])
    evicting = table((0, 0, True), budget=budget)
    update(evicting, list(range(1024)))
    with pytest.raises(MemoryBudgetError, match=r"evicts \(evict=True\), but the rows of this update do not fit"):
        update(evicting, list(range(5000, 7000)))  # more new rows than the whole budget holds


def test_past_a_refused_doubling_the_arena_grows_to_what_the_budget_holds() -> None:
    # Before: a doubling past the budget was refused whole, so the table refused (or evicted) with
    # up to half of its budget unused.
    probe = table(dynamic=False)
    row = probe.row_bytes()
    budget = _charged_for(1024, dynamic=False) + 300 * row + row // 2  # the first arena, room for 300 rows more
    t = table(budget=budget, dynamic=False)
    update(t, list(range(1024)))
    update(t, list(range(1024, 1324)))  # doubling to 2,048 does not fit; 1,324 rows do
    assert t.touched == 1324 and t._ids.numel() == 1324 and t.evicted == 0
    with pytest.raises(MemoryBudgetError, match="growing to 1,325 rows"):
        update(t, [5000])
    e = table((0, 0, True), budget=budget, dynamic=False)
    update(e, list(range(1324)))
    update(e, [5000])  # full: now the least recently updated row makes room
    assert e.evicted == 1 and e.touched == 1324


def test_a_tables_arena_grows_in_its_reserved_storage_without_copying_and_a_dynamic_one_by_doubling() -> None:
    # A fixed-size table's arena is the start of storage reserved for every row the shard can hold:
    # growing neither moves nor copies the rows made (the budget is still charged by doubling).
    for dynamic in (False, True):
        t = table(dynamic=dynamic)
        update(t, list(range(1000)))
        before, charged, capacity = t._values.data_ptr(), t._charged, t._ids.numel()
        update(t, list(range(1000, 3000)))  # past the first arena's 1,024 rows
        assert t.touched == 3000 and t._ids.numel() > capacity and t._charged > charged
        assert (t._values.data_ptr() == before) != dynamic  # (a dynamic table has no most rows to reserve for)
        every = torch.arange(3000)
        assert torch.equal(t.rows(every), initial(list(range(3000))) - LR)
        assert torch.equal(t._ids[:3000], every)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux's /proc/self/statm")
def test_the_reserved_storage_takes_memory_only_for_the_rows_written() -> None:
    # 2M rows x 64 on this shard: ~1 GB of values and state reserved; 5,000 rows made take ~2.6 MB.
    def resident_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    t = SparseTable("big", 2_000_000, 64, 0, 1, seed=3, optimizer=RowSGD(LR), std=0.0, budget=MemoryBudget(None))
    t.apply(torch.arange(10), torch.ones(10, 64))
    before = resident_mb()
    for start in range(10, 5010, 1000):  # (growing past the first arena's 1,024 rows, and again)
        t.apply(torch.arange(start, start + 1000), torch.ones(1000, 64))
    assert t.touched == 5010 and t._room is not None and t._room["values"].shape[0] == 2_000_000
    assert resident_mb() - before < 64, resident_mb() - before


def test_a_standby_that_takes_its_primarys_drops_and_updates_holds_the_same_table_and_a_snapshot_keeps_it() -> None:
    lifetime = (2, 16, True)
    budget = (2 << 20) + 120_000  # the sketch, and room for the arena to grow to ~1,700 rows (not 2,048): all three drops
    primary, standby = table(lifetime, budget=budget), table(lifetime)
    g = torch.Generator().manual_seed(0)
    for _ in range(120):
        ids = torch.unique(torch.randint(0, 3000, (200,), generator=g))
        applied, grads = primary.apply(ids, torch.randn(ids.numel(), DIM, generator=g))
        for what, changed in primary.take_lifetime():  # (as a replica record carries them: replica_path)
            if what == SIGHTED:
                standby.sight(changed)
            elif what == MADE:
                standby.make(changed)
            else:
                standby.remove(changed, expired=what == EXPIRED)
        standby.apply(applied, grads, replicated=True)
    assert primary.dropped and primary.expired and primary.evicted, (primary.dropped, primary.expired, primary.evicted)
    every = torch.arange(3000)
    assert torch.equal(primary.rows(every), standby.rows(every)) and primary.touched == standby.touched
    # its admission counts and counters too: a standby that takes over admits, and counts, as the primary would
    assert standby.sightings is not None and primary.sightings is not None
    assert torch.equal(standby.sightings.counts, primary.sightings.counts)
    assert (standby.admitted, standby.expired, standby.evicted, standby.dropped) == (
        primary.admitted, primary.expired, primary.evicted, primary.dropped)
    mine, its = primary.snapshot().tensors, standby.snapshot().tensors  # laid out alike: eviction's ties fall alike
    assert mine.keys() == its.keys() and all(torch.equal(mine[k], its[k]) for k in mine)
    snap = primary.snapshot()
    back = table(lifetime, budget=budget)
    back.load(snap)
    assert torch.equal(back.rows(every), primary.rows(every))
    assert (back.admitted, back.expired, back.evicted, back.dropped) == (primary.admitted, primary.expired,
                                                                         primary.evicted, primary.dropped)
    assert back.sightings is not None and primary.sightings is not None
    assert torch.equal(back.sightings.counts, primary.sightings.counts)


def test_sightings_are_never_undercounted_and_saturate() -> None:
    s = Sightings()
    ids = torch.arange(0, 200_000, dtype=torch.int64) * 7919
    for k in range(1, 4):
        assert bool((s.add(ids) >= k).all())
    assert s.nbytes == 2 << 20
    few = torch.tensor([11, 12])
    for _ in range(300):
        s.add(few)
    assert s.count(few).tolist() == [255, 255]


def test_a_min_count_past_what_the_sightings_count_is_refused_where_a_table_is_declared() -> None:
    """The sketch saturates at MIN_COUNT_MAX: a larger min_count admitted nothing, silently (every
    update of a new id counted as dropped). The modules, the collection and the job's table
    description refuse it, naming the limit; the limit itself is accepted."""
    import psgrad
    from psgrad.core.sharding import MIN_COUNT_MAX, TableSpec
    from psgrad.errors import ConfigError

    assert MIN_COUNT_MAX == 255 and Sightings().counts.dtype == torch.uint8  # (the limit is the counters')
    for make in (lambda k: psgrad.Embedding(None, 4, min_count=k), lambda k: psgrad.EmbeddingBag(None, 4, min_count=k),
                 lambda k: psgrad.EmbeddingBagCollection({"a": (None, 4)}, min_count=k),
                 lambda k: TableSpec("t", 0, 4, min_count=k)):
        make(MIN_COUNT_MAX)
        with pytest.raises(ConfigError, match=f"min_count={MIN_COUNT_MAX + 1}: the servers count at most 255"):
            make(MIN_COUNT_MAX + 1)
