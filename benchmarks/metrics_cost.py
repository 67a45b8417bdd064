"""What Prometheus metrics cost: the same traffic to a server with metrics on and one without, in one run.

    python benchmarks/metrics_cost.py --preset full   # 100 MB push/pull x 30, 300 small-model steps a round
    python benchmarks/metrics_cost.py --preset tiny   # CI-sized: 2 MB, 2 rounds of 10 steps
    python benchmarks/metrics_cost.py --preset full --reps 20    # a preset, with one size changed

For each model, `psgrad server` processes run side by side: "on" with `--metrics-port 0` (every
call timed by the interceptor, /metrics scraped every --scrape-s seconds by a thread here, harsher
than Prometheus' usual 15 s), "off" without, and (preset full) "off2", also without: the off2/off
ratios are what noise alone does to the same comparison. Each round sends the same calls to all three, taking
turns (each side in each place in rotation), so all see the same machine noise:
- a push and a pull of a --mb float32 model (one shard, gRPC frames: the path across hosts);
- --steps small-model iterations (push + pull of 100K parameters as one Step call), turn by turn
  step by step; on the metrics side each step's record also goes to a worker's Prometheus
  exporter (scraped too), as `psgrad worker --metrics-port` does, so the step latency carries both
  ends' metrics.
Reports medians and the ratios on/off (throughput: goal >= 0.98; latency: off/on, the same way up),
as the ratio of the medians and as the median of the ratios of back-to-back turns (paired_*),
beside the noise ratios off2/off, computed the same ways.
Prints one JSON document.
"""
from __future__ import annotations

import argparse
import threading
import time
import urllib.request
from typing import Any

import torch

from lib import PSGRAD_SERVER, Child, log, machine_info, start_server, stop_all, summarize, write_json

from psgrad.client.parameter_client import ParameterClient
from psgrad.config import ClientConfig, JobSpec
from psgrad.core.sharding import ParamSpec, plan_shards
from psgrad.metrics.exporters import PrometheusExporter

SMALL = 100_000
RATIOS = (("push", "push_throughput"), ("pull", "pull_throughput"), ("step", "step_rate"))
SIDES = ("on", "off", "off2")  # off2: a second server without metrics, the noise floor (off2 vs off)
PRESETS: dict[str, dict[str, float]] = {  # noise: also run the off2 servers
    "tiny": {"mb": 2.0, "reps": 2, "steps": 10, "scrape_s": 0.2, "noise": 0},  # no off2: 4 servers, not 6
    "full": {"mb": 100.0, "reps": 30, "steps": 300, "scrape_s": 1.0, "noise": 1},
}


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


def run(mb: float, reps: int, steps: int, scrape_s: float, noise: bool) -> dict[str, Any]:
    big = int(mb * 1e6 / 4)
    sides = SIDES if noise else SIDES[:2]
    children: list[Child] = []
    clients: list[ParameterClient] = []
    stop, scrapes = threading.Event(), [0]
    exporter = PrometheusExporter(rank=0, host="127.0.0.1", port=0)  # the metrics side's worker endpoint
    threading.Thread(target=_scrape, args=(exporter.url, stop, scrape_s, scrapes), daemon=True).start()
    try:
        for job in ("bulk", "small"):  # a server serves one model: one set of sides per model
            for side in sides:
                children.append(start_server(f"{job}-{side}", [*PSGRAD_SERVER, *(
                    ["--metrics-port", "0"] if side == "on" else [])]))
        for child in children[::len(sides)]:
            url = child.wait_line("metrics at ", timeout_s=180).rsplit(" ", 1)[1]  # logged before it listens
            threading.Thread(target=_scrape, args=(url, stop, scrape_s, scrapes), daemon=True).start()
        addrs = [c.address(timeout_s=180) for c in children]
        bulk = {side: _client(addrs[i], big) for i, side in enumerate(sides)}
        grad, flat = torch.full((big,), 1e-3), torch.empty(big)
        small = {side: _client(addrs[len(sides) + i], SMALL) for i, side in enumerate(sides)}
        clients += [c for c, _ in (*bulk.values(), *small.values())]
        clocks = {side: [bulk[side][1], small[side][1]] for side in sides}
        sgrad, sflat = torch.full((SMALL,), 1e-3), torch.empty(SMALL)
        push: dict[str, list[float]] = {s: [] for s in sides}
        pull: dict[str, list[float]] = {s: [] for s in sides}
        step: dict[str, list[float]] = {s: [] for s in sides}
        log(f"metrics_cost: {reps} rounds of a {mb:g} MB push + pull and {steps} small steps per side")
        turns = [sides[k:] + sides[:k] for k in range(len(sides))]  # each side in each place in turn
        for rep in range(reps + 1):  # round 0 warms up
            for side in turns[rep % len(turns)]:
                client, c = bulk[side][0], clocks[side]
                t0 = time.perf_counter()
                client.push(grad, c[0])
                t1 = time.perf_counter()
                client.pull(flat, c[0] + 1)
                t2 = time.perf_counter()
                c[0] += 1
                if rep:
                    push[side].append(t1 - t0)
                    pull[side].append(t2 - t1)
            for i in range(steps):  # step by step in turn: every side sees the same moment's load
                for side in turns[(rep * steps + i) % len(turns)]:
                    c = clocks[side]
                    s0 = time.perf_counter()
                    replies, _ = small[side][0].exchange(sgrad, c[1], sflat)
                    if side == "on":
                        took = time.perf_counter() - s0
                        exporter.record({"step": c[1] + 1, "clock": c[1], "loss": 1.0, "lr": 1e-9, "step_s": took,
                                         "staleness": max(r.staleness for r in replies), "exchange_s": took,
                                         "wait_s": took, "compute_s": 0.0})
                    if rep:
                        step[side].append(time.perf_counter() - s0)
                    c[1] += 1
    finally:
        stop.set()
        exporter.close()
        for client in clients:
            client.close()
        stop_all(children)
    series = {"push": push, "pull": pull, "step": step}
    med = {f"{name}_s": {side: summarize(values[side])["median"] for side in sides} for name, values in series.items()}

    def paired(name: str, base: str, other: str) -> float:
        """The median over turns of base's time / other's: each pair measured back to back, so a
        load that changes from second to second cancels out."""
        return summarize([b / o for b, o in zip(series[name][base], series[name][other], strict=True)])["median"]

    out: dict[str, Any] = {
        "payload_mb": big * 4 / 1e6,
        "reps": reps,
        "steps_per_round": steps,
        "scrapes": scrapes[0],
        "median": med,
        # throughput (or step rate) with metrics over without: ratios of the medians, and the median
        # of the ratios of back-to-back turns
        **{f"{name}_ratio_on_off": med[f"{key}_s"]["off"] / med[f"{key}_s"]["on"] for key, name in RATIOS},
        **{f"paired_{name}_ratio_on_off": paired(key, "off", "on") for key, name in RATIOS},
        "goal": 0.98,
    }
    if noise:  # the same between the two servers without metrics: how far apart noise alone puts them
        out.update({f"noise_{name}_ratio_off2_off": med[f"{key}_s"]["off"] / med[f"{key}_s"]["off2"] for key, name in RATIOS})
        out.update({f"noise_paired_{name}_ratio_off2_off": paired(key, "off", "off2") for key, name in RATIOS})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="sizes (default: tiny)")
    parser.add_argument("--mb", type=float, help="model size in MB for the push/pull (full: 100)")
    parser.add_argument("--reps", type=int, help="measured rounds (full: 30)")
    parser.add_argument("--steps", type=int, help="small-model steps per side and round (full: 300)")
    parser.add_argument("--scrape-s", type=float, help="seconds between scrapes of /metrics (full: 1)")
    args = parser.parse_args()
    p = {k: v if getattr(args, k, None) is None else getattr(args, k) for k, v in PRESETS[args.preset].items()}
    if p["mb"] <= 0 or p["reps"] < 1 or p["steps"] < 1 or p["scrape_s"] <= 0:
        parser.error("--mb and --scrape-s must be > 0, --reps and --steps >= 1")
    out = run(p["mb"], int(p["reps"]), int(p["steps"]), p["scrape_s"], bool(p["noise"]))
    write_json({"benchmark": "metrics_cost", "preset": args.preset, **out, "machine": machine_info()})


if __name__ == "__main__":
    main()
