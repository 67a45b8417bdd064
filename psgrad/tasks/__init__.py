"""Built-in training tasks (model + data + loss + evaluation), looked up by name in a registry."""
from psgrad.tasks import digits as _digits  # noqa: F401  (registers "digits")
from psgrad.tasks import mnist1d as _mnist1d  # noqa: F401  (registers "mnist1d")
from psgrad.tasks.base import TASKS, Task, get_task, register_task, resolve_task

__all__ = ["TASKS", "Task", "get_task", "register_task", "resolve_task"]
