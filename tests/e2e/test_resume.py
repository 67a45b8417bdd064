"""`psgrad launch --resume DIR`: a whole job, every process stopped mid-run, starts again from its
checkpoints; workers continue from their checkpointed clocks, and a sync job ends exactly where an
uninterrupted one does."""
from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from conftest import cli_in_process as cli, run_cli, spawn
from psgrad.metrics.jsonl import read_jsonl

# Every step takes at least 25 ms (--step-time-ms: a wait, no CPU), so the 70 steps after the stop's
# trigger (step 50, read from launch's relayed output) outlast that output's lag on a busy machine.
# A 60 s lease: a worker evicted on a busy machine (the 10 s default) makes a sync run that is no
# longer the uninterrupted one.
JOB = ["--num-servers", "2", "--num-workers", "2", "--mode", "sync", "--steps", "120", "--log-every", "10",
       "--eval-every", "120", "--step-time-ms", "25", "--lease-s", "60"]


def finals(metrics: Path) -> list[dict]:  # type: ignore[type-arg]
    out = []
    for path in sorted(metrics.glob("worker*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        out.append(next(r for r in reversed(records) if r.get("event") == "final"))
    return out


def events(metrics: Path) -> list[str]:
    """The workers' rejoin and rollback records: a sync run that had one is no longer the plain run."""
    return [line for path in sorted(metrics.glob("worker*.jsonl")) for line in path.read_text().splitlines()
            if '"event": "rejoin"' in line or '"event": "rollback"' in line]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_stopped_sync_job_resumes_from_its_checkpoints_and_ends_as_an_uninterrupted_one(tmp_path: Path) -> None:
    job = tmp_path / "job"
    first = spawn(["launch", *JOB, "--checkpoint-dir", str(job), "--checkpoint-every-versions", "20",
                   "--metrics-dir", str(tmp_path / "m1")])
    first.wait_for_line("worker 0/2: step 50/120", timeout_s=240)
    first.popen.send_signal(signal.SIGTERM)
    assert first.wait(60) == 128 + signal.SIGTERM
    assert not any("final test_loss" in line for line in first.lines)  # it was stopped mid-run
    saved = sorted(int(p.stem.removeprefix("ckpt-v")) for p in (job / "shard0").glob("ckpt-v*.json"))
    assert saved and max(saved) >= 40 and all(v % 20 == 0 for v in saved)

    resumed = run_cli(["launch", "--resume", str(job), "--metrics-dir", str(tmp_path / "m2")], timeout_s=240)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-2000:]
    assert f"resuming the job in {job}" in resumed.stdout
    assert f"restored shard 0 at version {max(saved)}" in resumed.stdout
    assert f"worker 1/2: joined 2 shard(s) at clock {max(saved)}" in resumed.stdout

    plain = run_cli(["launch", *JOB, "--metrics-dir", str(tmp_path / "m3")], timeout_s=240)
    assert plain.returncode == 0, plain.stdout[-3000:]
    got, want = finals(tmp_path / "m2"), finals(tmp_path / "m3")
    assert len(got) == len(want) == 2
    # (on a mismatch, say what each run went through: a worker evicted and joined again changes a sync run)
    said = {run: events(tmp_path / run) for run in ("m1", "m2", "m3")}
    assert [(r["test_loss"], r["test_accuracy"]) for r in got] == [(r["test_loss"], r["test_accuracy"]) for r in want], (
        said, [line for line in first.lines if "evicted" in line or "rolled back" in line or "restored" in line],
        resumed.stdout[-3000:])


@pytest.mark.timeout(120)
def test_resume_refuses_a_directory_without_a_job_and_a_new_job_refuses_one_with_a_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    res = cli(["launch", "--resume", str(tmp_path)], capsys)
    assert res.returncode == 2 and "no launch.json" in res.stderr
    (tmp_path / "launch.json").write_text(json.dumps({"format": "psgrad-launch", "argv": ["--checkpoint-dir", str(tmp_path)]}))
    res = cli(["launch", "--resume", str(tmp_path)], capsys)
    # found before anything starts: a usage error of --resume (it exited 1, a runtime failure's code)
    assert res.returncode == 2 and f"psgrad launch: error: --resume: {tmp_path}/shard0 holds no checkpoint" in res.stderr
    assert "[launch] started" not in res.stdout
    res = cli(["launch", "--checkpoint-dir", str(tmp_path), "--steps", "1"], capsys)
    assert res.returncode == 2 and f"--resume {tmp_path}" in res.stderr
    assert "[launch] started" not in res.stdout


@pytest.mark.timeout(240)
def test_a_resumed_job_keeps_its_metrics_and_says_what_it_trained_and_a_finished_one_starts_nothing(
    tmp_path: Path
) -> None:
    """Before: --resume wrote the workers' metrics files anew (the stopped run's records lost), its
    fresh workers said the restore lost none ("which held every update this worker had seen: none
    lost"), and resuming a finished job started everything to report "after 30 steps", nothing trained."""
    job, metrics = tmp_path / "job", tmp_path / "m"
    first = run_cli(["launch", "--num-servers", "1", "--num-workers", "1", "--mode", "async", "--steps", "20",
                     "--log-every", "10", "--eval-every", "20", "--checkpoint-every-versions", "10",
                     "--checkpoint-dir", str(job), "--metrics-dir", str(metrics)], timeout_s=120)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-2000:]
    resumed = run_cli(["launch", "--resume", str(job), "--steps", "30"], timeout_s=120)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-2000:]
    assert ("worker 0/1: shard 0 was restored from its checkpoint of version 20 before this worker joined"
            in resumed.stdout) and "none lost" not in resumed.stdout, resumed.stdout[-3000:]
    assert "after 30 steps (10 in this run)" in resumed.stdout
    records = read_jsonl(metrics / "worker0.jsonl")
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 31))  # the first run's 20, then 10
    assert [r["clock"] for r in records if r.get("event") == "start"] == [0, 20]
    finished = run_cli(["launch", "--resume", str(job), "--steps", "30"], timeout_s=120)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert (f"[launch] the job in {job} had already finished: its checkpoints hold every worker at clock 30 and "
            "--steps is 30, so nothing is left to train and nothing was started") in finished.stdout
    assert "[launch] started" not in finished.stdout and "final test_loss" not in finished.stdout
    assert len(read_jsonl(metrics / "worker0.jsonl")) == len(records)
