"""Which cores a worker binds to (core/cores.py): the host's cores split in equal runs by local rank,
the rank and count from torchrun's or SLURM's variables where not given, clear errors otherwise; a
SLURM task that SLURM bound keeps its cores; a server thread that follows its peer's cores."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import pytest

from psgrad.core.cores import bind_cores, engine_binding, share
from psgrad.server.scheduling import PeerCores
from psgrad.errors import ConfigError

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("rank, workers, cores, expected", [
    (0, 2, [0, 1, 2, 3], [0, 1]),
    (1, 2, [0, 1, 2, 3], [2, 3]),
    (1, 2, [4, 6, 8, 10, 12], [8, 10]),  # (the remainder to none; the cores' own numbers)
    (2, 3, [0, 1], [0]),  # more workers than cores: rank mod cores
    (0, 1, [3, 1, 2], [1, 2, 3]),
])
def test_a_workers_share_is_its_run_of_the_hosts_cores(rank: int, workers: int, cores: list[int],
                                                         expected: list[int]) -> None:
    assert share(rank, workers, cores) == expected


@pytest.mark.parametrize("rank, workers", [(2, 2), (-1, 2), (0, 0)])
def test_a_rank_outside_the_workers_is_refused_by_name(rank: int, workers: int) -> None:
    with pytest.raises(ConfigError, match=f"local rank {rank} of {workers} workers"):
        share(rank, workers, [0, 1])


def test_without_a_rank_or_an_engines_variables_binding_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("LOCAL_RANK", "SLURM_LOCALID", "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="give local_rank, or run under torchrun or SLURM"):
        bind_cores()
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(ConfigError, match="LOCAL_RANK='x' is not a count"):
        bind_cores(local_workers=2)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and two cores")
def test_a_worker_binds_to_its_share_from_torchruns_variables_and_its_threads_inherit_it() -> None:
    """In a process of its own (a binding is the whole process's): LOCAL_RANK=1 of LOCAL_WORLD_SIZE=2
    binds to the second half of the cores, and a thread started afterwards runs there too."""
    cores = sorted(os.sched_getaffinity(0))
    code = ("import os, threading, psgrad\n"
            "got = psgrad.bind_cores()\n"
            "seen = []\n"
            "t = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0)))); t.start(); t.join()\n"
            "print(got, sorted(os.sched_getaffinity(0)), seen[0])\n")
    env = dict(os.environ, LOCAL_RANK="1", LOCAL_WORLD_SIZE="2")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    half = cores[len(cores) // 2:2 * (len(cores) // 2)]
    assert out.stdout.split("\n")[0] == f"{half} {half} {half}"


@pytest.mark.parametrize("env, bound", [
    ({"SLURM_LOCALID": "1", "SLURM_CPU_BIND_TYPE": "mask_cpu:"}, "SLURM_CPU_BIND_TYPE=mask_cpu:"),
    ({"SLURM_LOCALID": "0", "SLURM_CPU_BIND_TYPE": "cores"}, "SLURM_CPU_BIND_TYPE=cores"),
    ({"SLURM_LOCALID": "1", "SLURM_CPU_BIND_TYPE": "none"}, None),  # (--cpu-bind=none)
    ({"SLURM_LOCALID": "1", "SLURM_CPU_BIND_TYPE": "quiet,none"}, None),
    ({"SLURM_LOCALID": "1"}, None),  # (a cluster that binds nothing says nothing)
    ({"SLURM_CPU_BIND_TYPE": "mask_cpu:"}, None),  # (not a task: an allocation's shell, say)
    # torchrun started in a bound task: its processes share the task's cores, split by LOCAL_RANK
    ({"LOCAL_RANK": "1", "SLURM_LOCALID": "0", "SLURM_CPU_BIND_TYPE": "mask_cpu:"}, None),
])
def test_a_task_slurm_bound_is_told_from_one_it_did_not(env: dict[str, str], bound: str | None) -> None:
    found = engine_binding(env)
    assert found == bound if bound is None else bound in (found or "")


@pytest.mark.parametrize("rank, workers, kept", [(None, None, True), (1, None, True), (0, None, False),
                                                 (1, 2, False), (None, 2, False)])
def test_only_the_engines_own_rank_and_no_count_keep_its_binding(rank: int | None, workers: int | None,
                                                                  kept: bool) -> None:
    """psgrad run copies SLURM's rank into --local-rank: still the engine's; a count, or another
    rank, is the caller's own split of the cores."""
    env = {"SLURM_LOCALID": "1", "SLURM_CPU_BIND_TYPE": "mask_cpu:"}
    assert (engine_binding(env, rank, workers) is not None) == kept


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and two cores")
def test_a_task_slurm_bound_keeps_its_cores_unless_given_a_rank() -> None:
    """In a process of its own: a SLURM task under --cpu-bind (SLURM_CPU_BIND_TYPE) keeps the cores
    it has (its share already; no count needed), where the same task without a binding, or given a
    rank and count, is bound to its half."""
    cores = sorted(os.sched_getaffinity(0))
    half = cores[len(cores) // 2:2 * (len(cores) // 2)]
    code = ("import os, sys, psgrad\n"
            "got = psgrad.bind_cores(*map(int, sys.argv[1:]))\n"
            "print(got, sorted(os.sched_getaffinity(0)))\n")
    base = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    for env, argv, expected in (
        ({"SLURM_LOCALID": "1", "SLURM_CPU_BIND_TYPE": "mask_cpu:"}, [], cores),
        ({"SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2", "SLURM_CPU_BIND_TYPE": "none"}, [], half),
        ({"SLURM_LOCALID": "0", "SLURM_CPU_BIND_TYPE": "mask_cpu:"}, ["1", "2"], half),
    ):
        out = subprocess.run([sys.executable, "-c", code, *argv], env={**base, **env}, capture_output=True, text=True,
                             timeout=50)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split("\n")[0] == f"{expected} {expected}", (env, argv, out.stdout)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and two cores")
def test_a_thread_follows_its_unix_peers_cores_and_not_a_tcp_peers() -> None:
    """The threads start on every core; the peer (this process: its main thread) then binds to one,
    and each thread follows: the Unix socket's moves there, the TCP one's (no peer's cores to read)
    stays where it was."""
    everywhere = os.sched_getaffinity(0)
    last = max(everywhere)
    main = os.getpid()
    before = os.sched_getaffinity(main)
    seen: dict[str, set[int]] = {}
    go = threading.Event()
    unix = socket.socketpair(socket.AF_UNIX)
    listener = socket.create_server(("127.0.0.1", 0))
    tcp_client = socket.create_connection(listener.getsockname())
    tcp_server, _ = listener.accept()

    def serve(name: str, conn: socket.socket) -> None:
        cores = PeerCores(conn)
        go.wait(30)
        cores.follow()
        seen[name] = os.sched_getaffinity(0)

    threads = [threading.Thread(target=serve, args=("unix", unix[0])),
               threading.Thread(target=serve, args=("tcp", tcp_server))]
    try:
        for t in threads:
            t.start()
        os.sched_setaffinity(main, {last})
        go.set()
        for t in threads:
            t.join(30)
    finally:
        go.set()
        os.sched_setaffinity(main, before)
        for s in (*unix, listener, tcp_client, tcp_server):
            s.close()
    assert seen == {"unix": {last}, "tcp": everywhere}


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and two cores")
def test_a_thread_bound_elsewhere_stays_within_its_own_cores() -> None:
    """A server thread that started on one core (a server bound to cores of its own) does not move to
    a worker's other cores; where they share cores, it narrows to those."""
    everywhere = sorted(os.sched_getaffinity(0))
    first, last = everywhere[0], everywhere[-1]
    main = os.getpid()
    before = os.sched_getaffinity(main)
    seen: list[set[int]] = []
    steps = [threading.Event() for _ in range(2)]
    done = [threading.Event() for _ in range(2)]
    unix = socket.socketpair(socket.AF_UNIX)

    def serve() -> None:
        os.sched_setaffinity(0, {first})
        cores = PeerCores(unix[0])
        for step, finished in zip(steps, done):
            step.wait(30)
            cores.follow()
            seen.append(os.sched_getaffinity(0))
            finished.set()

    thread = threading.Thread(target=serve)
    try:
        thread.start()
        os.sched_setaffinity(main, {last})  # (no core in common with the thread's)
        steps[0].set()
        done[0].wait(30)
        os.sched_setaffinity(main, set(everywhere))  # (every core: the thread keeps its own)
        steps[1].set()
        thread.join(30)
    finally:
        for e in steps:
            e.set()
        os.sched_setaffinity(main, before)
        for s in unix:
            s.close()
    assert seen == [{first}, {first}]
