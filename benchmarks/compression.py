"""Fewer bytes per push: gradient compression (--compress) on shaped links beside float32, bfloat16
and the all-reduce baseline, what each codec costs the worker and the server, and what a narrower
wire dtype costs in accuracy.

    python benchmarks/compression.py --preset full    # fashion-mnist, links of 100 Mbit/s and 1 Gbit/s, 2 seeds
    python benchmarks/compression.py --preset quick   # digits, one link rate, one seed (CI-sized)
    python benchmarks/compression.py --preset tiny    # CI smoke run without a test bed: codecs and wire-dtype
    python benchmarks/compression.py --preset full --parts wire-dtype   # digits and mnist1d, float32 vs bfloat16
    python benchmarks/compression.py --preset full --task charlm --rates 100 --seeds 1
    python benchmarks/compression.py --preset full --rates 1000 --worker-uplink-mbit 100   # workers behind slow uplinks
    python benchmarks/compression.py --preset full --parts train --rates 100 --rtt-ms 20   # links across regions
    python benchmarks/compression.py --preset full --parts codecs    # only the codecs' CPU cost
    python benchmarks/compression.py --from-json out.json --markdown  # the tables of a saved run

Parts (--parts; default codecs and train, with --preset tiny codecs and wire-dtype):
- codecs: per codec, the CPU time to encode a float32 gradient (with error feedback where the codec
  keeps it, as a worker does) and to decode it (as a shard does), per 100 MB of gradient (25M
  values, medians of --reps), on this process's one torch thread, and its payload bytes over
  float32's.
- train: the same job (task, seed, steps, recipe) with every config in turn on the test bed
  (lib/netbed.py: network namespaces, every link shaped with tc to the rate in both directions):
  two shard servers on hosts 0 and 1, two workers on hosts 2 and 3 (sync, or --mode; all-reduce:
  gloo ranks on hosts 2 and 3). Configs: fp32 (plain), bf16 (--wire-dtype bfloat16: pushes and pulls), topk:0.01,
  sign and int8 (--compress; error feedback on for topk and sign; pulls in float32), the same codecs
  with bf16 pulls (+bf16: sparse values travel in bfloat16 too), fp32-duplex and int8-duplex
  (async: push and pull at once, as two calls, --duplex; the others make one Step call per shard,
  whose reply comes after the whole request), both ways compressed (PUSH+pull:PULL: the push codec
  and --compress-pull PULL, e.g. int8+pull:int8; :resync100 adds --pull-resync-every 100, :noresync
  sets --pull-resync-error 0), -overlap (async: --overlap, the exchange behind the next step's
  compute), and allreduce. Per run: time to the
  task's target (wall time from the first worker's start to the first evaluation at or past it, as
  `psgrad compare` computes it; evaluations included, the same for every config), steps/s, the final
  metric (mean of the workers' final evaluations), and bytes per push as the servers counted them
  (`psgrad status`: push_bytes_total / pushes). Configs run in a rotating order per seed, so a busy
  moment of the machine does not always hit the same one. Summary per rate: each config's mean time
  to target over fp32's (speedup), its final metric minus fp32's (points), and bytes per push over
  fp32's. The goal: a compressed config >= 3x faster than fp32 to target at 100 Mbit/s, its final
  accuracy within 0.5 point. With --worker-uplink-mbit U the workers' uplinks (their pushes) run at
  U instead (the rest at the rate): where push compression can pay on full-duplex links, since a
  step's pushes and pulls go in opposite directions and compressing one leaves the other.

- wire-dtype: does a narrower wire dtype cost accuracy? The same job with float32, bfloat16 (and
  --dtypes, e.g. float16) on the wire: each run is `psgrad launch` on this machine (2 servers + 2
  workers, sync mode, a fixed seed; tiny and quick: 1 server), so the only difference between runs
  of one task is the wire dtype (pushes and pulls; the servers keep float32 master weights). Reports
  each run's final test accuracy (mean over the workers), the mean over seeds 0..N-1 (one run's accuracy moves by about a
  point from seed to seed on mnist1d) and the difference of the means to float32; the bar is
  |bf16 - fp32| <= 1 point. Tasks and steps: digits (and mnist1d in full) with their own presets;
  --seeds overrides the seeds. Its result is the document's "wire_dtype" (setup, results, targets).

Needs root, iproute2 and tc for the train part. Prints one JSON document; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lib import add_preset, log, machine_info, overrides, psgrad_launch, read_jsonl, rep_order, write_doc
from lib.bedjob import WORKER_HOSTS, train_on_bed
from lib.netbed import NetBed

from psgrad.config import metric_rises
from psgrad.experiments.analysis import load_run, run_metrics
from psgrad.tasks import recipe_for

CONFIGS: dict[str, list[str]] = {
    "fp32": [],
    "bf16": ["--wire-dtype", "bfloat16"],
    "topk:0.01": ["--compress", "topk:0.01"],
    "sign": ["--compress", "sign"],
    "int8": ["--compress", "int8"],
    "topk:0.01+bf16": ["--compress", "topk:0.01", "--wire-dtype", "bfloat16"],
    "sign+bf16": ["--compress", "sign", "--wire-dtype", "bfloat16"],
    "int8+bf16": ["--compress", "int8", "--wire-dtype", "bfloat16"],
    "topk:0.01:noef": ["--compress", "topk:0.01", "--no-error-feedback"],
    "fp32-duplex": ["--duplex"],  # async: push and pull at once, as two calls, instead of one Step call per shard
    "int8-duplex": ["--compress", "int8", "--duplex"],
    # Both ways: the push codec, then the pull's (--compress-pull: the change since the worker's copy)
    "int8+pull:int8": ["--compress", "int8", "--compress-pull", "int8"],
    "topk:0.01+pull:topk:0.01": ["--compress", "topk:0.01", "--compress-pull", "topk:0.01"],
    "topk:0.01+pull:int8": ["--compress", "topk:0.01", "--compress-pull", "int8"],
    "topk:0.01+pull:topk:0.1": ["--compress", "topk:0.01", "--compress-pull", "topk:0.1"],
    "sign+pull:sign": ["--compress", "sign", "--compress-pull", "sign"],
    "int8+pull:int8:resync100": ["--compress", "int8", "--compress-pull", "int8", "--pull-resync-every", "100"],
    "topk:0.01+pull:topk:0.01:noresync": ["--compress", "topk:0.01", "--compress-pull", "topk:0.01",
                                          "--pull-resync-error", "0"],
    "topk:0.01+pull:topk:0.01:resync50": ["--compress", "topk:0.01", "--compress-pull", "topk:0.01",
                                          "--pull-resync-error", "0", "--pull-resync-every", "50"],
    # async and ssp: push and pull in the background while the next step computes (--overlap)
    "fp32-overlap": ["--overlap"],
    "int8+pull:int8-overlap": ["--compress", "int8", "--compress-pull", "int8", "--overlap"],
    "topk:0.01+pull:int8-overlap": ["--compress", "topk:0.01", "--compress-pull", "int8", "--overlap"],
    "allreduce": [],
}
CODECS = ("topk:0.01", "randomk:0.01", "sign", "int8")
PRESETS: dict[str, dict[str, Any]] = {
    "quick": {"task": "digits", "target": 0.7, "worker_uplink_mbit": None, "mode": "sync", "rtt_ms": 0.0, "steps": 60, "eval_every": 20, "rates": [1000.0], "seeds": 1,
              "configs": ["fp32", "topk:0.01", "allreduce"], "parts": ["codecs", "train"], "codec_values": 1_000_000,
              "reps": 3},
    "tiny": {"task": "digits", "target": 0.7, "worker_uplink_mbit": None, "mode": "sync", "rtt_ms": 0.0, "steps": 60, "eval_every": 20, "rates": [1000.0], "seeds": 1,
             "configs": ["fp32", "topk:0.01", "allreduce"], "parts": ["codecs", "wire-dtype"], "codec_values": 200_000,
             "reps": 2},
    "full": {"task": "fashion-mnist", "target": None, "worker_uplink_mbit": None, "mode": "sync", "rtt_ms": 0.0, "steps": 600, "eval_every": 30, "rates": [100.0, 1000.0], "seeds": 2,
             "configs": ["fp32", "bf16", "topk:0.01", "sign", "int8", "topk:0.01+bf16", "sign+bf16", "allreduce"],
             "parts": ["codecs", "train"], "codec_values": 25_000_000, "reps": 5},
}
PARTS = ("codecs", "train", "wire-dtype")
SPEEDUP_GOAL = 3.0
POINTS_GOAL = 0.5
# --parts wire-dtype: tasks with their steps and settings, wire dtypes, seeds, servers per launch
# (quick is tiny's: one server, so a CI run starts fewer processes; the full preset's figures use 2)
WIRE_TINY: dict[str, Any] = {"tasks": {"digits": {"steps": 60, "lr": 0.1, "momentum": 0.0}},
                             "dtypes": ["float32", "bfloat16"], "seeds": 1, "servers": 1}
WIRE_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": WIRE_TINY,
    "quick": WIRE_TINY,
    "full": {
        "tasks": {
            "digits": {"steps": 1000, "lr": 0.1, "momentum": 0.9},
            "mnist1d": {"steps": 2000, "lr": 0.05, "momentum": 0.9},
        },
        "dtypes": ["float32", "bfloat16"],
        "seeds": 3,
        "servers": 2,
    },
}
TOLERANCE_POINTS = 1.0


# --------------------------------------------------------------------------------------------
# codecs: CPU per 100 MB


def codec_costs(values: int, reps: int) -> dict[str, Any]:
    """Encode (with error feedback where the codec keeps it) and decode time per 100 MB of float32."""
    import torch

    from psgrad.core.compression import parse_compression
    from psgrad.core.gradient_codecs import Codec, Compressor

    torch.set_num_threads(1)
    grad = torch.randn(values, generator=torch.Generator().manual_seed(0))
    out = torch.empty(values)
    per_100mb = 100e6 / (4 * values)
    results: dict[str, Any] = {}
    for name in CODECS:
        codec = parse_compression(name)
        assert codec is not None
        encoder = Compressor(codec, values)
        decoder = Codec(codec, values)
        enc, dec = [], []
        for _ in range(reps):
            t0 = time.process_time()
            payload = encoder.encode(grad)
            t1 = time.process_time()
            decoder.decode(payload, out)
            t2 = time.process_time()
            enc.append(t1 - t0)
            dec.append(t2 - t1)
        results[name] = {
            "payload_over_fp32": round(codec.payload_bytes(values) / (4 * values), 5),
            "encode_cpu_s_per_100mb": round(statistics.median(enc) * per_100mb, 4),
            "decode_cpu_s_per_100mb": round(statistics.median(dec) * per_100mb, 4),
            "error_feedback": encoder.residual is not None,
        }
        log(f"compression: codec {name}: {results[name]}")
    return {"values": values, "reps": reps, "torch_threads": 1, "codecs": results}


# --------------------------------------------------------------------------------------------
# train: time to target on the bed


def bytes_per_push(status: dict[str, Any]) -> float | None:
    """Push payload bytes per push over the servers (psgrad status: push_bytes_total / pushes)."""
    shards = status.get("shards", [])
    pushes = sum(s["pushes_applied"] + s["pushes_duplicate"] + s["pushes_rejected"] for s in shards)
    return sum(s["push_bytes_total"] for s in shards) / pushes if pushes else None


def bytes_per_pull(status: dict[str, Any]) -> float | None:
    """Pull payload bytes per pull over the servers (psgrad status: pull_bytes_total / pulls)."""
    shards = status.get("shards", [])
    pulls = sum(s["pulls"] for s in shards)
    return sum(s["pull_bytes_total"] for s in shards) / pulls if pulls else None


def train_one(bed: NetBed, config: str, seed: int, cfg: dict[str, Any], work: Path) -> dict[str, Any]:
    recipe = recipe_for(cfg["task"])
    target = recipe.target if cfg["target"] is None else cfg["target"]
    run_dir = work / f"{config.replace(':', '-')}-seed{seed}-{cfg['rate']:g}"
    common = ["--task", cfg["task"], "--steps", str(cfg["steps"]), "--eval-every", str(cfg["eval_every"]),
              "--log-every", str(cfg["steps"]), "--device", "cpu", "--seed", str(seed)]
    status = train_on_bed(bed, run_dir, config, common, allreduce=config == "allreduce",
                          worker_argv=["--mode", cfg["mode"], *CONFIGS[config]])
    run = load_run(run_dir, config)
    metrics = run_metrics(run, target, recipe.metric)
    finals = [r for recs in run.records.values() for r in recs if r.get("event") == "final"]
    elapsed = max(r["elapsed_s"] for r in finals)
    drifts = [float(r["pull_drift"]) for recs in run.records.values() for r in recs if "pull_drift" in r]
    # the drift over the run: worker 0's mean in each tenth of its steps
    first = [float(r["pull_drift"]) for r in next(iter(run.records.values()), []) if "pull_drift" in r]
    tenths = [first[len(first) * k // 10 : len(first) * (k + 1) // 10] for k in range(10)] if len(first) >= 10 else []
    steps = [r for recs in run.records.values() for r in recs if "compute_s" in r]

    def median_ms(key: str) -> float | None:
        values = [float(r[key]) for r in steps if r.get(key) is not None]
        return 1000 * statistics.median(values) if values else None

    return {
        "time_to_target_s": metrics["time_to_target_s"],
        "steps_per_s": cfg["steps"] / elapsed,
        "final": statistics.mean(float(r[recipe.metric]) for r in finals),
        "elapsed_s": elapsed,
        "bytes_per_push": bytes_per_push(status) if status else None,
        "bytes_per_pull": bytes_per_pull(status) if status else None,
        # --compress-pull: the workers' copies' distance from the weights, ||w - copy|| / ||w||
        "pull_drift_max": max(drifts) if drifts else None,
        "pull_drift_mean": statistics.mean(drifts) if drifts else None,
        "pull_drift_by_tenth": [round(statistics.mean(t), 5) for t in tenths],
        # where a step goes (medians over both workers' steps): its compute, and the push + pull
        "compute_ms": median_ms("compute_s"),
        "exchange_ms": median_ms("exchange_s"),
    }


def summarize_rate(runs: dict[str, list[dict[str, Any]]], metric: str) -> dict[str, Any]:
    """Per config: mean time to target, its speedup over fp32, final metric and its difference to
    fp32's (points for accuracy), bytes per push over fp32's."""
    def mean(config: str, key: str) -> float | None:
        values = [r[key] for r in runs.get(config, []) if r[key] is not None]
        return statistics.mean(values) if values and len(values) == len(runs[config]) else None

    base_t, base_final, base_bytes = mean("fp32", "time_to_target_s"), mean("fp32", "final"), mean("fp32", "bytes_per_push")
    scale = 100.0 if metric.endswith("accuracy") else 1.0
    out: dict[str, Any] = {}
    for config in runs:
        t, final, nbytes = mean(config, "time_to_target_s"), mean(config, "final"), mean(config, "bytes_per_push")
        out[config] = {
            "time_to_target_s": t,
            "speedup_over_fp32": base_t / t if base_t and t else None,
            "final": final,
            "final_minus_fp32": (final - base_final) * scale if final is not None and base_final is not None else None,
            "bytes_per_push": nbytes,
            "bytes_over_fp32": nbytes / base_bytes if nbytes and base_bytes else None,
            "bytes_per_pull": mean(config, "bytes_per_pull"),
            "steps_per_s": mean(config, "steps_per_s"),
        }
    return out


def goal_met(summary: dict[str, Any], metric: str) -> list[str]:
    """The compressed configs >= SPEEDUP_GOAL x fp32 to target with their final metric within
    POINTS_GOAL of fp32's (no worse by more)."""
    sign = 1.0 if metric_rises(metric) else -1.0
    return [c for c, s in summary.items() if c not in ("fp32", "bf16", "allreduce")
            and (s["speedup_over_fp32"] or 0) >= SPEEDUP_GOAL
            and s["final_minus_fp32"] is not None and sign * s["final_minus_fp32"] >= -POINTS_GOAL]


def train(cfg: dict[str, Any]) -> dict[str, Any]:
    why = NetBed.unavailable()
    if why:
        raise SystemExit(f"compression: no test bed here: {why}")
    metric = recipe_for(cfg["task"]).metric
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="psgrad-compress-") as tmp:
        for rate in cfg["rates"]:
            runs: dict[str, list[dict[str, Any]]] = {c: [] for c in cfg["configs"]}
            uplink = cfg["worker_uplink_mbit"]
            uplinks = {h: uplink for h in WORKER_HOSTS} if uplink else {}
            link = f"{rate:g} Mbit/s" + (f" (workers send at {uplink:g})" if uplink else "")
            link += f", rtt {cfg['rtt_ms']:g} ms" if cfg["rtt_ms"] else ""
            with NetBed(4, rate_mbit=rate, uplinks=uplinks, rtt_ms=cfg["rtt_ms"]) as bed:
                for seed in range(cfg["seeds"]):
                    for config in rep_order(cfg["configs"], seed + 1):
                        log(f"compression: {cfg['task']} {link} seed {seed}: {config} ...")
                        r = train_one(bed, config, seed, {**cfg, "rate": rate}, Path(tmp))
                        log(f"compression: {config}: {r}")
                        runs[config].append(r)
            summary = summarize_rate(runs, metric)
            key = f"{rate:g}" + (f"/up{uplink:g}" if uplink else "")
            out[key] = {"runs": runs, "summary": summary, "goal_met_by": goal_met(summary, metric)}
    return out


# --------------------------------------------------------------------------------------------
# wire-dtype: accuracy with a narrower wire dtype


def launch_wire(task: str, dtype: str, steps: int, lr: float, momentum: float, seed: int, workdir: Path,
                servers: int = 2) -> dict[str, Any]:
    """One `psgrad launch` run; returns the workers' final records."""
    metrics = workdir / f"{task}-{dtype}"
    wall_s = psgrad_launch([
        "--num-servers", str(servers), "--num-workers", "2",
        "--task", task, "--mode", "sync", "--steps", str(steps), "--lr", str(lr), "--momentum", str(momentum),
        "--wire-dtype", dtype, "--seed", str(seed), "--metrics-dir", str(metrics),
    ], timeout_s=1800)
    finals = []
    for path in sorted(metrics.glob("worker*.jsonl")):
        records = read_jsonl(path)
        finals.append(next(r for r in reversed(records) if r.get("event") == "final"))
    accs = [f["test_accuracy"] for f in finals]
    return {"test_accuracy": sum(accs) / len(accs), "per_worker": accs, "wall_s": wall_s}


def wire_dtype(preset: str, seeds: int | None = None, dtypes: list[str] | None = None) -> dict[str, Any]:
    """--parts wire-dtype: per task, the final test accuracy with each wire dtype beside float32's."""
    cfg = WIRE_PRESETS[preset]
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
                    r = launch_wire(task, dtype, t["steps"], t["lr"], t["momentum"], seed, Path(tmp) / f"s{seed}",
                                    cfg["servers"])
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
        "setup": {"servers": cfg["servers"], "workers": 2, "mode": "sync", "seeds": n_seeds, "tasks": cfg["tasks"]},
        "results": results,
        "targets": targets,
    }


def markdown(doc: dict[str, Any]) -> str:
    """The codec table and, per link rate, the time-to-target table of a run's JSON document."""
    out = []
    costs = doc.get("codec_costs")
    if costs:
        out += [f"Codecs, {costs['values']:,} float32 values (100 MB scaled), one torch thread, medians of {costs['reps']}:",
                "", "| codec | payload / fp32 | encode s per 100 MB | decode s per 100 MB | error feedback |",
                "|---|---|---|---|---|"]
        for name, c in costs["codecs"].items():
            out.append(f"| `{name}` | {c['payload_over_fp32']:.4f} | {c['encode_cpu_s_per_100mb']:.3f} | "
                       f"{c['decode_cpu_s_per_100mb']:.3f} | {'yes' if c['error_feedback'] else 'no'} |")
        out.append("")

    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    metric = "final accuracy" if doc["task"] != "charlm" else "final bpb"
    versus = "vs fp32 (points)" if doc["task"] != "charlm" else "vs fp32 (bpb; lower is better)"
    for rate, r in doc.get("train", {}).items():
        seeds = len(next(iter(r["runs"].values())))
        links = rate if "/up" not in rate else f"{rate.split('/up')[0]} (the workers' uplinks {rate.split('/up')[1]})"
        out += [f"{doc['task']}, links {links} Mbit/s, {doc['steps']} steps a worker, means of {seeds} seed(s) "
                f"(goal met by: {', '.join(r['goal_met_by']) or 'none'}):", "",
                f"| config | time to target (s) | speedup vs fp32 | steps/s | {metric} | {versus} | "
                "bytes a push | vs fp32 | bytes a pull |", "|---|---|---|---|---|---|---|---|---|"]
        for config, s in r["summary"].items():
            out.append(f"| {config} | {num(s['time_to_target_s'], '.1f')} | {num(s['speedup_over_fp32'], '.2f')} | "
                       f"{num(s['steps_per_s'], '.1f')} | {num(s['final'], '.4f')} | {num(s['final_minus_fp32'], '+.2f')} | "
                       f"{num(s['bytes_per_push'], ',.0f')} | {num(s['bytes_over_fp32'], '.4f')} | "
                       f"{num(s.get('bytes_per_pull'), ',.0f')} |")
        out.append("")
    wire = doc.get("wire_dtype")
    if wire:
        out += [f"Wire dtype, {wire['setup']['servers']} servers + {wire['setup']['workers']} sync workers, "
                f"mean final test accuracy over {wire['setup']['seeds']} seed(s):", "",
                "| task | wire dtype | test accuracy | vs float32 (points) |", "|---|---|---|---|"]
        for task, by_dtype in wire["results"].items():
            for dtype, r in by_dtype.items():
                out.append(f"| {task} | {dtype} | {r['test_accuracy']:.4f} | {num(r.get('points_vs_float32'), '+.2f')} |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_preset(parser, PRESETS, "task, link rates, configs and seeds (train); values and repetitions (codecs); "
               "tasks and steps (wire-dtype)")
    parser.add_argument("--task", help="override the task (its recipe gives the target, optimizer and lr); train only")
    parser.add_argument("--steps", type=int, help="override the steps per worker and run; train only")
    parser.add_argument("--mode", choices=("sync", "async", "ssp"), help="the workers' mode (default sync); train only")
    parser.add_argument("--rtt-ms", type=float, help="a round-trip delay between hosts (default 0; lib/netbed.py's "
                        "RTT_RACK_MS 0.5 inside a rack, RTT_REGION_MS 20 across regions); train only")
    parser.add_argument("--target", type=float, help="override the target (default: the task's recipe's); train only")
    parser.add_argument("--eval-every", type=int, help="override how often the workers evaluate; train only")
    parser.add_argument("--seeds", type=int, help="override how many seeds (0..N-1) each config (train) or each "
                        "task and wire dtype (wire-dtype) runs")
    parser.add_argument("--rates", type=lambda t: [float(x) for x in t.split(",")], help="override the link rates, "
                        "Mbit/s, comma-separated; train only")
    parser.add_argument("--worker-uplink-mbit", type=float, help="the workers' uplinks (what they send: pushes) at "
                        "this rate instead, e.g. 100 with --rates 1000: workers behind a slow uplink; train only")
    parser.add_argument("--configs", type=lambda t: t.split(","), help=f"comma-separated, of {', '.join(CONFIGS)}; "
                        "train only")
    parser.add_argument("--parts", type=lambda t: t.split(","), help=f"comma-separated, of {', '.join(PARTS)} "
                        "(default: the preset's)")
    parser.add_argument("--dtypes", type=lambda t: t.split(","), help="comma-separated wire dtypes to compare with "
                        "float32 (default: bfloat16); wire-dtype only")
    parser.add_argument("--from-json", metavar="PATH", help="read a saved run's JSON document instead of running")
    parser.add_argument("--markdown", action="store_true", help="print the tables in Markdown instead of JSON")
    args = parser.parse_args()
    if args.from_json:
        doc = json.loads(Path(args.from_json).read_text())
        sys.stdout.write(markdown(doc) if args.markdown else json.dumps(doc, indent=1))
        return
    bad = sorted(set(args.configs or ()) - set(CONFIGS)) + sorted(set(args.parts or ()) - set(PARTS))
    if bad:
        parser.error(f"unknown config or part: {', '.join(bad)}; configs: {', '.join(CONFIGS)}; parts: {', '.join(PARTS)}")
    cfg = overrides(args, PRESETS[args.preset])
    doc: dict[str, Any] = {"benchmark": "compression", "preset": args.preset, **cfg, "machine": machine_info(),
                           "goal": {"speedup_over_fp32": SPEEDUP_GOAL, "final_within_points": POINTS_GOAL}}
    if "codecs" in cfg["parts"]:
        doc["codec_costs"] = codec_costs(cfg["codec_values"], cfg["reps"])
    if "train" in cfg["parts"]:
        doc["train"] = train(cfg)
    if "wire-dtype" in cfg["parts"]:
        doc["wire_dtype"] = wire_dtype(args.preset, args.seeds, args.dtypes)
    write_doc(doc, markdown if args.markdown else None)


if __name__ == "__main__":
    main()
