"""The replication half of a shard: on a primary, each applied update becomes a record for the
backup (exactly what makes the backup's arithmetic the primary's); on a backup, records are
applied in order, and a worker's call promotes it. Mixed into Shard, under the shard's lock."""
from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from psgrad.config import ServerConfig
from psgrad.core.optimizers import UpdateRule
from psgrad.core.status import ReplicaStatus
from psgrad.errors import InvalidRequestError, NotPrimaryError, StaleEpochError
from psgrad.server.aggregation import SyncRound
from psgrad.server.buffers import Buffers
from psgrad.server.membership import Membership
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
)
from psgrad.server.state import MemberRecord, ShardState
from psgrad.server.transfers import PullStream
from psgrad.wire.security import ChannelFactory


class ReplicaPath:
    """Replication hooks and the backup's apply path, sharing the Shard's lock and state."""

    _cond: threading.Condition
    _lock: threading.RLock
    _config: ServerConfig
    _state: ShardState | None
    _members: Membership
    _rule: UpdateRule | None
    _buffers: Buffers
    _round: SyncRound
    _now: Callable[[], float]
    replication: Replication | None
    _replica_payload: tuple[torch.Tensor, float, float | None, bool] | None
    _replica_scratch: torch.Tensor | None
    _weights_shared: bool

    def _init_replica(self) -> None:
        self.replication = None  # set by the server runtime: the role, epoch and backup
        self._replica_payload = None  # the gradient of the update being applied, for the backup
        self._replica_scratch = None  # backup: a tensor to receive the next payload into
        self._replica_members: tuple[MemberRecord, ...] = ()  # backup: as the last record left them
        self._weights_shared = False  # backup: the weights are a view of the primary's segment
        self._replica_members_sent: tuple[MemberRecord, ...] = ()  # primary: as the backup last got them

    def _install(self, state: ShardState) -> None:
        raise NotImplementedError

    def _serving_changed(self) -> None:
        raise NotImplementedError

    def _notify(self) -> None:
        raise NotImplementedError

    def _end_read(self, stream: PullStream) -> None:
        raise NotImplementedError

    # ----------------------------------------------------------------- primary
    def _before_apply(self, grad: torch.Tensor, lr_scale: float, lr: float | None) -> None:
        """An update is about to apply grad with the optimizer (which may overwrite it): keep a
        copy for the backup, which applies the same gradient with the same optimizer and lr."""
        if self.replication is not None and self.replication.active:
            copy, in_segment = self.replication.payload_buffer(grad.numel())
            copy.copy_(grad)
            self._replica_payload = (copy, lr_scale, lr, in_segment)

    def _replicate(self) -> None:
        """An update was applied (caller holds the lock): queue its record for the backup."""
        rep, state = self.replication, self._state
        payload, self._replica_payload = self._replica_payload, None
        if rep is None or not rep.active or state is None:
            return
        members = self._replica_members_sent = state.member_records(frozenset(self._round.pending))
        if payload is not None:
            record = Record(GRADIENT, state.version, members, payload[1], tensor=payload[0], in_segment=payload[3],
                            lr=payload[2])
        elif self._rule is not None:  # staged: the new weights are a tensor of their own, never written again
            stream = PullStream(state.weights, state.version, torch.float32, self._config.chunk_bytes, self._lock,
                                self._end_read)
            self._buffers.open_read(stream)
            record = Record(WEIGHTS, state.version, members, stream=stream)
        else:  # every gradient of a sync iteration was skipped
            record = Record(NONE, state.version, members)
        record.job_lr = (state.optimizer.lr, state.job_lr_clock)  # a backup that takes over keeps the schedule
        rep.offer(record)

    def _replicate_members(self) -> None:
        """Workers joined, left or were evicted (caller holds the lock): the backup learns it
        (not waited for: a backup that missed it waits at most a lease for a worker that left)."""
        rep, state = self.replication, self._state
        if rep is None or not rep.active or state is None:
            return
        members = state.member_records(frozenset(self._round.pending))
        if members != self._replica_members_sent:
            self._replica_members_sent = members
            rep.offer(Record(MEMBERS, state.version, members))

    def _replicate_snapshot(self, state: ShardState) -> None:
        """The shard was initialized (caller holds the lock): the backup starts from this state."""
        rep = self.replication
        if rep is not None and rep.active:
            snap = state.snapshot()
            self._replica_members_sent = snap.members
            rep.offer(Record(SNAPSHOT, snap.version, snap.members, snapshot=snap))

    def _replicate_rollback(self, state: ShardState) -> None:
        """The shard went back to an older state (a sync roll-back; caller holds the lock): the
        backup starts again from it, as a newly attached backup would (what it was sent of the
        abandoned iterations is dropped)."""
        rep = self.replication
        if rep is not None and rep.active and rep.backup:
            snap = state.snapshot()
            self._replica_members_sent = snap.members
            rep.attach(rep.backup, Record(SNAPSHOT, snap.version, snap.members, snapshot=snap))

    def attach_backup(self, address: str) -> int:
        """Make the server at `address` this shard's backup: it receives the state now (or at the
        chief's initialization) and every update after it. Returns the epoch.

        Raises:
            NotPrimaryError: this server is not a serving primary.
        """
        with self._cond:
            rep = self.replication
            if rep is None or rep.role != PRIMARY:
                raise NotPrimaryError(f"server {getattr(rep, 'address', '?')} is not a primary: attach to the shard's primary")
            first = None
            if self._state is not None:
                snap = self._state.snapshot(frozenset(self._round.pending))
                first = Record(SNAPSHOT, snap.version, snap.members, snapshot=snap)
                self._replica_members_sent = snap.members
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
        with self._cond:
            rep.check_serving()
            if rep.role != BACKUP or not promote:
                return
            if self._state is None:
                raise NotPrimaryError(f"backup {rep.address} has no state from its primary yet")
            former = rep.promote()
            self._own_weights(self._state)
            # The members as the primary last replicated them (this backup's own reaper may have
            # evicted some meanwhile, seeing no calls), with fresh leases.
            self._state.set_members(self._replica_members or self._state.member_records(), self._now())
            self._notify()
        threading.Thread(target=_fence, args=(former, rep.epoch, rep.channels), name="psgrad-fence", daemon=True).start()

    def _replica_status(self) -> ReplicaStatus:
        rep = self.replication
        return ReplicaStatus() if rep is None else rep.status()

    # ----------------------------------------------------------------- backup
    def forget_replica_state(self, epoch: int) -> bool:
        """This backup's primary (at `epoch`) dropped it: its state is stale, and it must not take
        over with it. Returns whether it was a backup of that epoch (it then attaches again)."""
        with self._cond:
            rep = self.replication
            if rep is None or rep.role != BACKUP or epoch != rep.epoch:
                return False
            self._state = None
            self._serving_changed()
            rep.log(f"dropped by its primary {rep.primary}: the state is stale; attaching again")
            return True

    def _own_weights(self, state: ShardState) -> None:
        """Weights that live in the primary's segment become a tensor of this shard's own."""
        if self._weights_shared:
            self._buffers.detach_reads(state.weights, state.layout.spec.wire_dtype)
            state.weights = state.weights.clone()
            self._weights_shared = False

    def replica_buffer(self, numel: int) -> torch.Tensor:
        """A tensor to receive a record's payload into (the backup's scratch)."""
        with self._cond:
            buf, self._replica_scratch = self._replica_scratch, None
        return buf if buf is not None and buf.numel() == numel else torch.empty(numel)

    def apply_record(self, epoch: int, record: Record) -> int:
        """Apply a primary's record (in version order; an old one is acknowledged only). Returns
        the shard's version.

        Raises:
            StaleEpochError: the record comes from an epoch this server has moved past.
            InvalidRequestError: a gap in the versions, or a record before the state.
        """
        with self._cond:
            rep = self.replication
            assert rep is not None
            if epoch < rep.epoch or rep.role != BACKUP:
                raise StaleEpochError(
                    f"server {rep.address} is at epoch {rep.epoch} as {rep.role}: a record of epoch {epoch} is refused"
                )
            rep.epoch = epoch
            if record.kind == SNAPSHOT:
                assert record.snapshot is not None
                self._state = None
                self._install(ShardState.restore(record.snapshot, self._members, self._now()))
                self._weights_shared = False
                self._replica_members = record.snapshot.members
                self._notify()
                return record.version
            state = self._state
            if record.kind == MEMBERS:  # (one sent before the state is in the state)
                if state is not None and record.version == state.version:
                    state.set_members(record.members, self._now())
                    self._replica_members = record.members
                    self._notify()
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
                    self._buffers.detach_reads(old, wire)
                elif not any(r.source is old for r in self._buffers.reads):
                    self._replica_scratch = old
                self._weights_shared = record.in_segment
            elif record.kind == GRADIENT and record.tensor is not None:
                self._own_weights(state)
                self._buffers.detach_reads(state.weights, wire)
                state.apply(record.tensor, record.lr_scale, record.lr)
                if not record.in_segment:  # (a view of the primary's segment is not ours to keep)
                    self._replica_scratch = record.tensor
            elif record.kind == NONE:
                self._own_weights(state)
            else:
                raise InvalidRequestError(f"backup {rep.address}: malformed record of kind {record.kind!r}")
            if record.job_lr is not None:
                state.set_job_lr(*record.job_lr)
            state.version = record.version
            state.set_members(record.members, self._now())
            self._replica_members = record.members
            self._notify()
            return state.version


def _fence(former: str, epoch: int, channels: ChannelFactory) -> None:
    """Tell the former primary (if it still runs) that a newer epoch took over; best effort."""
    if not former:
        return
    from psgrad.server.replica_servicer import send_fence  # the gRPC edge, imported when used

    send_fence(former, epoch, channels=channels)
