"""Client streams held in check. A push (Push, PushGated), the chief's Init and a primary's
ReplicaApply each hold a handler thread (and a push its receive buffer) while their frames
arrive, so a peer that opens such a stream and stops sending could hold them for good. Here each
stream reads its frames under a deadline (a stream whose next frame does not come within
--stream-read-timeout-s is cancelled, and what it held is given back), and is admitted only while
few enough are open: per peer (--max-streams-per-peer), and in all (at most 3/4 of --threads:
status, heartbeats, joins, pulls and Step calls always find a thread). A peer is the caller's
authenticated identity (worker rank, admin, the job's servers) where the server authenticates,
else its host (the address without the port): a caller that opens many connections gets no more
streams than one. A stream over a limit is refused at once with ServerBusyError, which workers
retry after a pause.

A per-frame deadline alone lets a peer trickle a push (a few bytes per frame, each in time) and
hold its receive buffer for hours, or stop reading a pull and hold the weights it streams. So a
whole transfer, once its size is known, must also end within --transfer-allowance-s plus its size
at --min-transfer-rate-mb-s (transfer(): a push from the moment it holds a receive buffer, a pull
from the moment it is granted, a replica record's payload as it arrives); the same watchdog cancels
one that does not, and logs the peer and the figures. Until then a transfer that is slower than the
floor rate holds up no other: see transfers.behind_in."""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from psgrad.errors import ServerBusyError
from psgrad.wire import protocol
from psgrad.wire.protocol import METHOD_PREFIX

_log = logging.getLogger("psgrad.server")


def transfer_deadline_s(nbytes: int, allowance_s: float, min_rate_mb_s: float) -> float:
    """How long a transfer of nbytes may take: allowance_s + nbytes at min_rate_mb_s (MB/s, 10^6
    bytes a second; 0: no deadline, inf)."""
    return allowance_s + nbytes / (min_rate_mb_s * 1e6) if min_rate_mb_s > 0 else float("inf")


def peer_host(peer: str) -> str:
    """A gRPC peer without its port: 'ipv4:10.0.0.7:41234' -> 'ipv4:10.0.0.7', 'ipv6:[::1]:41234' ->
    'ipv6:[::1]'; any other kind (unix:...) as it is."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        host, sep, port = rest.rpartition(":")
        if sep and port.isdigit():
            return f"{kind}:{host}"
    return peer


def stream_budget(threads: int) -> int:
    """How many client streams may be open at once: all of --threads but a quarter (at least one),
    which the other calls keep."""
    return max(1, threads - max(1, threads // 4))


class _Stream:
    """One admitted client stream: whose it is, and since when it waits for its next frame."""

    __slots__ = ("method", "peer", "owner", "context", "since", "cancelled")

    def __init__(self, method: str, peer: str, owner: str, context: grpc.ServicerContext) -> None:
        self.method, self.peer, self.owner, self.context = method, peer, owner, context  # owner: whose cap it counts in
        self.since = 0.0  # time.monotonic() when it began to wait for a frame (0: not waiting)
        self.cancelled = False

    def frames(self, frames: Iterator[bytes]) -> Iterator[bytes]:
        """The call's frames, timed while the handler waits for each (two stores per frame)."""
        while True:
            self.since = time.monotonic()
            frame = next(frames, None)
            self.since = 0.0
            if frame is None:
                return
            yield frame


class _Transfer:
    """One push or pull under a whole-transfer deadline (see StreamLimits.transfer)."""

    __slots__ = ("method", "peer", "who", "context", "nbytes", "progress", "started", "deadline", "cancelled")

    def __init__(self, method: str, who: str, context: grpc.ServicerContext, nbytes: int,
                 progress: Callable[[], int], allowed_s: float) -> None:
        self.method, self.who, self.context, self.nbytes, self.progress = method, who, context, nbytes, progress
        self.peer = context.peer() or "?"
        self.started = time.monotonic()
        self.deadline = self.started + allowed_s
        self.cancelled = False


class StreamLimits(grpc.ServerInterceptor):
    """The server's client streams: admitted within the limits, their reads under a deadline (a
    watchdog thread cancels the stalled ones). Installed outermost but for the metrics interceptor,
    so that the guard reads a stream's header under the deadline too."""

    def __init__(self, read_timeout_s: float, max_streams: int, max_per_peer: int,
                 warn: Callable[[str], None] = _log.warning, allowance_s: float = 10.0,
                 min_rate_mb_s: float = 1.0, identify: Callable[[grpc.ServicerContext], str | None] | None = None,
                 ) -> None:
        """identify(context): the caller's authenticated identity (None: it has none, or the server
        does not authenticate); a stream counts against its identity's cap, else its host's."""
        self.read_timeout_s = read_timeout_s
        self.allowance_s = allowance_s  # a whole push or pull: this long, plus its size at min_rate_mb_s
        self.min_rate_mb_s = min_rate_mb_s
        self.max_streams = max_streams
        self.max_per_peer = max_per_peer
        self._warn = warn
        self._identify = identify
        self._cond = threading.Condition()
        self._open: set[_Stream] = set()
        self._transfers: set[_Transfer] = set()  # pushes and pulls under a whole-transfer deadline
        self._per_peer: dict[str, int] = {}
        self._closed = False
        self._watchdog: threading.Thread | None = None
        self.cancelled = 0  # streams cancelled for a frame that did not come in time, or transfers past their deadline
        self.transfers_cancelled = 0  # ... of which pushes and pulls past their whole-transfer deadline
        self.refused = 0  # streams refused over a limit
        self.idle_waits = 0  # times the watchdog found no stream open and waited for one (tests read it)
        self._wrapped: dict[str, tuple[Any, Any]] = {}  # method -> (its handler, the one under limits)

    # ----------------------------------------------------------------- admission
    def _owner(self, peer: str, context: grpc.ServicerContext) -> str:
        """Whose cap a stream counts against: its caller's identity, else its host."""
        who = self._identify(context) if self._identify is not None else None
        return who if who is not None else peer_host(peer)

    def _admit(self, method: str, context: grpc.ServicerContext) -> _Stream:
        peer = context.peer() or "?"
        owner = self._owner(peer, context)
        with self._cond:
            if self._closed:
                problem = None
            elif len(self._open) >= self.max_streams:
                problem = (f"{len(self._open)} pushes and other client streams are open on this server, the most it "
                           f"lets take its handler threads ({self.max_streams}, 3/4 of --threads)")
            elif self._per_peer.get(owner, 0) >= self.max_per_peer:
                problem = (f"{self._per_peer[owner]} client streams are open from {owner} (over all its connections), "
                           f"the most one peer may hold (--max-streams-per-peer {self.max_per_peer})")
            else:
                problem = None
                stream = _Stream(method, peer, owner, context)
                self._open.add(stream)
                self._per_peer[owner] = self._per_peer.get(owner, 0) + 1
                self._watched()
                return stream
            self.refused += 1
        protocol.abort(context, ServerBusyError(f"{method} refused for now: {problem}; try again once one ends"))
        raise AssertionError("unreachable: abort raises")

    def _watched(self) -> None:
        """(Under the lock, something to watch was just added.) Wake the watchdog if it waits untimed
        for something to watch (else it looks again within a tick, which is at most a quarter of the
        shortest deadline); start it at the first."""
        if len(self._open) + len(self._transfers) == 1:
            self._cond.notify_all()
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="psgrad-stream-watch", daemon=True)
            self._watchdog.start()

    def deadline_s(self, nbytes: int) -> float:
        """How long a whole push or pull of nbytes may take (--transfer-allowance-s, --min-transfer-rate-mb-s)."""
        return transfer_deadline_s(nbytes, self.allowance_s, self.min_rate_mb_s)

    @contextlib.contextmanager
    def transfer(self, method: str, who: str, context: grpc.ServicerContext, nbytes: int,
                 progress: Callable[[], int]) -> Iterator[None]:
        """Within the block, the call moves nbytes (a push receiving them, a pull sending them) and is
        cancelled by the watchdog if the block has not ended deadline_s(nbytes) after it began. `who`
        names the peer in the log line (its rank), `progress()` says how many bytes moved so far."""
        allowed = self.deadline_s(nbytes)
        if allowed == float("inf"):
            yield
            return
        transfer = _Transfer(method, who, context, nbytes, progress, allowed)
        with self._cond:
            watched = not self._closed
            if watched:
                self._transfers.add(transfer)
                self._watched()
        try:
            yield
        finally:
            if watched:
                with self._cond:
                    self._transfers.discard(transfer)

    def _release(self, stream: _Stream) -> None:
        with self._cond:
            self._open.discard(stream)
            left = self._per_peer.get(stream.owner, 1) - 1
            if left:
                self._per_peer[stream.owner] = left
            else:
                self._per_peer.pop(stream.owner, None)

    # ----------------------------------------------------------------- the deadline
    def _watch(self) -> None:
        tick = min(1.0, self.read_timeout_s / 4, self.allowance_s / 4)
        while True:
            with self._cond:
                while not self._open and not self._transfers and not self._closed:
                    self.idle_waits += 1
                    self._cond.wait()
                if self._closed:
                    return
                now = time.monotonic()
                late = [s for s in self._open if s.since and not s.cancelled and now - s.since > self.read_timeout_s]
                for s in late:
                    s.cancelled = True
                    self.cancelled += 1
                overdue = [t for t in self._transfers if not t.cancelled and now >= t.deadline]
                for t in overdue:
                    t.cancelled = True
                    self.cancelled += 1
                    self.transfers_cancelled += 1
            for s in late:  # (outside the lock: cancelling runs the call's callbacks)
                s.context.cancel()
                self._warn(f"cancelled a {s.method} call from {s.peer}: its next frame did not come within "
                           f"--stream-read-timeout-s {self.read_timeout_s:g}; what it held (a receive buffer, a "
                           "handler thread) is free again")
            for t in overdue:
                moved = t.progress()
                t.context.cancel()
                pushed = t.method != "Pull"
                self._warn(
                    f"cancelled a {t.method} call {'from' if pushed else 'to'} {t.peer} ({t.who}): "
                    f"{moved} of {t.nbytes} bytes {'arrived' if pushed else 'sent'} in {now - t.started:.2f} s, "
                    f"past its deadline of {t.deadline - t.started:.2f} s (--transfer-allowance-s {self.allowance_s:g} "
                    f"+ {t.nbytes} bytes at --min-transfer-rate-mb-s {self.min_rate_mb_s:g}); "
                    + ("what it held (a receive buffer, a handler thread) is free again" if pushed else
                       "the weights it was sending and its handler thread are released"))
            with self._cond:
                if not self._closed:
                    wait = tick
                    if self._transfers:
                        nearest = min((t.deadline for t in self._transfers if not t.cancelled), default=now + tick)
                        wait = max(0.005, min(tick, nearest - time.monotonic() + 0.005))
                    self._cond.wait(wait)

    def counts(self) -> tuple[int, int, int]:
        """(client streams open now, cancelled for a late frame or past a whole-transfer deadline,
        refused over a limit)."""
        return len(self._open), self.cancelled, self.refused

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # ----------------------------------------------------------------- the interceptor
    def intercept_service(self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or not handler.request_streaming or not details.method.startswith(METHOD_PREFIX):
            return handler
        cached = self._wrapped.get(details.method)
        if cached is not None and cached[0] is handler:  # the method table's handlers never change
            return cached[1]
        limited = self._limited(details.method[len(METHOD_PREFIX):], handler)
        self._wrapped[details.method] = (handler, limited)
        return limited

    def _limited(self, method: str, handler: Any) -> Any:
        admit, release = self._admit, self._release
        if handler.stream_unary:
            behavior = handler.stream_unary

            def single(frames: Iterator[bytes], context: grpc.ServicerContext) -> Any:
                stream = admit(method, context)
                try:
                    return behavior(stream.frames(frames), context)
                finally:
                    release(stream)

            wrapped: Callable[..., Any] = single
        else:
            behavior = handler.stream_stream

            def streaming(frames: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[Any]:
                stream = admit(method, context)
                try:
                    yield from behavior(stream.frames(frames), context)
                finally:
                    release(stream)

            wrapped = streaming
        kind = "stream_unary" if handler.stream_unary else "stream_stream"
        return getattr(grpc, f"{kind}_rpc_method_handler")(
            wrapped, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
