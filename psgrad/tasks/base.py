"""The Task interface (model, data, loss, evaluation), and building a task by name (the names: registry.py)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from psgrad.errors import TaskError
from psgrad.tasks.registry import register_task, resolve_task, takes_data_dir, takes_seed

__all__ = ["Task", "get_task", "register_task"]


@dataclass
class Task:
    """Everything a worker needs to train and evaluate one model.

    The training data is train_x/train_y (CPU tensors) or, for data that is not one tensor,
    train_set (any map-style torch Dataset of (x, y) examples); the test set is test_x/test_y.
    The split is fixed, so every worker and every run sees the same test set. quick_eval: how
    many test examples (the first ones) the evaluations during training use (None: all); the
    final evaluation uses them all.
    """

    name: str
    build_model: Callable[[], nn.Module]
    train_x: torch.Tensor | None = None
    train_y: torch.Tensor | None = None
    test_x: torch.Tensor | None = None
    test_y: torch.Tensor | None = None
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = nn.functional.cross_entropy
    train_set: Dataset[Any] | None = None
    quick_eval: int | None = None
    eval_batch_size: int = 1000
    #: evaluator(model, device, x, y) -> metrics, instead of the mean loss and argmax accuracy
    #: (a task whose metric is not a classification accuracy: ctr's AUC)
    evaluator: Callable[[nn.Module, torch.device, torch.Tensor, torch.Tensor], dict[str, float]] | None = None
    #: the same model with its psgrad embeddings as ordinary local tables (dense gradients): what the
    #: all-reduce baseline trains (None: build_model's)
    dense_model: Callable[[], nn.Module] | None = None

    def __post_init__(self) -> None:
        if not callable(self.build_model):
            raise TaskError(f"task {self.name!r}: build_model must be a callable returning an nn.Module")
        splits = [("test", self.test_x, self.test_y)]
        if self.train_set is None:
            splits.insert(0, ("train", self.train_x, self.train_y))
        elif not hasattr(self.train_set, "__len__") or len(self.train_set) == 0:
            raise TaskError(f"task {self.name!r}: train_set must be a non-empty map-style Dataset with a length")
        for split, x, y in splits:
            if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
                raise TaskError(f"task {self.name!r}: {split}_x and {split}_y must be torch tensors")
            if len(x) != len(y) or len(x) == 0:
                raise TaskError(
                    f"task {self.name!r}: {split}_x has {len(x)} examples and {split}_y {len(y)}; "
                    "they must be equal and non-zero"
                )

    def train_dataset(self) -> Dataset[Any]:
        """The training data as a Dataset (train_set, or train_x/train_y as a TensorDataset)."""
        if self.train_set is not None:
            return self.train_set
        assert self.train_x is not None and self.train_y is not None
        return TensorDataset(self.train_x, self.train_y)

    def worker_slice(self, rank: int, num_workers: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every num_workers-th training example from rank on (tensor tasks); workers now draw
        their batches through ShardedSampler instead (see BatchSchedule)."""
        assert self.train_x is not None and self.train_y is not None
        return self.train_x[rank::num_workers], self.train_y[rank::num_workers]

    @torch.no_grad()
    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """Mean loss and accuracy on the held-out test set."""
        assert self.test_x is not None and self.test_y is not None
        return self.evaluate_on(model, device, self.test_x, self.test_y)

    def evaluate_during_training(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """The evaluations between steps: on the first quick_eval test examples, else evaluate()."""
        if self.quick_eval is None:
            return self.evaluate(model, device)
        assert self.test_x is not None and self.test_y is not None
        return self.evaluate_on(model, device, self.test_x[: self.quick_eval], self.test_y[: self.quick_eval])

    @torch.no_grad()
    def evaluate_on(self, model: nn.Module, device: torch.device, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        """Mean loss and accuracy of the model (in eval mode) on x, y, in batches of eval_batch_size
        (or the task's evaluator's metrics)."""
        if self.evaluator is not None:
            return self.evaluator(model, device, x, y)
        was_training = model.training
        model.eval()
        loss_sum, correct = 0.0, 0.0
        with torch.no_grad():  # (an evaluation: no graph, and psgrad embeddings read their rows read-only)
            for lo in range(0, len(x), self.eval_batch_size):
                xb, yb = x[lo : lo + self.eval_batch_size].to(device), y[lo : lo + self.eval_batch_size].to(device)
                logits = model(xb)
                loss_sum += float(self.loss_fn(logits, yb)) * len(xb)
                correct += float((logits.argmax(dim=1) == yb).float().sum())
        model.train(was_training)
        return {"test_loss": loss_sum / len(x), "test_accuracy": correct / len(x)}


def get_task(name: str, seed: int = 0, data_dir: str | None = None) -> Task:
    """Build the task `name` names: a built-in, or MODULE:FUNCTION (called with the seed if it
    takes an argument, else with none; and with data_dir= if it has that parameter) that must
    return a psgrad.Task.

    Raises:
        TaskError: unknown name, import failure, the function raised, it returned something else,
            or data_dir is given to a task that reads no files.
    """
    factory = resolve_task(name)
    kwargs: dict[str, Any] = {}
    if takes_data_dir(factory):
        kwargs["data_dir"] = data_dir
    elif data_dir is not None:
        raise TaskError(f"task {name!r} reads no data directory: leave out --data-dir")
    try:
        task = factory(seed, **kwargs) if takes_seed(factory) else factory(**kwargs)
    except TaskError:
        raise
    except Exception as exc:
        said = " ".join(str(exc).split())  # one line
        raise TaskError(f"task {name!r}: building it raised {type(exc).__name__}: {said}") from exc
    if not isinstance(task, Task):
        raise TaskError(
            f"task {name!r} returned a {type(task).__name__}, expected a psgrad.Task "
            "(name, build_model, train_x, train_y, test_x, test_y[, loss_fn]); see docs/guide/tasks.md, 'Custom tasks'"
        )
    return task
