"""Two worker processes with one rank: the later Join takes the rank over, and the shards refuse the
earlier process's pushes, heartbeats and leave from then on (SupersededError, never retried), where
they used to take both processes' steps as one worker's (in async, the pushes of equal clocks were
acknowledged as duplicates and dropped, silently). Each ParameterClient stands for a process: it
draws its own incarnation number."""
from __future__ import annotations

import pytest
import torch

from conftest import run_in_threads
from psgrad.client.parameter_client import ParameterClient
from psgrad.config import ClientConfig, JobSpec, ServerConfig
from psgrad.core.sharding import ParamSpec, plan_shards
from psgrad.errors import SupersededError
from psgrad.server.runtime import start_server

pytestmark = pytest.mark.timeout(90)

PARAMS = [ParamSpec("w", (16,), "float32")]
CONFIG = ClientConfig(connect_timeout_s=10, rpc_timeout_s=20, reconnect_timeout_s=30, shared_memory=False)


def _client(address: str, spec: JobSpec, rank: int) -> ParameterClient:
    return ParameterClient([address], spec, PARAMS, plan_shards(PARAMS, 1), rank, CONFIG)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_second_process_with_a_rank_takes_it_over_and_the_first_is_refused(mode: str) -> None:
    spec = JobSpec(mode=mode, lr=0.5, num_shards=1, num_workers=2)
    server = start_server(ServerConfig(port=0, threads=8, lease_s=30.0))
    first, other = _client(server.address, spec, 0), _client(server.address, spec, 1)
    second = _client(server.address, spec, 0)  # started with rank 0 too
    flats = {c: torch.empty(16) for c in (first, other, second)}
    try:
        run_in_threads(2, lambda r: (first, other)[r].join((lambda: torch.zeros(16)) if r == 0 else None))
        run_in_threads(2, lambda r: (first, other)[r].exchange(torch.ones(16), 0, flats[(first, other)[r]]))
        assert server.shard.version == (1 if mode == "sync" else 2)
        clock = second.join(None)
        assert clock == 1 and first.incarnation != second.incarnation
        before = server.shard.version
        with pytest.raises(SupersededError, match="another process joined as worker rank 0"):
            first.exchange(torch.full((16,), 100.0), 1, flats[first])
        assert server.shard.version == before  # nothing of its push applied
        with pytest.raises(SupersededError):
            first.shards[0].heartbeat(0, first.fingerprint, first.incarnation)
        first.leave()  # (its goodbye leaves nothing: rank 0 is the second process's)
        assert 0 in server.shard.live_ranks()
        # The job goes on with the process that took the rank over (sync: its iteration completes).
        run_in_threads(2, lambda r: (second, other)[r].exchange(torch.ones(16), 1, flats[(second, other)[r]]))
        assert server.shard.version == before + (1 if mode == "sync" else 2)
        final = torch.empty(16)
        other.pull(final, 2, observe=True)
        applied = 2 if mode == "sync" else 4  # (iterations, or pushes, of ones at lr 0.5: none of the 100s)
        assert torch.equal(final, torch.full((16,), -0.5 * applied))
        second.leave()
        assert 0 not in server.shard.live_ranks()  # (its own leave does)
    finally:
        for c in (first, other, second):
            c.close()
        server.stop(0)
