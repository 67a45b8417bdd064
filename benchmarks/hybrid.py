"""Hybrid consistency against the pure modes: time to a target AUC on the ctr task over shaped links,
with one straggling worker. Persia's claim: the dense part synchronous and the tables asynchronous
keeps sync's accuracy at near async's speed.

    python benchmarks/hybrid.py --preset full     # 1 Gbit/s links, worker 1 three times as slow, 800 steps
    python benchmarks/hybrid.py --preset tiny     # 100 steps, a smaller table

On the test bed (lib/netbed.py: network namespaces on a shaped switch, every link --rate-mbit both
ways) two `psgrad server` shards run on hosts 0 and 1 and two `psgrad worker`s of the ctr task on
hosts 2 and 3 (PSGRAD_CTR_ROWS rows, the task's recipe: Adagrad lr 0.05, batch 512); worker 1 is
a straggler (`--slowdown F`: each step takes F times its compute). Configs, in a rotating order
per seed:
- `sync`: `--mode sync`;
- `hybrid`: `--mode sync --tables-mode async` (the dense mean per iteration; each worker's row
  gradients applied as its push arrives);
- `async`: `--mode async`.
Time to target is from the first worker's start to the first evaluation (every --eval-every steps,
any worker) at or past --target test AUC (psgrad.experiments.analysis, as `psgrad compare`
computes it); the final AUC is the workers' mean after --steps.

Needs root, iproute2 and tc. Prints one JSON document ("benchmark": "hybrid"); progress on stderr.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

from lib import add_preset, log, machine_info, overrides, rep_order, write_doc
from lib.args import names_arg
from lib.bedjob import train_on_bed
from lib.netbed import NetBed

from psgrad.experiments.analysis import load_run, run_metrics

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"rate_mbit": 1000.0, "rows": 200_000, "steps": 100, "eval_every": 25, "target": 0.75, "slowdown": 3.0,
             "seeds": 1},
    "full": {"rate_mbit": 1000.0, "rows": 2_000_000, "steps": 800, "eval_every": 50, "target": 0.9, "slowdown": 3.0,
             "seeds": 2},
}
CONFIGS = {"sync": ["--mode", "sync"], "hybrid": ["--mode", "sync", "--tables-mode", "async"],
           "async": ["--mode", "async"]}


def train_one(bed: NetBed, config: str, seed: int, cfg: dict[str, Any], work: Path) -> dict[str, Any]:
    run_dir = work / f"{config}-seed{seed}"
    common = ["--task", "ctr", "--steps", str(cfg["steps"]), "--eval-every", str(cfg["eval_every"]),
              "--log-every", str(cfg["steps"]), "--device", "cpu", "--seed", str(seed)]
    status = train_on_bed(bed, run_dir, config, common, env={"PSGRAD_CTR_ROWS": str(cfg["rows"])},
                          worker_argv=CONFIGS[config], rank_argv={1: ["--slowdown", str(cfg["slowdown"])]})
    run = load_run(run_dir, config)
    metrics = run_metrics(run, cfg["target"], "test_auc")
    finals = [r for recs in run.records.values() for r in recs if r.get("event") == "final"]
    staleness = [t.get("staleness_mean", 0.0) for s in status.get("shards", []) for t in s.get("tables", [])
                 if t.get("kind") == "sparse"]
    return {
        "time_to_target_s": metrics["time_to_target_s"],
        "final_auc": statistics.mean(float(r["test_auc"]) for r in finals),
        "elapsed_s": max(r["elapsed_s"] for r in finals),
        "samples_per_s": sum(r["steps"] for r in finals) * 512 / max(r["elapsed_s"] for r in finals),
        "rows_staleness_mean": statistics.mean(staleness) if staleness else None,
    }


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per config: the mean time to target (None unless every seed reached it), its ratio to sync's,
    the mean final AUC and its difference to sync's, samples/s."""
    def mean(config: str, key: str) -> float | None:
        values = [r[key] for r in runs.get(config, []) if r[key] is not None]
        return statistics.mean(values) if values and len(values) == len(runs[config]) else None

    sync_t, sync_auc = mean("sync", "time_to_target_s"), mean("sync", "final_auc")
    out = {}
    for config in runs:
        t, auc = mean(config, "time_to_target_s"), mean(config, "final_auc")
        out[config] = {
            "time_to_target_s": t,
            "time_over_sync": t / sync_t if t and sync_t else None,
            "final_auc": auc,
            "final_auc_minus_sync": auc - sync_auc if auc is not None and sync_auc is not None else None,
            "samples_per_s": mean(config, "samples_per_s"),
            "rows_staleness_mean": mean(config, "rows_staleness_mean"),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_preset(parser, PRESETS, "the links' rate, the table, steps, target and straggler")
    parser.add_argument("--configs", type=names_arg(CONFIGS), default=list(CONFIGS),
                        help=f"comma-separated, of {', '.join(CONFIGS)} (default: all)")
    parser.add_argument("--rate-mbit", type=float, help="every link's rate, both ways, in Mbit/s")
    parser.add_argument("--rows", type=int, help="PSGRAD_CTR_ROWS: the table's rows")
    parser.add_argument("--steps", type=int, help="steps per worker")
    parser.add_argument("--eval-every", type=int, help="evaluate every this many steps")
    parser.add_argument("--target", type=float, help="the target test AUC")
    parser.add_argument("--slowdown", type=float, help="worker 1's --slowdown (1: no straggler)")
    parser.add_argument("--seeds", type=int, help="seeds 0..N-1, each config once per seed")
    args = parser.parse_args()
    cfg = overrides(args, PRESETS[args.preset])
    configs = args.configs
    why = NetBed.unavailable()
    if why:
        raise SystemExit(f"hybrid: no test bed here: {why}")
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory(prefix="psgrad-hybrid-") as tmp, NetBed(4, rate_mbit=cfg["rate_mbit"]) as bed:
        for seed in range(cfg["seeds"]):
            for config in rep_order(configs, seed + 1):
                log(f"hybrid: seed {seed}: {config} ...")
                r = train_one(bed, config, seed, cfg, Path(tmp))
                log(f"hybrid: {config}: {r}")
                runs[config].append(r)
    write_doc({"benchmark": "hybrid", "settings": cfg, "machine": machine_info(), "runs": runs,
               "summary": summarize(runs)})


if __name__ == "__main__":
    main()
