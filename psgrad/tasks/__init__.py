"""Built-in training tasks (model + data + loss + evaluation + recipe), looked up by name in a registry.

The names, recipes and data checks import no torch (registry.py); Task, get_task and the data
helpers import it when first used.
"""
from __future__ import annotations

from typing import Any

from psgrad.tasks.recipes import Recipe
from psgrad.tasks import registry
from psgrad.tasks.registry import TASKS, known_task, recipe_for, register_task, resolve_task, task_names

__all__ = ["TASKS", "BatchSchedule", "Recipe", "ShardedSampler", "Task", "check_task", "get_task", "known_task",
           "recipe_for", "register_task", "resolve_task", "task_names"]

_LAZY = {"Task": "psgrad.tasks.base", "get_task": "psgrad.tasks.base", "BatchSchedule": "psgrad.tasks.data",
         "ShardedSampler": "psgrad.tasks.data"}


def __getattr__(name: str) -> Any:
    """Task, get_task, BatchSchedule and ShardedSampler, imported (with torch) on first use."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'psgrad.tasks' has no attribute {name!r}")


def check_task(name: str, data_dir: str | None = None) -> None:
    """What a launcher checks before it starts any process (see registry.check_task); a user's
    task (an import string) is also built, once (with seed 0), so that a function that raises,
    returns something other than a psgrad.Task or data whose lengths disagree stops the launcher,
    not its workers (torch is imported then: the user's module imports it anyway, most likely).

    Raises:
        TaskError: naming the problem.
    """
    registry.check_task(name, data_dir)
    if ":" in name:
        from psgrad.tasks.base import get_task

        get_task(name, 0, data_dir)
