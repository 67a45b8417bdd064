"""psgrad.experiments.analysis on hand-made run directories whose answers are worked out by hand below."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest

from psgrad.experiments import analysis
from psgrad.experiments.analysis import aggregate, load_run, nondeterminism_notes, percentile_from_histogram, run_metrics

pytestmark = pytest.mark.timeout(60)

T0 = 1000.0


def _step(rank: int, step: int, t: float, staleness: int, acc: float | None = None, loss: float | None = None) -> dict:
    rec: dict[str, Any] = {
        "time": T0 + t, "rank": rank, "step": step, "clock": step - 1, "loss": 1.0, "step_s": 0.1,
        "compute_s": 0.05, "delay_s": 0.0, "exchange_s": 0.02, "staleness": staleness,
        "accepted": True, "version": [step, step],
    }
    if acc is not None:
        rec.update(test_accuracy=acc, test_loss=loss)
    return rec


def _start(rank: int, t: float, batch: int) -> dict:
    return {"time": T0 + t, "rank": rank, "step": 0, "event": "start", "clock": 0, "batch_size": batch,
            "mode": "async", "slowdown": 1.0, "jitter_ms": 0.0}


def _final(rank: int, t: float, steps: int, acc: float, loss: float) -> dict:
    return {"time": T0 + t, "rank": rank, "step": steps, "event": "final", "steps": steps, "elapsed_s": t,
            "test_loss": loss, "test_accuracy": acc}


# Worker 0 (batch 10): steps at +1, +3 (eval 0.5), +5, +7 (eval 0.8); final at +9 (0.85), written LAST.
# Worker 1 (batch 20): steps at +2, +4 (eval 0.7), +6 (eval 0.9); final at +8 (0.9, higher rank and accuracy).
WORKERS = {
    0: [_start(0, 0.0, 10), _step(0, 1, 1, 0), _step(0, 2, 3, 1, 0.5, 1.5), _step(0, 3, 5, 2),
        _step(0, 4, 7, 0, 0.8, 0.6), _final(0, 9, 4, 0.85, 0.5)],
    1: [_start(1, 0.5, 20), _step(1, 1, 2, 0), _step(1, 2, 4, 0, 0.7, 0.9), _step(1, 3, 6, 5, 0.9, 0.4),
        _final(1, 8, 3, 0.9, 0.3)],
}
# Server histograms (JSON string keys, as status.json stores them): summed {0: 7, 1: 5, 3: 2}, 14 updates.
STATUS = {"shards": [
    {"shard": 0, "pushes_applied": 7, "staleness": {"histogram": {"0": 4, "1": 2, "3": 1}, "max": 3, "mean": 5 / 7}},
    {"shard": 1, "pushes_applied": 7, "staleness": {"histogram": {"0": 3, "1": 3, "3": 1}, "max": 3, "mean": 6 / 7}},
]}


def write_run(path: Path, workers: dict[int, list[dict]], status: dict | None = None) -> Path:
    path.mkdir(parents=True)
    for rank, recs in workers.items():
        (path / f"worker{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    if status is not None:
        (path / "status.json").write_text(json.dumps(status))
    return path


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return write_run(tmp_path / "async-r0", WORKERS, STATUS)


def test_load_run_reads_every_worker_and_the_status(run_dir: Path) -> None:
    run = load_run(run_dir)
    assert run.label == "async-r0" and run.repeat == 0
    assert sorted(run.records) == [0, 1]
    assert len(run.records[0]) == 6 and len(run.records[1]) == 5
    assert run.status is not None and len(run.status["shards"]) == 2
    named = load_run(run_dir, label="async", repeat=3)
    assert (named.label, named.repeat) == ("async", 3)


def test_load_run_without_workers_or_with_a_bad_line(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="worker"):
        load_run(tmp_path / "empty")
    torn = write_run(tmp_path / "torn", {0: WORKERS[0]})
    with open(torn / "worker0.jsonl", "a") as f:
        f.write('{"time": 1010.0, "rank": 0, "st')  # a worker killed mid-write
    assert len(load_run(torn).records[0]) == 6
    bad = write_run(tmp_path / "bad", {0: WORKERS[0]})
    lines = (bad / "worker0.jsonl").read_text().splitlines()
    lines.insert(2, "not json")
    (bad / "worker0.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match="worker0.jsonl:3"):
        load_run(bad)


def test_a_sink_that_appends_keeps_the_records_there_and_drops_a_torn_one(tmp_path: Path) -> None:
    """A resumed job's workers append (before: their files were written anew, the stopped run's steps
    lost); a record the stopped run tore is dropped, so that every line reads back."""
    from psgrad.metrics.jsonl import MetricsSink, read_jsonl

    path = tmp_path / "worker0.jsonl"
    with MetricsSink(path, 0) as sink:
        sink.write(1, loss=1.0)
        sink.write(2, loss=0.5)
    with open(path, "a") as f:
        f.write('{"time": 1010.0, "rank": 0, "st')  # killed mid-write
    with MetricsSink(path, 0, append=True) as sink:
        sink.write(2, event="start", clock=2)
        sink.write(3, loss=0.25)
    assert [(r["step"], r.get("loss")) for r in read_jsonl(path)] == [(1, 1.0), (2, 0.5), (2, None), (3, 0.25)]
    with MetricsSink(tmp_path / "new.jsonl", 0, append=True) as sink:  # (no file yet: a new one)
        sink.write(1, loss=1.0)
    with MetricsSink(path, 0) as sink:  # without append: anew
        sink.write(1, loss=2.0)
    assert [r["loss"] for r in read_jsonl(path)] == [2.0] and len(read_jsonl(tmp_path / "new.jsonl")) == 1


def test_time_and_gradients_to_target_use_merged_workers(run_dir: Path) -> None:
    m = run_metrics(load_run(run_dir), target=0.75)
    # First evaluation >= 0.75 in time order is worker 1's at +6 (worker 0 alone would say +7);
    # step records at or before +6: worker 0 at +1, +3, +5 and worker 1 at +2, +4, +6.
    assert m["time_to_target_s"] == pytest.approx(6.0)
    assert m["gradients_to_target"] == 6
    m2 = run_metrics(load_run(run_dir), target=0.8)  # reached by worker 1 at +6 as well (0.9 >= 0.8)
    assert m2["time_to_target_s"] == pytest.approx(6.0)
    m3 = run_metrics(load_run(run_dir), target=0.5)  # the very first evaluation, at +3 after 3 steps
    assert (m3["time_to_target_s"], m3["gradients_to_target"]) == (pytest.approx(3.0), 3)


def test_target_never_reached_is_none(run_dir: Path) -> None:
    m = run_metrics(load_run(run_dir), target=0.99)
    assert m["time_to_target_s"] is None and m["gradients_to_target"] is None
    agg = aggregate([m, m])
    assert agg["time_to_target_s"] == {"mean": None, "std": None, "n": 0, "reached": 0}
    assert agg["gradients_to_target"]["reached"] == 0
    assert agg["repeats"] == 2


def test_final_is_the_record_written_last(run_dir: Path) -> None:
    m = run_metrics(load_run(run_dir), target=0.75)
    # worker 0's final (+9) is newer than worker 1's (+8), though worker 1 has the higher rank and accuracy
    assert m["final_test_accuracy"] == pytest.approx(0.85)
    assert m["final_test_loss"] == pytest.approx(0.5)


def test_throughput_and_train_time(run_dir: Path) -> None:
    m = run_metrics(load_run(run_dir), target=0.75)
    # (4 steps x 10 + 3 steps x 20) samples between the first start (+0) and the last step record (+7)
    assert m["train_s"] == pytest.approx(7.0)
    assert m["samples_per_s"] == pytest.approx(100 / 7)
    assert m["gradients_total"] == 7


def test_curve_merges_workers_in_time_order(run_dir: Path) -> None:
    curve = run_metrics(load_run(run_dir), target=0.75)["curve"]
    expected = [
        (3.0, 3, 0.5, 1.5), (4.0, 4, 0.7, 0.9), (6.0, 6, 0.9, 0.4), (7.0, 7, 0.8, 0.6),
        (8.0, 7, 0.9, 0.3), (9.0, 7, 0.85, 0.5),  # the two final evaluations
    ]
    assert len(curve) == len(expected)
    for got, want in zip(curve, expected):
        assert got[1] == want[1]
        assert got[0] == pytest.approx(want[0]) and got[2:] == pytest.approx(want[2:])


def test_staleness_from_server_histograms(run_dir: Path) -> None:
    m = run_metrics(load_run(run_dir), target=0.75)
    assert m["staleness_histogram"] == {0: 7, 1: 5, 3: 2}
    assert m["staleness_mean"] == pytest.approx(11 / 14)
    assert m["staleness_p50"] == 0  # rank ceil(7) = 7 is the last 0 (an interpolating median would say 0.5)
    assert m["staleness_p99"] == 3  # rank ceil(13.86) = 14
    assert m["staleness_max"] == 3


def test_staleness_from_records_without_status(tmp_path: Path, run_dir: Path) -> None:
    plain = tmp_path / "allreduce-r0"
    shutil.copytree(run_dir, plain)
    (plain / "status.json").unlink()
    m = run_metrics(load_run(plain), target=0.75)
    # per-step staleness: worker 0 [0, 1, 2, 0], worker 1 [0, 0, 5]
    assert m["staleness_histogram"] == {0: 4, 1: 1, 2: 1, 5: 1}
    assert m["staleness_mean"] == pytest.approx(8 / 7)
    assert (m["staleness_p50"], m["staleness_p99"], m["staleness_max"]) == (0, 5, 5)


@pytest.mark.parametrize(
    ("q", "want"),
    [(0, 1), (50, 1), (98, 1), (98.5, 5), (99, 5), (99.5, 100), (100, 100)],
)
def test_percentile_nearest_rank(q: float, want: int) -> None:
    hist = {100: 1, 1: 98, 5: 1, 7: 0}  # unsorted keys and a zero count on purpose
    assert percentile_from_histogram(hist, q) == want


def test_percentile_rejects_bad_input() -> None:
    assert percentile_from_histogram({4: 1}, 99) == 4
    with pytest.raises(ValueError, match="empty"):
        percentile_from_histogram({}, 50)
    with pytest.raises(ValueError, match="empty"):
        percentile_from_histogram({3: 0}, 50)
    with pytest.raises(ValueError, match="percentile"):
        percentile_from_histogram({1: 1}, 101)


def test_aggregate_mean_std_and_reached() -> None:
    metrics = [
        {"time_to_target_s": 2.0, "gradients_to_target": 10, "final_test_accuracy": 0.9,
         "staleness_histogram": {0: 1}, "curve": [(1.0, 1, 0.5, 1.0)]},
        {"time_to_target_s": 4.0, "gradients_to_target": 20, "final_test_accuracy": 0.8,
         "staleness_histogram": {0: 2, 3: 1}, "curve": []},
        {"time_to_target_s": None, "gradients_to_target": None, "final_test_accuracy": 0.7,
         "staleness_histogram": {"3": 4}, "curve": []},
    ]
    agg = aggregate(metrics)
    assert agg["repeats"] == 3
    t = agg["time_to_target_s"]
    assert (t["mean"], t["n"], t["reached"]) == (pytest.approx(3.0), 2, 2)
    assert t["std"] == pytest.approx(math.sqrt(2.0))  # sample std of {2, 4}
    assert agg["gradients_to_target"]["mean"] == pytest.approx(15.0)
    acc = agg["final_test_accuracy"]
    assert (acc["mean"], acc["std"], acc["n"]) == (pytest.approx(0.8), pytest.approx(0.1), 3)
    assert "reached" not in acc
    assert agg["staleness_histogram"] == {0: 3, 3: 5}
    assert agg["curves"] == [[(1.0, 1, 0.5, 1.0)], [], []]


def test_aggregate_single_repeat_has_zero_std(run_dir: Path) -> None:
    agg = aggregate([run_metrics(load_run(run_dir), target=0.75)])
    assert agg["time_to_target_s"] == {"mean": pytest.approx(6.0), "std": 0.0, "n": 1, "reached": 1}
    assert agg["samples_per_s"]["std"] == 0.0
    assert agg["staleness_p99"]["mean"] == pytest.approx(3.0)
    assert "curve" not in agg and "staleness_histogram" in agg


def test_aggregate_over_two_loaded_repeats(tmp_path: Path) -> None:
    slow = {r: [dict(rec, time=T0 + 2 * (rec["time"] - T0)) for rec in recs] for r, recs in WORKERS.items()}
    a = run_metrics(load_run(write_run(tmp_path / "a", WORKERS, STATUS)), 0.75)
    b = run_metrics(load_run(write_run(tmp_path / "b", slow, STATUS)), 0.75)
    agg = aggregate([a, b])
    assert agg["time_to_target_s"]["mean"] == pytest.approx(9.0)  # 6 s and 12 s
    assert agg["time_to_target_s"]["std"] == pytest.approx(math.sqrt(18.0))
    assert agg["gradients_to_target"] == {"mean": 6.0, "std": 0.0, "n": 2, "reached": 2}
    assert agg["staleness_histogram"] == {0: 14, 1: 10, 3: 4}


def test_nondeterminism_notes() -> None:
    notes = nondeterminism_notes(["sync", "async", "ssp:2", "allreduce", "weird"])
    assert list(notes) == ["sync", "async", "ssp:2", "allreduce", "weird"]
    assert "deterministic" in notes["sync"] and "nondeterministic" not in notes["sync"]
    assert "rank order" in notes["sync"]
    for label in ("async", "ssp:2"):
        assert notes[label].startswith("nondeterministic") and "arrival order" in notes[label]
    assert "expected" in notes["allreduce"] and "not checked" in notes["allreduce"]
    assert "unknown" in notes["weird"]


def test_module_is_pure() -> None:
    source = Path(analysis.__file__).read_text()
    assert "matplotlib" not in source and "import torch" not in source
