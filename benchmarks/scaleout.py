"""Scale-out: one shard against many light clients, and an S shards x W workers grid, with a model
of how the cost grows, extrapolated to hundreds of hosts.

    python benchmarks/scaleout.py --preset full    # small (100K) to 256 clients, medium (5M) to 64; S x W grid
    python benchmarks/scaleout.py --preset tiny    # CI smoke run (< 30 s)
    python benchmarks/scaleout.py --preset full --op push-pull   # push and pull as two timed calls
    python benchmarks/scaleout.py --from-json out.json --markdown   # tables and curves of a saved run

What runs. Shards are real `python -m psgrad server` processes (port 0, the address read from
their "listening on" line), started with --threads max(32, 2 x the most clients they will see),
as `psgrad server --help` asks ("raise above 2x workers"), and --lease-s 600 as in the other
benchmarks. The clients are light: 256 torch + gRPC processes (about 300 MB each) do not fit this
machine, so K client processes ("hosts", --hosts) each drive many clients on threads. Every client
is a psgrad ParameterClient of its own (its own rank, clock, weights buffer and heartbeat), and has
its own TCP connection per shard, as a separate host would: the client processes add gRPC's
`grpc.use_local_subchannel_pool` to psgrad's client channel options, since gRPC otherwise puts
every channel of a process to the same address on one shared connection (the rounds report how
many sockets the server holds, to check). Payloads go through gRPC frames (shared_memory=False),
as from another host. The job is async (lr 1e-9); the gradient is a constant.

What a client does: a closed loop of think -> exchange, where think is a fixed sleep (the
forward/backward pass of a worker on its own host: it takes time, not this machine's CPU) and
exchange is ParameterClient.exchange (push the gradient at clock c, pull the weights for c + 1: one
Step call per shard when the shard's part fits one chunk, 1 MiB, else a push and a pull), as
PSOptimizer.step does. `--op push-pull` instead pushes and pulls as two timed calls (push latency
on its own). Clients start at a random phase within one think time, so the steady state comes
sooner. A fixed think time makes the offered load W / (think + exchange time): it grows with W
until the shard (or this machine) saturates, after which pushes/s stays flat and latency grows;
back to back (think 0) every W saturates at once and there would be no curve to read.

What is measured, per configuration (a "round"): the clients start together, and after a warm-up
the parent reads the server processes' CPU time (/proc/PID/stat), the client processes' and the
machine's, at both ends of a window; pushes/s = exchanges completed inside the window / its length
(an exchange straddling an end counts by the fraction inside); p50/p99 of the exchange (and push)
latency and of the step (think + exchange) of the exchanges that ended inside it; server CPU-ms per
push = server CPU / (exchanges x shards): the cost of one push + pull of one shard. After each W,
the server's VmRSS and VmHWM (/proc/PID/status): clients join in steps (all the clients of the
smallest W, then those the next W adds), so the RSS growth between two W divided by the clients
added is the server's memory per client (its connection, its member state, the handler threads
that more concurrent calls start). Repetitions run the Ws forward, then backward (lib.report's
rep_order); figures are medians over repetitions. Where it saturates: the first W whose pushes/s
grew by less than 10 % over the previous W and the first W at which a shard used >= 0.9 core (the
earlier of the two is saturated_at_workers), and, apart, the first at which the machine was >= 90 %
busy (clients and servers share its 2 cores: on this machine the clients' CPU competes with the
shard's, which the cost model separates out; other users' work counts there too).

The cost model: bytes per iteration (2 P b per worker, 2 P b / S per worker per shard, for P
parameters of b wire bytes), and the server's CPU per shard call fitted as a + c x payload bytes
over the measured configurations; extrapolated to W = 64 ... 1024 workers at a given step rate: the
shards needed so that no shard's CPU (budget 0.8 core: its handlers and apply run under one GIL)
or NIC (70 % of 25 Gbit/s) saturates, and where no shard count suffices (every worker's step calls
every shard, so the per-call cost a x W x rate is paid by each shard whatever S is).

Prints one JSON document; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
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
    exit_now,
    log,
    machine_info,
    percentile,
    rep_order,
    start_server,
    stop_all,
    write_doc,
)
from lib.procfs import memory_bytes
from lib.window import in_window, measure_window

from psgrad.server.limits import count_sockets

MODELS = {"small": 100_000, "medium": 5_000_000}  # float32 parameters
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"hosts": 2, "sweep": {"small": (2, 8)}, "think_ms": {"small": 20.0},
             "grid_model": "small", "grid_shards": (1, 2), "grid_workers": (2, 4), "reps": 1,
             "warmup_s": 0.3, "window_s": 0.8},
    "full": {"hosts": 4, "sweep": {"small": (4, 16, 32, 64, 128, 256), "medium": (4, 16, 64)},
             "think_ms": {"small": 50.0, "medium": 200.0},
             "grid_model": "small", "grid_shards": (1, 2, 4), "grid_workers": (4, 16, 64), "reps": 2,
             "warmup_s": 1.0, "window_s": 3.0},
}
LR = 1e-9
WIRE_BYTES = 4  # float32 on the wire
GROWTH = 1.1  # saturated: pushes/s grew by less than this factor from the previous W
SHARD_CORE_BUSY = 0.9
MACHINE_BUSY = 0.9
# The extrapolation's assumptions: what a shard process may use of a core (its gRPC handlers and
# apply run under one GIL), and of its NIC.
CPU_BUDGET_CORES = 0.8
NIC_BYTES_PER_S = 25e9 / 8
NIC_USABLE = 0.7
EXTRAPOLATE_WORKERS = (64, 256, 1024)
EXTRAPOLATE_STEPS_PER_S = (1.0, 10.0)
EXTRAPOLATE_PARAMS = (100_000, 5_000_000, 25_000_000, 100_000_000)
MAX_SHARDS = 4096


# ---------------------------------------------------------------------------------------------
# A client process: many light clients on threads


def _own_connections() -> None:
    """Give every channel this process opens a TCP connection of its own: gRPC shares one between
    channels of a process to the same address (its global subchannel pool), which would put all
    of a process's clients on one connection, unlike clients on separate hosts."""
    from psgrad.client import shard_client

    shard_client.CLIENT_CHANNEL_OPTIONS = [*shard_client.CLIENT_CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]


class _Light:
    """One light client: a ParameterClient of its own, its weights buffer and its clock."""

    def __init__(self, rank: int, client: Any, flat: Any, clock: int) -> None:
        self.rank, self.client, self.flat, self.clock = rank, client, flat, clock


class _ClientHost(CommandChild):
    """One client process: light clients of several jobs, run on one thread each."""

    def __init__(self) -> None:
        super().__init__()
        self.jobs: dict[str, list[_Light]] = {}
        self.grads: dict[int, Any] = {}  # numel -> the constant gradient, shared by the clients (read only)

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd["op"] == "join":
            return self._join(cmd)
        if cmd["op"] == "run":
            return self._run(cmd)
        raise ValueError(f"unknown op {cmd['op']!r}")

    def _join(self, cmd: dict[str, Any]) -> dict[str, Any]:
        import torch

        from psgrad.client.parameter_client import ParameterClient
        from psgrad.config import ClientConfig, JobSpec
        from psgrad.core.sharding import ParamSpec, plan_shards

        numel, servers = int(cmd["params"]), list(cmd["servers"])
        params = [ParamSpec("weight", (numel,), "float32")]
        spec = JobSpec(mode="async", num_workers=int(cmd["num_workers"]), num_shards=len(servers), lr=LR)
        config = ClientConfig(rpc_timeout_s=300.0, init_timeout_s=SETUP_TIMEOUT_S, shared_memory=False)
        self.grads.setdefault(numel, torch.full((numel,), 1e-3))
        clients = self.jobs.setdefault(cmd["key"], [])
        for rank in cmd["ranks"]:
            client = ParameterClient(servers, spec, params, plan_shards(params, len(servers)), rank, config)
            self.closers.append(client.close)
            clock = client.join(initial_weights=(lambda: torch.zeros(numel)) if rank == 0 else None)
            flat = torch.zeros(numel)
            client.pull(flat, clock)
            clients.append(_Light(rank, client, flat, clock))
        return {"ok": True, "pid": os.getpid(), "clients": len(clients)}

    def _run(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """The job's clients of rank < workers run think -> exchange for run_s seconds, one thread
        each; their timings, merged, on the shared monotonic clock."""
        lights = [c for c in self.jobs[cmd["key"]] if c.rank < int(cmd["workers"])]
        think_s, run_s, split = float(cmd["think_s"]), float(cmd["run_s"]), cmd["kind"] == "push-pull"
        go = time.monotonic()
        end = go + run_s
        out: dict[str, list[float]] = {"begin": [], "sent": [], "pushed": [], "done": []}
        lock = threading.Lock()

        def loop(light: _Light) -> None:
            grad = self.grads[light.flat.numel()]
            mine: dict[str, list[float]] = {k: [] for k in out}
            time.sleep(random.Random(light.rank).uniform(0.0, think_s))  # a random phase
            while (t0 := time.monotonic()) < end:
                if think_s:
                    time.sleep(think_s)
                t1 = time.monotonic()
                if split:
                    light.client.push(grad, light.clock)
                    t2 = time.monotonic()
                    light.client.pull(light.flat, light.clock + 1)
                else:
                    light.client.exchange(grad, light.clock, light.flat)
                    t2 = float("nan")
                light.clock += 1
                for k, t in zip(("begin", "sent", "pushed", "done"), (t0, t1, t2, time.monotonic())):
                    mine[k].append(t)
            with lock:
                for k, times in mine.items():
                    out[k] += times

        threads = [threading.Thread(target=loop, args=(c,), name=f"client{c.rank}") for c in lights]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if not split:
            out["pushed"] = []
        return {"go": go, **out}


def clients_main() -> None:
    _own_connections()
    _ClientHost().serve()
    exit_now()


# ---------------------------------------------------------------------------------------------
# Parent: servers, client processes, rounds


def server_threads(max_workers: int) -> int:
    """--threads for a shard that serves max_workers clients (`psgrad server --help`: above 2x workers)."""
    return max(32, 2 * max_workers + 8)


def _sockets(pid: int) -> int:
    """Sockets a process holds open (a shard: its listening socket plus one per connection)."""
    return count_sockets(os.listdir(f"/proc/{pid}/fd"), pid)


class _Job:
    """S shard servers of one model and the clients that joined them."""

    def __init__(self, key: str, params: int, servers: list[Child], max_workers: int) -> None:
        self.key, self.params, self.servers, self.max_workers = key, params, servers, max_workers
        self.addresses = [s.address(timeout_s=SETUP_TIMEOUT_S) for s in servers]
        self.pids = [s.popen.pid for s in servers]
        self.joined = 0
        self.idle = [memory_bytes(p) for p in self.pids]  # before any client (python, torch, grpc)
        self.memory: dict[int, list[dict[str, int]]] = {}  # workers -> each server's memory after its round


class Bed:
    """K client processes and the jobs (shard servers) they join; close() stops every process."""

    def __init__(self, hosts: int, server_args: tuple[str, ...] = ()) -> None:
        script = str(Path(__file__).resolve())
        self.server_args = list(server_args)  # more `psgrad server` arguments, for every shard
        self.hosts = [Child(f"clients{i}", [sys.executable, script, "--clients"]) for i in range(hosts)]
        self.servers: list[Child] = []
        self.jobs: dict[str, _Job] = {}

    def job(self, model: str, shards: int, max_workers: int) -> _Job:
        """The job of `model` on `shards` fresh servers (reused when asked again); rank 0 initializes it."""
        key = f"{model}-S{shards}"
        if key in self.jobs:
            return self.jobs[key]
        argv = [*PSGRAD_SERVER, "--threads", str(server_threads(max_workers)), *self.server_args]
        servers = [start_server(f"{key}.{i}", argv) for i in range(shards)]
        self.servers += servers
        job = self.jobs[key] = _Job(key, MODELS[model], servers, max_workers)
        log(f"{key}: servers {job.addresses}, --threads {server_threads(max_workers)}")
        self.grow(job, 1)
        return job

    def grow(self, job: _Job, workers: int) -> None:
        """Join ranks [joined, workers), rank r on client process r % K, the processes in parallel."""
        if workers > job.max_workers:
            raise ValueError(f"{job.key}: {workers} clients, more than the {job.max_workers} it was sized for")
        ranks = list(range(job.joined, workers))
        if not ranks:
            return
        common = {"op": "join", "key": job.key, "servers": job.addresses, "params": job.params,
                  "num_workers": job.max_workers}
        busy = []
        for i, host in enumerate(self.hosts):
            mine = [r for r in ranks if r % len(self.hosts) == i]
            if mine:
                host.send({**common, "ranks": mine})
                busy.append(host)
        for host in busy:
            host.recv(SETUP_TIMEOUT_S)
        job.joined = workers

    def round(self, job: _Job, workers: int, think_ms: float, op: str, warmup_s: float,
              window_s: float) -> dict[str, Any]:
        """`workers` clients of the job run think -> exchange together; the figures of the window."""
        self.grow(job, workers)
        think_s = think_ms / 1000
        command = {"op": "run", "key": job.key, "workers": workers, "think_s": think_s, "kind": op}
        m = measure_window(self.hosts, command, job.pids, max(warmup_s, 2 * think_s), window_s)
        return _figures(m, job, workers, op)


def _figures(m: dict[str, Any], job: _Job, workers: int, op: str) -> dict[str, Any]:
    t1, t2, replies = m["t1"], m["t2"], m["replies"]
    span = t2 - t1
    steps = sum(in_window(r["sent"], r["done"], t1, t2) for r in replies)
    inside = [(r, i) for r in replies for i, d in enumerate(r["done"]) if t1 <= d <= t2]
    exchange = [1000 * (r["done"][i] - r["sent"][i]) for r, i in inside]
    step = [1000 * (r["done"][i] - r["begin"][i]) for r, i in inside]
    push = [1000 * (r["pushed"][i] - r["sent"][i]) for r, i in inside if r["pushed"]]
    shards = len(job.pids)
    row: dict[str, Any] = {
        "workers": workers,
        "shards": shards,
        "window_s": span,
        "exchanges": steps,
        "pushes_per_s": steps / span,  # per shard: one push each per exchange
        "exchange_ms_p50": percentile(exchange, 50) if exchange else None,
        "exchange_ms_p99": percentile(exchange, 99) if exchange else None,
        "step_ms_p50": percentile(step, 50) if step else None,
        "step_ms_p99": percentile(step, 99) if step else None,
        "server_cores_busy": m["server_cpu_s"] / span,
        "server_cpu_ms_per_push": 1000 * m["server_cpu_s"] / (steps * shards) if steps else None,
        "client_cores_busy": m["workers_cpu_s"] / span,
        "client_cpu_ms_per_step": 1000 * m["workers_cpu_s"] / steps if steps else None,
        "machine_busy_fraction": m["machine_busy_fraction"],
        "server_sockets": [_sockets(p) for p in job.pids],
    }
    if op == "push-pull":
        row["push_ms_p50"] = percentile(push, 50) if push else None
        row["push_ms_p99"] = percentile(push, 99) if push else None
    return row


MEDIAN_KEYS = ("pushes_per_s", "exchange_ms_p50", "exchange_ms_p99", "step_ms_p50", "step_ms_p99", "push_ms_p50",
               "push_ms_p99", "server_cores_busy", "server_cpu_ms_per_push", "client_cores_busy",
               "client_cpu_ms_per_step", "machine_busy_fraction")


def _median_row(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the repetitions of one configuration (each repetition kept under "reps")."""
    row = {k: rounds[0][k] for k in ("workers", "shards")}
    for k in MEDIAN_KEYS:
        values = [r[k] for r in rounds if r.get(k) is not None]
        if values:
            row[k] = statistics.median(values)
    row["server_sockets"] = rounds[0]["server_sockets"]
    row["reps"] = rounds
    return row


def saturation(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Where a sweep saturates (rows in increasing W): see the module's docstring."""
    out: dict[str, Any] = {"flat_at_workers": None, "shard_core_at_workers": None, "machine_busy_at_workers": None}
    for prev, row in zip([None, *rows], rows):
        w = row["workers"]
        if prev is not None and out["flat_at_workers"] is None and row["pushes_per_s"] < GROWTH * prev["pushes_per_s"]:
            out["flat_at_workers"] = w
        if out["shard_core_at_workers"] is None and row["server_cores_busy"] >= SHARD_CORE_BUSY * row["shards"]:
            out["shard_core_at_workers"] = w
        if out["machine_busy_at_workers"] is None and row["machine_busy_fraction"] >= MACHINE_BUSY:
            out["machine_busy_at_workers"] = w
    best = max(rows, key=lambda r: r["pushes_per_s"])
    out["peak_pushes_per_s"] = best["pushes_per_s"]
    out["peak_at_workers"] = best["workers"]
    # The machine's flag is kept apart: on a shared machine other work may fill it at any W.
    hits = [w for w in (out["flat_at_workers"], out["shard_core_at_workers"]) if w]
    out["saturated_at_workers"] = min(hits) if hits else None
    return out


def before_saturation(row: dict[str, Any], sat: dict[str, Any]) -> bool:
    """Whether a row's W is below where its sweep went flat or its shard reached a core (a
    busy machine alone does not count: other work may have taken it)."""
    limits = [w for w in (sat["flat_at_workers"], sat["shard_core_at_workers"]) if w is not None]
    return not limits or row["workers"] < min(limits)


def _memory(job: _Job, counts: list[int]) -> dict[str, Any]:
    """The shard's resident memory after each W, and what each client added (first server)."""
    rss = {w: job.memory[w][0]["VmRSS"] for w in counts}
    per = []
    for a, b in zip(counts, counts[1:]):
        per.append({"from_workers": a, "to_workers": b, "rss_bytes_per_client": (rss[b] - rss[a]) / (b - a)})
    first, last = counts[0], counts[-1]
    return {
        "idle_rss_bytes": job.idle[0]["VmRSS"],
        "rss_bytes": {str(w): rss[w] for w in counts},
        "hwm_bytes": {str(w): job.memory[w][0]["VmHWM"] for w in counts},
        "rss_bytes_per_client_steps": per,
        "rss_bytes_per_client": (rss[last] - rss[first]) / (last - first) if last > first else None,
    }


def measure(preset: dict[str, Any], op: str, server_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run the sweeps and the grid (each repetition forward then backward), stop every process.
    server_args: more `psgrad server` arguments for every shard."""
    reps, warmup_s, window_s = preset["reps"], preset["warmup_s"], preset["window_s"]
    sweep_counts = {m: list(ws) for m, ws in preset["sweep"].items()}
    grid_model = preset["grid_model"]
    grid_counts = list(preset["grid_workers"])
    bed = Bed(preset["hosts"], server_args)
    try:
        # Every job sized for the most clients it will see (its num_workers and --threads).
        most: dict[tuple[str, int], int] = {}
        for model, counts in sweep_counts.items():
            most[(model, 1)] = max(counts)
        for s in preset["grid_shards"]:
            most[(grid_model, s)] = max(most.get((grid_model, s), 0), max(grid_counts))
        jobs = {k: bed.job(k[0], k[1], w) for k, w in most.items()}
        for job in jobs.values():
            log(f"{job.key}: server idle RSS {job.idle[0]['VmRSS'] / 1e6:.0f} MB")
        # The rounds: (part, model, shards, W), the sweeps' Ws in increasing order first (memory per client).
        plan: list[tuple[str, str, int, int]] = [("sweep", m, 1, w) for m, ws in sweep_counts.items() for w in ws]
        plan += [("grid", grid_model, s, w) for s in preset["grid_shards"] for w in grid_counts]
        rounds: dict[tuple[str, str, int, int], list[dict[str, Any]]] = {}
        for rep in range(1, reps + 1):
            for i in rep_order([str(i) for i in range(len(plan))], rep):
                part, model, s, w = plan[int(i)]
                job = jobs[(model, s)]
                think = preset["think_ms"][model]
                r = bed.round(job, w, think, op, warmup_s, window_s)
                if part == "sweep" and rep == 1:
                    job.memory[w] = [memory_bytes(p) for p in job.pids]
                r["rep"] = rep
                rounds.setdefault((part, model, s, w), []).append(r)
                log(f"rep {rep} {part} {model} S={s} W={w}: {r['pushes_per_s']:7.1f} pushes/s, exchange p50 "
                    f"{r['exchange_ms_p50'] or 0:.1f} p99 {r['exchange_ms_p99'] or 0:.1f} ms, server "
                    f"{r['server_cores_busy']:.2f} cores ({r['server_cpu_ms_per_push'] or 0:.2f} ms/push), "
                    f"clients {r['client_cores_busy']:.2f} cores, machine {r['machine_busy_fraction']:.0%}, "
                    f"sockets {r['server_sockets']}")
        sweeps = {}
        for model, counts in sweep_counts.items():
            rows = [_median_row(rounds[("sweep", model, 1, w)]) for w in counts]
            sweeps[model] = {"params": MODELS[model], "payload_bytes": WIRE_BYTES * MODELS[model],
                             "think_ms": preset["think_ms"][model], "rows": rows, "saturation": saturation(rows),
                             "server_memory": _memory(jobs[(model, 1)], counts)}
        grid_rows = [_median_row(rounds[("grid", grid_model, s, w)]) for s in preset["grid_shards"] for w in grid_counts]
        grid = {"model": grid_model, "params": MODELS[grid_model], "think_ms": preset["think_ms"][grid_model],
                "shards": list(preset["grid_shards"]), "workers": grid_counts, "rows": grid_rows,
                "saturation": {str(s): saturation([r for r in grid_rows if r["shards"] == s])
                               for s in preset["grid_shards"]}}
        return {"sweeps": sweeps, "grid": grid}
    finally:
        stop_all([*bed.hosts, *bed.servers])


# ---------------------------------------------------------------------------------------------
# The cost model


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares a, c of y = a + c x (c = 0 and a = the mean when all x are equal)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx == 0:
        return my, 0.0
    c = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - c * mx, c


def bytes_per_iteration(params: int, shards: int, workers: int, wire_bytes: int = WIRE_BYTES) -> dict[str, float]:
    """Payload bytes one iteration moves (a push of the gradient and a pull of the weights), without
    the per-call headers (a few hundred bytes per call)."""
    per_worker = 2 * params * wire_bytes
    return {"per_worker": per_worker, "per_worker_per_shard": per_worker / shards,
            "per_shard_all_workers": per_worker * workers / shards, "all": per_worker * workers,
            "calls_per_worker": shards, "calls_per_shard": workers}


def shards_needed(params: int, workers: int, steps_per_s: float, a_s: float, c_s_per_byte: float) -> dict[str, Any]:
    """The fewest shards for which neither a shard's CPU nor its NIC saturates (None: none does)."""
    calls = workers * steps_per_s  # every worker's step calls every shard once
    total_bytes = 2 * params * WIRE_BYTES * calls  # per second, all shards together
    fixed = calls * a_s  # cores each shard spends on the calls' fixed cost, whatever S
    nic = NIC_BYTES_PER_S * NIC_USABLE
    s_nic = max(1, -(-int(total_bytes) // int(nic)))
    if fixed >= CPU_BUDGET_CORES:
        s_cpu = None
    else:
        per_byte = total_bytes * c_s_per_byte  # cores for the bytes, all shards together
        s_cpu = max(1, int(-(-per_byte // (CPU_BUDGET_CORES - fixed))))
        if s_cpu > MAX_SHARDS:
            s_cpu = None
    return {"params": params, "workers": workers, "steps_per_s": steps_per_s,
            "bytes_per_worker_step": 2 * params * WIRE_BYTES, "shard_calls_per_s": calls,
            "fixed_cost_cores_per_shard": fixed, "shards_for_cpu": s_cpu, "shards_for_nic": s_nic,
            "shards_needed": None if s_cpu is None else max(s_cpu, s_nic),
            "bytes_per_s_per_shard": None if s_cpu is None else total_bytes / max(s_cpu, s_nic)}


def cost_model(sweeps: dict[str, Any], grid: dict[str, Any]) -> dict[str, Any]:
    """Server CPU per shard call against the bytes it moves, fitted over every measured
    configuration, and the extrapolation to hundreds of hosts."""
    points: list[tuple[float, float]] = []
    overload: list[tuple[float, float]] = []
    sets = [(sweep["rows"], sweep["saturation"], sweep["payload_bytes"]) for sweep in sweeps.values()]
    sets += [([r for r in grid["rows"] if r["shards"] == int(s)], sat, WIRE_BYTES * grid["params"])
             for s, sat in grid["saturation"].items()]
    for rows, sat, payload in sets:
        for r in rows:
            if r.get("server_cpu_ms_per_push") is not None:
                point = (2 * payload / r["shards"], r["server_cpu_ms_per_push"] / 1000)
                (points if before_saturation(r, sat) else overload).append(point)
    a, c = fit_line(points or overload)
    a = max(a, min(y for _, y in points or overload) / 2)  # a fit below zero says little: keep a floor
    c = max(c, 0.0)
    return {
        "server_cpu_s_per_call": {"a_s": a, "c_s_per_byte": c,
                                  "points": [{"bytes": x, "cpu_s": y} for x, y in points],
                                  "overload_points": [{"bytes": x, "cpu_s": y} for x, y in overload],
                                  "formula": "server CPU-s per shard call = a + c x (bytes pushed + pulled per call), "
                                             "fitted over the configurations before saturation"},
        "max_shard_calls_per_s": CPU_BUDGET_CORES / a,
        "bytes_per_iteration_formula": "per worker 2 P b; per worker per shard 2 P b / S; per shard, all workers "
                                       "2 P b W / S; calls: S per worker, W per shard (b = 4 for float32)",
        "assumptions": {"cpu_budget_cores_per_shard": CPU_BUDGET_CORES, "nic_bytes_per_s": NIC_BYTES_PER_S,
                        "nic_usable_fraction": NIC_USABLE, "wire_bytes": WIRE_BYTES},
        "extrapolation": [shards_needed(p, w, r, a, c) for p in EXTRAPOLATE_PARAMS for w in EXTRAPOLATE_WORKERS
                          for r in EXTRAPOLATE_STEPS_PER_S],
    }


def run(preset: str, op: str = "exchange", push_buffers: int | None = None) -> dict[str, Any]:
    p = PRESETS[preset]
    t0 = time.monotonic()
    server_args = () if push_buffers is None else ("--push-buffers", str(push_buffers))
    m = measure(p, op, server_args)
    return {"benchmark": "scaleout", "preset": preset, "op": op, "server_args": list(server_args),
            "hosts": p["hosts"], "reps": p["reps"],
            "warmup_s": p["warmup_s"], "window_s": p["window_s"], "models": MODELS, **m,
            "cost_model": cost_model(m["sweeps"], m["grid"]), "machine": machine_info(),
            "took_s": time.monotonic() - t0,
            "notes": "light clients: K client processes, each client a ParameterClient with its own connection per "
                     "shard, on a thread; think = sleep; pushes/s = exchanges/s (each pushes once to every shard); "
                     "server_cpu_ms_per_push = server CPU / (exchanges x shards), one push + pull of one shard; "
                     "clients and servers share this machine's CPUs."}


# ---------------------------------------------------------------------------------------------
# Markdown: tables and curves of a saved run


def _fmt(v: Any, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}" if isinstance(v, float) else str(v)


def _bar(value: float, top: float, width: int = 40) -> str:
    return "#" * max(1, round(width * value / top)) if top > 0 else ""


def markdown(doc: dict[str, Any]) -> str:
    out = []
    for model, sw in doc["sweeps"].items():
        mem = sw["server_memory"]
        out.append(f"### One shard, {model} model ({sw['params']:,} parameters), think {sw['think_ms']:g} ms\n")
        split = doc.get("op") == "push-pull"
        out.append("| W | pushes/s | " + ("push p50 / p99 ms | push + pull" if split else "exchange") +
                   " p50 / p99 ms | step p50 / p99 ms | server cores | server CPU ms/push "
                   "| client cores | machine busy | server RSS MB | sockets |")
        out.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if split else ""))
        for r in sw["rows"]:
            w = str(r["workers"])
            push = f"{_fmt(r.get('push_ms_p50'))} / {_fmt(r.get('push_ms_p99'))} | " if split else ""
            out.append(f"| {w} | {_fmt(r['pushes_per_s'])} | {push}{_fmt(r.get('exchange_ms_p50'))} / "
                       f"{_fmt(r.get('exchange_ms_p99'))} | {_fmt(r.get('step_ms_p50'))} / {_fmt(r.get('step_ms_p99'))} "
                       f"| {_fmt(r['server_cores_busy'], 2)} | {_fmt(r.get('server_cpu_ms_per_push'), 2)} | "
                       f"{_fmt(r['client_cores_busy'], 2)} | {r['machine_busy_fraction']:.0%} | "
                       f"{mem['rss_bytes'][w] / 1e6:,.0f} | {r['server_sockets'][0]} |")
        sat = sw["saturation"]
        per = mem["rss_bytes_per_client"]
        out.append(f"\nSaturation: pushes/s flat (< +10 %) at W = {_fmt(sat['flat_at_workers'])}; shard >= 0.9 core at "
                   f"W = {_fmt(sat['shard_core_at_workers'])}; machine >= 90 % busy at W = "
                   f"{_fmt(sat['machine_busy_at_workers'])}; peak {sat['peak_pushes_per_s']:,.0f} pushes/s at W = "
                   f"{sat['peak_at_workers']}. Server RSS idle {mem['idle_rss_bytes'] / 1e6:,.0f} MB; per client "
                   f"{'-' if per is None else f'{per / 1e3:,.0f} kB'}.\n")
        top = max(r["pushes_per_s"] for r in sw["rows"])
        top_lat = max(r.get("exchange_ms_p99") or 0 for r in sw["rows"])
        out.append("```")
        out.append(f"pushes/s (one shard, {model})")
        for r in sw["rows"]:
            out.append(f"W={r['workers']:>4} {_bar(r['pushes_per_s'], top):<40} {r['pushes_per_s']:,.0f}")
        out.append(f"{'push + pull' if split else 'exchange'} p99 ms (one shard, {model})")
        for r in sw["rows"]:
            v = r.get("exchange_ms_p99") or 0
            out.append(f"W={r['workers']:>4} {_bar(v, top_lat):<40} {v:,.1f}")
        out.append("```\n")
    g = doc["grid"]
    out.append(f"### S shards x W workers, {g['model']} model ({g['params']:,} parameters), think {g['think_ms']:g} ms\n")
    out.append("| S \\ W | " + " | ".join(str(w) for w in g["workers"]) + " |")
    out.append("|---|" + "---:|" * len(g["workers"]))
    by = {(r["shards"], r["workers"]): r for r in g["rows"]}
    for s in g["shards"]:
        cells = [f"{by[(s, w)]['pushes_per_s']:,.0f}/s, step {_fmt(by[(s, w)].get('step_ms_p50'))} ms, "
                 f"{_fmt(by[(s, w)].get('server_cpu_ms_per_push'), 2)} ms/push" for w in g["workers"]]
        out.append(f"| {s} | " + " | ".join(cells) + " |")
    out.append("")
    for s, sat in g.get("saturation", {}).items():  # (runs before it was recorded have none)
        out.append(f"- S = {s}: peak {sat['peak_pushes_per_s']:,.0f} pushes/s at W = {sat['peak_at_workers']}; flat at W = "
                   f"{_fmt(sat['flat_at_workers'])}; a shard >= 0.9 core at W = {_fmt(sat['shard_core_at_workers'])}")
    cm = doc["cost_model"]
    fit = cm["server_cpu_s_per_call"]
    out.append(f"\nServer CPU per shard call (fitted before saturation): a = {fit['a_s'] * 1e3:.3f} ms + "
               f"c = {fit['c_s_per_byte'] * 1e9:.3f} ms per MB pushed + pulled; a shard's calls/s at most "
               f"{cm.get('max_shard_calls_per_s', CPU_BUDGET_CORES / fit['a_s']):,.0f} (W x steps/s per worker, whatever S)\n")
    out.append("| P | W | steps/s per worker | bytes per worker step | shard calls/s | fixed cost cores/shard "
               "| shards (CPU) | shards (NIC) | shards needed |")
    out.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for e in cm["extrapolation"]:
        out.append(f"| {e['params']:,} | {e['workers']} | {e['steps_per_s']:g} | {e['bytes_per_worker_step'] / 1e6:,.1f} MB "
                   f"| {e['shard_calls_per_s']:,.0f} | {e['fixed_cost_cores_per_shard']:.2f} | {_fmt(e['shards_for_cpu'])} "
                   f"| {e['shards_for_nic']} | {_fmt(e['shards_needed']) if e['shards_needed'] else 'none suffices'} |")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_preset(parser, PRESETS, "models, client counts, grid and rounds")
    parser.add_argument("--op", choices=("exchange", "push-pull"), default="exchange",
                        help="what a client does after its think time: one exchange (push + pull, as "
                        "PSOptimizer.step) or a push and a pull as two timed calls (default: exchange)")
    parser.add_argument("--push-buffers", type=int, metavar="N",
                        help="start every shard with `psgrad server --push-buffers N` (default: the server's own)")
    parser.add_argument("--from-json", metavar="PATH", help="render a saved run instead of measuring")
    parser.add_argument("--markdown", action="store_true", help="print Markdown tables and curves instead of JSON")
    parser.add_argument("--clients", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.clients:
        clients_main()
        return
    doc = json.loads(Path(args.from_json).read_text()) if args.from_json else run(args.preset, args.op, args.push_buffers)
    write_doc(doc, markdown if args.markdown else None)


if __name__ == "__main__":
    main()
