"""A shard's replication: on a primary, each applied update becomes a record for the backup
(exactly what makes the backup's arithmetic the primary's); on a backup, records are applied in
order, and a worker's call promotes it. A collaborator of the shard core, acting under its lock."""
from __future__ import annotations

import json
import logging
import threading

import torch

from psgrad.core.status import ReplicaStatus
from psgrad.core.unused import Ranges
from psgrad.errors import InvalidRequestError, NotPrimaryError, StaleEpochError
from psgrad.server.ledger import Counters
from psgrad.server.replication import (
    BACKUP,
    GRADIENT,
    MEMBERS,
    NONE,
    PRIMARY,
    SNAPSHOT,
    WEIGHTS,
    Record,
    Replication,
    send_fence,
)
from psgrad.server.shard_core import ShardCore
from psgrad.server.state import MemberRecord, ShardState
from psgrad.server.tables import EVICTED, EXPIRED, MADE, SIGHTED
from psgrad.server.transfers import PullStream
from psgrad.wire.rows import RowUpdate
from psgrad.wire.security import ChannelFactory

_log = logging.getLogger(__name__)


class Replica:
    """Replication of one shard: the primary's records and the backup's apply path."""

    def __init__(self, core: ShardCore) -> None:
        self._core = core
        self.replication: Replication | None = None  # set by the server runtime: the role, epoch and backup
        self._payload: tuple[torch.Tensor, float, float | None, bool, Ranges] | None = None  # the update being applied
        self._scratch: torch.Tensor | None = None  # backup: a tensor to receive the next payload into
        self._members: tuple[MemberRecord, ...] = ()  # backup: as the last record left them
        self._weights_shared = False  # backup: the weights are a view of the primary's segment
        self._members_sent: tuple[MemberRecord, ...] = ()  # primary: as the backup last got them
        self._rows: list[RowUpdate] = []  # primary: the row updates applied with the update being applied
        self._skipped_tables: frozenset[str] = frozenset()  # primary: the tables the update being applied did not use
        # backup: the primary's shard counters as its last record left them (JSON; b"": none since the
        # snapshot), which this server continues from if it takes over
        self._counters = b""
        core.subscribe(on_update=self._record_update, on_members=self._members_changed)

    # ----------------------------------------------------------------- primary
    def before_apply(self, grad: torch.Tensor, lr_scale: float, lr: float | None, skip: Ranges = ()) -> None:
        """An update is about to apply grad with the optimizer (which may overwrite it): keep a
        copy for the backup, which applies the same gradient with the same optimizer and lr,
        skipping the same unused ranges."""
        if self.replication is not None and self.replication.active:
            copy, in_segment = self.replication.payload_buffer(grad.numel())
            copy.copy_(grad)
            self._payload = (copy, lr_scale, lr, in_segment, skip)

    def abandon(self, keep: int = 0) -> None:
        """The update being applied failed before it was applied (caller holds the lock): what was
        kept of it for its record goes, so no later update's record carries it (its retry keeps it
        again). keep: the row updates kept before it began (rows_kept), which stay: rows applied
        already that the next record carries (a hybrid job's pushes' rows, applied as they came)."""
        if self._payload is not None and self._payload[3] and self.replication is not None:
            self.replication.unclaim()  # (its copy was in the segment to the backup, which it now leaves free)
        self._payload, self._rows, self._skipped_tables = None, self._rows[:keep], frozenset()

    def rows_kept(self) -> int:
        """How many row updates the next record carries so far (see abandon)."""
        return len(self._rows)

    @property
    def recording(self) -> bool:
        """Whether the update being applied is recorded for a backup (tables_skipped,
        rows_applied and rows_lifetime keep what they are told)."""
        return self.replication is not None and self.replication.active

    def tables_skipped(self, names: frozenset[str]) -> None:
        """The update being applied did not use these sparse tables: its record says so, and the
        backup leaves their step counts as the primary does."""
        if self.recording:
            self._skipped_tables = names

    def rows_applied(self, table: str, ids: torch.Tensor, grads: torch.Tensor, base_version: int,
                     lr: float | None) -> None:
        """The update being applied updated rows `ids` of sparse table `table` with `grads` (not
        changed by the update) and `lr`: its record carries them, and the backup applies the same."""
        if self.recording:
            self._rows.append(RowUpdate(table, ids, grads, base_version, lr))

    def rows_lifetime(self, table: str, what: str, ids: torch.Tensor) -> None:
        """The update being applied counted ids `ids` of sparse table `table` for admission
        (SIGHTED: the backup counts the same, so its admission counts stay the primary's), stored
        their rows (MADE, in this order: the backup's arena is laid out as the primary's), or
        dropped their rows (EVICTED, EXPIRED): its record says so, in order, and the backup does
        the same (and counts it alike)."""
        if self.recording:
            self._rows.append(RowUpdate(table, ids, torch.empty(ids.numel(), 0), removed=what in (EVICTED, EXPIRED),
                                        expired=what == EXPIRED, sighted=what == SIGHTED, made=what == MADE))

    def _record_update(self) -> None:
        """An update was applied (caller holds the lock): queue its record for the backup."""
        core = self._core
        rep, state = self.replication, core.state
        payload, self._payload = self._payload, None
        rows, self._rows = tuple(self._rows), []
        skipped, self._skipped_tables = self._skipped_tables, frozenset()
        if rep is None or not rep.active or state is None:
            return
        members = self._members_sent = state.member_records(frozenset(core.round.pending))
        if payload is not None:
            record = Record(GRADIENT, state.version, members, payload[1], tensor=payload[0], in_segment=payload[3],
                            lr=payload[2], skip=payload[4])
        elif state.dense.rule is not None:  # staged: the new weights are a tensor of their own, never written again
            stream = PullStream(state.weights, state.version, torch.float32, core.config.chunk_bytes, core.lock,
                                core.end_read)
            core.buffers.open_read(stream)
            record = Record(WEIGHTS, state.version, members, stream=stream)
        else:  # every gradient of a sync iteration was skipped
            record = Record(NONE, state.version, members)
        record.job_lr = (state.job_lr, state.job_lr_clock)  # a backup that takes over keeps the schedule
        record.rows = rows
        record.skipped_tables = skipped
        record.counters = self._counts()  # ... and the counters (this update counted already)
        rep.offer(record)

    def _counts(self) -> bytes:
        """The shard's counters for a record (JSON of Counters.saved: a few hundred bytes beside the
        record's gradient)."""
        return json.dumps(self._core.counters.saved(), separators=(",", ":")).encode()

    def _members_changed(self) -> None:
        """Workers joined, left or were evicted (caller holds the lock): the backup learns it
        (not waited for: a backup that missed it waits at most a lease for a worker that left)."""
        core = self._core
        rep, state = self.replication, core.state
        if rep is None or not rep.active or state is None:
            return
        members = state.member_records(frozenset(core.round.pending))
        if members != self._members_sent:
            self._members_sent = members
            rep.offer(Record(MEMBERS, state.version, members, counters=self._counts()))

    def initialized(self, state: ShardState) -> None:
        """The shard was initialized (caller holds the lock): the backup starts from this state."""
        rep = self.replication
        if rep is not None and rep.active:
            snap = state.snapshot(counters=self._core.counters.saved())
            self._members_sent = snap.members
            rep.offer(Record(SNAPSHOT, snap.version, snap.members, snapshot=snap))

    def rolled_back(self, state: ShardState) -> None:
        """The shard went back to an older state (a sync roll-back; caller holds the lock): the
        backup starts again from it, as a newly attached backup would (what it was sent of the
        abandoned iterations is dropped)."""
        rep = self.replication
        if rep is not None and rep.active and rep.backup:
            snap = state.snapshot(counters=self._core.counters.saved())
            self._members_sent = snap.members
            rep.attach(rep.backup, Record(SNAPSHOT, snap.version, snap.members, snapshot=snap))

    def attach_backup(self, address: str) -> int:
        """Make the server at `address` this shard's backup: it receives the state now (or at the
        chief's initialization) and every update after it. Returns the epoch.

        Raises:
            NotPrimaryError: this server is not a serving primary.
        """
        core = self._core
        with core.cond:
            rep = self.replication
            if rep is None or rep.role != PRIMARY:
                raise NotPrimaryError(f"server {getattr(rep, 'address', '?')} is not a primary: attach to the shard's primary")
            first = None
            if core.state is not None:
                snap = core.state.snapshot(frozenset(core.round.pending), core.counters.saved())  # (counters too)
                first = Record(SNAPSHOT, snap.version, snap.members, snapshot=snap)
                self._members_sent = snap.members
            rep.attach(address, first)
            return rep.epoch

    def serving(self, promote: bool = True) -> None:
        """A worker's call arrived: a backup with state takes over (promote); refuse it where this
        server cannot serve it.

        Raises:
            NotPrimaryError: a backup without state yet, or a fenced former primary.
        """
        rep = self.replication
        if rep is None or rep.role == PRIMARY:
            return
        core = self._core
        with core.cond:
            rep.check_serving()
            if rep.role != BACKUP or not promote:
                return
            if core.state is None:
                raise NotPrimaryError(f"backup {rep.address} has no state from its primary yet")
            former = rep.promote()
            core.took_over = True
            self._continue_counters()
            self._own_weights(core.state)
            # The members as the primary last replicated them (this backup's own reaper may have
            # evicted some meanwhile, seeing no calls), with fresh leases.
            core.state.set_members(self._members or core.state.member_records(), core.now())
            core.notify()
            core.reaper_wake.notify_all()  # the leases it now keeps (the reaper may wait with none to watch)
        threading.Thread(target=_fence, args=(former, rep.epoch, rep.channels), name="psgrad-fence", daemon=True).start()

    def status(self) -> ReplicaStatus:
        rep = self.replication
        return ReplicaStatus() if rep is None else rep.status()

    # ----------------------------------------------------------------- backup
    def forget_state(self, epoch: int) -> bool:
        """This backup's primary (at `epoch`) dropped it: its state is stale, and it must not take
        over with it. Returns whether it was a backup of that epoch (it then attaches again)."""
        core = self._core
        with core.cond:
            rep = self.replication
            if rep is None or rep.role != BACKUP or epoch != rep.epoch:
                return False
            core.state = None
            core.serving_changed()
            rep.log(f"dropped by its primary {rep.primary}: the state is stale; attaching again")
            return True

    def _own_weights(self, state: ShardState) -> None:
        """Weights that live in the primary's segment become a tensor of this shard's own."""
        if self._weights_shared:
            self._core.buffers.detach_reads(state.weights, state.layout.spec.wire_dtype)
            state.weights = state.weights.clone()
            self._weights_shared = False

    def buffer(self, numel: int) -> torch.Tensor:
        """A tensor to receive a record's payload into (the backup's scratch)."""
        with self._core.cond:
            buf, self._scratch = self._scratch, None
        return buf if buf is not None and buf.numel() == numel else torch.empty(numel)

    def apply_record(self, epoch: int, record: Record) -> int:
        """Apply a primary's record (in version order; an old one is acknowledged only). Returns
        the shard's version.

        Raises:
            StaleEpochError: the record comes from an epoch this server has moved past.
            InvalidRequestError: a gap in the versions, or a record before the state.
        """
        core = self._core
        with core.cond:
            rep = self.replication
            assert rep is not None
            if epoch < rep.epoch or rep.role != BACKUP:
                raise StaleEpochError(
                    f"server {rep.address} is at epoch {rep.epoch} as {rep.role}: a record of epoch {epoch} is refused"
                )
            rep.epoch = epoch
            if record.kind == SNAPSHOT:
                assert record.snapshot is not None
                core.state = None
                core.install(ShardState.restore(record.snapshot, core.members, core.now(), core.budget_bytes))
                self._weights_shared = False
                self._members = record.snapshot.members
                self._counters = json.dumps(record.snapshot.counters).encode() if record.snapshot.counters else b""
                core.notify()
                return record.version
            state = core.state
            if record.kind == MEMBERS:  # (one sent before the state is in the state)
                if state is not None and record.version == state.version:
                    state.set_members(record.members, core.now())
                    self._members = record.members
                    self._counters = record.counters or self._counters
                    core.notify()
                return record.version
            if state is None:
                raise InvalidRequestError(f"backup {rep.address}: an update before the state")
            if record.version <= state.version:
                return state.version  # already applied (a resent record)
            if record.version != state.version + 1:
                raise InvalidRequestError(f"backup {rep.address} is at version {state.version}: record {record.version} leaves a gap")
            wire = state.layout.spec.wire_dtype
            if record.kind == WEIGHTS and record.tensor is not None:
                # New weights in the primary's segment are used in place until the next record: it
                # writes that segment again only after this backup acknowledged the one after it.
                # Streams of the former weights get a copy if those lived in a segment.
                old, state.weights = state.weights, record.tensor
                if self._weights_shared:
                    core.buffers.detach_reads(old, wire)
                elif not any(r.source is old for r in core.buffers.reads):
                    self._scratch = old
                self._weights_shared = record.in_segment
            elif record.kind == GRADIENT and record.tensor is not None:
                if record.skip and record.skip[-1][1] > state.dense.trainable:
                    raise InvalidRequestError(f"backup {rep.address}: record {record.version} skips {record.skip[-1]}, "
                                              f"past the {state.dense.trainable} trainable values")
                self._own_weights(state)
                core.buffers.detach_reads(state.weights, wire)
                state.dense.apply(record.tensor, record.lr_scale, record.lr, record.skip)
                if not record.in_segment:  # (a view of the primary's segment is not ours to keep)
                    self._scratch = record.tensor
            elif record.kind == NONE:
                self._own_weights(state)
            else:
                raise InvalidRequestError(f"backup {rep.address}: malformed record of kind {record.kind!r}")
            for u in record.rows:  # as the primary applied (counted, made, dropped) them, after the dense part
                if u.sighted:
                    state.sparse(u.table, -1).sight(u.ids)
                elif u.made:
                    state.sparse(u.table, -1).make(u.ids)
                elif u.removed:
                    state.sparse(u.table, -1).remove(u.ids, expired=u.expired)
                else:
                    state.sparse(u.table, -1).apply(u.ids, u.grads, u.lr, u.base_version,
                                                    step=record.version - state.table_skips.get(u.table, 0),
                                                    replicated=True)
            for name in {u.table for u in record.rows}:  # (what doing so logged: a primary's to send, not ours)
                state.sparse(name, -1).take_lifetime()
            for name in sorted(record.skipped_tables):
                state.sparse(name, -1)  # (a table the job has: refused by name otherwise)
            state.skip_tables(record.skipped_tables)
            if record.job_lr is not None:
                state.set_job_lr(*record.job_lr)
            state.version = record.version
            state.set_members(record.members, core.now())
            self._members = record.members
            self._counters = record.counters or self._counters  # (read if this server takes over)
            core.notify()
            return state.version


    def _continue_counters(self) -> None:
        """A backup taking over (under the lock): its shard counters (pushes applied, duplicate and
        rejected, pulls, the staleness histogram, ...) continue from the primary's, as its last
        record (or the snapshot it attached with) left them, as a restart continues a checkpoint's.
        Counters that do not read as counts are logged, and the backup's kept."""
        if not self._counters:
            return
        core = self._core
        try:
            core.counters = Counters.restored(json.loads(self._counters))
        except (ValueError, TypeError, AttributeError) as exc:
            _log.warning("the former primary's counters are not counts (%s: %s): this server's own are kept",
                         type(exc).__name__, exc)


def _fence(former: str, epoch: int, channels: ChannelFactory) -> None:
    """Tell the former primary (if it still runs) that a newer epoch took over; best effort."""
    if not former:
        return
    send_fence(former, epoch, channels=channels)
