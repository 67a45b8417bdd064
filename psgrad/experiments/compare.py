"""`psgrad compare`: train every consistency mode on a fresh local cluster, repeat, and report."""
from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from psgrad.config import MODES, JobSpec, ServerConfig, WorkerConfig
from psgrad.optim import DEFAULT_EPS
from psgrad.errors import ConfigError, PsgradError

# The rest (torch, grpc, matplotlib) is imported where a run needs it: `psgrad --help` reads
# CompareConfig's defaults from here and stays fast.

DEFAULT_MODES = "sync,async,ssp:2"
BASELINES = ("allreduce",)


@dataclass(frozen=True)
class ModeRun:
    """One entry of --modes: a label as the user wrote it, the mode, and its staleness bound."""

    label: str
    mode: str
    staleness: int = 0

    @property
    def slug(self) -> str:
        return self.label.replace(":", "")


def parse_modes(text: str) -> tuple[ModeRun, ...]:
    """'sync,async,ssp:2,allreduce' -> ModeRuns. Raises ConfigError naming the valid forms."""
    valid = "sync, async, ssp:S (S >= 0), allreduce"
    out: list[ModeRun] = []
    for item in (t.strip() for t in text.split(",")):
        name, sep, bound = item.partition(":")
        if name == "ssp" and sep and bound.isdigit():
            out.append(ModeRun(item, "ssp", int(bound)))
        elif not sep and (name in MODES and name != "ssp" or name in BASELINES):
            out.append(ModeRun(item, name))
        else:
            raise ConfigError(f"unknown mode {item!r} in --modes; valid: {valid}")
    labels = [m.label for m in out]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"--modes lists a mode twice: {text!r}")
    return tuple(out)


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
        d["eval_every"] = self.evaluate_every
        return d

    def job_spec(self, mode: ModeRun) -> JobSpec:
        """The spec of one run of mode (the all-reduce baseline: sync, which is what it does)."""
        return JobSpec(
            mode="sync" if mode.mode in BASELINES else mode.mode, staleness=mode.staleness,
            num_workers=self.num_workers, optimizer=self.optimizer, lr=self.lr, momentum=self.momentum,
            weight_decay=self.weight_decay, wire_dtype=self.wire_dtype, num_shards=self.num_servers,
            eps=DEFAULT_EPS.get(self.optimizer, JobSpec.eps),
        )

    def worker_config(self, seed: int, rank: int, run_dir: Path, servers: Sequence[str] = ()) -> WorkerConfig:
        """Worker rank's config in the run with this seed, writing its metrics into run_dir."""
        return WorkerConfig(
            servers=tuple(servers), task=self.task, rank=rank, steps=self.steps, batch_size=self.batch_size,
            device="cpu", seed=seed, metrics_out=str(run_dir / f"worker{rank}.jsonl"),
            eval_every=self.evaluate_every, log_every=self.steps, jitter_ms=self.jitter_ms,
            slowdown=dict(self.stragglers).get(rank, WorkerConfig.slowdown), lr_schedule=self.lr_schedule,
            warmup_steps=self.warmup_steps, step_time_ms=self.step_time_ms, data_dir=self.data_dir,
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


def run_compare(
    cfg: CompareConfig,
    command: str,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run every mode `repeats` times (mode after mode within a repeat, so machine noise hits all
    modes alike), then write summary.json, report.md, convergence.png and staleness.png.

    Raises:
        PsgradError: a run failed (the message points at its output.log).
        KeyboardInterrupt: interrupted; every child process has been stopped.
    """
    from tqdm import tqdm

    from psgrad.experiments import analysis, report

    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    plan = [(mode, repeat) for repeat in range(cfg.repeats) for mode in cfg.modes]
    per_mode: dict[str, list[dict[str, Any]]] = {m.label: [] for m in cfg.modes}
    with tqdm(plan, desc="psgrad compare", unit="run", file=sys.stderr, disable=not progress) as bar:
        for mode, repeat in bar:
            bar.set_postfix_str(f"{mode.label} repeat {repeat + 1}/{cfg.repeats}")
            run_dir = cfg.out_dir / "runs" / f"{mode.slug}-r{repeat}"
            rc = run_one(cfg, mode, cfg.seed + repeat, run_dir)
            if rc == 130:
                raise KeyboardInterrupt
            if rc != 0:
                raise PsgradError(f"{mode.label} (repeat {repeat}) failed; see {run_dir / 'output.log'}")
            data = analysis.load_run(run_dir, label=mode.label, repeat=repeat)
            metrics = analysis.run_metrics(data, cfg.target, cfg.metric)
            per_mode[mode.label].append(metrics)
            bar.write(f"{mode.label:>10} repeat {repeat + 1}: {_one_line(metrics, cfg.metric)}")
    summary = {label: analysis.aggregate(ms) for label, ms in per_mode.items()}
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
    report.write_report(cfg.out_dir, summary, command, env_versions, cfg.settings(), notes, cfg.metric)
    log(report.format_table(summary, cfg.metric))
    log(f"wrote {cfg.out_dir}/summary.json, report.md, convergence.png, staleness.png and runs/")
    return document
