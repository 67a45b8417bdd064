"""The benchmark scripts' tiny presets run end to end and print the figures they promise."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO


def _run(*args: str) -> dict:  # type: ignore[type-arg]
    res = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=240, cwd=REPO)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.mark.timeout(300)
def test_transport_tiny_reports_psgrad_beside_raw_grpc() -> None:
    out = _run("benchmarks/transport.py", "--preset", "tiny")
    for key in ("psgrad_push", "psgrad_pull", "raw_upload", "raw_download"):
        assert out["results"][key]["gb_per_s"] > 0
    assert set(out["ratios"]) == {"push_vs_raw_upload", "pull_vs_raw_download"}
    assert out["payload_bytes"] == 4 * out["params"]


@pytest.mark.timeout(300)
def test_fault_recovery_tiny_measures_both_runs() -> None:
    out = _run("benchmarks/fault_recovery.py", "--preset", "tiny", "--modes", "sync")
    (row,) = out["results"]
    assert row["mode"] == "sync" and row["baseline_train_s"] > 0 and row["with_kill_train_s"] > 0
