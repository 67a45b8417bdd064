"""A shard's transfer buffers: receive buffers lent to pushes (a bounded pool, or the one spare
tensor that staged updates compute the next weights into), and the pull streams that read the
weights, which in-place updates wait for. Not thread-safe on its own: every method is called
with the shard's lock held, and waits on conditions of that lock."""
from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterable

import torch

from psgrad.core.codecs import WireBuffer, get_codec
from psgrad.core.status import TransferStatus
from psgrad.server import transfers
from psgrad.server.transfers import PullStream, PushWriter


class Buffers:
    """Receive buffers and pull-stream bookkeeping of one shard."""

    def __init__(self, lock: threading.RLock, push_buffers: int, on_wait: Callable[[], None],
                 min_rate_mb_s: float = 0.0) -> None:
        self._push_buffers = push_buffers
        # The floor rate (--min-transfer-rate-mb-s, bytes a second here): a transfer holding what
        # another waits for is behind below it (transfers.behind_in), and the waiter goes ahead.
        self._min_rate_bps = min_rate_mb_s * 1e6
        self._on_wait = on_wait  # a push or an update starts waiting (wakes the shard's observers)
        self.closed = False
        # Receive buffers. Async/ssp lend at most push_buffers at once. With staged updates the
        # one push being received computes the next weights into its buffer as it arrives, and the
        # update swaps tensors: the former weights become the spare buffer once no pull stream
        # reads them and no staged push computes from them (`_retired` until then). A push that
        # waits for the turn while every staged push in flight is behind is staged beside them
        # (into a tensor beyond the spare), and one that the shard's weights moved past meanwhile
        # is rebased as it is applied. Sync (per_worker) keeps one per pushing worker.
        self.staged = False
        self.per_worker = False
        self._pool: list[tuple[torch.Tensor, WireBuffer]] = []
        self._lent: dict[int, PushWriter] = {}  # id(grad) -> writer, for buffers out on loan
        self._revoked: dict[int, PushWriter] = {}  # ... whose worker was evicted mid-push
        self._builders = 0  # staged pushes holding a turn to build the next weights (one, unless behind)
        self._retired: list[torch.Tensor] = []
        # Pushes wait for a receive buffer on _free, staged ones for their turn on _turn, and each
        # is woken one at a time: a buffer given back (or a turn ended) lets one waiter on, and
        # waking every waiter at each release (as this did) cost a shard with 256 clients 147
        # futile wake-ups per push, a third of its throughput (docs/benchmarks/scale-out.md).
        self._free = threading.Condition(lock)
        self._turn = threading.Condition(lock)
        self._buffer_waits = 0
        # Open pull streams reading a tensor the shard owns; weak, so a stream dropped unread ends.
        self.reads: weakref.WeakSet[PullStream] = weakref.WeakSet()
        self._writers_waiting = 0  # in-place updates waiting for streams of the current weights
        self._reads_done = threading.Condition(lock)  # ... wait here
        self.no_writers = threading.Condition(lock)  # a granted pull waits here for those updates

    @property
    def writers_waiting(self) -> int:
        return self._writers_waiting

    def configure(self, staged: bool, per_worker: bool) -> None:
        self.staged, self.per_worker = staged, per_worker

    def close(self) -> None:
        self.closed = True
        self._free.notify_all()
        self._turn.notify_all()
        self._reads_done.notify_all()
        self.no_writers.notify_all()

    # ----------------------------------------------------------------- pushes
    def lend(
        self, numel: int, dtype: str, weights: Callable[[], torch.Tensor | None]
    ) -> tuple[torch.Tensor, WireBuffer]:
        """A receive buffer for a push: the spare tensor when staged (after this push's turn came),
        else one of the pool's, waiting while push_buffers are out on loan (async/ssp). weights()
        gives the shard's current weights, which other pushes may replace while this one waits."""
        if self.staged:
            return self._staged_buffer(numel, weights)
        if not self.per_worker:
            while not self._pool and len(self._lent) >= self._push_buffers and not self.closed:
                wait_s = self._behind_in(self._lent.values())
                if wait_s <= 0:  # every holder is behind: lend one beyond the limit
                    break
                self._wait(self._free, wait_s)
        if self._pool:
            return self._pool.pop()
        return torch.empty(numel), WireBuffer(numel, dtype)

    def _staged_buffer(self, numel: int, weights: Callable[[], torch.Tensor | None]) -> tuple[torch.Tensor, WireBuffer]:
        """Wait for the turn to build the next weights (one push at a time, unless every push
        holding a turn is behind; a push whose worker is evicted gives it up), then for the spare
        tensor, which a pull stream of the former weights may still read (lend a new one once
        that stream is behind)."""
        while self._builders and not self.closed:
            wait_s = self._behind_in(w for w in self._lent.values() if w.holds_turn)
            if wait_s <= 0:  # every builder is behind: build beside them
                break
            self._wait(self._turn, wait_s)
        self._builders += 1
        while not self._pool and self._retired and not self.closed:
            current = weights()  # the weights now, not when this push began to wait for its turn
            wait_s = self._behind_in(r for r in self.reads if r.source is not current)
            if wait_s <= 0:
                break
            self._wait(self._free, wait_s)
        if self._pool:
            return self._pool.pop()
        return torch.empty(numel), WireBuffer(numel, "float32")

    def _behind_in(self, holders: Iterable[PushWriter | PullStream]) -> float:
        """Seconds until every one of `holders` is behind (transfers.behind_in; <= 0: they are, or
        there are none)."""
        now = time.monotonic()
        return max((transfers.behind_in(h, now, self._min_rate_bps) for h in holders), default=0.0)

    def _in_use(self, tensor: torch.Tensor) -> bool:
        """Whether a pull stream reads `tensor` or a staged push computes from it."""
        return (any(r.source is tensor for r in self.reads)
                or any(w.base is tensor for w in (*self._lent.values(), *self._revoked.values())))

    def _settle(self) -> None:
        """Former weights that nothing uses any more: the spare tensor if there is none, else freed."""
        for tensor in [t for t in self._retired if not self._in_use(t)]:
            self._retired = [t for t in self._retired if t is not tensor]
            if not self._pool:
                self._pool.append((tensor, WireBuffer(tensor.numel(), "float32")))
                self._free.notify()

    def _wait(self, cond: threading.Condition, timeout_s: float | None) -> None:
        self._buffer_waits += 1
        self._on_wait()
        try:
            cond.wait(timeout=timeout_s)
        finally:
            self._buffer_waits -= 1

    def track(self, grad: torch.Tensor, writer: PushWriter) -> None:
        """Record the writer of a lent buffer (it holds the staged turn when staged)."""
        writer.holds_turn = self.staged
        self._lent[id(grad)] = writer

    def writer_of(self, grad: torch.Tensor) -> PushWriter | None:
        return self._lent.get(id(grad)) or self._revoked.get(id(grad))

    def keep(self, grad: torch.Tensor) -> None:
        """The shard keeps this buffer (a sync gradient until the mean): no longer on loan."""
        self._lent.pop(id(grad), None)

    def revoke(self, rank: int) -> None:
        """An evicted worker's push in flight never applies; a staged one gives up its turn now
        (its buffer stays with it until its call ends, since bytes may still arrive)."""
        for key, writer in list(self._lent.items()):
            if writer.rank == rank:
                writer.revoked = True
                if writer.holds_turn:
                    self._revoked[key] = self._lent.pop(key)
                    self._builders -= 1
                    self._turn.notify()

    def release(self, grad: torch.Tensor, wire: WireBuffer) -> None:
        """Return a receive buffer: to the pool, or to the allocator if it was lent beyond the limit."""
        wire = wire.pooled  # (a compressed push's wraps the one lent with grad)
        self._revoked.pop(id(grad), None)
        writer = self._lent.pop(id(grad), None)
        if writer is not None and writer.holds_turn:
            self._builders -= 1
            self._turn.notify()
        if self.per_worker:
            keep = True
        elif self.staged:
            keep = not self._pool and not self._retired  # one spare tensor
        else:
            keep = len(self._pool) + len(self._lent) < self._push_buffers
        if keep:
            self._pool.append((grad, wire))
        self._free.notify()  # a buffer back, or one loan fewer: one waiter may go on
        if self.staged:
            self._settle()  # (former weights it computed from)

    def give_back(self, items: list[tuple[torch.Tensor, WireBuffer]]) -> None:
        """Buffers the shard kept (a sync iteration's gradients) return to the pool."""
        self._pool.extend(items)
        self._free.notify(len(items))

    def commit(self, new: torch.Tensor, old: torch.Tensor) -> None:
        """A staged buffer became the weights; the former weights become the spare buffer, once
        no pull stream reads them and no staged push computes from them."""
        del self._lent[id(new)]
        self._builders -= 1
        self._turn.notify()
        self._retired.append(old)
        self._settle()

    # ----------------------------------------------------------------- pull streams
    def open_read(self, stream: PullStream) -> None:
        self.reads.add(stream)

    def end_read(self, stream: PullStream, weights: torch.Tensor | None) -> None:
        """A pull stream ended: free what only it kept."""
        self.reads.discard(stream)
        if any(t is stream.source for t in self._retired):
            self._settle()
        if self._writers_waiting and not self._current_reads(weights):
            self._reads_done.notify_all()

    def _current_reads(self, weights: torch.Tensor | None) -> list[PullStream]:
        return [r for r in self.reads if r.source is weights]

    def await_reads(self, weights: torch.Tensor, wire_dtype: str) -> None:
        """Before an in-place update: wait until no pull stream reads the current weights. Pulls
        granted meanwhile wait for the update; a stream that is behind gets a private copy."""
        while reads := self._current_reads(weights):
            wait_s = self._behind_in(reads)
            if wait_s <= 0 or self.closed:
                self.detach_reads(weights, wire_dtype)
                return
            self._writers_waiting += 1
            self._on_wait()
            try:
                self._reads_done.wait(timeout=wait_s)
            finally:
                self._writers_waiting -= 1
                if not self._writers_waiting:
                    self.no_writers.notify_all()

    def detach_reads(self, weights: torch.Tensor, wire_dtype: str) -> None:
        """Give the streams still reading the current weights a private copy."""
        reads = self._current_reads(weights)
        if not reads:
            return
        copy = weights.to(get_codec(wire_dtype).dtype, copy=True)
        for stream in reads:
            stream.detach(copy)
            self.reads.discard(stream)

    @property
    def lent(self) -> int:
        """Receive buffers out on loan: pushes in flight."""
        return len(self._lent)

    def status(self) -> TransferStatus:
        return TransferStatus(
            streaming_pulls=len(self.reads),
            waiting_updates=self._writers_waiting,
            buffers_lent=len(self._lent),
            staged_updates=self.staged,
            retired_buffers=len(self._retired),
            waiting_for_buffer=self._buffer_waits,
        )
