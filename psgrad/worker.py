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

    def gather_grads(self) -> torch.Tensor:
        """The flat gradient on the host, ready to push."""
        for p, gview in self._views:
            if p.grad is not gview:  # autograd replaced the view: copy instead
                gview.copy_(p.grad if p.grad is not None else torch.zeros_like(gview))
                p.grad = gview
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
    log_every = _every(config.log_every, config.steps, 10)
    eval_every = _every(config.eval_every, config.steps, 10)
    who = f"worker {rank}/{spec.num_workers}"
    delays = DelayInjector(config.slowdown, config.jitter_ms, seed=config.seed * 1000 + rank + 1)

    with ParameterClient(config.servers, spec, params, plan, rank, config.client) as client:
        first_clock = client.join(initial_weights=(lambda: flat_model.flat.detach().cpu()) if rank == 0 else None)
        mode = spec.mode + (f"(staleness {spec.staleness})" if spec.mode == "ssp" else "")
        log(
            f"{who}: joined {spec.num_shards} shard(s) at clock {first_clock}, {plan.total:,} parameters, "
            f"mode {mode}, task {task.name}, {len(x_all)} training examples, device {device}"
        )
        sink.write(
            0, event="start", clock=first_clock, batch_size=config.batch_size, mode=spec.mode,
            slowdown=config.slowdown, jitter_ms=config.jitter_ms,
        )
        start = time.perf_counter()
        window_start, window_loss, window_n = start, 0.0, 0
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
            loss_value = loss.item()
            window_loss += loss_value
            window_n += 1
            record: dict[str, Any] = {
                "clock": clock,
                "loss": loss_value,
                "step_s": t3 - t0,
                "pull_s": t1 - t0,
                "compute_s": compute_s,
                "delay_s": delay_s,
                "push_s": t3 - t2,
                "staleness": max(r.staleness for r in replies),
                "accepted": all(r.applied or r.deferred for r in replies),
                "version": client.base_versions,
            }
            done = step + 1
            if done % eval_every == 0 or done == config.steps:
                record.update(task.evaluate(model, device))
            sink.write(done, **record)
            if done % log_every == 0 or done == config.steps:
                now = time.perf_counter()
                rate = window_n / max(now - window_start, 1e-9)
                acc = f" test_acc {record['test_accuracy']:.3f}" if "test_accuracy" in record else ""
                log(f"{who}: step {done}/{config.steps} loss {window_loss / window_n:.4f}{acc} ({rate:.1f} steps/s)")
                window_start, window_loss, window_n = now, 0.0, 0
        elapsed = time.perf_counter() - start
        if spec.mode == "sync":  # evaluate the final model: wait for the last iteration's update
            client.pull(flat_model.host_flat, first_clock + config.steps)
            client.leave()
        else:  # leave first, so nobody waits for this worker while it evaluates
            client.leave()
            client.pull(flat_model.host_flat, first_clock + config.steps, observe=True)
        flat_model.weights_pulled()
        final = task.evaluate(model, device)
    result = {"event": "final", "steps": config.steps, "elapsed_s": elapsed, **final}
    sink.write(config.steps, **result)
    log(
        f"{who}: final test_loss {final['test_loss']:.4f} test_accuracy {final['test_accuracy']:.4f} "
        f"after {config.steps} steps in {elapsed:.1f} s"
    )
    return result
