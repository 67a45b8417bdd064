"""The client edge: one channel per shard, deadlines, retries, fan-out, and gRPC status -> PsgradError."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from typing import Any, TypeVar

import grpc
import torch

from psgrad import errors, serde, shm
from psgrad.codec import (
    FrameParser,
    PayloadWriter,
    WireBuffer,
    byte_view,
    bytes_field_prefix,
    data_frames,
    write_frames,
)
from psgrad.config import ClientConfig, JobSpec
from psgrad.errors import InvalidRequestError, PsgradError, ServerUnavailableError
from psgrad.heap import tune_allocator
from psgrad.proto import ps_pb2 as pb
from psgrad.server import CHANNEL_OPTIONS, ERROR_METADATA_KEY, SERVICE_NAME, STEP_REQUEST_DATA
from psgrad.sharding import ParamSpec, ShardPlan, fingerprint

T = TypeVar("T")
# Pushes through frames above this size wait for the server's go-ahead before sending (PushGated):
# a push waiting for its turn at a busy shard would otherwise park up to a stream window of its
# gradient (tens of MB with gRPC's automatic windows) in the server. Smaller ones skip the extra
# round trip, since they can park little more than themselves.
GATED_PUSH_BYTES = 8 << 20
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)


def to_psgrad_error(exc: grpc.RpcError, address: str, what: str, timeout_s: float | None) -> PsgradError:
    """Map a gRPC error to the PsgradError the server raised, or to ServerUnavailableError."""
    code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    name = None
    if isinstance(exc, grpc.Call):
        for key, value in exc.trailing_metadata() or ():
            if key == ERROR_METADATA_KEY:
                name = value
    cls = errors.ERRORS_BY_NAME.get(name or "")
    if cls is not None:
        return cls(f"server {address}: {details}")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        within = f" within {timeout_s:g} s" if timeout_s else ""
        return ServerUnavailableError(
            f"server {address} did not answer {what}{within} ({code.name}: {details}); "
            "is it running and reachable?"
        )
    return PsgradError(f"server {address}: {what} failed with {code.name}: {details}")


# Copies up to this size are a plain memcpy on the calling thread; larger ones a torch copy, which
# spreads over torch's threads (and would wake them, to spin afterwards, for a small one).
_SMALL_COPY_BYTES = 4 << 20


def _copy_bytes(dest: memoryview, src: memoryview) -> None:
    if len(src) <= _SMALL_COPY_BYTES:
        dest[:] = src
    else:
        torch.frombuffer(dest, dtype=torch.uint8).copy_(torch.frombuffer(src, dtype=torch.uint8))


def _copy_in(dest: torch.Tensor, src: memoryview, wire: WireBuffer) -> None:
    """Wire-dtype bytes into dest (float32), converting if the wire dtype is narrower."""
    if wire.dtype == torch.float32:
        _copy_bytes(byte_view(dest), src)
    else:
        dest.copy_(torch.frombuffer(src, dtype=wire.dtype))


class ShardClient:
    """Calls to one shard server. Methods raise PsgradError subclasses, never grpc.RpcError."""

    def __init__(self, address: str, config: ClientConfig) -> None:
        self.address = address
        self.config = config
        self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        prefix = f"/{SERVICE_NAME}/"
        ch = self._channel
        self._join = ch.unary_unary(prefix + "Join", pb.JoinRequest.SerializeToString, pb.JoinReply.FromString)
        self._init = ch.stream_unary(prefix + "Init", None, pb.InitReply.FromString)
        self._pull = ch.unary_stream(prefix + "Pull", pb.PullRequest.SerializeToString, None)
        self._push = ch.stream_unary(prefix + "Push", None, pb.PushReply.FromString)
        self._push_gated = ch.stream_stream(prefix + "PushGated", None, pb.PushProgress.FromString)
        self._has_push_gated = True  # False once a server (an older psgrad) answers UNIMPLEMENTED
        self._status = ch.unary_unary(
            prefix + "Status", pb.StatusRequest.SerializeToString, pb.StatusReply.FromString
        )
        self._heartbeat = ch.unary_unary(
            prefix + "Heartbeat", pb.HeartbeatRequest.SerializeToString, pb.HeartbeatReply.FromString
        )
        self._leave = ch.unary_unary(prefix + "Leave", pb.LeaveRequest.SerializeToString, pb.LeaveReply.FromString)
        # Same-host payloads: the Push method called with its header frame only, the gradient in
        # the segment (a client stream of one message is a unary call on the wire).
        self._push_header_only = ch.unary_unary(prefix + "Push", None, pb.PushReply.FromString)
        self._pull_header_only = ch.unary_unary(prefix + "Pull", pb.PullRequest.SerializeToString, None)
        self._step = ch.unary_unary(prefix + "Step", None, pb.StepReply.FromString)
        self._has_step = True  # False once a server (an older psgrad) answers UNIMPLEMENTED
        self._shm = config.shared_memory and shm.supported()
        self._server_shm = False  # the server said at Join that it takes shared-memory payloads
        self._segment: shm.Segment | None = None
        self._segment_guard = threading.Lock()

    def close(self) -> None:
        with self._segment_guard:
            seg, self._segment = self._segment, None
        if seg is not None:
            seg.close()
        self._channel.close()

    def _take_segment(self, nbytes: int) -> shm.Segment | None:
        """This shard's shared-memory segment, locked for one transfer; None: use gRPC frames
        (another host, or the segment is busy with a concurrent transfer)."""
        if not (self._shm and self._server_shm) or nbytes == 0:
            return None
        with self._segment_guard:
            seg = self._segment
            if seg is None or seg.nbytes != nbytes:
                if seg is not None:
                    seg.close()
                try:
                    seg = self._segment = shm.Segment(nbytes)
                except OSError:
                    self._shm = False
                    return None
            return seg if seg.lock.acquire(blocking=False) else None

    def _drop_segment(self, seg: shm.Segment, for_good: bool = False) -> None:
        """Never write this segment again (the server may still read it, or cannot open it)."""
        with self._segment_guard:
            if self._segment is seg:
                self._segment = None
            if for_good:
                self._shm = False
        seg.close()

    def _call(self, what: str, fn: Callable[[], T], timeout_s: float, retry: bool = True) -> T:
        attempts = 1 + (self.config.retries if retry else 0)
        for attempt in range(attempts):
            try:
                return fn()
            except grpc.RpcError as exc:
                if attempt + 1 < attempts and isinstance(exc, grpc.Call) and exc.code() in _RETRYABLE:
                    time.sleep(0.2 * 2**attempt)  # back off before retrying a refused connection
                    continue
                raise to_psgrad_error(exc, self.address, what, timeout_s) from None
        raise AssertionError("unreachable")

    def join(self, req: pb.JoinRequest, timeout_s: float) -> pb.JoinReply:
        """Join; waits for the channel to connect (up to timeout_s) instead of failing fast.
        Learns whether the server takes payloads through shared memory."""

        def run() -> pb.JoinReply:
            reply, call = self._join.with_call(req, timeout=timeout_s, wait_for_ready=True)
            self._server_shm = (shm.METADATA_KEY, shm.SUPPORTED) in tuple(call.initial_metadata() or ())
            return reply

        return self._call("the join request", run, timeout_s, retry=False)

    def init(self, header: pb.InitHeader, weights: torch.Tensor) -> pb.InitReply:
        """Stream a shard's initial float32 weights (sent once, by the chief)."""
        def frames() -> Iterator[bytes]:
            yield pb.InitFrame(header=header).SerializeToString()
            yield from data_frames(byte_view(weights), self.config.chunk_bytes)

        t = self.config.rpc_timeout_s
        return self._call("the init stream", lambda: self._init(frames(), timeout=t), t)

    def pull(self, req: pb.PullRequest, dest: torch.Tensor, wire: WireBuffer) -> int:
        """Pull the shard's weights into dest (float32 slice of the flat space); returns their version."""
        version = self._pull_shared(req, dest, wire)
        return version if version is not None else self.pull_frames(req, dest, wire)

    def push(self, header: pb.PushHeader, payload: memoryview) -> pb.PushReply:
        """Push one gradient slice (already in the wire dtype). Retries are safe: pushes are keyed."""
        reply = self._push_shared(header, payload)
        return reply if reply is not None else self.push_frames(header, payload)

    # ----------------------------------------------------------------- through gRPC frames
    def pull_frames(self, req: pb.PullRequest, dest: torch.Tensor, wire: WireBuffer) -> int:
        t = self.config.rpc_timeout_s

        def run() -> int:
            stream = self._pull(req, timeout=t)
            header = self._pull_header(next(stream, None), dest, wire)
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
        if len(payload) > GATED_PUSH_BYTES and self._has_push_gated:
            reply = self._call("the push", lambda: self._gated(head, payload, t), t)
            if reply is not None:
                return reply

        def frames() -> Iterator[bytes]:
            yield head
            yield from data_frames(payload, self.config.chunk_bytes)

        return self._call("the push", lambda: self._push(frames(), timeout=t), t)

    def _gated(self, head: bytes, payload: memoryview, timeout_s: float) -> pb.PushReply | None:
        """One PushGated call: the header, the server's `ready`, the data frames, the reply.
        None when the server has no PushGated (an older psgrad): then push in one stream.

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
        except grpc.RpcError as exc:
            if isinstance(exc, grpc.Call) and exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                self._has_push_gated = False
                return None
            raise
        except BaseException:
            call.cancel()
            raise
        finally:
            go.set()  # a call that failed before `ready` ends its request stream unsent

    def _pull_header(self, first: bytes | None, dest: torch.Tensor, wire: WireBuffer) -> pb.PullHeader:
        if first is None:
            raise InvalidRequestError(f"server {self.address}: pull returned no header")
        return self._check_pull_header(pb.PullFrame.FromString(first).header, dest, wire)

    def _check_pull_header(self, header: pb.PullHeader, dest: torch.Tensor, wire: WireBuffer) -> pb.PullHeader:
        if header.numel != dest.numel() or header.dtype != wire.dtype_name:
            raise InvalidRequestError(
                f"server {self.address}: pull sends {header.numel} {header.dtype} values, "
                f"expected {dest.numel()} {wire.dtype_name}"
            )
        return header

    # ----------------------------------------------------------------- through shared memory
    def _pull_shared(self, req: pb.PullRequest, dest: torch.Tensor, wire: WireBuffer) -> int | None:
        """A same-host pull: the server copies the weights into this shard's segment and answers
        with the header alone. None when this shard's payloads go through gRPC frames (another
        host, or the segment is busy with a concurrent transfer)."""
        seg = self._take_segment(wire.nbytes)
        if seg is None:
            return None
        t = self.config.rpc_timeout_s
        try:
            first = self._pull_header_only(req, timeout=t, metadata=seg.metadata())
        except grpc.RpcError as exc:
            if self._shared_failed(seg, exc):
                return self.pull_frames(req, dest, wire)
            raise to_psgrad_error(exc, self.address, "the pull", t) from None
        try:
            header = self._pull_header(first, dest, wire)
            _copy_in(dest, seg.payload[: wire.nbytes], wire)
            seg.unlink()  # the server has it open
        finally:
            seg.lock.release()
        return int(header.version)

    def _push_shared(self, header: pb.PushHeader, payload: memoryview) -> pb.PushReply | None:
        """A same-host push: the gradient goes into this shard's segment, the call carries the
        header alone. None when this shard's payloads go through gRPC frames (see _pull_shared)."""
        seg = self._take_segment(len(payload))
        if seg is None:
            return None
        t = self.config.rpc_timeout_s
        try:
            _copy_bytes(seg.payload[: len(payload)], payload)
            frame = pb.PushFrame(header=header).SerializeToString()
            reply: pb.PushReply = self._push_header_only(frame, timeout=t, metadata=seg.metadata())
        except grpc.RpcError as exc:
            if self._shared_failed(seg, exc):
                return self.push_frames(header, payload)  # keyed: a retry is never applied twice
            raise to_psgrad_error(exc, self.address, "the push", t) from None
        except BaseException:
            seg.lock.release()
            raise
        seg.unlink()  # the server has it open
        seg.lock.release()
        return reply

    def _shared_failed(self, seg: shm.Segment, exc: grpc.RpcError) -> bool:
        """A same-host call failed: retire its segment (the server may still be using it), and say
        whether the transfer should be redone through frames (refused, or worth a retry)."""
        trailing = tuple(exc.trailing_metadata() or ()) if isinstance(exc, grpc.Call) else ()
        refused = (shm.METADATA_KEY, shm.REFUSED) in trailing
        if refused or not any(key == ERROR_METADATA_KEY for key, _ in trailing):
            # Refused, or the call ended without the server's answer, which may still be using
            # the segment: never write it again. A restarted server can no longer open a name
            # unlinked after first use, so a fresh segment may work next time; one that the
            # server never opened will not (another host, another /dev/shm).
            self._drop_segment(seg, for_good=refused and not seg.opened)
        seg.lock.release()
        return refused or (isinstance(exc, grpc.Call) and exc.code() in _RETRYABLE and self.config.retries > 0)

    # ----------------------------------------------------------------- push + pull in one call
    def step(
        self, header: pb.PushHeader, payload: memoryview, dest: torch.Tensor, wire: WireBuffer
    ) -> tuple[pb.PushReply, int] | None:
        """Push one gradient slice as header.clock, then pull the weights for header.clock + 1
        into dest, in one unary Step call: through this shard's segment (same host), else with
        both payloads in the messages when they fit one chunk. Returns the push reply and the
        pulled version; None when a Step call does not fit (a large payload to another host, or
        a server without Step): then push and pull separately. Retries are safe (pushes are keyed).
        """
        if not self._has_step:
            return None
        seg = self._take_segment(len(payload))
        if seg is not None:
            return self._step_shared(seg, header, payload, dest, wire)
        if len(payload) > self.config.chunk_bytes:
            return None
        head = pb.StepRequest(push=header).SerializeToString()
        request = b"".join((head, bytes_field_prefix(STEP_REQUEST_DATA, len(payload)), payload))
        t = self.config.rpc_timeout_s

        def run() -> pb.StepReply | None:
            try:
                reply: pb.StepReply = self._step(request, timeout=t)
                return reply
            except grpc.RpcError as exc:
                if self._step_unimplemented(exc):
                    return None
                raise

        reply = self._call("the push and pull", run, t)
        if reply is None:
            return None
        self._check_pull_header(reply.pull, dest, wire)
        data = memoryview(reply.data)
        if len(data) != wire.nbytes:
            raise InvalidRequestError(
                f"server {self.address}: step returned {len(data)} bytes of weights, expected {wire.nbytes}"
            )
        _copy_in(dest, data, wire)
        return reply.push, int(reply.pull.version)

    def _step_shared(
        self, seg: shm.Segment, header: pb.PushHeader, payload: memoryview, dest: torch.Tensor, wire: WireBuffer
    ) -> tuple[pb.PushReply, int] | None:
        """step() through the segment: the gradient goes in, the weights come back in it."""
        t = self.config.rpc_timeout_s
        try:
            _copy_bytes(seg.payload[: len(payload)], payload)
            request = pb.StepRequest(push=header).SerializeToString()
            reply: pb.StepReply = self._step(request, timeout=t, metadata=seg.metadata())
        except grpc.RpcError as exc:
            if self._step_unimplemented(exc):  # answered before any handler ran: the segment is intact
                seg.lock.release()
                return None
            if self._shared_failed(seg, exc):
                return None  # push and pull through frames instead (a keyed push is never applied twice)
            raise to_psgrad_error(exc, self.address, "the push and pull", t) from None
        except BaseException:
            seg.lock.release()
            raise
        try:
            self._check_pull_header(reply.pull, dest, wire)
            _copy_in(dest, seg.payload[: wire.nbytes], wire)
            seg.unlink()  # the server has it open
        finally:
            seg.lock.release()
        return reply.push, int(reply.pull.version)

    def _step_unimplemented(self, exc: grpc.RpcError) -> bool:
        """The server predates Step: remember it, and push and pull separately from now on."""
        if isinstance(exc, grpc.Call) and exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            self._has_step = False
        return not self._has_step

    def status(self, timeout_s: float | None = None) -> pb.StatusReply:
        t = timeout_s or self.config.rpc_timeout_s
        return self._call(
            "the status request",
            lambda: self._status(pb.StatusRequest(), timeout=t, wait_for_ready=True),
            t,
            retry=False,
        )

    def heartbeat(self, rank: int, fp: str) -> pb.HeartbeatReply:
        t = min(self.config.rpc_timeout_s, 5.0)
        req = pb.HeartbeatRequest(rank=rank, fingerprint=fp)
        return self._call("the heartbeat", lambda: self._heartbeat(req, timeout=t), t, retry=False)

    def leave(self, rank: int, fp: str) -> None:
        t = self.config.rpc_timeout_s
        self._call("the leave request", lambda: self._leave(pb.LeaveRequest(rank=rank, fingerprint=fp), timeout=t), t)


class ParameterClient:
    """A worker's view of the whole job: S shard clients, the shard plan, concurrent fan-out."""

    def __init__(
        self,
        addresses: Sequence[str],
        spec: JobSpec,
        params: Sequence[ParamSpec],
        plan: ShardPlan,
        rank: int,
        config: ClientConfig,
    ) -> None:
        if len(addresses) != plan.num_shards or spec.num_shards != plan.num_shards:
            raise errors.ConfigError(
                f"{len(addresses)} server addresses for a plan of {plan.num_shards} shards"
            )
        self.spec = spec
        self.params = list(params)
        self.plan = plan
        self.rank = rank
        self.config = config
        self.fingerprint = fingerprint(self.params, spec)
        tune_allocator()  # megabyte-sized message buffers from the heap, not a fresh mmap each
        self.shards = [ShardClient(a, config) for a in addresses]
        self._pool = futures.ThreadPoolExecutor(max_workers=len(addresses), thread_name_prefix="psgrad-fanout")
        # Separate staging buffers for pulls and pushes so the two may overlap.
        self._pull_wires = [WireBuffer(plan.size(i), spec.wire_dtype) for i in range(plan.num_shards)]
        self._push_wires = [WireBuffer(plan.size(i), spec.wire_dtype) for i in range(plan.num_shards)]
        self.base_versions = [0] * plan.num_shards
        self._heartbeat: threading.Thread | None = None
        self._stop_heartbeat = threading.Event()

    def __enter__(self) -> ParameterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the channels without leaving (the servers drop this worker when its lease ends)."""
        self._halt_heartbeat()
        self._pool.shutdown(wait=True)
        for s in self.shards:
            s.close()

    def _fan_out(self, fn: Callable[[int, ShardClient], T]) -> list[T]:
        """Run fn on every shard concurrently, the first one on this thread (a hand-off to another
        thread costs about as much as a small call); wait for all, then re-raise the first failure
        (in shard order)."""
        futs = [self._pool.submit(fn, i, s) for i, s in enumerate(self.shards) if i > 0]
        outcomes: list[tuple[bool, Any]] = []
        try:
            outcomes.append((True, fn(0, self.shards[0])))
        except BaseException as exc:  # the others are already running: let them finish first
            outcomes.append((False, exc))
        for f in futs:
            error = f.exception()
            outcomes.append((False, error) if error is not None else (True, f.result()))
        for ok, value in outcomes:
            if not ok:
                raise value
        return [value for _, value in outcomes]

    def _join_request(self, index: int, wait: bool) -> pb.JoinRequest:
        start, end = self.plan.ranges[index]
        return pb.JoinRequest(
            rank=self.rank,
            spec=serde.job_spec_to_proto(self.spec),
            params=serde.params_to_proto(self.params),
            shard=serde.shard_range_to_proto(index, start, end),
            fingerprint=self.fingerprint,
            wait_for_init=wait,
        )

    def join(self, initial_weights: Callable[[], torch.Tensor] | None) -> int:
        """Join every shard and return the clock this worker continues from.

        The chief passes its initial flat weights and initializes any empty shard; every worker
        then waits (server side, up to init_timeout_s) until the shards are initialized and, in
        sync/ssp mode, until all num_workers workers have joined. Starts the lease heartbeat.
        """
        replies = self._fan_out(
            lambda i, s: s.join(self._join_request(i, wait=False), self.config.connect_timeout_s)
        )
        if initial_weights is not None and not all(r.initialized for r in replies):
            flat = initial_weights()

            def init(i: int, s: ShardClient) -> Any:
                if replies[i].initialized:
                    return None
                start, end = self.plan.ranges[i]
                header = pb.InitHeader(join=self._join_request(i, wait=False), numel=end - start)
                return s.init(header, flat[start:end].contiguous())

            self._fan_out(init)
        if not all(r.ready for r in replies):
            t = self.config.init_timeout_s
            replies = self._fan_out(lambda i, s: s.join(self._join_request(i, wait=True), t))
            missing = [self.shards[i].address for i, r in enumerate(replies) if not r.initialized]
            if missing:
                raise errors.NotInitializedError(
                    f"shards at {', '.join(missing)} were not initialized within {t:g} s: "
                    "is worker rank 0 (the chief) running against the same --servers?"
                )
            short = [r.joined for r in replies if not r.ready]
            if short:
                raise errors.WorkerStateError(
                    f"only {min(short)} of {self.spec.num_workers} workers joined within {t:g} s "
                    f"({self.spec.mode} mode starts all workers together): start the others, or lower "
                    "--num-workers"
                )
        self._start_heartbeat(min(r.lease_s for r in replies))
        return max(r.start_clock for r in replies)

    def _start_heartbeat(self, lease_s: float) -> None:
        """Renew this worker's lease every lease_s/3 while it trains (also while a pull waits)."""
        if self._heartbeat is not None:
            return
        stop = self._stop_heartbeat

        def beat() -> None:
            while not stop.wait(lease_s / 3):
                for s in self.shards:
                    try:
                        s.heartbeat(self.rank, self.fingerprint)
                    except PsgradError:
                        pass  # the training loop's own calls report a lost server or eviction

        self._heartbeat = threading.Thread(target=beat, name="psgrad-heartbeat", daemon=True)
        self._heartbeat.start()

    def pull(self, flat: torch.Tensor, clock: int, observe: bool = False) -> list[int]:
        """Pull every shard into its range of flat (float32, CPU) once the mode's gate for `clock`
        holds; remembers the base versions. observe=True reads a snapshot: no gate, no lease."""

        req = pb.PullRequest(rank=self.rank, clock=clock, fingerprint=self.fingerprint, observe=observe)

        def one(i: int, s: ShardClient) -> int:
            start, end = self.plan.ranges[i]
            return s.pull(req, flat[start:end], self._pull_wires[i])

        versions = self._fan_out(one)
        if not observe:
            self.base_versions = versions
        return versions

    def _push_header(self, index: int, clock: int) -> pb.PushHeader:
        start, end = self.plan.ranges[index]
        return pb.PushHeader(
            rank=self.rank,
            clock=clock,
            base_version=self.base_versions[index],
            numel=end - start,
            dtype=self.spec.wire_dtype,
            fingerprint=self.fingerprint,
        )

    def push(self, flat_grad: torch.Tensor, clock: int) -> list[pb.PushReply]:
        """Push each shard its range of flat_grad, keyed (rank, clock), with the pull's base versions."""

        def one(i: int, s: ShardClient) -> pb.PushReply:
            start, end = self.plan.ranges[i]
            return s.push(self._push_header(i, clock), self._push_wires[i].encode(flat_grad[start:end]))

        return self._fan_out(one)

    def exchange(self, flat_grad: torch.Tensor, clock: int, flat: torch.Tensor) -> tuple[list[pb.PushReply], list[int]]:
        """One iteration's traffic: push(flat_grad, clock), then pull(flat, clock + 1), per shard
        in one Step call where it fits (same host, or payloads of at most one chunk), else as a
        push followed by a pull. Each shard goes at its own pace: its pull may wait at its gate
        while another shard still receives the push. Returns the push replies and the versions
        pulled (remembered as base versions)."""
        req = pb.PullRequest(rank=self.rank, clock=clock + 1, fingerprint=self.fingerprint)

        def one(i: int, s: ShardClient) -> tuple[pb.PushReply, int]:
            start, end = self.plan.ranges[i]
            header = self._push_header(i, clock)
            payload = self._push_wires[i].encode(flat_grad[start:end])
            done = s.step(header, payload, flat[start:end], self._pull_wires[i])
            if done is None:
                done = s.push(header, payload), s.pull(req, flat[start:end], self._pull_wires[i])
            return done

        results = self._fan_out(one)
        self.base_versions = [version for _, version in results]
        return [reply for reply, _ in results], list(self.base_versions)

    def leave(self) -> None:
        """Leave the job: nobody waits for this worker any more."""
        self._halt_heartbeat()
        self._fan_out(lambda i, s: s.leave(self.rank, self.fingerprint))

    def _halt_heartbeat(self) -> None:
        self._stop_heartbeat.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None


def shard_status(addresses: Sequence[str], timeout_s: float) -> list[pb.StatusReply]:
    """Status of each server (in the given order), each asked concurrently."""
    config = ClientConfig(connect_timeout_s=timeout_s, rpc_timeout_s=timeout_s, retries=0)
    clients = [ShardClient(a, config) for a in addresses]
    try:
        with futures.ThreadPoolExecutor(max_workers=len(clients)) as pool:
            return list(pool.map(lambda c: c.status(timeout_s), clients))
    finally:
        for c in clients:
            c.close()
