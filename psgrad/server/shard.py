"""One shard: its core (lock, state, policy) with the collaborators that act on it — the push path,
recovery and replication — and the calls a worker makes of the shard itself: join, init, the pull
gate, status; no network."""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import torch

from psgrad.config import ServerConfig
from psgrad.core.codecs import byte_view, get_codec
from psgrad.core.layout import Layout, explain_mismatch
from psgrad.core.status import LEFT, LIVE, CheckpointStatus, DelayStatus, PublishedStatus, ShardStatus, TransferStatus
from psgrad.errors import InvalidRequestError, JobMismatchError, PsgradError
from psgrad.server.delay_comp import DelayCompensation
from psgrad.server.ledger import HISTORY_LEN, JoinResult, PushResult
from psgrad.server.membership import Member
from psgrad.server.pushes import Pushes
from psgrad.server.recovery import Recovery
from psgrad.server.replica_path import Replica
from psgrad.server.rows_path import Rows
from psgrad.server.replication import Replication
from psgrad.server.shard_core import ShardCore
from psgrad.server.state import ShardState
from psgrad.server.tables import FrozenTable
from psgrad.server.transfers import PullStream
from psgrad.server.worker_copies import DeltaPull, WorkerCopies

__all__ = ["HISTORY_LEN", "JoinResult", "Layout", "PushResult", "Shard"]

_log = logging.getLogger("psgrad.server")


class Shard:
    """Thread-safe state of one parameter shard. Every public method may be called concurrently.

    `history` records, in order, every granted pull ("pull", rank, clock, slowest live clock,
    version), applied update ("apply", version after, ((rank, clock, staleness), ...)), and
    membership change ("join"/"leave"/"evict", rank, clock) — the audit trail the consistency
    tests check, bounded to the last HISTORY_LEN events.
    """

    def __init__(self, config: ServerConfig, now: Callable[[], float] = time.monotonic) -> None:
        self.core = core = ShardCore(config, now)
        # (the replica hears of each update before recovery: a record is queued, then a snapshot taken)
        self.replica = Replica(core)
        self.recovery = Recovery(core, self.replica)
        self.rows = Rows(core, self.replica)
        self.pushes = Pushes(core, self.replica, self.rows)
        self.on_gate_wait: Callable[[float], None] | None = None  # told how long each parked pull waited
        self.copies = WorkerCopies()  # compressed pulls: what each such worker holds
        #: the same-host published versions' status (the servicer's Publisher, once it has one)
        self.published_status: Callable[[], PublishedStatus] = PublishedStatus
        #: the server's client streams: (open, cancelled, refused) (its StreamLimits', once it has them)
        self.stream_counts: Callable[[], tuple[int, int, int]] = lambda: (0, 0, 0)
        #: the server's checkpoints (its Checkpointer's status, once it has one)
        self.checkpoint_status: Callable[[], CheckpointStatus] = CheckpointStatus
        # The collaborators' calls, as the shard's own.
        self.push_target = self.pushes.push_target
        self.apply_push = self.pushes.apply_push
        self.skip_push = self.pushes.skip_push
        self.release = self.pushes.release
        self.reject = self.pushes.reject
        self.may_check_as_applied = self.pushes.may_check_as_applied
        self.snapshot = self.recovery.snapshot
        self.restore = self.recovery.restore
        self.snapshot_at_multiples = self.recovery.snapshot_at_multiples
        self.set_rollback_source = self.recovery.set_rollback_source
        self.rollback_points = self.recovery.rollback_points
        self.rollback = self.recovery.rollback
        self.attach_backup = self.replica.attach_backup
        self.serving = self.replica.serving
        self.forget_replica_state = self.replica.forget_state
        self.replica_buffer = self.replica.buffer
        self.apply_record = self.replica.apply_record
        self.pull_rows = self.rows.pull
        self.reads = core.reads  # (the bound on the bytes of reads in flight: see ReadLimit)
        self.updated_rows = self.rows.updated
        self.news = core.news

    @property
    def replication(self) -> Replication | None:
        """The server's replication role (the runtime sets it; None: no standby)."""
        return self.replica.replication

    @replication.setter
    def replication(self, value: Replication | None) -> None:
        self.replica.replication = value

    @property
    def checkpoints_aligned(self) -> bool:
        return self.recovery.checkpoints_aligned

    @property
    def history(self) -> deque[tuple[Any, ...]]:
        return self.core.history

    @property
    def layout(self) -> Layout | None:
        return self.core.layout

    @property
    def version(self) -> int:
        return self.core.version

    @property
    def dc(self) -> DelayCompensation | None:
        """DC-ASGD's copies of the weights each worker pulled (None: off, or not initialized)."""
        state = self.core.state
        return None if state is None else state.dense.dc

    def start_reaper(self) -> threading.Thread:
        """Evict workers the moment their lease expires, even when no call arrives (so a sync
        iteration a dead worker owed completes on time). Servers start it; close() stops it."""
        core = self.core

        def loop() -> None:
            with core.cond:
                while not core.closed:
                    try:
                        core.refresh()
                    except Exception:  # (a sync iteration whose apply failed: kept, tried again at the next look)
                        _log.exception("the lease reaper's refresh failed; it looks again")
                    core.reaper_wake.wait(timeout=core.members.reaper_wait_s())

        thread = threading.Thread(target=loop, name="psgrad-lease-reaper", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        """Stop the reaper and wake every waiting call."""
        core = self.core
        with core.cond:
            core.closed = True
            core.notify()
            core.serving_changed()
            core.buffers.close()
            core.reaper_wake.notify_all()
            core.row_share.close()

    def wait_until(self, predicate: Callable[[ShardStatus], bool], timeout_s: float) -> bool:
        """Block until predicate(status()) holds (re-checked on every state change) or timeout_s."""
        deadline = time.monotonic() + timeout_s
        with self.core.cond:
            while not predicate(self.status()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.core.observers.wait(timeout=left)
            return True

    def watch_serving(self, callback: Callable[[bool], None]) -> None:
        """Tell callback whether the shard serves a job (it holds state: initialized, restored, or a
        backup's copy; and it is not closed or fenced), now and at every change (under the lock)."""
        with self.core.cond:
            self.core.on_serving = callback
            self.core.serving_changed()

    def audit(self) -> tuple[list[tuple[Any, ...]], list[tuple[int, int]], int]:
        """A consistent snapshot of (history, buffered sync pushes as (rank, clock), version)."""
        core = self.core
        with core.cond:
            pending = sorted((r, p.clock) for r, p in core.round.pending.items())
            return list(core.history), pending, core.version

    # ----------------------------------------------------------------- membership
    def live_ranks(self) -> set[int]:
        """Ranks of the workers whose lease holds (after evicting the expired ones)."""
        with self.core.cond:
            self.core.refresh()
            return self.core.members.live_ranks()

    def touch(self, rank: int, incarnation: int = 0) -> int:
        """Renew a live worker's lease (heartbeat); returns the shard version. incarnation: the
        calling process's number (see Membership.live)."""
        core = self.core
        with core.cond:
            core.refresh()
            core.members.live(rank, incarnation)
            return core.version

    def leave(self, rank: int, incarnation: int = 0) -> None:
        """Mark rank as having left the job on purpose; nobody waits for it any more (unless
        another process than `incarnation`'s holds the rank now: then nothing changes)."""
        core = self.core
        with core.cond:
            member = core.members.leave(rank, incarnation)
            if member is not None:
                core.event("leave", rank, member.clock, f"worker {rank} left at clock {member.clock} "
                           f"({len(core.members.live_ranks())} live)")
                if core.state is not None:  # per-worker state of tables (DC-ASGD's copies) goes
                    core.state.forget_workers(core.members.live_ranks())
            core.refresh()
            core.members_changed()
            core.notify()

    def wake(self) -> None:
        """Wake waiting pulls so they re-check their call (used when a call ends or is cancelled)."""
        with self.core.cond:
            if self.core.waiting:  # every pull's end calls this: skip the wake-up when nobody waits
                self.core.notify()

    # ----------------------------------------------------------------- join / init
    def _register(self, rank: int, rejoin: bool = False, incarnation: int = 0) -> Member:
        """Register rank as a live member; a new or returning one is logged (and recorded), and with
        `rejoin` (a worker's first Join of a session, not a round of waiting at the start) so is
        one whose lease still held: a worker that restarted within its lease. incarnation: the
        joining process's number: where another process held the rank, the line says so (that
        one's calls are refused from now on: see Membership.live)."""
        core = self.core
        before = core.members.get(rank)
        held = before.incarnation if before is not None and before.state == LIVE else 0
        member, changed = core.members.register(rank, core.policy.start_clock(core.view()), incarnation)
        taken = bool(held and incarnation and held != incarnation)  # (another process held the rank)
        if not changed and (rejoin or taken):
            layout = core.layout
            of = f" of {layout.spec.num_workers}" if layout is not None else ""
            by = (f" from another process: the calls of the process that held rank {rank} are refused from now on "
                  "(a restart; or two workers started with one rank?)") if taken else ""
            _log.info(f"worker {rank} joined again at clock {member.clock}, within its lease "
                      f"({len(core.members.live_ranks())} live{of}){by}")
            if taken:
                core.notify()  # (a Join of the process it took the rank from, waiting at the start, stops)
        if changed:
            core.joined(rank)
            core.members_changed()
            layout = core.layout
            of = f" of {layout.spec.num_workers}" if layout is not None else ""
            core.event("join", rank, member.clock, f"worker {rank} joined at clock {member.clock} "
                       f"({len(core.members.live_ranks())} live{of})")
            if core.version == 0 and core.policy.start_barrier and core.layout is not None:
                if len(core.members) == core.layout.spec.num_workers:
                    # everyone has joined: checkpoint version 0 again, now with all its members, so
                    # a restored shard waits for every worker of the first iterations
                    self.recovery.offer_snapshot()
            core.notify()
            core.reaper_wake.notify_all()
        return member

    def _still_joining(self, rank: int, incarnation: int) -> bool:
        """Whether a Join that registered rank and waits (at sync's start, for the chief's init) may
        register it again as it wakes: not once the worker left (its leave came while the call
        waited: a Ctrl-C there) or another process took the rank over; an evicted one may (its
        lease ran out while it waited). Under the lock."""
        member = self.core.members.get(rank)
        if member is None:
            return True  # (dropped since: a restore)
        return member.state != LEFT and not (incarnation and member.incarnation and member.incarnation != incarnation)

    def _ready(self) -> bool:
        layout = self.core.layout
        if layout is None:
            return False
        return not self.core.policy.start_barrier or len(self.core.members) >= layout.spec.num_workers

    def join(self, rank: int, layout: Layout, wait_s: float = 0.0, rejoin: bool = False,
             incarnation: int = 0) -> JoinResult:
        """Check a worker's layout against the installed one and register it; optionally wait (up to
        wait_s) for the chief's initialization and, in sync/ssp, for all num_workers to join. With
        `rejoin` (a Join that is not a round of waiting at the start), a rank that is live already
        is logged as joining again (a worker restarted within its lease). incarnation: the
        joining process's number (JoinRequest.incarnation).

        Raises:
            JobMismatchError: the worker's job spec, model or shard range differs (named).
        """
        core = self.core
        deadline = core.now() + max(0.0, wait_s)
        registered = False
        with core.cond:
            while True:
                if core.layout is not None:
                    problem = explain_mismatch(core.layout, layout, rank)
                    if problem:
                        raise JobMismatchError(problem)
                    if registered and not self._still_joining(rank, incarnation):
                        break  # (it left, or another process took the rank, while this call waited)
                    member = self._register(rank, rejoin, incarnation)  # (a wait that wakes renews its lease)
                    rejoin, registered = False, True
                if self._ready() or core.now() >= deadline:
                    break
                core.cond.wait(timeout=max(0.0, deadline - core.now()))
            if core.layout is None:
                return JoinResult(False, False, 0, 0, core.version)
            ranks = tuple(sorted(core.members.members))
            frozen = core.state.frozen if core.state is not None else None
            drawn_as = tuple((t.name, t.drawn_as) for t in core.layout.tables if t.drawn_as)
            return JoinResult(True, self._ready(), len(core.members), member.clock, core.version, ranks,
                              0 if frozen is None else frozen.version, member.last_push_clock, drawn_as)

    def frozen_values(self, rank: int, fingerprint: str, observe: bool = False) -> tuple[int, torch.Tensor]:
        """(the frozen table's version, a copy of its values): the shard's range of the frozen
        space. No gate, no clock: the values move only when written (Init, a restore). observe: a
        read-only read (any caller), else a worker's, from a rank that joined.

        Raises:
            NotInitializedError, JobMismatchError: see ShardCore.require.
            UnknownWorkerError: a worker's read (not observe) from a rank that never joined.
            InvalidRequestError: the job keeps no frozen parameters on the servers.
        """
        core = self.core
        with core.cond:
            table = self._frozen(rank, fingerprint, observe)
            core.counters.bytes_out += table.numel * 4
            return table.version, table.values.clone()

    def frozen_numel(self, rank: int, fingerprint: str, observe: bool = False) -> int:
        """The values a read of the frozen table gets (frozen_values; a layout's, fixed): what its
        reply's bytes are counted from before the values are copied (--max-read-mb).

        Raises:
            As frozen_values.
        """
        with self.core.cond:
            return self._frozen(rank, fingerprint, observe).numel

    def _frozen(self, rank: int, fingerprint: str, observe: bool) -> FrozenTable:
        """The frozen table a read names (see frozen_values). Under the lock."""
        table = self.core.require_reader(fingerprint, rank, observe, "a read of the frozen parameters").frozen
        if table is None:
            raise InvalidRequestError(f"worker rank {rank} asked for the frozen parameters; this job keeps none "
                                      "on the servers")
        return table

    def initialize(self, rank: int, layout: Layout, weights: torch.Tensor,
                   rows: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
                   frozen: torch.Tensor | None = None, incarnation: int = 0) -> bool:
        """Install the job and initial weights, rows of sparse tables that start from the
        chief's values (`rows`: table -> (ids, values [n, dim]); see SparseTable.load_rows), and
        the shard's range of the frozen parameters (`frozen`, float32; the layout has some).
        Idempotent for an identical layout.

        Returns True when the shard was already initialized with the same layout (nothing changes).
        """
        core = self.core
        state = ShardState.create(layout, weights, core.members, core.budget_bytes)
        for table, (ids, values) in (rows or {}).items():
            state.sparse(table, rank).load_rows(ids, values)
        if state.frozen is not None:
            if frozen is None:
                raise InvalidRequestError(f"init of shard {layout.index} brings no values of its frozen parameters")
            state.frozen.write(frozen)
        with core.cond:
            if core.layout is not None:
                problem = explain_mismatch(core.layout, layout, rank)
                if problem:
                    raise JobMismatchError(problem)
                return True
            core.install(state)
            spec = layout.spec
            _log.info(f"initialized by the chief (worker {rank}): shard {layout.index} of {spec.num_shards}, "
                      f"[{layout.start}, {layout.end}) = {layout.numel:,} parameters; {spec.mode} mode, {spec.num_workers} "
                      f"workers, optimizer {spec.optimizer}, lr {spec.lr:g}")
            state.dense.on_pull(rank, state.version)  # (DC-ASGD) the chief's gradients start from its weights
            self._register(rank, incarnation=incarnation)
            self.recovery.offer_snapshot()  # the first checkpoint: a restart never starts empty
            self.replica.initialized(state)  # the backup's starting state, if one is attached
            core.notify()
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
        """Wait until the policy's gate lets `rank` at `clock` pull, then return the version of the
        weights and a stream of their wire frames (built lazily; see PullStream). None if timeout_s
        passed or the call was cancelled.

        observe=True takes a read-only snapshot: no gate, no clock, no lease (evaluation, monitoring).
        """
        core = self.core
        deadline = None if timeout_s is None else core.now() + timeout_s
        parked = parked_now = 0.0  # when this pull first waited at the gate (0: it has not)
        with core.cond:
            state = core.require(fingerprint, rank)
            while True:
                ready = True
                if not observe:
                    core.refresh()
                    member = core.members.live(rank)
                    policy = core.policy
                    if rank in core.marks.rewound:  # its clock came from a checkpoint: is the shard behind it?
                        policy.check_pull(rank, clock, member.last_push_clock, core.view())
                    if clock > member.clock:  # a joining worker announces where it continues from
                        if member.fresh and not core.marks.restored:  # (a restored shard is behind the workers)
                            core.members.check_announced(member, clock, core.version)
                        member.clock = clock
                        core.refresh()
                    view = core.view()
                    ready = policy.rank_ready(rank, clock, view)
                if ready and not core.buffers.writers_waiting:
                    if not observe:
                        core.marks.rewound.discard(rank)
                        core.history.append(("pull", rank, clock, view.min_clock, core.version))
                        waited = core.now() - parked_now if parked_now else 0.0
                        if policy.observe_pull(waited, core.now(), len(view.live_clocks), view.version):
                            core.history.append(("bound", policy.staleness, view.version))
                            core.notify()  # a raised bound may open the gate for parked pulls
                    if parked and self.on_gate_wait is not None:
                        self.on_gate_wait(time.monotonic() - parked)
                    break
                if not is_active() or core.closed:
                    return None
                waits = [t for t in (core.members.next_expiry_s(),) if t is not None]
                if deadline is not None:
                    left = deadline - core.now()
                    if left <= 0:
                        return None
                    waits.append(left)
                if ready:  # the gate is open; an update is waiting for the pulls already streaming
                    core.buffers.no_writers.wait(timeout=min(waits) if waits else None)
                    continue
                core.waiting += 1
                parked, parked_now = parked or time.monotonic(), parked_now or core.now()
                core.observers.notify_all()
                try:
                    core.cond.wait(timeout=min(waits) if waits else None)
                finally:
                    core.waiting -= 1
            if not observe:  # (DC-ASGD) the weights this worker's next gradients use
                state.dense.on_pull(rank, state.version)
            wire_dtype = get_codec(state.layout.spec.wire_dtype).dtype
            stream = PullStream(state.weights, state.version, wire_dtype, core.config.chunk_bytes, core.lock,
                                core.end_read, state.uid)
            core.buffers.open_read(stream)
            core.counters.pulls += 1
            core.counters.bytes_out += stream.nbytes
            return state.version, stream

    def delta_pull(self, rank: int, ask: Any, stream: PullStream) -> DeltaPull:
        """The payload of a granted pull that asked for the change since the worker's copy
        (`ask`, a DeltaAsk; see WorkerCopies): the stream's weights are read into a snapshot, which
        ends the stream (no update waits while the change is encoded), and the bytes sent counted."""
        layout = self.layout
        assert layout is not None  # (granted: the shard serves a job)
        snapshot = torch.empty(layout.numel)
        stream.copy_into(byte_view(snapshot), torch.float32)
        out = self.copies.serve(rank, ask, snapshot, stream.version, layout.spec.wire_dtype,
                                layout.numel - layout.trainable)
        with self.core.lock:
            self.core.counters.bytes_out += len(out.payload) - stream.nbytes  # (the grant counted the weights)
            state = self.core.state
            if out.compress and state is not None and state.dense.dc is not None:
                # DC-ASGD compensates against the weights the worker computes on: its copy
                state.dense.dc.record(rank, stream.version, out.held, replace=True)
        return out

    def blocking(self, rank: int, clock: int) -> list[int]:
        """Ranks that a pull of `rank` at `clock` waits for (for error messages)."""
        with self.core.cond:
            return [r for r in self.core.policy.blocking(clock, self.core.view()) if r != rank]

    # ----------------------------------------------------------------- status
    def weights_copy(self) -> torch.Tensor | None:
        """A copy of the master weights."""
        with self.core.cond:
            state = self.core.state
            return None if state is None else state.weights.clone()

    def _transfers(self) -> TransferStatus:
        opened, cancelled, refused = self.stream_counts()
        r = self.core.reads.counts()
        return dataclasses.replace(self.core.buffers.status(), streams_open=opened, streams_cancelled=cancelled,
                                   streams_refused=refused, read_limit_bytes=r.limit, read_bytes=r.in_flight,
                                   read_bytes_peak=r.peak, reads_waiting=r.waiting, reads_queued=r.queued,
                                   reads_expired=r.expired, reads_refused=r.refused)

    def status(self, with_params: bool = False) -> ShardStatus:
        """A consistent snapshot of counters, membership, tables and the staleness histogram (and,
        when asked, the model's parameters)."""
        core = self.core
        with core.cond:
            try:
                core.refresh()
            except PsgradError as exc:  # (a kept sync round whose apply fails again: the status still answers)
                _log.debug("status: the shard's refresh failed: %s", exc)
            c, state = core.counters, core.state
            layout = None if state is None else state.layout
            return ShardStatus(
                initialized=layout is not None,
                index=layout.index if layout else 0,
                start=layout.start if layout else 0,
                end=layout.end if layout else 0,
                fingerprint=layout.fingerprint if layout else "",
                spec=layout.spec if layout else None,
                version=core.version,
                pushes_applied=c.pushes_applied, pushes_duplicate=c.pushes_duplicate,
                pushes_rejected=c.pushes_rejected, pulls=c.pulls, bytes_in=c.bytes_in, bytes_out=c.bytes_out,
                evictions=c.evictions, updates_lost=c.updates_lost, rolled_back=c.rolled_back,
                late_dropped=c.late_dropped, pushes_plain=c.pushes_plain, pushes_skipped=c.pushes_skipped,
                job_lr=state.job_lr if state else 0.0,
                job_lr_clock=state.job_lr_clock if state else -1,
                staleness_bound=core.policy.reported_bound,
                pending=len(core.round.pending),
                waiting=core.waiting,
                uptime_s=core.now() - core.started,
                workers=core.members.statuses(),
                staleness=dict(sorted(c.staleness.items())),
                transfers=self._transfers(),
                params=layout.params if layout and with_params else (),
                table_specs=layout.tables if layout and with_params else (),
                frozen_params=layout.frozen if layout and with_params else (),
                replica=self.replica.status(),
                delay=state.dense.delay_status() if state else DelayStatus(),
                delta=self.copies.status(),
                published=self.published_status(),
                tables=tuple(t.status(name) for name, t in state.tables.items()) if state else (),
                checkpoint=self.checkpoint_status(),
            )
