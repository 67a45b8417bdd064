"""A sync job's dynamic table that evicts at the memory budget (evict=True), through the shard's push
path: the rows an iteration makes and evicts depend on its gradients alone (the union of its
workers' ids), never on the order their pushes arrive in, so two runs of the same job hold the same
table, bit for bit, and a standby that takes the primary's records holds it laid out the same; a
push whose iteration's rows would not fit even with eviction is refused before anything of it is
applied."""
from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from psgrad.config import JobSpec, ServerConfig
from psgrad.core import rows
from psgrad.core.codecs import WireBuffer
from psgrad.core.sharding import ParamSpec, TableSpec, fingerprint, plan_shards
from psgrad.errors import MemoryBudgetError
from psgrad.server.shard import Layout, PushResult, Shard
from psgrad.server.state import ShardState
from psgrad.server.tables import EVICTED, EXPIRED, MADE, SIGHTED, SparseTable

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("row_kernels")]

PARAMS = (ParamSpec("head.weight", (2, 3), "float32"),)
DIM = 4
Rows = dict[str, tuple[torch.Tensor, torch.Tensor, int]]


def layout() -> Layout:
    spec = JobSpec(mode="sync", num_workers=2, optimizer="adagrad", lr=0.1)
    start, end = plan_shards(PARAMS, 1).ranges[0]
    return Layout(spec, PARAMS, 0, start, end, fingerprint(PARAMS, spec))


def sync_shard(budget: int | None) -> Shard:
    """A shard of a sync job of two workers with dynamic table "emb" (evict=True), under a budget of
    `budget` bytes (None: none)."""
    lay = layout()
    s = Shard(ServerConfig(memory_budget_mb=0 if budget is None else budget / 2**20))
    s.initialize(0, lay, torch.zeros(lay.numel))
    s.join(1, lay)
    state_of(s).add_sparse_tables([("emb", rows.DYNAMIC, DIM, 3, 1.0, TableSpec("emb", rows.DYNAMIC, DIM, seed=3,
                                                                                evict=True))])
    return s


def state_of(s: Shard) -> ShardState:
    assert s.core.state is not None
    return s.core.state


def table_of(s: Shard) -> SparseTable:
    return state_of(s).sparse("emb", -1)


def budget() -> int:
    """The bytes the table holds with 1,024 rows stored, and less than a row more: past 1,024 rows
    neither its arena nor its row index can grow, so new rows evict."""
    probe = sync_shard(None)
    table_of(probe).apply(torch.arange(1024) * 7919 + 11, torch.zeros(1024, DIM))
    return state_of(probe).budget.used + 24


def start_push(s: Shard, rank: int, clock: int, rows_: Rows) -> tuple[torch.Tensor, WireBuffer, torch.Tensor]:
    """A push's header, then its (zero) dense gradient received: what apply_push takes."""
    lay = state_of(s).layout
    grad = torch.zeros(lay.numel)
    buf, wire, writer = s.push_target(rank, clock, s.version, grad.numel(), "float32", lay.fingerprint, rows=rows_)
    writer.write(WireBuffer(grad.numel(), "float32").encode(grad))
    writer.finish()
    return buf, wire, grad


def push(s: Shard, rank: int, clock: int, rows_: Rows) -> PushResult:
    buf, wire, _ = start_push(s, rank, clock, rows_)
    return s.apply_push(rank, clock, s.version, buf, wire, wire.nbytes)


def iterations(count: int) -> list[tuple[Rows, Rows]]:
    """Each worker's row gradients of `count` iterations: ~120 distinct ids each of 3,000 (shared
    hot ids, and a long tail), sorted as workers send them."""
    g = torch.Generator().manual_seed(5)
    vocab = torch.randint(-2**62, 2**62, (3000,), generator=g)
    out = []
    for step in range(count):
        pair = []
        for _ in range(2):
            ids = torch.unique(vocab[(torch.rand(160, generator=g) ** 2 * 3000).long()])
            pair.append({"emb": (ids, torch.randn(ids.numel(), DIM, generator=g), step)})
        out.append((pair[0], pair[1]))
    return out


def run(order: Sequence[Sequence[int]], budget: int) -> tuple[Shard, list[tuple[str, torch.Tensor]]]:
    """The iterations with pushes arriving in order[step] (ranks); returns the shard and the
    records its replica was told (("removed" | "applied", ids), in order)."""
    s = sync_shard(budget)
    told: list[tuple[str, torch.Tensor]] = []
    s.replica.rows_lifetime = lambda table, what, ids: told.append((what, ids.clone()))  # type: ignore[method-assign]
    s.replica.rows_applied = lambda table, ids, grads, base, lr: told.append(("applied", ids.clone()))  # type: ignore[method-assign]
    for step, pair in enumerate(iterations(len(order))):
        for rank in order[step]:
            push(s, rank, step, pair[rank])
        assert s.version == step + 1
    return s, told


def assert_same_table(a: SparseTable, b: SparseTable) -> None:
    """The same rows in the same slots, with the same versions, optimizer state and counts."""
    sa, sb = a.snapshot(), b.snapshot()
    assert sa.scalars == sb.scalars
    assert sa.tensors.keys() == sb.tensors.keys()
    for key in sa.tensors:
        assert torch.equal(sa.tensors[key], sb.tensors[key]), key


def test_an_iterations_rows_and_evictions_do_not_depend_on_the_order_its_pushes_arrive_in() -> None:
    steps, limit = 14, budget()
    first, told_first = run([(0, 1)] * steps, limit)
    second, told_second = run([(1, 0)] * steps, limit)
    mixed, told_mixed = run([(0, 1) if step % 3 else (1, 0) for step in range(steps)], limit)
    t = table_of(first)
    assert t.evicted > 200 and t.touched == 1024, (t.evicted, t.touched)  # many evictions, among rows of equal versions
    for other, told in ((second, told_second), (mixed, told_mixed)):
        assert_same_table(table_of(other), t)
        assert [kind for kind, _ in told] == [kind for kind, _ in told_first]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(told, told_first))
    # a standby that takes the records (what the row lifetime did, then the updates, in order) holds
    # the table laid out the same (the gradients do not matter here: what is compared is which rows
    # it holds, in which slots)
    standby = table_of(sync_shard(None))
    for kind, ids in told_first:
        if kind == SIGHTED:
            standby.sight(ids)
        elif kind == MADE:
            standby.make(ids)
        elif kind in (EVICTED, EXPIRED):
            standby.remove(ids, expired=kind == EXPIRED)
        else:
            standby.apply(ids, torch.zeros(ids.numel(), DIM), replicated=True)
    assert standby.touched == t.touched
    assert torch.equal(standby.snapshot().tensors["ids"], t.snapshot().tensors["ids"])


def test_a_sync_push_whose_iterations_rows_would_not_fit_is_refused_and_changes_nothing() -> None:
    limit = budget()
    s, reference = sync_shard(limit), sync_shard(limit)
    for shard in (s, reference):
        for step, pair in enumerate(iterations(3)):
            push(shard, 0, step, pair[0])
            push(shard, 1, step, pair[1])
    g = torch.Generator().manual_seed(9)
    half = torch.unique(torch.randint(-2**62, 2**62, (700,), generator=g))
    other = torch.unique(torch.randint(-2**62, 2**62, (700,), generator=g))
    rows0 = {"emb": (half, torch.randn(half.numel(), DIM, generator=g), 3)}
    rows1 = {"emb": (other, torch.randn(other.numel(), DIM, generator=g), 3)}
    for shard in (s, reference):
        push(shard, 0, 3, rows0)  # 700 new rows: they fit, with rows evicted, once the iteration is applied
    assert_same_table(table_of(s), table_of(reference))  # (buffered: nothing made yet)
    with pytest.raises(MemoryBudgetError, match="do not fit even with every row it does not touch dropped"):
        push(s, 1, 3, rows1)  # with worker 0's, 1,400 new rows: more than the table holds
    buf, wire, _ = start_push(s, 1, 3, {"emb": (other[:300], rows1["emb"][1][:300], 3)})
    # refused as it is applied, where the header was checked before worker 0's was buffered
    late = sync_shard(limit)
    for step, pair in enumerate(iterations(3)):
        push(late, 0, step, pair[0])
        push(late, 1, step, pair[1])
    lbuf, lwire, _ = start_push(late, 1, 3, rows1)
    push(late, 0, 3, rows0)
    with pytest.raises(MemoryBudgetError, match="do not fit"):
        late.apply_push(1, 3, late.version, lbuf, lwire, lwire.nbytes)
    assert_same_table(table_of(late), table_of(reference))
    assert late.version == 3
    # the refused workers push fewer rows: the iterations complete, the same on both shards
    s.apply_push(1, 3, s.version, buf, wire, wire.nbytes)
    push(late, 1, 3, {"emb": (other[:300], rows1["emb"][1][:300], 3)})
    assert s.version == late.version == 4
    assert_same_table(table_of(s), table_of(late))
    assert table_of(s).evicted > 0
