"""One shard's channel: every call under a deadline, reconnecting with backoff, payloads through
frames, Step calls or same-host segments, and gRPC status -> PsgradError."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from typing import Any, TypeVar

import grpc
import torch

from psgrad import errors
from psgrad.wire import serde
from psgrad.client import reconnect
from psgrad.client.same_host import SameHost
from psgrad.wire import shm
from psgrad.core.codecs import WireBuffer, byte_view, copy_from_wire, segment_bytes
from psgrad.wire.frames import (
    FrameParser,
    PayloadWriter,
    bytes_field_prefix,
    data_frames,
    parse_frame,
    trailing_bytes_field,
    write_frames,
)
from psgrad.config import ClientConfig, JobSpec
from psgrad.errors import InvalidRequestError
from psgrad.wire.heap import tune_allocator
from psgrad.proto import ps_pb2 as pb
from psgrad.wire.protocol import (
    CLIENT_CHANNEL_OPTIONS,
    GATED_PUSH_BYTES,
    ROWS_REPLY_ROWS,
    SERVICE_NAME,
    STEP_REQUEST_DATA,
)
from psgrad.core.credentials import ADMIN
from psgrad.core.sharding import ParamSpec, ShardPlan, fingerprint
from psgrad.wire.security import client_channels

T = TypeVar("T")
# Rows read from a shard: each table's version, and the rows' float32 bytes, table after table
RowsRead = tuple[list[int], memoryview]


class ShardClient:
    """Calls to one shard: its server, or 'PRIMARY|BACKUP' (calls fail over to the other one when
    the one in use stops answering). Methods raise PsgradError subclasses, never grpc.RpcError."""

    def __init__(self, address: str, config: ClientConfig, role: str = ADMIN) -> None:
        """role: whose token to derive from config.auth's job secret (a worker's, or the admin's)."""
        self.addresses = tuple(address.split("|"))
        self.config = config
        self._channels_of = client_channels(config, role)
        self._channels: list[grpc.Channel] = []  # every one used; closed by close()
        self._bind_lock = threading.Lock()
        self._bind(self.addresses[0])
        self.same = SameHost(self, usable=config.shared_memory and shm.supported())  # the same-host path
        # Set once this worker has joined: sends the same Join again (deadline in seconds), before
        # a call is retried after the shard stopped answering.
        self.rejoin: Callable[[float], object] | None = None
        # Set when a call gave up on the shard (it did not come back within --reconnect-timeout-s,
        # or did not answer within its deadline): leaving does not wait for it a second time.
        self.given_up: errors.ServerUnavailableError | None = None

    @property
    def same_host(self) -> bool:
        """Whether payloads go through shared memory (the server said at Join that it shares this
        host and takes segments, and this worker may use them), not gRPC frames."""
        return self.same.active

    @property
    def view(self) -> torch.Tensor | None:
        """After a pull or step with published=True: the version the server lent (see SameHost)."""
        return self.same.view

    def lend_window(self, window: shm.Window) -> bool:
        """Make `window` this shard's segment: pushes of it are read in place (see SameHost)."""
        return self.same.lend_window(window)

    def forget_ring(self) -> None:
        """Map the server's ring afresh at its next lend (see SameHost)."""
        self.same.forget_ring()

    def failover(self, failed: str) -> str | None:
        """The server at `failed` does not answer: use the shard's other server (if it has one and
        this is still the one in use; another thread may have switched already). Returns the
        address now in use, or None when there is no other."""
        if len(self.addresses) < 2:
            return None
        with self._bind_lock:
            if self.address == failed:
                self._bind(self.addresses[1 - self.addresses.index(failed)])
            return self.address

    def _bind(self, address: str) -> None:
        """Send calls to `address` (a channel of its own; calls on the former one run on)."""
        self.address = address
        self._channel = self._channels_of(address, CLIENT_CHANNEL_OPTIONS)
        self._channels.append(self._channel)
        prefix = f"/{SERVICE_NAME}/"
        ch = self._channel
        self._join = ch.unary_unary(prefix + "Join", pb.JoinRequest.SerializeToString, pb.JoinReply.FromString)
        self._init = ch.stream_unary(prefix + "Init", None, pb.InitReply.FromString)
        self._pull = ch.unary_stream(prefix + "Pull", pb.PullRequest.SerializeToString, None)
        self._push = ch.stream_unary(prefix + "Push", None, pb.PushReply.FromString)
        self._push_gated = ch.stream_stream(prefix + "PushGated", None, pb.PushProgress.FromString)
        self._status = ch.unary_unary(
            prefix + "Status", pb.StatusRequest.SerializeToString, pb.StatusReply.FromString
        )
        self._heartbeat = ch.unary_unary(
            prefix + "Heartbeat", pb.HeartbeatRequest.SerializeToString, pb.HeartbeatReply.FromString
        )
        self._leave = ch.unary_unary(prefix + "Leave", pb.LeaveRequest.SerializeToString, pb.LeaveReply.FromString)
        self._rollback = ch.unary_unary(
            prefix + "Rollback", pb.RollbackRequest.SerializeToString, pb.RollbackReply.FromString
        )
        self._pull_rows = ch.unary_unary(prefix + "PullRows", pb.RowsRequest.SerializeToString, None)
        # Same-host payloads: the Push method called with its header frame only, the gradient in
        # the segment (a client stream of one message is a unary call on the wire).
        self._push_header_only = ch.unary_unary(prefix + "Push", None, pb.PushReply.FromString)
        self._pull_header_only = ch.unary_unary(prefix + "Pull", pb.PullRequest.SerializeToString, None)
        self._step = ch.unary_unary(prefix + "Step", None, pb.StepReply.FromString)

    def close(self) -> None:
        self.same.close()
        for channel in self._channels:
            channel.close()

    def _call(self, what: str, fn: Callable[[], T], timeout_s: float, retry: bool = True) -> T:
        """fn(), reconnecting (or failing over) while the shard does not answer (see reconnect.call)."""
        rejoin = self.rejoin if retry else None
        try:
            result = reconnect.call(what, fn, timeout_s, self.address, self.config, rejoin, retry, self.failover, self.diagnose)
        except errors.ServerUnavailableError as exc:
            if retry:  # retried for the whole reconnect timeout (or out of time): the shard is gone
                self.given_up = exc
            raise
        self.given_up = None  # it answers (again)
        return result

    def diagnose(self) -> str:
        """After a call to the server in use ran out of time: what a quick status call finds."""
        return reconnect.diagnose(lambda t: self._status(pb.StatusRequest(), timeout=t))

    def join(self, req: pb.JoinRequest, timeout_s: float, wait_for_ready: bool = True) -> pb.JoinReply:
        """Join. As a first call (wait_for_ready) it waits up to timeout_s for the server to answer,
        but reports a refused connection after a short grace (see reconnect.first_call); a shard
        with a backup tries its servers in turn (see reconnect.join_any). Learns whether the server
        takes payloads through shared memory."""
        def attempt(t: float, ready: bool = False) -> pb.JoinReply:
            reply, call = self._join.with_call(req, timeout=t, wait_for_ready=ready)
            self.same.server_shm = shm.same_host_server(call.initial_metadata())
            return reply

        if len(self.addresses) < 2 and wait_for_ready:
            return reconnect.first_call("the join request", attempt, timeout_s, self.address, self.config,
                                        self.diagnose, reconnect.WAIT_FOR_SERVERS_HINT)

        def run(t: float) -> pb.JoinReply:
            return self._call("the join request", lambda: attempt(t), t, retry=False)

        if len(self.addresses) < 2:
            return run(timeout_s)
        return reconnect.join_any(run, timeout_s, lambda: self.address, self.failover)

    def init(self, header: pb.InitHeader, payloads: Sequence[torch.Tensor]) -> pb.InitReply:
        """Stream a shard's initial float32 weights and the values of the rows its header names,
        in order (sent once, by the chief)."""
        def frames() -> Iterator[bytes]:
            yield pb.InitFrame(header=header).SerializeToString()
            for payload in payloads:
                yield from data_frames(byte_view(payload.contiguous()), self.config.chunk_bytes)

        t = self.config.rpc_timeout_s
        return self._call("the init stream", lambda: self._init(frames(), timeout=t), t)

    def pull(self, req: pb.PullRequest, dest: torch.Tensor, wire: WireBuffer, published: bool = False) -> int:
        """Pull the shard's weights into dest (float32 slice of the flat space), or with published
        (same host) into `view` where the server lends a slot; returns their version."""
        self.same.view = None
        version = self.same.pull(req, dest, wire, published)
        return version if version is not None else self.pull_frames(req, dest, wire)

    def push(self, header: pb.PushHeader, payload: memoryview) -> pb.PushReply:
        """Push one gradient slice (already in the wire dtype). Retries are safe: pushes are keyed."""
        reply = self.same.push(header, payload)
        return reply if reply is not None else self.push_frames(header, payload)

    # ----------------------------------------------------------------- through gRPC frames
    def pull_frames(self, req: pb.PullRequest, dest: torch.Tensor, wire: WireBuffer) -> int:
        t = self.config.rpc_timeout_s

        def run() -> int:
            stream = self._pull(req, timeout=t)
            header = self.pull_header(next(stream, None), dest, wire)
            writer = PayloadWriter(wire.receive_view(dest), f"pull from {self.address}")
            write_frames(stream, writer, FrameParser(pb.PullFrame, f"pull from {self.address}"))
            wire.finish_receive(dest)
            return int(header.version)

        return self._call("the pull", run, t)

    def push_frames(self, header: pb.PushHeader, payload: memoryview) -> pb.PushReply:
        """Push through gRPC frames: with a go-ahead (PushGated) when the payload is larger than
        GATED_PUSH_BYTES, so that it waits for its turn without sending; else in one stream."""
        t = self.config.rpc_timeout_s
        head = pb.PushFrame(header=header).SerializeToString()
        if len(payload) > GATED_PUSH_BYTES:
            return self._call("the push", lambda: self._gated(head, payload, t), t)

        def frames() -> Iterator[bytes]:
            yield head
            yield from data_frames(payload, self.config.chunk_bytes)

        return self._call("the push", lambda: self._push(frames(), timeout=t), t)

    def _gated(self, head: bytes, payload: memoryview, timeout_s: float) -> pb.PushReply:
        """One PushGated call: the header, the server's `ready`, the data frames, the reply.

        While the data goes out this thread waits on an event of its own, not on the call: gRPC
        wakes every thread waiting on a call at each message sent, and a waiter woken 100 times
        per 100 MB push cost the worker 1.5-4 ms of CPU (GIL hand-offs) on 2 vCPUs."""
        go = threading.Event()  # set on `ready`, and whenever the call ends
        send = [False]  # whether to send the data once go is set
        sent = threading.Event()  # the request stream is done, or the call ended

        def frames() -> Iterator[bytes]:
            try:
                yield head
                go.wait()  # the call's deadline ends the wait at the latest (see finally)
                if send[0]:
                    yield from data_frames(payload, self.config.chunk_bytes)
            finally:
                sent.set()

        call = self._push_gated(frames(), timeout=timeout_s)
        call.add_done_callback(lambda _: sent.set())  # a call ended mid-stream may leave frames() suspended
        try:
            first = next(call, None)
            if first is None or first.WhichOneof("kind") != "ready":
                raise InvalidRequestError(f"server {self.address}: push expected `ready`, got {first}")
            send[0] = True
            go.set()
            sent.wait(timeout_s)  # the deadline ends the call, and so the wait, at the latest
            last = next(call, None)
            if last is None or last.WhichOneof("kind") != "reply":
                raise InvalidRequestError(f"server {self.address}: push expected its reply, got {last}")
            reply: pb.PushReply = last.reply
            return reply
        except grpc.RpcError:
            raise
        except BaseException:
            call.cancel()
            raise
        finally:
            go.set()  # a call that failed before `ready` ends its request stream unsent

    def pull_header(self, first: bytes | None, dest: torch.Tensor, wire: WireBuffer) -> pb.PullHeader:
        if first is None:
            raise InvalidRequestError(f"server {self.address}: pull returned no header")
        return self.check_pull_header(pb.PullFrame.FromString(first).header, dest, wire)

    def check_pull_header(self, header: pb.PullHeader, dest: torch.Tensor, wire: WireBuffer) -> pb.PullHeader:
        if header.numel != dest.numel() or header.dtype != wire.dtype_name:
            raise InvalidRequestError(
                f"server {self.address}: pull sends {header.numel} {header.dtype} values, "
                f"expected {dest.numel()} {wire.dtype_name}"
            )
        return header

    # ----------------------------------------------------------------- push + pull in one call
    def step(
        self, header: pb.PushHeader, payload: memoryview, dest: torch.Tensor, wire: WireBuffer, published: bool = False,
        reads: Sequence[pb.TableRows] = (),
    ) -> tuple[pb.PushReply, int, RowsRead | None] | None:
        """Push one gradient slice as header.clock (with the row gradients its header carries),
        then pull the weights for header.clock + 1 into dest and the rows `reads` names (ids by
        table), in one unary Step call: through this shard's segment (same host), else with both
        payloads in the messages when they fit one chunk. Returns the push reply, the pulled
        version and the rows read (None: none asked for); None when a Step call does not fit (a
        large payload to another host): then push and pull separately. Retries are safe (pushes
        are keyed).
        """
        self.same.view = None
        seg = self.same.take_segment(segment_bytes(header.numel, header.dtype, len(payload)))
        if seg is not None:
            done = self.same.step(seg, header, payload, dest, wire, published, reads)
            return None if done is None else (done[0], done[1], self._rows_read(done[2], reads))
        if len(payload) > self.config.chunk_bytes:
            return None
        head = pb.StepRequest(push=header, pull_rows=reads).SerializeToString()
        request = b"".join((head, bytes_field_prefix(STEP_REQUEST_DATA, len(payload)), payload))
        t = self.config.rpc_timeout_s

        reply: pb.StepReply = self._call("the push and pull", lambda: self._step(request, timeout=t), t)
        self.check_pull_header(reply.pull, dest, wire)
        data = memoryview(reply.data)
        if len(data) != wire.nbytes:
            raise InvalidRequestError(
                f"server {self.address}: step returned {len(data)} bytes of weights, expected {wire.nbytes}"
            )
        copy_from_wire(dest, data, wire)
        return reply.push, int(reply.pull.version), self._rows_read(reply, reads)

    def _rows_read(self, reply: pb.StepReply, reads: Sequence[pb.TableRows]) -> RowsRead | None:
        """The rows a Step reply carries for `reads` (None: none asked for)."""
        if not reads:
            return None
        return self._checked_rows(list(reply.row_versions), memoryview(reply.rows), len(reads), "step")

    def _checked_rows(self, versions: list[int], rows: memoryview, tables: int, what: str) -> RowsRead:
        if len(versions) != tables:
            raise InvalidRequestError(f"server {self.address}: {what} returned the versions of {len(versions)} "
                                      f"tables for {tables} asked for")
        return versions, rows

    # ----------------------------------------------------------------- sparse tables
    def pull_rows(self, req: pb.RowsRequest) -> RowsRead:
        """Rows of sparse tables by id (req.tables; see ps.proto PullRows): each table's version and
        the rows' bytes, table after table, a view of the reply (the server puts them last; parsed
        by protobuf if not there)."""
        t = self.config.rpc_timeout_s
        reply: bytes = self._call("the pull of rows", lambda: self._pull_rows(req, timeout=t), t)
        what = f"the pull of rows from {self.address}"
        split = trailing_bytes_field(reply, ROWS_REPLY_ROWS)
        if split is not None:
            head, rows = split
            msg = parse_frame(pb.RowsReply, bytes(head), what)
        else:
            msg = parse_frame(pb.RowsReply, reply, what)
            rows = memoryview(msg.rows)
        return self._checked_rows(list(msg.versions), rows, len(req.tables), "the pull of rows")

    def updated_rows(self, req: pb.RowsRequest) -> pb.RowsReply:
        """A page of a sparse table's updated rows with their ids (req.updated; see ps.proto PullRows)."""
        t = self.config.rpc_timeout_s
        reply: bytes = self._call("the read of updated rows", lambda: self._pull_rows(req, timeout=t), t)
        return parse_frame(pb.RowsReply, reply, f"the read of updated rows from {self.address}")

    def status(self, timeout_s: float | None = None, with_params: bool = False) -> pb.StatusReply:
        """The shard's status, as a first call (a refused connection is reported after a short grace)."""
        req = pb.StatusRequest(with_params=with_params)
        return reconnect.first_call(
            "the status request", lambda t, ready: self._status(req, timeout=t, wait_for_ready=ready),
            timeout_s or self.config.rpc_timeout_s, self.address, self.config, self.diagnose)

    def heartbeat(self, rank: int, fp: str) -> pb.HeartbeatReply:
        t = min(self.config.rpc_timeout_s, 5.0)
        req = pb.HeartbeatRequest(rank=rank, fingerprint=fp)
        return self._call("the heartbeat", lambda: self._heartbeat(req, timeout=t), t, retry=False)

    def rollback(self, req: pb.RollbackRequest) -> pb.RollbackReply:
        """Ask for the shard's roll-back points, or (req.execute) roll it back (sync; see ps.proto).
        A roll-back may read a checkpoint from disk: it gets the init deadline."""
        t = max(self.config.rpc_timeout_s, self.config.init_timeout_s) if req.execute else self.config.rpc_timeout_s
        return self._call("the roll-back request", lambda: self._rollback(req, timeout=t), t)

    def leave(self, rank: int, fp: str) -> None:
        """Leave the shard, retried as any call; not sent to a shard a call gave up on already (the
        worker is on its way out because of it, and waiting another reconnect timeout to say goodbye
        would double its exit time: the shard drops the worker when its lease ends)."""
        if self.given_up is not None:
            return
        t = self.config.rpc_timeout_s
        self._call("the leave request", lambda: self._leave(pb.LeaveRequest(rank=rank, fingerprint=fp), timeout=t), t)
