"""A server's request threads under Linux's SCHED_BATCH (server/scheduling.py): batch_thread puts
the calling thread alone under it, threads it starts inherit it, and enabled=False leaves the thread
as it was. (The server's own threads: tests/unit/test_local_calls.py, tests/integration/test_local_socket.py.)"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import pytest

from psgrad.server.scheduling import batch_thread

pytestmark = [pytest.mark.timeout(30),
              pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="needs Linux's SCHED_BATCH")]


def in_a_thread(fn: Callable[[], Any]) -> Any:
    """fn's result, called on a new thread (the test's own thread keeps its policy)."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(10)
    assert out, "the thread did not finish"
    return out[0]


def test_the_calling_thread_goes_under_sched_batch_and_the_threads_it_starts_inherit_it() -> None:
    before = os.sched_getscheduler(0)

    def body() -> tuple[bool, int, int]:
        took = batch_thread(True)
        return took, os.sched_getscheduler(0), in_a_thread(lambda: os.sched_getscheduler(0))

    assert in_a_thread(body) == (True, os.SCHED_BATCH, os.SCHED_BATCH)
    assert os.sched_getscheduler(0) == before  # (only the thread that called it)


def test_disabled_it_leaves_the_thread_as_it_was() -> None:
    before = os.sched_getscheduler(0)
    assert in_a_thread(lambda: (batch_thread(False), os.sched_getscheduler(0))) == (False, before)
