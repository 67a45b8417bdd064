"""Compressed pulls, the worker's half: the copy of a shard's range this worker holds, and the pull
buffer that adds each pulled change to it (see server/worker_copies.py for the scheme, and DeltaAsk
in ps.proto for the protocol).

A DeltaWire stands where a shard's plain pull buffer (WireBuffer) stands, and every transport uses
it the same way: the request carries its ask(); the pull header is handed to expect(), which says
how many bytes follow (the exact weights, or the encoded change); receive_view/finish_receive (a
payload streamed in frames) or load (one in a message or a segment) then write the weights into the
destination, which is the model's range: it receives the copy whole each time, so what the model
changed there meanwhile (model buffers such as BatchNorm statistics, which the gradient carries as
deltas) is replaced as a plain pull replaces it. The copy and its name change only once a whole
payload arrived: a pull that failed half-way leaves both as they were, and if the server's copy
moved on meanwhile the name the worker sends is no longer its, so the next pull is exact.
"""
from __future__ import annotations

import torch

from psgrad.core.codecs import WireBuffer
from psgrad.core.compression import Compression
from psgrad.core.gradient_codecs import RangeCodec
from psgrad.errors import InvalidRequestError
from psgrad.proto import ps_pb2 as pb


class DeltaWire(WireBuffer):
    """One shard's pull buffer for a worker with compressed pulls (ClientConfig.compress_pull)."""

    def __init__(
        self, numel: int, wire_dtype: str, compression: Compression, plain: int = 0, resync_every: int = 0,
        resync_error: float = 0.0,
    ) -> None:
        super().__init__(numel, wire_dtype)
        self.changes = RangeCodec(compression, numel, wire_dtype, plain=plain)
        self.label = compression.label
        self._ask = pb.DeltaAsk(codec=self.label, resync_every=resync_every, resync_error=resync_error)
        self.held: torch.Tensor | None = None  # the copy (float32), once an exact pull made one
        self.token = 0  # the server's name for it (0: none)
        self.drift = 0.0  # the copy's distance from the weights at the last pull (the server's figure)
        self.pulls = self.exact = 0  # pulls read, and of those exact ones
        self._coming: tuple[str, int, float] | None = None  # the current pull's (codec, copy, drift)
        self._change = bytearray(self.changes.nbytes)

    def ask(self) -> pb.DeltaAsk:
        """What a pull request asks: the codec, the copy held, the resync settings. Asked at the
        start of each pull: what an earlier pull's header announced is forgotten."""
        self._coming = None
        ask = pb.DeltaAsk()
        ask.CopyFrom(self._ask)
        ask.holds = self.token if self.held is not None else 0
        return ask

    def expect(self, compress: str, copy: int, drift: float) -> None:
        """The header of the pull about to be read: its codec ("": exact), the copy it makes.

        Raises:
            InvalidRequestError: a codec other than the one asked for, or a change to no copy.
        """
        if compress and compress != self.label:
            raise InvalidRequestError(f"a compressed pull in {compress}, asked for {self.label}")
        if compress and self.held is None:
            raise InvalidRequestError("a compressed pull to a worker that holds no copy (its first pull must be exact)")
        self._coming = compress, copy, drift

    @property
    def nbytes(self) -> int:
        """The payload's size: the encoded change, or the weights (also before a header came: the
        largest a pull sends, which a same-host segment is sized for)."""
        coming = self._coming
        return self.changes.nbytes if coming is not None and coming[0] else super().nbytes

    def receive_view(self, dest: torch.Tensor) -> memoryview:
        return memoryview(self._change) if self._compressed else super().receive_view(dest)

    def finish_receive(self, dest: torch.Tensor) -> None:
        if self._compressed:
            self._apply(memoryview(self._change), dest)
        else:
            super().finish_receive(dest)
            self._adopt(dest)

    def load(self, dest: torch.Tensor, src: memoryview) -> None:
        """A whole payload (in a message or a segment) into dest."""
        if len(src) != self.nbytes:
            raise InvalidRequestError(f"a pull of {len(src)} bytes, expected {self.nbytes}")
        if self._compressed:
            self._apply(src, dest)
            return
        super().load(dest, src)
        self._adopt(dest)

    @property
    def _compressed(self) -> bool:
        return self._coming is not None and bool(self._coming[0])

    def _apply(self, change: memoryview, dest: torch.Tensor) -> None:
        """Add a decoded change to the copy (as the server added it to its own), then copy it to dest."""
        assert self.held is not None  # (expect refused a change to no copy)
        self.changes.decode(change, self.held, add=True)
        dest.copy_(self.held)
        self._done()

    def _adopt(self, dest: torch.Tensor) -> None:
        """The exact weights just written into dest become the copy."""
        if self.held is None:
            self.held = torch.empty(self.numel)
        self.held.copy_(dest)
        self.exact += 1
        self._done()

    def _done(self) -> None:
        assert self._coming is not None
        _, self.token, self.drift = self._coming
        self._coming = None
        self.pulls += 1
