"""A shard's transfers in flight: lazily framed pull streams, and push writers that check (and, for
element-wise update rules, apply) the gradient piece by piece as it arrives; no network, no gRPC."""
from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from psgrad.core.codecs import aligned, byte_view, element_size
from psgrad.wire.frames import PayloadWriter, data_frame
from psgrad.errors import EvictedError
from psgrad.core.optimizers import UpdateRule
from psgrad.core.optimizers.base import register_axpy_backend

# A transfer that moved no chunk for this long counts as stalled, and the shard stops waiting for
# it: an in-place update gives a pull stream that still reads the weights a private copy instead,
# and a push lends itself a receive buffer beyond push_buffers.
STALL_S = 2.0
# A transfer that holds what another one waits for (a receive buffer, the staged turn, the weights an
# update would write or reuse) also counts as behind, once it has held it HOLD_GRACE_S, while it has
# moved fewer bytes than the server's floor rate (--min-transfer-rate-mb-s) allows for the time it
# has held it: the waiter then goes ahead beside it (a receive buffer beyond push_buffers, a second
# staged push, a private copy of the weights for the stream) instead of waiting until the
# whole-transfer deadline cuts it. A push trickled a few bytes at a time holds up nobody for more
# than this grace.
HOLD_GRACE_S = 0.1
# Torch runs an element-wise op on fewer elements than its grain size (32768) on the calling
# thread. Piecewise work on a gradient in flight stays below it: a parallel op per piece would
# wake torch's OpenMP pool every time, and its threads spin between pieces (measured on 2 vCPUs:
# three times the server's CPU per push). 2047 * 16 keeps blocks whole AVX-512 vectors.
BLOCK = 2047 * 16
# A push of at most this many values read in place (shared memory) is worked through in blocks on
# the calling thread; a bigger one with one multi-threaded torch op per step.
SMALL_NUMEL = 16 * BLOCK

def behind_in(transfer: PushWriter | PullStream, now: float, min_rate_bps: float) -> float:
    """Seconds until `transfer` counts as behind if it moves no more bytes (<= 0: it is behind now):
    STALL_S without a byte, or, from HOLD_GRACE_S after it began, fewer bytes than min_rate_bps
    (bytes a second; 0: no floor) for the time since it began."""
    stalled_at = transfer.last_active + STALL_S
    if min_rate_bps <= 0:
        return stalled_at - now
    slow_at = transfer.started + max(HOLD_GRACE_S, transfer.moved / min_rate_bps)
    return min(stalled_at, slow_at) - now


class PushWriter(PayloadWriter):
    """Receives one gradient into a lent float32 buffer.

    On a float32 wire each piece is worked on the moment it arrives, on the receiving thread,
    while it is in cache: copied into the buffer and summed (a sum is non-finite whenever some
    value is NaN or inf, and costs far less than an element-wise check, which runs only when the
    sum is not finite); no pass over the gradient is left once the last byte is in. gRPC keeps
    reading the socket meanwhile (up to its flow-control window), so the work overlaps the
    transfer without a second thread; a helper thread (an earlier design) cost the server 3-15 ms
    more CPU per 100 MB push on 2 vCPUs in hand-offs and GIL switches, for no gain in time.
    When staged, it writes `rule(weights, piece)` instead of the piece itself: the buffer then
    holds the next weights, and the shard makes them current by swapping tensors.

    Narrower wire dtypes are copied as they arrive and converted by the shard at the end.
    """

    def __init__(self, rank: int, grad: torch.Tensor, dest: memoryview, what: str, checking: bool) -> None:
        super().__init__(dest, what)
        self.rank = rank
        self.grad = grad
        self._numel = grad.numel()
        self._checking = checking  # float32 wire: pieces are summed (and staged) as they arrive
        self._handed = 0  # elements checked (and staged or copied) so far
        self.nonfinite = 0  # NaN/inf values among them
        self.started = self.last_active = time.monotonic()  # (when it was lent its buffer; its last bytes)
        self.revoked = False  # its worker was evicted mid-push: it must never be applied
        self.holds_turn = False  # staged shards: this push is the one being received
        self.lr: float | None = None  # the learning rate the push carries (None: the job's)
        self.skip: tuple[tuple[int, int], ...] = ()  # the dense ranges it left unused (core/unused.py)
        self.skip_tables: frozenset[str] = frozenset()  # the sparse tables it did not use
        # The row gradients of sparse tables the push carries (table -> ids, gradients, base version),
        # checked with its header, and their non-finite values (the push's policy decides for both).
        self.rows: Mapping[str, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self.rows_nonfinite = 0
        # What its check reserved for them (rows_path.Reserved: state uid, placements, slots by table).
        self.rows_reserved: tuple[int, tuple[int, ...], dict[str, torch.Tensor]] | None = None
        self._stage: tuple[torch.Tensor, UpdateRule, float] | None = None
        self._block = BLOCK
        # Same host: the shard may apply a whole float32 gradient from the worker's segment in
        # place (may_borrow); write_all then only checks it and leaves it there (borrowed).
        self.may_borrow = False
        self.borrowed: torch.Tensor | None = None
        # (shard state uid, version) when the push was reserved, and an exact copy of those weights
        # (a published version) if one exists: a borrowed gradient is then checked piece by piece
        # as the shard applies it (apply_checked), and the copy undoes a non-finite one.
        self.target: tuple[int, int] = (0, -1)
        self.restore_from: torch.Tensor | None = None
        self.check_deferred = False

    def stage(self, weights: torch.Tensor, rule: UpdateRule, step_lr: float) -> None:
        """Compute `rule(weights, grad)` with this step's lr into the buffer as pieces arrive
        (before the first write)."""
        assert self._checking and self._offset == 0
        self._stage = (weights, rule, step_lr)
        # With one torch thread nothing can spin: whole pieces in one call each.
        self._block = max(1, self._numel) if torch.get_num_threads() == 1 else BLOCK

    @property
    def staged(self) -> bool:
        return self._stage is not None

    @property
    def base(self) -> torch.Tensor | None:
        """The weights a staged push computes its next weights from (the shard's when it was staged)."""
        return None if self._stage is None else self._stage[0]

    @property
    def moved(self) -> int:
        return self.received

    def rebase(self, current: torch.Tensor) -> None:
        """Make the staged next weights rule(current, grad) instead of rule(base, grad): another
        staged push, let go ahead beside this slow one, was applied meanwhile. Element-wise forms
        are affine in the weights (out = a * w - lr * g), so adding rule(current - base, 0) is
        exact in real arithmetic (one rounding apart in float32); a pass over the shard, taken only
        in that case."""
        assert self._stage is not None
        base, rule, step_lr = self._stage
        zeros, moved = torch.zeros(min(self._numel, BLOCK)), torch.empty(min(self._numel, BLOCK))
        for a in range(0, self._numel, BLOCK):
            b = min(a + BLOCK, self._numel)
            rule(current[a:b] - base[a:b], zeros[: b - a], moved[: b - a], step_lr)  # (out must not be w)
            self.grad[a:b] += moved[: b - a]
        self._stage = (current, rule, step_lr)

    def write(self, piece: memoryview) -> None:
        if self.revoked:
            raise EvictedError(f"worker rank {self.rank} was evicted while pushing; nothing was applied")
        self.last_active = time.monotonic()
        if not self._checking:
            super().write(piece)
            return
        if self._offset % 4 == 0 and len(piece) % 4 == 0 and piece:  # whole values
            start = self._advance(len(piece)) // 4
            self.nonfinite += self._ingest_piece(piece, start)
            self._handed = start + len(piece) // 4
        else:
            super().write(piece)
            end = self._offset // 4
            if end > self._handed:
                self.nonfinite += self._ingest_range(self._handed, end)
                self._handed = end

    def write_all(self, payload: memoryview, chunk_bytes: int) -> None:
        """The whole payload at once (a same-host segment, read in place): check it, and stage
        or copy it, with one torch op over the whole gradient each; then finish."""
        if self.revoked:
            raise EvictedError(f"worker rank {self.rank} was evicted while pushing; nothing was applied")
        if not self._checking or self._offset or len(payload) != 4 * self._numel or not aligned(payload):
            for off in range(0, len(payload), chunk_bytes):
                self.write(payload[off : off + chunk_bytes])
            self.finish()
            return
        self._advance(len(payload))
        grad = torch.frombuffer(payload, dtype=torch.float32)
        if self.may_borrow:  # checked here, applied from there: the worker waits for the reply
            self.check_deferred = self.restore_from is not None  # checked as it is applied
            if not self.check_deferred:
                self.nonfinite += count_nonfinite(grad)
            self._stage = None
            self.borrowed = grad
            self._handed = self._numel
            self.finish()
            return
        # The payload is another process's memory: read it once, into the private buffer, and check
        # what was read there (a non-finite gradient gives non-finite next weights), so that a
        # worker writing it meanwhile can tear the gradient but never slip a NaN past the check.
        if self._numel <= SMALL_NUMEL:  # below torch's grain: no thread pool woken for a small push
            if self._stage is None:
                self._dest[:] = payload
            else:
                self._apply(grad, 0)
            self.nonfinite += count_nonfinite(self.grad)
        else:  # one op over the whole gradient: torch may spread it over its threads
            if self._stage is None:
                self.grad.copy_(grad)
            else:
                weights, rule, scale = self._stage
                rule(weights, grad, self.grad, scale)
            if not math.isfinite(float(self.grad.sum())):
                self.nonfinite += int((~torch.isfinite(self.grad)).sum())
        self._handed = self._numel
        self.finish()

    @property
    def checked(self) -> bool:
        """Every element was checked as it arrived: `nonfinite` counts them for the whole gradient."""
        return self._checking and self._handed == self._numel and not self.check_deferred

    def _ingest_piece(self, piece: memoryview, start: int) -> int:
        end = start + len(piece) // 4
        if not aligned(piece):  # rare (an odd-sized frame prefix): copy, then work from the buffer
            self._dest[4 * start : 4 * end] = piece
            return self._ingest_range(start, end)
        values = torch.frombuffer(piece, dtype=torch.float32)
        bad = count_nonfinite(values)
        if self._stage is None:
            self._dest[4 * start : 4 * end] = piece
        else:
            self._apply(values, start)
        return bad

    def _ingest_range(self, start: int, end: int) -> int:
        """Elements [start, end) are already in the buffer (copied on the calling thread)."""
        assert self._checking
        bad = count_nonfinite(self.grad[start:end])
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


# on_two_threads' unit: apply_checked's pieces (4 MB, checked and then applied while in cache).
PIECE = 1 << 20
_HELPER: tuple[int, ThreadPoolExecutor] | None = None  # (the pid it belongs to: a forked child makes its own)
_HELPER_LOCK = threading.Lock()


def on_two_threads(n: int, work: Callable[[int, int], object]) -> None:
    """work(0, half) on this thread and work(half, n) on the helper thread at once (half a multiple
    of PIECE; n <= PIECE: all here). Memory-bound passes over big tensors go twice as fast where
    the host's memory bandwidth allows (on 2 vCPUs: 1.1-2x, varying with the machine's neighbours)."""
    global _HELPER
    if n <= PIECE:
        work(0, n)
        return
    with _HELPER_LOCK:
        if _HELPER is None or _HELPER[0] != os.getpid():
            _HELPER = (os.getpid(), ThreadPoolExecutor(max_workers=1, thread_name_prefix="psgrad-helper"))
        helper = _HELPER[1]
    half = -(-n // 2 // PIECE) * PIECE
    other = helper.submit(work, half, n)
    try:
        work(0, half)
    finally:
        other.result()


def _split_axpy(weights: torch.Tensor, grad: torch.Tensor, alpha: float) -> None:
    """w += alpha * g, torch's own add_ element by element, half on the helper thread where torch
    runs one thread (else torch spreads the op itself)."""
    if torch.get_num_threads() == 1:
        on_two_threads(weights.numel(), lambda a, b: weights[a:b].add_(grad[a:b], alpha=alpha))
    else:
        weights.add_(grad, alpha=alpha)


register_axpy_backend("split", lambda w, g, a: _split_axpy(w, g, a))  # (looked up at each call)


def apply_checked(grad: torch.Tensor, update: Callable[[int, int], None]) -> int:
    """Check a gradient and apply it piece by piece, `update(start, end)` right after each piece's
    check, on this thread and the helper (on_two_threads): one pass over memory instead of two.
    Returns the gradient's non-finite values: 0, or some pieces were applied and the caller must
    restore the weights. About the CPU time of a check and then an apply on one thread (measured on
    2 vCPUs), in 0.55-0.75 of the time."""
    stop = threading.Event()

    def run(start: int, end: int) -> None:
        for a in range(start, end, PIECE):
            b = min(a + PIECE, end)
            if stop.is_set() or count_nonfinite(grad[a:b]):
                stop.set()
                return
            update(a, b)

    n = grad.numel()
    on_two_threads(n, run)
    return int(n - int(torch.isfinite(grad).sum())) if stop.is_set() else 0


def count_nonfinite(values: torch.Tensor) -> int:
    """NaN/inf values among float32 values. A sum is non-finite whenever one of them is, and costs
    a fraction of an element-wise check, which therefore runs only when the sum is not finite
    (NaN/inf, or a mere overflow). torch's vectorized sum is 3x numpy's on these machines, but with
    more than one torch thread a piece above torch's grain size would wake the OpenMP pool (see
    BLOCK): numpy's sum then, which never spawns threads."""
    if values.numel() <= BLOCK or torch.get_num_threads() == 1:
        total = float(values.sum())
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            total = float(values.numpy().sum())
    if math.isfinite(total):
        return 0
    return int(values.numel() - int(torch.isfinite(values).sum()))


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
        origin: int = 0,
    ) -> None:
        self.source = source
        self.version = version
        self.origin = origin  # the uid of the shard state it reads: (origin, version) names the weights
        self._numel = source.numel()
        self._dtype = wire_dtype
        self._chunk = max(1, chunk_bytes // element_size(wire_dtype))
        self._offset = 0
        self._stage: torch.Tensor | None = None  # chunk-sized, for converting to a narrower dtype
        self._lock = lock
        self._on_end = on_end
        self.started = self.last_active = time.monotonic()
        self.open = True

    @property
    def nbytes(self) -> int:
        return self._numel * element_size(self._dtype)

    @property
    def sent(self) -> int:
        """Bytes handed out so far (frames given to gRPC, or copied)."""
        return self._offset * element_size(self._dtype)

    @property
    def moved(self) -> int:
        return self.sent

    @property
    def complete(self) -> bool:
        """Every value was read."""
        return self._offset >= self._numel

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

    def copy_into(self, dest: memoryview, dtype: torch.dtype | None = None) -> None:
        """Copy all the (remaining) values in the wire dtype (or `dtype`) into dest, chunk by chunk
        under the shard lock like frames (the same-host shared-memory path, a compressed pull's
        snapshot), then end the stream. A whole float32 copy on one torch thread goes at once,
        under the lock, on two threads."""
        dtype = dtype or self._dtype
        target = torch.frombuffer(dest, dtype=dtype) if len(dest) else torch.empty(0, dtype=dtype)
        size = element_size(dtype)
        try:
            with self._lock:
                source = self.source
                if self.open and self._offset == 0 and source.dtype == dtype and torch.get_num_threads() == 1:
                    on_two_threads(self._numel, lambda a, b: target[a:b].copy_(source[a:b]))
                    self._offset = self._numel
                    self.close()  # (under the same hold of the lock: a step's pull takes it once)
                    return
            while True:
                with self._lock:
                    start = self._offset
                    if not self.open or start >= self._numel:
                        return
                    end = min(start + self._chunk, self._numel)
                    piece = self.source[start:end]
                    if piece.dtype == dtype:  # a plain memcpy: no torch thread pool per chunk
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
        if not self.open:  # (closed for good: `open` is only ever set False, under the lock)
            return
        with self._lock:
            if self.open:
                self.open = False
                self._on_end(self)

    def __del__(self) -> None:
        self.close()
