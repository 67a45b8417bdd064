"""A shard's transfers in flight: lazily framed pull streams, and push writers that check (and, for
element-wise update rules, apply) the gradient piece by piece as it arrives; no network, no gRPC."""
from __future__ import annotations

import math
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from psgrad.codec import PayloadWriter, byte_view, data_frame, element_size
from psgrad.errors import WorkerStateError
from psgrad.optimizers import SGD, ShardOptimizer

# A transfer that moved no chunk for this long counts as stalled, and the shard stops waiting for
# it: an in-place update gives a pull stream that still reads the weights a private copy instead,
# and a push lends itself a receive buffer beyond push_buffers.
STALL_S = 2.0
# Torch runs an element-wise op on fewer elements than its grain size (32768) on the calling
# thread. Piecewise work on a gradient in flight stays below it: a parallel op per piece would
# wake torch's OpenMP pool every time, and its threads spin between pieces (measured on 2 vCPUs:
# three times the server's CPU per push). 2047 * 16 keeps blocks whole AVX-512 vectors.
BLOCK = 2047 * 16
# Pieces handed to the helper thread but not yet done, per push, before the receiving thread waits.
MAX_PENDING_PIECES = 4
# A push of at most this many values read in place (shared memory) is worked through in blocks on
# the calling thread; a bigger one with one multi-threaded torch op per step.
SMALL_NUMEL = 16 * BLOCK

# (weights block, gradient block, out block, lr scale): write the updated weights to out, which is
# either the gradient block itself or does not overlap it.
UpdateRule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], None]

# torch.frombuffer warns, once per process, that a read-only buffer (the bytes gRPC hands over)
# gives a tensor torch cannot protect; psgrad only reads such tensors, so take that warning here.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    torch.frombuffer(bytes(4), dtype=torch.float32)


def staged_rule(optimizer: ShardOptimizer) -> UpdateRule | None:
    """The optimizer's update as an out-of-place rule on blocks, for rules without state whose
    result for an element depends only on that element (plain SGD, with or without weight decay);
    None for the others (they keep state, and update the weights in place once the push is whole).

    Same torch ops as SGD.apply, so the result is bit for bit the same.
    """
    if type(optimizer) is not SGD or optimizer.momentum:
        return None
    lr, decay = optimizer.lr, optimizer.weight_decay

    def rule(w: torch.Tensor, g: torch.Tensor, out: torch.Tensor, lr_scale: float) -> None:
        if decay:
            g = torch.add(g, w, alpha=decay, out=out)
        torch.add(w, g, alpha=-lr * lr_scale, out=out)

    return rule


class PushWriter(PayloadWriter):
    """Receives one gradient into a lent float32 buffer.

    On a float32 wire the pieces go to a helper thread as they arrive, so the thread that asks
    gRPC for the next message only parses and hands over (the work overlaps the transfer). The
    helper copies each piece into the buffer and sums it while it is in cache (a sum is non-finite
    whenever some value is NaN or inf, and costs far less than an element-wise check, which runs
    only when the sum is not finite); no pass over the gradient is left once the last byte is in.
    When staged, it writes `rule(weights, piece)` instead of the piece itself: the buffer then
    holds the next weights, and the shard makes them current by swapping tensors.

    Narrower wire dtypes are copied on the calling thread and converted by the shard at the end.
    """

    def __init__(self, rank: int, grad: torch.Tensor, dest: memoryview, what: str, checking: bool) -> None:
        super().__init__(dest, what)
        self.rank = rank
        self.grad = grad
        self._numel = grad.numel()
        self._values = grad.numpy() if checking else None
        self._handed = 0  # elements handed to the helper so far
        self._pending: deque[Future[int]] = deque()
        self.nonfinite = 0  # NaN/inf values among the elements the helper finished
        self.last_active = time.monotonic()
        self.revoked = False  # its worker was evicted mid-push: it must never be applied
        self.holds_turn = False  # staged shards: this push is the one being received
        self._stage: tuple[torch.Tensor, UpdateRule, float] | None = None
        self.staged_version = -1  # the shard version the staged weights were computed from
        self._block = BLOCK

    def stage(self, weights: torch.Tensor, rule: UpdateRule, lr_scale: float, version: int) -> None:
        """Compute `rule(weights, grad)` into the buffer as pieces arrive (before the first write)."""
        assert self._values is not None and self._offset == 0
        self._stage = (weights, rule, lr_scale)
        self.staged_version = version
        # With one torch thread nothing can spin: whole pieces in one call each.
        self._block = max(1, self._numel) if torch.get_num_threads() == 1 else BLOCK

    @property
    def staged(self) -> bool:
        return self._stage is not None

    def write(self, piece: memoryview) -> None:
        if self.revoked:
            raise WorkerStateError(f"worker rank {self.rank} was evicted while pushing; nothing was applied")
        self.last_active = time.monotonic()
        if self._values is None:
            super().write(piece)
            return
        if self._offset % 4 == 0 and len(piece) % 4 == 0 and piece:  # whole values
            start = self._advance(len(piece)) // 4
            self._hand(self._ingest_piece, piece, start)
            self._handed = start + len(piece) // 4
        else:
            super().write(piece)
            end = self._offset // 4
            if end > self._handed:
                self._hand(self._ingest_range, self._handed, end)
                self._handed = end

    def _hand(self, fn: Callable[..., int], *args: Any) -> None:
        self._pending.append(_helper().submit(fn, *args))
        if len(self._pending) > MAX_PENDING_PIECES:  # bounded: keeps at most this many pieces alive
            self.nonfinite += self._pending.popleft().result()

    def finish(self) -> None:
        super().finish()
        self.drain()

    def drain(self) -> None:
        """Wait for the helper to finish this push's pieces (raises what it raised)."""
        while self._pending:
            self.nonfinite += self._pending.popleft().result()

    def cancel(self) -> None:
        """Stop: no helper work for this push runs or writes to the buffer after this returns."""
        pending, self._pending = self._pending, deque()
        for f in pending:
            f.cancel()
        futures.wait(pending)

    def write_all(self, payload: memoryview, chunk_bytes: int) -> None:
        """The whole payload at once (a same-host segment, read in place): check it, and stage
        or copy it, with one torch op over the whole gradient each; then finish."""
        if self.revoked:
            raise WorkerStateError(f"worker rank {self.rank} was evicted while pushing; nothing was applied")
        if self._values is None or self._offset or len(payload) != 4 * self._numel or not payload:
            for off in range(0, len(payload), chunk_bytes):
                self.write(payload[off : off + chunk_bytes])
            self.finish()
            return
        self._advance(len(payload))
        grad = torch.frombuffer(payload, dtype=torch.float32)
        if self._numel <= SMALL_NUMEL:  # below torch's grain: no thread pool woken for a small push
            self.nonfinite += _count_nonfinite(np.frombuffer(payload, dtype=np.float32))
            if self._stage is None:
                self._dest[:] = payload
            else:
                self._apply(grad, 0)
        else:
            if not math.isfinite(float(grad.sum())):
                self.nonfinite += int((~torch.isfinite(grad)).sum())
            if self._stage is None:
                self.grad.copy_(grad)
            else:
                weights, rule, scale = self._stage
                rule(weights, grad, self.grad, scale)
        self._handed = self._numel
        self.finish()

    @property
    def checked(self) -> bool:
        """The helper checked every element: `nonfinite` counts them for the whole gradient."""
        return self._values is not None and self._handed == self._numel and not self._pending

    # ----------------------------------------------------------------- on the helper thread
    def _ingest_piece(self, piece: memoryview, start: int) -> int:
        values = np.frombuffer(piece, dtype=np.float32)
        end = start + values.size
        if not values.flags.aligned:  # rare: copy, then work from the buffer
            self._dest[4 * start : 4 * end] = piece
            return self._ingest_range(start, end)
        bad = _count_nonfinite(values)
        if self._stage is None:
            self._dest[4 * start : 4 * end] = piece
        else:
            self._apply(torch.frombuffer(piece, dtype=torch.float32), start)
        return bad

    def _ingest_range(self, start: int, end: int) -> int:
        """Elements [start, end) are already in the buffer (copied on the calling thread)."""
        assert self._values is not None
        bad = _count_nonfinite(self._values[start:end])
        if self._stage is not None:
            self._apply(self.grad[start:end], start)
        return bad

    def _apply(self, grad: torch.Tensor, start: int) -> None:
        """Write the updated weights for elements [start, start + len(grad)) into the buffer."""
        assert self._stage is not None
        weights, rule, scale = self._stage
        for a in range(0, grad.numel(), self._block):
            b = min(a + self._block, grad.numel())
            rule(weights[start + a : start + b], grad[a:b], self.grad[start + a : start + b], scale)


def _count_nonfinite(values: np.ndarray) -> int:
    with np.errstate(over="ignore", invalid="ignore"):
        total = float(values.sum())
    if math.isfinite(total):
        return 0
    return int(values.size - np.count_nonzero(np.isfinite(values)))  # NaN/inf, or a mere overflow


_helper_pool: futures.ThreadPoolExecutor | None = None
_helper_lock = threading.Lock()


def _helper() -> futures.ThreadPoolExecutor:
    """The process's one helper thread for incoming pieces (created on first use)."""
    global _helper_pool
    with _helper_lock:
        if _helper_pool is None:
            _helper_pool = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="psgrad-ingest")
        return _helper_pool


class PullStream:
    """The data frames of one granted pull, built one chunk at a time when gRPC asks for the next.

    It reads `source`, a weights tensor of the shard at `version` (the shard neither changes nor
    reuses that tensor while the stream reads it, or first gives the stream a private copy), so no
    copy of the whole shard is made up front. Exhaust or close it; dropping it closes it too.
    """

    def __init__(
        self,
        source: torch.Tensor,
        version: int,
        wire_dtype: torch.dtype,
        chunk_bytes: int,
        lock: threading.RLock,
        on_end: Callable[[PullStream], None],
    ) -> None:
        self.source = source
        self.version = version
        self._numel = source.numel()
        self._dtype = wire_dtype
        self._chunk = max(1, chunk_bytes // element_size(wire_dtype))
        self._offset = 0
        self._stage: torch.Tensor | None = None  # chunk-sized, for converting to a narrower dtype
        self._lock = lock
        self._on_end = on_end
        self.last_active = time.monotonic()
        self.open = True

    @property
    def nbytes(self) -> int:
        return self._numel * element_size(self._dtype)

    def __iter__(self) -> PullStream:
        return self

    def __next__(self) -> bytes:
        with self._lock:  # the shard swaps `source` under the same lock
            frame = self._frame() if self.open else None
            if frame is None:
                self.close()
                raise StopIteration
            return frame

    def _frame(self) -> bytes | None:
        start = self._offset
        if start >= self._numel:
            return None
        end = min(start + self._chunk, self._numel)
        piece = self.source[start:end]
        if piece.dtype != self._dtype:
            if self._stage is None:
                self._stage = torch.empty(self._chunk, dtype=self._dtype)
            self._stage[: end - start].copy_(piece)
            piece = self._stage[: end - start]
        self._offset = end
        self.last_active = time.monotonic()
        return data_frame(byte_view(piece))

    def copy_into(self, dest: memoryview) -> None:
        """Copy all the (remaining) values in the wire dtype into dest, chunk by chunk under the
        shard lock like frames (the same-host shared-memory path), then end the stream."""
        target = torch.frombuffer(dest, dtype=self._dtype) if len(dest) else torch.empty(0, dtype=self._dtype)
        size = element_size(self._dtype)
        try:
            while True:
                with self._lock:
                    start = self._offset
                    if not self.open or start >= self._numel:
                        return
                    end = min(start + self._chunk, self._numel)
                    piece = self.source[start:end]
                    if piece.dtype == self._dtype:  # a plain memcpy: no torch thread pool per chunk
                        dest[start * size : end * size] = byte_view(piece)
                    else:
                        for a in range(start, end, BLOCK):
                            target[a : min(a + BLOCK, end)].copy_(self.source[a : min(a + BLOCK, end)])
                    self._offset = end
                    self.last_active = time.monotonic()
        finally:
            self.close()

    def detach(self, copy: torch.Tensor) -> None:
        """Read the rest from a private copy of the source (caller holds the shard lock)."""
        self.source = copy

    def close(self) -> None:
        """Stop reading (idempotent); the shard no longer keeps the source for this stream."""
        with self._lock:
            if self.open:
                self.open = False
                self._on_end(self)

    def __del__(self) -> None:
        self.close()
