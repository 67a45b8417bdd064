"""Validation of a job's consistency fields: mode, the SSP bound (fixed or adaptive), backup workers; pure."""
from __future__ import annotations

from typing import Any

from psgrad.errors import ConfigError

MODES = ("async", "ssp", "sync")
# --staleness auto: the default of --staleness-max, and where the bound starts (clamped to the max).
AUTO_STALENESS_MAX = 8
AUTO_STALENESS_START = 2


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
        spec.staleness == 0 or spec.mode == "ssp",
        f"staleness bounds only mode 'ssp', got staleness {spec.staleness} with mode {spec.mode!r}",
    )
    _check(spec.staleness_max >= 0, f"staleness_max must be >= 0 (0: a fixed bound), got {spec.staleness_max}")
    _check(
        spec.staleness_max == 0 or spec.mode == "ssp",
        f"--staleness auto adapts only mode 'ssp', got staleness_max {spec.staleness_max} with mode {spec.mode!r}",
    )
    _check(
        spec.staleness_max == 0 or spec.staleness == 0,
        f"staleness {spec.staleness} and staleness_max {spec.staleness_max}: give a fixed bound or 'auto', not both",
    )
    _check(spec.backup_workers >= 0, f"backup_workers must be >= 0, got {spec.backup_workers}")
    _check(
        spec.backup_workers == 0 or spec.mode == "sync",
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
