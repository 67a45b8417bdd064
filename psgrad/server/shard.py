"""One shard's state: master weights, optimizer, version, clocks, leases and the consistency gate; no network."""
from __future__ import annotations

import math
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from psgrad.server import transfers as streams
from psgrad.core.codecs import WireBuffer, torch_dtype
from psgrad.config import ServerConfig
from psgrad.core.consistency import ClockView, ConsistencyPolicy, SyncPolicy, make_policy
from psgrad.errors import (
    InvalidRequestError,
    JobMismatchError,
    NotInitializedError,
    WorkerStateError,
)
from psgrad.core.layout import Layout, explain_mismatch
from psgrad.core.optimizers import ShardOptimizer, make_optimizer
from psgrad.server.transfers import PullStream, PushWriter, UpdateRule, staged_rule

NOT_INITIALIZED_HINT = (
    "shard is not initialized: start worker rank 0 (the chief) against these servers first; "
    "it sends the job spec and the initial weights"
)
HISTORY_LEN = 100_000
LIVE, LEFT, EVICTED = "live", "left", "evicted"


@dataclass
class Member:
    """What a shard knows about one worker."""

    rank: int
    last_seen: float
    clock: int = 0  # iterations completed (pushes handled, or the clock it joined at)
    pushes: int = 0
    state: str = LIVE
    last_push_clock: int = -1  # highest clock whose push was handled (applied, buffered or skipped)


@dataclass
class PushResult:
    applied: bool
    reason: str
    version: int
    staleness: int
    deferred: bool = False


@dataclass
class JoinResult:
    initialized: bool
    ready: bool
    joined: int
    start_clock: int
    version: int


@dataclass
class _Pending:
    grad: torch.Tensor
    wire: WireBuffer
    clock: int
    base_version: int


@dataclass
class _Counters:
    pushes_applied: int = 0
    pushes_duplicate: int = 0
    pushes_rejected: int = 0
    pulls: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    evictions: int = 0
    staleness: Counter[int] = field(default_factory=Counter)


class Shard:
    """Thread-safe state of one parameter shard. Every public method may be called concurrently.

    `history` records, in order, every granted pull ("pull", rank, clock, slowest live clock,
    version), applied update ("apply", version after, ((rank, clock, staleness), ...)), and
    membership change ("join"/"leave"/"evict", rank, clock) — the audit trail the consistency
    tests check, bounded to the last HISTORY_LEN events.
    """

    def __init__(self, config: ServerConfig, now: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._now = now
        lock = threading.RLock()
        self._lock = lock
        self._cond = threading.Condition(lock)  # state changed: waiting pulls, joins, reaper re-check
        # Observers (wait_until) also wake when a pull starts waiting; a separate condition on the
        # same lock, so that parking a pull never wakes the other parked pulls.
        self._observers = threading.Condition(lock)
        # The reaper sleeps until the next lease expiry; only a new member or close() wakes it
        # early (a renewed lease only moves expiries later), not every push.
        self._reaper_wake = threading.Condition(lock)
        self._started = now()
        self.layout: Layout | None = None
        self._weights: torch.Tensor | None = None
        self._optimizer: ShardOptimizer | None = None
        self._policy: ConsistencyPolicy = make_policy("async")
        # Receive buffers. Async/ssp lend at most push_buffers at once. With push_buffers == 1 and
        # an element-wise rule (`_rule`, plain SGD), the one push being received computes the next
        # weights into its buffer as it arrives, and the update swaps tensors: the former weights
        # become the spare buffer once no pull stream reads them (`_retired` until then).
        self._pool: list[tuple[torch.Tensor, WireBuffer]] = []
        self._lent: dict[int, PushWriter] = {}  # id(grad) -> writer, for buffers out on loan
        self._revoked: dict[int, PushWriter] = {}  # ... whose worker was evicted mid-push
        self._rule: UpdateRule | None = None
        self._building = False  # staged: a push holds the turn to build the next weights
        self._retired: list[torch.Tensor] = []
        self._buffer_free = threading.Condition(lock)  # a push waits here for its turn or a buffer
        self._buffer_waits = 0
        # Open pull streams reading a tensor the shard owns; weak, so a stream dropped unread ends.
        self._reads: weakref.WeakSet[PullStream] = weakref.WeakSet()
        self._writers_waiting = 0  # in-place updates waiting for streams of the current weights
        self._reads_done = threading.Condition(lock)  # ... wait here
        self._no_writers = threading.Condition(lock)  # a granted pull waits here for those updates
        self._pending: dict[int, _Pending] = {}
        self._skipped = 0  # sync: pushes of the current iteration skipped as non-finite
        self.version = 0
        self._members: dict[int, Member] = {}
        self._counters = _Counters()
        self.history: deque[tuple[Any, ...]] = deque(maxlen=HISTORY_LEN)
        self._closed = False
        self._waiting = 0  # pulls parked in the gate right now

    def _notify(self) -> None:
        """Wake everything waiting for a state change (caller holds the lock)."""
        self._cond.notify_all()
        self._observers.notify_all()

    def _notify_transfers(self) -> None:
        """Wake pushes waiting for a buffer and updates waiting for pull streams (lock held)."""
        self._buffer_free.notify_all()
        self._reads_done.notify_all()
        self._no_writers.notify_all()

    def start_reaper(self) -> threading.Thread:
        """Evict workers the moment their lease expires, even when no call arrives (so a sync
        iteration a dead worker owed completes on time). Servers start it; close() stops it."""

        def loop() -> None:
            with self._cond:
                while not self._closed:
                    self._refresh()
                    self._reaper_wake.wait(timeout=self._next_expiry_s())

        thread = threading.Thread(target=loop, name="psgrad-lease-reaper", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        """Stop the reaper and wake every waiting call."""
        with self._cond:
            self._closed = True
            self._notify()
            self._notify_transfers()
            self._reaper_wake.notify_all()

    def wait_until(self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float) -> bool:
        """Block until predicate(status()) holds (re-checked on every state change) or timeout_s."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not predicate(self.status()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._observers.wait(timeout=left)
            return True

    def audit(self) -> tuple[list[tuple[Any, ...]], list[tuple[int, int]], int]:
        """A consistent snapshot of (history, buffered sync pushes as (rank, clock), version)."""
        with self._cond:
            return list(self.history), sorted((r, p.clock) for r, p in self._pending.items()), self.version

    # ----------------------------------------------------------------- membership
    def _view(self) -> ClockView:
        return ClockView(self.version, {r: m.clock for r, m in self._members.items() if m.state == LIVE})

    def _refresh(self) -> None:
        """Evict live members whose lease expired; complete a sync iteration nobody owes any more."""
        now = self._now()
        changed = False
        for m in self._members.values():
            if m.state == LIVE and now - m.last_seen > self._config.lease_s:
                m.state = EVICTED
                self._counters.evictions += 1
                self.history.append(("evict", m.rank, m.clock))
                self._revoke_pushes(m.rank)
                changed = True
        changed = self._complete_iteration() or changed
        if changed:
            self._notify()

    def _next_expiry_s(self) -> float | None:
        now = self._now()
        times = [m.last_seen + self._config.lease_s - now for m in self._members.values() if m.state == LIVE]
        return max(0.0, min(times)) + 1e-3 if times else None

    def _live_member(self, rank: int) -> Member:
        member = self._members.get(rank)
        if member is None:
            raise WorkerStateError(f"worker rank {rank} has not joined this shard (Join first)")
        if member.state == EVICTED:
            raise WorkerStateError(
                f"worker rank {rank} was evicted: no call for longer than its lease of "
                f"{self._config.lease_s:g} s (raise --lease-s on the servers if the worker is merely slow); "
                "restart the worker to rejoin"
            )
        if member.state == LEFT:
            raise WorkerStateError(f"worker rank {rank} already left the job; start it again to rejoin")
        member.last_seen = self._now()
        return member

    def live_ranks(self) -> set[int]:
        """Ranks of the workers whose lease holds (after evicting the expired ones)."""
        with self._cond:
            self._refresh()
            return {r for r, m in self._members.items() if m.state == LIVE}

    def touch(self, rank: int) -> int:
        """Renew a live worker's lease (heartbeat); returns the shard version."""
        with self._cond:
            self._refresh()
            self._live_member(rank)
            return self.version

    def leave(self, rank: int) -> None:
        """Mark rank as having left the job on purpose; nobody waits for it any more."""
        with self._cond:
            member = self._members.get(rank)
            if member is not None and member.state == LIVE:
                member.state = LEFT
                self.history.append(("leave", rank, member.clock))
            self._refresh()
            self._notify()

    def wake(self) -> None:
        """Wake waiting pulls so they re-check their call (used when a call ends or is cancelled)."""
        with self._cond:
            if self._waiting:  # every pull's end calls this: skip the wake-up when nobody waits
                self._notify()

    # ----------------------------------------------------------------- join / init
    def _require_layout(self, fingerprint: str, rank: int) -> Layout:
        layout = self.layout
        if layout is None:
            raise NotInitializedError(NOT_INITIALIZED_HINT)
        if fingerprint != layout.fingerprint:
            raise JobMismatchError(
                f"worker rank {rank} sent fingerprint {fingerprint or '(none)'}, but this shard was "
                f"initialized for {layout.fingerprint}: the worker's model or job spec differs "
                "(Join reports which field)"
            )
        return layout

    def _register(self, rank: int) -> Member:
        """Add rank as a live member, or bring a left/evicted one back; it continues from a clock
        at least past its own last push, so its new pushes are never mistaken for duplicates."""
        member = self._members.get(rank)
        view = self._view()
        start = self._policy.start_clock(view)
        if member is None:
            member = self._members[rank] = Member(rank, self._now(), clock=start)
            self.history.append(("join", rank, start))
            self._notify()
            self._reaper_wake.notify_all()
        elif member.state != LIVE:
            member.state = LIVE
            member.clock = max(start, member.last_push_clock + 1)
            self.history.append(("join", rank, member.clock))
            self._notify()
            self._reaper_wake.notify_all()
        member.last_seen = self._now()
        return member

    def _ready(self) -> bool:
        layout = self.layout
        if layout is None:
            return False
        return not self._policy.start_barrier or len(self._members) >= layout.spec.num_workers

    def join(self, rank: int, layout: Layout, wait_s: float = 0.0) -> JoinResult:
        """Check a worker's layout against the installed one and register it; optionally wait (up to
        wait_s) for the chief's initialization and, in sync/ssp, for all num_workers to join.

        Raises:
            JobMismatchError: the worker's job spec, model or shard range differs (named).
        """
        deadline = self._now() + max(0.0, wait_s)
        with self._cond:
            while True:
                if self.layout is not None:
                    problem = explain_mismatch(self.layout, layout, rank)
                    if problem:
                        raise JobMismatchError(problem)
                    member = self._register(rank)
                if self._ready() or self._now() >= deadline:
                    break
                self._cond.wait(timeout=max(0.0, deadline - self._now()))
            if self.layout is None:
                return JoinResult(False, False, 0, 0, self.version)
            return JoinResult(True, self._ready(), len(self._members), member.clock, self.version)

    def initialize(self, rank: int, layout: Layout, weights: torch.Tensor) -> bool:
        """Install the job and initial weights. Idempotent for an identical layout.

        Returns True when the shard was already initialized with the same layout (nothing changes).
        """
        if weights.dtype != torch.float32 or weights.numel() != layout.numel:
            raise InvalidRequestError(
                f"initial weights of shard {layout.index} must be {layout.numel} float32 values, "
                f"got {weights.numel()} {weights.dtype}"
            )
        optimizer = make_optimizer(layout.spec, layout.numel)
        policy = make_policy(layout.spec.mode, layout.spec.staleness)
        with self._cond:
            if self.layout is not None:
                problem = explain_mismatch(self.layout, layout, rank)
                if problem:
                    raise JobMismatchError(problem)
                return True
            self.layout = layout
            self._weights = weights
            self._optimizer = optimizer
            self._policy = policy
            staged = not isinstance(policy, SyncPolicy) and layout.spec.wire_dtype == "float32"
            self._rule = staged_rule(optimizer) if staged and self._config.push_buffers == 1 else None
            self._register(rank)
            self._notify()
            return False

    # ----------------------------------------------------------------- pull
    def pull_frames(
        self,
        rank: int,
        clock: int,
        fingerprint: str,
        timeout_s: float | None = None,
        is_active: Callable[[], bool] = lambda: True,
        observe: bool = False,
    ) -> tuple[int, PullStream] | None:
        """Wait until the mode's gate lets `rank` at `clock` pull, then return the version of the
        weights and a stream of their wire frames (built lazily; see PullStream). None if timeout_s
        passed or the call was cancelled.

        observe=True takes a read-only snapshot: no gate, no clock, no lease (evaluation, monitoring).
        """
        deadline = None if timeout_s is None else self._now() + timeout_s
        with self._cond:
            layout = self._require_layout(fingerprint, rank)
            while True:
                ready = True
                if not observe:
                    self._refresh()
                    member = self._live_member(rank)
                    if clock > member.clock:  # a joining worker announces where it continues from
                        member.clock = clock
                        self._refresh()
                    view = self._view()
                    ready = self._policy.pull_ready(clock, view)
                if ready and not self._writers_waiting:
                    if not observe:
                        self.history.append(("pull", rank, clock, view.min_clock, self.version))
                    break
                if not is_active() or self._closed:
                    return None
                waits = [t for t in (self._next_expiry_s(),) if t is not None]
                if deadline is not None:
                    left = deadline - self._now()
                    if left <= 0:
                        return None
                    waits.append(left)
                if ready:  # the gate is open; an update is waiting for the pulls already streaming
                    self._no_writers.wait(timeout=min(waits) if waits else None)
                    continue
                self._waiting += 1
                self._observers.notify_all()
                try:
                    self._cond.wait(timeout=min(waits) if waits else None)
                finally:
                    self._waiting -= 1
            assert self._weights is not None
            wire_dtype = torch_dtype(layout.spec.wire_dtype)
            stream = PullStream(
                self._weights, self.version, wire_dtype, self._config.chunk_bytes, self._lock, self._end_read
            )
            self._reads.add(stream)
            self._counters.pulls += 1
            self._counters.bytes_out += stream.nbytes
            return self.version, stream

    def _end_read(self, stream: PullStream) -> None:
        """A pull stream ended (caller holds the lock): free what only it kept."""
        self._reads.discard(stream)
        source = stream.source
        if any(t is source for t in self._retired) and not any(r.source is source for r in self._reads):
            self._retired = [t for t in self._retired if t is not source]
            self._pool.append((source, WireBuffer(source.numel(), "float32")))
            self._buffer_free.notify_all()
        if self._writers_waiting and not self._current_reads():
            self._reads_done.notify_all()

    def _current_reads(self) -> list[PullStream]:
        return [r for r in self._reads if r.source is self._weights]

    def _await_reads(self) -> None:
        """Before an in-place update (caller holds the lock): wait until no pull stream reads the
        current weights. Pulls granted meanwhile wait for the update; a stream idle for STALL_S
        gets a private copy instead."""
        while reads := self._current_reads():
            idle = time.monotonic() - max(r.last_active for r in reads)
            if idle >= streams.STALL_S or self._closed:
                self._detach_reads()
                return
            self._writers_waiting += 1
            self._observers.notify_all()
            try:
                self._reads_done.wait(timeout=streams.STALL_S - idle)
            finally:
                self._writers_waiting -= 1
                if not self._writers_waiting:
                    self._no_writers.notify_all()

    def _detach_reads(self) -> None:
        """Give the streams still reading the current weights a private copy (caller holds the lock)."""
        reads = self._current_reads()
        if not reads:
            return
        assert self._weights is not None and self.layout is not None
        copy = self._weights.to(torch_dtype(self.layout.spec.wire_dtype), copy=True)
        for stream in reads:
            stream.detach(copy)
            self._reads.discard(stream)

    def blocking(self, rank: int, clock: int) -> list[int]:
        """Ranks that a pull of `rank` at `clock` waits for (for error messages)."""
        with self._cond:
            return [r for r in self._policy.blocking(clock, self._view()) if r != rank]

    # ----------------------------------------------------------------- push
    def push_target(
        self, rank: int, clock: int, base_version: int, numel: int, dtype: str, fingerprint: str
    ) -> tuple[torch.Tensor, WireBuffer, PushWriter]:
        """Validate a push header and lend a receive buffer (apply_push or release gives it back)."""
        with self._cond:
            layout = self._require_layout(fingerprint, rank)
            problem = None
            if numel != layout.numel:
                problem = (
                    f"push from worker rank {rank} has {numel} elements, but shard {layout.index} owns "
                    f"range [{layout.start}, {layout.end}) = {layout.numel} elements"
                )
            elif dtype != layout.spec.wire_dtype:
                problem = (
                    f"push from worker rank {rank} is {dtype!r}, the job's wire dtype is "
                    f"{layout.spec.wire_dtype!r}"
                )
            elif base_version > self.version:
                problem = (
                    f"push from worker rank {rank} claims base version {base_version}, newer than "
                    f"shard version {self.version}"
                )
            if problem:
                self._counters.pushes_rejected += 1
                raise InvalidRequestError(problem)
            try:
                self._live_member(rank)
            except WorkerStateError:
                self._counters.pushes_rejected += 1
                raise
            if self._rule is not None:
                grad, wire = self._staged_buffer(layout.numel)
            else:
                grad, wire = self._classic_buffer(layout.numel, dtype)
            writer = PushWriter(rank, grad, wire.receive_view(grad), f"push from worker rank {rank}", dtype == "float32")
            self._lent[id(grad)] = writer
            writer.holds_turn = self._rule is not None
            member = self._members[rank]
            if self._rule is not None and clock > member.last_push_clock:  # not a duplicate
                spec = layout.spec
                scale = self._policy.lr_scale(self.version - base_version, spec.staleness_lr)
                assert self._weights is not None
                writer.stage(self._weights, self._rule, scale, self.version)
        return grad, wire, writer

    def _classic_buffer(self, numel: int, dtype: str) -> tuple[torch.Tensor, WireBuffer]:
        """A receive buffer; in async/ssp wait while push_buffers are out on loan (caller holds the
        lock), unless every holder has been idle for STALL_S: then lend one beyond the limit."""
        if not isinstance(self._policy, SyncPolicy):  # sync keeps one per worker until the mean
            while not self._pool and len(self._lent) >= self._config.push_buffers and not self._closed:
                idle = time.monotonic() - max(w.last_active for w in self._lent.values())
                if idle >= streams.STALL_S:
                    break
                self._wait_for_buffer(streams.STALL_S - idle)
        if self._pool:
            return self._pool.pop()
        return torch.empty(numel), WireBuffer(numel, dtype)

    def _staged_buffer(self, numel: int) -> tuple[torch.Tensor, WireBuffer]:
        """Wait for the turn to build the next weights (one push at a time; a push whose worker
        is evicted gives it up), then for the spare tensor, which a pull stream of the former
        weights may still read (lend a new one if that stream is idle for STALL_S)."""
        while self._building and not self._closed:
            self._wait_for_buffer(None)
        self._building = True
        while not self._pool and self._retired and not self._closed:
            reads = [r for r in self._reads if r.source is not self._weights]
            idle = time.monotonic() - max((r.last_active for r in reads), default=0.0)
            if idle >= streams.STALL_S:
                break
            self._wait_for_buffer(streams.STALL_S - idle)
        if self._pool:
            return self._pool.pop()
        return torch.empty(numel), WireBuffer(numel, "float32")

    def _writer_of(self, grad: torch.Tensor) -> PushWriter | None:
        return self._lent.get(id(grad)) or self._revoked.get(id(grad))

    def _wait_for_buffer(self, timeout_s: float | None) -> None:
        self._buffer_waits += 1
        self._observers.notify_all()
        try:
            self._buffer_free.wait(timeout=timeout_s)
        finally:
            self._buffer_waits -= 1

    def _revoke_pushes(self, rank: int) -> None:
        """An evicted worker's push in flight never applies; a staged one gives up its turn now
        (its buffer stays with it until its call ends, since bytes may still arrive)."""
        for key, writer in list(self._lent.items()):
            if writer.rank == rank:
                writer.revoked = True
                if writer.holds_turn:
                    self._revoked[key] = self._lent.pop(key)
                    self._building = False
                    self._buffer_free.notify_all()

    def release(self, grad: torch.Tensor, wire: WireBuffer) -> None:
        """Return a receive buffer: to the pool, or to the allocator if it was lent beyond the limit."""
        with self._cond:
            self._revoked.pop(id(grad), None)
            writer = self._lent.pop(id(grad), None)
            if writer is not None and writer.holds_turn:
                self._building = False
            if isinstance(self._policy, SyncPolicy):
                keep = True
            elif self._rule is not None:
                keep = not self._pool and not self._retired  # one spare tensor
            else:
                keep = len(self._pool) + len(self._lent) < self._config.push_buffers
            if keep:
                self._pool.append((grad, wire))
            self._buffer_free.notify_all()

    def reject(self) -> None:
        """Count a push that failed after its header was accepted."""
        with self._cond:
            self._counters.pushes_rejected += 1

    def apply_push(
        self, rank: int, clock: int, base_version: int, grad: torch.Tensor, wire: WireBuffer, nbytes: int
    ) -> PushResult:
        """Handle a fully received gradient once: apply it (async/ssp) or buffer it for the
        iteration's mean (sync). Duplicates of (rank, clock) are acknowledged only.
        Takes ownership of the buffers."""
        kept = False
        try:
            wire.finish_receive(grad)
            # A sum is non-finite whenever some element is NaN or +-inf, and costs far less than
            # isfinite(grad).all() (no mask allocated); only an overflowing sum needs the exact check.
            # The shard's own writer already summed the gradient piece by piece as it arrived.
            with self._cond:
                writer = self._writer_of(grad)
            staged = writer is not None and writer.staged
            if writer is not None and writer.checked:
                bad = writer.nonfinite
            elif math.isfinite(float(grad.sum())):
                bad = 0
            else:
                bad = int((~torch.isfinite(grad)).sum())
            with self._cond:
                if not staged and not isinstance(self._policy, SyncPolicy):
                    known = self._members.get(rank)
                    if known is None or clock > known.last_push_clock:  # (re-checked below)
                        self._await_reads()  # an in-place update must not change weights a pull streams
                self._refresh()
                self._counters.bytes_in += nbytes
                member = self._live_member(rank)
                if writer is not None and writer.revoked:
                    raise WorkerStateError(f"worker rank {rank} was evicted while pushing; nothing was applied")
                if clock <= member.last_push_clock:
                    self._counters.pushes_duplicate += 1
                    return PushResult(False, f"duplicate push (rank {rank}, clock {clock})", self.version, 0)
                sync = isinstance(self._policy, SyncPolicy)
                if sync and clock != self.version:
                    self._counters.pushes_rejected += 1
                    raise InvalidRequestError(
                        f"sync push from worker rank {rank} is for iteration {clock}, but shard is at "
                        f"iteration {self.version} (pull before pushing)"
                    )
                if bad and self._config.nonfinite != "allow":
                    self._counters.pushes_rejected += 1
                    if self._config.nonfinite == "reject":
                        raise InvalidRequestError(
                            f"gradient from worker rank {rank} at clock {clock} has {bad} non-finite values; "
                            "the shard is unchanged (start the server with --nonfinite skip|allow to change this)"
                        )
                    self._advance(member, clock)  # "skip": acknowledged, never applied
                    if sync:
                        self._skipped += 1
                        self._refresh()  # the skipped worker no longer owes this iteration
                    return PushResult(False, f"skipped: {bad} non-finite values", self.version, 0)
                if sync:
                    self._pending[rank] = _Pending(grad, wire, clock, base_version)
                    self._lent.pop(id(grad), None)
                    kept = True
                    self._advance(member, clock)
                    before = self.version
                    self._refresh()
                    if self.version > before:
                        return PushResult(True, "", self.version, 0)
                    return PushResult(False, "buffered until every live worker pushed", self.version, 0, True)
                assert self._weights is not None and self._optimizer is not None
                staleness = self.version - base_version
                if staged:  # the buffer holds the next weights: swap them in
                    assert writer is not None and writer.staged_version == self.version
                    self._commit(grad, wire)
                    kept = True
                else:
                    spec = self.layout.spec if self.layout else None
                    scale = self._policy.lr_scale(staleness, bool(spec and spec.staleness_lr))
                    self._optimizer.apply(self._weights, grad, lr_scale=scale)
                self.version += 1
                self._advance(member, clock)
                self._counters.pushes_applied += 1
                self._counters.staleness[staleness] += 1
                self.history.append(("apply", self.version, ((rank, clock, staleness),)))
                self._notify()
                return PushResult(True, "", self.version, staleness)
        finally:
            if not kept:
                self.release(grad, wire)

    def _commit(self, weights: torch.Tensor, wire: WireBuffer) -> None:
        """Make a staged buffer the weights (caller holds the lock); the former weights become the
        spare buffer, once no pull stream reads them."""
        old = self._weights
        assert old is not None
        self._weights = weights
        del self._lent[id(weights)]
        self._building = False
        if any(r.source is old for r in self._reads):
            self._retired.append(old)
        else:
            self._pool.append((old, wire))
        self._buffer_free.notify_all()

    def _advance(self, member: Member, clock: int) -> None:
        member.clock = max(member.clock, clock + 1)
        member.last_push_clock = clock
        member.pushes += 1

    def _complete_iteration(self) -> bool:
        """Sync: apply the mean of the buffered gradients (summed in rank order, so the result does
        not depend on arrival order) once no live worker still owes this iteration."""
        if not isinstance(self._policy, SyncPolicy):
            return False
        handled = len(self._pending) + self._skipped
        if not self._policy.iteration_complete(self.version, self._view(), handled):
            return False
        assert self._weights is not None and self._optimizer is not None
        ranks = sorted(self._pending)
        items = [self._pending.pop(r) for r in ranks]
        self._skipped = 0
        if items:  # else every gradient of the iteration was skipped: an empty update
            self._detach_reads()  # only snapshots (observe) can be streaming here; rare
            total = items[0].grad
            for item in items[1:]:
                total.add_(item.grad)
            total.mul_(1.0 / len(items))
            self._optimizer.apply(self._weights, total)
        applied_at = self.version
        self.version += 1
        stale = tuple((r, it.clock, applied_at - it.base_version) for r, it in zip(ranks, items))
        for _, _, s in stale:
            self._counters.staleness[s] += 1
        self._counters.pushes_applied += len(items)
        self.history.append(("apply", self.version, stale))
        for it in items:
            self._pool.append((it.grad, it.wire))
        self._buffer_free.notify_all()
        return True

    # ----------------------------------------------------------------- status
    def weights_copy(self) -> torch.Tensor | None:
        """A copy of the master weights (tests and checkpoints)."""
        with self._cond:
            return None if self._weights is None else self._weights.clone()

    def status(self) -> dict[str, Any]:
        """A consistent snapshot of counters, membership and the staleness histogram."""
        with self._cond:
            self._refresh()
            now = self._now()
            c = self._counters
            return {
                "layout": self.layout,
                "version": self.version,
                "pushes_applied": c.pushes_applied,
                "pushes_duplicate": c.pushes_duplicate,
                "pushes_rejected": c.pushes_rejected,
                "pulls": c.pulls,
                "bytes_in": c.bytes_in,
                "bytes_out": c.bytes_out,
                "evictions": c.evictions,
                "pending": len(self._pending),
                "waiting": self._waiting,
                "streaming_pulls": len(self._reads),  # pull streams reading the live weights
                "waiting_updates": self._writers_waiting,
                "buffers_lent": len(self._lent),
                "staged_updates": self._rule is not None,
                "retired_buffers": len(self._retired),  # former weights a pull stream still reads
                "waiting_for_buffer": self._buffer_waits,
                "staleness": dict(sorted(c.staleness.items())),
                "uptime_s": now - self._started,
                "workers": [
                    (m.rank, m.clock, m.state, now - m.last_seen, m.pushes)
                    for m in sorted(self._members.values(), key=lambda m: m.rank)
                ],
            }
