"""What psgrad.EmbeddingBagCollection takes, as TorchRec's EmbeddingBagCollection does: a
KeyedJaggedTensor whose keys of no feature are ignored, its weights as is_weighted says (refused,
never silently applied or dropped, where it is False), its to_dict() of JaggedTensors, several
features looking up one table (feature_names); torch's options it does not take refused by name;
and each of a table's errors naming it one way. TorchRec's types are emulated (their methods, as in
torchrec 1.8): the tests do not need torchrec."""
from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import psgrad
from psgrad.errors import ConfigError, InvalidRequestError

pytestmark = pytest.mark.timeout(60)


class JaggedTensor:
    """TorchRec's JaggedTensor, as a KeyedJaggedTensor's to_dict() gives them."""

    def __init__(self, values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        self._values, self._lengths, self._weights = values, lengths, weights

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        return torch.cat([torch.zeros(1, dtype=self._lengths.dtype), self._lengths.cumsum(0)])

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def weights(self) -> torch.Tensor:
        assert self._weights is not None  # (TorchRec's raises too)
        return self._weights


class KeyedJaggedTensor:
    """TorchRec's KeyedJaggedTensor: keys, then values, lengths (and weights) key after key."""

    def __init__(self, features: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                 weights: Mapping[str, torch.Tensor] | None = None) -> None:
        self._keys = list(features)
        self._values = torch.cat([v for v, _ in features.values()])
        self._lengths = torch.cat([n for _, n in features.values()])
        self._weights = None if weights is None else torch.cat([weights[k] for k in self._keys])
        self._features, self._by_key = features, weights

    def keys(self) -> list[str]:
        return self._keys

    def values(self) -> torch.Tensor:
        return self._values

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def weights(self) -> torch.Tensor:
        assert self._weights is not None
        return self._weights

    def to_dict(self) -> dict[str, JaggedTensor]:
        return {k: JaggedTensor(v, n, None if self._by_key is None else self._by_key[k])
                for k, (v, n) in self._features.items()}


class Rows:
    """A RowSource serving fixed rows of every table (the job's servers' part), counting pulls."""

    def __init__(self, tables: Mapping[str, torch.Tensor]) -> None:
        self.tables, self.pulls = tables, []

    def pull_tables(self, lookups: Mapping[str, torch.Tensor], observe: bool, checked: bool = False) -> dict[str, torch.Tensor]:
        self.pulls.append({name: ids.clone() for name, ids in lookups.items()})
        return {name: self.tables[name][ids].clone() for name, ids in lookups.items()}

    def updated_rows(self, table: str) -> tuple[torch.Tensor, torch.Tensor]:
        raise AssertionError("not read here")


GEN = torch.Generator().manual_seed(3)
TABLES = {"ebc.bags.a": torch.randn(20, 4, generator=GEN), "ebc.bags.b": torch.randn(30, 2, generator=GEN)}
A = (torch.tensor([1, 2, 19, 4]), torch.tensor([2, 0, 2]))  # (values, lengths): 3 bags
B = (torch.tensor([5, 5, 6]), torch.tensor([1, 1, 1]))
WEIGHTS = {"a": torch.tensor([0.5, -2.0, 3.0, 1.5]), "b": torch.tensor([1.0, 2.0, 0.25])}


def bound(mode: str = "sum", **options: object) -> tuple[psgrad.EmbeddingBagCollection, Rows]:
    ebc = psgrad.EmbeddingBagCollection({"a": (20, 4), "b": (30, 2)}, mode=mode, **options)  # type: ignore[arg-type]
    source = Rows(TABLES)
    for name, bag in ebc.bags.items():
        bag.bind(f"ebc.bags.{name}", source)  # type: ignore[operator]
    return ebc, source


def torchs(name: str, mode: str, weighted: bool = False) -> torch.Tensor:
    values, lengths = {"a": A, "b": B}[name]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
    return F.embedding_bag(values, TABLES[f"ebc.bags.{name}"], offsets, mode=mode,
                           per_sample_weights=WEIGHTS[name] if weighted else None)


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_a_keyed_jagged_tensors_keys_of_no_feature_are_ignored_as_torchrecs_and_a_dicts_refused(mode: str) -> None:
    """TorchRec's collection looks up its features' keys of a KeyedJaggedTensor and ignores the
    others (a batch carrying features for several modules); psgrad's refused them ("unknown
    ['other']"). A dict's unknown feature stays refused: there it is a misspelt name."""
    ebc, _ = bound(mode)
    expected = torch.cat([torchs("a", mode), torchs("b", mode)], dim=1)
    with torch.no_grad():
        assert torch.equal(ebc(KeyedJaggedTensor({"a": A, "b": B})), expected)
        extra = KeyedJaggedTensor({"other": (torch.tensor([7, 8]), torch.tensor([0, 2, 0])), "b": B, "a": A})
        assert torch.equal(ebc(extra), expected)
    with pytest.raises(ConfigError, match="missing \\['b'\\]"):
        ebc(KeyedJaggedTensor({"a": A, "other": B}))
    offsets = torch.tensor([0, 2, 2])
    with pytest.raises(ConfigError, match="unknown \\['c'\\].*a dict's are refused"):
        ebc({"a": (A[0], offsets), "b": (B[0], torch.arange(3)), "c": (A[0], offsets)})


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_a_weighted_keyed_jagged_tensor_is_refused_by_an_unweighted_collection_naming_is_weighted(mode: str) -> None:
    """TorchRec's unweighted collection (is_weighted=False, its default and psgrad's) ignores a
    KeyedJaggedTensor's weights; psgrad applied them in mode sum and refused them in mean. Neither
    silently now: refused, naming is_weighted=True (and its to_dict()'s JaggedTensors alike)."""
    ebc, _ = bound(mode)
    assert ebc.is_weighted() is False
    weighted = KeyedJaggedTensor({"a": A, "b": B}, WEIGHTS)
    for features in (weighted, weighted.to_dict()):
        with pytest.raises(ConfigError, match="weights given .*not weighted: build it with is_weighted=True"):
            ebc(features)


def test_a_weighted_collection_weighs_a_keyed_jagged_tensors_ids_as_torchs_per_sample_weights() -> None:
    ebc, _ = bound(is_weighted=True)
    assert ebc.is_weighted() is True
    expected = torch.cat([torchs("a", "sum", weighted=True), torchs("b", "sum", weighted=True)], dim=1)
    weighted = KeyedJaggedTensor({"a": A, "b": B}, WEIGHTS)
    with torch.no_grad():
        assert torch.equal(ebc(weighted), expected)
        assert torch.equal(ebc(weighted.to_dict()), expected)
        # a dict's triples: applied (float64 weights as float32 ones: torch's pooling raised a RuntimeError)
        triples = {"a": (A[0], torch.tensor([0, 2, 2]), WEIGHTS["a"].double()), "b": (B[0], torch.arange(3), WEIGHTS["b"])}
        assert torch.equal(ebc(triples), expected)
        assert torch.equal(bound()[0](triples), expected)
    with pytest.raises(ConfigError, match="no weights given .*is_weighted=True"):
        ebc(KeyedJaggedTensor({"a": A, "b": B}))
    with pytest.raises(ConfigError, match="is_weighted=True needs mode 'sum'"):
        psgrad.EmbeddingBagCollection({"a": (20, 4)}, mode="mean", is_weighted=True)


def test_a_keyed_jagged_tensors_to_dict_of_jagged_tensors_is_taken() -> None:
    """kjt.to_dict(): a dict of JaggedTensors (values(), lengths(), offsets(), weights_or_none()),
    which was refused, pools as the KeyedJaggedTensor does."""
    ebc, _ = bound("mean")
    with torch.no_grad():
        assert torch.equal(ebc(KeyedJaggedTensor({"a": A, "b": B}).to_dict()),
                           torch.cat([torchs("a", "mean"), torchs("b", "mean")], dim=1))
    with pytest.raises(ConfigError, match="feature 'a': lengths add up to 3, but there are 4 ids"):
        ebc({"a": JaggedTensor(A[0], torch.tensor([1, 1, 1])), "b": JaggedTensor(*B)})


def test_features_sharing_a_table_pool_from_it_and_pull_its_rows_once() -> None:
    """TorchRec's feature_names: a two-tower model's history and candidate items look up one table.
    Each feature has its columns (the table's features in order); the forward pulls the table's
    rows once, for both features' unique ids; its row gradients are the sum of both features'."""
    ebc = psgrad.EmbeddingBagCollection({"item": (20, 4), "b": (30, 2)}, mode="sum",
                                        feature_names={"item": ["history", "candidate"]})
    assert ebc.features == ["history", "candidate", "b"] and ebc.output_dim == 10
    assert list(ebc.bags) == ["item", "b"]
    items = torch.randn(20, 4, generator=torch.Generator().manual_seed(1))
    source = Rows({"m.item": items, "m.b": TABLES["ebc.bags.b"]})
    ebc.bags["item"].bind("m.item", source)  # type: ignore[operator]
    ebc.bags["b"].bind("m.b", source)  # type: ignore[operator]
    history = (torch.tensor([1, 2, 3, 3]), torch.tensor([0, 2]))
    candidate = (torch.tensor([3, 7]), torch.tensor([0, 1]))
    out = ebc(KeyedJaggedTensor({"candidate": (candidate[0], torch.tensor([1, 1])), "b": B[:1] + (torch.tensor([2, 1]),),
                                 "history": (history[0], torch.tensor([2, 2]))}))
    assert len(source.pulls) == 1 and torch.equal(source.pulls[0]["m.item"], torch.tensor([1, 2, 3, 7]))
    reference = nn.Parameter(items.clone())
    expected = torch.cat([F.embedding_bag(history[0], reference, history[1], mode="sum"),
                          F.embedding_bag(candidate[0], reference, candidate[1], mode="sum"),
                          F.embedding_bag(B[0], TABLES["ebc.bags.b"], torch.tensor([0, 2]), mode="sum")], dim=1)
    torch.testing.assert_close(out, expected)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    out.backward(grad_out)
    expected.backward(grad_out)
    taken = ebc.bags["item"].take_gradients()  # type: ignore[operator]
    assert taken is not None and torch.equal(taken[0], torch.tensor([1, 2, 3, 7]))
    torch.testing.assert_close(taken[1], reference.grad[taken[0]])  # type: ignore[index]
    with torch.no_grad():  # a dict takes the same features
        torch.testing.assert_close(ebc({"history": history, "candidate": candidate, "b": (B[0], torch.tensor([0, 2]))}),
                                   expected.detach())
    for feature_names, message in [({"c": ["x"]}, "names table\\(s\\) \\['c'\\]"),
                                   ({"item": ["b"]}, "feature 'b' looks up two tables"),
                                   ({"item": []}, "a list of one feature or more")]:
        with pytest.raises(ConfigError, match=message):
            psgrad.EmbeddingBagCollection({"item": (20, 4), "b": (30, 2)}, feature_names=feature_names)


@pytest.mark.parametrize("option, value", [("padding_idx", 0), ("include_last_offset", True), ("max_norm", 1.0),
                                           ("scale_grad_by_freq", True)])
def test_torchs_options_a_collection_does_not_take_are_refused_naming_what_to_do(option: str, value: object) -> None:
    """They raised a bare TypeError (unexpected keyword argument)."""
    with pytest.raises(ConfigError, match=f"EmbeddingBagCollection takes no {option}=: .*"
                                          f"{'clip_grad_norm_' if option == 'max_norm' else 'psgrad.EmbeddingBag'}"):
        psgrad.EmbeddingBagCollection({"a": (10, 4)}, **{option: value})  # type: ignore[arg-type]
    psgrad.EmbeddingBagCollection({"a": (10, 4)}, sparse=True)  # (accepted: changes nothing, as for EmbeddingBag)
    with pytest.raises(TypeError, match="unexpected keyword argument 'moed'"):
        psgrad.EmbeddingBagCollection({"a": (10, 4)}, moed="sum")  # type: ignore[call-arg]
    for name in ("items", "a.b", ""):  # (torch's ModuleDict raised a bare KeyError)
        with pytest.raises(ConfigError, match=f"table {name!r}: a table's name is the name of its module.*Rename "
                                              "the table.*its features may keep any name"):
            psgrad.EmbeddingBagCollection({name: (20, 4)})
    # the guide's two-tower example, and features named as ModuleDict's attributes: any feature name
    shared = psgrad.EmbeddingBagCollection({"item": (20, 4)}, feature_names={"item": ["history", "candidate"]})
    assert shared.features == ["history", "candidate"]
    odd = psgrad.EmbeddingBagCollection({"item": (20, 4)}, feature_names={"item": ["items", "type"]})
    assert odd.features == ["items", "type"]


@pytest.mark.parametrize("mode", ["sum", "max"])
def test_a_tables_errors_name_it_as_the_job_does(mode: str) -> None:
    """Bad offsets named the table by its feature ('a'), an id out of range by its name in the job
    ('ebc.bags.a'): both name it 'ebc.bags.a' now, as psgrad status does."""
    ebc, _ = bound(mode)
    b = (B[0], torch.arange(3))
    with pytest.raises(InvalidRequestError, match="^table 'ebc.bags.a': bag offsets must start at 0"):
        ebc({"a": (A[0], torch.tensor([1, 2, 2])), "b": b})
    with pytest.raises(InvalidRequestError, match="^table 'ebc.bags.a': row id 20 is out of range"):
        ebc({"a": (torch.tensor([1, 20]), torch.tensor([0, 1, 1])), "b": b})
    with pytest.raises(InvalidRequestError, match="^table 'ebc.bags.a': row ids must be an integer tensor"):
        ebc({"a": (torch.tensor([1.0, 2.0]), torch.tensor([0, 1, 1])), "b": b})


def test_ids_and_offsets_of_shapes_that_make_no_bags_are_refused_naming_the_feature_before_the_batch_sizes() -> None:
    """2-D ids with offsets, 1-D ids without, and 2-D offsets are refused naming the feature and
    what to pass (they were told as features of different batch sizes, or in torch's words
    without the feature), before a row is read; the same ids laid out right are pooled."""
    ebc, source = bound()
    b = (B[0], torch.arange(3))
    for a, message in (((torch.tensor([[1, 2], [3, 4], [5, 6]]), torch.arange(3)), r"ids with offsets must be 1-D.*"
                        r"got ids \[3, 2\] and offsets \[3\] \(2-D ids are a bag per row: pass them without offsets\)"),
                       ((A[0], torch.tensor([[0, 2, 2]])), r"ids with offsets must be 1-D and the offsets 1-D, one per "
                        r"bag, got ids \[4\] and offsets \[1, 3\]"),
                       ((torch.tensor([1, 2, 3]), None), r"ids without offsets are one bag per row, so 2-D, got 1-D "
                        r"\[3\]: pass \(ids, offsets\) for 1-D ids")):
        with pytest.raises(ConfigError, match=r"^feature 'a': " + message):
            ebc({"a": a, "b": b})
    assert not source.pulls
    out = ebc({"a": (A[0], torch.tensor([0, 2, 2])), "b": b})
    torch.testing.assert_close(out, torch.cat([torchs("a", "sum"), torchs("b", "sum")], dim=1))
    two_d = ebc({"a": torch.tensor([[1, 2], [19, 4], [0, 0]]), "b": (B[0].view(3, 1), None)})
    assert two_d.shape == (3, 6) and len(source.pulls) == 2


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_tables_of_one_width_are_read_as_one_leaf_pushed_whole_and_equal_torch(mode: str) -> None:
    """A training forward of a collection whose tables are of one width (a feature each, plain
    bags, int64 offsets) reads every table's rows as one tensor, one leaf whose parts the tables
    keep (where a leaf per table took a gradient each), and the step's row gradients are that
    leaf's gradient whole; the output and each table's gradient are torch's. Other inputs (int32
    offsets) take the tables one by one, with the same results; a read-only forward keeps
    nothing; a batch of no bags gives no rows and pushes nothing."""
    from psgrad.nn.embedding import RowsPart, Touched, step_rows

    gen = torch.Generator().manual_seed(5)
    weights = {"ebc.bags.a": torch.randn(20, 4, generator=gen), "ebc.bags.b": torch.randn(30, 4, generator=gen)}
    ebc = psgrad.EmbeddingBagCollection({"a": (20, 4), "b": (30, 4)}, mode=mode)
    source = Rows(weights)
    for name, bag in ebc.bags.items():
        bag.bind(f"ebc.bags.{name}", source)  # type: ignore[operator]
    named = [(f"ebc.bags.{name}", bag) for name, bag in ebc.bags.items()]
    a_off, b_off = torch.tensor([0, 2, 2]), torch.tensor([0, 1, 2])
    grad_out = torch.randn(3, 8, generator=gen)
    theirs = {name: w.clone().requires_grad_() for name, w in weights.items()}
    expected = torch.cat([F.embedding_bag(A[0], theirs["ebc.bags.a"], a_off, mode=mode),
                          F.embedding_bag(B[0], theirs["ebc.bags.b"], b_off, mode=mode)], dim=1)
    (expected * grad_out).sum().backward()
    for offsets, kind in ((torch.int64, RowsPart), (torch.int32, Touched)):
        out = ebc({"a": (A[0], a_off.to(offsets)), "b": (B[0], b_off.to(offsets))})
        assert all(len(bag._touched) == 1 and type(bag._touched[0]) is kind for _, bag in named)  # type: ignore[union-attr]
        torch.testing.assert_close(out, expected)
        (out * grad_out).sum().backward()
        got = step_rows(named)
        whole = [grad for grad in got.gradients.blocks.values()]
        assert len(whole) == (1 if kind is RowsPart else 0) and len(source.pulls) == 1  # (one read either way)
        for name, (ids, grad) in got.gradients.items():
            torch.testing.assert_close(grad, theirs[name].grad[ids])  # type: ignore[index]
        if whole:
            assert torch.equal(whole[0], torch.cat([got.gradients[name][1] for name, _ in named]))
        ebc.zero_grad()
        assert step_rows(named).gradients == {}
        for _, bag in named:
            bag.rows_pushed()  # (as a step does)
        source.pulls.clear()
    with torch.no_grad():
        torch.testing.assert_close(ebc({"a": (A[0], a_off), "b": (B[0], b_off)}), expected)
    assert all(not bag._touched for _, bag in named) and len(source.pulls) == 1  # type: ignore[union-attr]
    empty = ebc({"a": (A[0][:0], a_off[:0]), "b": (B[0][:0], b_off[:0])})
    assert empty.shape == (0, 8)
    empty.sum().backward()
    got = step_rows(named)
    assert got.gradients == {} and got.unused == []
