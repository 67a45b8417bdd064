"""Sparse tables on a shard: rows placed by id, read as their initial values from (seed, table, row id)
(the same after any restart) and stored at their first update, updated row by row with row-wise SGD, Adagrad and lazy Adam (checked against
torch), refused by name when ids are wrong, and carried whole through snapshots and checkpoints."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from psgrad.config import JobSpec, ServerConfig
from psgrad.core import rows
from psgrad.core.optimizers.rows import RowAdagrad, RowAdam, RowSGD, make_row_optimizer
from psgrad.errors import ConfigError, InvalidRequestError
from psgrad.server import checkpoint
from psgrad.server.shard import Shard
from psgrad.server.tables import SparseTable
from test_shard import make_layout, weights_for

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("row_kernels")]


def table(optimizer=None, num_embeddings: int = 1000, dim: int = 4, index: int = 0, shards: int = 1) -> SparseTable:  # type: ignore[no-untyped-def]
    return SparseTable("emb", num_embeddings, dim, index, shards, seed=7, optimizer=optimizer or RowSGD(0.5))


def test_placement_spreads_consecutive_hot_ids_and_covers_every_row_once() -> None:
    ids = torch.arange(10)
    assert rows.shard_of(ids, 3).tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]
    assert rows.local_index(ids, 3).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    assert [rows.rows_on_shard(10, i, 3) for i in range(3)] == [4, 3, 3]
    assert sum(rows.rows_on_shard(10_000_019, i, 7) for i in range(7)) == 10_000_019


@pytest.mark.parametrize("dynamic", [(False, False, False), (True, True, True), (False, True, False)],
                         ids=["fixed", "dynamic", "mixed"])
def test_tables_placed_together_give_each_shard_each_tables_ids_in_their_order(dynamic: tuple[bool, ...]) -> None:
    tables = [torch.tensor([2, 5, 7, 8, 11, 12, 20, 31]), torch.tensor([0, 3, 4, 9]), torch.tensor([1, 6, 8, 13, 14])]
    place = rows.TablesOnShards(tables, 3, dynamic)
    grads = [torch.arange(t.numel() * 2, dtype=torch.float32).view(-1, 2) + 100 * k for k, t in enumerate(tables)]
    ids_on, grads_on = place.by_shard(torch.cat(tables)), place.by_shard(torch.cat(grads))
    starts = [0, 8, 12]
    for i in range(3):
        positions = place.positions(i)
        assert positions is not None
        expect_positions = []
        expect_ids: list[int] = []
        expect_grads = []
        for t, (ids, hashed) in enumerate(zip(tables, dynamic)):
            mine = (rows.shard_of(ids, 3, hashed) == i).nonzero().squeeze(1)  # exactly shard i's, in order
            assert place.counts[i][t] == mine.numel()
            expect_ids += ids[mine].tolist()
            expect_grads.append(grads[t][mine])
            expect_positions += (mine + starts[t]).tolist()
        assert positions.tolist() == expect_positions
        assert ids_on[i].tolist() == expect_ids  # (its tables' one after another, each in its order)
        assert place.ids_by_shard()[i].tolist() == expect_ids and place.ids_by_shard()[i].dtype == torch.int64
        assert torch.equal(grads_on[i], torch.cat(expect_grads))
    one = rows.TablesOnShards(tables, 1, dynamic)
    assert one.positions(0) is None and one.counts == [[8, 4, 5]]
    assert [shard.tolist() for shard in one.by_shard(torch.cat(tables))] == [torch.cat(tables).tolist()]
    assert [shard.tolist() for shard in one.ids_by_shard()] == [torch.cat(tables).tolist()]
    assert rows.TablesOnShards([t.int() for t in tables], 3, dynamic).ids_by_shard()[0].dtype == torch.int64
    empty = rows.TablesOnShards([torch.tensor([3, 6, 9])], 3, [False])
    assert empty.counts == [[3], [0], [0]]  # (empty shards too)


def test_an_update_in_any_order_lays_its_rows_out_as_a_standby_applying_its_record_does() -> None:
    primary, standby = table(), table()
    ids, grads = torch.tensor([9, 3, 6]), torch.ones(3, 4)  # unique, not sorted (a worker sends them sorted)
    primary.apply(ids, grads)
    standby.apply(ids, grads, replicated=True)
    a, b = primary.snapshot().tensors, standby.snapshot().tensors
    assert a["ids"].tolist() == b["ids"].tolist() == [3, 6, 9]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_rows_read_as_their_initial_values_deterministically_and_only_an_update_stores_one() -> None:
    t = table(num_embeddings=10_000_000, dim=32)  # 1.28 GB if it were dense
    assert t.status("emb").rows_touched == 0 and t.status("emb").nbytes == 0
    ids = torch.tensor([3, 9_999_999, 42])
    values, versions = t.pull(ids)
    assert values.shape == (3, 32) and versions.tolist() == [0, 0, 0]
    assert torch.equal(t.rows(ids), values)
    assert t.status("emb").rows_touched == 0 and t.status("emb").nbytes == 0  # a read stores nothing
    t.apply(torch.tensor([42]), torch.ones(1, 32))  # an update stores its row (SGD lr 0.5)
    assert t.status("emb").rows_touched == 1 and t.status("emb").nbytes == 32 * 4
    mixed, versions = t.pull(ids)  # stored and computed rows in one read
    assert versions.tolist() == [0, 0, 1] and torch.equal(mixed[:2], values[:2])
    assert torch.equal(mixed[2], values[2] - 0.5)
    again = table(num_embeddings=10_000_000, dim=32).pull(torch.tensor([42, 3]))[0]  # another server, any order
    assert torch.equal(again, values[[2, 0]])
    other = SparseTable("other", 10_000_000, 32, 0, 1, seed=7, optimizer=RowSGD(0.5)).pull(ids)[0]
    assert not torch.equal(other, values)  # each table its own values
    big = table(num_embeddings=100_000, dim=16).pull(torch.arange(100_000))[0]
    assert abs(float(big.mean())) < 0.01 and abs(float(big.std()) - 1.0) < 0.01  # N(0, 1), like nn.Embedding


def test_rows_that_start_at_zero_read_as_plain_zeros() -> None:
    # std 0: no draws are made (they were, and multiplied by zero: a fifth of a recommender shard's
    # CPU, benchmarks/dlrm.py), and no row reads as -0.0 (a negative draw times zero did).
    ids = torch.tensor([3, 9_999_999, 42, 7])
    t = SparseTable("emb", 10_000_000, 32, 0, 1, seed=3, optimizer=RowSGD(0.5), std=0.0)
    for values in (t.rows(ids), rows.initial_rows(t.key, ids, 32, 0.0)):
        assert torch.equal(values, torch.zeros(4, 32)) and not bool(torch.signbit(values).any())
    t.apply(torch.tensor([42]), torch.ones(1, 32))
    assert torch.equal(t.rows(ids)[2], torch.full((32,), -0.5)) and torch.equal(t.rows(ids)[[0, 1, 3]], torch.zeros(3, 32))
    assert not bool(torch.signbit(t.rows(ids)[[0, 1, 3]]).any())  # (rows never stored, beside a stored one)


@pytest.mark.parametrize("name", ["sgd", "adagrad"])
def test_row_wise_updates_equal_torch_on_the_dense_table(name: str) -> None:
    """A dense table updated by torch's SGD / Adagrad with zero gradients on untouched rows is bit
    for bit the sparse table updated row by row (neither moves a row it has no gradient for)."""
    num, dim = 50, 3
    sparse = table(RowSGD(0.1) if name == "sgd" else RowAdagrad(0.1, 0.1, 1e-10), num, dim)
    weight = torch.nn.Parameter(sparse.pull(torch.arange(num))[0].clone())
    ref = torch.optim.SGD([weight], lr=0.1) if name == "sgd" else torch.optim.Adagrad(
        [weight], lr=0.1, initial_accumulator_value=0.1, eps=1e-10)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        ids = torch.randperm(num, generator=gen)[:7]
        grads = torch.randn(7, dim, generator=gen)
        sparse.apply(ids, grads)
        weight.grad = torch.zeros(num, dim).index_add_(0, ids, grads)
        ref.step()
    assert torch.equal(sparse.pull(torch.arange(num))[0], weight.detach())


def test_lazy_adam_counts_each_rows_own_steps() -> None:
    t = table(RowAdam(0.01), 10, 2)
    start = t.pull(torch.arange(10))[0]
    for _ in range(3):
        t.apply(torch.tensor([1]), torch.ones(1, 2))
    t.apply(torch.tensor([1, 5]), torch.ones(2, 2))
    after = t.pull(torch.arange(10))[0]
    # Adam's first step moves a row by lr (m/(1-b1) = g, sqrt(v/(1-b2)) = |g|): row 5 took one step,
    # row 1 four with the same gradient (each also lr), the others none.
    assert torch.allclose(after[5], start[5] - 0.01, atol=1e-6)
    assert torch.allclose(after[1], start[1] - 0.04, atol=1e-5)
    assert torch.equal(after[[0, 2, 3, 4, 6, 7, 8, 9]], start[[0, 2, 3, 4, 6, 7, 8, 9]])
    assert t.pull(torch.tensor([1, 5, 0]))[1].tolist() == [4, 4, 0]  # the table version of each row's last update


def test_bad_ids_and_gradients_are_refused_by_name() -> None:
    t = table(num_embeddings=100, index=1, shards=2)
    with pytest.raises(InvalidRequestError, match="row id 100 is out of range \\[0, 100\\)"):
        t.pull(torch.tensor([1, 100]))
    with pytest.raises(InvalidRequestError, match="row id -1 is out of range"):
        t.pull(torch.tensor([-1]))
    with pytest.raises(InvalidRequestError, match="row ids must be a 1-D int64 tensor, got torch.float32"):
        t.pull(torch.tensor([1.0]))
    with pytest.raises(InvalidRequestError, match="row 4 lives on shard 0, not on shard 1"):
        t.pull(torch.tensor([3, 4]))
    with pytest.raises(InvalidRequestError, match="must be unique"):
        t.apply(torch.tensor([3, 3]), torch.zeros(2, 4))
    with pytest.raises(InvalidRequestError, match="gradients must be float32 \\[1, 4\\]"):
        t.apply(torch.tensor([3]), torch.zeros(1, 5))
    assert t.status("emb").rows_touched == 0  # nothing was made by a refused call
    with pytest.raises(ConfigError, match="no row-wise form for sparse tables \\(its running averages decay .*\\); rows take sgd, adam, adagrad: name one for the tables in a param group of their own"):
        make_row_optimizer("rmsprop", JobSpec())


def test_a_shard_with_a_sparse_table_checkpoints_and_restores_it_exactly(tmp_path: Path) -> None:
    layout = make_layout(JobSpec(optimizer="adagrad", lr=0.1, num_shards=2, num_workers=1), index=1)
    shard = Shard(ServerConfig())
    shard.initialize(0, layout, weights_for(layout))
    state = shard.core.state
    assert state is not None
    emb = state.add_sparse_table("emb", 4_000_001, 8, seed=3)
    ids = torch.tensor([1, 3, 4_000_001 - 2, 77])
    emb.apply(ids, torch.randn(4, 8))
    status = {t.name: t for t in shard.status().tables}
    assert status["emb"].kind == "sparse" and status["emb"].rows == 2_000_000 and status["emb"].rows_touched == 4
    assert status["emb"].state_bytes == 4 * 8 * 4  # Adagrad's sums of the touched rows
    path = checkpoint.save(shard.snapshot(), tmp_path)
    restored = Shard(ServerConfig())
    restored.restore(checkpoint.load(path))
    back = restored.core.state.tables["emb"]  # type: ignore[union-attr]
    assert isinstance(back, SparseTable) and back.version == 1 and back.touched == 4
    probe = torch.tensor([77, 1, 5])  # two updated rows and one never touched
    assert torch.equal(back.pull(probe)[0], emb.pull(probe)[0])
    grads = torch.randn(2, 8)
    emb.apply(torch.tensor([3, 9]), grads)
    back.apply(torch.tensor([3, 9]), grads)  # the optimizer state came back too
    assert torch.equal(back.pull(torch.tensor([3, 9]))[0], emb.pull(torch.tensor([3, 9]))[0])


def _plain_splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _textbook_initial_rows(key: int, ids: torch.Tensor, dim: int, std: float) -> torch.Tensor:
    """The initial values' formula as written down plainly: value (id, j) of a table is std times
    Box-Muller's first normal of two splitmix64 draws from the counter id * dim + j, keyed (numpy's
    log and cos: a library's, whose last bits may differ from machine to machine)."""
    with np.errstate(over="ignore"):
        counter = ids.numpy().astype(np.uint64)[:, None] * np.uint64(dim) + np.arange(dim, dtype=np.uint64)
        a = _plain_splitmix64(counter ^ np.uint64(key))
        b = _plain_splitmix64(a)
    u1 = ((a >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0**-53
    u2 = (b >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return torch.from_numpy((np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2) * std).astype(np.float32))


@pytest.mark.parametrize("dim, std", [(1, 1.0), (32, 0.01), (64, 2.5)])
def test_initial_rows_are_the_textbook_formulas_values(dim: int, std: float) -> None:
    """The generator's own arithmetic (+, -, *, /, sqrt; no library log or cos) gives the float32s
    the textbook formula gives: all of them here, and never more than one float32 step apart (the
    rare value whose double lies within a few units of a float32 rounding boundary may round the
    other way). Rows never stored read the same in every release but in those rare values."""
    ids = torch.from_numpy(np.random.default_rng(dim).integers(0, 2**40, 20_000))
    key = rows.table_key(7, "t")
    ours, textbook = rows.initial_rows(key, ids, dim, std).numpy(), _textbook_initial_rows(key, ids, dim, std).numpy()
    steps = np.abs(ours.view(np.int32).astype(np.int64) - textbook.view(np.int32).astype(np.int64))
    assert steps.max() <= 1 and np.count_nonzero(steps) <= ours.size // 100_000, (steps.max(), np.count_nonzero(steps))
    x = np.arange(1_000, dtype=np.uint64) * np.uint64(0x1234567)
    assert np.array_equal(rows.splitmix64(x), _plain_splitmix64(x))


def test_the_generators_normal_is_within_two_units_of_the_exact_one() -> None:
    """Each value against Box-Muller computed exactly (mpmath, 40 digits), for random draws and the
    edges: u1 = 2^-53 and 1, u2 at every quarter turn and next to it."""
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 40
    rng = np.random.default_rng(3)
    a, b = rng.integers(0, 2**64, 600, dtype=np.uint64), rng.integers(0, 2**64, 600, dtype=np.uint64)
    edges_a = [0, 2**64 - 1, 1 << 63, (2**53 - 2) << 11, 1 << 11, 3 << 11]
    edges_b = [0, 2**64 - 1, 1 << 61, 1 << 62, 3 << 61, (1 << 61) - (1 << 11), (1 << 50) << 11, ((1 << 50) - 1) << 11]
    a[:len(edges_a)], b[:len(edges_b)] = edges_a, edges_b
    z = rows.normal(a.copy(), b.copy())
    for i in range(a.size):
        u1 = (mpmath.mpf(int(a[i] >> np.uint64(11))) + 1) * mpmath.mpf(2) ** -53
        u2 = mpmath.mpf(int(b[i] >> np.uint64(11))) * mpmath.mpf(2) ** -53
        radius = mpmath.sqrt(-2 * mpmath.log(u1))
        exact = radius * mpmath.cos(2 * mpmath.pi * u2)
        # (an error of each factor within a few units in its last place: of radius * cos)
        assert abs(mpmath.mpf(float(z[i])) - exact) <= 4 * 2.0**-53 * max(radius, mpmath.mpf(2) ** -60), (i, a[i], b[i])


def test_the_generator_gives_the_same_values_in_chunks_of_any_size(monkeypatch: pytest.MonkeyPatch) -> None:
    ids = torch.arange(-50, 1_000)
    key = rows.table_key(1, "t")
    whole = rows.initial_rows(key, ids, 9)
    monkeypatch.setattr(rows, "_CHUNK", 7)
    assert rows.initial_rows(key, ids, 9).numpy().tobytes() == whole.numpy().tobytes()


def test_initial_rows_of_several_tables_at_once_are_each_tables_own() -> None:
    ids = torch.tensor([4, 0, 9, 4, 7, 2])
    tables = [(rows.table_key(3, "a"), 1.0), (rows.table_key(3, "b"), 0.0), (rows.table_key(3, "c"), 0.25)]
    which = np.array([0, 1, 2, 2, 0, 1])
    keys = np.array([k for k, _ in tables], dtype=np.uint64)[which]
    stds = np.array([s for _, s in tables])[which]
    together = rows.initial_rows(keys, ids, 5, stds)
    for i, t in enumerate(which):
        key, std = tables[t]
        alone = rows.initial_rows(key, ids[i:i + 1], 5, std)[0]
        assert together[i].numpy().tobytes() == alone.numpy().tobytes()  # (bit for bit, +0.0 where std is 0)


@pytest.mark.parametrize("kind", ["fixed", "dynamic", "arena"])
def test_rows_a_read_drew_are_made_from_it_not_drawn_again(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row never stored is drawn when read; the update that makes it next takes the read's values
    (the same bits as drawn afresh) and draws only the rows no recent read reached."""
    from psgrad.server import table_groups, tables

    drawn: list[int] = []
    plain = rows.initial_rows

    def counting(key, ids, dim, std=1.0):  # type: ignore[no-untyped-def]
        drawn.append(ids.numel())
        return plain(key, ids, dim, std)

    def make() -> SparseTable:
        if kind == "arena":
            arena = table_groups.RowArena(4, 0, 1, RowSGD(0.5), tables.MemoryBudget(None), 1.0)
            table_groups.GroupedTable("other", 50, 4, 0, 1, 7, 0.5, arena)
            return table_groups.GroupedTable("emb", 1000, 4, 0, 1, 7, 1.0, arena)
        return SparseTable("emb", rows.DYNAMIC if kind == "dynamic" else 1000, 4, 0, 1, seed=7, optimizer=RowSGD(0.5))

    read, pushed = torch.tensor([9, 3, 500, 41]), torch.tensor([3, 9, 41, 77])  # 77: read by nobody
    grads = torch.ones(4, 4)
    fresh = make()
    fresh.apply(pushed, grads)  # no read before: every row drawn when made
    monkeypatch.setattr(rows, "initial_rows", counting)
    t = make()
    before = t.rows(read)
    t.apply(pushed, grads)
    assert drawn == [4, 1]  # the read's four rows, then only row 77
    assert torch.equal(t.rows(pushed), fresh.rows(pushed))  # bit for bit what drawing afresh made
    assert torch.equal(t.rows(torch.tensor([500])), before[2:3])
    for k in range(3 * tables.DRAWN_READS):  # what it keeps stays bounded
        t.rows(torch.arange(100 + 50 * k, 140 + 50 * k))
    keeper = t.arena if kind == "arena" else t  # type: ignore[attr-defined]
    assert 0 < len(keeper._drawn) <= tables.DRAWN_READS
    assert sum(v.numel() * 4 for _, v in keeper._drawn) <= tables.DRAWN_BYTES
    kept = list(keeper._drawn)
    monkeypatch.setattr(tables, "DRAWN_BYTES", 4 * 4 * 30)  # room for 30 rows of 4
    t.rows(torch.arange(600, 640))  # 40 rows drawn: more than is kept, and nothing it kept is lost for it
    assert len(keeper._drawn) == len(kept) and all(a is b for a, b in zip(keeper._drawn, kept))


def test_a_tables_row_index_is_charged_to_the_budget_before_it_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    """(The index, 8 bytes a row, was allocated first: a table far past --memory-budget-mb took its
    memory, and one past the machine's failed with the allocator's error.) Past the budget, nothing
    is allocated; past what the server can allocate, a MemoryBudgetError says what to do."""
    from psgrad.errors import MemoryBudgetError
    from psgrad.server import row_index, tables

    made: list[int] = []
    real = row_index.DenseIndex.__init__

    def spy(self: row_index.DenseIndex, num_embeddings: int, index: int, num_shards: int) -> None:
        made.append(num_embeddings)
        real(self, num_embeddings, index, num_shards)

    monkeypatch.setattr(row_index.DenseIndex, "__init__", spy)
    budget = tables.MemoryBudget(1 << 20)
    with pytest.raises(MemoryBudgetError, match=r"the row index of table 't' \(1,000,000 rows on shard 0\) needs 7.6 MiB"):
        SparseTable("t", 1_000_000, 4, 0, 1, 0, RowSGD(0.1), budget=budget)
    assert made == [] and budget.used == 0
    with pytest.raises(MemoryBudgetError, match="which this server cannot allocate: give the table fewer rows, more "
                                                "servers, or make it dynamic"):
        SparseTable("t", 10**13, 4, 0, 1, 0, RowSGD(0.1), budget=tables.MemoryBudget(None))
    SparseTable("t", 1000, 4, 0, 1, 0, RowSGD(0.1), budget=budget)
    assert made == [10**13, 1000] and budget.used == 8000
