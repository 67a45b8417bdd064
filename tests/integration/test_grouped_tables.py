"""Every table in one call per shard: psgrad.EmbeddingBagCollection's forward, prefetch of separate
modules, and the pipeline that brings the next batch's rows back with the step's fresh weights —
against real gRPC servers: the calls each makes, results equal to torch and to the unpipelined job
(sync: bitwise, the next batch's rows read after the iteration's update), staleness counted (async)."""
from __future__ import annotations

import copy
import dataclasses
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import psgrad
from conftest import run_in_threads
from psgrad.config import ClientConfig
from psgrad.errors import ConfigError, WorkerStateError
from psgrad.server.tables import SparseTable
from psgrad.worker.prefetch import PrefetchStats
from psgrad.wire import shm

pytestmark = pytest.mark.timeout(120)

# (rows through calls, not read in place: these tests count the calls a read makes per shard)
CLIENT = ClientConfig(connect_timeout_s=10, rpc_timeout_s=60, init_timeout_s=30, reconnect_timeout_s=0,
                      rows_in_place=False)
TABLES = {"a": (200, 4), "b": (300, 4), "c": (100, 4)}


class Separate(nn.Module):
    """Three psgrad.EmbeddingBag modules, as the docs teach, and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (psgrad.EmbeddingBag(n, d, mode="sum", std=0.1, seed=1) for n, d in TABLES.values())
        torch.manual_seed(0)
        self.head = nn.Linear(12, 1)

    def forward(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.head(torch.cat([self.a(x["a"]), self.b(x["b"]), self.c(x["c"])], dim=1)).squeeze(-1)

    def lookups(self, x: dict[str, torch.Tensor]) -> dict[nn.Module, Any]:
        return {self.a: x["a"], self.b: x["b"], self.c: x["c"]}


class Collection(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = psgrad.EmbeddingBagCollection(TABLES, mode="sum", std=0.1, seed=1)
        torch.manual_seed(0)
        self.head = nn.Linear(12, 1)

    def forward(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.head(self.ebc(x)).squeeze(-1)

    def lookups(self, x: dict[str, torch.Tensor]) -> dict[nn.Module, Any]:
        return {self.ebc: x}


def batches(seed: int, n: int, size: int = 16) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = {name: torch.randint(0, rows, (size, 2), generator=g) for name, (rows, _) in TABLES.items()}
        out.append((x, (x["a"][:, 0] % 2).float()))
    return out


class Keyed:
    """A batch of `batches` in TorchRec's KeyedJaggedTensor layout (keys, values, lengths; and
    weights_or_none(), its per-sample weights, where given)."""

    def __init__(self, x: dict[str, torch.Tensor], weights: dict[str, torch.Tensor] | None = None) -> None:
        self.x, self.w = x, weights

    def keys(self) -> list[str]:
        return list(TABLES)

    def values(self) -> torch.Tensor:
        return torch.cat([self.x[k].reshape(-1) for k in TABLES])

    def lengths(self) -> torch.Tensor:
        return torch.cat([torch.full((self.x[k].shape[0],), self.x[k].shape[1]) for k in TABLES])

    def weights_or_none(self) -> torch.Tensor | None:
        return None if self.w is None else torch.cat([self.w[k].reshape(-1) for k in TABLES])


def count_calls(opt: psgrad.PSOptimizer) -> dict[str, int]:
    """Counts of the PullRows and Step calls the optimizer's client makes from now on (an
    exchange's Step call, whole or in stages, starts as the shard client's stepping(); a read,
    whole or in stages, as its pull_rows() or reading_rows())."""
    counts = {"pull_rows": 0, "step": 0}
    for s in opt.client.shards:
        for name, method in (("pull_rows", "pull_rows"), ("pull_rows", "reading_rows"), ("step", "stepping")):
            def wrapped(*a: Any, _f: Callable[..., Any] = getattr(s, method), _n: str = name, **k: Any) -> Any:
                counts[_n] += 1
                return _f(*a, **k)
            setattr(s, method, wrapped)
    return counts


def train(opt: psgrad.PSOptimizer, model: nn.Module, data: list, pipelined: bool) -> None:
    loop = opt.pipeline(data, lambda b: model.lookups(b[0])) if pipelined else iter(data)
    for x, y in loop:
        opt.zero_grad()
        nn.functional.binary_cross_entropy_with_logits(model(x), y).backward()
        opt.step()


def tables_of(running: list) -> dict[str, torch.Tensor]:
    out = {}
    for k, s in enumerate(running):
        for name, t in s.shard.core.state.tables.items():
            if isinstance(t, SparseTable):
                snap = t.snapshot()
                order = torch.argsort(snap.tensors["ids"])
                out[f"{k}/{name}"] = torch.cat([snap.tensors["ids"][order].float().unsqueeze(1),
                                                snap.tensors["values"][order]], dim=1)
    return out


def test_a_collection_pulls_every_table_in_one_call_per_shard_and_equals_torch(make_servers) -> None:  # type: ignore[no-untyped-def]
    running = make_servers(2)
    model = Collection()
    [(x, _)] = batches(3, 1)
    with psgrad.connect([s.address for s in running], optimizer=psgrad.Adagrad(lr=0.1), client=CLIENT) as ps:
        opt = ps.optimizer(model)
        calls = count_calls(opt)
        got = model.ebc(x)
        assert calls["pull_rows"] == 2  # three tables, two shards: one call each
        reference = []
        for name in TABLES:
            bag = model.ebc.bags[name]
            torch_bag = nn.EmbeddingBag(*TABLES[name], mode="sum")
            with torch.no_grad():
                torch_bag.weight.copy_(bag.initial_weight())
            reference.append(torch_bag(x[name]))
        torch.testing.assert_close(got, torch.cat(reference, dim=1))
        # the same from keys / values / lengths (TorchRec's KeyedJaggedTensor layout)
        torch.testing.assert_close(model.ebc(Keyed(x)), got)
        with pytest.raises(ConfigError, match=r"missing \['c'\]"):
            model.ebc({"a": x["a"], "b": x["b"]})
        copied = copy.deepcopy(model)  # (the forward's remembered input is not copied: it cannot be pickled)
        torch.save(model, io.BytesIO())
        with pytest.raises(WorkerStateError, match="is a copy"):
            copied.ebc(x)


@pytest.mark.parametrize("layout", [Separate, Collection], ids=["separate", "collection"])
def test_a_pipelined_sync_job_equals_the_unpipelined_one_bitwise_in_one_call_per_shard(make_servers, layout) -> None:  # type: ignore[no-untyped-def]
    """Two sync workers, two shards: the next batch's rows come back in the step's Step call, read
    after the iteration's update, so the job is bit for bit the one whose forwards pull their rows:
    each module on its own (group_lookups=False), or every module's at the model's forward start."""
    steps = 5
    results = []
    for pipelined, grouped in ((False, False), (False, True), (True, True)):
        running = make_servers(2)
        calls: list[dict[str, int]] = [{}, {}]
        models = [layout(), layout()]  # (built here: torch's seed is one for every thread)
        grouped_forwards = [0, 0]

        def work(rank: int) -> None:
            model = models[rank]
            with psgrad.connect([s.address for s in running], rank=rank, num_workers=2, mode="sync",
                                optimizer=psgrad.Adagrad(lr=0.1), client=CLIENT) as ps:
                opt = ps.optimizer(model, group_lookups=grouped)
                calls[rank] = count_calls(opt)
                train(opt, model, batches(10 + rank, steps), pipelined)
                grouped_forwards[rank] = opt.prefetched.stats.grouped

        run_in_threads(2, work)
        if pipelined:  # the first batch's prefetch; then every step's rows ride its Step calls
            assert calls[0] == {"pull_rows": 2, "step": 2 * steps}, calls
            assert grouped_forwards == [0, 0]  # (the pipeline's rows are there before each forward)
        elif layout is Collection:  # every forward pulls: one call per shard
            assert calls[0]["pull_rows"] == 2 * steps and grouped_forwards == [0, 0], calls
        elif grouped:  # the first forward's modules pull one by one (it learns where their inputs are),
            # then each forward reads every module's rows at its start: one call per shard
            assert calls[0]["pull_rows"] == 6 + 2 * (steps - 1) and grouped_forwards == [steps - 1] * 2, calls
        else:  # one call per module and shard
            assert calls[0]["pull_rows"] == 6 * steps and grouped_forwards == [0, 0], calls
        results.append((tables_of(running), running[0].shard.core.state.weights.clone()))
    plain_tables, plain_w = results[0]
    assert len(plain_tables) == 6
    for tables, w in results[1:]:
        assert plain_tables.keys() == tables.keys()
        for key in plain_tables:
            assert torch.equal(plain_tables[key], tables[key]), key
        assert torch.equal(plain_w, w)


def test_on_one_host_the_rows_a_step_reads_come_back_through_a_segment(make_servers, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Same host: from the second Step call on (the first one's rows size the segment) the shards
    write the rows they read into a segment of the worker's, not into the reply. A server that
    cannot open it sends them in the reply, and after three such replies the worker stops naming
    one. Each way the job is bit for bit the one whose rows travel in gRPC messages."""
    steps = 8
    results = {}
    for way in ("frames", "segment", "refused"):
        running = make_servers(2)
        if way == "refused":  # (only rows segments are described by their size alone: dense ones keep working)
            def refuse(value: str) -> int:
                raise shm.SharedMemoryUnavailable("not here")
            monkeypatch.setattr(shm, "described_bytes", refuse)
        model = Collection()
        with psgrad.connect([s.address for s in running], mode="sync", optimizer=psgrad.Adagrad(lr=0.1),
                            client=dataclasses.replace(CLIENT, shared_memory=way != "frames")) as ps:
            opt = ps.optimizer(model)
            train(opt, model, batches(3, steps), pipelined=True)
            transports = [s.transport for s in opt.client.shards]
            if way == "frames":
                assert all(t.name == "grpc" for t in transports)
            else:
                assert all(t.name == "shm" for t in transports)
                through = [t.rows_through_segment for t in transports]  # type: ignore[attr-defined]
                misses = [t._rows_misses for t in transports]  # type: ignore[attr-defined]
                if way == "segment":  # the steps that read the next batch's rows (not the last), after the first
                    assert through == [steps - 2] * 2 and misses == [0, 0], (through, misses)
                else:
                    assert through == [0, 0] and misses == [3, 3], (through, misses)
                    assert all(t._rows_segment is None for t in transports)  # type: ignore[attr-defined]
        results[way] = tables_of(running)
        monkeypatch.undo()
    assert results["frames"].keys() == results["segment"].keys() == results["refused"].keys()
    for key in results["frames"]:
        assert torch.equal(results["frames"][key], results["segment"][key]), key
        assert torch.equal(results["frames"][key], results["refused"][key]), key


def test_prefetched_rows_of_async_steps_count_their_staleness(make_servers) -> None:  # type: ignore[no-untyped-def]
    """Worker 0's rows for its second batch are read with its first step; worker 1 updates the table
    before worker 0 pushes them: the table records that push one update stale."""
    running = make_servers(1)
    data = batches(5, 2)
    models = [Separate(), Separate()]
    with psgrad.connect([running[0].address], rank=0, num_workers=2, optimizer=psgrad.SGD(lr=0.1), client=CLIENT) as p0, \
            psgrad.connect([running[0].address], rank=1, num_workers=2, optimizer=psgrad.SGD(lr=0.1), client=CLIENT) as p1:
        opts = [p0.optimizer(models[0]), p1.optimizer(models[1])]

        def one_step(k: int, x: dict[str, torch.Tensor], y: torch.Tensor, ahead: dict[str, torch.Tensor] | None) -> None:
            opts[k].zero_grad()
            nn.functional.binary_cross_entropy_with_logits(models[k](x), y).backward()
            opts[k].step(prefetch=models[k].lookups(ahead) if ahead is not None else None)

        one_step(0, *data[0], ahead=data[1][0])  # table a: version 1; worker 0 holds batch 1's rows of version 1
        one_step(1, *data[0], ahead=None)  # version 2
        one_step(0, *data[1], ahead=None)  # rows read at version 1, applied at version 2
        assert opts[0].prefetched.stats.served == 3  # its three tables' rows came from the step
        table = running[0].shard.core.state.tables["a"]
        assert isinstance(table, SparseTable)
        assert (table.version, table.staleness_max) == (3, 1)
        with pytest.raises(ConfigError, match="not a psgrad embedding of this optimizer's model"):
            opts[0].prefetch({models[1].a: data[0][0]["a"]})


def test_prefetched_rows_no_forward_used_are_counted_in_rows(make_servers) -> None:  # type: ignore[no-untyped-def]
    """opt.prefetched.stats: served counts the tables' reads served from rows fetched ahead, unused the
    fetched rows no forward used, as the docs say (before, unused counted tables)."""
    running = make_servers(1)
    model = Separate()
    [(x, _), (other, y)] = batches(9, 2)
    with psgrad.connect([running[0].address], mode="sync", optimizer=psgrad.SGD(lr=0.1), client=CLIENT) as ps:
        opt = ps.optimizer(model)
        opt.prefetch(model.lookups(x))
        nn.functional.binary_cross_entropy_with_logits(model(other), y).backward()  # other ids: none used
        opt.step()
        opt.prefetch(model.lookups(x))
        model(x)
        fetched = sum(torch.unique(ids).numel() for ids in x.values())
        assert opt.prefetched.stats == PrefetchStats(served=3, unused=fetched) and fetched > 3


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_prefetch_between_backward_and_step_is_carried_by_that_step(make_servers, mode) -> None:  # type: ignore[no-untyped-def]
    """opt.prefetch(the next batch) after backward(), before opt.step(): the step reads those rows in
    its own calls, after its update, so every forward computes what it computes without the prefetch
    (bit for bit, in either mode), no push is stale, and the prefetch costs no call of its own.
    Before, the prefetch read the rows then: the next forward got rows that missed the step's update,
    and its push claimed the prefetch's read, newer than its rows (staleness 0 where it was 1)."""
    steps = 4
    data = batches(7, steps)
    results = []
    for prefetching in (False, True):
        running = make_servers(2)
        model = Separate()
        outs = []
        with psgrad.connect([s.address for s in running], mode=mode, optimizer=psgrad.SGD(lr=0.5), client=CLIENT) as ps:
            opt = ps.optimizer(model)
            calls = count_calls(opt)
            for k, (x, y) in enumerate(data):
                opt.zero_grad()
                out = model(x)
                outs.append(out.detach())
                nn.functional.binary_cross_entropy_with_logits(out, y).backward()
                if prefetching and k + 1 < steps:
                    opt.prefetch(model.lookups(data[k + 1][0]))
                opt.step()
            if prefetching:  # the first forward pulled (three modules, two shards); the rest rode the steps
                assert calls == {"pull_rows": 6, "step": 2 * steps}, calls
                assert opt.prefetched.stats == PrefetchStats(served=3 * (steps - 1), unused=0)
        assert {t.staleness_max for s in running for t in s.shard.status().tables if t.kind == "sparse"} == {0}
        results.append((outs, tables_of(running)))
    (plain_outs, plain_tables), (outs, tables) = results
    for k, (a, b) in enumerate(zip(plain_outs, outs)):
        assert torch.equal(a, b), k
    assert plain_tables.keys() == tables.keys() and all(torch.equal(plain_tables[k], tables[k]) for k in tables)


def test_rows_fetched_ahead_are_not_served_after_the_next_step(make_servers) -> None:  # type: ignore[no-untyped-def]
    """Sync, two workers: worker 0 fetches its next batch's rows with no step pending (read then),
    then skips a batch (zero_grad and step, to keep the iteration) while worker 1's gradient moves
    those rows. That step drops the rows (counted unused, in rows), and the next forward reads them
    after the update: the job equals the one without the prefetch. Before, the forward was served
    the rows read before the update, and unused counted tables."""
    steps = 3
    data = batches(8, steps)
    results = []
    for prefetching in (False, True):
        running = make_servers(1)
        models = [Separate(), Separate()]
        outs: list[torch.Tensor] = []
        stats: list[PrefetchStats] = []

        def work(rank: int) -> None:
            model = models[rank]
            with psgrad.connect([running[0].address], rank=rank, num_workers=2, mode="sync",
                                optimizer=psgrad.SGD(lr=0.5), client=CLIENT) as ps:
                opt = ps.optimizer(model)
                for k in range(steps):
                    x, y = data[2] if rank == 1 or k == 2 else data[k]  # (worker 1 trains on worker 0's last batch)
                    if rank == 0 and k == 1:
                        if prefetching:
                            opt.prefetch(model.lookups(data[2][0]))
                        opt.zero_grad()  # batch skipped: no forward
                        opt.step()
                        continue
                    opt.zero_grad()
                    out = model(x)
                    nn.functional.binary_cross_entropy_with_logits(out, y).backward()
                    opt.step()
                    if rank == 0:
                        outs.append(out.detach())
                if rank == 0:
                    stats.append(opt.prefetched.stats)

        run_in_threads(2, work)
        if prefetching:
            fetched = sum(torch.unique(v).numel() for v in data[2][0].values())
            # (the forward after the step reads its rows at its start, after the update, and is served
            # those: three tables, whose bags it pools there; the rows prefetched before the step are
            # all dropped)
            assert stats == [PrefetchStats(served=3, unused=fetched, grouped=1, pooled=3)]
        results.append((outs, tables_of(running)))
    (plain_outs, plain_tables), (outs, tables) = results
    assert len(outs) == 2 and all(torch.equal(a, b) for a, b in zip(plain_outs, outs))
    assert plain_tables.keys() == tables.keys() and all(torch.equal(plain_tables[k], tables[k]) for k in tables)


@pytest.mark.cuda
def test_a_pipelined_collection_trains_on_the_gpu_as_on_the_cpu(make_servers) -> None:  # type: ignore[no-untyped-def]
    """The model and its inputs on the GPU: rows travel to it and their gradients back, and the
    servers end with the rows a CPU run gives (within float rounding)."""
    results = []
    for device in ("cpu", "cuda"):
        running = make_servers(1)
        model = Collection().to(device)
        data = [({k: v.to(device) for k, v in x.items()}, y.to(device)) for x, y in batches(4, 4)]
        with psgrad.connect([running[0].address], optimizer=psgrad.Adagrad(lr=0.1), client=CLIENT) as ps:
            opt = ps.optimizer(model)
            train(opt, model, data, pipelined=True)
            assert opt.prefetched.stats.served == 3 * 4
        results.append(tables_of(running))
    assert results[0].keys() == results[1].keys()
    for key in results[0]:
        torch.testing.assert_close(results[1][key], results[0][key], rtol=1e-5, atol=1e-6)


def test_weighted_features_pool_and_train_as_torchs_per_sample_weights(make_servers) -> None:  # type: ignore[no-untyped-def]
    """A feature's per-sample weights (a dict triple, or a KeyedJaggedTensor's weights given
    is_weighted=True) weigh its ids in the sum and in their rows' gradients, as
    torch.nn.EmbeddingBag's per_sample_weights do (before, a weighted KeyedJaggedTensor pooled as
    unweighted, silently)."""
    lr = 0.5
    running = make_servers(2)
    model = nn.Module()
    model.ebc = psgrad.EmbeddingBagCollection(TABLES, mode="sum", std=0.1, seed=1, is_weighted=True)
    [(x, _)] = batches(4, 1)
    g = torch.Generator().manual_seed(5)
    w = {name: torch.rand(x[name].shape, generator=g) + 0.5 for name in TABLES}
    weighted = {name: (x[name].reshape(-1), torch.arange(0, x[name].numel(), 2), w[name].reshape(-1)) for name in TABLES}

    with psgrad.connect([s.address for s in running], optimizer=psgrad.SGD(lr=lr), client=CLIENT) as ps:
        opt = ps.optimizer(model)
        torch_bags = {}
        for name in TABLES:  # (a table's initial rows are drawn from its name, which binding gives it)
            torch_bags[name] = nn.EmbeddingBag(*TABLES[name], mode="sum")
            with torch.no_grad():
                torch_bags[name].weight.copy_(model.ebc.bags[name].initial_weight())
        reference = torch.cat([torch_bags[n](x[n], per_sample_weights=w[n]) for n in TABLES], dim=1)
        unweighted = model.ebc(x)
        assert not torch.allclose(unweighted, reference)
        torch.testing.assert_close(model.ebc(Keyed(x, w)), reference)
        opt.zero_grad()
        out = model.ebc(weighted)
        torch.testing.assert_close(out, reference)
        (out * torch.arange(12.0)).sum().backward()
        opt.step()
        (reference * torch.arange(12.0)).sum().backward()
        for name in TABLES:
            ids = torch.unique(x[name])
            expected = torch_bags[name].weight.detach()[ids] - lr * torch_bags[name].weight.grad[ids]
            torch.testing.assert_close(opt.client.pull_rows(f"ebc.bags.{name}", ids), expected)
        with pytest.raises(ConfigError, match="per-sample weights must be a floating-point tensor shaped as its ids"):
            model.ebc({**weighted, "a": (weighted["a"][0], weighted["a"][1], torch.ones(3))})
    maxed = psgrad.EmbeddingBagCollection({"a": (10, 4)}, mode="max")
    with pytest.raises(ConfigError, match="weighted features need mode 'sum'"):
        maxed({"a": (torch.tensor([1, 2]), torch.tensor([0]), torch.ones(2))})


class SharedItems(nn.Module):
    """A two-tower model whose towers share the item table, in each form psgrad has for it: "pairs"
    and "list", one psgrad.EmbeddingBag registered under three names (items, history, candidate),
    its lookups given as (module, input) pairs or as a list of inputs for the module; "collection",
    an EmbeddingBagCollection whose item table two features look up (feature_names), and which a
    module of its own (query: the collection's bag) reads too."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        if form == "collection":
            self.ebc = psgrad.EmbeddingBagCollection({"item": (300, 4), "user": (100, 4)}, mode="sum", std=0.1, seed=1,
                                                     feature_names={"item": ["history", "candidate"], "user": ["user"]})
            self.query = self.ebc.bags["item"]
        else:
            self.items = psgrad.EmbeddingBag(300, 4, mode="sum", std=0.1, seed=1)
            self.user = psgrad.EmbeddingBag(100, 4, mode="sum", std=0.1, seed=2)
            self.history, self.candidate = self.items, self.items
        torch.manual_seed(0)
        self.head = nn.Linear(16 if form == "collection" else 12, 1)

    def forward(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.form == "collection":
            features = {name: x[name] for name in ("history", "candidate", "user")}
            out = torch.cat([self.ebc(features), self.query(x["query"])], dim=1)
        else:
            out = torch.cat([self.history(x["history"]), self.candidate(x["candidate"]), self.user(x["user"])], dim=1)
        return self.head(out).squeeze(-1)

    def lookups(self, x: dict[str, torch.Tensor]) -> Any:
        if self.form == "pairs":
            return [(self.history, x["history"]), (self.candidate, x["candidate"]), (self.user, x["user"])]
        if self.form == "list":
            return {self.items: [x["history"], x["candidate"]], self.user: x["user"]}
        return {self.ebc: {name: x[name] for name in ("history", "candidate", "user")}, self.query: x["query"]}


def shared_batches(seed: int, n: int, size: int = 8) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = {"history": torch.randint(0, 300, (size, 3), generator=g), "candidate": torch.randint(0, 300, (size, 1), generator=g),
             "user": torch.randint(0, 100, (size, 1), generator=g), "query": torch.randint(0, 300, (size, 2), generator=g)}
        out.append((x, torch.rand(size, generator=g)))
    return out


@pytest.mark.parametrize("form", ["pairs", "list", "collection"])
def test_modules_sharing_a_table_are_each_served_their_prefetched_rows_and_equal_the_unpipelined_job(start_servers, form) -> None:  # type: ignore[no-untyped-def]
    """Sync, two server processes: a model whose forwards read one table several times trained
    without prefetch, through the pipeline, and with opt.prefetch(next batch) between backward and
    step. The table is read once for all of its forwards' ids, each forward is served its own rows
    (no forward pulls after the first batch's prefetch), and the jobs are bit for bit the same.
    Before, the prefetch kept one forward's ids per table: the others pulled their rows themselves
    (a collection's table that a module of its own read too), or the lookups could not name a
    module's second forward at all (pairs, a list)."""
    steps = 4
    data = shared_batches(31, steps)
    results = {}
    for how in ("plain", "pipeline", "prefetch"):
        addresses = start_servers(2)
        model = SharedItems(form)
        outs = []
        with psgrad.connect(addresses, mode="sync", optimizer=psgrad.Adagrad(lr=0.1), client=CLIENT) as ps:
            opt = ps.optimizer(model)
            calls = count_calls(opt)
            loop = opt.pipeline(data, lambda b: model.lookups(b[0])) if how == "pipeline" else iter(data)
            for k, (x, y) in enumerate(loop):
                opt.zero_grad()
                out = model(x)
                outs.append(out.detach())
                nn.functional.binary_cross_entropy_with_logits(out, y).backward()
                if how == "prefetch" and k + 1 < steps:
                    opt.prefetch(model.lookups(data[k + 1][0]))
                opt.step()
            if how == "pipeline":  # the first batch's prefetch (two shards); then every batch's rows rode a step
                assert calls["pull_rows"] == 2 and opt.prefetched.stats == PrefetchStats(served=3 * steps, unused=0), \
                    (calls, opt.prefetched.stats)
            elif how == "prefetch":  # the first batch's forwards pulled; every later one was served
                assert opt.prefetched.stats == PrefetchStats(served=3 * (steps - 1), unused=0), opt.prefetched.stats
            rows = {name: opt.client.pull_rows(name, torch.arange(m.num_embeddings), observe=True)
                    for name, m in opt.embeddings}
            assert len(rows) == 2
        results[how] = (outs, rows, model.head.weight.detach().clone())
    plain_outs, plain_rows, plain_head = results.pop("plain")
    for how, (outs, rows, head) in results.items():
        assert all(torch.equal(a, b) for a, b in zip(plain_outs, outs)), how
        assert rows.keys() == plain_rows.keys() and all(torch.equal(rows[t], plain_rows[t]) for t in rows), how
        assert torch.equal(head, plain_head), how


@pytest.mark.parametrize("ahead", ["pipeline", "prefetch", "step"])
def test_a_step_fetching_rows_ahead_that_failed_pushes_its_rows_once_when_taken_again(start_servers, ahead) -> None:  # type: ignore[no-untyped-def]
    """Sync, two server processes, the pipeline (each step reads the next batch's rows) and the same
    loop without it: a step whose dense gradient holds a NaN in shard 0's range is refused there
    and applied on shard 1 (which also reads the next batch's rows); mended and taken again, it
    pushes the rows' gradients again, applied by shard 0 alone, and reads the next batch's rows
    from both shards, which its forward is served. A step refused by both shards (a NaN loss) is
    dropped with zero_grad(); its next batch's forward reads its own rows. Both jobs end bit for
    bit the same, and as torch's dense twin trained on the batches that were not dropped."""
    from psgrad.errors import NonFiniteGradientError

    steps = 6
    data = batches(41, steps)
    results = {}
    for pipelined in (False, True):
        addresses = start_servers(2)
        model = Separate()
        with psgrad.connect(addresses, mode="sync", optimizer=psgrad.SGD(lr=0.5), client=CLIENT) as ps:
            opt = ps.optimizer(model)
            assert opt.plan.ranges[0][0] == 0 < opt.plan.ranges[0][1] < opt.plan.ranges[1][1]
            loop = opt.pipeline(data, lambda b: model.lookups(b[0])) if pipelined and ahead == "pipeline" else iter(data)
            if pipelined and ahead != "pipeline":
                opt.prefetch(model.lookups(data[0][0]))
            for k, (x, y) in enumerate(loop):
                following = model.lookups(data[k + 1][0]) if pipelined and ahead != "pipeline" and k + 1 < steps else None
                if following is not None and ahead == "step":
                    step = lambda: opt.step(prefetch=following)  # noqa: E731
                else:
                    step = opt.step
                opt.zero_grad()
                loss = nn.functional.binary_cross_entropy_with_logits(model(x), y)
                if k == 3:  # a NaN loss, stepped anyway: refused by both shards, then dropped
                    (loss * float("nan")).backward()
                    if following is not None and ahead == "prefetch":
                        opt.prefetch(following)
                    with pytest.raises(NonFiniteGradientError):
                        step()
                    opt.zero_grad()
                    continue
                loss.backward()
                if following is not None and ahead == "prefetch":  # (carried by the step, read after its update)
                    opt.prefetch(following)
                if k == 1:  # a NaN in shard 0's range: refused there, applied on shard 1
                    grad = model.head.weight.grad
                    assert grad is not None
                    kept = float(grad[0, 0])
                    grad[0, 0] = float("nan")
                    with pytest.raises(NonFiniteGradientError):
                        step()
                    grad[0, 0] = kept
                step()
            assert opt.clock == steps - 1
            if pipelined:  # every forward served but batch 4's (the step before it was dropped): 3 tables each
                assert opt.prefetched.stats == PrefetchStats(served=3 * (steps - 1), unused=0), opt.prefetched.stats
            rows = {name: opt.client.pull_rows(name, torch.arange(m.num_embeddings), observe=True)
                    for name, m in opt.embeddings}
        results[pipelined] = (rows, model.head.weight.detach().clone())
    (plain_rows, plain_head), (piped_rows, piped_head) = results[False], results[True]
    assert plain_rows.keys() == piped_rows.keys() and all(torch.equal(plain_rows[t], piped_rows[t]) for t in plain_rows)
    assert torch.equal(plain_head, piped_head)
    twin = Separate()  # torch's dense twin: nn.EmbeddingBag on the same initial rows, the same optimizer
    dense = {name: nn.EmbeddingBag(*TABLES[name], mode="sum") for name in TABLES}
    with torch.no_grad():
        for name, bag in dense.items():
            module = getattr(twin, name)
            module.table = name
            bag.weight.copy_(module.initial_weight())
            setattr(twin, name, bag)
    theirs = torch.optim.SGD(twin.parameters(), lr=0.5)
    for k, (x, y) in enumerate(data):
        if k != 3:
            theirs.zero_grad()
            nn.functional.binary_cross_entropy_with_logits(twin(x), y).backward()
            theirs.step()
    for name in TABLES:
        torch.testing.assert_close(plain_rows[name], twin.get_submodule(name).weight.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(plain_head, twin.head.weight.detach(), rtol=1e-5, atol=1e-6)


def test_a_pipelined_step_whose_next_batch_cannot_be_looked_up_is_taken_again_without_it(start_servers) -> None:  # type: ignore[no-untyped-def]
    """Sync, two server processes, a collection: the pipeline's batch 2 lacks a feature, so the
    step of batch 1, which fetches batch 2's rows ahead, is refused before it sends anything
    (ConfigError, saying so); taken again it pushes batch 1 (its rows included) without batch 2's
    rows, batch 2's own forward refuses the batch, the loop skips it, and the job ends bit for bit
    as the same loop without the pipeline. Before, only a bad id dropped the next batch's lookups:
    here every step taken again was refused the same way, so batch 1's gradients (the rows' with
    them) could never be pushed in the pipeline."""
    data = batches(43, 5)
    del data[2][0]["c"]
    results = []
    for pipelined in (False, True):
        addresses = start_servers(2)
        model = Collection()
        refused: list[str] = []
        with psgrad.connect(addresses, mode="sync", optimizer=psgrad.Adagrad(lr=0.1), client=CLIENT) as ps:
            opt = ps.optimizer(model)
            for x, y in opt.pipeline(data, lambda b: model.lookups(b[0])) if pipelined else iter(data):
                opt.zero_grad()
                try:
                    loss = nn.functional.binary_cross_entropy_with_logits(model(x), y)
                except ConfigError as exc:  # the batch's own forward: skipped
                    refused.append(str(exc))
                    continue
                loss.backward()
                try:
                    opt.step()
                except ConfigError as exc:
                    refused.append(str(exc))
                    assert opt.step().accepted  # taken again: without the next batch's rows
            assert opt.clock == 4
            rows = {name: opt.client.pull_rows(name, torch.arange(m.num_embeddings), observe=True)
                    for name, m in opt.embeddings}
        assert len(refused) == (2 if pipelined else 1), refused
        assert "missing ['c']" in refused[-1]
        if pipelined:
            assert "the next batch's rows, which this step fetches ahead" in refused[0], refused[0]
            assert "this step pushed nothing: opt.step() again pushes this step without fetching them" in refused[0]
        results.append((rows, model.head.weight.detach().clone()))
    (plain_rows, plain_head), (piped_rows, piped_head) = results
    assert plain_rows.keys() == piped_rows.keys() and all(torch.equal(plain_rows[t], piped_rows[t]) for t in plain_rows)
    assert torch.equal(plain_head, piped_head)


# ---------------------------------------------------------------------------------------------
# A forward's reads grouped at its start (group_lookups, psgrad/worker/prefetch.py GroupedForward)


class Routed(nn.Module):
    """Separate modules fed the ways a model hands its batch on: a dict's tensor (a), a list of (ids,
    offsets) pairs (b, c), a keyword argument (d), and ids the forward computes (e: a's ids % 50),
    which no argument holds. skip_c leaves c out (a forward that routes its batch differently)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = psgrad.EmbeddingBag(200, 4, mode="sum", std=0.1, seed=1)
        self.b = psgrad.EmbeddingBag(300, 4, mode="mean", std=0.1, seed=2)
        self.c = psgrad.EmbeddingBag(100, 4, mode="sum", std=0.1, seed=3)
        self.d = psgrad.Embedding(120, 4, std=0.1, seed=4)
        self.e = psgrad.EmbeddingBag(50, 4, mode="sum", std=0.1, seed=5)
        torch.manual_seed(0)
        self.head = nn.Linear(20, 1)

    def forward(self, x: dict[str, torch.Tensor], pairs: list[tuple[torch.Tensor, torch.Tensor]], *,
                tokens: torch.Tensor, skip_c: bool = False) -> torch.Tensor:
        (b_ids, b_offsets), (c_ids, c_offsets) = pairs
        c = torch.zeros(x["a"].shape[0], 4) if skip_c else self.c(c_ids, c_offsets)
        parts = [self.a(x["a"]), self.b(b_ids, b_offsets), c, self.d(tokens).sum(1), self.e(x["a"] % 50)]
        return self.head(torch.cat(parts, dim=1)).squeeze(-1)


def routed_batches(seed: int, n: int, size: int = 8) -> list[tuple[Any, ...]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        a = torch.randint(0, 200, (size, 2), generator=g)
        pairs = []
        for rows in (300, 100):
            lengths = torch.randint(1, 4, (size,), generator=g)
            pairs.append((torch.randint(0, rows, (int(lengths.sum()),), generator=g),
                          torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])))
        out.append(({"a": a}, pairs, torch.randint(0, 120, (size, 3), generator=g), (a[:, 0] % 2).float()))
    return out


def routed_step(opt: psgrad.PSOptimizer, model: Routed, batch: tuple[Any, ...], skip_c: bool = False) -> None:
    x, pairs, tokens, y = batch
    opt.zero_grad()
    nn.functional.binary_cross_entropy_with_logits(model(x, pairs, tokens=tokens, skip_c=skip_c), y).backward()
    opt.step()


def both_ways(make_servers: Callable[..., list], model_of: Callable[[], nn.Module],  # type: ignore[type-arg]
              run: Callable[[psgrad.PSOptimizer, Any, bool], None]) -> int:
    """The same sync job (two shards, Adagrad) without grouped reads, then with them: run(opt, model,
    grouped) trains it and checks what it saw. The two end bit for bit equal, every table's rows
    and the dense weights. Returns the number of tables found."""
    results = []
    for grouped in (False, True):
        running = make_servers(2)
        model = model_of()
        with psgrad.connect([s.address for s in running], mode="sync", optimizer=psgrad.Adagrad(lr=0.1),
                            client=CLIENT) as ps:
            run(ps.optimizer(model, group_lookups=grouped), model, grouped)
        results.append((tables_of(running), running[0].shard.core.state.weights.clone()))
    (plain_tables, plain_w), (grouped_tables, grouped_w) = results
    assert plain_tables.keys() == grouped_tables.keys()
    for key in plain_tables:
        assert torch.equal(plain_tables[key], grouped_tables[key]), key
    assert torch.equal(plain_w, grouped_w)
    return len(plain_tables)


def test_a_forward_reads_the_rows_of_the_modules_its_arguments_feed_in_one_call_per_shard(make_servers) -> None:  # type: ignore[no-untyped-def]
    """Two shards, sync. The first forward's five modules pull one by one (ten calls) while it learns
    where their inputs lie; from then on each forward reads a, b, c and d at its start in one call
    per shard, and e (ids the forward computes) pulls its own: four calls. Step 3's forward leaves c
    out: the rows read for it go unused, so step 4 learns again. The job equals, bit for bit, the one
    whose modules each read their own rows (group_lookups=False): the same rows, read moments
    earlier, with no step between."""
    steps, skip = 6, 3
    data = routed_batches(4, steps)

    def run(opt: psgrad.PSOptimizer, model: Routed, grouped: bool) -> None:
        calls = count_calls(opt)
        pulls = []
        for k, batch in enumerate(data):
            before = calls["pull_rows"]
            routed_step(opt, model, batch, skip_c=k == skip)
            pulls.append(calls["pull_rows"] - before)
        stats = opt.prefetched.stats
        if grouped:
            assert pulls == [10, 4, 4, 4, 10, 4], pulls
            assert opt.grouping is not None and opt.grouping.routes == [  # (in the order of the calls)
                (model.c, (1, 1, 0)), (model.a, (0, "a")), (model.b, (1, 0, 0)), (model.d, ("tokens",))]
            # (c's rows read at step 3's start are pooled for it there, and unused: its forward does not come)
            assert stats.grouped == 4 and stats.served == 4 * 4 and stats.unused > 0, stats
        else:
            assert pulls == [10, 10, 10, 8, 10, 10] and opt.grouping is None and stats == PrefetchStats(), (pulls, stats)

    assert both_ways(make_servers, Routed, run) == 10


def test_forwards_that_must_not_read_ahead_read_their_rows_as_before(make_servers) -> None:  # type: ignore[no-untyped-def]
    """No grouped read in an evaluation under torch.no_grad() (its reads are the latest rows, never
    held), in a second forward before the step (gradient accumulation: the first one's rows are
    pending), or with a row cache (it may serve the rows without a call). A bad id is refused by the
    module's own forward, with the message it always had."""
    running = make_servers(2)
    model = Routed()
    data = routed_batches(6, 4)
    with psgrad.connect([s.address for s in running], mode="async", optimizer=psgrad.SGD(lr=0.1), client=CLIENT) as ps:
        opt = ps.optimizer(model)
        routed_step(opt, model, data[0])  # (learns)
        routed_step(opt, model, data[1])
        assert opt.prefetched.stats.grouped == 1
        x, pairs, tokens, _ = data[2]
        with torch.no_grad():
            model(x, pairs, tokens=tokens)
        assert opt.prefetched.stats.grouped == 1
        opt.zero_grad()
        for x, pairs, tokens, y in data[2:4]:  # two forwards, one step
            nn.functional.binary_cross_entropy_with_logits(model(x, pairs, tokens=tokens), y).backward()
        opt.step()
        assert opt.prefetched.stats.grouped == 2  # the first of the two only
        bad = {"a": data[0][0]["a"].clone()}
        bad["a"][0, 0] = 200
        with pytest.raises(psgrad.InvalidRequestError) as grouped_error:
            model(bad, pairs, tokens=tokens)
    running = make_servers(2)
    model = Routed()
    with psgrad.connect([s.address for s in running], mode="async", optimizer=psgrad.SGD(lr=0.1), client=CLIENT) as ps:
        opt = ps.optimizer(model, group_lookups=False)
        with pytest.raises(psgrad.InvalidRequestError) as plain_error:
            model(bad, pairs, tokens=tokens)
    assert str(grouped_error.value) == str(plain_error.value) and "table 'a'" in str(plain_error.value)
    running = make_servers(2)
    model = Routed()
    with psgrad.connect([s.address for s in running], mode="async", optimizer=psgrad.SGD(lr=0.1), client=CLIENT) as ps:
        opt = ps.optimizer(model, row_cache=1000, row_cache_staleness=4)
        for _ in range(3):
            routed_step(opt, model, data[0])
        assert opt.prefetched.stats.grouped == 0 and opt.row_cache is not None and opt.row_cache.stats.hits > 0


def test_a_bound_model_with_grouped_reads_saves_and_copies_and_ps_close_takes_its_hooks_off(make_servers) -> None:  # type: ignore[no-untyped-def]
    """torch.save(model) and copy.deepcopy(model) of a bound model whose forwards read grouped work;
    the copy's hooks do nothing (its modules say they are copies, as without them), and closing the
    job takes the hooks off the model."""
    running = make_servers(1)
    model = Routed()
    data = routed_batches(8, 2)
    with psgrad.connect([running[0].address], optimizer=psgrad.SGD(lr=0.1), client=CLIENT) as ps:
        opt = ps.optimizer(model)
        for batch in data:
            routed_step(opt, model, batch)
        assert opt.prefetched.stats.grouped == 1 and model._forward_pre_hooks and model._forward_hooks
        buffer = io.BytesIO()
        torch.save(model, buffer)
        copied = copy.deepcopy(model)
        x, pairs, tokens, _ = data[0]
        for other in (copied, torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)):
            with pytest.raises(WorkerStateError, match="is a copy"):
                other(x, pairs, tokens=tokens)
        assert opt.prefetched.stats.grouped == 1
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert not any(m._forward_pre_hooks for m in model.modules())


class InPlace(Routed):
    """A forward that changes an input in place before its module reads it: the rows read ahead for
    that module are never the ones it asks for."""

    def forward(self, x: dict[str, torch.Tensor], pairs: list[tuple[torch.Tensor, torch.Tensor]], *,
                tokens: torch.Tensor, skip_c: bool = False) -> torch.Tensor:
        x["a"].clamp_(max=99)
        return super().forward(x, pairs, tokens=tokens, skip_c=skip_c)


def test_a_forward_whose_grouped_rows_keep_going_unused_stops_reading_ahead(make_servers) -> None:  # type: ignore[no-untyped-def]
    """The model clamps a's ids in place before a reads them, so the rows read ahead for a go unused
    at every grouped forward: the next forward learns again, finds the same routes, and after the
    second such failure no forward reads ahead (two grouped forwards in all, where each second
    forward would waste a read for ever). The job is bit for bit the one without grouping."""
    def run(opt: psgrad.PSOptimizer, model: InPlace, grouped: bool) -> None:
        for batch in routed_batches(12, 8):
            routed_step(opt, model, batch)
        if grouped:  # forwards 0 and 2 learn, 1 and 3 read ahead (a's rows unused), 4 learns and gives up
            assert opt.prefetched.stats.grouped == 2 and opt.prefetched.stats.unused > 0, opt.prefetched.stats
            assert opt.grouping is not None and opt.grouping.routes == []

    both_ways(make_servers, InPlace, run)


class Columns(nn.Module):
    """Four tables fed the columns of one id tensor (`x[:, f]`, views of the forward's argument), as
    many models read a batch of categorical features [batch, features]."""

    ROWS = (200, 300, 100, 120)

    def __init__(self) -> None:
        super().__init__()
        self.tables = nn.ModuleList(psgrad.Embedding(n, 4, std=0.1, seed=k) for k, n in enumerate(self.ROWS))
        torch.manual_seed(0)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([t(x[:, f]) for f, t in enumerate(self.tables)], dim=1)).squeeze(-1)


def test_modules_fed_views_of_an_argument_read_grouped_and_a_batch_of_another_shape_learns_again(make_servers) -> None:  # type: ignore[no-untyped-def]
    """Each table reads a column of the forward's one id tensor: learned as views of it, so from
    the second forward on one call per shard reads all four. A last batch of another size lays the
    tensor out otherwise: that forward learns again (its modules read one by one), the next one too,
    and the job stays bit for bit the one without grouping."""
    g = torch.Generator().manual_seed(3)
    sizes = [8, 8, 8, 5, 8, 8]
    data = [(torch.stack([torch.randint(0, n, (b,), generator=g) for n in Columns.ROWS], dim=1),
             torch.randint(0, 2, (b,), generator=g).float()) for b in sizes]

    def run(opt: psgrad.PSOptimizer, model: Columns, grouped: bool) -> None:
        calls = count_calls(opt)
        pulls = []
        for x, y in data:
            before = calls["pull_rows"]
            opt.zero_grad()
            nn.functional.binary_cross_entropy_with_logits(model(x), y).backward()
            opt.step()
            pulls.append(calls["pull_rows"] - before)
        if grouped:  # learn, grouped, grouped, learn (5 ids), learn (8 again), grouped
            assert opt.prefetched.stats.grouped == 3 and opt.prefetched.stats.unused == 0, opt.prefetched.stats
            assert [p == 2 for p in pulls] == [False, True, True, False, False, True], pulls

    assert both_ways(make_servers, Columns, run) == 8


class Bags(nn.Module):
    """Three EmbeddingBags of one width, as a recommender's features: a fed 2-D ids (a bag per row),
    b and c 1-D ids with offsets. drop_c: c's output is made but not used (the loss does not reach
    c's rows); a's output is changed in place before use."""

    def __init__(self) -> None:
        super().__init__()
        self.a = psgrad.EmbeddingBag(200, 4, mode="sum", std=0.1, seed=1)
        self.b = psgrad.EmbeddingBag(300, 4, mode="sum", std=0.1, seed=2)
        self.c = psgrad.EmbeddingBag(100, 4, mode="sum", std=0.1, seed=3)
        torch.manual_seed(0)
        self.head = nn.Linear(12, 1)

    def forward(self, a: torch.Tensor, pairs: list[tuple[torch.Tensor, torch.Tensor]], drop_c: bool = False) -> torch.Tensor:
        (b, b_offsets), (c, c_offsets) = pairs
        out_a = self.a(a)
        out_a.mul_(0.5)
        out_c = self.c(c, c_offsets)
        if drop_c:
            out_c = torch.zeros_like(out_c)
        return self.head(torch.cat([out_a, self.b(b, b_offsets), out_c], dim=1)).squeeze(-1)


def test_bags_of_a_forwards_embedding_bags_are_pooled_at_its_start_and_an_unused_output_pushes_nothing(make_servers) -> None:  # type: ignore[no-untyped-def]
    """From the second forward on, the three modules' bags are pooled at the forward's start in one
    pass (the pooling reads their rows itself, in one call per shard), and each module's forward
    returns its own: 3 pooled forwards a step, none unused. At step 2 c's output is not used by
    the loss, and c reads rows no other step reads (ids 90-99): no gradient of c is pushed, so the
    servers never store those rows, as without grouping (a zero gradient pushed would store them).
    The job is bit for bit the one whose modules pool their own bags (a's output changed in place
    included)."""
    g = torch.Generator().manual_seed(5)
    data = []
    for step in range(5):
        lengths = [torch.randint(1, 4, (8,), generator=g) for _ in range(2)]
        low, high = (90, 100) if step == 2 else (0, 90)
        pairs = [(torch.randint(0, 300, (int(lengths[0].sum()),), generator=g), lengths[0]),
                 (torch.randint(low, high, (int(lengths[1].sum()),), generator=g), lengths[1])]
        pairs = [(ids, torch.cat([torch.zeros(1, dtype=torch.int64), n.cumsum(0)[:-1]])) for ids, n in pairs]
        data.append((torch.randint(0, 200, (8, 2), generator=g), pairs, torch.randint(0, 2, (8,), generator=g).float()))

    def run(opt: psgrad.PSOptimizer, model: Bags, grouped: bool) -> None:
        calls = count_calls(opt)
        pulls = []
        for step, (a, pairs, y) in enumerate(data):
            before = calls["pull_rows"]
            opt.zero_grad()
            nn.functional.binary_cross_entropy_with_logits(model(a, pairs, drop_c=step == 2), y).backward()
            opt.step()
            pulls.append(calls["pull_rows"] - before)
        stats = opt.prefetched.stats
        if grouped:  # (the pooling reads all three tables' rows itself: one call per shard, two shards)
            assert pulls == [6, 2, 2, 2, 2], pulls
            assert stats.grouped == 4 and stats.pooled == 4 * 3 and stats.served == 4 * 3 and stats.unused == 0, stats
        else:
            assert pulls == [6] * 5 and stats == PrefetchStats(), (pulls, stats)

    both_ways(make_servers, Bags, run)


def bag_batches(count: int, seed: int) -> list[tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]]:
    """Batches for Bags: a's 2-D ids, b's and c's 1-D ids with offsets (bags of 1-3 ids), labels."""
    g = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(count):
        lengths = [torch.randint(1, 4, (8,), generator=g) for _ in range(2)]
        pairs = [(torch.randint(0, n, (int(k.sum()),), generator=g), torch.cat([torch.zeros(1, dtype=torch.int64),
                                                                                k.cumsum(0)[:-1]]))
                 for n, k in zip((300, 100), lengths)]
        data.append((torch.randint(0, 200, (8, 2), generator=g), pairs, torch.randint(0, 2, (8,), generator=g).float()))
    return data


def test_two_forwards_before_a_step_over_bags_pooled_as_one_leaf_equal_the_job_without_grouping(make_servers) -> None:  # type: ignore[no-untyped-def]
    """Gradient accumulation over bags pooled at the forward's start: the first forward of a step
    reads the three modules' rows as one leaf, the second (a step pending: no grouped read) each
    module its own, and each module pushes the two gradients merged; at step 2 b's zero_grad()
    between the two drops its first gradient alone (its part of the one leaf), as torch's would.
    The job equals, bit for bit, the one whose modules read and pool their own bags."""
    data = bag_batches(8, 11)

    def run(opt: psgrad.PSOptimizer, model: Bags, grouped: bool) -> None:
        for step in range(4):
            opt.zero_grad()
            for half in range(2):
                a, pairs, y = data[2 * step + half]
                nn.functional.binary_cross_entropy_with_logits(model(a, pairs), y).backward()
                if step == 2 and half == 0:
                    model.b.zero_grad()
            opt.step()
        stats = opt.prefetched.stats
        if grouped:  # (steps 1-3: the first forward's three modules pooled ahead; the second's none)
            assert stats.grouped == 3 and stats.pooled == 3 * 3 and stats.unused == 0, stats
        else:
            assert stats == PrefetchStats(), stats

    both_ways(make_servers, Bags, run)


def test_a_read_of_two_shards_is_made_on_the_calling_thread_both_requests_out_first(make_servers) -> None:  # type: ignore[no-untyped-def]
    """Where both servers take reads over their sockets, a read of rows on two shards sends both
    requests, then reads both replies, all on the caller's thread (no pool thread: a hand-off costs
    about what a small call does, and waits for a core on a busy host); the rows are those the
    pool-thread way reads, bit for bit, and both servers served the read over their sockets."""
    running = make_servers(2)
    model = Collection()
    with psgrad.connect([s.address for s in running], optimizer=psgrad.Adagrad(lr=0.1), client=CLIENT) as ps:
        opt = ps.optimizer(model)
        client = opt.client
        assert all(s.reads_staged for s in client.shards)
        handed: list[Any] = []
        submit = client._pool.submit
        client._pool.submit = lambda *a, **k: handed.append(a) or submit(*a, **k)  # type: ignore[method-assign]
        lookups = {f"ebc.bags.{name}": torch.arange(0, n, 3) for name, (n, _) in TABLES.items()}
        before = [s.servicer.local.read_calls for s in running]
        staged = client.pull_tables(lookups)
        assert handed == [] and [s.servicer.local.read_calls - b for s, b in zip(running, before)] == [1, 1]
        client._staged_reads = False  # (the way before: the second shard's read on a pool thread)
        apart = client.pull_tables(lookups)
        assert len(handed) == 1
        assert set(staged) == set(apart) == set(lookups)
        for name in lookups:
            assert torch.equal(staged[name], apart[name]), name
        assert staged.versions == apart.versions
