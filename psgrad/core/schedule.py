"""Learning-rate schedules by name, as the factor of the job's lr at each step (for torch's LambdaLR)."""
from __future__ import annotations

import math
from collections.abc import Callable

from psgrad.errors import ConfigError

LR_SCHEDULES = ("constant", "cosine", "linear")  # after --warmup-steps of linear warmup


def lr_factor(kind: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """step -> factor: a linear warmup from 1/warmup_steps to 1 over the first warmup_steps steps,
    then "constant" 1, "cosine" from 1 down to 0 at total_steps, or "linear" likewise.

    Raises:
        ConfigError: an unknown kind, or negative step counts.
    """
    if kind not in LR_SCHEDULES:
        raise ConfigError(f"lr schedule must be one of {', '.join(LR_SCHEDULES)}, got {kind!r}")
    if warmup_steps < 0 or total_steps < 0:
        raise ConfigError(f"warmup_steps and total_steps must be >= 0, got {warmup_steps} and {total_steps}")
    decay = max(1, total_steps - warmup_steps)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        done = min(1.0, (step - warmup_steps) / decay)
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * done))
        if kind == "linear":
            return 1.0 - done
        return 1.0

    return factor
