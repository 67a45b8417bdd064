"""Pure tests of psgrad.core.optimizers: SGD (Nesterov too), Adam(W), Adagrad, RMSprop and Adadelta
match torch.optim's; their state round trips; the registry."""
from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch

from psgrad.config import OPTIMIZER_NAMES, JobSpec
from psgrad.core.optimizer_settings import DECLS, EXACT, LAZY
from psgrad.errors import ConfigError
from psgrad.core.optimizers import OPTIMIZERS, SGD, Adadelta, Adagrad, Adam, RMSprop, ShardOptimizer, make_optimizer

pytestmark = pytest.mark.timeout(60)

NUMEL = 1000
STEPS = 5


def _reference(w0: torch.Tensor, grads: list[torch.Tensor], **kw: float) -> torch.Tensor:
    param = torch.nn.Parameter(w0.clone())
    opt = torch.optim.SGD([param], **kw)
    for g in grads:
        param.grad = g.clone()
        opt.step()
    return param.detach()


def _data(seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(NUMEL, generator=gen)
    grads = [torch.randn(NUMEL, generator=gen) * (i + 1) for i in range(STEPS)]
    return w0, grads


GRID = list(itertools.product([0.1, 0.01], [0.0, 0.5, 0.9], [0.0, 1e-2, 0.3]))


@pytest.mark.parametrize("lr, momentum, weight_decay", GRID)
@pytest.mark.parametrize("via_registry", [False, True], ids=["direct", "make_optimizer"])
def test_sgd_matches_torch(lr: float, momentum: float, weight_decay: float, via_registry: bool) -> None:
    w0, grads = _data(seed=int(lr * 1000 + momentum * 10 + weight_decay * 100))
    expected = _reference(w0, grads, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if via_registry:
        opt = make_optimizer(JobSpec(lr=lr, momentum=momentum, weight_decay=weight_decay), NUMEL)
    else:
        opt = SGD(NUMEL, lr, momentum, weight_decay)
    w = w0.clone()
    for g in grads:
        opt.apply(w, g.clone())  # grad is scratch space: hand over a copy
    assert not torch.equal(w, w0)
    assert torch.allclose(w, expected, rtol=1e-6, atol=1e-7), (w - expected).abs().max()


def test_sgd_plain_step_is_w_minus_lr_g() -> None:
    w = torch.tensor([1.0, -2.0, 3.0])
    SGD(3, lr=0.5).apply(w, torch.tensor([2.0, 2.0, -4.0]))
    assert w.tolist() == [0.0, -3.0, 5.0]


@pytest.mark.parametrize(
    "nesterov, after",
    [
        # Hand-computed: v1 = g1 = 1, w = 0 - 1*1 = -1; v2 = 0.5*1 + 3 = 3.5, w = -1 - 3.5 = -4.5.
        (False, (-1.0, -4.5)),
        # Nesterov steps along g + 0.5 v: 1 + 0.5 = 1.5, w = -1.5; then 3 + 0.5*3.5 = 4.75, w = -6.25.
        (True, (-1.5, -6.25)),
    ],
    ids=["heavy-ball", "nesterov"],
)
def test_momentum_buffer_starts_at_the_first_gradient(nesterov: bool, after: tuple[float, float]) -> None:
    opt = SGD(1, lr=1.0, momentum=0.5, nesterov=nesterov)
    w = torch.zeros(1)
    opt.apply(w, torch.tensor([1.0]))
    assert w.item() == after[0]
    opt.apply(w, torch.tensor([3.0]))
    assert w.item() == after[1]


def test_lr_scale() -> None:
    w0, grads = _data(seed=1)
    a, b = w0.clone(), w0.clone()
    SGD(NUMEL, lr=0.2).apply(a, grads[0].clone(), lr_scale=0.5)
    SGD(NUMEL, lr=0.1).apply(b, grads[0].clone())
    assert torch.allclose(a, b, rtol=1e-6)


def test_state_bytes() -> None:
    plain = SGD(NUMEL, lr=0.1)
    plain.apply(torch.zeros(NUMEL), torch.ones(NUMEL))
    assert plain.state_bytes() == 0
    heavy = SGD(NUMEL, lr=0.1, momentum=0.9)
    assert heavy.state_bytes() == 0
    heavy.apply(torch.zeros(NUMEL), torch.ones(NUMEL))
    assert heavy.state_bytes() == NUMEL * 4


def test_momentum_buffer_does_not_alias_the_gradient() -> None:
    opt = SGD(2, lr=1.0, momentum=0.9)
    w = torch.zeros(2)
    g = torch.ones(2)
    opt.apply(w, g)
    g.fill_(100.0)  # the caller reuses its receive buffer for the next push
    opt.apply(w, torch.zeros(2))
    # v2 = 0.9 * 1 + 0 = 0.9; w = -1 - 0.9
    assert torch.allclose(w, torch.full((2,), -1.9))


def test_make_optimizer_refuses_unknown_name() -> None:
    with pytest.raises(ConfigError) as info:
        make_optimizer(JobSpec(optimizer="lamb"), 10)
    msg = str(info.value)
    assert "'lamb'" in msg
    for name in ("sgd", "adam", "adamw", "adagrad", "rmsprop", "adadelta"):
        assert name in msg


def test_registry_and_config_list_the_same_names() -> None:
    assert sorted(OPTIMIZERS) == sorted(OPTIMIZER_NAMES)


# ----------------------------------------------------------------------------- Adam / AdamW
def _torch_adam(
    w0: torch.Tensor, grads: list[torch.Tensor], decoupled: bool, lr_scales: list[float] | None = None, **kw: float
) -> torch.Tensor:
    param = torch.nn.Parameter(w0.clone())
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    lr = kw.pop("lr")
    opt = cls([param], lr=lr, betas=(kw.pop("beta1"), kw.pop("beta2")), foreach=False, **kw)
    for i, g in enumerate(grads):
        opt.param_groups[0]["lr"] = lr * (lr_scales[i] if lr_scales else 1.0)
        param.grad = g.clone()
        opt.step()
    return param.detach()


ADAM_GRID = [
    # lr, beta1, beta2, eps, weight_decay
    (1e-3, 0.9, 0.999, 1e-8, 0.0),
    (1e-2, 0.9, 0.999, 1e-8, 1e-2),
    (0.1, 0.5, 0.98, 1e-6, 0.3),
    (1e-3, 0.0, 0.0, 1e-8, 0.0),  # no moment averaging: sign-like steps
    (3e-3, 0.99, 0.9999, 1e-3, 1e-4),
]


@pytest.mark.parametrize("lr, beta1, beta2, eps, weight_decay", ADAM_GRID)
@pytest.mark.parametrize("decoupled", [False, True], ids=["adam", "adamw"])
@pytest.mark.parametrize("block", [NUMEL, 128, 7], ids=["one-block", "block128", "block7"])
def test_adam_matches_torch(
    lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, decoupled: bool, block: int
) -> None:
    w0, grads = _data(seed=int(lr * 1e4 + beta1 * 10 + weight_decay * 100))
    grads += [g * 1e-3 for g in grads]  # small gradients after large ones: the bias correction matters
    expected = _torch_adam(
        w0, grads, decoupled, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay
    )
    opt = Adam(NUMEL, lr, beta1, beta2, eps, weight_decay, decoupled=decoupled, block=block)
    w = w0.clone()
    for g in grads:
        opt.apply(w, g.clone())
    assert not torch.equal(w, w0)
    assert torch.allclose(w, expected, rtol=1e-6, atol=1e-7), (w - expected).abs().max()


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adam_from_the_registry_matches_torch(name: str) -> None:
    spec = JobSpec(optimizer=name, lr=0.01, beta1=0.8, beta2=0.99, eps=1e-7, weight_decay=0.05)
    opt = make_optimizer(spec, NUMEL)
    assert isinstance(opt, Adam)
    w0, grads = _data(seed=3)
    expected = _torch_adam(
        w0, grads, name == "adamw", lr=0.01, beta1=0.8, beta2=0.99, eps=1e-7, weight_decay=0.05
    )
    w = w0.clone()
    for g in grads:
        opt.apply(w, g.clone())
    assert torch.allclose(w, expected, rtol=1e-6, atol=1e-7), (w - expected).abs().max()


@pytest.mark.parametrize("decoupled", [False, True], ids=["adam", "adamw"])
def test_adam_lr_scale_is_a_per_step_learning_rate(decoupled: bool) -> None:
    w0, grads = _data(seed=4)
    scales = [1.0, 0.5, 0.25, 1.0, 1 / 3]
    expected = _torch_adam(
        w0, grads, decoupled, lr_scales=scales, lr=0.01, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1
    )
    opt = Adam(NUMEL, 0.01, weight_decay=0.1, decoupled=decoupled, block=300)
    w = w0.clone()
    for g, s in zip(grads, scales):
        opt.apply(w, g.clone(), lr_scale=s)
    assert torch.allclose(w, expected, rtol=1e-6, atol=1e-7), (w - expected).abs().max()


def test_adam_first_step_is_lr_times_sign() -> None:
    # Hand-computed: after one step m_hat = g and v_hat = g*g, so the step is lr * g / (|g| + eps).
    opt = Adam(3, lr=0.5, eps=1e-12)
    w = torch.zeros(3)
    opt.apply(w, torch.tensor([2.0, -0.001, 1e4]))
    assert torch.allclose(w, torch.tensor([-0.5, 0.5, -0.5]), rtol=1e-6)


def test_adam_state_is_allocated_once_and_reused() -> None:
    numel, block = 1000, 256
    opt = Adam(numel, lr=1e-3, block=block)
    assert opt.state_bytes() == (2 * numel + block) * 4  # both moments and a block of scratch
    assert Adam(10, lr=1e-3, block=256).state_bytes() == (2 * 10 + 10) * 4  # scratch never exceeds numel
    before = [opt.exp_avg.data_ptr(), opt.exp_avg_sq.data_ptr(), opt._denom.data_ptr()]
    w, g = torch.zeros(numel), torch.ones(numel)
    for _ in range(3):
        opt.apply(w, g.clone())
    assert [opt.exp_avg.data_ptr(), opt.exp_avg_sq.data_ptr(), opt._denom.data_ptr()] == before
    assert opt.state_bytes() == (2 * numel + block) * 4
    assert opt.steps == 3


def _largest_allocation_of_a_second_apply(opt: ShardOptimizer, numel: int) -> int:
    """Bytes of the largest allocation torch's profiler sees while opt applies a gradient (its
    state already made by a first apply)."""
    from torch.profiler import ProfilerActivity, profile

    w, g = torch.randn(numel), torch.randn(numel)
    opt.apply(w, g)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        opt.apply(w, g)
    return max((e.cpu_memory_usage for e in prof.events()), default=0)


def test_adam_apply_allocates_nothing_large() -> None:
    from torch.profiler import ProfilerActivity, profile

    numel = 200_000
    largest = _largest_allocation_of_a_second_apply(Adam(numel, lr=1e-3, weight_decay=0.01, block=1 << 14), numel)
    assert largest < 1024, f"apply allocated {largest} bytes at once (P is {numel * 4} bytes)"
    w = torch.randn(numel)
    # The check itself can fail: the same profile around an out-of-place op sees its allocation.
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        (w * 2).sum()
    assert max(e.cpu_memory_usage for e in prof.events()) >= numel * 4


@pytest.mark.parametrize("cls", [Adam, Adagrad, RMSprop, Adadelta])
def test_a_zero_block_is_refused(cls: type) -> None:
    with pytest.raises(ConfigError, match="block must be >= 1, got 0"):
        cls(10, lr=1e-3, block=0)


@pytest.mark.parametrize(
    "spec",
    [
        JobSpec(lr=0.1, momentum=0.9), JobSpec(lr=0.1, momentum=0.9, nesterov=True), JobSpec(optimizer="adam", lr=0.01),
        JobSpec(optimizer="adamw", lr=0.01, weight_decay=0.1),
        JobSpec(optimizer="adagrad", lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
        JobSpec(optimizer="rmsprop", lr=0.01, momentum=0.9, centered=True),
        JobSpec(optimizer="adadelta", lr=1.0, weight_decay=0.01),
    ],
    ids=["momentum", "nesterov", "adam", "adamw", "adagrad", "rmsprop", "adadelta"],
)
def test_state_dict_round_trip_continues_bit_for_bit(spec: JobSpec) -> None:
    gen = torch.Generator().manual_seed(3)
    a, w_a = make_optimizer(spec, 40), torch.randn(40, generator=gen)
    for _ in range(3):
        a.apply(w_a, torch.randn(40, generator=gen))
    b, w_b = make_optimizer(spec, 40), w_a.clone()
    b.load_state_dict(a.state_dict())
    g = torch.randn(40, generator=gen)
    a.apply(w_a, g.clone())
    b.apply(w_b, g.clone())
    assert torch.equal(w_a, w_b)


def test_state_dict_is_a_copy() -> None:
    opt = make_optimizer(JobSpec(optimizer="adam", lr=0.01), 8)
    opt.apply(torch.zeros(8), torch.ones(8))
    state = opt.state_dict()
    opt.apply(torch.zeros(8), torch.ones(8))
    assert state["step"] == 1 and not torch.equal(state["exp_avg"], opt.state_dict()["exp_avg"])  # type: ignore[arg-type]


def test_plain_sgd_state_is_empty_and_restores_to_empty() -> None:
    opt = make_optimizer(JobSpec(lr=0.1), 8)
    assert opt.state_dict() == {}
    opt.load_state_dict({})
    assert opt.state_bytes() == 0


# ----------------------------------------------------------------------------- Nesterov, Adagrad, RMSprop, Adadelta
def _torch_run(
    cls: type[torch.optim.Optimizer], w0: torch.Tensor, grads: list[torch.Tensor], scales: list[float] | None = None,
    **kw: object,
) -> torch.Tensor:
    """torch.optim's single-tensor rule over the gradients; scales[i] multiplies the lr of step i."""
    param = torch.nn.Parameter(w0.clone())
    opt = cls([param], foreach=False, **kw)  # type: ignore[call-arg]
    lr = opt.param_groups[0]["lr"]
    for i, g in enumerate(grads):
        opt.param_groups[0]["lr"] = lr * (scales[i] if scales else 1.0)
        param.grad = g.clone()
        opt.step()
    return param.detach()


# (torch class, JobSpec fields, the same settings as torch's keyword arguments)
TORCH_CASES = {
    "sgd-nesterov": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True}, {}),
    "sgd-nesterov-decay": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.5, "nesterov": True, "weight_decay": 0.01}, {}),
    "adagrad": (torch.optim.Adagrad, {"optimizer": "adagrad", "lr": 0.01, "eps": 1e-10}, {}),
    "adagrad-all": (torch.optim.Adagrad, {"optimizer": "adagrad", "lr": 0.1, "lr_decay": 0.05, "weight_decay": 0.01,
                                          "initial_accumulator_value": 0.1, "eps": 1e-6}, {}),
    "rmsprop": (torch.optim.RMSprop, {"optimizer": "rmsprop", "lr": 0.01}, {}),
    "rmsprop-momentum": (torch.optim.RMSprop, {"optimizer": "rmsprop", "lr": 0.01, "momentum": 0.9,
                                               "weight_decay": 0.01, "alpha": 0.9}, {}),
    "rmsprop-centered": (torch.optim.RMSprop, {"optimizer": "rmsprop", "lr": 0.003, "centered": True, "eps": 1e-6}, {}),
    "rmsprop-centered-momentum": (torch.optim.RMSprop, {"optimizer": "rmsprop", "lr": 0.01, "centered": True,
                                                        "momentum": 0.5, "weight_decay": 0.1}, {}),
    "adadelta": (torch.optim.Adadelta, {"optimizer": "adadelta", "lr": 1.0, "eps": 1e-6}, {}),
    "adadelta-decay": (torch.optim.Adadelta, {"optimizer": "adadelta", "lr": 0.5, "rho": 0.8, "eps": 1e-5,
                                              "weight_decay": 0.05}, {}),
}


def _torch_kwargs(fields: dict[str, object]) -> dict[str, object]:
    return {k: v for k, v in fields.items() if k != "optimizer"}


def _spec(fields: dict[str, object]) -> JobSpec:
    return JobSpec(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("case", TORCH_CASES)
@pytest.mark.parametrize("block", [NUMEL, 128, 7], ids=["one-block", "block128", "block7"])
def test_the_new_rules_match_torch_bit_for_bit(case: str, block: int) -> None:
    cls, fields, _ = TORCH_CASES[case]
    w0, grads = _data(seed=len(case))
    grads += [g * 1e-3 for g in grads]  # small gradients after large ones: the running averages matter
    expected = _torch_run(cls, w0, grads, **_torch_kwargs(fields))
    opt = make_optimizer(_spec(fields), NUMEL)
    if block != NUMEL and hasattr(opt, "_block"):
        opt._block = block  # type: ignore[attr-defined]
    w = w0.clone()
    for g in grads:
        opt.apply(w, g.clone())
    assert not torch.equal(w, w0)
    assert torch.equal(w, expected), (w - expected).abs().max()


@pytest.mark.parametrize("case", TORCH_CASES)
def test_lr_scale_is_a_per_step_learning_rate_for_the_new_rules(case: str) -> None:
    """--staleness-lr scales each step's lr: the same as torch with that lr on that step."""
    cls, fields, _ = TORCH_CASES[case]
    w0, grads = _data(seed=5)
    scales = [1.0, 0.5, 0.25, 1.0, 1 / 3]
    expected = _torch_run(cls, w0, grads, scales, **_torch_kwargs(fields))
    opt = make_optimizer(_spec(fields), NUMEL)
    w = w0.clone()
    for g, s in zip(grads, scales):
        opt.apply(w, g.clone(), lr_scale=s)
    assert torch.equal(w, expected), (w - expected).abs().max()


@pytest.mark.parametrize("case", TORCH_CASES)
def test_the_new_rules_allocate_their_state_once(case: str) -> None:
    _, fields, _ = TORCH_CASES[case]
    opt = make_optimizer(_spec(fields), NUMEL)
    assert opt.elementwise() is None  # stateful: applied in place once a push is whole
    w, g = torch.zeros(NUMEL), torch.ones(NUMEL)
    opt.apply(w, g.clone())
    held = opt.state_bytes()
    floats = {"sgd": 1, "adagrad": 2, "rmsprop": 2 + bool(fields.get("centered")) + bool(fields.get("momentum")),
              "adadelta": 4}[str(fields.get("optimizer", "sgd"))]
    assert held == floats * NUMEL * 4
    opt.apply(w, g.clone())
    assert opt.state_bytes() == held


def test_nesterov_without_momentum_is_refused() -> None:
    with pytest.raises(ConfigError, match="nesterov needs momentum"):
        SGD(4, lr=0.1, nesterov=True)


@pytest.mark.parametrize("case", ["adagrad-all", "rmsprop-centered-momentum", "adadelta-decay"])
def test_the_new_rules_apply_without_allocating(case: str) -> None:
    numel = 200_000
    opt = make_optimizer(_spec(TORCH_CASES[case][1]), numel)
    opt._block = 1 << 14  # type: ignore[attr-defined]
    largest = _largest_allocation_of_a_second_apply(opt, numel)
    assert largest < 1024, f"apply allocated {largest} bytes at once (P is {numel * 4} bytes)"


# --------------------------------------------------------------------------- row forms, per setting
# A value away from its default for every setting an optimizer declares (optimizer_settings.DECLS).
ROW_VALUES = {"momentum": 0.9, "weight_decay": 0.01, "nesterov": True, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6,
              "lr_decay": 0.1, "initial_accumulator_value": 0.1, "alpha": 0.9, "centered": True, "rho": 0.8}
ROW_CASES = [(name, setting) for name, decl in DECLS.items() for setting in ("lr", *decl.settings)]


def _row_spec(name: str, setting: str) -> JobSpec:
    own: dict[str, object] = {"optimizer": name, "lr": 0.05}
    if setting != "lr":
        own[setting] = ROW_VALUES[setting]
    if setting == "nesterov":
        own["momentum"] = 0.9
    return JobSpec(**own)  # type: ignore[arg-type]


def _row_updates(num: int, dim: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Five updates of 7 of `num` rows each (different rows each time; row 0 in every one)."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(5):
        ids = torch.cat([torch.tensor([0]), 1 + torch.randperm(num - 1, generator=gen)[:6]]).sort().values
        out.append((ids, torch.randn(7, dim, generator=gen)))
    return out


@pytest.mark.parametrize("name, setting", ROW_CASES, ids=[f"{n}-{s}" for n, s in ROW_CASES])
def test_each_setting_applies_to_rows_as_declared_or_is_refused_by_name(name: str, setting: str) -> None:
    """For every optimizer and every setting it accepts: its row form on a sparse table equals the
    dense rule (torch's, on a dense table with zero gradients on the untouched rows) bit for bit
    where DECLS says EXACT; equals its lazy definition (each row its own Adam, stepped only when
    touched) where LAZY; else make_row_optimizer refuses it, naming the setting and the alternative."""
    from psgrad.core.optimizers.rows import make_row_optimizer
    from psgrad.server.tables import SparseTable

    spec, decl = _row_spec(name, setting), DECLS[name]
    rule = decl.row_rule(setting) if decl.rows else None
    if rule not in (EXACT, LAZY):
        what = f"optimizer {name!r} has no row-wise form" if decl.rows is None else (
            f"{'momentum' if setting == 'nesterov' else setting} .* of optimizer {name!r} does not apply to the rows "
            "of sparse table 'emb'.*in a param group of its own")
        with pytest.raises(ConfigError, match=what):
            make_row_optimizer(name, spec, "emb")
        return
    num, dim = 40, 3
    table = SparseTable("emb", num, dim, 0, 1, seed=7, optimizer=make_row_optimizer(name, spec, "emb"))
    start = table.pull(torch.arange(num))[0].clone()
    updates = _row_updates(num, dim)
    for ids, grads in updates:
        table.apply(ids, grads)
    got = table.pull(torch.arange(num))[0]
    torch_opt = getattr(torch.optim, decl.torch)
    if rule == EXACT:
        weight = torch.nn.Parameter(start.clone())
        ref = torch_opt([weight], **decl.torch_kwargs(spec))
        for ids, grads in updates:
            weight.grad = torch.zeros(num, dim).index_add_(0, ids, grads)
            ref.step()
        assert torch.equal(got, weight.detach())
        return
    # LAZY: each row is its own dense-rule parameter, stepped only with the updates that touched it
    expect = start.clone()
    for r in range(num):
        row = torch.nn.Parameter(start[r].clone())
        ref = torch_opt([row], **decl.torch_kwargs(spec))
        for ids, grads in updates:
            hit = (ids == r).nonzero()
            if hit.numel():
                row.grad = grads[int(hit[0, 0])].clone()
                ref.step()
        expect[r] = row.detach()
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-6)


def test_adagrad_lr_decay_on_rows_counts_the_shards_updates_not_the_tables() -> None:
    """The dense rule's step number of an update is the shard's (a table's rows may sit out some of
    its updates): the table takes it as `step`, and equals a dense Adagrad stepped at every update."""
    from psgrad.core.optimizers.rows import make_row_optimizer
    from psgrad.server.tables import SparseTable

    spec = JobSpec(optimizer="adagrad", lr=0.05, lr_decay=0.3)
    num, dim = 20, 2
    table = SparseTable("emb", num, dim, 0, 1, seed=1, optimizer=make_row_optimizer("adagrad", spec))
    weight = torch.nn.Parameter(table.pull(torch.arange(num))[0].clone())
    ref = torch.optim.Adagrad([weight], lr=0.05, lr_decay=0.3)
    for step, (ids, grads) in enumerate(_row_updates(num, dim), start=1):
        weight.grad = torch.zeros(num, dim)
        if step % 2:  # the even updates of the shard carried none of this table's rows
            weight.grad.index_add_(0, ids, grads)
            table.apply(ids, grads, step=step)
        ref.step()
    assert torch.equal(table.pull(torch.arange(num))[0], weight.detach())


def test_optimizer_names_and_torch_twins_are_declared_once() -> None:
    from psgrad.cli.flags import OPTIMIZER_LR
    from psgrad.core import optimizer_settings as settings
    from psgrad.core.optimizers.rows import ROW_OPTIMIZERS
    from psgrad.experiments.allreduce import torch_optimizer

    assert OPTIMIZER_NAMES == tuple(DECLS) and set(OPTIMIZERS) == set(DECLS)
    assert set(ROW_OPTIMIZERS) == {n for n, d in DECLS.items() if d.rows}
    assert OPTIMIZER_LR == {n: d.lr for n, d in DECLS.items()}
    for cls in settings.SERVER_OPTIMIZERS:  # the API's classes start from torch's defaults
        name = "adam" if cls is settings.Adam else cls.__name__.lower()
        assert cls().lr == DECLS[name].lr and getattr(cls(), "eps", None) == DECLS[name].eps
    for name, decl in DECLS.items():
        opt = torch_optimizer(JobSpec(optimizer=name, eps=settings.DEFAULT_EPS.get(name, 1e-8)), [torch.zeros(2)])
        assert type(opt).__name__ == decl.torch


def test_a_tables_param_group_sets_its_lr_and_settings_and_lifts_a_refusal() -> None:
    """A table in a param group of its own (the module in 'params') takes the group's lr multiple
    and its own values of the job optimizer's settings; a setting its rows cannot take is refused
    until its group sets the default (the refusal's alternative)."""
    import psgrad
    from psgrad.core.optimizers.rows import check_row_settings
    from psgrad.core.sharding import TableSpec, param_specs
    from psgrad.worker.param_groups import with_groups

    class Two(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = psgrad.Embedding(100, 4), psgrad.Embedding(50, 4)
            self.head = torch.nn.Linear(4, 1)

    model, spec = Two(), JobSpec(optimizer="sgd", lr=0.1, momentum=0.9)
    tables = [TableSpec("a", 100, 4), TableSpec("b", 50, 4)]
    with pytest.raises(ConfigError, match="momentum 0.9 of optimizer 'sgd' does not apply to the rows of sparse "
                                          "table 'a'.*'momentum': 0.0"):
        check_row_settings(spec, "a")
    groups = [{"params": [model.a], "lr": 0.05, "momentum": 0.0}, {"params": [model.b], "momentum": 0}]
    dense, grouped = with_groups(param_specs(model), model, groups, spec, tables)
    assert [(t.lr_scale, t.settings) for t in grouped] == [(0.5, (("momentum", 0.0),)), (1.0, (("momentum", 0.0),))]
    assert all(p.lr_scale == 1.0 and p.weight_decay is None for p in dense)  # the dense parameters keep the job's
    for t in grouped:
        check_row_settings(t.job_spec(spec), t.name)
        assert t.job_spec(spec).momentum == 0.0
    with pytest.raises(ConfigError, match="'momentum' and holds dense parameters"):
        with_groups(param_specs(model), model, [{"params": [model.head.weight, model.a], "momentum": 0.0}], spec, tables)
    with pytest.raises(ConfigError, match="'betas'.*sgd's settings"):
        with_groups(param_specs(model), model, [{"params": [model.a], "betas": (0.9, 0.9)}], spec, tables)
    with pytest.raises(ConfigError, match="not a psgrad embedding"):
        with_groups(param_specs(model), model, [{"params": [model.head]}], spec, tables)
    with pytest.raises(ConfigError, match="momentum must be in \\[0, 1\\)"):
        with_groups(param_specs(model), model, [{"params": [model.a], "momentum": 2.0}], spec, tables)


def test_a_tables_param_group_may_name_an_optimizer_of_its_own() -> None:
    """Under a job optimizer without a row form (AdamW), the refusal names the way out, and a
    table's param group that names an optimizer of its own (a name, or psgrad.Adagrad(...) with its
    settings) gives its rows that optimizer at torch's defaults plus what the group sets, at the
    lr the group (or the optimizer) gives; the job's settings do not leak into it."""
    import psgrad
    from psgrad.core.optimizers.rows import RowAdagrad, RowSGD, check_row_settings, make_row_optimizer
    from psgrad.core.sharding import TableSpec, fingerprint, param_specs
    from psgrad.wire import serde
    from psgrad.worker.param_groups import with_groups

    class Two(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = psgrad.Embedding(100, 4), psgrad.Embedding(50, 4)
            self.head = torch.nn.Linear(4, 1)

    model, spec = Two(), JobSpec(optimizer="adamw", lr=1e-3, weight_decay=0.01, eps=1e-6)
    tables = [TableSpec("a", 100, 4), TableSpec("b", 50, 4)]
    params = param_specs(model)
    with pytest.raises(ConfigError, match="'adamw' has no row-wise form for sparse table 'a'.*rows take sgd, adam, "
                                          "adagrad.*'optimizer': psgrad.Adagrad"):
        check_row_settings(spec, "a")
    groups = [{"params": [model.a], "optimizer": psgrad.Adagrad(lr=0.05, initial_accumulator_value=0.1)},
              {"params": [model.b], "optimizer": "sgd"}]
    dense, (a, b) = with_groups(params, model, groups, spec, tables)
    assert (a.optimizer, a.lr_scale, a.settings) == ("adagrad", pytest.approx(50.0), (("initial_accumulator_value", 0.1),))
    assert (b.optimizer, b.lr_scale, b.settings) == ("sgd", pytest.approx(100.0), ())  # (SGD's default lr, 0.1)
    assert all(p.lr_scale == 1.0 and p.weight_decay is None for p in dense)  # the dense parameters keep AdamW's
    own = a.job_spec(spec)  # Adagrad at torch's defaults (eps 1e-10, no decay), not AdamW's eps and decay
    assert (own.optimizer, own.eps, own.weight_decay, own.initial_accumulator_value, own.lr) == \
        ("adagrad", 1e-10, 0.0, 0.1, 1e-3)
    for t, kind in ((a, RowAdagrad), (b, RowSGD)):
        check_row_settings(t.job_spec(spec), t.name)
        assert isinstance(make_row_optimizer(t.job_spec(spec).optimizer, t.job_spec(spec), t.name), kind)
    assert serde.tables_from_proto(serde.tables_to_proto([a, b])) == [a, b]  # (to the servers and their standbys)
    assert TableSpec(**json.loads(json.dumps(dataclasses.asdict(a)))) == a  # (a checkpoint's layout)
    assert len({fingerprint(params, spec, [a, b]), fingerprint(params, spec, [dataclasses.replace(a, optimizer=""), b])}) == 2
    # A name and the object at its defaults are one table spec; a group's lr is the table's lr.
    _, (by_name, _) = with_groups(params, model, [{"params": [model.a], "optimizer": "adagrad", "lr": 0.05}], spec, tables)
    _, (by_object, _) = with_groups(params, model, [{"params": [model.a], "optimizer": psgrad.Adagrad(lr=0.05)}], spec, tables)
    assert by_name == by_object and by_name.lr_scale == pytest.approx(50.0)
    # Refused by name: no such optimizer, no row form, a setting rows cannot take, settings given twice,
    # another optimizer's setting, an optimizer for dense parameters.
    def own_table(**group: object) -> TableSpec:
        return with_groups(params, model, [{"params": [model.a], **group}], spec, tables)[1][0]
    with pytest.raises(ConfigError, match="names no optimizer: 'adagard'"):
        own_table(optimizer="adagard")
    with pytest.raises(ConfigError, match="must be an optimizer's name"):
        own_table(optimizer=torch.optim.Adagrad)
    with pytest.raises(ConfigError, match="'rmsprop' has no row-wise form"):
        check_row_settings(own_table(optimizer="rmsprop").job_spec(spec), "a")
    with pytest.raises(ConfigError) as info:  # (it said to do what the user did, and that the dense parameters keep it)
        check_row_settings(own_table(optimizer="rmsprop").job_spec(spec), "a", own=True)
    assert str(info.value) == ("optimizer 'rmsprop', which the param group of sparse table 'a' names, has no row-wise "
                               "form (its running averages decay at every step, rows the batch did not touch too): "
                               "a table's own optimizer is one of sgd, adam, adagrad"), info.value
    with pytest.raises(ConfigError, match="momentum 0.9 of optimizer 'sgd' does not apply to the rows"):
        check_row_settings(own_table(optimizer="sgd", momentum=0.9).job_spec(spec), "a")
    with pytest.raises(ConfigError, match="psgrad.Adagrad\\(...\\) and sets 'lr' beside it"):
        own_table(optimizer=psgrad.Adagrad(), lr=0.1)
    with pytest.raises(ConfigError, match="'betas'.*adagrad's settings"):
        own_table(optimizer="adagrad", betas=(0.9, 0.99))
    with pytest.raises(ConfigError, match="holds no parameter.*put the module itself in 'params'"):
        with_groups(params, model, [{"params": model.a.parameters(), "lr": 0.5}], spec, tables)  # (a table's: none)
    with pytest.raises(ConfigError, match="has 'optimizer': a group may set only 'lr' and 'weight_decay' for dense"):
        with_groups(params, model, [{"params": [model.head.weight], "optimizer": "sgd"}], spec, tables)


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam"])
def test_a_row_rule_only_reads_its_gradients(name: str) -> None:
    """The tables hand a rule the request's gradient bytes as they are (no copy): it must not write them."""
    from psgrad.core.optimizers.rows import ROW_OPTIMIZERS

    rule = ROW_OPTIMIZERS[name](JobSpec(optimizer=name, lr=0.1))
    grads = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    kept, weights, state = grads.clone(), torch.ones(5, 3), rule.new_state(5, 3)
    for step in (1, 2):
        rule.apply(weights, grads, state, None, step)
    assert torch.equal(grads, kept) and not torch.equal(weights, torch.ones(5, 3))
