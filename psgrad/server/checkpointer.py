"""A shard's checkpoint writer: a thread that writes snapshots to disk off the shard's lock — the
ones the shard hands over at every K-th version, and one every so many seconds when it changed."""
from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from psgrad.errors import CheckpointError, NotInitializedError
from psgrad.server import checkpoint
from psgrad.server.shard import Shard
from psgrad.server.state import ShardSnapshot


def warn(message: str) -> None:
    """A server's message for its operator (on stderr)."""
    print(f"psgrad server: {message}", file=sys.stderr, flush=True)


class Checkpointer:
    """Writes a shard's checkpoints into one directory until stopped (then once more, if changed)."""

    def __init__(
        self, shard: Shard, directory: Path, every_s: float, every_versions: int, warn: Callable[[str], None] = warn
    ) -> None:
        self._shard = shard
        self.directory = directory
        self._every_s = every_s
        self._warn = warn
        self._cond = threading.Condition()
        self._offered: ShardSnapshot | None = None  # the newest snapshot the shard handed over
        self._stopping = False
        self.written_version = -1
        self.writes = 0
        self.last_write_s = 0.0  # how long the last write took
        shard.snapshot_at_multiples(every_versions, self.offer)
        self._thread = threading.Thread(target=self._loop, name="psgrad-checkpointer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def offer(self, snap: ShardSnapshot) -> None:
        """Take a snapshot to write (called under the shard's lock: never blocks on the disk). A
        newer offer replaces one not yet written."""
        with self._cond:
            self._offered = snap
            self._cond.notify_all()

    def _loop(self) -> None:
        deadline = time.monotonic() + self._every_s
        while True:
            with self._cond:
                while self._offered is None and not self._stopping and time.monotonic() < deadline:
                    self._cond.wait(timeout=max(0.0, deadline - time.monotonic()))
                snap, self._offered, stopping = self._offered, None, self._stopping
            if snap is None and (stopping or time.monotonic() >= deadline):
                snap = self._changed_snapshot()
                deadline = time.monotonic() + self._every_s
            if snap is not None:
                self._write(snap)
            if stopping:
                return

    def _changed_snapshot(self) -> ShardSnapshot | None:
        if self._shard.version == self.written_version:
            return None
        try:
            return self._shard.snapshot()
        except NotInitializedError:
            return None

    def _write(self, snap: ShardSnapshot) -> None:
        start = time.perf_counter()
        try:
            checkpoint.save(snap, self.directory)
        except CheckpointError as exc:  # the shard keeps serving; the next checkpoint tries again
            self._warn(str(exc))
            return
        self.last_write_s = time.perf_counter() - start
        self.written_version = snap.version
        self.writes += 1

    def stop(self, timeout_s: float | None = None) -> None:
        """Write what is pending (and a last checkpoint if the shard changed), then end."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
