"""Push/pull throughput of one psgrad shard beside raw gRPC streaming of the same bytes, in one run.

    python benchmarks/transport.py --preset full     # 25M float32 parameters (100 MB)
    python benchmarks/transport.py --preset tiny     # CI smoke run, a few seconds

Both servers run as separate processes on this machine; measurements of psgrad and of the raw
ceiling are interleaved, repetition by repetition, so machine noise hits both alike. Prints one
JSON document.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from raw_grpc import RawClient  # noqa: E402

from psgrad.client import ParameterClient  # noqa: E402
from psgrad.codec import byte_view  # noqa: E402
from psgrad.config import DEFAULT_CHUNK_BYTES, ClientConfig, JobSpec  # noqa: E402
from psgrad.sharding import ParamSpec, plan_shards  # noqa: E402

PRESETS = {"tiny": {"params": 1_000_000, "reps": 3}, "full": {"params": 25_000_000, "reps": 8}}


def _start(argv: list[str], marker: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.stdout is not None
    for line in proc.stdout:
        if marker in line:
            return proc, line.rsplit(" ", 1)[1].strip()
    raise RuntimeError(f"{argv} exited before printing {marker!r}")


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _summary(times: list[float], nbytes: int) -> dict[str, float]:
    med = statistics.median(times)
    return {"median_s": med, "gb_per_s": nbytes / med / 1e9, "best_gb_per_s": nbytes / min(times) / 1e9}


def run(num_params: int, reps: int, wire_dtype: str, chunk: int) -> dict[str, object]:
    procs = []
    try:
        ps_proc, ps_addr = _start([sys.executable, "-m", "psgrad", "server", "--port", "0"], "listening on")
        procs.append(ps_proc)
        raw_proc, raw_addr = _start([sys.executable, str(HERE / "raw_grpc.py"), "--serve"], "listening on")
        procs.append(raw_proc)

        params = [ParamSpec("weight", (num_params,), "float32")]
        spec = JobSpec(num_shards=1, wire_dtype=wire_dtype, lr=1e-9)
        cfg = ClientConfig(rpc_timeout_s=300, chunk_bytes=chunk)
        client = ParameterClient([ps_addr], spec, params, plan_shards(params, 1), 0, cfg)
        flat = torch.zeros(num_params)
        grad = torch.full((num_params,), 1e-3)
        client.join(initial_weights=lambda: flat)
        wire_bytes = num_params * torch.empty(0, dtype=getattr(torch, wire_dtype)).element_size()
        raw = RawClient(raw_addr)
        raw_src = torch.ones(wire_bytes // 4 + 1)
        raw_src_view = byte_view(raw_src)[:wire_bytes]
        raw_dst = torch.empty(wire_bytes // 4 + 1)
        raw_dst_view = byte_view(raw_dst)[:wire_bytes]

        # warm-up: first use allocates server and client buffers
        client.pull(flat, 0)
        client.push(grad, 0)
        raw.upload(raw_src_view, chunk)
        raw.download(raw_dst_view, chunk)

        t: dict[str, list[float]] = {"psgrad_push": [], "psgrad_pull": [], "raw_upload": [], "raw_download": []}
        for i in range(reps):
            t["psgrad_pull"].append(_timed(lambda: client.pull(flat, i + 1)))
            t["raw_download"].append(_timed(lambda: raw.download(raw_dst_view, chunk)))
            t["psgrad_push"].append(_timed(lambda: client.push(grad, i + 1)))
            t["raw_upload"].append(_timed(lambda: raw.upload(raw_src_view, chunk)))
        client.close()
        raw.close()
        res = {k: _summary(v, wire_bytes) for k, v in t.items()}
        return {
            "benchmark": "transport",
            "params": num_params,
            "wire_dtype": wire_dtype,
            "payload_bytes": wire_bytes,
            "chunk_bytes": chunk,
            "reps": reps,
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                        "torch": torch.__version__},
            "results": res,
            "ratios": {
                "push_vs_raw_upload": res["psgrad_push"]["gb_per_s"] / res["raw_upload"]["gb_per_s"],
                "pull_vs_raw_download": res["psgrad_pull"]["gb_per_s"] / res["raw_download"]["gb_per_s"],
            },
            "notes": "psgrad push includes the server's finiteness check and SGD apply; raw upload only copies.",
        }
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model size and repetitions (default: tiny)")
    parser.add_argument("--params", type=int, help="override the number of float32 parameters")
    parser.add_argument("--reps", type=int, help="override the number of timed repetitions")
    parser.add_argument("--wire-dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="wire dtype (default: float32)")
    parser.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES, help="stream chunk size (default: 1 MiB)")
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    out = run(args.params or preset["params"], args.reps or preset["reps"], args.wire_dtype, args.chunk_bytes)
    out["preset"] = args.preset
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
