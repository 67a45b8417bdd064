"""Parameters a step leaves unused (torch: .grad None, and torch.optim skips them) against real
servers: a head used only on some steps trains exactly as a plain-torch twin does (zero_grad
set_to_none) with stateful rules, in sync with one and two workers (DDP's mean: one used by some
worker takes the mean with the others' zeros; one no worker used is skipped) and async; a backup
that takes over, and a checkpoint restore, continue bit for bit with skips in the history."""
from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import psgrad
from conftest import run_in_threads
from psgrad.client.parameter_client import ParameterClient
from psgrad.config import ClientConfig, JobSpec, ServerConfig
from psgrad.core.codecs import WireBuffer
from psgrad.core.layout import Layout
from psgrad.core.sharding import ParamSpec, fingerprint, plan_shards
from psgrad.core.unused import to_bytes
from psgrad.errors import InvalidRequestError
from psgrad.server import checkpoint
from psgrad.server.runtime import RunningServer, start_server
from psgrad.server.shard import Shard

pytestmark = pytest.mark.timeout(120)

CLIENT = ClientConfig(connect_timeout_s=10, rpc_timeout_s=60, init_timeout_s=30, reconnect_timeout_s=0)
STEPS = 7

OPTIMIZERS = {
    "adam": (lambda: psgrad.Adam(lr=0.05), lambda ps: torch.optim.Adam(ps, lr=0.05, foreach=False)),
    "sgd-momentum": (lambda: psgrad.SGD(lr=0.05, momentum=0.9, weight_decay=0.01),
                     lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01, foreach=False)),
    "sgd-decay": (lambda: psgrad.SGD(lr=0.05, weight_decay=0.1),  # (async: a staged rule, but not with skips)
                  lambda ps: torch.optim.SGD(ps, lr=0.05, weight_decay=0.1, foreach=False)),
    "adagrad-lr-decay": (lambda: psgrad.Adagrad(lr=0.1, lr_decay=0.5),
                         lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.5, foreach=False)),
}


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 4)
        self.head = nn.Linear(4, 1)
        self.head2 = nn.Linear(4, 1)  # used only on some steps

    def forward(self, x: torch.Tensor, use_head2: bool) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        return (self.head(h) + (self.head2(h) if use_head2 else 0)).squeeze(-1)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(5, 6, generator=gen), torch.randn(5, generator=gen)


def _uses_head2(rank: int, step: int) -> bool:
    """Rank 0 on even steps, rank 1 on every fourth: steps both use it, one does, none does."""
    return step % (2 * (rank + 1)) == 0


def _loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = _batch(rank, step)
    return ((model(x, _uses_head2(rank, step)) - y) ** 2).mean()


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _twin(init: nn.Module, reference: Callable[..., torch.optim.Optimizer], workers: int) -> torch.Tensor:
    """Plain torch: each step, every worker's backward accumulates into .grad (None for what no
    backward reached), then the mean (what DDP's all-reduce gives, what the servers' sync mean is)."""
    model = copy.deepcopy(init)
    opt = reference(model.parameters())
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for rank in range(workers):
            _loss(model, rank, step).backward()
        if workers > 1:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(1.0 / workers)
        opt.step()
    return _flat(model)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("mode, workers", [("sync", 1), ("sync", 2), ("async", 1)], ids=["sync1", "sync2", "async1"])
def test_a_head_used_on_some_steps_trains_like_torch_with_grad_none(make_servers, optimizer: str, mode: str,  # type: ignore[no-untyped-def]
                                                                    workers: int) -> None:
    make, reference = OPTIMIZERS[optimizer]
    running = make_servers(2)
    torch.manual_seed(0)
    init = TwoHeads()
    finals: dict[int, torch.Tensor] = {}

    def worker(rank: int) -> None:
        model = copy.deepcopy(init)
        with psgrad.connect([s.address for s in running], rank=rank, num_workers=workers, mode=mode,
                            optimizer=make(), client=CLIENT) as ps:
            opt = ps.optimizer(model)
            for step in range(STEPS):
                opt.zero_grad()
                _loss(model, rank, step).backward()
                assert opt.step().accepted or mode == "sync"
        finals[rank] = _flat(model)

    run_in_threads(workers, worker)
    expected = _twin(init, reference, workers)
    masters = torch.cat([w for w in (s.shard.weights_copy() for s in running) if w is not None])
    assert torch.equal(masters, expected), (masters - expected).abs().max()
    for rank in range(workers):
        assert torch.equal(finals[rank], expected)
    # (the twin with zeros for head2 instead of None ends elsewhere: what pushes gave before)


def test_a_gradient_written_by_hand_counts_as_used(make_servers) -> None:  # type: ignore[no-untyped-def]
    """A parameter no backward reached but whose .grad the step set by hand (its own tensor, or
    written into psgrad's view) is updated, as torch updates a .grad that is not None."""
    running = make_servers(1)
    torch.manual_seed(0)
    init = TwoHeads()
    model, twin = copy.deepcopy(init), copy.deepcopy(init)
    topt = torch.optim.Adam(twin.parameters(), lr=0.05, foreach=False)
    with psgrad.connect([running[0].address], optimizer=psgrad.Adam(lr=0.05), client=CLIENT) as ps:
        opt = ps.optimizer(model)
        for step in range(4):
            opt.zero_grad()
            topt.zero_grad(set_to_none=True)
            for m in (model, twin):
                _loss(m, 0, 1).backward()  # (odd step: head2 unused)
            g = torch.full_like(init.head2.weight, 0.5 * (step + 1))
            if step == 1:
                model.head2.weight.grad = g.clone()  # a tensor of its own
            elif step == 2:
                assert model.head2.weight.grad is not None
                model.head2.weight.grad.copy_(g)  # written into the view
            if step in (1, 2):
                twin.head2.weight.grad = g.clone()
            opt.step()
            topt.step()
        assert torch.equal(_flat(model), _flat(twin))


# ----------------------------------------------------------------------------- standby and checkpoints
NUMEL = 300
PARAMS = [ParamSpec("a", (100,), "float32"), ParamSpec("b", (50,), "float32"), ParamSpec("c", (150,), "float32")]
RANGES = {"a": (0, 100), "b": (100, 150), "c": (150, 300)}
CONFIG = ClientConfig(connect_timeout_s=5, rpc_timeout_s=10, reconnect_timeout_s=10, shared_memory=False)


def _unused(rank: int, clock: int) -> tuple[tuple[int, int], ...]:
    # sync's iteration skips what both left unused: b, nothing, c, a
    names = ([["b"], [], ["b", "c"], ["a"]] if rank == 0 else [["b", "c"], ["c"], ["c"], ["a"]])[clock % 4]
    return tuple(RANGES[n] for n in names)


def _grad(rank: int, clock: int) -> torch.Tensor:
    g = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1000 * rank + clock))
    for lo, hi in _unused(rank, clock):
        g[lo:hi] = 0.0
    return g


def _train(address: str, spec: JobSpec, clocks: range, between: Callable[[], None] | None = None) -> None:
    ranks = spec.num_workers
    half = len(clocks) // 2
    barrier = threading.Barrier(ranks, action=between)
    clients = [ParameterClient([address], spec, PARAMS, plan_shards(PARAMS, 1), r, CONFIG) for r in range(ranks)]

    def work(rank: int) -> None:
        c = clients[rank]
        c.join((lambda: torch.linspace(-1, 1, NUMEL)) if rank == 0 else None)
        flat = torch.empty(NUMEL)
        c.pull(flat, clocks[0])
        for i, clock in enumerate(clocks):
            if i == half:
                barrier.wait()
            c.exchange(_grad(rank, clock), clock, flat, unused=_unused(rank, clock))

    try:
        run_in_threads(ranks, work)
    finally:
        for c in clients:
            c.close()


@pytest.fixture
def servers() -> Callable[..., RunningServer]:  # type: ignore[misc]
    running: list[RunningServer] = []

    def start(**kw: object) -> RunningServer:
        s = start_server(ServerConfig(**{"port": 0, "threads": 16, **kw}))  # type: ignore[arg-type]
        running.append(s)
        return s

    yield start
    for s in running:
        s.stop(0)


def _same_state(a: RunningServer | Shard, b: RunningServer | Shard) -> None:
    sa = (a.shard if isinstance(a, RunningServer) else a).snapshot()
    sb = (b.shard if isinstance(b, RunningServer) else b).snapshot()
    assert sa.version == sb.version and torch.equal(sa.weights, sb.weights)
    assert sa.optimizer.keys() == sb.optimizer.keys()
    for key, value in sa.optimizer.items():
        other = sb.optimizer[key]
        assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, key


SKIP_SPECS = {
    "sync-adam": JobSpec(mode="sync", optimizer="adam", lr=0.01, weight_decay=0.01, num_workers=2),
    "async-momentum": JobSpec(lr=0.05, momentum=0.9, weight_decay=0.01, num_workers=1),
    "sync-adagrad": JobSpec(mode="sync", optimizer="adagrad", lr=0.1, lr_decay=0.3, num_workers=2),
    # plain SGD with decay: staged pushes (the next weights built as a push arrives) but those with skips
    "async-sgd-staged-decay": JobSpec(lr=0.1, weight_decay=0.1, num_workers=1),
}


def _counts_steps(spec: JobSpec) -> bool:
    return spec.optimizer != "sgd" or spec.momentum > 0


@pytest.mark.parametrize("name", SKIP_SPECS)
def test_a_backup_takes_over_with_skips_in_the_history_and_continues_bit_for_bit(
    name: str, servers: Callable[..., RunningServer]
) -> None:
    spec = SKIP_SPECS[name]
    reference = servers()  # the same job without a failure
    _train(reference.address, spec, range(10))
    snap = reference.shard.snapshot()
    assert ("step_runs" in snap.optimizer) == _counts_steps(spec)  # parameters at different step counts: skips taken
    primary = servers()
    backup = servers(replica_of=primary.address)
    checked: list[bool] = []

    def fail() -> None:  # half-way: the backup holds the primary's state, skips and all; then the primary dies
        _same_state(primary, backup)
        checked.append(True)
        primary.stop(0)

    _train(f"{primary.address}|{backup.address}", spec, range(10), between=fail)
    assert checked and backup.shard.status().replica.role == "primary"
    _same_state(backup, reference)


def _push(shard: Shard, rank: int, clock: int) -> None:
    layout = shard.layout
    assert layout is not None
    g = _grad(rank, clock)
    buf, wire, writer = shard.push_target(rank, clock, shard.version, NUMEL, "float32", layout.fingerprint,
                                          unused=to_bytes(_unused(rank, clock)))
    sender = WireBuffer(NUMEL, "float32")
    writer.write(sender.encode(g))
    writer.finish()
    shard.apply_push(rank, clock, shard.version, buf, wire, wire.nbytes)


@pytest.mark.parametrize("name", SKIP_SPECS)
def test_a_checkpoint_with_skips_in_the_history_restores_and_continues_bit_for_bit(name: str, tmp_path: Path) -> None:
    spec = SKIP_SPECS[name]
    layout = Layout(spec, tuple(PARAMS), 0, 0, NUMEL, fingerprint(PARAMS, spec))
    original = Shard(ServerConfig())
    original.initialize(0, layout, torch.linspace(-1, 1, NUMEL))
    for r in range(1, spec.num_workers):
        original.join(r, layout)
    for clock in range(5):
        for r in range(spec.num_workers):
            _push(original, r, clock)
    assert ("step_runs" in original.snapshot().optimizer) == _counts_steps(spec)
    restored = Shard(ServerConfig())
    restored.restore(checkpoint.load(checkpoint.save(original.snapshot(), tmp_path)))
    _same_state(original, restored)
    for shard in (original, restored):
        for clock in range(5, 9):
            for r in range(spec.num_workers):
                _push(shard, r, clock)
    _same_state(original, restored)


# ----------------------------------------------------------------------------- sparse tables
N, D = 6, 3
ALL_IDS = torch.tensor([[0, 1, 2], [3, 4, 5]])
EVEN_IDS = torch.tensor([[0, 2], [4, 0]])  # rows of shard 0 only (row r on shard r mod 2)


def _f_ids(rank: int, step: int) -> torch.Tensor | None:
    """Table f's input: rank 0 skips steps 0 and 2 and reads shard 0's rows only on steps 1 and 4
    (shard 1 must count those steps all the same); rank 1 uses f on steps 3 and 5 only."""
    if rank == 0:
        return [None, EVEN_IDS, None, ALL_IDS, EVEN_IDS, ALL_IDS, None][step]
    return ALL_IDS if step in (3, 5) else None


class Tables(nn.Module):
    def __init__(self, embedding: Callable[..., nn.Module]) -> None:
        super().__init__()
        self.p = embedding(N, D, mode="sum")
        self.f = embedding(N, D, mode="sum")
        self.head = nn.Linear(D, 1)

    def forward(self, f_ids: torch.Tensor | None) -> torch.Tensor:
        h = self.p(ALL_IDS)
        if f_ids is not None:
            h = h + self.f(f_ids)
        return self.head(h).squeeze(-1)


def _table_loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    y = torch.randn(2, generator=torch.Generator().manual_seed(10 * rank + step))
    return ((model(_f_ids(rank, step)) - y) ** 2).mean()


@pytest.mark.parametrize("mode, workers", [("sync", 1), ("sync", 2), ("async", 1)], ids=["sync1", "sync2", "async1"])
def test_a_table_unused_on_some_steps_counts_adagrads_lr_decay_like_a_dense_twin(make_servers, mode: str,  # type: ignore[no-untyped-def]
                                                                                 workers: int) -> None:
    """Adagrad's lr_decay on a table's rows counts the steps that used the table (on every shard,
    those that got none of its ids too), as torch's Adagrad over nn.EmbeddingBag(sparse=False)
    counts the steps whose .grad is not None."""
    running = make_servers(2)
    torch.manual_seed(0)
    head = nn.Linear(D, 1)
    tables: dict[str, torch.Tensor] = {}
    done = threading.Barrier(workers)

    def worker(rank: int) -> None:
        model = Tables(lambda *a, **kw: psgrad.EmbeddingBag(*a, std=0.5, **kw))
        model.head.load_state_dict(head.state_dict())
        with psgrad.connect([s.address for s in running], rank=rank, num_workers=workers, mode=mode,
                            optimizer=psgrad.Adagrad(lr=0.1, lr_decay=0.5), client=CLIENT) as ps:
            opt = ps.optimizer(model)
            if rank == 0:  # (a table's initial rows follow from its name in the model: bound by ps.optimizer)
                tables["p0"], tables["f0"] = model.p.initial_weight(), model.f.initial_weight()
            for step in range(7):
                opt.zero_grad()
                _table_loss(model, rank, step).backward()
                opt.step()
            done.wait()  # (every worker's last push applied: the rows read next are the final ones)
            if rank == 0:
                with torch.no_grad():
                    rows = torch.arange(N).unsqueeze(1)
                    tables["p"], tables["f"] = model.p(rows), model.f(rows)
                tables["head"] = model.head.weight.detach().clone()
            done.wait()

    run_in_threads(workers, worker)
    twin = Tables(nn.EmbeddingBag)
    with torch.no_grad():
        twin.p.weight.copy_(tables["p0"])
        twin.f.weight.copy_(tables["f0"])
    twin.head.load_state_dict(head.state_dict())
    opt = torch.optim.Adagrad(twin.parameters(), lr=0.1, lr_decay=0.5, foreach=False)
    for step in range(7):
        opt.zero_grad(set_to_none=True)
        for rank in range(workers):
            _table_loss(twin, rank, step).backward()
        if workers > 1:
            for p in twin.parameters():
                if p.grad is not None:
                    p.grad.mul_(1.0 / workers)
        opt.step()
    assert torch.equal(tables["f"], twin.f.weight.detach()), (tables["f"] - twin.f.weight).abs().max()
    assert torch.equal(tables["p"], twin.p.weight.detach())
    assert torch.equal(tables["head"], twin.head.weight.detach())


def _train_tables(address: str, fail: Callable[[], None] | None = None) -> dict[str, torch.Tensor]:
    """One sync worker trains Tables (f unused on some steps) on `address`; `fail` runs after step 3.
    Returns the final rows of both tables and the head."""
    torch.manual_seed(0)
    model = Tables(lambda *a, **kw: psgrad.EmbeddingBag(*a, std=0.5, **kw))
    with psgrad.connect(address, mode="sync", optimizer=psgrad.Adagrad(lr=0.1, lr_decay=0.5), client=CONFIG) as ps:
        opt = ps.optimizer(model)
        for step in range(7):
            opt.zero_grad()
            _table_loss(model, 0, step).backward()
            opt.step()
            if step == 3 and fail is not None:
                fail()
        with torch.no_grad():
            rows = torch.arange(N).unsqueeze(1)
            return {"p": model.p(rows), "f": model.f(rows), "head": model.head.weight.detach().clone()}


def test_a_tables_skipped_steps_replicate_checkpoint_and_survive_a_takeover(servers: Callable[..., RunningServer]) -> None:
    reference = servers()
    expected = _train_tables(reference.address)
    snap = reference.shard.snapshot()
    assert snap.optimizer.get("table_skips.f") == 3  # steps 0, 2 and 6 did not use f
    restored = Shard(ServerConfig())
    restored.restore(checkpoint.decode(*checkpoint.encode(snap)))
    _same_state(reference, restored)
    assert restored.snapshot().optimizer.get("table_skips.f") == 3

    primary = servers()
    backup = servers(replica_of=primary.address)
    checked: list[bool] = []

    def fail() -> None:
        _same_state(primary, backup)  # the skips so far (steps 0 and 2) reached the backup
        assert backup.shard.snapshot().optimizer.get("table_skips.f") == 2
        checked.append(True)
        primary.stop(0)

    got = _train_tables(f"{primary.address}|{backup.address}", fail)
    assert checked and backup.shard.status().replica.role == "primary"
    for key in expected:
        assert torch.equal(got[key], expected[key]), key
    _same_state(backup, reference)


def test_a_malformed_unused_set_or_an_unknown_table_is_refused_by_name() -> None:
    spec = SKIP_SPECS["async-momentum"]
    layout = Layout(spec, tuple(PARAMS), 0, 0, NUMEL, fingerprint(PARAMS, spec))
    shard = Shard(ServerConfig())
    shard.initialize(0, layout, torch.linspace(-1, 1, NUMEL))
    for bad in [to_bytes(((0, 400),)), to_bytes(((50, 60), (55, 70))), b"\0" * 8]:
        with pytest.raises(InvalidRequestError, match="unused ranges"):
            shard.push_target(0, 0, 0, NUMEL, "float32", layout.fingerprint, unused=bad)
    with pytest.raises(InvalidRequestError, match="nope"):
        shard.push_target(0, 0, 0, NUMEL, "float32", layout.fingerprint, unused_tables=("nope",))
    assert shard.status().pushes_rejected == 4 and shard.version == 0
