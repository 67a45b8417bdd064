"""Does overlapping communication with computation hide the network? One worker, simulated compute.

    python benchmarks/overlap.py --preset full      # 4M float32 parameters (16 MB), 1 shard
    python benchmarks/overlap.py --preset tiny      # CI smoke run, a few seconds

The worker runs the user's loop through the Python API (psgrad.connect / optimizer / step). Compute
is simulated by sleeping T per step (as a GPU computing while the host is idle would), with T set
to the measured communication time C of a step (push + pull, overlap off, no compute) in this same
run. Then, in alternating rounds, it times steps with overlap off (expected about T + C), on
(expected about max(T, C)) and again without compute (C, whose median over all rounds is the
figure the ratios use); target: overlap on <= 1.3 x max(T, C).

With --device cuda the model lives on the GPU and the report adds the per-step split into compute,
device<->host copies and network, with the pinned-memory copy ceiling measured in the same run.
Prints one JSON document; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

import torch
from torch import nn

from lib import add_preset, log, machine_info, psgrad_server, write_json

import psgrad
from psgrad.config import ClientConfig

PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"params": 200_000, "steps": 12, "blocks": 2},
    "full": {"params": 4_000_000, "steps": 40, "blocks": 3},
}
TARGET = 1.3


class Flat(nn.Module):
    """A model that is one big parameter: the gradient is set by hand, compute is simulated."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(numel))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_block(
    addresses: list[str], numel: int, steps: int, compute_s: float, overlap: bool, device: torch.device
) -> dict[str, float]:
    """Join, run `steps` steps of (simulated compute, step()), leave; medians of the step split."""
    model = Flat(numel).to(device)
    cfg = ClientConfig(rpc_timeout_s=120)
    timer = threading.Event()
    times: dict[str, list[float]] = {k: [] for k in ("step_s", "d2h_s", "h2d_s", "exchange_s", "wait_s")}
    with psgrad.connect(addresses, optimizer=psgrad.SGD(lr=1e-9), client=cfg) as ps:
        opt = ps.optimizer(model, overlap=overlap)
        assert model.weight.grad is not None
        model.weight.grad.fill_(1e-3)  # the "gradient" every step pushes
        for k in range(steps + 2):  # the first two steps fill the pipeline and are not timed
            t0 = time.perf_counter()
            if compute_s > 0:
                timer.wait(compute_s)  # the simulated computation (an interruptible sleep)
            stats = opt.step()
            elapsed = time.perf_counter() - t0
            if k >= 2:
                times["step_s"].append(elapsed)
                for key in ("d2h_s", "h2d_s", "exchange_s", "wait_s"):
                    value = getattr(stats, key)
                    if value is not None:
                        times[key].append(value)
    return {k: statistics.median(v) for k, v in times.items() if v}


def pinned_copy_ceiling(numel: int, device: torch.device, reps: int = 10) -> dict[str, float]:
    """GB/s of device->pinned-host and pinned-host->device copies of numel float32 values."""
    src = torch.empty(numel, device=device)
    host = torch.empty(numel, pin_memory=True)
    d2h, h2d = [], []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        host.copy_(src, non_blocking=True)
        _sync(device)
        t1 = time.perf_counter()
        src.copy_(host, non_blocking=True)
        _sync(device)
        t2 = time.perf_counter()
        d2h.append(t1 - t0)
        h2d.append(t2 - t1)
    nbytes = numel * 4
    return {"d2h_gb_per_s": nbytes / statistics.median(d2h) / 1e9, "h2d_gb_per_s": nbytes / statistics.median(h2d) / 1e9}


def run(preset: str, params: int | None = None, device_name: str = "cpu") -> dict[str, Any]:
    cfg = dict(PRESETS[preset])
    numel = params or cfg["params"]
    device = torch.device(device_name)
    # One intra-op thread: the worker shares this machine with the server, and OpenMP threads
    # waiting for a busy core turn a 1 ms copy into a 10 ms one.
    torch.set_num_threads(1)
    proc, address = psgrad_server("overlap-server", "--port", "0")
    try:
        addresses = [address]
        log(f"overlap: {numel:,} parameters through 1 shard at {address}, device {device}")
        first = run_block(addresses, numel, cfg["steps"], 0.0, False, device)
        compute_s = first["step_s"]
        log(f"overlap: communication per step C = {compute_s * 1e3:.1f} ms: simulated compute T = C")
        blocks: dict[str, list[dict[str, float]]] = {"comm": [first], "off": [], "on": []}
        for b in range(cfg["blocks"]):  # alternate, so machine noise hits every configuration alike
            for name, overlap, t in (("off", False, compute_s), ("on", True, compute_s), ("comm", False, 0.0)):
                res = run_block(addresses, numel, cfg["steps"], t, overlap, device)
                blocks[name].append(res)
                log(f"overlap: round {b + 1}/{cfg['blocks']} {name}: step {res['step_s'] * 1e3:.1f} ms")
        comm = {"step_s": statistics.median(r["step_s"] for r in blocks["comm"])}
        step_off = statistics.median(r["step_s"] for r in blocks["off"])
        step_on = statistics.median(r["step_s"] for r in blocks["on"])
        bound = max(compute_s, comm["step_s"])
        out: dict[str, Any] = {
            "benchmark": "overlap",
            "preset": preset,
            "params": numel,
            "payload_bytes": numel * 4,
            "device": str(device),
            "machine": machine_info(),
            "communication_s": comm["step_s"],
            "compute_s": compute_s,
            "step_overlap_off_s": step_off,
            "step_overlap_on_s": step_on,
            "off_vs_sum": step_off / (compute_s + comm["step_s"]),
            "on_vs_max": step_on / bound,
            "split_overlap_off": blocks["off"][-1],
            "split_overlap_on": blocks["on"][-1],
            "targets": [{
                "name": "overlap: step time / max(compute, communication)",
                "value": step_on, "ceiling": bound, "ratio": step_on / bound,
                "target": TARGET, "better": "lower", "met": step_on / bound <= TARGET,
            }],
            "notes": "compute is simulated by sleeping (the host is idle, as while a GPU computes); "
                     "C is the median no-compute step (push + pull + copies) measured in this run",
        }
        if device.type == "cuda":  # psgrad's own staging copies beside the pinned-copy ceiling
            split = blocks["off"][-1]
            ceiling = pinned_copy_ceiling(numel, device)
            mine = {
                "d2h_gb_per_s": numel * 4 / split["d2h_s"] / 1e9 if split.get("d2h_s") else None,
                "h2d_gb_per_s": numel * 4 / split["h2d_s"] / 1e9 if split.get("h2d_s") else None,
            }
            out["copies"] = {"psgrad": mine, "pinned_ceiling": ceiling}
        return out
    finally:
        proc.stop(grace_s=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_preset(parser, PRESETS, "model size and repetitions")
    parser.add_argument("--params", type=int, help="override the number of float32 parameters")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    args = parser.parse_args()
    write_json(run(args.preset, args.params, args.device))


if __name__ == "__main__":
    main()
