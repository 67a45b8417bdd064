"""The CLI worker's training loop (`psgrad worker`): the same Python API a user's own loop uses
(psgrad.api), plus the LR schedule, reporting, evaluation, emulated step times and stragglers
(worker/loop.py). It sits above the API: the worker package below it imports no psgrad.api."""
from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from psgrad.api import PSOptimizer, Session
from psgrad.client.export import write_state_dict
from psgrad.config import JobSpec, WorkerConfig
from psgrad.core.modes import mode_of
from psgrad.core.schedule import lr_factor
from psgrad.errors import CompressionWarning, ConfigError
from psgrad.metrics.jsonl import MetricsSink
from psgrad.nn.embedding import sparse_modules
from psgrad.tasks.base import Task
from psgrad.tasks.data import BatchSchedule
from psgrad.worker.flat import resolve_device
from psgrad.worker.loop import DelayInjector, TrainingLog


def lr_scheduler(
    opt: PSOptimizer, factor: Callable[[int], float], clock: int
) -> torch.optim.lr_scheduler.LambdaLR | None:
    """A torch LambdaLR that sets the optimizer's lr to the job's times factor(step), positioned
    at `clock` (a worker joining a running job, or rewinding, is where its clock is). None for a
    worker whose pushes follow the chief's schedule (async/ssp, rank > 0): it needs none. The
    async/ssp chief's is positioned after each step at the job's progress, updates applied /
    workers (the mean worker clock), so that a slow chief does not hold the job's schedule back."""
    if opt.follows_job_lr:
        return None
    for group in opt.param_groups:
        group.setdefault("initial_lr", group["lr"])
    return torch.optim.lr_scheduler.LambdaLR(opt, factor, last_epoch=clock - 1)


def table_groups(model: torch.nn.Module, config: WorkerConfig, task: str) -> list[dict[str, Any]] | None:
    """The param group of the model's psgrad embedding tables that --table-optimizer and --table-lr
    make (None: neither given, the tables take the job's optimizer and lr).

    Raises:
        ConfigError: either given for a task whose model has no psgrad embedding table.
    """
    group = config.table_groups()
    if group is None:
        return None
    tables = [module for _, module in sparse_modules(model)]
    if not tables:
        raise ConfigError(f"--table-optimizer and --table-lr set the rows of psgrad embedding tables, and task {task!r} "
                          "has none (its model is dense parameters only): leave them out")
    return [{"params": tables, **group}]


def train(
    config: WorkerConfig,
    spec: JobSpec,
    task: Task,
    sink: MetricsSink,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run one worker: join the servers, train until its clock reaches `config.steps` (a fresh job
    starts at clock 0; a resumed one, or a worker joining a running sync/ssp job, further on),
    evaluate, leave. Batch `clock` is the same whenever it is computed, so a sync job that rolls
    back to a checkpoint recomputes exactly the gradients it lost.

    Returns the final record (test_loss, test_accuracy, steps, elapsed_s).

    Raises:
        PsgradError: a server is unreachable, refuses the job, or rejects a push.
    """
    device = resolve_device(config.device, config.local_rank)
    torch.manual_seed(config.seed)
    model = task.build_model().to(device)
    rank = config.rank
    data = BatchSchedule(task.train_dataset(), config.batch_size, config.seed, rank, spec.num_workers)
    who = f"worker {rank}/{spec.num_workers}"
    delays = DelayInjector(config, spec.num_workers)
    cuda = device.type == "cuda"
    factor = lr_factor(config.lr_schedule, config.warmup_steps, config.steps)
    job_mode = mode_of(spec)

    with Session(config.servers, spec, rank, config.client) as session:
        with warnings.catch_warnings():  # (the start line below says which pushes stay plain)
            warnings.simplefilter("ignore", CompressionWarning)
            opt = session.optimizer(model, overlap=config.overlap, row_cache=config.row_cache_rows,
                                    row_cache_staleness=config.row_cache_staleness,
                                    param_groups=table_groups(model, config, task.name))
        schedule = lr_scheduler(opt, factor, opt.start_clock)
        bound = f"auto, at most {spec.staleness_max}" if spec.staleness_max else spec.staleness
        mode = spec.mode + (f"(staleness {bound})" if job_mode.bounds_staleness else "")
        mode += f"(backup workers {spec.backup_workers})" if spec.backup_workers else ""
        mode += f", tables {spec.tables_mode}" if spec.tables_mode else ""
        buffers = f" + {opt.flat.buffers.numel:,} in buffers" if opt.flat.buffers is not None else ""
        log(
            f"{who}: joined {spec.num_shards} shard(s) at clock {opt.start_clock}, {opt.flat.numel:,} parameters"
            f"{buffers}, mode {mode}{', overlap' if config.overlap else ''}, task {task.name}, "
            f"{len(data.sampler)} training examples per epoch, lr schedule {config.lr_schedule} "
            f"(warmup {config.warmup_steps}), device {device}, payloads {','.join(opt.client.transports())}"
            f"{opt.client.compression_note()}"
        )
        report = TrainingLog(config, task, model, device, sink, who, log)
        report.start(opt.start_clock, spec.mode)
        start = time.perf_counter()
        while opt.clock < config.steps:
            clock = opt.clock
            t0 = time.perf_counter()
            x, y = data.at(clock)
            torch.manual_seed(data.seed_at(clock))  # dropout and the like: the same on a recompute
            opt.zero_grad()
            loss = task.loss_fn(model(x.to(device, non_blocking=True)), y.to(device, non_blocking=True))
            loss.backward()
            if cuda:  # the compute time is the device's, not the launch's
                torch.cuda.current_stream(device).synchronize()
            compute_s = time.perf_counter() - t0
            delay_s = delays.apply(compute_s, clock)
            stats = opt.step()
            report.news(clock + 1, stats.evicted, stats.restores, spec.num_workers)
            if stats.rejoined_at is not None:
                sink.write(clock + 1, event="rejoin", clock=clock, to_clock=stats.rejoined_at)
                log(f"{who}: the shards had evicted this worker (lease ran out): joined again at clock {stats.rejoined_at}")
                schedule = lr_scheduler(opt, factor, opt.clock)
                continue
            if stats.rolled_back_to is not None:
                sink.write(clock + 1, event="rollback", clock=clock, to_clock=stats.rolled_back_to)
                log(f"{who}: a restored shard was behind: the job rolled back to iteration {stats.rolled_back_to}")
                schedule = lr_scheduler(opt, factor, opt.clock)
                continue
            if schedule is not None:
                if not job_mode.synchronous and stats.versions:  # the async/ssp chief: at the job's progress
                    schedule.last_epoch = min(stats.versions) // spec.num_workers - 1
                schedule.step()
            t1 = time.perf_counter()
            record: dict[str, Any] = {
                "clock": stats.clock,
                "loss": loss.item(),
                "lr": stats.lr,
                "step_s": t1 - t0,
                "compute_s": compute_s,
                "delay_s": delay_s,
                "d2h_s": stats.d2h_s,
                "h2d_s": stats.h2d_s,
                "wait_s": stats.wait_s,
                "version": stats.versions,
            }
            for key in ("exchange_s", "staleness", "accepted", "staleness_bound"):
                if getattr(stats, key) is not None:
                    record[key] = getattr(stats, key)
            drift = opt.client.pull_drift()
            if drift is not None:  # --compress-pull: how far this worker's copy is from the weights
                record["pull_drift"] = drift
            if opt.row_cache is not None:  # rows served from the worker's cache, since the start
                record["row_cache_hit_rate"] = opt.row_cache.stats.hit_rate
            report.step(clock + 1, record)
        elapsed = time.perf_counter() - start
        # In sync mode the last step's pull already waited for the final update. Otherwise leave
        # first, so nobody waits for this worker while it evaluates, then read the latest weights.
        session.leave()
        if not job_mode.synchronous:
            opt.refresh()
        final = report.final(elapsed)
        if config.save_model is not None:
            log(f"{who}: saved the final model to {write_state_dict(model.state_dict(), config.save_model)}")
        return final
