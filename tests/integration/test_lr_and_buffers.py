"""Learning-rate schedules and model buffers through real gRPC servers: a torch LR scheduler drives
PSOptimizer exactly like a single process (sync; one async worker), and a BatchNorm model trained
by two workers evaluates like the same model trained in one process, also when read back from the
servers (export)."""
from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

import psgrad
from conftest import run_in_threads
from psgrad.client.export import export_state_dict
from psgrad.config import ClientConfig
from psgrad.errors import ConfigError, InvalidRequestError
from psgrad.tasks import get_task

CLIENT = ClientConfig(connect_timeout_s=10, rpc_timeout_s=60, init_timeout_s=30, reconnect_timeout_s=0)
Scheduler = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def warmup_cosine(warmup: int, total: int) -> Scheduler:
    """Linear warmup from lr/10, then cosine to 0: torch's own schedulers, chained."""

    def make(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.SequentialLR(opt, [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=warmup),
            torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total - warmup),
        ], milestones=[warmup])

    return make


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "optimizer, reference",
    [
        (psgrad.SGD(lr=0.3, momentum=0.9, weight_decay=1e-3),
         lambda ps: torch.optim.SGD(ps, lr=0.3, momentum=0.9, weight_decay=1e-3)),
        (psgrad.Adam(lr=0.02, weight_decay=0.01, decoupled=True), lambda ps: torch.optim.AdamW(ps, lr=0.02)),
    ],
    ids=["sgd-momentum", "adamw"],
)
def test_a_torch_scheduler_drives_sync_training_exactly_like_one_process(make_servers, optimizer, reference) -> None:  # type: ignore[no-untyped-def]
    """Warmup + cosine set on PSOptimizer's param_groups by torch's schedulers: two sync workers end
    with the weights of one process running the same schedule on the whole batches, and each step
    reports the lr it pushed with."""
    task = get_task("digits")
    workers, steps, batch = 2, 8, 16
    schedule = warmup_cosine(3, steps)
    running = make_servers(2)
    gen = torch.Generator().manual_seed(1)
    batches = [[torch.randint(0, len(task.train_x), (batch,), generator=gen) for _ in range(steps)] for _ in range(workers)]
    init = _mlp()
    lrs: dict[int, list[float]] = {}

    def worker(rank: int) -> None:
        model = copy.deepcopy(init)
        with psgrad.connect([s.address for s in running], rank=rank, num_workers=workers, mode="sync",
                            optimizer=optimizer, client=CLIENT) as ps:
            opt = ps.optimizer(model)
            sched = schedule(opt)
            lrs[rank] = []
            for k in range(steps):
                idx = batches[rank][k]
                opt.zero_grad()
                nn.functional.cross_entropy(model(task.train_x[idx]), task.train_y[idx]).backward()
                lrs[rank].append(opt.step().lr)
                sched.step()

    run_in_threads(workers, worker)
    ref = _mlp()
    opt = reference(ref.parameters())
    sched = schedule(opt)
    expected_lrs = []
    for k in range(steps):
        idx = torch.cat([batches[r][k] for r in range(workers)])
        opt.zero_grad()
        nn.functional.cross_entropy(ref(task.train_x[idx]), task.train_y[idx]).backward()
        expected_lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == lrs[1] == expected_lrs
    assert expected_lrs[0] < expected_lrs[3] and expected_lrs[-1] < expected_lrs[3]  # warmup, then decay
    masters = torch.cat([s.shard.weights_copy() for s in running])
    torch.testing.assert_close(masters, _flat(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(60)
def test_one_async_worker_follows_the_schedule_and_bad_rates_are_refused(make_servers) -> None:  # type: ignore[no-untyped-def]
    """A LambdaLR on a lone async worker gives single-process SGD with the same schedule, bit for bit
    (the staged update path included); a non-finite lr never leaves the worker, and a server
    refuses one from a client that sends it anyway."""
    task = get_task("digits")
    steps, lr = 6, 0.5
    factor = lambda k: 1.0 / (1 + k)  # noqa: E731
    running = make_servers(2)
    model, ref = _mlp(), _mlp()
    gen = torch.Generator().manual_seed(3)
    idx = [torch.randint(0, len(task.train_x), (16,), generator=gen) for _ in range(steps)]
    with psgrad.connect([s.address for s in running], optimizer=psgrad.SGD(lr=lr), client=CLIENT) as ps:
        opt = ps.optimizer(model)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        for k in range(steps):
            opt.zero_grad()
            nn.functional.cross_entropy(model(task.train_x[idx[k]]), task.train_y[idx[k]]).backward()
            assert opt.step().lr == lr * factor(k)
            sched.step()
        opt.param_groups[0]["lr"] = math.nan
        with pytest.raises(ConfigError, match="finite number >= 0"):
            opt.step()
        with pytest.raises(InvalidRequestError, match="learning rate -1.0"):
            opt.client.exchange(opt.flat.gather_grads(), opt.clock, opt.flat.host_flat, lr=-1.0)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, factor)
    for k in range(steps):
        ref_opt.zero_grad()
        nn.functional.cross_entropy(ref(task.train_x[idx[k]]), task.train_y[idx[k]]).backward()
        ref_opt.step()
        ref_sched.step()
    assert torch.equal(torch.cat([s.shard.weights_copy() for s in running]), _flat(ref))


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 48), nn.BatchNorm1d(48), nn.ReLU(), nn.Linear(48, 10))


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


@pytest.mark.timeout(120)
def test_a_batchnorm_model_trained_by_two_workers_evaluates_like_one_process(make_servers) -> None:  # type: ignore[no-untyped-def]
    """Sync, 2 workers, BatchNorm: every worker's model and the model exported from the servers
    carry running statistics within 0.5 accuracy points of one process that trains the same model on
    the same batches (each worker's batch normalized on its own, as data parallelism does)."""
    task = get_task("digits")
    workers, steps, batch, lr = 2, 60, 16, 0.2
    # inputs shifted and scaled, so that default statistics (mean 0, var 1) would be far off
    xs, xt = task.train_x * 4 + 1, task.test_x * 4 + 1
    running = make_servers(2)
    addresses = [s.address for s in running]
    gen = torch.Generator().manual_seed(5)
    batches = [[torch.randint(0, len(xs), (batch,), generator=gen) for _ in range(steps)] for _ in range(workers)]
    init = _bn_model()
    accuracy: dict[int, float] = {}

    def worker(rank: int) -> None:
        model = copy.deepcopy(init)
        with psgrad.connect(addresses, rank=rank, num_workers=workers, mode="sync",
                            optimizer=psgrad.SGD(lr=lr), client=CLIENT) as ps:
            opt = ps.optimizer(model)
            for k in range(steps):
                idx = batches[rank][k]
                model.train()
                opt.zero_grad()
                nn.functional.cross_entropy(model(xs[idx]), task.train_y[idx]).backward()
                opt.step()
            accuracy[rank] = _accuracy(model, xt, task.test_y)

    run_in_threads(workers, worker)
    ref = copy.deepcopy(init)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for k in range(steps):
        ref.train()
        ref_opt.zero_grad()
        for r in range(workers):  # the mean gradient of the workers' batches, each normalized alone
            (nn.functional.cross_entropy(ref(xs[batches[r][k]]), task.train_y[batches[r][k]]) / workers).backward()
        ref_opt.step()
    expected = _accuracy(ref, xt, task.test_y)
    state, _ = export_state_dict(addresses)
    exported = copy.deepcopy(init)
    exported.load_state_dict(state)  # parameters and buffers, all from the servers
    assert int(state["1.num_batches_tracked"]) == steps
    without = copy.deepcopy(init)
    without.load_state_dict({k: v for k, v in state.items() if "running" not in k}, strict=False)
    got = {**{f"worker {r}": a for r, a in accuracy.items()}, "exported": _accuracy(exported, xt, task.test_y)}
    assert all(abs(a - expected) <= 0.005 for a in got.values()), (expected, got)
    assert expected > 0.85
    # what the running statistics are worth here: the same weights with fresh ones fall far behind
    assert _accuracy(without, xt, task.test_y) < expected - 0.1
