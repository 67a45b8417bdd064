"""What security costs: the same traffic to plaintext servers and to secured ones, in one run, rounds alternating.

    python benchmarks/tls_cost.py --preset full    # 100 MB push + pull x 8 rounds, 300 small-model steps per round
    python benchmarks/tls_cost.py --preset tiny    # a quick check (the tests run it)

`psgrad server` processes on loopback, one per model and side:
- plain: no TLS, no credential (what a job without security runs);
- tls: mutual TLS and a token per call (what `psgrad launch --tls` runs: a certificate per worker,
  checked at the handshake, and the job secret's token checked on every call by the server's guard);
- tokens (small model only): the token without TLS, over gRPC's local credentials (`--tokens`).
Each round sends, per side in alternating order, a push and a pull of a --mb float32 model (one
shard, gRPC frames: the path across hosts; the same-host shared-memory path is off, since it would
bypass TLS) and --steps iterations of a 100K-parameter model (push + pull as one Step call).
Reports medians and ratios against plaintext: throughput secured/plain (1.0 = free) and step
latency secured/plain (1.0 = free). Prints one JSON document.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from lib import PSGRAD_SERVER, Child, log, machine_info, start_server, stop_all, summarize, write_json

from psgrad.client.parameter_client import ParameterClient
from psgrad.config import AuthConfig, ClientConfig, JobSpec, TlsConfig
from psgrad.core.credentials import derive_token
from psgrad.core.sharding import ParamSpec, plan_shards
from psgrad.launch.certs import CertFiles, write_job_certs

SMALL = 100_000
PRESETS = {"tiny": {"mb": 4.0, "reps": 2, "steps": 20}, "full": {"mb": 100.0, "reps": 8, "steps": 300}}


class Sides:
    """Each side's server flags and the worker-0 client config that reaches it."""

    def __init__(self, root: Path) -> None:
        self.files: CertFiles = write_job_certs(root / "tls", 1)
        self.secret = os.urandom(32).hex().encode()
        self.secret_file = root / "job.secret"
        self.secret_file.write_bytes(self.secret)
        os.chmod(self.secret_file, 0o600)

    def server_argv(self, side: str) -> list[str]:
        f = self.files
        if side == "plain":
            return []
        argv = ["--job-secret-file", str(self.secret_file)]
        if side == "tls":
            argv += ["--tls-cert", str(f.pair("server")[0]), "--tls-key", str(f.pair("server")[1]), "--tls-ca", str(f.ca)]
        return argv

    def client(self, side: str) -> ClientConfig:
        base = ClientConfig(rpc_timeout_s=300, shared_memory=False)
        if side == "plain":
            return base
        cert, key = self.files.pair("worker-0")
        tls = TlsConfig(ca=str(self.files.ca), cert=str(cert), key=str(key)) if side == "tls" else None
        return ClientConfig(rpc_timeout_s=300, shared_memory=False, tls=tls,
                            auth=AuthConfig(token=derive_token(self.secret, "worker-0")))


def _client(address: str, params: int, config: ClientConfig) -> tuple[ParameterClient, list[int]]:
    specs = [ParamSpec("weight", (params,), "float32")]
    spec = JobSpec(mode="async", num_workers=1, num_shards=1, lr=1e-9)
    client = ParameterClient([address], spec, specs, plan_shards(specs, 1), 0, config)
    clock = client.join(initial_weights=lambda: torch.zeros(params))
    return client, [clock]


def run(mb: float, reps: int, steps: int) -> dict[str, Any]:
    big = int(mb * 1e6 / 4)
    bulk_sides, small_sides = ("plain", "tls"), ("plain", "tokens", "tls")
    children: list[Child] = []
    clients: list[ParameterClient] = []
    push: dict[str, list[float]] = {s: [] for s in bulk_sides}
    pull: dict[str, list[float]] = {s: [] for s in bulk_sides}
    step: dict[str, list[float]] = {s: [] for s in small_sides}
    round_ratios: dict[str, list[float]] = {"push_tls": [], "pull_tls": [], "step_tls": [], "step_tokens": []}
    with tempfile.TemporaryDirectory(prefix="psgrad-tls-cost-") as tmp:
        sides = Sides(Path(tmp))
        try:
            jobs = [("bulk", s) for s in bulk_sides] + [("small", s) for s in small_sides]
            for job, side in jobs:  # a server serves one model: one per model and side
                children.append(start_server(f"{job}-{side}", [*PSGRAD_SERVER, *sides.server_argv(side)]))
            addrs = {key: c.address(timeout_s=180) for key, c in zip(jobs, children)}
            bulk = {s: _client(addrs[("bulk", s)], big, sides.client(s)) for s in bulk_sides}
            small = {s: _client(addrs[("small", s)], SMALL, sides.client(s)) for s in small_sides}
            clients += [c for c, _ in (*bulk.values(), *small.values())]
            grad, flat = torch.full((big,), 1e-3), torch.empty(big)
            sgrad, sflat = torch.full((SMALL,), 1e-3), torch.empty(SMALL)
            log(f"tls_cost: {reps} rounds of a {mb:g} MB push + pull per side and {steps} small steps per side")
            for rep in range(reps + 1):  # round 0 warms up (connections, handshakes, allocator)
                times: dict[str, float] = {}
                for side in (bulk_sides if rep % 2 else bulk_sides[::-1]):
                    client, clock = bulk[side]
                    t0 = time.perf_counter()
                    client.push(grad, clock[0])
                    t1 = time.perf_counter()
                    client.pull(flat, clock[0] + 1)
                    times[f"push_{side}"], times[f"pull_{side}"] = t1 - t0, time.perf_counter() - t1
                    clock[0] += 1
                for side in (small_sides if rep % 2 else small_sides[::-1]):
                    client, clock = small[side]
                    lat = []
                    for _ in range(steps):
                        s0 = time.perf_counter()
                        client.exchange(sgrad, clock[0], sflat)
                        lat.append(time.perf_counter() - s0)
                        clock[0] += 1
                    times[f"step_{side}"] = summarize(lat)["median"]
                    if rep:
                        step[side].extend(lat)
                if rep:
                    for side in bulk_sides:
                        push[side].append(times[f"push_{side}"])
                        pull[side].append(times[f"pull_{side}"])
                    round_ratios["push_tls"].append(times["push_plain"] / times["push_tls"])
                    round_ratios["pull_tls"].append(times["pull_plain"] / times["pull_tls"])
                    round_ratios["step_tls"].append(times["step_tls"] / times["step_plain"])
                    round_ratios["step_tokens"].append(times["step_tokens"] / times["step_plain"])
        finally:
            for client in clients:
                client.close()
            stop_all(children)
    med = {"push_s": {s: summarize(push[s])["median"] for s in bulk_sides},
           "pull_s": {s: summarize(pull[s])["median"] for s in bulk_sides},
           "step_s": {s: summarize(step[s])["median"] for s in small_sides}}
    nbytes = big * 4
    return {
        "payload_mb": nbytes / 1e6,
        "reps": reps,
        "steps_per_round": steps,
        "median": med,
        "gbps": {f"{what}_{s}": nbytes / med[f"{what}_s"][s] / 1e9 for what in ("push", "pull") for s in bulk_sides},
        "push_throughput_ratio_tls_plain": med["push_s"]["plain"] / med["push_s"]["tls"],
        "pull_throughput_ratio_tls_plain": med["pull_s"]["plain"] / med["pull_s"]["tls"],
        "step_latency_ratio_tls_plain": med["step_s"]["tls"] / med["step_s"]["plain"],
        "step_latency_ratio_tokens_plain": med["step_s"]["tokens"] / med["step_s"]["plain"],
        "per_round": round_ratios,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="sizes (default: tiny)")
    parser.add_argument("--mb", type=float, help="model size in MB for the push/pull (default: the preset's)")
    parser.add_argument("--reps", type=int, help="measured rounds (default: the preset's)")
    parser.add_argument("--steps", type=int, help="small-model steps per side and round (default: the preset's)")
    args = parser.parse_args()
    chosen = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in PRESETS[args.preset].items()}
    if chosen["mb"] <= 0 or chosen["reps"] < 1 or chosen["steps"] < 1:
        parser.error("--mb must be > 0, --reps and --steps >= 1")
    write_json({"preset": args.preset, **run(**chosen), "machine": machine_info()})


if __name__ == "__main__":
    main()
