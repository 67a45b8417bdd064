"""A shard's checkpoint writer: a thread that writes snapshots to disk off the shard's lock — the
ones the shard hands over at every K-th version, and (async/ssp) one every so many seconds when it
changed — and the source a sync roll-back reads them back from."""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from psgrad.core.policies import policy_for
from psgrad.core.status import CheckpointStatus
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
    it returns to on every shard; a time-based or final one would be this shard's alone.

    A write that fails (a full disk, a directory gone read-only) is never fatal: the shard keeps
    serving, the failure is logged once with its reason (and again when a checkpoint is written
    after all), counted in the shard's status, and retried every `every_s` seconds: with a fresh
    snapshot where time-based checkpoints are taken, else (sync) with the failed snapshot itself,
    which a roll-back can still use meanwhile."""

    def __init__(
        self, shard: Shard, directory: Path, every_s: float, every_versions: int, warn: Callable[[str], None] = warn,
        note: Callable[[str], None] = note, lock: checkpoint.DirectoryLock | None = None,
    ) -> None:
        self._shard = shard
        self._lock = lock  # the server's hold on the directory, let go once the last checkpoint is written
        self.directory = directory
        self._every_s = every_s
        self._warn = warn
        self._note = note
        self._cond = threading.Condition()
        self._offered: ShardSnapshot | None = None  # the newest snapshot the shard handed over
        self._writing: ShardSnapshot | None = None  # the one being written now
        self._retry: ShardSnapshot | None = None  # a handed-over snapshot whose write failed
        self._stopping = False
        self._every_versions = every_versions
        self._warned_sync = False
        self.written_version = -1
        self._written_counters: dict[str, Any] = {}  # the counters the newest checkpoint written holds
        self.writes = 0
        self.failures = 0  # writes that failed
        self.last_error = ""  # why the latest failed write failed
        self._failing_since: float | None = None  # time.time() of the first failure of the current run of them
        self._error_at: float | None = None  # time.time() of the latest failure
        self.last_write_s = 0.0  # how long the last write took
        self._written_at: float | None = None  # time.time() of the newest write (or of the restored one)
        self._newest = -1  # the version of that checkpoint
        if shard.layout is not None:  # restored from this directory: its checkpoint is the newest
            self._newest = shard.version
            try:
                self._written_at = checkpoint.manifest_of(directory, shard.version).stat().st_mtime
            except OSError:
                pass
        shard.snapshot_at_multiples(every_versions, self.offer)
        shard.checkpoint_status = self.status
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
                due = snap is None and (stopping or time.monotonic() >= deadline)
                if due:  # a failed write is retried, unless a newer snapshot replaces it below
                    snap, self._retry = self._retry, None
                self._writing = snap
            if due:
                snap = self._changed_snapshot() or snap
                deadline = time.monotonic() + self._every_s
            if snap is not None:
                self._write(snap)
            with self._cond:
                self._writing = None
            if stopping:
                final = self._changed_snapshot(counted=True)  # updates (or counts) after the last one written
                if final is not None:
                    self._write(final)
                return

    def _changed_snapshot(self, counted: bool = False) -> ShardSnapshot | None:
        """A snapshot of the shard where it moved on since the newest checkpoint written (its
        version; counted: or its counters, which a graceful stop keeps: pulls and retried pushes
        change no version); None where it did not, or (sync) where only the snapshots handed over
        are written."""
        if self._shard.checkpoints_aligned or (self._shard.version == self.written_version and not counted):
            return None
        try:
            snap = self._shard.snapshot()
        except NotInitializedError:
            return None
        if snap.version == self.written_version and (not counted or snap.counters == self._written_counters):
            return None
        return snap

    def _write(self, snap: ShardSnapshot) -> None:
        start = time.perf_counter()
        try:
            checkpoint.save(snap, self.directory)
        except Exception as exc:  # CheckpointError, or anything else: the shard keeps serving, and
            # the next interval tries again
            self._failed(snap, str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}")
            return
        now = time.time()
        with self._cond:
            self.last_write_s = time.perf_counter() - start
            self.written_version, self._written_counters = snap.version, snap.counters
            self.writes += 1
            self._written_at, self._newest = now, snap.version
            if self._retry is not None and self._retry.version <= snap.version:
                self._retry = None
            since, self._failing_since = self._failing_since, None
        _log.debug(f"checkpoint of version {snap.version} written into {self.directory} in {self.last_write_s:.3f} s")
        if since is not None:
            self._note(f"checkpoints are written again: version {snap.version} into {self.directory}, "
                       f"{now - since:.0f} s after the first of the failed writes ({self.failures} failed in all)")

    def _failed(self, snap: ShardSnapshot, reason: str) -> None:
        now = time.time()
        with self._cond:
            self.failures += 1
            self.last_error, self._error_at = reason, now
            if self._retry is None or self._retry.version <= snap.version:
                self._retry = snap  # written at the next interval, unless a newer one is by then
            first, self._failing_since = self._failing_since is None, self._failing_since or now
        if first:
            self._warn(f"checkpoint of version {snap.version} failed: {reason}; the shard keeps serving, and the "
                       f"write is retried every {self._every_s:g} s (logged again once it succeeds; psgrad status "
                       "shows the last error)")
        else:
            _log.debug(f"checkpoint of version {snap.version} failed again: {reason}")

    def status(self) -> CheckpointStatus:
        """The newest checkpoint, its age and the failed writes (what `psgrad status` reports)."""
        now = time.time()
        return CheckpointStatus(
            enabled=True, version=self._newest,
            age_s=-1.0 if self._written_at is None else max(0.0, now - self._written_at),
            writes=self.writes, failures=self.failures, failing=self._failing_since is not None,
            last_error=self.last_error, error_age_s=-1.0 if self._error_at is None else max(0.0, now - self._error_at),
        )

    def age_s(self) -> float | None:
        """Seconds since the newest checkpoint was written, by this server or (restored) before it
        started; None: none yet."""
        return None if self._written_at is None else max(0.0, time.time() - self._written_at)

    # ----------------------------------------------------------------- the shard's RollbackSource
    def _unwritten(self) -> list[ShardSnapshot]:
        with self._cond:
            return [s for s in (self._offered, self._writing, self._retry) if s is not None]

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
        if self._lock is not None and not self._thread.is_alive():  # (a write still going keeps it)
            self._lock.release()
