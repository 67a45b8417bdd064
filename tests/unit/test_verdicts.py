"""psgrad.experiments.verdicts and claims: synthetic summaries -> supported / not supported / not run."""
from __future__ import annotations

from typing import Any

import pytest

from psgrad.experiments.claims import verdicts
from psgrad.experiments.verdicts import (
    NOT_RUN, NOT_SUPPORTED, SUPPORTED, gap_claim, parse_table, table_markdown, time_ratio_claim, weights_claim,
)

pytestmark = pytest.mark.timeout(60)


def mode(time_s: float | None = None, final: float = 0.9, repeats: int = 3, reached: int | None = None,
         std: float = 0.1) -> dict[str, Any]:
    n = repeats if reached is None else reached
    return {"repeats": repeats,
            "time_to_target_s": {"mean": time_s, "std": std if time_s is not None else None, "n": n,
                                 "reached": n if time_s is not None else 0},
            "final_test_accuracy": {"mean": final, "std": 0.002, "n": repeats},
            "final_test_loss": {"mean": 0.3, "std": 0.01, "n": repeats}}


def test_time_ratio_supported_and_not() -> None:
    summary = {"sync": mode(20.0), "ssp:2": mode(10.0), "async": mode(11.0)}
    v = time_ratio_claim("c", "s", summary, ["ssp:2", "async"], "sync", 0.6)
    assert v.verdict == SUPPORTED and "ssp:2/sync = 0.50" in v.check and "async/sync = 0.55" in v.check
    assert "sync: 20.00 ± 0.10 s (3/3 reached)" in v.figures
    slow = {"sync": mode(20.0), "ssp:2": mode(13.0), "async": mode(11.0)}
    v = time_ratio_claim("c", "s", slow, ["ssp:2", "async"], "sync", 0.6)
    assert v.verdict == NOT_SUPPORTED and "ssp:2 took 0.65x sync's time" in v.why


def test_a_seed_that_never_reaches_the_target_is_not_a_ratio() -> None:
    summary = {"sync": mode(20.0), "sync:backup=1": mode(5.0, reached=2)}
    v = time_ratio_claim("c", "s", summary, ["sync:backup=1"], "sync", 0.75)
    assert v.verdict == NOT_SUPPORTED and "did not reach the target in every seed" in v.why
    summary = {"sync": mode(None), "sync:backup=1": mode(5.0)}
    v = time_ratio_claim("c", "s", summary, ["sync:backup=1"], "sync", 0.75)
    assert v.verdict == NOT_SUPPORTED and v.why.startswith("sync did not reach")


def test_gap_recovery() -> None:
    summary = {"sync": mode(final=0.90), "async": mode(final=0.86), "async:slr": mode(final=0.885),
               "async:dc=0.04": mode(final=0.87)}
    v = gap_claim("c", "s", summary, ["async:slr"], "test_accuracy")
    assert v.verdict == SUPPORTED and "async:slr recovers 62%" in v.check
    v = gap_claim("c", "s", summary, ["async:dc=0.04"], "test_accuracy")
    assert v.verdict == NOT_SUPPORTED and "25%" in v.why
    no_gap = {"sync": mode(final=0.90), "async": mode(final=0.91), "async:slr": mode(final=0.92)}
    v = gap_claim("c", "s", no_gap, ["async:slr"], "test_accuracy")
    assert v.verdict == NOT_SUPPORTED and "no gap to recover" in v.why
    bpb = {"sync": {"repeats": 1, "final_test_bpb": {"mean": 3.0, "std": 0.0}},
           "async": {"repeats": 1, "final_test_bpb": {"mean": 3.4, "std": 0.0}},
           "async:slr": {"repeats": 1, "final_test_bpb": {"mean": 3.1, "std": 0.0}}}
    assert gap_claim("c", "s", bpb, ["async:slr"], "test_bpb").verdict == SUPPORTED  # lower is better: 75 %


def test_modes_without_results_are_not_run_and_weights() -> None:
    summary = {"sync": mode(20.0), "async": mode(final=0.8)}
    v = gap_claim("c", "s", summary, ["async:dc=0.04"], "test_accuracy")
    assert v.verdict == NOT_RUN and v.why == "no results for async:dc=0.04"
    v = time_ratio_claim("c", "s", None, ["ssp:auto"], "sync", 0.6)
    assert v.verdict == NOT_RUN and "did not finish" in v.why
    good = {"max_abs_diff": 3e-7, "parameters": 171_000, "steps": 100, "loss_sync": 0.31, "loss_allreduce": 0.31}
    assert weights_claim("c", "s", good).verdict == SUPPORTED
    assert weights_claim("c", "s", dict(good, max_abs_diff=1e-3)).verdict == NOT_SUPPORTED
    assert weights_claim("c", "s", {"error": "not saved"}).why == "not saved"
    far = dict(good, max_abs_diff=0.03)
    assert "the same algorithm, whose rounding" in weights_claim("c", "s", far, control=dict(good, max_abs_diff=0.0)).why
    assert "more than summation order" in weights_claim("c", "s", far, control=far).why


def test_the_preset_table_has_every_claim_and_parses_back() -> None:
    straggle = {"sync": mode(20.0), "sync:backup=1": mode(14.0), "async": mode(9.0), "ssp:2": mode(10.0),
                "ssp:auto": mode(10.5)}
    wide = {"sync": mode(final=0.90), "async": mode(final=0.86), "async:slr": mode(final=0.89),
            "async:dc=0.04": mode(final=0.87), "async:dca=2": mode(final=0.88)}
    weights = {"max_abs_diff": 0.0, "parameters": 10, "steps": 100, "loss_sync": 0.3, "loss_allreduce": 0.3}
    straggle["ssp:auto"].update(staleness_bound_mean={"mean": 5.25, "std": 0.1}, staleness_bound_max={"mean": 8.0})
    tail = {"sync": mode(20.0), "sync:backup=1": mode(12.0), "ssp:2": mode(11.0)}
    results = {"stragglers": straggle, "tail": tail, "workers8": wide}
    rows = verdicts(results, {"allreduce": weights, "allreduce2": weights})
    assert [r.verdict for r in rows] == [SUPPORTED] * 9
    assert rows[2].figures.endswith("ssp:auto's bound: mean 5.2, max 8.0")
    rows = verdicts(dict(results, stragglers=None), {})
    assert [r.verdict for r in rows] == [NOT_RUN, SUPPORTED, NOT_RUN, NOT_RUN, SUPPORTED, SUPPORTED, SUPPORTED,
                                         NOT_SUPPORTED, NOT_SUPPORTED]
    parsed = parse_table("# x\n\n" + "\n".join(table_markdown(rows)) + "\n\nafter\n")
    assert [p["claim"] for p in parsed] == [r.claim for r in rows]
    assert parsed[0]["verdict"].startswith(f"**{NOT_RUN}**") and parsed[1]["verdict"] == "**supported**"


def test_emulation_check_counts_the_steps_whose_compute_overran_the_emulated_step(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from psgrad.experiments.claims import emulation_check

    run = tmp_path / "runs" / "sync-r0"
    run.mkdir(parents=True)
    records = [{"step": 0, "event": "start"}] + [
        {"step": s, "compute_s": c, "delay_s": d} for s, c, d in
        [(1, 0.5, 0.0), (2, 0.02, 0.04), (3, 0.03, 0.03), (4, 0.07, 0.0), (5, 0.01, 0.05)]]
    (run / "worker0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "runs" / "grid").mkdir()  # grid runs are not counted
    check = emulation_check(tmp_path, 60.0)
    assert check == {"step_time_ms": 60.0, "median_compute_ms": pytest.approx(30.0), "overrun_share": 0.25, "steps": 4}
    assert emulation_check(tmp_path, 0.0) is None
