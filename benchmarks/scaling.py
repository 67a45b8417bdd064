"""Data-parallel scaling: samples/s with W = 1, 2, 4 workers and a simulated compute of T ms per
step, against the ideal W x the single worker's samples/s, on 1 and 2 shards.

    python benchmarks/scaling.py --preset full   # 2M parameters, T = 0 to 200 ms, 1 and 2 shards
    python benchmarks/scaling.py --preset tiny   # CI-sized (~15 s)

Each worker process (this script, `--worker`) pulls once, then repeats sleep T -> exchange through
the psgrad client (async mode, lr 1e-9): `ParameterClient.exchange` pushes clock c and pulls c + 1,
one Step call per shard, as PSOptimizer.step() does. `--no-shared-memory` sends every payload
through gRPC frames (as from another host) instead of the default same-host segments. Sleeping stands for the forward/backward pass: it takes time but
no CPU, so what limits scaling is what psgrad itself costs (the network path, the servers' decode
and apply, and the CPUs the processes share), not W copies of a model fighting over 2 cores. The
W workers of a round start together; samples/s = batch x the steps completed inside the measured
window / its length (a step straddling an end counts by the fraction inside). For each shard
count and T, the rounds with W = 1, 2, 4 run back to back in one repetition (the order rotates
between repetitions); efficiency(W) = samples/s(W) / (W x samples/s(1)), medians over the
repetitions (each repetition's own ratio is kept too). The report gives the smallest T at which
efficiency reaches 0.9 and, for the configurations below it, what limited them: psgrad's CPU cost
per step (servers' and workers' CPU time / steps) tells whether W workers at one worker's pace
need more cores than the machine has. Prints one JSON document.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from lib import (
    PSGRAD_SERVER,
    SETUP_TIMEOUT_S,
    Child,
    CommandChild,
    add_preset,
    figure,
    log,
    machine_info,
    start_server,
    stop_all,
    target,
    write_json,
)
from lib.window import in_window, measure_window

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"params": 250_000, "shards": (1,), "workers": (1, 2), "compute_ms": (0, 20), "reps": 1,
             "warmup_s": 0.2, "window_s": 0.5},
    "full": {"params": 2_000_000, "shards": (1, 2), "workers": (1, 2, 4), "compute_ms": (0, 10, 50, 100, 200),
             "reps": 3, "warmup_s": 0.5, "window_s": 1.5},
}
BATCH = 32  # samples per step per worker (notional: the compute is simulated)
LR = 1e-9
GOAL = 0.9
WINDOW_STEPS = 10  # a window holds at least about this many compute times


# ---------------------------------------------------------------------------------------------
# Worker process


class _Trainer(CommandChild):
    """One worker process: a psgrad client per shard count, over shared flat buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.loops: dict[str, Any] = {}

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd["op"] == "setup":
            self._setup(cmd)
            return {"ok": True}
        if cmd["op"] == "steps":
            return self.loops[cmd["key"]](float(cmd["compute_s"]), float(cmd["run_s"]))
        raise ValueError(f"unknown op {cmd['op']!r}")

    def _setup(self, cmd: dict[str, Any]) -> None:
        import torch

        from psgrad.client.parameter_client import ParameterClient
        from psgrad.config import ClientConfig, JobSpec
        from psgrad.core.sharding import ParamSpec, plan_shards

        numel, rank = int(cmd["params"]), int(cmd["rank"])
        flat, grad = torch.zeros(numel), torch.full((numel,), 1e-3)
        params = [ParamSpec("weight", (numel,), "float32")]
        config = ClientConfig(rpc_timeout_s=300.0, init_timeout_s=SETUP_TIMEOUT_S,
                              shared_memory=bool(cmd["shared_memory"]))
        for key, servers in cmd["jobs"].items():
            spec = JobSpec(mode="async", num_workers=int(cmd["num_workers"]), num_shards=len(servers), lr=LR)
            client = ParameterClient(servers, spec, params, plan_shards(params, len(servers)), rank, config)
            self.closers.append(client.close)
            clock = client.join(initial_weights=(lambda: torch.zeros(numel)) if rank == 0 else None)
            client.pull(flat, clock)
            self.loops[key] = self._loop(client, flat, grad, clock)

    @staticmethod
    def _loop(client: Any, flat: Any, grad: Any, clock: int) -> Any:
        def steps(compute_s: float, run_s: float) -> dict[str, Any]:
            """sleep(compute_s) -> exchange (push clock, pull clock + 1), back to back, for run_s seconds."""
            nonlocal clock
            go = time.monotonic()
            starts, ends, comm = [], [], []
            while (t0 := time.monotonic()) < go + run_s:
                if compute_s > 0:
                    time.sleep(compute_s)  # the simulated forward/backward pass
                t1 = time.monotonic()
                client.exchange(grad, clock, flat)
                t2 = time.monotonic()
                clock += 1
                starts.append(t0)
                ends.append(t2)
                comm.append(t2 - t1)
            return {"go": go, "start": starts, "done": ends, "comm_s": comm}

        return steps


def worker_main() -> None:
    import psgrad.client.shard_client  # noqa: F401  (import torch and grpc while the servers start)

    _Trainer().serve()


# ---------------------------------------------------------------------------------------------
# Parent


def _round(workers: list[Child], key: str, pids: list[int], compute_ms: float, warmup_s: float,
           window_s: float) -> dict[str, Any]:
    compute_s = compute_ms / 1000
    window = max(window_s, WINDOW_STEPS * compute_s)
    m = measure_window(workers, {"op": "steps", "key": key, "compute_s": compute_s}, pids,
                       max(warmup_s, 2 * compute_s), window)
    t1, t2, replies = m["t1"], m["t2"], m["replies"]
    steps = sum(in_window(r["start"], r["done"], t1, t2) for r in replies)
    step_s = [b - a for r in replies for a, b in zip(r["start"], r["done"])]
    comm_s = [c for r in replies for c in r["comm_s"]]
    return {
        "window_s": t2 - t1,
        "steps": steps,
        "samples_per_s": BATCH * steps / (t2 - t1),
        "step_ms_median": 1000 * statistics.median(step_s),
        "comm_ms_median": 1000 * statistics.median(comm_s),
        "server_cores_busy": m["server_cpu_s"] / (t2 - t1),
        "workers_cores_busy": m["workers_cpu_s"] / (t2 - t1),
        "cpu_ms_per_step": 1000 * (m["server_cpu_s"] + m["workers_cpu_s"]) / steps if steps else 0.0,
        "machine_busy_fraction": m["machine_busy_fraction"],
    }


def _why(row: dict[str, Any], single: dict[str, Any], shards: int, cpus: int) -> str:
    """What limited a configuration whose efficiency is below the goal, from its own measurements.

    psgrad's CPU cost of one step (servers' and workers' CPU time per step) times the steps W
    workers would make at one worker's pace is the CPU that ideal scaling needs; past the machine's
    cores, psgrad itself is the limit, whatever else runs.
    """
    need = row["workers"] * single["cpu_ms_per_step"] / single["step_ms_median"]
    comm = f"the push+pull exchange took {row['comm_ms_median']:.1f} ms per step (vs {single['comm_ms_median']:.1f} ms alone)"
    use = (f"servers {row['server_cores_busy']:.2f} + workers {row['workers_cores_busy']:.2f} cores of {cpus}, "
           f"machine {row['machine_busy_fraction']:.0%} busy")
    cost = (f"one step costs {single['cpu_ms_per_step']:.1f} CPU-ms of pull/push (de)serialization and apply, "
            f"so {row['workers']} workers at one worker's pace need {need:.2f} cores")
    if need >= 0.8 * cpus:
        return f"psgrad's own CPU cost saturates the machine: {cost} ({use}); {comm}"
    if row["server_cores_busy"] >= 0.8 * shards:
        return (f"the server process(es) were saturated ({use}): Python gRPC handlers and the apply run one "
                f"at a time per shard, so {comm}")
    if row["machine_busy_fraction"] >= 0.8:
        return (f"other work on the machine took the CPU: {cost}, but the machine was "
                f"{row['machine_busy_fraction']:.0%} busy ({use}), so {comm}; rerun on a quieter machine")
    return f"communication latency, not CPU: {cost} ({use}); {comm}"


def measure(params: int, shard_counts: tuple[int, ...], worker_counts: tuple[int, ...],
            compute_ms: tuple[float, ...], reps: int, warmup_s: float, window_s: float,
            shared_memory: bool = True) -> dict[str, Any]:
    """Start the servers (one set per shard count) and workers, run the rounds, stop everything.
    shared_memory=False: the workers send every payload through gRPC frames."""
    sets: dict[str, list[Child]] = {}
    workers: list[Child] = []
    try:
        for s in shard_counts:
            sets[f"S{s}"] = []
            for i in range(s):
                sets[f"S{s}"].append(start_server(f"psgrad-S{s}-{i}", PSGRAD_SERVER))
        max_w = max(worker_counts)
        for r in range(max_w):
            workers.append(Child(f"worker{r}", [sys.executable, str(Path(__file__).resolve()), "--worker"]))
        jobs = {key: [s.address(timeout_s=SETUP_TIMEOUT_S) for s in servers] for key, servers in sets.items()}
        pids = {key: [s.popen.pid for s in servers] for key, servers in sets.items()}
        log(f"servers up: {jobs}; setting up {max_w} workers, {params:,} parameters")
        for rank, w in enumerate(workers):  # all at once: non-chief joins wait for the chief's init
            w.send({"op": "setup", "rank": rank, "num_workers": max_w, "params": params, "jobs": jobs,
                    "shared_memory": shared_memory})
        for w in workers:
            w.recv(SETUP_TIMEOUT_S)

        rows: dict[tuple[str, float, int], list[dict[str, Any]]] = {}
        for rep in range(reps):
            for key in jobs:
                for t in compute_ms:
                    k = rep % len(worker_counts)
                    for count in worker_counts[k:] + worker_counts[:k]:
                        r = _round(workers[:count], key, pids[key], t, warmup_s, window_s)
                        r["rep"] = rep
                        rows.setdefault((key, t, count), []).append(r)
                        log(f"{key} T={t:g} ms W={count} rep {rep}: {r['samples_per_s']:8.0f} samples/s, step "
                            f"{r['step_ms_median']:.1f} ms, comm {r['comm_ms_median']:.1f} ms, servers "
                            f"{r['server_cores_busy']:.2f} + workers {r['workers_cores_busy']:.2f} cores, "
                            f"machine {r['machine_busy_fraction']:.0%} busy")
        return {"params": params, "payload_bytes": 4 * params, "batch": BATCH, "shards": list(shard_counts),
                "workers": list(worker_counts), "compute_ms": list(compute_ms), "reps": reps,
                "results": _summarize(rows, shard_counts, worker_counts, compute_ms)}
    finally:
        stop_all([*workers, *(c for servers in sets.values() for c in servers)])  # all asked at once


def _summarize(rows: dict[tuple[str, float, int], list[dict[str, Any]]], shard_counts: tuple[int, ...],
               worker_counts: tuple[int, ...], compute_ms: tuple[float, ...]) -> list[dict[str, Any]]:
    out = []
    for s in shard_counts:
        key = f"S{s}"
        for t in compute_ms:
            singles = rows[(key, t, 1)]
            for count in worker_counts:
                rounds = rows[(key, t, count)]
                med = {k: statistics.median(r[k] for r in rounds) for k in (
                    "samples_per_s", "step_ms_median", "comm_ms_median", "server_cores_busy",
                    "workers_cores_busy", "cpu_ms_per_step", "machine_busy_fraction")}
                ideal = count * statistics.median(r["samples_per_s"] for r in singles)
                row = {"shards": s, "compute_ms": t, "workers": count, **med, "ideal_samples_per_s": ideal,
                       "efficiency": med["samples_per_s"] / ideal,
                       # W workers beside the single worker of the same repetition (they ran back to back)
                       "efficiency_by_rep": [r["samples_per_s"] / (count * one["samples_per_s"])
                                             for r, one in zip(rounds, singles)]}
                out.append(row)
    return out


def falloff(results: list[dict[str, Any]], cpus: int) -> list[dict[str, Any]]:
    """Per shard count and W > 1: the smallest T with efficiency >= GOAL (from which every larger T
    also reaches it), and why each configuration below the goal fell short."""
    out = []
    singles = {(r["shards"], r["compute_ms"]): r for r in results if r["workers"] == 1}
    for s in sorted({r["shards"] for r in results}):
        for count in sorted({r["workers"] for r in results if r["workers"] > 1}):
            rows = sorted((r for r in results if r["shards"] == s and r["workers"] == count),
                          key=lambda r: r["compute_ms"])
            reaching = None
            for r in reversed(rows):
                if r["efficiency"] < GOAL:
                    break
                reaching = r["compute_ms"]
            below = [{"compute_ms": r["compute_ms"], "efficiency": r["efficiency"],
                      "why": _why(r, singles[(s, r["compute_ms"])], s, cpus)} for r in rows if r["efficiency"] < GOAL]
            out.append({"shards": s, "workers": count, "min_compute_ms_for_goal": reaching, "below_goal": below})
    return out


def targets_and_figures(results: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    max_w = max(r["workers"] for r in results)
    targets, figures = [], []
    for r in results:
        label = f"{r['workers']} workers, {r['shards']} shard(s), T = {r['compute_ms']:g} ms"
        if r["workers"] == max_w and max_w > 1:
            targets.append(target(f"scaling: samples/s, {label}", r["samples_per_s"], r["ideal_samples_per_s"],
                                  GOAL, "higher", "samples/s", f"{max_w} x the single worker's samples/s"))
        elif r["workers"] > 1:
            figures.append(figure(f"scaling: samples/s, {label}", r["samples_per_s"], "samples/s",
                                  r["ideal_samples_per_s"], f"{r['workers']} x the single worker's samples/s"))
        else:
            figures.append(figure(f"scaling: samples/s, {label}", r["samples_per_s"], "samples/s"))
    return targets, figures


def run(preset: str, shared_memory: bool = True) -> dict[str, Any]:
    """The suite's scaling part: samples/s and efficiency per shard count, T and W; where it falls off."""
    p = PRESETS[preset]
    m = measure(p["params"], p["shards"], p["workers"], p["compute_ms"], p["reps"], p["warmup_s"], p["window_s"],
                shared_memory)
    targets, figures = targets_and_figures(m["results"])
    return {"benchmark": "scaling", "preset": preset, "shared_memory": shared_memory, **m,
            "falloff": falloff(m["results"], os.cpu_count() or 1),
            "machine": machine_info(), "targets": targets, "figures": figures,
            "notes": "compute is simulated with sleep (no CPU); efficiency = median samples/s(W) / (W x median "
                     "samples/s(1)); cpu_ms_per_step = (servers' + workers' CPU time) / steps; measured on a "
                     "shared machine, every W beside W = 1 in the same repetition."}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_preset(parser, PRESETS, "sizes and sweep")
    parser.add_argument("--no-shared-memory", dest="shared_memory", action="store_false",
                        help="send every payload through gRPC frames, as from another host (default: the "
                        "same-host shared-memory path)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main()
        return
    write_json(run(args.preset, args.shared_memory))


if __name__ == "__main__":
    main()
