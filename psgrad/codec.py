"""Tensor <-> wire bytes: wire dtypes, byte views, and chunked payload frames; pure, no network.

A payload frame is the protobuf encoding of ``XFrame{bytes data = 2}``: one tag byte (0x12),
a varint length, then raw little-endian bytes. Building and parsing that prefix by hand lets
tensor bytes go straight between torch memory and gRPC's ``bytes`` without passing through a
protobuf object (which would copy them twice more), while the wire stays exactly what
``protos/psgrad/proto/ps.proto`` says.
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from typing import Any

import torch

from psgrad.config import DEFAULT_CHUNK_BYTES
from psgrad.errors import InvalidRequestError

WIRE_TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_DATA_TAG = 0x12  # field 2, wire type 2 (length-delimited)

if sys.byteorder != "little":  # pragma: no cover - all supported platforms are little-endian
    raise ImportError("psgrad's wire format is little-endian; this host is big-endian")


_ELEMENT_SIZE = {dtype: torch.empty(0, dtype=dtype).element_size() for dtype in WIRE_TORCH_DTYPES.values()}


def element_size(dtype: torch.dtype) -> int:
    """Bytes per value of a wire dtype."""
    return _ELEMENT_SIZE[dtype]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire dtype name ('float32', 'bfloat16', 'float16')."""
    try:
        return WIRE_TORCH_DTYPES[name]
    except KeyError:
        raise InvalidRequestError(
            f"unknown wire dtype {name!r}; valid: {', '.join(WIRE_TORCH_DTYPES)}"
        ) from None


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable uint8 memoryview aliasing a contiguous CPU tensor's storage (no copy)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(bytearray())
    return flat.view(torch.uint8).numpy().data.cast("B")


def _varint(n: int) -> bytes:
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


class FrameParser:
    """Fallback for data frames not in the canonical one-field layout: parse with protobuf."""

    def __init__(self, message_type: Any, what: str) -> None:  # a generated XFrame class
        self._type = message_type
        self._what = what

    def __call__(self, frame: bytes) -> memoryview:
        msg = self._type.FromString(frame)
        if msg.WhichOneof("kind") != "data":
            raise InvalidRequestError(f"{self._what}: expected a data frame, got {msg.WhichOneof('kind')}")
        return memoryview(msg.data)


class WireBuffer:
    """A reusable staging tensor for converting float32 <-> a narrower wire dtype."""

    def __init__(self, numel: int, wire_dtype: str) -> None:
        self.dtype_name = wire_dtype
        self.dtype = torch_dtype(wire_dtype)
        self.numel = numel
        self._buf = None if self.dtype == torch.float32 else torch.empty(numel, dtype=self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * element_size(self.dtype)

    def encode(self, src: torch.Tensor) -> memoryview:
        """Bytes of src (float32, CPU, contiguous) in the wire dtype; aliases src when float32."""
        if self._buf is None:
            return byte_view(src)
        self._buf.copy_(src)
        return byte_view(self._buf)

    def receive_view(self, dest: torch.Tensor) -> memoryview:
        """Where incoming wire bytes for dest should be written."""
        return byte_view(dest) if self._buf is None else byte_view(self._buf)

    def finish_receive(self, dest: torch.Tensor) -> None:
        """Convert received wire bytes into dest (no-op when the wire is float32)."""
        if self._buf is not None:
            dest.copy_(self._buf)
