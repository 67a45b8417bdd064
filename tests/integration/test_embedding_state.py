"""psgrad embeddings' state and gradients in a real job: a trained DLRM-like model's state_dict(),
saved with torch.save, gives the same predictions in a fresh process with no servers; the same
model given to a new job on the servers binds again; psgrad.clip_grad_norm_ clips the rows'
update as torch clips a dense table's."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import psgrad
from conftest import run_python
from psgrad.config import ClientConfig
from psgrad.errors import ConfigError, WorkerStateError

CLIENT = ClientConfig(connect_timeout_s=10, rpc_timeout_s=60, init_timeout_s=30, reconnect_timeout_s=0)

# The model and its data, defined once for this process and the fresh one.
MODEL = '''
import torch
from torch import nn
import psgrad


class Dlrm(nn.Module):
    """Dense features through a bottom MLP; two categorical features from psgrad tables (a bag of
    item ids with offsets, one user id with padding); their pairwise dot products; a top MLP."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.bottom = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.items = psgrad.EmbeddingBag(500, 8, mode="sum", std=0.1, seed=5, include_last_offset=True)
        self.user = psgrad.Embedding(300, 8, padding_idx=0, std=0.1, seed=6)
        self.top = nn.Sequential(nn.Linear(8 + 3, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, dense, items, offsets, user):
        z = [self.bottom(dense), self.items(items, offsets), self.user(user)]
        dots = torch.stack([(z[i] * z[j]).sum(-1) for i, j in ((0, 1), (0, 2), (1, 2))], dim=1)
        return self.top(torch.cat([z[0], dots], dim=1)).squeeze(-1)


def batch(seed, n=32):
    """(dense, items, offsets, user, labels) of n examples, from seed."""
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(n, 4, generator=g)
    lengths = torch.randint(1, 4, (n,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    items = torch.randint(0, 500, (int(lengths.sum()),), generator=g)
    user = torch.randint(0, 300, (n,), generator=g)
    return dense, items, offsets, user, (dense[:, 0] + items[offsets[:-1]] % 2 > 0.5).float()
'''
FRESH = MODEL + '''
import sys

state_path, out = sys.argv[1], sys.argv[2]
model = Dlrm()
model.load_state_dict(torch.load(state_path))  # weights_only (torch's default), strict
model.eval()
with torch.no_grad():
    torch.save(model(*batch(99)[:4]), out)
'''


def _definitions() -> dict[str, Any]:
    names: dict[str, Any] = {}
    exec(MODEL, names)
    return names


def _train_and_predict(model: nn.Module, opt: psgrad.PSOptimizer, batch: Any, steps: int) -> torch.Tensor:
    """Train `steps` steps on batch(0..), then the model's predictions (in eval mode) on batch(99)."""
    for step in range(steps):
        *x, y = batch(step)
        opt.zero_grad()
        nn.functional.binary_cross_entropy_with_logits(model(*x), y).backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        out: torch.Tensor = model(*batch(99)[:4])
    return out


@pytest.mark.timeout(120)
def test_a_trained_models_state_dict_predicts_the_same_in_a_fresh_process_without_servers(tmp_path: Path) -> None:
    defs = _definitions()
    Dlrm, batch = defs["Dlrm"], defs["batch"]
    servers = [psgrad.serve() for _ in range(2)]
    try:
        addresses = [s.address for s in servers]
        model = Dlrm()
        with psgrad.connect(addresses, mode="async", optimizer=psgrad.Adagrad(lr=0.1), client=CLIENT) as ps:
            opt = ps.optimizer(model, row_cache=1000, row_cache_staleness=2)  # (the state reads past the cache)
            initial = model.items.initial_weight()  # (bound: drawn under the job's name, 'items')
            expected = _train_and_predict(model, opt, batch, 6)
            state = model.state_dict()
            exported = psgrad.fetch_state_dict(addresses)  # psgrad export's layout: the same tables
            assert model.state_dict(keep_vars=True)["top.2.weight"] is model.top[2].weight
            with pytest.raises(ConfigError, match="into EmbeddingBag at 'items', bound to table 'items'"):
                model.load_state_dict(state)
        ids = state["items.ids"]
        assert ids.numel() > 0 and state["user.ids"].numel() > 0
        assert not torch.allclose(state["items.rows"], initial[ids])  # the rows moved
        for key in ("items.ids", "items.rows", "user.ids", "user.rows", "top.2.weight"):
            assert torch.equal(exported[key], state[key]), key
        # the job closed: the rows are on its servers, and the model says so
        with pytest.raises(WorkerStateError, match="not bound to a job: its job was closed"):
            model(*batch(99)[:4])
        with pytest.raises(WorkerStateError, match="its job was closed.*psgrad.fetch_state_dict"):
            model.state_dict()
        # given to a new job on the same servers, the model binds again and reads the job's rows
        with psgrad.connect(addresses, mode="async", optimizer=psgrad.Adagrad(lr=0.1), client=CLIENT) as ps:
            ps.optimizer(model)
            with torch.no_grad():
                torch.testing.assert_close(model(*batch(99)[:4]), expected, rtol=0, atol=0)
        from_export = Dlrm()
        from_export.load_state_dict(exported)
        from_export.eval()
        with torch.no_grad():
            torch.testing.assert_close(from_export(*batch(99)[:4]), expected, rtol=0, atol=0)
    finally:
        for s in servers:
            s.stop()
    path, out = tmp_path / "model.pt", tmp_path / "predictions.pt"
    torch.save(state, path)
    res = run_python(["-c", FRESH, str(path), str(out)], timeout_s=90)  # (forked from the template: no servers)
    assert res.returncode == 0, res.stderr[-3000:]
    torch.testing.assert_close(torch.load(out), expected, rtol=1e-6, atol=1e-6)


class Ctr(nn.Module):
    """A bag of ids from one table and a linear head (dense=True: torch.nn.EmbeddingBag on the same
    initial rows)."""

    def __init__(self, dense: bool = False) -> None:
        super().__init__()
        self.emb: nn.Module = psgrad.EmbeddingBag(200, 4, mode="sum", std=0.5, seed=3)
        if dense:
            table = nn.EmbeddingBag(200, 4, mode="sum")
            self.emb.table = "emb"  # (the job's name for it: its initial rows depend on it)
            with torch.no_grad():
                table.weight.copy_(self.emb.initial_weight())
            self.emb = table
        torch.manual_seed(0)
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(x)).squeeze(-1)


@pytest.mark.timeout(60)
def test_clip_grad_norm_clips_the_rows_update_as_torch_clips_a_dense_tables(make_servers) -> None:  # type: ignore[no-untyped-def]
    """Sync, one worker, SGD: each step's row update is lr times the clipped gradient, exactly what
    torch's clip_grad_norm_ and SGD do to a dense table (and the head moves alike)."""
    running = make_servers(1)
    model, dense = Ctr(), Ctr(dense=True)
    reference = torch.optim.SGD(dense.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(4)
    with psgrad.connect([running[0].address], mode="sync", optimizer=psgrad.SGD(lr=0.5), client=CLIENT) as ps:
        opt = ps.optimizer(model)
        for _ in range(3):
            x = torch.randint(0, 200, (16, 3), generator=gen)
            totals = []
            for m, o, clip in ((model, opt, psgrad.clip_grad_norm_), (dense, reference, torch.nn.utils.clip_grad_norm_)):
                o.zero_grad()
                loss = m(x).square().mean() + m(x[:4]).sum()  # two forwards: rows touched twice
                loss.backward()
                totals.append(clip(m.parameters() if m is dense else m, 0.05))
                o.step()
            torch.testing.assert_close(totals[0], totals[1])
            assert float(totals[0]) > 0.1  # clipped
        state = model.state_dict()
    ids = state["emb.ids"]
    assert ids.numel() > 0
    torch.testing.assert_close(state["emb.rows"], dense.emb.weight.detach()[ids], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model.head.weight, dense.head.weight, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
def test_a_loaded_state_and_pretrained_weights_become_a_new_jobs_initial_rows(make_servers) -> None:  # type: ignore[no-untyped-def]
    """The chief's loaded rows (load_state_dict, from_pretrained) are sent with its initial weights:
    a new job starts from them (the tables at version 1), and a frozen table never moves."""
    defs = _definitions()
    Dlrm, batch = defs["Dlrm"], defs["batch"]
    first, second = make_servers(2), make_servers(2)
    model = Dlrm()
    with psgrad.connect([s.address for s in first], optimizer=psgrad.Adagrad(lr=0.1), client=CLIENT) as ps:
        opt = ps.optimizer(model)
        expected = _train_and_predict(model, opt, batch, 4)
        state = model.state_dict()
    resumed = Dlrm()
    resumed.load_state_dict(state)
    with psgrad.connect([s.address for s in second], optimizer=psgrad.Adagrad(lr=0.1), client=CLIENT) as ps:
        ps.optimizer(resumed)  # the chief: its loaded rows go to the new servers with its weights
        resumed.eval()
        with torch.no_grad():
            torch.testing.assert_close(resumed(*batch(99)[:4]), expected, rtol=0, atol=0)
        again = resumed.state_dict()  # read from the new servers
        for key in ("items.ids", "items.rows", "user.ids", "user.rows"):
            assert torch.equal(again[key], state[key]), key
    assert {s.shard.core.state.tables["items"].version for s in second} == {1}

    class Words(nn.Module):
        def __init__(self, vectors: torch.Tensor, freeze: bool) -> None:
            super().__init__()
            self.words = psgrad.Embedding.from_pretrained(vectors, freeze=freeze)
            self.head = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.words(x)).sum()

    vectors = torch.randn(50, 4, generator=torch.Generator().manual_seed(1))
    x = torch.tensor([[1, 2, 3], [4, 5, 49]])
    for freeze, version in ((True, 1), (False, 2)):
        running = make_servers(1)
        words = Words(vectors, freeze)
        with psgrad.connect([running[0].address], optimizer=psgrad.SGD(lr=0.1), client=CLIENT) as ps:
            opt = ps.optimizer(words)
            torch.testing.assert_close(words.words(x), nn.Embedding.from_pretrained(vectors)(x), rtol=0, atol=0)
            opt.zero_grad()
            words(x).backward()
            opt.step()
        assert running[0].shard.core.state.tables["words"].version == version  # frozen: never updated


@pytest.mark.timeout(60)
def test_a_torch_models_state_loaded_before_the_job_becomes_its_initial_rows(make_servers) -> None:  # type: ignore[no-untyped-def]
    """A torch.nn.EmbeddingBag's state_dict (`weight`) loads into the psgrad model: ps.optimizer then
    starts the servers' table from it, so the model computes what torch's does; loaded into the
    bound model, it is refused naming the way that works."""
    reference = Ctr(dense=True)
    with torch.no_grad():
        reference.emb.weight.normal_(generator=torch.Generator().manual_seed(8))
    state = reference.state_dict()
    model = Ctr()
    model.load_state_dict(state)
    running = make_servers(1)
    x = torch.randint(0, 200, (8, 3), generator=torch.Generator().manual_seed(9))
    with psgrad.connect([running[0].address], mode="sync", optimizer=psgrad.SGD(lr=0.1), client=CLIENT) as ps:
        ps.optimizer(model)
        with torch.no_grad():
            torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
        with pytest.raises(ConfigError, match=r"bound to table 'emb'.*emb.weight.*before ps.optimizer\(model\).*"
                                              r"psgrad.EmbeddingBag.from_pretrained\(weight\)"):
            model.load_state_dict(state)
    assert running[0].shard.core.state.tables["emb"].version == 1  # the rows were loaded, as the table's first update


def _every_row(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every row of a Dlrm's two tables, read through the model (its forward's modules)."""
    with torch.no_grad():
        items = model.items(torch.arange(500), torch.arange(501))  # (include_last_offset: one id a bag)
        user = model.user.forward(torch.arange(300))  # (row 0 is padding: zeros either way)
    return {"items": items, "user": user}


def _trained_and_wrapped(make_servers: Any, steps: int) -> tuple[Any, Any, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the Dlrm class, a wrapper class holding one as `inner` (its state's keys gain the prefix
    `inner.`), the state_dict of a Dlrm trained `steps` steps on a server of its own, every row it
    reads then)."""
    defs = _definitions()
    Dlrm = defs["Dlrm"]

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Dlrm()

    model = Dlrm()
    with psgrad.connect([s.address for s in make_servers(1)], optimizer=psgrad.Adagrad(lr=0.1), client=CLIENT) as ps:
        opt = ps.optimizer(model)
        _train_and_predict(model, opt, defs["batch"], steps)
        return Dlrm, Wrapped, model.state_dict(), _every_row(model)


@pytest.mark.timeout(120)
def test_a_state_loaded_under_another_prefix_starts_a_new_job_with_every_row_as_the_job_that_wrote_it(
        make_servers) -> None:  # type: ignore[no-untyped-def]
    """A state_dict whose keys gained a wrapper's prefix (`emb` -> `inner.emb`, as DDP's `module.`
    added or stripped) loads into the wrapped model, which then starts a new job: every row, the
    never-updated ones too (drawn under the name the state's `table` entry keeps, not the
    module's new place), is the trained job's; the new job's state_dict, fetch_state_dict and
    export keep that name, so they load into a fresh model with the same rows again. A model
    that never loaded a state draws its rows under its own name, as before."""
    Dlrm, Wrapped, state, trained = _trained_and_wrapped(make_servers, 3)
    assert 0 < state["items.ids"].numel() < 500  # (rows never updated: the ones at stake)
    wrapped = Wrapped()
    wrapped.load_state_dict({"inner." + k: v for k, v in state.items()})
    servers = make_servers(2)
    addresses = [s.address for s in servers]
    with psgrad.connect(addresses, optimizer=psgrad.Adagrad(lr=0.1), client=CLIENT) as ps:
        ps.optimizer(wrapped)
        for name, rows in _every_row(wrapped.inner).items():
            torch.testing.assert_close(rows, trained[name], rtol=0, atol=0, msg=name)
        again = wrapped.state_dict()
        assert bytes(again["inner.items.table"].tolist()).decode() == "items"
        fetched = psgrad.fetch_state_dict(addresses, client=CLIENT)
        exported = psgrad.fetch_model(addresses, client=CLIENT).state_dict
    for loaded in (again, fetched, exported):
        fresh = Wrapped()
        fresh.load_state_dict(loaded)
        for name, rows in _every_row(fresh.inner).items():
            torch.testing.assert_close(rows, trained[name], rtol=0, atol=0, msg=name)
    for s in servers:  # the servers' spec says so (what standbys and checkpoints copy)
        layout = s.shard.core.state.layout
        assert {t.name: t.drawn_as for t in layout.tables} == {"inner.items": "items", "inner.user": "user"}

    fresh = Wrapped()  # never loaded: its rows are drawn under its own names, which binding gives it
    with pytest.raises(WorkerStateError, match=r"not bound.*ps\.optimizer\(model\)"):
        fresh.inner.items.initial_weight()
    with psgrad.connect([s.address for s in make_servers(1)], optimizer=psgrad.Adagrad(lr=0.1), client=CLIENT) as ps:
        opt = ps.optimizer(fresh)
        rows = _every_row(fresh.inner)
        assert torch.equal(rows["items"], fresh.inner.items.initial_weight())
        assert not torch.equal(rows["items"][1:], trained["items"][1:])
        assert bytes(fresh.state_dict()["inner.items.table"].tolist()).decode() == "inner.items"
        assert {t.drawn_as for t in opt.client.tables.values()} == {""}


@pytest.mark.timeout(120)
def test_every_worker_draws_the_rows_under_the_name_the_chiefs_loaded_state_gives(make_servers) -> None:  # type: ignore[no-untyped-def]
    """Before: only the chief learned the name a state it loaded under another prefix draws the
    rows under (TableSpec.drawn_as); another worker's modules drew under their own names, so its
    initial_weight() (and its state_dict's table entry) named rows no server holds. Now the join
    answers the job's names: a second worker with a fresh model reads, draws and names every row
    as the chief does."""
    _, Wrapped, state, _ = _trained_and_wrapped(make_servers, 2)
    chief, other = Wrapped(), Wrapped()
    chief.load_state_dict({"inner." + k: v for k, v in state.items()})
    addresses = [s.address for s in make_servers(2)]
    job = {"num_workers": 2, "mode": "async", "optimizer": psgrad.Adagrad(lr=0.1), "client": CLIENT}
    with psgrad.connect(addresses, rank=0, **job) as ps0:
        ps0.optimizer(chief)
        with psgrad.connect(addresses, rank=1, **job) as ps1:
            opt1 = ps1.optimizer(other)
            assert opt1.client.drawn_as == {"inner.items": "items", "inner.user": "user"}
            for name, module in (("items", other.inner.items), ("user", other.inner.user)):
                expect = getattr(chief.inner, name).initial_weight()
                assert torch.equal(module.initial_weight(), expect), name
            for name, rows in _every_row(other.inner).items():
                torch.testing.assert_close(rows, _every_row(chief.inner)[name], rtol=0, atol=0, msg=name)
            assert bytes(other.state_dict()["inner.items.table"].tolist()).decode() == "items"
    # The other way round: a job whose chief loaded nothing draws under the tables' own names, and a
    # worker that loaded the state (its rows ignored, as its weights are) draws so too.
    fresh_chief, loaded_other = Wrapped(), Wrapped()
    loaded_other.load_state_dict({"inner." + k: v for k, v in state.items()})
    addresses = [s.address for s in make_servers(2)]
    with psgrad.connect(addresses, rank=0, **job) as ps0:
        ps0.optimizer(fresh_chief)
        with psgrad.connect(addresses, rank=1, **job) as ps1:
            assert ps1.optimizer(loaded_other).client.drawn_as == {}
            expect = fresh_chief.inner.items.initial_weight()
            assert torch.equal(loaded_other.inner.items.initial_weight(), expect)
            assert bytes(loaded_other.state_dict()["inner.items.table"].tolist()).decode() == "inner.items"
