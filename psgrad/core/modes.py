"""The consistency modes, declared once (DECLARED): each a Mode, its policy and what it promises (the
questions code outside core asks instead of comparing mode names); the policy of a job spec made
from it (registry by name, no comparisons); validation of a job's consistency fields: mode, the SSP
bound (fixed or adaptive), backup workers; pure."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from psgrad.core.adaptive import AUTO_STALENESS_MAX, AUTO_STALENESS_START, AdaptiveSSPPolicy  # noqa: F401 (modes' names, as before)
from psgrad.core.backup import BackupSyncPolicy
from psgrad.core.consistency import AsyncPolicy, ConsistencyPolicy, SSPPolicy, SyncPolicy
from psgrad.errors import ConfigError

# --staleness left out: 2 in ssp mode (JobSpec's 0 bounds nothing there), 0 otherwise.
DEFAULT_SSP_STALENESS = 2


def _plain(spec: Any) -> ConsistencyPolicy | None:
    return None


def _with_backup_workers(spec: Any) -> ConsistencyPolicy | None:
    """Sync with backup_workers > 0: an iteration applies the first N - B gradients (core/backup.py)."""
    return BackupSyncPolicy(spec.backup_workers, spec.num_workers) if spec.backup_workers else None


def _adaptive_bound(spec: Any) -> ConsistencyPolicy | None:
    """SSP with staleness_max > 0 (`--staleness auto`): the bound moves at run time (core/adaptive.py)."""
    return AdaptiveSSPPolicy(spec.staleness_max) if spec.staleness_max else None


@dataclass(frozen=True)
class Mode:
    """One consistency mode: its policy, and what it promises. Code outside core asks these (a
    job's mode_of(spec), a name's find_mode(name)) instead of comparing mode names."""

    #: The mode's policy at a fixed bound; its name is the mode's name.
    policy: type[ConsistencyPolicy]
    #: Whether pulls wait until the slowest live worker is within a staleness bound (ssp: --staleness S,
    #: or auto; its default bound is DEFAULT_SSP_STALENESS).
    bounds_staleness: bool = False
    #: The policy of a job spec whose fields ask for a variant of the mode (backup workers, an
    #: adaptive bound), or None (the plain policy).
    variant: Callable[[Any], ConsistencyPolicy | None] = _plain
    #: Whether repeats of a run with the same seed train the same model (`psgrad compare`'s notes).
    reproducibility: str = ""

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def synchronous(self) -> bool:
        """Whether the mode applies each iteration once, the mean of its workers' gradients (sync):
        every gradient is computed on the latest weights (staleness 0), a shard's version is an
        iteration, and every worker's push carries its own lr."""
        return self.policy.aggregates

    @property
    def stale_gradients(self) -> bool:
        """Whether a gradient may be applied to weights newer than those it was computed on (async,
        ssp): where delay compensation, a staleness-aware lr, overlap and a row cache apply."""
        return not self.synchronous

    @property
    def takes_backup_workers(self) -> bool:
        """Whether the mode may complete an iteration without its slowest workers (sync: --backup-workers)."""
        return self.synchronous

    @property
    def default_staleness(self) -> int:
        """The staleness bound when none is given: DEFAULT_SSP_STALENESS where the mode bounds one, else 0."""
        return DEFAULT_SSP_STALENESS if self.bounds_staleness else 0

    def policy_for(self, spec: Any) -> ConsistencyPolicy:
        """spec (a JobSpec of this mode): its variant's policy, or the mode's at spec.staleness."""
        return self.variant(spec) or self.policy(spec.staleness)


# The one declaration of the modes; every other list of them (MODES, the CLI's choices, compare's
# variants and notes, the modes with stale gradients) is made from it.
DECLARED: tuple[Mode, ...] = (
    Mode(
        AsyncPolicy,
        reproducibility="nondeterministic: updates are applied in arrival order, which depends on thread "
        "scheduling and timing, so which weights each gradient was computed on differs from run to run.",
    ),
    Mode(
        SSPPolicy, bounds_staleness=True, variant=_adaptive_bound,
        reproducibility="nondeterministic: within the staleness bound updates are applied in arrival order, "
        "which depends on thread scheduling and timing, so repeats differ even with the same seed.",
    ),
    Mode(
        SyncPolicy, variant=_with_backup_workers,
        reproducibility="deterministic given the seed: every iteration's gradients are summed in rank order "
        "whatever their arrival order, and each worker's batch order is seeded, so the training "
        "trajectory repeats (wall-clock times do not; CUDA kernels may add their own nondeterminism).",
    ),
)
ASYNC, SSP, SYNC = DECLARED
MODES = tuple(m.name for m in DECLARED)  # ("async", "ssp", "sync")
_BY_NAME: Mapping[str, Mode] = {m.name: m for m in DECLARED}
# mode name -> its policy class (the policy at a fixed bound: make_policy)
POLICIES: Mapping[str, Callable[[int], ConsistencyPolicy]] = {m.name: m.policy for m in DECLARED}


def find_mode(name: str) -> Mode | None:
    """The mode of that name, or None (a name that is no mode: compare's allreduce baseline)."""
    return _BY_NAME.get(name)


def mode_named(name: str) -> Mode:
    """The mode of that name.

    Raises:
        ConfigError: unknown mode (the message lists the valid ones).
    """
    mode = _BY_NAME.get(name)
    if mode is None:
        raise ConfigError(f"unknown mode {name!r}; valid: {', '.join(MODES)}")
    return mode


def mode_of(spec: Any) -> Mode:
    """spec's (a JobSpec's) mode. Raises ConfigError for an unknown one."""
    return mode_named(spec.mode)


def tables_mode_of(spec: Any) -> Mode:
    """How spec's sparse tables are updated: its tables_mode (hybrid consistency: "async" tables
    in a sync job, each worker's row gradients applied as they arrive), or the job's mode ("")."""
    return mode_named(spec.tables_mode) if spec.tables_mode else mode_of(spec)


def make_policy(mode: str, staleness: int = 0) -> ConsistencyPolicy:
    """The plain policy of a mode name at a fixed staleness bound.

    Raises:
        ConfigError: unknown mode (the message lists the valid ones).
    """
    return mode_named(mode).policy(staleness)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def check_mode_fields(spec: Any) -> None:
    """mode, staleness, staleness_max (>0: `--staleness auto`) and backup_workers of a JobSpec.

    Raises:
        ConfigError: the field and the problem named.
    """
    mode = find_mode(spec.mode)
    if mode is None:
        raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {spec.mode!r}")
    _check(spec.staleness >= 0, f"staleness must be >= 0, got {spec.staleness}")
    _check(
        spec.staleness == 0 or mode.bounds_staleness,
        f"staleness bounds only mode 'ssp', got staleness {spec.staleness} with mode {spec.mode!r}",
    )
    _check(spec.staleness_max >= 0, f"staleness_max must be >= 0 (0: a fixed bound), got {spec.staleness_max}")
    _check(
        spec.staleness_max == 0 or mode.bounds_staleness,
        f"--staleness auto adapts only mode 'ssp', got staleness_max {spec.staleness_max} with mode {spec.mode!r}",
    )
    _check(
        spec.staleness_max == 0 or spec.staleness == 0,
        f"staleness {spec.staleness} and staleness_max {spec.staleness_max}: give a fixed bound or 'auto', not both",
    )
    _check(spec.backup_workers >= 0, f"backup_workers must be >= 0, got {spec.backup_workers}")
    _check(
        spec.backup_workers == 0 or mode.takes_backup_workers,
        f"backup workers apply only to mode 'sync', got backup_workers {spec.backup_workers} with mode {spec.mode!r}",
    )
    _check(
        spec.backup_workers == 0 or spec.backup_workers < spec.num_workers,
        f"backup_workers must be < num_workers (an iteration needs at least one gradient), got backup_workers "
        f"{spec.backup_workers} with num_workers {spec.num_workers}",
    )


def check_tables_mode(spec: Any) -> str:
    """spec.tables_mode in its one spelling: "" where it is the job's mode, else a mode the tables
    may take apart from the dense part (async tables in a sync job: Persia's hybrid).

    Raises:
        ConfigError: an unknown mode, or a pairing psgrad does not run (named, with the one it does).
    """
    if not spec.tables_mode or spec.tables_mode == spec.mode:
        return ""
    if spec.tables_mode not in _BY_NAME:
        raise ConfigError(f"unknown tables_mode {spec.tables_mode!r} (--tables-mode); valid: {', '.join(MODES)}, or "
                          "the job's own mode")
    tables = mode_named(spec.tables_mode)
    _check(
        mode_of(spec).synchronous and not tables.synchronous and not tables.bounds_staleness,
        f"tables mode {spec.tables_mode!r} with mode {spec.mode!r}: the tables may be async in a sync job "
        "(--mode sync --tables-mode async: the dense part averaged per iteration, each worker's row gradients "
        "applied as they arrive); in async and ssp jobs the tables already take each push as it comes",
    )
    return tables.name


def mode_argv(spec: Any) -> list[str]:
    """The worker flags that reproduce a JobSpec's consistency fields."""
    argv = ["--mode", spec.mode] + (["--tables-mode", spec.tables_mode] if spec.tables_mode else [])
    if spec.staleness_max:
        argv += ["--staleness", "auto", "--staleness-max", str(spec.staleness_max)]
    else:
        argv += ["--staleness", str(spec.staleness)]
    return argv + (["--backup-workers", str(spec.backup_workers)] if spec.backup_workers else [])
