"""The checkpoint writer: what it writes in each mode, and the roll-back source it offers (the
versions on disk or not yet written, each read back whole)."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from psgrad.config import JobSpec, ServerConfig
from psgrad.server import checkpoint
from psgrad.server.checkpointer import Checkpointer
from psgrad.server.shard import Shard
from test_shard import make_layout, push, weights_for
from test_state import grad, started
from conftest import SmallDisk, wait_for

pytestmark = pytest.mark.timeout(60)


def run_and_stop(spec: JobSpec, tmp_path: Path, every_versions: int, pushes: int) -> tuple[list[int], list[str]]:
    """Push `pushes` iterations of both workers with a checkpointer writing every `every_versions`;
    every_s is long, so only the shard's offers and the final checkpoint at stop can be written."""
    s, layout = started(spec)
    warnings: list[str] = []
    writer = Checkpointer(s, tmp_path, every_s=3600, every_versions=every_versions, warn=warnings.append)
    writer.start()
    for clock in range(pushes):
        for rank in (0, 1):
            push(s, layout, grad(layout, 2 * clock + rank), rank=rank, clock=clock)
    writer.stop(timeout_s=30)
    return checkpoint.versions(tmp_path), warnings


def test_async_writes_a_last_checkpoint_at_stop(tmp_path: Path) -> None:
    versions, warnings = run_and_stop(JobSpec(lr=0.5, num_shards=2, num_workers=2), tmp_path, 0, 3)
    assert versions == [6] and warnings == []


def test_the_last_checkpoint_at_stop_keeps_what_was_counted_since_one_of_the_same_version(tmp_path: Path) -> None:
    """A graceful stop writes the shard again where only its counters moved (a retried push, pulls:
    no new version), so that the restarted server's `psgrad status` continues them all."""
    s, layout = started(JobSpec(lr=0.5, num_shards=2, num_workers=2))
    writer = Checkpointer(s, tmp_path, every_s=3600, every_versions=1)
    writer.start()
    push(s, layout, grad(layout, 0), rank=0, clock=0)
    wait_for("the checkpoint of version 1", lambda: writer.written_version == 1)
    assert not push(s, layout, grad(layout, 0), rank=0, clock=0).applied  # a retry: counted, no new version
    writer.stop(timeout_s=30)
    assert checkpoint.versions(tmp_path) == [1]
    kept = checkpoint.load_version(tmp_path, 1).counters
    assert (kept["pushes_applied"], kept["pushes_duplicate"]) == (1, 1)
    writer = Checkpointer(s, tmp_path / "again", every_s=3600, every_versions=1)
    writer.start()
    push(s, layout, grad(layout, 1), rank=1, clock=0)
    wait_for("the checkpoint of version 2", lambda: writer.written_version == 2)
    writes = writer.writes
    writer.stop(timeout_s=30)
    assert writer.writes == writes  # nothing counted since: not written again


def test_the_checkpoint_age_counts_from_the_newest_write_or_the_restored_checkpoint(tmp_path: Path) -> None:
    writer = Checkpointer(Shard(ServerConfig()), tmp_path, every_s=3600, every_versions=0)
    assert writer.age_s() is None  # nothing written, nothing restored
    run_and_stop(JobSpec(lr=0.5, num_workers=2), tmp_path, 0, 2)
    restored = Shard(ServerConfig())
    snap = checkpoint.load_latest(tmp_path, print)
    assert snap is not None
    restored.restore(snap)
    written = checkpoint.manifest_of(tmp_path, snap.version).stat().st_mtime
    before = time.time()
    age = Checkpointer(restored, tmp_path, every_s=3600, every_versions=0).age_s()
    assert age is not None and before - written <= age <= time.time() - written


def test_sync_writes_only_the_iterations_every_shard_checkpoints(tmp_path: Path) -> None:
    spec = JobSpec(mode="sync", lr=0.5, num_shards=2, num_workers=2)
    versions, _ = run_and_stop(spec, tmp_path, 2, 5)
    # Not the final 5: another shard may not have it to roll back to. (Version 2 is offered too, but
    # a writer slower than the pushes writes only the newest snapshot offered: on a busy machine 2
    # may be passed over for 4.)
    assert versions in ([4, 2], [4])


def test_sync_without_every_versions_warns_that_a_restart_rolls_back_to_the_start(tmp_path: Path) -> None:
    layout = make_layout(JobSpec(mode="sync", lr=0.5, num_shards=2, num_workers=2))
    s = Shard(ServerConfig())
    warnings: list[str] = []
    writer = Checkpointer(s, tmp_path, every_s=3600, every_versions=0, warn=warnings.append)
    writer.start()
    s.initialize(0, layout, weights_for(layout))
    s.join(1, layout)
    for rank in (0, 1):
        push(s, layout, grad(layout, rank), rank=rank, clock=0)
    writer.stop(timeout_s=30)
    assert checkpoint.versions(tmp_path) == [0]  # version 0, with both workers, and nothing later
    assert [m.rank for m in checkpoint.load_version(tmp_path, 0).members] == [0, 1]
    assert len(warnings) == 1 and "--checkpoint-every-versions" in warnings[0]


def test_the_roll_back_source_reads_what_is_on_disk_and_what_is_not_written_yet(tmp_path: Path) -> None:
    spec = JobSpec(mode="sync", lr=0.5, num_shards=2, num_workers=2)
    s, layout = started(spec)
    writer = Checkpointer(s, tmp_path, every_s=3600, every_versions=1)  # never started: offers stay in memory
    for rank in (0, 1):
        push(s, layout, grad(layout, rank), rank=rank, clock=0)
    assert writer.versions() == [1] and checkpoint.versions(tmp_path) == []
    held = writer.load(1)
    assert held is not None and torch.equal(held.weights, s.weights_copy())
    checkpoint.save(s.snapshot(), tmp_path)
    assert writer.versions() == [1]
    warned: list[str] = []
    other = Checkpointer(s, tmp_path, every_s=3600, every_versions=0, warn=warned.append)
    loaded = other.load(1)
    assert loaded is not None and loaded.version == 1 and torch.equal(loaded.weights, s.weights_copy())
    assert other.load(7) is None and "version 7" in warned[0]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_full_disk_is_logged_once_retried_every_interval_and_reported_until_a_checkpoint_is_written(
    small_disk: SmallDisk, mode: str,
) -> None:
    # The writer caught OSError alone: safetensors' own error killed its thread, and nothing was
    # checkpointed again, even after the space came back.
    s, layout = started(JobSpec(mode=mode, lr=0.5, num_shards=2, num_workers=2))
    warnings: list[str] = []
    notes: list[str] = []
    writer = Checkpointer(s, small_disk.path, every_s=0.05, every_versions=1, warn=warnings.append, note=notes.append)
    writer.start()
    try:
        push(s, layout, grad(layout, 0), rank=0, clock=0)
        push(s, layout, grad(layout, 1), rank=1, clock=0)
        wait_for("the first checkpoint", lambda: writer.written_version == s.version)
        small_disk.fill()
        for rank in (0, 1):
            push(s, layout, grad(layout, 2 + rank), rank=rank, clock=1)
        version = s.version
        wait_for("three failed writes", lambda: s.status().checkpoint.failures >= 3)
        failing = s.status().checkpoint
        print(f"disk full: {failing}; logged: {warnings}")
        assert failing.failing and failing.version == version - (2 if mode == "async" else 1)
        assert "No space left on device" in failing.last_error
        assert len(warnings) == 1 and "No space left on device" in warnings[0] and "retried every 0.05 s" in warnings[0]
        assert version in writer.versions()  # a sync roll-back can still return to it (held in memory)
        small_disk.free()
        wait_for("a checkpoint after the disk was freed", lambda: writer.written_version == version)
        recovered = s.status().checkpoint
        print(f"disk freed: {recovered}; logged: {notes}")
        assert not recovered.failing and recovered.version == version and recovered.failures >= failing.failures
        assert len(warnings) == 1 and len(notes) == 1 and "written again" in notes[0]
    finally:
        writer.stop(timeout_s=30)
    snap = checkpoint.load_latest(small_disk.path, print)
    assert snap is not None and snap.version == version
