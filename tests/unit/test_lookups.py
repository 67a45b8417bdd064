"""A lookup in several embedding tables in compiled passes (psgrad/nn/lookups.py, its kernels
psgrad/nn/_lookup_kernels.py): each table's unique ids for every table at once, equal to
torch.unique's; several tables' bags pooled in one pass, equal to torch's embedding_bag forward bit
for bit, the backward equal to index_add_ of each bag's output gradient bit for bit (and to torch's
backward within rounding); used by psgrad.EmbeddingBag and psgrad.EmbeddingBagCollection, and
refused (None: torch's ops run) for what they do not serve."""
from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch
from torch.nn import functional as F

import psgrad
from psgrad.core import compiled
from psgrad.errors import ConfigError, InvalidRequestError
from psgrad.nn import lookups

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def kernels() -> None:
    if lookups.kernels(start=True, wait=True) is None:
        pytest.skip("the compiled pooling kernels are unavailable here (numba missing)")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def lookup(gen: torch.Generator, tables: int, bags: int, dim: int, rows: int, empty: bool = True):  # type: ignore[no-untyped-def]
    weights, inverses, offsets, lengths = [], [], [], []
    for t in range(tables):
        length = torch.randint(0 if empty and t % 2 else 1, 4, (bags,), generator=gen)
        inverses.append(torch.randint(0, rows, (int(length.sum()),), generator=gen))
        offsets.append(torch.cat([torch.zeros(1, dtype=torch.int64), length.cumsum(0)[:-1]]))
        weights.append(torch.randn(rows, dim, generator=gen))
        lengths.append(length)
    return weights, inverses, offsets, lengths


def test_unique_ids_of_several_tables_at_once_are_torchs(kernels) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(0)
    tables = [torch.randint(0, 1000, (1500,), generator=gen), torch.empty(0, dtype=torch.int64),
              torch.randint(-5, 5, (6, 4), generator=gen).int(), torch.tensor([(1 << 63) - 1, -(1 << 63), 0, 0]),
              (torch.rand(3000, generator=gen) ** 8 * 1e6).long()]
    got = lookups.unique_ids(tables, 32)
    assert got is not None and len(got) == len(tables)
    for ids, (unique, inverse) in zip(tables, got):
        u, i = torch.unique(ids.reshape(-1), sorted=True, return_inverse=True)
        assert unique.dtype == inverse.dtype == torch.int64
        assert torch.equal(unique, u.long()) and torch.equal(inverse, i.view(ids.shape))
    assert lookups.unique_ids([torch.zeros(3)], 8) is None  # (not ids: the module says so)
    assert lookups.unique_ids([torch.zeros(lookups.UNIQUE_MAX_IDS + 1, dtype=torch.int64)], 8) is None  # (torch's)


def test_unique_ids_are_sorted_whatever_their_span() -> None:
    """The kernel sorts each table's unique ids by their offsets from the least, a byte a pass, as
    many passes as the span needs: spans of one byte, of three (a table of millions of rows) and of
    all eight (any int64, both signs), ids all one, and a table of one id, each sorted as torch's."""
    pytest.importorskip("numba")
    from psgrad.nn._lookup_kernels import KERNELS  # (the kernel itself: a wrong one is not served, see the check)

    gen = torch.Generator().manual_seed(3)
    tables = [torch.randint(7, 7 + 256, (500,), generator=gen), torch.randint(0, 1 << 23, (3000,), generator=gen),
              torch.randint(-(1 << 62), 1 << 62, (800,), generator=gen) * 2, torch.full((40,), -9),
              torch.tensor([1 << 40]), torch.randint(255, 257, (9,), generator=gen)]
    got = lookups._unique_with(KERNELS, tables)
    for ids, (unique, inverse) in zip(tables, got):
        u, i = torch.unique(ids, sorted=True, return_inverse=True)
        assert torch.equal(unique, u) and torch.equal(inverse, i)


def test_a_collection_finds_every_tables_unique_ids_in_one_pass_and_remembers_them(kernels, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    ebc = psgrad.EmbeddingBagCollection({"a": (50, 8), "b": (70, 8), "c": (9, 8)})
    gen = torch.Generator().manual_seed(1)
    x = {"a": torch.randint(0, 50, (40, 3), generator=gen), "b": torch.randint(0, 70, (40, 2), generator=gen),
         "c": torch.randint(0, 9, (40, 1), generator=gen)}
    for name, bag in ebc.bags.items():
        bag.table = name  # (named as binding names them)
    calls = []
    monkeypatch.setattr(lookups, "unique_ids", lambda ids, dim, _f=lookups.unique_ids: calls.append(len(ids)) or _f(ids, dim))
    first = ebc.lookup(x)
    assert calls == [3]  # every table in one pass
    assert all(torch.equal(first[name], torch.unique(ids)) for name, ids in x.items())
    assert ebc.lookup(x).keys() == first.keys() and calls == [3]  # the same tensors: remembered
    x["a"][0, 0] = 49 if int(x["a"][0, 0]) != 49 else 48  # (changed in place: found again, alone)
    ebc.lookup(x)
    assert calls == [3, 1]
    with pytest.raises(psgrad.InvalidRequestError, match="out of range"):
        ebc.lookup({**x, "c": torch.full((40, 1), 9)})


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_several_tables_pool_as_torchs_embedding_bags_in_one_pass(kernels, mode) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(1)
    weights, inverses, offsets, lengths = lookup(gen, 8, 512, 32, 60)  # (many bags share rows)
    leaves = [w.clone().requires_grad_() for w in weights]
    out = lookups.pooled(leaves, inverses, offsets, mode == "mean")
    assert out is not None
    torch_leaves = [w.clone().requires_grad_() for w in weights]
    expect = torch.cat([F.embedding_bag(i, w, o, mode=mode) for i, w, o in zip(inverses, torch_leaves, offsets)], 1)
    assert same_bits(out.detach(), expect.detach())
    grad_out = torch.randn(out.shape, generator=gen)
    out.backward(grad_out)
    expect.backward(grad_out)
    for t, (leaf, torch_leaf) in enumerate(zip(leaves, torch_leaves)):
        assert leaf.grad is not None and torch_leaf.grad is not None
        torch.testing.assert_close(leaf.grad, torch_leaf.grad, rtol=1e-5, atol=1e-6)  # (torch's sort: its own order)
        bag = torch.repeat_interleave(torch.arange(512), lengths[t])
        source = grad_out[:, 32 * t:32 * (t + 1)][bag]
        if mode == "mean":
            source = source * (1.0 / lengths[t].clamp(min=1).float())[bag].unsqueeze(1)
        assert same_bits(leaf.grad, torch.zeros(60, 32).index_add_(0, inverses[t], source))


def apart_and_one(gen: torch.Generator, mean: bool):  # type: ignore[no-untyped-def]
    """4 tables of 64 bags, 8 wide, pooled apart and as one output, each from leaves of its own:
    (the tables' (weights, inverses, offsets), apart's leaves, its outputs, one's leaves, its output)."""
    weights, inverses, offsets, _ = lookup(gen, 4, 64, 8, 30)
    apart_leaves = [w.clone().requires_grad_() for w in weights]
    outs = lookups.pooled_apart(apart_leaves, inverses, offsets, mean)
    leaves = [w.clone().requires_grad_() for w in weights]
    one = lookups.pooled(leaves, inverses, offsets, mean)
    assert outs is not None and one is not None
    return (weights, inverses, offsets), apart_leaves, outs, leaves, one


@pytest.mark.parametrize("with_kernels", [True, False], ids=["kernels", "torch-ops"])
def test_tables_pooled_apart_are_pooled_ones_bits_and_a_table_no_backward_reaches_gets_no_gradient(kernels, monkeypatch, with_kernels) -> None:  # type: ignore[no-untyped-def]
    """pooled_apart: each table's bags a tensor of its own, bit for bit the columns of pooled()'s
    one output (with and without the kernels), forward and backward. A table whose output the loss
    does not use gets no gradient (None, as a module's own lookup left unused), where a column of
    one output would get zeros; an output changed in place (as a module's may be) is fine."""
    if not with_kernels:
        monkeypatch.setattr(lookups, "kernels", lambda start=False, wait=False: None)
    gen = torch.Generator().manual_seed(4)
    (weights, inverses, offsets), apart_leaves, outs, leaves, one = apart_and_one(gen, False)
    assert len(outs) == 4
    for t, out in enumerate(outs):
        assert out.is_contiguous() and same_bits(out.detach(), one.detach()[:, 8 * t:8 * (t + 1)])
    grad_out = torch.randn(64, 32, generator=gen)
    grad_out[:, 16:24] = 0.0  # (table 2 unused below: pooled()'s one output gives it zeros)
    outs[0].mul_(2.0)  # (in place, after pooling: the gradient through it is doubled)
    loss = sum((out * grad_out[:, 8 * t:8 * (t + 1)]).sum() for t, out in enumerate(outs) if t != 2)
    loss.backward()  # type: ignore[union-attr]
    (one * grad_out * torch.tensor([2.0] * 8 + [1.0] * 24)).sum().backward()
    assert apart_leaves[2].grad is None and leaves[2].grad is not None and not leaves[2].grad.any()
    for t in (0, 1, 3):
        assert apart_leaves[t].grad is not None and same_bits(apart_leaves[t].grad, leaves[t].grad), t
    assert lookups.pooled_apart(weights[:1], inverses[:1], offsets[:1], True) is not None  # (one table: its own output)


class Reached:
    """pooled_group's group: what its backward says of the tables' outputs."""

    def __init__(self) -> None:
        self.calls: list[list[bool]] = []

    def hold(self, reached: list[bool]) -> None:
        self.calls.append(list(reached))


@pytest.mark.parametrize("with_kernels", [True, False], ids=["kernels", "torch-ops"])
def test_tables_pooled_as_a_group_are_pooled_apart_bits_with_one_gradient_of_them_all(kernels, monkeypatch, with_kernels) -> None:  # type: ignore[no-untyped-def]
    """pooled_group: the tables' rows given as one tensor, one after another, pool to pooled_apart's
    outputs bit for bit, each its own tensor, and their backward gives that tensor one gradient:
    pooled_apart's gradients of the tables one after another, zeros for a table whose output the
    loss does not use, which the group is told (hold: per table, whether its output got one)."""
    if not with_kernels:
        monkeypatch.setattr(lookups, "kernels", lambda start=False, wait=False: None)
    gen = torch.Generator().manual_seed(6)
    (weights, inverses, offsets), apart_leaves, outs, _, _ = apart_and_one(gen, False)
    sizes = [int(w.shape[0]) for w in weights]
    one = torch.cat(weights).requires_grad_()
    group = Reached()
    grouped = lookups.pooled_group(one, sizes, inverses, offsets, False, group=group)
    assert grouped is not None and len(grouped) == 4
    for mine, theirs in zip(grouped, outs):
        assert mine.is_contiguous() and mine._base is None and same_bits(mine.detach(), theirs.detach())
    grad_out = torch.randn(64, 32, generator=gen)
    for pooled in (grouped, outs):
        sum((out * grad_out[:, 8 * t:8 * (t + 1)]).sum() for t, out in enumerate(pooled) if t != 1).backward()  # type: ignore[union-attr]
    assert group.calls == [[True, False, True, True]]
    assert apart_leaves[1].grad is None and one.grad is not None
    expected = torch.cat([torch.zeros(sizes[1], 8) if t == 1 else leaf.grad for t, leaf in enumerate(apart_leaves)])
    assert same_bits(one.grad, expected)
    # rows that do not add up to the tables' (or a tensor that is not 2-D float32): not served
    assert lookups.pooled_group(one.detach()[1:], sizes, inverses, offsets, False) is None
    assert lookups.pooled_group(one.detach(), sizes[:3], inverses, offsets, False) is None
    assert lookups.pooled_group(one.detach().double(), sizes, inverses, offsets, False) is None


@pytest.mark.parametrize("with_kernels", [True, False], ids=["kernels", "torch-ops"])
@pytest.mark.parametrize("mean", [False, True], ids=["sum", "mean"])
def test_tables_pooled_as_a_block_are_pooleds_bits_with_one_gradient_of_them_all(kernels, monkeypatch, with_kernels, mean) -> None:  # type: ignore[no-untyped-def]
    """pooled_block: the tables' rows given as one tensor, one after another, pool to pooled()'s
    one output bit for bit, [B, T * D], and its backward gives that tensor one gradient: pooled()'s
    gradients of the tables one after another, every table reached (the group is told so)."""
    if not with_kernels:
        monkeypatch.setattr(lookups, "kernels", lambda start=False, wait=False: None)
    gen = torch.Generator().manual_seed(8)
    (weights, inverses, offsets), _, _, _, _ = apart_and_one(gen, mean)
    sizes = [int(w.shape[0]) for w in weights]
    leaves = [w.clone().requires_grad_() for w in weights]
    theirs = lookups.pooled(leaves, inverses, offsets, mean)
    one = torch.cat(weights).requires_grad_()
    group = Reached()
    mine = lookups.pooled_block(one, sizes, inverses, offsets, mean, group=group)
    assert mine is not None and theirs is not None and same_bits(mine.detach(), theirs.detach())
    grad_out = torch.randn(*mine.shape, generator=gen)
    for out in (mine, theirs):
        (out * grad_out).sum().backward()
    assert group.calls == [[True] * 4] and one.grad is not None
    assert same_bits(one.grad, torch.cat([leaf.grad for leaf in leaves]))  # type: ignore[misc]
    assert lookups.pooled_block(one.detach()[1:], sizes, inverses, offsets, mean) is None  # (rows that do not add up)


@pytest.mark.parametrize("join", ["stack", "cat", "stack-within", "cat-reversed"])
def test_tables_pooled_apart_and_joined_by_the_model_get_pooled_ones_gradients(kernels, monkeypatch, join) -> None:  # type: ignore[no-untyped-def]
    """A model joins its features' bags along dim 1 (torch.stack, torch.cat): the backward hands
    pooled_apart its outputs' gradients as column blocks of one tensor, taken as they lie (no
    copy to join them) where they are in table order, joined otherwise: pooled()'s gradients bit
    for bit either way. The outputs share one block of memory, yet each is its own tensor: no
    view (changed in place, the others stay as they were)."""
    gen = torch.Generator().manual_seed(5)
    _, apart_leaves, outs, leaves, one = apart_and_one(gen, True)
    assert all(out._base is None and out.is_contiguous() for out in outs)
    before = [out.detach().clone() for out in outs]
    outs[1].add_(0.0)  # (in place: allowed, as on a module's output; the others untouched)
    assert all(same_bits(out.detach(), b) for out, b in zip(outs, before))
    taken = []
    monkeypatch.setattr(lookups, "_columns_of_one",
                        lambda grads, bags, dim, _f=lookups._columns_of_one: taken.append(_f(grads, bags, dim)) or taken[-1])
    grad_out = torch.randn(64, 32, generator=gen)
    if join == "stack":
        joined = torch.stack(outs, dim=1).view(64, 32)
    elif join == "cat":
        joined = torch.cat(outs, dim=1)
    elif join == "stack-within":  # (beside another vector, as DLRM's interaction joins the bottom MLP's)
        first = torch.randn(64, 1, 8, generator=gen, requires_grad=True)
        joined = torch.cat([first, torch.stack(outs, dim=1)], dim=1)[:, 1:].reshape(64, 32)
    else:  # (tables in another order: their gradients are joined by a copy)
        joined = torch.cat(outs[::-1], dim=1)
        grad_out = torch.cat([grad_out[:, 8 * t:8 * (t + 1)] for t in (3, 2, 1, 0)], dim=1)
    (joined * grad_out).sum().backward()
    if join == "cat-reversed":
        grad_out = torch.cat([grad_out[:, 8 * t:8 * (t + 1)] for t in (3, 2, 1, 0)], dim=1)
    (one * grad_out).sum().backward()
    assert len(taken) == 1 and (taken[0] is None) == (join == "cat-reversed"), taken
    for t in range(4):
        assert apart_leaves[t].grad is not None and same_bits(apart_leaves[t].grad, leaves[t].grad), t


def test_two_dimensional_inputs_are_a_bag_per_row(kernels) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(9, 5, generator=gen)
    inverse = torch.randint(0, 9, (7, 3), generator=gen)
    out = lookups.pooled([weight], [inverse], [None], True)
    assert out is not None and same_bits(out, F.embedding_bag(inverse, weight, mode="mean"))
    empty = torch.empty(4, 0, dtype=torch.int64)  # (bags of no ids: torch refuses them, and says why)
    assert lookups.pooled([weight], [empty], [None], False) is None
    with pytest.raises(RuntimeError):
        F.embedding_bag(empty, weight, mode="sum")


def test_rows_that_lie_one_after_another_are_read_in_place(kernels, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from psgrad.core import codecs

    monkeypatch.setattr(codecs, "JOIN_VIEW_MIN_BYTES", 0)  # (as large tables' rows are: these are small)
    gen = torch.Generator().manual_seed(3)
    weights, inverses, offsets, _ = lookup(gen, 3, 20, 4, 10)
    together = torch.cat(weights)
    views = list(together.split([10, 10, 10]))
    plan = lookups._Plan.make(views, inverses, offsets, False, lookups.kernels())
    assert plan is not None
    assert plan.rows(views).data_ptr() == together.data_ptr()  # (a view: no copy)
    apart = [w.clone() for w in weights]
    assert plan.rows(apart).data_ptr() not in {w.data_ptr() for w in apart}  # (a copy of tables stored apart)
    assert same_bits(lookups.pooled(views, inverses, offsets, False), lookups.pooled(apart, inverses, offsets, False))


def test_what_the_kernels_do_not_serve_is_left_to_torch(kernels, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(4)
    weights, inverses, offsets, _ = lookup(gen, 2, 6, 4, 5, empty=False)
    assert lookups.pooled(weights, inverses, offsets, False) is not None
    refused = [
        ([weights[0], torch.randn(5, 3)], inverses, offsets),  # widths differ
        (weights, inverses, [offsets[0], offsets[1][:-1]]),  # bag counts differ: torch.cat refuses
        ([w.double() for w in weights], inverses, offsets),  # not float32
        (weights, [i.int() for i in inverses], offsets),  # int32 ids
        (weights, [inverses[0], inverses[1] + 5], offsets),  # a row past the table's
        (weights, inverses, [offsets[0], None]),  # 1-D ids without offsets: torch's error
    ]
    # Offsets no pooling can take (torch refuses some, and pools arbitrary memory for decreasing
    # ones): refused by name, with or without the kernels.
    down = offsets[1].clone()
    down[2], down[3] = down[3] + 1, down[3]
    invalid = [
        ([offsets[0], down], "table 'b': bag offsets must not decrease, got .* \\(bag 3\\)"),
        ([offsets[0] + 1, offsets[1]], "table 'a': bag offsets must start at 0, got 1"),
        ([offsets[0], torch.cat([offsets[1][:-1], offsets[1][-1:] + 99])], "table 'b': a bag starts at offset"),
    ]
    for compiled_too in (True, False):
        for w, i, o in refused:
            assert lookups.pooled(w, i, o, False) is None
        for o, message in invalid:
            with pytest.raises(InvalidRequestError, match=message):
                lookups.pooled(weights, inverses, o, False, ["a", "b"])
        if compiled_too:
            compiled_out = lookups.pooled(weights, inverses, offsets, False)
            monkeypatch.setenv(compiled.ENV, "0")  # (torch's ops then: the same bits)
            out = lookups.pooled(weights, inverses, offsets, False)
            assert out is not None and compiled_out is not None and same_bits(out, compiled_out)
    with pytest.raises(ValueError, match="offsets"):  # (torch says what is wrong)
        F.embedding_bag(inverses[1], weights[1], None, mode="sum")


class Rows:
    """A RowSource serving fixed rows for every table (the job's servers' part)."""

    def __init__(self, tables: Mapping[str, torch.Tensor]) -> None:
        self.tables = tables

    def pull_tables(self, lookups: Mapping[str, torch.Tensor], observe: bool, checked: bool = False) -> dict[str, torch.Tensor]:
        return {name: self.tables[name][ids].clone() for name, ids in lookups.items()}

    def updated_rows(self, table: str) -> tuple[torch.Tensor, torch.Tensor]:
        raise AssertionError("not read here")


@pytest.mark.parametrize("kind", ["collection", "bag"])
def test_the_modules_pool_their_bags_in_one_node_with_the_same_bits_with_or_without_the_kernels(kernels, monkeypatch, kind) -> None:  # type: ignore[no-untyped-def]
    """A bound collection (and a bag): one pooling node, the same outputs and row gradients bit for
    bit whether the kernels are compiled or not (a job's bits do not depend on when they became
    ready), the outputs torch's embedding_bag's and the gradients within rounding of its backward."""
    gen = torch.Generator().manual_seed(5)
    tables = {"a": torch.randn(50, 8, generator=gen), "b": torch.randn(70, 8, generator=gen)}
    x = {"a": torch.randint(0, 50, (40, 3), generator=gen),
         "b": (torch.randint(0, 70, (90,), generator=gen), torch.arange(0, 80, 2))}
    results = {}
    pooled = lookups.pooled
    for way in ("kernels", "torch ops", "torch's embedding_bag"):
        monkeypatch.setenv(compiled.ENV, "0" if way == "torch ops" else "1")
        calls = []
        monkeypatch.setattr(lookups, "pooled", lambda *a, _w=way: calls.append(1) or (
            None if _w == "torch's embedding_bag" else pooled(*a)))
        if kind == "collection":
            module = psgrad.EmbeddingBagCollection({"a": (50, 8), "b": (70, 8)}, mode="mean")
            bags = dict(module.bags.items())
        else:
            module = psgrad.EmbeddingBag(70, 8, mode="sum")
            bags = {"b": module}
        for name, bag in bags.items():
            bag.bind(name, Rows(tables))
        out = module(x) if kind == "collection" else module(*x["b"])
        assert calls == [1]  # every table in one call
        out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape))
        results[way] = out.detach(), {name: bag.take_gradients() for name, bag in bags.items()}
    compiled_out, compiled_grads = results["kernels"]
    for way, (out, grads) in results.items():
        assert same_bits(out, compiled_out), way
        for name, (ids, grad) in grads.items():
            assert torch.equal(ids, compiled_grads[name][0])
            if way == "torch ops":
                assert same_bits(grad, compiled_grads[name][1]), name
            else:  # (torch's backward adds a shared row's gradients in its sort's order)
                torch.testing.assert_close(grad, compiled_grads[name][1], rtol=1e-5, atol=1e-6)


def test_binding_a_large_table_starts_compiling_the_kernels_and_a_small_one_does_not(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    started = []
    monkeypatch.setattr(lookups, "kernels", lambda start=False, wait=False: started.append(start))
    source = Rows({})
    psgrad.EmbeddingBag(200, 4).bind("small", source)
    assert started == []
    psgrad.EmbeddingBag(1_000_000, 32).bind("large", source)
    psgrad.Embedding(None, 4).bind("dynamic", source)
    assert started == [True, True]


def test_a_steps_lookups_of_separate_modules_are_found_in_one_pass(kernels, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """What opt.prefetch / opt.pipeline ask the servers for: every separate module's unique ids in
    one call of the kernels, a collection's in one of its own."""
    from types import SimpleNamespace

    bags = {name: psgrad.EmbeddingBag(100, 8) for name in "abc"}
    ebc = psgrad.EmbeddingBagCollection({"d": (50, 8), "e": (60, 8)})
    for name, bag in [*bags.items(), *(("ebc." + n, b) for n, b in ebc.bags.items())]:
        bag.table = name
    gen = torch.Generator().manual_seed(2)
    x = {name: torch.randint(0, 100, (30, 2), generator=gen) for name in bags}
    features = {"d": torch.randint(0, 50, (30, 2), generator=gen), "e": torch.randint(0, 60, (30, 1), generator=gen)}
    calls = []
    monkeypatch.setattr(lookups, "unique_ids", lambda ids, dim, _f=lookups.unique_ids: calls.append(len(ids)) or _f(ids, dim))
    opt = SimpleNamespace(embeddings=[*bags.items(), *(("ebc." + n, b) for n, b in ebc.bags.items())])
    got = psgrad.PSOptimizer._lookup_ids(opt, {**{bags[n]: x[n] for n in bags}, ebc: features})
    assert sorted(calls) == [2, 3]
    expect = {**{n: torch.unique(v) for n, v in x.items()}, **{"ebc." + n: torch.unique(v) for n, v in features.items()}}
    assert got.keys() == expect.keys() and all(len(got[k]) == 1 and torch.equal(got[k][0], expect[k]) for k in expect)


def test_the_ids_of_every_table_found_in_one_pass_are_checked_against_its_rows(kernels) -> None:  # type: ignore[no-untyped-def]
    """The unique ids found for several tables at once are checked against each table's rows at
    once (their least and greatest): in range, none, below 0, at the end; a dynamic table's (any
    id) by its own check; an id out of range is named with its table, whichever it is."""
    from psgrad.nn.embedding import unique_ids_of

    found = lookups.unique_ids([torch.tensor([3, 0, 9]), torch.empty(0, dtype=torch.int64), torch.tensor([4, -1]),
                                torch.tensor([2, 10, 5]), torch.tensor([1 << 50])], 8)
    assert found is not None
    assert found.within([10, 10, 10, 10, 0]) == [True, True, False, False, False]
    assert found.within([10, 10, 10, 11, 0]) == [True, True, False, True, False]
    bags = {name: psgrad.EmbeddingBag(rows, 4) for name, rows in (("a", 10), ("b", 10), ("c", None))}
    for name, bag in bags.items():
        bag.table = name
    modules = list(bags.values())
    ids = [torch.tensor([9, 0]), torch.tensor([5]), torch.tensor([1 << 50, 7])]
    got = unique_ids_of(modules, ids)
    assert [u.tolist() for u, _ in got] == [[0, 9], [5], [7, 1 << 50]]
    for k, bad in ((0, 10), (1, -1), (0, -3)):
        wrong = list(ids)
        wrong[k] = torch.tensor([2, bad])
        with pytest.raises(InvalidRequestError, match=f"table '{'ab'[k]}': row id {bad} is out of range"):
            unique_ids_of(modules, wrong)
    with pytest.raises(InvalidRequestError, match="table 'c': row id .* the two smallest int64 ids"):
        unique_ids_of(modules, [ids[0], ids[1], torch.tensor([-(1 << 63)])])


def test_a_collections_features_are_checked_and_refused_by_name() -> None:
    """What a collection is built from and fed is checked before any lookup: table shapes as two
    integers, features of one batch size, keyed lengths that are integers >= 0, tensors of ids."""
    for tables in ({"a": 10}, {"a": (10.5, 4)}, {"a": (10, None)}, {"a": (True, 4)}, {}):
        with pytest.raises(ConfigError, match="table 'a': give \\(num_embeddings, embedding_dim\\)|at least one table"):
            psgrad.EmbeddingBagCollection(tables)  # type: ignore[arg-type]
    ebc = psgrad.EmbeddingBagCollection({"a": (100, 4), "b": (None, 8)})
    with pytest.raises(ConfigError, match="different batch sizes: 'a' has 3 bags, 'b' has 2 bags"):
        ebc.split({"a": (torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2])), "b": torch.tensor([[4], [5]])})
    with pytest.raises(ConfigError, match="feature 'a': ids and offsets must be tensors, got list"):
        ebc.split({"a": ([1, 2], torch.tensor([0])), "b": torch.tensor([[4]])})

    class Keyed:
        def __init__(self, lengths: torch.Tensor) -> None:
            self._lengths = lengths

        def keys(self) -> list[str]:
            return ["a", "b"]

        def values(self) -> torch.Tensor:
            return torch.arange(5)

        def lengths(self) -> torch.Tensor:
            return self._lengths

    with pytest.raises(ConfigError, match="a negative length \\(-1\\)"):
        ebc.split(Keyed(torch.tensor([4, -1, 1, 1])))
    with pytest.raises(ConfigError, match="lengths must be integers, got torch.float32"):
        ebc.split(Keyed(torch.tensor([2.0, 1.0, 1.0, 1.0])))
    a, b = ebc.split(Keyed(torch.tensor([2, 1, 1, 1]))).values()
    assert torch.equal(a[1], torch.tensor([0, 2])) and torch.equal(b[0], torch.tensor([3, 4]))


@pytest.mark.parametrize("options", [{"mode": "max"}, {"mode": "sum", "padding_idx": 0}, {"mode": "sum"}])
def test_bag_offsets_are_checked_on_every_pooling_path(options) -> None:  # type: ignore[no-untyped-def]
    """Decreasing offsets: refused by name on the compiled path and on torch's (max bags, padding),
    where torch's embedding_bag pooled arbitrary memory (a collection of max bags likewise)."""
    tables = {"t": torch.randn(10, 4, generator=torch.Generator().manual_seed(1))}
    bag = psgrad.EmbeddingBag(10, 4, **options)
    bag.bind("t", Rows(tables))
    ids = torch.tensor([1, 2, 3, 4])
    assert bag(ids, torch.tensor([0, 1, 3])).shape == (3, 4)
    with pytest.raises(InvalidRequestError, match="table 't': bag offsets must not decrease, got 1 after 3 \\(bag 2\\)"):
        bag(ids, torch.tensor([0, 3, 1]))
    if options["mode"] == "max":
        ebc = psgrad.EmbeddingBagCollection({"t": (10, 4)}, mode="max")
        ebc.bags["t"].bind("t", Rows(tables))
        with pytest.raises(InvalidRequestError, match="table 't': bag offsets must start at 0"):
            ebc({"t": (ids, torch.tensor([1, 3]))})
