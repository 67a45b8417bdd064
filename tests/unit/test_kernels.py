"""The fused SGD kernel (server/kernels.py): w += alpha * g with g checked for NaN/inf in the same
pass, half on a helper thread; bit for bit torch's add_, and the shard's use of it."""
from __future__ import annotations

import threading

import pytest
import torch

from conftest import run_python
from psgrad.config import JobSpec
from psgrad.core.optimizers.base import axpy_backend, register_axpy_backend, torch_axpy
from psgrad.core.sharding import ParamSpec
from psgrad.errors import ConfigError
from psgrad.server import kernels, transfers
from psgrad.server.membership import Membership
from psgrad.server.state import ShardState
from test_shard import make_layout

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(kernels.ENV, raising=False)
    assert kernels.kernel(wait=True) is not None, "numba is a dependency: the fused kernel must compile"
    monkeypatch.setattr(transfers, "PIECE", 1000)  # two halves from 1001 values up


@pytest.mark.parametrize("n", [1, 7, 999, 1000, 1001, 4099, 65_537])
@pytest.mark.parametrize("alpha", [-1e-3, -0.37, -1e-9])
def test_the_update_is_torchs_add_bit_for_bit(n: int, alpha: float) -> None:
    gen = torch.Generator().manual_seed(n)
    weights = torch.randn(n, generator=gen) * 5
    grad = torch.randn(n, generator=gen) * 300
    expected = weights.clone().add_(grad, alpha=alpha)
    assert kernels.sgd_checked(weights, grad, alpha) is True
    assert torch.equal(weights, expected)


def test_big_updates_run_half_on_the_helper_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[tuple[int, int, int]] = []
    real = transfers.on_two_threads

    def spy(n: int, work):  # type: ignore[no-untyped-def]
        real(n, lambda a, b: (threads.append((a, b, threading.get_ident())), work(a, b)))

    monkeypatch.setattr(kernels, "on_two_threads", spy)
    weights, grad = torch.zeros(2500), torch.ones(2500)
    assert kernels.sgd_checked(weights, grad, -0.5) is True
    assert sorted((a, b) for a, b, _ in threads) == [(0, 2000), (2000, 2500)]
    assert len({t for _, _, t in threads}) == 2
    assert torch.equal(weights, torch.full((2500,), -0.5))


@pytest.mark.parametrize("where", [0, 999, 1000, 2499])  # either half, at its first or last value
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_gradient_is_reported(where: int, bad: float) -> None:
    grad = torch.ones(2500)
    grad[where] = bad
    assert kernels.sgd_checked(torch.zeros(2500), grad, -0.5) is False


def test_huge_finite_values_are_not_mistaken_for_inf() -> None:
    grad = torch.full((2500,), 3.0e38)  # their sum would overflow; they are finite all the same
    grad[7] = torch.finfo(torch.float32).tiny / 4  # a subnormal
    assert kernels.sgd_checked(torch.zeros(2500), grad, -1e-6) is True


def test_it_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    for off in ("0", "off", "False"):
        monkeypatch.setenv(kernels.ENV, off)
        weights = torch.zeros(10)
        assert kernels.kernel() is None and kernels.sgd_checked(weights, torch.ones(10), -1.0) is None
        assert torch.equal(weights, torch.zeros(10))  # nothing done: the caller uses torch ops


def test_without_numba_the_shard_uses_torch_ops() -> None:
    """A process where numba cannot be imported gets None (never an error) and the same weights."""
    code = (
        "import sys, torch; sys.modules['numba'] = None\n"
        "from psgrad.server import kernels\n"
        "assert kernels.kernel(wait=True) is None\n"
        "w = torch.zeros(5); assert kernels.sgd_checked(w, torch.ones(5), -1.0) is None\n"
        "print('torch ops')\n"
    )
    assert _python(code) == "torch ops"


def _python(code: str) -> str:
    """What `python -c code` prints, in a process of its own (forked from the preloaded template, which
    has imported psgrad but neither numba nor a kernel; it must succeed)."""
    out = run_python(["-c", code], timeout_s=100)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def _state(numel: int, **spec: object) -> ShardState:
    job = JobSpec(num_shards=1, num_workers=1, lr=0.25, **spec)  # type: ignore[arg-type]
    layout = make_layout(job, [ParamSpec("w", (numel,), "float32")])
    return ShardState.create(layout, torch.linspace(-1, 1, numel), Membership(30.0, lambda: 0.0))


@pytest.mark.parametrize("nonfinite_at", [None, 0, 2999])
def test_the_shard_applies_with_it_and_undoes_a_nan_from_the_copy(nonfinite_at: int | None) -> None:
    state = _state(3000)
    before = state.weights.clone()
    grad = torch.linspace(3, -2, 3000)
    if nonfinite_at is not None:
        grad[nonfinite_at] = float("nan")
    bad = state.apply_checked(grad, 0.5, None, restore=before.clone())
    if nonfinite_at is None:
        assert bad == 0 and torch.equal(state.weights, before.clone().add_(grad, alpha=-0.125))
    else:
        assert bad == 1 and torch.equal(state.weights, before)  # the whole half was applied, then undone


def test_the_server_registers_the_axpy_rules_backends() -> None:
    """One registry, core's: torch's add_ is core's own; the server adds split and checked (looked up
    by name at each call, so a patched kernels.sgd_checked is the one used); no other name."""
    assert axpy_backend("torch") is torch_axpy and axpy_backend("fused") is None
    split, checked, w = axpy_backend("split"), axpy_backend("checked"), torch.zeros(3000)
    assert split is not None and checked is not None
    assert split(w, torch.ones(3000), -0.5) is None and torch.equal(w, torch.full((3000,), -0.5))
    assert checked(w, torch.ones(3000), -0.5) is True and torch.equal(w, -torch.ones(3000))
    with pytest.raises(ConfigError, match="unknown axpy backend 'torch'"):
        register_axpy_backend("torch", torch_axpy)


@pytest.mark.parametrize("spec", [{}, {"momentum": 0.9}, {"weight_decay": 0.01}])
def test_plain_applies_give_the_optimizers_result_on_two_threads(
    spec: dict[str, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    """ShardState.apply (a gradient checked before: no kernel, no numba) spreads plain SGD, w + a *
    g, over this thread and the helper when torch runs one thread; the weights are the optimizer's
    bit for bit. Momentum and weight decay are not w + a * g: the optimizer applies them whole."""
    halves: list[tuple[int, int]] = []
    real = transfers.on_two_threads

    def spy(n: int, work):  # type: ignore[no-untyped-def]
        real(n, lambda a, b: (halves.append((a, b)), work(a, b)))

    monkeypatch.setattr(transfers, "on_two_threads", spy)
    monkeypatch.setattr(kernels, "sgd_checked", None)  # never called here
    reference = _state(3000, **spec)
    for k in range(2):
        reference.optimizer.apply(reference.weights, torch.linspace(-1, 2, 3000) * (k + 1), 1.0, 0.1)
    for threads in (1, 2):
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        state, halves[:] = _state(3000, **spec), []
        for k in range(2):
            state.apply(torch.linspace(-1, 2, 3000) * (k + 1), 1.0, 0.1)
        assert torch.equal(state.weights, reference.weights)
        assert sorted(halves) == ([(0, 2000), (0, 2000), (2000, 3000), (2000, 3000)] if not spec and threads == 1 else [])


def test_a_kernel_that_rounds_differently_is_refused() -> None:
    """The check after compiling: a multiply then an add (two roundings, where torch's add_ fuses
    them) differs in some bits, and would leave the shard on torch ops."""
    import numpy as np

    def two_roundings(w: np.ndarray, g: np.ndarray, a: np.float32) -> np.float32:
        w += a * g
        return np.float32((g * np.float32(0)).sum())

    def misses_nan(w: np.ndarray, g: np.ndarray, a: np.float32) -> np.float32:
        torch.from_numpy(w).add_(torch.from_numpy(g), alpha=float(a))
        return np.float32(0)

    fn = kernels.kernel()
    assert fn is not None and kernels._agrees_with_torch(fn)
    assert not kernels._agrees_with_torch(two_roundings)
    assert not kernels._agrees_with_torch(misses_nan)


def test_only_writable_contiguous_float32_vectors_are_taken() -> None:
    """Anything else (a strided view, float64) is left to torch's ops: the kernel was compiled and
    checked for one type."""
    weights = torch.zeros(64)
    assert kernels.sgd_checked(weights, torch.ones(128)[::2], -1.0) is None
    assert kernels.sgd_checked(weights.double(), torch.ones(64, dtype=torch.float64), -1.0) is None
    assert torch.equal(weights, torch.zeros(64))
    assert kernels.sgd_checked(weights, torch.ones(64), -1.0) is True and torch.equal(weights, -torch.ones(64))


def test_without_a_writable_cache_the_kernel_is_compiled_all_the_same() -> None:
    """numba refuses cache=True where no cache directory can be written (a read-only install
    without a home): the kernel is then compiled uncached, in every process."""
    code = (
        "import numba\n"
        "real = numba.njit\n"
        "def njit(*args, cache=False, **kwargs):\n"
        "    if cache:\n"
        "        raise RuntimeError('cannot cache function: no locator available')\n"
        "    return real(*args, **kwargs)\n"
        "numba.njit = njit\n"
        "import torch\n"
        "from psgrad.server import kernels\n"
        "assert kernels.kernel(wait=True) is not None\n"
        "w = torch.zeros(5); assert kernels.sgd_checked(w, torch.ones(5), -1.0) is True\n"
        "print(w.tolist())\n"
    )
    assert _python(code) == "[-1.0, -1.0, -1.0, -1.0, -1.0]"


def test_a_shard_of_one_piece_or_less_never_loads_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below two pieces there is nothing to split over threads: the torch ops check and apply it,
    and a server of a small model never pays numba's import and memory."""
    monkeypatch.setattr(kernels, "sgd_checked", None)  # would fail if called
    state = _state(1000)
    before = state.weights.clone()
    assert state.apply_checked(torch.ones(1000), 1.0, None, restore=before.clone()) == 0
    assert torch.equal(state.weights, before.clone().add_(torch.ones(1000), alpha=-0.25))
