"""apply_checked: a gradient checked and applied piece by piece on two threads, stopping at the
first non-finite piece (the shard then restores the weights from a published copy)."""
from __future__ import annotations

import threading

import pytest
import torch

from psgrad.server import transfers
from psgrad.server.transfers import apply_checked

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transfers, "PIECE", 100)


def run(grad: torch.Tensor, weights: torch.Tensor) -> tuple[int, list[tuple[int, int]], set[int]]:
    pieces: list[tuple[int, int]] = []
    threads: set[int] = set()
    lock = threading.Lock()

    def update(a: int, b: int) -> None:
        with lock:
            pieces.append((a, b))
            threads.add(threading.get_ident())
        weights[a:b].add_(grad[a:b], alpha=-0.5)

    return apply_checked(grad, update), pieces, threads


def test_a_finite_gradient_is_applied_whole_in_pieces_on_two_threads() -> None:
    grad = torch.linspace(-3, 3, 1050)
    weights = torch.arange(1050, dtype=torch.float32)
    expected = weights - 0.5 * grad
    bad, pieces, threads = run(grad, weights)
    assert bad == 0
    assert torch.equal(weights, expected)  # element-wise: the same bits as one add_
    assert sorted(pieces) == [(a, min(a + 100, 1050)) for a in range(0, 1050, 100)]
    assert len(threads) == 2  # this thread one half, the helper the other


@pytest.mark.parametrize("where", [0, 420, 1049])
def test_a_non_finite_value_stops_the_apply_and_is_counted(where: int) -> None:
    grad = torch.ones(1050)
    grad[where] = float("nan")
    grad[(where + 7) % 1050] = float("inf")
    weights = torch.zeros(1050)
    bad, pieces, _ = run(grad, weights)
    assert bad == 2
    assert not any(a <= where < b for a, b in pieces)  # the bad piece itself is never applied
    assert torch.isfinite(weights).all()
    # each thread stops at its first bad piece and the other one at its next piece
    assert len(pieces) < 11


def test_a_sum_that_merely_overflows_is_not_refused() -> None:
    grad = torch.full((1050,), 3e38)
    weights = torch.zeros(1050)
    bad, pieces, _ = run(grad, weights)
    assert bad == 0 and len(pieces) == 11
    assert torch.equal(weights, torch.full((1050,), -1.5e38))


def test_small_gradients_are_one_piece_on_this_thread() -> None:
    grad = torch.ones(60)
    weights = torch.zeros(60)
    bad, pieces, threads = run(grad, weights)
    assert (bad, pieces, threads) == (0, [(0, 60)], {threading.get_ident()})
