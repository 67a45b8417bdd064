"""Does communication keep out of the way of compute? Two parts (--part), each with a simulated compute
of T ms per step: data-parallel scaling over W workers (workers, the default), and one worker
overlapping its communication with its compute (overlap).

    python benchmarks/scaling.py --preset full                    # 2M parameters, T = 0 to 200 ms, 1 and 2 shards
    python benchmarks/scaling.py --preset tiny                    # CI-sized (~15 s)
    python benchmarks/scaling.py --part overlap --preset full     # 4M float32 parameters (16 MB), 1 shard
    python benchmarks/scaling.py --part overlap --preset tiny     # CI smoke run, a few seconds

--part workers: samples/s with W = 1, 2, 4 workers against the ideal W x the single worker's
samples/s, on 1 and 2 shards. Each worker process (this script, `--worker`) pulls once, then repeats
sleep T -> exchange through the psgrad client (async mode, lr 1e-9): `ParameterClient.exchange`
pushes clock c and pulls c + 1, one Step call per shard, as PSOptimizer.step() does.
`--no-shared-memory` sends every payload through gRPC frames (as from another host) instead of the
default same-host segments. Sleeping stands for the forward/backward pass: it takes time but no CPU,
so what limits scaling is what psgrad itself costs (the network path, the servers' decode and apply,
and the CPUs the processes share), not W copies of a model fighting over 2 cores. The W workers of a
round start together; samples/s = batch x the steps completed inside the measured window / its
length (a step straddling an end counts by the fraction inside). For each shard count and T, the
rounds with W = 1, 2, 4 run back to back in one repetition (the order rotates between repetitions);
efficiency(W) = samples/s(W) / (W x samples/s(1)), medians over the repetitions (each repetition's
own ratio is kept too). The report gives the smallest T at which efficiency reaches 0.9 and, for the
configurations below it, what limited them: psgrad's CPU cost per step (servers' and workers' CPU
time / steps) tells whether W workers at one worker's pace need more cores than the machine has.

--part overlap: does overlapping communication with computation hide the network? One worker runs
the user's loop through the Python API (psgrad.connect / optimizer / step). Compute is simulated by
sleeping T per step (as a GPU computing while the host is idle would), with T set to the measured
communication time C of a step (push + pull, overlap off, no compute) in this same run. Then, in
alternating rounds, it times steps with overlap off (expected about T + C), on (expected about
max(T, C)) and again without compute (C, whose median over all rounds is the figure the ratios use);
target: overlap on <= 1.3 x max(T, C).

With --part overlap --device cuda the model lives on the GPU and the report adds the per-step
split into compute, device<->host copies and network, with the pinned-memory copy ceiling measured
in the same run. Prints one JSON document; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import os
import statistics
import threading
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
    psgrad_server,
    start_server,
    target,
    write_json,
)
from lib.window import Fleet, completed, measure_window, rotated, worker_main

PARTS = ("workers", "overlap")
PRESETS: dict[str, dict[str, Any]] = {  # --part workers
    "tiny": {"params": 250_000, "shards": (1,), "workers": (1, 2), "compute_ms": (0, 20), "reps": 1,
             "warmup_s": 0.1, "window_s": 0.25},
    "full": {"params": 2_000_000, "shards": (1, 2), "workers": (1, 2, 4), "compute_ms": (0, 10, 50, 100, 200),
             "reps": 3, "warmup_s": 0.5, "window_s": 1.5},
}
BATCH = 32  # samples per step per worker (notional: the compute is simulated)
LR = 1e-9
GOAL = 0.9
WINDOW_STEPS = 10  # a window holds at least about this many compute times
OVERLAP_PRESETS: dict[str, dict[str, int]] = {  # --part overlap
    "tiny": {"params": 200_000, "steps": 12, "blocks": 1},
    "full": {"params": 4_000_000, "steps": 40, "blocks": 3},
}
OVERLAP_TARGET = 1.3


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


# ---------------------------------------------------------------------------------------------
# Parent


def _round(workers: list[Child], key: str, pids: list[int], compute_ms: float, warmup_s: float,
           window_s: float) -> dict[str, Any]:
    compute_s = compute_ms / 1000
    window = max(window_s, WINDOW_STEPS * compute_s)
    m = measure_window(workers, {"op": "steps", "key": key, "compute_s": compute_s}, pids,
                       max(warmup_s, 2 * compute_s), window)
    c = completed(m)
    comm_s = [x for r in m["replies"] for x in r["comm_s"]]
    return {
        "window_s": c["window_s"],
        "steps": c["count"],
        "samples_per_s": BATCH * c["per_s"],
        "step_ms_median": 1000 * statistics.median(c["op_s"]),
        "comm_ms_median": 1000 * statistics.median(comm_s),
        **{k: c[k] for k in ("server_cores_busy", "workers_cores_busy")},
        "cpu_ms_per_step": 1000 * (m["server_cpu_s"] + m["workers_cpu_s"]) / c["count"] if c["count"] else 0.0,
        "machine_busy_fraction": c["machine_busy_fraction"],
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
    with Fleet(str(Path(__file__).resolve())) as fleet:
        for s in shard_counts:
            for i in range(s):
                fleet.servers[f"S{s}/{i}"] = start_server(f"psgrad-S{s}-{i}", PSGRAD_SERVER)
        max_w = max(worker_counts)
        workers = fleet.start_workers(max_w)
        addresses, server_pids = fleet.addresses(), fleet.pids()
        jobs = {f"S{s}": [addresses[f"S{s}/{i}"] for i in range(s)] for s in shard_counts}
        pids = {f"S{s}": [server_pids[f"S{s}/{i}"] for i in range(s)] for s in shard_counts}
        log(f"servers up: {jobs}; setting up {max_w} workers, {params:,} parameters")
        fleet.setup(lambda rank: {"op": "setup", "rank": rank, "num_workers": max_w, "params": params, "jobs": jobs,
                                  "shared_memory": shared_memory})

        rows: dict[tuple[str, float, int], list[dict[str, Any]]] = {}
        for rep in range(reps):
            for key in jobs:
                for t in compute_ms:
                    for count in rotated(worker_counts, rep):
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


# ---------------------------------------------------------------------------------------------
# --part overlap: one worker through the Python API


def _sync(device: Any) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def run_block(
    addresses: list[str], numel: int, steps: int, compute_s: float, overlap: bool, device: Any
) -> dict[str, float]:
    """Join, run `steps` steps of (simulated compute, step()), leave; medians of the step split."""
    import torch

    import psgrad
    from psgrad.config import ClientConfig

    model = torch.nn.Module()  # one big parameter: the gradient is set by hand, compute is simulated
    model.weight = torch.nn.Parameter(torch.zeros(numel, device=device))
    cfg = ClientConfig(rpc_timeout_s=120)
    timer = threading.Event()
    times: dict[str, list[float]] = {k: [] for k in ("step_s", "d2h_s", "h2d_s", "exchange_s", "wait_s")}
    with psgrad.connect(addresses, optimizer=psgrad.SGD(lr=1e-9), client=cfg) as ps:
        opt = ps.optimizer(model, overlap=overlap)
        assert model.weight.grad is not None
        model.weight.grad.fill_(1e-3)  # the "gradient" every step pushes
        for k in range(steps + 2):  # the first two steps fill the pipeline and are not timed
            t0 = time.perf_counter()
            if compute_s > 0:
                timer.wait(compute_s)  # the simulated computation (an interruptible sleep)
            stats = opt.step()
            elapsed = time.perf_counter() - t0
            if k >= 2:
                times["step_s"].append(elapsed)
                for key in ("d2h_s", "h2d_s", "exchange_s", "wait_s"):
                    value = getattr(stats, key)
                    if value is not None:
                        times[key].append(value)
    return {k: statistics.median(v) for k, v in times.items() if v}


def pinned_copy_ceiling(numel: int, device: Any, reps: int = 10) -> dict[str, float]:
    """GB/s of device->pinned-host and pinned-host->device copies of numel float32 values."""
    import torch

    src = torch.empty(numel, device=device)
    host = torch.empty(numel, pin_memory=True)
    d2h, h2d = [], []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        host.copy_(src, non_blocking=True)
        _sync(device)
        t1 = time.perf_counter()
        src.copy_(host, non_blocking=True)
        _sync(device)
        t2 = time.perf_counter()
        d2h.append(t1 - t0)
        h2d.append(t2 - t1)
    nbytes = numel * 4
    return {"d2h_gb_per_s": nbytes / statistics.median(d2h) / 1e9, "h2d_gb_per_s": nbytes / statistics.median(h2d) / 1e9}


def run_overlap(preset: str, params: int | None = None, device_name: str = "cpu") -> dict[str, Any]:
    """--part overlap: one worker's step time with overlap off and on, beside its communication time."""
    import torch

    cfg = dict(OVERLAP_PRESETS[preset])
    numel = params or cfg["params"]
    device = torch.device(device_name)
    # One intra-op thread: the worker shares this machine with the server, and OpenMP threads
    # waiting for a busy core turn a 1 ms copy into a 10 ms one.
    torch.set_num_threads(1)
    proc, address = psgrad_server("overlap-server", "--port", "0")
    try:
        addresses = [address]
        log(f"overlap: {numel:,} parameters through 1 shard at {address}, device {device}")
        first = run_block(addresses, numel, cfg["steps"], 0.0, False, device)
        compute_s = first["step_s"]
        log(f"overlap: communication per step C = {compute_s * 1e3:.1f} ms: simulated compute T = C")
        blocks: dict[str, list[dict[str, float]]] = {"comm": [first], "off": [], "on": []}
        for b in range(cfg["blocks"]):  # alternate, so machine noise hits every configuration alike
            for name, overlap, t in (("off", False, compute_s), ("on", True, compute_s), ("comm", False, 0.0)):
                res = run_block(addresses, numel, cfg["steps"], t, overlap, device)
                blocks[name].append(res)
                log(f"overlap: round {b + 1}/{cfg['blocks']} {name}: step {res['step_s'] * 1e3:.1f} ms")
        comm = {"step_s": statistics.median(r["step_s"] for r in blocks["comm"])}
        step_off = statistics.median(r["step_s"] for r in blocks["off"])
        step_on = statistics.median(r["step_s"] for r in blocks["on"])
        bound = max(compute_s, comm["step_s"])
        out: dict[str, Any] = {
            "benchmark": "overlap",
            "preset": preset,
            "params": numel,
            "payload_bytes": numel * 4,
            "device": str(device),
            "machine": machine_info(),
            "communication_s": comm["step_s"],
            "compute_s": compute_s,
            "step_overlap_off_s": step_off,
            "step_overlap_on_s": step_on,
            "off_vs_sum": step_off / (compute_s + comm["step_s"]),
            "on_vs_max": step_on / bound,
            "split_overlap_off": blocks["off"][-1],
            "split_overlap_on": blocks["on"][-1],
            "targets": [{
                "name": "overlap: step time / max(compute, communication)",
                "value": step_on, "ceiling": bound, "ratio": step_on / bound,
                "target": OVERLAP_TARGET, "better": "lower", "met": step_on / bound <= OVERLAP_TARGET,
            }],
            "notes": "compute is simulated by sleeping (the host is idle, as while a GPU computes); "
                     "C is the median no-compute step (push + pull + copies) measured in this run",
        }
        if device.type == "cuda":  # psgrad's own staging copies beside the pinned-copy ceiling
            split = blocks["off"][-1]
            ceiling = pinned_copy_ceiling(numel, device)
            mine = {
                "d2h_gb_per_s": numel * 4 / split["d2h_s"] / 1e9 if split.get("d2h_s") else None,
                "h2d_gb_per_s": numel * 4 / split["h2d_s"] / 1e9 if split.get("h2d_s") else None,
            }
            out["copies"] = {"psgrad": mine, "pinned_ceiling": ceiling}
        return out
    finally:
        proc.stop(grace_s=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=PARTS, default="workers",
                        help="workers: data-parallel scaling over W workers (default); overlap: one worker "
                        "overlapping communication with compute (see above)")
    add_preset(parser, PRESETS, "sizes and sweep (workers), model size and repetitions (overlap)")
    parser.add_argument("--no-shared-memory", dest="shared_memory", action="store_false",
                        help="send every payload through gRPC frames, as from another host (default: the "
                        "same-host shared-memory path); --part workers only")
    parser.add_argument("--params", type=int, help="override the number of float32 parameters; --part overlap only")
    parser.add_argument("--device", help="cpu or cuda[:N] (default: cpu); --part overlap only")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(_Trainer)
        return
    if args.part == "overlap":
        if not args.shared_memory:
            parser.error("--no-shared-memory applies to --part workers, not overlap")
        write_json(run_overlap(args.preset, args.params, args.device or "cpu"))
        return
    given = [flag for flag, value in (("--params", args.params), ("--device", args.device)) if value is not None]
    if given:
        parser.error(f"{', '.join(given)}: only for --part overlap")
    write_json(run(args.preset, args.shared_memory))


if __name__ == "__main__":
    main()
