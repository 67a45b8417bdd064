"""Killing a server loses nothing but the updates since its last checkpoint: real processes, kill -9,
restart with the same --checkpoint-dir, workers ride it out; damaged checkpoints refused by name;
the model exported and saved."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import once_per_run, run_benchmark, run_cli, spawn
from psgrad.tasks import get_task


@pytest.fixture(scope="module")
def restart_rows(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:  # type: ignore[type-arg]
    """benchmarks/faults.py --fault server --preset tiny: per mode, a run with server 0 killed (-9) and
    restarted, and an uninterrupted one with the same seed."""
    out = once_per_run("faults-server-tiny", lambda: run_benchmark("faults.py", "--fault", "server", "--preset", "tiny",
                                                                   timeout_s=400), tmp_path_factory)
    assert out["benchmark"] == "server_restart" and out["fault"] == "server"
    return {row["mode"]: row for row in out["results"]}


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_an_async_job_survives_kill_9_of_a_server_restarted_from_its_checkpoints(restart_rows) -> None:  # type: ignore[no-untyped-def]
    row = restart_rows["async"]
    killed = row["with_kill"]
    assert killed["versions"][0] > 0
    assert killed["updates_lost"][1] == 0 and killed["updates_lost"][0] >= 0  # only the killed shard loses any
    # worker 0 was mid-run at the kill; the others may have finished by then (async: None)
    assert killed["stall_s"][0] is not None and all(s is None or 0 < s < 60 for s in killed["stall_s"])
    assert min(killed["final_accuracy"]) > 0.5


@pytest.mark.slow
@pytest.mark.timeout(450)
def test_a_sync_job_rolls_back_after_kill_9_and_ends_bitwise_equal_to_an_uninterrupted_run(restart_rows) -> None:  # type: ignore[no-untyped-def]
    row = restart_rows["sync"]
    killed = row["with_kill"]
    assert row["final_weights_bitwise_equal"] == [True, True, True] and row["final_weights_max_abs_diff"] == 0.0
    assert row["final_servers_bitwise_equal"]
    # the kill came at worker 0's step 30; checkpoints every 20 iterations: every worker rolled
    # back alike, to the iteration the restarted shard restored (20, or 0 if 20 was not yet
    # written), and the other shard undid the iterations past it (no roll-back is needed only if
    # the job was exactly at a checkpointed iteration when the shard died)
    [targets] = {tuple(t) for t in killed["worker_rollbacks_to"]}
    assert all(t % 20 == 0 for t in targets) and len(targets) <= 1
    assert (killed["rolled_back"][1] > 0) == bool(targets) and killed["versions"] == [60, 60]
    assert all(s is not None and 0 < s < 60 for s in killed["stall_s"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_sync_job_with_embedding_rows_on_the_servers_ends_bitwise_equal_after_kill_9(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Task ctr (its embedding table on the servers): kill -9 of a server holding sparse rows, restart
    from its checkpoint, roll back: every worker's model and the servers' rows end bit for bit as in
    the run without the kill."""
    monkeypatch.setenv("PSGRAD_CTR_ROWS", "200000")  # (the children inherit it)
    monkeypatch.setenv("PSGRAD_CTR_DIM", "16")
    out = run_benchmark("faults.py", "--fault", "server", "--preset", "tiny", "--modes", "sync", "--task", "ctr",
                        timeout_s=280)
    [row] = out["results"]
    assert out["task"] == "ctr" and row["mode"] == "sync"
    assert row["final_weights_bitwise_equal"] == [True, True, True] and row["final_servers_bitwise_equal"]
    killed = row["with_kill"]
    assert killed["versions"] == [60, 60] and all(s is not None and 0 < s < 60 for s in killed["stall_s"])
    [targets] = {tuple(t) for t in killed["worker_rollbacks_to"]}
    assert all(t % 20 == 0 for t in targets)


def _checkpointed_job(tmp_path: Path, start_servers) -> tuple[str, Path]:  # type: ignore[no-untyped-def]
    ckpt = tmp_path / "ckpt"
    [address] = start_servers(1, "--checkpoint-dir", str(ckpt), "--checkpoint-every-versions", "10")
    model = tmp_path / "model.pt"
    res = run_cli(["worker", "--servers", address, "--steps", "30", "--eval-every", "30", "--save-model", str(model),
                   "--metrics-out", str(tmp_path / "w0.jsonl")])
    assert res.returncode == 0, res.stderr
    return address, model


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_export_and_save_model_give_the_model_the_worker_evaluated(tmp_path: Path, start_servers) -> None:  # type: ignore[no-untyped-def]
    address, saved = _checkpointed_job(tmp_path, start_servers)
    out = tmp_path / "export.pt"
    res = run_cli(["export", "--servers", address, "--out", str(out)])
    assert res.returncode == 0, res.stderr
    assert "wrote 4 tensors (9,610 values) at shard versions [30] to" in res.stdout, res.stdout
    exported, model_state = torch.load(out), torch.load(saved)
    assert list(exported) == list(model_state) and all(torch.equal(exported[k], model_state[k]) for k in exported)
    task = get_task("digits")
    model = task.build_model()
    model.load_state_dict(exported)
    final = [json.loads(line) for line in (tmp_path / "w0.jsonl").read_text().splitlines()][-1]
    with torch.no_grad():
        accuracy = float((model(task.test_x).argmax(1) == task.test_y).float().mean())
    assert accuracy == pytest.approx(final["test_accuracy"])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_restarted_server_refuses_damaged_checkpoints_by_name(tmp_path: Path, start_servers, server_procs) -> None:  # type: ignore[no-untyped-def]
    _checkpointed_job(tmp_path, start_servers)
    server_procs[0].stop()
    ckpt = tmp_path / "ckpt"
    manifests = sorted(ckpt.glob("*.json"))
    assert len(manifests) == 2  # the newest two are kept
    newest = manifests[-1].with_suffix(".safetensors")
    newest.write_bytes(newest.read_bytes()[:-10])
    again = spawn(["server", "--port", "0", "--checkpoint-dir", str(ckpt)])
    server_procs.append(again)
    again.wait_for_line("psgrad server listening on ")
    assert f"{newest}" in again.output and "skipping a damaged checkpoint" in again.output
    assert f"restored shard 0 at version {manifests[0].stem.removeprefix('ckpt-v').lstrip('0')}" in again.output
    again.stop()
    manifests[0].with_suffix(".safetensors").write_bytes(b"garbage")
    res = run_cli(["server", "--port", "0", "--checkpoint-dir", str(ckpt)], timeout_s=60)
    assert res.returncode == 1 and "refusing to start empty" in res.stderr


def test_a_checkpoint_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("x")
    res = run_cli(["server", "--port", "0", "--checkpoint-dir", str(path)], timeout_s=60)
    assert res.returncode != 0 and str(path) in res.stderr
