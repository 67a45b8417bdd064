"""benchmarks/tables_path.py's tiny preset runs end to end, beside a second copy of psgrad loaded into
the same process (--against: here this checkout again, as a worktree of another commit would be),
and reports every part for both layouts and both copies; a bad --against is refused by name."""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_benchmark, run_python

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_tables_path_tiny_reports_every_part_for_both_copies() -> None:
    out = run_benchmark("tables_path.py", "--preset", "tiny", "--reps", "2", "--against", str(REPO), timeout_s=100)
    assert out["benchmark"] == "tables_path" and out["params"]["features"] == 4
    expected = {f"{tag} {part} {layout}" for tag in ("this", "against")
                for part in ("shard-warm", "shard-new", "worker") for layout in ("tables", "one")}
    assert set(out["ms"]) == expected
    assert all(len(runs) == 2 and min(runs) > 0 for runs in out["runs_ms"].values()), out["runs_ms"]


@pytest.mark.timeout(60)
def test_tables_path_refuses_a_checkout_without_psgrad(tmp_path: Path) -> None:
    res = run_python(["benchmarks/tables_path.py", "--preset", "tiny", "--against", str(tmp_path)], timeout_s=50)
    assert res.returncode != 0 and "no psgrad package there" in res.stderr, res.stderr[-2000:]
