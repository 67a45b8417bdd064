"""The transport a shard client's payloads go through (psgrad.client.transport), picked when the
server answers Join: shared memory from a server on this host with shared memory on, frames with it
off, frames for good once shared memory is refused for good; picked again only when a Join answers
differently (servers in-process, real gRPC channels)."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from psgrad.client import parameter_client
from psgrad.client.parameter_client import ParameterClient
from psgrad.client.same_host import SharedMemoryTransport
from psgrad.client.shard_client import FramesTransport
from psgrad.config import ClientConfig, JobSpec, ServerConfig
from psgrad.core.sharding import ParamSpec, plan_shards
from psgrad.server.runtime import RunningServer, start_server
from psgrad.wire import shm

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not shm.supported(), reason="no /dev/shm on this host"),
]


@pytest.fixture(autouse=True)
def _lend_small_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests' models are small: lend their versions all the same (by default a shard's
    weights below LEND_MIN_BYTES are copied into the segment, not lent)."""
    monkeypatch.setattr(parameter_client, "LEND_MIN_BYTES", 0)

PARAMS = [ParamSpec("w", (300, 7), "float32"), ParamSpec("b", (13,), "float32")]  # 2113 elements
N = 2113


@pytest.fixture
def servers() -> Iterator[list[RunningServer]]:
    running = [start_server(ServerConfig(port=0, threads=8)) for _ in range(2)]
    yield running
    for s in running:
        s.stop(0)


def client(servers: list[RunningServer], shared: bool = True) -> ParameterClient:
    config = ClientConfig(connect_timeout_s=5, rpc_timeout_s=10, init_timeout_s=5, reconnect_timeout_s=0,
                          chunk_bytes=1024, shared_memory=shared)
    job = JobSpec(num_shards=len(servers), num_workers=1, lr=0.5)
    return ParameterClient([s.address for s in servers], job, PARAMS, plan_shards(PARAMS, len(servers)), 0, config)


def initial() -> torch.Tensor:
    return torch.arange(N, dtype=torch.float32) / 1000


def attached(servers: list[RunningServer]) -> int:
    return sum(len(s.servicer._segments) for s in servers)


def test_a_same_host_server_with_shared_memory_on_picks_shared_memory(servers: list[RunningServer]) -> None:
    with client(servers) as c:
        assert all(isinstance(s.transport, FramesTransport) for s in c.shards)  # until the Join answer
        c.join(initial_weights=initial)
        assert c.transports() == ["shm", "shm"] and all(s.same_host for s in c.shards)
        for s in c.shards:
            assert isinstance(s.transport, SharedMemoryTransport)
            assert s.transport.frames is s.frames  # its fallback for a single transfer
        picked = [s.transport for s in c.shards]
        flat = torch.empty(N)
        c.exchange(torch.ones(N), 0, flat)
        c.join(initial_weights=None)  # joining the same servers again keeps the transport
        assert [s.transport for s in c.shards] == picked
        assert attached(servers) == 2  # the payloads went through the segments
        torch.testing.assert_close(flat, initial() - 0.5)


def test_shared_memory_off_picks_frames(servers: list[RunningServer]) -> None:
    with client(servers, shared=False) as c:
        c.join(initial_weights=initial)
        assert c.transports() == ["grpc", "grpc"] and not any(s.same_host for s in c.shards)
        assert all(s.transport is s.frames for s in c.shards)
        flat = torch.empty(N)
        c.exchange(torch.ones(N), 0, flat)
        assert attached(servers) == 0
        torch.testing.assert_close(flat, initial() - 0.5)


def test_shared_memory_refused_for_good_switches_to_frames_for_good(
    servers: list[RunningServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    def elsewhere(value: str, nbytes: int) -> shm.Attached:
        raise shm.SharedMemoryUnavailable("as if on another host")

    monkeypatch.setattr(shm, "attach", elsewhere)
    with client(servers) as c:
        c.join(initial_weights=initial)
        assert c.transports() == ["shm", "shm"]
        flat = torch.empty(N)
        replies, _ = c.exchange(torch.ones(N), 0, flat)  # refused, then pushed and pulled as frames
        assert all(r.applied for r in replies)
        assert c.transports() == ["grpc", "grpc"] and all(s.transport is s.frames for s in c.shards)
        c.join(initial_weights=None)  # the servers still say they take segments: frames all the same
        assert c.transports() == ["grpc", "grpc"]
        c.exchange(torch.ones(N), 1, flat)
        torch.testing.assert_close(flat, initial() - 1.0)
        assert [s.shard.status().pushes_applied for s in servers] == [2, 2]


def test_a_join_that_answers_otherwise_picks_again(servers: list[RunningServer], monkeypatch: pytest.MonkeyPatch) -> None:
    """As after a failover to a server on another host, and back: the shard client picks frames,
    then its shared-memory transport again (which maps the server's ring afresh)."""
    with client(servers) as c:
        c.join(initial_weights=initial)
        shared = [s.transport for s in c.shards]
        with monkeypatch.context() as m:
            m.setattr(shm, "same_host_server", lambda metadata: False)
            c.join(initial_weights=None)
            assert c.transports() == ["grpc", "grpc"]
            flat = torch.empty(N)
            c.exchange(torch.ones(N), 0, flat)
        c.join(initial_weights=None)
        assert [s.transport for s in c.shards] == shared
        c.exchange(torch.ones(N), 1, flat, published=True)
        views = c.views()
        assert all(v is not None for v in views)
        torch.testing.assert_close(torch.cat([v for v in views if v is not None]), initial() - 1.0)
