"""SLURM's environment -> a Role: `srun --multi-prog` (one step, the first S tasks serve) or a
heterogeneous job (component 0 serves, component 1 trains).

SLURM has no store, so the addresses follow from the layout: tasks are numbered in order over the
step's nodes (block distribution: the first TASKS_PER_NODE[0] tasks on the first node, and so on),
servers are the first S tasks, and server i listens on --port-base + i on its node."""
from __future__ import annotations

import functools
from collections.abc import Mapping

from psgrad.errors import ConfigError
from psgrad.launch.hostlist import expand_counts, expand_hostlist, node_of_tasks
from psgrad.launch.roles import SERVER, WORKER, Role, RunOptions, check_flag, need_int, refuse

WHY = "srun sets it in every task"


def _first(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str]:
    """(name, value) of the first of names that is set, or a refusal naming them all."""
    for name in names:
        if env.get(name, "").strip():
            return name, env[name].strip()
    raise refuse(f"{names[0]} is not set ({WHY}; also looked for {', '.join(names[1:])})")


def _task_nodes(env: Mapping[str, str], nodes_names: tuple[str, ...], counts_names: tuple[str, ...]) -> list[str]:
    """The node each task of the step (or of one het component) runs on, in task order, from the
    first of nodes_names (a node list) and of counts_names (tasks per node) that is set."""
    nodes_var, nodes_text = _first(env, nodes_names)
    counts_var, counts_text = _first(env, counts_names)
    try:
        nodes = expand_hostlist(nodes_text)
    except ConfigError as exc:
        raise refuse(f"{nodes_var}: {exc}") from None
    try:
        counts = expand_counts(counts_text)
    except ConfigError as exc:
        raise refuse(f"{counts_var}: {exc}") from None
    if len(counts) != len(nodes):
        raise refuse(f"{counts_var}={counts_text!r} gives task counts for {len(counts)} node(s), but "
                     f"{nodes_var}={nodes_text!r} names {len(nodes)}")
    return node_of_tasks(nodes, counts)


STEP_NODES = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
STEP_COUNTS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")


def _component(name: str, g: int) -> tuple[str, ...]:
    """The names SLURM gives variable `name` of het component g: SLURM_JOB_NODELIST_HET_GROUP_1 (since
    20.02), its older copy SLURM_JOB_NODELIST_PACK_GROUP_1 (which 22.05 still sets)."""
    return (f"{name}_HET_GROUP_{g}", f"{name}_PACK_GROUP_{g}")


def _het_layout(env: Mapping[str, str], het_size: int) -> tuple[list[str], list[str]]:
    """(server tasks' nodes, worker tasks' nodes) of a two-component heterogeneous step.

    SLURM describes each component by the job's variables with a _HET_GROUP_g suffix (node list,
    tasks per node, task count), and the step as a whole by SLURM_STEP_NODELIST and
    SLURM_STEP_TASKS_PER_NODE (every component's nodes and tasks); where the whole step's are set,
    they must place as many tasks on the same nodes. The SLURM_STEP_*_HET_GROUP_g names psgrad read
    before are still read, after the real ones."""
    if het_size != 2:
        raise refuse(f"SLURM_HET_SIZE={het_size}: psgrad runs a heterogeneous job of exactly 2 components "
                     "(0: servers, 1: workers)")
    groups = []
    for g in range(2):
        nodes = _task_nodes(
            env, (*_component("SLURM_JOB_NODELIST", g), f"SLURM_STEP_NODELIST_HET_GROUP_{g}",
                  f"SLURM_NODELIST_HET_GROUP_{g}"),
            (*_component("SLURM_TASKS_PER_NODE", g), f"SLURM_STEP_TASKS_PER_NODE_HET_GROUP_{g}"))
        var, text = _first(env, (*_component("SLURM_NTASKS", g), f"SLURM_STEP_NUM_TASKS_HET_GROUP_{g}"))
        if not text.isdigit() or int(text) != len(nodes):
            raise refuse(f"{var}={text!r} does not match the {len(nodes)} task(s) its node list and task "
                         "counts describe")
        groups.append(nodes)
    if all(env.get(v, "").strip() for v in STEP_NODES[:1] + STEP_COUNTS[:1]):
        step = _task_nodes(env, STEP_NODES[:1], STEP_COUNTS[:1])
        if sorted(step) != sorted(groups[0] + groups[1]):
            raise refuse(
                f"the step (SLURM_STEP_NODELIST={env['SLURM_STEP_NODELIST'].strip()!r}, SLURM_STEP_TASKS_PER_NODE="
                f"{env['SLURM_STEP_TASKS_PER_NODE'].strip()!r}) places {len(step)} task(s), but its components "
                f"(SLURM_JOB_NODELIST_HET_GROUP_0/1, SLURM_TASKS_PER_NODE_HET_GROUP_0/1) place {len(groups[0])} + "
                f"{len(groups[1])} elsewhere: run the whole allocation in one step (srun ... : ..., as `psgrad "
                "slurm --het` writes it)")
    return groups[0], groups[1]


def from_slurm(env: Mapping[str, str], opts: RunOptions) -> Role:
    """SLURM_PROCID, SLURM_NTASKS and the node list -> this task's role and every server's address."""
    procid = need_int(env, "SLURM_PROCID", WHY)
    het_text = env.get("SLURM_HET_SIZE", "").strip()
    if het_text:
        het_size = need_int(env, "SLURM_HET_SIZE", "a heterogeneous job sets it", low=1)
        server_nodes, worker_nodes = _het_layout(env, het_size)
        check_flag("--num-servers", opts.num_servers, "component 0 of the heterogeneous job", len(server_nodes))
        nodes = server_nodes + worker_nodes
        num_servers = len(server_nodes)
    else:
        ntasks = need_int(env, "SLURM_NTASKS", WHY, low=1)
        nodes = _task_nodes(env, STEP_NODES, STEP_COUNTS)
        if len(nodes) != ntasks:
            raise refuse(f"SLURM_NTASKS={ntasks}, but the step's task counts place {len(nodes)} task(s) "
                         "(SLURM_STEP_TASKS_PER_NODE)")
        if opts.num_servers is None:
            raise refuse(f"SLURM_NTASKS={ntasks} tasks in one step: pass --num-servers S (the first S tasks "
                         "serve), or run a heterogeneous job (SLURM_HET_SIZE) whose component 0 serves")
        num_servers = opts.num_servers
    if procid >= len(nodes):
        raise refuse(f"SLURM_PROCID={procid} is out of range for the step's {len(nodes)} task(s)")
    if num_servers >= len(nodes):
        raise refuse(f"--num-servers {num_servers} leaves no worker among the step's {len(nodes)} task(s)")
    num_workers = len(nodes) - num_servers
    check_flag("--num-workers", opts.num_workers, "the step's task count less the servers", num_workers)
    here = env.get("SLURMD_NODENAME", "").strip()
    if here and here != nodes[procid]:
        raise refuse(f"SLURMD_NODENAME={here}, but task {procid} should be on {nodes[procid]} under block "
                     "distribution (SLURM_STEP_TASKS_PER_NODE): run srun with --distribution=block")
    if opts.port_base + num_servers - 1 > 65535:
        raise refuse(f"--port-base {opts.port_base} + {num_servers} servers runs past port 65535")
    servers = tuple(f"{nodes[i]}:{opts.port_base + i}" for i in range(num_servers))
    make = functools.partial(Role, engine="slurm", num_servers=num_servers, num_workers=num_workers, servers=servers)
    if procid < num_servers:
        return make(kind=SERVER, index=procid, bind_host=opts.host, port=opts.port_base + procid,
                    advertise_host=nodes[procid])
    return make(kind=WORKER, index=procid - num_servers)
