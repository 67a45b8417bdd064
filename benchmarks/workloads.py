"""Real workloads through psgrad beside one process: does each consistency mode reach what a single
process reaches with the same model, data and number of examples seen?

    python benchmarks/workloads.py --preset full                   # mnist, fashion-mnist, charlm
    python benchmarks/workloads.py --preset full --tasks charlm    # one of them
    python benchmarks/workloads.py --preset tiny                   # CI smoke run: a few steps of each

For each task (its recipe: model, optimizer, lr schedule, batch size B, steps S per worker):
- the time of one training step (forward, backward, torch optimizer step) on one CPU thread: the
  median wall time and the median CPU time (the CPU time is what an idle core would take);
- `psgrad launch` with 2 servers and 4 workers in sync, async and ssp (staleness 2) mode, S steps
  each: 4 x S x B examples seen; the final metric is the last worker's final evaluation;
- one process (a plain torch loop, torch's own optimizer and LambdaLR) seeing as many examples:
  batch 4B for S steps (sync's equivalent: one update per 4 x B examples) and batch B for 4 x S
  steps (async's and ssp's: one update per B examples, 4 x S updates). Each mode is compared with
  the one it is equivalent to; the bar is 1 accuracy point, or 0.05 bits per byte.

fashion-mnist runs where its IDX files are (--data-dir, default the Debian package's directory) and
is reported as skipped, with the reason, elsewhere. Prints one JSON document; progress on stderr.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from lib import add_preset, log, machine_info, psgrad_launch, write_json

from psgrad.core.schedule import lr_factor
from psgrad.errors import TaskError
from psgrad.experiments import analysis
from psgrad.tasks import get_task, recipe_for
from psgrad.tasks.base import Task
from psgrad.tasks.data import BatchSchedule

MODES = {"sync": ["--mode", "sync"], "async": ["--mode", "async"], "ssp:2": ["--mode", "ssp", "--staleness", "2"]}
TOLERANCE = {"test_accuracy": 0.01, "test_bpb": 0.05}
PRESETS: dict[str, dict[str, Any]] = {
    # CI: every piece once (the timing, both single-process runs, a sync launch), a few steps
    "tiny": {"tasks": ["mnist", "charlm"], "servers": 1, "workers": 1, "modes": ["sync"], "steps": 4,
             "timing_steps": 2, "eval_every": 2},
    "full": {"tasks": ["mnist", "fashion-mnist", "charlm"], "servers": 2, "workers": 4, "modes": list(MODES),
             "steps": None, "timing_steps": 20, "eval_every": 0},
}


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
    out["single"] = {
        "big_batch": single_process(name, task, workers * r.batch_size, steps, r.warmup_steps),
        "small_batch": single_process(name, task, r.batch_size, workers * steps, workers * r.warmup_steps),
    }
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_preset(parser, PRESETS, "steps")
    parser.add_argument("--tasks", help="comma-separated tasks (default: mnist,fashion-mnist,charlm)")
    parser.add_argument("--data-dir", help="fashion-mnist's IDX files (default: /usr/share/datasets/fashion-mnist)")
    args = parser.parse_args()
    write_json(run(args.preset, args.tasks.split(",") if args.tasks else None, args.data_dir))


if __name__ == "__main__":
    main()
