"""A shard's receive buffers (server/buffers.py) under many waiting pushes: a buffer given back, or a
staged turn ended, wakes one waiter, not all of them, and every waiter still gets its turn."""
from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from psgrad.server.buffers import Buffers

WAITERS = 8


def _holder(rank: int) -> Any:
    """A stand-in for a push's writer that is never stalled (no loan beyond the limit)."""
    return SimpleNamespace(rank=rank, last_active=time.monotonic() + 1e6, holds_turn=False, revoked=False)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("staged", [False, True])
def test_each_release_wakes_one_waiter_and_every_waiter_gets_a_buffer(staged: bool) -> None:
    lock = threading.RLock()
    buffers = Buffers(lock, push_buffers=1, on_wait=lambda: None)
    buffers.configure(staged=staged, per_worker=False)
    waits = [0]
    wait = buffers._wait

    def counted(cond: threading.Condition, timeout_s: float | None) -> None:
        waits[0] += 1
        wait(cond, timeout_s)

    buffers._wait = counted  # type: ignore[method-assign]
    got: queue.Queue[tuple[int, Any, Any]] = queue.Queue()

    def push(rank: int) -> None:
        with lock:
            grad, wire = buffers.lend(16, "float32", lambda: None)
            buffers.track(grad, _holder(rank))
        got.put((rank, grad, wire))

    first = threading.Thread(target=push, args=(0,))
    first.start()
    held = [got.get(timeout=30)]
    threads = [threading.Thread(target=push, args=(r,), daemon=True) for r in range(1, WAITERS + 1)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while waits[0] < WAITERS and time.monotonic() < deadline:  # every one waits for the buffer
        time.sleep(0.01)
    assert waits[0] == WAITERS
    served = set()
    for _ in range(WAITERS):
        rank, grad, wire = held.pop()
        with lock:
            buffers.release(grad, wire)
        held.append(got.get(timeout=30))
        served.add(held[-1][0])
    assert served == set(range(1, WAITERS + 1))
    # one wake-up per release (waking all would make it WAITERS + WAITERS * (WAITERS - 1) / 2 = 36)
    assert waits[0] <= WAITERS + 2, waits[0]
    for t in threads + [first]:
        t.join(timeout=10)


@pytest.mark.timeout(60)
def test_closing_wakes_every_waiter() -> None:
    lock = threading.RLock()
    buffers = Buffers(lock, push_buffers=1, on_wait=lambda: None)
    buffers.configure(staged=True, per_worker=False)
    with lock:
        grad, _ = buffers.lend(16, "float32", lambda: None)
        buffers.track(grad, _holder(0))
    done = threading.Barrier(WAITERS + 1, timeout=30)

    def push() -> None:
        with lock:
            buffers.lend(16, "float32", lambda: None)  # waits for the turn until closed
        done.wait()

    threads = [threading.Thread(target=push, daemon=True) for _ in range(WAITERS)]
    for t in threads:
        t.start()
    with lock:
        buffers.close()
    done.wait()
