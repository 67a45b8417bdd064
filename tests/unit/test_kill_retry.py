"""benchmarks/faults.py reruns a job whose kill landed after a worker had finished (a busy machine
lets the job outrun the benchmark's trigger): such a run measured no outage."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import faults  # noqa: E402


def _runs(*stalls: list[Any]) -> tuple[list[Path], Any]:
    seen: list[Path] = []

    def run(directory: Path) -> dict[str, Any]:
        assert directory.is_dir() and directory not in seen  # a fresh directory per run
        seen.append(directory)
        return {"stall_s": stalls[len(seen) - 1], "run": len(seen)}

    return seen, run


@pytest.mark.timeout(30)
def test_a_run_whose_kill_landed_mid_run_is_kept(tmp_path: Path) -> None:
    seen, run = _runs([0.5, 0.7, 0.6])
    out, where = faults._until_mid_run(run, tmp_path)
    assert (out["run"], out["attempts"], where, len(seen)) == (1, 1, seen[0], 1)


@pytest.mark.timeout(30)
def test_a_run_with_a_worker_already_finished_at_a_kill_is_run_again(tmp_path: Path) -> None:
    seen, run = _runs([None, 0.7, 0.6], [[0.5, 0.4, 0.6], [0.9, None, 0.2]], [[0.5, 0.4, 0.6], [0.9, 0.3, 0.2]])
    out, where = faults._until_mid_run(run, tmp_path)
    assert (out["run"], out["attempts"], where) == (3, 3, seen[2])


@pytest.mark.timeout(30)
def test_after_the_last_attempt_the_run_is_returned_as_it_is(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    seen, run = _runs(*[[None, None, None]] * faults.KILL_ATTEMPTS)
    out, _ = faults._until_mid_run(run, tmp_path)
    assert out["attempts"] == faults.KILL_ATTEMPTS == len(seen) and out["stall_s"] == [None, None, None]
    assert capsys.readouterr().err.count("running it again") == faults.KILL_ATTEMPTS - 1
