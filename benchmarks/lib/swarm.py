"""A swarm: W worker processes (agents) and the servers they talk to, for comparisons where several
workers pull and push at once (transport.py's matrix and peer part, ray_ps.py).

An agent is a child (`lib_argv("swarm:agent_main")`) driven over stdin/stdout: it sets up psgrad
clients or raw gRPC clients over shared flat buffers, then runs rounds of pull+push iterations when
told, started together with the other agents (run_together). Jobs are named by what they are, and
asking for a job that exists reuses it; keep_swarms lets the parts of one suite run share a swarm.
"""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from typing import Any

import torch

from lib.children import (
    PSGRAD_SERVER,
    RAW_SERVER,
    SETUP_TIMEOUT_S,
    Child,
    CommandChild,
    exit_now,
    lib_argv,
    run_together,
    start_server,
    stop_all,
)
from lib.raw_grpc import RawClient
from lib.report import aggregate, pull_push_iterations

from psgrad.client.parameter_client import ParameterClient
from psgrad.config import DEFAULT_CHUNK_BYTES, ClientConfig, JobSpec
from psgrad.core.codecs import byte_view
from psgrad.core.sharding import ParamSpec, plan_shards

ROUND_TIMEOUT_S = 600.0


def wire_bytes(num_params: int, wire_dtype: str) -> int:
    return num_params * torch.empty(0, dtype=getattr(torch, wire_dtype)).element_size()


def split_ranges(total: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous ranges of sizes differing by at most one (how plan_shards splits parameters)."""
    base, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append((start, end))
        start = end
    return out


class _Agent(CommandChild):
    """One worker process: psgrad clients and raw gRPC clients over shared flat buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.flat = torch.zeros(0)
        self.grad = torch.zeros(0)
        self.jobs: dict[str, Callable[[int], dict[str, Any]]] = {}

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

        def push() -> None:
            nonlocal clock
            client.push(grad, clock)
            clock += 1

        self.jobs[cmd["key"]] = lambda iters: pull_push_iterations(
            iters, lambda: client.pull(flat, clock, published=True), push)

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

        self.jobs[cmd["key"]] = lambda iters: pull_push_iterations(
            iters, lambda: fan_out(lambda c, a, b: c.download(dst[a:b], chunk)),
            lambda: fan_out(lambda c, a, b: c.upload(src[a:b], chunk)))


def agent_main() -> None:
    _Agent().serve()
    exit_now()


class Swarm:
    """W worker processes plus the servers they talk to; close() stops and reaps every process.

    Jobs are named by what they are (shards, model size, wire dtype, chunk), and asking for a job
    that exists reuses it, so parts of one suite run can share a swarm (see keep_swarms).
    """

    def __init__(self, num_agents: int) -> None:
        self.children: list[Child] = []
        self.agents = [self._add(Child(f"agent{i}", [sys.executable, *lib_argv("swarm:agent_main")]))
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
