"""A server's bound on the bytes the replies to reads hold at once (--max-read-mb): reads of rows,
and pulls of the dense weights whose reply carries them (a Pull's frames, a Step's reply with the
weights; not those copied into a same-host worker's segment, or lent from the published versions,
which build no reply of them), and reads of the frozen table (a shard's range of the frozen
parameters: as the weights, larger than the bound it goes alone). A read takes its reply's bytes
(counted from its request: ids x width x 4, or the shard's weights at the wire's width) before it
builds the reply, and gives them back once the call has ended (the reply sent, or the call failed or was cancelled), so
that replies being built, or waiting in gRPC to be sent, never hold more than the bound. A read
past the bound waits its turn, in order of arrival (a large read is not passed for ever by small
ones), until shortly before its deadline; a read of rows larger than the whole bound is refused at
once, naming the flag and the size it would need (the caller can read fewer rows a call), while a
pull of the dense weights larger than it (a shard's weights: no call can ask for less) goes alone,
once nothing else is in flight. Reads store no rows, so --memory-budget-mb never held
them: without this, 16 concurrent reads of 61 MB took one server to 1.5 GB."""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from psgrad.errors import InvalidRequestError, ServerBusyError


#: what a read of rows larger than the whole bound may do instead (see ReadLimit.check)
ROWS_ADVICE = "read fewer rows a call"
#: ... and a pull of the dense weights (a Pull, or a Step's reply with the weights)
DENSE_ADVICE = "give the job more servers (each sends its shard's share of the weights)"


def read_limit_bytes(mb: float) -> int | None:
    """The bytes --max-read-mb allows at once (0: no limit)."""
    return None if mb == 0 else int(mb * 2**20)


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


def _flag(limit: int) -> str:
    mb = limit / 2**20
    return f"--max-read-mb {mb:,.0f}" if mb.is_integer() else f"--max-read-mb {mb:g}"


@dataclass(frozen=True)
class ReadCounts:
    """What the bound holds now and has done (all 0 where there is none but in_flight and peak)."""

    limit: int = 0  # the bound in bytes (0: none)
    in_flight: int = 0  # bytes of the replies of reads in progress now
    peak: int = 0  # the most bytes ever in flight at once
    waiting: int = 0  # reads waiting for their turn now
    queued: int = 0  # reads that waited for their turn (ever)
    expired: int = 0  # reads that gave up waiting: their deadline came, or their call ended
    refused: int = 0  # reads refused as larger than the whole bound


class ReadLimit:
    """The bytes of reads in flight on one server, bounded by `limit` (None: no bound; the bytes
    are still counted). Thread-safe."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[object] = deque()  # the reads waiting for their turn, oldest first
        self.in_flight = 0
        self.peak = 0
        self.queued = 0
        self.expired = 0
        self.refused = 0

    def check(self, nbytes: int, what: str, advice: str = ROWS_ADVICE) -> None:
        """Refuse a read of rows larger than the whole bound (it would never get its turn); advice:
        what the caller may do instead, besides raising the bound. A pull of the dense weights
        (advice DENSE_ADVICE) is never refused: one larger than the bound goes alone (see acquire).

        Raises:
            InvalidRequestError: naming the flag, its value and the size the read needs.
        """
        if self.limit is not None and nbytes > self.limit and advice != DENSE_ADVICE:
            with self._cond:
                self.refused += 1
            need = math.ceil(nbytes / 2**20)
            raise InvalidRequestError(
                f"{what} would make a reply of {nbytes:,} bytes ({_mb(nbytes)}), more than the {_mb(self.limit)} this "
                f"server lets the replies to reads hold at once ({_flag(self.limit)}): {advice}, or "
                f"start the servers with --max-read-mb {need} or more (0: no limit)")

    def acquire(self, nbytes: int, what: str, timeout_s: float | None = None,
                is_active: Callable[[], bool] = lambda: True, advice: str = ROWS_ADVICE) -> None:
        """Take nbytes for a read (checked: see check), waiting for its turn: reads are let in in
        order of arrival, each once its bytes fit beside those in flight (a pull of the dense weights
        larger than the whole bound: once nothing is in flight, alone). Give them back with
        release(nbytes) once its reply is sent. wake() makes a waiting read look at is_active again.

        Raises:
            InvalidRequestError: larger than the whole bound (see check).
            ServerBusyError: timeout_s passed first, or the call ended (is_active() turned False);
                nothing is taken.
        """
        self.check(nbytes, what, advice)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            if not self._queue and self._fits(nbytes):  # (the common case: nobody waits, and it fits)
                self._take(nbytes)
                return
            ticket = object()
            self._queue.append(ticket)
            self.queued += 1
            try:
                while not (self._queue[0] is ticket and self._fits(nbytes)):
                    left = None if deadline is None else deadline - time.monotonic()
                    if (left is not None and left <= 0) or not is_active():
                        self.expired += 1
                        assert self.limit is not None
                        raise ServerBusyError(
                            f"{what} ({_mb(nbytes)}) waited for its turn until its deadline: the replies to reads "
                            f"in progress hold {_mb(self.in_flight)} of the {_mb(self.limit)} this server lets them "
                            f"hold at once ({_flag(self.limit)}), and {len(self._queue) - 1} more reads wait; try "
                            "again, give the call a longer deadline, or raise --max-read-mb")
                    self._cond.wait(left)
                self._take(nbytes)
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()  # (the next in line may fit too, or be first now)

    def _fits(self, nbytes: int) -> bool:
        """Whether a read of nbytes may go now: beside those in flight within the bound, or one
        larger than the bound (checked: the dense weights) when nothing is in flight."""
        return self.limit is None or self.in_flight + nbytes <= self.limit or self.in_flight == 0

    def _take(self, nbytes: int) -> None:
        self.in_flight += nbytes
        self.peak = max(self.peak, self.in_flight)

    def release(self, nbytes: int) -> None:
        """Give back what acquire took for a read whose reply was sent (or will not be)."""
        with self._cond:
            self.in_flight = max(0, self.in_flight - nbytes)
            if self._queue:
                self._cond.notify_all()

    def wake(self) -> None:
        """Make the waiting reads look at their call again (one was cancelled)."""
        with self._cond:
            if self._queue:
                self._cond.notify_all()

    def counts(self) -> ReadCounts:
        with self._cond:
            return ReadCounts(self.limit or 0, self.in_flight, self.peak, len(self._queue), self.queued,
                              self.expired, self.refused)
