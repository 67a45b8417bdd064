"""A shard's checkpoint writer: a thread that writes snapshots to disk off the shard's lock — the
ones the shard hands over at every K-th version, and (async/ssp) one every so many seconds when it
changed — and the source a sync roll-back reads them back from."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from psgrad.core.policies import policy_for
from psgrad.errors import CheckpointError, NotInitializedError
from psgrad.server import checkpoint
from psgrad.server.shard import Shard
from psgrad.server.state import ShardSnapshot


_log = logging.getLogger("psgrad.server")


def warn(message: str) -> None:
    """A server's warning for its operator (logger psgrad.server; stderr under the CLI)."""
    _log.warning(message)


def note(message: str) -> None:
    """A server's note for its operator: what it restored, where it serves metrics (level info)."""
    _log.info(message)


class Checkpointer:
    """Writes a shard's checkpoints into one directory until stopped (then once more, if changed).

    In sync mode only the snapshots the shard hands over are written (the initial one and every
    K-th iteration, the same iterations on every shard), so that a roll-back finds the iteration
    it returns to on every shard; a time-based or final one would be this shard's alone."""

    def __init__(
        self, shard: Shard, directory: Path, every_s: float, every_versions: int, warn: Callable[[str], None] = warn
    ) -> None:
        self._shard = shard
        self.directory = directory
        self._every_s = every_s
        self._warn = warn
        self._cond = threading.Condition()
        self._offered: ShardSnapshot | None = None  # the newest snapshot the shard handed over
        self._writing: ShardSnapshot | None = None  # the one being written now
        self._stopping = False
        self._every_versions = every_versions
        self._warned_sync = False
        self.written_version = -1
        self.writes = 0
        self.last_write_s = 0.0  # how long the last write took
        self._written_at: float | None = None  # time.time() of the newest write (or of the restored one)
        if shard.layout is not None:  # restored from this directory: its checkpoint is the newest
            try:
                self._written_at = checkpoint.manifest_of(directory, shard.version).stat().st_mtime
            except OSError:
                pass
        shard.snapshot_at_multiples(every_versions, self.offer)
        self._thread = threading.Thread(target=self._loop, name="psgrad-checkpointer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def offer(self, snap: ShardSnapshot) -> None:
        """Take a snapshot to write (called under the shard's lock: never blocks on the disk). A
        newer offer replaces one not yet written."""
        if not self._every_versions and not self._warned_sync and policy_for(snap.layout.spec).aggregates:
            self._warned_sync = True
            self._warn("sync mode checkpoints only at multiples of --checkpoint-every-versions, which is off: "
                       "a restart rolls the job back to its first iteration")
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
                self._writing = snap
            if snap is None and (stopping or time.monotonic() >= deadline):
                snap = self._changed_snapshot()
                deadline = time.monotonic() + self._every_s
            if snap is not None:
                self._write(snap)
            with self._cond:
                self._writing = None
            if stopping:
                final = self._changed_snapshot()  # updates after the last offered snapshot
                if final is not None:
                    self._write(final)
                return

    def _changed_snapshot(self) -> ShardSnapshot | None:
        if self._shard.version == self.written_version or self._shard.checkpoints_aligned:
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
        self._written_at = time.time()

    def age_s(self) -> float | None:
        """Seconds since the newest checkpoint was written, by this server or (restored) before it
        started; None: none yet."""
        return None if self._written_at is None else max(0.0, time.time() - self._written_at)

    # ----------------------------------------------------------------- the shard's RollbackSource
    def _unwritten(self) -> list[ShardSnapshot]:
        with self._cond:
            return [s for s in (self._offered, self._writing) if s is not None]

    def versions(self) -> list[int]:
        """The versions a roll-back can read: on disk, or handed over and not yet written."""
        return sorted({*checkpoint.versions(self.directory), *(s.version for s in self._unwritten())}, reverse=True)

    def load(self, version: int) -> ShardSnapshot | None:
        """The snapshot of that version (from memory if not yet written); None: none readable."""
        for snap in self._unwritten():
            if snap.version == version:
                return snap
        try:
            return checkpoint.load_version(self.directory, version)
        except CheckpointError as exc:
            self._warn(f"cannot roll back to version {version}: {exc}")
            return None

    def stop(self, timeout_s: float | None = None) -> None:
        """Write what is pending (and a last checkpoint if the shard changed), then end."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
