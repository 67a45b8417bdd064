"""StreamLimits without a server: the read deadline's watchdog, admission and release."""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from conftest import wait_for
from psgrad.server.streams import StreamLimits, peer_host, stream_budget, transfer_deadline_s

pytestmark = pytest.mark.timeout(60)


class Context:
    """What StreamLimits uses of a grpc.ServicerContext: peer() and cancel()."""

    def __init__(self, peer: str = "ipv4:127.0.0.1:1") -> None:
        self._peer = peer
        self.cancelled = threading.Event()

    def peer(self) -> str:
        return self._peer

    def cancel(self) -> None:
        self.cancelled.set()


def stalled(release: threading.Event) -> Iterator[bytes]:
    """One frame, then nothing until released."""
    yield b"header"
    release.wait(30)


def read(limits: StreamLimits, context: Context, release: threading.Event) -> threading.Thread:
    """Admits a stream and reads it on a thread, as a handler would."""
    stream = limits._admit("Push", context)  # type: ignore[arg-type]

    def handler() -> None:
        try:
            for _ in stream.frames(stalled(release)):
                pass
        finally:
            limits._release(stream)

    thread = threading.Thread(target=handler, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def limits() -> Iterator[StreamLimits]:
    warnings: list[str] = []
    made = StreamLimits(0.3, 3, 2, warn=warnings.append)
    made.warnings = warnings  # type: ignore[attr-defined]
    yield made
    made.close()


def test_a_stalled_stream_is_cancelled_at_the_read_deadline(limits: StreamLimits) -> None:
    release, context = threading.Event(), Context()
    started = time.monotonic()
    thread = read(limits, context, release)
    assert context.cancelled.wait(20)
    took = time.monotonic() - started
    release.set()
    thread.join(20)
    assert took >= 0.3 and limits.counts() == (0, 1, 0)
    assert "next frame did not come within --stream-read-timeout-s 0.3" in limits.warnings[0]  # type: ignore[attr-defined]


def test_a_stream_admitted_after_a_quiet_spell_is_still_watched(limits: StreamLimits) -> None:
    # Before: once no stream was open the watchdog waited to be woken, and admission never woke
    # it: after the first quiet moment of a server's life no stalled push was ever cancelled
    # (found by an end-to-end test whose joins took longer than one tick on a busy machine).
    first = limits._admit("Init", Context())  # type: ignore[arg-type]
    limits._release(first)
    wait_for("the watchdog to find nothing open and wait", lambda: limits.idle_waits > 0)
    release, context = threading.Event(), Context()
    thread = read(limits, context, release)
    try:
        assert context.cancelled.wait(20), "the stalled stream was never cancelled"
    finally:
        release.set()
        thread.join(20)
    assert limits.counts() == (0, 1, 0)


def test_streams_over_a_limit_are_refused_and_freed_ones_admit_again(limits: StreamLimits) -> None:
    aborted: list[str] = []

    class Refusing(Context):
        def abort(self, code: object, details: str) -> None:
            aborted.append(details)
            raise RuntimeError("aborted")

        def set_trailing_metadata(self, metadata: object) -> None:
            pass

    held = [limits._admit("Push", Refusing("ipv4:a")) for _ in range(2)]  # type: ignore[arg-type]
    with pytest.raises(RuntimeError):
        limits._admit("Push", Refusing("ipv4:a"))  # type: ignore[arg-type]  # 2 per connection
    held.append(limits._admit("Push", Refusing("ipv4:b")))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError):
        limits._admit("Push", Refusing("ipv4:c"))  # type: ignore[arg-type]  # 3 in all
    assert limits.counts() == (3, 0, 2)
    assert "--max-streams-per-peer 2" in aborted[0] and "3/4 of --threads" in aborted[1]
    limits._release(held.pop())
    held.append(limits._admit("Push", Refusing("ipv4:c")))  # type: ignore[arg-type]
    for stream in held:
        limits._release(stream)
    assert limits.counts() == (0, 0, 2)


@pytest.mark.parametrize(("threads", "budget"), [(1, 1), (2, 1), (4, 3), (8, 6), (16, 12)])
def test_the_stream_budget_keeps_a_quarter_of_the_threads(threads: int, budget: int) -> None:
    assert stream_budget(threads) == budget


def test_a_whole_transfer_is_cancelled_at_its_deadline_from_its_size() -> None:
    # Before: only each frame had a deadline; a transfer that moved a little in time, frame after
    # frame (a trickled push, a pull read slowly), was never cut.
    warnings: list[str] = []
    limits = StreamLimits(30.0, 3, 2, warn=warnings.append, allowance_s=0.2, min_rate_mb_s=1.0)
    try:
        assert limits.deadline_s(100_000) == pytest.approx(0.3)  # 0.2 s + 100,000 bytes at 1 MB/s
        slow, quick = Context("ipv4:slow"), Context("ipv4:quick")
        with limits.transfer("Pull", "worker rank 2", quick, 100_000, lambda: 100_000):  # type: ignore[arg-type]
            pass
        started = time.monotonic()
        with limits.transfer("Push", "worker rank 1", slow, 100_000, lambda: 12):  # type: ignore[arg-type]
            assert slow.cancelled.wait(20), "the slow transfer was never cancelled"
        took = time.monotonic() - started
        assert 0.3 <= took < 1.3 and not quick.cancelled.is_set()
        assert limits.counts() == (0, 1, 0) and limits.transfers_cancelled == 1
        assert warnings[0].startswith("cancelled a Push call from ipv4:slow (worker rank 1): 12 of 100000 bytes "
                                      "arrived in 0.3"), warnings
        assert "deadline of 0.30 s (--transfer-allowance-s 0.2 + 100000 bytes at --min-transfer-rate-mb-s 1)" in warnings[0]
    finally:
        limits.close()


def test_the_cap_counts_per_identity_or_per_host_not_per_connection() -> None:
    class Refusing(Context):
        def abort(self, code: object, details: str) -> None:
            raise RuntimeError(details)

        def set_trailing_metadata(self, metadata: object) -> None:
            pass

    roles = {"ipv4:10.0.0.9:1": "worker-1", "ipv4:10.0.0.9:2": "worker-1", "ipv4:10.0.0.9:3": "worker-2"}
    limits = StreamLimits(30, 10, 1, identify=lambda context: roles.get(context.peer()))
    try:
        limits._admit("Push", Refusing("ipv4:10.0.0.9:1"))  # type: ignore[arg-type]
        with pytest.raises(RuntimeError, match="open from worker-1 .over all its connections"):
            limits._admit("Push", Refusing("ipv4:10.0.0.9:2"))  # type: ignore[arg-type]  # another connection
        limits._admit("Push", Refusing("ipv4:10.0.0.9:3"))  # type: ignore[arg-type]  # another identity
        # without an identity: per host, whatever the port
        limits._admit("Push", Refusing("ipv6:[::1]:5000"))  # type: ignore[arg-type]
        with pytest.raises(RuntimeError, match=r"open from ipv6:\[::1\] "):
            limits._admit("Push", Refusing("ipv6:[::1]:5001"))  # type: ignore[arg-type]
        assert limits.counts() == (3, 0, 2)
    finally:
        limits.close()


def test_a_floor_rate_of_zero_sets_no_whole_transfer_deadline() -> None:
    assert transfer_deadline_s(10**12, 10.0, 0.0) == float("inf")
    assert transfer_deadline_s(100 * 10**6, 10.0, 1.0) == pytest.approx(110.0)  # the defaults: 100 MB in 110 s


@pytest.mark.parametrize(("peer", "host"), [("ipv4:10.0.0.7:41234", "ipv4:10.0.0.7"), ("ipv6:[::1]:5", "ipv6:[::1]"),
                                            ("ipv6:%5B::1%5D:5", "ipv6:%5B::1%5D"), ("unix:/tmp/s", "unix:/tmp/s")])
def test_a_peer_host_is_its_address_without_the_port(peer: str, host: str) -> None:
    assert peer_host(peer) == host
