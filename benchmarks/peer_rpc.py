"""psgrad beside the classic torch.distributed.rpc parameter server: same model, same workers, same run.

    python benchmarks/peer_rpc.py --preset full   # 25M float32 (100 MB); 1, 2, 4 workers; 3 TensorPipe setups
    python benchmarks/peer_rpc.py --preset tiny   # CI-sized

The peer is the textbook RPC parameter server: one PS process holds the model as one float32
tensor; each worker iteration is `rpc_sync(ps, get_weights)` then `rpc_sync(ps, push_grad, (g,))`,
and the PS applies `w.add_(g, alpha=-lr)` under a lock. Every rank is its own process (TensorPipe
backend on the loopback interface, rendezvous through a FileStore in a temporary directory, so no
fixed port). psgrad runs the same iteration (pull, push; async mode, lr 1e-9, one shard) with the
same number of worker processes, and the two are interleaved round by round.

TensorPipe picks the fastest transport and channel both ends support: on one host that can be
shared memory and cross-memory attach (CMA: the receiver reads the sender's memory directly, one
copy, no socket). Each setup measured reports what it actually used, read from TensorPipe's own
log of one worker (TP_VERBOSE_LOGGING=7 on that process only: about 80 short lines per message,
well under 1 ms, against a few hundred ms for a 100 MB message).

While one system is measured, the other system's processes, and its own idle workers, are
stopped (SIGSTOP): TensorPipe's shared-memory transport busy-polls while idle, and that CPU would
otherwise be charged to whichever system is running. The idle CPU of each setup is reported.
Prints one JSON document.
"""
from __future__ import annotations

import argparse
import re
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from ceilings import (  # noqa: E402
    BenchError,
    Child,
    aggregate,
    command_loop,
    exit_now,
    figure,
    log,
    machine_info,
    paused,
    run_together,
    stop_all,
    summarize,
    target,
    write_json,
)
from transport import PSGRAD_SERVER, ROUND_TIMEOUT_S, SETUP_TIMEOUT_S, open_swarm, psgrad_key, release_swarm  # noqa: E402

LR = 1e-9
# name -> TensorPipeRpcBackendOptions private transport/channel lists (None: TensorPipe's defaults)
SETUPS: dict[str, dict[str, list[str]]] = {
    "default": {},
    "uv": {"_transports": ["uv"]},
    "uv+basic": {"_transports": ["uv"], "_channels": ["basic"]},
}
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"params": 1_000_000, "reps": 3, "iters": 2, "setups": {"default": (1, 2)}},
    "full": {"params": 25_000_000, "reps": 4, "iters": 3,
             "setups": {"default": (1, 2, 4), "uv": (1, 2), "uv+basic": (1, 2)}},
}
TARGET_WORKERS = (1, 2)

# ---------------------------------------------------------------------------------------------
# The RPC processes (`--role ps|worker`). Functions called over RPC are pickled by name; every
# rank runs this file as __main__, so they resolve to the same functions everywhere.

_weights: torch.Tensor | None = None
_lock = threading.Lock()


def get_weights() -> torch.Tensor:
    """PS side: the current weights (serialized by TensorPipe after return, as a classic PS does)."""
    assert _weights is not None
    return _weights


def push_grad(grad: torch.Tensor) -> bool:
    """PS side: one SGD step under the lock."""
    assert _weights is not None
    with _lock:
        _weights.add_(grad, alpha=-LR)
    return True


def _rpc_worker_handle(params: int) -> Any:
    from torch.distributed import rpc

    grad = torch.full((params,), 1e-3)

    def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd["op"] != "run":
            raise ValueError(f"unknown op {cmd['op']!r}")
        pull_s, push_s = [], []
        start = time.monotonic()
        for _ in range(int(cmd["iters"])):
            t0 = time.monotonic()
            weights = rpc.rpc_sync("ps", get_weights)
            t1 = time.monotonic()
            rpc.rpc_sync("ps", push_grad, args=(grad,))
            t2 = time.monotonic()
            if weights.numel() != params:
                raise ValueError(f"got {weights.numel()} weights, expected {params}")
            pull_s.append(t1 - t0)
            push_s.append(t2 - t1)
        return {"start": start, "end": time.monotonic(), "pull_s": pull_s, "push_s": push_s}

    return handle


def role_main(role: str, rank: int, world: int, store: str, params: int, setup: str, threads: int) -> None:
    from torch.distributed import rpc

    global _weights
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{store}", num_worker_threads=threads,
                                              rpc_timeout=ROUND_TIMEOUT_S, **SETUPS[setup])  # type: ignore[arg-type]
    if role == "ps":
        _weights = torch.zeros(params)
    name = "ps" if role == "ps" else f"worker{rank}"
    rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=options)
    print("rpc ready", flush=True)
    try:
        command_loop(_rpc_worker_handle(params) if role == "worker" else (lambda cmd: {"ok": True}))
    finally:
        # The parent sends quit only when no call is in flight, so nothing is lost by not waiting for
        # the other ranks (a graceful shutdown takes seconds here).
        rpc.shutdown(graceful=False)
    exit_now()


# ---------------------------------------------------------------------------------------------
# The parent side


class RpcWorld:
    """A PS process and `workers` worker processes in one torch.distributed.rpc world."""

    def __init__(self, setup: str, workers: int, params: int, threads: int = 16) -> None:
        self.setup = setup
        self.params = params
        self._dir = tempfile.TemporaryDirectory(prefix="psgrad-peer-")
        store = str(Path(self._dir.name) / "store")
        world = workers + 1

        def start(role: str, rank: int, env: dict[str, str]) -> Child:
            argv = [sys.executable, str(HERE / "peer_rpc.py"), "--role", role, "--rank", str(rank), "--world", str(world),
                    "--store", store, "--params", str(params), "--setup", setup, "--threads", str(threads)]
            return Child(f"rpc-{role}{rank}-{setup}", argv, env={"TP_SOCKET_IFNAME": "lo", **env})

        self.ps = start("ps", 0, {})
        # Only worker 1 logs TensorPipe's choices, to report what was used.
        self.workers = [start("worker", r, {"TP_VERBOSE_LOGGING": "7"} if r == 1 else {}) for r in range(1, world)]
        self.children = [self.ps, *self.workers]

    def wait_ready(self) -> None:
        for c in self.children:
            c.wait_line("rpc ready", SETUP_TIMEOUT_S)

    def round(self, workers: int, iters: int) -> dict[str, Any]:
        """`workers` workers run `iters` iterations together; the idle workers are paused meanwhile."""
        with paused(self.workers[workers:]):
            replies = run_together(self.workers[:workers], [{"op": "run", "iters": iters}] * workers, ROUND_TIMEOUT_S)
        return aggregate(replies, self.params * 4)

    def idle_cpu(self, seconds: float) -> float:
        """CPU (in cores) each process of this world uses on average while nobody calls anything."""
        before = [c.cpu_s() for c in self.children]
        time.sleep(seconds)
        after = [c.cpu_s() for c in self.children]
        return sum(b - a for a, b in zip(before, after)) / seconds / len(self.children)

    def used(self) -> dict[str, Any]:
        """Transports and channels TensorPipe opened, counted from worker 1's log.

        Every pipe first connects over uv (TCP) to exchange what both ends support, then opens
        its connections on the best common transport and its channel connections."""
        text = self.workers[0].stderr_text()
        transports: dict[str, int] = {}
        for name in re.findall(r"\.tr_(\w+) is opening connection", text):
            transports[name] = transports.get(name, 0) + 1
        channels = sorted(set(re.findall(r"\(for channel (\w+)\)", text)))
        main = max(transports, key=lambda k: transports[k]) if transports else None
        return {"transport": main, "transport_connections": transports, "channels": channels}

    def close(self) -> None:
        try:
            stop_all(self.children, timeout_s=30)
        finally:
            self._dir.cleanup()


def _summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "ops_per_s": summarize([r["ops_per_s"] for r in rounds])["median"],
        "gb_per_s": summarize([r["gb_per_s"] for r in rounds])["median"],
        "reps_ops_per_s": [r["ops_per_s"] for r in rounds],
        "pull_ms_median": summarize([t for r in rounds for t in r["pull_s"]])["median"] * 1e3,
        "push_ms_median": summarize([t for r in rounds for t in r["push_s"]])["median"] * 1e3,
    }


def run_peer(params: int, reps: int, iters: int, setups: dict[str, Sequence[int]]) -> dict[str, Any]:
    """For each TensorPipe setup: an RPC world, rounds interleaved with psgrad (1 shard) per worker count."""
    t_start = time.monotonic()
    max_workers = max(max(w) for w in setups.values())
    swarm = open_swarm(max_workers)
    worlds: list[RpcWorld] = []
    results: list[dict[str, Any]] = []
    failed = True
    try:
        swarm.servers(psgrad_key(1, params), 1, PSGRAD_SERVER)
        names = list(setups)
        worlds.append(RpcWorld(names[0], max(setups[names[0]]), params))  # starts beside the swarm
        key = swarm.psgrad_job(1, params)
        psgrad_children = list(swarm.children)
        swarm.round(key, max_workers, 1)  # warm-up
        for i, name in enumerate(names):
            world = worlds[-1]
            world.wait_ready()
            log(f"peer: setup {name!r} up after {time.monotonic() - t_start:.1f} s")
            with paused(psgrad_children):
                world.round(max(setups[name]), 1)  # warm-up: connections, first allocations
                idle_cpu = world.idle_cpu(1.0)
            rounds: dict[tuple[str, int], list[dict[str, Any]]] = {}
            for rep in range(reps):
                for w in setups[name]:
                    for system in ("psgrad", "rpc") if rep % 2 == 0 else ("rpc", "psgrad"):  # neither always first
                        if system == "psgrad":
                            others = world.children + swarm.agents[w:]
                        else:
                            others = psgrad_children
                        with paused(others):
                            r = swarm.round(key, w, iters) if system == "psgrad" else world.round(w, iters)
                        rounds.setdefault((system, w), []).append(r)
                log(f"peer: setup {name!r} repetition {rep + 1}/{reps} done ({time.monotonic() - t_start:.0f} s)")
            used = world.used()
            world.close()
            worlds.pop()
            if i + 1 < len(names):
                worlds.append(RpcWorld(names[i + 1], max(setups[names[i + 1]]), params))
            for w in setups[name]:
                ps, peer = _summary(rounds[("psgrad", w)]), _summary(rounds[("rpc", w)])
                results.append({"setup": name, "options": SETUPS[name], "used": used, "workers": w,
                                "rpc_idle_cpu_cores_per_process": idle_cpu,
                                "psgrad": ps, "rpc": peer, "ratio_ops_per_s": ps["ops_per_s"] / peer["ops_per_s"]})
        failed = False
    finally:
        for world in worlds:
            world.close()
        release_swarm(swarm, failed)
    return {"params": params, "payload_bytes": params * 4, "reps": reps, "iters_per_round": iters,
            "results": results, "elapsed_s": time.monotonic() - t_start}


def _targets_and_figures(out: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    mb = out["payload_bytes"] / 1e6
    targets, figures = [], []
    for r in out["results"]:
        via = "/".join([r["used"]["transport"] or "?", *r["used"]["channels"]])
        label = f"{r['workers']} worker(s), rpc setup {r['setup']} ({via})"
        if r["setup"] == "default" and r["workers"] in TARGET_WORKERS:
            targets.append(target(f"peer: (pulls+pushes)/s, {mb:.0f} MB model, {r['workers']} worker(s), psgrad 1 shard "
                                  f"vs torch.distributed.rpc PS ({via})", r["psgrad"]["ops_per_s"],
                                  r["rpc"]["ops_per_s"], 1.5, "higher", "1/s", "torch.distributed.rpc PS"))
        figures.append(figure(f"peer: (pulls+pushes)/s, {label}", r["psgrad"]["ops_per_s"], "1/s",
                              r["rpc"]["ops_per_s"], "torch.distributed.rpc PS"))
        figures.append(figure(f"peer: pull+push GB/s, {label}", r["psgrad"]["gb_per_s"], "GB/s",
                              r["rpc"]["gb_per_s"], "torch.distributed.rpc PS"))
    return targets, figures


def run(preset: str) -> dict[str, Any]:
    """The suite's peer part."""
    p = PRESETS[preset]
    out = run_peer(p["params"], p["reps"], p["iters"], p["setups"])
    targets, figures = _targets_and_figures(out)
    return {**out, "preset": preset, "targets": targets, "figures": figures,
            "notes": "get_weights returns the PS tensor itself (no copy under the lock, so a pull may see a "
                     "half-applied update; psgrad copies under its lock); the worker receives a freshly "
                     "allocated tensor per pull, psgrad pulls into the worker's reused buffer."}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model size and repetitions (default: tiny)")
    # internal: one rank of an RPC world
    parser.add_argument("--role", choices=["ps", "worker"], help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--params", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--setup", default="default", choices=sorted(SETUPS), help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=16, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role:
        if not args.store or not args.params:
            raise BenchError("--role needs --store and --params")
        role_main(args.role, args.rank, args.world, args.store, args.params, args.setup, args.threads)
        return
    out = run(args.preset)
    write_json({**out, "machine": machine_info()})


if __name__ == "__main__":
    main()
