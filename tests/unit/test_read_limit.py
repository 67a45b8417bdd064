"""The bound on the bytes of reads in flight (--max-read-mb, psgrad/server/read_limit.py): reads past
it wait their turn in order of arrival, within their deadline; one larger than all of it is refused
naming the flag and what it needs. Threads, no server (tests/integration/test_row_reads.py runs it in
a real server)."""
from __future__ import annotations

import threading
import time

import pytest

from conftest import wait_for
from psgrad.config import ServerConfig
from psgrad.errors import ConfigError, InvalidRequestError, ServerBusyError
from psgrad.server.read_limit import ReadLimit, read_limit_bytes

pytestmark = pytest.mark.timeout(60)
MIB = 2**20


class Reader(threading.Thread):
    """acquire(nbytes) in a thread of its own: `got` is set once it holds them, `error` if refused."""

    def __init__(self, limit: ReadLimit, nbytes: int, timeout_s: float | None = 30.0,
                 active: threading.Event | None = None) -> None:
        super().__init__(daemon=True)
        self.limit, self.nbytes, self.timeout_s = limit, nbytes, timeout_s
        self.active = active
        self.got = threading.Event()
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            is_active = (lambda: True) if self.active is None else self.active.is_set
            self.limit.acquire(self.nbytes, "a read", self.timeout_s, is_active)
            self.got.set()
        except BaseException as exc:  # (looked at by the test)
            self.error = exc


def test_reads_within_the_bound_go_at_once_and_the_peak_is_counted() -> None:
    limit = ReadLimit(10 * MIB)
    limit.acquire(4 * MIB, "a read")
    limit.acquire(6 * MIB, "a read")
    counts = limit.counts()
    assert (counts.limit, counts.in_flight, counts.peak, counts.queued) == (10 * MIB, 10 * MIB, 10 * MIB, 0)
    limit.release(4 * MIB)
    limit.release(6 * MIB)
    assert (limit.counts().in_flight, limit.counts().peak) == (0, 10 * MIB)
    unbounded = ReadLimit(read_limit_bytes(0))
    for _ in range(3):
        unbounded.acquire(100 * MIB, "a read")
    assert (unbounded.counts().in_flight, unbounded.counts().limit, unbounded.counts().queued) == (300 * MIB, 0, 0)


def test_a_read_larger_than_the_whole_bound_is_refused_naming_the_flag_and_the_size_it_needs() -> None:
    limit = ReadLimit(read_limit_bytes(8))
    with pytest.raises(InvalidRequestError) as refused:
        limit.acquire(9 * MIB + 1, "a read of 9,217 rows")
    message = str(refused.value)
    assert message.startswith("a read of 9,217 rows would make a reply of 9,437,185 bytes (9.0 MiB), more than the "
                              "8.0 MiB this server lets the replies to reads hold at once (--max-read-mb 8)")
    assert "start the servers with --max-read-mb 10 or more" in message
    assert (limit.counts().refused, limit.counts().in_flight) == (1, 0)
    limit.acquire(8 * MIB, "a read")  # all of it is fine


def test_reads_past_the_bound_wait_their_turn_in_order_of_arrival() -> None:
    limit = ReadLimit(10 * MIB)
    limit.acquire(6 * MIB, "a read")
    large = Reader(limit, 8 * MIB)
    wait_for("the large read to wait", lambda: limit.counts().waiting == 1)
    small = Reader(limit, 2 * MIB)  # would fit now, but the large one came first
    wait_for("the small read to wait behind it", lambda: limit.counts().waiting == 2)
    assert not large.got.is_set() and not small.got.is_set()
    limit.release(6 * MIB)
    assert large.got.wait(10) and small.got.wait(10)  # 8 + 2 fit together
    large.join(10)
    small.join(10)
    counts = limit.counts()
    assert (counts.in_flight, counts.peak, counts.waiting, counts.queued, counts.expired) == (10 * MIB, 10 * MIB, 0, 2, 0)


def test_a_read_that_waits_past_its_deadline_gives_up_and_the_next_goes_on() -> None:
    limit = ReadLimit(10 * MIB)
    limit.acquire(9 * MIB, "a read")
    started = time.monotonic()
    late = Reader(limit, 5 * MIB, timeout_s=0.3)
    late.join(10)
    assert isinstance(late.error, ServerBusyError), late.error
    assert time.monotonic() - started < 5  # (it waits on a condition with its deadline, not for ever)
    message = str(late.error)
    assert message.startswith("a read (5.0 MiB) waited for its turn until its deadline: the replies to reads in "
                              "progress hold 9.0 MiB of the 10.0 MiB")
    assert "raise --max-read-mb" in message
    small = Reader(limit, 1 * MIB)  # the queue holds nothing of the one that gave up
    assert small.got.wait(10)
    assert (limit.counts().expired, limit.counts().waiting, limit.counts().in_flight) == (1, 0, 10 * MIB)


def test_a_cancelled_read_stops_waiting_when_woken() -> None:
    limit = ReadLimit(10 * MIB)
    limit.acquire(10 * MIB, "a read")
    active = threading.Event()
    active.set()
    reader = Reader(limit, 1 * MIB, timeout_s=None, active=active)
    wait_for("the read to wait", lambda: limit.counts().waiting == 1)
    active.clear()  # its call ended (cancelled): the servicer's callback wakes it
    limit.wake()
    reader.join(10)
    assert not reader.is_alive() and isinstance(reader.error, ServerBusyError)
    assert limit.counts().waiting == 0


def test_the_flag_takes_zero_or_at_least_an_exports_page() -> None:
    assert ServerConfig(max_read_mb=0).max_read_mb == 0
    assert ServerConfig(max_read_mb=8).max_read_mb == 8
    with pytest.raises(ConfigError, match=r"max_read_mb must be 0 \(no limit\) or a finite number >= 8"):
        ServerConfig(max_read_mb=4)
    with pytest.raises(ConfigError, match="max_read_mb"):
        ServerConfig(max_read_mb=float("inf"))


def test_a_pull_of_dense_weights_larger_than_the_bound_goes_alone_once_nothing_is_in_flight() -> None:
    """A shard's weights are asked for whole (no call can ask for less), so a pull of them larger
    than the bound is not refused as a read of rows is: it waits until nothing is in flight and
    holds the bound alone; reads that come after it wait for it."""
    from psgrad.server.read_limit import DENSE_ADVICE

    limit = ReadLimit(8 * MIB)
    limit.check(9 * MIB, "a pull of the weights", DENSE_ADVICE)  # not refused
    limit.acquire(3 * MIB, "a read")

    class Dense(Reader):
        def run(self) -> None:
            try:
                self.limit.acquire(self.nbytes, "a pull of the weights", self.timeout_s, advice=DENSE_ADVICE)
                self.got.set()
            except BaseException as exc:  # (looked at by the test)
                self.error = exc

    big = Dense(limit, 9 * MIB)
    assert not big.got.wait(0.2) and big.error is None  # 3 MiB in flight: it waits
    after = Reader(limit, 1 * MIB)  # (arrived after it: waits behind it)
    limit.release(3 * MIB)
    assert big.got.wait(10) and big.error is None
    assert limit.in_flight == 9 * MIB and limit.peak == 9 * MIB
    assert not after.got.wait(0.2)  # the weights hold the bound alone
    limit.release(9 * MIB)
    assert after.got.wait(10) and after.error is None
    with pytest.raises(InvalidRequestError, match="--max-read-mb 9 or more"):  # rows: refused as before
        limit.check(9 * MIB, "a read of rows")
