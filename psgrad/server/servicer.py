"""The gRPC edge of a parameter shard: decodes requests, delegates to Shard, maps errors to status codes."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
import torch

from psgrad import errors
from psgrad.wire import serde
from psgrad.wire import local_socket, published, row_share, shm
from psgrad.core.codecs import WireBuffer, byte_view, consecutive_rows, copy_bytes, segment_bytes, torch_dtype
from psgrad.wire.frames import FrameParser, PayloadWriter, bytes_field_prefix, data_frames, parse_frame, write_frames
from psgrad.config import ServerConfig
from psgrad.errors import InvalidRequestError, PsgradError
from psgrad.core.layout import Layout
from psgrad.proto import ps_pb2 as pb
from psgrad.server.local_calls import LocalCalls, detached
from psgrad.server.publisher import Publisher
from psgrad.server.read_limit import DENSE_ADVICE, ROWS_ADVICE
from psgrad.server.rows_path import RowGradients
from psgrad.server.shard import Shard
from psgrad.server.streams import StreamLimits
from psgrad.server.tables import FROZEN
from psgrad.server.transfers import PullStream, PushWriter
from psgrad.server.worker_copies import check_ask
from psgrad.wire import protocol, security
from psgrad.wire.protocol import ROWS_REPLY_ROWS, STEP_REPLY_DATA, STEP_REPLY_ROWS
from psgrad.wire.rows import RowBlock

# A waiting pull gives up this long before the caller's deadline, so that the caller receives the
# server's explanation (who it was waiting for) rather than a bare local timeout.
DEADLINE_MARGIN_S = 0.5

F = TypeVar("F", bound=Callable[..., Any])


def _edge(method: F) -> F:
    """Turn PsgradError raised by a handler into a gRPC status with the error's class attached."""

    @functools.wraps(method)
    def wrapper(self: "ParameterServicer", request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except PsgradError as exc:
            protocol.abort(context, exc)

    return wrapper  # type: ignore[return-value]


def _layout_from_join(req: pb.JoinRequest) -> Layout:
    return Layout(
        spec=serde.job_spec_from_proto(req.spec),
        params=tuple(serde.params_from_proto(req.params)),
        index=req.shard.index,
        start=req.shard.start,
        end=req.shard.end,
        fingerprint=req.fingerprint,
        tables=tuple(serde.tables_from_proto(req.tables)),
        frozen=tuple(serde.params_from_proto(req.frozen)),
    )


def _header(frames: Iterator[bytes], frame_type: Any, what: str) -> Any:
    """Parse the first frame of a client stream, which must be a header."""
    first = next(frames, None)
    if first is None:
        raise InvalidRequestError(f"{what}: empty stream, expected a header frame first")
    msg = parse_frame(frame_type, first, what)
    if msg.WhichOneof("kind") != "header":
        raise InvalidRequestError(f"{what}: first frame must be the header")
    return msg.header


def _row_gradients(h: pb.PushHeader, what: str, grads: memoryview | None = None) -> RowGradients | None:
    """A push's row gradients (PushHeader.row_block), all its tables in one block; grads: their
    gradients where the call carried them beside the message (see local_calls.detached).

    Raises:
        InvalidRequestError: gradients beside a push without rows (or see RowBlock.from_proto)."""
    if not h.HasField("row_block"):
        if grads is not None:
            raise InvalidRequestError(f"{what}: {len(grads)} bytes of row gradients for a push that carries no rows")
        return None
    return RowBlock.from_proto(h.row_block, what, push=True, grads=grads).updates()


def _reads(block: pb.RowBlock, what: str) -> list[tuple[str, torch.Tensor]]:
    """The (table, ids) a read of rows names (a RowBlock of ids)."""
    return RowBlock.from_proto(block, what).lookups()


def _rows_bytes(rows: Sequence[torch.Tensor]) -> list[memoryview]:
    """Rows read, as the bytes a reply carries them in (table after table): one view where they
    lie one after another (tables stored together, read in one gather), else one a table."""
    if len(rows) > 1:
        whole = consecutive_rows(rows)
        if whole is not None:
            return [byte_view(whole)]
    return [byte_view(r.contiguous()) for r in rows]


def _metadata(context: grpc.ServicerContext, key: str) -> str | None:
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return str(v)
    return None


_READY = pb.PushProgress(ready=True).SerializeToString()


@dataclasses.dataclass
class _Reserved:
    """A push whose header was accepted and which holds a receive buffer of the shard."""

    header: pb.PushHeader
    grad: torch.Tensor
    wire: WireBuffer
    writer: PushWriter
    segment: shm.Attached | None


class ParameterServicer:
    """Handlers of the ParameterServer service for one shard."""

    def __init__(self, shard: Shard, config: ServerConfig) -> None:
        self.shard = shard
        self.config = config
        self._segments: dict[int, shm.Attached] = {}  # rank -> its shared-memory segment
        self._row_segments: dict[int, shm.Attached] = {}  # rank -> the segment its Step calls' rows go into
        self._segments_lock = threading.Lock()
        self.publisher: Publisher | None = None  # same-host pulls: published versions (zero copy)
        # The server's client-stream limits: whole pushes and pulls run under their deadline there.
        self.streams: StreamLimits | None = None
        self._authenticated = security.authenticates(config)
        # Step calls over a local socket (same host) or a TCP one, offered at Join (see server/local_calls.py).
        self.local: LocalCalls | None = None

    def _timed(self, method: str, context: grpc.ServicerContext, rank: int, nbytes: int,
               progress: Callable[[], int], observe: bool = False) -> contextlib.AbstractContextManager[None]:
        """A block that moves nbytes to or from `rank` (a push's data frames, a pull's), under the
        whole-transfer deadline (StreamLimits.transfer): cancelled if it has not ended in time."""
        if self.streams is None:
            return contextlib.nullcontext()
        who = f"a read-only pull as rank {rank}" if observe else f"worker rank {rank}"
        if not self._authenticated:
            who += ", as its request says: this server authenticates no one"
        return self.streams.transfer(method, who, context, nbytes, progress)

    def _segment(self, rank: int, value: str, nbytes: int) -> shm.Attached:
        """The worker's same-host segment that a call names (opened once, kept while it is used).

        Raises:
            shm.SharedMemoryUnavailable: this server cannot use it (another host, or a bad name).
        """
        with self._segments_lock:
            seg = self._segments.get(rank)
            if seg is not None and value.startswith(seg.name + ";") and seg.nbytes == nbytes:
                return seg
        seg = shm.attach(value, nbytes)
        with self._segments_lock:
            self._segments[rank] = seg  # a worker has one segment per shard; a new one replaces it
        self._unmap_departed()
        return seg

    def _rows_segment(self, context: grpc.ServicerContext, rank: int) -> shm.Attached | None:
        """The worker's segment a Step call names for the rows it reads (psgrad-rows-shm; opened
        once, kept while it is named); None: the rows go in the reply (none named, or this server
        cannot open it: the worker then sees them in the reply and stops naming one after a few)."""
        value = _metadata(context, shm.ROWS_METADATA_KEY)
        if value is None:
            return None
        with self._segments_lock:
            seg = self._row_segments.get(rank)
            if seg is not None and value.startswith(seg.name + ";"):
                return seg
        try:
            seg = shm.attach(value, shm.described_bytes(value))
        except shm.SharedMemoryUnavailable:
            return None
        with self._segments_lock:
            self._row_segments[rank] = seg  # one per worker and shard; a new one replaces it
        return seg

    def _unmap_departed(self) -> None:
        """Drop the mappings of segments whose workers left or were evicted (their memory goes
        once neither end maps it), so a dead worker's segment does not stay in this server."""
        live = self.shard.live_ranks()
        with self._segments_lock:
            for segments in (self._segments, self._row_segments):
                for rank in [r for r in segments if r not in live]:
                    del segments[rank]

    def _acked(self, version: int, context: grpc.ServicerContext) -> None:
        """Replication: hold a reply that reveals `version` until the backup has it."""
        replication = self.shard.replication
        if replication is not None:
            replication.wait_acked(version, context.time_remaining())

    @_edge
    def Join(self, req: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        self.shard.serving()
        wait_s = 0.0
        if req.wait_for_init:  # answer before the deadline: the worker then learns who it waits for
            remaining = context.time_remaining()
            wait_s = 3600.0 if remaining is None else max(0.0, remaining - DEADLINE_MARGIN_S)
        # a Join that is not a round of waiting at the start may be a worker restarted within its lease: logged
        r = self.shard.join(req.rank, _layout_from_join(req), wait_s, rejoin=not req.wait_for_init,
                            incarnation=req.incarnation)
        answer: list[tuple[str, str]] = []
        if shm.supported():  # a worker on this host may then move payloads through shared memory
            answer.append((shm.METADATA_KEY, shm.server_answer()))
        if self.local is not None:  # ... and make its Step calls over the local socket, or the TCP one
            offers = [o for o in (self.local.offer(req.rank), self.local.tcp_offer(req.rank)) if o is not None]
            answer += offers
            if offers and self.local.takes_reads:  # (a forward's reads of rows too)
                answer.append((local_socket.READS_KEY, "1"))
        if dict(context.invocation_metadata() or ()).get(row_share.METADATA_KEY) == shm.host_id():
            with self.shard.core.cond:  # (a worker of this host: lend it the tables' rows in place)
                name = self.shard.core.row_share.offer()
            if name is not None:
                answer.append((row_share.METADATA_KEY, f"{name};{shm.host_id()}"))
        if answer:
            context.send_initial_metadata(tuple(answer))
        return pb.JoinReply(
            initialized=r.initialized,
            version=r.version,
            lease_s=self.config.lease_s,
            ready=r.ready,
            joined=r.joined,
            start_clock=r.start_clock,
            joined_ranks=r.ranks,
            frozen_version=r.frozen_version,
            last_push_clock=r.last_push_clock,
            drawn_as=dict(r.drawn_as),
        )

    @_edge
    def Init(self, frames: Iterator[bytes], context: grpc.ServicerContext) -> pb.InitReply:
        self.shard.serving()
        header = _header(frames, pb.InitFrame, "init")
        layout = _layout_from_join(header.join)
        if header.numel != layout.numel:
            raise InvalidRequestError(
                f"init announces {header.numel} elements for shard {layout.index} owning "
                f"[{layout.start}, {layout.end}) = {layout.numel}"
            )
        if self.shard.layout is not None:  # idempotent: check, and do not read 4 bytes per element
            self.shard.join(header.join.rank, layout, incarnation=header.join.incarnation)
            return pb.InitReply(already_initialized=True, version=self.shard.version)
        loaded = _reads(header.row_block, "init")  # rows that start from the chief's values (ids; values follow)
        dims = {t.name: t.dim for t in layout.tables}
        unknown = [table for table, _ in loaded if table not in dims]
        if unknown:
            raise InvalidRequestError(f"init: rows of {unknown[0]!r}, which is not one of the job's sparse tables "
                                      f"({', '.join(map(repr, dims)) or 'none'})")
        start, end = layout.frozen_range
        if header.frozen_numel != end - start:
            raise InvalidRequestError(f"init announces {header.frozen_numel} frozen values for shard {layout.index} "
                                      f"keeping [{start}, {end}) of the frozen parameters = {end - start}")
        sizes = [ids.numel() * dims[table] for table, ids in loaded] + [end - start]
        payload = torch.empty(layout.numel + sum(sizes), dtype=torch.float32)
        writer = PayloadWriter(byte_view(payload), "init")
        with self._timed("Init", context, header.join.rank, writer.size, lambda: writer.received):
            write_frames(frames, writer, FrameParser(pb.InitFrame, "init"))
        weights = payload[: layout.numel] if len(payload) == layout.numel else payload[: layout.numel].clone()
        *values, frozen = payload[layout.numel:].split(sizes)
        rows = {table: (ids, v.view(ids.numel(), dims[table])) for (table, ids), v in zip(loaded, values)}
        already = self.shard.initialize(header.join.rank, layout, weights, rows, frozen if layout.frozen else None,
                                        header.join.incarnation)
        self._acked(self.shard.version, context)
        return pb.InitReply(already_initialized=already, version=self.shard.version)

    def _granted_pull(
        self, rank: int, clock: int, fingerprint: str, context: grpc.ServicerContext, observe: bool
    ) -> tuple[int, PullStream]:
        """Wait at the mode's gate (until shortly before the caller's deadline, or until it cancels);
        returns the version and the stream of the weights. The stream is closed when the call ends.

        Raises:
            StalledError: the deadline came first (the message names whom the pull waited for).
        """
        self.shard.serving(promote=not observe)
        context.add_callback(self.shard.wake)  # a cancelled waiting pull stops waiting at once
        remaining = context.time_remaining()
        timeout_s = None if remaining is None else max(0.0, remaining - DEADLINE_MARGIN_S)
        got = self.shard.pull_frames(rank, clock, fingerprint, timeout_s, context.is_active, observe)
        if got is None:
            self.shard.serving(promote=False)  # fenced meanwhile: the worker tries the other server
            blocking = self.shard.blocking(rank, clock)
            who = f"worker(s) {', '.join(map(str, blocking))}" if blocking else "the other workers"
            raise errors.StalledError(
                f"pull of worker rank {rank} at clock {clock} was still waiting for {who} "
                "when its deadline passed (raise --rpc-timeout-s if they are merely slow)"
            )
        version, frames = got
        # Updates wait for a stream that reads the live weights: end it as soon as the call ends.
        if not context.add_callback(frames.close):
            frames.close()
        try:
            self._acked(version, context)  # never show a worker weights its backup does not have
        except BaseException:
            frames.close()
            raise
        return version, frames

    def _pull_header(self, version: int, rank: int | None = None) -> pb.PullHeader:
        """The header of a pull of `version`; with a worker's rank (not an observing pull), what the
        shard tells it once and it was not told yet: e.g. a worker evicted while this pull waited."""
        layout = self.shard.layout
        assert layout is not None
        head = pb.PullHeader(version=version, numel=layout.numel, dtype=layout.spec.wire_dtype)
        if rank is not None:
            evicted, restored = self.shard.news(rank)
            head.evicted.extend(serde.evictions_to_proto(evicted))
            if restored is not None:
                head.restored_version = restored
        return head

    def _shared_segment(self, context: grpc.ServicerContext, rank: int, nbytes: int) -> shm.Attached | None:
        """The same-host segment the call names (None: payloads in the messages). One this server
        cannot open is refused with FAILED_PRECONDITION and a marker, and the worker falls back to
        sending the payload through gRPC."""
        value = _metadata(context, shm.METADATA_KEY)
        if value is None:
            return None
        try:
            return self._segment(rank, value, nbytes)
        except shm.SharedMemoryUnavailable as exc:
            context.set_trailing_metadata(((shm.METADATA_KEY, shm.REFUSED),))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            raise  # unreachable: abort raises

    def _publish(self, context: grpc.ServicerContext, rank: int, frames: PullStream) -> bool:
        """A same-host pull that asks for it: lend the worker a ring slot holding the version (see
        Publisher); True when the trailing metadata names it, False: copy into its segment."""
        layout = self.shard.layout
        if layout is None or layout.spec.wire_dtype != "float32" or not published.requested(context.invocation_metadata()):
            return False
        with self._segments_lock:
            if self.publisher is None or self.publisher.slot_bytes != frames.nbytes:
                if self.publisher is not None:
                    self.publisher.close()
                self.publisher = Publisher(frames.nbytes, layout.spec.num_workers, self.shard.live_ranks)
                self.shard.published_status = self.publisher.status
            publisher = self.publisher
        answer = publisher.lease(rank, frames.version, frames)
        if answer is None:
            return False
        context.set_trailing_metadata(answer)
        return True

    def close(self) -> None:
        """Remove the published versions' ring from /dev/shm (workers keep their mappings)."""
        with self._segments_lock:
            if self.publisher is not None:
                self.publisher.close()

    def Pull(self, req: pb.PullRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        if req.table:
            yield from self._pull_table(req, context)
            return
        delta = req.HasField("delta") and not req.observe
        try:
            if delta:
                check_ask(req.delta, req.rank)
            version, frames = self._granted_pull(req.rank, req.clock, req.fingerprint, context, req.observe)
        except PsgradError as exc:
            protocol.abort(context, exc)
            return
        if delta:
            yield from self._delta_pull(req, version, frames, context)
            return
        try:
            if _metadata(context, shm.METADATA_KEY) is None:  # the weights go in the reply: under --max-read-mb
                try:
                    self._hold_read(context, frames.nbytes, self._weights_read(req.rank, req.observe), DENSE_ADVICE)
                except PsgradError as exc:
                    protocol.abort(context, exc)
            header = pb.PullFrame(header=self._pull_header(version, None if req.observe else req.rank)).SerializeToString()
            if _metadata(context, shm.METADATA_KEY) is None:
                # A client that stops reading (or reads a trickle) holds the weights and a thread:
                # the whole pull runs under its deadline.
                with self._timed("Pull", context, req.rank, len(header) + frames.nbytes,
                                 lambda: frames.sent, req.observe):
                    yield header
                    yield from frames
                return
            # The weights go into the worker's segment; the reply is the header alone (so the
            # worker may call this method as a unary call).
            seg = self._shared_segment(context, req.rank, frames.nbytes)
            assert seg is not None
            if req.observe or not self._publish(context, req.rank, frames):
                if seg.window:  # the worker's gradient, never written: it pulls through frames instead
                    _not_lent(context, "no free slot to lend the version in")
                frames.copy_into(seg.payload[: frames.nbytes])
            yield header
        finally:
            frames.close()

    def _changed(self, rank: int, ask: pb.DeltaAsk, version: int, frames: PullStream) -> tuple[pb.PullHeader, memoryview]:
        """A compressed pull's header and payload (see WorkerCopies); ends the stream."""
        out = self.shard.delta_pull(rank, ask, frames)
        header = self._pull_header(version, rank)
        header.compress, header.copy, header.drift = out.compress, out.copy, out.drift
        return header, out.payload

    def _delta_pull(
        self, req: pb.PullRequest, version: int, frames: PullStream, context: grpc.ServicerContext,
    ) -> Iterator[bytes]:
        """Pull's reply to a worker that asked for the change since its copy: the header, then the
        payload in data frames, or copied into the worker's segment (same host; never lent from
        the ring of published versions, which hold the weights)."""
        try:
            # (its payload is built here, then sent or copied: under --max-read-mb, as the weights' bytes
            # at most, taken before it is built)
            self._hold_read(context, frames.nbytes, self._weights_read(req.rank, False), DENSE_ADVICE)
            head, payload = self._changed(req.rank, req.delta, version, frames)
            seg = self._shared_segment(context, req.rank, frames.nbytes)
        except PsgradError as exc:
            protocol.abort(context, exc)
            return
        finally:
            frames.close()
        header = pb.PullFrame(header=head).SerializeToString()
        if seg is not None:
            if seg.window:  # (the worker's gradient, never written; its compressed pulls are never lent)
                _not_lent(context, "a compressed pull names the worker's gradient")
            copy_bytes(seg.payload[: len(payload)], payload)
            yield header
            return
        sent = [0]
        with self._timed("Pull", context, req.rank, len(header) + len(payload), lambda: sent[0]):
            yield header
            for chunk in data_frames(payload, self.config.chunk_bytes):
                yield chunk
                sent[0] += len(chunk)

    def _pull_table(self, req: pb.PullRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        """A pull of the frozen table (req.table): its version, then its values in float32 frames.
        No gate and no clock (it moves only when written); read at join, and when its version moved."""
        try:
            if req.table != FROZEN:
                raise InvalidRequestError(f"a pull of table {req.table!r}: only the {FROZEN!r} table is pulled whole "
                                          "(the weights are pulled with no table named, sparse rows by PullRows)")
            self.shard.serving(promote=not req.observe)
            # (its reply's bytes, the shard's range of the frozen values, taken of --max-read-mb before
            # they are copied, as a pull of the weights: a range larger than the bound goes alone)
            nbytes = 4 * self.shard.frozen_numel(req.rank, req.fingerprint, req.observe)
            self._hold_read(context, nbytes, f"a pull of the frozen parameters ({'read-only, as ' if req.observe else ''}"
                                             f"rank {req.rank})", DENSE_ADVICE)
            version, values = self.shard.frozen_values(req.rank, req.fingerprint, req.observe)
            self._acked(self.shard.version, context)  # never show a worker values its backup does not have
        except PsgradError as exc:
            protocol.abort(context, exc)
            return
        header = pb.PullFrame(header=pb.PullHeader(version=version, numel=values.numel(), dtype="float32")).SerializeToString()
        sent = [0]
        # Under the whole-transfer deadline, as a pull of the weights: a client that stops reading
        # would hold this copy of the values and a thread.
        with self._timed("Pull", context, req.rank, len(header) + 4 * values.numel(), lambda: sent[0], req.observe):
            yield header
            for chunk in data_frames(byte_view(values), self.config.chunk_bytes):
                yield chunk
                sent[0] += len(chunk)

    def _reserve(self, h: pb.PushHeader, context: grpc.ServicerContext) -> _Reserved:
        """Check a push header and wait for a receive buffer (see Shard.push_target)."""
        if h.skip:
            raise InvalidRequestError(f"a skip (worker rank {h.rank}, clock {h.clock}) is sent through Push alone, "
                                      "with its header frame and no data")
        torch_dtype(h.dtype)  # refuses unknown dtype names with a clear message
        self.shard.serving()
        grad, wire, writer = self.shard.push_target(
            h.rank, h.clock, h.base_version, h.numel, h.dtype, h.fingerprint, h.lr if h.HasField("lr") else None,
            _row_gradients(h, f"push from worker rank {h.rank}", detached(context)), h.compress, h.unused,
            tuple(h.unused_tables), h.incarnation,
        )
        try:
            # A worker's segment holds the shard's plain payload (its pulls use it too), or a compressed
            # push's where that is larger: see SameHost.segment_bytes.
            seg = self._shared_segment(context, h.rank, segment_bytes(h.numel, h.dtype, wire.nbytes))
        except BaseException:
            self.shard.release(grad, wire)  # never received: neither applied nor rejected
            raise
        return _Reserved(h, grad, wire, writer, seg)

    def _receive(
        self, r: _Reserved, context: grpc.ServicerContext, frames: Iterator[bytes] | None = None,
        inline: memoryview | None = None, hold: bool = True, method: str = "Push",
    ) -> pb.PushReply:
        """Receive a reserved push (its data frames, the inline bytes, or the segment the call
        names) and hand it to the shard; a failure gives the buffer back, nothing applied."""
        h, writer = r.header, r.writer
        what = f"push from worker rank {h.rank}"
        with contextlib.ExitStack() as pins:  # the published copy an in-place apply may be undone from
            try:
                if r.segment is not None:  # the gradient is in the worker's segment: feed it as if it had arrived
                    extra = next(frames, None) if frames is not None else inline
                    if extra:
                        raise InvalidRequestError(f"{what}: data in the call and a shared-memory segment")
                    # Applied in place only well within the caller's deadline: the worker waits meanwhile.
                    writer.may_borrow &= (context.time_remaining() or 60.0) > 4 * DEADLINE_MARGIN_S
                    if writer.may_borrow and self.publisher is not None and self.shard.may_check_as_applied():
                        writer.restore_from = pins.enter_context(self.publisher.pinned(writer.target))
                    writer.write_all(r.segment.payload[: r.wire.nbytes], self.config.chunk_bytes)
                elif frames is not None:
                    # From now on the push holds a receive buffer: the whole of it must arrive in time.
                    with self._timed(method, context, h.rank, r.wire.nbytes, lambda: writer.received):
                        write_frames(frames, writer, FrameParser(pb.PushFrame, what))
                else:
                    writer.write_all(inline if inline is not None else memoryview(b""), self.config.chunk_bytes)
            except BaseException:
                self._unreserve(r)
                raise
            result = self.shard.apply_push(h.rank, h.clock, h.base_version, r.grad, r.wire, r.wire.nbytes)
        # Acknowledged once the backup has it. A sync gradient buffered for the iteration's mean exists
        # here alone: with a backup, its push is answered once the iteration is complete and replicated
        # (retried on the backup if this server dies before); Step (hold=False) answers after its pull.
        self._acked(result.version + (hold and result.deferred), context)
        evicted, restored = self.shard.news(h.rank)
        return pb.PushReply(applied=result.applied, reason=result.reason, version=result.version,
                            staleness=result.staleness, deferred=result.deferred, lr=result.lr,
                            staleness_bound=result.bound, evicted=serde.evictions_to_proto(evicted),
                            restored_version=restored)

    def _unreserve(self, r: _Reserved) -> None:
        """A reserved push that will not be received: its buffer goes back, counted as rejected."""
        self.shard.release(r.grad, r.wire)
        self.shard.reject()

    @_edge
    def Push(self, frames: Iterator[bytes], context: grpc.ServicerContext) -> pb.PushReply:
        h = _header(frames, pb.PushFrame, "push")
        if h.skip:
            return self._skip(h, frames, context)
        r = self._reserve(h, context)
        return self._receive(r, context, frames=frames)

    def _skip(self, h: pb.PushHeader, frames: Iterator[bytes], context: grpc.ServicerContext) -> pb.PushReply:
        """A skip (ps.proto PushHeader.skip): the worker dropped its step at h.clock, which other
        shards applied; acknowledged unapplied (see Shard.skip_push), once the backup has it."""
        if next(frames, None) is not None:
            raise InvalidRequestError(f"a skip (worker rank {h.rank}, clock {h.clock}) carries no data")
        self.shard.serving()
        result = self.shard.skip_push(h.rank, h.clock, h.base_version, h.fingerprint, h.incarnation)
        self._acked(result.version, context)
        evicted, restored = self.shard.news(h.rank)
        return pb.PushReply(applied=False, reason=result.reason, version=result.version,
                            evicted=serde.evictions_to_proto(evicted), restored_version=restored)

    def PushGated(self, frames: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        """Push with a go-ahead (see ps.proto): `ready` once the buffer is reserved, then the
        frames are read and the reply sent."""
        try:
            r = self._reserve(_header(frames, pb.PushFrame, "push"), context)
        except PsgradError as exc:
            protocol.abort(context, exc)
            return
        try:
            yield _READY
        except BaseException:  # the call ended before the data came (cancelled, or shut down)
            self._unreserve(r)
            raise
        try:
            reply = self._receive(r, context, frames=frames, method="PushGated")
        except PsgradError as exc:
            protocol.abort(context, exc)
            return
        yield pb.PushProgress(reply=reply).SerializeToString()

    @_edge
    def Step(self, req: pb.StepRequest, context: grpc.ServicerContext) -> bytes:
        """Push, then pull for the next clock, in one unary call (see ps.proto). The reply is
        built by hand so the rows read and the weights are copied once, when it is joined (the
        weights, unless compressed, once before that: from the version's copy)."""
        h = req.push
        # (most steps read none: a forward's rows are read in place or ahead; nothing parsed then)
        reads = _reads(req.read_block, f"step of worker rank {h.rank}") if req.HasField("read_block") else []
        # checked before the push: a read refused then leaves the push unapplied
        read_bytes = self.shard.rows.check_reads(h.rank, h.fingerprint, reads) if reads else 0
        delta = req.delta if req.HasField("delta") else None
        if delta is not None:
            check_ask(delta, h.rank)
        # The weights go in the reply unless the worker's segment takes them (a compressed pull's payload
        # is built either way): their bytes count with the rows' (the rows were checked above; a reply
        # with the weights larger than the whole bound goes alone: see ReadLimit).
        dense = delta is not None or _metadata(context, shm.METADATA_KEY) is None
        if dense and self.shard.layout is not None:
            what, advice = f"the reply of a step of worker rank {h.rank}", DENSE_ADVICE
        else:
            what, advice = f"the rows of a step of worker rank {h.rank}", ROWS_ADVICE
        reserved = self._reserve(h, context)
        seg = reserved.segment
        pushed = self._receive(reserved, context, inline=memoryview(req.data), hold=False)
        version, frames = self._granted_pull(h.rank, h.clock + 1, h.fingerprint, context, observe=False)
        try:
            # The rows are read once the gate holds: in sync mode after this iteration's update. The
            # reply's bytes (its rows', and its weights' where they go in it) are taken of --max-read-mb
            # first, waiting for their turn, past the gate: what holds such bytes then waits for no other
            # worker (held at the gate, they could be what the step of the worker it waits for waits for).
            dense = delta is not None or seg is None or seg.window
            nbytes = read_bytes + (frames.nbytes if dense else 0)
            if nbytes:
                self._hold_read(context, nbytes, what, advice if dense else ROWS_ADVICE)
            got = self.shard.pull_rows(h.rank, h.fingerprint, reads, True) if reads else []  # (checked above)
            head, payload = (self._changed(h.rank, delta, version, frames) if delta is not None
                             else (self._pull_header(version, h.rank), None))
            rows = _rows_bytes([r for _, r in got])
            in_segment = self._rows_into_segment(context, h.rank, rows)
            reply: list[bytes | memoryview] = [pb.StepReply(push=pushed, pull=head, row_versions=[v for v, _ in got],
                                                            rows_in_segment=in_segment).SerializeToString()]
            if rows and not in_segment:
                reply += [bytes_field_prefix(STEP_REPLY_ROWS, sum(len(r) for r in rows)), *rows]
            nbytes = frames.nbytes if payload is None else len(payload)
            if seg is not None and payload is None and self._publish(context, h.rank, frames):
                return b"".join(reply)
            if seg is not None and not seg.window:  # (a window is the worker's gradient: never written)
                if payload is not None:
                    copy_bytes(seg.payload[:nbytes], payload)
                else:
                    frames.copy_into(seg.payload[:nbytes])
                return b"".join(reply)
            data: bytes | memoryview | bytearray
            if payload is None:
                data = bytearray(nbytes)
                frames.copy_into(memoryview(data))
            else:
                data = payload
            return b"".join([*reply, bytes_field_prefix(STEP_REPLY_DATA, nbytes), data])
        finally:
            frames.close()

    @_edge
    def Status(self, req: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        return serde.status_to_proto(self.shard.status(with_params=req.with_params))

    @_edge
    def Heartbeat(self, req: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatReply:
        self.shard.serving()
        version = self.shard.touch(req.rank, req.incarnation)
        if self._segments or self._row_segments:
            self._unmap_departed()  # every lease/3 from each live worker: departed ones go soon
        return pb.HeartbeatReply(version=version)

    @_edge
    def Rollback(self, req: pb.RollbackRequest, context: grpc.ServicerContext) -> pb.RollbackReply:
        self.shard.serving()
        if req.execute:
            version = self.shard.rollback(req.rank, req.fingerprint, req.version)
            self._acked(version, context)  # the backup has the rolled-back state too
            return pb.RollbackReply(version=version)
        version, points = self.shard.rollback_points(req.rank, req.fingerprint)
        return pb.RollbackReply(version=version, points=points)

    def _rows_into_segment(self, context: grpc.ServicerContext, rank: int, rows: Sequence[memoryview]) -> int:
        """Write a Step call's rows read into the worker's rows segment, where the call names one
        and they fit (same host: no bytes through gRPC); how many bytes were written (0: none,
        they go in the reply)."""
        total = sum(len(r) for r in rows)
        seg = self._rows_segment(context, rank) if total else None
        if seg is None or total > seg.nbytes:
            return 0
        at = 0
        for r in rows:
            copy_bytes(seg.payload[at:at + len(r)], r)
            at += len(r)
        return total

    def _weights_bytes(self) -> int:
        """The bytes of the shard's weights as a pull sends them (its wire dtype)."""
        layout = self.shard.layout
        assert layout is not None
        return layout.numel * torch_dtype(layout.spec.wire_dtype).itemsize

    @staticmethod
    def _weights_read(rank: int, observe: bool) -> str:
        return f"a pull of the weights ({'read-only, as ' if observe else ''}rank {rank})"

    def _hold_read(self, context: grpc.ServicerContext, nbytes: int, what: str, advice: str = ROWS_ADVICE) -> None:
        """Take nbytes of what the replies to reads may hold at once (--max-read-mb: see ReadLimit)
        until the call ends (its reply sent, or not), waiting for the read's turn until shortly
        before the call's deadline (or until it is cancelled). O(1) where it need not wait.

        Raises:
            InvalidRequestError: more than all of --max-read-mb.
            ServerBusyError: the deadline came first (the caller retries), or the call ended.
        """
        reads = self.shard.reads
        if reads.limit is not None:  # (no bound: the bytes are counted, nothing ever waits)
            context.add_callback(reads.wake)  # a cancelled read stops waiting at once
        remaining = context.time_remaining()
        timeout_s = None if remaining is None else max(0.0, remaining - DEADLINE_MARGIN_S)
        reads.acquire(nbytes, what, timeout_s, context.is_active, advice)
        if not context.add_callback(functools.partial(reads.release, nbytes)):
            reads.release(nbytes)
            raise errors.ServerBusyError(f"{what}: the call ended while it waited for its turn")

    @_edge
    def PullRows(self, req: pb.RowsRequest, context: grpc.ServicerContext) -> bytes:
        """A serialized RowsReply, built by hand so the rows are copied once, after the version;
        its bytes taken of --max-read-mb before it is built, until it was sent."""
        self.shard.serving()
        if req.updated:
            limit, nbytes = self.shard.rows.updated_page(req.rank, req.fingerprint, req.table, req.limit,
                                                          req.observe)
            self._hold_read(context, nbytes, f"a read of updated rows of table {req.table!r} (rank {req.rank})")
            # (at most `limit` rows, what was taken: as many as the request's limit, or the table's
            # rows, fewer, which ends the reader's pages as the request's own limit would)
            version, ids, rows = self.shard.updated_rows(req.rank, req.fingerprint, req.table, req.from_id, limit,
                                                         req.observe)
            return pb.RowsReply(version=version, rows=rows.numpy().tobytes(), ids=ids.numpy().tobytes()).SerializeToString()
        lookups = _reads(req.block, "pull of rows")
        nbytes = self.shard.rows.check_reads(req.rank, req.fingerprint, lookups, ids=False)
        self._hold_read(context, nbytes, f"a pull of rows (rank {req.rank})")
        got = self.shard.pull_rows(req.rank, req.fingerprint, lookups, observe=req.observe, sized=True)
        head = pb.RowsReply(versions=[v for v, _ in got]).SerializeToString()
        data = _rows_bytes([r for _, r in got])
        return b"".join((head, bytes_field_prefix(ROWS_REPLY_ROWS, sum(len(d) for d in data)), *data))

    @_edge
    def Leave(self, req: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveReply:
        self.shard.serving()
        self.shard.leave(req.rank, req.incarnation)
        self._unmap_departed()
        return pb.LeaveReply()


def _not_lent(context: grpc.ServicerContext, why: str) -> None:
    """Refuse a pull that names the worker's gradient window (never written) and could not be lent
    a version: the worker pulls through frames instead (see SharedMemoryTransport.pull)."""
    context.set_trailing_metadata(((shm.METADATA_KEY, shm.NOT_LENT),))
    context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
