"""Wire codecs: how float32 values travel as bytes (float32, bfloat16, float16), found by name in a
registry; byte views of tensors, and reusable conversion buffers. Pure, no network."""
from __future__ import annotations

import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from psgrad.errors import InvalidRequestError

if sys.byteorder != "little":  # pragma: no cover - all supported platforms are little-endian
    raise ImportError("psgrad's wire format is little-endian; this host is big-endian")

# torch.frombuffer warns, once per process, that a read-only buffer (the bytes gRPC hands over)
# gives a tensor torch cannot protect; psgrad only reads such tensors, so take that warning here.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    torch.frombuffer(bytes(4), dtype=torch.float32)


@dataclass(frozen=True)
class Codec:
    """One wire format for a range of float32 values: little-endian values of `dtype`."""

    name: str
    dtype: torch.dtype

    @property
    def element_size(self) -> int:
        """Bytes per value on the wire."""
        return self.dtype.itemsize

    @property
    def exact(self) -> bool:
        """The wire bytes are the float32 values themselves: no conversion on either end, and a
        receiver may check (and apply) each piece as it arrives."""
        return self.dtype == torch.float32


CODECS: dict[str, Codec] = {}


def register_codec(codec: Codec) -> Codec:
    """Add a codec under its name (config.WIRE_DTYPES lists the names for the CLI; a test keeps
    the two equal)."""
    CODECS[codec.name] = codec
    return codec


FLOAT32 = register_codec(Codec("float32", torch.float32))
register_codec(Codec("bfloat16", torch.bfloat16))
register_codec(Codec("float16", torch.float16))

_ELEMENT_SIZE = {c.dtype: c.element_size for c in CODECS.values()}


def get_codec(name: str) -> Codec:
    """The codec registered under name.

    Raises:
        InvalidRequestError: no such codec (the message lists the valid ones).
    """
    try:
        return CODECS[name]
    except KeyError:
        raise InvalidRequestError(f"unknown wire dtype {name!r}; valid: {', '.join(CODECS)}") from None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire dtype name ('float32', 'bfloat16', 'float16')."""
    return get_codec(name).dtype


def segment_bytes(numel: int, dtype: str, payload_bytes: int) -> int:
    """The size of the same-host segment a push of numel values of wire dtype `dtype` travels in:
    the plain payload's (the worker's pulls and steps use the same segment), or the push's payload
    where that is larger (a compressed one may be)."""
    return max(numel * get_codec(dtype).element_size, payload_bytes)


def element_size(dtype: torch.dtype) -> int:
    """Bytes per value of a wire dtype."""
    return _ELEMENT_SIZE[dtype]


_NUMPY_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16,
                           torch.int8, torch.uint8, torch.bool})


def byte_view(t: torch.Tensor) -> memoryview:
    """A writable uint8 memoryview aliasing a contiguous CPU tensor's storage (no copy)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    if t.numel() == 0:
        return memoryview(bytearray())
    if t.dtype in _NUMPY_DTYPES:  # (4 x faster than through a uint8 view: it runs per table, per call)
        return t.numpy().data.cast("B")
    return t.reshape(-1).view(torch.uint8).numpy().data.cast("B")  # bfloat16, which numpy lacks


# Below about this many bytes (judged by the first part), joined copies without looking for a view:
# finding one costs ~15-25 us of Python for 8 parts, whatever their size; a copy of 128 KiB about
# 10 us in a loop, but two to four times that within a training step, whose other work has taken
# the caches (what a step of 8 tables of 32 floats measured: 0.17 ms a copy of ~300 KiB).
JOIN_VIEW_MIN_BYTES = 128 << 10


def joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(tensors) (along dim 0): a view where they lie one after another in one storage,
    contiguous, of one dtype and row shape (a step's rows of several tables, split from one
    tensor, are) and large enough that the copy would cost more than looking (JOIN_VIEW_MIN_BYTES),
    else a copy."""
    if len(tensors) == 1:
        return tensors[0]
    if tensors[0].numel() * tensors[0].element_size() * len(tensors) < JOIN_VIEW_MIN_BYTES:
        return torch.cat(tensors)
    view = consecutive_rows(tensors)
    if view is not None:
        return view
    if tensors[0].dim() in (1, 2) and tensors[0].numel():  # (consecutive_rows looked: they do not lie so)
        return torch.cat(tensors)
    full = [t for t in tensors if t.numel()]  # (an empty tensor has no place: its data_ptr is 0)
    first = full[0] if full else tensors[0]
    if not full or not all(t.dim() and t.dtype == first.dtype and t.shape[1:] == first.shape[1:] for t in tensors):
        return torch.cat(tensors)
    step, at, base = first[0].numel() * first.element_size(), first.data_ptr(), first._base
    storage = first.untyped_storage().data_ptr() if base is None else 0
    for t in full:  # (views of one tensor share their base: the storage then goes without asking)
        if not (t.is_contiguous() and t.data_ptr() == at
                and (t._base is base if base is not None else t.untyped_storage().data_ptr() == storage)):
            return torch.cat(tensors)
        at += t.shape[0] * step
    size = (sum(int(t.shape[0]) for t in full), *first.shape[1:])
    strides: list[int] = []
    span = 1
    for n in reversed(size):  # (a contiguous tensor's, whatever the strides of the parts' size-1 dims)
        strides.insert(0, span)
        span *= n
    return first.as_strided(size, strides)


def consecutive_rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """joined()'s view, found the quick way, of 1-D parts or 2-D parts of one width, of one dtype,
    contiguous, each starting where the one before ends (empty ones anywhere), within the first
    one's storage: parts split in order from one tensor, and also parts that lie so without being
    views of it (the row gradients autograd accumulates from one backward's block are detached
    parts of it, with no _base); None for anything else (joined then looks the general way where
    parts have more dimensions, else copies). By their addresses: a part that starts where the one
    before ends, within the first's storage, is those bytes of it."""
    first = tensors[0]
    dims = first.dim()
    if dims not in (1, 2) or not first.numel():
        return None
    width, dtype = first.shape[1] if dims == 2 else 1, first.dtype
    step = width * first.element_size()
    start = at = first.data_ptr()
    for t in tensors:  # (a few cheap attributes a part: len() or .size() of a tensor costs more)
        if t.dtype != dtype or t.dim() != dims or (dims == 2 and t.shape[1] != width) or not t.is_contiguous():
            return None
        n = t.shape[0]
        if n:  # (an empty part's address may be anything: it holds no bytes)
            if t.data_ptr() != at:
                return None
            at += n * step
    storage = first.untyped_storage()
    if at > storage.data_ptr() + storage.nbytes():  # (past the first's storage: another allocation)
        return None
    rows = (at - start) // step
    return first.as_strided((rows, width), (width, 1)) if dims == 2 else first.as_strided((rows,), (1,))


class WireBuffer:
    """A reusable staging tensor for converting float32 <-> a narrower wire dtype."""

    def __init__(self, numel: int, wire_dtype: str) -> None:
        self.codec = get_codec(wire_dtype)
        self.dtype_name = wire_dtype
        self.dtype = self.codec.dtype
        self.numel = numel
        self._buf = None if self.codec.exact else torch.empty(numel, dtype=self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * self.codec.element_size

    @property
    def pooled(self) -> WireBuffer:
        """The buffer a receive-buffer pool keeps (a compressed push's wraps one: see CompressedWire)."""
        return self

    def encode(self, src: torch.Tensor) -> memoryview:
        """Bytes of src (float32, CPU, contiguous) in the wire dtype; aliases src when exact."""
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

    def load(self, dest: torch.Tensor, src: memoryview) -> None:
        """Wire bytes received whole (in a message or a segment) into dest (float32)."""
        if self.codec.exact:
            copy_bytes(byte_view(dest), src)
        elif len(src):  # (torch.frombuffer refuses an empty buffer: a shard without dense elements)
            dest.copy_(torch.frombuffer(src, dtype=self.dtype))


# Copies up to this size are a plain memcpy on the calling thread; larger ones a torch copy, which
# spreads over torch's threads (and would wake them, to spin afterwards, for a small one).
_SMALL_COPY_BYTES = 4 << 20


def aligned(view: memoryview | bytes, size: int = 4) -> bool:
    """Whether view's bytes start at an address values of `size` bytes (float32, int32) can be
    read at in place (False for no bytes)."""
    return bool(len(view)) and np.frombuffer(view, dtype=np.uint8).ctypes.data % size == 0


def copy_bytes(dest: memoryview, src: memoryview) -> None:
    """src into dest (same length), the way that is fastest for its size."""
    if len(src) <= _SMALL_COPY_BYTES:
        dest[:] = src
    else:
        torch.frombuffer(dest, dtype=torch.uint8).copy_(torch.frombuffer(src, dtype=torch.uint8))
