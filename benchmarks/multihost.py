"""psgrad across hosts on shaped links: push/pull beside raw gRPC, bfloat16 beside float32 on the
wire, and a sync iteration beside gloo all-reduce — all on one test bed, in one run.

    python benchmarks/multihost.py --preset full    # 10M float32 parameters, every link 1 Gbit/s
    python benchmarks/multihost.py --preset tiny    # 1M parameters, CI-sized

The hosts are network namespaces (lib/netbed.py), each with its own address and /dev/shm, every
host's link shaped with `tc ... tbf` to `--rate-mbit` in both directions. Needs root, iproute2
and tc. Prints one JSON document.

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
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from lib import RAW_SERVER, add_preset, log, machine_info, rep_order, write_json
from lib.netbed import NetBed

from psgrad.launch.supervisor import SupervisedProcess

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"params": 1_000_000, "reps": 3, "rounds": 2, "iters": 2, "rate_mbit": 1000},
    "full": {"params": 10_000_000, "reps": 10, "rounds": 4, "iters": 5, "rate_mbit": 1000},
}


# --------------------------------------------------------------------------------------------
# Agents: run on a host of the bed as `python benchmarks/multihost.py --agent KIND ...`


def agent_transport(args: argparse.Namespace) -> dict[str, Any]:
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


def agent_sync(args: argparse.Namespace) -> dict[str, Any]:
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


# --------------------------------------------------------------------------------------------
# The driver: builds the bed, starts the servers, runs the agents, computes the figures


def _summary(times: list[float], nbytes: int) -> dict[str, float]:
    med = statistics.median(times)
    return {"median_s": med, "min_s": min(times), "max_s": max(times), "mb_per_s": nbytes / med / 1e6}


def run(preset: str, params: int | None = None, rate_mbit: float | None = None) -> dict[str, Any]:
    cfg = dict(PRESETS[preset])
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
        proc = SupervisedProcess(bed.command(host, argv), name=name, new_session=False)
        procs.append(proc)
        return proc.wait_for_line(marker, timeout_s=120).rsplit(" ", 1)[1]

    def agent(bed: NetBed, host: int, argv: list[str]) -> Any:
        proc = SupervisedProcess(bed.command(host, [py, me, *argv]), name=f"agent@{host}", new_session=False,
                                 stderr_file=True)
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
            ps = start(bed, 0, [py, *server, "--host", a[0]], "listening on", "psgrad-fp32")
            ps16 = start(bed, 0, [py, *server, "--host", a[0]], "listening on", "psgrad-bf16")
            raw = start(bed, 0, [py, *RAW_SERVER, "--host", a[0]], "listening on", "raw")
            t = result(agent(bed, 2, ["--agent", "transport", "--params", str(n), "--reps", str(cfg["reps"]),
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
            common = ["--agent", "sync", "--params", str(n), "--servers", f"{s0},{s1}", "--store", store,
                      "--rounds", str(cfg["rounds"]), "--iters", str(cfg["iters"])]
            agents = [agent(bed, 2 + r, [*common, "--rank", str(r)]) for r in range(2)]
            s = [result(x) for x in agents]
            if os.path.exists(store):
                os.remove(store)
        finally:
            for p in procs:
                p.stop(10)
    fp32_bytes, bf16_bytes = 4 * n, 2 * n
    tr = {k: _summary(v, bf16_bytes if k.startswith("bf16") else fp32_bytes) for k, v in t["times_s"].items()}
    # A sync iteration ends for both workers together; take the slower worker's time per iteration.
    sync_times = {k: [max(x) for x in zip(*(r["times_s"][k] for r in s))] for k in ("sync_iteration", "allreduce")}
    sy = {k: _summary(v, 2 * fp32_bytes) for k, v in sync_times.items()}
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_preset(parser, PRESETS, "model size and repetitions")
    parser.add_argument("--params", type=int, help="override the number of float32 parameters")
    parser.add_argument("--rate-mbit", type=float, help="override every link's rate in Mbit/s (default: 1000)")
    parser.add_argument("--agent", choices=["transport", "sync"], help=argparse.SUPPRESS)
    parser.add_argument("--reps", type=int, default=3, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--iters", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    for name in ("--psgrad", "--psgrad-bf16", "--raw", "--servers", "--store"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.agent:
        if args.params is None:
            parser.error("--agent needs --params")
        import torch

        torch.set_num_threads(1)
        out = agent_transport(args) if args.agent == "transport" else agent_sync(args)
        print(json.dumps(out), flush=True)
        return
    write_json(run(args.preset, args.params, args.rate_mbit))


if __name__ == "__main__":
    main()
