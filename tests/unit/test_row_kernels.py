"""The row kernels (server/kernels.py, compiled from server/_row_kernels.py): each row rule's fused
form gives its torch ops' rows, state and versions bit for bit; locate checks ids as the tables'
checks do and finds the same slots as the index; gather reads what the table reads; and a process
whose calls are all small never compiles them. The tables' own tests run both ways (the
row_kernels fixture)."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from conftest import run_python
from psgrad.core.optimizers.rows import RowAdagrad, RowAdam, RowSGD
from psgrad.server import aggregation, kernels, rows_path
from psgrad.server.row_index import DenseIndex
from psgrad.wire.rows import tensor_from_bytes

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def k(monkeypatch: pytest.MonkeyPatch) -> kernels.RowKernels:
    monkeypatch.delenv(kernels.ENV, raising=False)
    compiled = kernels.rows(wait=True)
    assert compiled is not None, "numba is a dependency: the row kernels must compile and agree with torch's ops"
    return compiled


RULES = {"sgd": lambda: RowSGD(0.05), "adagrad": lambda: RowAdagrad(0.05, 0.1, 1e-10),
         "adagrad-decay": lambda: RowAdagrad(0.2, 0.0, 1e-6, lr_decay=0.05)}


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("n,dim", [(1, 1), (5, 3), (64, 32), (257, 13), (1000, 64)])
def test_a_fused_rule_is_its_torch_ops_bit_for_bit(k: kernels.RowKernels, rule: str, n: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(n * 100 + dim)
    opt = RULES[rule]()
    values = torch.randn(3 * n, dim, generator=gen)
    state = {name: t.uniform_(0, 3, generator=gen) for name, t in opt.new_state(3 * n, dim).items()}
    expect_values, expect_state = values.clone(), {name: t.clone() for name, t in state.items()}
    versions = torch.zeros(3 * n, dtype=torch.int64)
    for step in (1, 2, 7):  # (Adagrad's lr_decay counts the step)
        slots = torch.randperm(3 * n, generator=gen)[:n]
        grads = torch.randn(n, dim, generator=gen) * 10.0 ** float(torch.randint(-6, 4, (), generator=gen))
        grads[0, 0] = 0.0
        opt.apply_at(expect_values, expect_state, slots, grads, 0.03, step)
        form = opt.fused(0.03, step)
        assert form is not None
        assert k.apply(form, values, state, slots, grads, versions, torch.full((n,), step)) is True
        assert kernels._same_bits(values, expect_values)
        assert all(kernels._same_bits(state[name], expect_state[name]) for name in state)
        assert torch.equal(versions[slots], torch.full((n,), step))


@pytest.mark.parametrize("dim", [1, 16, 17, 33])
def test_an_updates_first_pass_reads_a_value_of_each_line_of_the_rows_named(k: kernels.RowKernels, dim: int) -> None:
    """The pass that fetches an update's rows before its arithmetic (_touched): one value every 16
    (a 64-byte line) of each named row of values and of state, and each one's version, summed;
    nothing written, no row read but those named."""
    values = torch.arange(40 * dim, dtype=torch.float32).view(40, dim) % 7
    state = torch.full((40, dim), 0.5)
    versions = torch.arange(40, dtype=torch.int64)
    slots = torch.tensor([3, 31, 0, 17])
    before = (values.clone(), state.clone(), versions.clone())
    got = k._k["touched"](values.numpy(), state.numpy(), slots.numpy(), versions.numpy())
    expect = float(values[slots][:, ::16].sum() + state[slots][:, ::16].sum() + versions[slots].sum())
    assert got == pytest.approx(expect)
    assert all(torch.equal(a, b) for a, b in zip(before, (values, state, versions)))


def test_a_requests_bytes_are_read_in_place_and_left_as_they_were(k: kernels.RowKernels) -> None:
    """Row gradients are a view of a request's bytes (wire/rows.py): the kernels read them there,
    as the rule does, and change none of them."""
    raw = (torch.arange(12, dtype=torch.float32) / 7).numpy().tobytes()
    grads = tensor_from_bytes(raw, torch.float32, "test").view(3, 4)
    values, versions, slots = torch.ones(5, 4), torch.zeros(5, dtype=torch.int64), torch.tensor([4, 0, 2])
    expect = values.clone()
    RowSGD(0.5).apply_at(expect, {}, slots, grads, 0.5, 1)
    assert k.apply(("sgd", -0.5, 0.0), values, {}, slots, grads, versions, torch.tensor([3, 3, 3])) is True
    assert torch.equal(values, expect) and versions.tolist() == [3, 0, 3, 0, 3]
    assert raw == (torch.arange(12, dtype=torch.float32) / 7).numpy().tobytes()


def test_what_the_kernels_do_not_take_is_left_to_torch(k: kernels.RowKernels) -> None:
    """Adam's lazy rule has no fused form; a slot of -1 (a row not made), a strided or float64
    gradient are not the kernels' either: nothing is changed, and the caller's torch ops go on."""
    assert RowAdam(0.01).fused(0.01, 1) is None
    values, versions = torch.zeros(4, 2), torch.zeros(4, dtype=torch.int64)
    stamp = torch.ones(2, dtype=torch.int64)
    for slots, grads in ((torch.tensor([0, -1]), torch.ones(2, 2)), (torch.tensor([0, 1]), torch.ones(2, 4)[:, ::2]),
                         (torch.tensor([0, 1]), torch.ones(2, 2, dtype=torch.float64))):
        assert k.apply(("sgd", -1.0, 0.0), values, {}, slots, grads, versions, stamp) is False
    assert k.apply(("adam", -1.0, 1e-8), values, {}, torch.tensor([0, 1]), torch.ones(2, 2), versions, stamp) is False
    assert torch.equal(values, torch.zeros(4, 2)) and not versions.any()


def _index(rows: int, stored: dict[int, int], index: int = 1, shards: int = 2) -> DenseIndex:
    out = DenseIndex(rows, index, shards)
    if stored:
        out.assign(torch.tensor(sorted(stored)), torch.tensor([stored[i] for i in sorted(stored)]))
    return out


def _locate(k: kernels.RowKernels, ids: list[list[int]], sizes: list[int], bases: list[int], index: DenseIndex,
            ascending: bool = True) -> tuple[int, int, list[int], list[int]]:
    flat = torch.tensor([i for part in ids for i in part], dtype=torch.int64)
    bad, new, arena_ids, slots = k.locate(flat, np.array([len(p) for p in ids]), np.array(sizes), np.array(bases),
                                          2, 1, ascending, index.slots)
    return bad, new, arena_ids.tolist(), slots.tolist()


def test_locate_finds_the_arena_ids_and_the_indexs_slots(k: kernels.RowKernels) -> None:
    """Two tables of an arena of shard 1 of 2 (the second based at 10): each id's arena id, and the
    slot the index's lookup gives (-1: never stored), with the count never stored."""
    index = _index(30, {11: 0, 3: 5, 17: 2})
    bad, new, arena_ids, slots = _locate(k, [[1, 3, 9], [1, 7]], [10, 20], [0, 10], index)
    assert bad == -1 and arena_ids == [1, 3, 9, 11, 17]
    assert slots == index.lookup(torch.tensor(arena_ids)).tolist() == [-1, 5, -1, 0, 2] and new == 2


@pytest.mark.parametrize("ids,bad", [
    ([[1, 3, 10], [1]], 2),   # out of the first table's range
    ([[1, -1], [1]], 1),      # negative
    ([[1, 3], [2]], 2),       # on shard 0
    ([[1, 21], []], 1),       # out of range (an arena id the index has no place for)
    ([[3, 1], [1]], 1),       # not increasing (an update's ids, as workers send them)
])
def test_locate_names_the_first_id_the_checks_refuse(k: kernels.RowKernels, ids: list[list[int]], bad: int) -> None:
    assert _locate(k, ids, [10, 20], [0, 10], _index(30, {}))[0] == bad
    # the check alone (a read's, before its call's push) refuses the same id and finds nothing
    flat = torch.tensor([i for part in ids for i in part], dtype=torch.int64)
    assert k.locate(flat, np.array([len(p) for p in ids]), np.array([10, 20]), np.array([0, 10]), 2, 1, True,
                    _index(30, {}).slots, find=False) == (bad, 0, None, None)


@pytest.mark.parametrize("shards,shard", [(1, 0), (2, 1), (3, 2), (4, 3), (5, 0)])
def test_locate_places_ids_on_any_number_of_shards(k: kernels.RowKernels, shards: int, shard: int) -> None:
    """A power of two of shards (a mask and a shift) or not (divisions): the shard's ids found at
    the index's places (two tables, the second based at 60), an id of another shard refused at its
    position."""
    mine = [[r for r in range(10) if r % shards == shard], [r for r in range(20) if r % shards == shard]]
    stored = {a: slot for slot, a in enumerate(a for a in range(80) if a % shards == shard and (a // shards) % 2)}
    index = DenseIndex(80, shard, shards)
    index.assign(torch.tensor(sorted(stored)), torch.tensor([stored[a] for a in sorted(stored)]))
    flat = torch.tensor([i for part in mine for i in part], dtype=torch.int64)
    bad, new, arena_ids, slots = k.locate(flat, np.array([len(p) for p in mine]), np.array([10, 20]),
                                          np.array([0, 60]), shards, shard, True, index.slots)
    assert bad == -1 and arena_ids.tolist() == [*mine[0], *(r + 60 for r in mine[1])]
    assert slots.tolist() == index.lookup(arena_ids).tolist() and new == sum(s < 0 for s in slots.tolist())
    assert 0 < new < len(slots)  # (some stored, some not)
    if shards > 1:
        wrong = torch.tensor([*mine[0], 10 + (shard + 1) % shards], dtype=torch.int64)  # (past the others, another shard's)
        assert k.locate(wrong, np.array([len(wrong), 0]), np.array([20, 20]), np.array([0, 60]), shards, shard, True,
                        index.slots)[0] == len(mine[0])


def test_a_check_alone_passes_what_locate_passes_and_reads_no_index(k: kernels.RowKernels) -> None:
    flat = torch.tensor([1, 3, 9, 1, 7], dtype=torch.int64)
    counts, sizes, bases = np.array([3, 2]), np.array([10, 20]), np.array([0, 10])
    assert k.locate(flat, counts, sizes, bases, 2, 1, True, torch.empty(0, dtype=torch.int64), find=False) == (-1, 0, None, None)


def test_an_updates_new_rows_claim_the_next_slots_in_their_order(k: kernels.RowKernels) -> None:
    slots = torch.tensor([4, -1, 0, -1, -1, 7])
    ids = torch.tensor([3, 5, 9, 11, 13, 15])
    claimed, fresh = k.claimed(slots, ids, 20)
    assert claimed.tolist() == [4, 20, 0, 21, 22, 7] and fresh.tolist() == [5, 11, 13]
    assert slots.tolist() == [4, -1, 0, -1, -1, 7]  # (a new tensor: the slots given are left as they were)
    claimed, fresh = k.claimed(torch.tensor([1, 2]), torch.tensor([8, 9]), 5)
    assert claimed.tolist() == [1, 2] and fresh.numel() == 0


def test_reads_need_not_be_in_order(k: kernels.RowKernels) -> None:
    bad, new, arena_ids, _ = _locate(k, [[9, 1], [3, 1]], [10, 20], [0, 10], _index(30, {}), ascending=False)
    assert bad == -1 and new == 4 and arena_ids == [9, 1, 13, 11]


def test_gather_reads_stored_rows_and_zeros_for_the_others(k: kernels.RowKernels) -> None:
    values = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    out = k.gather(values, torch.tensor([2, -1, 0, 2]))
    assert torch.equal(out, torch.tensor([[6.0, 7, 8], [0, 0, 0], [0, 1, 2], [6, 7, 8]]))


@pytest.mark.parametrize("workers,dim", [(1, 4), (2, 32), (3, 13), (4, 64)])
def test_a_sync_rounds_merge_is_the_torch_sum_bit_for_bit(k: kernels.RowKernels, workers: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(workers)
    runs = [torch.randperm(500, generator=gen)[:int(torch.randint(0, 300, (), generator=gen))].sort().values
            for _ in range(workers)]
    ids, grads = torch.cat(runs), torch.randn(sum(r.numel() for r in runs), dim, generator=gen) * 1e3
    ends = torch.tensor([r.numel() for r in runs]).cumsum(0).tolist()
    got, expect = k.merge(ids, ends, grads, workers), aggregation.rows_mean(ids, grads, workers)
    assert got is not None and torch.equal(got[0], expect[0]) and torch.equal(got[0], torch.unique(ids))
    assert torch.equal(got[1].view(torch.int32), expect[1].view(torch.int32)) and got[2] is None
    # each row's slot (one per id, the same in every run) comes out beside its id
    slot_of = torch.randperm(500, generator=gen)
    carried = k.merge(ids, ends, grads, workers, slots=slot_of[ids])
    assert carried is not None and carried[2] is not None and torch.equal(carried[2], slot_of[got[0]])
    assert torch.equal(carried[1].view(torch.int32), got[1].view(torch.int32))
    if ids.numel():  # (a slot short: not the kernels')
        assert k.merge(ids, ends, grads, workers, slots=slot_of[ids][:-1]) is None


def test_a_sync_round_whose_ids_do_not_increase_goes_to_torch(k: kernels.RowKernels) -> None:
    ids, grads = torch.tensor([5, 2, 2, 7]), torch.arange(8, dtype=torch.float32).reshape(4, 2)
    assert k.merge(ids, [2, 4], grads, 2) is None  # worker 0's ids 5, 2
    assert k.merge(ids, [1, 5], grads, 2) is None  # (runs past the ids' end)
    assert k.merge(torch.tensor([1, 2, 3, 4]), [3, 1, 4], grads, 3) is None  # (runs out of order, each increasing)
    unique, total, slots = rows_path.round_mean(ids, [2, 4], grads, 2, ids + 10)  # (torch's ops: the same rule)
    assert slots is None  # (torch's ops give none: the apply looks them up)
    assert unique.tolist() == [2, 5, 7] and total.tolist() == [[3.0, 4.0], [0.0, 0.5], [3.0, 3.5]]


def test_a_broken_merge_leaves_every_row_kernel_unused(k: kernels.RowKernels) -> None:
    def scaled_first(ids, slots, ends, grads, scale, out_ids, out_slots, out_grads):  # type: ignore[no-untyped-def]
        n = k._k["merged_rows"](ids, slots, ends, grads, scale, out_ids, out_slots, out_grads)
        out_grads[:n] *= np.float32(1.0000001)  # (a bit off)
        return n

    assert not kernels._rows_agree_with_torch(kernels.RowKernels({**k._k, "merged_rows": scaled_first}))


def test_a_broken_kernel_is_not_used(k: kernels.RowKernels) -> None:
    """The check after compiling: a rule computed with two roundings where torch's addcmul_ fuses
    them (or any other bit off) leaves the shard on torch's ops."""
    assert kernels._rows_agree_with_torch(k)

    def two_roundings(acc: np.ndarray, slots: np.ndarray, grads: np.ndarray, out: np.ndarray, kept: np.ndarray) -> None:
        for i, s in enumerate(slots):
            if kept.shape[0]:
                kept[i] = acc[s]
            acc[s] = acc[s] + np.float32(1) * (grads[i] * grads[i])
            out[i] = acc[s]

    broken = kernels.RowKernels({**k._k, "square_sums": two_roundings})
    assert not kernels._rows_agree_with_torch(broken)

    def keeps_nothing(acc: np.ndarray, slots: np.ndarray, grads: np.ndarray, out: np.ndarray, kept: np.ndarray) -> None:
        k._k["square_sums"](acc, slots, grads, out, kept[:0])  # (right sums; the undo's copies left unwritten)

    assert not kernels._rows_agree_with_torch(kernels.RowKernels({**k._k, "square_sums": keeps_nothing}))


@pytest.mark.parametrize("form", [("sgd", -0.5, 0.0), ("adagrad", -0.1, 1e-10)])
def test_the_kernels_copy_what_they_overwrite_in_the_same_pass(k: kernels.RowKernels, form: tuple[str, float, float]) -> None:
    """An undo's copies (RowJournal): kept holds each row's values, version and written state as they
    were, in slot order, and the update is the same as without them."""
    gen = torch.Generator().manual_seed(4)
    values, sums = torch.randn(50, 8, generator=gen), torch.rand(50, 8, generator=gen)
    versions = torch.randint(0, 100, (50,), generator=gen)
    slots, grads = torch.tensor([7, 3, 41, 12]), torch.randn(4, 8, generator=gen)
    stamp = torch.full((4,), 101)
    state = {"sum": sums} if form[0] == "adagrad" else {}
    twin_values, twin_state, twin_versions = values.clone(), {n: t.clone() for n, t in state.items()}, versions.clone()
    kept: dict[str, torch.Tensor] = {}
    assert k.apply(form, values, state, slots, grads, versions, stamp, kept) is True
    assert k.apply(form, twin_values, twin_state, slots, grads, twin_versions, stamp) is True
    assert torch.equal(values, twin_values) and torch.equal(versions, twin_versions)
    assert all(torch.equal(state[n], twin_state[n]) for n in state)
    assert set(kept) == {"values", "versions", *("state." + n for n in state)}
    before_values, before_versions = values.clone(), versions.clone()
    before_values[slots], before_versions[slots] = kept["values"], kept["versions"]
    assert not torch.equal(before_values, values)  # (the rows did change)
    regen = torch.Generator().manual_seed(4)
    assert torch.equal(before_values, torch.randn(50, 8, generator=regen))
    original_sums = torch.rand(50, 8, generator=regen)
    assert torch.equal(before_versions, torch.randint(0, 100, (50,), generator=regen))
    if state:
        assert torch.equal(kept["state.sum"], original_sums[slots])


def _python(code: str) -> str:
    """What `python -c code` prints, in a process of its own (forked from the preloaded template, which
    has imported psgrad but neither numba nor a kernel; it must succeed)."""
    out = run_python(["-c", code], timeout_s=100)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_small_calls_do_not_compile_them_and_a_large_one_does() -> None:
    """A process whose tables see only small calls (a test's, a toy model's) never loads numba for
    the rows; the first update of ROW_KERNEL_MIN values or more starts compiling them."""
    code = (
        "import os, sys, torch\n"
        "os.environ.pop('PSGRAD_FUSED_APPLY', None)\n"
        "from psgrad.core.optimizers.rows import RowAdagrad\n"
        "from psgrad.server import kernels\n"
        "from psgrad.server.tables import SparseTable\n"
        "t = SparseTable('t', 100_000, 32, 0, 1, 0, RowAdagrad(0.1))\n"
        "t.apply(torch.arange(100), torch.ones(100, 32))\n"
        "print('numba' in sys.modules, kernels.rows() is None)\n"
        "t.apply(torch.arange(1000), torch.ones(1000, 32))\n"
        "print(kernels.rows(wait=True) is not None)\n"
    )
    assert _python(code).split() == ["False", "True", "True"]


def test_without_numba_the_tables_use_torch_ops() -> None:
    code = (
        "import sys, torch; sys.modules['numba'] = None\n"
        "from psgrad.core.optimizers.rows import RowAdagrad\n"
        "from psgrad.server import kernels\n"
        "from psgrad.server.tables import SparseTable\n"
        "assert kernels.rows(wait=True) is None\n"
        "t = SparseTable('t', 100_000, 32, 0, 1, 0, RowAdagrad(0.1), std=0.0)\n"
        "t.apply(torch.arange(1000), torch.ones(1000, 32))\n"
        "print(float(t.rows(torch.tensor([5]))[0, 0]))\n"
    )
    assert float(_python(code)) == pytest.approx(-0.1)
