"""How a shard's payloads travel: the interface (Transport) a shard client's pulls, pushes and Step
calls go through, and the checks of what comes back that every transport makes.

A shard client holds one transport at a time, picked when the server answers Join
(ShardClient._pick): FramesTransport (client/shard_client.py), the payloads in gRPC frames or
inline in a Step call; or SharedMemoryTransport (client/same_host.py), when the server says it
shares this host and takes shared-memory segments and this worker may use them (ClientConfig
shared_memory): the payloads in a segment, the calls carrying headers alone. It is picked again
only when a Join answers differently (a failover or a rejoin to another server), and the client
switches to frames for good once shared memory is refused for good. The shared-memory transport
holds the frames transport as its fallback for a single transfer (its segment busy with another
transfer, or a call refused or worth a retry): an explicit collaborator, not a chain of checks."""
from __future__ import annotations

from collections.abc import Generator
from typing import Protocol

import torch

from psgrad.client.delta_wire import DeltaWire
from psgrad.core.codecs import WireBuffer
from psgrad.errors import InvalidRequestError
from psgrad.proto import ps_pb2 as pb
from psgrad.wire import local_socket, shm
from psgrad.wire.frames import PushHead
from psgrad.wire.rows import RowBlock

# Rows read from a shard: each table's version, and the rows' float32 bytes, table after table
RowsRead = tuple[list[int], memoryview]
# What a Step call returns: the push's reply, the version pulled, the rows read (None: none asked for)
Stepped = tuple[pb.PushReply, int, RowsRead | None]


class Transport(Protocol):
    """One shard's payload calls. Methods raise PsgradError subclasses, never grpc.RpcError; retries
    are safe (pushes are keyed by (rank, clock), never applied twice)."""

    name: str  # "grpc" (frames) or "shm" (shared memory), as ParameterClient.transports() says
    # After a pull or step with published=True: the weights as a float32 tensor of the version the
    # server lent (valid until this shard's next pull), or None where they were written into dest.
    view: torch.Tensor | None
    # The server's socket its Step calls go over where it offers one (and, where it takes them, the
    # shard client's reads of rows: local_socket.Offered.read, or .reading in stages)
    socket: local_socket.Offered

    def pull(self, req: pb.PullRequest, dest: torch.Tensor, wire: WireBuffer, published: bool = False) -> int:
        """Pull the shard's weights into dest (float32 slice of the flat space), or with published
        (same host) into `view` where the server lends a slot; returns their version."""
        ...

    def push(self, head: PushHead, payload: memoryview) -> pb.PushReply:
        """Push one gradient slice (already in the wire dtype) and the row gradients head carries."""
        ...

    def stepping(
        self, head: PushHead, payload: memoryview, dest: torch.Tensor, wire: WireBuffer, published: bool = False,
        reads: RowBlock | None = None,
    ) -> Generator[None, None, Stepped | None]:
        """Push as head.header.clock, then pull its clock + 1 into dest (or `view`, see pull) and the
        rows `reads` names, in one Step call, as a generator that returns (the push's reply, the
        version pulled, the rows read); None when a Step call does not fit (frames: a payload over
        one chunk) or the call should be redone (shared memory refused): then push and pull
        separately. Where `staged`, it yields once the request is sent, before its reply is read,
        so that one thread sends every shard's Step call before it waits for any answer; elsewhere
        it runs the whole call before it returns (no yield)."""
        ...

    @property
    def staged(self) -> bool:
        """Whether stepping() yields while the server works (a Step call over a same-host server's
        local socket); False: a caller that wants the shards' calls at once runs them on threads."""
        ...

    def lend_window(self, window: shm.Window) -> bool:
        """Make `window` (this shard's range of the caller's gradient buffer) the segment pushes of
        it are read from in place; False (the window is retired): this transport cannot."""
        ...

    def forget_ring(self) -> None:
        """Map the server's ring of published versions afresh at its next lend."""
        ...

    def close(self) -> None: ...


def check_pull_header(address: str, header: pb.PullHeader, dest: torch.Tensor, wire: WireBuffer) -> pb.PullHeader:
    """The header of pulled weights, checked against what dest expects (and handed to a compressed
    pull's buffer, which then knows what the payload is: see DeltaWire)."""
    if header.numel != dest.numel() or header.dtype != wire.dtype_name:
        raise InvalidRequestError(
            f"server {address}: pull sends {header.numel} {header.dtype} values, "
            f"expected {dest.numel()} {wire.dtype_name}"
        )
    if isinstance(wire, DeltaWire):
        try:
            wire.expect(header.compress, header.copy, header.drift)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"server {address}: {exc}") from None
    elif header.compress:
        raise InvalidRequestError(f"server {address}: a pull compressed {header.compress}, which this worker "
                                  "did not ask for")
    return header


def asking(req: pb.PullRequest, wire: WireBuffer) -> pb.PullRequest:
    """The pull request a pull into `wire` sends: req, with a compressed pull's ask (DeltaWire)."""
    if not isinstance(wire, DeltaWire) or req.observe:
        return req
    out = pb.PullRequest()
    out.CopyFrom(req)
    out.delta.CopyFrom(wire.ask())
    return out


def step_request(reads: RowBlock | None, wire: WireBuffer) -> pb.StepRequest:
    """A Step request's pull part (the push goes in by PushHead.step_request): the rows `reads`
    names, and a compressed pull's ask where `wire` is one (DeltaWire)."""
    req = pb.StepRequest(read_block=reads.message()) if reads else pb.StepRequest()
    if isinstance(wire, DeltaWire):
        req.delta.CopyFrom(wire.ask())
    return req


def pull_header(address: str, first: bytes | None, dest: torch.Tensor, wire: WireBuffer) -> pb.PullHeader:
    """The header frame of a pull, parsed and checked."""
    if first is None:
        raise InvalidRequestError(f"server {address}: pull returned no header")
    return check_pull_header(address, pb.PullFrame.FromString(first).header, dest, wire)


def checked_rows(address: str, versions: list[int], rows: memoryview, tables: int, what: str) -> RowsRead:
    if len(versions) != tables:
        raise InvalidRequestError(f"server {address}: {what} returned the versions of {len(versions)} "
                                  f"tables for {tables} asked for")
    return versions, rows


def rows_read(address: str, reply: pb.StepReply, reads: RowBlock | None) -> RowsRead | None:
    """The rows a Step reply carries for `reads` (None: none asked for)."""
    if not reads:
        return None
    return checked_rows(address, list(reply.row_versions), memoryview(reply.rows), len(reads.tables), "step")

