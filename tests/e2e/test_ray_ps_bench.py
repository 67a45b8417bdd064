"""benchmarks/ray_ps.py's tiny preset runs end to end: psgrad beside Ray's actor parameter server
(zero-copy and copy-in), the physical limits and the gRPC target, every figure in one JSON document."""
from __future__ import annotations

import json

import pytest

from conftest import run_python

pytest.importorskip("ray")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.ray
def test_ray_ps_tiny_reports_psgrad_beside_ray_and_the_limits() -> None:
    res = run_python(["benchmarks/ray_ps.py", "--preset", "tiny"], timeout_s=280, env=None)  # (from the template)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert [r["workers"] for r in out["results"]] == [1, 2]
    for r in out["results"]:
        for system in ("psgrad", "ray", "ray_copy_in"):
            assert r[system]["ops_per_s"] > 0 and len(r[system]["reps_ops_per_s"]) == out["reps"]
        assert r["ratio_vs_ray"] == pytest.approx(r["psgrad"]["ops_per_s"] / r["ray"]["ops_per_s"])
    ph = out["physical"]
    assert ph["copy_ms"] > 0 and ph["sgd_apply_ms"] > 0
    assert ph["pull_vs_copy"] == pytest.approx(ph["psgrad_pull_ms"] / ph["copy_ms"])
    assert ph["push_vs_sgd_apply"] == pytest.approx(ph["psgrad_push_ms"] / ph["sgd_apply_ms"])
    assert ph["copy_all_cores_ms"] > 0 and ph["sgd_apply_all_cores_ms"] > 0
    assert ph["push_vs_sgd_apply_all_cores"] == pytest.approx(ph["psgrad_push_ms"] / ph["sgd_apply_all_cores_ms"])
    assert ph["fused_sgd_checked_ms"] > 0  # numba is a dependency: the shard's fused kernel, alone
    assert ph["push_vs_fused_sgd_checked"] == pytest.approx(ph["psgrad_push_ms"] / ph["fused_sgd_checked_ms"])
    assert {f["ceiling_name"] for f in out["figures"]} == {
        "Ray actor PS, copy-in", "w.add_(g)", "torch copy_", "kernels.sgd_checked, two threads"}
    assert out["grpc"]["push_vs_raw_sgd_upload_same_process"] > 0
    assert out["grpc"]["push_vs_raw_copy_upload_same_process"] > 0
    assert out["memory_mb"]["psgrad_server"]["VmRSS"] > 0
    assert out["memory_mb"]["psgrad_ring_mb"] >= 4e6 / 1e6  # at least one published version (1M float32)
    assert {t["ceiling_name"] for t in out["targets"]} == {"Ray actor PS", "torch copy_, all cores", "w.add_(g), all cores"}
    assert len(out["loadavg_before"]) == 3
