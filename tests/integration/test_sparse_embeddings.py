"""psgrad.Embedding / EmbeddingBag against real gRPC servers: rows pulled and pushed by id, sync equal
to single-process training with a dense table (per-row mean over the workers), async applying each
worker's rows with its push, per-table staleness, checkpoints of
sparse tables, and errors that name the problem."""
from __future__ import annotations

import copy
import re
import time

import pytest
import torch
from torch import nn

import psgrad
from conftest import run_in_threads, scrape
from psgrad.cli.status import format_status
from psgrad.config import ClientConfig
from psgrad.errors import ConfigError, InvalidRequestError, MemoryBudgetError, WorkerStateError
from psgrad.server import checkpoint
from psgrad.server.tables import SparseTable

CLIENT = ClientConfig(connect_timeout_s=10, rpc_timeout_s=60, init_timeout_s=30, reconnect_timeout_s=0)
ROWS, DIM = 1000, 8


class Ctr(nn.Module):
    """A bag of 3 ids per example from one table, and a linear head (sparse=False: a local dense table)."""

    def __init__(self, sparse: bool = True, mode: str = "sum") -> None:
        super().__init__()
        self.emb: nn.Module = psgrad.EmbeddingBag(ROWS, DIM, mode=mode, std=0.1, seed=3)
        if not sparse:
            dense = nn.EmbeddingBag(ROWS, DIM, mode=mode)
            self.emb.table = "emb"  # (the servers' name: its initial rows depend on it)
            with torch.no_grad():
                dense.weight.copy_(self.emb.initial_weight())
            self.emb = dense
        torch.manual_seed(0)
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x)).squeeze(-1)


def _batch(gen: torch.Generator, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, ROWS, (n, 3), generator=gen)
    return x, (x[:, 0] % 2).float()


def _train(model: nn.Module, opt: psgrad.PSOptimizer, gen: torch.Generator, steps: int) -> None:
    """`steps` steps of the user's loop on batches from gen."""
    for _ in range(steps):
        x, y = _batch(gen)
        opt.zero_grad()
        nn.functional.binary_cross_entropy_with_logits(model(x), y).backward()
        opt.step()


def _server_table(running: list, name: str = "emb") -> torch.Tensor:
    """The whole table as the servers hold it: every shard's touched rows over the initial rows."""
    probe = psgrad.EmbeddingBag(ROWS, DIM, std=0.1, seed=3)
    probe.table = name
    full = probe.initial_weight()
    for s in running:
        table = s.shard.core.state.tables[name]
        assert isinstance(table, SparseTable)
        snap = table.snapshot()
        full[snap.tensors["ids"]] = snap.tensors["values"]
    return full


def _own_adagrad(model: nn.Module) -> list[dict]:
    return [{"params": [model.emb], "optimizer": psgrad.Adagrad(lr=0.2, initial_accumulator_value=0.1)}]


def _adamw_and_adagrad(model: nn.Module) -> list[torch.optim.Optimizer]:
    return [torch.optim.AdamW(model.head.parameters(), lr=0.01, weight_decay=0.05),
            torch.optim.Adagrad(model.emb.parameters(), lr=0.2, initial_accumulator_value=0.1)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("optimizer, groups, reference", [
    (psgrad.SGD(lr=0.5), None, lambda m: [torch.optim.SGD(m.parameters(), lr=0.5)]),
    (psgrad.Adagrad(lr=0.1), None, lambda m: [torch.optim.Adagrad(m.parameters(), lr=0.1)]),
    # The table's own optimizer (its param group's) under a job optimizer without a row form.
    (psgrad.Adam(lr=0.01, weight_decay=0.05, decoupled=True), _own_adagrad, _adamw_and_adagrad),
], ids=["sgd", "adagrad", "adamw-with-adagrad-rows"])
def test_sync_rows_equal_single_process_training_with_a_dense_table(make_servers, optimizer, groups, reference) -> None:  # type: ignore[no-untyped-def]
    """Two workers over two shards: each row's update is the sum of the workers' gradients over their
    number, exactly what one process computing the mean of their losses applies to a dense table
    (with the job's optimizer, or the table's own)."""
    workers, steps = 2, 6
    running = make_servers(2)
    gens = [torch.Generator().manual_seed(10 + r) for r in range(workers)]
    batches = [[_batch(gens[r]) for _ in range(steps)] for r in range(workers)]
    init = Ctr()  # (built here: threads seeding torch's global generator at once would race)

    def worker(rank: int) -> None:
        model = copy.deepcopy(init)
        with psgrad.connect([s.address for s in running], rank=rank, num_workers=workers, mode="sync",
                            optimizer=optimizer, client=CLIENT) as ps:
            opt = ps.optimizer(model, param_groups=groups(model) if groups else None)
            for x, y in batches[rank]:
                opt.zero_grad()
                nn.functional.binary_cross_entropy_with_logits(model(x), y).backward()
                assert opt.step().accepted
            heads.append(model.head.weight.detach().clone())

    heads: list[torch.Tensor] = []
    run_in_threads(workers, worker)
    ref = Ctr(sparse=False)
    opts = reference(ref)
    for k in range(steps):
        for opt in opts:
            opt.zero_grad()
        loss = sum(nn.functional.binary_cross_entropy_with_logits(ref(x), y)
                   for x, y in (batches[r][k] for r in range(workers))) / workers
        loss.backward()
        for opt in opts:
            opt.step()
    torch.testing.assert_close(_server_table(running), ref.emb.weight.detach(), rtol=1e-5, atol=1e-6)
    for head in heads:
        torch.testing.assert_close(head, ref.head.weight.detach(), rtol=1e-5, atol=1e-6)
    for s in running:
        status = {t.name: t for t in s.shard.status().tables}["emb"]
        assert status.kind == "sparse" and status.updates == steps and status.staleness_max == 0
        assert 0 < status.rows_touched <= status.rows == ROWS // 2


@pytest.mark.timeout(60)
def test_async_rows_are_applied_with_each_push_and_their_staleness_is_measured(make_servers) -> None:  # type: ignore[no-untyped-def]
    running = make_servers(1, metrics_port=0)
    model = Ctr(mode="mean")
    gen = torch.Generator().manual_seed(5)
    with psgrad.connect([running[0].address], optimizer=psgrad.SGD(lr=1.0), client=CLIENT) as ps:
        opt = ps.optimizer(model)
        x, y = _batch(gen)
        before = model.emb(x).detach()
        # two forwards before one step: their row gradients are summed per id
        opt.zero_grad()
        loss = nn.functional.binary_cross_entropy_with_logits(model(x), y)
        loss = loss + nn.functional.binary_cross_entropy_with_logits(model(x[:4]), y[:4])
        loss.backward()
        opt.step()
        after = model.emb(x).detach()
        assert not torch.equal(before, after)
        table = running[0].shard.core.state.tables["emb"]
        assert table.version == 1 and table.touched == torch.unique(x).numel()
    status = {t.name: t for t in running[0].shard.status().tables}["emb"]
    assert (status.updates, status.staleness_max, status.staleness_mean) == (1, 0, 0.0)
    m = scrape(running[0].metrics_url)
    labels = (("shard", "0"), ("table", "emb"))
    assert m[("psgrad_table_rows", labels)] == ROWS and m[("psgrad_table_updates", labels)] == 1
    assert m[("psgrad_table_rows_touched", labels)] == status.rows_touched > 0
    text = format_status([dict(running[0].shard.status().to_dict(), address=running[0].address)])
    assert f"emb (sparse, {status.rows_touched:,} of {ROWS:,} rows touched, 1 updates" in text


@pytest.mark.timeout(60)
def test_rows_outlive_the_job_in_checkpoints(make_servers, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A server restarted on its checkpoint directory holds the sparse rows it had, bit for bit."""
    running = make_servers(1, checkpoint_dir=str(tmp_path), checkpoint_every_versions=1)
    model = Ctr()
    gen = torch.Generator().manual_seed(6)
    with psgrad.connect([running[0].address], mode="sync", optimizer=psgrad.Adagrad(lr=0.1), client=CLIENT) as ps:
        _train(model, ps.optimizer(model), gen, 3)
        assert running[0].shard.core.state.version == 3
        deadline = time.monotonic() + 30  # (the checkpoint thread writes it)
        while 3 not in checkpoint.versions(tmp_path):
            assert time.monotonic() < deadline, "no checkpoint of version 3"
            time.sleep(0.02)
        held = _server_table(running)
    running[0].stop(0)
    again = make_servers(1, checkpoint_dir=str(tmp_path))
    assert again[0].shard.version == 3
    assert torch.equal(_server_table(again), held)
    state = again[0].shard.core.state.tables["emb"].snapshot()
    assert state.tensors["state.sum"].abs().sum() > 0  # Adagrad's row state came back too


class Factors(nn.Module):
    """A matrix factorization: two tables and (biased) a global bias as its whole dense part. On more
    servers than that, some shards hold no dense element (without the bias, none does), only their
    part of the tables' rows."""

    def __init__(self, biased: bool) -> None:
        super().__init__()
        self.users, self.items = psgrad.Embedding(200, 4), psgrad.EmbeddingBag(300, 4, mode="sum")
        self.bias = nn.Parameter(torch.zeros(1)) if biased else None

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        score = (self.users(users) * self.items(items)).sum(-1)
        return score if self.bias is None else score + self.bias


@pytest.mark.timeout(120)
@pytest.mark.parametrize("biased", [True, False], ids=["bias", "tables-alone"])
@pytest.mark.parametrize("shared_memory", [False, True], ids=["grpc", "same-host"])
def test_shards_without_dense_elements_hold_rows_as_any_other(make_servers, tmp_path,  # type: ignore[no-untyped-def]
                                                              shared_memory: bool, biased: bool) -> None:
    """A matrix factorization whose dense part is a bias or nothing, on 3 servers (shards without
    dense elements), trains bit for bit as on one server; its state_dict loads strictly into the
    model; status reports every shard; a shard without dense elements keeps its hot standby (never
    dropped) and restarts from its checkpoint with its rows."""
    gen = torch.Generator().manual_seed(9)
    users, items, y = torch.randint(0, 200, (32,), generator=gen), torch.randint(0, 300, (32, 2), generator=gen), \
        torch.randn(32, generator=gen)
    client = ClientConfig(connect_timeout_s=10, rpc_timeout_s=60, init_timeout_s=30, reconnect_timeout_s=0,
                          shared_memory=shared_memory)
    got = []
    for n in (1, 3):
        directory = tmp_path / f"of{n}"
        directory.mkdir()
        running = make_servers(1, checkpoint_dir=str(directory), checkpoint_every_versions=1) + make_servers(n - 1)
        standby = make_servers(1, replica_of=running[0].address) if n == 3 else []
        model = Factors(biased)
        with psgrad.connect([s.address for s in running], mode="sync", optimizer=psgrad.Adagrad(lr=0.1),
                            client=client) as ps:
            opt = ps.optimizer(model)
            losses = []
            for _ in range(4):
                opt.zero_grad()
                loss = ((model(users, items) - y) ** 2).mean()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            state = psgrad.fetch_state_dict([s.address for s in running], client=client)
        Factors(biased).load_state_dict(state)  # (strict)
        got.append((losses, state))
        if n == 3:
            layouts = [s.shard.core.state.layout for s in running]
            assert [layout.end - layout.start for layout in layouts] == ([0, 0, 1] if biased else [0, 0, 0])
            text = format_status([dict(s.shard.status().to_dict(), address=s.address) for s in running])
            assert "users" in text and "items" in text
            held = running[0].shard.core.state.tables["users"].snapshot().tensors
            assert held["ids"].numel() > 0  # (the shard without dense elements holds rows)
            assert running[0].shard.replication._generation == 1  # (its standby attached once, never dropped)
            mirrored = standby[0].shard.core.state.tables["users"].snapshot().tensors
            assert mirrored.keys() == held.keys() and all(torch.equal(mirrored[k], held[k]) for k in held)
            deadline = time.monotonic() + 30  # (the checkpoint thread writes it)
            while 4 not in checkpoint.versions(directory):
                assert time.monotonic() < deadline, "no checkpoint of version 4"
                time.sleep(0.02)
            running[0].stop(0)
            again = make_servers(1, checkpoint_dir=str(directory))
            back = again[0].shard.core.state.tables["users"].snapshot().tensors
            assert again[0].shard.version == 4 and back.keys() == held.keys()
            assert all(torch.equal(back[k], held[k]) for k in held)
    (losses_1, state_1), (losses_3, state_3) = got
    assert losses_1 == losses_3 and losses_3[-1] < losses_3[0]
    assert state_1.keys() == state_3.keys()
    assert all(torch.equal(state_1[k], state_3[k]) for k in state_1)

@pytest.mark.timeout(60)
def test_bad_ids_and_tables_fail_with_messages_that_name_them(make_servers) -> None:  # type: ignore[no-untyped-def]
    running = make_servers(2)
    model = Ctr()
    with pytest.raises(WorkerStateError, match="not bound to a job"):
        model(torch.zeros(2, 3, dtype=torch.long))
    with psgrad.connect([s.address for s in running], optimizer=psgrad.SGD(lr=0.1), client=CLIENT) as ps:
        opt = ps.optimizer(model)
        with pytest.raises(InvalidRequestError, match=f"row id {ROWS} is out of range"):
            model(torch.tensor([[1, 2, ROWS]]))
        with pytest.raises(InvalidRequestError, match="row id -1 is out of range"):
            model(torch.tensor([[-1, 2, 3]]))
        with pytest.raises(InvalidRequestError, match="must be an integer tensor"):
            model(torch.tensor([[1.0, 2.0, 3.0]]))
        with pytest.raises(InvalidRequestError, match="must be an integer tensor \\(int64, int32, int16, int8, uint8 or bool, "
                                                      "as torch.nn.EmbeddingBag takes\\), got a list"):
            model([[1, 2, 3]])
        with pytest.raises(InvalidRequestError, match="table 'emb': bag offsets must be an integer tensor.*got torch.float32"):
            model.emb(torch.tensor([1, 2, 3]), torch.tensor([0.0, 1.0]))  # (torch's error named its `indices`)
        small = torch.tensor([[1, 2, 3]], dtype=torch.int16)  # (other integer ids: converted, as torch's bags take them)
        torch.testing.assert_close(model(small), model(small.long()), rtol=0, atol=0)
        with pytest.raises(InvalidRequestError, match="no sparse table 'nope'"):
            opt.client.pull_rows("nope", torch.tensor([1]))
        # the server checks what a client sends, too: a row of another shard, a table it lacks
        from psgrad.proto import ps_pb2 as pb
        one = torch.tensor([1], dtype=torch.int64).numpy().tobytes()
        req = pb.RowsRequest(rank=0, fingerprint=opt.client.fingerprint,
                             block=pb.RowBlock(tables=["emb"], counts=[1], ids=one))
        with pytest.raises(InvalidRequestError, match="row 1 lives on shard 1, not on shard 0"):
            opt.client.shards[0].pull_rows(req)
        req.block.tables[0] = "other"
        with pytest.raises(InvalidRequestError, match="the job's are: 'emb'"):
            opt.client.shards[0].pull_rows(req)
        # a push whose row block is not the size its counts and widths make: refused by name, nothing applied
        from psgrad.wire.frames import PushHead
        from psgrad.wire.rows import RowBlock
        c = opt.client
        start, end = c.plan.ranges[0]
        payload = memoryview(bytes(4 * (end - start)))
        dim = c.tables["emb"].dim
        good = RowBlock(["emb"], [2], torch.tensor([0, 2]), torch.ones(2 * dim), [dim], [0])
        short = RowBlock(["emb"], [2], good.ids, good.grads[:-1], [dim], [0])  # type: ignore[index]
        before = running[0].shard.version
        with pytest.raises(InvalidRequestError, match=f"{2 * dim - 1} gradient values for row ids and widths that make {2 * dim}"):
            c.shards[0].push(PushHead(c._push_header(0, 0).header, short), payload)
        assert running[0].shard.version == before
        assert c.shards[0].push(PushHead(c._push_header(0, 0).header, good), payload).applied  # its retry: once
        assert running[0].shard.version == before + 1
    with pytest.raises(ConfigError, match="optimizer 'rmsprop' has no row-wise form.*sgd, adam, adagrad"):
        with psgrad.connect([s.address for s in running], optimizer=psgrad.RMSprop(lr=0.01), client=CLIENT) as ps:
            ps.optimizer(Ctr())
    with pytest.raises(ConfigError, match="overlap does not go with psgrad embeddings"):
        with psgrad.connect([s.address for s in running], optimizer=psgrad.SGD(lr=0.1), client=CLIENT) as ps:
            ps.optimizer(Ctr(), overlap=True)


@pytest.mark.timeout(60)
def test_a_bad_id_in_the_batch_a_step_fetches_ahead_is_named_and_nothing_is_pushed(make_servers) -> None:  # type: ignore[no-untyped-def]
    running, model = make_servers(2), Ctr()
    with psgrad.connect([s.address for s in running], optimizer=psgrad.SGD(lr=0.1), client=CLIENT) as ps:
        opt = ps.optimizer(model)
        x = torch.tensor([[1, 2, 3]])
        opt.zero_grad()
        nn.functional.binary_cross_entropy_with_logits(model(x), torch.ones(1)).backward()
        versions = [s.shard.version for s in running]
        with pytest.raises(InvalidRequestError, match=f"the next batch's rows, which this step fetches ahead .*row id "
                                                      f"{ROWS} is out of range.*this step pushed nothing"):
            opt.step(prefetch={model.emb: torch.tensor([[1, ROWS, 3]])})
        assert [s.shard.version for s in running] == versions and opt.clock == 0
        assert opt.step(prefetch={model.emb: x}).accepted  # taken again: applied once
        assert [s.shard.version for s in running] == [v + 1 for v in versions]


@pytest.mark.timeout(60)
def test_a_table_over_the_servers_memory_budget_is_refused_by_name(make_servers) -> None:  # type: ignore[no-untyped-def]
    running = make_servers(1, memory_budget_mb=1)

    class Big(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = psgrad.Embedding(10_000_000, 32)  # its row index alone: 80 MB
            self.head = nn.Linear(32, 1)

    with pytest.raises(MemoryBudgetError, match="row index of table 'table'.*--memory-budget-mb 1"):
        with psgrad.connect([running[0].address], client=CLIENT) as ps:
            ps.optimizer(Big())


def test_embedding_modules_match_torch_on_the_same_rows() -> None:
    """Bound to an in-process row source, psgrad's modules compute what torch's do on the same
    table, and their gradients come out coalesced per id."""

    class Local:
        def __init__(self, weight: torch.Tensor) -> None:
            self.weight = weight

        def pull_tables(self, lookups: dict[str, torch.Tensor], observe: bool, checked: bool = False) -> dict[str, torch.Tensor]:
            return {table: self.weight[ids].clone() for table, ids in lookups.items()}

    torch.manual_seed(1)
    weight = torch.randn(50, 4)
    x = torch.tensor([[1, 7, 7], [3, 1, 0]])
    for mine, theirs in [
        (psgrad.Embedding(50, 4, padding_idx=0), nn.Embedding(50, 4, padding_idx=0)),
        (psgrad.EmbeddingBag(50, 4, mode="sum"), nn.EmbeddingBag(50, 4, mode="sum")),
        (psgrad.EmbeddingBag(50, 4, mode="mean"), nn.EmbeddingBag(50, 4, mode="mean")),
    ]:
        mine.bind("t", Local(weight))
        with torch.no_grad():
            theirs.weight.copy_(weight)
            if isinstance(theirs, nn.Embedding):
                theirs.weight[0] = 0
        torch.testing.assert_close(mine(x), theirs(x))
        mine(x).square().sum().backward()
        mine(x[:1]).sum().backward()
        theirs(x).square().sum().backward()
        theirs(x[:1]).sum().backward()
        ids, grads = mine.take_gradients()
        padding = getattr(mine, "padding_idx", None)  # (its row takes no gradient and is not pushed)
        assert ids.tolist() == sorted(set(x.flatten().tolist()) - {padding})
        torch.testing.assert_close(grads, theirs.weight.grad[ids])
        assert mine.take_gradients() is None  # taken
    with pytest.raises(ConfigError, match="mode must be one of sum, mean, max, got 'median'"):
        psgrad.EmbeddingBag(5, 2, mode="median")
    for bad in (0, 2**63):  # (2**63 rows: an int64 id cannot name the last; it failed at bind, unnamed)
        with pytest.raises(ConfigError, match=r"num_embeddings must be an integer in \[1, 2\*\*63\)"):
            psgrad.Embedding(bad, 2)


@pytest.mark.timeout(60)
def test_an_export_holds_the_updated_rows_and_can_materialize_the_whole_table(make_servers) -> None:  # type: ignore[no-untyped-def]
    from psgrad.client.export import fetch_model

    running = make_servers(2)
    model = Ctr()
    gen = torch.Generator().manual_seed(8)
    with psgrad.connect([s.address for s in running], mode="sync", optimizer=psgrad.SGD(lr=0.5), client=CLIENT) as ps:
        _train(model, ps.optimizer(model), gen, 3)
        model(torch.tensor([[ROWS - 1, ROWS - 1, ROWS - 1]]))  # pulled, never updated: not in the export
    held = _server_table(running)
    snap = fetch_model([s.address for s in running])
    state = snap.state_dict
    ids = state["emb.ids"]
    tables = [s.shard.core.state.tables["emb"] for s in running]
    assert ids.numel() == sum(int((t.snapshot().tensors["versions"] > 0).sum()) for t in tables) > 0
    assert ids.tolist() == sorted(ids.tolist()) and ROWS - 1 not in ids.tolist()
    assert torch.equal(state["emb.rows"], held[ids])
    assert state["emb.init"].tolist() == [ROWS, DIM, 3] and float(state["emb.init_std"]) == pytest.approx(0.1)
    assert torch.equal(state["head.weight"], model.head.weight.detach())
    whole = fetch_model([s.address for s in running], materialize=True).state_dict
    assert torch.equal(whole["emb.weight"], held)
    dense = Ctr(sparse=False)
    dense.load_state_dict(whole)  # the layout of torch.nn.EmbeddingBag


@pytest.mark.timeout(90)
def test_a_hot_standby_holds_the_rows_and_takes_over_with_them(make_servers) -> None:  # type: ignore[no-untyped-def]
    """A backup receives every update of the sparse table; when the primary stops, the worker goes on
    with the backup, and the job ends exactly where a job without the failure ends."""
    steps = 6

    def run(address: str, between: object = None) -> tuple[torch.Tensor, nn.Module]:
        model = Ctr()
        gen = torch.Generator().manual_seed(9)
        config = ClientConfig(connect_timeout_s=10, rpc_timeout_s=20, init_timeout_s=30, reconnect_timeout_s=20,
                              shared_memory=False)
        with psgrad.connect([address], optimizer=psgrad.Adagrad(lr=0.1), client=config) as ps:
            opt = ps.optimizer(model)
            for k in range(steps):
                if k == steps // 2 and callable(between):
                    between()
                x, y = _batch(gen)
                opt.zero_grad()
                nn.functional.binary_cross_entropy_with_logits(model(x), y).backward()
                opt.step()
            ps.leave()
            return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), model

    reference = make_servers(1)
    expected, _ = run(reference[0].address)
    primary = make_servers(1)[0]
    backup = make_servers(1, replica_of=primary.address)[0]

    def check_and_stop() -> None:
        assert torch.equal(_server_table([backup]), _server_table([primary]))
        primary.stop(0)

    got, _ = run(f"{primary.address}|{backup.address}", check_and_stop)
    assert backup.shard.status().replica.role == "primary"
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert torch.equal(_server_table([backup]), _server_table(reference))


@pytest.mark.timeout(60)
def test_a_row_cache_serves_hot_rows_and_sync_mode_refuses_one(make_servers) -> None:  # type: ignore[no-untyped-def]
    running = make_servers(1)
    model = Ctr()
    x, y = _batch(torch.Generator().manual_seed(11))
    with psgrad.connect([running[0].address], optimizer=psgrad.SGD(lr=0.5), client=CLIENT) as ps:
        opt = ps.optimizer(model, row_cache=100, row_cache_staleness=2)
        pulls = []
        pull = opt.client.pull_tables
        opt.client.pull_tables = lambda lookups, observe=False, checked=False: pulls.append(lookups["emb"].numel()) or pull(lookups, observe, checked)
        for _ in range(4):
            opt.zero_grad()
            nn.functional.binary_cross_entropy_with_logits(model(x), y).backward()
            opt.step()
        unique = torch.unique(x).numel()
        assert pulls == [unique, unique]  # steps 0 and 2 pull; 1 and 3 are served from the cache
        assert opt.row_cache.stats.hit_rate == pytest.approx(0.5)
        assert running[0].shard.core.state.tables["emb"].version == 4  # every step's rows were pushed
    with pytest.raises(ConfigError, match="sync mode"):
        with psgrad.connect([running[0].address], mode="sync", client=CLIENT) as ps:
            ps.optimizer(Ctr(), row_cache=10)
    # hybrid tables: refused naming them, not sync mode alone (their rows are async already)
    with pytest.raises(ConfigError, match=r"a row cache does not go with hybrid tables \(tables_mode='async' with "
                                          r"mode='sync'; --tables-mode async\).*Leave the row cache out.*make the "
                                          r"whole job async \(mode='async' without tables_mode\)"):
        with psgrad.connect([running[0].address], mode="sync", tables_mode="async", client=CLIENT) as ps:
            ps.optimizer(Ctr(), row_cache=10)


@pytest.mark.timeout(120)
def test_a_tables_own_lr_in_param_groups_changes_only_that_tables_update(make_servers) -> None:  # type: ignore[no-untyped-def]
    """Two tables and a head over two shards, one table in a param group with half the job's lr: its
    rows move by half of what the same job without the group moves them, the other table's and the
    head's exactly as without it."""

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = psgrad.EmbeddingBag(ROWS, DIM, mode="sum", std=0.1, seed=3)
            self.b = psgrad.EmbeddingBag(ROWS, DIM, mode="sum", std=0.1, seed=3)
            torch.manual_seed(0)
            self.head = nn.Linear(DIM, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.a(x) + self.b(x)).squeeze(-1)

    x, y = _batch(torch.Generator().manual_seed(4))
    moved = {}
    for grouped in (False, True):
        running, model = make_servers(2), Two()  # (a job of its own each)
        with psgrad.connect([s.address for s in running], mode="sync", optimizer=psgrad.SGD(lr=0.5),
                            client=CLIENT) as ps:
            groups = [{"params": [model.a], "lr": 0.25}] if grouped else None
            opt = ps.optimizer(model, param_groups=groups)
            ids = torch.unique(x)
            before = {name: opt.client.pull_rows(name, ids).clone() for name in ("a", "b")}
            head = model.head.weight.detach().clone()
            opt.zero_grad()
            nn.functional.binary_cross_entropy_with_logits(model(x), y).backward()
            assert opt.step().accepted
            moved[grouped] = {name: opt.client.pull_rows(name, ids) - before[name] for name in ("a", "b")}
            moved[grouped]["head"] = model.head.weight.detach() - head
    assert torch.equal(moved[True]["b"], moved[False]["b"]) and torch.equal(moved[True]["head"], moved[False]["head"])
    torch.testing.assert_close(moved[True]["a"], moved[False]["a"] / 2, rtol=1e-4, atol=1e-7)
    assert not torch.equal(moved[True]["a"], moved[False]["a"])

    # The job's momentum does not reach rows: refused by name, until the tables' group sets it to 0.
    running = make_servers(1)
    with psgrad.connect([running[0].address], optimizer=psgrad.SGD(lr=0.5, momentum=0.9), client=CLIENT) as ps:
        with pytest.raises(ConfigError, match="momentum 0.9 of optimizer 'sgd' does not apply to the rows of sparse "
                                              "table 'a'.*param group of its own"):
            ps.optimizer(Two())
        model = Two()
        opt = ps.optimizer(model, param_groups=[{"params": [model.a, model.b], "momentum": 0.0}])
        opt.zero_grad()
        nn.functional.binary_cross_entropy_with_logits(model(x), y).backward()
        assert opt.step().accepted
        state = running[0].shard.core.state
        assert state.tables["a"].version == 1 and state.dense.optimizer.momentum == 0.9


class Padded(nn.Module):
    """A table, a bag and a dynamic table, each with a padding id (0, 0 and -1), and a head: the
    psgrad modules, or (dense=True) torch's twins on the same initial rows (the padding row zero,
    as torch makes it; the dynamic table's rows of `vocab`, its padding id's first)."""

    def __init__(self, dense: bool = False, vocab: torch.Tensor | None = None) -> None:
        super().__init__()
        self.emb: nn.Module = psgrad.Embedding(50, 4, padding_idx=0, std=0.5, seed=1)
        self.bag: nn.Module = psgrad.EmbeddingBag(50, 4, mode="mean", padding_idx=0, std=0.5, seed=2)
        self.dyn: nn.Module = psgrad.Embedding(None, 4, padding_idx=-1, std=0.5, seed=3)
        torch.manual_seed(0)
        self.head = nn.Linear(12, 1)
        self.vocab = vocab
        if dense:
            assert vocab is not None and int(vocab[0]) == -1
            emb, bag = nn.Embedding(50, 4, padding_idx=0), nn.EmbeddingBag(50, 4, mode="mean", padding_idx=0)
            dyn = nn.Embedding(vocab.numel(), 4, padding_idx=0)
            with torch.no_grad():
                for name, mine, theirs in (("emb", self.emb, emb), ("bag", self.bag, bag)):
                    mine.table = name  # (the servers' name: its initial rows depend on it)
                    theirs.weight.copy_(mine.initial_weight())
                    theirs.weight[0] = 0
                dyn.weight.copy_(row_initial(3, "dyn", vocab))
                dyn.weight[0] = 0
            self.emb, self.bag, self.dyn = emb, bag, dyn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = torch.where(x == 0, -1, x * 7919)  # the dynamic table's ids (padding: -1)
        if isinstance(self.dyn, nn.Embedding):  # torch's twin: the vocabulary's places
            assert self.vocab is not None
            ids = torch.searchsorted(self.vocab, ids)
        return self.head(torch.cat([self.emb(x).sum(1), self.bag(x), self.dyn(ids).sum(1)], 1)).squeeze(-1)


def row_initial(seed: int, table: str, ids: torch.Tensor) -> torch.Tensor:
    from psgrad.core import rows

    return rows.initial_rows(rows.table_key(seed, table), ids, 4, 0.5)


def test_the_padding_ids_row_is_never_pushed_or_stored_and_training_equals_torchs(start_servers) -> None:  # type: ignore[no-untyped-def]
    """Before: a forward pulled the padding id's row, and its zero gradient was pushed with the
    others: the servers stored the row (a dynamic table made one for -1), counted it, and stepped its
    optimizer state. Now the worker pushes no gradient for it, so after training on batches full of
    padding the servers hold no row of it (it reads as its initial value, unused), and the model
    equals torch's modules trained alike (their padding rows stay zero). A real server process."""
    from psgrad.client.parameter_client import shard_status

    (address,) = start_servers(1)
    gen = torch.Generator().manual_seed(4)
    batches = []
    for _ in range(5):
        x = torch.randint(1, 50, (6, 4), generator=gen)
        x[torch.rand(6, 4, generator=gen) < 0.4] = 0  # padding, in every batch
        x[0] = 0  # a row of padding alone
        batches.append((x, torch.rand(6, generator=gen)))
    vocab = torch.unique(torch.cat([torch.where(x == 0, -1, x * 7919).flatten() for x, _ in batches]))
    model, twin = Padded(), Padded(dense=True, vocab=vocab)
    theirs = torch.optim.Adagrad(twin.parameters(), lr=0.3)
    with psgrad.connect([address], optimizer=psgrad.Adagrad(lr=0.3), client=CLIENT) as ps:
        opt = ps.optimizer(model)
        for x, y in batches:
            for m, o in ((model, opt), (twin, theirs)):
                o.zero_grad()
                nn.functional.binary_cross_entropy_with_logits(m(x), y).backward()
                o.step()
        client = opt.client
        used = torch.unique(torch.cat([x.flatten() for x, _ in batches]))
        for name, pad, ids in (("emb", 0, used), ("bag", 0, used), ("dyn", -1, vocab)):
            stored, values = client.updated_rows(name)
            assert pad in ids.tolist() and pad not in stored.tolist(), name
            assert stored.tolist() == [i for i in ids.tolist() if i != pad], name
            expected = getattr(twin, name).weight.detach()
            at = stored if name != "dyn" else torch.searchsorted(vocab, stored)
            torch.testing.assert_close(values, expected[at], msg=name)
        # The padding rows: as they were made, never updated (no row stored, no optimizer state).
        assert torch.equal(client.pull_rows("emb", torch.tensor([0])), row_initial(1, "emb", torch.tensor([0])))
        assert torch.equal(client.pull_rows("dyn", torch.tensor([-1])), row_initial(3, "dyn", torch.tensor([-1])))
        (status,) = shard_status([address], 10)
        touched = {t.name: (t.rows_touched, t.admitted) for t in status.tables if t.kind == "sparse"}
        n = used.numel() - 1
        assert touched == {"emb": (n, n), "bag": (n, n), "dyn": (vocab.numel() - 1, vocab.numel() - 1)}, touched
        torch.testing.assert_close(model.head.weight, twin.head.weight)
        model.eval()
        twin.eval()
        with torch.no_grad():
            for x, _ in batches:  # the forwards (padding's outputs included) are torch's
                torch.testing.assert_close(model(x), twin(x))


def _bce(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.binary_cross_entropy_with_logits(model(x), y)


@pytest.mark.timeout(60)
def test_a_training_step_in_eval_mode_trains_the_rows_as_torch_does(make_servers) -> None:  # type: ignore[no-untyped-def]
    """model.eval() with autograd on (fine-tuning with dropout off and BatchNorm's statistics fixed):
    torch's table trains, and so does psgrad's (before, its forwards in eval mode gave the rows no
    gradient: only the head trained). A forward under torch.no_grad() records nothing and is not
    served rows fetched ahead; a training forward in eval mode is."""
    running = make_servers(1)
    model, reference = Ctr(mode="mean"), Ctr(sparse=False, mode="mean")
    torch_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(22)
    data = [_batch(gen) for _ in range(2)]
    with psgrad.connect([running[0].address], mode="sync", optimizer=psgrad.SGD(lr=0.5), client=CLIENT) as ps:
        opt = ps.optimizer(model)
        for m, o in ((model, opt), (reference, torch_opt)):
            m.eval()
            for x, y in data:
                o.zero_grad()
                _bce(m, x, y).backward()
                o.step()
        x, _ = data[0]
        opt.prefetch({model.emb: x})
        with torch.no_grad():
            model.emb(x)  # a read-only read: records nothing, takes none of the prefetched rows
        assert opt.prefetched.stats.served == 0 and model.emb.take_gradients() is None
        model.emb(x).sum().backward()  # eval mode, autograd on: a training forward, served the prefetched rows
        assert opt.prefetched.stats.served == 1 and model.emb.take_gradients() is not None
    torch.testing.assert_close(_server_table(running), reference.emb.weight.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.head.weight, reference.head.weight, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("zeroing", ["optimizer", "modules"])
def test_zero_grad_drops_the_rows_gradients_as_torch_does(make_servers, zeroing) -> None:  # type: ignore[no-untyped-def]
    """A backward whose step is skipped (zero_grad, then another batch), a NaN loss skipped the same
    way, and zero_grad between a forward and its backward: the table and the head end as torch's
    dense model does, zeroed by opt.zero_grad() or by the modules' own zero_grad() (the table's for
    its rows). Before, zero_grad left the rows' gradients: the next step pushed the skipped batch's
    too, and after the NaN loss it failed with NonFiniteGradientError."""
    running = make_servers(1)
    model, reference = Ctr(), Ctr(sparse=False)
    torch_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(21)
    (xa, ya), (xb, yb), (xc, yc) = (_batch(gen) for _ in range(3))
    with psgrad.connect([running[0].address], mode="sync", optimizer=psgrad.SGD(lr=0.5), client=CLIENT) as ps:
        opt = ps.optimizer(model)

        def zero_psgrad() -> None:
            if zeroing == "optimizer":
                opt.zero_grad()
            else:  # (model.zero_grad() reaches the parameters only: the table's rows take their own)
                model.zero_grad()
                model.emb.zero_grad()

        for m, o, zero in ((model, opt, zero_psgrad), (reference, torch_opt, torch_opt.zero_grad)):
            zero()
            _bce(m, xa, ya).backward()  # a step skipped
            zero()
            _bce(m, xb, yb).backward()
            o.step()
            zero()
            (_bce(m, xa, ya) * float("nan")).backward()  # a NaN loss, skipped
            zero()
            _bce(m, xc, yc).backward()
            o.step()
            loss = _bce(m, xa, ya)
            zero()  # between the forward and its backward: the rows still take this backward's gradient
            loss.backward()
            o.step()
        assert model.emb.take_gradients() is None
    torch.testing.assert_close(_server_table(running), reference.emb.weight.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.head.weight, reference.head.weight, rtol=1e-5, atol=1e-6)
    assert running[0].shard.core.state.tables["emb"].version == 3


@pytest.mark.timeout(60)
def test_requires_grad_false_freezes_a_tables_rows_and_true_unfreezes_them(make_servers) -> None:  # type: ignore[no-untyped-def]
    """module.requires_grad_(False), torch's way to freeze a module: the table's rows stay as they
    are on the servers while the head trains, as torch's frozen table does; requires_grad_(True)
    (or requires_grad = True) trains them again. Before, requires_grad_ reached no parameter (a
    table has none) and the rows kept training."""
    running = make_servers(1)
    model, reference = Ctr(), Ctr(sparse=False)
    assert model.emb.requires_grad_(False) is model.emb and model.emb.requires_grad is False
    reference.emb.requires_grad_(False)
    torch_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(23)
    data = [_batch(gen) for _ in range(4)]
    with psgrad.connect([running[0].address], mode="sync", optimizer=psgrad.SGD(lr=0.5), client=CLIENT) as ps:
        opt = ps.optimizer(model)
        for m, o in ((model, opt), (reference, torch_opt)):
            for k, (x, y) in enumerate(data):
                if k == 2:  # unfrozen for the last two steps
                    if m is model:
                        m.emb.requires_grad = True
                    else:
                        m.emb.requires_grad_(True)
                o.zero_grad()
                _bce(m, x, y).backward()
                o.step()
                if k == 1 and m is model:
                    assert running[0].shard.core.state.tables["emb"].version == 0  # frozen: never updated
        assert model.emb.requires_grad is True
    assert running[0].shard.core.state.tables["emb"].version == 2
    torch.testing.assert_close(_server_table(running), reference.emb.weight.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.head.weight, reference.head.weight, rtol=1e-5, atol=1e-6)
    # one rule for every way to freeze: a collection's tables, from_pretrained(freeze=True)
    collection = psgrad.EmbeddingBagCollection({"a": (10, 2), "b": (20, 2)})
    assert collection.requires_grad_(False) is collection and not collection.requires_grad
    assert not any(bag.requires_grad for bag in collection.bags.values())
    pretrained = psgrad.Embedding.from_pretrained(torch.zeros(5, 2))
    assert pretrained.requires_grad is False and pretrained.requires_grad_().requires_grad is True


@pytest.mark.timeout(60)
def test_a_push_counts_the_rows_staleness_from_the_oldest_read_of_its_gradient(make_servers) -> None:  # type: ignore[no-untyped-def]
    """Async, two workers: worker 0 reads rows, worker 1 updates them, worker 0 reads them again and
    pushes the gradient of both forwards (gradient accumulation): its push is one update stale (it
    claimed its latest read before, staleness 0). With a row cache, a forward of cached rows (read a
    step ago) and pulled ones counts from the cached ones."""
    running = make_servers(1)
    gen = torch.Generator().manual_seed(24)
    x, y = _batch(gen)
    models = [Ctr(), Ctr()]
    with psgrad.connect([running[0].address], rank=0, num_workers=2, optimizer=psgrad.SGD(lr=0.5), client=CLIENT) as p0, \
            psgrad.connect([running[0].address], rank=1, num_workers=2, optimizer=psgrad.SGD(lr=0.5), client=CLIENT) as p1:
        opts = [p0.optimizer(models[0]), p1.optimizer(models[1])]
        opts[0].zero_grad()
        _bce(models[0], x, y).backward()  # rows of version 0
        opts[1].zero_grad()
        _bce(models[1], x, y).backward()
        opts[1].step()  # version 1
        _bce(models[0], x, y).backward()  # rows of version 1
        opts[0].step()
        table = running[0].shard.core.state.tables["emb"]
        assert (table.version, table.staleness_max, table.staleness_sum) == (2, 1, 1)

    running = make_servers(1)
    model = Ctr()
    with psgrad.connect([running[0].address], optimizer=psgrad.SGD(lr=0.5), client=CLIENT) as ps:
        opt = ps.optimizer(model, row_cache=100, row_cache_staleness=3)
        for ids in ([[1, 2, 3]], [[1, 2, 4]]):  # step 1: rows 1 and 2 cached at version 0, row 4 pulled at 1
            opt.zero_grad()
            _bce(model, torch.tensor(ids), torch.ones(1)).backward()
            opt.step()
        assert opt.row_cache.stats.hits == 2
        table = running[0].shard.core.state.tables["emb"]
        assert (table.version, table.staleness_max) == (2, 1)


@pytest.mark.timeout(60)
def test_after_a_bad_id_in_the_pipelines_next_batch_a_step_again_goes_on(make_servers) -> None:  # type: ignore[no-untyped-def]
    """The pipeline's next batch holds an id out of range: the step refuses before sending anything,
    saying how to go on; taken again it pushes without that batch's rows, whose own forward then
    refuses the id, and the loop skips it. Before, the step taken again was refused the same way
    (the pipeline still held that batch's lookups)."""
    running, model = make_servers(2), Ctr()
    batches = [torch.tensor([[1, 2, 3]]), torch.tensor([[4, 5, 6]]), torch.tensor([[7, ROWS, 8]]), torch.tensor([[9, 1, 2]])]
    refused: list[str] = []
    with psgrad.connect([s.address for s in running], mode="sync", optimizer=psgrad.SGD(lr=0.1), client=CLIENT) as ps:
        opt = ps.optimizer(model)
        for x in opt.pipeline(batches, lambda b: {model.emb: b}):
            opt.zero_grad()
            try:
                loss = _bce(model, x, torch.ones(1))
            except InvalidRequestError as exc:  # the bad batch's own forward: skipped
                refused.append(str(exc))
                continue
            loss.backward()
            try:
                opt.step()
            except InvalidRequestError as exc:
                refused.append(str(exc))
                versions = [s.shard.version for s in running]
                assert opt.step().accepted  # taken again: goes on without the next batch's rows
                assert [s.shard.version for s in running] == [v + 1 for v in versions]
        assert opt.clock == 3
    assert len(refused) == 2, refused
    assert re.search(f"the next batch's rows, which this step fetches ahead.*row id {ROWS} is out of range.*this step "
                     r"pushed nothing: opt.step\(\) again pushes this step without fetching them", refused[0]), refused[0]
    assert f"table 'emb': row id {ROWS} is out of range" in refused[1]


@pytest.mark.timeout(120)
def test_a_step_the_servers_refused_pushes_its_rows_when_taken_again_and_zero_grad_drops_them(start_servers) -> None:  # type: ignore[no-untyped-def]
    """Sync, two server processes. A step whose dense gradient holds a NaN in shard 0's range is
    refused there (shard 1 applies its part: rows and dense); the user mends the gradient and takes
    the step again, which pushes the rows' gradients once more, applied by shard 0 only (shard 1
    acknowledges a duplicate). A step refused by both (a NaN loss) and then dropped with
    opt.zero_grad() pushes nothing later. The table and the head end as torch's dense twin trained
    on the same batches, skipping the dropped one. Before, the refused step had already taken the
    rows' gradients, so the step taken again pushed the dense part alone: shard 0's rows of that
    batch never moved."""
    from psgrad.client.parameter_client import shard_status
    from psgrad.errors import NonFiniteGradientError

    addresses = start_servers(2)
    model, twin = Ctr(), Ctr(sparse=False)
    theirs = torch.optim.SGD(twin.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(23)
    data = [_batch(gen) for _ in range(5)]
    with psgrad.connect(addresses, mode="sync", optimizer=psgrad.SGD(lr=0.5), client=CLIENT) as ps:
        opt = ps.optimizer(model)
        (start0, end0), (start1, end1) = opt.plan.ranges
        assert start0 == 0 < end0 and end1 > start1  # head.weight[0, 0] is shard 0's; shard 1 holds dense elements too
        for k, (x, y) in enumerate(data):
            opt.zero_grad()
            if k == 2:  # a NaN loss, stepped anyway: refused by both shards, then dropped
                (_bce(model, x, y) * float("nan")).backward()
                with pytest.raises(NonFiniteGradientError):
                    opt.step()
                opt.zero_grad()
                continue
            _bce(model, x, y).backward()
            if k == 1:  # a NaN in shard 0's range of the dense gradient: refused there, applied on shard 1
                grad = model.head.weight.grad
                assert grad is not None
                kept = float(grad[0, 0])
                grad[0, 0] = float("nan")
                with pytest.raises(NonFiniteGradientError):
                    opt.step()
                grad[0, 0] = kept  # mended: taken again
            stats = opt.step()
            assert stats.accepted or k == 1  # (shard 1 answers the step taken again as a duplicate)
            theirs.zero_grad()
            _bce(twin, x, y).backward()
            theirs.step()
        assert opt.clock == 4
        assert [s.pushes_duplicate for s in shard_status(addresses, 10)] == [0, 1]  # shard 1 had step 1's push
        table = opt.client.pull_rows("emb", torch.arange(ROWS))
    torch.testing.assert_close(table, twin.emb.weight.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.head.weight, twin.head.weight, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("convert", ["double", "half", "bfloat16"])
def test_a_model_converted_to_another_dtype_trains_its_tables_as_torchs_would(make_servers, convert) -> None:  # type: ignore[no-untyped-def]
    """model.double() / .half() / .bfloat16() before ps.optimizer(model) converts the tables as it
    converts torch's: forwards return that dtype (the model's next layer takes it, where they
    returned float32 and its Linear failed on the mix), and the rows' gradient reaches the
    servers in float32, which hold the rows so: one sync SGD step moves them by torch's converted
    model's gradient (to that dtype's precision)."""
    model, reference = getattr(Ctr(), convert)(), getattr(Ctr(sparse=False), convert)()
    dtype = reference.head.weight.dtype
    x, y = _batch(torch.Generator().manual_seed(4))
    running = make_servers(1)
    before = _server_table([])  # (the initial rows)
    with psgrad.connect([running[0].address], mode="sync", optimizer=psgrad.SGD(lr=0.5), client=CLIENT) as ps:
        opt = ps.optimizer(model)
        out = model(x)
        assert out.dtype == model.emb(x).dtype == reference.emb(x).dtype == dtype
        nn.functional.mse_loss(out, y.to(dtype)).backward()
        opt.step()
    nn.functional.mse_loss(reference(x), y.to(dtype)).backward()
    tolerance = {"double": 1e-6, "half": 2e-3, "bfloat16": 2e-2}[convert]
    torch.testing.assert_close(_server_table(running), before - 0.5 * reference.emb.weight.grad.float(),
                               rtol=tolerance, atol=tolerance)
    assert not torch.equal(_server_table(running), before)
