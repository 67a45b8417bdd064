"""A launched job's checkpoint directory: one subdirectory per shard and the command that started
the job (launch.json), so that `psgrad launch --resume DIR` can start the same job again."""
from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

from psgrad.errors import ConfigError

RECORD = "launch.json"
FORMAT = "psgrad-launch"


def shard_dir(directory: Path, index: int) -> Path:
    """Where shard `index` of the job keeps its checkpoints."""
    return directory / f"shard{index}"


def _flag_value(argv: Sequence[str], name: str) -> tuple[list[str], str | None]:
    """argv without `name VALUE` / `name=VALUE`, and that value (None: absent)."""
    rest: list[str] = []
    value = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == name and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
            continue
        if arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return rest, value


def _has_checkpoints(directory: Path) -> bool:
    """Whether a shard of the job in directory wrote a checkpoint."""
    return any(directory.glob("shard*/ckpt-v*.json"))


def forget_unstarted(directory: Path) -> None:
    """After a launch that failed: remove its record where no shard wrote a checkpoint, so that the
    directory takes a new launch again (it holds nothing --resume could restore)."""
    if not _has_checkpoints(directory):
        (directory / RECORD).unlink(missing_ok=True)


def start_new(directory: Path, argv: Sequence[str]) -> None:
    """Record a new job's launch command in directory (created) before anything starts.

    Raises:
        ConfigError: directory already holds a job (resume it, or pick another), or is a file.
    """
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"--checkpoint-dir {directory} is a file, not a directory")
    if (directory / RECORD).exists() or _has_checkpoints(directory):
        raise ConfigError(
            f"{directory} already holds a job's checkpoints: start it again with --resume {directory}, "
            "or give a new job a directory of its own"
        )
    rest, _ = _flag_value(argv, "--checkpoint-dir")
    record = {"format": FORMAT, "created_unix_s": time.time(), "argv": [*rest, "--checkpoint-dir", str(directory.resolve())]}
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{RECORD}.tmp"
        tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, directory / RECORD)
    except OSError as exc:
        raise ConfigError(f"cannot use {directory} as the job's checkpoint directory: {exc}") from None


def resume_argv(directory: Path, argv: Sequence[str]) -> list[str]:
    """The launch arguments that start the job checkpointed in directory again: the recorded ones,
    then the ones given now (without --resume), so that a flag given now wins.

    Raises:
        ConfigError: directory holds no launched job, or flags that contradict resuming.
    """
    record_path = directory / RECORD
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
        saved = [str(a) for a in record["argv"]] if record.get("format") == FORMAT else None
    except FileNotFoundError:
        raise ConfigError(
            f"--resume {directory}: no {RECORD} there; it resumes a job started with psgrad launch --checkpoint-dir"
        ) from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"--resume {directory}: cannot read {record_path}: {exc}") from None
    if saved is None:
        raise ConfigError(f"--resume {directory}: {record_path} is not a psgrad launch record")
    given, _ = _flag_value(argv, "--resume")
    for name in ("--checkpoint-dir", "--num-servers"):
        if any(a == name or a.startswith(name + "=") for a in given):
            raise ConfigError(f"--resume takes the job's {name} from {record_path}; do not give it again")
    return [*saved, *given]


def check_resumable(directory: Path, num_servers: int) -> None:
    """Every shard of the job has a checkpoint to restore: checked before anything starts, so one
    missing is a usage error of --resume (exit 2), like a directory that holds no launched job.

    Raises:
        ConfigError: a shard directory is missing or holds none (named).
    """
    from psgrad.server import checkpoint  # (imports torch, which a launcher otherwise needs not)

    for i in range(num_servers):
        shard = shard_dir(directory, i)
        if not shard.is_dir() or not checkpoint.manifests(shard):
            raise ConfigError(f"--resume: {shard} holds no checkpoint of shard {i}, so the job cannot resume")
