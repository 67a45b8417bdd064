"""Which cores a worker runs on where several share a host: its share of the host's cores
(`bind_cores`; a server on the host then serves its calls on those cores too: see
server/scheduling.py's PeerCores).

Workers that share a host without a binding are placed by the kernel at each wake-up, and two of
them can queue on one core while another sits idle for milliseconds until the load balancer moves
one (measured on a 2-vCPU VM: a core idle 22 % of a DLRM job's time while a task waited on the
other; TorchRec's two ranks ran 1.17 x as fast bound, psgrad's workers 1.06 x). A worker bound to cores
of its own (`bind_cores`, as torchrun's and DeepSpeed's core bindings do) never queues behind
another worker.
"""
from __future__ import annotations

import os

from psgrad.errors import ConfigError

# Where engines put a process's index among the processes on its host, and their number: torchrun, then SLURM.
LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "SLURM_LOCALID")
LOCAL_WORKERS_VARIABLES = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE")


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


def bind_cores(local_rank: int | None = None, local_workers: int | None = None) -> list[int]:
    """Bind this process to its share of its host's cores (see `share`), for a worker that shares
    its host with other workers; threads it starts afterwards inherit the binding, so call it
    first thing in the worker. local_rank / local_workers default to torchrun's LOCAL_RANK and
    LOCAL_WORLD_SIZE (or SLURM's SLURM_LOCALID and SLURM_NTASKS_PER_NODE). Returns the cores, or
    [] where the platform has no CPU affinity (nothing bound).

    Raises:
        ConfigError: no rank or count given or in the environment, or one that is not a number.
    """
    local_rank = _from_env(local_rank, LOCAL_RANK_VARIABLES, "local_rank")
    local_workers = _from_env(local_workers, LOCAL_WORKERS_VARIABLES, "local_workers")
    cores = share(local_rank, local_workers)
    if not hasattr(os, "sched_setaffinity"):
        return []
    os.sched_setaffinity(0, cores)
    return cores


def _from_env(value: int | None, names: tuple[str, ...], what: str) -> int:
    if value is not None:
        return int(value)
    for name in names:
        raw = os.environ.get(name, "").strip()
        if raw:
            if not raw.isdigit():
                raise ConfigError(f"bind_cores: {name}={raw!r} is not a count")
            return int(raw)
    raise ConfigError(f"bind_cores: give {what}, or run under torchrun or SLURM, which set {' or '.join(names)}")
