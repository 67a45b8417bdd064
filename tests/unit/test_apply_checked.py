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


def test_on_two_threads_covers_the_range_once_in_two_halves() -> None:
    seen: list[tuple[int, int, int]] = []
    lock = threading.Lock()

    def work(a: int, b: int) -> None:
        with lock:
            seen.append((a, b, threading.get_ident()))

    transfers.on_two_threads(1050, work)
    assert sorted((a, b) for a, b, _ in seen) == [(0, 600), (600, 1050)]  # half: a multiple of PIECE
    assert len({t for _, _, t in seen}) == 2


@pytest.mark.parametrize("numel", [60, 1050])
def test_a_pull_stream_copies_a_whole_float32_version_on_two_threads(numel: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # as `psgrad server` runs
    ended = []
    source = torch.randn(numel)
    stream = transfers.PullStream(source, 3, torch.float32, 64, threading.RLock(), ended.append)
    dest = bytearray(4 * numel)
    stream.copy_into(memoryview(dest))
    assert torch.equal(torch.frombuffer(dest, dtype=torch.float32), source)
    assert stream.complete and not stream.open and ended == [stream]
    closed = transfers.PullStream(source, 3, torch.float32, 64, threading.RLock(), ended.append)
    closed.close()
    untouched = bytearray(4 * numel)
    closed.copy_into(memoryview(untouched))
    assert untouched == bytearray(4 * numel) and not closed.complete


def test_a_forked_child_gets_a_helper_of_its_own() -> None:
    import multiprocessing

    transfers.on_two_threads(1050, lambda a, b: None)  # the parent's helper thread exists
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:  # the child inherits the executor but not its thread
        assert pool.apply_async(_two_halves_in_child).get(timeout=30) == 2


def _two_halves_in_child() -> int:
    threads: set[int] = set()
    transfers.on_two_threads(1050, lambda a, b: threads.add(threading.get_ident()))
    return len(threads)
