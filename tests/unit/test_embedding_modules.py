"""psgrad.Embedding / EmbeddingBag as a PyTorch user expects them, on an in-process row source: torch's
module options (computed as torch computes them on the same weights, or refused naming why),
state_dict()/load_state_dict() (the table's handle; an unbound module serves loaded rows), pickles
and copies (unbound), and psgrad.clip_grad_norm_ against torch's on an equivalent dense model."""
from __future__ import annotations

from collections.abc import Mapping

import copy
import io
import math
import threading
from typing import Any

import pytest
import torch
from torch import nn

import psgrad
from psgrad.core import rows
from psgrad.errors import ConfigError, InvalidRequestError, WorkerStateError
from psgrad.nn import SparseEmbedding, sparse_modules

pytestmark = pytest.mark.timeout(60)

ROWS, DIM = 40, 4


class LocalRows:
    """A RowSource holding the whole table in memory; the lock stands for a job's gRPC channels
    (which cannot be pickled or copied either)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.clone()
        self.updated: set[int] = set()
        self.lock = threading.Lock()

    def pull_tables(self, lookups: Mapping[str, torch.Tensor], observe: bool, checked: bool = False) -> dict[str, torch.Tensor]:
        return {table: self.weight[ids].clone() for table, ids in lookups.items()}

    def updated_rows(self, table: str) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.tensor(sorted(self.updated), dtype=torch.int64)
        return ids, self.weight[ids].clone()

    def update(self, ids: list[int], delta: float) -> None:
        self.weight[ids] += delta
        self.updated.update(ids)


def _bound(module: SparseEmbedding, table: str = "emb") -> LocalRows:
    """Bind module to a LocalRows of its initial weight (as table `table`); returns the source."""
    module.table = table
    source = LocalRows(module.initial_weight())
    module.bind(table, source)
    return source


def _torch_twin(mine: SparseEmbedding, kind: type[nn.Module], **options: Any) -> nn.Module:
    """torch's module with the same options, on mine's initial weight (its padding row zero, as torch
    makes it)."""
    theirs = kind(ROWS, DIM, **options)
    with torch.no_grad():
        theirs.weight.copy_(mine.initial_weight())
        if options.get("padding_idx") is not None:
            theirs.weight[options["padding_idx"]] = 0
    return theirs


IDS_2D = torch.tensor([[1, 7, 7, 2], [3, 1, 2, 2], [2, 2, 2, 2]])  # 2: the padding id where there is one
IDS_1D = torch.tensor([1, 7, 7, 2, 3, 1, 5, 2, 2])
OFFSETS = torch.tensor([0, 4, 4, 6])  # bags [0:4], [4:4] (empty), [4:6], [6:]


@pytest.mark.parametrize("options", [
    {}, {"padding_idx": 2}, {"padding_idx": -38}, {"scale_grad_by_freq": True}, {"sparse": True},
    {"padding_idx": 2, "scale_grad_by_freq": True},
], ids=str)
def test_embedding_options_compute_what_torchs_compute(options: dict[str, Any]) -> None:
    mine = psgrad.Embedding(ROWS, DIM, std=0.5, seed=4, **options)
    _bound(mine)
    theirs = _torch_twin(mine, nn.Embedding, **options)
    out = mine(IDS_2D)
    torch.testing.assert_close(out, theirs(IDS_2D))
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    (out * probe).sum().backward()
    (theirs(IDS_2D) * probe).sum().backward()
    ids, grads = mine.take_gradients()
    # the padding row takes no gradient (torch's neither), and none is pushed for it
    assert ids.tolist() == [i for i in torch.unique(IDS_2D).tolist() if i != mine.padding_idx]
    torch.testing.assert_close(grads, _dense_grad(theirs.weight)[ids])
    if options.get("padding_idx") is not None:
        assert mine.padding_idx == 2 and not _dense_grad(theirs.weight)[2].any()


BAG_CASES = [
    {"mode": "sum"}, {"mode": "mean"}, {"mode": "max"},
    {"mode": "sum", "include_last_offset": True}, {"mode": "mean", "include_last_offset": True},
    {"mode": "max", "include_last_offset": True},
    {"mode": "sum", "padding_idx": 2}, {"mode": "mean", "padding_idx": 2}, {"mode": "max", "padding_idx": 2},
    {"mode": "mean", "padding_idx": 2, "include_last_offset": True},
    {"mode": "sum", "scale_grad_by_freq": True}, {"mode": "mean", "scale_grad_by_freq": True, "padding_idx": 2},
    {"mode": "sum", "sparse": True},
]


# Each case with the inputs it applies to: a 2-D input, a 1-D one with offsets, and weighted
# (per_sample_weights: mode "sum" only, torch's rule); include_last_offset is about offsets.
BAG_INPUTS = [(options, layout) for options in BAG_CASES for layout in ("2d", "offsets", "weighted")
              if not (layout == "weighted" and options["mode"] != "sum")
              and not (layout == "2d" and options.get("include_last_offset"))]


def _dense_grad(weight: torch.Tensor) -> torch.Tensor:
    """torch's gradient of a table (sparse=True makes it a sparse tensor)."""
    assert weight.grad is not None
    return weight.grad.to_dense() if weight.grad.is_sparse else weight.grad


@pytest.mark.parametrize("options, layout", BAG_INPUTS, ids=str)
def test_embedding_bag_options_compute_what_torchs_compute(options: dict[str, Any], layout: str) -> None:
    mine = psgrad.EmbeddingBag(ROWS, DIM, std=0.5, seed=4, **options)
    _bound(mine)
    theirs = _torch_twin(mine, nn.EmbeddingBag, **options)
    if layout == "2d":
        args: tuple[Any, ...] = (IDS_2D,)
    else:
        offsets = torch.cat([OFFSETS, torch.tensor([IDS_1D.numel()])]) if options.get("include_last_offset") else OFFSETS
        weights = torch.linspace(0.5, 2.0, IDS_1D.numel()) if layout == "weighted" else None
        args = (IDS_1D, offsets, weights)
    out = mine(*args)
    torch.testing.assert_close(out, theirs(*args))
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    (out * probe).sum().backward()
    (theirs(*args) * probe).sum().backward()
    ids, grads = mine.take_gradients()
    torch.testing.assert_close(grads, _dense_grad(theirs.weight)[ids])
    assert grads.abs().sum() > 0
    if options.get("padding_idx") is not None:  # no gradient (torch's neither), and none pushed
        assert 2 not in ids.tolist() and not _dense_grad(theirs.weight)[2].any()


def test_options_torch_has_and_psgrad_cannot_honour_are_refused_naming_the_alternative() -> None:
    for make in (lambda **kw: psgrad.Embedding(ROWS, DIM, **kw), lambda **kw: psgrad.EmbeddingBag(ROWS, DIM, **kw)):
        with pytest.raises(ConfigError, match=r"max_norm=1\.0 is not supported.*rows live on the servers.*"
                                              r"out\.norm\(dim=-1.*psgrad\.clip_grad_norm_"):
            make(max_norm=1.0, norm_type=2.0)
        assert make(norm_type=1.0).norm_type == 1.0  # (read only with max_norm, as in torch)
        assert make(sparse=True).sparse and make(scale_grad_by_freq=True).scale_grad_by_freq
        with pytest.raises(ConfigError, match=f"padding_idx must be within num_embeddings \\({ROWS}\\), got {ROWS}"):
            make(padding_idx=ROWS)
    with pytest.raises(ConfigError, match="scale_grad_by_freq does not go with mode 'max'.*use mode 'sum' or 'mean'"):
        psgrad.EmbeddingBag(ROWS, DIM, mode="max", scale_grad_by_freq=True)
    with pytest.raises(ValueError, match="max mode does not support scaling"):  # torch's own refusal, at the forward
        nn.EmbeddingBag(ROWS, DIM, mode="max", scale_grad_by_freq=True)(IDS_2D)
    assert "sparse=True" in repr(psgrad.Embedding(ROWS, DIM, sparse=True))


@pytest.mark.parametrize("options", [{}, {"mode": "sum"}, {"mode": "max", "padding_idx": -1}, {"padding_idx": 3}], ids=str)
def test_repr_starts_as_torchs_with_the_bags_mode(options: dict[str, Any]) -> None:
    """repr shows torch's options as torch's does (a bag's mode always, before: left out), then psgrad's."""
    bag_only = {"mode"} & set(options)
    pairs = [(psgrad.EmbeddingBag, nn.EmbeddingBag)] + ([] if bag_only else [(psgrad.Embedding, nn.Embedding)])
    for mine, theirs in pairs:
        shown, torchs = repr(mine(ROWS, DIM, **options)), repr(theirs(ROWS, DIM, **options))
        assert shown.startswith(torchs[:-1] + ", std=1"), (shown, torchs)



class DrawnRows:
    """A RowSource of a dynamic table: every row its initial value (any int64 id)."""

    def pull_tables(self, lookups: Mapping[str, torch.Tensor], observe: bool, checked: bool = False) -> dict[str, torch.Tensor]:
        return {table: rows.initial_rows(rows.table_key(0, table), ids, DIM) for table, ids in lookups.items()}

    def updated_rows(self, table: str) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, DIM)


def test_a_dynamic_tables_padding_idx_is_an_id_as_it_is_and_one_it_cannot_hold_is_refused() -> None:
    """A dynamic table has no end to count a negative padding_idx from: -1 pads id -1 (output zeros,
    no gradient; in a bag, no part in it), while a table of N rows reads -1 as row N - 1, as torch
    does. A padding_idx that is no id the table holds (a reserved one, past int64, not an integer)
    was accepted and matched nothing; now it is refused by name."""
    x = torch.tensor([[5, -1, 7], [-1, -1, 9]])
    drawn = rows.initial_rows(rows.table_key(0, "t"), torch.tensor([5, 7, 9]), DIM)
    table = psgrad.Embedding(None, DIM, padding_idx=-1)
    table.bind("t", DrawnRows())
    out = table(x)
    torch.testing.assert_close(out[0], torch.stack([drawn[0], torch.zeros(DIM), drawn[1]]), rtol=0, atol=0)
    assert not out[1, :2].any()
    out.sum().backward()
    taken = table.take_gradients()
    assert taken is not None
    ids, grads = taken
    assert ids.tolist() == [5, 7, 9] and bool((grads == 1).all())  # (the padding id's row: not pushed)
    bag = psgrad.EmbeddingBag(None, DIM, mode="mean", padding_idx=-1)
    bag.bind("t", DrawnRows())
    torch.testing.assert_close(bag(x), torch.stack([drawn[:2].mean(0), drawn[2]]), rtol=0, atol=0)
    assert psgrad.Embedding(ROWS, DIM, padding_idx=-1).padding_idx == ROWS - 1  # (a table of N rows: as torch)
    for kind in (psgrad.Embedding, psgrad.EmbeddingBag):
        for bad in (-(2**63), -(2**63) + 1, 2**63):
            with pytest.raises(ConfigError, match=f"padding_idx {bad} is not an id a dynamic table holds.*-1 or 0"):
                kind(None, DIM, padding_idx=bad)
        for size in (None, ROWS):
            for wrong in (1.5, True, "0"):
                with pytest.raises(ConfigError, match=f"padding_idx must be an integer \\(a row id\\) or None, got {wrong!r}"):
                    kind(size, DIM, padding_idx=wrong)  # type: ignore[arg-type]


def test_from_pretrained_takes_torch_arguments_in_torch_order() -> None:
    """psgrad's from_pretrained takes torch's positional arguments where torch has them (EmbeddingBag's
    third is max_norm, not mode), psgrad's own (std, seed) by name; a mode in max_norm's place is
    refused naming the fix."""
    vectors = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(3))
    bag_args = (True, None, 2.0, False, "sum", False, False, 2)  # freeze .. padding_idx, as torch orders them
    mine, theirs = psgrad.EmbeddingBag.from_pretrained(vectors, *bag_args), nn.EmbeddingBag.from_pretrained(vectors, *bag_args)
    assert (mine.mode, mine.padding_idx) == ("sum", 2) and (IDS_2D == 2).any()
    torch.testing.assert_close(mine(IDS_2D), theirs(IDS_2D), rtol=0, atol=0)
    table_args = (True, 1, None, 2.0, True, True)  # freeze, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse
    one = psgrad.Embedding.from_pretrained(vectors, *table_args)
    assert (one.padding_idx, one.scale_grad_by_freq, one.sparse) == (1, True, True)
    # (the padding id's output is zeros, as a fresh torch table's: torch's from_pretrained keeps the
    # padding row it is given, so the two agree where that row is zeros; docs/guide/embeddings.md)
    zeroed = vectors.clone()
    zeroed[1] = 0.0
    torch.testing.assert_close(one(IDS_2D), nn.Embedding.from_pretrained(zeroed, *table_args)(IDS_2D), rtol=0, atol=0)
    with pytest.raises(ConfigError, match="the third is max_norm, not mode: pass mode='sum' by name"):
        psgrad.EmbeddingBag.from_pretrained(vectors, True, "sum")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"max_norm=1\.0 is not supported"):
        psgrad.Embedding.from_pretrained(vectors, True, None, 1.0)
    named = psgrad.EmbeddingBag.from_pretrained(vectors, mode="max", std=0.5, seed=3)
    assert (named.mode, named.std, named.seed) == ("max", 0.5, 3)

class Model(nn.Module):
    """A bag table, a plain table and a linear head."""

    def __init__(self, rows: int = ROWS) -> None:
        super().__init__()
        self.bag = psgrad.EmbeddingBag(rows, DIM, mode="sum", std=0.3, seed=1)
        self.one = psgrad.Embedding(rows, DIM, padding_idx=0, std=0.2, seed=2)
        torch.manual_seed(0)
        self.head = nn.Linear(2 * DIM, 1)

    def forward(self, bags: torch.Tensor, one: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.bag(bags), self.one(one)], dim=1)).squeeze(-1)


BAGS, ONE = torch.tensor([[1, 2, 3], [3, 9, 9], [30, 0, 1]]), torch.tensor([0, 5, 39])


def _bound_model() -> tuple[Model, dict[str, LocalRows]]:
    """A Model bound to in-memory tables (named by place, as ps.optimizer names them), some of whose
    rows moved."""
    model = Model()
    sources = {name: _bound(m, name) for name, m in sparse_modules(model)}
    sources["bag"].update([3, 9, 30], 0.25)
    sources["one"].update([5], -0.5)
    return model, sources


def test_state_dict_is_the_tables_handle_and_an_unbound_model_serves_it() -> None:
    model, sources = _bound_model()
    state = model.state_dict()
    assert set(state) == {"head.weight", "head.bias"} | {f"{t}.{k}" for t in ("bag", "one")
                                                         for k in ("ids", "rows", "init", "init_std", "table")}
    assert state["bag.ids"].tolist() == [3, 9, 30] and state["one.ids"].tolist() == [5]
    torch.testing.assert_close(state["bag.rows"], sources["bag"].weight[[3, 9, 30]])
    assert state["bag.init"].tolist() == [ROWS, DIM, 1] and float(state["one.init_std"]) == pytest.approx(0.2)
    assert bytes(state["one.table"].tolist()).decode() == "one"
    # torch.save / torch.load (weights_only, torch's default: the handle is tensors only)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    fresh = Model()
    with pytest.raises(WorkerStateError, match=r"EmbeddingBag\(40, 4\) is not bound to a job.*load_state_dict\(\)"):
        fresh(BAGS, ONE)
    assert fresh.load_state_dict(loaded) is not None
    torch.testing.assert_close(fresh(BAGS, ONE), model(BAGS, ONE), rtol=0, atol=0)
    assert "3 rows loaded" in repr(fresh.bag)
    again = fresh.state_dict()  # a loaded module's state is what it loaded
    assert all(torch.equal(again[k], state[k]) for k in state)
    # a loaded module serves forwards read-only: its rows take no gradient and nothing is kept
    fresh(BAGS, ONE).sum().backward()
    assert fresh.bag.take_gradients() is None and fresh.head.weight.grad is not None


def test_a_fresh_modules_state_is_its_initial_table_and_the_name_travels_with_the_state() -> None:
    model = Model()
    state = model.state_dict()
    assert state["bag.ids"].numel() == 0 and state["bag.rows"].shape == (0, DIM)
    outer = nn.Module()
    outer.tower = Model()
    outer.tower.load_state_dict(state)  # the rows are drawn under the table's name in the state: "bag"
    model.bag.table = "bag"
    torch.testing.assert_close(outer.tower.bag(BAGS), nn.functional.embedding_bag(BAGS, model.bag.initial_weight(), mode="sum"))
    # an export of an older psgrad (no .table entry): the module's place names the table
    export = {k: v for k, v in state.items() if not k.endswith(".table")}
    other = Model()
    other.load_state_dict(export)
    assert other.bag.table == "bag" and other.one.table == "one"


def test_loads_that_cannot_be_honoured_are_refused_by_name() -> None:
    model, _ = _bound_model()
    state = model.state_dict()
    with pytest.raises(ConfigError, match=r"init describes a table of 40 x 4 rows.*is 50 x 4: build it with "
                                          r"num_embeddings=40, embedding_dim=4"):
        Model(rows=50).load_state_dict(state)
    with pytest.raises(ConfigError, match="load_state_dict\\(\\) into EmbeddingBag at 'bag', bound to table 'bag'.*"
                                          "unbound copy.*checkpoints"):
        model.load_state_dict(state)
    duplicated = dict(state, **{"bag.ids": torch.tensor([3, 3, 9]), "bag.rows": torch.zeros(3, DIM)})
    with pytest.raises(ConfigError, match="bag.ids lists a row id more than once"):
        Model().load_state_dict(duplicated)
    with pytest.raises(ConfigError, match="bag.ids: row id 99 is out of range"):
        Model().load_state_dict(dict(state, **{"bag.ids": torch.tensor([3, 9, 99])}))
    with pytest.raises(ConfigError, match=r"bag.rows has shape \[3, 4\], not \[2, 4\]"):
        Model().load_state_dict(dict(state, **{"bag.ids": torch.tensor([3, 9])}))
    # what no state_dict() writes: ids that are not integers (truncated, they named other rows), a
    # std or seed a constructor refuses, a table name that is not text
    for bad, match in (({"bag.ids": torch.tensor([0.9, 2.5, 9.0])}, "bag.ids must be an integer tensor.*torch.float32"),
                       ({"bag.init_std": torch.tensor(-1.0)}, "bag.init_std is -1.0: a table's std is a finite number"),
                       ({"bag.init": torch.tensor([40, 4, -1])}, "bag.init gives the seed -1"),
                       ({"bag.table": torch.tensor([0xFF, 0xFE], dtype=torch.uint8)}, "bag.table is not a table name")):
        with pytest.raises(ConfigError, match=match):
            Model().load_state_dict(dict(state, **bad))
    # strict loading names what is missing and what is extra, as torch does; strict=False skips them
    partial = {k: v for k, v in state.items() if k != "one.rows"}
    partial["one.extra"] = torch.zeros(1)
    with pytest.raises(RuntimeError, match=r'(?s)Missing key\(s\) in state_dict: "one.rows".*Unexpected key\(s\) in '
                                           r'state_dict: "one.extra"'):
        Model().load_state_dict(partial)
    lenient = Model()
    result = lenient.load_state_dict(partial, strict=False)
    assert result.missing_keys == ["one.rows"] and result.unexpected_keys == ["one.extra"]
    assert lenient.bag.stored_rows()[0].tolist() == [3, 9, 30]  # the complete table loaded
    with pytest.raises(WorkerStateError, match="not bound"):
        lenient.one(ONE)  # the incomplete one did not


def test_a_seed_that_is_not_a_64_bit_natural_number_is_refused_when_the_module_is_made() -> None:
    import numpy as np

    for seed in (-1, 2**63, 2.7, "1"):
        with pytest.raises(ConfigError, match=r"seed must be an integer in \[0, 2\*\*63\)"):
            psgrad.Embedding(10, 2, seed=seed)  # type: ignore[arg-type]
    assert psgrad.EmbeddingBag(10, 2, seed=np.int64(2**63 - 1)).seed == 2**63 - 1
    with pytest.raises(ConfigError, match="seed must be"):
        psgrad.EmbeddingBagCollection({"t": (10, 2)}, seed=-3)


def test_a_torch_modules_state_loads_as_every_row_and_a_bound_module_refuses_it() -> None:
    """torch.nn.Embedding's state (`weight`, the whole table) loads into the psgrad module where it
    has the table's shape: every row loaded, served unbound and the job's initial rows once bound;
    a bound module refuses it, naming from_pretrained and loading before ps.optimizer."""
    twin = nn.Module()
    twin.bag, twin.one = nn.EmbeddingBag(ROWS, DIM, mode="sum"), nn.Embedding(ROWS, DIM, padding_idx=0)
    twin.head = nn.Linear(2 * DIM, 1)
    state = twin.state_dict()
    model = Model()
    assert not model.load_state_dict(state).missing_keys  # strict: every key taken
    expected = twin.head(torch.cat([twin.bag(BAGS), twin.one(ONE)], dim=1)).squeeze(-1)
    torch.testing.assert_close(model(BAGS, ONE), expected, rtol=0, atol=0)
    loaded = model.bag.prepare_to_bind()  # (what the chief sends as the job's initial rows)
    assert loaded is not None
    ids, values = loaded
    assert ids.tolist() == list(range(ROWS)) and torch.equal(values, state["bag.weight"])
    with pytest.raises(ConfigError, match=r"bag.weight \(a torch.nn.EmbeddingBag's whole table\) has shape \[40, 4\], "
                                          r"and EmbeddingBag at 'bag' takes \[50 rows, 4\]"):
        Model(rows=50).load_state_dict(state)
    dynamic = psgrad.Embedding(None, DIM, seed=2)
    dynamic.load_state_dict({"weight": state["one.weight"]})  # ids 0..39 loaded, any other initial
    served = dynamic(torch.tensor([3, 10**12]))
    torch.testing.assert_close(served[0], state["one.weight"][3], rtol=0, atol=0)
    initial = rows.initial_rows(rows.table_key(2, ""), torch.tensor([10**12]), DIM, 1.0)[0]  # (named "": no prefix)
    torch.testing.assert_close(served[1], initial, rtol=0, atol=0)
    bound, _ = _bound_model()
    with pytest.raises(ConfigError, match=r"into EmbeddingBag at 'bag', bound to table 'bag'.*torch.nn.EmbeddingBag's "
                                          r"state \(bag.weight\).*before ps.optimizer\(model\).*"
                                          r"psgrad.EmbeddingBag.from_pretrained\(weight\)"):
        bound.load_state_dict(state)


def test_pickles_and_copies_leave_the_binding_and_a_copy_of_a_bound_module_is_unbound() -> None:
    model, sources = _bound_model()
    before = model(BAGS, ONE)
    buffer = io.BytesIO()
    torch.save(model, buffer)  # the whole model: its sources' locks are not pickled
    buffer.seek(0)
    for copied in (torch.load(buffer, weights_only=False), copy.deepcopy(model)):
        with pytest.raises(WorkerStateError, match=r"\(table 'bag'\) is not bound to a job: it is a copy \(copy.deepcopy, "
                                                   r"pickle, torch.save\).*load_state_dict\(\)"):
            copied(BAGS, ONE)
        with pytest.raises(WorkerStateError, match="state_dict\\(\\) of EmbeddingBag.*a copy does not carry the rows.*"
                                                   "Take state_dict\\(\\) of the bound model"):
            copied.state_dict()
        torch.testing.assert_close(copied.head.weight, model.head.weight)
        copied.load_state_dict(model.state_dict())  # the documented way to give a copy its rows
        torch.testing.assert_close(copied(BAGS, ONE), before, rtol=0, atol=0)
        again = copy.deepcopy(copied)  # a loaded module's copy holds its rows
        torch.testing.assert_close(again(BAGS, ONE), before, rtol=0, atol=0)
    torch.testing.assert_close(model(BAGS, ONE), before, rtol=0, atol=0)  # the original is still bound
    assert model.bag._source is sources["bag"]
    rebound = copy.deepcopy(model)
    rebound.bag.bind("bag", sources["bag"])
    rebound.one.bind("one", sources["one"])
    torch.testing.assert_close(rebound(BAGS, ONE), before, rtol=0, atol=0)


def _dense_twin(model: Model) -> nn.Module:
    """The same model with torch.nn tables holding the bound tables' current rows."""
    dense = copy.deepcopy(model)
    for name, m in sparse_modules(model):
        kind = nn.Embedding if isinstance(m, psgrad.Embedding) else nn.EmbeddingBag
        options = {"padding_idx": m.padding_idx} if isinstance(m, psgrad.Embedding) else {"mode": m.mode}
        table = kind(ROWS, DIM, **options)
        with torch.no_grad():
            table.weight.copy_(m._source.weight)  # type: ignore[union-attr]
            if isinstance(m, psgrad.Embedding):
                table.weight[0] = 0
        setattr(dense, name, table)
    return dense


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clip_grad_norm_covers_the_rows_as_torchs_does_a_dense_table(norm_type: float) -> None:
    """Two forwards touching some rows twice: the norm is of the gradient per id (as a dense table
    holds it), and the rows' gradients are scaled with the parameters'."""
    model, _ = _bound_model()
    dense = _dense_twin(model)
    for m in (model, dense):
        (m(BAGS, ONE).square().sum() + m(BAGS[:2], ONE[:2]).sum()).backward()
    max_norm = 0.1
    total = psgrad.clip_grad_norm_(model, max_norm, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(dense.parameters(), max_norm, norm_type)
    torch.testing.assert_close(total, expected)
    assert float(total) > 5 * max_norm  # it clipped
    torch.testing.assert_close(model.head.weight.grad, dense.head.weight.grad)
    for name in ("bag", "one"):
        ids, grads = getattr(model, name).take_gradients()
        torch.testing.assert_close(grads, getattr(dense, name).weight.grad[ids])
    # given tensors, it is torch's: the rows are not in the norm
    model.zero_grad()
    model(BAGS, ONE).sum().backward()
    head_only = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in model.head.parameters()]), norm_type)
    torch.testing.assert_close(psgrad.clip_grad_norm_(model.parameters(), 1e6, norm_type), head_only)


def test_rows_take_gradients_while_autograd_is_on_and_zero_grad_drops_them() -> None:
    """A forward with autograd on takes gradients in eval mode too (torch's tables train there), and
    keeps its rows only while its graph may still be backpropagated (an evaluation forgetting
    torch.no_grad() keeps nothing once its output is gone); zero_grad() of a table or a collection
    drops its rows' gradients, and a backward after it still counts; requires_grad_(False)
    freezes the rows (the collection's: every table's)."""
    mine = psgrad.EmbeddingBag(ROWS, DIM, mode="sum")
    _bound(mine)
    mine.eval()
    out = mine(IDS_2D)
    assert out.requires_grad
    with torch.no_grad():
        assert not mine(IDS_2D).requires_grad
    del out
    assert [t.leaf() for t in mine._touched] == [None]  # gone with its output
    assert mine.take_gradients() is None
    out = mine(IDS_2D)
    mine.zero_grad()  # between a forward and its backward
    out.sum().backward()
    del out  # (the graph is freed by the backward: the leaf is kept for its gradient)
    assert mine.take_gradients() is not None
    mine(IDS_2D).sum().backward()
    mine.zero_grad(set_to_none=False)
    assert mine.take_gradients() is None
    mine.requires_grad_(False)
    assert not mine(IDS_2D).requires_grad and mine.take_gradients() is None

    ebc = psgrad.EmbeddingBagCollection({"a": (ROWS, DIM), "b": (ROWS, DIM)})
    source = LocalRows(torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0)))
    for name, bag in ebc.bags.items():
        bag.bind(f"ebc.bags.{name}", source)
    ebc({"a": IDS_2D, "b": IDS_2D}).sum().backward()
    ebc.zero_grad()
    assert all(bag.take_gradients() is None for bag in ebc.bags.values())
    ebc.requires_grad_(False)
    assert not ebc({"a": IDS_2D, "b": IDS_2D}).requires_grad and not ebc.requires_grad
    ebc.requires_grad_(True)
    ebc({"a": IDS_2D, "b": IDS_2D}).sum().backward()
    assert all(bag.take_gradients() is not None for bag in ebc.bags.values())


def test_bags_pooled_ahead_read_in_one_call_and_keep_rows_only_where_a_backward_reached_them() -> None:
    """pool_ahead: the modules' rows are read in one call of their source, each module's forward
    returns its bags (torch's), and its rows are kept, the graph freed, only where the backward
    reached its output (the pooling's backward says so: no hook a leaf); a pooled forward no
    backward reaches keeps nothing once its outputs are gone; gradients equal torch's."""
    from psgrad.nn.embedding import pool_ahead

    class Counting(LocalRows):
        calls = 0

        def pull_tables(self, lookups: Mapping[str, torch.Tensor], observe: bool, checked: bool = False) -> dict[str, torch.Tensor]:
            self.calls += 1
            return super().pull_tables(lookups, observe)

    bags = [psgrad.EmbeddingBag(ROWS, DIM, mode="sum") for _ in range(3)]
    source = Counting(torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(3)))
    for k, bag in enumerate(bags):
        bag.table = f"t{k}"
        bag.bind(f"t{k}", source)
    inputs = [IDS_2D, IDS_2D + 1, IDS_2D + 2]
    assert pool_ahead([(bag, ids, None) for bag, ids in zip(bags, inputs)]) == bags
    assert source.calls == 1
    outs = [bag(ids) for bag, ids in zip(bags, inputs)]
    assert source.calls == 1  # (each forward served what was pooled)
    expected = [nn.functional.embedding_bag(ids, source.weight, mode="sum") for ids in inputs]
    assert all(torch.equal(out, e) for out, e in zip(outs, expected))
    (outs[0] * 2 + outs[1]).sum().backward()  # (the third output unused)
    del outs
    got = [bag.take_gradients() for bag in bags]
    assert got[2] is None
    for scale, ids, taken in zip((2.0, 1.0), inputs, got):
        assert taken is not None
        weight = source.weight.clone().requires_grad_()
        (nn.functional.embedding_bag(ids, weight, mode="sum") * scale).sum().backward()
        assert torch.equal(taken[0], torch.unique(ids)) and torch.equal(taken[1], weight.grad[taken[0]])
    assert pool_ahead([(bag, ids, None) for bag, ids in zip(bags, inputs)]) == bags
    outs = [bag(ids) for bag, ids in zip(bags, inputs)]
    del outs  # (an evaluation with autograd on: no backward)
    assert all(t.leaf() is None for bag in bags for t in bag._touched)
    assert all(bag.take_gradients() is None for bag in bags)


def test_bags_pooled_ahead_as_a_group_take_one_gradient_and_each_module_still_has_its_own() -> None:
    """Rows pool_ahead reads for several modules in one call are one leaf: one gradient accumulated
    for the group, each module's rows' gradient its part of it (a view, no copy). Each module
    still acts as a table of its own, as torch's separate tables do: zero_grad() of one drops its
    gradient alone, a backward after it gives it only the new one, clip_grad_norm_ counts each
    part once, and the step's rows_pushed() lets the group go."""
    from psgrad.nn.embedding import pool_ahead

    source = LocalRows(torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(3)))
    bags = nn.ModuleList(psgrad.EmbeddingBag(ROWS, DIM, mode="sum") for _ in range(3))
    for k, bag in enumerate(bags):
        bag.table = f"t{k}"
        bag.bind(f"t{k}", source)
    twins = nn.ModuleList(nn.EmbeddingBag.from_pretrained(source.weight.clone(), freeze=False, mode="sum") for _ in bags)
    inputs = [IDS_2D, IDS_2D + 1, IDS_2D + 5]
    assert pool_ahead([(bag, ids, None) for bag, ids in zip(bags, inputs)]) == list(bags)
    leaf = bags[0]._touched[0].leaf()
    assert leaf is not None and all(len(bag._touched) == 1 and bag._touched[0].leaf() is leaf for bag in bags)
    losses = [sum(scale * m(ids).square().sum() for scale, m, ids in zip((2.0, 1.0, 3.0), ms, inputs))
              for ms in (bags, twins)]
    for loss in losses:
        loss.backward(retain_graph=True)

    def same_as_torch() -> None:
        for bag, twin, ids in zip(bags, twins, inputs):
            got = bag.row_gradients()
            assert got is not None and torch.equal(got.ids, torch.unique(ids))
            torch.testing.assert_close(got.grads, twin.weight.grad[got.ids])
            assert got.grads.untyped_storage().data_ptr() == leaf.grad.untyped_storage().data_ptr()  # (a view)

    same_as_torch()
    bags[1].zero_grad()
    twins[1].zero_grad()
    assert bags[1].row_gradients() is None and bags[0].row_gradients() is not None
    for loss in losses:  # (the same graph again: table 1 gets this backward's gradient only, the others add)
        loss.backward()
    same_as_torch()
    total = psgrad.clip_grad_norm_(bags, 0.5)
    torch.testing.assert_close(total, torch.nn.utils.clip_grad_norm_(twins.parameters(), 0.5))
    assert float(total) > 1.0  # (it clipped)
    same_as_torch()
    for bag in bags:
        bag.rows_pushed()
    assert all(not bag._touched for bag in bags)


def test_a_group_read_as_one_block_is_pooled_from_that_block_as_its_leaf() -> None:
    """Where the read of a group's rows wrote them one after another in one tensor (PulledRows.blocks,
    as the client's reads do), that tensor is the group's leaf as it is (no part looked at, none
    copied); the outputs and gradients are those of the same rows read table by table."""
    from psgrad.core.rows import PulledRows
    from psgrad.nn.embedding import pool_ahead

    weight = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(5))
    inputs = [IDS_2D, IDS_2D + 2, IDS_2D + 4]
    blocks: list[torch.Tensor] = []

    def read(asked: dict[str, torch.Tensor], whole: bool) -> PulledRows:
        names = tuple(asked)
        block = torch.cat([weight[ids] for ids in asked.values()])
        parts = dict(zip(names, block.split_with_sizes([int(i.numel()) for i in asked.values()])))
        blocks.append(block)
        return PulledRows(parts, {}, {names: block} if whole else {})

    results = []
    for whole in (True, False):
        bags = [psgrad.EmbeddingBag(ROWS, DIM, mode="sum") for _ in inputs]
        source = LocalRows(weight)  # (one source: the group's modules are one job's)
        for k, bag in enumerate(bags):
            bag.table = f"t{k}"
            bag.bind(f"t{k}", source)
        assert pool_ahead([(bag, ids, None) for bag, ids in zip(bags, inputs)], lambda asked: read(asked, whole)) == bags
        leaf = bags[0]._touched[0].leaf()
        assert (leaf is blocks[-1]) is whole
        outs = [bag(ids) for bag, ids in zip(bags, inputs)]
        sum(o.square().sum() * (k + 1) for k, o in enumerate(outs)).backward()
        results.append((outs, [bag.row_gradients() for bag in bags]))
    (outs_a, grads_a), (outs_b, grads_b) = results
    for a, b in zip(outs_a, outs_b):
        assert torch.equal(a, b)
    for a, b in zip(grads_a, grads_b):
        assert a is not None and b is not None and torch.equal(a.ids, b.ids) and torch.equal(a.grads, b.grads)


def bound_bags(count: int, seed: int) -> list[psgrad.EmbeddingBag]:
    """`count` sum bags t0, t1, ... bound to one source of random rows (one job's tables)."""
    source = LocalRows(torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(seed)))
    bags = [psgrad.EmbeddingBag(ROWS, DIM, mode="sum") for _ in range(count)]
    for k, bag in enumerate(bags):
        bag.table = f"t{k}"
        bag.bind(f"t{k}", source)
    return bags


def test_bags_pooled_ahead_keep_no_unique_ids_and_an_id_out_of_range_is_refused_naming_its_table() -> None:
    """pool_ahead serves the forwards itself: the modules do not keep the unique ids it computed
    (for a later unique_ids of the same tensor), yet each module's ids are checked against its
    range, and an id out of it is refused as the module's own forward refuses it."""
    from psgrad.nn.embedding import pool_ahead

    bags = bound_bags(3, 8)
    inputs = [IDS_2D, IDS_2D + 1, IDS_2D + 2]
    assert pool_ahead([(bag, ids, None) for bag, ids in zip(bags, inputs)]) == bags
    assert all(bag._last_unique is None for bag in bags)
    for bag, ids in zip(bags, inputs):
        bag(ids)
    bad = IDS_2D.clone()
    bad[0, 0] = ROWS
    with pytest.raises(InvalidRequestError) as pooled:
        pool_ahead([(bags[0], IDS_2D, None), (bags[1], bad, None)])
    with pytest.raises(InvalidRequestError) as own:
        bags[1](bad)
    assert str(pooled.value) == str(own.value) and "table 't1'" in str(own.value)


def test_a_steps_row_gradients_of_a_whole_group_in_order_are_handed_over_as_the_groups_gradient() -> None:
    """step_rows: the row gradients of modules pooled as one group, each its one part, in the
    group's order, are the group's gradient whole (what the push splits by shard as it is), each
    module's part what its row_gradients() gives; not where a module's gradient was dropped, the
    modules come in another order, or one module of the group is missing: then each module's
    own, the same gradients."""
    from psgrad.nn.embedding import pool_ahead, step_rows

    bags = bound_bags(3, 6)
    inputs = [IDS_2D, IDS_2D + 1, IDS_2D + 7]
    assert pool_ahead([(bag, ids, None) for bag, ids in zip(bags, inputs)]) == bags
    sum(bag(ids).square().sum() for bag, ids in zip(bags, inputs)).backward()
    leaf = bags[0]._touched[0].leaf()
    assert leaf is not None and leaf.grad is not None
    named = [(f"t{k}", bag) for k, bag in enumerate(bags)]

    def each(modules: list[tuple[str, psgrad.EmbeddingBag]]) -> dict[str, tuple[torch.Tensor, torch.Tensor, dict[int, int]]]:
        return {name: (g.ids, g.grads, g.bases) for name, m in modules for g in [m.row_gradients()] if g is not None}

    def same(got: Any, modules: list[tuple[str, psgrad.EmbeddingBag]]) -> bool:
        own = each(modules)
        return (list(got.gradients) == list(own) and got.bases == {n: b for n, (_, _, b) in own.items()}
                and all(torch.equal(got.gradients[n][0], i) and torch.equal(got.gradients[n][1], g)
                        for n, (i, g, _) in own.items()))

    got = step_rows(named)
    assert list(got.gradients.blocks) == [("t0", "t1", "t2")] and got.gradients.blocks[("t0", "t1", "t2")] is leaf.grad
    assert same(got, named) and got.unused == []
    for modules in (named[::-1], named[:2]):  # (another order; a part of the group missing)
        got = step_rows(modules)
        assert got.gradients.blocks == {} and same(got, modules)
    bags[1].zero_grad()
    got = step_rows(named)
    assert got.gradients.blocks == {} and same(got, named) and got.unused == ["t1"]  # (one module's gradient dropped)


def test_a_frozen_module_pooled_with_others_takes_no_gradient_and_all_frozen_take_no_leaf() -> None:
    """A frozen module whose bags are pooled with others' (one read, one leaf for the group) keeps
    no rows and has no gradient to push, as its own forward would; the others' gradients are
    torch's. Where every module of the group is frozen, the rows are no leaf: the outputs need no
    backward."""
    from psgrad.nn.embedding import pool_ahead

    source = LocalRows(torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(4)))
    bags = [psgrad.EmbeddingBag(ROWS, DIM, mode="mean") for _ in range(3)]
    for k, bag in enumerate(bags):
        bag.table = f"t{k}"
        bag.bind(f"t{k}", source)
    bags[1].requires_grad_(False)
    inputs = [IDS_2D, IDS_2D + 3, IDS_2D + 6]
    assert pool_ahead([(bag, ids, None) for bag, ids in zip(bags, inputs)]) == bags
    sum(bag(ids).sum() for bag, ids in zip(bags, inputs)).backward()  # type: ignore[union-attr]
    assert not bags[1]._touched and bags[1].take_gradients() is None and not bags[1].reached()
    for k in (0, 2):
        got = bags[k].take_gradients()
        weight = source.weight.clone().requires_grad_()
        nn.functional.embedding_bag(inputs[k], weight, mode="mean").sum().backward()
        assert got is not None and torch.equal(got[0], torch.unique(inputs[k]))
        torch.testing.assert_close(got[1], weight.grad[got[0]])
    for bag in bags:
        bag.requires_grad_(False)
    assert pool_ahead([(bag, ids, None) for bag, ids in zip(bags, inputs)]) == bags
    outs = [bag(ids) for bag, ids in zip(bags, inputs)]
    assert not any(out.requires_grad for out in outs) and not any(bag._touched for bag in bags)


def test_initial_weight_is_refused_until_the_module_knows_the_name_its_rows_are_drawn_under() -> None:
    """A fresh module's rows are drawn under its name in the job (its place in the model), which it
    learns when bound: initial_weight() before that is refused naming the fix (it drew under "",
    a table no job serves). Bound, it is the job's draw; after load_state_dict(), the draw under
    the state's name (what a job started from it draws the rows the state does not list under),
    loaded rows not included; from_pretrained alone names no table, and the message says the
    embeddings are the rows."""

    model = Model()
    with pytest.raises(WorkerStateError, match=r"initial_weight\(\).*not bound.*ps\.optimizer\(model\)"):
        model.bag.initial_weight()
    state = model.state_dict()  # (a fresh model's state names its tables by their places: "bag")
    drawn = rows.initial_rows(rows.table_key(model.bag.seed, "bag"), torch.arange(ROWS), DIM, model.bag.std)
    outer = nn.Module()
    outer.tower = Model()
    outer.tower.load_state_dict(state)
    assert torch.equal(outer.tower.bag.initial_weight(), drawn)
    _bound(model.bag, "bag")
    assert torch.equal(model.bag.initial_weight(), drawn)
    pretrained = psgrad.EmbeddingBag.from_pretrained(torch.ones(ROWS, DIM))
    with pytest.raises(WorkerStateError, match="from_pretrained: every row a job starts from is the embeddings"):
        pretrained.initial_weight()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_the_tables_follow_the_models_dtype_conversions_as_torchs_do(dtype: torch.dtype) -> None:
    """model.double() / .half() / .bfloat16() / .to(dtype) convert psgrad's tables as torch's: a
    forward returns that dtype (computed on the float32 rows, then cast), per-sample weights of it
    are taken as torch's module takes them, and the rows' gradients stay float32 (what the push
    sends); .float() converts back, and a device move leaves the dtype."""
    tolerance = {torch.float64: 1e-6, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    weights = torch.rand(IDS_1D.shape, generator=torch.Generator().manual_seed(2)) + 0.5
    for kind, options, args in [
        (psgrad.Embedding, {"padding_idx": 2}, (IDS_2D,)),
        (psgrad.EmbeddingBag, {"mode": "sum"}, (IDS_1D, OFFSETS, weights)),
        (psgrad.EmbeddingBag, {"mode": "max"}, (IDS_2D,)),
        (psgrad.EmbeddingBag, {"mode": "mean"}, (IDS_2D,)),
    ]:
        mine = kind(ROWS, DIM, **options)
        _bound(mine)
        theirs = _torch_twin(mine, getattr(nn, kind.__name__), **options)
        holder = nn.ModuleDict({"t": mine})
        assert holder.to(dtype) is holder and mine.dtype == dtype
        mine.to("cpu")  # (a device move: the dtype stays)
        theirs.to(dtype)
        cast = [a.to(dtype) if a.is_floating_point() else a for a in args]
        out, expected = mine(*cast), theirs(*cast)
        assert out.dtype == expected.dtype == dtype, kind
        torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)
        out.float().square().sum().backward()
        expected.float().square().sum().backward()
        ids, grads = mine.take_gradients()  # type: ignore[misc]
        assert grads.dtype == torch.float32
        torch.testing.assert_close(grads, theirs.weight.grad.float()[ids], rtol=10 * tolerance, atol=10 * tolerance)
        holder.float()
        assert mine.dtype == torch.float32 and mine(*args).dtype == torch.float32
    ebc = psgrad.EmbeddingBagCollection({"a": (ROWS, DIM), "b": (ROWS, DIM)}, mode="sum")
    source = LocalRows(torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(0)))
    for name, bag in ebc.bags.items():
        bag.bind(f"ebc.bags.{name}", source)
    assert ebc.to(dtype)({"a": IDS_2D, "b": IDS_2D}).dtype == dtype


def test_ids_and_offsets_of_other_dtypes_are_taken_or_refused_as_torch_does_with_messages_that_name_them() -> None:
    """torch's EmbeddingBag takes ids of any integer dtype and bool (converted), so the bags (and a
    collection's) do too, with the same output as int64 ids; torch's Embedding takes int64 and
    int32 only, and the refusal names them and the conversion. Float offsets are named as offsets
    (torch's error names its `indices`); integer offsets of another dtype are taken, as torch does."""
    bag = psgrad.EmbeddingBag(ROWS, DIM, mode="sum")
    one = psgrad.Embedding(ROWS, DIM)
    ebc = psgrad.EmbeddingBagCollection({"a": (ROWS, DIM)}, mode="sum")
    for module, table in ((bag, "bag"), (one, "one"), (ebc.bags["a"], "ebc.bags.a")):
        _bound(module, table)
    for dtype in (torch.int16, torch.int8, torch.uint8, torch.bool):
        ids = (IDS_1D % 2 if dtype == torch.bool else IDS_1D).to(dtype)
        for offsets in (OFFSETS, OFFSETS.to(dtype if dtype != torch.bool else torch.int16)):
            torch.testing.assert_close(bag(ids, offsets), bag(ids.long(), OFFSETS), rtol=0, atol=0)
        torch.testing.assert_close(ebc({"a": (ids, OFFSETS)}), ebc({"a": (ids.long(), OFFSETS)}), rtol=0, atol=0)
        with pytest.raises(InvalidRequestError, match=r"table 'one': row ids must be an integer tensor \(int64 or int32, as "
                                                      r"torch.nn.Embedding takes; convert others with ids.long\(\)\)"):
            one(ids)
    for module in (bag, ebc):
        with pytest.raises(InvalidRequestError, match=r"table '(bag|ebc.bags.a)': row ids must be an integer tensor "
                                                      r"\(int64, int32, int16, int8, uint8 or bool.*got torch.float32"):
            module({"a": (IDS_1D.float(), OFFSETS)} if module is ebc else IDS_1D.float(), *([] if module is ebc else [OFFSETS]))
        for mode in ("sum", "max"):  # (the compiled pooling's path and torch's)
            bag.mode = mode
            with pytest.raises(InvalidRequestError, match=r"'(bag|ebc.bags.a)': bag offsets must be an integer tensor.*"
                                                          r"got torch.float64"):
                module({"a": (IDS_1D, OFFSETS.double())}) if module is ebc else module(IDS_1D, OFFSETS.double())
        bag.mode = "sum"


def test_bag_shapes_and_weights_torch_refuses_are_refused_naming_the_table_before_a_row_is_read() -> None:
    """What torch's embedding_bag refuses with a message of its own (2-D ids with offsets, 1-D ids
    without, offsets or ids of other ranks, per-sample weights not one per id, or with a mode other
    than sum) is refused by psgrad's bags naming the table and what to pass, before the rows are
    read; torch refuses each of them too, and the valid calls beside them still compute."""
    bag = psgrad.EmbeddingBag(ROWS, DIM, mode="mean")
    source = _bound(bag, "bag")
    reads = []
    pull = source.pull_tables
    source.pull_tables = lambda lookups, observe, checked=False: reads.append(1) or pull(lookups, observe, checked)  # type: ignore[method-assign]
    theirs = nn.EmbeddingBag(ROWS, DIM, mode="mean")
    refused = [((IDS_2D, OFFSETS), r"2-D ids are one bag per row and take no offsets: pass offsets=None"),
               ((IDS_1D,), r"1-D ids need offsets, where each bag starts"),
               ((IDS_1D, OFFSETS.view(2, 2)), r"bag offsets must be 1-D, one per bag, got 2-D \[2, 2\]"),
               ((IDS_1D.view(1, 1, 9), None), r"ids must be 1-D \(with offsets\) or 2-D \(one bag per row\), got 3-D")]
    for args, message in refused:
        with pytest.raises(InvalidRequestError, match=r"table 'bag': " + message):
            bag(*args)
        with pytest.raises((ValueError, RuntimeError)):
            theirs(*args)
    with pytest.raises(ConfigError, match=r"table 'bag': per_sample_weights need mode 'sum'.*mode is 'mean': build it "
                                          r"with mode='sum'"):
        bag(IDS_1D, OFFSETS, torch.ones(9))
    with pytest.raises(NotImplementedError):
        theirs(IDS_1D, OFFSETS, torch.ones(9))
    bag.mode = theirs.mode = "sum"
    for weights, got in ((torch.ones(8), r"torch.float32 \[8\]"), (torch.ones(9, dtype=torch.int64), r"torch.int64 \[9\]")):
        with pytest.raises(InvalidRequestError, match=r"table 'bag': per_sample_weights must be a floating-point tensor "
                                                      r"shaped as the ids \[9\], got " + got):
            bag(IDS_1D, OFFSETS, weights)
        with pytest.raises((ValueError, RuntimeError)):
            theirs(IDS_1D, OFFSETS, weights)
    assert not reads
    with torch.no_grad():
        theirs.weight.copy_(bag.initial_weight())
    weights = torch.linspace(0.5, 2.0, 9)
    torch.testing.assert_close(bag(IDS_1D, OFFSETS, weights), theirs(IDS_1D, OFFSETS, weights))
    assert reads
