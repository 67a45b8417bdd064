"""The shared-memory transport (see client/transport.py): a shard client's payloads through its
shared-memory segment (pushes read in place, pulls copied in), published weight versions read
zero-copy from the server's ring, and the frames transport it hands a single transfer to when
shared memory cannot take it."""
from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Generator
from typing import Protocol

import grpc
import torch

from psgrad.client import reconnect
from psgrad.client.transport import (
    RowsRead, Stepped, Transport, asking, check_pull_header, checked_rows, pull_header, step_request,
)
from psgrad.config import ClientConfig
from psgrad.core.codecs import WireBuffer, copy_bytes, segment_bytes
from psgrad.errors import InvalidRequestError
from psgrad.proto import ps_pb2 as pb
from psgrad.wire import local_socket, published, shm
from psgrad.wire.frames import PushHead
from psgrad.wire.rows import RowBlock
from psgrad.wire.protocol import ERROR_METADATA_KEY


def _address(view: memoryview) -> int:
    import numpy as np

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


# Replies in a row that bring their rows inline although a rows segment large enough was named (the
# server could not open it) before this worker stops making rows segments for the shard.
_ROWS_SEGMENT_TRIES = 3


class _Client(Protocol):
    """What the shared-memory transport uses of its shard client: where it calls, the explanation
    of a deadline, and the calls that carry a header alone (bound to the server in use)."""

    config: ClientConfig
    address: str
    _pull_header_only: grpc.UnaryUnaryMultiCallable
    _push_header_only: grpc.UnaryUnaryMultiCallable
    _step: grpc.UnaryUnaryMultiCallable

    def diagnose(self) -> str: ...

    def heard(self, header: pb.PullHeader) -> pb.PullHeader: ...


class SharedMemoryTransport:
    """A shard client's payloads through shared memory (the Transport it picks when the server said
    at Join that it shares this host and takes segments): the segment, the published versions, and
    the calls that use them. A transfer that shared memory cannot take (the segment busy with a
    concurrent transfer, a call refused or worth a retry) goes through `frames`, the frames
    transport it holds; once shared memory is refused for good (this host cannot make a segment, or
    the server can never open this worker's), it calls `refused` and the client uses frames.

    Zero-copy pull (`pull(..., published=True)`): the server lends a slot of its ring that holds
    the version, and `view` is then a float32 tensor of that slot (dest is not written); it stays
    valid until this client's next pull of the shard (the server never rewrites a leased slot).
    Zero-copy push: `lend_window()` makes this shard's range of the caller's gradient buffer (a
    shared segment) its segment, and a push whose payload is that range is not copied. A failed
    call retires the segment (the server may still read it); the caller's buffer then stays valid
    memory, and later pushes copy it into a segment of this shard's own."""

    name = "shm"

    def __init__(self, client: _Client, frames: Transport, refused: Callable[[], None]) -> None:
        self._client = client
        self.frames = frames  # a single transfer shared memory cannot take goes this way
        self._refused = refused  # shared memory refused for good: the client switches to frames
        self.usable = True  # until refused for good (then every transfer goes through frames)
        self.segment: shm.AnySegment | None = None
        self._segment_guard = threading.Lock()
        self.view: torch.Tensor | None = None
        self._ring: published.RingView | None = None
        self._slot_views: dict[int, torch.Tensor] = {}
        self._published_ok = True
        # The rows a Step call reads come back in this segment (sized by the rows that came back
        # in replies before), not through gRPC; used under the segment's lock, as Step calls are.
        self._rows_segment: shm.Segment | None = None
        self._rows_misses = 0  # replies in a row that brought rows inline though they fit the segment named
        self.rows_through_segment = 0  # Step replies whose rows came through it
        # Step calls over the server's local socket (wire/local_socket.py), where the last Join offered it.
        self.socket = local_socket.Offered(lambda offer: local_socket.LocalChannel(*offer))

    def close(self) -> None:
        with self._segment_guard:
            seg, self.segment = self.segment, None
        if seg is not None:
            seg.close()
        self._drop_rows_segment()
        self.socket.set(None)

    @property
    def staged(self) -> bool:
        """Whether stepping() yields between sending its request and reading the reply: its Step
        calls go over the server's local socket (one is offered)."""
        return self.socket.staged

    def _step_calling(self, head: PushHead, pull: pb.StepRequest, timeout_s: float,
                      metadata: tuple[tuple[str, str], ...]
                      ) -> Generator[None, None, tuple[pb.StepReply, grpc.Call | local_socket.LocalCall]]:
        """The Step call of the push `head` (its payload in the segment) and the pull part `pull`:
        over the local socket where there is one (yielding once the request is sent: see
        stepping), else through gRPC (no yield).

        Raises:
            local_socket.ChannelLost: the socket's connection failed during the call (given up
                until a Join offers a socket again; the server may or may not have the call).
        """
        channel = self.socket.channel()
        if self.socket.failed is not None:
            warnings.warn(f"server {self._client.address}: {self.socket.failed}; Step calls go through gRPC",
                          stacklevel=4)
            self.socket.failed = None
        if channel is None:
            reply, call = self._client._step.with_call(head.step_request(pull, None), timeout=timeout_s,
                                                       metadata=metadata)
            return reply, call
        pieces, detached = head.step_socket_request(pull, None)
        done: tuple[pb.StepReply, local_socket.LocalCall] = yield from self.socket.calling(
            channel, pieces, timeout_s, metadata + detached)
        return done

    def _drop_rows_segment(self) -> None:
        """Never name the rows segment again (a call that failed may still have it written)."""
        rows, self._rows_segment = self._rows_segment, None
        if rows is not None:
            rows.close()

    def _rows_metadata(self, reads: RowBlock | None) -> tuple[tuple[str, str], ...]:
        rows = self._rows_segment if reads else None
        return rows.metadata(shm.ROWS_METADATA_KEY) if rows is not None else ()

    def _rows_read(self, reply: pb.StepReply, reads: RowBlock | None) -> RowsRead | None:
        """The rows a Step reply brought, in the rows segment (a view of it, valid until this
        shard's next call: the exchange places them before it returns) or in the reply; a segment
        is made or grown for the next call from what came inline."""
        if not reads:
            return None
        address, segment, n = self._client.address, self._rows_segment, reply.rows_in_segment
        if n:
            if segment is None or n > segment.nbytes:
                raise InvalidRequestError(f"server {address}: sent {n} bytes of rows in a segment this worker did not offer")
            rows = segment.payload[:n]  # (a view: the rows are placed from it before this shard's next call writes it)
            segment.unlink()  # the server has it open
            self.rows_through_segment += 1
            self._rows_misses = 0  # (a restarted server opens the fresh segment made after its miss)
        else:
            rows = memoryview(reply.rows)
            if len(rows):  # a fresh segment for the next call, twice as large as these rows
                if segment is not None and len(rows) <= segment.nbytes:
                    self._rows_misses += 1  # named and large enough, yet inline: the server could not open it
                self._drop_rows_segment()
                if self._rows_misses < _ROWS_SEGMENT_TRIES:
                    try:
                        self._rows_segment = shm.Segment(max(2 * len(rows), 1 << 16))
                    except OSError:  # this host cannot make one: the rows stay in the replies
                        self._rows_misses = _ROWS_SEGMENT_TRIES
        return checked_rows(address, list(reply.row_versions), rows, len(reads.tables), "step")

    def forget_ring(self) -> None:
        """Map the server's ring afresh at its next lend (views already handed out keep theirs)."""
        self._ring = None
        self._slot_views = {}

    def take_segment(self, nbytes: int) -> shm.AnySegment | None:
        """This shard's shared-memory segment, locked for one transfer; None: this transfer goes
        through frames (the segment is busy with a concurrent transfer, no payload, or shared
        memory was refused for good)."""
        if not self.usable or nbytes == 0:
            return None
        with self._segment_guard:
            seg = self.segment
            if seg is None or seg.nbytes != nbytes:
                if seg is not None:
                    seg.close()
                try:
                    seg = self.segment = shm.Segment(nbytes)
                except OSError:  # this host cannot make a segment
                    self.usable = False
            if self.usable:
                return seg if seg is not None and seg.lock.acquire(blocking=False) else None
        self._refused()
        return None

    def _drop_segment(self, seg: shm.AnySegment, for_good: bool = False) -> None:
        """Never write this segment again (the server may still read it, or cannot open it)."""
        with self._segment_guard:
            if self.segment is seg:
                self.segment = None
            if for_good:
                self.usable = False
        seg.close()
        if for_good:
            self._refused()

    def lend_window(self, window: shm.Window) -> bool:
        """Make `window` (this shard's range of the caller's gradient buffer, a shared segment: see
        ParameterClient.gradient_buffer) this shard's segment: pushes of it are read in place.
        No call writes it: pulls that are not lent a version (no free slot in the server's ring:
        more workers than num_workers) use frames, and a Step call's weights then come back in
        its reply. False (the window is retired):
        shared memory was refused, or a transfer is using the segment now; this shard's part is
        then copied."""
        if not self.usable:
            window.close()
            return False
        with self._segment_guard:
            old = self.segment
            if old is not None and not old.lock.acquire(blocking=False):
                window.close()
                return False
            if old is not None:
                old.lock.release()
                old.close()
            self.segment = window
        return True

    def _pull_metadata(self, seg: shm.AnySegment, want: bool) -> tuple[tuple[str, str], ...]:
        return seg.metadata() + (published.request() if want and self._published_ok else ())

    def _adopt(self, call: grpc.Call | local_socket.LocalCall, dest: torch.Tensor, wire: WireBuffer, want: bool) -> bool:
        """Take the slot the server lent (trailing metadata) as the weights; False: it lent none
        (the weights are in the segment)."""
        self.view = None
        answer = published.answer_in(call.trailing_metadata()) if want else None
        if answer is None:
            return False
        name, nonce, size, slots, index = published.parse_answer(answer)
        if size != wire.nbytes or wire.dtype_name != "float32":
            raise InvalidRequestError(f"server {self._client.address}: lent a slot of {size} bytes, expected {wire.nbytes}")
        if self._ring is None or self._ring.name != name:
            self._ring = published.RingView(name, nonce, size, slots)  # former views keep their mapping
            self._slot_views = {}
        view = self._slot_views.get(index)
        if view is None:
            with warnings.catch_warnings():  # (a private mapping: a write stays in this process)
                warnings.simplefilter("ignore", UserWarning)
                view = self._slot_views[index] = torch.frombuffer(self._ring.slot(index), dtype=torch.float32)
        self.view = view
        return True

    def pull(self, req: pb.PullRequest, dest: torch.Tensor, wire: WireBuffer, published: bool = False) -> int:
        """A same-host pull: the server lends a slot of its ring (published, see _adopt), or copies
        the weights into this shard's segment, and answers with the header alone. Through frames
        when the segment is busy, or is the caller's gradient and no lent version is asked for."""
        self.view = None
        req = asking(req, wire)
        seg = self.take_segment(wire.nbytes)
        if seg is None:
            return self.frames.pull(req, dest, wire)
        if seg.lent and not published:  # the caller's gradient: a pull that may not be lent a slot uses frames
            seg.lock.release()
            return self.frames.pull(req, dest, wire)
        t = self._client.config.rpc_timeout_s
        try:
            first, call = self._client._pull_header_only.with_call(
                req, timeout=t, metadata=self._pull_metadata(seg, published))
        except grpc.RpcError as exc:
            if seg.lent and (shm.METADATA_KEY, shm.NOT_LENT) in _trailing(exc):
                seg.lock.release()  # no slot to lend: the weights come through frames, never into the gradient
                return self.frames.pull(req, dest, wire)
            if self._shared_failed(seg, exc):
                return self.frames.pull(req, dest, wire)
            raise reconnect.as_error(exc, self._client.address, self._client.diagnose, "the pull", t) from None
        try:
            header = self._client.heard(pull_header(self._client.address, first, dest, wire))
            try:
                lent = self._adopt(call, dest, wire, published)
            except shm.SharedMemoryUnavailable:
                self._published_ok = False
                return self.frames.pull(req, dest, wire)
            if not lent:
                wire.load(dest, seg.payload[: wire.nbytes])
            seg.unlink()  # the server has it open
        finally:
            seg.lock.release()
        return int(header.version)

    def push(self, head: PushHead, payload: memoryview) -> pb.PushReply:
        """A same-host push: the gradient goes into this shard's segment (unless it is there
        already, see lend_window), the call carries the header alone. Through frames when the
        segment is busy, or the call was refused or is worth a retry."""
        seg = self.take_segment(segment_bytes(head.header.numel, head.header.dtype, len(payload)))
        if seg is None:
            return self.frames.push(head, payload)
        t = self._client.config.rpc_timeout_s
        try:
            if _address(payload) != _address(seg.payload):
                copy_bytes(seg.payload[: len(payload)], payload)
            reply: pb.PushReply = self._client._push_header_only(head.frame(), timeout=t, metadata=seg.metadata())
        except grpc.RpcError as exc:
            if self._shared_failed(seg, exc):
                return self.frames.push(head, payload)  # keyed: a retry is never applied twice
            raise reconnect.as_error(exc, self._client.address, self._client.diagnose, "the push", t) from None
        except BaseException:
            seg.lock.release()
            raise
        seg.unlink()  # the server has it open
        seg.lock.release()
        return reply

    def _shared_failed(self, seg: shm.AnySegment, exc: grpc.RpcError) -> bool:
        """A same-host call failed: retire its segment (the server may still be using it), and say
        whether the transfer should be redone through frames (refused, or worth a retry)."""
        trailing = _trailing(exc)
        refused = (shm.METADATA_KEY, shm.REFUSED) in trailing
        if refused or not any(key == ERROR_METADATA_KEY for key, _ in trailing):
            # Refused, or the call ended without the server's answer, which may still be using
            # the segment: never write it again. A restarted server can no longer open a name
            # unlinked after first use, so a fresh segment may work next time; one that the
            # server never opened will not (another host, another /dev/shm).
            self._drop_segment(seg, for_good=refused and not seg.opened)
        seg.lock.release()
        config = self._client.config
        return refused or (config.reconnect_timeout_s > 0 and reconnect.worth_retrying(exc, config, self._client.diagnose))

    def stepping(
        self, head: PushHead, payload: memoryview, dest: torch.Tensor, wire: WireBuffer, published: bool = False,
        reads: RowBlock | None = None,
    ) -> Generator[None, None, Stepped | None]:
        """The Step call through the segment: the gradient goes in, the weights come back in it (or
        in a lent slot: published, see _adopt); the rows `reads` names come back in the reply. The
        frames transport's Step call when the segment is busy; None (push and pull separately)
        when the call was refused or is worth a retry, or the local socket it went over broke.
        Over the server's local socket where the Join answer offered one (_step_calling): it then
        yields once the request went out, before the reply is read (through gRPC or frames it runs
        whole, no yield)."""
        self.view = None
        header = head.header
        seg = self.take_segment(segment_bytes(header.numel, header.dtype, len(payload)))
        if seg is None:
            return (yield from self.frames.stepping(head, payload, dest, wire, published, reads))
        t = self._client.config.rpc_timeout_s
        try:
            if _address(payload) != _address(seg.payload):
                copy_bytes(seg.payload[: len(payload)], payload)
            try:
                reply, call = yield from self._step_calling(
                    head, step_request(reads, wire), t, self._pull_metadata(seg, published) + self._rows_metadata(reads))
            except (local_socket.ChannelLost, GeneratorExit) as exc:  # the server may still write the segments: never again
                self._drop_rows_segment()
                self._drop_segment(seg)
                if isinstance(exc, GeneratorExit):
                    raise  # (the lock is released below)
                seg.lock.release()
                return None  # push and pull through gRPC instead (a keyed push is never applied twice)
        except grpc.RpcError as exc:
            self._drop_rows_segment()  # (the server may still write it)
            if self._shared_failed(seg, exc):
                return None  # push and pull through frames instead (a keyed push is never applied twice)
            raise reconnect.as_error(exc, self._client.address, self._client.diagnose, "the push and pull", t) from None
        except BaseException:
            seg.lock.release()
            raise
        try:
            got = self._rows_read(reply, reads)
            self._client.heard(check_pull_header(self._client.address, reply.pull, dest, wire))
            try:
                lent = self._adopt(call, dest, wire, published)
            except shm.SharedMemoryUnavailable:
                self._published_ok = False
                self.view = None
                after = pb.PullRequest(rank=header.rank, clock=header.clock + 1, fingerprint=header.fingerprint)
                return reply.push, self.frames.pull(after, dest, wire), got
            if not lent:  # in the segment, or in the reply where the segment is the caller's gradient
                if seg.lent and len(reply.data) != wire.nbytes:
                    raise InvalidRequestError(f"server {self._client.address}: a step reply of {len(reply.data)} "
                                              f"bytes of weights, expected {wire.nbytes}")
                wire.load(dest, memoryview(reply.data) if seg.lent else seg.payload[: wire.nbytes])
            seg.unlink()  # the server has it open
        finally:
            seg.lock.release()
        return reply.push, int(reply.pull.version), got


def _trailing(exc: grpc.RpcError) -> tuple[tuple[str, str], ...]:
    """A failed call's trailing metadata (none where it never reached a server)."""
    return tuple(exc.trailing_metadata() or ()) if isinstance(exc, grpc.Call) else ()
