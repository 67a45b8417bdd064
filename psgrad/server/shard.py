"""One shard: composes its state, membership, consistency policy, sync round and transfer buffers
under one lock, and answers join, init, pull and push; no network."""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from psgrad.config import ServerConfig
from psgrad.core.codecs import get_codec
from psgrad.core.consistency import ClockView, ConsistencyPolicy, make_policy
from psgrad.core.policies import policy_for
from psgrad.core.layout import Layout, explain_mismatch
from psgrad.core.optimizers import UpdateRule
from psgrad.core.status import DelayStatus, ShardStatus
from psgrad.errors import JobMismatchError, NotInitializedError
from psgrad.server.aggregation import SyncRound
from psgrad.server.buffers import Buffers
from psgrad.server.delay_comp import DelayCompensation
from psgrad.server.ledger import HISTORY_LEN, Counters, JoinResult, PushResult
from psgrad.server.membership import Member, Membership
from psgrad.server.mode_hooks import observe_pull
from psgrad.server.pushes import PushPath
from psgrad.server.recovery import Recovery, RollbackSource
from psgrad.server.replica_path import ReplicaPath
from psgrad.server.state import NOT_INITIALIZED_HINT, ShardSnapshot, ShardState
from psgrad.server.transfers import PullStream

__all__ = ["HISTORY_LEN", "JoinResult", "Layout", "PushResult", "Shard"]


class Shard(ReplicaPath, Recovery, PushPath):
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
        self._members = Membership(config.lease_s, now)
        self._state: ShardState | None = None
        self._policy: ConsistencyPolicy = make_policy("async")
        self._adaptive = False  # --staleness auto: the policy's bound moves
        self._bound = 0  # the adaptive bound in effect (0: a fixed one)
        self._rule: UpdateRule | None = None  # staged updates: the optimizer's piecewise rule
        self._dc: DelayCompensation | None = None  # DC-ASGD's copies of the weights each worker pulled
        self._buffers = Buffers(lock, config.push_buffers, self._observers.notify_all)
        self._round = SyncRound()
        self._counters = Counters()
        self.history: deque[tuple[Any, ...]] = deque(maxlen=HISTORY_LEN)
        self._closed = False
        self._waiting = 0  # pulls parked in the gate right now
        self.on_gate_wait: Callable[[float], None] | None = None  # told how long each parked pull waited
        self._on_serving: Callable[[bool], None] = lambda serving: None  # see watch_serving
        self._restored_clocks: dict[int, int] = {}
        self._restored = False
        self._rewound: set[int] = set()
        self._snapshot_every = 0
        self._snapshot_sink: Callable[[ShardSnapshot], None] | None = None
        self._rollback_source: RollbackSource | None = None
        self._init_replica()

    @property
    def layout(self) -> Layout | None:
        return None if self._state is None else self._state.layout

    @property
    def version(self) -> int:
        return 0 if self._state is None else self._state.version

    def _notify(self) -> None:
        """Wake everything waiting for a state change (caller holds the lock)."""
        self._cond.notify_all()
        self._observers.notify_all()

    def start_reaper(self) -> threading.Thread:
        """Evict workers the moment their lease expires, even when no call arrives (so a sync
        iteration a dead worker owed completes on time). Servers start it; close() stops it."""

        def loop() -> None:
            with self._cond:
                while not self._closed:
                    self._refresh()
                    self._reaper_wake.wait(timeout=self._members.next_expiry_s())

        thread = threading.Thread(target=loop, name="psgrad-lease-reaper", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        """Stop the reaper and wake every waiting call."""
        with self._cond:
            self._closed = True
            self._notify()
            self._serving_changed()
            self._buffers.close()
            self._reaper_wake.notify_all()

    def wait_until(self, predicate: Callable[[ShardStatus], bool], timeout_s: float) -> bool:
        """Block until predicate(status()) holds (re-checked on every state change) or timeout_s."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not predicate(self.status()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._observers.wait(timeout=left)
            return True

    def watch_serving(self, callback: Callable[[bool], None]) -> None:
        """Tell callback whether the shard serves a job (it holds state: initialized, restored, or a
        backup's copy; and it is not closed or fenced), now and at every change (under the lock)."""
        with self._cond:
            self._on_serving = callback
            self._serving_changed()

    def _serving_changed(self) -> None:
        self._on_serving(self._state is not None and not self._closed)

    def audit(self) -> tuple[list[tuple[Any, ...]], list[tuple[int, int]], int]:
        """A consistent snapshot of (history, buffered sync pushes as (rank, clock), version)."""
        with self._cond:
            pending = sorted((r, p.clock) for r, p in self._round.pending.items())
            return list(self.history), pending, self.version

    # ----------------------------------------------------------------- membership
    def _view(self) -> ClockView:
        return ClockView(self.version, self._members.live_clocks())

    def _refresh(self) -> None:
        """Evict live members whose lease expired; complete a sync iteration nobody owes any more."""
        evicted = self._members.expire()
        for m in evicted:
            self._counters.evictions += 1
            self.history.append(("evict", m.rank, m.clock))
            self._buffers.revoke(m.rank)
        if self._dc is not None:  # DC-ASGD: the copies of workers that left or were evicted go
            self._dc.keep_only(self._members.live_ranks())
        if self._complete_iteration() or evicted:
            self._notify()
            self._replicate_members()

    def live_ranks(self) -> set[int]:
        """Ranks of the workers whose lease holds (after evicting the expired ones)."""
        with self._cond:
            self._refresh()
            return self._members.live_ranks()

    def touch(self, rank: int) -> int:
        """Renew a live worker's lease (heartbeat); returns the shard version."""
        with self._cond:
            self._refresh()
            self._members.live(rank)
            return self.version

    def leave(self, rank: int) -> None:
        """Mark rank as having left the job on purpose; nobody waits for it any more."""
        with self._cond:
            member = self._members.leave(rank)
            if member is not None:
                self.history.append(("leave", rank, member.clock))
            self._refresh()
            self._replicate_members()
            self._notify()

    def wake(self) -> None:
        """Wake waiting pulls so they re-check their call (used when a call ends or is cancelled)."""
        with self._cond:
            if self._waiting:  # every pull's end calls this: skip the wake-up when nobody waits
                self._notify()

    # ----------------------------------------------------------------- join / init / restore
    def _require(self, fingerprint: str, rank: int) -> ShardState:
        state = self._state
        if state is None:
            raise NotInitializedError(NOT_INITIALIZED_HINT)
        if fingerprint != state.layout.fingerprint:
            raise JobMismatchError(
                f"worker rank {rank} sent fingerprint {fingerprint or '(none)'}, but this shard was "
                f"initialized for {state.layout.fingerprint}: the worker's model or job spec differs "
                "(Join reports which field)"
            )
        return state

    def _register(self, rank: int) -> Member:
        member, changed = self._members.register(rank, self._policy.start_clock(self._view()))
        if changed:
            self._replicate_members()
            self.history.append(("join", rank, member.clock))
            if self.version == 0 and self._policy.start_barrier and self.layout is not None:
                if len(self._members) == self.layout.spec.num_workers:
                    # everyone has joined: checkpoint version 0 again, now with all its members, so
                    # a restored shard waits for every worker of the first iterations
                    self._offer_snapshot()
            self._notify()
            self._reaper_wake.notify_all()
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
            ranks = tuple(sorted(self._members.members))
            return JoinResult(True, self._ready(), len(self._members), member.clock, self.version, ranks)

    def initialize(self, rank: int, layout: Layout, weights: torch.Tensor) -> bool:
        """Install the job and initial weights. Idempotent for an identical layout.

        Returns True when the shard was already initialized with the same layout (nothing changes).
        """
        state = ShardState.create(layout, weights, self._members)
        with self._cond:
            if self.layout is not None:
                problem = explain_mismatch(self.layout, layout, rank)
                if problem:
                    raise JobMismatchError(problem)
                return True
            self._install(state)
            if self._dc is not None:  # the chief's gradients start from its initial weights
                self._dc.record(rank, state.version, state.weights)
            self._register(rank)
            self._offer_snapshot()  # the first checkpoint: a restart never starts empty
            self._replicate_snapshot(state)  # the backup's starting state, if one is attached
            self._notify()
            return False

    def _install(self, state: ShardState) -> None:
        """Make state the shard's, with its job's policy and update path (caller holds the lock)."""
        spec = state.layout.spec
        self._state = state
        self._policy = policy_for(spec)
        self._adaptive = self._policy.adapts
        self._bound = self._policy.staleness if self._adaptive else 0
        # Staged updates: a policy that applies on arrival, an exact wire, one receive buffer, an
        # optimizer with a piecewise rule (plain SGD), and no buffers in the range (they take deltas).
        staged = not self._policy.aggregates and get_codec(spec.wire_dtype).exact
        staged = staged and state.layout.trainable == state.layout.numel and not spec.dc_asgd
        self._dc = DelayCompensation.for_job(spec, state.layout.trainable)  # DC-ASGD (None: off); no copies yet
        self._rule = state.optimizer.piecewise_rule() if staged and self._config.push_buffers == 1 else None
        self._buffers.configure(staged=self._rule is not None, per_worker=self._policy.aggregates)
        self._serving_changed()

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
        parked = parked_now = 0.0  # when this pull first waited at the gate (0: it has not)
        with self._cond:
            state = self._require(fingerprint, rank)
            while True:
                ready = True
                if not observe:
                    self._refresh()
                    member = self._members.live(rank)
                    if rank in self._rewound:  # its clock came from a checkpoint: is the shard behind it?
                        self._policy.check_pull(rank, clock, member.last_push_clock, self._view())
                    if clock > member.clock:  # a joining worker announces where it continues from
                        member.clock = clock
                        self._refresh()
                    view = self._view()
                    p = self._policy
                    ready = p.rank_ready(rank, clock, view) if p.drops_late else p.pull_ready(clock, view)
                if ready and not self._buffers.writers_waiting:
                    if not observe:
                        self._rewound.discard(rank)
                        self.history.append(("pull", rank, clock, view.min_clock, self.version))
                    if parked and self.on_gate_wait is not None:
                        self.on_gate_wait(time.monotonic() - parked)
                    if self._adaptive and not observe:  # --staleness auto
                        self._bound = observe_pull(self._policy, parked_now, self._now(), view, self.history, self._notify)
                    break
                if not is_active() or self._closed:
                    return None
                waits = [t for t in (self._members.next_expiry_s(),) if t is not None]
                if deadline is not None:
                    left = deadline - self._now()
                    if left <= 0:
                        return None
                    waits.append(left)
                if ready:  # the gate is open; an update is waiting for the pulls already streaming
                    self._buffers.no_writers.wait(timeout=min(waits) if waits else None)
                    continue
                self._waiting += 1
                parked, parked_now = parked or time.monotonic(), parked_now or self._now()
                self._observers.notify_all()
                try:
                    self._cond.wait(timeout=min(waits) if waits else None)
                finally:
                    self._waiting -= 1
            if self._dc is not None and not observe:  # DC-ASGD: the weights this worker's next gradients use
                self._dc.record(rank, state.version, state.weights)
            wire_dtype = get_codec(state.layout.spec.wire_dtype).dtype
            stream = PullStream(state.weights, state.version, wire_dtype, self._config.chunk_bytes, self._lock,
                                self._end_read, state.uid)
            self._buffers.open_read(stream)
            self._counters.pulls += 1
            self._counters.bytes_out += stream.nbytes
            return state.version, stream

    def _end_read(self, stream: PullStream) -> None:
        self._buffers.end_read(stream, None if self._state is None else self._state.weights)

    def blocking(self, rank: int, clock: int) -> list[int]:
        """Ranks that a pull of `rank` at `clock` waits for (for error messages)."""
        with self._cond:
            return [r for r in self._policy.blocking(clock, self._view()) if r != rank]

    # ----------------------------------------------------------------- status
    def weights_copy(self) -> torch.Tensor | None:
        """A copy of the master weights."""
        with self._cond:
            return None if self._state is None else self._state.weights.clone()

    def status(self, with_params: bool = False) -> ShardStatus:
        """A consistent snapshot of counters, membership and the staleness histogram (and, when
        asked, the model's parameters)."""
        with self._cond:
            self._refresh()
            c, layout = self._counters, self.layout
            return ShardStatus(
                initialized=layout is not None,
                index=layout.index if layout else 0,
                start=layout.start if layout else 0,
                end=layout.end if layout else 0,
                fingerprint=layout.fingerprint if layout else "",
                spec=layout.spec if layout else None,
                version=self.version,
                pushes_applied=c.pushes_applied, pushes_duplicate=c.pushes_duplicate,
                pushes_rejected=c.pushes_rejected, pulls=c.pulls, bytes_in=c.bytes_in, bytes_out=c.bytes_out,
                evictions=c.evictions, updates_lost=c.updates_lost, rolled_back=c.rolled_back,
                late_dropped=c.late_dropped,
                job_lr=self._state.optimizer.lr if self._state else 0.0,
                job_lr_clock=self._state.job_lr_clock if self._state else -1,
                staleness_bound=self._bound,
                pending=len(self._round.pending),
                waiting=self._waiting,
                uptime_s=self._now() - self._started,
                workers=self._members.statuses(),
                staleness=dict(sorted(c.staleness.items())),
                transfers=self._buffers.status(),
                params=layout.params if layout and with_params else (),
                replica=self._replica_status(),
                delay=self._dc.status() if self._dc is not None else DelayStatus(),
                published=self.published_status(),
            )

