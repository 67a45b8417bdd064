"""Payload frames: tensor bytes chunked into ``XFrame{bytes data = 2}`` messages built and parsed by
hand, and writers that reassemble them; pure, no network.

A payload frame is the protobuf encoding of ``XFrame{bytes data = 2}``: one tag byte (0x12),
a varint length, then raw little-endian bytes. Building and parsing that prefix by hand lets
tensor bytes go straight between torch memory and gRPC's ``bytes`` without passing through a
protobuf object (which would copy them twice more), while the wire stays exactly what
``protos/psgrad/proto/ps.proto`` says.

A push's header goes the same way (PushHead): its rows' ids and gradients (one block of all its
tables) are joined straight into the header frame or the Step request, copied once.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError

from psgrad.config import DEFAULT_CHUNK_BYTES
from psgrad.core.codecs import byte_view
from psgrad.errors import InvalidRequestError
from psgrad.proto import ps_pb2 as pb
from psgrad.wire.rows import RowBlock

_DATA_TAG = 0x12  # field 2, wire type 2 (length-delimited)


_SMALL_VARINTS = tuple(bytes((n,)) for n in range(0x80))  # (tags, and most lengths of a header's fields)


def _varint(n: int) -> bytes:
    if 0 <= n < 0x80:
        return _SMALL_VARINTS[n]
    out = bytearray()
    while True:
        low = n & 0x7F
        n >>= 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


@functools.lru_cache(maxsize=64)
def _data_prefix(length: int) -> bytes:
    return bytes((_DATA_TAG,)) + _varint(length)


def bytes_field_prefix(number: int, length: int) -> bytes:
    """Tag and length of a `bytes` field `number` holding length bytes: followed by those bytes
    and appended to a serialized message, it sets that field (protobuf allows any field order)."""
    return _varint(number << 3 | 2) + _varint(length)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    """The varint at pos and the position after it (ValueError past the end or after 10 bytes)."""
    value = shift = 0
    for i in range(pos, min(pos + 10, len(buf))):
        byte = buf[i]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i + 1
        shift += 7
    raise ValueError("truncated varint")


def trailing_bytes_field(message: bytes | bytearray | memoryview, number: int) -> tuple[memoryview, memoryview] | None:
    """(the fields before it, its bytes) where a serialized message ends with the `bytes` field
    `number` (as one built with bytes_field_prefix does), views, no copy; None when it does not, or
    the bytes are not a message (parse it with protobuf)."""
    view = memoryview(message)
    pos = 0
    try:
        while pos < len(view):
            start = pos
            tag, pos = _read_varint(view, pos)
            kind = tag & 7
            if kind == 0:
                _, pos = _read_varint(view, pos)
            elif kind == 1:
                pos += 8
            elif kind == 5:
                pos += 4
            elif kind == 2:
                length, pos = _read_varint(view, pos)
                if tag >> 3 == number and pos + length == len(view):
                    return view[:start], view[pos:]
                pos += length
            else:
                return None
    except ValueError:
        return None
    return None


def data_frame(piece: memoryview) -> bytes:
    """One ``data`` frame holding piece: the tag and length prefix and the bytes, copied once."""
    return b"".join((_data_prefix(len(piece)), piece))


def data_frames(payload: memoryview, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[bytes]:
    """Yield ``data`` frames of at most chunk_bytes payload each; one copy per byte, no more."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    for off in range(0, len(payload), chunk_bytes):
        yield data_frame(payload[off : off + chunk_bytes])


def frame_payload(frame: bytes) -> memoryview | None:
    """The payload of a frame that is exactly one ``data`` field, else None (parse it with protobuf)."""
    if not frame or frame[0] != _DATA_TAG:
        return None
    length = 0
    shift = 0
    pos = 1
    while pos < len(frame) and pos <= 10:
        byte = frame[pos]
        length |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return memoryview(frame)[pos:] if pos + length == len(frame) else None
        shift += 7
    return None


class PayloadWriter:
    """Copies incoming payload pieces, in order, into a preallocated byte buffer; checks the size."""

    def __init__(self, dest: memoryview, what: str) -> None:
        self._dest = dest
        self._offset = 0
        self._what = what

    @property
    def size(self) -> int:
        """Payload bytes expected in all."""
        return len(self._dest)

    @property
    def received(self) -> int:
        """Payload bytes written so far."""
        return self._offset

    def write(self, piece: memoryview) -> None:
        start = self._advance(len(piece))
        self._dest[start : self._offset] = piece

    def _advance(self, nbytes: int) -> int:
        """Account for nbytes more payload without copying them; returns where they start."""
        start = self._offset
        end = start + nbytes
        if end > len(self._dest):
            raise InvalidRequestError(
                f"{self._what}: payload is larger than the {len(self._dest)} bytes announced "
                f"(at least {end} bytes arrived)"
            )
        self._offset = end
        return start

    def finish(self) -> None:
        if self._offset != len(self._dest):
            raise InvalidRequestError(
                f"{self._what}: payload ended after {self._offset} of {len(self._dest)} bytes"
            )


def write_frames(frames: Iterator[bytes], writer: PayloadWriter, parse_other: "FrameParser") -> None:
    """Feed every data frame of a stream to writer; any other frame is parsed and refused."""
    for frame in frames:
        piece = frame_payload(frame)
        if piece is None:
            piece = parse_other(frame)
        writer.write(piece)
    writer.finish()


def parse_frame(message_type: Any, frame: bytes | bytearray | memoryview, what: str) -> Any:
    """A frame of a client stream as its message (a generated XFrame class).

    Raises:
        InvalidRequestError: the bytes do not parse.
    """
    try:
        return message_type.FromString(frame)
    except DecodeError as exc:
        raise InvalidRequestError(f"{what}: a frame that does not parse ({exc})") from None


class FrameParser:
    """Fallback for data frames not in the canonical one-field layout: parse with protobuf."""

    def __init__(self, message_type: Any, what: str) -> None:  # a generated XFrame class
        self._type = message_type
        self._what = what

    def __call__(self, frame: bytes) -> memoryview:
        msg = parse_frame(self._type, frame, self._what)
        if msg.WhichOneof("kind") != "data":
            raise InvalidRequestError(f"{self._what}: expected a data frame, got {msg.WhichOneof('kind')}")
        return memoryview(msg.data)


# A socket call's metadata (wire.local_socket): its body begins with this many bytes, the row
# gradients of the push header's row block, which the message after them leaves out.
DETACHED_KEY = "psgrad-detached"

_BLOCK_IDS = pb.RowBlock.DESCRIPTOR.fields_by_name["ids"].number
_BLOCK_GRADS = pb.RowBlock.DESCRIPTOR.fields_by_name["grads"].number


def block_to_wire(block: RowBlock, number: int, grads: bool = True) -> list[bytes | memoryview]:
    """The bytes of a RowBlock field `number` holding `block`, in pieces that, joined and appended
    to the enclosing message's other fields (protobuf allows any field order), parse as
    block.message(). The ids and gradients are views of their tensors: whoever joins the pieces
    copies them once, where a message built with them copies them at every nesting and again to
    serialize (four times the copying for a megabyte of rows). grads=False: without the
    gradients (a socket call carries them beside the message: PushHead.step_socket_request)."""
    head = pb.RowBlock(tables=block.tables, counts=block.counts, widths=block.widths,
                       base_versions=block.base_versions)
    parts: list[bytes | memoryview] = [head.SerializeToString()]
    for field, values in ((_BLOCK_IDS, block.ids), (_BLOCK_GRADS, block.grads if grads else None)):
        if values is not None and values.numel():
            view = byte_view(values)
            parts += [bytes_field_prefix(field, len(view)), view]
    return [bytes_field_prefix(number, sum(len(part) for part in parts)), *parts]


_HEADER_ROWS = pb.PushHeader.DESCRIPTOR.fields_by_name["row_block"].number
_FRAME_HEADER = pb.PushFrame.DESCRIPTOR.fields_by_name["header"].number
_STEP_PUSH = pb.StepRequest.DESCRIPTOR.fields_by_name["push"].number
_STEP_DATA = pb.StepRequest.DESCRIPTOR.fields_by_name["data"].number


@dataclass(frozen=True)
class PushHead:
    """A push's header as it travels: its fields (`header`, without rows) and the row gradients it
    carries (all its tables in one block), written straight into the bytes of the call (the
    push's header frame, or its Step request) so that the rows are copied once, when those bytes
    are joined."""

    header: pb.PushHeader
    rows: RowBlock | None = None

    def _pieces(self, grads: bool = True) -> list[bytes | memoryview]:
        """The serialized PushHeader, rows and all (grads=False: but their gradients), in pieces."""
        if not self.rows:
            return [self.header.SerializeToString()]
        return [self.header.SerializeToString(), *block_to_wire(self.rows, _HEADER_ROWS, grads)]

    def message(self) -> pb.PushHeader:
        """The whole PushHeader message (its rows copied into it)."""
        out = pb.PushHeader()
        out.CopyFrom(self.header)
        if self.rows:
            out.row_block.CopyFrom(self.rows.message())
        return out

    def frame(self) -> bytes:
        """The push's header frame (a PushFrame holding the header)."""
        pieces = self._pieces()
        return b"".join([bytes_field_prefix(_FRAME_HEADER, sum(len(p) for p in pieces)), *pieces])

    def step_request(self, pull: pb.StepRequest, payload: memoryview | None) -> bytes:
        """The Step request of this push with `payload` inline (None: in a shared-memory segment)
        and the pull part `pull` (its rows to read, a compressed pull's ask)."""
        return b"".join(self.step_request_pieces(pull, payload))

    def step_request_pieces(self, pull: pb.StepRequest, payload: memoryview | None,
                            grads: bool = True) -> list[bytes | memoryview]:
        """step_request in pieces, the rows and the payload views of their tensors (grads=False:
        without the rows' gradients)."""
        pieces = self._pieces(grads)
        tail: list[bytes | memoryview] = [] if payload is None else [bytes_field_prefix(_STEP_DATA, len(payload)), payload]
        return [bytes_field_prefix(_STEP_PUSH, sum(len(p) for p in pieces)), *pieces, pull.SerializeToString(), *tail]

    def step_socket_request(self, pull: pb.StepRequest, payload: memoryview | None
                            ) -> tuple[list[bytes | memoryview], tuple[tuple[str, str], ...]]:
        """The Step request as a server's socket takes it (wire.local_socket, DETACHED_KEY): (the
        body in pieces, views of the tensors, which the socket sends as they are: one copy, into
        the kernel; the metadata that says so). The rows' gradients go first, beside the message
        rather than in it, so that the server takes them where they arrived, where protobuf would
        copy them twice more (parsing the request, then reading the field)."""
        grads = self.rows.grads if self.rows else None
        if grads is None or not grads.numel():
            return self.step_request_pieces(pull, payload), ()
        view = byte_view(grads)
        return [view, *self.step_request_pieces(pull, payload, grads=False)], ((DETACHED_KEY, str(len(view))),)
