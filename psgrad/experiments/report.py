"""The `psgrad compare` report: convergence and staleness figures, report.md, and the terminal table."""
from __future__ import annotations

import importlib.metadata
import os
import platform
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: this module only ever writes files

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
from psgrad.config import metric_rises

DPI = 120
CONVERGENCE_SIZE_IN = (12.0, 9.0)  # 1440 x 1080 pixels at DPI
STALENESS_WIDTH_IN = 8.0
GRID_POINTS = 200

# (summary key, column header, decimals, is a time/gradients-to-target column)
COLUMNS: tuple[tuple[str, str, int, bool], ...] = (
    ("time_to_target_s", "time to target (s)", 2, True),
    ("gradients_to_target", "gradients to target", 0, True),
    ("final_test_accuracy", "final test acc", 4, False),
    ("final_test_loss", "final test loss", 4, False),
    ("samples_per_s", "samples/s", 0, False),
    ("staleness_mean", "staleness mean", 2, False),
    ("staleness_p50", "p50", 1, False),
    ("staleness_p99", "p99", 1, False),
    ("staleness_max", "max", 1, False),
)
SETTINGS_ORDER = ("workers", "servers", "task", "steps", "target", "repeats", "stragglers", "jitter", "seed")
VERSIONS_ORDER = ("python", "torch", "grpcio", "psgrad", "platform")

Curve = Sequence[Sequence[float]]  # points (time_s, gradients, the task's metric, test_loss)


def _label(metric: str) -> str:
    """"test_accuracy" -> "test accuracy", "test_bpb" -> "test bits per byte"."""
    return metric.replace("_bpb", " bits per byte").replace("_", " ")


def columns(metric: str = "test_accuracy") -> tuple[tuple[str, str, int, bool], ...]:
    """COLUMNS, with the final value of the task's metric after the accuracy where it is another."""
    if f"final_{metric}" in (key for key, *_ in COLUMNS):
        return COLUMNS
    extra = (f"final_{metric}", f"final {_label(metric)}", 4, False)
    return COLUMNS[:2] + (extra,) + COLUMNS[2:]


def _mean_band(repeats: list[np.ndarray], x: int, y: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Interpolate every repeat (sorted by column x) onto one grid from the earliest to the latest x.

    Before its first point a repeat is left out of the mean, min and max; after its last point it
    holds its last value (the run has ended with that model). Returns grid, mean, min, max.
    """
    lo = min(float(r[0, x]) for r in repeats)
    hi = max(float(r[-1, x]) for r in repeats)
    grid = np.linspace(lo, hi, GRID_POINTS) if hi > lo else np.array([lo])
    ys = np.stack([np.where(grid < r[0, x], np.nan, np.interp(grid, r[:, x], r[:, y])) for r in repeats])
    return grid, np.nanmean(ys, axis=0), np.nanmin(ys, axis=0), np.nanmax(ys, axis=0)


def plot_convergence(
    path: str | Path, curves: Mapping[str, Sequence[Curve]], target: float, metric: str = "test_accuracy"
) -> Path:
    """2x2 figure: the task's metric (test accuracy, or bits per byte) and test loss against wall
    time and against gradients applied.

    One line per mode: the mean over repeats (each repeat interpolated onto a common grid, see
    `_mean_band`), with a min..max band when there are 2+ repeats.
    """
    fig, axes = plt.subplots(2, 2, figsize=CONVERGENCE_SIZE_IN)
    try:
        panels = (  # (axes, x column, y column, x label, y label)
            (axes[0, 0], 0, 2, "wall time since job start (s)", _label(metric)),
            (axes[0, 1], 1, 2, "gradients applied (all workers)", _label(metric)),
            (axes[1, 0], 0, 3, "wall time since job start (s)", "test loss"),
            (axes[1, 1], 1, 3, "gradients applied (all workers)", "test loss"),
        )
        most = 0
        for i, (label, runs) in enumerate(curves.items()):
            repeats = []
            for c in runs:
                arr = np.asarray(c, dtype=float).reshape(-1, 4)
                if len(arr):
                    repeats.append(arr)
            if not repeats:
                continue
            most = max(most, len(repeats))
            for ax, x, y, _, _ in panels:
                ordered = [r[np.argsort(r[:, x], kind="stable")] for r in repeats]
                grid, mean, low, high = _mean_band(ordered, x, y)
                name = f"{label} (n={len(repeats)})"
                ax.plot(grid, mean, color=f"C{i}", label=name, marker="o" if len(grid) == 1 else None)
                if len(repeats) > 1:
                    ax.fill_between(grid, low, high, color=f"C{i}", alpha=0.2, linewidth=0)
        for ax, _, y, xlabel, ylabel in panels:
            if y == 2:
                ax.axhline(target, color="black", linestyle="--", linewidth=1, label=f"target {target:g}")
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
        axes[0, 0].legend(loc="lower right" if metric_rises(metric) else "upper right", fontsize="small")
        band = "; band: min..max over repeats" if most > 1 else ""
        fig.suptitle(f"Convergence by consistency mode (line: mean over repeats{band})")
        fig.tight_layout()
        fig.savefig(path, dpi=DPI, format="png")
    finally:
        plt.close(fig)
    return Path(path)


def plot_staleness(path: str | Path, histograms: Mapping[str, Mapping[Any, int]]) -> Path:
    """One bar chart per mode: the fraction of gradients at each staleness, titled with mean and max.

    The y axis is logarithmic when the nonzero fractions span more than a factor of 50.
    """
    n = max(1, len(histograms))
    fig, axes = plt.subplots(n, 1, sharex=True, squeeze=False, figsize=(STALENESS_WIDTH_IN, 1.2 + 2.2 * n))
    try:
        if not histograms:
            axes[0, 0].text(0.5, 0.5, "no modes", ha="center", va="center", transform=axes[0, 0].transAxes)
        for ax, (label, raw) in zip(axes[:, 0], histograms.items()):
            hist = {int(k): int(v) for k, v in raw.items() if int(v) > 0}
            total = sum(hist.values())
            if not total:
                ax.set_title(f"{label}: no staleness recorded")
                ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
                continue
            values = sorted(hist)
            fractions = [hist[v] / total for v in values]
            mean = sum(k * v for k, v in hist.items()) / total
            ax.bar(values, fractions, width=0.8, color="C0")
            if max(fractions) / min(fractions) > 50:
                ax.set_yscale("log")
            ax.set_title(f"{label}: mean {mean:.2f}, max {max(values)} ({total} gradient-shard updates)")
            ax.set_ylabel("fraction")
            ax.grid(True, axis="y", alpha=0.3)
        axes[-1, 0].set_xlabel("staleness (updates applied between a gradient's pull and its apply)")
        axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
        fig.tight_layout()
        fig.savefig(path, dpi=DPI, format="png")
    finally:
        plt.close(fig)
    return Path(path)


def _cell(entry: Mapping[str, Any] | None, decimals: int, target: bool, repeats: int) -> str:
    if entry is None or entry.get("mean") is None:
        text = "-"
    else:
        text = f"{entry['mean']:.{decimals}f} ± {entry['std']:.{decimals}f}"
    if target:
        reached = entry.get("reached", 0) if entry is not None else 0
        text += f" ({reached}/{repeats} reached)"
    return text


def _has_lr(summary: Mapping[str, Mapping[str, Any]]) -> bool:
    return any(isinstance(agg.get("lr"), float) for agg in summary.values())


def _rows(summary: Mapping[str, Mapping[str, Any]], metric: str) -> list[list[str]]:
    rows = []
    for label, agg in summary.items():
        repeats = int(agg.get("repeats", 0))
        lr = [f"{agg['lr']:g}" if isinstance(agg.get("lr"), float) else "-"] if _has_lr(summary) else []
        rows.append([label, *lr] + [_cell(agg.get(key), d, t, repeats) for key, _, d, t in columns(metric)])
    return rows


def _headers(metric: str, lr: bool = False) -> list[str]:
    return ["mode", *(["lr"] if lr else [])] + [header for _, header, _, _ in columns(metric)]


def format_table(summary: Mapping[str, Mapping[str, Any]], metric: str = "test_accuracy") -> str:
    """The results as an aligned plain-text table, one row per mode (mean ± std over repeats)."""
    table = [_headers(metric, _has_lr(summary))] + _rows(summary, metric)
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def environment_versions() -> dict[str, str]:
    """Python, torch, grpcio and psgrad versions and the platform, read without importing torch."""
    out = {"python": platform.python_version()}
    for dist in ("torch", "grpcio", "protobuf", "psgrad"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "not installed"
    out["platform"] = platform.platform()
    out["cpus"] = str(os.cpu_count())
    return out


def _ordered(items: Mapping[str, Any], order: Sequence[str]) -> list[tuple[str, Any]]:
    first = [(k, items[k]) for k in order if k in items]
    return first + [(k, v) for k, v in items.items() if k not in order]


def write_report(
    out_dir: str | Path,
    summary: Mapping[str, Mapping[str, Any]],
    command: str,
    versions: Mapping[str, str],
    settings: Mapping[str, Any],
    notes: Mapping[str, str],
    metric: str = "test_accuracy",
    sections: Sequence[str] = (),
) -> Path:
    """Write out_dir/report.md: command, settings, results table, the lines of `sections` (e.g. an lr
    grid), figures, reproducibility notes, versions."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# psgrad compare: consistency modes", "", "Command:", "", "```", command, "```", "", "## Settings", ""]
    lines += [f"- {key}: {value}" for key, value in _ordered(settings, SETTINGS_ORDER)]
    lines += ["", "## Results", ""]
    headers = _headers(metric, _has_lr(summary))
    lines.append("| " + " | ".join(headers) + " |")
    lines.append("|" + "---|" * len(headers))
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in _rows(summary, metric)]
    lines += [
        "",
        "Each cell is mean ± sample standard deviation over the repeats; the target columns average "
        "only the repeats that reached the target, and say how many did. Gradients count the pushes "
        "of all workers. Staleness is the servers' count of updates applied between a gradient's pull "
        "and its apply, over every shard a gradient updated.",
        "",
        *sections,
        "## Figures",
        "",
    ]
    for name, title in (("convergence.png", "Convergence"), ("staleness.png", "Staleness")):
        if (out / name).exists():
            lines.append(f"![{title}]({name})")
        else:
            lines.append(f"{title}: {name} was not written.")
        lines.append("")
    lines += ["## Reproducibility", ""]
    lines += [f"- **{label}**: {note}" for label, note in notes.items()]
    lines += ["", "## Versions", ""]
    lines += [f"- {key}: {value}" for key, value in _ordered(versions, VERSIONS_ORDER)]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
