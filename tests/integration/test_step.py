"""The fused Step call (push clock c, then pull c + 1, one unary call per shard) behind
ParameterClient.exchange: inline payloads, same-host segments, the fallbacks to separate push and
pull, refusals and the sync gate (servers in-process, real gRPC channels)."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch

from psgrad.wire import local_socket, shm
from psgrad.client.parameter_client import ParameterClient, _in_stages
from psgrad.client.shard_client import ShardClient
from psgrad.config import ClientConfig, JobSpec, ServerConfig
from psgrad.errors import InvalidRequestError, StalledError
from psgrad.server.runtime import RunningServer, start_server
from psgrad.wire.local_socket import LocalChannel
from psgrad.wire.protocol import SERVICE_NAME
from psgrad.core.sharding import ParamSpec, plan_shards

pytestmark = pytest.mark.timeout(60)

PARAMS = [ParamSpec("w", (300, 7), "float32"), ParamSpec("b", (13,), "float32")]  # 2113 elements
N = 2113
INLINE = 64 << 10  # chunk_bytes: both shards' payloads (about 4 KB each) fit one message


def config(shared: bool, chunk_bytes: int = INLINE, rpc_timeout_s: float = 10, duplex: bool = False) -> ClientConfig:
    """duplex: push and pull at once (async, another host; off: a Step call)."""
    return ClientConfig(connect_timeout_s=5, rpc_timeout_s=rpc_timeout_s, init_timeout_s=5, reconnect_timeout_s=0,
                        chunk_bytes=chunk_bytes, shared_memory=shared, duplex=duplex)


@pytest.fixture
def servers(request: pytest.FixtureRequest) -> Iterator[list[RunningServer]]:
    running = [start_server(ServerConfig(port=0, threads=8, **getattr(request, "param", {}))) for _ in range(2)]
    yield running
    for s in running:
        s.stop(0)


def client(servers: list[RunningServer], cfg: ClientConfig, rank: int = 0, **spec: Any) -> ParameterClient:
    job = JobSpec(**{"num_shards": len(servers), "num_workers": 2, "lr": 0.5, **spec})
    return ParameterClient([s.address for s in servers], job, PARAMS, plan_shards(PARAMS, len(servers)), rank, cfg)


def initial() -> torch.Tensor:
    return torch.arange(N, dtype=torch.float32) / 1000


def ready(c: ParameterClient) -> torch.Tensor:
    """Join as the chief and pull clock 0; returns the flat weights."""
    c.join(initial_weights=initial)
    flat = torch.empty(N)
    c.pull(flat, 0)
    return flat


class Calls:
    """Counts the Step calls and the separate push/pull calls the shard clients of `c` make."""

    def __init__(self, c: ParameterClient, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counts = {"step": 0, "push": 0, "pull": 0}
        for s in c.shards:
            monkeypatch.setattr(s, "_step", self._counted("step", s._step))
        # (on one host a Step call goes over the server's local socket where it offers one: each
        # call starts there, whole or in stages)
        monkeypatch.setattr(LocalChannel, "start", self._counted("step", LocalChannel.start))
        for name in ("push", "pull"):
            monkeypatch.setattr(ShardClient, name, self._counted(name, getattr(ShardClient, name)))

    def _counted(self, name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.counts[name] += 1
            return fn(*args, **kwargs)

        if hasattr(fn, "with_call"):  # a gRPC callable: same-host calls read its trailing metadata
            call.with_call = self._counted(name, fn.with_call)  # type: ignore[attr-defined]
        return call


@pytest.mark.parametrize("shared", [False, True], ids=["inline", "shm"])
@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
def test_exchange_is_one_step_call_per_shard_and_equals_push_then_pull(
    servers: list[RunningServer], monkeypatch: pytest.MonkeyPatch, shared: bool, wire: str
) -> None:
    with client(servers, config(shared), wire_dtype=wire) as c:
        flat = ready(c)
        calls = Calls(c, monkeypatch)
        grad = torch.linspace(-1, 1, N)
        replies, versions = c.exchange(grad, 0, flat)
        assert calls.counts == {"step": 2, "push": 0, "pull": 0}
        assert [r.applied for r in replies] == [True, True] and versions == [1, 1] == c.base_versions
        # the weights pulled are the shards' weights after the update, sent in the wire dtype
        dtype = getattr(torch, wire)
        expected = torch.cat([s.shard.weights_copy() for s in servers]).to(dtype).float()
        assert torch.equal(flat, expected)
        torch.testing.assert_close(expected, (initial() - 0.5 * grad.to(dtype).float()).to(dtype).float())
        # the next exchange pushes with those base versions and sees its own update
        replies, versions = c.exchange(grad, 1, flat)
        assert [r.staleness for r in replies] == [0, 0] and versions == [2, 2]


def test_payloads_over_one_chunk_to_another_host_push_and_pull_separately(
    servers: list[RunningServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    with client(servers, config(shared=False, chunk_bytes=1024)) as c:  # about 4 KB per shard
        flat = ready(c)
        calls = Calls(c, monkeypatch)
        grad = torch.ones(N)
        replies, versions = c.exchange(grad, 0, flat)
        assert calls.counts == {"step": 0, "push": 2, "pull": 2}
        assert [r.applied for r in replies] == [True, True] and versions == [1, 1]
        torch.testing.assert_close(flat, initial() - 0.5)


def test_an_async_step_to_another_host_pushes_and_pulls_at_once(
    servers: list[RunningServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before (one Step call): the reply, and its weights, were sent only once the whole request had
    # arrived, so a link carried the push up, then the pull down. Each push here is held until its
    # shard's pull has begun: one after the other, that wait would time out.
    with client(servers, config(shared=False, duplex=True), num_workers=1) as c:
        flat = ready(c)
        calls = Calls(c, monkeypatch)
        pulling = {s.address: threading.Event() for s in c.shards}
        push, pull = ShardClient.push, ShardClient.pull

        def held_push(self: ShardClient, *args: Any) -> Any:
            assert pulling[self.address].wait(10), "the pull did not begin while the push was on its way"
            return push(self, *args)

        def marked_pull(self: ShardClient, *args: Any, **kwargs: Any) -> Any:
            pulling[self.address].set()
            return pull(self, *args, **kwargs)

        monkeypatch.setattr(ShardClient, "push", held_push)
        monkeypatch.setattr(ShardClient, "pull", marked_pull)
        grad = torch.linspace(-1, 1, N)
        replies, versions = c.exchange(grad, 0, flat)
        assert [r.applied for r in replies] == [True, True] and all(v in (0, 1) for v in versions), versions
        assert calls.counts["step"] == 0
        # the weights pulled: before or after this push, as the server's version says
        for i, s in enumerate(servers):
            start, end = c.plan.ranges[i]
            mine = initial()[start:end] - 0.5 * grad[start:end] if versions[i] else initial()[start:end]
            torch.testing.assert_close(flat[start:end], mine)
            torch.testing.assert_close(s.shard.weights_copy(), initial()[start:end] - 0.5 * grad[start:end])
        replies, _ = c.exchange(grad, 1, flat)  # the next push counts its staleness from what was pulled
        assert [r.staleness for r in replies] == [1 - v for v in versions]


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_sync_and_ssp_steps_stay_one_call_with_duplex_on(
    servers: list[RunningServer], monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    # Sync: the pull waits for the iteration this push completes; ssp's gate counts a worker's clock
    # from its pulls: a pull must follow its push.
    bound = {"staleness": 1} if mode == "ssp" else {}
    a, b = (client(servers, config(False, duplex=True), rank=r, mode=mode, **bound) for r in (0, 1))
    with a, b:
        t = threading.Thread(target=b.join, args=(None,))
        t.start()
        a.join(initial_weights=initial)
        t.join(timeout=30)
        b.leave()
        flat = torch.empty(N)
        a.pull(flat, 0)
        calls = Calls(a, monkeypatch)
        a.exchange(torch.ones(N), 0, flat)
        assert calls.counts == {"step": 2, "push": 0, "pull": 0}


@pytest.mark.parametrize("shared", [False, True], ids=["inline", "shm"])
def test_a_refused_push_pulls_nothing(servers: list[RunningServer], shared: bool) -> None:
    with client(servers, config(shared)) as c:
        flat = ready(c)
        before = [s.shard.status().pulls for s in servers]
        grad = torch.ones(N)
        grad[7] = float("nan")  # in shard 0's range; shard 1's part is finite
        with pytest.raises(InvalidRequestError, match="1 non-finite values"):
            c.exchange(grad, 0, flat)
        assert [s.shard.status().pulls for s in servers] == [before[0], before[1] + 1]
        assert torch.equal(servers[0].shard.weights_copy(), initial()[: c.plan.ranges[0][1]])
        # the same clock, finite this time: shard 0 applies it, shard 1 acknowledges a duplicate
        replies, versions = c.exchange(torch.ones(N), 0, flat)
        assert [r.applied for r in replies] == [True, False] and "duplicate" in replies[1].reason
        assert versions == [1, 1] and [s.shard.status().pulls for s in servers] == [before[0] + 1, before[1] + 2]
        torch.testing.assert_close(flat, initial() - 0.5)


@pytest.mark.parametrize("shared", [False, True], ids=["inline", "shm"])
def test_sync_step_waits_at_the_gate_for_the_other_worker(servers: list[RunningServer], shared: bool) -> None:
    a, b = (client(servers, config(shared), rank=r, mode="sync") for r in (0, 1))
    with a, b:
        joined = [0, 0]
        t = threading.Thread(target=lambda: joined.__setitem__(1, b.join(None)))
        t.start()
        a.join(initial_weights=initial)
        t.join(timeout=30)
        flats = [torch.empty(N), torch.empty(N)]
        a.pull(flats[0], 0)
        b.pull(flats[1], 0)
        got: dict[str, Any] = {}
        t = threading.Thread(target=lambda: got.update(a=a.exchange(torch.ones(N), 0, flats[0])))
        t.start()
        # rank 0's Step has pushed and now waits at the sync gate for rank 1's push
        assert all(s.shard.wait_until(lambda st: st.waiting == 1 and st.pending == 1, 30) for s in servers)
        assert "a" not in got
        _, versions_b = b.exchange(3 * torch.ones(N), 0, flats[1])
        t.join(timeout=30)
        assert not t.is_alive()
        _, versions_a = got["a"]
        assert versions_a == versions_b == [1, 1]
        expected = initial() - 0.5 * 2.0  # the mean of 1 and 3
        torch.testing.assert_close(flats[0], expected)
        torch.testing.assert_close(flats[1], expected)


def test_a_step_whose_pull_outlives_the_deadline_names_the_missing_worker(servers: list[RunningServer]) -> None:
    a, b = (client(servers, config(False, rpc_timeout_s=1.5), rank=r, mode="sync") for r in (0, 1))
    with a, b:
        t = threading.Thread(target=b.join, args=(None,))
        t.start()
        a.join(initial_weights=initial)
        t.join(timeout=30)
        flat = torch.empty(N)
        a.pull(flat, 0)
        with pytest.raises(StalledError, match=r"rank 0 at clock 1 was still waiting for worker\(s\) 1"):
            a.exchange(torch.ones(N), 0, flat)
        assert all(s.shard.status().pending == 1 for s in servers)  # the push itself was taken


def test_step_reply_is_a_valid_step_reply_message(servers: list[RunningServer]) -> None:
    """The hand-built reply (headers, then the weights appended) parses as ps.proto says."""
    from psgrad.proto import ps_pb2 as pb

    with client(servers, config(False)) as c:
        c.join(initial_weights=initial)
        c.pull(torch.empty(N), 0)
        start, end = c.plan.ranges[1]
        channel = grpc.insecure_channel(servers[1].address)
        try:
            step = channel.unary_unary(f"/{SERVICE_NAME}/Step", pb.StepRequest.SerializeToString, None)
            grad = torch.ones(end - start)
            raw = step(pb.StepRequest(push=c._push_header(1, 0).message(), data=grad.numpy().tobytes()), timeout=10)
        finally:
            channel.close()
        reply = pb.StepReply.FromString(raw)
        assert reply.push.applied and reply.push.version == 1
        assert (reply.pull.version, reply.pull.numel, reply.pull.dtype) == (1, end - start, "float32")
        got = torch.frombuffer(bytearray(reply.data), dtype=torch.float32)
        torch.testing.assert_close(got, initial()[start:end] - 0.5)


@pytest.mark.skipif(not (local_socket.supported() and shm.supported()), reason="needs abstract Unix sockets and /dev/shm")
def test_same_host_steps_are_all_sent_before_a_reply_is_read_on_one_thread(
    servers: list[RunningServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On one host the exchange sends every shard's Step request over its local socket, then reads
    the replies, all on the caller's thread (no hand-off to a pool thread): each server works on its
    call while the next one's request goes out. The weights are those of push then pull."""
    seen: list[tuple[str, str, int]] = []
    for name in ("start", "finish_bytes"):  # (a reply is read by finish_bytes, whoever parses it)
        def traced(self: LocalChannel, *args: Any, _orig: Any = getattr(LocalChannel, name), _name: str = name) -> Any:
            seen.append((_name, self.name, threading.get_ident()))
            return _orig(self, *args)
        monkeypatch.setattr(LocalChannel, name, traced)
    with client(servers, config(True)) as c:
        flat = ready(c)
        assert all(s.staged for s in c.shards)
        seen.clear()
        grad = torch.linspace(-1, 1, N)
        replies, versions = c.exchange(grad, 0, flat)
        sockets = [s.transport.socket._channel.name for s in c.shards]  # type: ignore[attr-defined]
        me = threading.get_ident()
        assert seen == [("start", sockets[0], me), ("start", sockets[1], me),
                        ("finish_bytes", sockets[0], me), ("finish_bytes", sockets[1], me)]
        assert [r.applied for r in replies] == [True, True] and versions == [1, 1]
        torch.testing.assert_close(flat, initial() - 0.5 * grad)


@pytest.mark.skipif(not (local_socket.supported() and shm.supported()), reason="needs abstract Unix sockets and /dev/shm")
def test_a_step_abandoned_after_its_request_went_out_drops_its_connection(servers: list[RunningServer]) -> None:
    """A Step call in stages closed between its request and its reply (its reply never read) closes
    the connection, whose late reply must not answer the next call; the next exchange connects
    afresh, and the push the server did receive is not applied twice."""
    with client(servers, config(True)) as c:
        flat = ready(c)
        start, end = c.plan.ranges[0]
        grad = torch.ones(N)
        payload, compress = c._push_payload(0, grad[start:end])
        stages = c.shards[0].stepping(c._push_header(0, 0, None, compress), payload, flat[start:end], c._pull_wire(0))
        next(stages)  # the request is out
        channel = c.shards[0].transport.socket._channel  # type: ignore[attr-defined]
        stages.close()
        assert channel._sock.fileno() == -1 and c.shards[0].transport.socket._channel is None  # type: ignore[attr-defined]
        assert servers[0].shard.wait_until(lambda st: st.version == 1, 30)  # the server had the push
        replies, versions = c.exchange(grad, 0, flat)  # clock 0 again: a duplicate on shard 0
        assert [r.applied for r in replies] == [False, True] and "duplicate" in replies[0].reason
        assert versions == [1, 1] and c.shards[0].transport.socket.calls >= 1  # type: ignore[attr-defined]
        torch.testing.assert_close(flat, initial() - 0.5)


def test_calls_in_stages_all_run_and_the_first_failure_is_raised() -> None:
    """_in_stages: every call's first stage, then every call's rest; a call that fails (at either
    stage) does not stop the others, and the first failure in call order is raised."""
    log: list[str] = []

    def call(k: int, fail_at: int | None) -> Any:
        log.append(f"send {k}")
        if fail_at == 0:
            raise ValueError(f"call {k} failed to send")
        yield
        log.append(f"read {k}")
        if fail_at == 1:
            raise KeyError(f"call {k} failed to read")
        return k * 10

    def whole(k: int) -> Any:
        log.append(f"whole {k}")
        return k * 10
        yield  # pragma: no cover

    assert _in_stages([call(0, None), whole(1), call(2, None)]) == [0, 10, 20]
    assert log == ["send 0", "whole 1", "send 2", "read 0", "read 2"]
    log.clear()
    with pytest.raises(KeyError, match="call 1 failed to read"):
        _in_stages([call(0, None), call(1, 1), call(2, 0), call(3, None)])
    assert log == ["send 0", "send 1", "send 2", "send 3", "read 0", "read 1", "read 3"]
