"""Delay compensation (DC-ASGD, Zheng et al., ICML 2017) as a job setting: the adaptive variant's
constants and the checks of JobSpec's dc_asgd fields (no torch: the CLI imports config)."""
from __future__ import annotations

import math
from typing import Protocol

from psgrad.core.modes import DECLARED, find_mode
from psgrad.errors import ConfigError

# DC-ASGD-a keeps, per element, the running mean square of the gradients a shard receives,
# ms_t = MOMENTUM * ms_{t-1} + (1 - MOMENTUM) * g*g (ms_0 = 0, the raw gradient before compensation),
# and compensates with lambda_t = lambda0 / sqrt(ms_t + EPS) instead of a constant lambda.
MEAN_SQUARE_MOMENTUM = 0.95
EPS = 1e-7
MODES = tuple(m.name for m in DECLARED if m.stale_gradients)  # where a gradient can be stale


class _DelaySpec(Protocol):
    @property
    def mode(self) -> str: ...
    @property
    def dc_asgd(self) -> float: ...
    @property
    def dc_asgd_adaptive(self) -> bool: ...


def check_dc_asgd(spec: _DelaySpec) -> None:
    """Raises ConfigError for a lambda that is negative or not finite, delay compensation in a mode
    without stale gradients, or the adaptive variant without a lambda0."""
    lam = spec.dc_asgd
    if not (math.isfinite(lam) and lam >= 0):
        raise ConfigError(f"dc_asgd (--dc-asgd LAMBDA) must be a finite number >= 0 (0: off), got {lam!r}")
    mode = find_mode(spec.mode)
    if lam and not (mode is not None and mode.stale_gradients):
        raise ConfigError(
            f"--dc-asgd compensates a gradient for the updates applied since its worker pulled, but mode "
            f"{spec.mode!r} applies every gradient to the weights it was computed on (staleness 0): "
            f"use --mode {' or '.join(MODES)}, or leave --dc-asgd at 0"
        )
    if spec.dc_asgd_adaptive and not lam:
        raise ConfigError("--dc-asgd-adaptive scales --dc-asgd LAMBDA0 per element: give --dc-asgd > 0 as well")
