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
    """Appends records to a JSONL file (or nowhere, when path is None); flushed per record. Each
    record is also handed to every exporter."""

    def __init__(self, path: str | os.PathLike[str] | None, rank: int, exporters: Sequence[Exporter] = ()) -> None:
        self.rank = rank
        self.exporters = list(exporters)
        self._file: IO[str] | None = None
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "w", encoding="utf-8")

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
