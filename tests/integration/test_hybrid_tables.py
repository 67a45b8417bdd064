"""Hybrid consistency (Persia's): a sync job whose embedding tables are async (`--tables-mode async`).
The dense part stays one averaged update per iteration; each worker's row gradients are applied as
its push arrives (the tables' version moves with each push), on the primary and on its hot standby.
In-process servers, real gRPC channels; the updates are checked against plain arithmetic (SGD)."""
from __future__ import annotations

import threading

import pytest
import torch

from conftest import run_in_threads, wait_for
from psgrad.client.parameter_client import ParameterClient
from psgrad.config import ClientConfig, JobSpec, ServerConfig
from psgrad.core import rows as placement
from psgrad.core.sharding import ParamSpec, TableSpec, plan_shards
from psgrad.errors import ConfigError
from psgrad.experiments.modes import parse_mode
from psgrad.server.runtime import start_server
from psgrad.server.tables import SparseTable
from psgrad.wire import serde

pytestmark = pytest.mark.timeout(120)

NUMEL, ROWS, DIM, LR = 50, 1000, 4, 0.5
PARAMS = [ParamSpec("w", (NUMEL,), "float32")]
TABLE = TableSpec("emb", ROWS, DIM, 3, 1.0)
CONFIG = ClientConfig(connect_timeout_s=5, rpc_timeout_s=20, reconnect_timeout_s=0, shared_memory=False)


def test_the_tables_mode_is_a_job_setting_in_one_spelling() -> None:
    spec = JobSpec(mode="sync", tables_mode="async", num_workers=2)
    assert spec.tables_mode == "async" and JobSpec(mode="sync", tables_mode="sync").tables_mode == ""
    assert serde.job_spec_from_proto(serde.job_spec_to_proto(spec)) == spec
    assert spec.to_argv()[:4] == ["--mode", "sync", "--tables-mode", "async"]
    assert JobSpec(mode="sync", num_workers=2).differences(spec) == [("tables_mode", "", "async")]  # the servers refuse a mismatch
    assert JobSpec(mode="async", tables_mode="async").tables_mode == ""  # the job's own mode
    for mode, tables in (("ssp", "async"), ("async", "sync"), ("sync", "ssp")):
        with pytest.raises(ConfigError, match=f"tables mode '{tables}' with mode '{mode}': the tables may be async in a sync job"):
            JobSpec(mode=mode, tables_mode=tables)
    with pytest.raises(ConfigError, match="unknown tables_mode 'eventual'"):
        JobSpec(mode="sync", tables_mode="eventual")
    assert parse_mode("sync:tables=async").tables_mode == "async"
    with pytest.raises(ConfigError, match="'tables=async' is not an option of async"):
        parse_mode("async:tables=async")


def initial(ids: torch.Tensor) -> torch.Tensor:
    return placement.initial_rows(placement.table_key(TABLE.seed, "emb"), ids, DIM, TABLE.std)


@pytest.mark.parametrize("tables_mode", ["", "async"])
def test_async_tables_in_a_sync_job_take_each_push_as_it_comes(tables_mode: str) -> None:
    primary = start_server(ServerConfig(port=0, threads=16))
    backup = start_server(ServerConfig(port=0, threads=16, replica_of=primary.address))
    spec = JobSpec(mode="sync", lr=LR, num_workers=2, tables_mode=tables_mode)
    clients = [ParameterClient([f"{primary.address}|{backup.address}"], spec, PARAMS, plan_shards(PARAMS, 1), r,
                               CONFIG, tables=[TABLE]) for r in range(2)]
    try:
        w0 = torch.linspace(-1, 1, NUMEL)
        run_in_threads(2, lambda r: clients[r].join((lambda: w0.clone()) if r == 0 else None))
        ids = torch.tensor([3, 7, 11])
        g = [torch.full((3, DIM), 1.0 + r) for r in range(2)]  # worker 0's rows: 1, worker 1's: 2
        dense = [torch.full((NUMEL,), 0.1 * (r + 1)) for r in range(2)]
        state = primary.shard.core.state
        assert state is not None
        table = state.tables["emb"]
        assert isinstance(table, SparseTable)

        for c in clients:
            c.pull(torch.empty(NUMEL), 0)
        # Worker 0's push is buffered until worker 1's (with a standby its reply waits for the
        # iteration: it is pushed from a thread of its own).
        first = threading.Thread(target=clients[0].push, args=(dense[0], 0), kwargs={"rows": {"emb": (ids, g[0])}},
                                 daemon=True)
        first.start()
        wait_for("worker 0's buffered push", lambda: primary.shard.status().pending == 1)
        assert state.version == 0  # the dense iteration waits for worker 1
        if tables_mode:  # ... the tables do not: worker 0's rows are applied already
            assert table.version == 1 and torch.equal(table.rows(ids), initial(ids) - LR * g[0])
        else:
            assert table.version == 0 and torch.equal(table.rows(ids), initial(ids))
        clients[1].push(dense[1], 0, rows={"emb": (ids, g[1])})
        first.join(timeout=60)
        assert not first.is_alive() and state.version == 1
        assert torch.allclose(state.weights, w0 - LR * (dense[0] + dense[1]) / 2)  # the dense mean, either way
        if tables_mode:  # each worker's rows as a step of its own
            expected, version = initial(ids) - LR * g[0] - LR * g[1], 2
        else:  # the iteration's mean
            expected, version = initial(ids) - LR * (g[0] + g[1]) / 2, 1
        assert table.version == version and torch.allclose(table.rows(ids), expected)
        backup_state = backup.shard.core.state
        assert backup_state is not None
        wait_for("the standby to follow", lambda: backup_state.tables["emb"].version == version, timeout_s=20)
        mirrored = backup_state.tables["emb"]
        assert isinstance(mirrored, SparseTable) and torch.equal(mirrored.rows(ids), table.rows(ids))
        assert torch.equal(backup_state.weights, state.weights)
    finally:
        for c in clients:
            c.close()
        backup.stop(0)
        primary.stop(0)


def test_a_hybrid_push_whose_rows_fail_as_applied_is_undone_and_the_standby_keeps_the_others(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With async tables a push's rows are applied as it arrives, and the iteration's record carries
    them to the standby. One whose rows fail as they are applied (injected: the row update writes,
    then raises) is undone and refused, and only its own rows leave that record: the rows of the
    pushes applied before it still reach the standby. Its retry applies once; primary and standby
    end alike, as plain arithmetic says."""
    from psgrad.errors import ApplyFailedError

    primary = start_server(ServerConfig(port=0, threads=16))
    backup = start_server(ServerConfig(port=0, threads=16, replica_of=primary.address))
    spec = JobSpec(mode="sync", lr=LR, num_workers=2, tables_mode="async")
    clients = [ParameterClient([f"{primary.address}|{backup.address}"], spec, PARAMS, plan_shards(PARAMS, 1), r,
                               CONFIG, tables=[TABLE]) for r in range(2)]
    armed: list[bool] = []
    apply = SparseTable.apply

    def faulty(self: SparseTable, *args: object, **kwargs: object) -> object:
        out = apply(self, *args, **kwargs)  # type: ignore[arg-type]
        if armed and not kwargs.get("replicated"):
            armed.clear()
            raise RuntimeError("injected: a row kernel failed after writing")
        return out

    monkeypatch.setattr(SparseTable, "apply", faulty)
    try:
        w0 = torch.linspace(-1, 1, NUMEL)
        run_in_threads(2, lambda r: clients[r].join((lambda: w0.clone()) if r == 0 else None))
        ids = torch.tensor([3, 7, 11])
        g = [torch.full((3, DIM), 1.0 + r) for r in range(2)]
        dense = [torch.full((NUMEL,), 0.1 * (r + 1)) for r in range(2)]
        state = primary.shard.core.state
        assert state is not None
        table = state.tables["emb"]
        for c in clients:
            c.pull(torch.empty(NUMEL), 0)
        first = threading.Thread(target=clients[0].push, args=(dense[0], 0), kwargs={"rows": {"emb": (ids, g[0])}},
                                 daemon=True)
        first.start()
        wait_for("worker 0's buffered push", lambda: primary.shard.status().pending == 1)
        applied_once = initial(ids) - LR * g[0]
        assert table.version == 1 and torch.equal(table.rows(ids), applied_once)
        armed.append(True)
        with pytest.raises(ApplyFailedError, match="undone"):
            clients[1].push(dense[1], 0, rows={"emb": (ids, g[1])})
        assert not armed and table.version == 1 and torch.equal(table.rows(ids), applied_once)  # undone
        assert state.version == 0 and primary.shard.status().pending == 1
        clients[1].push(dense[1], 0, rows={"emb": (ids, g[1])})  # the retry: applied once
        first.join(timeout=60)
        assert not first.is_alive() and state.version == 1
        assert table.version == 2 and torch.allclose(table.rows(ids), initial(ids) - LR * g[0] - LR * g[1])
        backup_state = backup.shard.core.state
        assert backup_state is not None
        wait_for("the standby to follow", lambda: backup_state.version == 1, timeout_s=20)
        mirrored = backup_state.tables["emb"]
        assert isinstance(mirrored, SparseTable) and mirrored.version == 2
        assert torch.equal(mirrored.rows(ids), table.rows(ids))  # worker 0's rows too
        assert torch.equal(backup_state.weights, state.weights)
    finally:
        for c in clients:
            c.close()
        backup.stop(0)
        primary.stop(0)
