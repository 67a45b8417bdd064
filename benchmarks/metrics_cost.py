"""What Prometheus metrics cost a server: the same traffic to a server with metrics on and one without, in one run.

    python benchmarks/metrics_cost.py                 # 100 MB push/pull x 8, 300 small-model steps
    python benchmarks/metrics_cost.py --mb 4 --reps 3 --steps 40    # a quick check

Pairs of `psgrad server` processes run side by side: one with `--metrics-port 0` (every call timed
by the interceptor, the gate hook on, /metrics scraped every --scrape-s seconds by a thread here,
harsher than Prometheus' usual 15 s) and one without (a pair for each model). Each round sends the same calls to both, in
alternating order, so both see the same machine noise:
- a push and a pull of a --mb float32 model (one shard, gRPC frames: the path across hosts);
- --steps small-model iterations (push + pull of 100K parameters as one Step call).
Reports medians and the ratios on/off (throughput: goal >= 0.98; latency: off/on, the same way up).
Prints one JSON document.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from ceilings import Child, log, machine_info, start_server, stop_all, summarize, write_json  # noqa: E402
from transport import PSGRAD_SERVER  # noqa: E402

from psgrad.client.parameter_client import ParameterClient  # noqa: E402
from psgrad.config import ClientConfig, JobSpec  # noqa: E402
from psgrad.core.sharding import ParamSpec, plan_shards  # noqa: E402

SMALL = 100_000
SIDES = ("on", "off")


def _client(address: str, params: int) -> tuple[ParameterClient, int]:
    specs = [ParamSpec("weight", (params,), "float32")]
    spec = JobSpec(mode="async", num_workers=2, num_shards=1, lr=1e-9)
    client = ParameterClient([address], spec, specs, plan_shards(specs, 1), 0, ClientConfig(shared_memory=False))
    clock = client.join(initial_weights=lambda: torch.zeros(params))
    return client, clock


def _scrape(url: str, stop: threading.Event, every_s: float, count: list[int]) -> None:
    while not stop.wait(every_s):
        urllib.request.urlopen(url, timeout=10).read()
        count[0] += 1


def run(mb: float, reps: int, steps: int, scrape_s: float) -> dict[str, Any]:
    big = int(mb * 1e6 / 4)
    children: list[Child] = []
    clients: list[ParameterClient] = []
    stop, scrapes = threading.Event(), [0]
    try:
        for job in ("bulk", "small"):  # a server serves one model: one pair per model
            children.append(start_server(f"{job}-on", [*PSGRAD_SERVER, "--metrics-port", "0"]))
            children.append(start_server(f"{job}-off", PSGRAD_SERVER))
        for child in children[::2]:
            url = child.wait_line("metrics at ", timeout_s=180).rsplit(" ", 1)[1]  # logged before it listens
            threading.Thread(target=_scrape, args=(url, stop, scrape_s, scrapes), daemon=True).start()
        addrs = [c.address(timeout_s=180) for c in children]
        bulk = {side: _client(addrs[i], big) for i, side in enumerate(SIDES)}
        grad, flat = torch.full((big,), 1e-3), torch.empty(big)
        small = {side: _client(addrs[2 + i], SMALL) for i, side in enumerate(SIDES)}
        clients += [c for c, _ in (*bulk.values(), *small.values())]
        clocks = {side: [bulk[side][1], small[side][1]] for side in SIDES}
        sgrad, sflat = torch.full((SMALL,), 1e-3), torch.empty(SMALL)
        push: dict[str, list[float]] = {s: [] for s in SIDES}
        pull: dict[str, list[float]] = {s: [] for s in SIDES}
        step: dict[str, list[float]] = {s: [] for s in SIDES}
        log(f"metrics_cost: {reps} rounds of a {mb:g} MB push + pull and {steps} small steps per side")
        for rep in range(reps + 1):  # round 0 warms up
            for side in (SIDES if rep % 2 else SIDES[::-1]):
                client, c = bulk[side][0], clocks[side]
                t0 = time.perf_counter()
                client.push(grad, c[0])
                t1 = time.perf_counter()
                client.pull(flat, c[0] + 1)
                t2 = time.perf_counter()
                c[0] += 1
                lat = []
                for _ in range(steps):
                    s0 = time.perf_counter()
                    small[side][0].exchange(sgrad, c[1], sflat)
                    lat.append(time.perf_counter() - s0)
                    c[1] += 1
                if rep:
                    push[side].append(t1 - t0)
                    pull[side].append(t2 - t1)
                    step[side].extend(lat)
    finally:
        stop.set()
        for client in clients:
            client.close()
        stop_all(children)
    med = {name: {side: summarize(series[side])["median"] for side in SIDES}
           for name, series in (("push_s", push), ("pull_s", pull), ("step_s", step))}
    return {
        "payload_mb": big * 4 / 1e6,
        "reps": reps,
        "steps_per_round": steps,
        "scrapes": scrapes[0],
        "median": med,
        "push_throughput_ratio_on_off": med["push_s"]["off"] / med["push_s"]["on"],
        "pull_throughput_ratio_on_off": med["pull_s"]["off"] / med["pull_s"]["on"],
        "step_rate_ratio_on_off": med["step_s"]["off"] / med["step_s"]["on"],
        "goal": 0.98,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=float, default=100.0, help="model size in MB for the push/pull (default: 100)")
    parser.add_argument("--reps", type=int, default=8, help="measured rounds (default: 8)")
    parser.add_argument("--steps", type=int, default=300, help="small-model steps per side and round (default: 300)")
    parser.add_argument("--scrape-s", type=float, default=1.0, help="seconds between scrapes of /metrics (default: 1)")
    args = parser.parse_args()
    if args.mb <= 0 or args.reps < 1 or args.steps < 1 or args.scrape_s <= 0:
        parser.error("--mb and --scrape-s must be > 0, --reps and --steps >= 1")
    write_json({**run(args.mb, args.reps, args.steps, args.scrape_s), "machine": machine_info()})


if __name__ == "__main__":
    main()
