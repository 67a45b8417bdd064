"""`psgrad run`'s environment readers: TF_CONFIG, torchrun, SLURM and Kubernetes -> Role, and their refusals."""
from __future__ import annotations

import json
import re
from typing import Any

import pytest

from psgrad.errors import ConfigError
from psgrad.launch.env import detect_engine, resolve
from psgrad.launch.roles import LaunchEnvironmentError, Role, RunOptions

pytestmark = pytest.mark.timeout(30)

PS = ["ps-0.svc:2222", "ps-1.svc:2222"]
WORKERS = ["w-0.svc:2222", "w-1.svc:2222", "w-2.svc:2222"]


def tf_env(task_type: str, index: int, chief: bool = False, **cluster: Any) -> dict[str, str]:
    spec: dict[str, Any] = {"ps": PS, "worker": WORKERS, **cluster}
    if chief:
        spec["chief"] = ["chief-0.svc:2222"]
    return {"TF_CONFIG": json.dumps({"cluster": spec, "task": {"type": task_type, "index": index}})}


def refused(env: dict[str, str], opts: RunOptions | None = None, engine: str = "auto") -> str:
    with pytest.raises(LaunchEnvironmentError) as info:
        resolve(env, opts or RunOptions(), engine)
    assert isinstance(info.value, ConfigError)  # a usage error: exit 2
    return str(info.value)


# --------------------------------------------------------------------------- TF_CONFIG
def test_tf_config_ps_tasks_serve_on_their_entrys_port() -> None:
    role = resolve(tf_env("ps", 1), RunOptions())
    assert (role.engine, role.kind, role.index, role.num_servers, role.num_workers) == ("tf-config", "server", 1, 2, 3)
    assert (role.bind_host, role.port, role.advertise_host) == ("0.0.0.0", 2222, "ps-1.svc")
    assert resolve(tf_env("ps", 0), RunOptions(host="10.0.0.5")).bind_host == "10.0.0.5"


def test_tf_config_without_chief_worker_0_is_the_chief() -> None:
    ranks = [resolve(tf_env("worker", i), RunOptions()) for i in range(3)]
    assert [(r.kind, r.index, r.num_workers) for r in ranks] == [("worker", 0, 3), ("worker", 1, 3), ("worker", 2, 3)]
    assert all(r.servers == tuple(PS) for r in ranks)


def test_tf_config_with_chief_the_chief_is_rank_0_and_workers_follow() -> None:
    chief = resolve(tf_env("chief", 0, chief=True), RunOptions())
    assert (chief.kind, chief.index, chief.num_workers) == ("worker", 0, 4)
    assert [resolve(tf_env("worker", i, chief=True), RunOptions()).index for i in range(3)] == [1, 2, 3]
    master = resolve(tf_env("master", 0, master=["m:1"]), RunOptions())  # older TFJobs' name for the chief
    assert (master.index, master.num_workers) == (0, 4)


@pytest.mark.parametrize(
    "env, words",
    [
        ({}, ["TF_CONFIG"]),
        ({"TF_CONFIG": "{not json"}, ["TF_CONFIG", "JSON"]),
        ({"TF_CONFIG": json.dumps({"task": {"type": "ps", "index": 0}})}, ["TF_CONFIG", "cluster"]),
        ({"TF_CONFIG": json.dumps({"cluster": {"ps": PS, "worker": WORKERS}})}, ["TF_CONFIG", "task"]),
        (tf_env("ps", 2), ["TF_CONFIG", "task.index 2", "2 entries"]),
        (tf_env("worker", 3), ["TF_CONFIG", "task.index 3"]),
        (tf_env("evaluator", 0), ["TF_CONFIG", "evaluator"]),
        (tf_env("ps", -1), ["TF_CONFIG", "task.index"]),
        (tf_env("worker", 0, ps=[]), ["TF_CONFIG", "cluster.ps"]),
        (tf_env("worker", 0, ps=["nohostport"]), ["TF_CONFIG", "nohostport"]),
        (tf_env("chief", 0, chief=True, master=["m:1"]), ["TF_CONFIG", "chief"]),
    ],
)
def test_tf_config_refusals_name_the_variable(env: dict[str, str], words: list[str]) -> None:
    message = refused(env, engine="tf-config")
    for word in words:
        assert word in message


def test_tf_config_contradicting_flags_are_refused() -> None:
    assert "--num-servers 3" in refused(tf_env("ps", 0), RunOptions(num_servers=3))
    assert "--num-workers 2" in refused(tf_env("ps", 0), RunOptions(num_workers=2))
    message = refused(tf_env("ps", 0), RunOptions(role="worker"))
    assert "--role worker" in message and "server 0" in message


# --------------------------------------------------------------------------- torchrun
def torch_env(rank: int, world: int, role: str = "default", role_rank: int | None = None,
              role_world: int | None = None, agent_store: bool = True) -> dict[str, str]:
    return {
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
        "ROLE_NAME": role, "ROLE_RANK": str(rank if role_rank is None else role_rank),
        "ROLE_WORLD_SIZE": str(world if role_world is None else role_world),
        "MASTER_ADDR": "node-a", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job7",
        "TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_USE_AGENT_STORE": str(agent_store),
    }


def test_torchrun_one_group_first_ranks_serve() -> None:
    opts = RunOptions(num_servers=2, hostname="node-b")
    roles = [resolve(torch_env(r, 5), opts) for r in range(5)]
    assert [(r.kind, r.index) for r in roles] == [("server", 0), ("server", 1), ("worker", 0), ("worker", 1), ("worker", 2)]
    assert all((r.num_servers, r.num_workers, r.engine) == (2, 3, "torchrun") for r in roles)
    server = roles[1]
    assert (server.port, server.advertise_host, server.servers) == (0, "node-b", ())
    assert server.store is not None and server.store.key(1) == "psgrad/job7/1/server/1"
    assert (server.store.host, server.store.port, server.store.is_master) == ("node-a", 29500, False)
    assert resolve(torch_env(0, 5), RunOptions(num_servers=2, advertise_host="10.1.2.3")).advertise_host == "10.1.2.3"


def test_torchrun_role_groups() -> None:
    # torchrun --role server --nproc-per-node 2 on one node, --role worker --nproc-per-node 3 on another
    servers = [resolve(torch_env(r, 5, "server", r, 2), RunOptions()) for r in range(2)]
    workers = [resolve(torch_env(2 + r, 5, "worker", r, 3), RunOptions()) for r in range(3)]
    assert [(r.kind, r.index, r.num_servers, r.num_workers) for r in servers + workers] == [
        ("server", 0, 2, 3), ("server", 1, 2, 3), ("worker", 0, 2, 3), ("worker", 1, 2, 3), ("worker", 2, 2, 3)]
    assert resolve(torch_env(0, 5, "ps", 0, 2), RunOptions()).kind == "server"


def test_torchrun_without_the_agent_store_rank_0_hosts_it() -> None:
    assert resolve(torch_env(0, 3, agent_store=False), RunOptions(num_servers=1)).store.is_master  # type: ignore[union-attr]
    assert not resolve(torch_env(1, 3, agent_store=False), RunOptions(num_servers=1)).store.is_master  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "env, opts, words",
    [
        (torch_env(0, 4), RunOptions(), ["ROLE_NAME", "--num-servers"]),
        (torch_env(0, 4), RunOptions(num_servers=4), ["--num-servers 4", "WORLD_SIZE=4"]),
        (torch_env(0, 2, "server", 0, 2), RunOptions(), ["ROLE_WORLD_SIZE", "--role worker"]),
        (torch_env(0, 4, "trainers", 0, 2), RunOptions(), ["ROLE_NAME='trainers'"]),
        (torch_env(3, 2), RunOptions(num_servers=1), ["RANK=3", "WORLD_SIZE=2"]),
        ({**torch_env(0, 4), "MASTER_PORT": "x"}, RunOptions(num_servers=1), ["MASTER_PORT"]),
        ({k: v for k, v in torch_env(0, 4).items() if k != "MASTER_ADDR"}, RunOptions(num_servers=1), ["MASTER_ADDR"]),
        (torch_env(0, 5, "server", 0, 2), RunOptions(num_servers=3), ["--num-servers 3", "ROLE_WORLD_SIZE"]),
    ],
)
def test_torchrun_refusals_name_the_variable(env: dict[str, str], opts: RunOptions, words: list[str]) -> None:
    message = refused(env, opts)
    for word in words:
        assert word in message


# --------------------------------------------------------------------------- SLURM
def slurm_env(procid: int, **extra: str) -> dict[str, str]:
    env = {"SLURM_PROCID": str(procid), "SLURM_NTASKS": "5", "SLURM_STEP_NODELIST": "node[01-02],gpu5",
           "SLURM_STEP_TASKS_PER_NODE": "2(x2),1"}
    return {**env, **extra}


def test_slurm_multi_prog_first_tasks_serve_on_port_base_plus_i() -> None:
    opts = RunOptions(num_servers=3, port_base=9000)
    roles = [resolve(slurm_env(t), opts) for t in range(5)]
    assert [(r.kind, r.index) for r in roles] == [("server", 0), ("server", 1), ("server", 2), ("worker", 0), ("worker", 1)]
    expected = ("node01:9000", "node01:9001", "node02:9002")
    assert all(r.servers == expected and r.num_workers == 2 for r in roles)
    assert (roles[2].port, roles[2].advertise_host, roles[2].bind_host) == (9002, "node02", "0.0.0.0")
    # the older variable names work too
    old = {"SLURM_PROCID": "4", "SLURM_NTASKS": "5", "SLURM_NODELIST": "node[01-02],gpu5", "SLURM_TASKS_PER_NODE": "2(x2),1"}
    assert resolve(old, opts).servers == expected


def het_env(procid: int, pack: bool = True, step: bool = True) -> dict[str, str]:
    """What SLURM 22.05 sets in a task of a two-component het step (`srun ... : ...`): each component's
    job variables with the suffix _HET_GROUP_g (and _PACK_GROUP_g copies), and the whole step's node
    list and tasks per node; component 0 has 1 task on each of cpu1, cpu2, component 1 2 on gpu07
    and 1 on gpu08."""
    env = {"SLURM_PROCID": str(procid), "SLURM_HET_SIZE": "2", "SLURM_NTASKS": "5"}
    for g, (nodes, counts, ntasks) in enumerate((("cpu[1-2]", "1(x2)", "2"), ("gpu[07-08]", "2,1", "3"))):
        for kind in ("HET", "PACK") if pack else ("HET",):
            env.update({f"SLURM_JOB_NODELIST_{kind}_GROUP_{g}": nodes, f"SLURM_TASKS_PER_NODE_{kind}_GROUP_{g}": counts,
                        f"SLURM_NTASKS_{kind}_GROUP_{g}": ntasks})
    if step:
        env.update({"SLURM_STEP_NODELIST": "cpu[1-2],gpu[07-08]", "SLURM_STEP_TASKS_PER_NODE": "1(x2),2,1"})
    return env


def test_slurm_het_job_component_0_serves() -> None:
    roles = [resolve(het_env(t), RunOptions()) for t in range(5)]
    assert [(r.kind, r.index) for r in roles] == [("server", 0), ("server", 1), ("worker", 0), ("worker", 1), ("worker", 2)]
    assert all(r.servers == (f"cpu1:{7070}", f"cpu2:{7071}") and r.num_workers == 3 for r in roles)
    assert roles[1].advertise_host == "cpu2"
    here = {**het_env(3), "SLURMD_NODENAME": "gpu07"}  # task 3 = worker 1, the second task on gpu07
    assert resolve(here, RunOptions()).index == 1


def test_slurm_het_job_reads_the_pack_copies_and_the_old_names() -> None:
    """Before 20.02 SLURM wrote _PACK_GROUP_ only; psgrad's SLURM_STEP_*_HET_GROUP_* names of before
    still work after the real ones."""
    pack_only = {k: v for k, v in het_env(0).items() if "_HET_GROUP_" not in k}
    old = {"SLURM_PROCID": "0", "SLURM_HET_SIZE": "2",
           "SLURM_STEP_NODELIST_HET_GROUP_0": "cpu[1-2]", "SLURM_STEP_TASKS_PER_NODE_HET_GROUP_0": "1(x2)",
           "SLURM_STEP_NUM_TASKS_HET_GROUP_0": "2",
           "SLURM_STEP_NODELIST_HET_GROUP_1": "gpu[07-08]", "SLURM_STEP_TASKS_PER_NODE_HET_GROUP_1": "2,1",
           "SLURM_STEP_NUM_TASKS_HET_GROUP_1": "3"}
    for env in (pack_only, old, het_env(0, pack=False, step=False)):
        got = resolve(env, RunOptions())
        assert (got.kind, got.index, got.servers, got.num_workers) == ("server", 0, ("cpu1:7070", "cpu2:7071"), 3)


@pytest.mark.parametrize(
    "env, opts, words",
    [
        ({}, RunOptions(num_servers=1), ["SLURM_PROCID"]),
        (slurm_env(0), RunOptions(), ["--num-servers", "SLURM_HET_SIZE"]),
        (slurm_env(0, SLURM_NTASKS="6"), RunOptions(num_servers=1), ["SLURM_NTASKS=6"]),
        (slurm_env(5), RunOptions(num_servers=1), ["SLURM_PROCID=5"]),
        (slurm_env(0, SLURM_STEP_NODELIST="node[01-"), RunOptions(num_servers=1), ["SLURM_STEP_NODELIST", "'['"]),
        (slurm_env(0, SLURM_STEP_TASKS_PER_NODE="2(x3)"), RunOptions(num_servers=1), ["SLURM_STEP_TASKS_PER_NODE"]),
        (slurm_env(0, SLURM_STEP_TASKS_PER_NODE="two"), RunOptions(num_servers=1), ["SLURM_STEP_TASKS_PER_NODE"]),
        ({k: v for k, v in slurm_env(0).items() if "TASKS_PER_NODE" not in k}, RunOptions(num_servers=1),
         ["SLURM_STEP_TASKS_PER_NODE"]),
        (slurm_env(2, SLURMD_NODENAME="gpu5"), RunOptions(num_servers=1), ["SLURMD_NODENAME=gpu5", "block"]),
        (slurm_env(0), RunOptions(num_servers=5), ["--num-servers 5"]),
        ({**het_env(0), "SLURM_HET_SIZE": "3"}, RunOptions(), ["SLURM_HET_SIZE=3"]),
        ({**het_env(0), "SLURM_NTASKS_HET_GROUP_1": "4"}, RunOptions(), ["SLURM_NTASKS_HET_GROUP_1='4'"]),
        ({k: v for k, v in het_env(0).items() if not k.startswith("SLURM_TASKS_PER_NODE_")}, RunOptions(),
         ["SLURM_TASKS_PER_NODE_HET_GROUP_0 is not set", "SLURM_TASKS_PER_NODE_PACK_GROUP_0"]),
        ({k: v for k, v in het_env(0).items() if "NODELIST_" not in k}, RunOptions(),
         ["SLURM_JOB_NODELIST_HET_GROUP_0 is not set"]),
        ({**het_env(0), "SLURM_STEP_TASKS_PER_NODE": "1(x2),1,1"}, RunOptions(),  # srun ran fewer tasks
         ["SLURM_STEP_TASKS_PER_NODE='1(x2),1,1') places 4 task(s)", "2 + 3", "srun ... : ..."]),
        (het_env(0), RunOptions(num_servers=1), ["--num-servers 1", "component 0"]),
    ],
)
def test_slurm_refusals_name_the_variable(env: dict[str, str], opts: RunOptions, words: list[str]) -> None:
    message = refused(env, opts, engine="slurm")
    for word in words:
        assert word in message


# --------------------------------------------------------------------------- Kubernetes
K8S = RunOptions(num_servers=2, num_workers=3, server_names="job-server-{i}.job", port_base=7000)


def test_k8s_index_and_role_flags() -> None:
    server = resolve({"JOB_COMPLETION_INDEX": "1"}, RunOptions(**{**K8S.__dict__, "role": "server"}))
    assert (server.kind, server.index, server.port, server.advertise_host) == ("server", 1, 7000, "job-server-1.job")
    worker = resolve({"JOB_COMPLETION_INDEX": "2"}, RunOptions(**{**K8S.__dict__, "role": "worker"}))
    assert (worker.kind, worker.index, worker.num_workers) == ("worker", 2, 3)
    assert worker.servers == ("job-server-0.job:7000", "job-server-1.job:7000")


@pytest.mark.parametrize(
    "env, changes, words",
    [
        ({"JOB_COMPLETION_INDEX": "0"}, {"role": None}, ["JOB_COMPLETION_INDEX", "--role"]),
        ({"JOB_COMPLETION_INDEX": "0"}, {"role": "worker", "server_names": None}, ["--server-names"]),
        ({"JOB_COMPLETION_INDEX": "0"}, {"role": "worker", "server_names": "job-server.job"}, ["{i}"]),
        ({"JOB_COMPLETION_INDEX": "2"}, {"role": "server"}, ["JOB_COMPLETION_INDEX=2", "2 server"]),
        ({"JOB_COMPLETION_INDEX": "-1"}, {"role": "server"}, ["JOB_COMPLETION_INDEX=-1"]),
    ],
)
def test_k8s_refusals_name_the_variable(env: dict[str, str], changes: dict[str, Any], words: list[str]) -> None:
    message = refused(env, RunOptions(**{**K8S.__dict__, **changes}), engine="k8s")
    for word in words:
        assert word in message


# --------------------------------------------------------------------------- detection
def test_detection_prefers_the_most_specific_engine() -> None:
    assert detect_engine(tf_env("ps", 0)) == "tf-config"
    assert detect_engine({**slurm_env(0), **torch_env(0, 3)}) == "torchrun"  # torchrun inside an allocation
    assert detect_engine({**slurm_env(0), "JOB_COMPLETION_INDEX": "0"}) == "k8s"
    assert detect_engine(slurm_env(0)) == "slurm"
    message = refused({"PATH": "/bin"})
    assert all(v in message for v in ("TF_CONFIG", "TORCHELASTIC_RUN_ID", "JOB_COMPLETION_INDEX", "SLURM_PROCID"))
    with pytest.raises(LaunchEnvironmentError, match="--engine"):
        resolve(slurm_env(0), RunOptions(num_servers=1), engine="mpi")


def test_options_and_roles_validate_themselves() -> None:
    with pytest.raises(ConfigError, match="--role"):
        RunOptions(role="chief")
    with pytest.raises(ConfigError, match="--port-base"):
        RunOptions(port_base=70000)
    with pytest.raises(ConfigError, match="index"):
        Role(engine="slurm", kind="worker", index=3, num_servers=1, num_workers=3, servers=("a:1",))
    with pytest.raises(ConfigError, match="advertise"):
        Role(engine="slurm", kind="server", index=0, num_servers=1, num_workers=1)


# --------------------------------------------------------------------------- when a server's job is over
def test_a_server_is_done_once_every_rank_has_left() -> None:
    from psgrad.cli.run import every_worker_left
    from psgrad.config import JobSpec
    from psgrad.core.status import EVICTED, LEFT, LIVE, ShardStatus, WorkerStatus

    def status(*states: str, workers: int = 2) -> ShardStatus:
        members = tuple(WorkerStatus(rank, 5, state, 0.1, 5) for rank, state in enumerate(states))
        return ShardStatus(initialized=True, spec=JobSpec(num_workers=workers), workers=members)

    assert every_worker_left(status(LEFT, LEFT))
    assert not every_worker_left(status(LEFT, LIVE))
    assert not every_worker_left(status(LEFT, EVICTED))  # it may come back; the engine stops a crashed job
    assert not every_worker_left(status(LEFT))  # rank 1 never joined yet
    assert not every_worker_left(status(LEFT, LEFT, workers=3))
    assert not every_worker_left(ShardStatus(initialized=False))


def test_loopback_advertise_names_are_recognized() -> None:
    from psgrad.cli.run import _is_loopback

    assert _is_loopback("127.0.0.1") and _is_loopback("::1") and _is_loopback("localhost")
    assert not _is_loopback("10.1.2.3") and not _is_loopback("no-such-host.invalid")


@pytest.mark.parametrize(
    "name, env, expected",
    [("local_rank", {}, None), ("local_rank", {"LOCAL_RANK": "3"}, 3), ("local_rank", {"SLURM_LOCALID": "2"}, 2),
     ("local_rank", {"LOCAL_RANK": "1", "SLURM_LOCALID": "5"}, 1), ("local_rank", {"LOCAL_RANK": " "}, None),
     ("local_workers", {}, None), ("local_workers", {"LOCAL_WORLD_SIZE": "4"}, 4),
     ("local_workers", {"SLURM_NTASKS_PER_NODE": "3"}, 3),
     ("local_workers", {"LOCAL_WORLD_SIZE": "2", "SLURM_NTASKS_PER_NODE": "8"}, 2),
     ("local_workers", {"LOCAL_WORLD_SIZE": ""}, None)],
)
def test_the_local_rank_and_workers_come_from_torchrun_then_slurm(
    name: str, env: dict[str, str], expected: int | None
) -> None:
    from psgrad.launch import env as launch_env

    assert getattr(launch_env, name)(env) == expected


@pytest.mark.parametrize(
    "name, variable, value, message",
    [("local_rank", "LOCAL_RANK", "x", "LOCAL_RANK='x' is not an integer"),
     ("local_rank", "LOCAL_RANK", "-1", "LOCAL_RANK=-1 must be >= 0"),
     ("local_workers", "LOCAL_WORLD_SIZE", "two", "LOCAL_WORLD_SIZE='two' is not an integer"),
     ("local_workers", "LOCAL_WORLD_SIZE", "0", "LOCAL_WORLD_SIZE=0 must be >= 1")],
)
def test_a_bad_local_rank_or_workers_count_is_refused_naming_the_variable(
    name: str, variable: str, value: str, message: str
) -> None:
    from psgrad.launch import env as launch_env

    with pytest.raises(LaunchEnvironmentError, match=re.escape(message)):
        getattr(launch_env, name)({variable: value})
