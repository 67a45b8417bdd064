"""The cluster engines' environments -> a Role: TF_CONFIG (Kubeflow), torchrun, SLURM, Kubernetes Indexed Jobs.

Pure functions of a Mapping[str, str] (the CLI passes os.environ; tests pass dicts)."""
from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

from psgrad.core.cores import LOCAL_RANK_VARIABLES, LOCAL_WORKERS_VARIABLES
from psgrad.launch.roles import (
    ENGINES,
    SERVER,
    WORKER,
    Role,
    RunOptions,
    StoreInfo,
    check_flag,
    need,
    need_int,
    refuse,
    split_address,
)
from psgrad.launch.slurm_env import from_slurm

TF_CHIEF_TYPES = ("chief", "master")  # "master": older TFJobs call the chief that
TORCH_SERVER_ROLES = ("server", "ps")
TORCH_WORKER_ROLES = ("worker", "trainer")
TORCH_SPLIT_ROLES = ("default", "")  # torchrun's role when --role is not given


# --------------------------------------------------------------------------- TF_CONFIG
def _tf_list(cluster: dict[str, Any], key: str) -> list[str]:
    entries = cluster.get(key, [])
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise refuse(f"TF_CONFIG: cluster.{key} must be a list of \"HOST:PORT\" strings, got {entries!r}")
    for e in entries:
        split_address(e, f"TF_CONFIG cluster.{key}")
    return entries


def from_tf_config(env: Mapping[str, str], opts: RunOptions) -> Role:
    """Kubeflow's TF_CONFIG: `ps` tasks serve (shard i = ps i, on its entry's port); the chief (or
    worker 0 where there is none) is rank 0, the `worker` tasks follow in order."""
    text = need(env, "TF_CONFIG", "Kubeflow's TFJob/TrainJob sets it")
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise refuse(f"TF_CONFIG is not valid JSON: {exc}") from None
    if not isinstance(config, dict) or not isinstance(config.get("cluster"), dict):
        raise refuse("TF_CONFIG has no \"cluster\" object")
    if not isinstance(config.get("task"), dict):
        raise refuse("TF_CONFIG has no \"task\" object (type and index of this process)")
    cluster, task = config["cluster"], config["task"]
    ps = _tf_list(cluster, "ps")
    if not ps:
        raise refuse("TF_CONFIG has no cluster.ps entries: psgrad's servers are the ps tasks")
    chiefs = [e for key in TF_CHIEF_TYPES for e in _tf_list(cluster, key)]
    if len(chiefs) > 1:
        raise refuse(f"TF_CONFIG names {len(chiefs)} chief/master tasks, at most one is allowed: {chiefs}")
    trainers = chiefs + _tf_list(cluster, "worker")
    if not trainers:
        raise refuse("TF_CONFIG has no cluster.chief or cluster.worker entries: a job needs >= 1 worker")
    kind, index = task.get("type"), task.get("index", 0)
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise refuse(f"TF_CONFIG task.index must be an integer >= 0, got {index!r}")
    check_flag("--num-servers", opts.num_servers, "TF_CONFIG (its cluster.ps)", len(ps))
    check_flag("--num-workers", opts.num_workers, "TF_CONFIG (its chief and worker entries)", len(trainers))
    make = functools.partial(Role, engine="tf-config", num_servers=len(ps), num_workers=len(trainers))
    if kind == "ps":
        if index >= len(ps):
            raise refuse(f"TF_CONFIG task.index {index} is out of range: cluster.ps has {len(ps)} entries")
        host, port = split_address(ps[index], "TF_CONFIG cluster.ps")
        return make(kind=SERVER, index=index, bind_host=opts.host, port=port, advertise_host=host)
    if kind in TF_CHIEF_TYPES or kind == "worker":
        group = chiefs if kind in TF_CHIEF_TYPES else trainers[len(chiefs):]
        if index >= len(group):
            raise refuse(f"TF_CONFIG task.index {index} is out of range: cluster.{kind} has {len(group)} entries")
        rank = index if kind in TF_CHIEF_TYPES else len(chiefs) + index
        return make(kind=WORKER, index=rank, servers=tuple(ps))
    raise refuse(f"TF_CONFIG task.type {kind!r} is not one psgrad runs: expected ps, chief, master or worker")


# --------------------------------------------------------------------------- torchrun
def from_torchrun(env: Mapping[str, str], opts: RunOptions) -> Role:
    """torchrun / torch elastic: two role groups (ROLE_NAME server|ps and worker), or one group whose
    first --num-servers ranks serve. Servers bind any free port and publish HOST:PORT in the
    rendezvous TCPStore at MASTER_ADDR:MASTER_PORT, where the workers read them."""
    why = "torchrun sets it for every process it starts"
    rank = need_int(env, "RANK", why)
    world = need_int(env, "WORLD_SIZE", why, low=1)
    if rank >= world:
        raise refuse(f"RANK={rank} must be < WORLD_SIZE={world}")
    master_port = need_int(env, "MASTER_PORT", why, low=1)
    store = StoreInfo(
        host=need(env, "MASTER_ADDR", why), port=master_port,
        # With the agent's store (c10d rendezvous, torch >= 2.4's default) every process is a client;
        # without it, global rank 0 hosts the store at MASTER_ADDR:MASTER_PORT, as torch.distributed does.
        is_master=env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and rank == 0,
        prefix=f"psgrad/{env.get('TORCHELASTIC_RUN_ID', 'none')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}",
    )
    role = env.get("ROLE_NAME", "").strip()
    if role in TORCH_SERVER_ROLES or role in TORCH_WORKER_ROLES:
        role_rank = need_int(env, "ROLE_RANK", why)
        role_world = need_int(env, "ROLE_WORLD_SIZE", why, low=1)
        if role_rank >= role_world or role_world > world:
            raise refuse(f"ROLE_RANK={role_rank}, ROLE_WORLD_SIZE={role_world} and WORLD_SIZE={world} do not fit")
        if role_world == world:
            other = "worker" if role in TORCH_SERVER_ROLES else "server"
            raise refuse(f"ROLE_NAME={role}: ROLE_WORLD_SIZE = WORLD_SIZE = {world}, so there are no {other}s; "
                         f"start a `torchrun --role {other}` group in the same rendezvous")
        serving = role in TORCH_SERVER_ROLES
        num_servers, num_workers = (role_world, world - role_world) if serving else (world - role_world, role_world)
        check_flag("--num-servers", opts.num_servers, "ROLE_WORLD_SIZE/WORLD_SIZE", num_servers)
        kind, index = (SERVER if serving else WORKER), role_rank
    elif role in TORCH_SPLIT_ROLES:
        if opts.num_servers is None:
            raise refuse(f"ROLE_NAME={role or '(unset)'}: one torchrun group serves and trains, so pass "
                         "--num-servers S (its first S ranks serve), or use torchrun --role server/worker groups")
        num_servers = opts.num_servers
        if num_servers >= world:
            raise refuse(f"--num-servers {num_servers} leaves no worker among WORLD_SIZE={world} processes")
        num_workers = world - num_servers
        kind, index = (SERVER, rank) if rank < num_servers else (WORKER, rank - num_servers)
    else:
        raise refuse(f"ROLE_NAME={role!r} is not a psgrad role: use torchrun --role server (or ps) and "
                     "--role worker, or no --role with --num-servers")
    check_flag("--num-workers", opts.num_workers, "WORLD_SIZE and the servers", num_workers)
    return Role(
        engine="torchrun", kind=kind, index=index, num_servers=num_servers, num_workers=num_workers,
        bind_host=opts.host, port=0, advertise_host=opts.advertise_host or opts.hostname, store=store,
    )


# --------------------------------------------------------------------------- Kubernetes
def from_k8s(env: Mapping[str, str], opts: RunOptions) -> Role:
    """A Kubernetes Indexed Job (or a JobSet's): JOB_COMPLETION_INDEX is the shard or rank; --role says
    which Job this pod belongs to; server i is reached at the --server-names pattern, port --port-base."""
    index = need_int(env, "JOB_COMPLETION_INDEX", "Kubernetes sets it in the pods of an Indexed Job")
    missing = [flag for flag, value in (("--role", opts.role), ("--num-servers", opts.num_servers),
               ("--num-workers", opts.num_workers), ("--server-names", opts.server_names)) if value is None]
    if missing:
        raise refuse(f"JOB_COMPLETION_INDEX={index} is set (a Kubernetes Indexed Job), which does not say the "
                     f"job's layout: pass {', '.join(missing)} (`psgrad k8s` writes them into the manifests)")
    assert opts.role is not None and opts.num_servers is not None and opts.num_workers is not None
    pattern = opts.server_names or ""
    if "{i}" not in pattern:
        raise refuse(f"--server-names {pattern!r} must contain {{i}} (the server's index), "
                     "e.g. job-server-{i}.job-svc")
    count = opts.num_servers if opts.role == SERVER else opts.num_workers
    if index >= count:
        raise refuse(f"JOB_COMPLETION_INDEX={index} is out of range for {count} {opts.role}(s)")
    names = [pattern.replace("{i}", str(i)) for i in range(opts.num_servers)]
    servers = tuple(f"{name}:{opts.port_base}" for name in names)
    make = functools.partial(Role, engine="k8s", index=index, num_servers=opts.num_servers, num_workers=opts.num_workers)
    if opts.role == SERVER:
        return make(kind=SERVER, bind_host=opts.host, port=opts.port_base, advertise_host=names[index],
                    servers=servers)
    return make(kind=WORKER, servers=servers)


# --------------------------------------------------------------------------- detection
READERS = {"tf-config": from_tf_config, "torchrun": from_torchrun, "slurm": from_slurm, "k8s": from_k8s}
# The variable that marks each engine, most specific first: torchrun inside a SLURM allocation or a
# pod sees both, and its own variables describe the processes it started.
MARKERS = (("tf-config", "TF_CONFIG"), ("torchrun", "TORCHELASTIC_RUN_ID"), ("torchrun", "ROLE_NAME"),
           ("k8s", "JOB_COMPLETION_INDEX"), ("slurm", "SLURM_PROCID"))


def detect_engine(env: Mapping[str, str]) -> str:
    for engine, variable in MARKERS:
        if env.get(variable, "").strip():
            return engine
    raise refuse("no cluster environment found: none of TF_CONFIG, TORCHELASTIC_RUN_ID/ROLE_NAME (torchrun), "
                 "JOB_COMPLETION_INDEX (Kubernetes) or SLURM_PROCID (SLURM) is set; run under one of them, "
                 "or start servers and workers with `psgrad server` / `psgrad worker`")



def local_rank(env: Mapping[str, str]) -> int | None:
    """This process's index on its host (None where no engine says), so that a worker on a host with
    several GPUs takes its own (cuda:LOCAL_RANK mod GPUs), and its own cores under --bind-cores."""
    return _on_host(env, LOCAL_RANK_VARIABLES, "the process's index on its host, which picks its GPU and cores", 0)


def local_workers(env: Mapping[str, str]) -> int | None:
    """How many processes the engine starts on this process's host (None where no engine says): the
    count whose equal runs of cores --bind-cores gives out."""
    return _on_host(env, LOCAL_WORKERS_VARIABLES, "the processes on the host, which share its cores", 1)


def _on_host(env: Mapping[str, str], names: tuple[str, ...], why: str, low: int) -> int | None:
    for name in names:
        if env.get(name, "").strip():
            return need_int(env, name, why, low)
    return None


def resolve(env: Mapping[str, str], opts: RunOptions, engine: str = "auto") -> Role:
    """This process's role, from `engine`'s variables (auto: the first engine whose marker is set)."""
    if engine != "auto" and engine not in ENGINES:
        raise refuse(f"--engine must be auto or one of {', '.join(ENGINES)}, got {engine!r}")
    chosen = detect_engine(env) if engine == "auto" else engine
    role = READERS[chosen](env, opts)
    if opts.role is not None and opts.role != role.kind:
        raise refuse(f"--role {opts.role} contradicts the {chosen} environment, which makes this process "
                     f"{role.describe().split(',')[0]}")
    return role
