"""The consistency modes by name: what each promises (the questions code outside core asks instead of
comparing mode strings), and validation of a job's consistency fields: mode, the SSP bound (fixed or
adaptive), backup workers; pure."""
from __future__ import annotations

from typing import Any

from psgrad.errors import ConfigError

MODES = ("async", "ssp", "sync")
# --staleness auto: the default of --staleness-max, and where the bound starts (clamped to the max).
AUTO_STALENESS_MAX = 8
AUTO_STALENESS_START = 2
# --staleness left out: 2 in ssp mode (JobSpec's 0 bounds nothing there), 0 otherwise.
DEFAULT_SSP_STALENESS = 2


def is_synchronous(mode: str) -> bool:
    """Whether mode applies each iteration once, the mean of its workers' gradients (sync): every
    gradient is computed on the latest weights (staleness 0), a shard's version is an iteration, and
    every worker's push carries its own lr. False for async and ssp, and for names that are no mode
    (compare's allreduce baseline)."""
    return mode == "sync"


def bounds_staleness(mode: str) -> bool:
    """Whether mode's pulls wait until the slowest live worker is within a staleness bound (ssp:
    --staleness S, or auto)."""
    return mode == "ssp"


def default_staleness(mode: str) -> int:
    """The staleness bound of mode when none is given: DEFAULT_SSP_STALENESS where it bounds one, else 0."""
    return DEFAULT_SSP_STALENESS if bounds_staleness(mode) else 0


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def check_mode_fields(spec: Any) -> None:
    """mode, staleness, staleness_max (>0: `--staleness auto`) and backup_workers of a JobSpec.

    Raises:
        ConfigError: the field and the problem named.
    """
    _check(spec.mode in MODES, f"mode must be one of {', '.join(MODES)}, got {spec.mode!r}")
    _check(spec.staleness >= 0, f"staleness must be >= 0, got {spec.staleness}")
    _check(
        spec.staleness == 0 or bounds_staleness(spec.mode),
        f"staleness bounds only mode 'ssp', got staleness {spec.staleness} with mode {spec.mode!r}",
    )
    _check(spec.staleness_max >= 0, f"staleness_max must be >= 0 (0: a fixed bound), got {spec.staleness_max}")
    _check(
        spec.staleness_max == 0 or bounds_staleness(spec.mode),
        f"--staleness auto adapts only mode 'ssp', got staleness_max {spec.staleness_max} with mode {spec.mode!r}",
    )
    _check(
        spec.staleness_max == 0 or spec.staleness == 0,
        f"staleness {spec.staleness} and staleness_max {spec.staleness_max}: give a fixed bound or 'auto', not both",
    )
    _check(spec.backup_workers >= 0, f"backup_workers must be >= 0, got {spec.backup_workers}")
    _check(
        spec.backup_workers == 0 or is_synchronous(spec.mode),
        f"backup workers apply only to mode 'sync', got backup_workers {spec.backup_workers} with mode {spec.mode!r}",
    )
    _check(
        spec.backup_workers == 0 or spec.backup_workers < spec.num_workers,
        f"backup_workers must be < num_workers (an iteration needs at least one gradient), got backup_workers "
        f"{spec.backup_workers} with num_workers {spec.num_workers}",
    )


def mode_argv(spec: Any) -> list[str]:
    """The worker flags that reproduce a JobSpec's consistency fields."""
    argv = ["--mode", spec.mode]
    if spec.staleness_max:
        argv += ["--staleness", "auto", "--staleness-max", str(spec.staleness_max)]
    else:
        argv += ["--staleness", str(spec.staleness)]
    return argv + (["--backup-workers", str(spec.backup_workers)] if spec.backup_workers else [])
