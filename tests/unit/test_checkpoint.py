"""Shard checkpoints on disk: exact round trip, atomic replacement, the newest two kept, and damaged
files refused by name with a fall back to the previous checkpoint."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from psgrad.config import JobSpec, ServerConfig
from psgrad.errors import CheckpointError, InvalidRequestError
from psgrad.server import checkpoint
from psgrad.server.shard import Shard
from test_shard import push
from test_state import grad, started
from conftest import SmallDisk

pytestmark = pytest.mark.timeout(60)

SPEC = JobSpec(optimizer="adam", lr=0.01, num_shards=2, num_workers=2)


# Each server optimizer with state: its state must come back from disk for the shard to continue exactly.
OPTIMIZER_SPECS = {
    "adam": SPEC,
    "nesterov": JobSpec(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, num_shards=2, num_workers=2),
    "adagrad": JobSpec(optimizer="adagrad", lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1, num_shards=2,
                       num_workers=2),
    "rmsprop": JobSpec(optimizer="rmsprop", lr=0.01, momentum=0.9, centered=True, num_shards=2, num_workers=2),
    "adadelta": JobSpec(optimizer="adadelta", lr=1.0, weight_decay=0.01, num_shards=2, num_workers=2),
}


def trained(steps: int, spec: JobSpec = SPEC) -> tuple[Shard, object]:
    s, layout = started(spec)
    for clock in range(steps):
        push(s, layout, grad(layout, clock), rank=clock % 2, clock=clock // 2)
    return s, layout


@pytest.mark.parametrize("optimizer", OPTIMIZER_SPECS)
def test_a_checkpoint_reads_back_exactly_and_a_shard_restored_from_it_continues_bit_for_bit(
    tmp_path: Path, optimizer: str
) -> None:
    s, layout = trained(5, OPTIMIZER_SPECS[optimizer])
    snap = s.snapshot()
    path = checkpoint.save(snap, tmp_path)
    back = checkpoint.load(path)
    assert back.layout == snap.layout and back.version == 5 and back.members == snap.members
    assert torch.equal(back.weights, snap.weights)
    assert back.optimizer.keys() == snap.optimizer.keys() and any(isinstance(v, torch.Tensor) for v in back.optimizer.values())
    for key, value in snap.optimizer.items():
        assert torch.equal(back.optimizer[key], value) if isinstance(value, torch.Tensor) else back.optimizer[key] == value  # type: ignore[arg-type]
    restored = Shard(ServerConfig())
    restored.restore(back)
    for shard in (s, restored):
        push(shard, layout, grad(layout, 99), rank=1, clock=2)  # type: ignore[arg-type]
    assert torch.equal(s.weights_copy(), restored.weights_copy())


def test_the_newest_two_are_kept_and_no_temporary_file_is_left(tmp_path: Path) -> None:
    s, layout = trained(1)
    for clock in range(4):
        checkpoint.save(s.snapshot(), tmp_path)
        push(s, layout, grad(layout, clock), rank=0, clock=1 + clock)  # type: ignore[arg-type]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "ckpt-v000000000003.json", "ckpt-v000000000003.safetensors",
        "ckpt-v000000000004.json", "ckpt-v000000000004.safetensors",
    ]


def test_a_full_disk_is_a_checkpoint_error_that_leaves_the_previous_checkpoint_and_no_temporary_file(
    small_disk: SmallDisk,
) -> None:
    # safetensors raises its own SafetensorError (not OSError) when a write fails: it escaped save().
    s, layout = trained(2)
    directory = small_disk.path / "ckpt"
    first = checkpoint.save(s.snapshot(), directory)
    push(s, layout, grad(layout, 7), rank=0, clock=1)  # type: ignore[arg-type]
    small_disk.fill()
    with pytest.raises(CheckpointError, match="No space left on device") as refused:
        checkpoint.save(s.snapshot(), directory)
    print(f"a full disk: {refused.value}")
    assert sorted(p.name for p in directory.iterdir()) == [first.name, first.with_suffix(".safetensors").name]
    snap = checkpoint.load_latest(directory, print)
    assert snap is not None and snap.version == 2
    small_disk.free()
    assert checkpoint.save(s.snapshot(), directory).name == "ckpt-v000000000003.json"


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest", "missing"])
def test_a_damaged_newest_checkpoint_is_refused_by_name_and_the_previous_one_used(tmp_path: Path, damage: str) -> None:
    s, layout = trained(2)
    checkpoint.save(s.snapshot(), tmp_path)
    push(s, layout, grad(layout, 7), rank=0, clock=1)  # type: ignore[arg-type]
    newest = checkpoint.save(s.snapshot(), tmp_path)
    data = newest.with_suffix(".safetensors")
    if damage == "truncate":
        data.write_bytes(data.read_bytes()[:-100])
    elif damage == "flip":
        raw = bytearray(data.read_bytes())
        raw[-5] ^= 0xFF
        data.write_bytes(bytes(raw))
    elif damage == "manifest":
        newest.write_text('{"format": "psgrad-shard-checkpoint", "format_vers')
    else:
        data.unlink()
    warnings: list[str] = []
    snap = checkpoint.load_latest(tmp_path, warnings.append)
    assert snap is not None and snap.version == 2
    assert len(warnings) == 1 and newest.stem in warnings[0]


def test_no_readable_checkpoint_refuses_to_start_empty(tmp_path: Path) -> None:
    s, _ = trained(1)
    only = checkpoint.save(s.snapshot(), tmp_path)
    only.with_suffix(".safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="refusing to start empty"):
        checkpoint.load_latest(tmp_path, lambda _: None)


def test_an_empty_or_missing_directory_holds_no_checkpoint(tmp_path: Path) -> None:
    assert checkpoint.load_latest(tmp_path, lambda _: None) is None
    assert checkpoint.load_latest(tmp_path / "nowhere", lambda _: None) is None
    assert (tmp_path / "nowhere").is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="cannot use .*file as a checkpoint directory"):
        checkpoint.load_latest(tmp_path / "file", lambda _: None)


def test_a_file_in_the_checkpoint_directorys_place_is_named_as_a_file(tmp_path: Path) -> None:
    """A regular file given as --checkpoint-dir said "[Errno 17] File exists"."""
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError) as info:
        checkpoint.load_latest(tmp_path / "file", lambda _: None)
    assert str(info.value) == (f"cannot use {tmp_path / 'file'} as a checkpoint directory: it is a file, not a folder; "
                               "give the path of a folder (made if missing), or move the file away")
    with pytest.raises(CheckpointError, match=f"^cannot use {tmp_path / 'file' / 'shard0'} as a checkpoint directory: "
                                              f"{tmp_path / 'file'} is a file, not a folder; give the path of a folder"):
        checkpoint.load_latest(tmp_path / "file" / "shard0", lambda _: None)


def test_another_files_json_is_not_taken_for_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "ckpt-v000000000009.json").write_text('{"format": "something-else"}')
    with pytest.raises(CheckpointError, match="not a psgrad shard checkpoint"):
        checkpoint.load_latest(tmp_path, lambda _: None)


def test_updates_applied_after_the_checkpoint_are_counted_as_lost_when_their_worker_returns() -> None:
    s, layout = trained(4)  # ranks 0 and 1 pushed clocks 0 and 1
    snap = s.snapshot()
    for clock in (2, 3, 4):
        push(s, layout, grad(layout, clock), rank=0, clock=clock)  # type: ignore[arg-type]
    restored = Shard(ServerConfig())
    restored.restore(snap)
    assert push(restored, layout, grad(layout, 5), rank=0, clock=5).applied  # type: ignore[arg-type]
    assert push(restored, layout, grad(layout, 6), rank=1, clock=2).applied  # type: ignore[arg-type]
    assert restored.status().updates_lost == 3  # rank 0's clocks 2, 3, 4; rank 1 lost nothing


def counters_of(shard: Shard) -> dict[str, object]:
    """What `psgrad status` shows of a shard's counters."""
    st = shard.status()
    names = ("pushes_applied", "pushes_duplicate", "pushes_rejected", "pulls", "bytes_in", "bytes_out", "evictions",
             "updates_lost", "rolled_back", "late_dropped", "pushes_plain", "pushes_skipped")
    return {**{n: getattr(st, n) for n in names}, "staleness": dict(st.staleness)}


def test_a_restored_shard_continues_the_counters_its_checkpoint_kept_and_an_older_one_starts_them_at_0(
        tmp_path: Path) -> None:
    """Before: a shard restored from a checkpoint counted pushes applied, the staleness histogram and
    the rest from 0 again (`psgrad status` after a restart showed 0 pushes applied). A checkpoint
    keeps them now; one written by an older psgrad (no counters) restores with them at 0."""
    import json

    s, layout = trained(6)
    push(s, layout, grad(layout, 9), rank=1, clock=2)  # type: ignore[arg-type]  # (a retry: a duplicate)
    push(s, layout, grad(layout, 10), rank=0, clock=3, base_version=1)  # type: ignore[arg-type]  # (stale by 5)
    with pytest.raises(InvalidRequestError):
        push(s, layout, grad(layout, 11), rank=0, clock=9)  # type: ignore[arg-type]  # (a clock ahead: rejected)
    s.pull_frames(0, 4, layout.fingerprint)[1].close()  # type: ignore[index, union-attr, attr-defined]
    before = counters_of(s)
    assert before["pushes_applied"] == 7 and before["pushes_duplicate"] == 1 and before["pushes_rejected"] == 1
    assert before["pulls"] == 1 and before["staleness"] == {0: 6, 5: 1}
    path = checkpoint.save(s.snapshot(), tmp_path)
    restored = Shard(ServerConfig())
    restored.restore(checkpoint.load(path))
    assert counters_of(restored) == before
    assert push(restored, layout, grad(layout, 12), rank=1, clock=3).applied  # type: ignore[arg-type]
    assert counters_of(restored)["pushes_applied"] == 8  # and it counts on
    # A checkpoint of an older psgrad: no counters; it restores, counting from 0.
    meta = json.loads(path.read_text())
    assert meta["counters"]["pushes_applied"] == 7 and meta["counters"]["staleness"] == {"0": 6, "5": 1}
    del meta["counters"]
    path.write_text(json.dumps(meta))
    older = Shard(ServerConfig())
    older.restore(checkpoint.load(path))
    assert older.version == s.version and counters_of(older) == counters_of(Shard(ServerConfig()))
    assert push(older, layout, grad(layout, 12), rank=1, clock=3).applied  # type: ignore[arg-type]
    assert older.status().pushes_applied == 1 and older.status().staleness == {0: 1}


def test_a_snapshot_taken_as_an_update_is_applied_counts_its_pushes() -> None:
    """A sync checkpoint is taken by the update that brings the version to a multiple of
    --checkpoint-every-versions: its pushes are counted before (they were counted after, so a shard
    restored from it showed one iteration's pushes fewer than the shard had applied)."""
    spec = JobSpec(mode="sync", lr=0.5, num_shards=2, num_workers=2)
    s, layout = started(spec)
    taken: list[tuple[int, int]] = []
    s.snapshot_at_multiples(2, lambda snap: taken.append((snap.version, snap.counters["pushes_applied"])))
    for clock in range(4):
        for rank in (0, 1):
            push(s, layout, grad(layout, clock), rank=rank, clock=clock)  # type: ignore[arg-type]
    assert taken == [(2, 4), (4, 8)]
    a, alayout = trained(3)
    a.snapshot_at_multiples(1, lambda snap: taken.append((snap.version, snap.counters["pushes_applied"])))
    push(a, alayout, grad(alayout, 3), rank=1, clock=1)  # type: ignore[arg-type]
    assert taken[-1] == (4, 4)


def test_sync_shards_snapshot_at_the_same_iterations_with_nothing_buffered() -> None:
    spec = JobSpec(mode="sync", lr=0.5, num_shards=2, num_workers=2)
    s, layout = started(spec)
    taken: list[tuple[int, int]] = []
    s.snapshot_at_multiples(2, lambda snap: taken.append((snap.version, max(m.last_push_clock for m in snap.members))))
    for clock in range(5):
        for rank in (0, 1):
            push(s, layout, grad(layout, clock), rank=rank, clock=clock)  # type: ignore[arg-type]
    assert taken == [(2, 1), (4, 3)]


def test_a_restored_shard_takes_gradients_computed_on_weights_it_lost() -> None:
    """Workers pulled versions the restart lost; their next gradients apply (as fresh), while a
    shard never restored still refuses a base version from its future."""
    s, layout = trained(2)
    snap = s.snapshot()
    restored = Shard(ServerConfig())
    restored.restore(snap)
    result = push(restored, layout, grad(layout, 3), rank=0, clock=5, base_version=9)  # type: ignore[arg-type]
    assert result.applied and result.staleness == 0 and restored.version == 3
    with pytest.raises(InvalidRequestError, match="newer than shard version"):
        push(s, layout, grad(layout, 3), rank=0, clock=5, base_version=9)  # type: ignore[arg-type]


def test_the_chiefs_initialization_is_the_first_snapshot() -> None:
    from test_shard import make_layout, weights_for

    taken = []
    s = Shard(ServerConfig())
    s.snapshot_at_multiples(0, taken.append)
    layout = make_layout(SPEC)
    s.initialize(0, layout, weights_for(layout))
    push(s, layout, grad(layout, 0))
    assert [snap.version for snap in taken] == [0] and torch.equal(taken[0].weights, weights_for(layout))


def test_a_shard_restored_from_another_jobs_checkpoint_refuses_this_jobs_workers_by_field(tmp_path: Path) -> None:
    """A --checkpoint-dir that holds another job's shard: the server restores that job, and the
    first worker of this one is refused naming what differs; nothing is overwritten."""
    from dataclasses import replace

    from psgrad.errors import JobMismatchError
    from test_shard import make_layout

    s, _ = trained(3)
    path = checkpoint.save(s.snapshot(), tmp_path)
    restored = Shard(ServerConfig())
    restored.restore(checkpoint.load(path))
    ours = make_layout(replace(SPEC, lr=0.05))
    with pytest.raises(JobMismatchError, match="lr: shard has 0.01, worker rank 0 sent 0.05"):
        restored.join(0, ours)
    with pytest.raises(JobMismatchError):
        restored.initialize(0, ours, torch.zeros(ours.numel))
    assert restored.version == 3 and checkpoint.versions(tmp_path) == [3]


def test_a_snapshot_encoded_in_memory_decodes_exactly_and_garbage_is_refused() -> None:
    s, _ = trained(5)
    snap = s.snapshot()
    manifest, data = checkpoint.encode(snap)
    back = checkpoint.decode(manifest, data)
    assert back.layout == snap.layout and back.version == 5 and back.members == snap.members
    assert torch.equal(back.weights, snap.weights)
    assert back.optimizer.keys() == snap.optimizer.keys() and any(isinstance(v, torch.Tensor) for v in back.optimizer.values())
    for key, value in snap.optimizer.items():
        assert torch.equal(back.optimizer[key], value) if isinstance(value, torch.Tensor) else back.optimizer[key] == value  # type: ignore[arg-type]
    with pytest.raises(CheckpointError, match="not a psgrad shard snapshot"):
        checkpoint.decode(b"{}", data)
    with pytest.raises(CheckpointError, match="cannot read a snapshot"):
        checkpoint.decode(manifest, data[:-10])


def test_a_checkpoint_holds_the_shard_table_by_table_and_a_first_format_one_still_reads(tmp_path: Path) -> None:
    """Format 2 writes each table's kind, tensors and scalars (the dense table's tensors keep the first
    format's names); a checkpoint of the first format (the dense range alone, the job's lr among the
    optimizer's scalars) still restores the same shard."""
    import json

    s, layout = trained(5, OPTIMIZER_SPECS["nesterov"])
    s.core.state.set_job_lr(0.05, 4)  # type: ignore[union-attr]
    snap = s.snapshot()
    path = checkpoint.save(snap, tmp_path / "v2")
    meta = json.loads(path.read_text())
    assert meta["format_version"] == 2 and meta["job"] == {"job_lr": 0.05, "job_lr_clock": 4}
    assert meta["tables"] == {"dense": {"kind": "dense", "scalars": {}, "tensors": ["optimizer.momentum_buffer", "weights"]}}
    assert sorted(meta["tensors"]["names"]) == ["optimizer.momentum_buffer", "weights"]
    # The same state as the first format wrote it.
    old = dict(meta, format_version=1, optimizer={"job_lr": 0.05, "job_lr_clock": 4})
    del old["tables"], old["job"]
    v1 = tmp_path / "v1"
    v1.mkdir()
    (v1 / Path(meta["tensors"]["file"])).write_bytes((path.parent / meta["tensors"]["file"]).read_bytes())
    (v1 / path.name).write_text(json.dumps(old))
    back = checkpoint.load(v1 / path.name)
    assert set(back.tables) == {"dense"} and back.job == {"job_lr": 0.05, "job_lr_clock": 4}
    restored = Shard(ServerConfig())
    restored.restore(back)
    assert restored.status().job_lr == 0.05 and restored.status().job_lr_clock == 4
    for shard in (s, restored):
        push(shard, layout, grad(layout, 99), rank=1, clock=2)  # type: ignore[arg-type]
    assert torch.equal(s.weights_copy(), restored.weights_copy())  # momentum came back too


def test_a_checkpoint_whose_tables_lack_a_tensor_is_refused_by_name(tmp_path: Path) -> None:
    import json

    s, _ = trained(2)
    path = checkpoint.save(s.snapshot(), tmp_path)
    meta = json.loads(path.read_text())
    meta["tables"]["dense"]["tensors"].append("optimizer.missing")
    path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="table 'dense' lacks its tensors \\['optimizer.missing'\\]"):
        checkpoint.load(path)
