"""Push/pull throughput of psgrad shards beside raw gRPC streaming of the same bytes, in one run.

    python benchmarks/transport.py --preset full            # one shard, one client, 25M float32 (100 MB)
    python benchmarks/transport.py --preset tiny            # the same, CI-sized
    python benchmarks/transport.py --preset full --matrix   # 1 and 2 shards x 1, 2, 4 worker processes

Servers run as separate processes on this machine; measurements of psgrad and of its ceilings are
interleaved, repetition by repetition (in alternating order), so machine noise hits both alike.
Prints one JSON document.

Without --matrix, one client in this process pulls and pushes through one shard beside raw gRPC
(`ratios.push_vs_raw_upload`, `ratios.pull_vs_raw_download`), with the CPU each side spent per
operation and, as a diagnostic, a push beside raw uploads served by one server process
(psgrad_with_raw.py), whose Upload copies, does a shard's per-chunk sum and SGD update into the
next weights, or does that update in place (`diagnostics`). With --matrix (and `run(preset)`,
which the suite calls), W worker processes pull and push at once (async mode, lr 1e-9, no
compute) through S shards; the same W processes then stream the same bytes through S raw gRPC
servers; loopback TCP and memory-copy bandwidth are measured in the same repetitions.

`--stream-window-bytes N` starts both psgrad servers of the one-shard comparison with that
window (`psgrad server --stream-window-bytes`; 0 = gRPC's automatic windows), to weigh the
window's cost in push speed on your machine (server_bench.py takes the same flag for memory).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from ceilings import (  # noqa: E402
    Child,
    MemcpyProbe,
    TcpClient,
    aggregate,
    command_loop,
    exit_now,
    figure,
    log,
    machine_info,
    median_gbps,
    run_together,
    start_server,
    stop_all,
    summarize,
    target,
    window_argv,
    window_bytes_arg,
    write_json,
)
from psgrad_with_raw import SGD_IN_PLACE_SERVICE, SGD_SERVICE  # noqa: E402
from raw_grpc import SERVICE as RAW_SERVICE  # noqa: E402
from raw_grpc import RawClient  # noqa: E402

from psgrad.client.parameter_client import ParameterClient  # noqa: E402
from psgrad.core.codecs import byte_view  # noqa: E402
from psgrad.config import DEFAULT_CHUNK_BYTES, ClientConfig, JobSpec  # noqa: E402
from psgrad.core.sharding import ParamSpec, plan_shards  # noqa: E402

PRESETS = {"tiny": {"params": 1_000_000, "reps": 3}, "full": {"params": 25_000_000, "reps": 24}}
MATRIX_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"params": 1_000_000, "reps": 3, "iters": 2, "shards": (1, 2), "workers": (1, 2)},
    "full": {"params": 25_000_000, "reps": 5, "iters": 3, "shards": (1, 2), "workers": (1, 2, 4)},
}
PSGRAD_SERVER = ["-m", "psgrad", "server", "--host", "127.0.0.1", "--port", "0", "--lease-s", "600"]
RAW_SERVER = [str(HERE / "raw_grpc.py"), "--serve"]
ROUND_TIMEOUT_S = 600.0
SETUP_TIMEOUT_S = 180.0


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _summary(times: list[float], nbytes: int) -> dict[str, float]:
    med = summarize(times)["median"]
    return {"median_s": med, "gb_per_s": nbytes / med / 1e9, "best_gb_per_s": nbytes / min(times) / 1e9}


def wire_bytes(num_params: int, wire_dtype: str) -> int:
    return num_params * torch.empty(0, dtype=getattr(torch, wire_dtype)).element_size()


def rep_order(keys: list[str], rep: int) -> list[str]:
    """The order of the operations in repetition `rep` (from 1): as listed, then reversed, in turn.
    In a fixed order each operation always follows the same one, so whatever that one leaves
    behind (another server process to switch away from, its buffers in the caches) weighs on it in
    every repetition; in a fixed order psgrad's push always ran just after an upload to another
    server process, and the bare uploads it is compared with never did."""
    return keys if rep % 2 else keys[::-1]


def compare_one_shard(num_params: int, reps: int, wire_dtype: str, chunk: int,
                      stream_window_bytes: int | None = None) -> dict[str, Any]:
    """One client in this process, one shard, beside raw gRPC upload/download of the same bytes;
    then, as a diagnostic, a push beside raw uploads served by the same server process.
    stream_window_bytes: given, both psgrad servers run with that stream window (else their default)."""
    children: list[Child] = []
    clients: list[ParameterClient | RawClient] = []
    window_args = window_argv(stream_window_bytes)
    try:
        # The servers keep torch's default thread count here, as this comparison always has.
        ps = start_server("psgrad-server", [*PSGRAD_SERVER, *window_args], one_thread=False)
        raw_server = start_server("raw-grpc", RAW_SERVER, one_thread=False)
        # A second shard server that also serves raw uploads (copy, and a shard's sum + SGD update
        # into the next weights or in place).
        diag = start_server("psgrad-with-raw", [str(HERE / "psgrad_with_raw.py"), *window_args], one_thread=False)
        children += [ps, raw_server, diag]

        params = [ParamSpec("weight", (num_params,), "float32")]
        spec = JobSpec(num_shards=1, wire_dtype=wire_dtype, lr=1e-9)
        # The ratios compare gRPC with gRPC: no same-host shared memory (peer_rpc.py measures that).
        cfg = ClientConfig(rpc_timeout_s=300, chunk_bytes=chunk, shared_memory=False)
        flat = torch.zeros(num_params)
        grad = torch.full((num_params,), 1e-3)
        client = ParameterClient([ps.address()], spec, params, plan_shards(params, 1), 0, cfg)
        diag_client = ParameterClient([diag.address()], spec, params, plan_shards(params, 1), 0, cfg)
        raw = RawClient(raw_server.address())
        diag_raw = RawClient(diag.address(), RAW_SERVICE)
        diag_raw_sgd = RawClient(diag.address(), SGD_SERVICE)
        diag_raw_sgd_in_place = RawClient(diag.address(), SGD_IN_PLACE_SERVICE)
        clients += [client, diag_client, raw, diag_raw, diag_raw_sgd, diag_raw_sgd_in_place]
        client.join(initial_weights=lambda: flat)
        diag_client.join(initial_weights=lambda: flat)
        nbytes = wire_bytes(num_params, wire_dtype)
        raw_src = torch.ones(nbytes // 4 + 1)
        raw_src_view = byte_view(raw_src)[:nbytes]
        raw_dst = torch.empty(nbytes // 4 + 1)
        raw_dst_view = byte_view(raw_dst)[:nbytes]

        # warm-up: first use allocates server and client buffers
        client.pull(flat, 0)
        client.push(grad, 0)
        diag_client.push(grad, 0)
        raw.upload(raw_src_view, chunk)
        raw.download(raw_dst_view, chunk)
        diag_raw.upload(raw_src_view, chunk)
        diag_raw_sgd.upload(raw_src_view, chunk)
        diag_raw_sgd_in_place.upload(raw_src_view, chunk)

        ops: dict[str, tuple[Child, Callable[[int], object]]] = {
            "psgrad_pull": (ps, lambda i: client.pull(flat, i)),
            "raw_download": (raw_server, lambda i: raw.download(raw_dst_view, chunk)),
            "psgrad_push": (ps, lambda i: client.push(grad, i)),
            "raw_upload": (raw_server, lambda i: raw.upload(raw_src_view, chunk)),
            "same_process_push": (diag, lambda i: diag_client.push(grad, i)),
            "same_process_raw_upload": (diag, lambda i: diag_raw.upload(raw_src_view, chunk)),
            "same_process_raw_upload_sgd": (diag, lambda i: diag_raw_sgd.upload(raw_src_view, chunk)),
            "same_process_raw_upload_sgd_in_place": (diag, lambda i: diag_raw_sgd_in_place.upload(raw_src_view, chunk)),
        }
        t: dict[str, list[float]] = {k: [] for k in ops}
        cpu = {k: {"server": 0.0, "client": 0.0} for k in ops}
        for i in range(1, reps + 1):
            for key in rep_order(list(ops), i):
                server, fn = ops[key]
                # Time the operation, and add the CPU it cost the server process and this (the client) one.
                s0, c0, t0 = server.cpu_s(), time.process_time(), time.perf_counter()
                fn(i)
                t[key].append(time.perf_counter() - t0)
                cpu[key]["server"] += server.cpu_s() - s0
                cpu[key]["client"] += time.process_time() - c0
        res = {k: _summary(v, nbytes) for k, v in t.items()}
        cpu_ms = {k: {side: 1e3 * total / reps for side, total in v.items()} for k, v in cpu.items()}
        both = {k: v["server"] + v["client"] for k, v in cpu_ms.items()}
        gbps = {k: v["gb_per_s"] for k, v in res.items()}
        return {
            "benchmark": "transport",
            "params": num_params,
            "wire_dtype": wire_dtype,
            "payload_bytes": nbytes,
            "chunk_bytes": chunk,
            "reps": reps,
            "stream_window_bytes": stream_window_bytes,  # None: the psgrad servers' default
            "machine": machine_info(),
            "results": res,
            "ratios": {
                "push_vs_raw_upload": gbps["psgrad_push"] / gbps["raw_upload"],
                "pull_vs_raw_download": gbps["psgrad_pull"] / gbps["raw_download"],
            },
            # Not targets: a push and bare gRPC uploads served by one process (psgrad_with_raw.py),
            # whose Upload copies (the ceiling's work) or does a shard's sum + SGD update per chunk
            # (into the next weights, as a push does, or in place).
            "diagnostics": {
                "same_process_push_vs_raw_upload": gbps["same_process_push"] / gbps["same_process_raw_upload"],
                "same_process_push_vs_raw_sgd_upload": gbps["same_process_push"] / gbps["same_process_raw_upload_sgd"],
                "same_process_raw_sgd_upload_vs_raw_upload": gbps["same_process_raw_upload_sgd"]
                / gbps["same_process_raw_upload"],
                # The same update in place (which a push must not do: it applies whole or not at all)
                # reads and writes one weight vector; into the next weights, as a push does, it reads
                # the current ones and writes a second vector. These two show what that costs.
                "same_process_raw_sgd_in_place_upload_vs_raw_upload": gbps["same_process_raw_upload_sgd_in_place"]
                / gbps["same_process_raw_upload"],
                "same_process_raw_sgd_upload_vs_raw_sgd_in_place_upload": gbps["same_process_raw_upload_sgd"]
                / gbps["same_process_raw_upload_sgd_in_place"],
                # CPU (client + server) per raw operation / per psgrad one: where the two processes
                # keep the shared cores busy, the throughput ratio cannot exceed it for long.
                "cpu_ratio_push": both["raw_upload"] / both["psgrad_push"] if both["psgrad_push"] else None,
                "cpu_ratio_pull": both["raw_download"] / both["psgrad_pull"] if both["psgrad_pull"] else None,
            },
            # Means per operation; the server's from /proc (10 ms ticks, summed over all repetitions).
            "cpu_ms_per_op": cpu_ms,
            "notes": "psgrad push includes the server's finiteness check and SGD apply; raw upload only copies. "
            "Client and server share this machine's CPUs: where they are busy, every extra CPU-ms "
            "of either side comes out of throughput (cpu_ms_per_op shows how much each side spent).",
        }
    finally:
        for c in clients:
            c.close()
        stop_all(children)


# ---------------------------------------------------------------------------------------------
# Worker processes (agents): `python benchmarks/transport.py --agent`, driven over stdin/stdout


def split_ranges(total: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous ranges of sizes differing by at most one (how plan_shards splits parameters)."""
    base, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


class _Agent:
    """One worker process: psgrad clients and raw gRPC clients over shared flat buffers."""

    def __init__(self) -> None:
        self.flat = torch.zeros(0)
        self.grad = torch.zeros(0)
        self.jobs: dict[str, Callable[[int], dict[str, Any]]] = {}
        self.closers: list[Callable[[], None]] = []

    def _buffers(self, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.flat.numel() != numel:
            self.flat = torch.zeros(numel)
            self.grad = torch.full((numel,), 1e-3)
        return self.flat, self.grad

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "psgrad":
            self._setup_psgrad(cmd)
        elif op == "raw":
            self._setup_raw(cmd)
        elif op == "run":
            return self.jobs[cmd["key"]](int(cmd["iters"]))
        else:
            raise ValueError(f"unknown op {op!r}")
        return {"ok": True}

    def _setup_psgrad(self, cmd: dict[str, Any]) -> None:
        numel, rank, servers = int(cmd["params"]), int(cmd["rank"]), list(cmd["servers"])
        params = [ParamSpec("weight", (numel,), "float32")]
        spec = JobSpec(mode="async", num_workers=int(cmd["num_workers"]), num_shards=len(servers),
                       wire_dtype=cmd["wire_dtype"], lr=1e-9)
        cfg = ClientConfig(rpc_timeout_s=ROUND_TIMEOUT_S, init_timeout_s=SETUP_TIMEOUT_S, chunk_bytes=int(cmd["chunk"]))
        client = ParameterClient(servers, spec, params, plan_shards(params, len(servers)), rank, cfg)
        flat, grad = self._buffers(numel)
        clock = client.join(initial_weights=(lambda: flat) if rank == 0 else None)
        self.closers.append(client.close)
        # Same host: the gradient lives in shared memory (a zero-copy push) and pulls take the
        # version the server lends (zero-copy), as a CPU worker's PSOptimizer does; copy_push keeps
        # the gradient in private memory, copied into each shard's segment at every push.
        shared = None if cmd.get("copy_push") else client.gradient_buffer()
        if shared is not None:
            shared.copy_(grad)
            grad = shared

        def run(iters: int) -> dict[str, Any]:
            nonlocal clock
            pull_s, push_s = [], []
            start = time.monotonic()
            for _ in range(iters):
                t0 = time.monotonic()
                client.pull(flat, clock, published=True)
                t1 = time.monotonic()
                client.push(grad, clock)
                t2 = time.monotonic()
                clock += 1
                pull_s.append(t1 - t0)
                push_s.append(t2 - t1)
            return {"start": start, "end": time.monotonic(), "pull_s": pull_s, "push_s": push_s}

        self.jobs[cmd["key"]] = run

    def _setup_raw(self, cmd: dict[str, Any]) -> None:
        nbytes, chunk, addrs = int(cmd["nbytes"]), int(cmd["chunk"]), list(cmd["servers"])
        flat, grad = self._buffers((nbytes + 3) // 4)
        src, dst = byte_view(grad)[:nbytes], byte_view(flat)[:nbytes]
        clients = [RawClient(a) for a in addrs]
        ranges = split_ranges(nbytes, len(clients))
        pool = futures.ThreadPoolExecutor(max_workers=len(clients)) if len(clients) > 1 else None
        self.closers += [c.close for c in clients]
        if pool is not None:
            self.closers.append(lambda: pool.shutdown(wait=True))

        def fan_out(fn: Callable[[RawClient, int, int], object]) -> None:
            if pool is None:
                fn(clients[0], 0, nbytes)
            else:
                for f in [pool.submit(fn, c, a, b) for c, (a, b) in zip(clients, ranges)]:
                    f.result()

        def run(iters: int) -> dict[str, Any]:
            pull_s, push_s = [], []
            start = time.monotonic()
            for _ in range(iters):
                t0 = time.monotonic()
                fan_out(lambda c, a, b: c.download(dst[a:b], chunk))
                t1 = time.monotonic()
                fan_out(lambda c, a, b: c.upload(src[a:b], chunk))
                t2 = time.monotonic()
                pull_s.append(t1 - t0)
                push_s.append(t2 - t1)
            return {"start": start, "end": time.monotonic(), "pull_s": pull_s, "push_s": push_s}

        self.jobs[cmd["key"]] = run

    def close(self) -> None:
        for close in reversed(self.closers):
            close()


def agent_main() -> None:
    agent = _Agent()
    try:
        command_loop(agent.handle)
    finally:
        agent.close()
    exit_now()


class Swarm:
    """W worker processes plus the servers they talk to; close() stops and reaps every process.

    Jobs are named by what they are (shards, model size, wire dtype, chunk), and asking for a job
    that exists reuses it, so parts of one suite run can share a swarm (see keep_swarms).
    """

    def __init__(self, num_agents: int) -> None:
        self.children: list[Child] = []
        self.agents = [self._add(Child(f"agent{i}", [sys.executable, str(HERE / "transport.py"), "--agent"]))
                       for i in range(num_agents)]
        self.groups: dict[str, list[Child]] = {}
        self.payload: dict[str, int] = {}

    def _add(self, child: Child) -> Child:
        self.children.append(child)
        return child

    def servers(self, group: str, count: int, argv: Sequence[str]) -> list[Child]:
        """The first `count` servers of a group, starting the missing ones now (their addresses are
        read when a job needs them, so servers started together come up together)."""
        have = self.groups.setdefault(group, [])
        while len(have) < count:
            have.append(self._add(start_server(f"{group}.{len(have)}", argv)))
        return have[:count]

    def _setup(self, commands: list[dict[str, Any]]) -> None:
        for agent, cmd in zip(self.agents, commands):
            agent.send(cmd)
        for agent in self.agents:
            agent.recv(SETUP_TIMEOUT_S)

    def psgrad_job(
        self, shards: int, params: int, wire_dtype: str = "float32", chunk: int = DEFAULT_CHUNK_BYTES,
        copy_push: bool = False,
    ) -> str:
        """Every agent joins an async job on `shards` fresh psgrad servers (rank 0 initializes them);
        returns the job's key. copy_push: the agents' gradients are private memory (see the agent)."""
        key = psgrad_key(shards, params, wire_dtype, chunk) + ("-copied" if copy_push else "")
        if key not in self.payload:
            addrs = [s.address(timeout_s=SETUP_TIMEOUT_S) for s in self.servers(key, shards, PSGRAD_SERVER)]
            common = {"op": "psgrad", "key": key, "servers": addrs, "params": params, "wire_dtype": wire_dtype,
                      "chunk": chunk, "num_workers": len(self.agents), "copy_push": copy_push}
            self._setup([{**common, "rank": r} for r in range(len(self.agents))])
            self.payload[key] = wire_bytes(params, wire_dtype)
        return key

    def raw_job(self, shards: int, nbytes: int, chunk: int = DEFAULT_CHUNK_BYTES) -> str:
        """Every agent connects to `shards` raw gRPC servers, the bytes split among them; returns the key."""
        key = f"raw-s{shards}-b{nbytes}-c{chunk}"
        if key not in self.payload:
            addrs = [s.address(timeout_s=SETUP_TIMEOUT_S) for s in self.servers("raw", shards, RAW_SERVER)]
            self._setup([{"op": "raw", "key": key, "servers": addrs, "nbytes": nbytes, "chunk": chunk}] * len(self.agents))
            self.payload[key] = nbytes
        return key

    def round(self, key: str, workers: int, iters: int) -> dict[str, Any]:
        """`workers` agents each run `iters` pull+push iterations of job `key`, started together."""
        replies = run_together(self.agents[:workers], [{"op": "run", "key": key, "iters": iters}] * workers,
                               ROUND_TIMEOUT_S)
        return aggregate(replies, self.payload[key])

    def alive(self) -> bool:
        return all(c.popen.poll() is None for c in self.children)

    def close(self) -> None:
        stop_all(self.children)


def psgrad_key(shards: int, params: int, wire_dtype: str = "float32", chunk: int = DEFAULT_CHUNK_BYTES) -> str:
    return f"psgrad-s{shards}-p{params}-{wire_dtype}-c{chunk}"


_kept: list[Swarm] | None = None  # swarms shared while keep_swarms() is open


@contextlib.contextmanager
def keep_swarms() -> Iterator[None]:
    """While open, open_swarm reuses a live swarm with enough agents (and its jobs) instead of
    starting new processes; all are stopped when the block ends. The suite wraps transport and
    peer in this: starting a process that imports torch costs seconds on a small machine."""
    global _kept
    if _kept is not None:
        yield
        return
    _kept = []
    try:
        yield
    finally:
        kept, _kept = _kept, None
        for swarm in kept:
            swarm.close()


def open_swarm(num_agents: int) -> Swarm:
    if _kept is None:
        return Swarm(num_agents)
    for swarm in _kept:
        if len(swarm.agents) >= num_agents and swarm.alive():
            return swarm
    swarm = Swarm(num_agents)
    _kept.append(swarm)
    return swarm


def release_swarm(swarm: Swarm, failed: bool) -> None:
    """Close a swarm unless keep_swarms keeps it; one whose part failed is always closed."""
    if _kept is not None and swarm in _kept and not failed:
        return
    if _kept is not None and swarm in _kept:
        _kept.remove(swarm)
    swarm.close()


# ---------------------------------------------------------------------------------------------
# The matrix


def _cell_summary(rounds: list[dict[str, Any]], payload: int) -> dict[str, Any]:
    """Medians over repetitions of one (system, shards, workers) cell."""
    pulls = [t for r in rounds for t in r["pull_s"]]
    pushes = [t for r in rounds for t in r["push_s"]]
    workers = len(rounds[0]["per_worker"])
    return {
        "gb_per_s": summarize([r["gb_per_s"] for r in rounds])["median"],
        "ops_per_s": summarize([r["ops_per_s"] for r in rounds])["median"],
        "reps_gb_per_s": [r["gb_per_s"] for r in rounds],
        "pull_gb_per_s": median_gbps(pulls, payload),
        "push_gb_per_s": median_gbps(pushes, payload),
        "per_worker_ops_per_s": [summarize([r["per_worker"][w]["ops_per_s"] for r in rounds])["median"]
                                 for w in range(workers)],
        "per_worker_gb_per_s": [summarize([r["per_worker"][w]["gb_per_s"] for r in rounds])["median"]
                                for w in range(workers)],
    }


def run_matrix(params: int, reps: int, iters: int, shards: Sequence[int], workers: Sequence[int],
               wire_dtype: str = "float32", chunk: int = DEFAULT_CHUNK_BYTES) -> dict[str, Any]:
    """psgrad through each shard count x worker count, beside raw gRPC with the same processes,
    loopback TCP and memory copy; all interleaved repetition by repetition."""
    t_start = time.monotonic()
    payload = wire_bytes(params, wire_dtype)
    swarm = open_swarm(max(workers))
    tcp: TcpClient | None = None
    failed = True
    try:
        for s in shards:  # start every server before waiting for any
            swarm.servers(psgrad_key(s, params, wire_dtype, chunk), s, PSGRAD_SERVER)
        swarm.servers("raw", max(shards), RAW_SERVER)
        (tcp_server,) = swarm.servers("tcp", 1, [str(HERE / "ceilings.py"), "--tcp-serve"])
        keys = {(system, s): swarm.psgrad_job(s, params, wire_dtype, chunk) if system == "psgrad"
                else swarm.raw_job(s, payload, chunk) for s in shards for system in ("psgrad", "raw")}
        log(f"transport: {len(swarm.children)} processes up after {time.monotonic() - t_start:.1f} s")
        tcp = TcpClient(tcp_server.address())
        memcpy = MemcpyProbe(payload)
        tcp_buf = torch.ones((payload + 3) // 4)
        tcp_view = byte_view(tcp_buf)[:payload]

        # warm-up: every server allocates its buffers for the most concurrent workers
        for key in keys.values():
            swarm.round(key, max(workers), 2)
        tcp.upload(tcp_view, chunk)
        tcp.download(tcp_view, chunk)

        rounds: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
        ceil_t: dict[str, list[float]] = {"tcp_upload": [], "tcp_download": [], "memcpy_reused": [], "memcpy_fresh": []}
        for rep in range(reps):
            for s in shards:
                for w in workers:
                    for system in ("psgrad", "raw") if rep % 2 == 0 else ("raw", "psgrad"):  # neither always first
                        rounds.setdefault((system, s, w), []).append(swarm.round(keys[(system, s)], w, iters))
            for _ in range(iters):
                ceil_t["tcp_upload"].append(_timed(lambda: tcp.upload(tcp_view, chunk)))
                ceil_t["tcp_download"].append(_timed(lambda: tcp.download(tcp_view, chunk)))
                ceil_t["memcpy_reused"].append(memcpy.reused_s())
                ceil_t["memcpy_fresh"].append(memcpy.fresh_s())
            log(f"transport: repetition {rep + 1}/{reps} done ({time.monotonic() - t_start:.0f} s)")
        failed = False
    finally:
        if tcp is not None:
            tcp.close()
        release_swarm(swarm, failed)

    cells = []
    for s in shards:
        for w in workers:
            ps = _cell_summary(rounds[("psgrad", s, w)], payload)
            raw = _cell_summary(rounds[("raw", s, w)], payload)
            cells.append({"shards": s, "workers": w, "psgrad": ps, "raw_grpc": raw,
                          "ratio_gb_per_s": ps["gb_per_s"] / raw["gb_per_s"]})
    ceilings = {f"{k}_gb_per_s": median_gbps(v, payload) for k, v in ceil_t.items()}
    return {
        "params": params,
        "wire_dtype": wire_dtype,
        "omp_threads_per_process": 1,
        "payload_bytes": payload,
        "chunk_bytes": chunk,
        "reps": reps,
        "iters_per_round": iters,
        "cells": cells,
        "ceilings": ceilings,
        "ceiling_samples_s": ceil_t,
        "elapsed_s": time.monotonic() - t_start,
    }


def _targets_and_figures(m: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    mb = m["payload_bytes"] / 1e6
    one = next(c for c in m["cells"] if c["shards"] == 1 and c["workers"] == 1)
    dtype = m["wire_dtype"]
    targets = [
        target(f"transport: {dtype} push, 1 shard, 1 worker ({mb:.0f} MB) vs raw gRPC upload",
               one["psgrad"]["push_gb_per_s"], one["raw_grpc"]["push_gb_per_s"], 0.9, "higher", "GB/s",
               "raw gRPC streaming upload"),
        target(f"transport: {dtype} pull, 1 shard, 1 worker ({mb:.0f} MB) vs raw gRPC download",
               one["psgrad"]["pull_gb_per_s"], one["raw_grpc"]["pull_gb_per_s"], 0.9, "higher", "GB/s",
               "raw gRPC streaming download"),
    ]
    figures = []
    for c in m["cells"]:
        label = f"{c['shards']} shard(s), {c['workers']} worker(s)"
        figures.append(figure(f"transport: pull+push GB/s, {label}", c["psgrad"]["gb_per_s"], "GB/s",
                              c["raw_grpc"]["gb_per_s"], "raw gRPC, same processes"))
        figures.append(figure(f"transport: (pulls+pushes)/s, {label}", c["psgrad"]["ops_per_s"], "1/s",
                              c["raw_grpc"]["ops_per_s"], "raw gRPC, same processes"))
    names = {"tcp_upload": "loopback TCP upload, 1 stream", "tcp_download": "loopback TCP download, 1 stream",
             "memcpy_reused": "memory copy into a reused buffer", "memcpy_fresh": "memory copy into a fresh allocation"}
    for key, label in names.items():
        figures.append(figure(f"ceiling: {label} ({mb:.0f} MB)", m["ceilings"][f"{key}_gb_per_s"], "GB/s"))
    return targets, figures


def run(preset: str) -> dict[str, Any]:
    """The suite's transport part: the shard x worker matrix with its ceilings, and its targets."""
    p = MATRIX_PRESETS[preset]
    m = run_matrix(p["params"], p["reps"], p["iters"], p["shards"], p["workers"])
    targets, figures = _targets_and_figures(m)
    return {**m, "preset": preset, "targets": targets, "figures": figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model size and repetitions (default: tiny)")
    parser.add_argument("--params", type=int, help="override the number of float32 parameters")
    parser.add_argument("--reps", type=int, help="override the number of timed repetitions")
    parser.add_argument("--wire-dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="wire dtype (default: float32)")
    parser.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES, help="stream chunk size (default: 1 MiB)")
    parser.add_argument("--matrix", action="store_true",
                        help="run the shards x workers matrix with worker processes (what the suite runs)")
    parser.add_argument("--stream-window-bytes", type=window_bytes_arg, metavar="N",
                        help="start the psgrad servers with this stream window (0 = gRPC's automatic windows; "
                        "default: the server's own); one-shard comparison only")
    parser.add_argument("--agent", action="store_true", help=argparse.SUPPRESS)  # a worker process of --matrix
    args = parser.parse_args()
    if args.agent:
        agent_main()
        return
    if args.matrix:
        if args.stream_window_bytes is not None:
            parser.error("--stream-window-bytes applies to the one-shard comparison, not to --matrix")
        p = MATRIX_PRESETS[args.preset]
        m = run_matrix(args.params or p["params"], args.reps or p["reps"], p["iters"], p["shards"], p["workers"],
                       args.wire_dtype, args.chunk_bytes)
        targets, figures = _targets_and_figures(m)
        write_json({**m, "preset": args.preset, "machine": machine_info(), "targets": targets, "figures": figures})
        return
    preset = PRESETS[args.preset]
    out = compare_one_shard(args.params or preset["params"], args.reps or preset["reps"], args.wire_dtype,
                            args.chunk_bytes, args.stream_window_bytes)
    out["preset"] = args.preset
    write_json(out)


if __name__ == "__main__":
    main()
