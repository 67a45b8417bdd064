"""The Task interface (model, data, loss, evaluation) and the registry that names tasks."""
from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from psgrad.errors import TaskError
from psgrad.tasks.recipes import DEFAULT, RECIPES, Recipe


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
        for lo in range(0, len(x), self.eval_batch_size):
            xb, yb = x[lo : lo + self.eval_batch_size].to(device), y[lo : lo + self.eval_batch_size].to(device)
            logits = model(xb)
            loss_sum += float(self.loss_fn(logits, yb)) * len(xb)
            correct += float((logits.argmax(dim=1) == yb).float().sum())
        model.train(was_training)
        return {"test_loss": loss_sum / len(x), "test_accuracy": correct / len(x)}


TASKS: dict[str, Callable[..., Task]] = {}
# name -> a quick check that the task finds its data (called with --data-dir), raising TaskError
# where it would not: what `psgrad launch` and `compare` check before anything starts.
DATA_CHECKS: dict[str, Callable[[str | None], object]] = {}


def register_task(
    name: str, recipe: Recipe | None = None, check: Callable[[str | None], object] | None = None,
) -> Callable[[Callable[..., Task]], Callable[..., Task]]:
    """Decorator: register a factory seed -> Task (or (seed, data_dir) -> Task, for a task that
    reads files) under name, with its metric and recommended settings (default: DEFAULT's), and
    `check(data_dir)`, which raises TaskError (saying where it looked) when the data is missing."""

    def deco(factory: Callable[..., Task]) -> Callable[..., Task]:
        TASKS[name] = factory
        RECIPES[name] = recipe or DEFAULT
        if check is not None:
            DATA_CHECKS[name] = check
        return factory

    return deco


def check_task(name: str, data_dir: str | None = None) -> Callable[..., Task]:
    """What a launcher checks before it starts any process: the task resolves (see resolve_task),
    reads --data-dir if one is given, and (a built-in that reads files or a package) finds its
    data; without building it. Returns its factory.

    Raises:
        TaskError: naming the problem, e.g. where fashion-mnist looked for its files.
    """
    factory = resolve_task(name)
    if data_dir is not None and not _takes_data_dir(factory):
        raise TaskError(f"task {name!r} reads no data directory: leave out --data-dir")
    check = DATA_CHECKS.get(name)
    if check is not None:
        check(data_dir)
    return factory


def recipe_for(name: str) -> Recipe:
    """The recipe of task `name` (DEFAULT for a module:function task)."""
    return RECIPES.get(name, DEFAULT)


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


def _takes_data_dir(factory: Callable[..., Task]) -> bool:
    try:
        return "data_dir" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


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
    if _takes_data_dir(factory):
        kwargs["data_dir"] = data_dir
    elif data_dir is not None:
        raise TaskError(f"task {name!r} reads no data directory: leave out --data-dir")
    try:
        task = factory(seed, **kwargs) if _takes_seed(factory) else factory(**kwargs)
    except TaskError:
        raise
    except Exception as exc:
        raise TaskError(f"task {name!r}: building it raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(task, Task):
        raise TaskError(
            f"task {name!r} returned a {type(task).__name__}, expected a psgrad.Task "
            "(name, build_model, train_x, train_y, test_x, test_y[, loss_fn]); see docs/guide/tasks.md, 'Custom tasks'"
        )
    return task
