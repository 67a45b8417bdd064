"""`psgrad compare`: train every consistency mode on a fresh local cluster, repeat, and report."""
from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from psgrad.errors import PsgradError
from psgrad.experiments.compare_config import CompareConfig
from psgrad.experiments.modes import BASELINES, ModeRun, parse_modes

__all__ = ["BASELINES", "CompareConfig", "ModeRun", "parse_modes", "run_compare", "worker_argv", "write_summary"]

# The rest (torch, grpc, matplotlib) is imported where a run needs it: `psgrad --help` reads
# the settings (compare_config.py) and stays fast.


def worker_argv(cfg: CompareConfig, mode: ModeRun, seed: int, rank: int, run_dir: Path, servers: str = "") -> list[str]:
    """The flags of worker rank in one run of mode (after `psgrad worker`, or `psgrad allreduce` without servers)."""
    config = cfg.worker_config(seed, rank, run_dir, servers.split(",") if servers else ())
    if mode.compress != "none":  # its servers share the host: compress there too, or the variant would not
        config = replace(config, client=replace(config.client, compress_same_host=True))
    board = [] if cfg.tensorboard is None else ["--tensorboard", str(Path(cfg.tensorboard) / run_dir.name)]
    return [*config.to_argv(), *cfg.job_spec(mode).to_argv(), *board]


def run_one(cfg: CompareConfig, mode: ModeRun, seed: int, run_dir: Path) -> int:
    """Train one mode once on a fresh cluster; metrics, status and output go into run_dir."""
    from psgrad.client.status_client import shard_status
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

        if mode.baseline:
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
    alike), and write summary.json, report.md, convergence.png and staleness.png (see
    write_summary; on Ctrl-C, of the runs that finished before it).

    Raises:
        PsgradError: a run failed (the message points at its output.log).
        KeyboardInterrupt: interrupted; every child process has been stopped, and the finished
            runs summarized.
    """
    from tqdm import tqdm

    from psgrad.experiments import lrgrid

    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    grid = None
    if cfg.lr_grid:
        grid = lrgrid.run_grid(cfg, _train, log)
        best = grid["best"]
        cfg = replace(cfg, modes=tuple(m.with_lr(best[m.label]) if m.label in best else m for m in cfg.modes), lr_grid=())
    plan = [(mode, repeat) for repeat in range(cfg.repeats) for mode in cfg.modes]
    per_mode: dict[str, list[dict[str, Any]]] = {m.label: [] for m in cfg.modes}
    try:
        with tqdm(plan, desc="psgrad compare", unit="run", file=sys.stderr, disable=not progress) as bar:
            for mode, repeat in bar:
                bar.set_postfix_str(f"{mode.label} repeat {repeat + 1}/{cfg.repeats}")
                run_dir = cfg.out_dir / "runs" / f"{mode.slug}-r{repeat}"
                metrics = _train(cfg, mode, cfg.seed + repeat, run_dir, repeat)
                if metrics is None:
                    raise PsgradError(f"{mode.label} (repeat {repeat}) failed; see {run_dir / 'output.log'}")
                per_mode[mode.label].append(metrics)
                bar.write(f"{mode.label:>10} repeat {repeat + 1}: {_one_line(metrics, cfg.metric)}")
    except KeyboardInterrupt:  # Ctrl-C: keep what the finished runs found
        finished = sum(len(ms) for ms in per_mode.values())
        if finished:
            log(f"psgrad compare: interrupted after {finished} of {len(plan)} run(s); summarizing those")
            write_summary(cfg, command, per_mode, grid, log, interrupted=True)
        raise
    return write_summary(cfg, command, per_mode, grid, log)


def write_summary(
    cfg: CompareConfig,
    command: str,
    per_mode: dict[str, list[dict[str, Any]]],
    grid: dict[str, Any] | None,
    log: Callable[[str], None] = print,
    interrupted: bool = False,
) -> dict[str, Any]:
    """Write summary.json, report.md, convergence.png and staleness.png of the runs in per_mode
    (label -> each finished repeat's metrics; modes without one are left out: an interrupted
    comparison, whose summary says "interrupted": true), print the table; returns the summary."""
    from psgrad.experiments import analysis, lrgrid, report

    per_mode = {label: ms for label, ms in per_mode.items() if ms}
    modes = [m for m in cfg.modes if m.label in per_mode]
    summary = {label: analysis.aggregate(ms) for label, ms in per_mode.items()}
    for mode in modes:
        summary[mode.label]["lr"] = cfg.mode_lr(mode)
    notes = analysis.nondeterminism_notes([m.label for m in modes])
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
        **({"interrupted": True} if interrupted else {}),
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
    if interrupted:
        sections = ["Interrupted (Ctrl-C): these are the runs that finished before it; the others did not run.",
                    "", *sections]
    report.write_report(cfg.out_dir, summary, command, env_versions, cfg.settings(), notes, cfg.metric, sections)
    log(report.format_table(summary, cfg.metric))
    log(f"wrote {cfg.out_dir}/summary.json, report.md, convergence.png, staleness.png and runs/")
    return document
