"""PushGated: a push through gRPC frames sends its header, waits for the server's `ready` (its turn
at the shard's receive buffer) and only then its data. Servers in-process, real gRPC channels."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch

import psgrad.client.shard_client
import psgrad.server.transfers
from psgrad.client.parameter_client import ParameterClient
from psgrad.wire.frames import PushHead
from psgrad.config import ClientConfig, JobSpec, ServerConfig
from psgrad.errors import InvalidRequestError
from psgrad.proto import ps_pb2 as pb
from psgrad.server.runtime import RunningServer, start_server
from psgrad.core.sharding import ParamSpec, plan_shards

pytestmark = pytest.mark.timeout(60)

N = 5000
PARAMS = [ParamSpec("w", (N,), "float32")]
LR = 0.5
# Every test pushes through frames (no shared memory), 1 KiB per frame: about 20 frames per push.
CONFIG = ClientConfig(connect_timeout_s=5, rpc_timeout_s=10, init_timeout_s=5, reconnect_timeout_s=0, chunk_bytes=1024,
                      shared_memory=False)


@pytest.fixture
def server() -> Iterator[RunningServer]:
    running = start_server(ServerConfig(port=0, threads=8))
    yield running
    running.stop(0)


@pytest.fixture(autouse=True)
def gate_every_push(monkeypatch: pytest.MonkeyPatch) -> None:
    """Gate pushes of any size (the default gates only those over 8 MiB)."""
    monkeypatch.setattr(psgrad.client.shard_client, "GATED_PUSH_BYTES", 0)


def client(server: RunningServer, rank: int = 0) -> ParameterClient:
    job = JobSpec(num_shards=1, num_workers=2, lr=LR, mode="async")
    return ParameterClient([server.address], job, PARAMS, plan_shards(PARAMS, 1), rank, CONFIG)


def initial() -> torch.Tensor:
    return torch.arange(N, dtype=torch.float32) / 1000


def weights(server: RunningServer) -> torch.Tensor:
    w = server.shard.weights_copy()
    assert w is not None
    return w


class Counted:
    """Counts the calls made through one of a shard client's gRPC callables."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, c: ParameterClient, attr: str) -> None:
        self.n = 0
        inner = getattr(c.shards[0], attr)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.n += 1
            return inner(*args, **kwargs)

        monkeypatch.setattr(c.shards[0], attr, call)


def test_a_gated_push_is_one_pushgated_call_and_applies_like_push(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    with client(server) as c:
        c.join(initial_weights=initial)
        gated, plain = Counted(monkeypatch, c, "_push_gated"), Counted(monkeypatch, c, "_push")
        grad = torch.linspace(-1, 1, N)
        [reply] = c.push(grad, 0)
        assert (gated.n, plain.n) == (1, 0)
        assert reply.applied and reply.version == 1
        torch.testing.assert_close(weights(server), initial() - LR * grad)
        [again] = c.push(grad, 0)  # the same key: acknowledged, not applied twice
        assert not again.applied and again.version == 1
        torch.testing.assert_close(weights(server), initial() - LR * grad)


class TurnHeld:
    """Holds the shard's receive buffer (its one turn to build SGD's next weights) as a push of
    worker 1 would, and records when the server reserves a buffer for another push and when the
    client starts reading its gradient into data frames."""

    def __init__(self, server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
        # A holder that is never behind (however long it holds the turn without sending): else the
        # other push would go ahead beside it (server/transfers.behind_in).
        monkeypatch.setattr(psgrad.server.transfers, "STALL_S", 600.0)
        monkeypatch.setattr(psgrad.server.transfers, "HOLD_GRACE_S", 600.0)
        shard = server.shard
        assert shard.layout is not None
        self._shard = shard
        self._lent = shard.push_target(1, 0, shard.version, N, "float32", shard.layout.fingerprint)
        self.order: list[str] = []
        self.data_started = threading.Event()
        servicer = type(server.servicer)
        reserve = servicer._reserve

        def reserving(this: Any, h: pb.PushHeader, context: grpc.ServicerContext) -> Any:
            got = reserve(this, h, context)
            self.order.append("reserved")
            return got

        monkeypatch.setattr(servicer, "_reserve", reserving)
        frames = psgrad.client.shard_client.data_frames

        def data_frames(payload: memoryview, chunk_bytes: int) -> Iterator[bytes]:
            self.order.append("data")
            self.data_started.set()
            yield from frames(payload, chunk_bytes)

        monkeypatch.setattr(psgrad.client.shard_client, "data_frames", data_frames)

    def release(self) -> None:
        grad, wire, _ = self._lent
        self._shard.release(grad, wire)


def _push_in_thread(c: ParameterClient, grad: torch.Tensor) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(c.push(grad, 0)), daemon=True)
    t.start()
    return t, out


def test_a_push_waiting_for_its_turn_sends_no_data_until_ready(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    with client(server, 0) as a, client(server, 1) as b:
        a.join(initial_weights=initial)
        b.join(initial_weights=initial)
        held = TurnHeld(server, monkeypatch)
        grad = torch.ones(N)
        t, out = _push_in_thread(a, grad)
        # While worker 1 holds the turn, the gated push has sent its header only: its gradient is
        # not even read into frames. (A bounded wait for something that must not happen.)
        assert not held.data_started.wait(0.5)
        held.release()
        t.join(10)
        assert out and out[0][0].applied
        assert held.order == ["reserved", "data"]
        torch.testing.assert_close(weights(server), initial() - LR * grad)


def test_an_ungated_push_sends_its_data_while_it_waits(server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The contrast: through plain Push the gradient streams (into the server's flow-control
    window) before the push has a buffer."""
    monkeypatch.setattr(psgrad.client.shard_client, "GATED_PUSH_BYTES", 1 << 30)
    with client(server, 0) as a, client(server, 1) as b:
        a.join(initial_weights=initial)
        b.join(initial_weights=initial)
        held = TurnHeld(server, monkeypatch)
        t, out = _push_in_thread(a, torch.ones(N))
        assert held.data_started.wait(10)
        held.release()
        t.join(10)
        assert out and out[0][0].applied
        assert held.order == ["data", "reserved"]


def test_a_gated_push_refused_before_ready_raises_and_changes_nothing(server: RunningServer) -> None:
    with client(server) as c:
        c.join(initial_weights=initial)
        header = pb.PushHeader(rank=0, clock=0, base_version=0, numel=N + 1, dtype="float32", fingerprint=c.fingerprint)
        payload = memoryview(bytes(4 * (N + 1)))
        with pytest.raises(InvalidRequestError, match=f"has {N + 1} elements"):
            c.shards[0].frames.push(PushHead(header), payload)
        assert server.shard.version == 0
        torch.testing.assert_close(weights(server), initial())
        [reply] = c.push(torch.ones(N), 0)  # the shard is not left waiting for anything
        assert reply.applied


def test_a_push_abandoned_after_ready_gives_its_turn_back(server: RunningServer) -> None:
    with client(server) as c:
        c.join(initial_weights=initial)
        header = pb.PushHeader(rank=0, clock=0, base_version=0, numel=N, dtype="float32", fingerprint=c.fingerprint)
        go_on = threading.Event()

        def frames() -> Iterator[bytes]:
            yield pb.PushFrame(header=header).SerializeToString()
            go_on.wait(10)  # never sends data: the call is cancelled first

        call = c.shards[0]._push_gated(frames(), timeout=10)
        assert next(call).ready
        call.cancel()
        go_on.set()
        # Holding the shard's only turn would keep this push waiting past its deadline.
        [reply] = c.push(torch.ones(N), 0)
        assert reply.applied and reply.version == 1
        assert server.shard.status().pushes_rejected == 1


@pytest.mark.parametrize("threshold, gated", [(4 * N, 0), (4 * N - 1, 1)], ids=["at-threshold", "above"])
def test_only_pushes_above_the_threshold_are_gated(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch, threshold: int, gated: int
) -> None:
    monkeypatch.setattr(psgrad.client.shard_client, "GATED_PUSH_BYTES", threshold)
    with client(server) as c:
        c.join(initial_weights=initial)
        calls, plain = Counted(monkeypatch, c, "_push_gated"), Counted(monkeypatch, c, "_push")
        [reply] = c.push(torch.ones(N), 0)  # a 4 * N byte payload
        assert reply.applied and (calls.n, plain.n) == (gated, 1 - gated)


@pytest.mark.timeout(60)
def test_a_gated_push_failed_by_the_server_mid_stream_raises_its_error(
    server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server refuses the data after a few frames, while the client still has megabytes to send
    (more than the stream window): the client raises the server's error, not a deadline."""
    import psgrad.server.transfers

    big = 3 << 20  # 12 MB of float32: more than the 4 MiB window, so the sender is still sending
    params = [ParamSpec("w", (big,), "float32")]
    write = psgrad.server.transfers.PushWriter.write
    seen = [0]

    def failing(self: psgrad.server.transfers.PushWriter, piece: memoryview) -> None:
        seen[0] += 1
        if seen[0] == 3:
            raise InvalidRequestError("refused at the third frame")
        write(self, piece)

    monkeypatch.setattr(psgrad.server.transfers.PushWriter, "write", failing)
    # A deadline past the test's timeout: a push left waiting for its stream would fail the test.
    config = ClientConfig(connect_timeout_s=5, rpc_timeout_s=300, reconnect_timeout_s=0, shared_memory=False)
    job = JobSpec(num_shards=1, num_workers=1, lr=LR, mode="async")
    with ParameterClient([server.address], job, params, plan_shards(params, 1), 0, config) as c:
        c.join(initial_weights=lambda: torch.zeros(big))
        calls = Counted(monkeypatch, c, "_push_gated")
        with pytest.raises(InvalidRequestError, match="refused at the third frame"):
            c.push(torch.ones(big), 0)
        assert calls.n == 1 and seen[0] == 3
        assert server.shard.version == 0 and server.shard.status().pushes_rejected == 1
        monkeypatch.setattr(psgrad.server.transfers.PushWriter, "write", write)
        [reply] = c.push(torch.ones(big), 1)  # the turn was given back
        assert reply.applied and reply.version == 1
