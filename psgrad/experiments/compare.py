"""`psgrad compare`: train every consistency mode on a fresh local cluster, repeat, and report."""
from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from psgrad.config import JobSpec, ServerConfig, WorkerConfig
from psgrad.core.stragglers import StragglerModel
from psgrad.experiments.modes import BASELINES, ModeRun, parse_modes
from psgrad.core.optimizer_settings import DEFAULT_EPS
from psgrad.errors import ConfigError, PsgradError

__all__ = ["BASELINES", "CompareConfig", "ModeRun", "parse_modes", "run_compare", "worker_argv"]

# The rest (torch, grpc, matplotlib) is imported where a run needs it: `psgrad --help` reads
# CompareConfig's defaults from here and stays fast.

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
        if self.metric.endswith("accuracy") and not 0.0 < self.target <= 1.0:
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
        if self.optimizer != "sgd" and any(m.mode == "allreduce" for m in self.modes):
            raise ConfigError(
                f"the allreduce baseline trains with SGD only; drop allreduce from --modes to compare "
                f"with --optimizer {self.optimizer}"
            )
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
            mode="sync" if mode.mode in BASELINES else mode.mode, staleness=mode.staleness,
            staleness_max=mode.staleness_max, staleness_lr=mode.staleness_lr, backup_workers=mode.backup_workers,
            dc_asgd=mode.dc_asgd, dc_asgd_adaptive=mode.dc_asgd_adaptive, num_workers=self.num_workers, optimizer=self.optimizer,
            lr=self.mode_lr(mode), momentum=self.momentum,
            weight_decay=self.weight_decay, wire_dtype=self.wire_dtype, num_shards=self.num_servers,
            eps=DEFAULT_EPS.get(self.optimizer, JobSpec.eps),
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


def worker_argv(cfg: CompareConfig, mode: ModeRun, seed: int, rank: int, run_dir: Path, servers: str = "") -> list[str]:
    """The flags of worker rank in one run of mode (after `psgrad worker`, or `psgrad allreduce` without servers)."""
    config = cfg.worker_config(seed, rank, run_dir, servers.split(",") if servers else ())
    board = [] if cfg.tensorboard is None else ["--tensorboard", str(Path(cfg.tensorboard) / run_dir.name)]
    return [*config.to_argv(), *cfg.job_spec(mode).to_argv(), *board]


def run_one(cfg: CompareConfig, mode: ModeRun, seed: int, run_dir: Path) -> int:
    """Train one mode once on a fresh cluster; metrics, status and output go into run_dir."""
    from psgrad.client.parameter_client import shard_status
    from psgrad.launch import jobkeys
    from psgrad.launch.local import run_launch

    run_dir.mkdir(parents=True, exist_ok=True)
    log_lock = threading.Lock()
    env = dict(os.environ, OMP_NUM_THREADS=str(cfg.omp_threads))
    with open(run_dir / "output.log", "w", encoding="utf-8") as log_file:

        def out(line: str) -> None:
            with log_lock:
                log_file.write(line + "\n")
                log_file.flush()

        if mode.mode == "allreduce":
            store = run_dir / "store"
            store.unlink(missing_ok=True)
            return run_launch(
                0, cfg.num_workers, [],
                lambda rank, _servers: [*worker_argv(cfg, mode, seed, rank, run_dir), "--store", str(store)],
                out=out, env=env, worker_command="allreduce",
            )

        keys = jobkeys.create(cfg.security, cfg.num_workers)

        def status(addresses: list[str]) -> None:
            client = keys.admin() if keys else None
            shards = [s.to_dict() for s in shard_status(addresses, timeout_s=10.0, client=client)]
            (run_dir / "status.json").write_text(json.dumps({"shards": shards}, indent=1))

        try:
            return run_launch(
                cfg.num_servers, cfg.num_workers, ["--lease-s", str(cfg.lease_s), *(keys.server_argv() if keys else [])],
                lambda rank, servers: [*worker_argv(cfg, mode, seed, rank, run_dir, servers),
                                       *(keys.worker_argv(rank) if keys else [])],
                status=status, out=out, env=env,
            )
        finally:
            if keys is not None:
                keys.remove()


def _one_line(metrics: dict[str, Any], metric: str) -> str:
    def fmt(key: str, spec: str) -> str:
        value = metrics.get(key)
        return "n/a" if value is None else format(value, spec)

    reached = metrics.get("time_to_target_s")
    target = f"target in {reached:.1f} s" if reached is not None else "target not reached"
    name = metric.removeprefix("test_")
    return f"{target}, final {name} {fmt('final_' + metric, '.3f')}, {fmt('samples_per_s', '.0f')} samples/s"


def _train(cfg: CompareConfig, mode: ModeRun, seed: int, run_dir: Path, repeat: int = 0) -> dict[str, Any] | None:
    """One run's metrics, or None when it failed (its output.log says why).

    Raises:
        KeyboardInterrupt: interrupted; every child process has been stopped.
    """
    from psgrad.experiments import analysis

    rc = run_one(cfg, mode, seed, run_dir)
    if rc == 130:
        raise KeyboardInterrupt
    if rc != 0:
        return None
    return analysis.run_metrics(analysis.load_run(run_dir, label=mode.label, repeat=repeat), cfg.target, cfg.metric)


def run_compare(
    cfg: CompareConfig,
    command: str,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """With an lr grid, first run it (lrgrid.run_grid) and give every mode its best lr. Then run
    every mode `repeats` times (mode after mode within a repeat, so machine noise hits all modes
    alike), and write summary.json, report.md, convergence.png and staleness.png.

    Raises:
        PsgradError: a run failed (the message points at its output.log).
        KeyboardInterrupt: interrupted; every child process has been stopped.
    """
    from tqdm import tqdm

    from psgrad.experiments import analysis, lrgrid, report

    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    grid = None
    if cfg.lr_grid:
        grid = lrgrid.run_grid(cfg, _train, log)
        best = grid["best"]
        cfg = replace(cfg, modes=tuple(m.with_lr(best[m.label]) if m.label in best else m for m in cfg.modes), lr_grid=())
    plan = [(mode, repeat) for repeat in range(cfg.repeats) for mode in cfg.modes]
    per_mode: dict[str, list[dict[str, Any]]] = {m.label: [] for m in cfg.modes}
    with tqdm(plan, desc="psgrad compare", unit="run", file=sys.stderr, disable=not progress) as bar:
        for mode, repeat in bar:
            bar.set_postfix_str(f"{mode.label} repeat {repeat + 1}/{cfg.repeats}")
            run_dir = cfg.out_dir / "runs" / f"{mode.slug}-r{repeat}"
            metrics = _train(cfg, mode, cfg.seed + repeat, run_dir, repeat)
            if metrics is None:
                raise PsgradError(f"{mode.label} (repeat {repeat}) failed; see {run_dir / 'output.log'}")
            per_mode[mode.label].append(metrics)
            bar.write(f"{mode.label:>10} repeat {repeat + 1}: {_one_line(metrics, cfg.metric)}")
    summary = {label: analysis.aggregate(ms) for label, ms in per_mode.items()}
    for mode in cfg.modes:
        summary[mode.label]["lr"] = cfg.mode_lr(mode)
    notes = analysis.nondeterminism_notes([m.label for m in cfg.modes])
    env_versions = report.environment_versions()
    document = {
        "command": command,
        "settings": cfg.settings(),
        "versions": env_versions,
        "modes": summary,
        "runs": {
            label: [{k: v for k, v in m.items() if k != "curve"} for m in ms] for label, ms in per_mode.items()
        },
        "nondeterminism": notes,
        "lr_grid": grid,
    }
    (cfg.out_dir / "summary.json").write_text(json.dumps(document, indent=2, default=str))
    report.plot_convergence(
        cfg.out_dir / "convergence.png",
        {label: [m["curve"] for m in ms] for label, ms in per_mode.items()},
        cfg.target,
        cfg.metric,
    )
    report.plot_staleness(
        cfg.out_dir / "staleness.png", {label: s["staleness_histogram"] for label, s in summary.items()}
    )
    sections = [] if grid is None else lrgrid.grid_markdown(grid, cfg.metric, cfg.settings()["lrs"])
    report.write_report(cfg.out_dir, summary, command, env_versions, cfg.settings(), notes, cfg.metric, sections)
    log(report.format_table(summary, cfg.metric))
    log(f"wrote {cfg.out_dir}/summary.json, report.md, convergence.png, staleness.png and runs/")
    return document
