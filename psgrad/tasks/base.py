"""The Task interface (model, data, loss, evaluation) and the registry that names tasks."""
from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from psgrad.errors import TaskError


@dataclass
class Task:
    """Everything a worker needs to train and evaluate one model.

    train_x/train_y and test_x/test_y are CPU tensors; the split is fixed, so every worker and
    every run sees the same test set.
    """

    name: str
    build_model: Callable[[], nn.Module]
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = nn.functional.cross_entropy

    def __post_init__(self) -> None:
        if not callable(self.build_model):
            raise TaskError(f"task {self.name!r}: build_model must be a callable returning an nn.Module")
        for split, x, y in (("train", self.train_x, self.train_y), ("test", self.test_x, self.test_y)):
            if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
                raise TaskError(f"task {self.name!r}: {split}_x and {split}_y must be torch tensors")
            if len(x) != len(y) or len(x) == 0:
                raise TaskError(
                    f"task {self.name!r}: {split}_x has {len(x)} examples and {split}_y {len(y)}; "
                    "they must be equal and non-zero"
                )

    def worker_slice(self, rank: int, num_workers: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This worker's disjoint part of the training data (every num_workers-th example)."""
        return self.train_x[rank::num_workers], self.train_y[rank::num_workers]

    @torch.no_grad()
    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """Mean loss and accuracy on the held-out test set."""
        was_training = model.training
        model.eval()
        logits = model(self.test_x.to(device))
        y = self.test_y.to(device)
        loss = float(self.loss_fn(logits, y))
        acc = float((logits.argmax(dim=1) == y).float().mean())
        model.train(was_training)
        return {"test_loss": loss, "test_accuracy": acc}


class BatchSchedule:
    """Shuffled minibatches as a function of the clock: batch `clock` of a worker is the same
    whenever it is asked for, so a worker that rewinds (a sync roll-back, a resumed job) computes
    exactly the gradients it computed the first time. Each epoch (ceil(len / batch_size) batches,
    the last one shorter) is a permutation seeded by (seed, epoch)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int) -> None:
        if len(x) == 0:
            raise TaskError("this worker's slice of the training data is empty: use fewer workers")
        self.x, self.y, self.batch_size, self.seed = x, y, batch_size, seed
        self.per_epoch = -(-len(x) // batch_size)
        self._epoch, self._order = -1, torch.empty(0, dtype=torch.long)

    def seed_at(self, clock: int) -> int:
        """A seed for the step at `clock` (stochastic layers such as dropout)."""
        return int(np.random.SeedSequence([self.seed % 2**32, 1, clock]).generate_state(1)[0])

    def at(self, clock: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The minibatch of iteration `clock` (0-based)."""
        epoch, i = divmod(clock, self.per_epoch)
        if epoch != self._epoch:
            state = np.random.SeedSequence([self.seed % 2**32, 0, epoch]).generate_state(1)[0]
            self._epoch, self._order = epoch, torch.randperm(len(self.x), generator=torch.Generator().manual_seed(int(state)))
        idx = self._order[i * self.batch_size : (i + 1) * self.batch_size]
        return self.x[idx], self.y[idx]


def batches(
    x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless shuffled minibatches from clock 0 on: BatchSchedule(...).at(0), at(1), ..."""
    schedule = BatchSchedule(x, y, batch_size, seed)
    clock = 0
    while True:
        yield schedule.at(clock)
        clock += 1


TASKS: dict[str, Callable[[int], Task]] = {}


def register_task(name: str) -> Callable[[Callable[[int], Task]], Callable[[int], Task]]:
    """Decorator: register a factory seed -> Task under name."""

    def deco(factory: Callable[[int], Task]) -> Callable[[int], Task]:
        TASKS[name] = factory
        return factory

    return deco


def resolve_task(name: str) -> Callable[..., Task]:
    """The factory behind a task name: a registered name, or an import string MODULE:FUNCTION.

    An import string is resolved like `python -m` would (the current directory is searched first),
    without calling the function; get_task calls it.

    Raises:
        TaskError: no task has that name, the module cannot be imported, or the attribute is missing.
    """
    if ":" not in name:
        try:
            return TASKS[name]
        except KeyError:
            raise TaskError(
                f"unknown task {name!r}; valid tasks: {', '.join(sorted(TASKS))}, "
                "or your own as package.module:function"
            ) from None
    module_name, _, attr = name.partition(":")
    if not module_name or not attr or not all(p.isidentifier() for p in module_name.split(".") + attr.split(".")):
        raise TaskError(f"malformed task {name!r}: expected a built-in name or package.module:function")
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise TaskError(
            f"task {name!r}: cannot import module {module_name!r} ({exc}); is it installed or on "
            "PYTHONPATH? (the current directory is searched)"
        ) from None
    except Exception as exc:
        raise TaskError(f"task {name!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise TaskError(f"task {name!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise TaskError(f"task {name!r}: {attr!r} is a {type(obj).__name__}, not a function returning a psgrad.Task")
    factory: Callable[..., Task] = obj
    return factory


def _takes_seed(factory: Callable[..., Task]) -> bool:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: assume the documented form
        return True
    return any(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params
    )


def get_task(name: str, seed: int = 0) -> Task:
    """Build the task `name` names: a built-in, or MODULE:FUNCTION (called with the seed if it
    takes an argument, else with none) that must return a psgrad.Task.

    Raises:
        TaskError: unknown name, import failure, the function raised, or it returned something else.
    """
    factory = resolve_task(name)
    try:
        task = factory(seed) if _takes_seed(factory) else factory()
    except TaskError:
        raise
    except Exception as exc:
        raise TaskError(f"task {name!r}: building it raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(task, Task):
        raise TaskError(
            f"task {name!r} returned a {type(task).__name__}, expected a psgrad.Task "
            "(name, build_model, train_x, train_y, test_x, test_y[, loss_fn]); see the README's 'Custom tasks'"
        )
    return task
