"""The CLI worker's training loop (`psgrad worker`): the same Python API a user's own loop uses
(psgrad.api), plus the LR schedule, reporting, evaluation, emulated step times and stragglers."""
from __future__ import annotations

import random
import resource
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from psgrad.api import PSOptimizer, Session
from psgrad.client.export import write_state_dict
from psgrad.config import JobSpec, WorkerConfig
from psgrad.core.modes import bounds_staleness, is_synchronous
from psgrad.core.schedule import lr_factor
from psgrad.worker.flat import resolve_device
from psgrad.metrics.jsonl import MetricsSink
from psgrad.tasks.base import Task
from psgrad.tasks.data import BatchSchedule


def max_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # (kilobytes on Linux)


def _every(value: int, steps: int, times: int) -> int:
    return value if value > 0 else max(1, steps // times)


class TrainingLog:
    """What every training loop reports: one metrics record per step, an evaluation every
    eval_every steps, a progress line every log_every steps, and the final record."""

    def __init__(
        self, config: WorkerConfig, task: Task, model: nn.Module, device: torch.device,
        sink: MetricsSink, who: str, log: Callable[[str], None],
    ) -> None:
        self._config = config
        self.steps = config.steps
        self.eval_every = _every(config.eval_every, config.steps, 10)
        self.log_every = _every(config.log_every, config.steps, 10)
        self._task, self._model, self._device = task, model, device
        self._sink, self._who, self._log = sink, who, log
        self._window_start, self._window_loss, self._window_n = time.perf_counter(), 0.0, 0

    def start(self, clock: int, mode: str) -> None:
        """The run's first record: where the worker starts and how it is configured."""
        self._sink.write(
            0, event="start", clock=clock, batch_size=self._config.batch_size, mode=mode,
            slowdown=self._config.slowdown, jitter_ms=self._config.jitter_ms,
            straggler_model=self._config.straggler_model.describe(),
        )
        self._window_start = time.perf_counter()

    def step(self, done: int, record: dict[str, Any]) -> None:
        """Record step `done` (1-based); record holds at least "loss"."""
        self._window_loss += record["loss"]
        self._window_n += 1
        if done % self.eval_every == 0 or done == self.steps:
            record.update(self._task.evaluate_during_training(self._model, self._device))
        self._sink.write(done, **record)
        if done % self.log_every == 0 or done == self.steps:
            now = time.perf_counter()
            rate = self._window_n / max(now - self._window_start, 1e-9)
            acc = f" test_acc {record['test_accuracy']:.3f}" if "test_accuracy" in record else ""
            acc += f" test_bpb {record['test_bpb']:.3f}" if "test_bpb" in record else ""
            acc += f" test_auc {record['test_auc']:.4f}" if "test_auc" in record else ""
            mean_loss = self._window_loss / self._window_n
            self._log(f"{self._who}: step {done}/{self.steps} loss {mean_loss:.4f}{acc} ({rate:.1f} steps/s)")
            self._window_start, self._window_loss, self._window_n = now, 0.0, 0

    def final(self, elapsed_s: float) -> dict[str, Any]:
        """Evaluate the model as it is now and write the final record."""
        final = self._task.evaluate(self._model, self._device)
        result = {"event": "final", "steps": self.steps, "elapsed_s": elapsed_s, **final, "max_rss_mb": max_rss_mb()}
        self._sink.write(self.steps, **result)
        bpb = f" test_bpb {final['test_bpb']:.4f}" if "test_bpb" in final else ""
        if "test_auc" in final:
            bpb += f" test_auc {final['test_auc']:.4f}" + (f" (bayes {final['bayes_auc']:.4f})" if "bayes_auc" in final else "")
        self._log(
            f"{self._who}: final test_loss {final['test_loss']:.4f} test_accuracy {final['test_accuracy']:.4f}{bpb} "
            f"after {self.steps} steps in {elapsed_s:.1f} s"
        )
        return result


class DelayInjector:
    """Emulated step times, stragglers and noise: after each step's compute, wait so that the step
    takes step_time_ms x factor (an emulated accelerator: the compute, then the rest of the step),
    or, without step_time_ms, (factor - 1) x the measured compute time; plus a uniform random
    jitter. The factor is the worker's slowdown (on the slow node's steps only, when the model
    rotates it) times the model's random draw for the step. Deterministic given the seed."""

    def __init__(self, config: WorkerConfig, num_workers: int) -> None:
        self.slowdown = config.slowdown
        self.jitter_s = config.jitter_ms / 1000.0
        self.step_time_s = config.step_time_ms / 1000.0
        self.model = config.straggler_model
        self._seed, self._rank, self._world = config.seed, config.rank, num_workers
        self._rng = random.Random(config.seed * 1000 + config.rank + 1)
        self._timer = threading.Event()  # never set: wait() is an interruptible sleep

    def factor(self, step: int) -> float:
        """How many times its nominal time (step_time_ms, or its compute) step `step` takes."""
        fixed = self.model.slowdown_at(self.slowdown, step, self._rank, self._world)
        return fixed * self.model.multiplier(self._seed, self._rank, step)

    def delay_s(self, compute_s: float, step: int = 0) -> float:
        factor = self.factor(step)
        if self.step_time_s > 0:
            extra = max(0.0, self.step_time_s * factor - compute_s)
        else:
            extra = (factor - 1.0) * compute_s
        if self.jitter_s:
            extra += self._rng.uniform(0.0, self.jitter_s)
        return extra

    def apply(self, compute_s: float, step: int = 0) -> float:
        extra = self.delay_s(compute_s, step)
        if extra > 0:
            self._timer.wait(extra)
        return extra


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

    with Session(config.servers, spec, rank, config.client) as session:
        opt = session.optimizer(model, overlap=config.overlap, row_cache=config.row_cache_rows,
                                row_cache_staleness=config.row_cache_staleness)
        schedule = lr_scheduler(opt, factor, opt.start_clock)
        bound = f"auto, at most {spec.staleness_max}" if spec.staleness_max else spec.staleness
        mode = spec.mode + (f"(staleness {bound})" if bounds_staleness(spec.mode) else "")
        mode += f"(backup workers {spec.backup_workers})" if spec.backup_workers else ""
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
                if not is_synchronous(spec.mode) and stats.versions:  # the async/ssp chief: at the job's progress
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
            if opt.row_cache is not None:  # rows served from the worker's cache, since the start
                record["row_cache_hit_rate"] = opt.row_cache.stats.hit_rate
            report.step(clock + 1, record)
        elapsed = time.perf_counter() - start
        # In sync mode the last step's pull already waited for the final update. Otherwise leave
        # first, so nobody waits for this worker while it evaluates, then read the latest weights.
        session.leave()
        if not is_synchronous(spec.mode):
            opt.refresh()
        final = report.final(elapsed)
        if config.save_model is not None:
            log(f"{who}: saved the final model to {write_state_dict(model.state_dict(), config.save_model)}")
        return final
