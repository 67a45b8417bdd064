"""A shard's published weight versions: which ring slot holds which version, and which worker leases
which slot; copies a version into a free slot once, however many workers then read it. No gRPC."""
from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from psgrad.core.status import PublishedStatus
from psgrad.server.transfers import PullStream
from psgrad.wire import published

_log = logging.getLogger("psgrad.server")


@dataclass
class _Slot:
    version: int = -1  # the version it holds (-1: none yet)
    holders: set[int] = field(default_factory=set)  # ranks leasing it
    origin: int = 0  # the uid of the shard state it was copied from
    pins: int = 0  # pushes that may restore the shard's weights from it (never reused meanwhile)


class Publisher:
    """Lends same-host workers read-only slots holding weight versions.

    A worker leases the slot of the version it pulled until its next pull (which gives the lease
    back first) or until it is no longer a live member of the shard (evicted or left): a slot is
    never rewritten while a live worker leases it. The ring has one slot per worker of the job,
    allocated at the first published pull: a pull gives its worker's lease back before it takes
    one, so the other workers hold at most num_workers - 1 slots and one is free. A pull that finds
    none (more workers than num_workers, or an evicted one whose lease has not run out yet) is
    served by a copy into the worker's segment instead.
    """

    def __init__(self, slot_bytes: int, slots: int, live: Callable[[], set[int]]) -> None:
        self.slot_bytes = slot_bytes
        self.slots = slots
        self._live = live
        self._ring: published.Ring | None = None
        self._table = [_Slot() for _ in range(slots)]
        self._lock = threading.Lock()  # one publication at a time; a second puller finds it done
        self._newest = -1  # a version below it (a roll-back) voids what the slots hold
        self.copies = 0  # versions copied into a slot
        self.leases = 0  # pulls served from a slot
        self.pins = 0  # pushes that found the copy of their weights (see pinned)

    @property
    def nbytes(self) -> int:
        """Shared memory the ring holds (0 until the first published pull)."""
        return 0 if self._ring is None else self._ring.nbytes

    def lease(self, rank: int, version: int, stream: PullStream) -> tuple[tuple[str, str], ...] | None:
        """Lend `rank` a slot holding `version`, copying it in from `stream` (which reads that
        version under the shard's lock) when no slot holds it yet; returns the trailing metadata
        that names the slot, or None when no slot is free (the caller copies instead)."""
        with self._lock:
            if self._ring is None:
                self._ring = published.Ring(self.slot_bytes, self.slots)
                _log.info("same-host pulls: published versions in /dev/shm/%s, %d slot(s) of %.1f MB (%.1f MB)",
                          self._ring.name, self.slots, self.slot_bytes / 1e6, self._ring.nbytes / 1e6)
            for slot in self._table:
                slot.holders.discard(rank)  # its former version: it moved on
                if version < self._newest:  # rolled back: a version number may now name other weights
                    slot.version = -1
            self._newest = version
            index = next((i for i, s in enumerate(self._table) if s.version == version), None)
            if index is None:
                index = self._free()
                if index is None:
                    return None
                self._table[index].version = -1  # a half-written slot holds no version
                stream.copy_into(self._ring.slot(index))
                if not stream.complete:  # the call ended mid-copy
                    return None
                self._table[index].version, self._table[index].origin = version, stream.origin
                self.copies += 1
            self._table[index].holders.add(rank)
            self.leases += 1
            return self._ring.answer(index)

    @contextlib.contextmanager
    def pinned(self, key: tuple[int, int]) -> Iterator[torch.Tensor | None]:
        """An exact copy of the shard's weights `key` = (state uid, version) names, if a slot holds
        it (else None): the slot is not reused while the block runs, so a push applied in place
        before its check is done can be undone from it."""
        with self._lock:
            index = next((i for i, s in enumerate(self._table) if (s.origin, s.version) == key), None)
            if self._ring is None or index is None:
                copy = None
            else:
                self._table[index].pins += 1
                self.pins += 1
                copy = torch.frombuffer(self._ring.slot(index), dtype=torch.float32)
        try:
            yield copy
        finally:
            if copy is not None and index is not None:
                with self._lock:
                    self._table[index].pins -= 1

    def _free(self) -> int | None:
        """A slot that no live worker leases and no push pins, the oldest version first (leases of
        departed workers end here)."""
        live = self._live()
        for slot in self._table:
            slot.holders &= live
        free = [i for i, s in enumerate(self._table) if not s.holders and not s.pins]
        return min(free, key=lambda i: self._table[i].version) if free else None

    def status(self) -> PublishedStatus:
        """The ring's size and use, for `psgrad status` and the metrics. Takes no lock: the shard
        asks under its own lock, which lease() takes while it holds this publisher's (a copy reads
        the weights under the shard's lock), so taking ours here could deadlock; counters read a
        moment apart are fine for a status."""
        leased = sum(1 for s in self._table if s.holders)
        return PublishedStatus(self.slots, self.nbytes, leased, self.copies, self.leases, self.pins)

    def held(self) -> dict[int, int]:
        """rank -> the version it leases (for status and tests)."""
        with self._lock:
            return {r: s.version for s in self._table for r in s.holders}

    def close(self) -> None:
        with self._lock:
            if self._ring is not None:
                self._ring.close()
                self._ring = None
