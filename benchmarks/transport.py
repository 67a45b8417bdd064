"""psgrad's push and pull beside other transports of the same bytes, each in one run: raw gRPC
streaming, raw gRPC unary calls and the classic torch.distributed.rpc parameter server; on this
machine, or across hosts on shaped links; dense weights, or sparse embedding rows.

    python benchmarks/transport.py --preset full                  # one shard, one client, 25M float32 (100 MB)
    python benchmarks/transport.py --preset tiny                  # the same, CI-sized
    python benchmarks/transport.py --preset full --part matrix    # 1 and 2 shards x 1, 2, 4 worker processes
    python benchmarks/transport.py --preset full --part latency   # a 100K-parameter iteration vs a unary call
    python benchmarks/transport.py --preset full --part peer      # beside torch.distributed.rpc; 1, 2, 4 workers
    python benchmarks/transport.py --preset full --part multihost # 10M float32 parameters, every link 1 Gbit/s
    python benchmarks/transport.py --preset full --part sparse-rows            # 4,096 unique ids x 64 dims a call
    python benchmarks/transport.py --preset full --part sparse-rows --netbed   # the same on the shaped test bed

Servers run as separate processes (on this machine, or on the test bed's hosts); measurements of
psgrad and of what it is compared with are interleaved, repetition by repetition (in alternating
order), so machine noise hits both alike. Prints one JSON document; progress goes to stderr. The
suite runs the matrix (`run`, its part "transport"), the latency part (`run_latency`) and the peer
part (`run_peer`).

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

--part multihost: psgrad across hosts on shaped links: push/pull beside raw gRPC, bfloat16 beside
float32 on the wire, and a sync iteration beside gloo all-reduce, all on one test bed, in one run
(presets tiny, full; --params, --rate-mbit). The hosts are network namespaces (lib/netbed.py), each
with its own address and /dev/shm, every host's link shaped with `tc ... tbf` to `--rate-mbit` in
both directions. Needs root, iproute2 and tc.

- transport: one shard server, a raw gRPC server (lib/raw_grpc.py: 1 MiB chunks through generic
  handlers, a copy per chunk) and a bfloat16 shard server on host 0; one client on host 2 pulls
  and pushes the model through each, repetitions interleaved in alternating order.
  `psgrad_vs_raw`: psgrad's throughput over raw gRPC's of the same bytes over the same link
  (goal >= 0.9); `bf16_vs_fp32`: the bfloat16 wire's model throughput over float32's (goal >= 1.8).
- sync: two shards (hosts 0 and 1), two sync workers (hosts 2 and 3); each iteration pushes the
  gradient and pulls the weights (one Step call per shard). The same two processes then all-reduce
  the same gradient with torch.distributed's gloo backend between hosts 2 and 3, rounds alternating.
  `sync_vs_allreduce`: a sync iteration's time over an all-reduce's (lower is better).
  Traffic per worker link is the same for both (the model's bytes in each direction; with two
  ranks a ring all-reduce sends and receives half the bytes twice); each shard's link carries half
  the model from each of the two workers.

--part sparse-rows: sparse rows over the wire: psgrad's pull and push of embedding rows beside raw
gRPC unary calls moving the same bytes, in one run, through 1 and 2 shards; on loopback, or across
hosts on links shaped to 1 Gbit/s (--netbed; presets tiny = quick, full). The job: one worker (rank
0, async mode, SGD lr 1e-9) whose model is a psgrad.Embedding of `--rows` x `--dim` (1M x 64 in
full: its rows are made on the servers on first touch, so the table costs nothing until then) and a
small nn.Linear, joined through `psgrad.connect(...).optimizer` as a worker on another host would
be (no same-host shared memory: every byte over gRPC, and the Step calls over the servers' TCP step
sockets, as psgrad does by default; the servers run without TLS). Every server is its own process (`psgrad
server`), as is the worker (an agent that this script starts and sends the addresses to).

One call moves `--ids` unique row ids (a fixed random set, about half on each of 2 shards):
- pull: `ParameterClient.pull_rows` of warm rows (made by an earlier pull): ids out, rows back;
- cold_pull: the same for ids never touched before (the shard makes each row on first touch);
- push: `ParameterClient.push` of a step with the rows' gradients: per shard one Push call whose
  header carries the ids and gradients beside the step's small dense gradient (applied together);
- step: `ParameterClient.exchange`, the traffic of `PSOptimizer.step`: per shard one Step call
  (that push, and the dense pull) over the server's TCP step socket;
- step_grpc: the same Step calls through gRPC (as `psgrad worker --no-step-socket` makes them, and
  every worker did before the step socket);
- raw_pull, raw_put: per shard one bare gRPC unary call (lib/raw_grpc.py Fetch and Put, identity
  serializers, the same concurrency) moving the same bytes: the ids out and the rows' bytes back,
  or the ids and gradients out and 8 bytes back; one raw server process beside each shard;
- raw_tcp_put: the ids and gradients as one message on a bare TCP connection (lib/ceilings.py,
  a copy into a reused buffer) and 8 bytes back: the loopback TCP ceiling of a push, one TCP
  server process beside each shard.
Each repetition times `--calls` calls of each, back to back (so the test bed's token bucket, at
most 64 KB, is a small part of the bytes timed), in alternating order; figures are medians over repetitions.
`payload` bytes are those in the heavy direction: the rows for pulls, ids + gradients for pushes.
Ratios are psgrad's over raw gRPC's (rows/s and bytes/s alike: the same rows and bytes); goal
>= 0.8 for pull and push; the step's is also given over raw TCP's. With --netbed the worker is on host 0 and shard i (and raw server i) on
host i + 1 of lib/netbed.py's bed, every link shaped to --rate-mbit; the ratio to the link's
bytes/s is reported too. CPU per call (the worker's and its servers', from /proc) shows what
the shared cores spent. Progress and a table go to stderr.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import torch

from lib import (
    PSGRAD_SERVER,
    RAW_SERVER,
    SETUP_TIMEOUT_S,
    BenchError,
    Child,
    aggregate,
    command_loop,
    exit_now,
    figure,
    lib_argv,
    log,
    machine_info,
    median_gbps,
    overrides,
    paused,
    rep_order,
    run_together,
    start_server,
    stop_all,
    run_by_run,
    summarize,
    target,
    window_argv,
    window_bytes_arg,
    write_json,
)
from lib.ceilings import MemcpyProbe, TcpClient
from lib.procfs import cpu_seconds
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

PARTS = ("one-shard", "matrix", "latency", "peer", "multihost", "sparse-rows")
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
    "multihost": {
    "tiny": {"params": 1_000_000, "reps": 3, "rounds": 2, "iters": 2, "rate_mbit": 1000},
    "full": {"params": 10_000_000, "reps": 10, "rounds": 4, "iters": 5, "rate_mbit": 1000},
    },
    "sparse-rows": {  # quick is tiny
    "tiny": {"rows": 100_000, "ids": 512, "dim": 64, "shards": (1, 2), "reps": 3, "calls": 3},
    "quick": {"rows": 100_000, "ids": 512, "dim": 64, "shards": (1, 2), "reps": 3, "calls": 3},
    "full": {"rows": 1_000_000, "ids": 4096, "dim": 64, "shards": (1, 2), "reps": 20, "calls": 10},
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
# --part multihost: across hosts on shaped links


# Agents: run on a host of the bed as `python benchmarks/transport.py --agent multihost-KIND ...`


def multihost_agent_transport(args: argparse.Namespace) -> dict[str, Any]:
    """Interleaved pulls and pushes through psgrad (float32 and bfloat16) and raw gRPC."""
    import torch

    from psgrad.client.parameter_client import ParameterClient
    from psgrad.config import ClientConfig, JobSpec
    from psgrad.core.codecs import byte_view
    from psgrad.core.sharding import ParamSpec, plan_shards

    from lib.raw_grpc import RawClient

    n = args.params
    params = [ParamSpec("weight", (n,), "float32")]
    cfg = ClientConfig(rpc_timeout_s=600, shared_memory=False)
    flat, grad = torch.zeros(n), torch.full((n,), 1e-3)
    clients = {}
    for key, address, dtype in (("fp32", args.psgrad, "float32"), ("bf16", args.psgrad_bf16, "bfloat16")):
        spec = JobSpec(num_shards=1, wire_dtype=dtype, lr=1e-9)
        c = ParameterClient([address], spec, params, plan_shards(params, 1), 0, cfg)
        c.join(initial_weights=lambda: flat)
        clients[key] = c
    raw = RawClient(args.raw)
    chunk = 1 << 20
    src = byte_view(torch.ones(n))
    dst = byte_view(torch.empty(n))
    ops = {
        "psgrad_pull": lambda i: clients["fp32"].pull(flat, i),
        "raw_download": lambda i: raw.download(dst, chunk),
        "psgrad_push": lambda i: clients["fp32"].push(grad, i),
        "raw_upload": lambda i: raw.upload(src, chunk),
        "bf16_pull": lambda i: clients["bf16"].pull(flat, i),
        "bf16_push": lambda i: clients["bf16"].push(grad, i),
    }
    for fn in ops.values():  # warm-up: buffers on both ends, connections
        fn(0)
    times: dict[str, list[float]] = {k: [] for k in ops}
    for rep in range(1, args.reps + 1):
        for key in rep_order(list(ops), rep):
            t0 = time.perf_counter()
            ops[key](rep)
            times[key].append(time.perf_counter() - t0)
    for c in clients.values():
        c.close()
    raw.close()
    return {"times_s": times}


def multihost_agent_sync(args: argparse.Namespace) -> dict[str, Any]:
    """Sync iterations through two shards, then gloo all-reduces of the same gradient, in rounds."""
    import torch
    import torch.distributed as dist

    from psgrad.client.parameter_client import ParameterClient
    from psgrad.config import ClientConfig, JobSpec
    from psgrad.core.sharding import ParamSpec, plan_shards

    n, rank = args.params, args.rank
    servers = args.servers.split(",")
    params = [ParamSpec("weight", (n,), "float32")]
    spec = JobSpec(num_shards=len(servers), num_workers=2, mode="sync", lr=1e-9)
    cfg = ClientConfig(rpc_timeout_s=600, init_timeout_s=300, shared_memory=False)
    flat, grad = torch.zeros(n), torch.full((n,), 1e-3)
    client = ParameterClient(servers, spec, params, plan_shards(params, len(servers)), rank, cfg)
    clock = client.join(initial_weights=(lambda: flat) if rank == 0 else None)
    client.pull(flat, clock)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
    dist.init_process_group("gloo", store=dist.FileStore(args.store, 2), rank=rank, world_size=2)
    reduced = grad.clone()

    def sync_iteration() -> None:
        nonlocal clock
        client.exchange(grad, clock, flat)
        clock += 1

    def allreduce() -> None:
        reduced.copy_(grad)
        dist.all_reduce(reduced)
        reduced.div_(2)

    ops = {"sync_iteration": sync_iteration, "allreduce": allreduce}
    for fn in ops.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {k: [] for k in ops}
    for rnd in range(1, args.rounds + 1):
        for key in rep_order(list(ops), rnd):
            dist.barrier()
            for _ in range(args.iters):
                t0 = time.perf_counter()
                ops[key]()
                times[key].append(time.perf_counter() - t0)
    dist.barrier()
    dist.destroy_process_group()
    client.leave()
    client.close()
    return {"rank": rank, "times_s": times}


# The driver: builds the bed, starts the servers, runs the agents, computes the figures


def _link_summary(times: list[float], nbytes: int) -> dict[str, float]:
    med = statistics.median(times)
    return {"median_s": med, "min_s": min(times), "max_s": max(times), "mb_per_s": nbytes / med / 1e6}


def run_multihost(preset: str, params: int | None = None, rate_mbit: float | None = None) -> dict[str, Any]:
    """--part multihost: the transport and sync comparisons on a bed of 4 hosts."""
    from lib.netbed import NetBed

    from psgrad.launch.supervisor import SupervisedProcess

    cfg = dict(PRESETS["multihost"][preset])
    if params:
        cfg["params"] = params
    if rate_mbit:
        cfg["rate_mbit"] = rate_mbit
    why = NetBed.unavailable()
    if why:
        raise SystemExit(f"multihost: no test bed here: {why}")
    n = cfg["params"]
    py = sys.executable
    me = str(Path(__file__).resolve())
    procs: list[Any] = []

    def start(bed: NetBed, host: int, argv: list[str], marker: str, name: str) -> str:
        proc = SupervisedProcess(argv, name=name, new_session=False, template=bed.templates([host])[0])
        procs.append(proc)
        return proc.wait_for_line(marker, timeout_s=120).rsplit(" ", 1)[1]

    def agent(bed: NetBed, host: int, argv: list[str]) -> Any:
        proc = SupervisedProcess([py, me, *argv], name=f"agent@{host}", new_session=False, stderr_file=True,
                                 template=bed.templates([host])[0])
        procs.append(proc)
        return proc

    def result(proc: Any) -> dict[str, Any]:
        rc = proc.wait(3600)
        if rc != 0:
            raise SystemExit(f"multihost: {proc.name} failed (exit {rc}): {proc.stderr_text()[-3000:]}")
        out: dict[str, Any] = json.loads(proc.lines[-1])
        return out

    server = ["-m", "psgrad", "server", "--port", "0", "--lease-s", "600", "--insecure"]  # a private bed
    with NetBed(4, rate_mbit=cfg["rate_mbit"]) as bed:
        try:
            a = [h.addr for h in bed.hosts]
            log(f"multihost: bed up: 4 hosts, links {cfg['rate_mbit']} Mbit/s; transport, {n:,} float32 parameters")
            bed.templates(range(4))  # (each host's processes are forks of its template)
            ps = start(bed, 0, [py, *server, "--host", a[0]], "listening on", "psgrad-fp32")
            ps16 = start(bed, 0, [py, *server, "--host", a[0]], "listening on", "psgrad-bf16")
            raw = start(bed, 0, [py, *RAW_SERVER, "--host", a[0]], "listening on", "raw")
            t = result(agent(bed, 2, ["--agent", "multihost-transport", "--params", str(n), "--reps", str(cfg["reps"]),
                                      "--psgrad", ps, "--psgrad-bf16", ps16, "--raw", raw]))
            for p in procs:
                p.stop(10)
            procs.clear()
            log("multihost: sync: 2 shards, 2 workers, beside gloo all-reduce")
            s0 = start(bed, 0, [py, *server, "--host", a[0]], "listening on", "shard0")
            s1 = start(bed, 1, [py, *server, "--host", a[1]], "listening on", "shard1")
            store = f"/tmp/psgrad-multihost-store-{os.getpid()}"
            if os.path.exists(store):
                os.remove(store)
            common = ["--agent", "multihost-sync", "--params", str(n), "--servers", f"{s0},{s1}", "--store", store,
                      "--rounds", str(cfg["rounds"]), "--iters", str(cfg["iters"])]
            agents = [agent(bed, 2 + r, [*common, "--rank", str(r)]) for r in range(2)]
            s = [result(x) for x in agents]
            if os.path.exists(store):
                os.remove(store)
        finally:
            for p in procs:
                p.stop(10)
    fp32_bytes, bf16_bytes = 4 * n, 2 * n
    tr = {k: _link_summary(v, bf16_bytes if k.startswith("bf16") else fp32_bytes) for k, v in t["times_s"].items()}
    # A sync iteration ends for both workers together; take the slower worker's time per iteration.
    sync_times = {k: [max(x) for x in zip(*(r["times_s"][k] for r in s))] for k in ("sync_iteration", "allreduce")}
    sy = {k: _link_summary(v, 2 * fp32_bytes) for k, v in sync_times.items()}
    link_mb_s = cfg["rate_mbit"] / 8
    model_time = {k: tr[k]["median_s"] for k in tr}
    return {
        "benchmark": "multihost",
        "preset": preset,
        "params": n,
        "rate_mbit": cfg["rate_mbit"],
        "link_ceiling_mb_per_s": link_mb_s,
        "machine": machine_info(),
        "transport": tr,
        "sync": sy,
        "ratios": {
            "push_vs_raw_upload": tr["raw_upload"]["median_s"] / tr["psgrad_push"]["median_s"],
            "pull_vs_raw_download": tr["raw_download"]["median_s"] / tr["psgrad_pull"]["median_s"],
            # model parameters per second, bfloat16 wire over float32 wire
            "bf16_vs_fp32_push": model_time["psgrad_push"] / model_time["bf16_push"],
            "bf16_vs_fp32_pull": model_time["psgrad_pull"] / model_time["bf16_pull"],
            # time of one sync iteration over one all-reduce of the same gradient (lower is better)
            "sync_iteration_vs_allreduce": sy["sync_iteration"]["median_s"] / sy["allreduce"]["median_s"],
        },
        "goals": {"push_vs_raw_upload": 0.9, "pull_vs_raw_download": 0.9, "bf16_vs_fp32_push": 1.8,
                  "bf16_vs_fp32_pull": 1.8},
    }


# ---------------------------------------------------------------------------------------------
# --part sparse-rows: embedding rows by id


SPARSE_GOAL = 0.8
SPARSE_TABLE = "emb"
SPARSE_OPS = ("pull", "raw_pull", "cold_pull", "push", "step", "step_grpc", "raw_put", "raw_tcp_put")
# op -> the raw op it is compared with
SPARSE_VERSUS = {"pull": "raw_pull", "cold_pull": "raw_pull", "push": "raw_put", "step": "raw_put",
                 "step_grpc": "raw_put"}


def sparse_payload_bytes(op: str, ids: int, dim: int) -> int:
    """Bytes one call moves in its heavy direction: the rows (pulls), ids + gradients (pushes)."""
    return ids * dim * 4 + (0 if "pull" in op else ids * 8)


# ---------------------------------------------------------------------------------------------
# The agent: the worker, in a process of its own (on host 0 of the bed with --netbed)


def _fan(pool: futures.ThreadPoolExecutor, fns: Sequence[Callable[[], object]]) -> None:
    """Run fns concurrently, the first on this thread (as ParameterClient fans out); wait for all."""
    futs = [pool.submit(f) for f in fns[1:]]
    fns[0]()
    for f in futs:
        f.result()


def _cpu(pids: Sequence[int]) -> float:
    return sum(cpu_seconds(p) for p in pids)


def sparse_measure_job(cfg: dict[str, Any], job: dict[str, Any], raws: list[Any], tcps: list[Any],
                       pool: futures.ThreadPoolExecutor) -> dict[str, Any]:
    """Every op through one job's shards and as many raw servers, repetitions interleaved."""
    import torch
    from torch import nn

    import psgrad
    from psgrad.config import ClientConfig
    from psgrad.core import rows as placement
    from psgrad.core.codecs import byte_view

    n, dim, reps, calls, S = cfg["ids"], cfg["dim"], cfg["reps"], cfg["calls"], job["shards"]
    model = nn.Module()
    model.emb = psgrad.Embedding(cfg["rows"], dim)
    model.head = nn.Linear(dim, 8)
    session = psgrad.connect(job["servers"], rank=0, num_workers=1, mode="async", optimizer=psgrad.SGD(lr=1e-9),
                             client=ClientConfig(shared_memory=False, rpc_timeout_s=120))
    try:
        opt = session.optimizer(model)
        client = opt.client
        order = torch.randperm(cfg["rows"], generator=torch.Generator().manual_seed(S))
        warm = order[:n].sort().values
        fresh = iter(chunk.sort().values for chunk in order[n:].split(n) if chunk.numel() == n)
        grads = torch.full((n, dim), 1e-3)
        dense, weights = torch.zeros(client.plan.total), torch.zeros(client.plan.total)
        clock = opt.clock

        # raw gRPC: shard i's ids (id mod S == i) out, their rows' bytes back into one buffer
        where = placement.shard_of(warm, S)
        mine = [warm[where == i].contiguous() for i in range(S)]
        theirs = [grads[where == i].contiguous() for i in range(S)]
        out = torch.empty(n, dim)
        byte_out = byte_view(out)
        offsets = [0]
        for m in mine:
            offsets.append(offsets[-1] + m.numel() * dim * 4)

        def fetch(i: int) -> None:
            raws[i].fetch(mine[i].numpy().tobytes(), byte_out[offsets[i]:offsets[i + 1]])

        def put(i: int) -> None:  # the request made from the tensors, as any sender must
            raws[i].put(b"".join((byte_view(mine[i]), byte_view(theirs[i]))))

        def raw_pull() -> None:
            _fan(pool, [functools.partial(fetch, i) for i in range(S)])

        def raw_put() -> None:
            _fan(pool, [functools.partial(put, i) for i in range(S)])

        def tcp_put(i: int) -> None:  # the request made from the tensors, as raw_put's
            tcps[i].upload(memoryview(b"".join((byte_view(mine[i]), byte_view(theirs[i])))), 1 << 30)

        def raw_tcp_put() -> None:
            _fan(pool, [functools.partial(tcp_put, i) for i in range(S)])

        def push() -> None:
            nonlocal clock
            client.push(dense, clock, rows={SPARSE_TABLE: (warm, grads)})
            clock += 1

        def step() -> None:
            nonlocal clock
            client.exchange(dense, clock, weights, rows={SPARSE_TABLE: (warm, grads)})
            clock += 1

        def step_grpc() -> None:  # (each shard's TCP connection stays open for `step`: not given up)
            offers = [s.frames.socket.offer for s in client.shards]
            for s in client.shards:  # as without a socket offered: the shards' calls fanned out to threads
                s.frames.socket.channel, s.frames.socket.offer = lambda: None, None
            try:
                step()
            finally:
                for s, offer in zip(client.shards, offers):
                    del s.frames.socket.channel
                    s.frames.socket.offer = offer

        ops: dict[str, Callable[[], object]] = {
            "pull": lambda: client.pull_rows(SPARSE_TABLE, warm),
            "raw_pull": raw_pull,
            "cold_pull": lambda: client.pull_rows(SPARSE_TABLE, next(fresh)),
            "push": push,
            "step": step,
            "step_grpc": step_grpc,
            "raw_put": raw_put,
            "raw_tcp_put": raw_tcp_put,
        }
        server_pids = {op: job["pids"] if not op.startswith("raw") else cfg["raw_pids"][:S] for op in ops}
        server_pids["raw_tcp_put"] = cfg["tcp_pids"][:S]
        for fn in ops.values():  # warm-up: connections, buffers, and the warm rows made
            for _ in range(calls):
                fn()
        batch_s: dict[str, list[float]] = {op: [] for op in ops}
        call_s: dict[str, list[float]] = {op: [] for op in ops}
        cpu = {op: {"worker": 0.0, "servers": 0.0} for op in ops}
        for rep in range(1, reps + 1):
            for op in rep_order(list(ops), rep):
                fn = ops[op]
                s0, c0 = _cpu(server_pids[op]), time.process_time()
                t0 = time.perf_counter()
                for _ in range(calls):
                    t1 = time.perf_counter()
                    fn()
                    call_s[op].append(time.perf_counter() - t1)
                batch_s[op].append(time.perf_counter() - t0)
                cpu[op]["worker"] += time.process_time() - c0
                cpu[op]["servers"] += _cpu(server_pids[op]) - s0
        per_shard = [int(m.numel()) for m in mine]
        on_socket = [s.frames.socket.calls for s in client.shards]
        if not all(on_socket):  # (the figures would not be what they are named)
            raise BenchError(f"step: the Step calls did not go over the servers' TCP sockets ({on_socket} did)")
        return {"shards": S, "ids_per_shard": per_shard, "batch_s": batch_s, "call_s": call_s,
                "cpu_ms_per_call": {op: {k: 1e3 * v / (reps * calls) for k, v in c.items()} for op, c in cpu.items()}}
    finally:
        session.close()


def sparse_agent_main() -> None:
    """The worker's process: answers {"op": "run", ...config} with every job's timings."""
    import torch

    from lib.ceilings import TcpClient
    from lib.raw_grpc import RawClient

    torch.set_num_threads(1)

    def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd.get("op") != "run":
            raise BenchError(f"unknown op {cmd.get('op')!r}")
        raws = [RawClient(a) for a in cmd["raw"]]
        tcps = [TcpClient(a) for a in cmd["tcp"]]
        pool = futures.ThreadPoolExecutor(max_workers=max(len(cmd["raw"]), 1))
        try:
            return {"jobs": [sparse_measure_job(cmd, job, raws, tcps, pool) for job in cmd["jobs"]]}
        finally:
            pool.shutdown()
            for r in [*raws, *tcps]:
                r.close()

    command_loop(handle)
    exit_now()


# ---------------------------------------------------------------------------------------------
# The driver


def run_sparse_rows(p: dict[str, Any], netbed: bool, rate_mbit: float) -> dict[str, Any]:
    """Start the servers (psgrad: a job per shard count; raw: one per shard) and the agent, on
    loopback or on hosts of a shaped bed; collect its timings."""
    need = p["ids"] * (1 + p["calls"] * (p["reps"] + 1))
    if need > p["rows"]:
        raise SystemExit(f"sparse_rows: {p['reps']} repetitions of {p['calls']} cold pulls of {p['ids']} ids need "
                         f"{need:,} rows; the table has {p['rows']:,} (raise --rows or lower --reps/--calls)")
    top = max(p["shards"])
    me = str(Path(__file__).resolve())
    children: list[Child] = []
    bed: Any = None
    try:
        if netbed:
            from lib.netbed import NetBed

            why = NetBed.unavailable()
            if why:
                raise SystemExit(f"sparse_rows: no test bed here: {why}")
            bed = NetBed(1 + top, rate_mbit=rate_mbit).__enter__()
            log(f"sparse_rows: bed up: {1 + top} hosts, every link {rate_mbit:g} Mbit/s")
            bed.templates(range(1 + top))  # (each host's processes are forks of its template)

        def start(name: str, host: int, argv: list[str], speaks: bool = False) -> Child:
            child = Child(name, [sys.executable, *argv], speaks=speaks, template=bed.templates([host])[0] if bed else None)
            children.append(child)
            return child

        def psgrad_argv(host: int) -> list[str]:  # plaintext on the bed: a private network
            if not bed:
                return PSGRAD_SERVER
            return ["-m", "psgrad", "server", "--host", bed.hosts[host].addr, "--port", "0", "--lease-s", "600",
                    "--insecure"]

        def raw_argv(host: int, server: list[str] = RAW_SERVER) -> list[str]:
            return [*server, "--host", bed.hosts[host].addr] if bed else server

        agent = start("agent", 0, [me, "--agent", "sparse-rows"], speaks=True)
        jobs = [(S, [start(f"psgrad-{S}s-{i}", 1 + i, psgrad_argv(1 + i)) for i in range(S)]) for S in p["shards"]]
        raws = [start(f"raw-{i}", 1 + i, raw_argv(1 + i)) for i in range(top)]
        tcps = [start(f"tcp-{i}", 1 + i, raw_argv(1 + i, TCP_SERVER)) for i in range(top)]
        cmd = {"op": "run", **{k: p[k] for k in ("rows", "ids", "dim", "reps", "calls")},
               "raw": [r.address(timeout_s=SETUP_TIMEOUT_S) for r in raws], "raw_pids": [r.popen.pid for r in raws],
               "tcp": [t.address(timeout_s=SETUP_TIMEOUT_S) for t in tcps], "tcp_pids": [t.popen.pid for t in tcps],
               "jobs": [{"shards": S, "servers": [c.address(timeout_s=SETUP_TIMEOUT_S) for c in cs],
                         "pids": [c.popen.pid for c in cs]} for S, cs in jobs]}
        log(f"sparse_rows: servers up; {p['ids']:,} ids x {p['dim']} dims a call, {p['reps']} repetitions of "
            f"{p['calls']} calls, shards {', '.join(map(str, p['shards']))}")
        return agent.call(cmd, SETUP_TIMEOUT_S + 600)
    finally:
        stop_all(children)
        if bed is not None:
            bed.__exit__(None, None, None)


def sparse_summarize_job(job: dict[str, Any], p: dict[str, Any], link_mb_s: float | None) -> dict[str, Any]:
    """Per op: rows/s and MB/s of the median batch, the median call, CPU; ratios to raw gRPC."""
    n, calls = p["ids"], p["calls"]
    res: dict[str, Any] = {}
    for op in SPARSE_OPS:
        med = summarize(job["batch_s"][op])["median"]
        nbytes = sparse_payload_bytes(op, n, p["dim"])
        res[op] = {"rows_per_s": calls * n / med, "mb_per_s": calls * nbytes / med / 1e6,
                   "call_ms_median": 1e3 * summarize(job["call_s"][op])["median"],
                   "call_ms_p99": 1e3 * summarize(job["call_s"][op])["p99"],
                   "cpu_ms_per_call": job["cpu_ms_per_call"][op]}
        if link_mb_s:
            res[op]["vs_link"] = res[op]["mb_per_s"] / link_mb_s
    ratios = {f"{op}_vs_{raw}": res[op]["rows_per_s"] / res[raw]["rows_per_s"] for op, raw in SPARSE_VERSUS.items()}
    return {"shards": job["shards"], "ids_per_shard": job["ids_per_shard"], "results": res, "ratios": ratios,
            "ratios_by_rep": sparse_ratios_by_rep(job["batch_s"])}


def sparse_ratios_by_rep(batch_s: dict[str, list[float]]) -> dict[str, dict[str, Any]]:
    """Each ratio of sparse_summarize_job repetition by repetition: an op's batch against its raw
    op's batch of the same repetition (the same rows, moved seconds apart, so a slow phase of the
    machine weighs on both), with their median, range and how many reach SPARSE_GOAL: whether a
    ratio is met steadily, which the medians of each op over the whole run cannot say."""
    out: dict[str, dict[str, Any]] = {}
    for op, raw in SPARSE_VERSUS.items():
        # (rows/s over rows/s: time over time)
        out[f"{op}_vs_{raw}"] = run_by_run([r / o for o, r in zip(batch_s[op], batch_s[raw])], SPARSE_GOAL)
    return out


def sparse_report(p: dict[str, Any], raw: dict[str, Any], netbed: bool, rate_mbit: float) -> dict[str, Any]:
    link = rate_mbit / 8 if netbed else None
    where = f"shaped {rate_mbit:g} Mbit/s links" if netbed else "loopback"
    jobs = [sparse_summarize_job(j, p, link) for j in raw["jobs"]]
    targets, figures = [], []
    for j in jobs:
        S, r = j["shards"], j["results"]
        for op in ("pull", "push", "step"):  # (step: a whole sparse step, PSOptimizer.step's call)
            vs = SPARSE_VERSUS[op]
            targets.append(target(f"sparse {op}: rows/s, {p['ids']:,} ids x {p['dim']}, {S} shard(s), {where}",
                                  r[op]["rows_per_s"], r[vs]["rows_per_s"], SPARSE_GOAL, "higher", "rows/s", f"raw gRPC {vs}"))
            targets[-1]["by_rep"] = j["ratios_by_rep"][f"{op}_vs_{vs}"]
        for op in ("pull", "cold_pull", "push", "step", "step_grpc"):
            vs = SPARSE_VERSUS[op]
            figures.append(figure(f"sparse {op} rows/s, {S} shard(s), {where}", r[op]["rows_per_s"], "rows/s",
                                  r[vs]["rows_per_s"], f"raw gRPC {vs}"))
            figures.append(figure(f"sparse {op} MB/s, {S} shard(s), {where}", r[op]["mb_per_s"], "MB/s",
                                  r[vs]["mb_per_s"], f"raw gRPC {vs}"))
            if op == "step":
                figures.append(figure(f"sparse step rows/s over raw TCP, {S} shard(s), {where}", r[op]["rows_per_s"],
                                      "rows/s", r["raw_tcp_put"]["rows_per_s"], "raw TCP raw_tcp_put"))
            if link:
                figures.append(figure(f"sparse {op} MB/s, {S} shard(s), vs the link", r[op]["mb_per_s"], "MB/s",
                                      link, f"{rate_mbit:g} Mbit/s link"))
    return {
        "benchmark": "sparse_rows",
        "network": "netbed" if netbed else "loopback",
        "rate_mbit": rate_mbit if netbed else None,
        "link_mb_per_s": link,
        **{k: p[k] for k in ("rows", "ids", "dim", "reps", "calls")},
        "payload_bytes": {op: sparse_payload_bytes(op, p["ids"], p["dim"]) for op in SPARSE_OPS},
        "machine": machine_info(),
        "jobs": jobs,
        "targets": targets,
        "figures": figures,
        "notes": "push = per shard one Push call carrying the rows' ids and gradients in its header with the "
                 "step's small dense gradient, applied together; step = per shard one Step call (that push "
                 "and the dense pull) over the server's TCP step socket, as PSOptimizer.step sends; step_grpc = "
                 "the same through gRPC; raw_put = one unary gRPC call of the same ids + gradients; raw_tcp_put "
                 "= one message of them on a bare TCP connection. Pulls move ids out and rows back in one unary "
                 "call per shard, as raw_pull does.",
    }


def sparse_table(doc: dict[str, Any]) -> str:
    """The figures as a fixed-width table."""
    link = doc["link_mb_per_s"]
    head = f"{'shards':>6} {'op':<11} {'rows/s':>10} {'MB/s':>8} {'ms/call':>8} {'raw MB/s':>9} {'ratio':>6}"
    head += f" {'by rep':>9} {'at 0.8':>6}"
    head += f" {'vs link':>7}" if link else ""
    head += f" {'cpu ms/call w+s':>16}"
    lines = [f"sparse rows, {doc['ids']:,} ids x {doc['dim']} dims a call ({doc['network']}"
             + (f", {doc['rate_mbit']:g} Mbit/s" if link else "") + f"), medians of {doc['reps']} x {doc['calls']} calls",
             head]
    for j in doc["jobs"]:
        r = j["results"]
        for op in SPARSE_OPS:
            vs = SPARSE_VERSUS.get(op)
            ratio = f"{r[op]['rows_per_s'] / r[vs]['rows_per_s']:6.2f}" if vs else f"{'':>6}"
            raw_mb = f"{r[vs]['mb_per_s']:9.1f}" if vs else f"{'':>9}"
            c = r[op]["cpu_ms_per_call"]
            line = (f"{j['shards']:>6} {op:<11} {r[op]['rows_per_s']:10,.0f} {r[op]['mb_per_s']:8.1f} "
                    f"{r[op]['call_ms_median']:8.2f} {raw_mb} {ratio}")
            by_rep = j.get("ratios_by_rep", {}).get(f"{op}_vs_{vs}")
            line += (f" {by_rep['min']:4.2f}-{by_rep['max']:4.2f} {by_rep['at_goal']:>3}/{by_rep['n']:<2}" if by_rep
                     else f" {'':>9} {'':>6}")
            line += f" {r[op]['vs_link']:7.2f}" if link else ""
            line += f" {c['worker']:7.2f}+{c['servers']:<7.2f}"
            lines.append(line)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------


# The public flags each part takes (argparse dests; the others are refused with that part).
PART_FLAGS: dict[str, tuple[str, ...]] = {
    "one-shard": ("params", "reps", "wire_dtype", "chunk_bytes", "stream_window_bytes"),
    "matrix": ("params", "reps", "wire_dtype", "chunk_bytes"),
    "latency": (),
    "peer": (),
    "multihost": ("params", "rate_mbit"),
    "sparse-rows": ("netbed", "rate_mbit", "rows", "ids", "dim", "reps", "calls", "shards"),
}
PUBLIC_FLAGS = sorted({f for flags in PART_FLAGS.values() for f in flags})


def _shard_counts(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=PARTS, default="one-shard",
                        help="what psgrad is measured beside, and where (default: one-shard; see above)")
    parser.add_argument("--matrix", action="store_true", help="the same as --part matrix")
    parser.add_argument("--preset", choices=["full", "quick", "tiny"], default="tiny",
                        help="model size and repetitions: tiny (CI-sized) or full; --part sparse-rows also takes "
                        "quick, the same as tiny (default: tiny)")
    # one-shard, matrix and multihost
    parser.add_argument("--params", type=int, help="override the number of float32 parameters (one-shard, matrix, "
                        "multihost)")
    parser.add_argument("--reps", type=int, help="override the number of timed repetitions (one-shard, matrix, "
                        "sparse-rows)")
    parser.add_argument("--wire-dtype", choices=["float32", "bfloat16", "float16"],
                        help="wire dtype (one-shard, matrix; default: float32)")
    parser.add_argument("--chunk-bytes", type=int, help="stream chunk size (one-shard, matrix; default: 1 MiB)")
    parser.add_argument("--stream-window-bytes", type=window_bytes_arg, metavar="N",
                        help="start the psgrad servers with this stream window (0 = gRPC's automatic windows; "
                        "default: the server's own); one-shard only")
    # on the test bed
    parser.add_argument("--rate-mbit", type=float, help="every link's rate on the test bed, Mbit/s (multihost, "
                        "sparse-rows with --netbed; default: 1000)")
    # sparse-rows
    parser.add_argument("--netbed", action="store_true", default=None,
                        help="worker and servers on hosts of a shaped test bed (root); sparse-rows only")
    parser.add_argument("--rows", type=int, help="override the table's rows; sparse-rows only")
    parser.add_argument("--ids", type=int, help="override the unique ids a call; sparse-rows only")
    parser.add_argument("--dim", type=int, help="override the row width; sparse-rows only")
    parser.add_argument("--calls", type=int, help="override the calls timed together per repetition; sparse-rows only")
    parser.add_argument("--shards", type=_shard_counts, help="override the shard counts, e.g. 1,2; sparse-rows only")
    # internal: one rank of the peer part's RPC world (--params too)
    parser.add_argument("--role", choices=["ps", "worker"], help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--setup", default="default", choices=sorted(SETUPS), help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=16, help=argparse.SUPPRESS)
    # internal: an agent of --part multihost (with --params, --reps, --rank, --store) or sparse-rows
    parser.add_argument("--agent", choices=["multihost-transport", "multihost-sync", "sparse-rows"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--iters", type=int, default=2, help=argparse.SUPPRESS)
    for name in ("--psgrad", "--psgrad-bf16", "--raw", "--servers"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        if not args.store or not args.params:
            raise BenchError("--role needs --store and --params")
        role_main(args.role, args.rank, args.world, args.store, args.params, args.setup, args.threads)
        return
    if args.agent == "sparse-rows":
        sparse_agent_main()
        return
    if args.agent:
        if args.params is None:
            parser.error("--agent needs --params")
        torch.set_num_threads(1)
        if args.agent == "multihost-transport":
            out = multihost_agent_transport(argparse.Namespace(**{**vars(args), "reps": args.reps or 3}))
        else:
            out = multihost_agent_sync(args)
        print(json.dumps(out), flush=True)
        return
    part = "matrix" if args.matrix else args.part
    if args.matrix and args.part not in ("one-shard", "matrix"):
        parser.error(f"--matrix and --part {args.part} are two different parts")
    given = [f"--{k.replace('_', '-')}" for k in PUBLIC_FLAGS if getattr(args, k) is not None]
    refused = [flag for flag in given if flag[2:].replace("-", "_") not in PART_FLAGS[part]]
    if refused:
        takes = sorted(p for p, flags in PART_FLAGS.items() if refused[0][2:].replace("-", "_") in flags)
        parser.error(f"{', '.join(refused)}: not for --part {part} ({refused[0]} is for --part {', '.join(takes)})")
    if args.preset not in PRESETS[part]:
        parser.error(f"--part {part} has presets {', '.join(sorted(PRESETS[part]))}, not {args.preset}")
    if part == "latency":
        write_json({**run_latency(args.preset), "machine": machine_info()})
        return
    if part == "peer":
        write_json({**run_peer(args.preset), "machine": machine_info()})
        return
    if part == "multihost":
        write_json(run_multihost(args.preset, args.params, args.rate_mbit))
        return
    if part == "sparse-rows":
        p = overrides(args, PRESETS[part][args.preset])
        if min(p["shards"]) < 1 or min(p["ids"], p["dim"], p["reps"], p["calls"]) < 1:
            parser.error("shards, ids, dim, reps and calls must be >= 1")
        netbed, rate_mbit = bool(args.netbed), args.rate_mbit or 1000.0
        t0 = time.monotonic()
        raw = run_sparse_rows(p, netbed, rate_mbit)
        doc = {**sparse_report(p, raw, netbed, rate_mbit), "preset": args.preset, "elapsed_s": time.monotonic() - t0}
        print(sparse_table(doc), file=sys.stderr, flush=True)
        write_json(doc)
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
