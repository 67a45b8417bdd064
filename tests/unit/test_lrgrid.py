"""psgrad.experiments.lrgrid: how the grid ranks learning rates, runs, and reports."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from psgrad.experiments.compare_config import CompareConfig
from psgrad.experiments.lrgrid import grid_markdown, pick_best, run_grid
from psgrad.experiments.modes import ModeRun, parse_modes

pytestmark = pytest.mark.timeout(60)


def outcome(final: float, reached: float | None = None, metric: str = "test_accuracy") -> dict[str, Any]:
    return {f"final_{metric}": final, "time_to_target_s": reached}


def test_reaching_the_target_sooner_wins_then_the_final_value() -> None:
    runs = {0.01: outcome(0.80), 0.05: outcome(0.93, reached=12.0), 0.1: outcome(0.91, reached=8.0), 0.5: None}
    assert pick_best(runs, "test_accuracy") == 0.1  # soonest to the target, though 0.05 ends higher
    assert pick_best(runs, "test_accuracy", by="final") == 0.05
    nobody = {0.01: outcome(0.80), 0.1: outcome(0.85), 1.0: outcome(math.nan)}
    assert pick_best(nobody, "test_accuracy") == 0.1  # none reached it: the best final accuracy
    lower = {0.001: outcome(3.4, metric="test_bpb"), 0.003: outcome(3.2, metric="test_bpb")}
    assert pick_best(lower, "test_bpb") == 0.003  # bits per byte: lower is better
    assert pick_best({0.2: outcome(0.9), 0.1: outcome(0.9)}, "test_accuracy") == 0.1  # a tie: the smaller lr
    assert pick_best({0.1: None, 0.2: None}, "test_accuracy") == 0.1  # all failed: still an answer
    with pytest.raises(ValueError):
        pick_best({}, "test_accuracy")


def test_run_grid_runs_each_mode_at_each_lr_short_and_reports(tmp_path: Path) -> None:
    cfg = CompareConfig(out_dir=tmp_path, modes=parse_modes("sync,async,ssp:2:lr=0.3"), steps=100, repeats=3,
                        lr_grid=(0.05, 0.2), grid_steps=20, sync_lr_scaling="linear", num_workers=4)
    calls: list[tuple[str, float | None, int, int, Path]] = []

    def fake(short: CompareConfig, mode: ModeRun, seed: int, run_dir: Path) -> dict[str, Any] | None:
        calls.append((mode.label, mode.lr, short.steps, short.repeats, run_dir))
        if mode.label == "async" and mode.lr == 0.2:
            return None  # diverged
        return outcome(0.9 - abs((mode.lr or 0) - 0.05), reached=10.0 if mode.lr == 0.2 else None)

    grid = run_grid(cfg, fake, log=lambda _: None)
    assert [(c[0], c[1], c[2], c[3]) for c in calls] == [
        ("sync", 0.05, 20, 1), ("sync", 0.2, 20, 1), ("async", 0.05, 20, 1), ("async", 0.2, 20, 1)]
    assert calls[0][4] == tmp_path / "runs" / "grid" / "sync-lr0.05"
    assert grid["best"] == {"sync": 0.2, "async": 0.05}  # ssp has its own lr=: not gridded
    assert grid["results"]["async"]["0.2"]["failed"] is True
    md = "\n".join(grid_markdown(grid, "test_accuracy", {"sync": 0.8, "async": 0.05}))
    assert "| sync | 0.9000 / not reached | **0.7500 / 10.0** | 0.2 (trains at 0.8) |" in md
    assert "| async | **0.9000 / not reached** | failed | 0.05 |" in md
    assert "20 steps per worker" in md


def test_run_compare_trains_each_mode_at_its_grid_best_and_reports_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from psgrad.experiments import compare

    seen: list[tuple[str, float, int, int]] = []

    def fake(cfg: CompareConfig, mode: ModeRun, seed: int, run_dir: Path, repeat: int = 0) -> dict[str, Any]:
        lr = cfg.mode_lr(mode)
        seen.append((mode.label, lr, cfg.steps, seed))
        final = 0.95 - abs(lr - (0.2 if mode.mode == "sync" else 0.05))  # sync is best at 0.2, async at 0.05
        return {"time_to_target_s": None, "gradients_to_target": None, "final_test_accuracy": final,
                "final_test_loss": 1 - final, "samples_per_s": 100.0, "staleness_mean": 0.0,
                "staleness_histogram": {0: 4}, "curve": [(0.0, 0, 0.1, 2.0), (1.0, 8, final, 1 - final)]}

    monkeypatch.setattr(compare, "_train", fake)
    cfg = CompareConfig(out_dir=tmp_path, modes=parse_modes("sync,async"), steps=40, repeats=2,
                        lr_grid=(0.05, 0.2), grid_by="final", target=0.99)
    doc = compare.run_compare(cfg, "psgrad compare --lr-grid 0.05,0.2", progress=False, log=lambda _: None)
    assert seen[:4] == [("sync", 0.05, 20, 0), ("sync", 0.2, 20, 0), ("async", 0.05, 20, 0), ("async", 0.2, 20, 0)]
    assert seen[4:] == [("sync", 0.2, 40, 0), ("async", 0.05, 40, 0), ("sync", 0.2, 40, 1), ("async", 0.05, 40, 1)]
    assert doc["lr_grid"]["best"] == {"sync": 0.2, "async": 0.05}
    assert doc["modes"]["sync"]["lr"] == 0.2 and doc["settings"]["lrs"] == {"sync": 0.2, "async": 0.05}
    report = (tmp_path / "report.md").read_text()
    assert "| mode | lr | time to target (s) |" in report and "| sync | 0.2 | " in report
    assert "## Learning-rate grid" in report and "| async | **0.9500 / not reached** | 0.8000 / not reached | 0.05 |" in report
