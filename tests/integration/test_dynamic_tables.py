"""Dynamic tables (psgrad.Embedding(None, dim)): any int64 id, no collisions, ids placed on the shards
by their hash; a row reads as its computed initial value until its first update stores it. Trained
against real in-process servers (two shards, one with a hot standby) with 64-bit hashed ids, and
checked against plain arithmetic (SGD); the rows survive a checkpoint and restore, reach the
standby, and come back through state_dict, fetch_state_dict and a fresh module."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import psgrad
from psgrad.cli.status import format_status
from psgrad.client.export import export_state_dict
from psgrad.client.parameter_client import shard_status
from psgrad.config import ClientConfig, ServerConfig
from psgrad.core import rows
from psgrad.errors import ConfigError
from psgrad.server import checkpoint
from psgrad.server.shard import Shard
from psgrad.server.tables import SparseTable
from conftest import wait_for

pytestmark = pytest.mark.timeout(120)

CLIENT = ClientConfig(connect_timeout_s=10, rpc_timeout_s=60, reconnect_timeout_s=0, shared_memory=False)
DIM, LR = 8, 0.5


class Clicks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.item = psgrad.Embedding(None, DIM)  # any int64 id
        self.head = nn.Linear(DIM, 1)


def hashed_ids(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(2**63) + 2, 2**63 - 1, (n,), generator=g, dtype=torch.int64)


def test_a_dynamic_table_trains_on_64_bit_ids_and_keeps_its_rows_through_every_path(make_servers, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    primary, other = make_servers(2)
    [backup] = make_servers(1, replica_of=primary.address)
    servers = [f"{primary.address}|{backup.address}", other.address]
    model = Clicks()
    with psgrad.connect(servers, optimizer=psgrad.SGD(lr=LR), client=CLIENT) as ps:
        opt = ps.optimizer(model)
        table = model.item.table
        assert table and "None (dynamic)" in repr(model.item)
        batches = [hashed_ids(64, s) for s in range(3)]
        initial = rows.initial_rows(rows.table_key(0, table), torch.unique(torch.cat(batches)), DIM)
        before = opt.client.pull_rows(table, torch.unique(torch.cat(batches)))
        assert torch.equal(before, initial)  # read as computed; nothing stored by the read
        counts: dict[int, int] = {}
        for x in batches:  # loss = the sum of the looked-up rows' values: each occurrence's gradient is 1
            opt.zero_grad()
            model.item(x).sum().backward()
            model.head.weight.grad = torch.zeros_like(model.head.weight)
            opt.step()
            for i in x.tolist():
                counts[i] = counts.get(i, 0) + 1
        ids = torch.tensor(sorted(counts))
        expected = initial - LR * torch.tensor([float(counts[i]) for i in sorted(counts)]).unsqueeze(1)
        assert torch.allclose(opt.client.pull_rows(table, ids), expected, atol=1e-6)
        # placed by hash over both shards, each row stored once, where its hash says
        stored = []
        for s in shard_status([primary.address, other.address], 10):
            (t,) = [t for t in s.tables if t.kind == "sparse"]
            assert t.rows == 0  # no fixed number of rows
            stored.append(t.rows_touched)
        assert sum(stored) == len(counts) and min(stored) > 0
        assert stored[0] == int((rows.shard_of(ids, 2, dynamic=True) == 0).sum())
        # the standby holds the same rows
        state, mirror = primary.shard.core.state, backup.shard.core.state
        assert state is not None and mirror is not None
        wait_for("the standby to follow", lambda: mirror.version == state.version, timeout_s=20)
        mine = ids[rows.shard_of(ids, 2, dynamic=True) == 0]
        main_table, backup_table = state.tables[table], mirror.tables[table]
        assert isinstance(main_table, SparseTable) and isinstance(backup_table, SparseTable)
        assert torch.equal(main_table.rows(mine), backup_table.rows(mine))
        # checkpoint and restore of the shard that holds them
        restored = Shard(ServerConfig())
        restored.restore(checkpoint.load(checkpoint.save(primary.shard.snapshot(), tmp_path)))
        again = restored.core.state.tables[table]  # type: ignore[union-attr]
        assert isinstance(again, SparseTable) and torch.equal(again.rows(mine), main_table.rows(mine))
        # state_dict: the updated rows by id; a fresh unbound module serves them
        saved = model.state_dict()
        assert saved["item.init"].tolist() == [rows.DYNAMIC, DIM, 0] and saved["item.ids"].numel() == len(counts)
        fetched = psgrad.fetch_state_dict(servers)
        assert torch.equal(fetched[f"{table}.ids"], saved["item.ids"])
        with pytest.raises(ConfigError, match="dynamic"):
            export_state_dict(servers, materialize=True)
    fresh = Clicks()
    fresh.load_state_dict(saved)
    assert torch.allclose(fresh.item(ids), expected, atol=1e-6)
    with pytest.raises(ConfigError, match="no whole table"):
        fresh.item.initial_weight()


def test_a_collections_row_lifetime_reaches_every_one_of_its_tables_on_the_servers(make_servers) -> None:  # type: ignore[no-untyped-def]
    """EmbeddingBagCollection takes min_count, ttl and evict as EmbeddingBag does, for each of its
    tables (before, it had none: a collection of dynamic tables could not bound its rows)."""
    [server] = make_servers(1)
    model = nn.Module()
    model.ebc = psgrad.EmbeddingBagCollection({"a": (None, DIM), "b": (100, DIM)}, min_count=2, ttl=16, evict=True)
    with pytest.raises(ConfigError, match="min_count must be an integer >= 0"):
        psgrad.EmbeddingBagCollection({"a": (None, DIM)}, min_count=-1)
    with psgrad.connect([server.address], optimizer=psgrad.SGD(lr=LR), client=CLIENT) as ps:
        opt = ps.optimizer(model)
        opt.zero_grad()
        model.ebc({"a": hashed_ids(8, 0).view(4, 2), "b": torch.arange(4).view(4, 1)}).sum().backward()
        opt.step()
        state = server.shard.core.state
        assert state is not None
        for name in ("ebc.bags.a", "ebc.bags.b"):
            table = state.tables[name]
            assert isinstance(table, SparseTable)
            assert (table.min_count, table.ttl, table.evict) == (2, 16, True), name
            assert table.touched == 0 and table.dropped > 0, name  # seen once: not admitted yet


def test_psgrad_status_shows_a_dynamic_tables_admitted_rows(make_servers) -> None:  # type: ignore[no-untyped-def]
    """`psgrad status` text: a dynamic table's admitted count is shown always (before, only beside
    expired or evicted rows, so admission's 0 admitted / N dropped, then N admitted, were hidden); a
    fixed table without drops leaves it out (it is its rows touched)."""
    [server] = make_servers(1)
    model = nn.Module()
    model.item = psgrad.Embedding(None, DIM, min_count=2)
    model.fixed = psgrad.Embedding(100, DIM)
    x = torch.tensor([3, 5, 3, 7])

    def text() -> str:
        (status,) = shard_status([server.address], 10)
        line = [ln for ln in format_status([dict(status.to_dict(), address=server.address)]).splitlines()
                if ": tables " in ln]
        assert len(line) == 1
        return line[0]

    with psgrad.connect([server.address], optimizer=psgrad.SGD(lr=LR), client=CLIENT) as ps:
        opt = ps.optimizer(model)
        for step in range(2):  # ids 3, 5, 7: seen once (dropped), then admitted
            opt.zero_grad()
            (model.item(x).sum() + model.fixed(x).sum()).backward()
            opt.step()
            shown = text()
            item, fixed = shown.split("item (")[1].split("), ")[0], shown.split("fixed (")[1]
            assert ("0 admitted, 3 dropped" if step == 0 else "3 admitted, 3 dropped") in item, shown
            assert "admitted" not in fixed and "3 of 100 rows touched" in fixed, shown


def test_admission_expiry_and_eviction_travel_to_the_servers_and_their_standby(make_servers) -> None:  # type: ignore[no-untyped-def]
    """Through real gRPC: the table's min_count, ttl and evict reach the servers with the job (a worker
    with other values is refused), the primary's drops reach its standby in its records, and status
    counts them."""
    budget_mb = 2.09  # the admission counts (2 MiB) and an arena of 1,024 rows, not the 2,048 it would grow to
    [primary] = make_servers(1, memory_budget_mb=budget_mb)
    [backup] = make_servers(1, replica_of=primary.address, memory_budget_mb=budget_mb)

    class Model(nn.Module):
        def __init__(self, **lifetime: object) -> None:
            super().__init__()
            self.item = psgrad.Embedding(None, DIM, **lifetime)  # type: ignore[arg-type]
            self.head = nn.Linear(DIM, 1)

    lifetime = {"min_count": 2, "ttl": 16, "evict": True}
    model = Model(**lifetime)
    servers = [f"{primary.address}|{backup.address}"]
    with psgrad.connect(servers, optimizer=psgrad.SGD(lr=LR), client=CLIENT) as ps:
        opt = ps.optimizer(model)
        g = torch.Generator().manual_seed(1)
        for step in range(40):
            x = torch.randint(0, 6000 if step % 2 else 300, (256,), generator=g)  # hot ids, and a wide spread
            opt.zero_grad()
            model.item(x).sum().backward()
            model.head.weight.grad = torch.zeros_like(model.head.weight)
            opt.step()
        (status,) = shard_status([primary.address], 10)
        (t,) = [t for t in status.tables if t.kind == "sparse"]
        assert t.dropped and t.expired and t.evicted and t.admitted > t.rows_touched, t
        state, mirror = primary.shard.core.state, backup.shard.core.state
        assert state is not None and mirror is not None
        wait_for("the standby to follow", lambda: mirror.version == state.version, timeout_s=20)
        every = torch.arange(6000)
        table = model.item.table
        assert table
        main, copy = state.tables[table], mirror.tables[table]
        assert isinstance(main, SparseTable) and isinstance(copy, SparseTable)
        assert main.touched == copy.touched and torch.equal(main.rows(every), copy.rows(every))
        # the admission counts, the counters and the arena's layout too: a standby that takes over
        # admits, evicts and counts as its primary would have
        assert main.sightings is not None and copy.sightings is not None
        assert torch.equal(main.sightings.counts, copy.sightings.counts)
        assert (main.admitted, main.dropped, main.expired, main.evicted) == (copy.admitted, copy.dropped,
                                                                             copy.expired, copy.evicted)
        mine, its = main.snapshot().tensors, copy.snapshot().tensors
        assert mine.keys() == its.keys() and all(torch.equal(mine[k], its[k]) for k in mine)
        with pytest.raises(psgrad.JobMismatchError, match="item"):  # the lifetime is part of the job
            with psgrad.connect(servers, optimizer=psgrad.SGD(lr=LR), client=CLIENT, rank=0) as other:
                other.optimizer(Model(min_count=3, ttl=16, evict=True))
