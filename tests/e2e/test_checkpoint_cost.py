"""benchmarks/feature_cost.py --feature checkpoint --preset tiny runs end to end: both servers
measured in alternating rounds, checkpoints really written inside the checkpointing server's rounds,
and the snapshot, save and load timed beside their ceilings (structure and sanity only, no timing
assertions)."""
from __future__ import annotations


import pytest

from conftest import run_benchmark


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_checkpoint_cost_tiny_measures_with_and_without_checkpoints() -> None:
    out = run_benchmark("feature_cost.py", "--feature", "checkpoint", "--preset", "tiny", timeout_s=100)
    assert out["benchmark"] == "checkpoint_cost" and out["feature"] == "checkpoint" and out["preset"] == "tiny"

    tp = out["throughput"]
    assert tp["payload_bytes"] == 4 * tp["params"] and tp["path"] == "gRPC"
    for key in ("no_checkpoints", "checkpoints"):
        assert tp["gb_per_s"][key] > 0
        rounds = tp["rounds"][key]
        assert len(rounds) == tp["reps"] and all(r["iters"] >= 1 and r["seconds"] >= tp["round_s"] for r in rounds)
        assert len(tp["round_gb_per_s"][key]) == tp["reps"]
    assert tp["ratio"] == pytest.approx(tp["gb_per_s"]["checkpoints"] / tp["gb_per_s"]["no_checkpoints"])
    assert len(tp["ratio_per_rep"]) == tp["reps"] and all(r > 0 for r in tp["ratio_per_rep"])
    assert min(tp["ratio_per_rep"]) <= tp["ratio_median_per_rep"] <= max(tp["ratio_per_rep"])
    assert tp["met"] == (tp["ratio"] >= tp["goal"])
    # Checkpoints were written during the measured rounds (each round is 3 x the interval), and the
    # files hold the whole model.
    assert tp["checkpoints_written"] >= 2 and sum(tp["checkpoints_per_round"]) == tp["checkpoints_written"]
    assert len(tp["checkpoints_per_round"]) == tp["reps"]
    assert tp["measured_s_per_checkpoint"] == pytest.approx(tp["measured_s"] / tp["checkpoints_written"])
    assert tp["checkpoint_file_bytes"] > tp["payload_bytes"]
    versions = [m["version"] for m in tp["manifests_seen"] if "version" in m]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)

    wr = out["write"]
    assert wr["optimizer"] == "adam" and wr["state_bytes"] == 3 * 4 * wr["params"]
    assert wr["checkpoint_file_bytes"] > wr["state_bytes"]
    assert wr["roundtrip_exact"] is True and wr["checkpoints_kept"] == 2
    for key in ("snapshot", "memcpy_fresh", "memcpy_reused", "save", "plain_write", "load", "load_and_restore",
                "plain_read", "sha256"):
        assert len(wr["samples_s"][key]) == wr["reps"] and wr["median_s"][key] > 0
    assert all(r > 0 for r in wr["ratios"].values())
    assert set(wr["cpu_s"]) == {"snapshot", "save", "load_and_restore"} and all(c >= 0 for c in wr["cpu_s"].values())

    (row,) = out["targets"]
    assert row["ratio"] == pytest.approx(tp["ratio"]) and row["better"] == "higher"
    assert len(out["figures"]) == 4
    for fig in out["figures"][:3]:
        assert fig["value"] > 0 and fig["ceiling"] > 0 and fig["ratio"] > 0
