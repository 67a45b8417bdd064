"""A measured window: W worker children start a command together, and the parent reads the CPU time
of the servers, of the workers and of the whole machine at both ends of a window inside their run
(server_bench.py and scaling.py)."""
from __future__ import annotations

import time
from typing import Any

from lib.children import Child
from lib.procfs import busy_fraction, cpu_seconds, machine_busy
from lib.report import log

TAIL_S = 0.2  # workers run this much past the window, so it ends before any of them stops


def in_window(starts: list[float], ends: list[float], t1: float, t2: float) -> float:
    """How many of the operations [starts[i], ends[i]] fell inside [t1, t2], counting an operation
    that straddles an end by the fraction of its duration inside (no +-1 quantization when a
    window holds only a few long operations)."""
    total = 0.0
    for a, b in zip(starts, ends, strict=True):
        overlap = min(b, t2) - max(a, t1)
        if overlap > 0:
            total += overlap / (b - a) if b > a else 1.0
    return total


def measure_window(
    workers: list[Child], command: dict[str, Any], pids: list[int], warmup_s: float, window_s: float
) -> dict[str, Any]:
    """Start `command` on the workers together (barrier, then go) and have them run for the warm-up,
    the window and a tail; read the CPU time of the server processes `pids`, of the workers and of
    the whole machine at both ends of the window [t1, t2]. Workers report times on the shared
    monotonic clock."""
    run_s = warmup_s + window_s + TAIL_S
    timeout = run_s + 120.0
    for w in workers:
        w.send({**command, "run_s": run_s, "barrier": True})
    for w in workers:
        w.recv(timeout)
    t0 = time.monotonic()
    for w in workers:
        w.send({"op": "go"})
    time.sleep(max(0.0, t0 + warmup_s - time.monotonic()))
    worker_pids = [w.popen.pid for w in workers]
    t1, mach1 = time.monotonic(), machine_busy()
    cpu1, wcpu1 = sum(cpu_seconds(p) for p in pids), sum(cpu_seconds(p) for p in worker_pids)
    time.sleep(max(0.0, t1 + window_s - time.monotonic()))
    t2, mach2 = time.monotonic(), machine_busy()
    cpu2, wcpu2 = sum(cpu_seconds(p) for p in pids), sum(cpu_seconds(p) for p in worker_pids)
    replies = [w.recv(timeout) for w in workers]
    late = max(r["go"] - t0 for r in replies)
    if late > warmup_s / 2:
        log(f"{command}: a worker started {late:.2f} s after the go (warm-up {warmup_s} s)")
    return {"t1": t1, "t2": t2, "replies": replies, "server_cpu_s": cpu2 - cpu1, "workers_cpu_s": wcpu2 - wcpu1,
            "machine_busy_fraction": busy_fraction(mach1, mach2)}
