"""The gRPC edge through a real channel: status codes, messages, dedupe, wire dtypes (server in-process)."""
from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import grpc
import pytest
import torch

from psgrad.client.parameter_client import ParameterClient
from psgrad.client.shard_client import ShardClient
from psgrad.config import ClientConfig, JobSpec, ServerConfig
from psgrad.errors import (
    ConfigError,
    InvalidRequestError,
    JobMismatchError,
    NotInitializedError,
    ServerStartError,
    ServerUnavailableError,
    StalledError,
)
from psgrad.wire.frames import PushHead
from psgrad.proto import ps_pb2 as pb
from psgrad.server.runtime import RunningServer, start_server
from psgrad.core.sharding import ParamSpec, plan_shards

PARAMS = [ParamSpec("w", (300, 7), "float32"), ParamSpec("b", (13,), "float32")]  # 2113 elements
# shared_memory=False: these tests are about the gRPC frames; tests/integration/test_shm.py covers the same-host path.
FAST = ClientConfig(
    connect_timeout_s=5, rpc_timeout_s=10, init_timeout_s=5, reconnect_timeout_s=0, chunk_bytes=1024, shared_memory=False
)


@pytest.fixture
def servers(request: pytest.FixtureRequest) -> Iterator[list[RunningServer]]:
    n = getattr(request, "param", 2)
    running = [start_server(ServerConfig(port=0, threads=8)) for _ in range(n)]
    yield running
    for s in running:
        s.stop(0)


def make_client(servers: list[RunningServer], rank: int = 0, **spec_kw: object) -> ParameterClient:
    spec = JobSpec(num_shards=len(servers), num_workers=2, **spec_kw)  # type: ignore[arg-type]
    plan = plan_shards(PARAMS, len(servers))
    return ParameterClient([s.address for s in servers], spec, PARAMS, plan, rank, FAST)


def initial() -> torch.Tensor:
    return torch.arange(2113, dtype=torch.float32) / 1000


def test_init_pull_push_roundtrip_across_shards(servers: list[RunningServer]) -> None:
    with make_client(servers, lr=0.5) as c:
        c.join(initial_weights=initial)
        flat = torch.empty(2113)
        assert c.pull(flat, clock=0) == [0, 0]
        assert torch.equal(flat, initial())
        grad = torch.linspace(-1, 1, 2113)
        replies = c.push(grad, clock=0)
        assert [r.applied for r in replies] == [True, True]
        assert [r.version for r in replies] == [1, 1]
        c.pull(flat, clock=1)
        torch.testing.assert_close(flat, initial() - 0.5 * grad)
        # each shard holds exactly its planned range
        for i, s in enumerate(servers):
            start, end = c.plan.ranges[i]
            torch.testing.assert_close(s.shard.weights_copy(), (initial() - 0.5 * grad)[start:end])


def test_second_init_is_a_noop_and_workers_wait_for_the_chief(servers: list[RunningServer]) -> None:
    with make_client(servers) as chief, make_client(servers, rank=1) as other:
        chief.join(initial_weights=initial)
        chief.push(torch.ones(2113), clock=0)
        # re-running the chief (same fingerprint) does not reset the weights
        chief.join(initial_weights=lambda: torch.zeros(2113))
        assert [s.shard.version for s in servers] == [1, 1]
        assert other.join(initial_weights=None) == 0  # async: a new worker counts from 0


def test_non_chief_times_out_naming_the_servers_when_nobody_initializes(servers: list[RunningServer]) -> None:
    with make_client(servers, rank=1) as c:
        with pytest.raises((NotInitializedError, ServerUnavailableError)) as info:
            c.join(initial_weights=None)
    assert servers[0].address in str(info.value) or "rank 0" in str(info.value)


def test_pull_and_push_before_init_fail_with_a_hint(servers: list[RunningServer]) -> None:
    with make_client(servers) as c:
        with pytest.raises(NotInitializedError, match="rank 0"):
            c.pull(torch.empty(2113), clock=0)
        with pytest.raises(NotInitializedError, match="rank 0"):
            c.push(torch.ones(2113), clock=0)


def test_not_initialized_is_failed_precondition_on_the_wire(servers: list[RunningServer]) -> None:
    channel = grpc.insecure_channel(servers[0].address)
    pull = channel.unary_stream("/psgrad.ParameterServer/Pull", pb.PullRequest.SerializeToString, None)
    with pytest.raises(grpc.RpcError) as info:
        list(pull(pb.PullRequest(rank=0), timeout=5))
    channel.close()
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "rank 0" in info.value.details()


def test_push_of_wrong_length_is_invalid_argument_and_changes_nothing(servers: list[RunningServer]) -> None:
    with make_client(servers) as c:
        c.join(initial_weights=initial)
        before = servers[0].shard.weights_copy()
        shard = ShardClient(servers[0].address, FAST)
        size = c.plan.size(0)
        header = pb.PushHeader(rank=0, clock=0, numel=size - 1, dtype="float32", fingerprint=c.fingerprint)
        payload = memoryview(torch.ones(size - 1).numpy()).cast("B")
        with pytest.raises(InvalidRequestError) as info:
            shard.push(PushHead(header), payload)
        msg = str(info.value)
        assert str(size - 1) in msg and str(size) in msg
        # header claims the right size but fewer bytes arrive
        header.numel = size
        with pytest.raises(InvalidRequestError, match="ended after"):
            shard.push(PushHead(header), payload)
        shard.close()
        assert torch.equal(servers[0].shard.weights_copy(), before)
        assert servers[0].shard.version == 0
        assert servers[0].shard.status().pushes_rejected == 2


def test_wrong_length_push_reaches_client_as_invalid_argument_code(servers: list[RunningServer]) -> None:
    with make_client(servers) as c:
        c.join(initial_weights=initial)
        channel = grpc.insecure_channel(servers[0].address)
        push = channel.stream_unary("/psgrad.ParameterServer/Push", None, pb.PushReply.FromString)
        frame = pb.PushFrame(header=pb.PushHeader(rank=0, numel=5, dtype="float32", fingerprint=c.fingerprint))
        with pytest.raises(grpc.RpcError) as info:
            push(iter([frame.SerializeToString()]), timeout=5)
        channel.close()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_non_finite_gradient_is_refused_by_default(servers: list[RunningServer]) -> None:
    with make_client(servers) as c:
        c.join(initial_weights=initial)
        grad = torch.zeros(2113)
        grad[5] = float("nan")
        grad[2000] = float("inf")
        with pytest.raises(InvalidRequestError, match="non-finite"):
            c.push(grad, clock=0)
        assert [s.shard.version for s in servers] == [0, 0]
        flat = torch.empty(2113)
        c.pull(flat, clock=0)
        assert torch.equal(flat, initial())


def test_duplicate_push_is_acknowledged_not_applied(servers: list[RunningServer]) -> None:
    with make_client(servers, lr=1.0) as c:
        c.join(initial_weights=initial)
        c.pull(torch.empty(2113), clock=0)
        first = c.push(torch.ones(2113), clock=0)
        again = c.push(torch.ones(2113), clock=0)  # a retried push
        assert all(r.applied for r in first)
        assert not any(r.applied for r in again)
        assert all("duplicate" in r.reason for r in again)
        assert [s.shard.version for s in servers] == [1, 1]
        flat = torch.empty(2113)
        c.pull(flat, clock=1)
        torch.testing.assert_close(flat, initial() - 1.0)


def test_staleness_is_version_at_apply_minus_base_version(servers: list[RunningServer]) -> None:
    with make_client(servers) as a, make_client(servers, rank=1) as b:
        a.join(initial_weights=initial)
        b.join(initial_weights=None)
        a.pull(torch.empty(2113), clock=0)
        b.pull(torch.empty(2113), clock=0)
        a.push(torch.ones(2113), clock=0)  # applied at version 0 -> staleness 0
        replies = b.push(torch.ones(2113), clock=0)  # computed from version 0, applied at 1
        assert [r.staleness for r in replies] == [1, 1]
        assert servers[0].shard.status().staleness == {0: 1, 1: 1}


def test_job_mismatch_names_the_field(servers: list[RunningServer]) -> None:
    with make_client(servers, lr=0.1) as chief, make_client(servers, rank=1, lr=0.2) as other:
        chief.join(initial_weights=initial)
        with pytest.raises(JobMismatchError, match=r"lr: shard has 0.1, worker rank 1 sent 0.2"):
            other.join(initial_weights=None)


@pytest.mark.parametrize("wire", ["bfloat16", "float16"])
def test_narrow_wire_dtypes_round_trip(servers: list[RunningServer], wire: str) -> None:
    with make_client(servers, lr=1.0, wire_dtype=wire) as c:
        c.join(initial_weights=initial)
        flat = torch.empty(2113)
        c.pull(flat, clock=0)
        dt = getattr(torch, wire)
        torch.testing.assert_close(flat, initial().to(dt).float())
        grad = torch.full((2113,), 0.25)
        c.push(grad, clock=0)
        assert servers[0].shard.status().bytes_in == c.plan.size(0) * 2
        expected = initial() - grad.to(dt).float()
        got = torch.cat([s.shard.weights_copy() for s in servers])
        torch.testing.assert_close(got, expected)  # servers keep float32 masters


def test_status_reports_counters(servers: list[RunningServer]) -> None:
    with make_client(servers) as c:
        c.join(initial_weights=initial)
        c.pull(torch.empty(2113), clock=0)
        c.push(torch.ones(2113), clock=0)
        shard = ShardClient(servers[1].address, FAST)
        st = shard.status()
        shard.close()
    assert st.initialized and st.version == 1 and st.pushes_applied == 1 and st.pulls == 1
    assert (st.shard.start, st.shard.end) == c.plan.ranges[1]
    assert [(w.rank, w.clock, w.state) for w in st.workers] == [(0, 1, "live")]
    assert st.bytes_in == st.bytes_out == 4 * c.plan.size(1)


def test_binding_a_port_in_use_fails_loudly() -> None:
    first = start_server(ServerConfig(port=0))
    try:
        port = int(first.address.rsplit(":", 1)[1])
        with pytest.raises(ServerStartError, match=str(port)):
            start_server(ServerConfig(port=port))
    finally:
        first.stop(0)


def test_unanswering_server_times_out_naming_the_address() -> None:
    """A socket that accepts TCP but never speaks HTTP/2: the join must fail within its deadline."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        addr = f"127.0.0.1:{silent.getsockname()[1]}"
        cfg = ClientConfig(connect_timeout_s=1.0, rpc_timeout_s=1.0, reconnect_timeout_s=0)
        c = ParameterClient([addr], JobSpec(), PARAMS, plan_shards(PARAMS, 1), 0, cfg)
        with pytest.raises(ServerUnavailableError, match=addr):
            c.join(initial_weights=initial)
        c.close()


def _sync_pair(servers: list[RunningServer], cfg: ClientConfig = FAST) -> tuple[ParameterClient, ParameterClient]:
    spec = JobSpec(mode="sync", num_shards=len(servers), num_workers=2)
    plan = plan_shards(PARAMS, len(servers))
    a = ParameterClient([s.address for s in servers], spec, PARAMS, plan, 0, cfg)
    b = ParameterClient([s.address for s in servers], spec, PARAMS, plan, 1, cfg)
    return a, b


def _first_iteration_without_rank_1(a: ParameterClient, b: ParameterClient) -> None:
    """Both join (sync starts once both have), then only rank 0 pushes iteration 0."""
    t = threading.Thread(target=b.join, args=(None,))
    t.start()
    a.join(initial_weights=initial)
    t.join(10)
    a.pull(torch.empty(2113), clock=0)
    a.push(torch.ones(2113), clock=0)


def test_waiting_pull_honours_its_deadline_and_names_the_blocking_worker(servers: list[RunningServer]) -> None:
    short = ClientConfig(connect_timeout_s=5, rpc_timeout_s=2.0, init_timeout_s=5, reconnect_timeout_s=0)
    a, b = _sync_pair(servers, short)
    try:
        _first_iteration_without_rank_1(a, b)
        with pytest.raises(StalledError, match=r"waiting for worker\(s\) 1"):
            a.pull(torch.empty(2113), clock=1)
    finally:
        a.close()
        b.close()


def test_cancelled_waiting_pulls_free_their_server_threads() -> None:
    server = start_server(ServerConfig(port=0, threads=2))
    a, b = _sync_pair([server])
    try:
        _first_iteration_without_rank_1(a, b)
        channel = grpc.insecure_channel(server.address)
        pull = channel.unary_stream("/psgrad.ParameterServer/Pull", pb.PullRequest.SerializeToString, None)
        calls = [pull(pb.PullRequest(rank=0, clock=1, fingerprint=a.fingerprint), timeout=60) for _ in range(2)]
        assert server.shard.wait_until(lambda s: s.waiting == 2, timeout_s=30)
        probe = ShardClient(server.address, FAST)
        with pytest.raises(ServerUnavailableError):  # both server threads are parked in the sync gate
            probe.status(timeout_s=1)
        for call in calls:
            call.cancel()
        st = probe.status(timeout_s=10)  # served only if the cancelled pulls gave their threads back
        probe.close()
        assert st.version == 0 and st.pending == 1
        channel.close()
    finally:
        a.close()
        b.close()
        server.stop(0)


def test_server_options_fix_the_stream_window_unless_asked_for_grpcs_own() -> None:
    from psgrad.server.runtime import server_options

    fixed = dict(server_options(ServerConfig(port=0)))
    assert fixed["grpc.http2.bdp_probe"] == 0 and fixed["grpc.http2.lookahead_bytes"] == 4 << 20
    assert fixed["grpc.max_receive_message_length"] >= 1 << 20 and fixed["grpc.so_reuseport"] == 0
    auto = dict(server_options(ServerConfig(port=0, stream_window_bytes=0)))
    assert "grpc.http2.bdp_probe" not in auto and "grpc.http2.lookahead_bytes" not in auto
    with pytest.raises(ConfigError, match="stream_window_bytes"):
        ServerConfig(stream_window_bytes=1000)
