"""Does a narrower wire dtype cost accuracy? The same job with float32, bfloat16 (and float16) on the wire.

    python benchmarks/wire_dtype.py --preset full    # digits and mnist1d, 2 servers + 2 workers each
    python benchmarks/wire_dtype.py --preset tiny    # CI smoke run: digits, a few steps

Each run is `psgrad launch` in sync mode with a fixed seed, so the only difference between runs of
one task is the wire dtype (pushes and pulls; the servers keep float32 master weights). Reports
each run's final test accuracy (mean over the workers), the mean over seeds 0..N-1 (one run's
accuracy moves by about a point from seed to seed on mnist1d) and the difference of the means to
float32; the bar is |bf16 - fp32| <= 1 point. Prints one JSON document; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from lib import add_preset, log, machine_info, psgrad_launch, read_jsonl, write_json

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"tasks": {"digits": {"steps": 60, "lr": 0.1, "momentum": 0.0}}, "dtypes": ["float32", "bfloat16"], "seeds": 1},
    "full": {
        "tasks": {
            "digits": {"steps": 1000, "lr": 0.1, "momentum": 0.9},
            "mnist1d": {"steps": 2000, "lr": 0.05, "momentum": 0.9},
        },
        "dtypes": ["float32", "bfloat16"],
        "seeds": 3,
    },
}
TOLERANCE_POINTS = 1.0


def launch(task: str, dtype: str, steps: int, lr: float, momentum: float, seed: int, workdir: Path) -> dict[str, Any]:
    """One `psgrad launch` run; returns the workers' final records."""
    metrics = workdir / f"{task}-{dtype}"
    wall_s = psgrad_launch([
        "--num-servers", "2", "--num-workers", "2",
        "--task", task, "--mode", "sync", "--steps", str(steps), "--lr", str(lr), "--momentum", str(momentum),
        "--wire-dtype", dtype, "--seed", str(seed), "--metrics-dir", str(metrics),
    ], timeout_s=1800)
    finals = []
    for path in sorted(metrics.glob("worker*.jsonl")):
        records = read_jsonl(path)
        finals.append(next(r for r in reversed(records) if r.get("event") == "final"))
    accs = [f["test_accuracy"] for f in finals]
    return {"test_accuracy": sum(accs) / len(accs), "per_worker": accs, "wall_s": wall_s}


def run(preset: str, seeds: int | None = None, dtypes: list[str] | None = None) -> dict[str, Any]:
    cfg = PRESETS[preset]
    n_seeds = seeds or cfg["seeds"]
    wire_dtypes = dtypes or cfg["dtypes"]
    if "float32" not in wire_dtypes:
        wire_dtypes = ["float32", *wire_dtypes]
    results: dict[str, dict[str, Any]] = {}
    targets = []
    with tempfile.TemporaryDirectory(prefix="psgrad-wire-") as tmp:
        for task, t in cfg["tasks"].items():
            results[task] = {}
            for dtype in wire_dtypes:
                runs = []
                for seed in range(n_seeds):
                    log(f"wire_dtype: {task}, wire {dtype}, seed {seed}, {t['steps']} steps ...")
                    r = launch(task, dtype, t["steps"], t["lr"], t["momentum"], seed, Path(tmp) / f"s{seed}")
                    log(f"wire_dtype: {task}, wire {dtype}, seed {seed}: test accuracy {r['test_accuracy']:.4f} ({r['wall_s']:.0f} s)")
                    runs.append(r)
                accs = [r["test_accuracy"] for r in runs]
                results[task][dtype] = {"test_accuracy": sum(accs) / len(accs), "per_seed": accs, "runs": runs}
            base = results[task]["float32"]["test_accuracy"]  # the mean over seeds
            for dtype in wire_dtypes:
                if dtype == "float32":
                    continue
                diff = 100 * (results[task][dtype]["test_accuracy"] - base)
                results[task][dtype]["points_vs_float32"] = diff
                targets.append({
                    "name": f"{task}: {dtype} wire accuracy - float32 (points, mean of {n_seeds} seeds)",
                    "value": results[task][dtype]["test_accuracy"], "ceiling": base, "ratio": diff,
                    "target": TOLERANCE_POINTS, "better": "abs-lower", "met": abs(diff) <= TOLERANCE_POINTS,
                })
    return {
        "benchmark": "wire_dtype",
        "preset": preset,
        "setup": {"servers": 2, "workers": 2, "mode": "sync", "seeds": n_seeds, "tasks": cfg["tasks"]},
        "machine": machine_info(),
        "results": results,
        "targets": targets,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_preset(parser, PRESETS, "tasks and steps")
    parser.add_argument("--seeds", type=int, help="runs per task and dtype, seeds 0..N-1 (default: the preset's)")
    parser.add_argument(
        "--dtypes", help="comma-separated wire dtypes to compare with float32 (default: the preset's)"
    )
    args = parser.parse_args()
    dtypes = args.dtypes.split(",") if args.dtypes else None
    write_json(run(args.preset, args.seeds, dtypes))


if __name__ == "__main__":
    main()
