"""Rows read in place (work in progress): the shard lock that keeps the shared counter odd while held
(server/row_share.py SeqLock) and the header a worker reads under it (wire/row_share.py)."""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from psgrad.server.row_share import SeqLock
from psgrad.wire import row_share

pytestmark = pytest.mark.timeout(60)


def test_without_a_counter_it_is_a_reentrant_lock_conditions_can_wait_on() -> None:
    lock = SeqLock()
    cond = threading.Condition(lock)
    with lock:
        with lock:  # (reentrant)
            assert lock._is_owned()
    assert not lock._is_owned()
    ready: list[int] = []

    def later() -> None:
        with cond:
            ready.append(1)
            cond.notify_all()

    with cond:
        t = threading.Thread(target=later)
        t.start()
        assert cond.wait_for(lambda: ready, timeout=30)
    t.join(30)


def test_the_counter_is_odd_exactly_while_the_lock_is_held_at_any_depth() -> None:
    lock = SeqLock()
    counter = np.zeros(1, dtype=np.int64)
    with lock:
        lock.attach(counter)
        assert counter[0] == 1  # (attached while held: odd now)
    assert counter[0] == 2
    with lock:
        assert counter[0] == 3
        with lock:
            assert counter[0] == 3  # (a nested acquire changes nothing)
        assert counter[0] == 3
    assert counter[0] == 4
    with lock:
        lock.detach()
        assert counter[0] == 6  # (left even)
    assert counter[0] == 6


def test_before_release_runs_once_per_outermost_release_while_the_counter_is_odd() -> None:
    lock = SeqLock()
    counter = np.zeros(1, dtype=np.int64)
    seen: list[int] = []
    lock.before_release = lambda: seen.append(int(counter[0]))
    with lock:
        lock.attach(counter)
        with lock:
            pass
    assert seen == [1] and counter[0] == 2


def test_a_condition_wait_lets_the_counter_go_even_and_takes_it_back_odd() -> None:
    lock = SeqLock()
    cond = threading.Condition(lock)
    counter = np.zeros(1, dtype=np.int64)
    with lock:
        lock.attach(counter)
    during: list[int] = []

    def other() -> None:
        with cond:  # (it gets the lock only while the waiter waits)
            during.append(int(counter[0]))
            cond.notify_all()

    with cond:
        with cond:  # (a wait at depth 2 lets go of both levels)
            t = threading.Thread(target=other)
            t.start()
            assert cond.wait_for(lambda: during, timeout=30)
            assert int(counter[0]) & 1  # (held again: odd)
    t.join(30)
    assert during and during[0] & 1  # (the other thread held it: odd)
    assert not int(counter[0]) & 1  # (let go: even)


def test_the_header_carries_a_description_and_versions_a_worker_maps_read_only(tmp_path) -> None:
    path = str(tmp_path / "header")
    shard = row_share.Header.create(path)
    worker = row_share.Header.open(path)
    assert worker.description() is None  # (nothing described yet)
    entry = {"values": "v", "rows": 10, "dim": 4, "index": "i", "index_rows": 5, "base": 0, "slot": 0,
             "key": 7, "std": 0.0}
    shard.describe({"tables": {"t": entry}, "shards": 2, "shard": 1})
    shard.versions[0] = 5
    generation, desc = worker.description()
    assert generation == 1 and desc["shards"] == 2
    assert row_share.TablePlace.of(desc["tables"]["t"]) == row_share.TablePlace("v", 10, 4, "i", 5, 0, 0, 7, 0.0)
    assert worker.versions[0] == 5
    with pytest.raises(ValueError):
        worker.versions[0] = 1  # (read-only for a worker)
    with pytest.raises(FileExistsError):
        row_share.Header.create(path)
    other = tmp_path / "other"
    other.write_bytes(b"x" * row_share.HEADER_BYTES)
    with pytest.raises(OSError, match="magic"):
        row_share.Header.open(str(other))
    worker.close()
    shard.close()
    os.unlink(path)


def test_a_read_under_the_counter_never_sees_a_change_half_made(tmp_path) -> None:
    """A writer that changes a two-element "row" in two steps under the lock, a reader that reads
    it under the header's counter: every read the counter lets through is a whole row."""
    path = str(tmp_path / "header")
    shard = row_share.Header.create(path)
    worker = row_share.Header.open(path)
    lock = SeqLock()
    with lock:
        lock.attach(shard.words[row_share.SEQ:row_share.SEQ + 1])
    row = np.zeros(2, dtype=np.int64)
    finished = threading.Event()

    def writer() -> None:
        for k in range(1, 3001):
            with lock:
                row[0] = k
                for _ in range(50):  # (a change that takes a while)
                    pass
                row[1] = k
            time.sleep(0)  # (lets the reader run between changes)
        finished.set()

    t = threading.Thread(target=writer)
    t.start()
    try:
        whole = []
        while not finished.is_set():
            got = worker.consistent(lambda: (int(row[0]), int(row[1])))
            if got is not None:
                whole.append(got)
        t.join(30)
        whole.append(worker.consistent(lambda: (int(row[0]), int(row[1]))))  # (at rest: always whole)
        assert whole[-1] == (3000, 3000)
        assert all(a == b for a, b in whole), [w for w in whole if w[0] != w[1]][:3]
    finally:
        finished.set()
        t.join(30)
    worker.close()
    shard.close()
