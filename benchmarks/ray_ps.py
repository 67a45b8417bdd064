"""psgrad's same-host path beside Ray's actor parameter server: same model, same workers, same run.

    python benchmarks/ray_ps.py --preset full   # 25M float32 (100 MB), 1 shard, async; 1, 2, 4 workers
    python benchmarks/ray_ps.py --preset tiny   # CI-sized
    python benchmarks/ray_ps.py --preset full --shards 2   # psgrad on 2 shards, + pushes copied (A/B)

The peer is the usual Ray pattern: a `ParameterServer` actor holds the model as one float32 array;
each worker (an actor) pulls with `ray.get(ps.get_weights.remote())` (the weights go through Ray's
shared-memory object store and the worker reads them zero-copy, as a read-only numpy view) and
pushes with `ray.get(ps.push.remote(grad))` (the gradient goes into the object store, the actor
reads it zero-copy and applies `w.add_(g, alpha=-lr)`, one call at a time). A copy-in variant copies
each pulled version into the worker's own buffer, as a worker whose model must own its weights does.
psgrad runs the same iteration (pull, push; async, lr 1e-9, one shard, no compute) with as many
worker processes on the same host. Rounds alternate between the three, in rotating order.

Beside them, in the same run: the physical limits (one 100 MB memory copy with torch `copy_`, and the
SGD apply alone, `w.add_(g, alpha=-lr)`, on one thread and on every core: the targets take every
core, since a pull's copy and a push's update run on two threads; and the shard's fused update +
NaN check alone, the push's own arithmetic), psgrad's pull and push times
over them, and the gRPC path's restated target (transport.py's one-shard comparison: a push
against a raw gRPC upload doing the same copy + SGD arithmetic in the same server process, and the
raw-copy ratio beside it). Ray runs with a bounded object store and is started and stopped here;
while Ray's workers are measured psgrad's processes are paused (SIGSTOP). Ray's own idle daemons
are not paused while psgrad is measured (they cost psgrad, not Ray). Prints one JSON document.
"""
from __future__ import annotations

import argparse
import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from lib import PSGRAD_SERVER, add_preset, aggregate, figure, log, machine_info, paused, summarize, target, write_json
from lib.ceilings import MemcpyProbe
from lib.procfs import memory_bytes
from lib.swarm import open_swarm, psgrad_key, release_swarm
from transport import compare_one_shard

from psgrad.config import DEFAULT_CHUNK_BYTES

LR = 1e-9
SYSTEMS = ("psgrad", "ray", "ray_copy_in")
COPIED = "psgrad_copied_push"  # --shards > 1: the gradient in private memory, copied into each shard's segment
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"params": 1_000_000, "reps": 2, "iters": 2, "workers": (1, 2), "probe_reps": 5, "grpc_reps": 2},
    "full": {"params": 25_000_000, "reps": 5, "iters": 8, "workers": (1, 2, 4), "probe_reps": 15, "grpc_reps": 12},
}


# ---------------------------------------------------------------------------------------------
# The Ray parameter server (actors are defined when Ray is imported, in run_ray_world)


def _make_actors(ray: Any) -> tuple[Any, Any]:
    import numpy as np

    @ray.remote(num_cpus=0)
    class ParameterServer:
        def __init__(self, params: int) -> None:
            torch.set_num_threads(1)  # as a psgrad shard (its --torch-threads default)
            self.weights = np.zeros(params, dtype=np.float32)
            self._w = torch.from_numpy(self.weights)

        def get_weights(self) -> Any:
            return self.weights  # Ray copies it into the object store once per call

        def push(self, grad: Any) -> bool:
            with warnings.catch_warnings():  # the object store's view is read-only; it is only read
                warnings.simplefilter("ignore", UserWarning)
                g = torch.from_numpy(grad)
            self._w.add_(g, alpha=-LR)
            return True

        def pid(self) -> int:
            return os.getpid()

    @ray.remote(num_cpus=0)
    class Worker:
        def __init__(self, ps: Any, params: int) -> None:
            self.ps = ps
            self.grad = np.full(params, 1e-3, dtype=np.float32)
            self.own = np.zeros(params, dtype=np.float32)

        def run(self, iters: int, copy_in: bool) -> dict[str, Any]:
            pull_s, push_s = [], []
            start = time.monotonic()
            for _ in range(iters):
                t0 = time.monotonic()
                weights = ray.get(self.ps.get_weights.remote())
                if copy_in:
                    np.copyto(self.own, weights)
                t1 = time.monotonic()
                ray.get(self.ps.push.remote(self.grad))
                t2 = time.monotonic()
                if weights.size != self.grad.size:
                    raise ValueError(f"got {weights.size} weights, expected {self.grad.size}")
                del weights
                pull_s.append(t1 - t0)
                push_s.append(t2 - t1)
            return {"start": start, "end": time.monotonic(), "pull_s": pull_s, "push_s": push_s}

    return ParameterServer, Worker


class RayWorld:
    """A local Ray instance (bounded object store) with a ParameterServer actor and worker actors."""

    def __init__(self, params: int, workers: int) -> None:
        import ray

        self._ray = ray
        # Room for every worker's pulled version and pushed gradient at once, plus slack.
        self.object_store_bytes = max(80 << 20, (2 * workers + 2) * params * 4)
        # address "local": an instance of its own, even where another Ray instance runs on this machine
        ray.init(address="local", num_cpus=os.cpu_count() or 1, object_store_memory=self.object_store_bytes,
                 include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
        ps_cls, worker_cls = _make_actors(ray)
        self.ps = ps_cls.remote(params)
        self.workers = [worker_cls.remote(self.ps, params) for _ in range(workers)]
        ray.get([self.ps.pid.remote(), *[w.run.remote(0, False) for w in self.workers]])  # all up

    def round(self, workers: int, iters: int, copy_in: bool, payload: int) -> dict[str, Any]:
        replies = self._ray.get([w.run.remote(iters, copy_in) for w in self.workers[:workers]])
        return aggregate(replies, payload)

    def close(self) -> None:
        self._ray.shutdown()


# ---------------------------------------------------------------------------------------------
# The physical limits, measured in this process on one torch thread


def probe_limits(params: int, reps: int) -> dict[str, Any]:
    """One memory copy and the SGD apply alone, on one torch thread (as the shard's torch ops run)
    and on every core (the push's checked apply and the pull's copy use two threads), and the
    shard's fused kernel alone (update + NaN check, two threads; absent where numba is)."""
    from psgrad.server import kernels

    threads = torch.get_num_threads()
    cores = os.cpu_count() or 1
    try:
        copy = MemcpyProbe(params * 4)
        w = torch.zeros(params)
        g = torch.full((params,), 1e-3)
        w.add_(g, alpha=-LR)
        fused = kernels.kernel(wait=True) is not None
        out: dict[str, list[float]] = {k: [] for k in ("copy", "apply", "copy_all", "apply_all", "fused")}
        # One thread first: after a multi-threaded op, torch's OpenMP threads spin for a while and
        # would take the core the fused kernel's helper thread needs (measured: 13 ms against 9).
        for n, suffix in ((1, ""), (cores, "_all")):
            torch.set_num_threads(n)
            for _ in range(reps):
                out["copy" + suffix].append(copy.reused_s())
                t0 = time.perf_counter()
                w.add_(g, alpha=-LR)
                out["apply" + suffix].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                if n == 1 and fused and kernels.sgd_checked(w, g, -LR):
                    out["fused"].append(time.perf_counter() - t0)
        ms = {k: summarize(v)["median"] * 1e3 if v else None for k, v in out.items()}
        return {"copy_ms": ms["copy"], "sgd_apply_ms": ms["apply"],
                "copy_all_cores_ms": ms["copy_all"], "sgd_apply_all_cores_ms": ms["apply_all"],
                "fused_sgd_checked_ms": ms["fused"]}
    finally:
        torch.set_num_threads(threads)


def _rss_mb(pid: int) -> dict[str, float]:
    """A process's resident memory (MB): in all, its own pages (RssAnon + RssFile), and the shared
    memory it maps (RssShmem: the published ring and the workers' segments it has open)."""
    return {k: v / (1 << 20) for k, v in memory_bytes(pid).items() if k != "own"}


def _ring_mb(pid: int) -> float:
    """The pages a server's published-versions ring holds in /dev/shm (MB)."""
    shm = Path("/dev/shm")
    return sum(p.stat().st_blocks * 512 for p in shm.glob(f"psgrad-pub-{pid}-*")) / 1e6


def _cell(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "ops_per_s": summarize([r["ops_per_s"] for r in rounds])["median"],
        "reps_ops_per_s": [r["ops_per_s"] for r in rounds],
        "pull_ms_median": summarize([t for r in rounds for t in r["pull_s"]])["median"] * 1e3,
        "push_ms_median": summarize([t for r in rounds for t in r["push_s"]])["median"] * 1e3,
    }


def run_compare(
    params: int, reps: int, iters: int, workers: tuple[int, ...], probe_reps: int, shards: int = 1
) -> dict[str, Any]:
    t_start = time.monotonic()
    payload = params * 4
    max_w = max(workers)
    swarm = open_swarm(max_w)
    world: RayWorld | None = None
    failed = True
    rounds: dict[tuple[str, int], list[dict[str, Any]]] = {}
    limits: list[dict[str, Any]] = []
    try:
        server = swarm.servers(psgrad_key(shards, params), shards, PSGRAD_SERVER)[0]
        keys = {"psgrad": swarm.psgrad_job(shards, params)}
        if shards > 1:  # the same job with each push copied into the shards' segments (no shared gradient)
            keys[COPIED] = swarm.psgrad_job(shards, params, copy_push=True)
        systems = tuple(keys) + SYSTEMS[1:]
        psgrad_children = list(swarm.children)
        for key in keys.values():
            swarm.round(key, max_w, 1)  # warm-up: connections, segments, first allocations
        with paused(psgrad_children):
            world = RayWorld(params, max_w)
            log(f"ray_ps: ray up after {time.monotonic() - t_start:.1f} s")
            for copy_in in (False, True):
                world.round(max_w, 1, copy_in, payload)  # warm-up
        for rep in range(reps):
            order = systems[rep % len(systems):] + systems[: rep % len(systems)]  # nobody always first
            for w in workers:
                for system in order:
                    if system in keys:
                        with paused(swarm.agents[w:]):
                            r = swarm.round(keys[system], w, iters)
                    else:
                        with paused(psgrad_children):
                            r = world.round(w, iters, system == "ray_copy_in", payload)
                    rounds.setdefault((system, w), []).append(r)
            with paused(psgrad_children):
                limits.append(probe_limits(params, probe_reps))
            log(f"ray_ps: repetition {rep + 1}/{reps} done ({time.monotonic() - t_start:.0f} s)")
        memory = {"psgrad_server": _rss_mb(server.popen.pid), "psgrad_ring_mb": _ring_mb(server.popen.pid),
                  "psgrad_worker_segments_mb": max_w * payload / 1e6,
                  "ray_object_store_limit_mb": world.object_store_bytes / 1e6}
        failed = False
    finally:
        if world is not None:
            world.close()
        release_swarm(swarm, failed)
    results = []
    for w in workers:
        cells = {s: _cell(rounds[(s, w)]) for s in systems}
        results.append({"workers": w, **cells,
                        "ratio_vs_ray": cells["psgrad"]["ops_per_s"] / cells["ray"]["ops_per_s"],
                        "ratio_vs_ray_copy_in": cells["psgrad"]["ops_per_s"] / cells["ray_copy_in"]["ops_per_s"]})
        if COPIED in cells:
            results[-1]["ratio_vs_copied_push"] = cells["psgrad"]["ops_per_s"] / cells[COPIED]["ops_per_s"]
    lim = {k: summarize([x[k] for x in limits])["median"] if limits[0][k] is not None else None for k in limits[0]}
    one = next(r for r in results if r["workers"] == 1)["psgrad"]
    physical = {**lim, "psgrad_pull_ms": one["pull_ms_median"], "psgrad_push_ms": one["push_ms_median"],
                "pull_vs_copy": one["pull_ms_median"] / lim["copy_ms"],
                "push_vs_sgd_apply": one["push_ms_median"] / lim["sgd_apply_ms"],
                "pull_vs_copy_all_cores": one["pull_ms_median"] / lim["copy_all_cores_ms"],
                "push_vs_sgd_apply_all_cores": one["push_ms_median"] / lim["sgd_apply_all_cores_ms"],
                "push_vs_fused_sgd_checked": (one["push_ms_median"] / lim["fused_sgd_checked_ms"]
                                              if lim["fused_sgd_checked_ms"] else None)}
    return {"params": params, "shards": shards, "payload_bytes": payload, "reps": reps, "iters_per_round": iters,
            "results": results, "physical": physical, "memory_mb": memory, "elapsed_s": time.monotonic() - t_start}


def grpc_target(params: int, reps: int) -> dict[str, Any]:
    """The gRPC path (no shared memory): transport.py's one-shard comparison, its ratios only."""
    out = compare_one_shard(params, reps, "float32", DEFAULT_CHUNK_BYTES)
    d = out["diagnostics"]
    return {"push_vs_raw_sgd_upload_same_process": d["same_process_push_vs_raw_sgd_upload"],
            "push_vs_raw_copy_upload_same_process": d["same_process_push_vs_raw_upload"],
            "raw_sgd_upload_vs_raw_copy_upload": d["same_process_raw_sgd_upload_vs_raw_upload"],
            "push_gb_per_s": out["results"]["same_process_push"]["gb_per_s"], "reps": reps}


def run(preset: str, shards: int = 1) -> dict[str, Any]:
    p = PRESETS[preset]
    load_before = os.getloadavg()
    out = run_compare(p["params"], p["reps"], p["iters"], p["workers"], p["probe_reps"], shards)
    mb = out["payload_bytes"] / 1e6
    on = f"{shards} shards, " if shards > 1 else ""
    targets, figures = [], []
    for r in out["results"]:
        w = r["workers"]
        targets.append(target(f"ray_ps: (pulls+pushes)/s, {mb:.0f} MB, {on}{w} worker(s), psgrad same-host vs Ray actor PS",
                              r["psgrad"]["ops_per_s"], r["ray"]["ops_per_s"], 1.0, "higher", "1/s", "Ray actor PS"))
        figures.append(figure(f"ray_ps: (pulls+pushes)/s, {on}{w} worker(s), vs Ray copy-in", r["psgrad"]["ops_per_s"],
                              "1/s", r["ray_copy_in"]["ops_per_s"], "Ray actor PS, copy-in"))
        if COPIED in r:
            figures.append(figure(f"ray_ps: (pulls+pushes)/s, {on}{w} worker(s), vs pushes copied into each shard's segment",
                                  r["psgrad"]["ops_per_s"], "1/s", r[COPIED]["ops_per_s"], "psgrad, gradient copied"))
    if shards > 1:  # the limits and the gRPC comparison are the one-shard job's
        return {**out, "preset": preset, "targets": targets, "figures": figures,
                "loadavg_before": load_before, "loadavg_after": os.getloadavg()}
    out["grpc"] = grpc_target(p["params"], p["grpc_reps"])
    ph = out["physical"]
    # Against the copy and the apply on every core: the pull's copy and the push's apply use two threads.
    targets.append(target(f"ray_ps: {mb:.0f} MB pull vs one memory copy on every core", ph["psgrad_pull_ms"],
                          ph["copy_all_cores_ms"], 1.5, "lower", "ms", "torch copy_, all cores"))
    targets.append(target(f"ray_ps: {mb:.0f} MB push vs the SGD apply alone on every core", ph["psgrad_push_ms"],
                          ph["sgd_apply_all_cores_ms"], 1.5, "lower", "ms", "w.add_(g), all cores"))
    figures.append(figure(f"ray_ps: {mb:.0f} MB pull vs one memory copy on one thread", ph["psgrad_pull_ms"], "ms",
                          ph["copy_ms"], "torch copy_"))
    figures.append(figure(f"ray_ps: {mb:.0f} MB push vs the SGD apply on one thread", ph["psgrad_push_ms"], "ms",
                          ph["sgd_apply_ms"], "w.add_(g)"))
    if ph["fused_sgd_checked_ms"] is not None:
        figures.append(figure(f"ray_ps: {mb:.0f} MB push vs the shard's fused update + check alone", ph["psgrad_push_ms"],
                              "ms", ph["fused_sgd_checked_ms"], "kernels.sgd_checked, two threads"))
    return {**out, "preset": preset, "targets": targets, "figures": figures,
            "loadavg_before": load_before, "loadavg_after": os.getloadavg()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_preset(parser, PRESETS, "model size and repetitions")
    parser.add_argument("--shards", type=int, default=1, help="psgrad's shards (server processes), Ray's actor stays one; "
                        "above 1 the same job with each push copied into the shards' segments runs beside it, and "
                        "the one-shard limits and gRPC comparison are left out (default: 1)")
    args = parser.parse_args()
    if args.shards < 1:
        parser.error(f"--shards must be >= 1, got {args.shards}")
    try:
        import ray  # noqa: F401
    except ImportError:
        parser.exit(2, "ray_ps.py needs Ray: pip install 'psgrad[ray]'\n")
    write_json({**run(args.preset, args.shards), "machine": machine_info()})


if __name__ == "__main__":
    main()
