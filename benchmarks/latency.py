"""One small-model iteration (push + pull) through psgrad beside a raw gRPC unary round trip, in one run.

    python benchmarks/latency.py --preset full    # 100K float32 parameters over 2 shards, 200 iterations
    python benchmarks/latency.py --preset tiny    # 30 iterations

Two psgrad shards (each its own process) hold a 100K-parameter model (400 KB, async mode, lr 1e-9);
a raw gRPC server process answers unary pings. Every round of the loop, in this order:
- the iteration as PSOptimizer.step() runs it: `ParameterClient.exchange` (push clock c, pull
  c + 1; one unary Step call per shard) through the same-host path (shared-memory payloads);
- the same through gRPC only (payloads inside the messages, as for a server on another host);
- the same traffic as two separate calls, push then pull (each a call per shard);
- one unary round trip (tiny request, tiny reply) to the raw server.
So all series see the same machine noise. Reports median and p99 of each and the ratios to the
unary round trip. Prints one JSON document.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from ceilings import Child, figure, log, machine_info, start_server, stop_all, summarize, target, write_json  # noqa: E402
from raw_grpc import RawClient  # noqa: E402
from transport import PSGRAD_SERVER  # noqa: E402

from psgrad.client.parameter_client import ParameterClient  # noqa: E402
from psgrad.config import ClientConfig, JobSpec  # noqa: E402
from psgrad.core.sharding import ParamSpec, plan_shards  # noqa: E402

PRESETS = {"tiny": {"params": 100_000, "iters": 30, "warmup": 5},
           "full": {"params": 100_000, "iters": 200, "warmup": 20}}
SHARDS = 2
SERIES = ("iteration", "iteration_grpc", "separate", "raw_unary")


def _ms(values: list[float]) -> dict[str, float]:
    return {k: (v * 1e3 if k != "n" else v) for k, v in summarize(values).items()}


def run_latency(params: int, iters: int, warmup: int, shards: int = SHARDS) -> dict[str, Any]:
    t_start = time.monotonic()
    children: list[Child] = []
    clients: list[ParameterClient] = []
    raw: RawClient | None = None
    try:
        children += [start_server(f"psgrad{i}", PSGRAD_SERVER) for i in range(shards)]
        raw_server = start_server("raw", [str(HERE / "raw_grpc.py"), "--serve"])
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


def run(preset: str) -> dict[str, Any]:
    """The suite's latency part."""
    p = PRESETS[preset]
    out = run_latency(p["params"], p["iters"], p["warmup"])
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="iterations (default: tiny)")
    args = parser.parse_args()
    write_json({**run(args.preset), "machine": machine_info()})


if __name__ == "__main__":
    main()
