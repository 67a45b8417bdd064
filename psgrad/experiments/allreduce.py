"""The no-parameter-server baseline: synchronous data-parallel SGD whose workers average gradients by all-reduce."""
from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
# Imported before any process group exists, on purpose: torch.distributed.nn.functional (which
# torch.optim pulls in through torch._dynamo on the first optimizer) binds group.WORLD as default
# arguments at import time. Imported after init_process_group, it would hold the gloo group past
# destroy_process_group, and the group's threads would then be torn down during interpreter
# exit, which can abort the process (SIGABRT, "terminate called without an active exception").
import torch.distributed.nn  # noqa: F401

from psgrad.client.export import write_state_dict
from psgrad.config import JobSpec, WorkerConfig
from psgrad.errors import ConfigError, PsgradError
from psgrad.metrics.jsonl import MetricsSink
from psgrad.core.optimizer_settings import DECLS
from psgrad.core.schedule import lr_factor
from psgrad.tasks.base import Task
from psgrad.tasks.data import BatchSchedule
from psgrad.worker.flat import FlatModel, resolve_device
from psgrad.worker.loop import DelayInjector, TrainingLog


@contextmanager
def _collective(what: str, who: str) -> Iterator[None]:
    """Turn torch.distributed failures (a peer missing, dead or too slow) into a PsgradError."""
    try:
        yield
    except RuntimeError as exc:  # DistError and its subclasses derive from RuntimeError
        raise PsgradError(f"{who}: {what} failed: {exc}") from exc


def _sync(device: torch.device) -> None:
    """Wait for queued device work, so that wall-clock timings mean something on CUDA."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rank_device(name: str, rank: int) -> torch.device:
    """The device of this rank: a bare 'cuda' (or 'auto' on a GPU host) becomes cuda:(rank % GPUs)."""
    device = resolve_device(name, local_rank=rank)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", rank % torch.cuda.device_count())
    return device


def train_allreduce(
    config: WorkerConfig,
    spec: JobSpec,
    task: Task,
    sink: MetricsSink,
    store_path: str,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run one rank of all-reduce data-parallel SGD for `config.steps` steps, then evaluate.

    Every step each of the `spec.num_workers` ranks computes a gradient on its own batch, the
    flat gradients are summed with one all_reduce and divided by the world size, and every rank
    applies the same torch.optim step (the job's optimizer and its settings: torch_optimizer). Model
    init, data slice, batch order, delay injection and the metrics schema are those of
    psgrad.cli.train.train; exchange_s (= allreduce_s) is the all-reduce time, step_s also
    covers the optimizer step, and evaluations see the weights after this step's update.
    Only spec.num_workers and the optimizer's settings are read from spec.

    `store_path` is the rendezvous FileStore, shared by all ranks; it must be new (or empty).
    Rendezvous and each collective wait at most config.client.init_timeout_s for the other ranks.

    Returns the final record (test_loss, test_accuracy, steps, elapsed_s).

    Raises:
        ConfigError: rank is not below num_workers.
        PsgradError: rendezvous timed out, or a peer died or stalled during a collective.
    """
    rank, world = config.rank, spec.num_workers
    if rank >= world:
        raise ConfigError(f"rank must be < num_workers ({world}), got {rank}")
    who = f"worker {rank}/{world}"
    device = _rank_device(config.device, rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with _collective(f"rendezvous through file store {store_path!r}", who):
        dist.init_process_group(
            backend,
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=config.client.init_timeout_s),
        )
    try:
        result = _train(config, spec, task, sink, device, backend, who, log)
        # every rank has finished its last collective before anyone tears its sockets down
        with _collective("final barrier", who):
            dist.barrier()
        return result
    finally:
        dist.destroy_process_group()
        # A reference cycle still holding the group would keep its threads past this point, to be
        # torn down during interpreter exit (which can abort the process): collect it now.
        gc.collect()


def torch_optimizer(spec: JobSpec, params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
    """The torch.optim optimizer with the job's name and settings: what the servers' optimizer of
    that name applies (their tests hold the two equal), applied here by every rank to the mean gradient."""
    decl = DECLS.get(spec.optimizer)
    if decl is None:
        raise ConfigError(f"the all-reduce baseline has no optimizer {spec.optimizer!r}")
    optimizer: torch.optim.Optimizer = getattr(torch.optim, decl.torch)(params, **decl.torch_kwargs(spec))
    return optimizer


def _train(
    config: WorkerConfig,
    spec: JobSpec,
    task: Task,
    sink: MetricsSink,
    device: torch.device,
    backend: str,
    who: str,
    log: Callable[[str], None],
) -> dict[str, Any]:
    rank, world = config.rank, spec.num_workers
    torch.manual_seed(config.seed)
    model = (task.dense_model or task.build_model)().to(device)
    flat_model = FlatModel(model, device)
    if flat_model.flat is None or flat_model.grad is None:
        raise ConfigError(
            f"the all-reduce baseline needs every parameter in one dtype, got {flat_model.dtypes}"
        )
    flat, grad = flat_model.flat, flat_model.grad
    with _collective("broadcast of rank 0's initial weights", who):
        dist.broadcast(flat, src=0)
    optimizer = torch_optimizer(spec, flat_model.params)
    data = BatchSchedule(task.train_dataset(), config.batch_size, config.seed, rank, world)
    delays = DelayInjector(config, world)
    factor = lr_factor(config.lr_schedule, config.warmup_steps, config.steps)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    log(
        f"{who}: all-reduce ({backend}) with {world} rank(s), {flat.numel():,} parameters, "
        f"task {task.name}, {len(data.sampler)} training examples per epoch, device {device}"
    )
    report = TrainingLog(config, task, model, device, sink, who, log)
    report.start(0, "allreduce")
    start = time.perf_counter()
    for step in range(config.steps):
        t0 = time.perf_counter()
        x, y = data.at(step)
        torch.manual_seed(data.seed_at(step))  # as the parameter-server worker does
        flat_model.zero_grad()
        loss = task.loss_fn(model(x.to(device)), y.to(device))
        loss.backward()
        flat_model.collect_grads()
        _sync(device)
        compute_s = time.perf_counter() - t0
        delay_s = delays.apply(compute_s, step)
        t2 = time.perf_counter()
        with _collective(f"all_reduce of step {step}", who):
            dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        _sync(device)
        t3 = time.perf_counter()
        grad.div_(world)
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        schedule.step()
        loss_value = loss.item()  # synchronizes with the device
        t4 = time.perf_counter()
        report.step(step + 1, {
            "clock": step,
            "loss": loss_value,
            "step_s": t4 - t0,
            "compute_s": compute_s,
            "delay_s": delay_s,
            "exchange_s": t3 - t2,
            "allreduce_s": t3 - t2,
            "lr": lr,
            "staleness": 0,
            "accepted": True,
            "version": [step],
        })
    final = report.final(time.perf_counter() - start)
    if config.save_model is not None:
        log(f"{who}: saved the final model to {write_state_dict(model.state_dict(), config.save_model)}")
    return final
