"""The gRPC edge of replication, server to server: a backup attaching to its primary, the records
the primary sends it, and the fence a promoted backup sends the primary it replaced."""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import grpc
import torch

from psgrad.core.addresses import REFUSED, refusing_shard
from psgrad.core.unused import from_bytes
from psgrad.core.codecs import byte_view
from psgrad.errors import InvalidRequestError, PsgradError, ServerStartError
from psgrad.proto import ps_pb2 as pb
from psgrad.server import checkpoint
from psgrad.server.replication import FENCE_TIMEOUT_S, GRADIENT, SNAPSHOT, WEIGHTS, Record, members_from_json, send_fence
from psgrad.server.shard import Shard
from psgrad.server.streams import StreamLimits
from psgrad.wire import protocol, shm
from psgrad.wire.frames import FrameParser, PayloadWriter, parse_frame, write_frames
from psgrad.wire.protocol import CLIENT_CHANNEL_OPTIONS, METHOD_PREFIX, to_psgrad_error
from psgrad.wire.rows import updates_from_proto
from psgrad.wire.security import ChannelFactory, plaintext_channels



class ReplicaServicer:
    """Handlers of the replication methods for one shard."""

    def __init__(self, shard: Shard, streams: StreamLimits | None = None) -> None:
        self.shard = shard
        self._streams = streams  # a record's payload arrives under the whole-transfer deadline there
        self._segments: dict[str, shm.Attached] = {}  # the primary's same-host segments, by name

    def _segment(self, context: grpc.ServicerContext, nbytes: int) -> memoryview | None:
        """The payload in the primary's same-host segment the call names (None: in frames). One
        this server cannot open is refused with FAILED_PRECONDITION and the marker, and the primary
        sends frames from then on."""
        value = next((str(v) for k, v in context.invocation_metadata() or () if k == shm.METADATA_KEY), None)
        if value is None:
            return None
        name = value.split(";", 1)[0]
        seg = self._segments.get(name)
        if seg is None or seg.nbytes != nbytes:
            try:
                seg = shm.attach(value, nbytes)
            except shm.SharedMemoryUnavailable as exc:
                context.set_trailing_metadata(((shm.METADATA_KEY, shm.REFUSED),))
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
                raise  # unreachable: abort raises
            if len(self._segments) >= 3:  # a primary has three; older ones belonged to a former one
                self._segments.pop(next(iter(self._segments)))
            self._segments[name] = seg
        return seg.payload[:nbytes]

    def ReplicaAttach(self, req: pb.ReplicaAttachRequest, context: grpc.ServicerContext) -> pb.ReplicaAttachReply:
        try:
            return pb.ReplicaAttachReply(epoch=self.shard.attach_backup(req.address))
        except PsgradError as exc:
            protocol.abort(context, exc)
            raise  # unreachable: abort raises

    def ReplicaApply(self, frames: Iterator[bytes], context: grpc.ServicerContext) -> pb.ReplicaReply:
        try:
            first = next(frames, None)
            msg = parse_frame(pb.ReplicaFrame, first, "replica record") if first is not None else None
            if msg is None or msg.WhichOneof("kind") != "header":
                raise InvalidRequestError("replica record: the first frame must be the header")
            h = msg.header
            what = f"replica record {h.version}"
            record = Record(h.kind, h.version, members_from_json(h.members), h.lr_scale,
                            lr=h.lr if h.HasField("lr") else None, job_lr=(h.job_lr, h.job_lr_clock) if h.HasField("job_lr") else None,
                            rows=tuple(updates_from_proto(h.rows, what)), counters=h.counters)
            record.skip = from_bytes(h.unused, 1 << 62, what)  # (inside the trainable range: checked as applied)
            record.skipped_tables = frozenset(h.unused_tables)
            parse = FrameParser(pb.ReplicaFrame, what)
            shared = self._segment(context, h.nbytes) if h.kind in (GRADIENT, WEIGHTS) else None
            if shared is not None:  # used in place (see Replication: the primary writes it again later)
                record.tensor, record.in_segment = torch.frombuffer(shared, dtype=torch.float32), True
            elif h.kind == SNAPSHOT:
                data = bytearray(h.nbytes)
                self._receive(context, h.primary, frames, PayloadWriter(memoryview(data), what), parse)
                record.snapshot = checkpoint.decode(h.manifest, bytes(data))
            elif h.kind in (GRADIENT, WEIGHTS):
                record.tensor = self.shard.replica_buffer(h.nbytes // 4)
                self._receive(context, h.primary, frames, PayloadWriter(byte_view(record.tensor), what), parse)
            rep = self.shard.replication
            if rep is not None and not rep.primary:
                rep.primary = h.primary
            return pb.ReplicaReply(version=self.shard.apply_record(h.epoch, record))
        except PsgradError as exc:
            protocol.abort(context, exc)
            raise  # unreachable: abort raises

    def _receive(self, context: grpc.ServicerContext, primary: str, frames: Iterator[bytes], writer: PayloadWriter,
                 parse: FrameParser) -> None:
        """A record's payload, read under the whole-transfer deadline (--transfer-allowance-s + its
        size at --min-transfer-rate-mb-s), as a worker's push is: a primary (or a caller with the
        servers' credential) that trickles it is cut, and the handler thread is free again."""
        timed = (contextlib.nullcontext() if self._streams is None else
                 self._streams.transfer("ReplicaApply", f"primary {primary or '?'}", context, writer.size,
                                        lambda: writer.received))
        with timed:
            write_frames(frames, writer, parse)

    def Fence(self, req: pb.FenceRequest, context: grpc.ServicerContext) -> pb.FenceReply:
        rep = self.shard.replication
        if rep is not None and req.dropped:  # this backup's primary went on without it
            if self.shard.forget_replica_state(req.epoch):
                threading.Thread(target=_attach_again, args=(self.shard,), name="psgrad-reattach", daemon=True).start()
        elif rep is not None:
            rep.fence(req.epoch)
        return pb.FenceReply()

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        """The method table entries of the replication methods."""
        return {
            "ReplicaAttach": grpc.unary_unary_rpc_method_handler(
                protocol.refusing_undecodable(self.ReplicaAttach), request_deserializer=protocol.decoder(pb.ReplicaAttachRequest),
                response_serializer=pb.ReplicaAttachReply.SerializeToString,
            ),
            "ReplicaApply": grpc.stream_unary_rpc_method_handler(
                self.ReplicaApply, response_serializer=pb.ReplicaReply.SerializeToString
            ),
            "Fence": grpc.unary_unary_rpc_method_handler(
                protocol.refusing_undecodable(self.Fence), request_deserializer=protocol.decoder(pb.FenceRequest),
                response_serializer=pb.FenceReply.SerializeToString,
            ),
        }


def attach_to_primary(primary: str, address: str, timeout_s: float, channels: ChannelFactory = plaintext_channels) -> int:
    """Ask the primary at `primary` to make this server (reached at `address`) its backup; the
    state and the updates follow as ReplicaApply calls. Returns the primary's epoch.

    Raises:
        ServerStartError: the primary did not answer within timeout_s, or refused.
    """
    with channels(primary, CLIENT_CHANNEL_OPTIONS) as channel:
        attach = channel.unary_unary(
            METHOD_PREFIX + "ReplicaAttach", pb.ReplicaAttachRequest.SerializeToString, pb.ReplicaAttachReply.FromString
        )
        try:
            reply = attach(pb.ReplicaAttachRequest(address=address), timeout=timeout_s, wait_for_ready=True)
        except grpc.RpcError as exc:
            cause = to_psgrad_error(exc, primary, "the attach request", timeout_s)
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and refusing_shard([primary], 0.0) is not None:
                # (waiting for it to be ready, gRPC reports a port nobody listens on as a deadline)
                raise ServerStartError(f"cannot become the backup of {primary}: server {primary} {REFUSED} "
                                       f"throughout {timeout_s:g} s (--replica-timeout-s)") from None
            raise ServerStartError(f"cannot become the backup of {primary}: {cause}") from None
        return int(reply.epoch)


def _attach_again(shard: Shard) -> None:
    """A dropped backup asks its primary for the state again."""
    rep = shard.replication
    assert rep is not None
    try:
        attach_to_primary(rep.primary, rep.address, FENCE_TIMEOUT_S * 5, rep.channels)
    except ServerStartError as exc:
        rep.log(f"dropped by {rep.primary} and cannot attach again ({exc}); serving nobody until restarted")
