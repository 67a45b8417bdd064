"""Killing a primary that has a hot-standby backup loses nothing: real processes, kill -9, no
restart; every worker finishes, every push is applied exactly once, sync ends bitwise equal to an
uninterrupted run, and the failover stall is short (benchmarks/faults.py --fault primary --preset tiny)."""
from __future__ import annotations


import pytest

from conftest import run_benchmark


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_job_survives_kill_9_of_a_primary_with_a_backup() -> None:
    out = run_benchmark("faults.py", "--fault", "primary", "--preset", "tiny", timeout_s=400)
    assert out["benchmark"] == "failover" and out["fault"] == "primary"
    rows = {r["mode"]: r for r in out["results"]}
    assert set(rows) == {"sync", "async"}
    # async: every worker's every push, once (the document's worker count is the job's)
    assert rows["async"]["expected_version"] == out["workers"] * out["steps"]
    for row in rows.values():
        assert row["kills"] == 1 and row["every_push_applied_once"], row
        assert row["versions"] == [row["expected_version"]] * 2
        assert row["epochs"] == [1, 0]  # shard 0's backup took over; shard 1 untouched
        # the worst worker's stall at the kill (the bound is 2 s; this shared CI machine gets 3x)
        assert all(s is not None for s in row["stall_s"][0]) and row["stall_s_median"] < 6.0, row
    assert rows["sync"]["weights_bitwise_equal"] is True
    assert rows["sync"]["final_accuracy_with_kills"] == rows["sync"]["final_accuracy_uninterrupted"]
    for mode in ("async", "sync"):
        assert out["throughput"][mode]["best"]["ratio_median"] > 0 and out["throughput"][mode]["mean"]["ratio_median"] > 0
