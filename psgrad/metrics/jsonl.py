"""JSONL metrics sink: one JSON object per line, each stamped with time and rank."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from collections.abc import Sequence
from typing import IO, Any, Protocol


class Exporter(Protocol):
    """Somewhere else a worker's records go as they are written (Prometheus, TensorBoard, a progress bar)."""

    def record(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class MetricsSink:
    """Writes records to a JSONL file (or nowhere, when path is None), flushed per record: a new
    file, or with `append` after the records it holds (a resumed job's worker keeps the stopped
    run's; a record torn by that run's stop is dropped first). Each record is also handed to
    every exporter."""

    def __init__(self, path: str | os.PathLike[str] | None, rank: int, exporters: Sequence[Exporter] = (),
                 append: bool = False) -> None:
        self.rank = rank
        self.exporters = list(exporters)
        self._file: IO[str] | None = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            if append:
                _drop_torn_record(Path(path))
            self._file = open(path, "a" if append else "w", encoding="utf-8")

    def write(self, step: int, **fields: Any) -> dict[str, Any]:
        record = {"time": time.time(), "rank": self.rank, "step": step, **fields}
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        for exporter in self.exporters:
            exporter.record(record)
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        for exporter in self.exporters:
            exporter.close()
        self.exporters = []

    def __enter__(self) -> MetricsSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _drop_torn_record(path: Path) -> None:
    """Cut what follows the last newline of path (a record a killed process left half written), if
    it exists; records are short, so the newline is within the last MiB."""
    try:
        f = open(path, "rb+")
    except FileNotFoundError:
        return
    with f:
        size = f.seek(0, os.SEEK_END)
        start = max(0, size - (1 << 20))
        f.seek(start)
        tail = f.read()
        if tail and not tail.endswith(b"\n"):
            cut = tail.rfind(b"\n")
            if cut >= 0 or start == 0:
                f.truncate(start + cut + 1)


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of a JSONL metrics file; a torn last line (a process killed mid-write) is dropped,
    any other bad line raises ValueError naming the file and line."""
    lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    out: list[dict[str, Any]] = []
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{i + 1}: not a JSON record: {exc}") from None
    return out
