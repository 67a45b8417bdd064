"""One shard under concurrent pushes: sustained pushes/s, server CPU-seconds per GB applied and peak
memory, for SGD, SGD with momentum and Adam, beside raw gRPC upload of the same bytes.

    python benchmarks/server_bench.py --preset full   # 25M float32 parameters, 1, 2 and 4 workers
    python benchmarks/server_bench.py --preset tiny   # 1M parameters, 1 and 2 workers (CI, ~15 s)
    python benchmarks/server_bench.py --preset full --server-env MALLOC_ARENA_MAX=2   # + twin servers
    python benchmarks/server_bench.py --preset full --stream-window-bytes 0   # gRPC's own windows

One psgrad server process per optimizer (`python -m psgrad server`), one raw gRPC server
(benchmarks/lib/raw_grpc.py) and W worker processes of this script (`--worker`). Workers only push
(async mode, lr 1e-9, no pulls, no compute). A round gives W workers one target; they start
together after a barrier and push back to back; the parent reads the server's CPU time from
/proc/PID/stat at the start and the end of a measured window, after a warm-up, and counts the
pushes that completed inside it (a push straddling an end counts by the fraction inside). Rounds of all targets are interleaved, repetition by repetition
(the order rotates), so machine noise hits psgrad and the raw ceiling alike. After the rounds of
each W, the parent reads each psgrad server's peak resident memory (VmHWM in /proc/PID/status)
and compares what the shard added to its idle process (VmHWM minus the RSS before
initialization) with 2 x (weights + optimizer state) + 64 MB. Prints one JSON document.
--stream-window-bytes N starts every psgrad server with that stream window (as `psgrad server
--stream-window-bytes`), to see what the window costs in memory; transport.py measures its speed.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from lib import (
    PSGRAD_SERVER,
    RAW_SERVER,
    SETUP_TIMEOUT_S,
    Child,
    CommandChild,
    add_preset,
    figure,
    log,
    machine_info,
    start_server,
    target,
    window_argv,
    window_bytes_arg,
    write_json,
)
from lib.procfs import OwnPeak, memory_bytes
from lib.window import Fleet, completed, measure_window, rotated, worker_main

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"params": 1_000_000, "workers": (1, 2), "reps": 1, "warmup_s": 0.1, "window_s": 0.25},
    "full": {"params": 25_000_000, "workers": (1, 2, 4), "reps": 3, "warmup_s": 1.0, "window_s": 3.0},
}
# The job spec fields of each measured optimizer (besides mode async, lr 1e-9).
OPTIMIZERS: dict[str, dict[str, Any]] = {
    "sgd": {"optimizer": "sgd"},
    "momentum": {"optimizer": "sgd", "momentum": 0.9},
    "adam": {"optimizer": "adam"},
}
RAW = "raw"
LR = 1e-9
MB = 1e6
SLACK_BYTES = 64 * 10**6  # the target's "+ 64 MB"


def expected_state_bytes(name: str, numel: int) -> int:
    """Optimizer state of a shard of numel elements, as the optimizer's state_bytes() reports it."""
    from psgrad.core.optimizers import ADAM_BLOCK

    spec = OPTIMIZERS[name]
    if spec["optimizer"] == "adam":
        return 8 * numel + 4 * min(numel, ADAM_BLOCK)  # two moments + the denominator's scratch block
    return 4 * numel if spec.get("momentum") else 0


# ---------------------------------------------------------------------------------------------
# Worker process


class _Pusher(CommandChild):
    """One worker process: a psgrad client per measured server and a raw gRPC client."""

    def __init__(self) -> None:
        super().__init__()
        self.push: dict[str, Any] = {}

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd["op"] == "setup":
            self._setup(cmd)
            return {"ok": True, "pid": os.getpid()}
        if cmd["op"] == "push":
            return self._run(cmd["target"], float(cmd["run_s"]))
        raise ValueError(f"unknown op {cmd['op']!r}")

    def _setup(self, cmd: dict[str, Any]) -> None:
        import torch
        from lib.raw_grpc import RawClient

        from psgrad.client.parameter_client import ParameterClient
        from psgrad.core.codecs import byte_view
        from psgrad.config import ClientConfig, JobSpec
        from psgrad.core.sharding import ParamSpec, plan_shards

        numel, rank, chunk = int(cmd["params"]), int(cmd["rank"]), int(cmd["chunk"])
        grad = torch.full((numel,), 1e-3)
        params = [ParamSpec("weight", (numel,), "float32")]
        plan = plan_shards(params, 1)
        config = ClientConfig(rpc_timeout_s=300.0, init_timeout_s=SETUP_TIMEOUT_S, chunk_bytes=chunk)
        for name, job in cmd["servers"].items():
            spec = JobSpec(mode="async", num_workers=int(cmd["num_workers"]), lr=LR, **job["spec"])
            client = ParameterClient([job["address"]], spec, params, plan, rank,
                                     dataclasses.replace(config, shared_memory=job["shared_memory"]))
            self.closers.append(client.close)
            start = client.join(initial_weights=(lambda: torch.zeros(numel)) if rank == 0 else None)
            self.push[name] = self._psgrad_push(client, grad, start)
        raw = RawClient(cmd["raw"])
        self.closers.append(raw.close)
        payload = byte_view(grad)

        def upload() -> int:
            raw.upload(payload, chunk)
            return 0  # nothing to apply: never "not applied"

        self.push[RAW] = upload

    @staticmethod
    def _psgrad_push(client: Any, grad: Any, clock: int) -> Any:
        def push() -> int:
            nonlocal clock
            replies = client.push(grad, clock)
            clock += 1
            return sum(not r.applied for r in replies)

        return push

    def _run(self, name: str, run_s: float) -> dict[str, Any]:
        """Push back to back for run_s seconds; completion times on the shared monotonic clock."""
        push = self.push[name]
        go = time.monotonic()
        starts, done, not_applied = [], [], 0
        while (t0 := time.monotonic()) < go + run_s:
            not_applied += push()
            starts.append(t0)
            done.append(time.monotonic())
        return {"go": go, "start": starts, "done": done, "not_applied": not_applied}


# ---------------------------------------------------------------------------------------------
# Parent


def _round(
    workers: list[Child], name: str, pid: int, warmup_s: float, window_s: float, nbytes: int
) -> dict[str, Any]:
    """W workers push to one target together; the server's CPU and the completions in the window."""
    m = measure_window(workers, {"op": "push", "target": name}, [pid], warmup_s, window_s)
    c, cpu_s = completed(m), m["server_cpu_s"]
    gb = c["count"] * nbytes / 1e9
    return {
        "window_s": c["window_s"],
        "pushes": c["count"],
        "pushes_per_s": c["per_s"],
        "gb_per_s": gb / c["window_s"],
        "server_cpu_s": cpu_s,
        "server_cpu_s_per_gb": cpu_s / gb if gb else None,
        **{k: c[k] for k in ("server_cores_busy", "workers_cores_busy", "machine_busy_fraction")},
        "push_s_median": statistics.median(c["op_s"] or [0.0]),
        "not_applied": sum(r["not_applied"] for r in m["replies"]),
    }


def _median_of(rounds: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rounds if r[key] is not None]
    return statistics.median(values) if values else None


GRPC_TAG = " [gRPC]"  # a variant whose workers send the gradient through gRPC frames


def _variants(server_env: dict[str, str] | None) -> dict[str, tuple[str, dict[str, str] | None, bool]]:
    """Measured psgrad servers: name -> (optimizer, extra environment, shared memory). Each
    optimizer runs twice: with the default same-host path (payloads in shared-memory segments)
    and with gRPC frames only (as from another host). With server_env, each optimizer also runs
    on a twin server with that environment, measured in the same rounds."""
    out: dict[str, tuple[str, dict[str, str] | None, bool]] = {}
    for n in OPTIMIZERS:
        out[n] = (n, None, True)
        out[n + GRPC_TAG] = (n, None, False)
    if server_env:
        tag = ",".join(f"{k}={v}" for k, v in server_env.items())
        out.update({f"{n} [{tag}]": (n, server_env, True) for n in OPTIMIZERS})
    return out


def measure(params: int, worker_counts: tuple[int, ...], reps: int, warmup_s: float, window_s: float,
            chunk: int = 1 << 20, server_env: dict[str, str] | None = None,
            stream_window_bytes: int | None = None) -> dict[str, Any]:
    """Start the servers and workers, run the interleaved rounds, stop and reap every process.

    server_env: also measure every optimizer on a server with these extra environment variables
    (e.g. MALLOC_ARENA_MAX=2), side by side with the default servers.
    stream_window_bytes: given, every psgrad server runs with this stream window (else its default).
    """
    window_args = window_argv(stream_window_bytes)
    nbytes = 4 * params
    variants = _variants(server_env)
    names = [*variants, RAW]
    with Fleet(str(Path(__file__).resolve())) as fleet:
        for n, (_, env, _shared) in variants.items():
            fleet.servers[n] = Child(f"psgrad-{n}", [sys.executable, *PSGRAD_SERVER, *window_args], env=env,
                                     speaks=False)
        fleet.servers[RAW] = start_server("raw-grpc", RAW_SERVER)
        max_w = max(worker_counts)
        workers = fleet.start_workers(max_w)
        addresses, pids = fleet.addresses(), fleet.pids()
        idle = {n: memory_bytes(pids[n]) for n in variants}
        log(f"servers up: {addresses}; setting up {max_w} workers, {params:,} parameters")
        jobs = {n: {"address": addresses[n], "spec": OPTIMIZERS[opt], "shared_memory": shared}
                for n, (opt, _, shared) in variants.items()}
        fleet.setup(lambda rank: {"op": "setup", "rank": rank, "num_workers": max_w, "params": params,
                                  "chunk": chunk, "servers": jobs, "raw": addresses[RAW]})
        after_init = {n: memory_bytes(pids[n]) for n in variants}
        own_peak = OwnPeak({n: pids[n] for n in variants})

        per_w: dict[str, Any] = {}
        for count in worker_counts:
            rounds: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
            for rep in range(reps):
                for n in rotated(names, rep):
                    r = _round(workers[:count], n, pids[n], warmup_s, window_s, nbytes)
                    log(f"W={count} rep {rep} {n:8s}: {r['pushes_per_s']:7.1f} pushes/s, server "
                        f"{r['server_cores_busy']:.2f} cores, workers {r['workers_cores_busy']:.2f} cores, "
                        f"machine {r['machine_busy_fraction']:.0%} busy")
                    rounds[n].append(r)
            memory = {n: memory_bytes(pids[n]) for n in variants}
            own = dict(own_peak.peak)
            per_w[str(count)] = {
                n: {
                    "pushes_per_s": _median_of(rounds[n], "pushes_per_s"),
                    "gb_per_s": _median_of(rounds[n], "gb_per_s"),
                    "server_cpu_s_per_gb": _median_of(rounds[n], "server_cpu_s_per_gb"),
                    "server_cores_busy": _median_of(rounds[n], "server_cores_busy"),
                    "workers_cores_busy": _median_of(rounds[n], "workers_cores_busy"),
                    "machine_busy_fraction": _median_of(rounds[n], "machine_busy_fraction"),
                    "push_s_median": _median_of(rounds[n], "push_s_median"),
                    **({"peak_rss_bytes": memory[n]["VmHWM"], "peak_own_bytes": own[n]} if n in memory else {}),
                    "rounds": rounds[n],
                }
                for n in names
            }
        own_peak.stop()
        memory_rows = {}
        for n, (opt, env, shared) in variants.items():
            weights, state = nbytes, expected_state_bytes(opt, params)
            memory_rows[n] = {
                "optimizer": opt,
                "server_env": env or {},
                "shared_memory": shared,
                "weights_bytes": weights,
                "optimizer_state_bytes": state,
                "limit_bytes": 2 * (weights + state) + SLACK_BYTES,
                "idle_rss_bytes": idle[n]["VmRSS"],
                "rss_after_init_bytes": after_init[n]["VmRSS"],
                "peak_by_workers": {
                    w: {
                        "peak_rss_bytes": per_w[w][n]["peak_rss_bytes"],
                        "shard_peak_bytes": per_w[w][n]["peak_rss_bytes"] - idle[n]["VmRSS"],
                        "shard_own_peak_bytes": per_w[w][n]["peak_own_bytes"] - idle[n]["own"],
                        "receive_buffers_bytes": int(w) * nbytes,
                    }
                    for w in per_w
                },
            }
        return {"params": params, "payload_bytes": nbytes, "chunk_bytes": chunk, "workers": list(worker_counts),
                "stream_window_bytes": stream_window_bytes,  # None: the servers' default
                "servers": list(variants), "reps": reps, "warmup_s": warmup_s, "window_s": window_s,
                "by_workers": per_w, "memory": memory_rows}


def targets_and_figures(m: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    targets, figures = [], []
    for n, row in m["memory"].items():
        for w, peak in row["peak_by_workers"].items():
            if row["shared_memory"]:
                # The workers' segments the shard maps are the workers' memory (shared pages, also
                # resident in each worker): the target counts the shard's own pages, sampled.
                what, value = "own memory (sampled, without the workers' mapped segments)", peak["shard_own_peak_bytes"]
                figures.append(figure(
                    f"server: shard peak resident memory incl. mapped worker segments, {n}, {w} worker(s)",
                    peak["shard_peak_bytes"] / MB, "MB", row["limit_bytes"] / MB,
                    "2 x (weights + optimizer state) + 64 MB"))
            else:
                what, value = "peak memory (VmHWM)", peak["shard_peak_bytes"]
            targets.append(target(
                f"server: shard {what}, {n}, {w} pushing worker(s)", value / MB,
                row["limit_bytes"] / MB, 1.0, "lower", "MB", "2 x (weights + optimizer state) + 64 MB",
            ))
    for w, by_name in m["by_workers"].items():
        raw = by_name[RAW]
        for n in m["servers"]:
            figures.append(figure(f"server: pushes/s, {n}, {w} worker(s)", by_name[n]["pushes_per_s"], "1/s",
                                  raw["pushes_per_s"], "raw gRPC uploads/s of the same bytes"))
            figures.append(figure(f"server: CPU-s per GB applied, {n}, {w} worker(s)",
                                  by_name[n]["server_cpu_s_per_gb"], "s/GB", raw["server_cpu_s_per_gb"],
                                  "raw gRPC server CPU-s per GB received"))
    return targets, figures


def run(preset: str, server_env: dict[str, str] | None = None, stream_window_bytes: int | None = None) -> dict[str, Any]:
    """The suite's server part: per optimizer and W, pushes/s and CPU-s/GB beside raw gRPC; memory."""
    p = PRESETS[preset]
    m = measure(p["params"], p["workers"], p["reps"], p["warmup_s"], p["window_s"], server_env=server_env,
                stream_window_bytes=stream_window_bytes)
    targets, figures = targets_and_figures(m)
    return {"benchmark": "server", "preset": preset, **m, "machine": machine_info(), "targets": targets,
            "figures": figures,
            "notes": "shard_peak_bytes = VmHWM - RSS of the idle server before init (python, torch, grpc); "
                     "shard_own_peak_bytes = the highest RssAnon + RssFile sampled every 20 ms, minus the "
                     "same of the idle server (without shared-memory pages: the workers' same-host "
                     "segments that a shard maps are also resident in, and owned by, the workers); "
                     f"variants named '...{GRPC_TAG}' move gradients through gRPC frames only; "
                     "the shard lends one P-sized receive buffer per concurrent push (receive_buffers_bytes "
                     "at most); every psgrad figure was measured beside raw gRPC in the same interleaved "
                     "rounds on a shared machine."}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_preset(parser, PRESETS, "model size and rounds")
    parser.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="also measure every optimizer on a twin server with this extra environment variable, in the "
        "same rounds, e.g. MALLOC_ARENA_MAX=2 to see what glibc's per-thread malloc arenas cost; repeatable",
    )
    parser.add_argument(
        "--stream-window-bytes",
        type=window_bytes_arg,
        metavar="N",
        help="start every psgrad server with this stream window (0 = gRPC's automatic windows; "
        "default: the server's own)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(_Pusher)
        return
    env = {}
    for item in args.server_env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--server-env expects KEY=VALUE, got {item!r}")
        env[key] = value
    write_json(run(args.preset, env or None, args.stream_window_bytes))


if __name__ == "__main__":
    main()
