"""A shard client's same-host payloads, a collaborator it holds: its shared-memory segment (pushes read
in place, pulls copied in), published weight versions read zero-copy from the server's ring, and the
fallbacks to the client's gRPC frames."""
from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from typing import Protocol

import grpc
import torch

from psgrad.client import reconnect
from psgrad.config import ClientConfig
from psgrad.core.codecs import WireBuffer, copy_bytes, copy_from_wire, segment_bytes
from psgrad.errors import InvalidRequestError
from psgrad.proto import ps_pb2 as pb
from psgrad.wire import published, shm
from psgrad.wire.protocol import ERROR_METADATA_KEY


def _address(view: memoryview) -> int:
    import numpy as np

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


class _Client(Protocol):
    """What the same-host path uses of its shard client: where it calls, its frames path (the
    fallback) and the header checks, and the calls that carry a header alone."""

    config: ClientConfig
    address: str
    _pull_header_only: grpc.UnaryUnaryMultiCallable
    _push_header_only: grpc.UnaryUnaryMultiCallable
    _step: grpc.UnaryUnaryMultiCallable

    def diagnose(self) -> str: ...

    def pull_frames(self, req: pb.PullRequest, dest: torch.Tensor, wire: WireBuffer) -> int: ...

    def push_frames(self, header: pb.PushHeader, payload: memoryview) -> pb.PushReply: ...

    def pull_header(self, first: bytes | None, dest: torch.Tensor, wire: WireBuffer) -> pb.PullHeader: ...

    def check_pull_header(self, header: pb.PullHeader, dest: torch.Tensor, wire: WireBuffer) -> pb.PullHeader: ...


class SameHost:
    """A shard client's same-host path (a collaborator it holds): the segment, the published
    versions, and the calls that use them; each falls back to the client's gRPC frames.

    Zero-copy pull (`pull(..., published=True)`): the server lends a slot of its ring that holds
    the version, and `view` is then a float32 tensor of that slot (dest is not written); it stays
    valid until this client's next pull of the shard (the server never rewrites a leased slot).
    Zero-copy push: `lend_window()` makes this shard's range of the caller's gradient buffer (a
    shared segment) its segment, and a push whose payload is that range is not copied. A failed
    call retires the segment (the server may still read it); the caller's buffer then stays valid
    memory, and later pushes copy it into a segment of this shard's own."""

    def __init__(self, client: _Client, usable: bool) -> None:
        self._client = client
        self.usable = usable  # this worker may use shared memory (it is on, and the host has it)
        self.server_shm = False  # the server said at Join that it takes shared-memory payloads
        self.segment: shm.AnySegment | None = None
        self._segment_guard = threading.Lock()
        self.view: torch.Tensor | None = None
        self._ring: published.RingView | None = None
        self._slot_views: dict[int, torch.Tensor] = {}
        self._published_ok = True

    @property
    def active(self) -> bool:
        """Whether payloads go through shared memory (the server said at Join that it shares this
        host and takes segments, and this worker may use them), not gRPC frames."""
        return self.usable and self.server_shm

    def close(self) -> None:
        with self._segment_guard:
            seg, self.segment = self.segment, None
        if seg is not None:
            seg.close()

    def forget_ring(self) -> None:
        """Map the server's ring afresh at its next lend (views already handed out keep theirs)."""
        self._ring = None
        self._slot_views = {}

    def take_segment(self, nbytes: int) -> shm.AnySegment | None:
        """This shard's shared-memory segment, locked for one transfer; None: use gRPC frames
        (another host, or the segment is busy with a concurrent transfer)."""
        if not self.active or nbytes == 0:
            return None
        with self._segment_guard:
            seg = self.segment
            if seg is None or seg.nbytes != nbytes:
                if seg is not None:
                    seg.close()
                try:
                    seg = self.segment = shm.Segment(nbytes)
                except OSError:
                    self.usable = False
                    return None
            return seg if seg.lock.acquire(blocking=False) else None

    def _drop_segment(self, seg: shm.AnySegment, for_good: bool = False) -> None:
        """Never write this segment again (the server may still read it, or cannot open it)."""
        with self._segment_guard:
            if self.segment is seg:
                self.segment = None
            if for_good:
                self.usable = False
        seg.close()

    def lend_window(self, window: shm.Window) -> bool:
        """Make `window` (this shard's range of the caller's gradient buffer, a shared segment: see
        ParameterClient.gradient_buffer) this shard's segment: pushes of it are read in place.
        Pulls that do not ask for a lent version then use frames; one that asks and finds no free
        slot in the server's ring (more workers than num_workers) gets the weights copied into it,
        after its push was read (a step's gradient is consumed). False (the window is retired):
        another host, or a transfer is using the segment now; this shard's part is then copied."""
        if not self.active:
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

    def _adopt(self, call: grpc.Call, dest: torch.Tensor, wire: WireBuffer, want: bool) -> bool:
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

    def pull(self, req: pb.PullRequest, dest: torch.Tensor, wire: WireBuffer, want: bool) -> int | None:
        """A same-host pull: the server lends a slot of its ring (want, see _adopt), or copies the
        weights into this shard's segment, and answers with the header alone. None when this
        shard's payloads go through gRPC frames (another host, or the segment is busy)."""
        seg = self.take_segment(wire.nbytes)
        if seg is None:
            return None
        if seg.lent and not want:  # the caller's gradient: a pull that may not be lent a slot uses frames
            seg.lock.release()
            return None
        t = self._client.config.rpc_timeout_s
        try:
            first, call = self._client._pull_header_only.with_call(req, timeout=t, metadata=self._pull_metadata(seg, want))
        except grpc.RpcError as exc:
            if self._shared_failed(seg, exc):
                return self._client.pull_frames(req, dest, wire)
            raise reconnect.as_error(exc, self._client.address, self._client.diagnose, "the pull", t) from None
        try:
            header = self._client.pull_header(first, dest, wire)
            try:
                lent = self._adopt(call, dest, wire, want)
            except shm.SharedMemoryUnavailable:
                self._published_ok = False
                return self._client.pull_frames(req, dest, wire)
            if not lent:
                copy_from_wire(dest, seg.payload[: wire.nbytes], wire)
            seg.unlink()  # the server has it open
        finally:
            seg.lock.release()
        return int(header.version)

    def push(self, header: pb.PushHeader, payload: memoryview) -> pb.PushReply | None:
        """A same-host push: the gradient goes into this shard's segment (unless it is there
        already, see gradient_buffer), the call carries the header alone. None when this shard's
        payloads go through gRPC frames (see _pull_shared)."""
        seg = self.take_segment(segment_bytes(header.numel, header.dtype, len(payload)))
        if seg is None:
            return None
        t = self._client.config.rpc_timeout_s
        try:
            if _address(payload) != _address(seg.payload):
                copy_bytes(seg.payload[: len(payload)], payload)
            frame = pb.PushFrame(header=header).SerializeToString()
            reply: pb.PushReply = self._client._push_header_only(frame, timeout=t, metadata=seg.metadata())
        except grpc.RpcError as exc:
            if self._shared_failed(seg, exc):
                return self._client.push_frames(header, payload)  # keyed: a retry is never applied twice
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
        trailing = tuple(exc.trailing_metadata() or ()) if isinstance(exc, grpc.Call) else ()
        refused = (shm.METADATA_KEY, shm.REFUSED) in trailing
        if refused or not any(key == ERROR_METADATA_KEY for key, _ in trailing):
            # Refused, or the call ended without the server's answer, which may still be using
            # the segment: never write it again. A restarted server can no longer open a name
            # unlinked after first use, so a fresh segment may work next time; one that the
            # server never opened will not (another host, another /dev/shm).
            self._drop_segment(seg, for_good=refused and not seg.opened)
        seg.lock.release()
        return refused or (isinstance(exc, grpc.Call) and exc.code() in reconnect.RETRYABLE and self._client.config.reconnect_timeout_s > 0)

    def step(
        self, seg: shm.AnySegment, header: pb.PushHeader, payload: memoryview, dest: torch.Tensor, wire: WireBuffer,
        want: bool = False, reads: Sequence[pb.TableRows] = (),
    ) -> tuple[pb.PushReply, int, pb.StepReply] | None:
        """step() through the segment: the gradient goes in, the weights come back in it (or in a
        lent slot: want, see _adopt); the rows `reads` names come back in the reply (returned last)."""
        t = self._client.config.rpc_timeout_s
        try:
            if _address(payload) != _address(seg.payload):
                copy_bytes(seg.payload[: len(payload)], payload)
            request = pb.StepRequest(push=header, pull_rows=reads).SerializeToString()
            reply, call = self._client._step.with_call(request, timeout=t, metadata=self._pull_metadata(seg, want))
        except grpc.RpcError as exc:
            if self._shared_failed(seg, exc):
                return None  # push and pull through frames instead (a keyed push is never applied twice)
            raise reconnect.as_error(exc, self._client.address, self._client.diagnose, "the push and pull", t) from None
        except BaseException:
            seg.lock.release()
            raise
        try:
            self._client.check_pull_header(reply.pull, dest, wire)
            try:
                lent = self._adopt(call, dest, wire, want)
            except shm.SharedMemoryUnavailable:
                self._published_ok = False
                lent = False
                self.view = None
                return reply.push, self._client.pull_frames(pb.PullRequest(
                    rank=header.rank, clock=header.clock + 1, fingerprint=header.fingerprint), dest, wire), reply
            if not lent:
                copy_from_wire(dest, seg.payload[: wire.nbytes], wire)
            seg.unlink()  # the server has it open
        finally:
            seg.lock.release()
        return reply.push, int(reply.pull.version), reply
