"""`psgrad compare --lr-grid`: each mode at each learning rate (short, seeded runs), and the pick of each mode's best."""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any
from psgrad.config import metric_rises

if TYPE_CHECKING:
    from psgrad.experiments.compare_config import CompareConfig
    from psgrad.experiments.modes import ModeRun

GRID_BY = ("time", "final")
# A grid run's outcome: its metrics (analysis.run_metrics), or None when it failed (diverged, crashed).
Outcome = Mapping[str, Any] | None


def score(outcome: Outcome, metric: str, by: str = "time") -> tuple[int, float]:
    """Sort key of one grid run, smaller is better.

    by "time": runs that reached the target first, by wall time to it; then the others by their
    final value of metric (higher accuracy, lower loss or bits per byte). by "final": the final value
    alone. A failed run, or one whose final value is missing or not finite, comes last.
    """
    if outcome is None:
        return (3, 0.0)
    final = outcome.get(f"final_{metric}")
    if final is None or not math.isfinite(final):
        return (3, 0.0)
    signed = -final if metric_rises(metric) else final
    reached = outcome.get("time_to_target_s")
    if by == "time" and reached is not None:
        return (0, float(reached))
    return (1 if by == "time" else 0, signed)


def pick_best(outcomes: Mapping[float, Outcome], metric: str, by: str = "time") -> float:
    """The lr whose run scores best (see score); ties go to the smaller lr. Raises ValueError on no lrs."""
    if not outcomes:
        raise ValueError("pick_best needs at least one lr")
    return min(sorted(outcomes), key=lambda lr: score(outcomes[lr], metric, by))


RunGrid = Callable[["CompareConfig", "ModeRun", int, Path], "dict[str, Any] | None"]


def run_grid(cfg: CompareConfig, run: RunGrid, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every mode without its own lr= at every lr of cfg.lr_grid for cfg's grid steps, seed cfg.seed.

    run(cfg, mode, seed, run_dir) trains one run and returns its metrics, or None when it failed.
    Returns {"lrs", "steps", "by", "results": {label: {lr: summary}}, "best": {label: lr}}; the
    summaries hold time_to_target_s, the final metric and whether the run failed.
    """
    short = replace(cfg, steps=cfg.grid_steps_or_default, repeats=1, eval_every=0, lr_grid=(), save_weights=False)
    results: dict[str, dict[float, Outcome]] = {}
    for mode in cfg.modes:
        if mode.lr is not None:
            continue
        results[mode.label] = {}
        for lr in cfg.lr_grid:
            run_dir = cfg.out_dir / "runs" / "grid" / f"{mode.slug}-lr{lr:g}"
            outcome = run(short, mode.with_lr(lr), cfg.seed, run_dir)
            results[mode.label][lr] = outcome
            final = None if outcome is None else outcome.get(f"final_{cfg.metric}")
            log(f"grid {mode.label:>10} lr {lr:g}: " + ("failed" if outcome is None else f"final {final}"))
    best = {label: pick_best(res, cfg.metric, cfg.grid_by) for label, res in results.items()}
    return {
        "lrs": list(cfg.lr_grid),
        "steps": short.steps,
        "by": cfg.grid_by,
        "results": {label: {str(lr): _summary(o, cfg.metric) for lr, o in res.items()} for label, res in results.items()},
        "best": best,
    }


def _summary(outcome: Outcome, metric: str) -> dict[str, Any]:
    if outcome is None:
        return {"failed": True, "time_to_target_s": None, f"final_{metric}": None}
    return {"failed": False, "time_to_target_s": outcome.get("time_to_target_s"),
            f"final_{metric}": outcome.get(f"final_{metric}")}


def grid_markdown(grid: Mapping[str, Any], metric: str, scaled: Mapping[str, float] | None = None) -> list[str]:
    """report.md's "Learning-rate grid" section: one row per mode, a cell per lr, the best in bold."""
    lrs: Sequence[float] = grid["lrs"]
    rule = ("the lr whose run reached the target soonest (wall time), else the best final value"
            if grid["by"] == "time" else "the lr with the best final value")
    lines = [
        "## Learning-rate grid", "",
        f"Each mode ran {grid['steps']} steps per worker at each lr (one seed); the comparison then ran each mode "
        f"at its best: {rule}. Cells: final {metric.removeprefix('test_')} / time to target (s); lrs before any "
        "linear scaling.", "",
        "| mode | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | picked |",
        "|---|" + "---|" * (len(lrs) + 1),
    ]
    for label, cells in grid["results"].items():
        row = []
        for lr in lrs:
            cell = cells.get(str(lr), {})
            if cell.get("failed", True):
                text = "failed"
            else:
                final, reached = cell.get(f"final_{metric}"), cell.get("time_to_target_s")
                text = f"{final:.4f}" if final is not None else "-"
                text += f" / {reached:.1f}" if reached is not None else " / not reached"
            row.append(f"**{text}**" if lr == grid["best"][label] else text)
        trained = f" (trains at {scaled[label]:g})" if scaled and scaled.get(label) != grid["best"][label] else ""
        lines.append(f"| {label} | " + " | ".join(row) + f" | {grid['best'][label]:g}{trained} |")
    return lines + [""]
