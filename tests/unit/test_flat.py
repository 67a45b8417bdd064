"""FlatModel: parameters and gradients as flat buffers, host staging, dtype conversion.

Every test runs on the CPU; the same tests run on CUDA (marked `cuda`, skipped without a GPU)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from psgrad.errors import ConfigError
from psgrad.worker.flat import FlatModel, resolve_device

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.cuda),
]


def _model(dtype: torch.dtype = torch.float32, device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)).to(device=device, dtype=dtype)


def _mixed(device: str = "cpu") -> nn.Module:
    """float32 first layer, bfloat16 second, float32 last: dtype groups interleave in the flat space."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 4), nn.Linear(4, 3)).to(device)
    m[1].to(torch.bfloat16)
    return m


def _forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = x
    for layer in model:
        out = layer(out.to(layer.weight.dtype) if isinstance(layer, nn.Linear) else out)
    return out.float()


def _expected_flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().float().reshape(-1).cpu() for p in model.parameters()])


def _backward(model: nn.Module, device: str, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 6, generator=gen).to(device)
    _forward(model, x).pow(2).sum().backward()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("staging", [False, True])
def test_gathered_gradient_is_every_parameter_gradient_in_order(device: str, dtype: torch.dtype, staging: bool) -> None:
    model = _model(dtype, device)
    flat = FlatModel(model, staging=staging)
    flat.zero_grad()
    _backward(model, device)
    got = flat.gather_grads()
    assert got.dtype == torch.float32 and got.device.type == "cpu" and got.numel() == flat.numel
    torch.testing.assert_close(got, _expected_flat_grad(model))


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_dtypes_map_to_the_flat_space_in_parameter_order(device: str) -> None:
    model = _mixed(device)
    before = torch.cat([p.detach().float().reshape(-1).cpu() for p in model.parameters()])
    flat = FlatModel(model)
    assert flat.flat is None and flat.staged  # no single device buffer: always staged
    torch.testing.assert_close(flat.host_weights(), before)
    flat.zero_grad()
    _backward(model, device)
    torch.testing.assert_close(flat.gather_grads(), _expected_flat_grad(model))
    new = torch.linspace(-1, 1, flat.numel)
    flat.host_flat.copy_(new)
    flat.weights_pulled()
    for p, chunk in zip(model.parameters(), new.split([p.numel() for p in model.parameters()])):
        assert p.dtype in (torch.float32, torch.bfloat16)
        torch.testing.assert_close(p.detach().cpu(), chunk.view_as(p).to(p.dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pulled_weights_reach_the_parameters_rounded_to_their_dtype(device: str, dtype: torch.dtype) -> None:
    model = _model(dtype, device)
    flat = FlatModel(model, staging=True)
    new = torch.randn(flat.numel, generator=torch.Generator().manual_seed(3))
    flat.host_flat.copy_(new)
    flat.weights_pulled()
    got = torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()])
    assert torch.equal(got, new.to(dtype))


def test_unstaged_float32_cpu_buffers_alias_the_model() -> None:
    model = _model()
    flat = FlatModel(model)
    assert not flat.staged and flat.host_flat is flat.flat and flat.host_grad is flat.grad
    flat.host_flat.fill_(0.5)  # a pull into host_flat is a write into the parameters
    assert all(bool((p == 0.5).all()) for p in model.parameters())
    assert flat.host_weights() is flat.host_flat


def test_staged_buffers_are_separate_from_the_model() -> None:
    """Overlap needs this: a background pull must not write into weights autograd is using."""
    model = _model()
    flat = FlatModel(model, staging=True)
    before = [p.detach().clone() for p in model.parameters()]
    flat.host_flat.fill_(7.0)
    flat.host_grad.fill_(7.0)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    flat.weights_pulled()
    assert all(bool((p == 7.0).all()) for p in model.parameters())


def test_gradients_survive_zero_grad_set_to_none() -> None:
    model = _model()
    flat = FlatModel(model, staging=True)
    model.zero_grad(set_to_none=True)  # torch's default: autograd then allocates fresh .grad tensors
    _backward(model, "cpu")
    expected = _expected_flat_grad(model)
    torch.testing.assert_close(flat.gather_grads(), expected)
    flat.zero_grad()  # re-attaches the views
    assert all(bool((p.grad == 0).all()) for p in model.parameters())
    _backward(model, "cpu")
    torch.testing.assert_close(flat.gather_grads(), expected)


def test_a_step_allocates_no_new_host_buffers() -> None:
    model = _model(torch.bfloat16)
    flat = FlatModel(model, staging=True)
    ptrs = (flat.host_grad.data_ptr(), flat.host_flat.data_ptr())
    for seed in range(3):
        flat.zero_grad()
        _backward(model, "cpu", seed)
        assert flat.gather_grads().data_ptr() == ptrs[0]
        flat.weights_pulled()
    assert (flat.host_grad.data_ptr(), flat.host_flat.data_ptr()) == ptrs


@pytest.mark.cuda
def test_cuda_staging_buffers_are_pinned_and_timed() -> None:
    model = _model(torch.float32, "cuda")
    flat = FlatModel(model)
    assert flat.host_grad.is_pinned() and flat.host_flat.is_pinned()
    _backward(model, "cuda")
    flat.gather_grads()
    flat.weights_pulled()
    assert flat.d2h_s > 0 and flat.h2d_s > 0


def test_bad_models_are_refused_with_a_reason() -> None:
    frozen = _model()
    for p in frozen.parameters():
        p.requires_grad_(False)
    with pytest.raises(ConfigError, match="no trainable parameters"):
        FlatModel(frozen)
    empty = FlatModel(frozen, tables=True)  # (its trainable weights are psgrad tables: an empty flat space)
    assert empty.numel == empty.total == 0 and empty.gather_grads().numel() == 0
    empty.weights_pulled()
    with pytest.raises(ConfigError, match="requested"):
        FlatModel(_model(), torch.device("meta"))


@pytest.mark.parametrize(
    "name, message",
    [("tpu", "invalid device"), ("cuda:7", "CUDA"), ("meta", "unsupported device")],
)
def test_resolve_device_names_the_problem(name: str, message: str) -> None:
    if name.startswith("cuda") and torch.cuda.device_count() > 7:
        pytest.skip("this machine has 8+ GPUs")
    with pytest.raises(ConfigError, match=message):
        resolve_device(name)


def test_resolve_device_auto_is_cpu_without_a_gpu() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected


@pytest.mark.parametrize("local_rank, gpus, expected", [(None, 4, 0), (0, 4, 0), (3, 4, 3), (5, 4, 1), (2, 1, 0)])
def test_resolve_device_auto_gives_each_local_rank_its_own_gpu(
    monkeypatch: pytest.MonkeyPatch, local_rank: int | None, gpus: int, expected: int
) -> None:
    # A host with `gpus` GPUs, as torch would report it (only the count is asked for under auto).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert resolve_device("auto", local_rank) == torch.device("cuda", expected)


def test_resolve_device_auto_ignores_the_local_rank_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto", 3) == torch.device("cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_resolve_device_auto_local_ranks_on_this_gpu_host() -> None:
    gpus = torch.cuda.device_count()
    picked = [resolve_device("auto", r) for r in range(2 * gpus)]
    assert [d.index for d in picked] == [r % gpus for r in range(2 * gpus)]
    x = torch.ones(4, device=picked[-1])  # the device exists and takes memory
    assert x.device == picked[-1]


# ----------------------------------------------------------------------------- unused parameters
class _Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 2)
        self.b = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.a(x) + (self.b(x) if use_b else 0)


@pytest.mark.parametrize("staging", [False, True], ids=["zero-copy", "staged"])
def test_the_parameters_no_backward_reached_are_named_unused(staging: bool) -> None:
    torch.manual_seed(0)
    model = _Branches()
    flat = FlatModel(model, staging=staging)
    b_range = ((8, 16),)  # a.weight, a.bias (8 values), then b.weight, b.bias
    x = torch.randn(4, 3)

    def step(use_b: bool, edit: object = None) -> tuple[tuple[int, int], ...]:
        flat.zero_grad()
        model(x, use_b).sum().backward()
        if callable(edit):
            edit()
        flat.gather_grads()
        return flat.unused

    assert step(True) == ()
    assert step(False) == b_range
    assert torch.equal(flat.host_grad[8:16], torch.zeros(8))  # (pushed as zeros, and named unused)
    assert step(True) == ()  # the flags start again at each push
    # two backwards before one push: used if either reached it
    flat.zero_grad()
    model(x, False).sum().backward()
    model(x, True).sum().backward()
    flat.gather_grads()
    assert flat.unused == ()
    # .grad set to None by the user, or by torch's model.zero_grad(): unused
    assert step(False, lambda: setattr(model.b.weight, "grad", None)) == b_range
    # a gradient set by hand counts as used: a tensor of its own, or values written into the view
    assert step(False, lambda: setattr(model.b.bias, "grad", torch.ones(2))) == ((8, 14),)
    assert step(False, lambda: model.b.weight.grad.fill_(0.5)) == ((14, 16),)
    # zero_grad() between a backward and the push forgets it (torch: set_to_none)
    model(x, True).sum().backward()
    assert step(False) == b_range
    # the same step gathered again (taken again after it raised): the same answer, reached or not
    for use_b in (False, True):
        first = step(use_b)
        flat.gather_grads()
        assert flat.unused == first
    flat.zero_grad()  # reached with a zero gradient (a zero input: the weights' gradients are 0): used, and again
    model(torch.zeros(4, 3), True).sum().backward()
    for _ in range(2):
        flat.gather_grads()
        assert flat.unused == ()
