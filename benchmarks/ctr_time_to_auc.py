"""Time to a target test AUC on task ctr across hosts on shaped links: psgrad async and sync (the
embedding table's rows on the servers, pulled and pushed by id) against the all-reduce baseline
(every worker holds the whole table and all-reduces its dense gradient every step) — same task,
same workers, same links, one run.

    python benchmarks/ctr_time_to_auc.py --preset full    # 1M-row table x 32 dims, links 1 Gbit/s
    python benchmarks/ctr_time_to_auc.py --preset quick   # a 20k-row table, CI-sized
    python benchmarks/ctr_time_to_auc.py --preset full --modes async,async:cache   # the worker's row cache

The hosts are network namespaces (lib/netbed.py), every link shaped with tc to --rate-mbit in both
directions: the two shard servers on hosts 0 and 1, the two workers on hosts 2 and 3 (the same
hosts for the all-reduce ranks, gloo over the shaped links). Each run trains `steps` steps per
worker with the task's recipe (Adagrad; the all-reduce baseline applies torch's Adagrad with the
same settings), evaluating on the first 10,000 test examples every `eval_every` steps; its time to
target is the wall time from its first worker's start to the first evaluation at or above the
target (lib: psgrad.experiments.analysis.run_metrics, as `psgrad compare` computes it). Needs root,
iproute2 and tc. Prints one JSON document: per mode the time to target, steps/s, final test AUC and
the planted model's (bayes_auc), and `allreduce_over_MODE`: the all-reduce baseline's time to
target over each psgrad mode's (goal >= 3). Mode `async:cache` is async with the workers' row cache
(--row-cache-rows 200000 --row-cache-staleness 4), with its hit rate.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from lib import add_preset, log, machine_info, overrides, write_json
from lib.bedjob import train_on_bed
from lib.netbed import NetBed

from psgrad.experiments.analysis import load_run, run_metrics

PRESETS: dict[str, dict[str, Any]] = {
    "quick": {"rows": 20_000, "dim": 8, "steps": 40, "eval_every": 10, "target": 0.8, "rate_mbit": 1000,
              "modes": ["async", "sync", "allreduce"]},
    "full": {"rows": 1_000_000, "dim": 32, "steps": 150, "eval_every": 10, "target": 0.85, "rate_mbit": 1000,
             "modes": ["async", "sync", "allreduce"]},
}
GOAL = 3.0
MODES = ("async", "sync", "allreduce", "async:cache")
CACHE = ["--row-cache-rows", "200000", "--row-cache-staleness", "4"]


def run_mode(bed: NetBed, mode: str, cfg: dict[str, Any], work: Path) -> dict[str, Any]:
    """One run of `mode`: psgrad's servers on hosts 0, 1 and workers on 2, 3, or all-reduce ranks on 2, 3."""
    env = {"PSGRAD_CTR_ROWS": str(cfg["rows"]), "PSGRAD_CTR_DIM": str(cfg["dim"])}
    run_dir = work / mode.replace(":", "-")
    common = ["--task", "ctr", "--steps", str(cfg["steps"]), "--eval-every", str(cfg["eval_every"]),
              "--log-every", str(cfg["steps"]), "--device", "cpu"]
    ps_mode, _, cache = mode.partition(":")
    train_on_bed(bed, run_dir, mode, common, env, allreduce=mode == "allreduce",
                 worker_argv=["--mode", ps_mode, *(CACHE if cache else [])])
    metrics = run_metrics(load_run(run_dir, mode), cfg["target"], "test_auc")
    records = load_run(run_dir, mode).records.values()
    finals = [r for recs in records for r in recs if r.get("event") == "final"]
    hits = [recs[-2]["row_cache_hit_rate"] for recs in records if len(recs) > 1 and "row_cache_hit_rate" in recs[-2]]
    elapsed = max(r["elapsed_s"] for r in finals)
    return {
        **({"row_cache_hit_rate": min(hits)} if hits else {}),
        "time_to_target_s": metrics["time_to_target_s"],
        "steps_per_s": cfg["steps"] / elapsed,
        "final_test_auc": min(r["test_auc"] for r in finals),
        "bayes_auc": finals[0]["bayes_auc"],
        "elapsed_s": elapsed,
        "max_rss_mb": max(r["max_rss_mb"] for r in finals),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_preset(parser, PRESETS, "table size, steps and target")
    parser.add_argument("--rows", type=int, help="override the table's rows (PSGRAD_CTR_ROWS)")
    parser.add_argument("--steps", type=int, help="override the steps per worker and run")
    parser.add_argument("--target", type=float, help="override the target test AUC")
    parser.add_argument("--rate-mbit", type=float, help="override every link's rate in Mbit/s")
    parser.add_argument("--modes", type=lambda text: text.split(","), help=f"comma-separated, of {', '.join(MODES)} "
                        "(default: async,sync,allreduce)")
    args = parser.parse_args()
    bad = sorted(set(args.modes or ()) - set(MODES))
    if bad:
        parser.error(f"--modes takes {', '.join(MODES)}, got {', '.join(bad)}")
    cfg = overrides(args, PRESETS[args.preset])
    why = NetBed.unavailable()
    if why:
        raise SystemExit(f"ctr_time_to_auc: no test bed here: {why}")
    results: dict[str, Any] = {}
    with NetBed(4, rate_mbit=cfg["rate_mbit"]) as bed, tempfile.TemporaryDirectory(prefix="psgrad-ctr-") as tmp:
        for mode in cfg["modes"]:
            log(f"ctr_time_to_auc: {mode}: {cfg['rows']:,} rows x {cfg['dim']}, {cfg['steps']} steps, "
                f"links {cfg['rate_mbit']:g} Mbit/s")
            results[mode] = run_mode(bed, mode, cfg, Path(tmp))
            log(f"ctr_time_to_auc: {mode}: {results[mode]}")
    base = results.get("allreduce", {}).get("time_to_target_s")
    ratios = {f"allreduce_over_{m}": (base / r["time_to_target_s"] if base and r["time_to_target_s"] else None)
              for m, r in results.items() if m != "allreduce"}
    write_json({"benchmark": "ctr_time_to_auc", "preset": args.preset, **cfg, "table_bytes": cfg["rows"] * cfg["dim"] * 4,
                "machine": machine_info(), "results": results, "ratios": ratios, "goal": GOAL})


if __name__ == "__main__":
    main()
