"""JobSpec: what every worker of a job must agree on (frozen, self-validating; psgrad.config
re-exports it), and the flags that reproduce it; pure (no torch: the CLI imports config)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from psgrad.core import compression
from psgrad.core.delay import check_dc_asgd
from psgrad.core.modes import check_mode_fields, check_tables_mode, mode_argv, mode_of
from psgrad.core.optimizer_settings import check_optimizer_fields, floats_as_floats
from psgrad.errors import ConfigError

WIRE_DTYPES = ("float32", "bfloat16", "float16")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(frozen=True)
class JobSpec:
    """What every worker of a job must agree on; the chief installs it on the servers."""

    mode: str = "async"
    staleness: int = 0
    num_workers: int = 1
    optimizer: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    wire_dtype: str = "float32"
    num_shards: int = 1
    staleness_lr: bool = False
    beta1: float = 0.9  # Adam's first-moment decay (adam, adamw)
    beta2: float = 0.999  # Adam's second-moment decay (adam, adamw)
    eps: float = 1e-8  # the denominator term (Adam's default; see optimizer_settings.DEFAULT_EPS)
    nesterov: bool = False  # sgd with momentum: Nesterov's rule
    lr_decay: float = 0.0  # adagrad: lr / (1 + (step - 1) * lr_decay)
    initial_accumulator_value: float = 0.0  # adagrad: where the sum of squared gradients starts
    alpha: float = 0.99  # rmsprop: decay of the squared-gradient average
    centered: bool = False  # rmsprop: divide by the gradient's estimated variance, not its raw second moment
    rho: float = 0.9  # adadelta: decay of both running averages
    dc_asgd: float = 0.0  # DC-ASGD's lambda (0: off); async/ssp (see core/delay.py)
    dc_asgd_adaptive: bool = False  # DC-ASGD-a: lambda0 / sqrt(mean square of the gradients)
    backup_workers: int = 0  # sync: an iteration applies the first num_workers - backup_workers gradients
    staleness_max: int = 0  # ssp: > 0 adapts the bound at run time within [1, staleness_max] (--staleness auto)
    compress: str = "none"  # how pushed gradients travel: none, topk:R, randomk:R, sign, int8 (core/compression.py)
    error_feedback: bool = True  # biased codecs (topk, randomk, sign): workers keep what a push drops
    tables_mode: str = ""  # sparse tables' mode ("": the job's; "async" in a sync job: hybrid, core/modes.py)

    def __post_init__(self) -> None:
        floats_as_floats(self)  # lr=20 is lr=20.0: one job, one fingerprint
        _check(self.num_workers >= 1, f"num_workers must be >= 1, got {self.num_workers}")
        check_mode_fields(self)  # mode, staleness (fixed or auto), backup_workers
        object.__setattr__(self, "tables_mode", check_tables_mode(self))  # one spelling: "" for the job's own
        _check(self.num_shards >= 1, f"num_shards must be >= 1, got {self.num_shards}")
        check_optimizer_fields(self)  # lr, momentum, weight_decay, beta1, ..., rho: ranges, and who reads them
        _check(
            self.wire_dtype in WIRE_DTYPES,
            f"wire_dtype must be one of {', '.join(WIRE_DTYPES)}, got {self.wire_dtype!r}",
        )
        check_dc_asgd(self)
        # One spelling per setting, and error feedback only where a codec drops something: one job, one fingerprint.
        compression.check_text(self.compress, "compress")
        object.__setattr__(self, "compress", compression.normalize(self.compress))
        codec = compression.parse_compression(self.compress)
        if codec is None or not codec.biased:
            object.__setattr__(self, "error_feedback", True)
        # The optimizer name is checked against the registry where it is built (optimizers.py).

    @property
    def compression(self) -> compression.Compression:
        """The codec of compressed pushes (ValueError for a job that sends plain gradients)."""
        codec = compression.parse_compression(self.compress)
        if codec is None:
            raise ValueError("this job sends plain gradients (compress: none)")
        return codec

    def differences(self, other: JobSpec) -> list[tuple[str, Any, Any]]:
        """Fields whose values differ, as (name, self's value, other's value)."""
        return field_differences(self, other)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_argv(self) -> list[str]:
        """The `psgrad worker` (and `psgrad allreduce`) flags that reproduce this spec. num_shards is
        not among them: a worker counts its shards in --servers (see WorkerConfig.to_argv)."""
        return [
            *mode_argv(self), *(["--staleness-lr"] if self.staleness_lr else []),
            "--num-workers", str(self.num_workers), "--optimizer", self.optimizer, "--lr", str(self.lr),
            "--momentum", str(self.momentum), "--weight-decay", str(self.weight_decay),
            "--beta1", str(self.beta1), "--beta2", str(self.beta2), "--eps", str(self.eps),
            *(["--nesterov"] if self.nesterov else []), "--lr-decay", str(self.lr_decay),
            "--initial-accumulator-value", str(self.initial_accumulator_value), "--alpha", str(self.alpha),
            *(["--centered"] if self.centered else []), "--rho", str(self.rho), "--wire-dtype", self.wire_dtype,
            *(["--dc-asgd", str(self.dc_asgd)] if self.dc_asgd else []),
            *(["--dc-asgd-adaptive"] if self.dc_asgd_adaptive else []),
            *(["--compress", self.compress] if self.compress != compression.NONE else []),
            *([] if self.error_feedback else ["--no-error-feedback"]),
        ]  # str(float) round-trips: float(str(x)) == x


def check_overlap(spec: JobSpec, overlap: bool) -> None:
    """Raises ConfigError when overlap is asked for in a mode that cannot have it (sync), or with
    DC-ASGD (whose servers compensate a gradient against the worker's latest pull)."""
    if overlap and mode_of(spec).synchronous:
        raise ConfigError(
            "overlap needs mode async or ssp: sync mode computes every gradient on the weights of the "
            "previous iteration's update (staleness 0), so there is nothing to overlap"
        )
    if overlap and spec.dc_asgd:
        raise ConfigError(
            "overlap and --dc-asgd do not go together: the servers compensate a gradient against the weights "
            "its worker pulled last, and with overlap each gradient comes from the pull before that "
            "(none would be compensated); drop one of them"
        )


def check_row_cache(spec: JobSpec, rows: int) -> None:
    """Raises ConfigError when a row cache is asked for in sync mode (which allows no stale rows),
    hybrid tables included (async tables in a sync job: a row cache is for async and ssp jobs)."""
    if rows and mode_of(spec).synchronous and spec.tables_mode:
        raise ConfigError(
            f"a row cache does not go with hybrid tables (tables_mode={spec.tables_mode!r} with mode={spec.mode!r}; "
            f"--tables-mode {spec.tables_mode}): the row cache is for jobs whose mode is async or ssp, and this job's mode is sync, its "
            "dense part one averaged update per iteration. Leave the row cache out (the hybrid tables already take "
            f"each worker's rows as they come), or make the whole job {spec.tables_mode} (mode={spec.tables_mode!r} "
            "without tables_mode) to keep it")
    if rows and mode_of(spec).synchronous:
        raise ConfigError("a row cache serves rows up to row_cache_staleness steps old, which sync mode (staleness 0) "
                          "does not allow: use mode async or ssp, or no row cache")


def field_differences(a: Any, b: Any) -> list[tuple[str, Any, Any]]:
    """The compared fields of two dataclass instances of one class whose values differ, as (name,
    a's value, b's value): a job's spec (JobSpec.differences) or a sparse table's (TableSpec)."""
    return [(f.name, getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
            if f.compare and getattr(a, f.name) != getattr(b, f.name)]
