"""A launched job's checkpoint directory: one subdirectory per shard and the command that started
the job (launch.json), so that `psgrad launch --resume DIR` can start the same job again. The paths
the command names inside the directory are recorded relative to it, and --resume DIR finds them in
DIR: a job directory copied or moved resumes (and writes) where it is now."""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from psgrad.errors import ConfigError

RECORD = "launch.json"
FORMAT = "psgrad-launch"
# The launch flags that name a path. A value inside the job's directory is recorded relative to it
# (the record's "in_job_dir" lists those flags); any other stays as given.
PATH_FLAGS = ("--checkpoint-dir", "--metrics-dir", "--data-dir", "--tensorboard")


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


def _map_paths(argv: Sequence[str], fn: Callable[[str, str], str]) -> list[str]:
    """argv with the value v of each path flag (PATH_FLAGS; `name v` or `name=v`) replaced by fn(name, v)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, value = arg.partition("=")
        if eq and name in PATH_FLAGS:
            out.append(f"{name}={fn(name, value)}")
        elif arg in PATH_FLAGS and i + 1 < len(argv):
            out += [arg, fn(arg, argv[i + 1])]
            i += 1
        else:
            out.append(arg)
        i += 1
    return out


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
    root = directory.resolve()
    inside = {"--checkpoint-dir"}

    def relative(name: str, value: str) -> str:  # (a path inside the job's directory: relative to it)
        path = Path(value).resolve()
        if not path.is_relative_to(root):
            return value
        inside.add(name)
        return str(path.relative_to(root))

    rest, _ = _flag_value(argv, "--checkpoint-dir")
    record = {"format": FORMAT, "created_unix_s": time.time(), "argv": [*_map_paths(rest, relative), "--checkpoint-dir", "."],
              "in_job_dir": sorted(inside), "launched_in": str(Path.cwd())}
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f".{RECORD}.tmp"
        tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, directory / RECORD)
    except OSError as exc:
        raise ConfigError(f"cannot use {directory} as the job's checkpoint directory: {exc}") from None


def resume_argv(directory: Path, argv: Sequence[str]) -> list[str]:
    """The launch arguments that start the job checkpointed in directory again: the recorded ones,
    then the ones given now (without --resume), so that a flag given now wins. The job's checkpoint
    directory is `directory` (made absolute), and a recorded path inside the job's directory is found
    in `directory`, wherever the job was started: a record that lists it in "in_job_dir" holds it
    relative; one written before (with none) holds it absolute, inside its --checkpoint-dir.

    Raises:
        ConfigError: directory holds no launched job, or flags that contradict resuming.
    """
    record_path = directory / RECORD
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
        saved = [str(a) for a in record["argv"]] if record.get("format") == FORMAT else None
        in_job = record.get("in_job_dir")
        in_job = None if in_job is None else {str(name) for name in in_job}
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
    root = directory.absolute()
    saved, recorded = _flag_value(saved, "--checkpoint-dir")
    old_root = Path(recorded) if in_job is None and recorded is not None and Path(recorded).is_absolute() else None

    def rebased(name: str, value: str) -> str:
        if in_job is not None:
            return str(root / value) if name in in_job else value
        path = Path(value)  # (an older record: absolute paths inside the directory the job was started in)
        if old_root is not None and path.is_absolute() and path.is_relative_to(old_root):
            return str(root / path.relative_to(old_root))
        return value

    return [*_map_paths(saved, rebased), "--checkpoint-dir", str(root), *given]


def launched_in(directory: Path) -> Path | None:
    """The working directory the job in `directory` was launched from (where a task of the user's,
    package.module:function, was found: the current directory is searched), where the record names
    one that still exists; None otherwise (a record written before, or a directory gone)."""
    try:
        where = json.loads((directory / RECORD).read_text(encoding="utf-8")).get("launched_in")
    except (OSError, ValueError, AttributeError):
        return None
    return Path(where) if isinstance(where, str) and Path(where).is_dir() else None


def reached_clock(directory: Path, num_servers: int, num_workers: int) -> int | None:
    """The clock every worker of the job had reached by the checkpoints a resume restores (each
    shard's newest readable manifest): the lowest over ranks and shards; None where a manifest
    names no clock for a rank (or none reads), so that nothing is claimed."""
    from psgrad.server import checkpoint

    lowest: int | None = None
    for i in range(num_servers):
        for manifest in checkpoint.manifests(shard_dir(directory, i)):
            try:
                members = json.loads(manifest.read_text(encoding="utf-8"))["members"]
                clocks = {int(m["rank"]): int(m["clock"]) for m in members}
            except (OSError, ValueError, KeyError, TypeError):
                continue  # (as a restoring server skips it)
            break
        else:
            return None
        if any(rank not in clocks for rank in range(num_workers)):
            return None
        shard = min(clocks[rank] for rank in range(num_workers))
        lowest = shard if lowest is None else min(lowest, shard)
    return lowest


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
