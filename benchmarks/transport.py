"""psgrad's push and pull beside other transports of the same bytes, each in one run: raw gRPC
streaming, raw gRPC unary calls and the classic torch.distributed.rpc parameter server.

    python benchmarks/transport.py --preset full                  # one shard, one client, 25M float32 (100 MB)
    python benchmarks/transport.py --preset tiny                  # the same, CI-sized
    python benchmarks/transport.py --preset full --part matrix    # 1 and 2 shards x 1, 2, 4 worker processes
    python benchmarks/transport.py --preset full --part latency   # a 100K-parameter iteration vs a unary call
    python benchmarks/transport.py --preset full --part peer      # beside torch.distributed.rpc; 1, 2, 4 workers

Servers run as separate processes on this machine; measurements of psgrad and of what it is
compared with are interleaved, repetition by repetition (in alternating order), so machine noise
hits both alike. Prints one JSON document; progress goes to stderr. The suite runs the matrix
(`run`, its part "transport"), the latency part (`run_latency`) and the peer part (`run_peer`).

--part one-shard (the default): one client in this process pulls and pushes through one shard
beside raw gRPC (`ratios.push_vs_raw_upload`, `ratios.pull_vs_raw_download`), with the CPU each
side spent per operation and, as a diagnostic, a push beside raw uploads served by one server
process (lib/raw_grpc.py's psgrad_with_raw_main), whose Upload copies, does a shard's per-chunk
sum and SGD update into the next weights, or does that update in place (`diagnostics`).
`--stream-window-bytes N` starts both psgrad servers of this comparison with that window (`psgrad
server --stream-window-bytes`; 0 = gRPC's automatic windows), to weigh the window's cost in push
speed on your machine (server_bench.py takes the same flag for memory).

--part matrix (`--matrix` for short): W worker processes pull and push at once (async mode, lr
1e-9, no compute) through S shards; the same W processes then stream the same bytes through S raw
gRPC servers; loopback TCP and memory-copy bandwidth are measured in the same repetitions.

--part latency: two psgrad shards (each its own process) hold a 100K-parameter model (400 KB, async
mode, lr 1e-9); a raw gRPC server process answers unary pings. Every round of the loop, in this order:
- the iteration as PSOptimizer.step() runs it: `ParameterClient.exchange` (push clock c, pull
  c + 1; one unary Step call per shard) through the same-host path (shared-memory payloads);
- the same through gRPC only (payloads inside the messages, as for a server on another host);
- the same traffic as two separate calls, push then pull (each a call per shard);
- one unary round trip (tiny request, tiny reply) to the raw server.
So all series see the same machine noise. Reports median and p99 of each and the ratios to the
unary round trip.

--part peer: the peer is the textbook RPC parameter server: one PS process holds the model as one
float32 tensor; each worker iteration is `rpc_sync(ps, get_weights)` then `rpc_sync(ps, push_grad,
(g,))`, and the PS applies `w.add_(g, alpha=-lr)` under a lock. Every rank is its own process
(TensorPipe backend on the loopback interface, rendezvous through a FileStore in a temporary
directory, so no fixed port). psgrad runs the same iteration (pull, push; async mode, lr 1e-9, one
shard) with the same number of worker processes, and the two are interleaved round by round.
TensorPipe picks the fastest transport and channel both ends support: on one host that can be
shared memory and cross-memory attach (CMA: the receiver reads the sender's memory directly, one
copy, no socket). Each setup measured reports what it actually used, read from TensorPipe's own
log of one worker (TP_VERBOSE_LOGGING=7 on that process only: about 80 short lines per message,
well under 1 ms, against a few hundred ms for a 100 MB message). While one system is measured, the
other system's processes, and its own idle workers, are stopped (SIGSTOP): TensorPipe's
shared-memory transport busy-polls while idle, and that CPU would otherwise be charged to
whichever system is running. The idle CPU of each setup is reported.
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from lib import (
    PSGRAD_SERVER,
    RAW_SERVER,
    SETUP_TIMEOUT_S,
    BenchError,
    Child,
    add_preset,
    aggregate,
    command_loop,
    exit_now,
    figure,
    lib_argv,
    log,
    machine_info,
    median_gbps,
    paused,
    rep_order,
    run_together,
    start_server,
    stop_all,
    summarize,
    target,
    window_argv,
    window_bytes_arg,
    write_json,
)
from lib.ceilings import MemcpyProbe, TcpClient
from lib.raw_grpc import SERVICE as RAW_SERVICE
from lib.raw_grpc import SGD_IN_PLACE_SERVICE, SGD_SERVICE, RawClient
from lib.swarm import (
    ROUND_TIMEOUT_S,
    open_swarm,
    psgrad_key,
    release_swarm,
    wire_bytes,
)

from psgrad.client.parameter_client import ParameterClient
from psgrad.config import DEFAULT_CHUNK_BYTES, ClientConfig, JobSpec
from psgrad.core.codecs import byte_view
from psgrad.core.sharding import ParamSpec, plan_shards

PARTS = ("one-shard", "matrix", "latency", "peer")
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "one-shard": {"tiny": {"params": 1_000_000, "reps": 3}, "full": {"params": 25_000_000, "reps": 24}},
    "matrix": {
        "tiny": {"params": 1_000_000, "reps": 3, "iters": 2, "shards": (1, 2), "workers": (1, 2)},
        "full": {"params": 25_000_000, "reps": 5, "iters": 3, "shards": (1, 2), "workers": (1, 2, 4)},
    },
    "latency": {"tiny": {"params": 100_000, "iters": 30, "warmup": 5},
                "full": {"params": 100_000, "iters": 200, "warmup": 20}},
    "peer": {
        "tiny": {"params": 1_000_000, "reps": 3, "iters": 2, "setups": {"default": (1, 2)}},
        "full": {"params": 25_000_000, "reps": 4, "iters": 3,
                 "setups": {"default": (1, 2, 4), "uv": (1, 2), "uv+basic": (1, 2)}},
    },
}
PSGRAD_WITH_RAW = lib_argv("raw_grpc:psgrad_with_raw_main")
TCP_SERVER = lib_argv("ceilings:tcp_serve_main")


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _summary(times: list[float], nbytes: int) -> dict[str, float]:
    med = summarize(times)["median"]
    return {"median_s": med, "gb_per_s": nbytes / med / 1e9, "best_gb_per_s": nbytes / min(times) / 1e9}


# ---------------------------------------------------------------------------------------------
# One shard, one client


def compare_one_shard(num_params: int, reps: int, wire_dtype: str, chunk: int,
                      stream_window_bytes: int | None = None) -> dict[str, Any]:
    """One client in this process, one shard, beside raw gRPC upload/download of the same bytes;
    then, as a diagnostic, a push beside raw uploads served by the same server process.
    stream_window_bytes: given, both psgrad servers run with that stream window (else their default)."""
    children: list[Child] = []
    clients: list[ParameterClient | RawClient] = []
    window_args = window_argv(stream_window_bytes)
    try:
        # The servers keep torch's default thread count here, as this comparison always has.
        ps = start_server("psgrad-server", [*PSGRAD_SERVER, *window_args], one_thread=False)
        raw_server = start_server("raw-grpc", RAW_SERVER, one_thread=False)
        # A second shard server that also serves raw uploads (copy, and a shard's sum + SGD update
        # into the next weights or in place).
        diag = start_server("psgrad-with-raw", [*PSGRAD_WITH_RAW, *window_args], one_thread=False)
        children += [ps, raw_server, diag]

        params = [ParamSpec("weight", (num_params,), "float32")]
        spec = JobSpec(num_shards=1, wire_dtype=wire_dtype, lr=1e-9)
        # The ratios compare gRPC with gRPC: no same-host shared memory (--part peer measures that).
        cfg = ClientConfig(rpc_timeout_s=300, chunk_bytes=chunk, shared_memory=False)
        flat = torch.zeros(num_params)
        grad = torch.full((num_params,), 1e-3)
        client = ParameterClient([ps.address()], spec, params, plan_shards(params, 1), 0, cfg)
        diag_client = ParameterClient([diag.address()], spec, params, plan_shards(params, 1), 0, cfg)
        raw = RawClient(raw_server.address())
        diag_raw = RawClient(diag.address(), RAW_SERVICE)
        diag_raw_sgd = RawClient(diag.address(), SGD_SERVICE)
        diag_raw_sgd_in_place = RawClient(diag.address(), SGD_IN_PLACE_SERVICE)
        clients += [client, diag_client, raw, diag_raw, diag_raw_sgd, diag_raw_sgd_in_place]
        client.join(initial_weights=lambda: flat)
        diag_client.join(initial_weights=lambda: flat)
        nbytes = wire_bytes(num_params, wire_dtype)
        raw_src = torch.ones(nbytes // 4 + 1)
        raw_src_view = byte_view(raw_src)[:nbytes]
        raw_dst = torch.empty(nbytes // 4 + 1)
        raw_dst_view = byte_view(raw_dst)[:nbytes]

        # warm-up: first use allocates server and client buffers
        client.pull(flat, 0)
        client.push(grad, 0)
        diag_client.push(grad, 0)
        raw.upload(raw_src_view, chunk)
        raw.download(raw_dst_view, chunk)
        diag_raw.upload(raw_src_view, chunk)
        diag_raw_sgd.upload(raw_src_view, chunk)
        diag_raw_sgd_in_place.upload(raw_src_view, chunk)

        ops: dict[str, tuple[Child, Callable[[int], object]]] = {
            "psgrad_pull": (ps, lambda i: client.pull(flat, i)),
            "raw_download": (raw_server, lambda i: raw.download(raw_dst_view, chunk)),
            "psgrad_push": (ps, lambda i: client.push(grad, i)),
            "raw_upload": (raw_server, lambda i: raw.upload(raw_src_view, chunk)),
            "same_process_push": (diag, lambda i: diag_client.push(grad, i)),
            "same_process_raw_upload": (diag, lambda i: diag_raw.upload(raw_src_view, chunk)),
            "same_process_raw_upload_sgd": (diag, lambda i: diag_raw_sgd.upload(raw_src_view, chunk)),
            "same_process_raw_upload_sgd_in_place": (diag, lambda i: diag_raw_sgd_in_place.upload(raw_src_view, chunk)),
        }
        t: dict[str, list[float]] = {k: [] for k in ops}
        cpu = {k: {"server": 0.0, "client": 0.0} for k in ops}
        for i in range(1, reps + 1):
            for key in rep_order(list(ops), i):
                server, fn = ops[key]
                # Time the operation, and add the CPU it cost the server process and this (the client) one.
                s0, c0, t0 = server.cpu_s(), time.process_time(), time.perf_counter()
                fn(i)
                t[key].append(time.perf_counter() - t0)
                cpu[key]["server"] += server.cpu_s() - s0
                cpu[key]["client"] += time.process_time() - c0
        res = {k: _summary(v, nbytes) for k, v in t.items()}
        cpu_ms = {k: {side: 1e3 * total / reps for side, total in v.items()} for k, v in cpu.items()}
        both = {k: v["server"] + v["client"] for k, v in cpu_ms.items()}
        gbps = {k: v["gb_per_s"] for k, v in res.items()}
        return {
            "benchmark": "transport",
            "params": num_params,
            "wire_dtype": wire_dtype,
            "payload_bytes": nbytes,
            "chunk_bytes": chunk,
            "reps": reps,
            "stream_window_bytes": stream_window_bytes,  # None: the psgrad servers' default
            "machine": machine_info(),
            "results": res,
            "ratios": {
                "push_vs_raw_upload": gbps["psgrad_push"] / gbps["raw_upload"],
                "pull_vs_raw_download": gbps["psgrad_pull"] / gbps["raw_download"],
            },
            # Not targets: a push and bare gRPC uploads served by one process (psgrad_with_raw_main),
            # whose Upload copies (the ceiling's work) or does a shard's sum + SGD update per chunk
            # (into the next weights, as a push does, or in place).
            "diagnostics": {
                "same_process_push_vs_raw_upload": gbps["same_process_push"] / gbps["same_process_raw_upload"],
                "same_process_push_vs_raw_sgd_upload": gbps["same_process_push"] / gbps["same_process_raw_upload_sgd"],
                "same_process_raw_sgd_upload_vs_raw_upload": gbps["same_process_raw_upload_sgd"]
                / gbps["same_process_raw_upload"],
                # The same update in place (which a push must not do: it applies whole or not at all)
                # reads and writes one weight vector; into the next weights, as a push does, it reads
                # the current ones and writes a second vector. These two show what that costs.
                "same_process_raw_sgd_in_place_upload_vs_raw_upload": gbps["same_process_raw_upload_sgd_in_place"]
                / gbps["same_process_raw_upload"],
                "same_process_raw_sgd_upload_vs_raw_sgd_in_place_upload": gbps["same_process_raw_upload_sgd"]
                / gbps["same_process_raw_upload_sgd_in_place"],
                # CPU (client + server) per raw operation / per psgrad one: where the two processes
                # keep the shared cores busy, the throughput ratio cannot exceed it for long.
                "cpu_ratio_push": both["raw_upload"] / both["psgrad_push"] if both["psgrad_push"] else None,
                "cpu_ratio_pull": both["raw_download"] / both["psgrad_pull"] if both["psgrad_pull"] else None,
            },
            # Means per operation; the server's from /proc (10 ms ticks, summed over all repetitions).
            "cpu_ms_per_op": cpu_ms,
            "notes": "psgrad push includes the server's finiteness check and SGD apply; raw upload only copies. "
            "Client and server share this machine's CPUs: where they are busy, every extra CPU-ms "
            "of either side comes out of throughput (cpu_ms_per_op shows how much each side spent).",
        }
    finally:
        for c in clients:
            c.close()
        stop_all(children)


# ---------------------------------------------------------------------------------------------
# The matrix


def _cell_summary(rounds: list[dict[str, Any]], payload: int) -> dict[str, Any]:
    """Medians over repetitions of one (system, shards, workers) cell."""
    pulls = [t for r in rounds for t in r["pull_s"]]
    pushes = [t for r in rounds for t in r["push_s"]]
    workers = len(rounds[0]["per_worker"])
    return {
        "gb_per_s": summarize([r["gb_per_s"] for r in rounds])["median"],
        "ops_per_s": summarize([r["ops_per_s"] for r in rounds])["median"],
        "reps_gb_per_s": [r["gb_per_s"] for r in rounds],
        "pull_gb_per_s": median_gbps(pulls, payload),
        "push_gb_per_s": median_gbps(pushes, payload),
        "per_worker_ops_per_s": [summarize([r["per_worker"][w]["ops_per_s"] for r in rounds])["median"]
                                 for w in range(workers)],
        "per_worker_gb_per_s": [summarize([r["per_worker"][w]["gb_per_s"] for r in rounds])["median"]
                                for w in range(workers)],
    }


def run_matrix(params: int, reps: int, iters: int, shards: Sequence[int], workers: Sequence[int],
               wire_dtype: str = "float32", chunk: int = DEFAULT_CHUNK_BYTES) -> dict[str, Any]:
    """psgrad through each shard count x worker count, beside raw gRPC with the same processes,
    loopback TCP and memory copy; all interleaved repetition by repetition."""
    t_start = time.monotonic()
    payload = wire_bytes(params, wire_dtype)
    swarm = open_swarm(max(workers))
    tcp: TcpClient | None = None
    failed = True
    try:
        for s in shards:  # start every server before waiting for any
            swarm.servers(psgrad_key(s, params, wire_dtype, chunk), s, PSGRAD_SERVER)
        swarm.servers("raw", max(shards), RAW_SERVER)
        (tcp_server,) = swarm.servers("tcp", 1, TCP_SERVER)
        keys = {(system, s): swarm.psgrad_job(s, params, wire_dtype, chunk) if system == "psgrad"
                else swarm.raw_job(s, payload, chunk) for s in shards for system in ("psgrad", "raw")}
        log(f"transport: {len(swarm.children)} processes up after {time.monotonic() - t_start:.1f} s")
        tcp = TcpClient(tcp_server.address())
        memcpy = MemcpyProbe(payload)
        tcp_buf = torch.ones((payload + 3) // 4)
        tcp_view = byte_view(tcp_buf)[:payload]

        # warm-up: every server allocates its buffers for the most concurrent workers
        for key in keys.values():
            swarm.round(key, max(workers), 2)
        tcp.upload(tcp_view, chunk)
        tcp.download(tcp_view, chunk)

        rounds: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
        ceil_t: dict[str, list[float]] = {"tcp_upload": [], "tcp_download": [], "memcpy_reused": [], "memcpy_fresh": []}
        for rep in range(reps):
            for s in shards:
                for w in workers:
                    for system in ("psgrad", "raw") if rep % 2 == 0 else ("raw", "psgrad"):  # neither always first
                        rounds.setdefault((system, s, w), []).append(swarm.round(keys[(system, s)], w, iters))
            for _ in range(iters):
                ceil_t["tcp_upload"].append(_timed(lambda: tcp.upload(tcp_view, chunk)))
                ceil_t["tcp_download"].append(_timed(lambda: tcp.download(tcp_view, chunk)))
                ceil_t["memcpy_reused"].append(memcpy.reused_s())
                ceil_t["memcpy_fresh"].append(memcpy.fresh_s())
            log(f"transport: repetition {rep + 1}/{reps} done ({time.monotonic() - t_start:.0f} s)")
        failed = False
    finally:
        if tcp is not None:
            tcp.close()
        release_swarm(swarm, failed)

    cells = []
    for s in shards:
        for w in workers:
            ps = _cell_summary(rounds[("psgrad", s, w)], payload)
            raw = _cell_summary(rounds[("raw", s, w)], payload)
            cells.append({"shards": s, "workers": w, "psgrad": ps, "raw_grpc": raw,
                          "ratio_gb_per_s": ps["gb_per_s"] / raw["gb_per_s"]})
    ceilings = {f"{k}_gb_per_s": median_gbps(v, payload) for k, v in ceil_t.items()}
    return {
        "params": params,
        "wire_dtype": wire_dtype,
        "omp_threads_per_process": 1,
        "payload_bytes": payload,
        "chunk_bytes": chunk,
        "reps": reps,
        "iters_per_round": iters,
        "cells": cells,
        "ceilings": ceilings,
        "ceiling_samples_s": ceil_t,
        "elapsed_s": time.monotonic() - t_start,
    }


def _matrix_targets_and_figures(m: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    mb = m["payload_bytes"] / 1e6
    one = next(c for c in m["cells"] if c["shards"] == 1 and c["workers"] == 1)
    dtype = m["wire_dtype"]
    targets = [
        target(f"transport: {dtype} push, 1 shard, 1 worker ({mb:.0f} MB) vs raw gRPC upload",
               one["psgrad"]["push_gb_per_s"], one["raw_grpc"]["push_gb_per_s"], 0.9, "higher", "GB/s",
               "raw gRPC streaming upload"),
        target(f"transport: {dtype} pull, 1 shard, 1 worker ({mb:.0f} MB) vs raw gRPC download",
               one["psgrad"]["pull_gb_per_s"], one["raw_grpc"]["pull_gb_per_s"], 0.9, "higher", "GB/s",
               "raw gRPC streaming download"),
    ]
    figures = []
    for c in m["cells"]:
        label = f"{c['shards']} shard(s), {c['workers']} worker(s)"
        figures.append(figure(f"transport: pull+push GB/s, {label}", c["psgrad"]["gb_per_s"], "GB/s",
                              c["raw_grpc"]["gb_per_s"], "raw gRPC, same processes"))
        figures.append(figure(f"transport: (pulls+pushes)/s, {label}", c["psgrad"]["ops_per_s"], "1/s",
                              c["raw_grpc"]["ops_per_s"], "raw gRPC, same processes"))
    names = {"tcp_upload": "loopback TCP upload, 1 stream", "tcp_download": "loopback TCP download, 1 stream",
             "memcpy_reused": "memory copy into a reused buffer", "memcpy_fresh": "memory copy into a fresh allocation"}
    for key, label in names.items():
        figures.append(figure(f"ceiling: {label} ({mb:.0f} MB)", m["ceilings"][f"{key}_gb_per_s"], "GB/s"))
    return targets, figures


def run(preset: str) -> dict[str, Any]:
    """The suite's transport part: the shard x worker matrix with its ceilings, and its targets."""
    p = PRESETS["matrix"][preset]
    m = run_matrix(p["params"], p["reps"], p["iters"], p["shards"], p["workers"])
    targets, figures = _matrix_targets_and_figures(m)
    return {**m, "preset": preset, "targets": targets, "figures": figures}


# ---------------------------------------------------------------------------------------------
# Latency


SHARDS = 2
SERIES = ("iteration", "iteration_grpc", "separate", "raw_unary")


def _ms(values: list[float]) -> dict[str, float]:
    return {k: (v * 1e3 if k != "n" else v) for k, v in summarize(values).items()}


def measure_latency(params: int, iters: int, warmup: int, shards: int = SHARDS) -> dict[str, Any]:
    t_start = time.monotonic()
    children: list[Child] = []
    clients: list[ParameterClient] = []
    raw: RawClient | None = None
    try:
        children += [start_server(f"psgrad{i}", PSGRAD_SERVER) for i in range(shards)]
        raw_server = start_server("raw", RAW_SERVER)
        children.append(raw_server)
        addrs = [c.address(timeout_s=180) for c in children[:shards]]
        specs = [ParamSpec("weight", (params,), "float32")]
        spec = JobSpec(mode="async", num_workers=2, num_shards=shards, lr=1e-9)
        plan = plan_shards(specs, shards)
        # rank 0 may use shared memory, rank 1 goes through gRPC only
        for rank, shared in ((0, True), (1, False)):
            clients.append(ParameterClient(addrs, spec, specs, plan, rank, ClientConfig(shared_memory=shared)))
        flat = torch.zeros(params)
        grad = torch.full((params,), 1e-3)
        clocks = [c.join(initial_weights=lambda: flat) for c in clients]
        for c, clock in zip(clients, clocks):
            c.pull(flat, clock)
        raw = RawClient(raw_server.address(timeout_s=180))
        log(f"latency: {len(children)} servers up after {time.monotonic() - t_start:.1f} s")

        times: dict[str, list[float]] = {name: [] for name in SERIES}
        for i in range(warmup + iters):
            t0 = time.perf_counter()
            clients[0].exchange(grad, clocks[0], flat)
            t1 = time.perf_counter()
            clients[1].exchange(grad, clocks[1], flat)
            t2 = time.perf_counter()
            clients[0].push(grad, clocks[0] + 1)
            clients[0].pull(flat, clocks[0] + 2)
            t3 = time.perf_counter()
            raw.ping()
            t4 = time.perf_counter()
            clocks = [clocks[0] + 2, clocks[1] + 1]
            if i >= warmup:
                for name, seconds in zip(SERIES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                    times[name].append(seconds)
    finally:
        for c in clients:
            c.close()
        if raw is not None:
            raw.close()
        stop_all(children)
    ms = {f"{name}_ms": _ms(values) for name, values in times.items()}
    unary = ms["raw_unary_ms"]
    return {
        "params": params,
        "shards": shards,
        "payload_bytes": params * 4,
        "iters": iters,
        "warmup": warmup,
        **ms,
        "ratio_median": ms["iteration_ms"]["median"] / unary["median"],
        "ratio_p99": ms["iteration_ms"]["p99"] / unary["p99"],
        "ratio_median_grpc": ms["iteration_grpc_ms"]["median"] / unary["median"],
        "ratio_median_separate": ms["separate_ms"]["median"] / unary["median"],
        "elapsed_s": time.monotonic() - t_start,
    }


def run_latency(preset: str) -> dict[str, Any]:
    """The suite's latency part."""
    p = PRESETS["latency"][preset]
    out = measure_latency(p["params"], p["iters"], p["warmup"])
    k = out["params"] / 1e3
    it, unary = out["iteration_ms"], out["raw_unary_ms"]
    what = f"latency: push+pull of a {k:.0f}K-parameter model over {out['shards']} shards, median"
    targets = [
        target(f"{what}, same host, vs raw gRPC unary round trip", it["median"], unary["median"], 3.0, "lower",
               "ms", "raw gRPC unary round trip"),
        target(f"{what}, gRPC only, vs raw gRPC unary round trip", out["iteration_grpc_ms"]["median"],
               unary["median"], 3.0, "lower", "ms", "raw gRPC unary round trip"),
    ]
    figures = [
        figure("latency: iteration (push+pull, one Step call per shard, same host) median", it["median"], "ms",
               unary["median"], "raw gRPC unary, median"),
        figure("latency: iteration, same host, p99", it["p99"], "ms", unary["p99"], "raw gRPC unary, p99"),
        figure("latency: iteration through gRPC only (payloads in the messages) p99",
               out["iteration_grpc_ms"]["p99"], "ms", unary["p99"], "raw gRPC unary, p99"),
        figure("latency: push then pull as separate calls (same host) median", out["separate_ms"]["median"], "ms",
               unary["median"], "raw gRPC unary, median"),
    ]
    return {**out, "preset": preset, "targets": targets, "figures": figures}


# ---------------------------------------------------------------------------------------------
# The peer: torch.distributed.rpc's parameter server

LR = 1e-9
# name -> TensorPipeRpcBackendOptions private transport/channel lists (None: TensorPipe's defaults)
SETUPS: dict[str, dict[str, list[str]]] = {
    "default": {},
    "uv": {"_transports": ["uv"]},
    "uv+basic": {"_transports": ["uv"], "_channels": ["basic"]},
}
TARGET_WORKERS = (1, 2)

# The RPC processes (`--role ps|worker`). Functions called over RPC are pickled by name; every
# rank runs this file as __main__, so they resolve to the same functions everywhere.

_weights: torch.Tensor | None = None
_lock = threading.Lock()


def get_weights() -> torch.Tensor:
    """PS side: the current weights (serialized by TensorPipe after return, as a classic PS does)."""
    assert _weights is not None
    return _weights


def push_grad(grad: torch.Tensor) -> bool:
    """PS side: one SGD step under the lock."""
    assert _weights is not None
    with _lock:
        _weights.add_(grad, alpha=-LR)
    return True


def _rpc_worker_handle(params: int) -> Any:
    from torch.distributed import rpc

    grad = torch.full((params,), 1e-3)

    def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd["op"] != "run":
            raise ValueError(f"unknown op {cmd['op']!r}")
        pull_s, push_s = [], []
        start = time.monotonic()
        for _ in range(int(cmd["iters"])):
            t0 = time.monotonic()
            weights = rpc.rpc_sync("ps", get_weights)
            t1 = time.monotonic()
            rpc.rpc_sync("ps", push_grad, args=(grad,))
            t2 = time.monotonic()
            if weights.numel() != params:
                raise ValueError(f"got {weights.numel()} weights, expected {params}")
            pull_s.append(t1 - t0)
            push_s.append(t2 - t1)
        return {"start": start, "end": time.monotonic(), "pull_s": pull_s, "push_s": push_s}

    return handle


def role_main(role: str, rank: int, world: int, store: str, params: int, setup: str, threads: int) -> None:
    from torch.distributed import rpc

    global _weights
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{store}", num_worker_threads=threads,
                                              rpc_timeout=ROUND_TIMEOUT_S, **SETUPS[setup])  # type: ignore[arg-type]
    if role == "ps":
        _weights = torch.zeros(params)
    name = "ps" if role == "ps" else f"worker{rank}"
    rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=options)
    print("rpc ready", flush=True)
    try:
        command_loop(_rpc_worker_handle(params) if role == "worker" else (lambda cmd: {"ok": True}))
    finally:
        # The parent sends quit only when no call is in flight, so nothing is lost by not waiting for
        # the other ranks (a graceful shutdown takes seconds here).
        rpc.shutdown(graceful=False)
    exit_now()


# ---------------------------------------------------------------------------------------------
# The parent side


class RpcWorld:
    """A PS process and `workers` worker processes in one torch.distributed.rpc world."""

    def __init__(self, setup: str, workers: int, params: int, threads: int = 16) -> None:
        self.setup = setup
        self.params = params
        self._dir = tempfile.TemporaryDirectory(prefix="psgrad-peer-")
        store = str(Path(self._dir.name) / "store")
        world = workers + 1

        def start(role: str, rank: int, env: dict[str, str]) -> Child:
            argv = [sys.executable, str(Path(__file__).resolve()), "--role", role, "--rank", str(rank), "--world", str(world),
                    "--store", store, "--params", str(params), "--setup", setup, "--threads", str(threads)]
            return Child(f"rpc-{role}{rank}-{setup}", argv, env={"TP_SOCKET_IFNAME": "lo", **env})

        self.ps = start("ps", 0, {})
        # Only worker 1 logs TensorPipe's choices, to report what was used.
        self.workers = [start("worker", r, {"TP_VERBOSE_LOGGING": "7"} if r == 1 else {}) for r in range(1, world)]
        self.children = [self.ps, *self.workers]

    def wait_ready(self) -> None:
        for c in self.children:
            c.wait_line("rpc ready", SETUP_TIMEOUT_S)

    def round(self, workers: int, iters: int) -> dict[str, Any]:
        """`workers` workers run `iters` iterations together; the idle workers are paused meanwhile."""
        with paused(self.workers[workers:]):
            replies = run_together(self.workers[:workers], [{"op": "run", "iters": iters}] * workers, ROUND_TIMEOUT_S)
        return aggregate(replies, self.params * 4)

    def idle_cpu(self, seconds: float) -> float:
        """CPU (in cores) each process of this world uses on average while nobody calls anything."""
        before = [c.cpu_s() for c in self.children]
        time.sleep(seconds)
        after = [c.cpu_s() for c in self.children]
        return sum(b - a for a, b in zip(before, after)) / seconds / len(self.children)

    def used(self) -> dict[str, Any]:
        """Transports and channels TensorPipe opened, counted from worker 1's log.

        Every pipe first connects over uv (TCP) to exchange what both ends support, then opens
        its connections on the best common transport and its channel connections."""
        text = self.workers[0].stderr_text()
        transports: dict[str, int] = {}
        for name in re.findall(r"\.tr_(\w+) is opening connection", text):
            transports[name] = transports.get(name, 0) + 1
        channels = sorted(set(re.findall(r"\(for channel (\w+)\)", text)))
        main = max(transports, key=lambda k: transports[k]) if transports else None
        return {"transport": main, "transport_connections": transports, "channels": channels}

    def close(self) -> None:
        try:
            stop_all(self.children, timeout_s=30)
        finally:
            self._dir.cleanup()


def _peer_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "ops_per_s": summarize([r["ops_per_s"] for r in rounds])["median"],
        "gb_per_s": summarize([r["gb_per_s"] for r in rounds])["median"],
        "reps_ops_per_s": [r["ops_per_s"] for r in rounds],
        "pull_ms_median": summarize([t for r in rounds for t in r["pull_s"]])["median"] * 1e3,
        "push_ms_median": summarize([t for r in rounds for t in r["push_s"]])["median"] * 1e3,
    }


def measure_peer(params: int, reps: int, iters: int, setups: dict[str, Sequence[int]]) -> dict[str, Any]:
    """For each TensorPipe setup: an RPC world, rounds interleaved with psgrad (1 shard) per worker count."""
    t_start = time.monotonic()
    max_workers = max(max(w) for w in setups.values())
    swarm = open_swarm(max_workers)
    worlds: list[RpcWorld] = []
    results: list[dict[str, Any]] = []
    failed = True
    try:
        swarm.servers(psgrad_key(1, params), 1, PSGRAD_SERVER)
        names = list(setups)
        worlds.append(RpcWorld(names[0], max(setups[names[0]]), params))  # starts beside the swarm
        key = swarm.psgrad_job(1, params)
        psgrad_children = list(swarm.children)
        swarm.round(key, max_workers, 1)  # warm-up
        for i, name in enumerate(names):
            world = worlds[-1]
            world.wait_ready()
            log(f"peer: setup {name!r} up after {time.monotonic() - t_start:.1f} s")
            with paused(psgrad_children):
                world.round(max(setups[name]), 1)  # warm-up: connections, first allocations
                idle_cpu = world.idle_cpu(1.0)
            rounds: dict[tuple[str, int], list[dict[str, Any]]] = {}
            for rep in range(reps):
                for w in setups[name]:
                    for system in ("psgrad", "rpc") if rep % 2 == 0 else ("rpc", "psgrad"):  # neither always first
                        if system == "psgrad":
                            others = world.children + swarm.agents[w:]
                        else:
                            others = psgrad_children
                        with paused(others):
                            r = swarm.round(key, w, iters) if system == "psgrad" else world.round(w, iters)
                        rounds.setdefault((system, w), []).append(r)
                log(f"peer: setup {name!r} repetition {rep + 1}/{reps} done ({time.monotonic() - t_start:.0f} s)")
            used = world.used()
            world.close()
            worlds.pop()
            if i + 1 < len(names):
                worlds.append(RpcWorld(names[i + 1], max(setups[names[i + 1]]), params))
            for w in setups[name]:
                ps, peer = _peer_summary(rounds[("psgrad", w)]), _peer_summary(rounds[("rpc", w)])
                results.append({"setup": name, "options": SETUPS[name], "used": used, "workers": w,
                                "rpc_idle_cpu_cores_per_process": idle_cpu,
                                "psgrad": ps, "rpc": peer, "ratio_ops_per_s": ps["ops_per_s"] / peer["ops_per_s"]})
        failed = False
    finally:
        for world in worlds:
            world.close()
        release_swarm(swarm, failed)
    return {"params": params, "payload_bytes": params * 4, "reps": reps, "iters_per_round": iters,
            "results": results, "elapsed_s": time.monotonic() - t_start}


def _peer_targets_and_figures(out: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    mb = out["payload_bytes"] / 1e6
    targets, figures = [], []
    for r in out["results"]:
        via = "/".join([r["used"]["transport"] or "?", *r["used"]["channels"]])
        label = f"{r['workers']} worker(s), rpc setup {r['setup']} ({via})"
        if r["setup"] == "default" and r["workers"] in TARGET_WORKERS:
            targets.append(target(f"peer: (pulls+pushes)/s, {mb:.0f} MB model, {r['workers']} worker(s), psgrad 1 shard "
                                  f"vs torch.distributed.rpc PS ({via})", r["psgrad"]["ops_per_s"],
                                  r["rpc"]["ops_per_s"], 1.5, "higher", "1/s", "torch.distributed.rpc PS"))
        figures.append(figure(f"peer: (pulls+pushes)/s, {label}", r["psgrad"]["ops_per_s"], "1/s",
                              r["rpc"]["ops_per_s"], "torch.distributed.rpc PS"))
        figures.append(figure(f"peer: pull+push GB/s, {label}", r["psgrad"]["gb_per_s"], "GB/s",
                              r["rpc"]["gb_per_s"], "torch.distributed.rpc PS"))
    return targets, figures


def run_peer(preset: str) -> dict[str, Any]:
    """The suite's peer part."""
    p = PRESETS["peer"][preset]
    out = measure_peer(p["params"], p["reps"], p["iters"], p["setups"])
    targets, figures = _peer_targets_and_figures(out)
    return {**out, "preset": preset, "targets": targets, "figures": figures,
            "notes": "get_weights returns the PS tensor itself (no copy under the lock, so a pull may see a "
                     "half-applied update; psgrad copies under its lock); the worker receives a freshly "
                     "allocated tensor per pull, psgrad pulls into the worker's reused buffer."}


# ---------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=PARTS, default="one-shard",
                        help="what psgrad is measured beside (default: one-shard; see above)")
    parser.add_argument("--matrix", action="store_true", help="the same as --part matrix")
    add_preset(parser, PRESETS["one-shard"], "model size and repetitions")
    # one-shard and matrix only
    parser.add_argument("--params", type=int, help="override the number of float32 parameters (one-shard, matrix)")
    parser.add_argument("--reps", type=int, help="override the number of timed repetitions (one-shard, matrix)")
    parser.add_argument("--wire-dtype", choices=["float32", "bfloat16", "float16"],
                        help="wire dtype (one-shard, matrix; default: float32)")
    parser.add_argument("--chunk-bytes", type=int, help="stream chunk size (one-shard, matrix; default: 1 MiB)")
    parser.add_argument("--stream-window-bytes", type=window_bytes_arg, metavar="N",
                        help="start the psgrad servers with this stream window (0 = gRPC's automatic windows; "
                        "default: the server's own); one-shard only")
    # internal: one rank of the peer part's RPC world (--params too)
    parser.add_argument("--role", choices=["ps", "worker"], help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--setup", default="default", choices=sorted(SETUPS), help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=16, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        if not args.store or not args.params:
            raise BenchError("--role needs --store and --params")
        role_main(args.role, args.rank, args.world, args.store, args.params, args.setup, args.threads)
        return
    part = "matrix" if args.matrix else args.part
    if args.matrix and args.part not in ("one-shard", "matrix"):
        parser.error(f"--matrix and --part {args.part} are two different parts")
    given = [flag for flag, value in (("--params", args.params), ("--reps", args.reps), ("--wire-dtype", args.wire_dtype),
                                      ("--chunk-bytes", args.chunk_bytes)) if value is not None]
    if part in ("latency", "peer") and given:
        parser.error(f"{', '.join(given)}: only for --part one-shard and matrix, not {part}")
    if part != "one-shard" and args.stream_window_bytes is not None:
        parser.error(f"--stream-window-bytes applies to the one-shard comparison, not to --part {part}")
    if part == "latency":
        write_json({**run_latency(args.preset), "machine": machine_info()})
        return
    if part == "peer":
        write_json({**run_peer(args.preset), "machine": machine_info()})
        return
    p = PRESETS[part][args.preset]
    params, reps = args.params or p["params"], args.reps or p["reps"]
    wire_dtype, chunk = args.wire_dtype or "float32", args.chunk_bytes or DEFAULT_CHUNK_BYTES
    if part == "matrix":
        m = run_matrix(params, reps, p["iters"], p["shards"], p["workers"], wire_dtype, chunk)
        targets, figures = _matrix_targets_and_figures(m)
        write_json({**m, "preset": args.preset, "machine": machine_info(), "targets": targets, "figures": figures})
        return
    out = compare_one_shard(params, reps, wire_dtype, chunk, args.stream_window_bytes)
    out["preset"] = args.preset
    write_json(out)


if __name__ == "__main__":
    main()
