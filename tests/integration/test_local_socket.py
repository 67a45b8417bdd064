"""Step calls over the servers' sockets (server/local_calls.py, wire/local_socket.py): a sync job of
two workers on real server processes makes every Step call, and every forward's read of rows,
over their local sockets (same host) or, with its payloads in gRPC frames, over their TCP sockets
(another host), each worker's
connection bound to its own rank, and trains bit for bit as over gRPC; a server whose socket closes
mid-job gets the calls through gRPC again, the job unchanged; a worker that cannot reach the TCP
port warns and calls through gRPC; servers with a job secret but no TLS, or `--step-port off`,
offer none."""
from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn

import psgrad
from conftest import run_in_threads
from psgrad.config import ClientConfig
from psgrad.wire import local_socket, shm

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not (local_socket.supported() and shm.supported()),
                                 reason="needs abstract Unix sockets and /dev/shm (Linux)")]

# (rows through calls, not read in place: these tests count the reads the sockets carry)
CLIENT = ClientConfig(connect_timeout_s=20, rpc_timeout_s=60, init_timeout_s=30, reconnect_timeout_s=0,
                      rows_in_place=False)
STEPS = 6


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = psgrad.EmbeddingBagCollection({"a": (300, 4), "b": (200, 4)}, mode="sum", std=0.1, seed=1)
        torch.manual_seed(0)
        self.head = nn.Linear(8, 1)

    def forward(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.head(self.ebc(x)).squeeze(-1)


@dataclasses.dataclass
class Seen:
    """What a worker's transport of a shard says at the end of its job."""

    name: str = ""
    steps_through_socket: int = 0  # its Step calls over the socket
    offer: tuple[str, int, str] | None = None  # the socket offered (rank bound), None: none or given up
    reads_through_socket: int = 0  # its forwards' reads of rows (PullRows) over the socket


def data(rank: int) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    g = torch.Generator().manual_seed(10 + rank)
    return [({"a": torch.randint(0, 300, (16, 2), generator=g), "b": torch.randint(0, 200, (16, 3), generator=g)},
             torch.randint(0, 2, (16,), generator=g).float()) for _ in range(STEPS)]


def job(addresses: list[str], local: bool, after_step: Callable[[int, int], None] = lambda rank, k: None,
        **client: bool) -> tuple[dict[str, torch.Tensor], list[list[Seen]]]:
    """Two sync workers (threads) of Model for STEPS steps: (worker 0's state_dict of the servers'
    final weights and rows, what each worker's shard transports say at its end)."""
    states: dict[int, dict[str, torch.Tensor]] = {}
    transports: dict[int, list[Seen]] = {}
    models = [Model(), Model()]  # (here: the threads would draw their initial weights from one generator)

    def worker(rank: int) -> None:
        model = models[rank]
        with psgrad.connect(addresses, rank=rank, num_workers=2, mode="sync", optimizer=psgrad.Adagrad(lr=0.1),
                            client=dataclasses.replace(CLIENT, local_socket=local, **client)) as ps:
            opt = ps.optimizer(model)
            for k, (x, y) in enumerate(data(rank)):
                opt.zero_grad()
                nn.functional.binary_cross_entropy_with_logits(model(x), y).backward()
                opt.step()
                after_step(rank, k)
            transports[rank] = [Seen(s.transport.name, s.transport.socket.calls,  # (as the job ends)
                                     s.transport.socket.offer, s.transport.socket.read_calls) for s in opt.client.shards]
            if rank == 0:
                opt.refresh()
                states[0] = {k: v.clone() for k, v in model.state_dict().items()}

    run_in_threads(2, worker, timeout_s=150)
    return states[0], [transports[0], transports[1]]


def test_a_same_host_jobs_step_calls_go_over_the_socket_bit_for_bit_as_over_grpc(start_servers) -> None:  # type: ignore[no-untyped-def]
    over_socket, socket_transports = job(start_servers(2), local=True)
    over_grpc, grpc_transports = job(start_servers(2), local=False)
    for rank, shards in enumerate(socket_transports):
        assert [t.name for t in shards] == ["shm", "shm"], socket_transports
        assert [t.steps_through_socket for t in shards] == [STEPS, STEPS], socket_transports
        assert [t.reads_through_socket for t in shards] == [STEPS, STEPS], socket_transports  # each forward's
        assert [t.offer and t.offer[1] for t in shards] == [rank, rank], socket_transports  # its own rank
    assert [t.steps_through_socket for shards in grpc_transports for t in shards] == [0] * 4, grpc_transports
    assert [t.reads_through_socket for shards in grpc_transports for t in shards] == [0] * 4, grpc_transports
    assert over_socket.keys() == over_grpc.keys() and any(k.startswith("ebc.") for k in over_socket)
    for key in over_socket:
        assert torch.equal(over_socket[key], over_grpc[key]), key


def test_a_server_whose_socket_closes_mid_job_gets_the_calls_through_grpc(make_servers) -> None:  # type: ignore[no-untyped-def]
    reference, _ = job([s.address for s in make_servers(2)], local=False)
    running = make_servers(2)

    def close_shard_0s_socket(rank: int, k: int) -> None:
        if rank == 0 and k == 1:
            running[0].servicer.local.close()

    result, transports = job([s.address for s in running], local=True, after_step=close_shard_0s_socket)
    for shards in transports:
        assert shards[0].steps_through_socket < STEPS and shards[0].offer is None  # given up
        assert shards[0].reads_through_socket < STEPS  # (the reads after it through gRPC too)
        assert shards[1].steps_through_socket == STEPS and shards[1].reads_through_socket == STEPS
    assert transports[0][0].steps_through_socket == 2
    for key in reference:
        assert torch.equal(result[key], reference[key]), key


# --------------------------------------------------------------------- across hosts: the TCP socket
# (a worker whose payloads go through gRPC frames, as on another host: shared_memory=False)

def test_a_jobs_step_calls_in_frames_go_over_the_tcp_socket_bit_for_bit_as_over_grpc(start_servers) -> None:  # type: ignore[no-untyped-def]
    over_tcp, tcp_transports = job(start_servers(2), local=True, shared_memory=False)
    over_grpc, grpc_transports = job(start_servers(2), local=True, shared_memory=False, step_socket=False)
    for rank, shards in enumerate(tcp_transports):
        assert [t.name for t in shards] == ["grpc", "grpc"], tcp_transports
        assert [t.steps_through_socket for t in shards] == [STEPS, STEPS], tcp_transports
        assert [t.reads_through_socket for t in shards] == [STEPS, STEPS], tcp_transports
        assert [t.offer and t.offer[1] for t in shards] == [rank, rank], tcp_transports  # its own rank
    assert [t.steps_through_socket for shards in grpc_transports for t in shards] == [0] * 4, grpc_transports
    assert [t.reads_through_socket for shards in grpc_transports for t in shards] == [0] * 4, grpc_transports
    assert [t.offer for shards in grpc_transports for t in shards] == [None] * 4  # not taken up
    assert over_tcp.keys() == over_grpc.keys() and any(k.startswith("ebc.") for k in over_tcp)
    for key in over_tcp:
        assert torch.equal(over_tcp[key], over_grpc[key]), key


def test_a_server_whose_tcp_socket_closes_mid_job_gets_the_calls_through_grpc(make_servers) -> None:  # type: ignore[no-untyped-def]
    reference, _ = job([s.address for s in make_servers(2)], local=True, shared_memory=False, step_socket=False)
    running = make_servers(2)

    def close_shard_0s_socket(rank: int, k: int) -> None:
        if rank == 0 and k == 1:
            running[0].servicer.local.close()

    result, transports = job([s.address for s in running], local=True, after_step=close_shard_0s_socket,
                             shared_memory=False)
    assert transports[0][0].steps_through_socket == 2
    for shards in transports:
        assert shards[0].steps_through_socket < STEPS and shards[0].offer is None  # given up
        assert shards[1].steps_through_socket == STEPS
    for key in reference:
        assert torch.equal(result[key], reference[key]), key


def test_a_worker_that_cannot_reach_the_tcp_port_warns_and_calls_through_grpc(make_servers) -> None:  # type: ignore[no-untyped-def]
    reference, _ = job([s.address for s in make_servers(1)], local=True, shared_memory=False, step_socket=False)
    running = make_servers(1)
    tcp = [s for s in running[0].servicer.local._listeners if s.family != __import__("socket").AF_UNIX]
    assert len(tcp) == 1
    tcp[0].shutdown(__import__("socket").SHUT_RDWR)  # (as a firewall that refuses the port: the offer stands,
    tcp[0].close()  # a connection is refused)
    with pytest.warns(UserWarning, match=r"step socket .*; Step calls go through gRPC"):
        result, transports = job([s.address for s in running], local=True, shared_memory=False)
    assert [t.steps_through_socket for shards in transports for t in shards] == [0, 0]
    assert [t.offer for shards in transports for t in shards] == [None, None]
    for key in reference:
        assert torch.equal(result[key], reference[key]), key


def test_servers_with_a_secret_but_no_tls_or_told_off_offer_no_tcp_socket(make_servers) -> None:  # type: ignore[no-untyped-def]
    # (a job secret without TLS: gRPC's local credentials, which take callers of this host only; a
    # server with TLS speaks TLS there too: test_api_security.py)
    from psgrad.config import AuthConfig

    plain, secret, off = (make_servers(1)[0], make_servers(1, auth=AuthConfig(secret=b"s" * 32))[0],
                          make_servers(1, step_port=None)[0])
    assert plain.servicer.local.tcp_offer(0) is not None and plain.servicer.local.offer(0) is not None
    for server in (secret, off):  # (the local socket stays: on this host a token still binds the rank)
        assert server.servicer.local.tcp_offer(0) is None and server.servicer.local.offer(0) is not None
        assert server.servicer.local.tcp_port is None


def test_a_refusal_over_the_tcp_socket_is_raised_as_it_is_and_not_sent_again(make_servers) -> None:  # type: ignore[no-untyped-def]
    """A call over the socket that the server refuses counts as the call's first attempt: the
    refusal is raised as over gRPC, not made again there (a stalled sync pull would wait twice)."""
    server = make_servers(1)[0]
    model = nn.Module()
    model.emb = psgrad.Embedding(100, 4)
    model.head = nn.Linear(4, 1)
    with psgrad.connect([server.address], mode="async", client=dataclasses.replace(CLIENT, shared_memory=False)) as ps:
        c = ps.optimizer(model).client
        through_grpc: list[int] = []
        step = c.shards[0]._step
        c.shards[0]._step = lambda *a, **k: (through_grpc.append(1), step(*a, **k))[1]
        dense = torch.zeros(c.plan.total)
        with pytest.raises(psgrad.InvalidRequestError, match="claim base version 1000000"):
            c.exchange(dense, 0, torch.zeros_like(dense), rows={"emb": (torch.tensor([5, 7]), torch.zeros(2, 4))},
                       bases={"emb": {0: 10**6}})
        assert through_grpc == [] and c.shards[0].frames.socket.offer is not None  # (the socket stays)
        c.exchange(dense, 0, torch.zeros_like(dense), rows={"emb": (torch.tensor([5, 7]), torch.zeros(2, 4))})
        assert through_grpc == [] and c.shards[0].frames.socket.calls == 1



@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="needs Linux's SCHED_BATCH")
@pytest.mark.parametrize("batch", [True, False])
def test_a_servers_request_threads_run_under_sched_batch_by_default(batch: bool) -> None:
    """psgrad.serve(): the threads that serve gRPC calls (the Join) and the local socket's (the Step
    calls) are under SCHED_BATCH unless batch_scheduling=False; the caller's thread is left as it was."""
    before = os.sched_getscheduler(0)
    settings = {} if batch else {"batch_scheduling": False}
    earlier = {t.native_id for t in threading.enumerate()}  # (other tests' servers in this process: not this one's)
    with psgrad.serve(**settings) as server:
        model = nn.Linear(4, 1)
        with psgrad.connect(server.address, client=CLIENT, mode="sync", optimizer=psgrad.SGD(lr=0.1)) as ps:
            opt = ps.optimizer(model)
            for _ in range(2):
                opt.zero_grad()
                model(torch.ones(2, 4)).sum().backward()
                opt.step()
            assert server.servicer.local.calls == 2  # (the steps went over the local socket)
            threads = {t.name: os.sched_getscheduler(t.native_id) for t in threading.enumerate()
                       if t.native_id is not None and t.native_id not in earlier
                       and t.name.startswith(("psgrad-rpc", "psgrad-local"))}
    assert any(n.startswith("psgrad-rpc") for n in threads) and "psgrad-local" in threads, threads
    assert set(threads.values()) == {os.SCHED_BATCH if batch else before}, threads
    assert os.sched_getscheduler(0) == before


_BOUND_WORKER = """
import sys, torch, psgrad
from torch import nn
from psgrad.config import ClientConfig
cores = psgrad.bind_cores(1, 2)  # (before any thread starts)
model = nn.Linear(4, 1)
with psgrad.connect(sys.argv[1], client=ClientConfig(connect_timeout_s=20, rpc_timeout_s=60, init_timeout_s=30,
                    reconnect_timeout_s=0), mode="async", optimizer=psgrad.SGD(lr=0.1)) as ps:
    opt = ps.optimizer(model)
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    print("stepped", *cores, flush=True)
    sys.stdin.readline()  # (stays connected until the test has looked)
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and two cores")
@pytest.mark.parametrize("follow", [True, False])
def test_a_servers_thread_for_a_bound_worker_runs_on_that_workers_cores_by_default(follow: bool) -> None:
    """psgrad.serve(), and a worker process bound by psgrad.bind_cores to the second half of the
    cores: the thread serving its Step calls over the Unix socket runs on those cores, unless
    follow_worker_cores=False (then where the server started it: every core)."""
    import subprocess
    import sys

    everywhere = os.sched_getaffinity(0)
    earlier = {t.native_id for t in threading.enumerate()}
    with psgrad.serve(**({} if follow else {"follow_worker_cores": False})) as server:
        worker = subprocess.Popen([sys.executable, "-c", _BOUND_WORKER, server.address], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        try:
            line = worker.stdout.readline() if worker.stdout else ""
            assert line.startswith("stepped"), line
            cores = {int(c) for c in line.split()[1:]}
            assert server.servicer.local.calls >= 2  # (the steps went over the local socket)
            threads = [os.sched_getaffinity(t.native_id) for t in threading.enumerate()
                       if t.native_id is not None and t.native_id not in earlier and t.name == "psgrad-local"]
        finally:
            try:
                worker.communicate("\n", timeout=60)
            finally:
                worker.kill()
    assert cores and cores < everywhere
    assert threads == [cores if follow else everywhere]
