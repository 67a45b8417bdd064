"""A measured window: W worker children start a command together, and the parent reads the CPU time
of the servers, of the workers and of the whole machine at both ends of a window inside their run;
and the skeleton of the benchmarks built on it (server_bench.py and scaling.py): a Fleet of server
and worker processes, rounds in rotating order, the operations completed inside a window."""
from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from lib.children import SETUP_TIMEOUT_S, Child, CommandChild, stop_all
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


# ---------------------------------------------------------------------------------------------
# The skeleton both scripts share: servers and worker processes of the script itself, set up
# together, rounds in rotating order, and the completions counted inside each window


T = TypeVar("T")


class Fleet:
    """The processes of a measured-window benchmark: named server processes and worker processes
    of the benchmark script itself (`SCRIPT --worker`, a CommandChild; see worker_main), set up
    together. On exit every process is asked to stop at once and reaped, so they exit in parallel."""

    def __init__(self, script: str) -> None:
        self.script = script
        self.servers: dict[str, Child] = {}
        self.workers: list[Child] = []

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        stop_all([*self.workers, *self.servers.values()])

    def start_workers(self, count: int) -> list[Child]:
        self.workers = [Child(f"worker{r}", [sys.executable, self.script, "--worker"]) for r in range(count)]
        return self.workers

    def addresses(self) -> dict[str, str]:
        return {n: s.address(timeout_s=SETUP_TIMEOUT_S) for n, s in self.servers.items()}

    def pids(self) -> dict[str, int]:
        return {n: s.popen.pid for n, s in self.servers.items()}

    def setup(self, command: Callable[[int], dict[str, Any]]) -> list[dict[str, Any]]:
        """Send every worker its setup command(rank) at once (a non-chief's join waits for the chief's
        init), then wait for all replies."""
        for rank, w in enumerate(self.workers):
            w.send(command(rank))
        return [w.recv(SETUP_TIMEOUT_S) for w in self.workers]


def rotated(items: Sequence[T], rep: int) -> list[T]:
    """The order of repetition `rep` (from 0): items rotated by rep, so none always runs first."""
    k = rep % len(items)
    return [*items[k:], *items[:k]]


def completed(m: dict[str, Any]) -> dict[str, Any]:
    """What measure_window's result `m` says of the operations the workers reported (their "start"
    and "done" times): how many completed inside the window (fractions at its ends), per second,
    every operation's duration, and the CPU the servers, the workers and the machine used."""
    t1, t2, replies = m["t1"], m["t2"], m["replies"]
    span = t2 - t1
    count = sum(in_window(r["start"], r["done"], t1, t2) for r in replies)
    return {
        "window_s": span,
        "count": count,
        "per_s": count / span,
        "op_s": [b - a for r in replies for a, b in zip(r["start"], r["done"])],
        "server_cores_busy": m["server_cpu_s"] / span,
        "workers_cores_busy": m["workers_cpu_s"] / span,
        "machine_busy_fraction": m["machine_busy_fraction"],
    }


def worker_main(child: Callable[[], CommandChild]) -> None:
    """A worker process (`SCRIPT --worker`): serve the parent's commands with child()."""
    import psgrad.client.shard_client  # noqa: F401  (import torch and grpc while the servers start)

    child().serve()
