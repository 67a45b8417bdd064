"""Built-in training tasks (model + data + loss + evaluation + recipe), looked up by name in a registry."""
from psgrad.tasks import charlm as _charlm  # noqa: F401  (registers "charlm")
from psgrad.tasks import ctr as _ctr  # noqa: F401  (registers "ctr")
from psgrad.tasks import digits as _digits  # noqa: F401  (registers "digits")
from psgrad.tasks import images as _images  # noqa: F401  (registers "mnist", "fashion-mnist")
from psgrad.tasks import mnist1d as _mnist1d  # noqa: F401  (registers "mnist1d")
from psgrad.tasks.base import TASKS, Task, check_task, get_task, recipe_for, register_task, resolve_task
from psgrad.tasks.data import BatchSchedule, ShardedSampler
from psgrad.tasks.recipes import Recipe

__all__ = ["TASKS", "BatchSchedule", "Recipe", "ShardedSampler", "Task", "check_task", "get_task", "recipe_for",
           "register_task", "resolve_task"]
