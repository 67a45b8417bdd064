"""benchmarks/server_bench.py and benchmarks/scaling.py: their helpers (and lib's /proc readings and
measured windows), and their tiny presets end to end (JSON shape and positive figures; no timing
thresholds)."""
from __future__ import annotations

import json
import mmap
import os
import time
import sys
from typing import Any

import pytest
import torch

from conftest import REPO, run_python

sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import scaling  # noqa: E402
import server_bench  # noqa: E402
from lib import procfs, window  # noqa: E402

from psgrad.config import JobSpec  # noqa: E402
from psgrad.core.optimizers import make_optimizer  # noqa: E402

TARGET_KEYS = {"name", "value", "ceiling", "ratio", "target", "better", "met"}


def _run(script: str, *extra: str) -> dict[str, Any]:
    res = run_python([os.path.join("benchmarks", script), "--preset", "tiny", *extra], timeout_s=240,
                     env=dict(os.environ))  # (forked from the preloaded template)
    assert res.returncode == 0, res.stderr[-3000:]
    out: dict[str, Any] = json.loads(res.stdout)  # exactly one JSON document on stdout
    return out


def _check_targets(rows: list[dict[str, Any]]) -> None:
    assert rows
    for row in rows:
        assert TARGET_KEYS <= row.keys(), row
        assert row["better"] in ("higher", "lower")
        assert row["value"] > 0 and row["ceiling"] > 0
        assert row["ratio"] == pytest.approx(row["value"] / row["ceiling"])
        assert row["met"] == (row["ratio"] >= row["target"] if row["better"] == "higher" else row["ratio"] <= row["target"])
    json.dumps(rows, allow_nan=False)


# ----------------------------------------------------------------------------- helpers
@pytest.mark.timeout(30)
def test_in_window_counts_fractions_of_straddling_operations() -> None:
    starts, ends = [0.0, 1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0]
    assert window.in_window(starts, ends, 0.0, 4.0) == pytest.approx(4.0)
    assert window.in_window(starts, ends, 0.5, 2.5) == pytest.approx(2.0)  # half + one + half
    assert window.in_window(starts, ends, 1.25, 1.5) == pytest.approx(0.25)
    assert window.in_window(starts, ends, 5.0, 6.0) == 0.0
    assert window.in_window([], [], 0.0, 1.0) == 0.0


@pytest.mark.timeout(30)
def test_proc_readings_of_this_process() -> None:
    before = procfs.cpu_seconds(os.getpid())
    x = torch.ones(2_000_000)
    # /proc counts CPU time in clock ticks (10 ms): work until one passes, for at most ~5 s of wall time
    deadline = time.monotonic() + 5.0
    while procfs.cpu_seconds(os.getpid()) <= before and time.monotonic() < deadline:
        for _ in range(50):
            x.mul_(1.0001)
    assert procfs.cpu_seconds(os.getpid()) > before
    mem = procfs.memory_bytes(os.getpid())
    assert set(mem) == {"VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem", "own"}
    assert mem["VmHWM"] >= mem["VmRSS"] > 8_000_000  # holds x at least
    assert mem["own"] == mem["RssAnon"] + mem["RssFile"] and mem["RssAnon"] > 8_000_000
    sampler = procfs.OwnPeak({"me": os.getpid()}, interval_s=60.0)
    # 20 MB more, resident when sampled: fresh pages of an anonymous mapping (a tensor can reuse heap
    # pages this process already holds, late in a long-lived test process: its RSS then stays put)
    y = mmap.mmap(-1, 20_000_000, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (a shared one counts as RssShmem)
    y.write(b"\1" * 20_000_000)
    sampler.sample()
    y.close()
    sampler.sample()  # a lower reading leaves the peak
    sampler.stop()
    assert sampler.peak["me"] >= mem["own"] + 15_000_000
    busy = procfs.machine_busy()
    assert 0 <= busy[0] <= busy[1]
    assert 0.0 <= procfs.busy_fraction(busy, procfs.machine_busy()) <= 1.0
    # (readings a tick apart, divided into seconds: 0.02 / 0.02 came out 1.0000000007)
    assert procfs.busy_fraction((115509.05, 147901.32), (115509.07, 147901.34)) == 1.0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("numel", [1000, 3_000_000])
def test_expected_state_bytes_is_what_the_optimizers_hold(numel: int) -> None:
    for name, fields in server_bench.OPTIMIZERS.items():
        opt = make_optimizer(JobSpec(lr=1e-9, **fields), numel)
        opt.apply(torch.zeros(numel), torch.ones(numel))  # momentum allocates its buffer on the first step
        assert server_bench.expected_state_bytes(name, numel) == opt.state_bytes(), name


def _row(shards: int, t: float, w: int, sps: float, cpu_ms: float = 5.0, busy: float = 0.5) -> dict[str, Any]:
    return {"shards": shards, "compute_ms": t, "workers": w, "samples_per_s": sps,
            "ideal_samples_per_s": w * 100.0, "efficiency": sps / (w * 100.0), "comm_ms_median": 5.0,
            "step_ms_median": t + 5.0, "cpu_ms_per_step": cpu_ms, "server_cores_busy": 0.3,
            "workers_cores_busy": 0.2, "machine_busy_fraction": busy}


@pytest.mark.timeout(30)
def test_falloff_finds_the_smallest_compute_time_from_which_the_goal_holds() -> None:
    # One step at T = 0 costs 5 CPU-ms in 5 ms: 4 workers at that pace need 4 cores of 2.
    results = [_row(1, t, 1, 100.0) for t in (0, 10, 50, 100, 200)]
    results += [_row(1, 0, 4, 200.0), _row(1, 10, 4, 380.0), _row(1, 50, 4, 300.0),
                _row(1, 100, 4, 350.0, busy=0.95), _row(1, 200, 4, 390.0)]
    (row,) = scaling.falloff(results, cpus=2)
    assert row["workers"] == 4 and row["shards"] == 1
    assert row["min_compute_ms_for_goal"] == 200  # 10 ms reached 0.95, but 50 ms fell back below
    assert [b["compute_ms"] for b in row["below_goal"]] == [0, 50, 100]
    why = [b["why"] for b in row["below_goal"]]
    assert "psgrad's own CPU cost saturates" in why[0] and "need 4.00 cores" in why[0]
    assert "latency" in why[1] and "need 0.36 cores" in why[1]  # 4 x 5 / 55
    assert "other work" in why[2] and "95%" in why[2]
    targets, figures = scaling.targets_and_figures(results)
    assert [t["name"] for t in targets] == [
        f"scaling: samples/s, 4 workers, 1 shard(s), T = {t} ms" for t in (0, 10, 50, 100, 200)
    ]
    assert [t["met"] for t in targets] == [False, True, False, False, True]
    assert len(figures) == 5  # the single-worker rows


# ----------------------------------------------------------------------------- tiny presets
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_server_bench_tiny() -> None:
    out = _run("server_bench.py")
    assert out["benchmark"] == "server" and out["preset"] == "tiny"
    assert out["payload_bytes"] == 4 * out["params"]
    names = set(server_bench.OPTIMIZERS) | {n + server_bench.GRPC_TAG for n in server_bench.OPTIMIZERS}
    assert set(out["by_workers"]) == {str(w) for w in out["workers"]}
    for by_name in out["by_workers"].values():
        assert set(by_name) == names | {"raw"}
        for name, row in by_name.items():
            assert row["pushes_per_s"] > 0 and row["gb_per_s"] > 0, name
            # (a process's CPU time in /proc moves in the kernel's 10 ms ticks: a tiny preset's 0.25 s
            # window of a server on a loaded machine may fall between two, and read 0)
            assert row["server_cpu_s_per_gb"] >= 0, name
            assert all(r["not_applied"] == 0 for r in row["rounds"]), name
            if name != "raw":
                assert row["peak_rss_bytes"] >= row["peak_own_bytes"] > 0
    assert sum(row["server_cpu_s_per_gb"] for by_name in out["by_workers"].values() for row in by_name.values()) > 0
    assert set(out["memory"]) == names
    assert out["memory"]["adam"]["optimizer_state_bytes"] > out["memory"]["momentum"]["optimizer_state_bytes"] > 0
    assert {n: row["shared_memory"] for n, row in out["memory"].items()} == {n: not n.endswith("]") for n in names}
    _check_targets(out["targets"])
    assert len(out["targets"]) == len(names) * len(out["workers"])
    assert all(t["unit"] == "MB" and t["better"] == "lower" for t in out["targets"])
    for fig in out["figures"]:
        if fig["unit"] == "s/GB":  # (CPU seconds from /proc's 10 ms ticks: a tiny window may read 0, as above)
            assert fig["value"] >= 0 and fig["ceiling"] >= 0, fig["name"]
        else:
            assert fig["value"] > 0 and fig["ceiling"] > 0, fig["name"]
    assert sum(fig["value"] + fig["ceiling"] for fig in out["figures"] if fig["unit"] == "s/GB") > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("shared", [True, False], ids=["same-host", "grpc-only"])
def test_scaling_tiny(shared: bool) -> None:
    out = _run("scaling.py", *([] if shared else ["--no-shared-memory"]))
    assert out["benchmark"] == "scaling" and out["preset"] == "tiny" and out["shared_memory"] is shared
    results = out["results"]
    assert {(r["shards"], r["compute_ms"], r["workers"]) for r in results} == {
        (s, t, w) for s in out["shards"] for t in out["compute_ms"] for w in out["workers"]
    }
    for r in results:
        assert r["samples_per_s"] > 0 and r["step_ms_median"] > 0 and r["efficiency"] > 0
        assert r["step_ms_median"] >= r["compute_ms"]  # a step includes its simulated compute
        if r["workers"] == 1:
            assert r["efficiency"] == pytest.approx(1.0)
    _check_targets(out["targets"])
    assert {f["shards"] for f in out["falloff"]} == set(out["shards"])
    for f in out["falloff"]:
        assert all(b["why"] for b in f["below_goal"])


class _Started(Exception):
    pass


def test_server_bench_window_flag_reaches_every_psgrad_server(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[list[str]] = []

    class Child:
        def __init__(self, name: str, argv: list[str], **kwargs: Any) -> None:
            started.append(list(argv))
            if len(started) == len(server_bench.OPTIMIZERS) * 2:  # each optimizer, same-host and gRPC
                raise _Started

    monkeypatch.setattr(server_bench, "Child", Child)
    monkeypatch.setattr(window, "stop_all", lambda children: None)  # nothing was started
    with pytest.raises(_Started):
        server_bench.measure(1000, (1,), 1, 0.1, 0.1, stream_window_bytes=1 << 20)
    assert len(started) == 6
    for argv in started:
        assert argv[-2:] == ["--stream-window-bytes", str(1 << 20)], argv
