"""Pure tests of psgrad.optimizers: the server-side SGD matches torch.optim.SGD; the registry."""
from __future__ import annotations

import itertools

import pytest
import torch

from psgrad.config import JobSpec
from psgrad.errors import ConfigError
from psgrad.optimizers import SGD, make_optimizer

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


def test_momentum_buffer_starts_at_the_first_gradient() -> None:
    # Hand-computed: v1 = g1 = 1, w = 0 - 1*1 = -1; v2 = 0.5*1 + 3 = 3.5, w = -1 - 3.5 = -4.5.
    opt = SGD(1, lr=1.0, momentum=0.5)
    w = torch.zeros(1)
    opt.apply(w, torch.tensor([1.0]))
    assert w.item() == -1.0
    opt.apply(w, torch.tensor([3.0]))
    assert w.item() == -4.5


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
        make_optimizer(JobSpec(optimizer="adamw"), 10)
    msg = str(info.value)
    assert "'adamw'" in msg
    assert "sgd" in msg
