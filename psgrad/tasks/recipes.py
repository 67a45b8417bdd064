"""What a task is judged by and trained with: its metric, a sensible target, and the settings it is
meant to run with (optimizer, lr, schedule, batch size, steps); the CLI's flags default to these."""
from __future__ import annotations

from dataclasses import dataclass

from psgrad.config import LR_SCHEDULES, METRICS, OPTIMIZER_NAMES
from psgrad.core.optimizer_settings import DEFAULT_WEIGHT_DECAY
from psgrad.errors import ConfigError


@dataclass(frozen=True)
class Recipe:
    """A task's metric and target, and its recommended training settings.

    steps is what `psgrad worker`/`launch` train by default, compare_steps what `psgrad compare`
    runs per worker (shorter: it runs every mode, twice).
    """

    metric: str = "test_accuracy"
    target: float = 0.9
    optimizer: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float | None = None  # None: torch's default for the optimizer (0; AdamW's 0.01)
    batch_size: int = 32
    steps: int = 1000
    compare_steps: int = 400
    lr_schedule: str = "constant"
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ConfigError(f"metric must be one of {', '.join(METRICS)}, got {self.metric!r}")
        if self.optimizer not in OPTIMIZER_NAMES or self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"unknown optimizer {self.optimizer!r} or schedule {self.lr_schedule!r}")
        if self.weight_decay is None:
            object.__setattr__(self, "weight_decay", DEFAULT_WEIGHT_DECAY[self.optimizer])
        if min(self.batch_size, self.steps, self.compare_steps) < 1 or self.warmup_steps < 0:
            raise ConfigError("batch_size, steps and compare_steps must be >= 1, warmup_steps >= 0")


# The built-in tasks' recipes are in registry.BUILT_IN; a task registered with register_task adds
# its own here; a task given as module:function gets DEFAULT.
DEFAULT = Recipe()
RECIPES: dict[str, Recipe] = {}
