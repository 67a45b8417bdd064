"""What a training loop reports (TrainingLog: metrics, evaluations, progress lines) and the emulated
step times and stragglers (DelayInjector); `psgrad worker`'s loop (cli/train.py) and `psgrad
allreduce`'s use them."""
from __future__ import annotations

import random
import resource
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from psgrad.config import WorkerConfig
from psgrad.core.push_outcome import Eviction, Restore
from psgrad.metrics.jsonl import MetricsSink
from psgrad.tasks.base import Task


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
        self.restores: list[Restore] = []  # restarts of shards that lost updates, as this worker saw them
        self.start_clock = 0  # the clock this run started from (a resumed job's worker: its checkpointed one)

    def start(self, clock: int, mode: str) -> None:
        """The run's first record: where the worker starts and how it is configured; a worker that
        starts at --steps or past it says that nothing is left to train."""
        self.start_clock = clock
        if clock >= self.steps:
            self._log(f"{self._who}: joined at clock {clock}, and --steps is {self.steps}: the job had already "
                      "finished, nothing is left to train (give a larger --steps to train on)")
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
            if "test_neighbours" in record:  # (skipgram: a held-out loss and a neighbour check, no accuracy)
                acc += f" test_loss {record['test_loss']:.4f} test_neighbours {record['test_neighbours']:.3f}"
            mean_loss = self._window_loss / self._window_n
            self._log(f"{self._who}: step {done}/{self.steps} loss {mean_loss:.4f}{acc} ({rate:.1f} steps/s)")
            self._window_start, self._window_loss, self._window_n = now, 0.0, 0

    def news(self, done: int, evicted: Sequence[Eviction], restores: Sequence[Restore], num_workers: int) -> None:
        """What the shards told this worker at step `done` (each once): other workers they evicted
        (a line, and an "evicted" record), and restarts from a checkpoint that lost updates (a
        line, a "restore" record, and the count in the final record)."""
        for e in evicted:
            self._sink.write(done, event="evicted", rank=e.rank, clock=e.clock, lease_s=e.lease_s, live=e.live)
            self._log(f"{self._who}: {e.describe(num_workers)}")
        for r in restores:
            self.restores.append(r)
            self._sink.write(done, event="restore", shard=r.shard, from_version=r.from_version,
                             to_version=r.to_version, updates_lost=None if r.joined_after else r.lost,
                             **({"joined_after": True} if r.joined_after else {}))
            self._log(f"{self._who}: {r.describe()}")

    def final(self, elapsed_s: float) -> dict[str, Any]:
        """Evaluate the model as it is now and write the final record (with the updates that
        restarts lost, if any did)."""
        final = self._task.evaluate(self._model, self._device)
        result = {"event": "final", "steps": self.steps, "elapsed_s": elapsed_s, **final, "max_rss_mb": max_rss_mb()}
        if self.restores:  # (updates_lost: what this worker could count; not a restart from before it joined)
            counted = [r for r in self.restores if not r.joined_after]
            if counted:
                result["updates_lost"] = sum(r.lost for r in counted)
            result["restores"] = [{"shard": r.shard, "from_version": r.from_version, "to_version": r.to_version,
                                   **({"joined_after": True} if r.joined_after else {})} for r in self.restores]
        self._sink.write(self.steps, **result)
        bpb = f" test_bpb {final['test_bpb']:.4f}" if "test_bpb" in final else ""
        if "test_auc" in final:
            bpb += f" test_auc {final['test_auc']:.4f}" + (f" (bayes {final['bayes_auc']:.4f})" if "bayes_auc" in final else "")
        if "test_neighbours" in final:
            bpb += (f" test_neighbours {final['test_neighbours']:.3f} (corpus {final['corpus_tokens']:,.0f} tokens, "
                    f"vocabulary {final['vocabulary']:,.0f})")
        acc = f" test_accuracy {final['test_accuracy']:.4f}" if "test_accuracy" in final else ""
        if self.start_clock >= self.steps:
            trained = f" at clock {self.start_clock}, nothing trained (the job had already finished)"
        elif self.start_clock:
            trained = f" after {self.steps} steps ({self.steps - self.start_clock} in this run) in {elapsed_s:.1f} s"
        else:
            trained = f" after {self.steps} steps in {elapsed_s:.1f} s"
        self._log(f"{self._who}: final test_loss {final['test_loss']:.4f}{acc}{bpb}{trained}")
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
