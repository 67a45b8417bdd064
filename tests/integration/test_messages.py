"""What a worker is told when its job cannot start or a server cannot be reached, against real gRPC
servers on 127.0.0.1: the start barrier names the ranks that have not joined (in the waiting workers'
log, `psgrad status` and the error at --init-timeout-s), and every connection error says what
happened (refused, no gRPC, no answer, slow) and for how long it waited. Each message is asserted."""
from __future__ import annotations

import logging
import re
import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest
import torch
from torch import nn

import psgrad
from conftest import held_address, hold_port, run_in_threads
from psgrad.cli.status import fetch, format_status
from psgrad.client.parameter_client import ParameterClient
from psgrad.config import ClientConfig, JobSpec
from psgrad.core.sharding import ParamSpec, plan_shards
from psgrad.errors import DeadlineExceededError, ServerUnavailableError, WorkerStateError
from psgrad.proto import ps_pb2 as pb
from psgrad.wire.protocol import SERVICE_NAME

pytestmark = pytest.mark.timeout(60)

REFUSED = r"refused the connection \(nothing listens on that port: is the server running, at that address\?\)"


@pytest.mark.parametrize(
    "mode, started, expected",
    [
        ("sync", (0, 1), "2 of 3 workers joined; rank 2 has not: start it or lower --num-workers"),
        ("ssp", (0,), "1 of 3 workers joined; ranks 1 and 2 have not: start them or lower --num-workers"),
    ],
)
def test_the_start_barrier_names_the_ranks_that_have_not_joined(
    make_servers: Any, caplog: pytest.LogCaptureFixture, mode: str, started: tuple[int, ...], expected: str
) -> None:
    running = make_servers(2)
    addresses = [s.address for s in running]
    init_timeout_s = 2.5
    errors: dict[int, tuple[float, BaseException]] = {}

    def worker(rank: int) -> None:
        begin = time.monotonic()
        try:
            psgrad.connect(addresses, rank=rank, num_workers=3, mode=mode,
                           client=ClientConfig(init_timeout_s=init_timeout_s)).optimizer(nn.Linear(4, 2))
        except WorkerStateError as exc:
            errors[rank] = (time.monotonic() - begin, exc)

    caplog.set_level(logging.INFO, logger="psgrad.client")
    threads = [threading.Thread(target=worker, args=(r,)) for r in started]
    for t in threads:
        t.start()
    try:
        # `psgrad status` while they wait: every shard names the missing ranks
        for s in running:
            assert s.shard.wait_until(lambda st: len(st.workers) == len(started), timeout_s=20)
        table = format_status(fetch(addresses, timeout_s=5))
        for i in range(2):
            assert f"shard {i}: waiting for the start ({mode} mode starts all workers together): {expected}" in table, table
    finally:
        for t in threads:
            t.join(30)
    assert not any(t.is_alive() for t in threads)
    why = f"({mode} mode starts all workers together; waited {init_timeout_s:g} s, --init-timeout-s)"
    for rank in started:
        elapsed, exc = errors[rank]
        assert str(exc) == f"{expected} {why}"
        assert init_timeout_s <= elapsed < init_timeout_s + 2.0  # at the timeout, not after a network deadline
    # the waiting workers said so within a second or two, not only at the end
    logged = [r.getMessage() for r in caplog.records if r.name == "psgrad.client"]
    for rank in started:
        assert any(m.startswith(f"worker rank {rank}: waiting at the start: {expected} ({mode} mode") for m in logged), logged


def test_a_barrier_that_fills_up_starts_and_says_nothing_more(make_servers: Any, caplog: pytest.LogCaptureFixture) -> None:
    running = make_servers(1)
    caplog.set_level(logging.INFO, logger="psgrad.client")

    def worker(rank: int) -> None:
        with psgrad.connect([running[0].address], rank=rank, num_workers=2, mode="sync",
                            client=ClientConfig(init_timeout_s=20)) as ps:
            ps.optimizer(nn.Linear(4, 2))

    run_in_threads(2, worker)
    assert running[0].shard.status().missing_at_start == ()


def test_a_worker_restarted_within_its_lease_is_logged_joining_again(
    make_servers: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The server logs each join; a worker that restarts while its lease still holds (its rank is live)
    joined again without a line. The rounds of waiting at sync's start barrier log nothing."""
    address = make_servers(1)[0].address
    caplog.set_level(logging.INFO, logger="psgrad.server")
    clients: list[Any] = []

    def start(rank: int) -> None:
        ps = psgrad.connect([address], rank=rank, num_workers=2, mode="sync")
        clients.append(ps)  # kept open: a process that died keeps its lease until it runs out
        ps.optimizer(nn.Linear(4, 2))

    try:
        run_in_threads(2, start)  # one waits at the start for the other
        start(1)  # rank 1 restarted
    finally:
        for ps in clients:
            ps.close()
    logged = [r.getMessage() for r in caplog.records if r.name == "psgrad.server" and "join" in r.getMessage()]
    assert sorted(logged[:2]) == ["worker 0 joined at clock 0 (1 live of 2)", "worker 1 joined at clock 0 (2 live of 2)"] \
        or sorted(logged[:2]) == ["worker 0 joined at clock 0 (2 live of 2)", "worker 1 joined at clock 0 (1 live of 2)"], logged
    assert logged[2:] == ["worker 1 joined again at clock 0, within its lease (2 live of 2) from another process: the "
                          "calls of the process that held rank 1 are refused from now on (a restart; or two workers "
                          "started with one rank?)"], logged


def test_joining_a_port_nobody_listens_on_says_it_was_refused() -> None:
    """A refused connection is an answer: reported after a short grace (a server starting binds its
    port within it), not at the end of --connect-timeout-s (30 s here)."""
    with hold_port() as held:
        address = held_address(held)
        start = time.monotonic()
        with pytest.raises(ServerUnavailableError) as info:
            psgrad.connect([address], client=ClientConfig(connect_timeout_s=30.0)).optimizer(nn.Linear(2, 2))
    assert re.fullmatch(
        rf"server {address} {REFUSED} for \d\.\d s: the join request was not sent \(--wait-for-servers, or "
        r"ClientConfig\(wait_for_servers=True\), waits up to --connect-timeout-s for a server that starts later\)",
        str(info.value)), info.value
    assert time.monotonic() - start < 10


def test_a_push_to_a_server_that_died_says_refused_and_not_retried(make_servers: Any) -> None:
    running = make_servers(2)
    addresses = [s.address for s in running]
    client = ClientConfig(reconnect_timeout_s=0, shared_memory=False)
    model = nn.Linear(4, 2)
    ps = psgrad.connect(addresses, client=client)
    opt = ps.optimizer(model)
    running[1].stop(0)
    held = hold_port(addresses[1])  # refused, and no other test's server gets it
    model(torch.ones(1, 4)).sum().backward()
    with held, pytest.raises(ServerUnavailableError) as info:
        opt.step()
    assert re.fullmatch(rf"server {addresses[1]} {REFUSED}: the push and pull were not sent "
                        r"\(not retried: --reconnect-timeout-s 0\)", str(info.value)), info.value
    ps.close()  # leaves shard 0; nothing is sent to the shard that was given up on (no second wait)
    assert [state for _, _, state, *_ in running[0].shard.status().workers] == ["left"]


def test_a_server_that_takes_tcp_but_never_speaks_grpc_is_named_so() -> None:
    with socket.socket() as silent:  # a stopped process's port: the kernel accepts, nobody answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(DeadlineExceededError) as info:
            psgrad.connect([address], client=ClientConfig(connect_timeout_s=1.0)).optimizer(nn.Linear(2, 2))
    assert str(info.value) == (
        f"server {address} did not answer the join request within 1 s (deadline exceeded): a second call found that "
        "it took the TCP connection but did not speak gRPC (a stopped or overloaded process, another program on that "
        "port, TLS on one side only, or a TLS handshake that failed: a --tls-ca that did not sign the server's "
        "certificate?)"
    )


class _Stuck:
    """A gRPC server of the psgrad service whose Join never answers in time; its Status answers
    at once (a slow call) or not at all (a server that answers nothing, like a paused one)."""

    def __init__(self, status_answers: bool) -> None:
        self.release = threading.Event()

        def join(request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
            self.release.wait(30)
            return pb.JoinReply()

        def status(request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
            if not status_answers:
                self.release.wait(30)
            return pb.StatusReply()

        handlers = {
            "Join": grpc.unary_unary_rpc_method_handler(
                join, pb.JoinRequest.FromString, pb.JoinReply.SerializeToString),
            "Status": grpc.unary_unary_rpc_method_handler(
                status, pb.StatusRequest.FromString, pb.StatusReply.SerializeToString),
        }
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def stop(self) -> None:
        self.release.set()
        self.server.stop(0)


@pytest.fixture
def stuck(request: pytest.FixtureRequest) -> Iterator[_Stuck]:
    server = _Stuck(status_answers=request.param)
    yield server
    server.stop()


@pytest.mark.parametrize(
    "stuck, why",
    [
        (True, "it answers other calls, so this one took too long: a busy server or a slow link (raise the deadline "
               "if that is expected)"),
        (False, "a status call got no answer within 1 s either: is it paused or overloaded, or does a firewall or "
                "network partition drop the packets to it?"),
    ],
    indirect=["stuck"],
    ids=["slow-call", "no-answer"],
)
def test_a_deadline_says_whether_the_server_answers_at_all(stuck: _Stuck, why: str) -> None:
    params = [ParamSpec("w", (4,), "float32")]
    spec = JobSpec(num_shards=1)
    config = ClientConfig(connect_timeout_s=1.0, shared_memory=False)
    start = time.monotonic()
    with ParameterClient([stuck.address], spec, params, plan_shards(params, 1), 0, config) as client:
        with pytest.raises(DeadlineExceededError) as info:
            client.join(lambda: torch.zeros(4))
    assert str(info.value) == (
        f"server {stuck.address} did not answer the join request within 1 s (deadline exceeded): {why}")
    assert time.monotonic() - start < 5  # the deadline and the one-second probe
