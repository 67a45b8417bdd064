"""A launched job's directory: the recorded command, what --resume adds to it, and the refusals."""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from psgrad.cli.main import resumed_launch
from psgrad.cli.parser import build_parser
from psgrad.config import JobSpec
from psgrad.errors import ConfigError
from psgrad.launch import jobdir
from psgrad.server import checkpoint
from test_state import started

pytestmark = pytest.mark.timeout(60)


def test_a_new_job_records_its_command_and_resume_replays_it_with_the_flags_given_now(tmp_path: Path) -> None:
    job = tmp_path / "job"
    jobdir.start_new(job, ["--num-servers", "2", "--checkpoint-dir", "job", "--steps", "100"])
    record = json.loads((job / "launch.json").read_text())
    assert record["argv"] == ["--num-servers", "2", "--steps", "100", "--checkpoint-dir", "."]
    argv = jobdir.resume_argv(job, ["--resume", str(job), "--steps", "300"])
    recorded = ["--num-servers", "2", "--steps", "100", "--checkpoint-dir", str(job.absolute())]
    assert argv == [*recorded, "--steps", "300"]  # argparse: the later --steps wins
    assert jobdir.resume_argv(job, [f"--resume={job}"]) == recorded


def _resumed(directory: Path) -> argparse.Namespace:
    parser = build_parser()
    ns = parser.parse_args(["launch", "--resume", str(directory)])
    ns.raw_argv = ["launch", "--resume", str(directory)]
    return resumed_launch(parser, ns)


def _checkpointed(job: Path, argv: list[str]) -> None:
    jobdir.start_new(job, argv)
    s, _ = started(JobSpec(num_shards=1, num_workers=1))
    checkpoint.save(s.snapshot(), jobdir.shard_dir(job, 0))


def test_a_copied_or_moved_job_directory_resumes_from_and_into_itself(tmp_path: Path) -> None:
    """Before: --resume DIR took the absolute --checkpoint-dir recorded in DIR/launch.json, so a copy
    resumed (and wrote its checkpoints) into the original's directory, and a moved one failed naming
    the old path. Paths inside the job's directory (--metrics-dir here) follow it too."""
    job = tmp_path / "job"
    _checkpointed(job, ["--num-servers", "1", "--checkpoint-dir", str(job), "--metrics-dir", str(job / "metrics"),
                        "--data-dir", str(tmp_path / "data")])
    copy = tmp_path / "copy"
    shutil.copytree(job, copy)
    ns = _resumed(copy)
    assert (ns.checkpoint_dir, ns.metrics_dir) == (str(copy.absolute()), str(copy.absolute() / "metrics"))
    assert ns.data_dir == str(tmp_path / "data")  # (outside the job's directory: as given)
    moved = tmp_path / "moved"
    job.rename(moved)
    assert _resumed(moved).checkpoint_dir == str(moved.absolute())


def test_a_record_written_before_with_absolute_paths_resumes_where_its_directory_is_now(tmp_path: Path) -> None:
    old, now = tmp_path / "old", tmp_path / "now"
    _checkpointed(now, [])
    (now / "launch.json").write_text(json.dumps({"format": "psgrad-launch", "argv": [
        "--num-servers", "1", f"--metrics-dir={old / 'm'}", "--tensorboard", str(tmp_path / "tb"),
        "--checkpoint-dir", str(old)]}))
    ns = _resumed(now)
    assert (ns.checkpoint_dir, ns.metrics_dir, ns.tensorboard) == (
        str(now.absolute()), str(now.absolute() / "m"), str(tmp_path / "tb"))


def test_a_directory_that_holds_a_job_is_not_reused_for_a_new_one(tmp_path: Path) -> None:
    jobdir.start_new(tmp_path, ["--steps", "1"])
    with pytest.raises(ConfigError, match="--resume"):
        jobdir.start_new(tmp_path, ["--steps", "1"])
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        jobdir.start_new(tmp_path / "file", [])


def test_a_launch_that_failed_before_any_checkpoint_leaves_the_directory_to_a_new_one(tmp_path: Path) -> None:
    """(A Ray cluster that refused the driver left a record and nothing else, and the same command then
    answered that the directory held a job's checkpoints.)"""
    jobdir.start_new(tmp_path, ["--steps", "1"])
    jobdir.forget_unstarted(tmp_path)
    jobdir.start_new(tmp_path, ["--steps", "2"])  # taken again
    (tmp_path / "shard0").mkdir()
    (tmp_path / "shard0" / "ckpt-v000000000004.json").write_text("{}")
    jobdir.forget_unstarted(tmp_path)  # a checkpoint: the record stays, for --resume
    with pytest.raises(ConfigError, match="--resume"):
        jobdir.start_new(tmp_path, ["--steps", "1"])


def test_resume_refusals_name_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no launch.json"):
        jobdir.resume_argv(tmp_path, [])
    (tmp_path / "launch.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        jobdir.resume_argv(tmp_path, [])
    (tmp_path / "launch.json").write_text(json.dumps({"format": "x", "argv": []}))
    with pytest.raises(ConfigError, match="not a psgrad launch record"):
        jobdir.resume_argv(tmp_path, [])
    jobdir.start_new(tmp_path / "job", ["--num-servers", "2"])
    with pytest.raises(ConfigError, match="--num-servers"):
        jobdir.resume_argv(tmp_path / "job", ["--num-servers", "3"])
    with pytest.raises(ConfigError, match="--resume: .*shard0 holds no checkpoint of shard 0"):
        jobdir.check_resumable(tmp_path / "job", 2)
    s, _ = started(JobSpec(num_shards=2, num_workers=2))
    checkpoint.save(s.snapshot(), jobdir.shard_dir(tmp_path / "job", 0))
    with pytest.raises(ConfigError, match="--resume: .*shard1 holds no checkpoint of shard 1"):
        jobdir.check_resumable(tmp_path / "job", 2)
    checkpoint.save(s.snapshot(), jobdir.shard_dir(tmp_path / "job", 1))
    jobdir.check_resumable(tmp_path / "job", 2)


def test_the_clock_a_resume_would_start_from_is_read_from_every_shards_newest_checkpoint(tmp_path: Path) -> None:
    """(What `launch --resume` compares with --steps: a finished job is said so and nothing starts.)"""
    job = tmp_path / "job"
    assert jobdir.reached_clock(job, 1, 1) is None  # no checkpoint
    s, _ = started(JobSpec(num_shards=2, num_workers=2))  # (ranks 0 and 1 joined, at clock 0)
    checkpoint.save(s.snapshot(), jobdir.shard_dir(job, 0))
    assert jobdir.reached_clock(job, 1, 2) == 0 and jobdir.reached_clock(job, 2, 2) is None  # (shard 1: none)
    assert jobdir.reached_clock(job, 1, 3) is None  # (rank 2 in no checkpoint: nothing claimed)
