"""psgrad.core.unused: the ranges of parameters a step left unused, and the update rules that skip
them as torch.optim skips a parameter whose .grad is None (no weight, state or step change), bit for
bit against torch.optim over several parameters; their state (per-range step counts) round trips."""
from __future__ import annotations

import pytest
import torch

from psgrad.config import JobSpec
from psgrad.core.optimizers import make_optimizer
from psgrad.core.optimizers.segments import Segment, SegmentedOptimizer
from psgrad.core.unused import StepCounts, clipped, complement, from_bytes, intersection, merged, to_bytes
from psgrad.errors import InvalidRequestError

pytestmark = pytest.mark.timeout(60)

SIZES = [7, 30, 1, 12]  # four parameters of the flat range
BOUNDS = [(sum(SIZES[:i]), sum(SIZES[: i + 1])) for i in range(len(SIZES))]
NUMEL = sum(SIZES)
# each step's unused parameters (indices): none, some, the first step skipping some, all of them
SCHEDULE = [{1, 3}, set(), {1}, {0, 1, 2, 3}, {2}, set(), {3, 1}, set()]

# (torch class, JobSpec fields; torch takes the same settings but "optimizer")
CASES = {
    "adam": (torch.optim.Adam, {"optimizer": "adam", "lr": 0.05}),
    "adam-decay": (torch.optim.Adam, {"optimizer": "adam", "lr": 0.05, "weight_decay": 0.1}),
    "adamw": (torch.optim.AdamW, {"optimizer": "adamw", "lr": 0.05, "weight_decay": 0.1}),
    "sgd-decay": (torch.optim.SGD, {"lr": 0.1, "weight_decay": 0.1}),
    "sgd-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "sgd-nesterov-decay": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.5, "nesterov": True, "weight_decay": 0.01}),
    "adagrad-lr-decay": (torch.optim.Adagrad, {"optimizer": "adagrad", "lr": 0.1, "lr_decay": 0.5,
                                               "weight_decay": 0.01, "initial_accumulator_value": 0.1}),
    "rmsprop-centered-momentum": (torch.optim.RMSprop, {"optimizer": "rmsprop", "lr": 0.01, "centered": True,
                                                        "momentum": 0.5, "weight_decay": 0.1}),
    "adadelta-decay": (torch.optim.Adadelta, {"optimizer": "adadelta", "lr": 0.5, "rho": 0.8, "eps": 1e-6, "weight_decay": 0.05}),
}


def _data() -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(NUMEL, generator=gen), [torch.randn(NUMEL, generator=gen) for _ in SCHEDULE]


def _torch_run(cls: type[torch.optim.Optimizer], fields: dict[str, object], w0: torch.Tensor,
               grads: list[torch.Tensor]) -> torch.Tensor:
    params = [torch.nn.Parameter(w0[lo:hi].clone()) for lo, hi in BOUNDS]
    opt = cls(params, foreach=False, **{k: v for k, v in fields.items() if k != "optimizer"})  # type: ignore[call-arg]
    for g, unused in zip(grads, SCHEDULE):
        opt.zero_grad(set_to_none=True)
        for i, (p, (lo, hi)) in enumerate(zip(params, BOUNDS)):
            if i not in unused:
                p.grad = g[lo:hi].clone()
        opt.step()
    return torch.cat([p.detach() for p in params])


def _skip(unused: set[int]) -> tuple[tuple[int, int], ...]:
    return merged(BOUNDS[i] for i in unused)


def test_ranges() -> None:
    assert merged([(5, 7), (0, 2), (2, 3), (9, 9), (6, 8)]) == ((0, 3), (5, 8))
    assert complement(((0, 3), (5, 8)), 10) == ((3, 5), (8, 10))
    assert complement((), 4) == ((0, 4),) and complement(((0, 4),), 4) == ()
    assert intersection(((0, 3), (5, 8)), ((2, 6), (7, 9))) == ((2, 3), (5, 6), (7, 8))
    assert clipped(((0, 3), (5, 8)), 2, 6) == ((0, 1), (3, 4))
    assert from_bytes(to_bytes(((0, 3), (5, 8))), 8, "x") == ((0, 3), (5, 8))
    assert to_bytes(()) == b"" and from_bytes(b"", 8, "x") == ()
    for bad in [((3, 2),), ((0, 3), (2, 4)), ((0, 9),), ((-1, 2),)]:
        with pytest.raises(InvalidRequestError):
            from_bytes(to_bytes(bad), 8, "push")
    with pytest.raises(InvalidRequestError):
        from_bytes(b"\0" * 12, 8, "push")


def test_step_counts() -> None:
    c = StepCounts(10)
    assert c.advance() == [(0, 10, 1)]
    assert c.advance(((2, 4),)) == [(0, 2, 2), (4, 10, 2)]
    assert c.runs == [(0, 2, 2), (2, 4, 1), (4, 10, 2)] and c.uniform is None and c.most == 2
    assert c.advance(((0, 2), (4, 10))) == [(2, 4, 2)]
    assert c.uniform == 2 and c.runs == [(0, 10, 2)]
    d = StepCounts(10)
    d.advance(((0, 5),))
    e = StepCounts(10)
    e.load(d.state())
    assert e.runs == d.runs == [(0, 5, 0), (5, 10, 1)]


@pytest.mark.parametrize("case", CASES)
def test_skipped_parameters_match_torch_with_grad_none(case: str) -> None:
    cls, fields = CASES[case]
    w0, grads = _data()
    expected = _torch_run(cls, fields, w0, grads)
    opt = make_optimizer(JobSpec(**fields), NUMEL)  # type: ignore[arg-type]
    w = w0.clone()
    for g, unused in zip(grads, SCHEDULE):
        g = g.clone()
        for i in unused:
            g[BOUNDS[i][0] : BOUNDS[i][1]] = 0.0  # what the worker pushes for them: zeros
        opt.apply_skipping(w, g, _skip(unused))
    assert torch.equal(w, expected), (w - expected).abs().max()


@pytest.mark.parametrize("case", ["adam", "sgd-momentum", "adagrad-lr-decay"])
def test_zeros_without_skipping_are_what_pushes_gave_before(case: str) -> None:
    """The bug this fixes: zeros applied as a gradient move a stateful rule's parameters."""
    cls, fields = CASES[case]
    w0, grads = _data()
    expected = _torch_run(cls, fields, w0, grads)
    opt = make_optimizer(JobSpec(**fields), NUMEL)  # type: ignore[arg-type]
    w = w0.clone()
    for g, unused in zip(grads, SCHEDULE):
        g = g.clone()
        for i in unused:
            g[BOUNDS[i][0] : BOUNDS[i][1]] = 0.0
        opt.apply(w, g)
    assert not torch.equal(w, expected)


@pytest.mark.parametrize("case", CASES)
def test_state_round_trips_with_skips_in_the_history(case: str) -> None:
    cls, fields = CASES[case]
    w0, grads = _data()
    expected = _torch_run(cls, fields, w0, grads)
    spec = JobSpec(**fields)  # type: ignore[arg-type]
    opt = make_optimizer(spec, NUMEL)
    w = w0.clone()
    for k, (g, unused) in enumerate(zip(grads, SCHEDULE)):
        if k == 3:  # mid-way, with parameters at different step numbers: a fresh rule from the state
            state = opt.state_dict()
            opt = make_optimizer(spec, NUMEL)
            opt.load_state_dict(state)
        opt.apply_skipping(w, g.clone(), _skip(unused))
    assert torch.equal(w, expected)


def test_segmented_rules_skip_per_segment() -> None:
    """Parameter groups: each segment's rule skips its part of the ranges."""
    w0, grads = _data()
    spec = JobSpec(optimizer="adam", lr=0.05)
    params = [torch.nn.Parameter(w0[lo:hi].clone()) for lo, hi in BOUNDS]
    ref = torch.optim.Adam([{"params": params[:2]}, {"params": params[2:], "lr": 0.1}], lr=0.05, foreach=False)
    cut = BOUNDS[2][0]
    opt = SegmentedOptimizer.build(spec, [Segment(0, cut), Segment(cut, NUMEL, lr_scale=2.0)])
    w = w0.clone()
    for g, unused in zip(grads, SCHEDULE):
        ref.zero_grad(set_to_none=True)
        for i, (p, (lo, hi)) in enumerate(zip(params, BOUNDS)):
            if i not in unused:
                p.grad = g[lo:hi].clone()
        ref.step()
        opt.apply_skipping(w, g.clone(), _skip(unused))
    assert torch.equal(w, torch.cat([p.detach() for p in params]))
