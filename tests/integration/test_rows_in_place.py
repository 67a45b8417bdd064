"""Rows read in place on one host: a worker that shares its servers' host reads a forward's rows from
the files the servers keep them in (they lend them when it joins), not through PullRows calls; what
it reads is what the calls read (rows stored and never stored, tables of two widths and of both
inits, their versions); a row an async push is updating is never read half updated (the header's
counter, kept odd by the shard lock while held); a worker that does not ask reads through calls
and its servers lend nothing; the files go with the servers, whose header then describes nothing.
Real server processes."""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import psgrad
from psgrad.client import rows_in_place as in_place
from psgrad.client.parameter_client import _ReadPlan
from psgrad.config import ClientConfig
from psgrad.wire import row_share

pytestmark = [pytest.mark.timeout(180), pytest.mark.filterwarnings("error::UserWarning"),
              pytest.mark.skipif(not row_share.supported(), reason="rows are lent in place on x86-64 only")]

CLIENT = ClientConfig(connect_timeout_s=30, rpc_timeout_s=60)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.zero = psgrad.Embedding(20_000, 32, std=0.0)
        self.drawn = psgrad.Embedding(30_000, 32)  # (std 1: rows never stored are drawn)
        self.narrow = psgrad.Embedding(5_000, 16)  # (another width: a table of its own on each shard)
        self.head = nn.Linear(32, 1)


@pytest.fixture(params=["kernel", "torch"])
def read_by(request, monkeypatch) -> Iterator[list[int]]:  # type: ignore[no-untyped-def]
    """Reads in place by the compiled read (every shard lends: one pass per shard), or placed and
    gathered by torch's ops (before it is compiled, or where a shard does not lend). Returns a
    list counting, as [kernel's, torch's], the shards' reads each served in place."""
    served = [0, 0]
    if request.param == "kernel":
        if in_place.kernel(wait=True) is None:
            pytest.skip("the compiled read is unavailable here (numba)")
    else:
        monkeypatch.setattr(in_place, "kernel", lambda start=False, wait=False: None)
    for k, method in enumerate(("read_into", "read")):
        def counted(self, *args, _inner=getattr(in_place.InPlaceRows, method), _k=k, **kwargs):  # type: ignore[no-untyped-def]
            got = _inner(self, *args, **kwargs)
            served[_k] += got is not None
            return got
        monkeypatch.setattr(in_place.InPlaceRows, method, counted)
    yield served
    assert served[0 if request.param == "kernel" else 1] > 0 and (request.param == "kernel" or not served[0])


def lent_files(pid: int) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"psgrad-rows-{pid}-")]


def test_reads_in_place_are_what_the_calls_read(start_servers, read_by) -> None:  # type: ignore[no-untyped-def]
    addresses = start_servers(2)
    with psgrad.connect(addresses, optimizer=psgrad.Adagrad(lr=0.1), client=CLIENT) as ps:
        opt = ps.optimizer(Net())
        client = opt.client
        assert all(s.rows_in_place is not None for s in client.shards)
        gen = torch.Generator().manual_seed(0)
        rows = {name: (torch.randperm(spec.num_embeddings, generator=gen)[:600].sort().values,
                       torch.randn(600, spec.dim, generator=gen)) for name, spec in client.tables.items()}
        dense = torch.zeros(client.plan.total)
        weights = torch.zeros(client.plan.total)
        for clock in range(opt.clock, opt.clock + 3):
            client.exchange(dense, clock, weights, rows=rows)
        # half of each table's ids stored (pushed), and ids never stored
        ask = {name: torch.cat([ids[:300], torch.randperm(spec.num_embeddings, generator=gen)[:200]]).unique()
               for (name, (ids, _)), spec in zip(rows.items(), client.tables.values())}
        lent = [s.rows_in_place for s in client.shards]
        for _ in range(100):  # (a read the shard's lock was held through, a heartbeat's, goes through a call)
            before = [held.reads for held in lent]  # type: ignore[union-attr]
            here = client.pull_tables(ask, checked=True)
            if all(held.reads > b for held, b in zip(lent, before)):  # type: ignore[union-attr]
                break
        assert all(held.reads > b for held, b in zip(lent, before))  # type: ignore[union-attr]
        for s in client.shards:
            s.rows_in_place = None
        try:
            called = client.pull_tables(ask, checked=True)
        finally:
            for s, held in zip(client.shards, lent):
                s.rows_in_place = held
        for name in ask:
            assert torch.equal(here[name], called[name]), name
        assert here.versions == called.versions and all(v == {0: 3, 1: 3} for v in here.versions.values())
        for got in (here, called):  # each group of one width read as one block, each table's rows a part of it
            assert sorted(name for names in got.blocks for name in names) == sorted(ask)
            for names, block in got.blocks.items():
                assert torch.equal(block, torch.cat([got[name] for name in names]))
                assert got[names[0]].data_ptr() == block.data_ptr()
        assert bool((called["drawn"] != 0).all(dim=1).any())  # (drawn rows: not all zero)


def test_an_async_read_in_place_never_sees_a_row_half_updated(start_servers, read_by) -> None:  # type: ignore[no-untyped-def]
    """A second worker pushes a gradient of ones for every element of the same rows, step after step
    (SGD, lr 1: each element of a row moves by the same step, so a whole row has one value at any
    version); the first reads those rows in place meanwhile: every row read has one value."""
    (address,) = start_servers(1)
    pushing = threading.Event()
    done = threading.Event()
    ids = torch.arange(0, 20_000, 7, dtype=torch.int64)

    class One(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = psgrad.Embedding(20_000, 64, std=0.0)
            self.head = nn.Linear(64, 1)

    def pusher(ps: psgrad.Session) -> None:
        opt = ps.optimizer(One())
        client = opt.client
        grads = torch.ones(ids.numel(), 64)
        dense = torch.zeros(client.plan.total)
        weights = torch.zeros(client.plan.total)
        clock = opt.clock
        while not done.is_set():
            client.exchange(dense, clock, weights, rows={"emb": (ids, grads)})
            clock += 1
            pushing.set()

    with psgrad.connect([address], rank=0, num_workers=2, mode="async", optimizer=psgrad.SGD(lr=1.0),
                        client=CLIENT) as reader, \
            psgrad.connect([address], rank=1, num_workers=2, mode="async", optimizer=psgrad.SGD(lr=1.0),
                           client=CLIENT) as writer:
        reader_opt = None
        t = threading.Thread(target=pusher, args=(writer,))
        try:
            reader_opt = reader.optimizer(One())
            t.start()
            assert pushing.wait(60)
            lent = reader_opt.client.shards[0].rows_in_place
            assert lent is not None
            seen: set[float] = set()
            reads, deadline = 0, time.monotonic() + 120
            # (300 reads at least, and until the rows were seen to move: on a busy machine the pusher
            # may not get through a push in the time 300 reads take)
            while reads < 300 or len(seen) < 3:
                assert time.monotonic() < deadline, f"the rows did not move in {reads} reads: {seen}"
                got = reader_opt.client.pull_tables({"emb": ids}, checked=True)["emb"]
                assert bool((got == got[:, :1]).all()), "a row read half updated"
                seen.add(float(got[0, 0]))
                reads += 1
            assert lent.reads > 0  # (read in place, while the rows moved)
        finally:
            done.set()
            t.join(60)


def test_a_worker_that_does_not_ask_reads_through_calls_and_files_go_with_the_servers(
        start_servers, server_procs) -> None:  # type: ignore[no-untyped-def]
    (address,) = start_servers(1)
    (proc,) = server_procs
    with psgrad.connect([address], optimizer=psgrad.SGD(lr=0.5),
                        client=ClientConfig(**{**CLIENT.__dict__, "rows_in_place": False})) as ps:
        opt = ps.optimizer(Net())
        assert opt.client.shards[0].rows_in_place is None
        opt.client.pull_tables({"zero": torch.arange(10)})
        assert lent_files(proc.popen.pid) == []
    (address,) = start_servers(1)
    proc = server_procs[-1]
    with psgrad.connect([address], optimizer=psgrad.SGD(lr=0.5), client=CLIENT) as ps:
        opt = ps.optimizer(Net())
        client = opt.client
        rows = {"zero": (torch.arange(100), torch.ones(100, 32))}
        client.exchange(torch.zeros(client.plan.total), opt.clock, torch.zeros(client.plan.total), rows=rows)
        lent = client.shards[0].rows_in_place
        assert lent is not None
        for _ in range(100):  # (until one read went in place: see above)
            client.pull_tables({"zero": torch.arange(10)})
            if lent.reads:
                break
        assert lent.reads >= 1
        assert len(lent_files(proc.popen.pid)) >= 3  # (its header, the arena's rows and row index)
        asks = _ReadPlan(client, {"zero": torch.arange(10)}, checked=True).asks(0)
        assert lent.read(asks) is not None
    proc.stop()
    assert lent_files(proc.popen.pid) == []
    missed = lent.missed
    assert lent.read(asks) is None and lent.missed == missed + 1  # (a stopped server's header describes
    # nothing: a worker still mapping it would ask the server, which is gone)
