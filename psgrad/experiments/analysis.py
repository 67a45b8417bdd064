"""Pure analysis of `psgrad compare` runs: load a run directory, derive its metrics, aggregate repeats."""
from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from psgrad.config import metric_reached
from psgrad.core.modes import DECLARED
from psgrad.metrics.jsonl import read_jsonl

# One point of a convergence curve: (seconds since job start, gradients pushed so far, the task's metric
# (test accuracy, or bits per byte), test loss).
CurvePoint = tuple[float, int, float, float]
Record = dict[str, Any]

_WORKER_FILE = re.compile(r"worker(\d+)\.jsonl")
_TARGET_METRICS = ("time_to_target_s", "gradients_to_target")
_NOT_SCALAR = ("curve", "staleness_histogram", "staleness_bound_curve")


@dataclass
class RunData:
    """One run: its mode label, repeat index, each worker's records (file order) and the servers' status."""

    label: str
    repeat: int
    records: dict[int, list[Record]]
    status: dict[str, Any] | None = None
    path: Path | None = field(default=None, compare=False)


def load_run(run_dir: str | Path, label: str | None = None, repeat: int = 0) -> RunData:
    """Read worker{R}.jsonl for every rank and status.json (if present) from `run_dir`.

    `label` defaults to the directory's name. Raises FileNotFoundError when there is no worker file.
    """
    root = Path(run_dir)
    records: dict[int, list[Record]] = {}
    for path in sorted(root.glob("worker*.jsonl")):
        m = _WORKER_FILE.fullmatch(path.name)
        if m:
            records[int(m.group(1))] = read_jsonl(path)
    if not records:
        raise FileNotFoundError(f"no worker*.jsonl metrics in {root}")
    status_path = root / "status.json"
    status = json.loads(status_path.read_text(encoding="utf-8")) if status_path.exists() else None
    return RunData(label=label if label is not None else root.name, repeat=repeat, records=records,
                   status=status, path=root)


def percentile_from_histogram(hist: Mapping[int, int], q: float) -> int:
    """The q-th percentile (0 <= q <= 100) of the values a {value: count} histogram describes.

    Nearest-rank definition: with N observations sorted ascending, the result is the observation
    at 1-based rank ceil(q/100 * N), and the smallest observation for q = 0. It is always a value
    that occurs in the data (no interpolation). Zero counts are ignored; an empty histogram raises
    ValueError.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if any(c < 0 for c in hist.values()):
        raise ValueError("histogram counts must be >= 0")
    total = sum(hist.values())
    if total == 0:
        raise ValueError("percentile of an empty histogram")
    rank = max(1, math.ceil(q / 100.0 * total))
    seen = 0
    for value in sorted(hist):
        seen += hist[value]
        if seen >= rank:
            return int(value)
    raise AssertionError("unreachable: rank <= total")  # pragma: no cover


def merge_histograms(hists: Iterable[Mapping[Any, int]]) -> dict[int, int]:
    """Sum {staleness: count} histograms (JSON string keys are accepted), sorted by staleness."""
    out: dict[int, int] = {}
    for hist in hists:
        for key, count in hist.items():
            out[int(key)] = out.get(int(key), 0) + int(count)
    return dict(sorted(out.items()))


def staleness_histogram(run: RunData) -> dict[int, int]:
    """Server-side histograms summed over shards; without status.json, the workers' per-step `staleness`.

    Summed over shards, each gradient is counted once per shard it updated.
    """
    if run.status is not None:
        return merge_histograms(s.get("staleness", {}).get("histogram", {}) for s in run.status.get("shards", []))
    values = [r["staleness"] for r in _steps(run) if r.get("staleness") is not None]
    return merge_histograms([{v: 1} for v in values])


def _is_step(r: Record) -> bool:
    return "event" not in r and int(r.get("step", 0)) >= 1


def _merged(run: RunData) -> list[Record]:
    """All records of all workers, in time order (ties: by rank, then step)."""
    return sorted((r for recs in run.records.values() for r in recs),
                  key=lambda r: (r["time"], r.get("rank", 0), r.get("step", 0)))


def _steps(run: RunData) -> list[Record]:
    return [r for r in _merged(run) if _is_step(r)]


def run_metrics(run: RunData, target: float, metric: str = "test_accuracy") -> dict[str, Any]:
    """Time/gradients to `target` of `metric` (test accuracy: at or above it; a loss or bits per
    byte: at or below), the final metric, accuracy and loss, throughput, staleness and the curve.

    Evaluation records are step records carrying the metric plus the final records (each a
    worker's evaluation of the newest weights it could read), merged over workers in time order.
    "Gradients" counts step records of all workers written no later than the moment considered.
    Curve points are (time, gradients, metric, test loss).
    """
    merged = _merged(run)
    if not merged:
        raise ValueError(f"run {run.label!r} repeat {run.repeat} has no metrics records")
    starts = [r for r in merged if r.get("event") == "start"]
    t0 = starts[0]["time"] if starts else merged[0]["time"]
    steps = [r for r in merged if _is_step(r)]
    step_times = [r["time"] for r in steps]
    evals = [r for r in merged if r.get(metric) is not None and (_is_step(r) or r.get("event") == "final")]
    finals = [r for r in merged if r.get("event") == "final"]

    curve: list[CurvePoint] = []
    time_to_target: float | None = None
    grads_to_target: int | None = None
    done = 0  # step records with time <= the current evaluation's time
    for r in evals:
        while done < len(step_times) and step_times[done] <= r["time"]:
            done += 1
        curve.append((r["time"] - t0, done, float(r[metric]), float(r["test_loss"])))
        if time_to_target is None and metric_reached(float(r[metric]), target, metric):
            time_to_target, grads_to_target = r["time"] - t0, done

    batch = {r["rank"]: int(r["batch_size"]) for r in starts if "batch_size" in r}
    samples = sum(batch.get(r["rank"], 0) for r in steps)
    train_s = (step_times[-1] - t0) if steps else None
    last = finals[-1] if finals else None  # sorted by time: the final record written last
    hist = staleness_histogram(run)
    total = sum(hist.values())
    # --staleness auto: the bound each step's push reported (largest over shards), over time
    bounds = [(r["time"] - t0, int(r["staleness_bound"])) for r in steps if r.get("staleness_bound")]
    late = [int(s.get("late_dropped", 0)) for s in run.status.get("shards", [])] if run.status else []
    final = {f"final_{key}": float(last[key]) if last is not None and key in last else None
             for key in dict.fromkeys(("test_accuracy", "test_loss", metric))}
    return {
        "time_to_target_s": time_to_target,
        "gradients_to_target": grads_to_target,
        **final,
        "samples_per_s": samples / train_s if train_s else None,
        "train_s": train_s,
        "gradients_total": len(steps),
        "staleness_mean": sum(k * v for k, v in hist.items()) / total if total else None,
        "staleness_p50": percentile_from_histogram(hist, 50) if total else None,
        "staleness_p99": percentile_from_histogram(hist, 99) if total else None,
        "staleness_max": max(k for k, v in hist.items() if v > 0) if total else None,
        "staleness_histogram": hist,
        # sync with backup workers: gradients dropped as late (shard 0 decides, so its count)
        "late_dropped": max(late) if late else None,
        "staleness_bound_mean": statistics.fmean(b for _t, b in bounds) if bounds else None,
        "staleness_bound_max": max(b for _t, b in bounds) if bounds else None,
        "staleness_bound_curve": bounds,
        "curve": curve,
    }


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def aggregate(metrics: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Mean and std over repeats of every scalar metric, the merged staleness histogram, the curves.

    Each scalar becomes {"mean", "std", "n"} over the repeats where it is not None (mean and std
    None when n = 0); std is the sample standard deviation (n - 1), 0.0 for n = 1. The target
    metrics also get "reached": the number of repeats that reached the target. "repeats" is the
    number of runs aggregated.
    """
    out: dict[str, Any] = {"repeats": len(metrics)}
    keys = list(dict.fromkeys(k for m in metrics for k in m if k not in _NOT_SCALAR))
    for key in keys:
        values = [m.get(key) for m in metrics]
        if not all(v is None or _is_number(v) for v in values):
            continue
        present = [float(v) for v in values if v is not None]
        n = len(present)
        entry: dict[str, Any] = {
            "mean": statistics.fmean(present) if n else None,
            "std": (statistics.stdev(present) if n > 1 else 0.0) if n else None,
            "n": n,
        }
        if key in _TARGET_METRICS:
            entry["reached"] = n
        out[key] = entry
    for key in _TARGET_METRICS:  # present even when no run carried the key
        out.setdefault(key, {"mean": None, "std": None, "n": 0, "reached": 0})
    out["staleness_histogram"] = merge_histograms(m.get("staleness_histogram", {}) for m in metrics)
    out["curves"] = [list(m.get("curve", [])) for m in metrics]
    return out


# Each mode's note is its Mode.reproducibility (core/modes.py); the baseline's is here.
_NOTES = {
    **{m.name: m.reproducibility for m in DECLARED},
    "allreduce": "expected (not checked by a test) to be deterministic given the seed: for a fixed "
    "world size gloo's ring allreduce reduces in a fixed order and batch order is seeded "
    "(wall-clock times still vary).",
}


def nondeterminism_notes(labels: Iterable[str]) -> dict[str, str]:
    """A short sentence per mode label ("sync", "async", "ssp:2", "allreduce") on its reproducibility."""
    out: dict[str, str] = {}
    for label in labels:
        mode = label.split(":", 1)[0].strip().lower()
        out[label] = _NOTES.get(mode, f"unknown mode {mode!r}: no claim about reproducibility.")
    return out
