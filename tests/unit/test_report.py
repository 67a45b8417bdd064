"""psgrad.experiments.report: the figures are real PNGs of the asked size, and report.md / the table carry every mode."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from psgrad.experiments import report
from psgrad.experiments.analysis import aggregate, load_run, nondeterminism_notes, run_metrics
from test_analysis import STATUS, T0, WORKERS, write_run

pytestmark = pytest.mark.timeout(60)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
COMMAND = "psgrad compare --modes sync,ssp:2 --repeats 2 --target-accuracy 0.75 --seed 7"
SETTINGS = {"workers": 2, "servers": 2, "task": "digits", "steps": 4, "target": 0.75, "repeats": 2,
            "stragglers": "0:4", "jitter": "5 ms", "seed": 7}
VERSIONS = {"python": "3.11.7", "torch": "2.13.0", "grpcio": "1.85.1", "psgrad": "0.1.0", "platform": "Linux-x"}


@pytest.fixture(scope="module")
def summary(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """sync: 2 repeats that reach 0.75 (at 6 s and 12 s); ssp:2: 2 repeats that never reach 0.99."""
    root = tmp_path_factory.mktemp("runs")
    slow = {r: [dict(rec, time=T0 + 2 * (rec["time"] - T0)) for rec in recs] for r, recs in WORKERS.items()}
    repeats = list(enumerate([WORKERS, slow]))
    sync = [run_metrics(load_run(write_run(root / f"sync-r{i}", w, STATUS)), 0.75) for i, w in repeats]
    ssp = [run_metrics(load_run(write_run(root / f"ssp2-r{i}", w, None)), 0.99) for i, w in repeats]
    return {"sync": aggregate(sync), "ssp:2": aggregate(ssp)}


def _check_png(path: Path, size: tuple[int, int]) -> np.ndarray:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > 10_000
    with Image.open(path) as img:
        img.verify()
    with Image.open(path) as img:
        assert img.size == size
        return np.asarray(img.convert("RGB"))


def _has_color(pixels: np.ndarray, hex_color: str, min_pixels: int = 50) -> bool:
    rgb = np.array([int(hex_color[i : i + 2], 16) for i in (1, 3, 5)])
    return int((np.abs(pixels.astype(int) - rgb).sum(axis=2) < 30).sum()) >= min_pixels


def test_convergence_png(tmp_path: Path, summary: dict) -> None:
    sync = summary["sync"]["curves"]
    curves = {"sync": sync, "ssp:2": [[(t, g, a - 0.3, loss + 1) for t, g, a, loss in c] for c in sync]}
    curves["allreduce"] = [[(1.0, 2, 0.6, 1.0), (3.0, 8, 0.9, 0.4)]]  # one repeat: a line, no band
    curves["empty"] = [[]]  # a mode without evaluations must not break the figure
    out = report.plot_convergence(tmp_path / "convergence.png", curves, target=0.75)
    assert out == tmp_path / "convergence.png"
    pixels = _check_png(out, (1440, 1080))  # 12 x 9 inches at 120 dpi
    for color in ("#1f77b4", "#ff7f0e", "#2ca02c"):  # C0, C1, C2: one line per mode
        assert _has_color(pixels, color), color


def test_mean_band_holds_the_last_value_and_skips_before_the_first() -> None:
    a = np.array([[0.0, 0, 0.0, 0.0], [10.0, 10, 1.0, 0.0]])
    b = np.array([[2.0, 0, 0.5, 0.0], [12.0, 10, 0.5, 0.0]])
    grid, mean, low, high = report._mean_band([a, b], 0, 2)
    assert len(grid) == report.GRID_POINTS
    assert (grid[0], grid[-1]) == (pytest.approx(0.0), pytest.approx(12.0))
    assert (mean[0], low[0], high[0]) == (0.0, 0.0, 0.0)  # only repeat a has started
    assert mean[-1] == pytest.approx(0.75)  # a holds its final 1.0 after t = 10
    assert (low[-1], high[-1]) == (pytest.approx(0.5), pytest.approx(1.0))
    i = int(np.argmin(np.abs(grid - 6.0)))
    assert mean[i] == pytest.approx((grid[i] / 10 + 0.5) / 2)
    single, m1, _, _ = report._mean_band([a[:1]], 0, 2)
    assert list(single) == [0.0] and list(m1) == [0.0]


def test_staleness_png(tmp_path: Path, summary: dict) -> None:
    hists = {label: s["staleness_histogram"] for label, s in summary.items()}
    hists["sync-empty"] = {}
    out = report.plot_staleness(tmp_path / "staleness.png", hists)
    pixels = _check_png(out, (960, 936))  # 8 x (1.2 + 2.2 x 3) inches at 120 dpi
    assert _has_color(pixels, "#1f77b4", min_pixels=500)  # the bars


def test_report_md(tmp_path: Path, summary: dict) -> None:
    (tmp_path / "convergence.png").write_bytes(PNG_SIGNATURE)
    notes = nondeterminism_notes(summary)
    path = report.write_report(tmp_path, summary, COMMAND, VERSIONS, SETTINGS, notes)
    assert path == tmp_path / "report.md"
    text = path.read_text()
    assert COMMAND in text
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}
    assert set(rows) == {"mode", "sync", "ssp:2"}
    assert "time to target (s)" in rows["mode"] and "p99" in rows["mode"]
    assert "9.00 ± 4.24 (2/2 reached)" in rows["sync"]  # 6 s and 12 s
    assert "6 ± 0 (2/2 reached)" in rows["sync"]
    assert "0.8500 ± 0.0000" in rows["sync"]  # final test accuracy
    assert "0.79 ± 0.00" in rows["sync"]  # staleness mean 11/14 from status.json
    assert rows["ssp:2"].count("(0/2 reached)") == 2
    assert rows["sync"].count("|") == rows["mode"].count("|") == 11
    for key, value in SETTINGS.items():
        assert f"- {key}: {value}" in text
    for key, value in VERSIONS.items():
        assert f"- {key}: {value}" in text
    for label, note in notes.items():
        assert f"**{label}**: {note}" in text
    assert "![Convergence](convergence.png)" in text
    assert "staleness.png was not written" in text  # no link to a missing figure


def test_format_table(summary: dict) -> None:
    table = report.format_table(summary)
    lines = table.splitlines()
    assert len(lines) == 4  # header, rule, one row per mode
    assert lines[0].startswith("mode") and "samples/s" in lines[0]
    assert set(lines[1]) <= {"-", " "}
    assert lines[2].startswith("sync ") and lines[3].startswith("ssp:2 ")
    assert "(2/2 reached)" in lines[2] and "(0/2 reached)" in lines[3]
    col = lines[0].index("time to target")  # columns are aligned
    assert lines[2][col:].startswith("9.00 ± 4.24") and lines[3][col:].startswith("- (0/2 reached)")


def test_environment_versions() -> None:
    v = report.environment_versions()
    assert list(v) == ["python", "torch", "grpcio", "protobuf", "psgrad", "platform", "cpus"]
    assert all(isinstance(x, str) and x for x in v.values())
