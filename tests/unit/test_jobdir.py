"""A launched job's directory: the recorded command, what --resume adds to it, and the refusals."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

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
    assert record["argv"] == ["--num-servers", "2", "--steps", "100", "--checkpoint-dir", str(job.resolve())]
    argv = jobdir.resume_argv(job, ["--resume", str(job), "--steps", "300"])
    assert argv == [*record["argv"], "--steps", "300"]  # argparse: the later --steps wins
    assert jobdir.resume_argv(job, [f"--resume={job}"]) == record["argv"]


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
