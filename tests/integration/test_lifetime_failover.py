"""A dynamic table with a row lifetime (admission after min_count sightings, expiry, eviction at the
memory budget) on a primary with a hot standby, real server processes: the standby follows what
the primary's row lifetime did (the ids it counted for admission, the rows it stored, expired and
evicted, and its counts of them), so after SIGKILL of the primary the job goes on from the standby
and ends bit for bit as the same job on a server that never failed. (Before, the standby's
admission counts stayed as they were when it attached and it counted no drops: after a failover ids
were admitted later than on the primary, and the shard's counters started from 0.) A standby
attached mid-run lays its tables' storage out as the primary's: the same arena capacity, and it
grows as the primary's does."""
from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from torch import nn

import psgrad
from conftest import Proc, wait_for
from psgrad.client.parameter_client import shard_status
from psgrad.config import ClientConfig
from psgrad.core.status import TableStatus

pytestmark = pytest.mark.timeout(120)

DIM, LR, STEPS, KILL_AT = 8, 0.5, 40, 20
BUDGET_MB = "2.09"  # the admission counts (2 MiB) and an arena of 1,024 rows, not the 2,048 it would grow to
CLIENT = ClientConfig(connect_timeout_s=10, rpc_timeout_s=30, reconnect_timeout_s=30, shared_memory=False)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.item = psgrad.Embedding(None, DIM, min_count=2, ttl=16, evict=True)
        self.head = nn.Linear(DIM, 1)


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)  # hot ids, and a wide spread seen once or twice: all of admission's paths
    return [torch.randint(0, 6000 if step % 2 else 300, (256,), generator=g) for step in range(STEPS)]


def train(servers: str, xs: Sequence[torch.Tensor], between: Callable[[], None] | None = None) -> dict[str, torch.Tensor]:
    """One worker's sync job of steps xs (loss: the sum of the looked-up rows; `between` run after
    KILL_AT steps); returns the job's state_dict fetched from the servers at its end."""
    torch.manual_seed(0)
    model = Model()
    with psgrad.connect(servers, mode="sync", optimizer=psgrad.SGD(lr=LR), client=CLIENT) as ps:
        opt = ps.optimizer(model)
        for step, x in enumerate(xs):
            if step == KILL_AT and between is not None:
                between()
            opt.zero_grad()
            model.item(x).sum().backward()
            model.head.weight.grad = torch.zeros_like(model.head.weight)
            opt.step()
        return psgrad.fetch_state_dict(servers)


def lifetime(address: str) -> tuple[int, ...]:
    """The dynamic table's counts on the server at `address`: rows, admitted, dropped, expired,
    evicted, updates."""
    (status,) = shard_status([address], 10)
    (t,) = [t for t in status.tables if t.kind == "sparse"]
    assert isinstance(t, TableStatus)
    return t.rows_touched, t.admitted, t.dropped, t.expired, t.evicted, t.updates


def test_a_standby_follows_the_row_lifetime_and_a_job_that_fails_over_ends_as_one_that_did_not(
        start_servers, server_procs: list[Proc]) -> None:  # type: ignore[no-untyped-def]
    reference, primary = start_servers(2, "--memory-budget-mb", BUDGET_MB)
    primary_proc = server_procs[-1]
    [backup] = start_servers(1, "--memory-budget-mb", BUDGET_MB, "--replica-of", primary)
    wait_for("the backup to attach", lambda: shard_status([primary], 10)[0].replica.backup != "", timeout_s=30)
    xs = batches()
    expected = train(reference, xs)
    counts = lifetime(reference)
    _, admitted, dropped, expired, evicted, _ = counts
    assert admitted and dropped and expired and evicted, counts  # (every part of the lifetime at work)

    def check_the_standby_then_kill_the_primary() -> None:
        def replicated() -> bool:
            (st,) = shard_status([primary], 10)
            return st.replica.replicated_version == st.version
        wait_for("the backup to acknowledge every update", replicated, timeout_s=30)
        mine, its = lifetime(primary), lifetime(backup)
        assert mine == its, (mine, its)
        assert mine[2] and mine[3], mine  # dropped and expired before the failover: the standby counted them
        primary_proc.popen.kill()
        assert primary_proc.wait(30) != 0

    got = train(f"{primary}|{backup}", xs, between=check_the_standby_then_kill_the_primary)
    assert shard_status([backup], 10)[0].replica.role == "primary"  # (it took over)
    assert lifetime(backup) == counts, (lifetime(backup), counts)
    assert got.keys() == expected.keys()
    for key, value in expected.items():  # bit for bit: the rows stored, their values, the dense weights
        assert torch.equal(got[key], value), key


class Grows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.item = psgrad.Embedding(None, DIM, evict=True)  # (48 bytes a row with SGD, and its hash index's places)
        self.head = nn.Linear(DIM, 1)


def storage(address: str) -> tuple[int, ...]:
    """The dynamic table's storage on the server at `address`: capacity (rows before it grows), rows
    stored, evicted, updates."""
    (status,) = shard_status([address], 10)
    (t,) = [t for t in status.tables if t.kind == "sparse"]
    return t.capacity, t.rows_touched, t.evicted, t.updates


def test_a_standby_attached_mid_run_takes_the_primarys_arena_capacity_and_grows_as_it_does(
        start_servers) -> None:  # type: ignore[no-untyped-def]
    """Before: a standby attached mid-run made its arena as large as the rows it was sent (1,500),
    where the primary's had doubled to 2,048, so it grew to other sizes than the primary's (3,000 and
    6,000 where the primary's were 2,048 and 4,096) and charged the budget more: near the budget it
    refused an update its primary had applied (MemoryBudgetError, growing to 4,200 rows), and the
    primary dropped it (it attached again). Real processes, --memory-budget-mb 0.5: the primary stores
    1,500 rows alone, a standby attaches, and both tables have the same capacity then, and after
    each step that follows, as the table grows (doubling, then to what the budget holds) and
    evicts."""
    [primary] = start_servers(1, "--memory-budget-mb", "0.5")
    g = torch.Generator().manual_seed(2)
    fresh = iter(torch.randperm(1 << 20, generator=g).split(300))  # 300 new ids a step
    torch.manual_seed(0)
    model = Grows()

    def replicated() -> bool:
        (st,) = shard_status([primary], 10)
        return st.replica.backup != "" and st.replica.replicated_version == st.version

    with psgrad.connect([primary], mode="async", optimizer=psgrad.SGD(lr=LR), client=CLIENT) as ps:
        opt = ps.optimizer(model)

        def step() -> None:
            opt.zero_grad()
            model.item(next(fresh)).sum().backward()
            model.head.weight.grad = torch.zeros_like(model.head.weight)
            opt.step()

        for _ in range(5):
            step()
        capacity, rows, evicted, _ = storage(primary)
        assert (capacity, rows, evicted) == (2048, 1500, 0)  # (doubled from 1,024)
        [backup] = start_servers(1, "--memory-budget-mb", "0.5", "--replica-of", primary)
        wait_for("the backup to attach and take the state", replicated, timeout_s=30)
        seen = [storage(primary)]
        assert storage(backup) == seen[-1], (storage(backup), seen[-1])
        while seen[-1][2] == 0 or len(seen) < 4:  # on until the budget is reached and the table evicts
            assert len(seen) < 60, seen
            step()
            wait_for("the backup to acknowledge every update", replicated, timeout_s=30)
            seen.append(storage(primary))
            assert storage(backup) == seen[-1], (storage(backup), seen)  # at every size the table passes through
        capacities = sorted({capacity for capacity, *_ in seen})
        assert capacities[:2] == [2048, 4096] and len(capacities) >= 3, seen  # (doubled, then up to the budget)


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.item = psgrad.Embedding(1000, DIM)
        self.head = nn.Linear(DIM, 1)


def test_a_promoted_standby_continues_the_shards_counters(start_servers, server_procs: list[Proc]) -> None:  # type: ignore[no-untyped-def]
    """Before: replication records carried no counters, so a standby that took over counted from 0
    (`psgrad status` and the metrics said a shard that had applied thousands of pushes had applied
    the few since the failover; a checkpoint it then wrote kept that). Real processes: a primary and
    its standby, an async job of 12 steps and a refused push, SIGKILL of the primary, 4 more steps:
    the promoted standby's counters continue the primary's (pushes applied, rejected, the
    staleness histogram, pulls, bytes), as do its table's."""
    primary, = start_servers(1)
    primary_proc = server_procs[-1]
    [backup] = start_servers(1, "--replica-of", primary)
    wait_for("the backup to attach", lambda: shard_status([primary], 10)[0].replica.backup != "", timeout_s=30)
    torch.manual_seed(0)
    model = Small()
    g = torch.Generator().manual_seed(3)
    with psgrad.connect(f"{primary}|{backup}", mode="async", optimizer=psgrad.SGD(lr=LR), client=CLIENT) as ps:
        opt = ps.optimizer(model)

        def step() -> None:
            opt.zero_grad()
            model.head(model.item(torch.randint(0, 1000, (32,), generator=g))).sum().backward()
            opt.step()

        for _ in range(8):
            step()
        bad = torch.zeros(opt.client.plan.total)
        bad[0] = float("nan")
        with pytest.raises(psgrad.errors.NonFiniteGradientError):  # refused: counted, not applied
            opt.client.push(bad, opt.clock)
        for _ in range(4):
            step()

        def replicated() -> bool:
            (st,) = shard_status([primary], 10)
            return st.replica.replicated_version == st.version

        wait_for("the backup to acknowledge every update", replicated, timeout_s=30)
        (before,) = shard_status([primary], 10)
        assert before.pushes_applied == 12 and before.pushes_rejected == 1, before
        (table,) = [t for t in before.tables if t.kind == "sparse"]
        primary_proc.popen.kill()
        assert primary_proc.wait(30) != 0
        for _ in range(4):  # the worker fails over to the standby, which takes over
            step()
    (after,) = shard_status([backup], 10)
    assert after.replica.role == "primary" and after.version == before.version + 4
    assert after.pushes_applied == before.pushes_applied + 4, (after.pushes_applied, before.pushes_applied)
    assert after.pushes_rejected == before.pushes_rejected
    assert sum(after.staleness.values()) == sum(before.staleness.values()) + 4
    assert all(after.staleness.get(k, 0) >= v for k, v in before.staleness.items()), (after.staleness, before.staleness)
    assert after.pulls > before.pulls and after.bytes_in > before.bytes_in and after.bytes_out > before.bytes_out
    (table_after,) = [t for t in after.tables if t.kind == "sparse"]
    assert table_after.updates == table.updates + 4
