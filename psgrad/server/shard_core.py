"""The shard core: the lock and its conditions, the state (the shard's tables, version and
members), the consistency policy in force, and the bookkeeping every part of a shard shares
(transfer buffers, the sync round, counters, the audit history). The push path, recovery and
replication are collaborators handed the core; they hear of updates and membership changes
through its events. No network; every method is called with the lock held unless it says so."""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from psgrad.config import ServerConfig
from psgrad.core.codecs import get_codec
from psgrad.core.consistency import ClockView, ConsistencyPolicy
from psgrad.core.modes import ASYNC
from psgrad.core.layout import Layout
from psgrad.core.policies import policy_for
from psgrad.core.push_outcome import Eviction
from psgrad.errors import JobMismatchError, NotInitializedError, UnknownWorkerError
from psgrad.server.aggregation import SyncRound
from psgrad.server.buffers import Buffers
from psgrad.server.ledger import HISTORY_LEN, Counters
from psgrad.server.membership import Membership
from psgrad.server.read_limit import ReadLimit, read_limit_bytes
from psgrad.server.row_share import RowShare, SeqLock
from psgrad.server.state import NOT_INITIALIZED_HINT, ShardState
from psgrad.server.tables import memory_budget_bytes
from psgrad.server.transfers import PullStream

_log = logging.getLogger("psgrad.server")


@dataclass
class RestoreMarks:
    """What a shard remembers of having been restored from a snapshot (or rolled back)."""

    restored: bool = False  # since it started
    #: rank -> its last push in the snapshot, until its next push (the pushes between are lost)
    last_pushes: dict[int, int] = field(default_factory=dict)
    #: ranks whose clocks the snapshot set, until their next granted pull
    rewound: set[int] = field(default_factory=set)
    #: a restart restored the checkpoint of this version (None: no restart restored one)
    version: int | None = None
    #: ranks told of that restore (see ShardCore.news)
    told: set[int] = field(default_factory=set)


class ShardCore:
    """State, lock and shared bookkeeping of one shard."""

    def __init__(self, config: ServerConfig, now: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.now = now
        # (an RLock that, once a worker of this host is lent rows in place, keeps their header's
        # counter odd while held: see server/row_share.py)
        self.seq_lock = SeqLock()
        self.lock = cast(threading.RLock, self.seq_lock)  # (it keeps RLock's protocol, Conditions' too)
        self.row_share = RowShare(self.seq_lock, lambda: self.state)
        self.cond = threading.Condition(self.lock)  # state changed: waiting pulls, joins, reaper re-check
        # Observers (wait_until) also wake when a pull starts waiting; a separate condition on the
        # same lock, so that parking a pull never wakes the other parked pulls.
        self.observers = threading.Condition(self.lock)
        # The reaper sleeps until the next lease expiry; only a new member or close() wakes it
        # early (a renewed lease only moves expiries later), not every push.
        self.reaper_wake = threading.Condition(self.lock)
        self.started = now()
        self.members = Membership(config.lease_s, now)
        self.state: ShardState | None = None
        self.policy: ConsistencyPolicy = ASYNC.policy()
        self.buffers = Buffers(self.lock, config.push_buffers, self.observers.notify_all, config.min_transfer_rate_mb_s)
        self.round = SyncRound()
        self.counters = Counters()
        self.history: deque[tuple[Any, ...]] = deque(maxlen=HISTORY_LEN)
        self.marks = RestoreMarks()
        # What each worker is told once, in a push or pull reply (see news): the latest evictions, and how
        # many of all the shard's evictions (counters.evictions) each rank was told of or joined after.
        self.evicted: deque[Eviction] = deque(maxlen=64)
        self.told: dict[int, int] = {}
        #: what the shard's sparse tables may hold in all (bytes; None: no limit)
        self.budget_bytes = memory_budget_bytes(config.memory_budget_mb)
        #: the bytes the replies to reads of rows hold at once (--max-read-mb; its own lock: a read
        #: waits for its turn without the shard's)
        self.reads = ReadLimit(read_limit_bytes(config.max_read_mb))
        self.closed = False
        #: why this shard refuses pushes: an update failed part way and could not be undone exactly
        #: (see Pushes._write); None: it takes them
        self.broken: str | None = None
        #: this server is a backup that took its shard over: a worker may have read rows of versions its
        #: former primary applied and never replicated (a read of rows waits for no backup)
        self.took_over = False
        self.waiting = 0  # pulls parked in the gate right now
        self.on_serving: Callable[[bool], None] = lambda serving: None
        #: completes the sync iteration nobody owes any more (the push path sets it); True if it did
        self.complete_round: Callable[[], bool] = lambda: False
        self._on_update: list[Callable[[], None]] = []
        self._on_members: list[Callable[[], None]] = []

    # ----------------------------------------------------------------- events
    def subscribe(self, on_update: Callable[[], None] | None = None, on_members: Callable[[], None] | None = None) -> None:
        """Be told, under the lock and in the order of subscription, after every applied update
        (on_update) and every change of the members a backup must learn (on_members)."""
        if on_update is not None:
            self._on_update.append(on_update)
        if on_members is not None:
            self._on_members.append(on_members)

    def updated(self) -> None:
        """An update was applied (its version is the state's): tell the subscribers."""
        for hook in self._on_update:
            hook()

    def members_changed(self) -> None:
        """Workers joined, left, were evicted or had a push handled without an update."""
        for hook in self._on_members:
            hook()

    def event(self, kind: str, rank: int, clock: int, message: str) -> None:
        """A change of the members ("join", "leave", "evict"): recorded in the audit history and
        logged for the operator (info). Events are rare (never per push or pull), so logging's
        handler writes the line here, under the lock."""
        self.history.append((kind, rank, clock))
        _log.info(message)

    def notify(self) -> None:
        """Wake everything waiting for a state change."""
        self.cond.notify_all()
        self.observers.notify_all()

    # ----------------------------------------------------------------- state
    @property
    def layout(self) -> Layout | None:
        return None if self.state is None else self.state.layout

    @property
    def version(self) -> int:
        return 0 if self.state is None else self.state.version

    def view(self) -> ClockView:
        return ClockView(self.version, self.members.live_clocks())

    def require(self, fingerprint: str, rank: int) -> ShardState:
        """The state, for a worker of the job it belongs to.

        Raises:
            NotInitializedError: there is no state yet.
            JobMismatchError: the worker's fingerprint is another job's.
        """
        state = self.state
        if state is None:
            raise NotInitializedError(NOT_INITIALIZED_HINT)
        if fingerprint != state.layout.fingerprint:
            raise JobMismatchError(
                f"worker rank {rank} sent fingerprint {fingerprint or '(none)'}, but this shard was "
                f"initialized for {state.layout.fingerprint}: the worker's model or job spec differs "
                "(Join reports which field)"
            )
        return state

    def require_reader(self, fingerprint: str, rank: int, observe: bool, what: str) -> ShardState:
        """The state, for a read (`what`: of rows, of the frozen table) of the job it belongs to: a
        worker's read (not `observe`) only from a rank that has joined this shard (live, or left or
        evicted since); a read-only one (observe: an export, fetch_state_dict, an evaluation) from
        any caller, as it joins nothing.

        Raises:
            NotInitializedError, JobMismatchError: see require.
            UnknownWorkerError: a worker's read from a rank that never joined this shard (or that a
                restart from a checkpoint taken before it joined does not know: the client joins
                again by itself and retries).
        """
        state = self.require(fingerprint, rank)
        if not observe and self.members.get(rank) is None:
            raise UnknownWorkerError(
                f"{what} as worker rank {rank} refused: worker rank {rank} has not joined this shard (Join first; "
                "a reader that joins nothing, as psgrad export and fetch_state_dict, reads with observe set)")
        return state

    def install(self, state: ShardState) -> None:
        """Make state the shard's, with its job's policy; each table decides its update path."""
        spec = state.layout.spec
        self.state = state
        self.policy = policy_for(spec)
        # (a compressed job's pushes are decoded once received: nothing to stage as they arrive)
        exact = get_codec(spec.wire_dtype).exact and spec.compress == "none"
        state.dense.configure(not self.policy.aggregates, exact, self.config.push_buffers)
        self.buffers.configure(staged=state.dense.rule is not None, per_worker=self.policy.aggregates)
        self.serving_changed()

    def serving_changed(self) -> None:
        self.on_serving(self.state is not None and not self.closed)

    def end_read(self, stream: PullStream) -> None:
        """A pull stream of the weights ended (its close() holds the lock)."""
        self.buffers.end_read(stream, None if self.state is None else self.state.weights)

    # ----------------------------------------------------------------- membership
    def refresh(self) -> None:
        """Evict live members whose lease expired; complete a sync iteration nobody owes any more."""
        evicted = self.members.expire()
        live = len(self.members.live_ranks())
        if self.members.stalled_s:
            _log.warning("this server did not run for %.1f s (stopped, or starved of CPU): the leases of its %d live "
                         "worker(s) start again now, as their calls went unanswered", self.members.stalled_s, live)
            self.members.stalled_s = 0.0
        for m in evicted:
            self.counters.evictions += 1
            self.evicted.append(Eviction(m.rank, m.clock, self.members.lease_s, live))
            self.event("evict", m.rank, m.clock, (
                f"worker {m.rank} evicted at clock {m.clock}: no call for {self.now() - m.last_seen:.1f} s, past its "
                f"lease (--lease-s {self.members.lease_s:g}); nobody waits for it now ({live} "
                "live), and it joins again by itself if it is alive"))
            self.buffers.revoke(m.rank)
        if evicted and self.state is not None:  # per-worker state of tables (DC-ASGD's copies) goes
            self.state.forget_workers(self.members.live_ranks())
        completed = False
        try:
            completed = self.complete_round()  # (one whose apply fails raises, and is kept: see Pushes)
        finally:
            if completed or evicted:
                self.notify()
                self.members_changed()

    def joined(self, rank: int) -> None:
        """rank (re)joined: it is told of the evictions from now on, not of earlier ones."""
        self.told[rank] = self.counters.evictions

    def news(self, rank: int) -> tuple[tuple[Eviction, ...], int | None]:
        """What `rank` has not been told yet (called for each push reply and each of its pulls;
        takes the lock only when there is something to tell): the workers evicted since it was last
        told (others than itself), and the checkpoint version a restart restored (once per rank)."""
        marks = self.marks
        if self.told.get(rank, 0) == self.counters.evictions and (marks.version is None or rank in marks.told):
            return (), None
        with self.lock:
            unseen = self.counters.evictions - self.told.get(rank, 0)
            self.told[rank] = self.counters.evictions
            evicted = tuple(e for e in list(self.evicted)[-unseen:] if e.rank != rank) if unseen > 0 else ()
            restored = None
            marks = self.marks
            if marks.version is not None and rank not in marks.told:
                marks.told.add(rank)
                restored = marks.version
            return evicted, restored
