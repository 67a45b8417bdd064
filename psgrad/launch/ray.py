"""`psgrad launch --backend ray`: the job's servers and workers as Ray actors spread over a cluster's
nodes; the driver relays their output, reports restarts and exit codes, and stops them all at the end."""
from __future__ import annotations

import logging
import math
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, NamedTuple

from psgrad.config import RayConfig, ServerConfig
from psgrad.errors import ConfigError, PsgradError
from psgrad.launch.ray_actors import ServerActor, WorkerActor
from psgrad.launch.supervisor import PRINT_LOCK, print_line

POLL_S = 0.5  # how often the driver collects the actors' output
STOP_TIMEOUT_S = 15.0
CONNECT_TIMEOUT_S = 10.0
NAMESPACE = "psgrad"


class RayLaunchError(PsgradError):
    """An actor failed to start, died, or its worker exited with an error."""


def import_ray() -> ModuleType:
    """Ray, which only `--backend ray` needs (an optional extra).

    Raises:
        ConfigError: Ray is not installed (exit 2, with the command that installs it).
    """
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(f"--backend ray needs Ray, which is not installed ({exc}): pip install 'psgrad[ray]'") from None
    return ray


class Node(NamedTuple):
    """A live node of the cluster: Ray's id, its IP, its CPUs and GPUs, and whether it is the head."""

    id: str
    ip: str
    cpus: float
    gpus: float
    head: bool


def nodes_of(entries: Sequence[dict[str, Any]]) -> list[Node]:
    """The live nodes in `ray.nodes()` entries, the head first, then by id (the same order every run)."""
    out = [
        Node(str(e["NodeID"]), str(e["NodeManagerAddress"]), float(e["Resources"].get("CPU", 0)),
             float(e["Resources"].get("GPU", 0)), "node:__internal_head__" in e["Resources"])
        for e in entries if e.get("Alive")
    ]
    return sorted(out, key=lambda n: (not n.head, n.id))


class Placement:
    """Nodes for the job's actors: round robin over the live nodes that have the CPUs and GPUs an actor
    asks for, passing over those the job already filled (servers first, then workers, so both spread
    over the cluster). Where every fitting node is full, round robin anyway: Ray then queues the actor."""

    def __init__(self, nodes: Sequence[Node]) -> None:
        self.nodes = list(nodes)
        self._left = {n.id: [n.cpus, n.gpus] for n in self.nodes}

    def place(self, count: int, cpus: float, gpus: float, what: str) -> list[Node]:
        """A node for each of `count` actors (a server or a worker: `what`) asking for cpus and gpus.

        Raises:
            RayLaunchError: no live node has that many CPUs and GPUs.
        """
        fit = [n for n in self.nodes if n.cpus >= cpus and n.gpus >= gpus]
        if not fit:
            have = ", ".join(f"{n.ip} ({n.cpus:g} CPU, {n.gpus:g} GPU)" for n in self.nodes) or "none"
            flags = "--worker-cpus/--worker-gpus" if what == "worker" else f"--{what}-cpus"
            raise RayLaunchError(f"no node of the cluster has {cpus:g} CPU(s) and {gpus:g} GPU(s) for a {what} "
                                 f"(live nodes: {have}); lower {flags} or add nodes")
        out: list[Node] = []
        start = 0
        for _ in range(count):
            order = fit[start:] + fit[:start]
            node = next((n for n in order if self._left[n.id][0] >= cpus and self._left[n.id][1] >= gpus), order[0])
            self._left[node.id][0] -= cpus
            self._left[node.id][1] -= gpus
            out.append(node)
            start = (fit.index(node) + 1) % len(fit)
        return out


def gpus_per_worker(config: RayConfig, cluster_gpus: float, num_workers: int) -> float:
    """--worker-gpus, or by default one GPU per worker where the cluster has GPUs, shared evenly
    (1/k of one) when it has fewer whole GPUs than workers; 0 where it has none."""
    if config.worker_gpus is not None:
        return config.worker_gpus
    whole = math.floor(cluster_gpus)
    return 0.0 if whole < 1 else 1.0 / math.ceil(num_workers / whole)


@dataclass
class _Actor:
    """The driver's view of one actor: its handle, what of its output was relayed, the call in flight."""

    name: str
    handle: Any
    pid: int | None = None
    index: int = 0
    call: Any = None
    unavailable: bool = False
    restarts: int = 0
    info: dict[str, Any] = field(default_factory=dict)


class RayJob:
    """One launched job's actors on a connected Ray: start them, relay their output, stop them."""

    def __init__(self, ray: ModuleType, config: RayConfig, log: Callable[[str], None]) -> None:
        self.ray, self.config, self.log = ray, config, log
        self.id = secrets.token_hex(3)
        self.servers: list[_Actor] = []
        self.workers: list[_Actor] = []

    def _options(self, name: str, node: Node, **resources: Any) -> dict[str, Any]:
        """Pinned to the node (Ray's soft affinity placed actors that ask for no CPUs on the driver's
        node; a pinned server that Ray restarts comes back where its checkpoints are)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return {"name": f"psgrad-{self.id}-{name}", "namespace": NAMESPACE, "max_concurrency": 4,
                "scheduling_strategy": NodeAffinitySchedulingStrategy(node.id, soft=False), **resources}

    def _await_ready(self, actors: Sequence[_Actor]) -> None:
        refs = {a.handle.ready.remote(): a for a in actors}
        deadline = time.monotonic() + self.config.start_timeout_s
        while refs:
            done, _ = self.ray.wait(list(refs), timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                names = ", ".join(a.name for a in refs.values())
                raise RayLaunchError(f"{names} did not start within {self.config.start_timeout_s:g} s: the cluster "
                                     "may lack the CPUs/GPUs they ask for (see `ray status`), or a node cannot "
                                     "import psgrad; raise --start-timeout-s if nodes are still being added")
            for ref in done:
                actor = refs.pop(ref)
                try:
                    actor.info = self.ray.get(ref)
                except self.ray.exceptions.RayActorError as exc:
                    raise RayLaunchError(f"{actor.name} failed to start: {_cause(exc)}") from None
                metrics = f", metrics at {actor.info['metrics']}" if actor.info.get("metrics") else ""
                self.log(f"[launch] {actor.name} runs on node {actor.info['ip']} ({actor.info['node'][:8]}), "
                         f"pid {actor.info['pid']}, actor {NAMESPACE}/psgrad-{self.id}-{actor.name}{metrics}")

    def start_servers(self, placement: Placement, configs: Sequence[ServerConfig], local_only: bool,
                      formatter: logging.Formatter | None, log_level: str) -> list[str]:
        """Start one server actor per config, round robin over the nodes; returns their addresses in shard order."""
        remote = self.ray.remote(ServerActor)
        nodes = placement.place(len(configs), self.config.server_cpus, 0.0, "server")
        for i, (node, config) in enumerate(zip(nodes, configs)):
            restarts = self.config.server_restarts if config.checkpoint_dir is not None else 0
            options = self._options(f"server{i}", node, num_cpus=self.config.server_cpus, max_restarts=restarts)
            handle = remote.options(**options).remote(config, self.id, local_only, formatter, log_level)
            self.servers.append(_Actor(f"server{i}", handle))
        self._await_ready(self.servers)
        return [str(a.info["address"]) for a in self.servers]

    def start_workers(self, placement: Placement, argvs: Sequence[list[str]], gpus: float, env: dict[str, str]) -> None:
        """Start one worker actor per argv, round robin over the nodes that have the resources it asks for."""
        remote = self.ray.remote(WorkerActor)
        nodes = placement.place(len(argvs), self.config.worker_cpus, gpus, "worker")
        for rank, (node, argv) in enumerate(zip(nodes, argvs)):
            options = self._options(f"worker{rank}", node, num_cpus=self.config.worker_cpus, num_gpus=gpus)
            self.workers.append(_Actor(f"worker{rank}", remote.options(**options).remote(argv, env, os.getcwd())))
        self._await_ready(self.workers)

    def train(self) -> None:
        """Run every worker to its end, relaying output; a restarted server is reported and waited for.

        Raises:
            RayLaunchError: a worker exited non-zero or its actor died, or a server died for good.
        """
        runs = {w.handle.run.remote(): w for w in self.workers}
        actors = [*self.servers, *self.workers]
        while runs:
            for a in actors:
                if a.call is None:
                    a.call = a.handle.lines.remote(a.pid, a.index)
            calls = {a.call: a for a in actors}
            done, _ = self.ray.wait([*runs, *calls], num_returns=len(runs) + len(calls), timeout=POLL_S)
            for ref in done:
                if ref in calls:
                    self._relay(calls[ref], ref)
            for ref in done:
                if ref in runs:
                    self._finish(runs.pop(ref), ref)

    def _relay(self, actor: _Actor, ref: Any) -> None:
        """Print an actor's new lines, prefixed with its name; note a server that Ray restarts."""
        actor.call = None
        errors = self.ray.exceptions
        try:
            pid, actor.index, lines = self.ray.get(ref)
        except errors.ActorUnavailableError:
            if not actor.unavailable:
                actor.unavailable = True
                self.log(f"[launch] {actor.name} is not answering; Ray is restarting it")
            return
        except errors.RayActorError as exc:
            raise RayLaunchError(f"{actor.name} died: {_cause(exc)}") from None
        if actor.pid is not None and pid != actor.pid:
            actor.restarts += 1
            self.log(f"[launch] {actor.name} was restarted by Ray (restart {actor.restarts}), now pid {pid}")
        actor.pid, actor.unavailable = pid, False
        for line in lines:
            self.log(f"[{actor.name}] {line}")

    def _finish(self, worker: _Actor, ref: Any) -> None:
        try:
            code = self.ray.get(ref)
        except self.ray.exceptions.RayActorError as exc:
            raise RayLaunchError(f"{worker.name} died: {_cause(exc)}") from None
        if worker.call is not None:  # the lines asked for before it ended, then the rest
            self._relay(worker, worker.call)
        self._relay(worker, worker.handle.lines.remote(worker.pid, worker.index))
        if code != 0:
            raise RayLaunchError(f"{worker.name} (exit code {code})")

    def stop(self) -> None:
        """Stop the workers' processes, then the servers gracefully; then kill every actor."""
        for group in (self.workers, self.servers):
            refs = [a.handle.stop.remote() for a in group]
            self.ray.wait(refs, num_returns=len(refs), timeout=STOP_TIMEOUT_S)
        for a in [*self.workers, *self.servers]:
            try:
                self.ray.kill(a.handle, no_restart=True)
            except Exception:  # already gone
                pass


def _cause(exc: BaseException) -> str:
    """The useful end of a Ray actor error: the exception its actor raised, or why it died."""
    text = str(exc).strip()
    lines = [line for line in text.splitlines() if line.strip()]
    tail = next((line.strip() for line in reversed(lines) if "Error" in line or "error" in line), None)
    return tail or (lines[0] if lines else type(exc).__name__)


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Fail fast where a HOST:PORT (or ray://HOST:PORT) address does not answer: ray.init retries such
    an address for minutes. "auto" and other forms are left to Ray.

    Raises:
        ConnectionError: nothing accepts a connection there within timeout_s.
    """
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConnectionError(f"nothing answers at {address} ({exc}); is the cluster's head running there?") from None


def _connect(ray: ModuleType, config: RayConfig, needed_cpus: float) -> None:
    common: dict[str, Any] = {"namespace": NAMESPACE, "log_to_driver": False, "logging_level": logging.WARNING}
    if config.address is not None:
        check_reachable(config.address)
        ray.init(address=config.address, **common)
        return
    # A Ray instance on this machine for this job only (address "local": a new one even where another
    # instance or `ray start` runs here; without it ray.init joins that one and refuses num_cpus):
    # enough logical CPUs for every actor (the processes share the cores, as a local launch's do), no
    # dashboard, a small object store (psgrad passes only small messages through it; Ray's default
    # reserves 30% of RAM in /dev/shm).
    ray.init(address="local", num_cpus=max(os.cpu_count() or 1, math.ceil(needed_cpus)), include_dashboard=False,
             object_store_memory=config.object_store_mb << 20, **common)


def run_ray_launch(
    config: RayConfig, server_configs: Sequence[ServerConfig], num_workers: int,
    worker_args: Callable[[int, str], list[str]], *, env: dict[str, str] | None = None,
    status: Callable[[list[str]], None] | None = None, out: Callable[[str], None] | None = None,
    formatter: logging.Formatter | None = None, log_level: str = "info",
) -> int:
    """Start a server actor per ServerConfig, then num_workers worker actors (`psgrad worker
    worker_args(rank, servers)`), relay their output until every worker ended, print the status,
    stop everything and disconnect (stopping the Ray instance when it started one). Returns the exit
    code: 0, 1 when an actor failed, 130/143 when interrupted (Ctrl-C / SIGTERM).

    Raises:
        ConfigError: Ray is not installed.
    """
    ray = import_ray()
    log = out if out is not None else print_line
    needed = len(server_configs) * config.server_cpus + num_workers * config.worker_cpus
    previous = signal.getsignal(signal.SIGTERM)
    main = threading.current_thread() is threading.main_thread()
    start = time.monotonic()
    try:
        _connect(ray, config, needed)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = config.address or "a new instance on this machine"
        hint = ("" if config.address is None or os.environ.get("RAY_AUTH_MODE") else
                " (a cluster with token authentication, which `ray start` reports, needs RAY_AUTH_MODE=token in this "
                "command's environment: docs/operations/clusters.md)")
        log(f"[launch] failed: cannot start or reach Ray ({where}): {exc}{hint}")
        return 1

    def on_term(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    if main:
        signal.signal(signal.SIGTERM, on_term)
    job = RayJob(ray, config, log)
    try:
        nodes = nodes_of(ray.nodes())
        gpus = gpus_per_worker(config, float(ray.cluster_resources().get("GPU", 0)), num_workers)
        where = "a Ray instance started on this machine" if config.address is None else f"the Ray cluster at {config.address}"
        log(f"[launch] Ray {ray.__version__}, {where}: {len(nodes)} node(s) ({time.monotonic() - start:.1f} s); "
            f"job {job.id}, {len(server_configs)} server(s) + {num_workers} worker(s) ({gpus:g} GPU each)")
        placement = Placement(nodes)
        addresses = job.start_servers(placement, server_configs, config.address is None, formatter, log_level)
        servers = ",".join(addresses)
        log(f"[launch] {len(addresses)} server(s) up: {servers}; starting {num_workers} worker(s)")
        job.start_workers(placement, [worker_args(rank, servers) for rank in range(num_workers)], gpus, env or {})
        job.train()
        if status is not None:
            with PRINT_LOCK:  # its lines together, not split by a child's
                status(addresses)
        log(f"[launch] all {num_workers} worker(s) finished ({time.monotonic() - start:.1f} s)")
        return 0
    except RayLaunchError as exc:
        log(f"[launch] failed: {exc}; stopping the others")
        return 1
    except KeyboardInterrupt:
        log("[launch] interrupted; stopping all actors")
        return 130
    finally:
        try:
            job.stop()
        finally:
            ray.shutdown()
            if main:
                signal.signal(signal.SIGTERM, previous)
