"""Input this project's clients never send but a broken or hostile one can (found by fuzzing a
serving shard with raw calls): each is refused by name before it changes anything, and the job
goes on."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from conftest import run_in_threads
from psgrad.client.parameter_client import ParameterClient
from psgrad.config import ClientConfig, JobSpec, ServerConfig
from psgrad.core.sharding import ParamSpec, plan_shards
from psgrad.errors import InvalidRequestError
from psgrad.server.runtime import RunningServer, start_server

pytestmark = pytest.mark.timeout(60)

PARAMS = [ParamSpec("w", (64,), "float32")]
JOB = JobSpec(num_shards=1, num_workers=2, lr=0.5, mode="sync")
CONFIG = ClientConfig(connect_timeout_s=5, rpc_timeout_s=20, init_timeout_s=20, reconnect_timeout_s=0,
                      shared_memory=False)


@pytest.fixture
def server() -> Iterator[RunningServer]:
    running = start_server(ServerConfig(port=0, lease_s=60))
    yield running
    running.stop(0)


def client(server: RunningServer, rank: int) -> ParameterClient:
    return ParameterClient([server.address], JOB, PARAMS, plan_shards(PARAMS, 1), rank, CONFIG)


def test_a_learning_rate_float32_cannot_hold_is_refused_at_the_header_and_the_sync_job_goes_on(server) -> None:  # type: ignore[no-untyped-def]
    """Before: a push carrying lr 1e39 (finite, past float32) was taken, set the job's lr, and
    overflowed as the iteration was applied, after its gradients were taken from the round: the
    shard's version stayed behind the workers' clocks and every later call of the sync job waited or
    was refused (UNKNOWN to the caller)."""
    chief, other = client(server, 0), client(server, 1)
    with chief, other:
        run_in_threads(2, lambda r: (chief, other)[r].join(initial_weights=(lambda: torch.zeros(64)) if r == 0 else None))
        with pytest.raises(InvalidRequestError, match=r"carries learning rate 1e\+39; times the largest lr_scale here "
                                                      r"\(1\) it must be at most 3.403e\+38"):
            chief.push(torch.ones(64), 0, lr=1e39)
        flat = torch.empty(64)
        for clock in range(2):  # the refused push changed nothing: the iteration runs as if it never came
            run_in_threads(2, lambda r: (chief, other)[r].push(torch.full((64,), float(r + 1)), clock))
            run_in_threads(2, lambda r: (chief, other)[r].pull(flat, clock + 1))
        assert server.shard.version == 2
        torch.testing.assert_close(flat, torch.full((64,), -2 * 0.5 * 1.5))  # two means of 1 and 2, at the job's lr

