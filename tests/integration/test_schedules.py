"""PyTorch's word_language_model pattern on PSOptimizer through real gRPC servers: StepLR and a
manual param_group["lr"] annealing in sync mode equal one process, gradient clipping per worker,
the chief's schedule as the job's in async mode, and state_dict()/load_state_dict()."""
from __future__ import annotations

import copy
import io
from collections.abc import Callable

import pytest
import torch
from torch import nn

import psgrad
from conftest import run_in_threads
from psgrad.errors import ConfigError
from psgrad.tasks import get_task
from test_lr_and_buffers import CLIENT, _flat, _mlp

VOCAB, SEQ = 24, 7


class TinyLM(nn.Module):
    """word_language_model's RNNModel in miniature: embedding, LSTM, decoder."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Embedding(VOCAB, 12)
        self.rnn = nn.LSTM(12, 16, batch_first=True)
        self.decoder = nn.Linear(16, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.encoder(tokens))
        return self.decoder(out)


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def step_lr(opt: torch.optim.Optimizer) -> Callable[[int], None]:
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.25)
    return lambda k: sched.step()


def manual_annealing(opt: torch.optim.Optimizer) -> Callable[[int], None]:
    """word_language_model's loop: `lr /= 4.0` written into every param group when validation stalls
    (here: after steps 1 and 3)."""

    def after(k: int) -> None:
        if k in (1, 3):
            for group in opt.param_groups:
                group["lr"] = group["lr"] / 4.0

    return after


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", [step_lr, manual_annealing], ids=["StepLR", "manual-param_group-lr"])
def test_the_word_language_model_schedule_on_two_sync_workers_equals_one_process(make_servers, schedule) -> None:  # type: ignore[no-untyped-def]
    """Two sync workers, an LSTM language model, the lr changed by StepLR or by hand between steps:
    the servers apply each new lr from the step the schedule says, and the weights equal one
    process running the same schedule on the whole batches."""
    workers, steps, batch = 2, 6, 4
    running = make_servers(2)
    gen = torch.Generator().manual_seed(7)
    data = [[torch.randint(0, VOCAB, (batch, SEQ), generator=gen) for _ in range(steps)] for _ in range(workers)]
    init = TinyLM()
    lrs: dict[int, list[float]] = {}

    def worker(rank: int) -> None:
        model = copy.deepcopy(init)
        with psgrad.connect([s.address for s in running], rank=rank, num_workers=workers, mode="sync",
                            optimizer=psgrad.SGD(lr=2.0), client=CLIENT) as ps:
            opt = ps.optimizer(model)
            after = schedule(opt)
            lrs[rank] = []
            for k in range(steps):
                opt.zero_grad()
                lm_loss(model, data[rank][k]).backward()
                lrs[rank].append(opt.step().lr)
                after(k)

    run_in_threads(workers, worker)
    ref = copy.deepcopy(init)
    opt = torch.optim.SGD(ref.parameters(), lr=2.0)
    after = schedule(opt)
    expected = []
    for k in range(steps):
        opt.zero_grad()
        lm_loss(ref, torch.cat([data[r][k] for r in range(workers)])).backward()
        expected.append(opt.param_groups[0]["lr"])
        opt.step()
        after(k)
    assert lrs[0] == lrs[1] == expected
    assert len(set(expected)) == 3  # the schedule changed the lr twice
    masters = torch.cat([s.shard.weights_copy() for s in running])
    torch.testing.assert_close(masters, _flat(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
def test_gradient_clipping_applies_to_each_workers_gradient(make_servers) -> None:  # type: ignore[no-untyped-def]
    """clip_grad_norm_ on the model before step() clips the gradient the worker pushes (the flat
    buffer behind the model's .grad): two sync workers end with the weights of the mean of their
    clipped gradients, computed in one process."""
    task = get_task("digits")
    workers, steps, batch, lr, max_norm = 2, 4, 16, 0.5, 0.3
    running = make_servers(1)
    gen = torch.Generator().manual_seed(2)
    idx = [[torch.randint(0, len(task.train_x), (batch,), generator=gen) for _ in range(steps)] for _ in range(workers)]
    init = _mlp()

    def loss(model: nn.Module, i: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(model(task.train_x[i]), task.train_y[i])

    def worker(rank: int) -> None:
        model = copy.deepcopy(init)
        with psgrad.connect([running[0].address], rank=rank, num_workers=workers, mode="sync",
                            optimizer=psgrad.SGD(lr=lr), client=CLIENT) as ps:
            opt = ps.optimizer(model)
            for k in range(steps):
                opt.zero_grad()
                loss(model, idx[rank][k]).backward()
                nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                opt.step()

    run_in_threads(workers, worker)
    ref = copy.deepcopy(init)
    norms = []
    for k in range(steps):
        mean = [torch.zeros_like(p) for p in ref.parameters()]
        for r in range(workers):
            ref.zero_grad()
            loss(ref, idx[r][k]).backward()
            norms.append(float(nn.utils.clip_grad_norm_(ref.parameters(), max_norm)))
            for m, p in zip(mean, ref.parameters()):
                m.add_(p.grad / workers)
        with torch.no_grad():
            for m, p in zip(mean, ref.parameters()):
                p.sub_(lr * m)
    assert max(norms) > 2 * max_norm  # the clipping changed the gradients
    torch.testing.assert_close(running[0].shard.weights_copy(), _flat(ref), rtol=1e-5, atol=1e-6)


def _step(model: nn.Module, opt: psgrad.PSOptimizer, x: torch.Tensor, y: torch.Tensor) -> psgrad.StepStats:
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    return opt.step()


@pytest.mark.timeout(120)
def test_in_async_mode_the_chiefs_schedule_is_the_jobs(make_servers) -> None:  # type: ignore[no-untyped-def]
    """Async, two workers stepped in a fixed order: rank 0's StepLR sets the job's lr on every
    shard; rank 1's pushes are applied with it (its own lr changes are ignored, with a warning),
    its param_groups show it, and the weights equal async SGD run by hand with those lrs."""
    task = get_task("digits")
    running = make_servers(2)
    addresses = [s.address for s in running]
    x, y = task.train_x, task.train_y
    batches = [torch.arange(16 * k, 16 * (k + 1)) for k in range(8)]
    order = [1, 0, 0, 0, 1, 1]  # which worker steps next
    models = {r: _mlp() for r in (0, 1)}
    sessions = {r: psgrad.connect(addresses, rank=r, num_workers=2, mode="async", optimizer=psgrad.SGD(lr=0.4),
                                  client=CLIENT) for r in (0, 1)}
    try:
        opts = {r: sessions[r].optimizer(models[r]) for r in (0, 1)}
        sched = torch.optim.lr_scheduler.StepLR(opts[0], step_size=2, gamma=0.1)
        assert not opts[0].follows_job_lr and opts[1].follows_job_lr
        applied = []
        for k, r in enumerate(order):
            if k == 5:  # rank 1 tries a schedule of its own
                opts[1].param_groups[0]["lr"] = 7.0
                with pytest.warns(UserWarning, match="follows the chief's"):
                    stats = _step(models[r], opts[r], x[batches[k]], y[batches[k]])
            else:
                stats = _step(models[r], opts[r], x[batches[k]], y[batches[k]])
            applied.append(stats.lr)
            if r == 0:
                sched.step()
        # rank 1 first runs on the spec's lr, then on the chief's decayed one (set at its clock 2)
        assert applied == pytest.approx([0.4, 0.4, 0.4, 0.04, 0.04, 0.04])
        assert opts[1].param_groups[0]["lr"] == pytest.approx(0.04)
        statuses = [opts[0].client.shards[i].status() for i in range(2)]
        assert [(s.job_lr, s.job_lr_clock) for s in statuses] == [(pytest.approx(0.04), 2)] * 2
    finally:
        for s in sessions.values():
            s.close()
    # the same interleaving by hand: each worker computes on the weights it last pulled
    ref, local = _mlp(), {r: _mlp() for r in (0, 1)}
    with torch.no_grad():
        for k, r in enumerate(order):
            local[r].zero_grad()
            with torch.enable_grad():
                nn.functional.cross_entropy(local[r](x[batches[k]]), y[batches[k]]).backward()
            for p, q in zip(ref.parameters(), local[r].parameters()):
                p.sub_(applied[k] * q.grad)
            local[r].load_state_dict(ref.state_dict())
    torch.testing.assert_close(torch.cat([s.shard.weights_copy() for s in running]), _flat(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(120)
def test_state_dict_resumes_the_schedule_and_refuses_a_torch_optimizers_state(make_servers) -> None:  # type: ignore[no-untyped-def]
    """A PSOptimizer's state_dict (saved with torch.save) and its StepLR's restore the lr on a
    worker that joins again, and the schedule continues as in one uninterrupted process; a
    torch.optim optimizer's state_dict (momentum buffers, the servers' business here) and malformed
    ones are refused, naming the problem."""
    task = get_task("digits")
    running = make_servers(1)
    x, y = task.train_x[:32], task.train_y[:32]
    connect = lambda: psgrad.connect([running[0].address], optimizer=psgrad.SGD(lr=0.3), client=CLIENT)  # noqa: E731
    first = _mlp()
    with connect() as ps:
        opt = ps.optimizer(first)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        for _ in range(3):
            _step(first, opt, x, y)
            sched.step()
        buf = io.BytesIO()
        torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, buf)
        assert opt.state_dict()["psgrad"] == {"rank": 0, "mode": "async", "clock": 3}
    buf.seek(0)
    saved = torch.load(buf)
    again = _mlp()
    with connect() as ps:
        opt = ps.optimizer(again)
        assert opt.param_groups[0]["lr"] == 0.3  # a new optimizer starts at the job's
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
        resumed = []
        for _ in range(3):
            resumed.append(_step(again, opt, x, y).lr)
            sched.step()
        expected = [0.3 * 0.5 ** (k // 2) for k in range(6)]  # StepLR(step_size=2, gamma=0.5), uninterrupted
        assert resumed == expected[3:] and len(set(expected)) == 3
        lr_before = opt.param_groups[0]["lr"]
        ref_model = _mlp()  # a torch optimizer's state_dict: momentum buffers the servers keep instead
        ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.3, momentum=0.9)
        nn.functional.cross_entropy(ref_model(x), y).backward()
        ref_opt.step()
        with pytest.raises(ConfigError, match="per-parameter state for 4 parameters.*on the servers"):
            opt.load_state_dict(ref_opt.state_dict())
        two_groups = {**saved["optimizer"], "param_groups": saved["optimizer"]["param_groups"] * 2}
        with pytest.raises(ConfigError, match="one parameter group, this one has 2"):
            opt.load_state_dict(two_groups)
        bad_lr = copy.deepcopy(saved["optimizer"])
        bad_lr["param_groups"][0]["lr"] = float("inf")
        with pytest.raises(ConfigError, match="finite number >= 0"):
            opt.load_state_dict(bad_lr)
        assert opt.param_groups[0]["lr"] == lr_before  # nothing of a refused state_dict was taken


@pytest.mark.timeout(120)
def test_the_cli_workers_async_schedule_follows_the_jobs_progress_not_the_slow_chiefs(make_servers, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`psgrad worker --lr-schedule cosine` in async mode with the chief (rank 0) a 6x straggler:
    the chief positions the schedule at the job's progress (updates applied / workers) after each
    step, every lr rank 1's pushes got is one the chief pushed (or the job's initial lr), and the
    job's lr moves ahead of the chief's own clock."""
    from psgrad.config import JobSpec, WorkerConfig
    from psgrad.core.schedule import lr_factor
    from psgrad.metrics.jsonl import MetricsSink, read_jsonl
    from psgrad.cli.train import train

    running = make_servers(2)
    steps, lr = 12, 0.2
    spec = JobSpec(mode="async", num_workers=2, num_shards=2, lr=lr)
    factor = lr_factor("cosine", 0, steps)

    def worker(rank: int) -> None:
        config = WorkerConfig(servers=tuple(s.address for s in running), rank=rank, steps=steps, batch_size=16,
                              device="cpu", lr_schedule="cosine", step_time_ms=20, slowdown=6.0 if rank == 0 else 1.0,
                              eval_every=steps, client=CLIENT)
        with MetricsSink(tmp_path / f"{rank}.jsonl", rank) as sink:
            train(config, spec, get_task("digits"), sink, log=lambda line: None)

    run_in_threads(2, worker)
    records = {r: [x for x in read_jsonl(tmp_path / f"{r}.jsonl") if "loss" in x] for r in (0, 1)}
    chief = records[0]
    assert len(chief) == steps and chief[0]["lr"] == lr
    for before, after in zip(chief, chief[1:]):  # each step's lr: the schedule at the job's progress
        assert after["lr"] == pytest.approx(lr * factor(min(before["version"]) // 2))
    assert {x["lr"] for x in records[1]} <= {x["lr"] for x in chief} | {lr}
    ahead = [x for k, x in enumerate(chief) if min(x["version"]) // 2 > k]
    assert ahead, "rank 1 ran ahead of the slow chief, and the job's schedule with it"
