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



def test_a_tables_base_version_outside_the_tables_is_refused_and_changes_nothing(start_servers) -> None:  # type: ignore[no-untyped-def]
    """A push's per-table base version (the table version its rows were read at) only feeds the
    table's staleness figures. Before: one past the table's version (or an int64 -1 sent as the
    wire's uint64) was taken, its rows applied, and counted as staleness 0; now the push is refused
    by name, as a whole, at its header. A real server process."""
    from psgrad.client.parameter_client import shard_status
    from psgrad.core.sharding import TableSpec

    (address,) = start_servers(1)
    table = TableSpec("emb", 1000, 4, 1, 0.1)
    job = JobSpec(num_shards=1, num_workers=1, lr=0.5, mode="async", optimizer="adagrad")
    c = ParameterClient([address], job, PARAMS, plan_shards(PARAMS, 1), 0, CONFIG, tables=[table])
    ids = torch.tensor([3, 5, 8])

    def push(clock: int) -> None:
        c.push(torch.ones(64), clock, rows={"emb": (ids, torch.full((3, 4), float(clock + 1)))})

    def status():  # type: ignore[no-untyped-def]
        (st,) = shard_status([address], 10)
        (emb,) = [t for t in st.tables if t.name == "emb"]
        return st, emb

    with c:
        c.join(initial_weights=lambda: torch.zeros(64))
        for clock in range(2):
            c.pull_rows("emb", ids)  # the rows read at the table's version: the base of the next push
            push(clock)
        before, table_before = status()
        assert table_before.updates == 2 and table_before.staleness_max == 0
        rows = c.pull_rows("emb", ids)
        for bogus in (3, 2**40, 2**64 - 1):  # past the table's 2 (2**64 - 1: an int64 -1 as the wire's uint64)
            c.row_versions[("emb", 0)] = bogus
            with pytest.raises(InvalidRequestError, match=f"push from worker rank 0: table 'emb''s rows claim base "
                                                          f"version {bogus}, but the table is at version 2 on this "
                                                          "shard: .* 0 to 2"):
                push(2)
        after, table_after = status()
        assert after.version == before.version == 2 and after.pushes_rejected == before.pushes_rejected + 3
        assert table_after == table_before  # no update, its staleness figures untouched
        assert torch.equal(c.pull_rows("emb", ids), rows)
        c.row_versions[("emb", 0)] = 0  # read two updates ago: a base it may claim
        push(2)  # the refused clock, mended: applied
        _, table_after = status()
        assert table_after.updates == 3 and table_after.staleness_max == 2
