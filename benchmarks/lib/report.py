"""What a benchmark reports: progress on stderr, one JSON document on stdout, where it was measured
(machine_info), summary statistics, and the rows of targets and figures (a value beside the
ceiling measured in the same run, their ratio and whether the goal was met)."""
from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any


def log(message: str) -> None:
    """Progress goes to stderr; stdout carries only the JSON document."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def write_json(obj: Any, out: IO[str] = sys.stdout) -> None:
    json.dump(obj, out, indent=2)
    out.write("\n")
    out.flush()


def write_doc(doc: dict[str, Any], markdown: Callable[[dict[str, Any]], str] | None = None) -> None:
    """A benchmark's result on stdout: its JSON document, or (markdown given) the tables it renders."""
    if markdown is None:
        write_json(doc)
    else:
        sys.stdout.write(markdown(doc))
        sys.stdout.flush()


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """Where the figures were measured: CPUs, memory, versions, and the load."""
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "grpcio": _version("grpcio"),
        "numpy": _version("numpy"),
        "loadavg_1m": os.getloadavg()[0],
    }
    try:
        with open("/proc/cpuinfo") as f:
            models = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        info["cpu_model"] = models[0] if models else None
        with open("/proc/meminfo") as f:
            kb = next(int(ln.split()[1]) for ln in f if ln.startswith("MemTotal:"))
        info["mem_total_gib"] = round(kb / (1 << 20), 1)
    except (OSError, StopIteration, IndexError, ValueError):
        pass
    return info


def code_version() -> dict[str, Any]:
    """The commit measured, and the psgrad/ and benchmarks/ files changed since (None outside git)."""
    def git(*args: str) -> str | None:
        try:
            res = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                                 cwd=Path(__file__).resolve().parents[2])
        except (OSError, subprocess.SubprocessError):
            return None
        return res.stdout if res.returncode == 0 else None

    commit, changed = git("rev-parse", "HEAD"), git("status", "--porcelain", "--", "psgrad", "benchmarks")
    return {"commit": commit.strip() if commit else None,
            "changed_files": None if changed is None else [ln[3:] for ln in changed.splitlines()]}


# ---------------------------------------------------------------------------------------------
# Statistics


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def summarize(values: Sequence[float]) -> dict[str, float]:
    """n, median, p99, mean, min and max of a non-empty sequence."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return {
        "n": len(ordered),
        "median": median,
        "p99": percentile(ordered, 99),
        "mean": sum(ordered) / len(ordered),
        "min": ordered[0],
        "max": ordered[-1],
    }


def run_by_run(ratios: Sequence[float], goal: float) -> dict[str, Any]:
    """A ratio taken pair by pair (each measurement over its peer's, measured beside it): how
    many, their median and range, how many reach `goal` (a ratio where higher is better), and
    the ratios themselves. A goal is met steadily where every pair reaches it."""
    s = summarize(ratios)
    return {"n": len(ratios), "median": s["median"], "min": s["min"], "max": s["max"],
            "at_goal": sum(r >= goal for r in ratios), "ratios": list(ratios)}


def median_gbps(times_s: Sequence[float], nbytes: int) -> float:
    """Bandwidth of the median time."""
    return nbytes / summarize(times_s)["median"] / 1e9


def pull_push_iterations(iters: int, pull: Callable[[], object], push: Callable[[], object]) -> dict[str, Any]:
    """Time `iters` iterations of pull() then push(): one worker's reply to a round (see aggregate),
    on the monotonic clock, which is one clock for all processes on a Linux host."""
    pull_s, push_s = [], []
    start = time.monotonic()
    for _ in range(iters):
        t0 = time.monotonic()
        pull()
        t1 = time.monotonic()
        push()
        t2 = time.monotonic()
        pull_s.append(t1 - t0)
        push_s.append(t2 - t1)
    return {"start": start, "end": time.monotonic(), "pull_s": pull_s, "push_s": push_s}


def aggregate(replies: Sequence[dict[str, Any]], payload_bytes: int) -> dict[str, Any]:
    """Combine W workers' timings of one round: each reply has start, end, pull_s and push_s.

    The aggregate window runs from the first start to the last end, so a worker that finishes
    early counts against the total (conservative, and the same rule for psgrad and its ceilings).
    """
    start = min(r["start"] for r in replies)
    end = max(r["end"] for r in replies)
    ops = sum(len(r["pull_s"]) + len(r["push_s"]) for r in replies)
    per_worker = []
    for r in replies:
        n = len(r["pull_s"]) + len(r["push_s"])
        span = r["end"] - r["start"]
        per_worker.append({"ops_per_s": n / span, "gb_per_s": n * payload_bytes / span / 1e9})
    return {
        "window_s": end - start,
        "ops": ops,
        "ops_per_s": ops / (end - start),
        "gb_per_s": ops * payload_bytes / (end - start) / 1e9,
        "per_worker": per_worker,
        "pull_s": [t for r in replies for t in r["pull_s"]],
        "push_s": [t for r in replies for t in r["push_s"]],
    }


def rep_order(keys: list[str], rep: int) -> list[str]:
    """The order of the operations in repetition `rep` (from 1): as listed, then reversed, in turn.
    In a fixed order each operation always follows the same one, so whatever that one leaves
    behind (another server process to switch away from, its buffers in the caches) weighs on it in
    every repetition; in a fixed order psgrad's push always ran just after an upload to another
    server process, and the bare uploads it is compared with never did."""
    return keys if rep % 2 else keys[::-1]


# ---------------------------------------------------------------------------------------------
# Target and figure rows


def target(name: str, value: float, ceiling: float, goal: float, better: str, unit: str = "",
           ceiling_name: str = "") -> dict[str, Any]:
    """One row of the suite's summary: ratio = value / ceiling, met against goal in direction better."""
    if better not in ("higher", "lower"):
        raise ValueError(f"better must be 'higher' or 'lower', got {better!r}")
    ratio = value / ceiling if ceiling else float("nan")
    met = ratio >= goal if better == "higher" else ratio <= goal
    return {"name": name, "value": value, "ceiling": ceiling, "ratio": ratio, "target": goal, "better": better,
            "met": bool(met), "unit": unit, "ceiling_name": ceiling_name}


def figure(name: str, value: float, unit: str, ceiling: float | None = None, ceiling_name: str = "") -> dict[str, Any]:
    """One row of a part's figures table (a measurement, with the ceiling it was measured beside)."""
    row: dict[str, Any] = {"name": name, "value": value, "unit": unit}
    if ceiling is not None:
        row.update(ceiling=ceiling, ceiling_name=ceiling_name, ratio=value / ceiling if ceiling else float("nan"))
    return row
