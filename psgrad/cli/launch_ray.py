"""`psgrad launch --backend ray`: its flags, their RayConfig, and the hand-off of a checked job to psgrad.launch.ray."""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from pathlib import Path

from psgrad.cli import logs
from psgrad.config import RayConfig, ServerConfig
from psgrad.errors import ConfigError

R = RayConfig  # the defaults
# The flags only --backend ray reads, named as RayConfig's fields; all default to None, so that one
# given with --backend local is refused rather than ignored.
RAY_FLAGS = tuple(f.name for f in dataclasses.fields(RayConfig))


def add_ray_args(p: argparse.ArgumentParser) -> None:
    """`psgrad launch`'s --backend and the flags of its Ray backend."""
    g = p.add_argument_group("where it runs")
    g.add_argument("--backend", choices=("local", "ray"), default="local", help="local: the servers and workers "
                   "are subprocesses of this command on this machine; ray: they are Ray actors spread over the "
                   "nodes of a Ray cluster (needs pip install 'psgrad[ray]') (default: local)")
    g.add_argument("--address", help="ray: the cluster to run on: auto (the one RAY_ADDRESS names, else the one "
                   "started on this machine), its head's HOST:PORT (`ray start --head` prints it; port 6379 by "
                   "default) or ray://HOST:10001 (default: start a Ray instance on this machine for this job and "
                   "stop it at the end)")
    g.add_argument("--server-cpus", type=float, metavar="N", help=f"ray: CPUs each server actor asks Ray for "
                   f"(default: {R.server_cpus:g}); 0 places servers whatever the nodes' CPU counts")
    g.add_argument("--worker-cpus", type=float, metavar="N", help=f"ray: CPUs each worker actor asks Ray for; Ray "
                   f"gives the worker as many OpenMP threads (default: {R.worker_cpus:g}); raise it for models "
                   "that compute on the CPU")
    g.add_argument("--worker-gpus", type=float, metavar="N", help="ray: GPUs each worker actor asks Ray for "
                   "(default: 1 where the cluster has GPUs, an even share of one where it has fewer GPUs than "
                   "workers, 0 where it has none); give 1 for a cluster whose GPU nodes are still being added")
    g.add_argument("--server-restarts", type=int, metavar="N", help="ray, with --checkpoint-dir: how often Ray "
                   "may restart a server actor that died; the new one binds the same port on the same node and "
                   "restores the shard's newest checkpoint while the workers wait for it up to "
                   f"--reconnect-timeout-s (default: {R.server_restarts}; without --checkpoint-dir: 0, a server "
                   "that dies ends the job)")
    g.add_argument("--object-store-mb", type=int, metavar="MB", help="ray without --address: the object store "
                   f"of the Ray instance started for the job (default: {R.object_store_mb}; psgrad passes only "
                   "small messages through it, where Ray's own default reserves 30%% of the RAM in /dev/shm)")
    g.add_argument("--start-timeout-s", type=float, metavar="S", help="ray: how long to wait for every actor to "
                   f"start (default: {R.start_timeout_s:g}); raise it when the cluster first has to add nodes")


def ray_config(ns: argparse.Namespace) -> RayConfig | None:
    """The RayConfig of --backend ray (None for --backend local).

    Raises:
        ConfigError: a Ray flag given with --backend local, a bad value, a flag the Ray backend does not
            take, or Ray not installed.
    """
    given = {name: getattr(ns, name) for name in RAY_FLAGS if getattr(ns, name) is not None}
    if ns.backend != "ray":
        if given:
            name = "--" + next(iter(given)).replace("_", "-")
            raise ConfigError(f"{name} is a flag of the Ray backend: add --backend ray")
        return None
    if ns.replicas:
        raise ConfigError("--replicas is for --backend local; under Ray a server actor that dies is restarted "
                          "from its --checkpoint-dir instead")
    if ns.bind_cores:
        raise ConfigError("--bind-cores is for --backend local: Ray places the worker actors on its nodes and gives "
                          "each --worker-cpus CPUs, so a rank says nothing of which cores on its node are its own; "
                          "drop --bind-cores")
    config = RayConfig(**given)
    from psgrad.launch.ray import import_ray

    import_ray()  # before anything starts or is recorded: without Ray, exit 2 naming the extra to install
    return config


def server_metrics_port(ns: argparse.Namespace, index: int) -> int | None:
    """`launch --metrics-port P`: server `index`'s own metrics port, after the workers' P..P+W-1: P + W +
    index (backups: index num_servers + i); with P = 0, 0 (a free port each, logged); None without
    --metrics-port. Both backends give their servers these."""
    if ns.metrics_port is None:
        return None
    return ns.metrics_port + ns.num_workers + index if ns.metrics_port else 0


def shard_configs(ns: argparse.Namespace) -> list[ServerConfig]:
    """Each server actor's config from `psgrad launch` flags: the job's server settings, its own
    metrics port (as the local backend gives it) and checkpoint directory."""
    from psgrad.launch import jobdir

    base = ServerConfig(lease_s=ns.lease_s, nonfinite=ns.nonfinite, memory_budget_mb=ns.memory_budget_mb,
                        max_read_mb=ns.max_read_mb, batch_scheduling=ns.batch_scheduling,
                        follow_worker_cores=ns.follow_worker_cores,
                        checkpoint_every_s=ns.checkpoint_every_s, checkpoint_every_versions=ns.checkpoint_every_versions,
                        insecure=ns.insecure)
    # Paths travel to other nodes: absolute, as the driver means them.
    checkpoints = None if ns.checkpoint_dir is None else Path(ns.checkpoint_dir).absolute()
    return [dataclasses.replace(base, metrics_port=server_metrics_port(ns, i),
                                checkpoint_dir=None if checkpoints is None else str(jobdir.shard_dir(checkpoints, i)))
            for i in range(ns.num_servers)]


def launch_on_ray(
    ns: argparse.Namespace, config: RayConfig, worker_args: Callable[[int, str], list[str]],
    status: Callable[[list[str]], None],
) -> int:
    """Run the checked job of `psgrad launch` flags ns on Ray (psgrad.launch.ray)."""
    from psgrad.launch.ray import run_ray_launch

    shards = shard_configs(ns)
    env = {"OMP_NUM_THREADS": str(ns.omp_threads)} if ns.omp_threads else {}
    formatter = logs.JsonFormatter() if ns.log_format == "json" else logs.TextFormatter()
    return run_ray_launch(config, shards, ns.num_workers, worker_args, env=env, status=status,
                          formatter=formatter, log_level=ns.log_level)
