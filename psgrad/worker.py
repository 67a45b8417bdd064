"""The training-loop side: a flat view of the model, and the pull / compute / push loop of one worker."""
from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from psgrad.client import ParameterClient
from psgrad.config import JobSpec, WorkerConfig
from psgrad.errors import ConfigError
from psgrad.metrics import MetricsSink
from psgrad.sharding import param_specs, plan_shards
from psgrad.tasks.base import Task, batches


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda when available, else cpu; 'cuda[:N]' must exist."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"invalid device {name!r}; valid: auto, cpu, cuda, cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"device {name!r} requested but torch sees no CUDA device")
        if device.index is not None and device.index >= count:
            raise ConfigError(f"device {name!r} requested but only {count} CUDA device(s) exist")
    return device


class FlatModel:
    """Keeps a model's trainable parameters and gradients as views of two flat float32 buffers.

    Pulled weights are written straight into `flat`, and backward accumulates straight into
    `grad`, so a step copies nothing on the CPU. On CUDA, `host_flat` and `host_grad` are pinned
    host staging buffers, copied once per pull / push with non_blocking=True.
    """

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        for p in self.params:
            if p.dtype != torch.float32:
                raise ConfigError(f"parameters must be float32 for now, got {p.dtype}")
        total = sum(p.numel() for p in self.params)
        self.device = device
        self.flat = torch.empty(total, dtype=torch.float32, device=device)
        self.grad = torch.zeros(total, dtype=torch.float32, device=device)
        self._views: list[tuple[nn.Parameter, torch.Tensor]] = []
        offset = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                view = self.flat[offset : offset + n].view_as(p)
                view.copy_(p)
                p.data = view
                gview = self.grad[offset : offset + n].view_as(p)
                p.grad = gview
                self._views.append((p, gview))
                offset += n
        pinned = device.type == "cuda"
        if pinned:
            self.host_flat = torch.empty(total, dtype=torch.float32, pin_memory=True)
            self.host_grad = torch.empty(total, dtype=torch.float32, pin_memory=True)
        else:
            self.host_flat, self.host_grad = self.flat, self.grad

    def zero_grad(self) -> None:
        self.grad.zero_()
        for p, gview in self._views:  # re-attach if user code replaced .grad
            if p.grad is not gview:
                p.grad = gview

    def collect_grads(self) -> torch.Tensor:
        """The flat gradient on the model's device, with every parameter's gradient in it."""
        for p, gview in self._views:
            if p.grad is not gview:  # autograd replaced the view: copy instead
                gview.copy_(p.grad if p.grad is not None else torch.zeros_like(gview))
                p.grad = gview
        return self.grad

    def gather_grads(self) -> torch.Tensor:
        """The flat gradient on the host, ready to push."""
        self.collect_grads()
        if self.host_grad is not self.grad:
            self.host_grad.copy_(self.grad, non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
        return self.host_grad

    def weights_pulled(self) -> None:
        """Move freshly pulled host weights to the device (no-op on CPU)."""
        if self.host_flat is not self.flat:
            self.flat.copy_(self.host_flat, non_blocking=True)


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
        )
        self._window_start = time.perf_counter()

    def step(self, done: int, record: dict[str, Any]) -> None:
        """Record step `done` (1-based); record holds at least "loss"."""
        self._window_loss += record["loss"]
        self._window_n += 1
        if done % self.eval_every == 0 or done == self.steps:
            record.update(self._task.evaluate(self._model, self._device))
        self._sink.write(done, **record)
        if done % self.log_every == 0 or done == self.steps:
            now = time.perf_counter()
            rate = self._window_n / max(now - self._window_start, 1e-9)
            acc = f" test_acc {record['test_accuracy']:.3f}" if "test_accuracy" in record else ""
            mean_loss = self._window_loss / self._window_n
            self._log(f"{self._who}: step {done}/{self.steps} loss {mean_loss:.4f}{acc} ({rate:.1f} steps/s)")
            self._window_start, self._window_loss, self._window_n = now, 0.0, 0

    def final(self, elapsed_s: float) -> dict[str, Any]:
        """Evaluate the model as it is now and write the final record."""
        final = self._task.evaluate(self._model, self._device)
        result = {"event": "final", "steps": self.steps, "elapsed_s": elapsed_s, **final}
        self._sink.write(self.steps, **result)
        self._log(
            f"{self._who}: final test_loss {final['test_loss']:.4f} test_accuracy {final['test_accuracy']:.4f} "
            f"after {self.steps} steps in {elapsed_s:.1f} s"
        )
        return result


class DelayInjector:
    """Straggler and noise injection: after each step's compute, wait (slowdown - 1) x that
    step's measured compute time plus a uniform random jitter; deterministic given the seed."""

    def __init__(self, slowdown: float, jitter_ms: float, seed: int) -> None:
        self.slowdown = slowdown
        self.jitter_s = jitter_ms / 1000.0
        self._rng = random.Random(seed)
        self._timer = threading.Event()  # never set: wait() is an interruptible sleep

    def delay_s(self, compute_s: float) -> float:
        extra = (self.slowdown - 1.0) * compute_s
        if self.jitter_s:
            extra += self._rng.uniform(0.0, self.jitter_s)
        return extra

    def apply(self, compute_s: float) -> float:
        extra = self.delay_s(compute_s)
        if extra > 0:
            self._timer.wait(extra)
        return extra


def train(
    config: WorkerConfig,
    spec: JobSpec,
    task: Task,
    sink: MetricsSink,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run one worker: join the servers, train `config.steps` steps, evaluate, leave.

    Returns the final record (test_loss, test_accuracy, steps, elapsed_s).

    Raises:
        PsgradError: a server is unreachable, refuses the job, or rejects a push.
    """
    device = resolve_device(config.device)
    torch.manual_seed(config.seed)
    model = task.build_model().to(device)
    flat_model = FlatModel(model, device)
    params = param_specs(model)
    plan = plan_shards(params, spec.num_shards)
    rank = config.rank
    x_all, y_all = task.worker_slice(rank, spec.num_workers)
    data = batches(x_all, y_all, config.batch_size, seed=config.seed * 1000 + rank)
    who = f"worker {rank}/{spec.num_workers}"
    delays = DelayInjector(config.slowdown, config.jitter_ms, seed=config.seed * 1000 + rank + 1)

    with ParameterClient(config.servers, spec, params, plan, rank, config.client) as client:
        first_clock = client.join(initial_weights=(lambda: flat_model.flat.detach().cpu()) if rank == 0 else None)
        mode = spec.mode + (f"(staleness {spec.staleness})" if spec.mode == "ssp" else "")
        log(
            f"{who}: joined {spec.num_shards} shard(s) at clock {first_clock}, {plan.total:,} parameters, "
            f"mode {mode}, task {task.name}, {len(x_all)} training examples, device {device}"
        )
        report = TrainingLog(config, task, model, device, sink, who, log)
        report.start(first_clock, spec.mode)
        start = time.perf_counter()
        for step in range(config.steps):
            clock = first_clock + step
            t0 = time.perf_counter()
            client.pull(flat_model.host_flat, clock)
            flat_model.weights_pulled()
            t1 = time.perf_counter()
            x, y = next(data)
            flat_model.zero_grad()
            loss = task.loss_fn(model(x.to(device)), y.to(device))
            loss.backward()
            grad = flat_model.gather_grads()
            compute_s = time.perf_counter() - t1
            delay_s = delays.apply(compute_s)
            t2 = time.perf_counter()
            replies = client.push(grad, clock)
            t3 = time.perf_counter()
            report.step(step + 1, {
                "clock": clock,
                "loss": loss.item(),
                "step_s": t3 - t0,
                "pull_s": t1 - t0,
                "compute_s": compute_s,
                "delay_s": delay_s,
                "push_s": t3 - t2,
                "staleness": max(r.staleness for r in replies),
                "accepted": all(r.applied or r.deferred for r in replies),
                "version": client.base_versions,
            })
        elapsed = time.perf_counter() - start
        if spec.mode == "sync":  # evaluate the final model: wait for the last iteration's update
            client.pull(flat_model.host_flat, first_clock + config.steps)
            client.leave()
        else:  # leave first, so nobody waits for this worker while it evaluates
            client.leave()
            client.pull(flat_model.host_flat, first_clock + config.steps, observe=True)
        flat_model.weights_pulled()
        return report.final(elapsed)
