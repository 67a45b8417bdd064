"""benchmarks/dlrm.py's run-by-run ratios: each psgrad run over the TorchRec runs beside it in time,
and a layout's over the single table's run of its repetition, so that a machine's slow phase,
which slows both sides of a pair, does not read as a ratio above or below the goal."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import dlrm  # noqa: E402

pytestmark = pytest.mark.timeout(60)


def _run(key: str, rep: int, speed: float, auc: float = 0.83) -> dict:
    if key == dlrm.TORCHREC:
        system, mode, layout = dlrm.TORCHREC, "sync", "table-wise"
    else:
        system, mode, layout = key.split()
    cpu = {"workers": 1.0, "servers": 1.0}
    return {"key": key, "rep": rep, "system": system, "mode": mode, "layout": layout, "samples_per_s": speed,
            "test_auc": auc, "cpu_ms_per_1k_samples": cpu, "transports": ["shm", "shm"]}


def _runs() -> list[dict]:
    # Two repetitions, the second in reverse order, the machine twice as fast in the second: each
    # psgrad run is 1.1 x the TorchRec runs beside it, separate 0.9 x single, in both.
    sep, single, tr = "psgrad sync separate", "psgrad sync single", dlrm.TORCHREC
    return [_run(sep, 1, 99.0), _run(tr, 1, 90.0), _run(single, 1, 110.0), _run(tr, 1, 100.0),
            _run(tr, 2, 200.0), _run(single, 2, 220.0), _run(tr, 2, 200.0), _run(sep, 2, 198.0)]


def test_each_run_is_paired_with_the_torchrec_runs_beside_it_and_the_single_table_of_its_repetition() -> None:
    pairs = dlrm.paired_ratios(_runs())
    assert set(pairs) == {"psgrad sync separate", "psgrad sync single"}
    assert pairs["psgrad sync separate"]["torchrec"] == pytest.approx([1.1, 0.99])  # 99/90; 198/200 (one neighbor)
    assert pairs["psgrad sync single"]["torchrec"] == pytest.approx([110 / 95, 1.1])  # 110/95; 220/200
    assert pairs["psgrad sync separate"]["single"] == pytest.approx([0.9, 0.9])
    assert pairs["psgrad sync single"]["single"] == []


def test_the_goals_carry_the_run_by_run_ratios_beside_the_ratio_of_medians() -> None:
    runs = _runs()
    results = dlrm.summarize_runs(runs)
    ratios, targets = dlrm.compare(results, dlrm.paired_ratios(runs))
    # The medians mix the slow and the fast phase: 148.5 / 150 for separate over TorchRec.
    vs_torchrec = ratios["psgrad sync separate / torchrec"]
    assert vs_torchrec["samples_per_s"] == pytest.approx(148.5 / 150.0)
    assert vs_torchrec["paired"]["n"] == 2 and vs_torchrec["paired"]["at_goal"] == 1
    assert vs_torchrec["paired"]["min"] == pytest.approx(0.99) and vs_torchrec["paired"]["max"] == pytest.approx(1.1)
    layout = ratios["psgrad sync separate / single"]["paired"]
    assert layout["median"] == pytest.approx(0.9) and layout["at_goal"] == 2  # (0.9 >= the 0.9 goal)
    goal = next(t for t in targets if t["name"] == "DLRM samples/s, psgrad sync separate vs TorchRec DMP table-wise")
    assert goal["paired"] is vs_torchrec["paired"]
    doc = {"config": {"features": 8, "rows": 10, "dim": 4, "batch": 2, "steps": 1, "warmup": 0, "reps": 2},
           "data": {"bayes_auc": 0.9}, "results": results, "ratios": ratios, "targets": targets, "skipped": {}}
    text = dlrm.table(doc)
    assert "run by run, beside its peer: 0.99-1.10, median 1.04, 1 of 2 at the goal" in text


def test_without_pairs_the_ratios_of_medians_stand_alone() -> None:
    results = dlrm.summarize_runs(_runs())
    ratios, targets = dlrm.compare(results)
    assert all("paired" not in r for r in ratios.values()) and all("paired" not in t for t in targets)
