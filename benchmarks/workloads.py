"""Real workloads through psgrad. Two parts (--part): does each consistency mode reach what a single
process reaches with the same model, data and number of examples seen (modes, the default); and
how soon does task ctr reach a target test AUC across hosts, beside the all-reduce baseline (ctr-auc).

    python benchmarks/workloads.py --preset full                   # mnist, fashion-mnist, charlm
    python benchmarks/workloads.py --preset full --tasks charlm    # one of them
    python benchmarks/workloads.py --preset tiny                   # CI smoke run: a few steps of each
    python benchmarks/workloads.py --part ctr-auc --preset full    # 1M-row table x 32 dims, links 1 Gbit/s
    python benchmarks/workloads.py --part ctr-auc --preset quick   # a 20k-row table, CI-sized (tiny: the same)
    python benchmarks/workloads.py --part ctr-auc --preset full --modes async,async:cache   # the worker's row cache

--part modes: for each task (its recipe: model, optimizer, lr schedule, batch size B, steps S per worker):
- the time of one training step (forward, backward, torch optimizer step) on one CPU thread: the
  median wall time and the median CPU time (the CPU time is what an idle core would take);
- `psgrad launch` with 2 servers and 4 workers in sync, async and ssp (staleness 2) mode, S steps
  each: 4 x S x B examples seen; the final metric is the last worker's final evaluation;
- one process (a plain torch loop, torch's own optimizer and LambdaLR) seeing as many examples:
  batch 4B for S steps (sync's equivalent: one update per 4 x B examples) and batch B for 4 x S
  steps (async's and ssp's: one update per B examples, 4 x S updates). Each mode is compared with
  the one it is equivalent to; the bar is 1 accuracy point, or 0.05 bits per byte.

fashion-mnist runs where its IDX files are (--data-dir, default the Debian package's directory) and
is reported as skipped, with the reason, elsewhere.

--part ctr-auc: time to a target test AUC on task ctr across hosts on shaped links: psgrad async and
sync (the embedding table's rows on the servers, pulled and pushed by id) against the all-reduce
baseline (every worker holds the whole table and all-reduces its dense gradient every step): same
task, same workers, same links, one run. The hosts are network namespaces (lib/netbed.py), every
link shaped with tc to --rate-mbit in both directions: the two shard servers on hosts 0 and 1, the
two workers on hosts 2 and 3 (the same hosts for the all-reduce ranks, gloo over the shaped links).
Each run trains `steps` steps per worker with the task's recipe (Adagrad; the all-reduce baseline
applies torch's Adagrad with the same settings), evaluating on the first 10,000 test examples every
`eval_every` steps; its time to target is the wall time from its first worker's start to the first
evaluation at or above the target (lib: psgrad.experiments.analysis.run_metrics, as `psgrad compare`
computes it). Needs root, iproute2 and tc. Its JSON document ("benchmark": "ctr_time_to_auc") gives
per mode the time to target, steps/s, final test AUC and the planted model's (bayes_auc), and
`allreduce_over_MODE`: the all-reduce baseline's time to target over each psgrad mode's (goal >= 3).
Mode `async:cache` is async with the workers' row cache (--row-cache-rows 200000
--row-cache-staleness 4), with its hit rate.

Prints one JSON document; progress on stderr.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from lib import log, machine_info, overrides, psgrad_launch, write_json

from psgrad.core.schedule import lr_factor
from psgrad.errors import TaskError
from psgrad.experiments import analysis
from psgrad.tasks import get_task, recipe_for
from psgrad.tasks.base import Task
from psgrad.tasks.data import BatchSchedule

MODES = {"sync": ["--mode", "sync"], "async": ["--mode", "async"], "ssp:2": ["--mode", "ssp", "--staleness", "2"]}
TOLERANCE = {"test_accuracy": 0.01, "test_bpb": 0.05}
PARTS = ("modes", "ctr-auc")
PRESETS: dict[str, dict[str, Any]] = {  # --part modes
    # CI: every piece once (the timing, the single-process run, a sync launch), a few steps; with one
    # worker the two single-process runs are the same run (batch B, S steps), made once
    "tiny": {"tasks": ["mnist", "charlm"], "servers": 1, "workers": 1, "modes": ["sync"], "steps": 4,
             "timing_steps": 2, "eval_every": 4},
    "full": {"tasks": ["mnist", "fashion-mnist", "charlm"], "servers": 2, "workers": 4, "modes": list(MODES),
             "steps": None, "timing_steps": 20, "eval_every": 0},
}


CTR_QUICK: dict[str, Any] = {"rows": 20_000, "dim": 8, "steps": 40, "eval_every": 10, "target": 0.8, "rate_mbit": 1000,
                             "modes": ["async", "sync", "allreduce"]}
CTR_PRESETS: dict[str, dict[str, Any]] = {  # --part ctr-auc (tiny is quick)
    "tiny": CTR_QUICK,
    "quick": CTR_QUICK,
    "full": {"rows": 1_000_000, "dim": 32, "steps": 150, "eval_every": 10, "target": 0.85, "rate_mbit": 1000,
             "modes": ["async", "sync", "allreduce"]},
}
CTR_GOAL = 3.0
CTR_MODES = ("async", "sync", "allreduce", "async:cache")
CTR_CACHE = ["--row-cache-rows", "200000", "--row-cache-staleness", "4"]


def torch_optimizer(task: str, params: Any) -> torch.optim.Optimizer:
    """The torch optimizer the servers' update rule for task's recipe equals."""
    r = recipe_for(task)
    if r.optimizer == "sgd":
        return torch.optim.SGD(params, lr=r.lr, momentum=r.momentum, weight_decay=r.weight_decay)
    cls = torch.optim.AdamW if r.optimizer == "adamw" else torch.optim.Adam
    return cls(params, lr=r.lr, weight_decay=r.weight_decay)


def step_time_ms(name: str, task: Task, steps: int) -> dict[str, float]:
    """Median wall and CPU time of one training step on one CPU thread (recipe batch size)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = task.build_model()
        opt = torch_optimizer(name, model.parameters())
        data = BatchSchedule(task.train_dataset(), recipe_for(name).batch_size, seed=0)
        wall, cpu = [], []
        for clock in range(steps + 2):
            x, y = data.at(clock)
            t0, c0 = time.perf_counter(), time.process_time()
            opt.zero_grad()
            task.loss_fn(model(x), y).backward()
            opt.step()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        return {"wall_ms": 1000 * statistics.median(wall[2:]), "cpu_ms": 1000 * statistics.median(cpu[2:])}
    finally:
        torch.set_num_threads(threads)


def single_process(name: str, task: Task, batch: int, steps: int, warmup: int, seed: int = 0) -> dict[str, Any]:
    """A plain torch loop: the task's model (seed 0, as worker rank 0 builds it), torch's optimizer
    and a LambdaLR with the recipe's schedule over `steps` (warmup: its first `warmup`); returns the
    final evaluation."""
    r = recipe_for(name)
    torch.manual_seed(seed)
    model = task.build_model()
    opt = torch_optimizer(name, model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(r.lr_schedule, warmup, steps))
    data = BatchSchedule(task.train_dataset(), batch, seed=seed)
    t0 = time.perf_counter()
    for clock in range(steps):
        x, y = data.at(clock)
        torch.manual_seed(data.seed_at(clock))
        opt.zero_grad()
        task.loss_fn(model(x), y).backward()
        opt.step()
        sched.step()
    return {**task.evaluate(model, torch.device("cpu")), "batch": batch, "steps": steps, "wall_s": time.perf_counter() - t0}


def launch(
    name: str, mode: list[str], preset: dict[str, Any], steps: int, eval_every: int, workdir: Path, data_dir: str | None
) -> dict[str, Any]:
    """`psgrad launch` with the preset's servers and workers; returns the final evaluation and throughput."""
    metrics = workdir / "metrics"
    args = ["--num-servers", str(preset["servers"]), "--num-workers", str(preset["workers"]),
            "--task", name, "--steps", str(steps), "--eval-every", str(eval_every), "--metrics-dir", str(metrics), *mode]
    args += ["--data-dir", data_dir] if data_dir else []
    wall_s = psgrad_launch(args, timeout_s=3600)
    metric = recipe_for(name).metric
    m = analysis.run_metrics(analysis.load_run(metrics), recipe_for(name).target, metric)
    return {
        "command": " ".join(["psgrad", "launch", *args]), "wall_s": wall_s, "train_s": m["train_s"],
        **{k: m[k] for k in m if k.startswith("final_")}, "samples_per_s": m["samples_per_s"],
        "staleness_mean": m["staleness_mean"], "staleness_max": m["staleness_max"],
    }


def run_task(name: str, preset: dict[str, Any], workdir: Path, data_dir: str | None) -> dict[str, Any]:
    r = recipe_for(name)
    try:
        task = get_task(name, 0, data_dir if name == "fashion-mnist" else None)
    except TaskError as exc:
        log(f"workloads: {name}: skipped ({exc})")
        return {"skipped": str(exc)}
    steps, workers = preset["steps"] or r.steps, preset["workers"]
    eval_every = preset["eval_every"] or max(1, steps // 5)
    out: dict[str, Any] = {"recipe": r.__dict__, "steps_per_worker": steps, "batch_per_worker": r.batch_size,
                           "parameters": sum(p.numel() for p in task.build_model().parameters())}
    out["step_ms_one_thread"] = step_time_ms(name, task, preset["timing_steps"])
    log(f"workloads: {name}: {out['step_ms_one_thread']} per step on one thread")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like each worker; OpenMP threads on a busy machine only spin
    big = single_process(name, task, workers * r.batch_size, steps, r.warmup_steps)
    # one worker: the small-batch run has the same batch, steps and warm-up (the same run, seed 0)
    small = big if workers == 1 else single_process(name, task, r.batch_size, workers * steps, workers * r.warmup_steps)
    out["single"] = {"big_batch": big, "small_batch": small}
    torch.set_num_threads(threads)
    log(f"workloads: {name}: one process: {out['single']}")
    out["modes"] = {}
    for label in preset["modes"]:
        result = launch(name, MODES[label], preset, steps, eval_every, workdir / name / label.replace(":", ""), data_dir)
        ref = out["single"]["big_batch" if label == "sync" else "small_batch"]
        result["vs_single"] = result[f"final_{r.metric}"] - ref[r.metric]
        out["modes"][label] = result
        log(f"workloads: {name} {label}: {r.metric} {result[f'final_{r.metric}']:.4f} (one process {ref[r.metric]:.4f}), "
             f"{result['wall_s']:.0f} s")
    return out


def run(preset_name: str, tasks: list[str] | None, data_dir: str | None) -> dict[str, Any]:
    preset = PRESETS[preset_name]
    results, targets = {}, []
    with tempfile.TemporaryDirectory(prefix="psgrad-workloads-") as tmp:
        for name in tasks or preset["tasks"]:
            results[name] = res = run_task(name, preset, Path(tmp), data_dir)
            metric = recipe_for(name).metric
            for label, mode in res.get("modes", {}).items():
                targets.append({
                    "name": f"{name} {label}: final {metric} - one process's (same examples seen)",
                    "value": mode[f"final_{metric}"], "ratio": mode["vs_single"], "target": TOLERANCE[metric],
                    "better": "abs-lower", "met": abs(mode["vs_single"]) <= TOLERANCE[metric],
                })
    return {
        "benchmark": "workloads", "preset": preset_name,
        "setup": {k: preset[k] for k in ("servers", "workers", "modes")},
        "machine": machine_info(),
        "results": results, "targets": targets,
    }


# ---------------------------------------------------------------------------------------------
# --part ctr-auc: time to a target AUC across hosts


def ctr_run_mode(bed: Any, mode: str, cfg: dict[str, Any], work: Path) -> dict[str, Any]:
    """One run of `mode`: psgrad's servers on hosts 0, 1 and workers on 2, 3, or all-reduce ranks on 2, 3."""
    from lib.bedjob import train_on_bed

    env = {"PSGRAD_CTR_ROWS": str(cfg["rows"]), "PSGRAD_CTR_DIM": str(cfg["dim"])}
    run_dir = work / mode.replace(":", "-")
    common = ["--task", "ctr", "--steps", str(cfg["steps"]), "--eval-every", str(cfg["eval_every"]),
              "--log-every", str(cfg["steps"]), "--device", "cpu"]
    ps_mode, _, cache = mode.partition(":")
    train_on_bed(bed, run_dir, mode, common, env, allreduce=mode == "allreduce",
                 worker_argv=["--mode", ps_mode, *(CTR_CACHE if cache else [])])
    metrics = analysis.run_metrics(analysis.load_run(run_dir, mode), cfg["target"], "test_auc")
    records = analysis.load_run(run_dir, mode).records.values()
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


def run_ctr(preset: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """--part ctr-auc: every mode's time to the target test AUC on one shaped bed, and the ratios."""
    from lib.netbed import NetBed

    why = NetBed.unavailable()
    if why:
        raise SystemExit(f"workloads --part ctr-auc: no test bed here: {why}")
    results: dict[str, Any] = {}
    with NetBed(4, rate_mbit=cfg["rate_mbit"]) as bed, tempfile.TemporaryDirectory(prefix="psgrad-ctr-") as tmp:
        for mode in cfg["modes"]:
            log(f"ctr_time_to_auc: {mode}: {cfg['rows']:,} rows x {cfg['dim']}, {cfg['steps']} steps, "
                f"links {cfg['rate_mbit']:g} Mbit/s")
            results[mode] = ctr_run_mode(bed, mode, cfg, Path(tmp))
            log(f"ctr_time_to_auc: {mode}: {results[mode]}")
    base = results.get("allreduce", {}).get("time_to_target_s")
    ratios = {f"allreduce_over_{m}": (base / r["time_to_target_s"] if base and r["time_to_target_s"] else None)
              for m, r in results.items() if m != "allreduce"}
    return {"benchmark": "ctr_time_to_auc", "preset": preset, **cfg, "table_bytes": cfg["rows"] * cfg["dim"] * 4,
            "machine": machine_info(), "results": results, "ratios": ratios, "goal": CTR_GOAL}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=PARTS, default="modes",
                        help="modes: each consistency mode beside one process (default); ctr-auc: time to a target "
                        "AUC on task ctr across hosts, beside all-reduce (see above)")
    parser.add_argument("--preset", choices=["full", "quick", "tiny"], default="tiny",
                        help="steps (modes: tiny or full); table size, steps and target (ctr-auc: quick, the same "
                        "tiny, or full) (default: tiny)")
    parser.add_argument("--tasks", help="comma-separated tasks (default: mnist,fashion-mnist,charlm); modes only")
    parser.add_argument("--data-dir", help="fashion-mnist's IDX files (default: /usr/share/datasets/fashion-mnist); "
                        "modes only")
    parser.add_argument("--rows", type=int, help="override the table's rows (PSGRAD_CTR_ROWS); ctr-auc only")
    parser.add_argument("--steps", type=int, help="override the steps per worker and run; ctr-auc only")
    parser.add_argument("--target", type=float, help="override the target test AUC; ctr-auc only")
    parser.add_argument("--rate-mbit", type=float, help="override every link's rate in Mbit/s; ctr-auc only")
    parser.add_argument("--modes", type=lambda text: text.split(","), help=f"comma-separated, of {', '.join(CTR_MODES)} "
                        "(default: async,sync,allreduce); ctr-auc only")
    args = parser.parse_args()
    mine = {"modes": ("tasks", "data_dir"), "ctr-auc": ("rows", "steps", "target", "rate_mbit", "modes")}
    other = [f"--{k.replace('_', '-')}" for part, keys in mine.items() if part != args.part for k in keys
             if getattr(args, k) is not None]
    if other:
        parser.error(f"{', '.join(other)}: not for --part {args.part}")
    if args.part == "ctr-auc":
        bad = sorted(set(args.modes or ()) - set(CTR_MODES))
        if bad:
            parser.error(f"--modes takes {', '.join(CTR_MODES)}, got {', '.join(bad)}")
        write_json(run_ctr(args.preset, overrides(args, CTR_PRESETS[args.preset])))
        return
    if args.preset not in PRESETS:
        parser.error(f"--part modes has presets {', '.join(sorted(PRESETS))}, not {args.preset}")
    write_json(run(args.preset, args.tasks.split(",") if args.tasks else None, args.data_dir))


if __name__ == "__main__":
    main()
