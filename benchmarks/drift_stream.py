"""A drifting click stream under a small memory budget: does the servers' memory stay flat, and what
does the table's row lifetime do to the recent-window AUC?

    python benchmarks/drift_stream.py --preset full     # 3 configs x 10 minutes, 64 MB per server
    python benchmarks/drift_stream.py --preset tiny     # 3 configs x 40 s (what the test runs)

Each config is one `psgrad launch --task ctr --drift RATE` job (2 servers, 2 async workers, the
ctr task's recipe) run for --minutes, then stopped:
- `lifetime`: the table admits an id at its --min-count-th sighting, expires rows no update touched
  in --ttl updates of the table, and evicts the least recently updated rows at the budget
  (PSGRAD_CTR_MIN_COUNT, PSGRAD_CTR_TTL, PSGRAD_CTR_EVICT=1), under --budget-mb per server;
- `evict`: eviction at the same budget alone (no admission, no expiry);
- `unbounded`: no lifetime and no budget (`--memory-budget-mb 0`).
Every --sample-s seconds the servers' resident memory (RssAnon + RssFile, /proc) is sampled; at the
end `psgrad status --json` gives the table's rows stored, admitted, expired, evicted and the updates
dropped before admission. The workers evaluate every --eval-every steps on the stream's most recent
window (the ctr task with drift: 10,000 examples over the last 0.02 of its time); the figure is the
mean test AUC (and the planted model's, `bayes_auc`) of the last three evaluations of both workers.

Prints one JSON document ("benchmark": "drift_stream"); progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lib import add_preset, log, machine_info, overrides, read_jsonl, write_doc
from lib.args import names_arg
from lib.procfs import memory_bytes

from psgrad.launch.supervisor import SupervisedProcess

PSGRAD = [sys.executable, "-m", "psgrad"]
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"minutes": 0.67, "rows": 200_000, "drift": 4.0, "budget_mb": 16.0, "min_count": 2, "ttl": 200,
             "eval_every": 100, "sample_s": 5.0},
    "full": {"minutes": 10.0, "rows": 4_000_000, "drift": 2.0, "budget_mb": 64.0, "min_count": 2, "ttl": 1000,
             "eval_every": 500, "sample_s": 10.0},
}
CONFIGS = ("lifetime", "evict", "unbounded")


def config_env(config: str, cfg: dict[str, Any]) -> tuple[dict[str, str], float]:
    """The job's environment for the ctr task's table, and the servers' --memory-budget-mb."""
    env = {"PSGRAD_CTR_ROWS": str(cfg["rows"]), "PSGRAD_CTR_MIN_COUNT": "0", "PSGRAD_CTR_TTL": "0",
           "PSGRAD_CTR_EVICT": "0"}
    if config == "lifetime":
        env.update(PSGRAD_CTR_MIN_COUNT=str(cfg["min_count"]), PSGRAD_CTR_TTL=str(cfg["ttl"]), PSGRAD_CTR_EVICT="1")
    elif config == "evict":
        env.update(PSGRAD_CTR_EVICT="1")
    return env, 0.0 if config == "unbounded" else cfg["budget_mb"]


def run_config(config: str, cfg: dict[str, Any], work: Path) -> dict[str, Any]:
    env, budget = config_env(config, cfg)
    metrics = work / config
    argv = [*PSGRAD, "launch", "--task", "ctr", "--drift", str(cfg["drift"]), "--mode", "async",
            "--num-workers", "2", "--num-servers", "2", "--steps", "1000000", "--eval-every", str(cfg["eval_every"]),
            "--log-every", str(cfg["eval_every"]), "--metrics-dir", str(metrics), "--memory-budget-mb", f"{budget:g}",
            "--progress", "off"]
    job = SupervisedProcess(argv, name=f"launch-{config}", env={**os.environ, **env})
    samples: list[tuple[float, list[float]]] = []
    try:
        up = job.wait_for_line("server(s) up:", timeout_s=180)
        servers = up.split("server(s) up:", 1)[1].split(";")[0].strip()
        pids = [int(p) for p in re.findall(r"started server\d+ \(pid (\d+)\)", job.output)]
        t0 = time.monotonic()
        end = t0 + 60.0 * cfg["minutes"]
        while time.monotonic() < end:
            if job.popen.poll() is not None:
                raise SystemExit(f"drift_stream: {config}: the job ended early:\n{job.output[-3000:]}")
            samples.append((round(time.monotonic() - t0, 1), [memory_bytes(p)["own"] / 2**20 for p in pids]))
            time.sleep(min(cfg["sample_s"], max(0.0, end - time.monotonic())))
        status = json.loads(subprocess.run([*PSGRAD, "status", "--servers", servers, "--json"], capture_output=True,
                                           text=True, timeout=60, check=True).stdout)
    finally:
        job.stop(30)
    return summarize(config, budget, samples, status, metrics)


def summarize(config: str, budget: float, samples: list[tuple[float, list[float]]], status: dict[str, Any],
              metrics: Path) -> dict[str, Any]:
    """Memory over time (first sample after a tenth of the run, peak, last), the table's counters
    summed over the shards, and the last three evaluations' AUC."""
    tables = [t for s in status["shards"] for t in s.get("tables", []) if t.get("kind") == "sparse"]
    counters = {k: sum(int(t.get(k, 0)) for t in tables) for k in ("rows_touched", "admitted", "expired", "evicted",
                                                                    "dropped")}
    counters["rows_stored"] = counters.pop("rows_touched")  # (the rows held now: reads store none)
    evals, steps = [], 0
    for path in sorted(metrics.glob("worker*.jsonl")):
        records = read_jsonl(path)
        steps += max((int(r.get("step", 0)) for r in records), default=0)
        evals += [r for r in records if "test_auc" in r][-3:]
    per_server = [sum(m) / len(m) for _, m in samples]  # (the mean of the servers, each sample)
    settled = per_server[max(1, len(per_server) // 10):] or per_server
    return {
        "config": config,
        "budget_mb_per_server": budget or None,
        "server_own_mb": {"after_a_tenth": round(settled[0], 1), "peak": round(max(per_server), 1),
                          "last": round(per_server[-1], 1), "samples": samples},
        "table": counters,
        "test_auc": round(statistics.mean(r["test_auc"] for r in evals), 4) if evals else None,
        "bayes_auc": round(statistics.mean(r["bayes_auc"] for r in evals), 4) if evals else None,
        "steps": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_preset(parser, PRESETS, "the run's length, the table's size, drift and budget")
    parser.add_argument("--configs", type=names_arg(CONFIGS), default=list(CONFIGS),
                        help=f"comma-separated, of {', '.join(CONFIGS)} (default: all)")
    parser.add_argument("--minutes", type=float, help="how long each config's job runs")
    parser.add_argument("--budget-mb", type=float, help="--memory-budget-mb of each server (lifetime and evict)")
    parser.add_argument("--rows", type=int, help="PSGRAD_CTR_ROWS: the ranged table's rows")
    parser.add_argument("--drift", type=float, help="--drift RATE of the stream")
    parser.add_argument("--ttl", type=int, help="the lifetime config's ttl, in updates of the table")
    parser.add_argument("--min-count", type=int, help="the lifetime config's admission count")
    args = parser.parse_args()
    cfg = overrides(args, PRESETS[args.preset])
    configs = args.configs
    results = []
    with tempfile.TemporaryDirectory(prefix="psgrad-drift-") as tmp:
        for config in configs:
            log(f"drift_stream: {config}: {cfg['minutes']:g} min ...")
            r = run_config(config, cfg, Path(tmp))
            log(f"drift_stream: {config}: memory {r['server_own_mb']['after_a_tenth']} -> {r['server_own_mb']['last']} MB "
                f"(peak {r['server_own_mb']['peak']}), table {r['table']}, test AUC {r['test_auc']} "
                f"(bayes {r['bayes_auc']}), {r['steps']} steps")
            results.append(r)
    write_doc({"benchmark": "drift_stream", "settings": cfg, "machine": machine_info(), "results": results})


if __name__ == "__main__":
    main()
