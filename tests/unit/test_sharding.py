"""Pure tests of psgrad.core.sharding: the shard plan, pieces, fingerprint and param_specs."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import psgrad.config as config_module
from psgrad.config import JobSpec
from psgrad.errors import ConfigError
from psgrad.core.sharding import ParamSpec, fingerprint, frozen_ranges, param_specs, plan_shards

pytestmark = pytest.mark.timeout(60)

shapes = st.lists(st.integers(min_value=1, max_value=40), min_size=0, max_size=3).map(tuple)
param_lists = st.lists(shapes, min_size=1, max_size=8).map(
    lambda ss: [ParamSpec(f"layer{i}.weight", s, "float32") for i, s in enumerate(ss)]
)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _check_plan(params: list[ParamSpec], num_shards: int) -> None:
    total = sum(_numel(p.shape) for p in params)
    plan = plan_shards(params, num_shards)
    assert plan.total == total
    assert plan.num_shards == num_shards == len(plan.ranges)
    # Contiguous cover of [0, total), every shard non-empty.
    assert plan.ranges[0][0] == 0
    assert plan.ranges[-1][1] == total
    for (_, end), (start, _) in zip(plan.ranges, plan.ranges[1:]):
        assert end == start
    sizes = [plan.size(i) for i in range(num_shards)]
    assert sizes == [e - s for s, e in plan.ranges]
    assert min(sizes) >= 1
    assert max(sizes) - min(sizes) <= 1
    assert sum(sizes) == total
    # Pieces: each shard's pieces add up to its size, and every parameter is covered exactly once, in order.
    covered: dict[str, list[tuple[int, int]]] = {p.name: [] for p in params}
    for i in range(num_shards):
        pieces = plan.pieces(params, i)
        assert sum(hi - lo for _, lo, hi in pieces) == plan.size(i)
        for name, lo, hi in pieces:
            assert 0 <= lo < hi
            covered[name].append((lo, hi))
    for p in params:
        spans = covered[p.name]
        position = 0
        for lo, hi in spans:
            assert lo == position, f"{p.name}: gap or overlap at {position} ({spans})"
            position = hi
        assert position == _numel(p.shape), f"{p.name} not fully covered: {spans}"


@settings(max_examples=150, deadline=None)
@given(params=param_lists, data=st.data())
def test_plan_properties(params: list[ParamSpec], data: st.DataObject) -> None:
    total = sum(_numel(p.shape) for p in params)
    num_shards = data.draw(st.integers(min_value=1, max_value=min(total, 64)))
    _check_plan(params, num_shards)


@settings(max_examples=50, deadline=None)
@given(params=param_lists, data=st.data())
def test_plan_is_deterministic_and_depends_only_on_sizes(params: list[ParamSpec], data: st.DataObject) -> None:
    total = sum(_numel(p.shape) for p in params)
    num_shards = data.draw(st.integers(min_value=1, max_value=min(total, 16)))
    a = plan_shards(params, num_shards)
    b = plan_shards(list(params), num_shards)
    assert a == b
    renamed = [ParamSpec(f"other{i}", p.shape, "float16") for i, p in enumerate(params)]
    assert plan_shards(renamed, num_shards).ranges == a.ranges


@settings(max_examples=50, deadline=None)
@given(params=param_lists, extra=st.integers(min_value=1, max_value=50))
def test_more_shards_than_elements_is_refused(params: list[ParamSpec], extra: int) -> None:
    total = sum(_numel(p.shape) for p in params)
    with pytest.raises(ConfigError) as info:
        plan_shards(params, total + extra)
    assert str(total) in str(info.value) and str(total + extra) in str(info.value)


def test_plan_examples() -> None:
    params = [ParamSpec("a", (10,), "float32")]
    assert plan_shards(params, 1).ranges == ((0, 10),)
    assert plan_shards(params, 3).ranges == ((0, 3), (3, 6), (6, 10))
    assert plan_shards(params, 10).ranges == tuple((i, i + 1) for i in range(10))


def test_big_tensor_is_split_across_shards() -> None:
    params = [
        ParamSpec("emb.weight", (100, 8), "float32"),  # 800 elements
        ParamSpec("head.weight", (4, 8), "float32"),  # 32
        ParamSpec("head.bias", (4,), "float32"),  # 4
    ]
    plan = plan_shards(params, 4)  # 836 elements, 209 per shard
    holders = [i for i in range(4) if any(name == "emb.weight" for name, _, _ in plan.pieces(params, i))]
    assert len(holders) >= 2
    assert holders == [0, 1, 2, 3]
    assert plan.pieces(params, 0) == [("emb.weight", 0, 209)]
    assert plan.pieces(params, 3) == [("emb.weight", 627, 800), ("head.weight", 0, 32), ("head.bias", 0, 4)]
    _check_plan(params, 4)


def test_scalar_and_zero_size_params() -> None:
    params = [
        ParamSpec("scale", (), "float32"),
        ParamSpec("empty", (0, 5), "float32"),
        ParamSpec("w", (3,), "float32"),
    ]
    plan = plan_shards(params, 2)
    assert plan.total == 4
    pieces = [plan.pieces(params, i) for i in range(2)]
    assert pieces == [[("scale", 0, 1), ("w", 0, 1)], [("w", 1, 3)]]


@pytest.mark.parametrize("num_shards", [0, -1, -5])
def test_nonpositive_shard_count_is_refused(num_shards: int) -> None:
    with pytest.raises(ConfigError) as info:
        plan_shards([ParamSpec("w", (10,), "float32")], num_shards)
    assert str(num_shards) in str(info.value)
    assert "num_shards" in str(info.value)


def test_fewer_elements_than_shards_message() -> None:
    with pytest.raises(ConfigError) as info:
        plan_shards([ParamSpec("w", (3,), "float32")], 5)
    msg = str(info.value)
    assert "3" in msg and "5" in msg


def test_empty_model_is_refused() -> None:
    with pytest.raises(ConfigError):
        plan_shards([], 1)
    assert plan_shards([], 2, tables=True).ranges == ((0, 0), (0, 0))  # (a model of tables alone)


def test_a_job_with_tables_may_have_shards_without_dense_elements() -> None:
    """Every shard holds a part of a job's table rows, so a dense part smaller than the shard count
    (a recommender's bias, or none) leaves some shards without dense elements, where a job without
    tables is refused."""
    params = [ParamSpec("bias", (1,), "float32")]
    plan = plan_shards(params, 3, tables=True)
    assert plan.total == 1 and plan.ranges == ((0, 0), (0, 0), (0, 1))
    assert [plan.pieces(params, i) for i in range(3)] == [[], [], [("bias", 0, 1)]]
    with pytest.raises(ConfigError, match="1 trainable elements, fewer than 3 shards: a server would hold nothing"):
        plan_shards(params, 3)


# ----------------------------------------------------------------------------- fingerprint
BASE_PARAMS = (
    ParamSpec("fc1.weight", (16, 8), "float32"),
    ParamSpec("fc1.bias", (16,), "float32"),
)
BASE_SPEC = JobSpec()


def test_fingerprint_is_stable() -> None:
    a = fingerprint(BASE_PARAMS, BASE_SPEC)
    b = fingerprint(list(BASE_PARAMS), JobSpec())
    assert a == b
    assert isinstance(a, str) and len(a) >= 16
    int(a, 16)  # hexadecimal


@pytest.mark.parametrize(
    "params",
    [
        (ParamSpec("fc1.W", (16, 8), "float32"), BASE_PARAMS[1]),  # name
        (ParamSpec("fc1.weight", (8, 16), "float32"), BASE_PARAMS[1]),  # shape, same numel
        (ParamSpec("fc1.weight", (128,), "float32"), BASE_PARAMS[1]),  # rank
        (ParamSpec("fc1.weight", (16, 8), "float16"), BASE_PARAMS[1]),  # dtype
        (BASE_PARAMS[1], BASE_PARAMS[0]),  # order
        BASE_PARAMS[:1],  # one parameter fewer
    ],
    ids=["name", "shape", "rank", "dtype", "order", "count"],
)
def test_fingerprint_changes_with_params(params: tuple[ParamSpec, ...]) -> None:
    assert fingerprint(params, BASE_SPEC) != fingerprint(BASE_PARAMS, BASE_SPEC)


# field -> (spec to change, value): each change touches exactly that one field of a valid spec.
# staleness is only valid with mode "ssp", so it is changed on an ssp spec.
SSP_SPEC = JobSpec(mode="ssp")
ADAM_SPEC = JobSpec(optimizer="adam")
SPEC_CHANGES = {
    "mode": (BASE_SPEC, "sync"),
    "staleness": (SSP_SPEC, 3),
    "num_workers": (BASE_SPEC, 4),
    "optimizer": (BASE_SPEC, "adam"),
    "lr": (BASE_SPEC, 0.05),
    "momentum": (BASE_SPEC, 0.9),
    "weight_decay": (BASE_SPEC, 1e-4),
    "wire_dtype": (BASE_SPEC, "bfloat16"),
    "num_shards": (BASE_SPEC, 2),
    "staleness_lr": (BASE_SPEC, True),
    "beta1": (ADAM_SPEC, 0.8),
    "beta2": (ADAM_SPEC, 0.99),
    "eps": (ADAM_SPEC, 1e-6),
    "nesterov": (JobSpec(momentum=0.9), True),
    "lr_decay": (JobSpec(optimizer="adagrad"), 0.01),
    "initial_accumulator_value": (JobSpec(optimizer="adagrad"), 0.1),
    "alpha": (JobSpec(optimizer="rmsprop"), 0.9),
    "centered": (JobSpec(optimizer="rmsprop"), True),
    "rho": (JobSpec(optimizer="adadelta"), 0.8),
    "dc_asgd": (JobSpec(), 0.04),
    "dc_asgd_adaptive": (JobSpec(dc_asgd=2.0), True),
    "backup_workers": (JobSpec(mode="sync", num_workers=3), 1),
    "staleness_max": (SSP_SPEC, 4),
    "compress": (BASE_SPEC, "topk:0.01"),
    "error_feedback": (JobSpec(compress="sign"), False),
    "tables_mode": (JobSpec(mode="sync", num_workers=2), "async"),
}


def test_spec_changes_cover_every_field() -> None:
    names = {f.name for f in dataclasses.fields(JobSpec)}
    assert names == set(SPEC_CHANGES), "a JobSpec field was added: extend SPEC_CHANGES"


@pytest.mark.parametrize("field, change", list(SPEC_CHANGES.items()), ids=list(SPEC_CHANGES))
def test_fingerprint_changes_with_each_spec_field(field: str, change: tuple[JobSpec, object]) -> None:
    base, value = change
    other = dataclasses.replace(base, **{field: value})
    assert base.differences(other) == [(field, getattr(base, field), value)]
    assert fingerprint(BASE_PARAMS, other) != fingerprint(BASE_PARAMS, base)


def test_fingerprint_distinguishes_every_mode_and_staleness_bound() -> None:
    specs = [JobSpec(mode=m) for m in config_module.MODES] + [JobSpec(mode="ssp", staleness=s) for s in (1, 2, 8)]
    specs += [dataclasses.replace(spec, staleness_lr=True) for spec in specs]
    prints = {fingerprint(BASE_PARAMS, spec) for spec in specs}
    assert len(prints) == len(specs) == 2 * (len(config_module.MODES) + 3)
    assert set(config_module.MODES) == {"async", "ssp", "sync"}


def test_fingerprint_of_ssp_staleness_is_stable() -> None:
    a = fingerprint(BASE_PARAMS, JobSpec(mode="ssp", staleness=2, staleness_lr=True))
    assert a == fingerprint(list(BASE_PARAMS), JobSpec(mode="ssp", staleness=2, staleness_lr=True))


# ----------------------------------------------------------------------------- param_specs
class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.zeta = torch.nn.Linear(3, 2)  # registered first despite its name
        self.frozen = torch.nn.Parameter(torch.zeros(5), requires_grad=False)
        self.alpha = torch.nn.Conv1d(2, 4, kernel_size=3, bias=False)
        self.scale = torch.nn.Parameter(torch.ones((), dtype=torch.float64))


def test_param_specs_follows_named_parameters_and_skips_frozen() -> None:
    net = _Net()
    specs = param_specs(net)
    # Own parameters come before submodules' in named_parameters(); registration order otherwise.
    assert specs == [
        ParamSpec("scale", (), "float64"),
        ParamSpec("zeta.weight", (2, 3), "float32"),
        ParamSpec("zeta.bias", (2,), "float32"),
        ParamSpec("alpha.weight", (4, 2, 3), "float32"),
    ]
    assert [s.name for s in specs] == [n for n, p in net.named_parameters() if p.requires_grad]
    assert [s.numel for s in specs] == [1, 6, 2, 24]
    assert all(isinstance(d, int) for s in specs for d in s.shape)


def test_param_specs_sees_requires_grad_changes() -> None:
    net = _Net()
    net.zeta.bias.requires_grad_(False)
    names = [s.name for s in param_specs(net)]
    assert names == ["scale", "zeta.weight", "alpha.weight"]
    net.frozen.requires_grad_(True)
    names = [s.name for s in param_specs(net)]
    assert names == ["frozen", "scale", "zeta.weight", "alpha.weight"]


def test_frozen_parameters_are_a_space_of_their_own_split_over_the_shards() -> None:
    """param_specs(frozen=True) lists the frozen parameters as param_specs lists the trainable ones;
    frozen_ranges splits them like the flat space, but a shard's range may be empty; the fingerprint
    names them only when the servers keep some (a job without keeps the one it always had)."""
    net = _Net()
    net.zeta.requires_grad_(False)
    frozen = param_specs(net, frozen=True)
    assert [s.name for s in frozen] == ["frozen", "zeta.weight", "zeta.bias"]
    assert [s.name for s in param_specs(net)] == ["scale", "alpha.weight"]
    assert frozen_ranges(frozen, 2) == ((0, 6), (6, 13))
    assert frozen_ranges(frozen[2:], 3) == ((0, 0), (0, 1), (1, 2))
    assert frozen_ranges([], 2) == ((0, 0), (0, 0))
    trainable = param_specs(net)
    assert fingerprint(trainable, BASE_SPEC, (), ()) == fingerprint(trainable, BASE_SPEC)
    assert fingerprint(trainable, BASE_SPEC, (), frozen) != fingerprint(trainable, BASE_SPEC)
