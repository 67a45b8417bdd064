"""Shard checkpoints on disk: a snapshot as a safetensors file of its tensors plus a JSON manifest,
written atomically (write, fsync, rename; the manifest last), the newest two kept, and read back
with every file checked, falling back to an older checkpoint when the newest is damaged. The same
two parts, in memory, carry a shard's state to a backup (encode / decode)."""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_bytes, load_file, save as save_bytes, save_file

from psgrad.config import JobSpec
from psgrad.core.layout import Layout
from psgrad.core.sharding import ParamSpec, TableSpec
from psgrad.errors import CheckpointError, ConfigError
from psgrad.server.state import JOB_LR, JOB_LR_CLOCK, MemberRecord, ShardSnapshot
from psgrad.server.tables import DENSE, DenseTable, TableSnapshot

FORMAT = "psgrad-shard-checkpoint"
FORMAT_VERSION = 2  # 2: the shard's state table by table (1: the dense range alone; still read)
READABLE_VERSIONS = (1, 2)
KEEP = 2
_PREFIX = "ckpt-v"


# Held (flock) by the server that writes a directory's checkpoints, for as long as it runs.
LOCK_NAME = ".psgrad-server.lock"


class DirectoryLock:
    """A server's hold on its checkpoint directory (created if missing): one writer a directory.
    Two servers given the same --checkpoint-dir overwrote each other's checkpoints (one shard's
    were lost, and a restart restored the other shard's state); the second is refused now, named.
    The hold is an advisory lock on LOCK_NAME, which the kernel releases when the holding process
    ends, killed or not: a restart after kill -9 finds the directory free.

    Raises:
        ConfigError: another server holds the directory (its pid and host named).
        CheckpointError: the directory cannot be made (named).
    """

    def __init__(self, directory: Path) -> None:
        make_directory(directory)
        self._fd: int | None = None
        try:
            fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:  # (a directory this process cannot write: it writes no checkpoint there either)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "its pid not written yet"
            os.close(fd)
            raise ConfigError(
                f"--checkpoint-dir {directory} is in use by another server ({holder}): each server writes its "
                "checkpoints into a directory of its own (e.g. ckpt/shard0, ckpt/shard1)") from None
        except OSError:  # (a filesystem that keeps no such locks, as some network ones: served as before)
            pass
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Let the directory go (at the server's stop; again: nothing)."""
        if self._fd is not None:
            os.close(self._fd)  # (closing the descriptor releases the lock)
            self._fd = None


def _stem(version: int) -> str:
    return f"{_PREFIX}{version:012d}"


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def manifests(directory: Path) -> list[Path]:
    """The checkpoint manifests in directory, newest (highest version) first."""
    return sorted(directory.glob(f"{_PREFIX}*.json"), reverse=True)


def save(snap: ShardSnapshot, directory: Path, keep: int = KEEP) -> Path:
    """Write snap as a checkpoint in directory (created if missing); returns the manifest's path.
    A crash at any point leaves the previous checkpoints intact: the tensors file, then the
    manifest naming its checksum, each appear only complete (renamed into place after fsync).

    Raises:
        CheckpointError: the directory or a file cannot be written (a full disk, no permission, ...);
            the temporary files are removed, and the previous checkpoints are left as they were.
    """
    stem = _stem(snap.version)
    tensors, manifest = _parts(snap)
    data, tmp = directory / f"{stem}.safetensors", directory / f".{stem}.safetensors.tmp"
    tmp_manifest, path = directory / f".{stem}.json.tmp", directory / f"{stem}.json"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp))  # (raises SafetensorError, not OSError, when a write fails)
        _fsync_file(tmp)
        os.replace(tmp, data)
        manifest["tensors"] = {"file": data.name, "sha256": _sha256(data), "names": sorted(tensors)}
        _fsync_write(tmp_manifest, json.dumps(manifest, indent=1).encode())
        os.replace(tmp_manifest, path)
        _fsync_dir(directory)
    except (OSError, SafetensorError) as exc:
        _discard(tmp, tmp_manifest, *(() if path.exists() else (data,)))
        raise CheckpointError(f"cannot write a checkpoint into {directory}: {_reason(exc)}") from None
    try:
        _prune(directory, keep)
    except OSError:  # written all the same; the next checkpoint prunes again
        pass
    return path


def _reason(exc: BaseException) -> str:
    """What went wrong, said once (safetensors wraps the OS error in its own message)."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror} (errno {exc.errno}{f', {exc.filename}' if exc.filename else ''})"
    return f"{type(exc).__name__}: {exc}"


def _discard(*paths: Path) -> None:
    """Remove what a failed write left (best effort: the disk may refuse this too)."""
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass


def _parts(snap: ShardSnapshot) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A snapshot's tensors (by name) and its manifest, without the tensors file's entry. Each
    table's tensors are named `<table>/<name>`, except the dense table's, which keep the names of
    the first format (`weights`, `optimizer.<key>`)."""
    tensors: dict[str, torch.Tensor] = {}
    tables: dict[str, dict[str, Any]] = {}
    for name, table in snap.tables.items():
        prefix = "" if name == DENSE else f"{name}/"
        tensors.update({prefix + key: value.contiguous() for key, value in table.tensors.items()})
        tables[name] = {"kind": table.kind, "scalars": dict(table.scalars), "tensors": sorted(table.tensors)}
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "created_unix_s": time.time(),
        "version": snap.version,
        "layout": _layout_to_json(snap.layout),
        "members": [dataclasses.asdict(m) for m in snap.members],
        "tables": tables,
        "job": dict(snap.job),
        **({"counters": dict(snap.counters)} if snap.counters else {}),
    }
    return tensors, manifest


def encode(snap: ShardSnapshot) -> tuple[bytes, bytes]:
    """A snapshot in memory, as a checkpoint holds it: (manifest JSON, safetensors bytes)."""
    tensors, manifest = _parts(snap)
    return json.dumps(manifest).encode(), save_bytes(tensors)


def decode(manifest: bytes, data: bytes) -> ShardSnapshot:
    """The snapshot encode() gave.

    Raises:
        CheckpointError: the parts are not a psgrad snapshot, or do not fit together.
    """
    try:
        meta = json.loads(manifest)
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CheckpointError("not a psgrad shard snapshot")
        return _snapshot(meta, load_bytes(data), "a snapshot in memory")
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, ConfigError, SafetensorError) as exc:
        raise CheckpointError(f"cannot read a snapshot: {type(exc).__name__}: {exc}") from None


def _snapshot(meta: dict[str, Any], tensors: dict[str, torch.Tensor], where: str) -> ShardSnapshot:
    layout = _layout_from_json(meta["layout"])
    if "tables" in meta:
        tables = {}
        for name, entry in meta["tables"].items():
            prefix = "" if name == DENSE else f"{name}/"
            missing = [k for k in entry["tensors"] if prefix + k not in tensors]
            if missing:
                raise CheckpointError(f"{where}: table {name!r} lacks its tensors {missing}")
            tables[name] = TableSnapshot(str(entry["kind"]), {k: tensors[prefix + k] for k in entry["tensors"]},
                                         dict(entry["scalars"]))
        job = dict(meta["job"])
    else:  # the first format: the dense table alone, the job's lr among the optimizer's scalars
        scalars = dict(meta["optimizer"])
        job = {k: scalars.pop(k) for k in (JOB_LR, JOB_LR_CLOCK) if k in scalars}
        tables = {DENSE: TableSnapshot(DenseTable.kind, tensors, scalars)}
    dense = tables.get(DENSE)
    if dense is None or "weights" not in dense.tensors:
        raise CheckpointError(f"{where}: no dense table with weights")
    weights = dense.tensors["weights"]
    if weights.dtype != torch.float32 or weights.numel() != layout.numel:
        raise CheckpointError(f"{where}: weights are {weights.numel()} {weights.dtype}, the layout owns {layout.numel}")
    members = tuple(MemberRecord(**m) for m in meta["members"])
    counters = meta.get("counters", {})  # (none in a checkpoint of an older psgrad: the counters start at 0)
    if not isinstance(counters, dict):
        raise CheckpointError(f"{where}: its counters are {type(counters).__name__}, not a mapping")
    return ShardSnapshot(layout, tables, int(meta["version"]), members, job, counters)


def _prune(directory: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints, and tensor files no manifest names."""
    kept = manifests(directory)[:keep]
    named = {m.with_suffix(".safetensors").name for m in kept}
    for old in manifests(directory)[keep:]:
        old.unlink(missing_ok=True)
    for data in directory.glob(f"{_PREFIX}*.safetensors"):  # one writer: none is in progress
        if data.name not in named:
            data.unlink(missing_ok=True)


def load(manifest: Path) -> ShardSnapshot:
    """The snapshot one checkpoint holds, every file checked.

    Raises:
        CheckpointError: a file is missing, truncated, corrupt or not a psgrad checkpoint (named).
    """
    try:
        meta = json.loads(manifest.read_text(encoding="utf-8"))
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CheckpointError(f"{manifest} is not a psgrad shard checkpoint")
        if meta.get("format_version") not in READABLE_VERSIONS:
            raise CheckpointError(
                f"{manifest} has format version {meta.get('format_version')}, expected one of {READABLE_VERSIONS}"
            )
        data = manifest.parent / meta["tensors"]["file"]
        if not data.exists():
            raise CheckpointError(f"{manifest} names {data}, which does not exist")
        if _sha256(data) != meta["tensors"]["sha256"]:
            raise CheckpointError(f"{data} does not match the checksum in {manifest.name} (truncated or corrupt)")
        return _snapshot(meta, load_file(str(data)), str(data))
    except CheckpointError:
        raise
    except (OSError, ValueError, KeyError, TypeError, ConfigError, SafetensorError) as exc:
        raise CheckpointError(f"cannot read checkpoint {manifest}: {type(exc).__name__}: {exc}") from None


def versions(directory: Path) -> list[int]:
    """The versions of the checkpoints in directory, newest first (not read: load checks them)."""
    return [int(m.stem.removeprefix(_PREFIX)) for m in manifests(directory)]


def manifest_of(directory: Path, version: int) -> Path:
    """Where the manifest of the checkpoint of that version is (or would be)."""
    return directory / f"{_stem(version)}.json"


def load_version(directory: Path, version: int) -> ShardSnapshot:
    """The checkpoint of that version in directory, every file checked.

    Raises:
        CheckpointError: there is none, or it is damaged (named).
    """
    manifest = manifest_of(directory, version)
    if not manifest.exists():
        raise CheckpointError(f"{directory} holds no checkpoint of version {version} (it has {versions(directory)})")
    return load(manifest)


def make_directory(directory: Path) -> None:
    """Create a checkpoint directory if missing.

    Raises:
        CheckpointError: it cannot be (a file has its name or a parent's, no permission), named.
    """
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        # A file in the way ("File exists", "Not a directory"): name it, not errno's words.
        blocking = next((p for p in (directory, *directory.parents) if p.exists() and not p.is_dir()), None)
        if blocking is not None:
            what = "it is a file" if blocking == directory else f"{blocking} is a file"
            raise CheckpointError(f"cannot use {directory} as a checkpoint directory: {what}, not a folder; give "
                                  "the path of a folder (made if missing), or move the file away") from None
        raise CheckpointError(f"cannot use {directory} as a checkpoint directory: {exc}") from None


def load_latest(directory: Path, warn: Callable[[str], None]) -> ShardSnapshot | None:
    """The newest checkpoint in directory that reads back whole; each damaged one is skipped with a
    warning naming it. None when the directory holds no checkpoint at all (it is created if missing).

    Raises:
        CheckpointError: there are checkpoints, but none can be read (never start empty then), or
            the directory cannot be created (a file has its name, no permission).
    """
    make_directory(directory)  # fail now, not at the first checkpoint
    found = manifests(directory)
    problems = []
    for manifest in found:
        try:
            return load(manifest)
        except CheckpointError as exc:
            problems.append(str(exc))
            warn(f"skipping a damaged checkpoint: {exc}")
    if problems:
        raise CheckpointError(
            f"none of the {len(problems)} checkpoints in {directory} can be read ({'; '.join(problems)}); "
            "refusing to start empty: move the directory away to start a new job"
        )
    return None


def _layout_to_json(layout: Layout) -> dict[str, Any]:
    return {
        "spec": layout.spec.as_dict(),
        "params": [_param_to_json(p) for p in layout.params],
        "index": layout.index,
        "start": layout.start,
        "end": layout.end,
        "fingerprint": layout.fingerprint,
        **({"tables": [_table_to_json(t) for t in layout.tables]} if layout.tables else {}),
        **({"frozen": [_param_to_json(p) for p in layout.frozen]} if layout.frozen else {}),
    }


def _table_to_json(t: TableSpec) -> dict[str, Any]:
    """A table's spec, its aliases and drawn_as only where it has some (a checkpoint an older psgrad reads too)."""
    return {k: v for k, v in dataclasses.asdict(t).items() if k not in ("aliases", "drawn_as") or v}


def _layout_from_json(d: dict[str, Any]) -> Layout:
    return Layout(
        spec=JobSpec(**d["spec"]),
        params=tuple(_param_from_json(p) for p in d["params"]),
        index=int(d["index"]),
        start=int(d["start"]),
        end=int(d["end"]),
        fingerprint=str(d["fingerprint"]),
        tables=tuple(TableSpec(**t) for t in d.get("tables", ())),
        frozen=tuple(_param_from_json(p) for p in d.get("frozen", ())),
    )


def _param_to_json(p: ParamSpec) -> Any:
    """[name, shape, dtype] (+ [true] for a buffer), as the first format wrote it; with a group's
    settings or aliases, all its fields by name."""
    if not p.aliases and p.lr_scale == 1.0 and p.weight_decay is None:
        return [p.name, list(p.shape), p.dtype, *([True] if p.buffer else [])]
    return {"name": p.name, "shape": list(p.shape), "dtype": p.dtype, "buffer": p.buffer, "aliases": list(p.aliases),
            "lr_scale": p.lr_scale, "weight_decay": p.weight_decay}


def _param_from_json(p: Any) -> ParamSpec:
    if isinstance(p, dict):
        decay = p.get("weight_decay")
        return ParamSpec(str(p["name"]), tuple(p["shape"]), str(p["dtype"]), bool(p.get("buffer", False)),
                         tuple(p.get("aliases", ())), float(p.get("lr_scale", 1.0)), None if decay is None else float(decay))
    return ParamSpec(p[0], tuple(p[1]), p[2], bool(p[3:]))
