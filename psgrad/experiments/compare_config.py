"""`psgrad compare`'s settings: CompareConfig (validated on creation), the default modes, and the
JobSpec and WorkerConfig of each run; the CLI, the runner (compare.py), the lr grid (lrgrid.py) and
the claims preset read them."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from psgrad.config import JobSpec, ServerConfig, WorkerConfig, metric_rises
from psgrad.core.modes import SYNC
from psgrad.core.optimizer_settings import DEFAULT_EPS
from psgrad.core.stragglers import StragglerModel
from psgrad.errors import ConfigError
from psgrad.experiments.modes import ModeRun, parse_modes

# No torch, grpc or matplotlib here: `psgrad --help` reads CompareConfig's defaults from here and stays fast.

DEFAULT_MODES = "sync,async,ssp:2"
LR_SCALINGS = ("none", "linear")


@dataclass(frozen=True)
class CompareConfig:
    """Everything one comparison needs; validated on creation."""

    out_dir: Path
    modes: tuple[ModeRun, ...] = field(default_factory=lambda: parse_modes(DEFAULT_MODES))
    task: str = WorkerConfig.task
    num_servers: int = 2
    num_workers: int = 4
    steps: int = 400  # the CLI takes the task's recipe (compare_steps: digits 400, not its 1000)
    batch_size: int = WorkerConfig.batch_size
    optimizer: str = JobSpec.optimizer
    lr: float = JobSpec.lr
    momentum: float = JobSpec.momentum
    weight_decay: float = JobSpec.weight_decay
    wire_dtype: str = JobSpec.wire_dtype
    metric: str = "test_accuracy"  # what the target is of, and the table ranks by: the task's
    target: float = 0.9
    lr_schedule: str = WorkerConfig.lr_schedule
    warmup_steps: int = WorkerConfig.warmup_steps
    step_time_ms: float = WorkerConfig.step_time_ms
    data_dir: str | None = None
    repeats: int = 2
    seed: int = WorkerConfig.seed
    stragglers: tuple[tuple[int, float], ...] = ()
    jitter_ms: float = WorkerConfig.jitter_ms
    eval_every: int = 0  # 0: about 20 evaluations per worker and run
    lease_s: float = ServerConfig.lease_s
    omp_threads: int = 1
    tensorboard: str | None = None  # also write TensorBoard scalars under tensorboard/RUN/workerR
    security: str = "off"  # "tokens" or "tls": every run gets fresh credentials (see launch/jobkeys.py)
    straggler_dist: tuple[str, float] = ("none", 0.0)  # every worker's random slow steps (core/stragglers.py)
    slow_node_rotate: int = 0  # steps after which the one --straggler's role moves to the next rank; 0: fixed
    sync_lr_scaling: str = "none"  # "linear": modes that average k gradients per update train at lr x k
    lr_grid: tuple[float, ...] = ()  # each mode at each lr first (grid_steps, one seed), then at its best
    grid_steps: int = 0  # 0: steps // 2
    grid_by: str = "time"  # how the grid ranks lrs: "time" to target (else final metric), or "final" metric
    save_weights: bool = False  # every run's rank 0 writes its final model to runs/RUN/model.pt

    def __post_init__(self) -> None:
        if not self.modes:
            raise ConfigError("--modes must name at least one mode")
        if metric_rises(self.metric) and not 0.0 < self.target <= 1.0:
            raise ConfigError(f"target accuracy must be in (0, 1], got {self.target}")
        if not self.target > 0:
            raise ConfigError(f"target {self.metric} must be > 0, got {self.target}")
        for name in ("num_servers", "num_workers", "steps", "repeats", "batch_size", "omp_threads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for rank, factor in self.stragglers:
            if rank >= self.num_workers:
                raise ConfigError(f"--straggler names rank {rank}, but there are only {self.num_workers} workers")
        if self.security not in ("off", "tokens", "tls"):
            raise ConfigError(f"security must be off, tokens or tls, got {self.security!r}")
        if len({r for r, _ in self.stragglers}) != len(self.stragglers):
            raise ConfigError("--straggler names the same rank twice")
        if self.sync_lr_scaling not in LR_SCALINGS:
            raise ConfigError(f"sync lr scaling must be one of {', '.join(LR_SCALINGS)}, got {self.sync_lr_scaling!r}")
        if any(not (lr > 0) for lr in self.lr_grid) or len(set(self.lr_grid)) != len(self.lr_grid):
            raise ConfigError(f"--lr-grid needs distinct learning rates > 0, got {self.lr_grid}")
        if self.grid_by not in ("time", "final"):
            raise ConfigError(f"grid_by must be time or final, got {self.grid_by!r}")
        if self.grid_steps < 0:
            raise ConfigError(f"grid_steps must be >= 0 (0: half of --steps), got {self.grid_steps}")
        if self.slow_node_rotate and len(self.stragglers) != 1:
            raise ConfigError("--slow-node-rotate moves one slow node: give exactly one --straggler RANK:FACTOR")
        _ = self.straggler_model  # StragglerModel checks the distribution before any run starts
        for mode in self.modes:
            self.job_spec(mode)  # lr, momentum, ... checked by JobSpec before any run starts

    @property
    def evaluate_every(self) -> int:
        return self.eval_every or max(1, self.steps // 20)

    def settings(self) -> dict[str, Any]:
        d = asdict(self)
        d["out_dir"] = str(self.out_dir)
        d["modes"] = [m.label for m in self.modes]
        d["stragglers"] = {str(r): f for r, f in self.stragglers}
        d["straggler_model"] = self.straggler_model.describe()
        d["lrs"] = {m.label: self.mode_lr(m) for m in self.modes}
        d["eval_every"] = self.evaluate_every
        return d

    @property
    def grid_steps_or_default(self) -> int:
        return self.grid_steps or max(1, self.steps // 2)

    def mode_lr(self, mode: ModeRun) -> float:
        """The lr mode trains at: its own (lr=, or its grid's best), else --lr; with linear scaling,
        times the gradients each of its updates averages."""
        base = self.lr if mode.lr is None else mode.lr
        return base * (mode.averaged(self.num_workers) if self.sync_lr_scaling == "linear" else 1)

    @property
    def straggler_model(self) -> StragglerModel:
        """Every worker's straggler model: the distribution, and the rotation of the one straggler."""
        dist, shape = self.straggler_dist
        first = self.stragglers[0][0] if self.slow_node_rotate else 0
        return StragglerModel(dist=dist, shape=shape, rotate_steps=self.slow_node_rotate, rotate_first=first)

    def slowdown(self, rank: int) -> float:
        """Worker rank's --slowdown: its --straggler factor, or rotating, the slow node's for everyone."""
        if self.slow_node_rotate:
            return self.stragglers[0][1]
        return dict(self.stragglers).get(rank, WorkerConfig.slowdown)

    def job_spec(self, mode: ModeRun) -> JobSpec:
        """The spec of one run of mode (the all-reduce baseline: sync, which is what it does)."""
        return JobSpec(
            mode=SYNC.name if mode.baseline else mode.mode, staleness=mode.staleness,
            staleness_max=mode.staleness_max, staleness_lr=mode.staleness_lr, backup_workers=mode.backup_workers,
            dc_asgd=mode.dc_asgd, dc_asgd_adaptive=mode.dc_asgd_adaptive, num_workers=self.num_workers, optimizer=self.optimizer,
            lr=self.mode_lr(mode), momentum=self.momentum,
            weight_decay=self.weight_decay, wire_dtype=self.wire_dtype, num_shards=self.num_servers,
            eps=DEFAULT_EPS.get(self.optimizer, JobSpec.eps), compress=mode.compress, error_feedback=mode.error_feedback,
            tables_mode=mode.tables_mode,
        )

    def worker_config(self, seed: int, rank: int, run_dir: Path, servers: Sequence[str] = ()) -> WorkerConfig:
        """Worker rank's config in the run with this seed, writing its metrics into run_dir."""
        return WorkerConfig(
            servers=tuple(servers), task=self.task, rank=rank, steps=self.steps, batch_size=self.batch_size,
            device="cpu", seed=seed, metrics_out=str(run_dir / f"worker{rank}.jsonl"),
            eval_every=self.evaluate_every, log_every=self.steps, jitter_ms=self.jitter_ms,
            slowdown=self.slowdown(rank), lr_schedule=self.lr_schedule, straggler_model=self.straggler_model,
            warmup_steps=self.warmup_steps, step_time_ms=self.step_time_ms, data_dir=self.data_dir,
            save_model=str(run_dir / "model.pt") if self.save_weights and rank == 0 else None,
        )
