"""The Ray backend's pure parts: node placement, GPU shares, where a server binds, the port a restarted
server binds again, the actors' output buffer, and the flags (Ray itself is not needed here)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from psgrad.cli.commands import server_metrics_argv
from psgrad.cli.launch_ray import RAY_FLAGS, ray_config, shard_configs
from psgrad.cli.main import main
from psgrad.cli.parser import build_parser
from psgrad.config import RayConfig
from psgrad.errors import ConfigError
from psgrad.launch.ray import Node, Placement, RayLaunchError, gpus_per_worker, nodes_of
from psgrad.launch.ray_actors import Output, _previous_port, _record_port, bind_host


def _entry(node_id: str, ip: str, cpus: float, gpus: float = 0, head: bool = False, alive: bool = True) -> dict:
    resources = {"CPU": cpus, **({"GPU": gpus} if gpus else {}), **({"node:__internal_head__": 1.0} if head else {})}
    return {"NodeID": node_id, "NodeManagerAddress": ip, "Alive": alive, "Resources": resources}


def test_nodes_are_the_live_ones_head_first() -> None:
    nodes = nodes_of([_entry("b", "10.0.0.2", 4), _entry("c", "10.0.0.3", 4, alive=False),
                      _entry("a", "10.0.0.4", 4), _entry("z", "10.0.0.1", 0, head=True)])
    assert [n.id for n in nodes] == ["z", "a", "b"]
    assert nodes[0] == Node("z", "10.0.0.1", 0.0, 0.0, True)


def _ids(nodes: list[Node]) -> list[str]:
    return [n.id for n in nodes]


def test_actors_spread_round_robin_over_the_nodes_that_have_their_resources() -> None:
    head, a, b = Node("h", "1", 0, 0, True), Node("a", "2", 8, 1, False), Node("b", "3", 8, 0, False)
    assert _ids(Placement([head, a, b]).place(4, 0, 0, "server")) == ["h", "a", "b", "h"]
    assert _ids(Placement([head, a, b]).place(3, 1, 0, "server")) == ["a", "b", "a"]  # the head has no CPU
    assert _ids(Placement([head, a, b]).place(2, 1, 0.5, "worker")) == ["a", "a"]  # only a has a GPU
    with pytest.raises(RayLaunchError, match="no node of the cluster has 1 CPU.* and 2 GPU.*--worker-cpus/--worker-gpus"):
        Placement([head, a, b]).place(1, 1, 2, "worker")
    with pytest.raises(RayLaunchError, match="lower --server-cpus or add nodes"):
        Placement([head]).place(1, 1, 0, "server")


def test_placement_passes_over_nodes_the_job_filled() -> None:
    two, one = Node("a", "1", 4, 2, False), Node("b", "2", 4, 1, False)
    placement = Placement([two, one])
    assert _ids(placement.place(2, 1, 0, "server")) == ["a", "b"]
    assert _ids(placement.place(3, 1, 1, "worker")) == ["a", "b", "a"]  # a has the second GPU
    assert _ids(placement.place(2, 1, 1, "worker")) == ["a", "b"]  # all GPUs taken: Ray queues them
    cpus = Placement([Node("a", "1", 2, 0, False), Node("b", "2", 8, 0, False)])
    assert _ids(cpus.place(5, 2, 0, "worker")) == ["a", "b", "b", "b", "b"]


@pytest.mark.parametrize(("gpus", "workers", "asked", "share"), [
    (0, 4, None, 0.0), (4, 4, None, 1.0), (8, 2, None, 1.0), (1, 4, None, 0.25), (3, 4, None, 0.5),
    (0.5, 2, None, 0.0), (0, 2, 1.0, 1.0), (2, 2, 0.5, 0.5),
])
def test_workers_get_a_gpu_each_or_an_even_share(gpus: float, workers: int, asked: float | None, share: float) -> None:
    assert gpus_per_worker(RayConfig(worker_gpus=asked), gpus, workers) == share


def test_servers_listen_on_loopback_only_when_the_job_is_on_this_machine() -> None:
    assert bind_host("10.1.2.3", local_only=True) == "127.0.0.1"
    assert bind_host("10.1.2.3", local_only=False) == "10.1.2.3"


def test_a_restarted_server_finds_the_port_of_its_own_job(tmp_path: Path) -> None:
    assert _previous_port(tmp_path / "shard0", "job1") == 0  # a first start: any free port
    _record_port(tmp_path / "shard0", "job1", 41234)
    assert _previous_port(tmp_path / "shard0", "job1") == 41234
    assert _previous_port(tmp_path / "shard0", "job2") == 0  # another job (a resumed one) starts afresh
    (tmp_path / "shard0" / "ray-port.json").write_text("{not json")
    assert _previous_port(tmp_path / "shard0", "job1") == 0


def test_output_is_read_on_from_an_index_and_from_the_start_after_a_restart() -> None:
    out = Output()
    out.add("a")
    out.add("b")
    pid, index, lines = out.since(None, 0)
    assert (pid, index, lines) == (os.getpid(), 2, ["a", "b"])
    out.add("c")
    assert out.since(pid, index) == (pid, 3, ["c"])
    assert out.since(pid + 1, 3) == (pid, 3, ["a", "b", "c"])  # another process: everything


def _launch(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["launch", *argv])


def test_ray_flags_default_to_the_config_and_are_refused_without_the_backend() -> None:
    assert ray_config(_launch()) is None
    assert set(RAY_FLAGS) == {"address", "server_cpus", "worker_cpus", "worker_gpus", "server_restarts",
                              "object_store_mb", "start_timeout_s"}
    pytest.importorskip("ray", reason="RayConfig of --backend ray is checked once Ray imports")
    assert ray_config(_launch("--backend", "ray")) == RayConfig()
    given = ray_config(_launch("--backend", "ray", "--address", "auto", "--worker-gpus", "0.5", "--server-restarts", "0"))
    assert given == RayConfig(address="auto", worker_gpus=0.5, server_restarts=0)


@pytest.mark.parametrize(("argv", "message"), [
    (["--address", "auto"], "--address is a flag of the Ray backend: add --backend ray"),
    (["--worker-gpus", "1"], "--worker-gpus is a flag of the Ray backend"),
    (["--backend", "ray", "--replicas", "1"], "--replicas is for --backend local"),
    (["--backend", "ray", "--bind-cores"], "--bind-cores is for --backend local"),
    (["--backend", "ray", "--object-store-mb", "10"], "--object-store-mb must be >= 75"),
    (["--backend", "ray", "--worker-gpus", "1.5"], "--worker-gpus must be a fraction of one GPU or a whole number"),
])
def test_bad_ray_flags_are_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err


def test_without_ray_the_backend_is_a_usage_error_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'psgrad\[ray\]'"):
        ray_config(_launch("--backend", "ray"))
    assert main(["launch", "--backend", "ray", "--checkpoint-dir", str(tmp_path / "ck")]) == 2
    assert "pip install 'psgrad[ray]'" in capsys.readouterr().err
    assert not (tmp_path / "ck").exists()  # refused before anything was recorded


def test_an_address_where_nothing_listens_fails_fast() -> None:
    import socket

    from psgrad.launch.ray import check_reachable

    with socket.create_server(("127.0.0.1", 0)) as listening:
        check_reachable(f"127.0.0.1:{listening.getsockname()[1]}")
        check_reachable(f"ray://127.0.0.1:{listening.getsockname()[1]}")
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    with pytest.raises(ConnectionError, match=f"nothing answers at 127.0.0.1:{port}"):
        check_reachable(f"127.0.0.1:{port}", timeout_s=5)
    check_reachable("auto")  # Ray resolves it


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("flags", "ports"), [([], [None, None]), (["--metrics-port", "0"], [0, 0]),
                                              (["--metrics-port", "9100"], [9103, 9104])])
def test_ray_servers_get_the_metrics_ports_local_servers_get(flags: list[str], ports: list[int | None],
                                                               tmp_path: Path) -> None:
    # Before: a server actor's config had no metrics port, whatever --metrics-port said.
    ns = build_parser().parse_args(["launch", "--backend", "ray", "--num-servers", "2", "--num-workers", "3",
                                    "--checkpoint-dir", str(tmp_path), *flags])
    configs = shard_configs(ns)
    assert [c.metrics_port for c in configs] == ports
    local = [server_metrics_argv(ns, i) for i in range(2)]  # what the local backend passes its servers
    assert local == [[] if p is None else ["--metrics-port", str(p)] for p in ports]
    assert [c.checkpoint_dir for c in configs] == [str(tmp_path.absolute() / f"shard{i}") for i in range(2)]


def test_ray_servers_get_the_read_bound_launch_was_given() -> None:
    ns = build_parser().parse_args(["launch", "--backend", "ray", "--num-servers", "2", "--max-read-mb", "32"])
    assert [c.max_read_mb for c in shard_configs(ns)] == [32, 32]
    ns = build_parser().parse_args(["launch", "--backend", "ray", "--num-servers", "1"])
    assert [c.max_read_mb for c in shard_configs(ns)] == [256]
