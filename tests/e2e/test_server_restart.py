"""Killing a server loses nothing but the updates since its last checkpoint: real processes, kill -9,
restart with the same --checkpoint-dir, workers ride it out; damaged checkpoints refused by name;
the model exported and saved (those two share one checkpointed job)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import once_per_run, run_benchmark, run_cli, spawn
from psgrad.tasks import get_task


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_async_job_survives_kill_9_of_a_server_restarted_from_its_checkpoints() -> None:
    """benchmarks/faults.py --fault server --preset tiny --modes async: a run with server 0 killed (-9)
    and restarted, and an uninterrupted one with the same seed. (The preset's sync mode is the next
    test's, on task ctr: its dense weights and its servers' embedding rows.)"""
    out = run_benchmark("faults.py", "--fault", "server", "--preset", "tiny", "--modes", "async", timeout_s=280)
    assert out["benchmark"] == "server_restart" and out["fault"] == "server"
    [row] = out["results"]
    assert row["mode"] == "async"
    killed = row["with_kill"]
    assert killed["versions"][0] > 0
    assert killed["updates_lost"][1] == 0 and killed["updates_lost"][0] >= 0  # only the killed shard loses any
    # worker 0 was mid-run at the kill; the others may have finished by then (async: None)
    assert killed["stall_s"][0] is not None and all(s is None or 0 < s < 60 for s in killed["stall_s"])
    assert min(killed["final_accuracy"]) > 0.5


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_sync_job_with_embedding_rows_on_the_servers_ends_bitwise_equal_after_kill_9(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Task ctr (its embedding table on the servers, besides its dense weights): kill -9 of a server
    holding sparse rows, restart from its checkpoint, roll back: every worker's model and the servers'
    rows end bit for bit as in the run without the kill. (This is the server fault's sync test; the
    same run on task digits, which has dense weights only, checked nothing this one does not.)"""
    monkeypatch.setenv("PSGRAD_CTR_ROWS", "200000")  # (the children inherit it)
    monkeypatch.setenv("PSGRAD_CTR_DIM", "16")
    out = run_benchmark("faults.py", "--fault", "server", "--preset", "tiny", "--modes", "sync", "--task", "ctr",
                        timeout_s=280)
    [row] = out["results"]
    assert out["task"] == "ctr" and row["mode"] == "sync"
    assert row["final_weights_bitwise_equal"] == [True, True, True] and row["final_weights_max_abs_diff"] == 0.0
    assert row["final_servers_bitwise_equal"]
    killed = row["with_kill"]
    # the kill came at worker 0's step 30; checkpoints every 20 iterations: every worker rolled
    # back alike, to the iteration the restarted shard restored (20, or 0 if 20 was not yet
    # written), and the other shard undid the iterations past it (no roll-back is needed only if
    # the job was exactly at a checkpointed iteration when the shard died)
    [targets] = {tuple(t) for t in killed["worker_rollbacks_to"]}
    assert all(t % 20 == 0 for t in targets) and len(targets) <= 1
    assert (killed["rolled_back"][1] > 0) == bool(targets) and killed["versions"] == [60, 60]
    assert all(s is not None and 0 < s < 60 for s in killed["stall_s"])


def _checkpointed_job(where: Path) -> dict[str, Any]:
    """A real server checkpointing into where/ckpt every 10 versions, one worker's 30 steps (its
    final model saved, its records written), `psgrad export` of the server's model, then the server
    stopped: what the export and the damaged-checkpoint tests start from."""
    ckpt = where / "ckpt"
    proc = spawn(["server", "--host", "127.0.0.1", "--port", "0", "--checkpoint-dir", str(ckpt),
                  "--checkpoint-every-versions", "10"])
    try:
        address = proc.wait_for_line("psgrad server listening on ").rsplit(" ", 1)[1]
        model, records, exported = where / "model.pt", where / "w0.jsonl", where / "export.pt"
        res = run_cli(["worker", "--servers", address, "--steps", "30", "--eval-every", "30", "--save-model", str(model),
                       "--metrics-out", str(records)])
        assert res.returncode == 0, res.stderr
        export = run_cli(["export", "--servers", address, "--out", str(exported)])
    finally:
        proc.stop()
    return {"ckpt": str(ckpt), "model": str(model), "records": str(records), "export": str(exported),
            "export_rc": export.returncode, "export_stdout": export.stdout, "export_stderr": export.stderr}


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """_checkpointed_job once per test run (shared across xdist workers; its files stay in the run's
    temporary directory, and a test that changes them works on a copy)."""
    return once_per_run("checkpointed-job", lambda: _checkpointed_job(tmp_path_factory.mktemp("checkpointed")),
                        tmp_path_factory)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_export_and_save_model_give_the_model_the_worker_evaluated(checkpointed: dict[str, Any]) -> None:
    assert checkpointed["export_rc"] == 0, checkpointed["export_stderr"]
    stdout = checkpointed["export_stdout"]
    assert "wrote 4 tensors (9,610 values) at shard versions [30] to" in stdout, stdout
    exported, model_state = torch.load(checkpointed["export"]), torch.load(checkpointed["model"])
    assert list(exported) == list(model_state) and all(torch.equal(exported[k], model_state[k]) for k in exported)
    task = get_task("digits")
    model = task.build_model()
    model.load_state_dict(exported)
    final = [json.loads(line) for line in Path(checkpointed["records"]).read_text().splitlines()][-1]
    with torch.no_grad():
        accuracy = float((model(task.test_x).argmax(1) == task.test_y).float().mean())
    assert accuracy == pytest.approx(final["test_accuracy"])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_restarted_server_refuses_damaged_checkpoints_by_name(tmp_path: Path, checkpointed: dict[str, Any],
                                                                 server_procs) -> None:  # type: ignore[no-untyped-def]
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpointed["ckpt"], ckpt)  # the job's own files stay as they were
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


@pytest.mark.timeout(180)
def test_a_second_server_on_the_same_checkpoint_dir_is_refused_until_the_first_is_gone(tmp_path: Path) -> None:
    """Two servers given one --checkpoint-dir overwrote each other's checkpoints (one shard's lost, a
    restart restored the other's): the second is refused, naming the first; once the first is killed
    (-9: the kernel lets its hold go), a server takes the directory."""
    ckpt = str(tmp_path / "ckpt")
    first = spawn(["server", "--port", "0", "--checkpoint-dir", ckpt])
    try:
        first.wait_for_line("listening on", timeout_s=120)
        res = run_cli(["server", "--port", "0", "--checkpoint-dir", ckpt], timeout_s=60)
        assert res.returncode == 2, res.stdout + res.stderr
        assert f"--checkpoint-dir {ckpt} is in use by another server (pid {first.popen.pid} " in res.stderr, res.stderr
        assert "listening" not in res.stdout
    finally:
        first.popen.kill()
        first.wait(60)
    again = spawn(["server", "--port", "0", "--checkpoint-dir", ckpt])
    try:
        again.wait_for_line("listening on", timeout_s=120)
    finally:
        assert again.stop() == 0, again.output


# What `psgrad status --json` shows of a shard's counters, and of its sparse tables'.
COUNTERS = ("version", "pushes_applied", "pushes_duplicate", "pushes_rejected", "pulls", "evictions", "updates_lost",
            "rolled_back", "late_dropped", "pushes_plain", "staleness")
TABLE_COUNTERS = ("updates", "staleness_max", "staleness_mean", "rows_touched", "admitted")


def _counters(address: str) -> dict[str, Any]:
    res = run_cli(["status", "--servers", address, "--json"], timeout_s=60)
    assert res.returncode == 0, res.stderr
    [shard] = json.loads(res.stdout)["shards"]
    tables = {t["name"]: {k: t[k] for k in TABLE_COUNTERS} for t in shard["tables"] if t["kind"] == "sparse"}
    return {**{k: shard[k] for k in COUNTERS}, "MB": (shard["bytes_in"], shard["bytes_out"]), "tables": tables}


@pytest.mark.timeout(240)
def test_a_server_restored_from_its_checkpoint_continues_the_counters_psgrad_status_shows(
        tmp_path: Path, server_procs) -> None:  # type: ignore[no-untyped-def]
    """Before: a server started again on its --checkpoint-dir showed 0 pushes applied, an empty
    staleness histogram and 0 staleness for every table, whatever the job had done. A real server
    trains an async job with an embedding table on it (rows pushed at older table versions, so
    their staleness is not 0; a retried push), is stopped (its last checkpoint), and a fresh
    process restored from the directory shows the same counters in `psgrad status`."""
    from torch import nn

    import psgrad
    from psgrad.config import ClientConfig

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = psgrad.Embedding(1000, 8)
            self.head = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(x)).sum()

    args = ["server", "--host", "127.0.0.1", "--port", "0", "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--checkpoint-every-s", "3600"]  # (its checkpoints: the chief's init, and the last one at its stop)
    first = spawn(args)
    server_procs.append(first)
    address = first.wait_for_line("psgrad server listening on ").rsplit(" ", 1)[1]
    client = ClientConfig(rpc_timeout_s=60, reconnect_timeout_s=0, shared_memory=False)
    model = Model()
    with psgrad.connect([address], mode="async", optimizer=psgrad.SGD(lr=0.1), client=client) as ps:
        opt = ps.optimizer(model)
        for step in range(6):
            opt.zero_grad()
            model(torch.tensor([[step, 10 + step, 500]])).backward()
            opt.step()
        table, raw = model.emb.table, opt.client
        assert table
        ids = torch.tensor([3, 4, 5])
        raw.pull_rows(table, ids)  # the rows at one table version, pushed three times: staleness 0, 1, 2
        for k in range(3):
            raw.push(torch.zeros(raw.plan.total), opt.clock + k, rows={table: (ids, torch.full((3, 8), 0.01))})
        assert not raw.push(torch.zeros(raw.plan.total), opt.clock + 2)[0].applied  # a retry: a duplicate
    before = _counters(address)
    assert before["pushes_applied"] == 9 and before["pushes_duplicate"] == 1 and before["version"] == 9
    assert sum(before["staleness"]["histogram"].values()) == 9 and before["staleness"]["max"] >= 2
    assert before["tables"][table]["staleness_max"] == 2 and before["tables"][table]["updates"] == 9
    assert first.stop() == 0
    again = spawn(args)
    server_procs.append(again)
    restarted = again.wait_for_line("psgrad server listening on ").rsplit(" ", 1)[1]
    assert "restored shard 0 at version 9" in again.output, again.output
    assert _counters(restarted) == before
