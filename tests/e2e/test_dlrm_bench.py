"""benchmarks/dlrm.py's tiny preset, psgrad alone (TorchRec is no psgrad dependency): both modes
train the DLRM through real servers and report samples/s and a test AUC that learned something;
every layout (a collection, pipelined too) trains the same model in sync mode; TorchRec left out is
reported as skipped, with why."""
from __future__ import annotations

import json
import os

import pytest

from psgrad.wire import row_share

from conftest import run_python


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dlrm_tiny_psgrad_reports_both_modes() -> None:
    res = run_python(["benchmarks/dlrm.py", "--preset", "tiny", "--no-torchrec"], timeout_s=220, env=dict(os.environ))
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    assert out["benchmark"] == "dlrm" and out["preset"] == "tiny"
    assert out["torchrec"]["available"] is False and out["skipped"]["torchrec"] == "--no-torchrec"
    assert 0.5 < out["data"]["bayes_auc"] <= 1.0
    layouts = ["separate", "single", "collection", "collection+pipeline"]
    expected = {f"psgrad {mode} {layout}" for mode in ("sync", "async") for layout in layouts}
    assert set(out["results"]) == expected
    # sync trains one model whatever the tables' layout: the pipeline's rows are read after each update
    sync_auc = {layout: out["results"][f"psgrad sync {layout}"]["test_auc"] for layout in layouts}
    assert max(sync_auc.values()) - min(sync_auc.values()) < 1e-3, sync_auc
    steps, batch = out["config"]["steps"], out["config"]["batch"]
    for key, r in out["results"].items():
        assert r["samples_per_s"] > 0 and r["runs"] == 1, key
        assert 0.5 < r["test_auc"] <= 1.0, key
        assert len(r["transports"]) == 2 and set(r["transports"]) <= {"shm", "grpc"}, key
    for run in out["runs"]:
        assert run["samples"] == 2 * steps * batch and run["window_s"] > 0
        assert run["samples_per_s"] == pytest.approx(run["samples"] / run["window_s"])
        assert set(run["phase_ms_per_step"]) == {"forward", "backward", "step"}
    # The same rows in one table or in several: a sync job computes the same model either way.
    sync = [out["results"][f"psgrad sync {layout}"]["test_auc"] for layout in layouts]
    assert max(sync) - min(sync) < 1e-3
    # Ratios to the single table, none to the TorchRec that did not run.
    assert set(out["ratios"]) == {f"psgrad {mode} {layout} / single" for mode in ("sync", "async")
                                  for layout in layouts if layout != "single"}
    assert len(out["targets"]) == len(out["ratios"])
    assert all(t["ceiling_name"].endswith("single") and t["value"] > 0 for t in out["targets"])
    assert "psgrad sync separate" in res.stderr and "samples/s" in res.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_dlrm_layouts_tiny_reports_each_layouts_cpu_side_by_side(mode: str) -> None:
    """benchmarks/dlrm_layouts.py's tiny preset: two layouts' workers (separate modules and one
    table), each with two servers of its own, step alternately, in the mode asked for (sync: the
    servers' round path); each side's CPU per step is there, by phase, the separate modules'
    forwards were grouped and their bags pooled (none unused), and the ratios are the sides'
    figures over each other."""
    res = run_python(["benchmarks/dlrm_layouts.py", "--preset", "tiny", "--mode", mode], timeout_s=220,
                     env=dict(os.environ))
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    assert out["benchmark"] == "dlrm_layouts" and out["config"]["layouts"] == ["separate", "single"]
    assert out["config"]["mode"] == mode and f"DLRM layouts by CPU, {mode}," in res.stderr
    [rep] = out["repetitions"]
    assert rep["separate"]["mode"] == rep["single"]["mode"] == mode
    for layout in ("separate", "single"):
        main = rep[layout]["main_thread_ms"]
        assert all(main[k] > 0 for k in ("forward", "backward", "step")), main
        assert main["total"] == pytest.approx(main["forward"] + main["backward"] + main["step"])
        assert rep[layout]["servers_ms"] > 0 and rep[layout]["pool_threads_ms"] >= 0
        assert rep[layout]["worker_ms"] == pytest.approx(main["total"] + rep[layout]["pool_threads_ms"])
    steps, features = out["config"]["warmup"] + out["config"]["steps"], out["config"]["features"]
    assert rep["separate"]["prefetch"] == {"grouped": steps - 1, "pooled": (steps - 1) * features, "unused": 0}
    assert rep["single"]["prefetch"]["grouped"] == 0  # (one module: nothing to group)
    ratio = out["ratios"]["separate / single total"]
    assert ratio == pytest.approx(rep["separate"]["main_thread_ms"]["total"] / rep["single"]["main_thread_ms"]["total"])
    assert out["ratios"]["separate / single worker"] == pytest.approx(rep["separate"]["worker_ms"] / rep["single"]["worker_ms"])
    assert "separate / single" in res.stderr
    if mode == "sync":
        return  # (the refusals below: once)
    bad = run_python(["benchmarks/dlrm_layouts.py", "--layouts", "separate"], timeout_s=60, env=dict(os.environ))
    assert bad.returncode == 2 and "two different layouts" in bad.stderr
    bad = run_python(["benchmarks/dlrm_layouts.py", "--layouts", "single,single"], timeout_s=60, env=dict(os.environ))
    assert bad.returncode == 2 and "one twice with --off" in bad.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dlrm_layouts_measures_a_layout_against_the_model_in_plain_pytorch() -> None:
    """--layouts separate,local: the second side is the same model with torch.nn.EmbeddingBag tables
    and torch's Adagrad in the benchmark's process: its phases are timed as psgrad's are, it has
    no servers (no servers ratio), and --off, which names a switch of psgrad's client, is refused
    for it."""
    res = run_python(["benchmarks/dlrm_layouts.py", "--preset", "tiny", "--layouts", "separate,local"],
                     timeout_s=220, env=dict(os.environ))
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    [rep] = out["repetitions"]
    local, separate = rep["local"], rep["separate"]
    assert all(local["main_thread_ms"][k] > 0 for k in ("forward", "backward", "step")), local
    assert local["servers_ms"] == 0 and local["pool_threads_ms"] == 0 and local["prefetch"] is None
    assert separate["servers_ms"] > 0
    assert out["ratios"]["separate / local servers"] is None
    assert out["ratios"]["separate / local worker"] == pytest.approx(separate["worker_ms"] / local["worker_ms"])
    bad = run_python(["benchmarks/dlrm_layouts.py", "--preset", "tiny", "--layouts", "separate,local",
                      "--off", "_staged_reads"], timeout_s=60, env=dict(os.environ))
    assert bad.returncode == 2 and "local side has no psgrad client" in bad.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dlrm_layouts_off_measures_one_layout_against_itself_with_a_client_switch_off() -> None:
    """--layouts separate,separate --off rows_in_place: the second side's worker connects with
    ClientConfig(rows_in_place=False) and reads its rows through calls, the first one reads them in
    place (its servers share its host); a switch the client does not have is refused by name."""
    res = run_python(["benchmarks/dlrm_layouts.py", "--preset", "tiny", "--layouts", "separate,separate",
                      "--off", "rows_in_place"], timeout_s=220, env=dict(os.environ))
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    [rep] = out["repetitions"]
    on, off = rep["separate"], rep["separate (rows_in_place off)"]
    assert off["rows_read_in_place"] == 0, off
    if row_share.supported():  # (x86-64)
        assert on["rows_read_in_place"] > 0, on
    assert out["config"]["off"] == "rows_in_place" and "separate / separate (rows_in_place off) worker" in out["ratios"]
    bad = run_python(["benchmarks/dlrm_layouts.py", "--preset", "tiny", "--layouts", "separate,separate",
                      "--off", "no_such_switch"], timeout_s=120, env=dict(os.environ))
    assert bad.returncode != 0 and "no_such_switch" in bad.stderr and "no such switch" in bad.stderr
