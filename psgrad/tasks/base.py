"""The Task interface (model, data, loss, evaluation) and the registry that names tasks."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

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


def batches(
    x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless shuffled minibatches (reshuffled every epoch, deterministic given seed)."""
    if len(x) == 0:
        raise TaskError("this worker's slice of the training data is empty: use fewer workers")
    gen = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(x), generator=gen)
        for i in range(0, len(x), batch_size):
            idx = order[i : i + batch_size]
            yield x[idx], y[idx]


TASKS: dict[str, Callable[[int], Task]] = {}


def register_task(name: str) -> Callable[[Callable[[int], Task]], Callable[[int], Task]]:
    """Decorator: register a factory seed -> Task under name."""

    def deco(factory: Callable[[int], Task]) -> Callable[[int], Task]:
        TASKS[name] = factory
        return factory

    return deco


def get_task(name: str, seed: int = 0) -> Task:
    """Build the task registered as name.

    Raises:
        TaskError: no task has that name (the message lists the valid ones).
    """
    try:
        factory = TASKS[name]
    except KeyError:
        raise TaskError(f"unknown task {name!r}; valid tasks: {', '.join(sorted(TASKS))}") from None
    return factory(seed)
