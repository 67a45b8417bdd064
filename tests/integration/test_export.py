"""`psgrad.fetch_state_dict` / `export_state_dict`: a job's model read from its servers (joining
nothing, without its job spec) as a state_dict that a fresh model, in a fresh process, loads and
evaluates exactly like the workers that trained it; in sync mode at one iteration on every shard."""
from __future__ import annotations

import copy
import dataclasses
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import psgrad
from conftest import SlowToAnswer, note_first_sleep, run_in_threads, run_python
from psgrad.client import export
from psgrad.client.export import export_state_dict
from psgrad.client.parameter_client import ParameterClient
from psgrad.config import ClientConfig, JobSpec
from psgrad.core.sharding import ParamSpec, plan_shards
from psgrad.errors import JobMismatchError, NotInitializedError, StalledError
from psgrad.tasks import get_task

pytestmark = pytest.mark.timeout(120)

CLIENT = ClientConfig(connect_timeout_s=10, rpc_timeout_s=60, init_timeout_s=30, reconnect_timeout_s=0)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def test_an_export_loaded_into_a_fresh_model_reproduces_the_workers_accuracy(make_servers) -> None:  # type: ignore[no-untyped-def]
    task = get_task("digits")
    running = make_servers(2)
    addresses = [s.address for s in running]
    model = _model()
    gen = torch.Generator().manual_seed(0)
    with psgrad.connect(addresses, optimizer=psgrad.SGD(lr=0.1), client=CLIENT) as ps:
        opt = ps.optimizer(model)
        for _ in range(60):
            idx = torch.randint(0, len(task.train_x), (32,), generator=gen)
            opt.zero_grad()
            nn.functional.cross_entropy(model(task.train_x[idx]), task.train_y[idx]).backward()
            opt.step()
        trained = _accuracy(model, task.test_x, task.test_y)
    state, versions = export_state_dict(addresses)
    assert versions == [60, 60] and list(state) == [name for name, _ in model.named_parameters()]
    fresh = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    fresh.load_state_dict(state)
    assert _accuracy(fresh, task.test_x, task.test_y) == trained > 0.5
    for name, p in model.named_parameters():
        assert torch.equal(state[name], p.detach())


def test_export_names_what_is_wrong(make_servers) -> None:  # type: ignore[no-untyped-def]
    running = make_servers(2)
    addresses = [s.address for s in running]
    with pytest.raises(NotInitializedError, match=f"server {addresses[0]} holds no job yet"):
        export_state_dict(addresses)
    with psgrad.connect(addresses, client=CLIENT) as ps:
        ps.optimizer(_model())
    with pytest.raises(JobMismatchError, match="listed as shard 0: give --servers in shard order"):
        export_state_dict(addresses[::-1])
    # Each table is read by its kind: a kind this psgrad does not know is named, not misread.
    from psgrad.core.status import TableStatus
    from psgrad.server.tables import DenseTable

    real = DenseTable.status
    try:
        DenseTable.status = lambda self, name: dataclasses.replace(real(self, name), kind="rows")  # type: ignore[method-assign]
        with pytest.raises(JobMismatchError, match="holds table 'dense' of kind 'rows', which this psgrad cannot export"):
            export_state_dict(addresses)
    finally:
        DenseTable.status = real  # type: ignore[method-assign]
    assert isinstance(real(running[0].shard.core.state.dense, "dense"), TableStatus)


# ----------------------------------------------------------------------------- psgrad.fetch_state_dict
# A fresh process that knows nothing of the job but the servers' addresses: it fetches the model,
# loads it strictly into a model it builds itself, and saves its test-set logits.
FRESH = """
import sys, torch
from torch import nn
import psgrad
from psgrad.tasks import get_task

servers, kind, out = sys.argv[1], sys.argv[2], sys.argv[3]
model = {kinds}[kind]()
model.load_state_dict(psgrad.fetch_state_dict(servers, timeout_s=20))  # strict: every tensor named
model.eval()
with torch.no_grad():
    torch.save(model(get_task("digits").test_x), out)
"""
KINDS = {
    "mlp": "lambda: nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))",
    # BatchNorm's running statistics are buffers, not parameters: evaluation depends on them.
    "batchnorm": "lambda: nn.Sequential(nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))",
}


def _build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return eval(KINDS[kind], {"nn": nn})()  # type: ignore[no-any-return]


def _fresh_logits(servers: list[str], kind: str, tmp_path: Path) -> torch.Tensor:
    out = tmp_path / f"{kind}.pt"
    script = FRESH.replace("{kinds}", "{" + ", ".join(f"{k!r}: {v}" for k, v in KINDS.items()) + "}")
    res = run_python(["-c", script, ",".join(servers), kind, str(out)], timeout_s=90)  # (forked from the template)
    assert res.returncode == 0, res.stderr[-3000:]
    return torch.load(out)  # type: ignore[no-any-return]


def _train_sync(kind: str, addresses: list[str], workers: int = 2, steps: int = 20) -> dict[int, torch.Tensor]:
    """A sync job of `workers` threads; each worker's test-set logits (eval mode) after training."""
    task = get_task("digits")
    init = _build(kind)
    logits: dict[int, torch.Tensor] = {}

    def worker(rank: int) -> None:
        model = copy.deepcopy(init)
        gen = torch.Generator().manual_seed(rank)
        with psgrad.connect(addresses, rank=rank, num_workers=workers, mode="sync",
                            optimizer=psgrad.SGD(lr=0.1, momentum=0.9), client=CLIENT) as ps:
            opt = ps.optimizer(model)
            for _ in range(steps):
                idx = torch.randint(0, len(task.train_x), (32,), generator=gen)
                opt.zero_grad()
                nn.functional.cross_entropy(model(task.train_x[idx]), task.train_y[idx]).backward()
                opt.step()  # its pull brings the iteration's weights: every worker ends with the same
        model.eval()
        with torch.no_grad():
            logits[rank] = model(task.test_x)

    run_in_threads(workers, worker)
    return logits


def test_a_model_fetched_in_a_fresh_process_evaluates_exactly_like_the_workers_that_trained_it(
    make_servers: Any, tmp_path: Path
) -> None:
    running = make_servers(2)
    addresses = [s.address for s in running]
    logits = _train_sync("mlp", addresses)
    assert torch.equal(logits[0], logits[1])
    assert torch.equal(_fresh_logits(addresses, "mlp", tmp_path), logits[0])
    snap = psgrad.fetch_model(",".join(addresses))
    assert snap.versions == [20, 20] and snap.consistent and snap.mode == "sync"


def test_a_batchnorm_model_fetched_in_a_fresh_process_evaluates_like_the_workers(make_servers: Any, tmp_path: Path) -> None:
    """The servers hold the running statistics (averaged over the two workers): a model fetched
    from them evaluates bit for bit like each worker's after its last pull."""
    running = make_servers(2)
    addresses = [s.address for s in running]
    logits = _train_sync("batchnorm", addresses, workers=2)
    assert torch.equal(logits[0], logits[1])
    assert torch.equal(_fresh_logits(addresses, "batchnorm", tmp_path), logits[0])


def test_in_sync_mode_fetch_waits_until_every_shard_is_at_one_iteration(
    make_servers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shard 0 has applied iteration 1, shard 1 not yet (the worker's push to it is late): a fetch
    reads again until both are at iteration 1, and gives exactly the weights of iteration 1."""
    running = make_servers(2)
    addresses = [s.address for s in running]
    params = [ParamSpec("w", (8,), "float32"), ParamSpec("b", (2,), "float32")]
    spec = JobSpec(mode="sync", lr=0.5, num_shards=2)
    plan = plan_shards(params, 2)
    with ParameterClient(addresses, spec, params, plan, 0, CLIENT) as c:
        c.join(lambda: torch.zeros(10))
        c.pull(torch.empty(10), 0)
        grad = torch.arange(10, dtype=torch.float32)
        (lo0, hi0), (lo1, hi1) = plan.ranges
        c.shards[0].push(c._push_header(0, 0), memoryview(grad[lo0:hi0].numpy()).cast("B"))
        assert [s.shard.version for s in running] == [1, 0]
        with pytest.raises(StalledError, match=r"the shards stayed at different iterations \(\[1, 0\]\) for 0.3 s"):
            psgrad.fetch_state_dict(addresses, timeout_s=0.3)
        retrying = note_first_sleep(monkeypatch, export)  # set when the reader first waits to read again
        got: list[Any] = []
        reader = threading.Thread(target=lambda: got.append(psgrad.fetch_model(addresses, timeout_s=30)))
        reader.start()
        try:  # it reads, finds [1, 0], and will read again
            assert retrying.wait(20) and reader.is_alive()
        finally:
            c.shards[1].push(c._push_header(1, 0), memoryview(grad[lo1:hi1].numpy()).cast("B"))
            reader.join(30)
    snap = got[0]
    assert snap.versions == [1, 1] and snap.consistent
    expected = -0.5 * grad  # iteration 1 of SGD from zeros
    assert torch.equal(snap.state_dict["w"], expected[:8]) and torch.equal(snap.state_dict["b"], expected[8:])


def test_in_async_mode_each_shard_is_read_as_of_its_own_version(make_servers: Any) -> None:
    running = make_servers(2)
    addresses = [s.address for s in running]
    params = [ParamSpec("w", (10,), "float32")]
    spec = JobSpec(mode="async", lr=1.0, num_shards=2)
    plan = plan_shards(params, 2)
    with ParameterClient(addresses, spec, params, plan, 0, CLIENT) as c:
        c.join(lambda: torch.zeros(10))
        lo, hi = plan.ranges[0]
        c.shards[0].push(c._push_header(0, 0), memoryview(torch.ones(hi - lo).numpy()).cast("B"))
        snap = psgrad.fetch_model(addresses, timeout_s=5)  # no waiting: no iteration spans the shards
    assert snap.versions == [1, 0] and not snap.consistent and snap.mode == "async"
    assert snap.state_dict["w"].tolist() == [-1.0] * (hi - lo) + [0.0] * (10 - hi + lo)


def test_a_tied_weight_round_trips_under_each_of_its_names(make_servers: Any) -> None:
    """An LM whose output layer shares the embedding's weight: the state_dict names the tensor twice,
    the flat space holds it once; the export writes it under both names, so a strict load_state_dict
    takes it."""

    class TiedLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(20, 8)
            self.mix = nn.Linear(8, 8)
            self.head = nn.Linear(8, 20, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.mix(self.embed(x))))

    torch.manual_seed(0)
    model = TiedLM()
    addresses = [s.address for s in make_servers(2)]
    with psgrad.connect(addresses, client=CLIENT) as ps:
        opt = ps.optimizer(model)
        x = torch.randint(0, 20, (16,))
        for _ in range(2):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), x).backward()
            opt.step()
        state = psgrad.fetch_state_dict(addresses)
    assert set(state) == set(model.state_dict()) and {"embed.weight", "head.weight"} <= set(state)
    fresh = TiedLM()
    fresh.load_state_dict(state)  # strict
    assert torch.equal(fresh.head.weight, model.embed.weight.detach()) and fresh.head.weight is fresh.embed.weight


def test_an_integer_lr_is_the_same_job_as_its_float(make_servers) -> None:  # type: ignore[no-untyped-def]
    """psgrad.SGD(lr=20), as pytorch/examples' word_language_model writes it: the export, and a worker
    that says lr=20.0 (as `psgrad worker --lr 20` does), see the same job."""
    running = make_servers(1)
    addresses = [s.address for s in running]
    with psgrad.connect(addresses, num_workers=2, optimizer=psgrad.SGD(lr=20), client=CLIENT) as ps:
        ps.optimizer(_model())
        state, versions = export_state_dict(addresses)  # was: "fingerprints differ"-like JobMismatchError
        assert versions == [0] and len(state) == 4
        with psgrad.connect(addresses, rank=1, num_workers=2, optimizer=psgrad.SGD(lr=20.0), client=CLIENT) as other:
            other.optimizer(_model())  # was: JobMismatchError naming no field


@pytest.mark.parametrize("frozen", [None, "local"])
def test_a_frozen_backbone_round_trips_when_it_lives_on_the_servers(make_servers: Any, frozen: str | None) -> None:
    """Fine-tuning with a frozen first layer: by default (frozen="servers") the frozen weights are part
    of the job (a table no step moves), so an export loads strictly and holds them unchanged; with
    "local" (nothing frozen travels) the export lacks them and a strict load says which."""
    torch.manual_seed(0)
    model = _model()
    backbone = model[0].weight.detach().clone()  # type: ignore[index]
    for p in model[0].parameters():  # type: ignore[index]
        p.requires_grad_(False)
    addresses = [s.address for s in make_servers(2)]
    task = get_task("digits")
    with psgrad.connect(addresses, optimizer=psgrad.SGD(lr=0.1, momentum=0.9), client=CLIENT) as ps:
        opt = ps.optimizer(model) if frozen is None else ps.optimizer(model, frozen=frozen)
        for k in range(3):
            opt.zero_grad()
            nn.functional.cross_entropy(model(task.train_x[: 32]), task.train_y[: 32]).backward()
            opt.step()
        state = psgrad.fetch_state_dict(addresses)
    fresh = _model()
    if frozen == "local":
        assert "0.weight" not in state
        with pytest.raises(RuntimeError, match="Missing key.*0.weight"):
            fresh.load_state_dict(state)
        return
    fresh.load_state_dict(state)  # strict: every key
    assert torch.equal(fresh[0].weight, backbone) and torch.equal(model[0].weight, backbone)  # type: ignore[index]
    assert not torch.equal(fresh[2].weight, _model()[2].weight)  # type: ignore[index]  # the head trained


def test_frozen_and_tied_parameters_round_trip_strictly_with_default_settings(make_servers: Any) -> None:
    """An LM whose frozen embedding is tied to its output layer, with a frozen norm and a trainable
    middle: with ps.optimizer's defaults the export holds every key (the frozen ones under each of
    their names) and a strict load_state_dict takes it, frozen values unchanged and the middle trained."""

    class FrozenTiedLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(20, 8)
            self.norm = nn.LayerNorm(8)
            self.mix = nn.Linear(8, 8)
            self.head = nn.Linear(8, 20, bias=False)
            self.head.weight = self.embed.weight
            self.embed.requires_grad_(False)
            self.norm.requires_grad_(False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.mix(self.norm(self.embed(x)))))

    torch.manual_seed(0)
    model = FrozenTiedLM()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)  # not the fresh model's values
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    addresses = [s.address for s in make_servers(2)]
    with psgrad.connect(addresses, client=CLIENT) as ps:
        opt = ps.optimizer(model)
        for _ in range(3):
            opt.zero_grad()
            x = torch.randint(0, 20, (16,))
            nn.functional.cross_entropy(model(x), (x + 1) % 20).backward()
            opt.step()
        state = psgrad.fetch_state_dict(addresses)
    assert set(state) == set(model.state_dict())
    fresh = FrozenTiedLM()
    fresh.load_state_dict(state)  # strict
    assert fresh.head.weight is fresh.embed.weight
    for name in ("embed.weight", "head.weight", "norm.weight", "norm.bias"):
        assert torch.equal(fresh.state_dict()[name], initial[name]), name
    assert not torch.equal(fresh.mix.weight, initial["mix.weight"])
    assert torch.equal(fresh.mix.weight, model.mix.weight)


def test_a_fetched_table_loaded_under_another_prefix_predicts_as_the_job_did(make_servers: Any) -> None:
    """A table's rows never updated are drawn from (seed, its name in the job, id). The export now
    writes that name (`NAME.table`), as the module's own state_dict() does, so a model that loads it
    after stripping a wrapper's prefix (DDP's `module.`) predicts as the job did for every id; it drew
    them under the prefix-less name before, silently different."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.items = psgrad.EmbeddingBag(100, 4, mode="sum")
            self.head = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.items(x)).squeeze(-1)

    torch.manual_seed(0)
    wrapped = nn.Module()
    wrapped.net = Net()
    train_x, test_x = torch.tensor([[1, 2]]), torch.tensor([[1, 50]])  # id 50 is never updated
    addresses = [s.address for s in make_servers(1)]
    with psgrad.connect(addresses, mode="sync", client=CLIENT) as ps:
        opt = ps.optimizer(wrapped)
        opt.zero_grad()
        wrapped.net(train_x).sum().backward()
        opt.step()
        wrapped.eval()
        with torch.no_grad():
            in_job = wrapped.net(test_x)
        fetched = psgrad.fetch_state_dict(addresses)
        exported, _ = export_state_dict(addresses)
        own = wrapped.state_dict()
    assert bytes(fetched["net.items.table"].tolist()).decode() == "net.items"
    assert set(fetched) == set(exported) == set(own) and torch.equal(fetched["net.items.table"], own["net.items.table"])
    net = Net()
    net.load_state_dict({k.removeprefix("net."): v for k, v in fetched.items()})  # strict
    net.eval()
    with torch.no_grad():
        assert torch.equal(net(test_x), in_job)


def test_a_table_shared_by_two_places_in_the_model_round_trips_strictly(make_servers: Any) -> None:
    """One psgrad.Embedding registered under two names (a two-tower model's history and candidate
    items): the model's state_dict holds its entries under both, the job one table. The export
    wrote them under the first name only, and a strict load failed ("Missing key(s):
    cand_items.ids, ..."); now under each name, and the loaded model predicts as the job did."""

    class TwoTower(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            shared = psgrad.Embedding(20, 4)
            self.user_items = shared
            self.cand_items = shared
            self.head = nn.Linear(4, 1)

        def forward(self, hist: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
            return self.head(self.user_items(hist) * self.cand_items(cand)).squeeze(-1)

    hist, cand = torch.tensor([1, 2, 3]), torch.tensor([3, 4, 5])
    torch.manual_seed(0)
    model = TwoTower()
    addresses = [s.address for s in make_servers(2)]
    with psgrad.connect(addresses, mode="sync", client=CLIENT) as ps:
        opt = ps.optimizer(model)
        for _ in range(2):
            opt.zero_grad()
            model(hist, cand).sum().backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            in_job = model(hist, cand)
        own = model.state_dict()
        fetched = psgrad.fetch_state_dict(addresses)
        whole = export.fetch_model(addresses, materialize=True).state_dict
    assert set(fetched) == set(own) and {"user_items.ids", "cand_items.ids"} <= set(fetched)
    for key in own:
        assert torch.equal(fetched[key], own[key]), key
    assert torch.equal(whole["cand_items.weight"], whole["user_items.weight"])
    fresh = TwoTower()
    fresh.load_state_dict(fetched)  # strict
    fresh.eval()
    with torch.no_grad():
        assert torch.equal(fresh(hist, cand), in_job)


def test_an_export_waits_through_a_servers_slow_handshake(make_servers: Any) -> None:
    """A server that takes the connection but answers its handshake late (a busy machine: seen as
    "took the TCP connection but did not speak gRPC" from the export's first pull, whose channel
    gives a connection attempt a fraction of a second) is waited for, within the export's
    timeout, as the status read before it was: the export reads the model."""
    running = make_servers(1)
    model = _model()
    with psgrad.connect([running[0].address], optimizer=psgrad.SGD(lr=0.1), client=CLIENT) as ps:
        opt = ps.optimizer(model)
        opt.zero_grad()
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
    slow = SlowToAnswer(running[0].address, 0.3)
    try:
        state, versions = export_state_dict([slow.address], 30.0)
    finally:
        slow.close()
    assert versions == [1] and set(state) == {name for name, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        assert torch.equal(state[name], p.detach())
