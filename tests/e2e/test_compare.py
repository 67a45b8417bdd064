"""`psgrad compare` end to end (tiny runs with real processes) and its argument parsing."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from psgrad.experiments.compare import worker_argv
from psgrad.experiments.compare_config import CompareConfig
from psgrad.experiments.modes import ModeRun, parse_modes
from psgrad.errors import ConfigError


def test_parse_modes() -> None:
    assert parse_modes("sync,async,ssp:2,allreduce") == (
        ModeRun("sync", "sync"), ModeRun("async", "async"), ModeRun("ssp:2", "ssp", 2), ModeRun("allreduce", "allreduce"),
    )
    for bad in ("bsp", "ssp", "ssp:x", "sync:1", "sync,sync", ""):
        with pytest.raises(ConfigError):
            parse_modes(bad)


def test_a_bad_variant_or_preset_flag_is_a_usage_error_naming_it(tmp_path: Path) -> None:
    res = run_cli(["compare", "--modes", "sync,async:backup=1", "--out", str(tmp_path / "x")])
    assert res.returncode == 2 and "mode 'async:backup=1' in --modes: 'backup=1' is not an option of async" in res.stderr
    res = run_cli(["compare", "--quick", "--out", str(tmp_path / "x")])
    assert res.returncode == 2 and "--quick shrinks --preset claims" in res.stderr
    res = run_cli(["compare", "--slow-node-rotate", "10", "--out", str(tmp_path / "x")])
    assert res.returncode == 2 and "give exactly one --straggler" in res.stderr
    assert not (tmp_path / "x").exists()


def test_the_optimizer_reaches_every_run_the_allreduce_baselines_too(tmp_path: Path) -> None:
    cfg = CompareConfig(out_dir=tmp_path, modes=parse_modes("sync,async,allreduce"), optimizer="adagrad", lr=0.05)
    for mode in cfg.modes:
        args = worker_argv(cfg, mode, seed=0, rank=0, run_dir=tmp_path, servers="127.0.0.1:1")
        assert args[args.index("--optimizer") + 1] == "adagrad"


@pytest.mark.parametrize("name, cls", [("sgd", torch.optim.SGD), ("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW),
                                       ("adagrad", torch.optim.Adagrad), ("rmsprop", torch.optim.RMSprop),
                                       ("adadelta", torch.optim.Adadelta)])
def test_the_allreduce_baseline_applies_the_jobs_optimizer_with_its_settings(name: str, cls: type) -> None:
    from psgrad.config import JobSpec
    from psgrad.experiments.allreduce import torch_optimizer

    spec = JobSpec(optimizer=name, lr=0.03, weight_decay=0.01, **({} if name == "sgd" else {"eps": 1e-7}))
    opt = torch_optimizer(spec, [torch.zeros(3, requires_grad=True)])
    group = opt.param_groups[0]
    assert type(opt) is cls and group["lr"] == 0.03 and group["weight_decay"] == 0.01
    assert name == "sgd" or group["eps"] == 1e-7


@pytest.mark.slow
@pytest.mark.timeout(720)
def test_tiny_comparison_writes_every_artifact_and_ctrl_c_keeps_the_finished_runs_which_repeat_it(tmp_path: Path) -> None:
    """Three tests merged, two comparisons instead of four (each run starts a server and 3 workers):
    a tiny comparison writes every artifact (below); a second one, interrupted, keeps what its finished
    run found (assert_ctrl_c_keeps_the_summary); and that run (plain, no straggler, 2 ms jitter)
    repeats the first one's sync run (TLS, a 2x straggler, 1 ms jitter) bitwise: sync is reproducible
    given the seed whatever the timing and the transport. 3 workers, so that summing in arrival order
    would show (two gradients sum to the same float in either order)."""
    out = tmp_path / "cmp"
    res = run_cli(
        ["compare", "--modes", "sync,async", "--num-servers", "1", "--num-workers", "3", "--steps", "40", "--seed", "7",
         "--target-accuracy", "0.5", "--straggler", "1:2", "--jitter-ms", "1", "--repeats", "1", "--out", str(out),
         "--tensorboard", str(tmp_path / "tb"),
         "--tls"],  # every run secured: fresh credentials each, the final status read as the admin
        timeout_s=280,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "sync, async x 1 repeat(s) = 2 runs" in res.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["modes"]) == {"sync", "async"}
    for label, s in summary["modes"].items():
        for key in ("time_to_target_s", "gradients_to_target", "final_test_accuracy", "final_test_loss",
                    "samples_per_s", "staleness_mean", "staleness_p50", "staleness_p99", "staleness_max"):
            assert {"mean", "std", "n"} <= set(s[key]), (label, key)
        assert 0.0 < s["final_test_accuracy"]["mean"] <= 1.0
    assert summary["modes"]["sync"]["staleness_max"]["mean"] == 0
    assert summary["settings"]["stragglers"] == {"1": 2.0} and summary["settings"]["jitter_ms"] == 1.0
    assert summary["settings"]["security"] == "tls"
    assert summary["command"].startswith("psgrad compare --modes sync,async")
    report = (out / "report.md").read_text()
    assert "| sync" in report and "| async" in report and summary["command"] in report
    for png in ("convergence.png", "staleness.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    for run in ("sync-r0", "async-r0"):
        for rank in range(3):
            lines = (out / "runs" / run / f"worker{rank}.jsonl").read_text().splitlines()
            records = [json.loads(line) for line in lines]
            assert records[0]["event"] == "start" and records[-1]["event"] == "final"
        assert json.loads((out / "runs" / run / "status.json").read_text())["shards"]
    assert_tensorboard_has_every_step(tmp_path / "tb", out / "runs")
    slow = [json.loads(line) for line in (out / "runs" / "sync-r0" / "worker1.jsonl").read_text().splitlines()]
    assert slow[0]["slowdown"] == 2.0
    assert all(r["delay_s"] >= r["compute_s"] * 0.99 for r in slow if "delay_s" in r)  # 2x: waits 1x compute
    assert "sync" in res.stdout and "final test acc" in res.stdout  # the table printed at the end

    again = tmp_path / "again"
    assert_ctrl_c_keeps_the_summary(again, ["--num-workers", "3", "--steps", "40", "--seed", "7", "--jitter-ms", "2"])
    curves = [[_curve(d / "runs" / "sync-r0" / f"worker{r}.jsonl") for r in range(3)] for d in (out, again)]
    assert curves[0] == curves[1]  # bitwise: same losses and accuracies at every step, every worker


def assert_ctrl_c_keeps_the_summary(out: Path, job: list[str]) -> None:
    """SIGINT threw away what the finished runs found (no summary.json); it is written for them
    (marked "interrupted"), then compare exits 130. The signal is sent once the first run reported
    its result, while the second one is still starting its processes."""
    import signal

    from conftest import spawn

    proc = spawn(["compare", "--modes", "sync,async", "--num-servers", "1", *job, "--target", "0.3", "--repeats", "1",
                  "--out", str(out)])
    try:
        proc.wait_for_line("sync repeat 1:", timeout_s=280)
        proc.popen.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130, proc.output
    finally:
        proc.stop(grace_s=5)
    assert "interrupted after 1 of 2 run(s); summarizing those" in proc.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True and set(summary["modes"]) == {"sync"}, summary["modes"].keys()
    assert summary["modes"]["sync"]["repeats"] == 1 and 0.0 < summary["modes"]["sync"]["final_test_accuracy"]["mean"]
    report = (out / "report.md").read_text()
    assert "Interrupted (Ctrl-C)" in report and "| sync" in report and "| async" not in report
    assert (out / "convergence.png").exists() and (out / "staleness.png").exists()


def assert_tensorboard_has_every_step(board: Path, runs: Path) -> None:
    """compare --tensorboard: each run's workers under BOARD/RUN/workerR, their loss and lr the JSONL's."""
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    assert sorted(p.name for p in board.iterdir()) == ["async-r0", "sync-r0"]
    for run in ("sync-r0", "async-r0"):
        for rank in range(3):
            acc = event_accumulator.EventAccumulator(str(board / run / f"worker{rank}"))
            acc.Reload()
            steps = [json.loads(line) for line in (runs / run / f"worker{rank}.jsonl").read_text().splitlines()]
            steps = [r for r in steps if "loss" in r]
            losses = acc.Scalars("train/loss")
            assert [e.step for e in losses] == [r["step"] for r in steps]
            assert [e.value for e in losses] == pytest.approx([r["loss"] for r in steps], rel=1e-6)
            assert [e.value for e in acc.Scalars("train/lr")] == pytest.approx([r["lr"] for r in steps])


def _curve(path: Path) -> list[tuple[int, float, float]]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [(r["step"], r["loss"], r.get("test_accuracy", -1.0)) for r in records if "loss" in r]


def test_every_run_is_launched_with_its_mode_and_the_comparison_settings(tmp_path: Path) -> None:
    from psgrad.cli import flags
    from psgrad.cli.parser import build_parser

    cfg = CompareConfig(out_dir=tmp_path, modes=parse_modes("sync,ssp:3,allreduce"), stragglers=((1, 2.0),), jitter_ms=1.0)
    for mode in cfg.modes:
        for rank in range(2):
            if mode.mode == "allreduce":
                ns = build_parser().parse_args(["allreduce", "--store", "s", *worker_argv(cfg, mode, 5, rank, tmp_path)])
            else:
                ns = build_parser().parse_args(["worker", *worker_argv(cfg, mode, 5, rank, tmp_path, "127.0.0.1:1,127.0.0.1:2")])
            spec = flags.job_spec(ns, ns.num_workers, cfg.num_servers)
            assert spec == cfg.job_spec(mode)
            assert (spec.mode, spec.staleness) == (("sync", 0) if mode.mode == "allreduce" else (mode.mode, mode.staleness))
            config = flags.worker_config(ns, getattr(ns, "servers", ()), flags.client_config(ns), ns.rank, ns.slowdown, ns.metrics_out)
            assert config == cfg.worker_config(5, rank, tmp_path, getattr(ns, "servers", ()))
            assert (config.rank, config.seed, config.device, config.slowdown) == (rank, 5, "cpu", 2.0 if rank else 1.0)
            assert config.metrics_out == str(tmp_path / f"worker{rank}.jsonl") and config.log_every == cfg.steps


def test_a_spec_the_runs_cannot_have_is_refused_before_any_run(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="momentum applies only to optimizer 'sgd'"):
        CompareConfig(out_dir=tmp_path, optimizer="adam", momentum=0.9)


def claims_quick_report_is_complete(out: Path) -> None:
    """What `psgrad compare --preset claims --quick --out OUT` wrote: every claim has a row with parsed
    figures (what the rows say is not checked: quick mode is too small to test the claims). Nine runs
    (one per mode the claims compare), each a server and two workers: 193 s at CI's load.

    docs/guide/compare.md runs that command as a block of the page, and tests/e2e/test_doc_examples.py
    checks its output with this function (one run of the preset in the suite, not two)."""
    from psgrad.experiments.verdicts import NOT_SUPPORTED, SUPPORTED, parse_table

    report = (out / "report.md").read_text()
    rows = parse_table(report)
    assert [r["source"] for r in rows] == [
        "Ho et al., NIPS'13", "Ho et al., NIPS'13", "psgrad (--staleness auto)", "Chen et al., 2016",
        "Chen et al., 2016", "Zhang et al., IJCAI'16",
        "Zheng et al., ICML'17 (DC-ASGD)", "psgrad (float summation order aside)", "psgrad (control)"]
    claims = json.loads((out / "claims.json").read_text())
    assert [c["claim"] for c in claims["claims"]] == [r["claim"] for r in rows]
    for row, claim in zip(rows, claims["claims"]):
        assert claim["verdict"] in (SUPPORTED, NOT_SUPPORTED), claim  # every mode ran
        assert row["verdict"].startswith(f"**{claim['verdict']}**")
        assert claim["figures"] != "-" and claim["check"], claim
    ssp = claims["claims"][0]
    assert "sync: " in ssp["figures"] and " s (1/1 reached)" in ssp["figures"]  # mean ± std and how many reached
    assert "ssp:2/sync = " in ssp["check"]
    assert claims["weights"]["allreduce"]["max_abs_diff"] >= 0.0 and claims["weights"]["allreduce2"]["steps"] == 30
    assert "Quick mode" in report and "![stragglers: convergence](quick/convergence.png)" in report
    assert (out / "quick" / "convergence.png").read_bytes()[:4] == b"\x89PNG"
    assert claims["wall_s"] > 0 and len(claims["loadavg_start"]) == 3
    # quick mode also runs the straggler models: they reach every worker, and the report records them
    start = json.loads((out / "quick" / "runs" / "async-r0" / "worker1.jsonl").read_text().splitlines()[0])
    assert start["event"] == "start" and start["slowdown"] == 2.0
    assert start["straggler_model"] == ("Pareto slow steps (alpha 3); the slow node moves to the next rank every "
                                        "10 steps, from rank 0")
    assert "Pareto slow steps" in (out / "quick" / "report.md").read_text()
