"""Straggler models beyond a fixed factor: heavy-tailed random slow steps and a slow node that moves between ranks."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from psgrad.errors import ConfigError

DISTRIBUTIONS = ("none", "lognormal", "pareto")
# One draw never stretches a step more than this: a Pareto tail with alpha <= 1 has no mean, and an
# unbounded draw could stall a whole sync job on one step.
MAX_MULTIPLIER = 100.0


def parse_dist(text: str) -> tuple[str, float]:
    """'lognormal:0.5' -> ("lognormal", 0.5), 'pareto:1.5', 'none' -> ("none", 0.0).

    Raises ConfigError naming the bad text and the valid forms.
    """
    name, sep, value = text.strip().partition(":")
    if name == "none" and not sep:
        return "none", 0.0
    try:
        shape = float(value) if sep and name in DISTRIBUTIONS[1:] else math.nan
    except ValueError:
        shape = math.nan
    if not (math.isfinite(shape) and shape > 0):
        raise ConfigError(
            f"straggler distribution {text!r}: expected lognormal:SIGMA or pareto:ALPHA with a finite number > 0, "
            "or none"
        )
    return name, shape


def parse_rotation(text: str) -> tuple[int, int]:
    """A worker's --slow-node-rotate 'STEPS:FIRST' -> (steps, first rank)."""
    steps, sep, first = text.partition(":")
    if not (sep and steps.isdigit() and first.isdigit() and int(steps) >= 1):
        raise ConfigError(f"--slow-node-rotate {text!r}: expected STEPS:FIRST_RANK with STEPS >= 1, e.g. 50:0")
    return int(steps), int(first)


@dataclass(frozen=True)
class StragglerModel:
    """How a worker's steps are stretched beyond its fixed --slowdown, deterministically given the seed.

    dist/shape: every step of every worker is multiplied by a random draw m >= 1, independent per
    (seed, rank, step): "lognormal" m = max(1, exp(shape * Z)) with Z standard normal (half the steps
    are not slowed, the rest have a log-normal tail); "pareto" m = Pareto(alpha = shape) with minimum 1
    (heavier the smaller alpha: no variance for alpha <= 2). Both capped at MAX_MULTIPLIER.

    rotate_steps/rotate_first: the slowdown is not this worker's for good: rank rotate_first is the
    slow node for steps 0..rotate_steps-1, then the next rank (mod the workers), and so on; the slow
    node's factor is the worker's slowdown, every other step runs at factor 1. 0: no rotation.
    """

    dist: str = "none"
    shape: float = 0.0
    rotate_steps: int = 0
    rotate_first: int = 0

    def __post_init__(self) -> None:
        if self.dist not in DISTRIBUTIONS:
            raise ConfigError(f"straggler distribution must be one of {', '.join(DISTRIBUTIONS)}, got {self.dist!r}")
        if self.dist != "none" and not (math.isfinite(self.shape) and self.shape > 0):
            raise ConfigError(f"{self.dist}'s parameter must be a finite number > 0, got {self.shape!r}")
        if self.rotate_steps < 0 or self.rotate_first < 0:
            raise ConfigError(
                f"slow-node rotation needs steps >= 0 and a rank >= 0, got {self.rotate_steps}:{self.rotate_first}"
            )

    def to_argv(self) -> list[str]:
        """The `psgrad worker` flags that reproduce this model."""
        argv = [] if self.dist == "none" else ["--straggler-dist", f"{self.dist}:{self.shape!r}"]
        return argv + ([] if not self.rotate_steps else ["--slow-node-rotate", f"{self.rotate_steps}:{self.rotate_first}"])

    def describe(self) -> str:
        """A phrase for reports: 'log-normal slow steps (sigma 0.5); the slow node moves every 50 steps'."""
        parts = {"none": [], "lognormal": [f"log-normal slow steps (sigma {self.shape:g})"],
                 "pareto": [f"Pareto slow steps (alpha {self.shape:g})"]}[self.dist]
        if self.rotate_steps:
            parts.append(f"the slow node moves to the next rank every {self.rotate_steps} steps, from rank "
                         f"{self.rotate_first}")
        return "; ".join(parts) or "none"

    def slowdown_at(self, slowdown: float, step: int, rank: int, num_workers: int) -> float:
        """The fixed part of the factor for this rank's step: slowdown, or, rotating, slowdown on the
        slow node and 1 elsewhere."""
        if not self.rotate_steps:
            return slowdown
        slow_rank = (self.rotate_first + step // self.rotate_steps) % max(1, num_workers)
        return slowdown if rank == slow_rank else 1.0

    def multiplier(self, seed: int, rank: int, step: int) -> float:
        """The random factor (>= 1) of this rank's step; the same for the same (seed, rank, step)."""
        if self.dist == "none":
            return 1.0
        rng = random.Random(f"psgrad-straggler:{seed}:{rank}:{step}")
        if self.dist == "lognormal":
            draw = math.exp(min(self.shape * rng.gauss(0.0, 1.0), math.log(MAX_MULTIPLIER)))
        else:
            draw = rng.paretovariate(self.shape)
        return min(MAX_MULTIPLIER, max(1.0, draw))
