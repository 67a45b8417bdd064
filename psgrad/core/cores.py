"""Which cores a worker runs on where several share a host: its share of the host's cores
(`bind_cores`; a server on the host then serves its calls on those cores too: see
server/scheduling.py's PeerCores).

Workers that share a host without a binding are placed by the kernel at each wake-up, and two of
them can queue on one core while another sits idle for milliseconds until the load balancer moves
one (measured on a 2-vCPU VM: a core idle 22 % of a DLRM job's time while a task waited on the
other; TorchRec's two ranks ran 1.17 x as fast bound, psgrad's workers 1.06 x). A worker bound to cores
of its own (`bind_cores`, as torchrun's and DeepSpeed's core bindings do) never queues behind
another worker.

A task that its engine bound already (SLURM binds each task to cores of its own under `--cpu-bind`
or the cluster's default binding, and says so in SLURM_CPU_BIND_TYPE) has its share: where the
rank and count would come from that engine, `bind_cores` keeps its binding (`engine_binding`)
instead of splitting the task's own cores again among the host's tasks.
"""
from __future__ import annotations

import os
from collections.abc import Mapping

from psgrad.errors import ConfigError

# Where engines put a process's index among the processes on its host, and their number: torchrun, then SLURM.
LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "SLURM_LOCALID")
LOCAL_WORKERS_VARIABLES = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE")
# The words of SLURM_CPU_BIND_TYPE that bind nothing (its other words name a binding: mask_cpu:,
# map_cpu:, cores, threads, sockets, ldoms, rank, ...).
_UNBOUND_WORDS = frozenset({"", "none", "quiet", "verbose"})


def host_cores() -> list[int]:
    """The cores this process may run on, in order (all of the host's where nothing restricts it)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def share(local_rank: int, local_workers: int, cores: list[int] | None = None) -> list[int]:
    """The cores of worker `local_rank` of `local_workers` on a host with `cores` (default: this
    process's): the cores split into equal consecutive runs, one per worker, the remainder to none;
    with more workers than cores, worker r gets core r mod the cores.

    Raises:
        ConfigError: a local rank outside 0..local_workers - 1, or no workers.
    """
    if local_workers < 1 or not 0 <= local_rank < local_workers:
        raise ConfigError(f"bind_cores: local rank {local_rank} of {local_workers} workers on this host; "
                          f"the rank must be 0 to the workers' count - 1")
    cores = host_cores() if cores is None else sorted(cores)
    per = len(cores) // local_workers
    if per == 0:
        return [cores[local_rank % len(cores)]]
    return cores[local_rank * per:(local_rank + 1) * per]


def engine_binding(env: Mapping[str, str] | None = None, local_rank: int | None = None,
                   local_workers: int | None = None) -> str | None:
    """Why this process's cores are its own already, where the engine that gives its local rank
    bound it (a SLURM task whose SLURM_CPU_BIND_TYPE names a binding: `--cpu-bind=cores`,
    `mask_cpu:`, a cluster's default) and the caller's rank and count are the engine's (no count
    given, and no rank or SLURM's own: psgrad run copies it); None where nothing bound it, where
    torchrun gives the rank (its processes share the task's cores: torchrun started in a bound
    SLURM task), or where a rank or count of the caller's own is to split the cores. `env`: the
    environment (default os.environ)."""
    env = os.environ if env is None else env
    ranked_by = next((name for name in LOCAL_RANK_VARIABLES if env.get(name, "").strip()), None)
    kind = env.get("SLURM_CPU_BIND_TYPE", "").strip()
    if ranked_by != "SLURM_LOCALID" or set(kind.replace(",", " ").split()) <= _UNBOUND_WORDS:
        return None
    if local_workers is not None or local_rank not in (None, _from_env(None, (ranked_by,), "local_rank", env)):
        return None
    return f"SLURM bound this task to them (SLURM_CPU_BIND_TYPE={kind})"


def bind_cores(local_rank: int | None = None, local_workers: int | None = None) -> list[int]:
    """Bind this process to its share of its host's cores (see `share`), for a worker that shares
    its host with other workers; threads it starts afterwards inherit the binding, so call it
    first thing in the worker. local_rank / local_workers default to torchrun's LOCAL_RANK and
    LOCAL_WORLD_SIZE (or SLURM's SLURM_LOCALID and SLURM_NTASKS_PER_NODE). In a task its engine
    bound already (`engine_binding`: a SLURM task under `--cpu-bind`), given no count and no rank
    but the engine's, it keeps that binding: the task's cores are its share. Returns the cores, or
    [] where the platform has no CPU affinity (nothing bound).

    Raises:
        ConfigError: no rank or count given or in the environment, or one that is not a number.
    """
    if engine_binding(None, local_rank, local_workers) is not None:
        return host_cores() if hasattr(os, "sched_setaffinity") else []
    local_rank = _from_env(local_rank, LOCAL_RANK_VARIABLES, "local_rank")
    local_workers = _from_env(local_workers, LOCAL_WORKERS_VARIABLES, "local_workers")
    cores = share(local_rank, local_workers)
    if not hasattr(os, "sched_setaffinity"):
        return []
    os.sched_setaffinity(0, cores)
    return cores


def _from_env(value: int | None, names: tuple[str, ...], what: str, env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    if value is not None:
        return int(value)
    for name in names:
        raw = env.get(name, "").strip()
        if raw:
            if not raw.isdigit():
                raise ConfigError(f"bind_cores: {name}={raw!r} is not a count")
            return int(raw)
    raise ConfigError(f"bind_cores: give {what}, or run under torchrun or SLURM, which set {' or '.join(names)}")
