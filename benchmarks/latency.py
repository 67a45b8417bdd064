"""One small-model iteration (pull + push) through psgrad beside a raw gRPC unary round trip, in one run.

    python benchmarks/latency.py --preset full    # 100K float32 parameters over 2 shards, 200 iterations
    python benchmarks/latency.py --preset tiny    # 30 iterations

A client in this process pulls and pushes a 100K-parameter model (400 KB, async mode, lr 1e-9)
through two psgrad shards, each its own process; after every iteration it makes one unary
round trip (tiny request, tiny reply) to a raw gRPC server process, so both series see the same
machine noise. Reports median and p99 of each and their ratio. Prints one JSON document.
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

from psgrad.client import ParameterClient  # noqa: E402
from psgrad.config import ClientConfig, JobSpec  # noqa: E402
from psgrad.sharding import ParamSpec, plan_shards  # noqa: E402

PRESETS = {"tiny": {"params": 100_000, "iters": 30, "warmup": 5},
           "full": {"params": 100_000, "iters": 200, "warmup": 20}}
SHARDS = 2


def _ms(values: list[float]) -> dict[str, float]:
    return {k: (v * 1e3 if k != "n" else v) for k, v in summarize(values).items()}


def run_latency(params: int, iters: int, warmup: int, shards: int = SHARDS) -> dict[str, Any]:
    t_start = time.monotonic()
    children: list[Child] = []
    client: ParameterClient | None = None
    raw: RawClient | None = None
    try:
        children += [start_server(f"psgrad{i}", PSGRAD_SERVER) for i in range(shards)]
        raw_server = start_server("raw", [str(HERE / "raw_grpc.py"), "--serve"])
        children.append(raw_server)
        addrs = [c.address(timeout_s=180) for c in children[:shards]]
        specs = [ParamSpec("weight", (params,), "float32")]
        spec = JobSpec(mode="async", num_shards=shards, lr=1e-9)
        client = ParameterClient(addrs, spec, specs, plan_shards(specs, shards), 0, ClientConfig())
        flat = torch.zeros(params)
        grad = torch.full((params,), 1e-3)
        clock = client.join(initial_weights=lambda: flat)
        raw = RawClient(raw_server.address(timeout_s=180))
        log(f"latency: {len(children)} servers up after {time.monotonic() - t_start:.1f} s")

        iteration_s, pull_s, push_s, ping_s = [], [], [], []
        for i in range(warmup + iters):
            t0 = time.perf_counter()
            client.pull(flat, clock)
            t1 = time.perf_counter()
            client.push(grad, clock)
            t2 = time.perf_counter()
            raw.ping()
            t3 = time.perf_counter()
            clock += 1
            if i >= warmup:
                iteration_s.append(t2 - t0)
                pull_s.append(t1 - t0)
                push_s.append(t2 - t1)
                ping_s.append(t3 - t2)
    finally:
        if client is not None:
            client.close()
        if raw is not None:
            raw.close()
        stop_all(children)
    it, unary = _ms(iteration_s), _ms(ping_s)
    return {
        "params": params,
        "shards": shards,
        "payload_bytes": params * 4,
        "iters": iters,
        "warmup": warmup,
        "iteration_ms": it,
        "pull_ms": _ms(pull_s),
        "push_ms": _ms(push_s),
        "raw_unary_ms": unary,
        "ratio_median": it["median"] / unary["median"],
        "ratio_p99": it["p99"] / unary["p99"],
        "elapsed_s": time.monotonic() - t_start,
    }


def run(preset: str) -> dict[str, Any]:
    """The suite's latency part."""
    p = PRESETS[preset]
    out = run_latency(p["params"], p["iters"], p["warmup"])
    k = out["params"] / 1e3
    it, unary = out["iteration_ms"], out["raw_unary_ms"]
    targets = [target(f"latency: pull+push of a {k:.0f}K-parameter model over {out['shards']} shards, median, "
                      "vs raw gRPC unary round trip", it["median"], unary["median"], 3.0, "lower", "ms",
                      "raw gRPC unary round trip")]
    figures = [
        figure("latency: iteration (pull+push) median", it["median"], "ms", unary["median"], "raw gRPC unary, median"),
        figure("latency: iteration (pull+push) p99", it["p99"], "ms", unary["p99"], "raw gRPC unary, p99"),
        figure("latency: pull median", out["pull_ms"]["median"], "ms", unary["median"], "raw gRPC unary, median"),
        figure("latency: push median", out["push_ms"]["median"], "ms", unary["median"], "raw gRPC unary, median"),
    ]
    return {**out, "preset": preset, "targets": targets, "figures": figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="iterations (default: tiny)")
    args = parser.parse_args()
    write_json({**run(args.preset), "machine": machine_info()})


if __name__ == "__main__":
    main()
