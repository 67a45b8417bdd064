"""A shard's replication role and the primary's side of it: the epoch, the records of applied
updates queued for the backup, the thread that forwards them in order, and the acknowledgements
that pushes and pulls wait for (outside the shard's lock)."""
from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import grpc
import torch

from psgrad.core.codecs import byte_view
from psgrad.core.status import ReplicaStatus
from psgrad.core.unused import to_bytes
from psgrad.errors import NotPrimaryError, StaleEpochError, StalledError
from psgrad.proto import ps_pb2 as pb
from psgrad.server import checkpoint
from psgrad.server.state import MemberRecord, ShardSnapshot
from psgrad.server.transfers import PullStream
from psgrad.wire import shm
from psgrad.wire.frames import data_frames
from psgrad.wire.protocol import CLIENT_CHANNEL_OPTIONS, ERROR_METADATA_KEY, METHOD_PREFIX
from psgrad.wire.rows import RowUpdate, updates_to_proto
from psgrad.wire.security import ChannelFactory, plaintext_channels

PRIMARY, BACKUP, FENCED = "primary", "backup", "fenced"
SNAPSHOT, GRADIENT, WEIGHTS, NONE, MEMBERS = "snapshot", "gradient", "weights", "none", "members"


@dataclass
class Record:
    """One replicated step of a shard: after it the backup is at `version` with these members.

    gradient: apply `tensor` with the optimizer (lr and lr_scale as on the primary); weights: the new
    weights, read lazily from the primary's live tensor (`stream`, plain SGD's staged updates);
    none: an update that changed no weight (every gradient skipped); members: no update, only the
    workers changed (joined, left, evicted); snapshot: the whole state. Gradient, weights and none
    records carry the row updates of sparse tables applied with them (`rows`)."""

    kind: str
    version: int
    members: tuple[MemberRecord, ...] = ()
    lr_scale: float = 1.0
    tensor: torch.Tensor | None = None
    stream: PullStream | None = None
    snapshot: ShardSnapshot | None = None
    in_segment: bool = False  # tensor is a view of the same-host segment (copied there already)
    lr: float | None = None  # gradient: the learning rate in effect on the primary (None: the job's)
    job_lr: tuple[float, int] | None = None  # the primary's job lr after the update, and the chief's clock that set it
    rows: tuple[RowUpdate, ...] = ()  # the row updates of sparse tables applied with it (their lr as applied)
    counters: bytes = b""  # the primary's shard counters after it (JSON of Counters.saved; b"": none)
    skip: tuple[tuple[int, int], ...] = ()  # gradient: the dense ranges the update left alone (core/unused.py)
    skipped_tables: frozenset[str] = frozenset()  # the sparse tables the update did not use (their steps stay)

    def frames(self, epoch: int, primary: str, chunk_bytes: int, segment: shm.Segment | None = None) -> Iterator[bytes]:
        """The ReplicaApply request: the header frame, then the payload's data frames; with a
        segment, the header alone, the payload written into the segment before it (the backup
        reads the segment as soon as the header arrives)."""
        manifest, payload = b"", memoryview(b"")
        if self.snapshot is not None:
            manifest, data = checkpoint.encode(self.snapshot)
            payload = memoryview(data)
        elif self.tensor is not None:
            payload = byte_view(self.tensor)
        nbytes = self.stream.nbytes if self.stream is not None else len(payload)
        if segment is not None:
            if self.stream is not None:
                self.stream.copy_into(segment.payload[:nbytes])
            elif not self.in_segment:
                segment.payload[:nbytes] = payload
        header = pb.ReplicaHeader(
            epoch=epoch, version=self.version, kind=self.kind, lr_scale=self.lr_scale, nbytes=nbytes,
            members=json.dumps([asdict(m) for m in self.members]).encode(), manifest=manifest, primary=primary,
            lr=self.lr, rows=updates_to_proto(self.rows), counters=self.counters, unused=to_bytes(self.skip),
            unused_tables=sorted(self.skipped_tables),
        )
        if self.job_lr is not None:
            header.job_lr, header.job_lr_clock = self.job_lr
        head = pb.ReplicaFrame(header=header).SerializeToString()
        return self._frames(head, None if segment is not None else payload, chunk_bytes)

    def _frames(self, head: bytes, payload: memoryview | None, chunk_bytes: int) -> Iterator[bytes]:
        yield head
        if payload is None:
            return
        if self.stream is not None:
            yield from self.stream
        else:
            yield from data_frames(payload, chunk_bytes)

    @property
    def sharable(self) -> bool:
        """Its payload may go through a same-host segment (the shard's size at most)."""
        return self.kind in (GRADIENT, WEIGHTS) and (self.tensor is not None or self.stream is not None)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()


def members_from_json(data: bytes) -> tuple[MemberRecord, ...]:
    return tuple(MemberRecord(**m) for m in json.loads(data or b"[]"))


class Replication:
    """The role of one server (primary, backup, or a fenced former primary), its epoch, and, on a
    primary with a backup attached, the ordered queue of records and the thread forwarding them.

    Thread-safety: offer() and attach() are called under the shard's lock and never block on it;
    the forwarding thread and the waiters use this object's own lock only, never the shard's
    while holding it (a weights record's stream takes the shard's lock frame by frame)."""

    def __init__(
        self, address: str, chunk_bytes: int, timeout_s: float, log: Callable[[str], None],
        channels: ChannelFactory = plaintext_channels,
    ) -> None:
        self.address = address  # this server's, as its backup or its workers reach it
        self.channels = channels  # to the shard's other server, with this server's credentials
        self._chunk_bytes = chunk_bytes
        self._timeout_s = timeout_s
        self.log = log  # the operator's warnings (stderr)
        self.note: Callable[[str], None] = log  # ... and notes (the runtime logs them at level info)
        self._cond = threading.Condition()
        self.role = PRIMARY
        self.epoch = 0
        self.primary = ""  # a backup's primary
        self.backup = ""  # a primary's attached backup
        self.acked = -1  # the newest version the backup acknowledged
        self._queue: deque[Record] = deque()
        self._generation = 0  # bumped when a backup attaches or is dropped: its thread stops
        self.on_fenced: Callable[[], None] = lambda: None  # the server stops serving (wakes waiting calls)
        self.on_dropped: Callable[[str, int], None] = lambda backup, epoch: None  # tell a dropped backup
        # Same-host payloads go through three segments per backup (unless it cannot open them):
        # gradients are copied straight into the first when it is free (claimed until their record
        # is sent); the forwarding thread copies the other payloads into the second and third in
        # turn, so that a backup may use the new weights in place until the record after next
        # (by then it has acknowledged the next one, in the other segment).
        self._segments: list[shm.Segment | None] = [None, None, None]
        self._shm = shm.supported()
        self._segment_claimed = False
        self._turn = 1
        self._closed = False
        self.waiting = 0  # replies held until the backup acknowledges

    @property
    def active(self) -> bool:
        """A backup is attached: applied updates become records (caller holds the shard's lock)."""
        return bool(self.backup) and self.role == PRIMARY

    def check_serving(self) -> None:
        """Raises NotPrimaryError when this server must not serve workers (fenced, or stopping)."""
        if self._closed:
            raise NotPrimaryError(f"server {self.address} is stopping: use the shard's other server")
        if self.role == FENCED:
            raise NotPrimaryError(
                f"server {self.address} was replaced by its backup (epoch {self.epoch}): use the shard's other server"
            )

    def offer(self, record: Record) -> None:
        """Queue a record for the backup (under the shard's lock; never blocks)."""
        with self._cond:
            if not self.active:
                record.close()
                return
            self._queue.append(record)
            self._cond.notify_all()

    def attach(self, backup: str, first: Record | None) -> None:
        """Make `backup` this primary's backup (replacing any other), starting from `first` (a
        snapshot; None: the shard is not initialized yet, its initialization will be). Called
        under the shard's lock, so no update falls between the snapshot and the records."""
        with self._cond:
            dropped = list(self._queue)
            self._queue.clear()
            self.backup, self.acked = backup, -1
            self._generation += 1
            self._segments, self._segment_claimed = [None, None, None], False  # the new backup gets segments of its own
            if first is not None:
                self._queue.append(first)
            generation = self._generation
            self._cond.notify_all()
        for record in dropped:
            record.close()
        threading.Thread(target=self._forward, args=(backup, generation), name="psgrad-replica", daemon=True).start()
        self.note(f"backup {backup} attached (epoch {self.epoch}): every update is sent to it before it is "
                  "acknowledged")

    def payload_buffer(self, numel: int) -> tuple[torch.Tensor, bool]:
        """Where to copy a gradient for the backup: the same-host segment when it is free (the
        record then needs no second copy), else a new tensor. Returns (tensor, in the segment)."""
        if not numel:  # (a shard without dense elements: nothing to copy, no segment to claim)
            return torch.empty(0), False
        with self._cond:
            seg = None if self._segment_claimed else self._segment_of(4 * numel, 0)
            if seg is not None:
                self._segment_claimed = True
                return torch.frombuffer(seg.payload[: 4 * numel], dtype=torch.float32), True
        return torch.empty(numel), False

    def _segment_of(self, nbytes: int, which: int) -> shm.Segment | None:
        """Segment `which` to the backup, made on first use (caller holds self._cond)."""
        if not self._shm or not self.active:
            return None
        seg = self._segments[which]
        if seg is None or seg.nbytes != nbytes:
            try:
                seg = self._segments[which] = shm.Segment(nbytes)
            except OSError:
                self._shm = False
                return None
        return seg

    def wait_acked(self, version: int, timeout_s: float | None) -> None:
        """Block until the backup has `version` (at once without a backup).

        Raises:
            NotPrimaryError: this server was fenced meanwhile (its backup took over).
            StalledError: timeout_s passed first (the reply must not go out unreplicated).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            self.waiting += 1
            self._cond.notify_all()
            try:
                while self.active and self.acked < version:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise StalledError(
                            f"server {self.address}: backup {self.backup} did not acknowledge version {version} "
                            f"before the call's deadline (it is dropped after {self._timeout_s:g} s without an answer)"
                        )
                    self._cond.wait(timeout=left)
                self.check_serving()
            finally:
                self.waiting -= 1

    def wait_for_waiting(self, count: int, timeout_s: float) -> bool:
        """Block until `count` replies wait for the backup (tests), or timeout_s passed."""
        with self._cond:
            return self._cond.wait_for(lambda: self.waiting >= count, timeout=timeout_s)

    def close(self) -> None:
        """The server stops: calls waiting for an acknowledgement end (NotPrimaryError, which sends
        their workers to the backup, where an update they did not see acknowledged is applied). The
        segments' names go (a segment is unlinked once its backup opened it; one never sent would
        stay in /dev/shm); their memory stays mapped while a record being sent still reads it."""
        with self._cond:
            self._closed = True
            dropped = self._drop_locked()
            segments, self._segments = self._segments, [None, None, None]
        for record in dropped:
            record.close()
        for seg in segments:
            if seg is not None:
                seg.unlink()

    def unclaim(self) -> None:
        """The gradient copied into the segment (payload_buffer) will not be sent: its update failed
        before it was applied, and made no record. The next update may use the segment."""
        with self._cond:
            self._segment_claimed = False

    def fence(self, epoch: int) -> bool:
        """A promoted backup reports `epoch`: a primary at an older epoch stops serving. Returns
        whether this server is now fenced."""
        with self._cond:
            fenced = epoch > self.epoch and self.role == PRIMARY
            if fenced:
                self.role, self.epoch = FENCED, epoch
                dropped = self._drop_locked()
        if fenced:
            for record in dropped:
                record.close()
            self.log(f"fenced: a backup took over this shard at epoch {epoch}; not serving workers any more")
            self.on_fenced()
        return self.role == FENCED

    def promote(self) -> str:
        """A backup takes over: primary at the next epoch. Returns the former primary's address."""
        with self._cond:
            former, self.primary = self.primary, ""
            self.role, self.epoch = PRIMARY, self.epoch + 1
            self.log(f"promoted to primary at epoch {self.epoch} (former primary {former})")
            return former

    def _drop_locked(self) -> list[Record]:
        dropped = list(self._queue)
        self._queue.clear()
        self.backup = ""
        self._generation += 1
        self._segment_claimed = False
        self._cond.notify_all()
        return dropped

    def _forward(self, backup: str, generation: int) -> None:
        """Send the queued records to `backup` in order, one call each, until it is dropped."""
        # A subchannel of its own: one shared with an earlier channel to this address (a server
        # that died there) may still be backing off, and would fail the first record at once.
        channel = self.channels(backup, [*CLIENT_CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)])
        call = channel.stream_unary(METHOD_PREFIX + "ReplicaApply", None, pb.ReplicaReply.FromString)

        def send(record: Record, epoch: int) -> None:
            seg = None
            nbytes = 0
            if record.sharable:
                nbytes = record.stream.nbytes if record.stream is not None else 4 * record.tensor.numel()  # type: ignore[union-attr]
            if nbytes:  # (a shard without dense elements: its records carry rows alone, in frames)
                with self._cond:
                    if self._generation != generation:  # a new backup has segments of its own
                        return
                    if record.in_segment:
                        seg = self._segments[0]
                    else:
                        seg, self._turn = self._segment_of(nbytes, self._turn), 3 - self._turn
            frames = record.frames(epoch, self.address, self._chunk_bytes, seg)
            if seg is None:  # (the state a backup asked for waits for its channel to connect)
                call(frames, timeout=self._timeout_s, wait_for_ready=record.kind == SNAPSHOT)
                return
            try:
                call(frames, timeout=self._timeout_s, metadata=seg.metadata())
                seg.unlink()  # the backup has it open
            except grpc.RpcError as exc:
                if (shm.METADATA_KEY, shm.REFUSED) not in tuple((exc.trailing_metadata() if isinstance(exc, grpc.Call) else None) or ()):
                    raise
                self._shm = False  # another host: frames from now on
                self.log(f"backup {backup} cannot open this server's shared memory; sending frames")
                if record.stream is not None:  # already read into the segment
                    record.close()
                    record.stream, record.tensor = None, torch.frombuffer(bytearray(seg.payload[:nbytes]), dtype=torch.float32)
                call(record.frames(epoch, self.address, self._chunk_bytes), timeout=self._timeout_s)

        try:
            while True:
                with self._cond:
                    while not self._queue and self._generation == generation:
                        self._cond.wait()
                    if self._generation != generation:
                        return
                    record, epoch = self._queue[0], self.epoch
                problem = None
                try:
                    send(record, epoch)
                except grpc.RpcError as exc:
                    problem = exc
                finally:
                    record.close()
                with self._cond:
                    if record.in_segment:
                        self._segment_claimed = False
                    if self._generation != generation:
                        return
                    if problem is None:
                        self._queue.popleft()
                        self.acked = max(self.acked, record.version)
                        self._cond.notify_all()
                        continue
                    stale = (ERROR_METADATA_KEY, StaleEpochError.__name__) in tuple(
                        (problem.trailing_metadata() if isinstance(problem, grpc.Call) else None) or ()
                    )
                    if stale:
                        self.role = FENCED
                    dropped = self._drop_locked()
                for r in dropped:
                    r.close()
                what = "took over (a newer epoch): this server stops serving" if stale else "is dropped"
                self.log(f"backup {backup} failed to take version {record.version} ({problem}); it {what}")
                if stale:
                    self.on_fenced()
                else:  # a backup still running must not take over with the state it has
                    self.on_dropped(backup, epoch)
                return
        finally:
            channel.close()

    def status(self) -> ReplicaStatus:
        with self._cond:
            return ReplicaStatus(self.role, self.epoch, self.backup, max(0, self.acked), self.primary)


FENCE_TIMEOUT_S = 2.0


def send_fence(address: str, epoch: int, dropped: bool = False, channels: ChannelFactory = plaintext_channels) -> None:
    """Tell the server at `address` that epoch `epoch` took over, or (dropped) that its primary
    went on without it (best effort: it may be dead)."""
    with channels(address, CLIENT_CHANNEL_OPTIONS) as channel:
        fence = channel.unary_unary(METHOD_PREFIX + "Fence", pb.FenceRequest.SerializeToString, pb.FenceReply.FromString)
        try:
            fence(pb.FenceRequest(epoch=epoch, dropped=dropped), timeout=FENCE_TIMEOUT_S)
        except grpc.RpcError:
            pass
