"""The benchmark scripts' tiny presets run end to end and print the figures they promise; the
suite's plumbing and benchmarks/lib (child processes, statistics, target rows, ceilings, Markdown)
behave."""
from __future__ import annotations

import json
import math
import os
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from conftest import REPO, once_per_run, run_python

BENCH = Path(REPO) / "benchmarks"
sys.path.insert(0, str(BENCH))

import lib  # noqa: E402
import suite  # noqa: E402
from lib import ceilings, raw_grpc  # noqa: E402


def _run(*args: str) -> dict:  # type: ignore[type-arg]
    res = run_python(args, env=dict(os.environ))
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


SCRIPTS = sorted(p.name for p in BENCH.glob("*.py"))
# Every parser a script builds answers for each of its flags (help=SUPPRESS: internal, for its children),
# and `--help` answers before the script starts any process (attacks.py ran its whole benchmark first).
# One process checks every script in turn (each run as `python SCRIPT --help` would run it), printing
# one JSON line per script: a process per script spent most of its time importing torch again.
_HELP_CHECK = """
import argparse, json, runpy, subprocess, sys, traceback
from psgrad.launch import template
sys.path.insert(0, sys.argv[1])
def parse_args(self, *args, **kwargs):
    undescribed = [a.option_strings for a in self._actions
                   if a.option_strings and a.help != argparse.SUPPRESS and not (a.help or "").strip()]
    raise SystemExit(json.dumps({"undescribed": undescribed, "help": self.format_help()}))
def started(*args, **kwargs):
    raise RuntimeError("it started a process before parsing its arguments")
argparse.ArgumentParser.parse_args = parse_args
subprocess.Popen.__init__ = started
template.Template.spawn = started
for script in sys.argv[2:]:
    sys.argv = [script, "--help"]
    try:
        runpy.run_path(script, run_name="__main__")
        out = {"error": "it exited without parsing its arguments"}
    except SystemExit as exc:
        out = json.loads(exc.code) if isinstance(exc.code, str) and exc.code.startswith("{") else \
            {"error": f"SystemExit({exc.code!r}) before parsing its arguments"}
    except BaseException:
        out = {"error": traceback.format_exc()}
    print(json.dumps({"script": script, **out}), flush=True)
"""


@pytest.fixture(scope="module")
def every_scripts_help(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """{script: {"undescribed": [...], "help": TEXT} or {"error": ...}}: every script's `--help`, from one
    process (forked from the preloaded template), once per test run."""
    def compute() -> dict[str, dict[str, Any]]:
        res = run_python(["-c", _HELP_CHECK, str(BENCH), *(str(BENCH / s) for s in SCRIPTS)], timeout_s=250)
        assert res.returncode == 0, res.stderr[-3000:]
        lines = [json.loads(line) for line in res.stdout.splitlines() if line.startswith('{"script": ')]
        return {Path(line.pop("script")).name: line for line in lines}

    return once_per_run("benchmark-helps", compute, tmp_path_factory)  # type: ignore[no-any-return]


@pytest.mark.timeout(300)  # it may check every script (the fixture), or wait for another worker's check
@pytest.mark.parametrize("script", SCRIPTS)
def test_every_flag_of_every_script_is_described_in_its_help(script: str,
                                                             every_scripts_help: dict[str, dict[str, Any]]) -> None:
    out = every_scripts_help.get(script)
    assert out is not None, f"{script}: no result (the checker's output: {sorted(every_scripts_help)})"
    assert "error" not in out, (script, out.get("error"))
    assert out["undescribed"] == [], (script, out["undescribed"])
    assert out["help"].startswith("usage: "), out["help"][:200]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_transport_tiny_reports_psgrad_beside_raw_grpc() -> None:
    out = _run("benchmarks/transport.py", "--preset", "tiny")
    same = ("same_process_push", "same_process_raw_upload", "same_process_raw_upload_sgd",
            "same_process_raw_upload_sgd_in_place")
    for key in ("psgrad_push", "psgrad_pull", "raw_upload", "raw_download", *same):
        assert out["results"][key]["gb_per_s"] > 0
    assert set(out["ratios"]) == {"push_vs_raw_upload", "pull_vs_raw_download"}
    gbps = {k: v["gb_per_s"] for k, v in out["results"].items()}
    diag = out["diagnostics"]
    assert diag["same_process_push_vs_raw_upload"] == pytest.approx(gbps[same[0]] / gbps[same[1]])
    assert diag["same_process_push_vs_raw_sgd_upload"] == pytest.approx(gbps[same[0]] / gbps[same[2]])
    assert diag["same_process_raw_sgd_upload_vs_raw_upload"] == pytest.approx(gbps[same[2]] / gbps[same[1]])
    assert diag["same_process_raw_sgd_in_place_upload_vs_raw_upload"] == pytest.approx(gbps[same[3]] / gbps[same[1]])
    assert diag["same_process_raw_sgd_upload_vs_raw_sgd_in_place_upload"] == pytest.approx(
        gbps[same[2]] / gbps[same[3]]
    )
    assert out["payload_bytes"] == 4 * out["params"]
    # CPU per operation on each side: this process always spends some; a server's ticks may round to 0.
    assert set(out["cpu_ms_per_op"]) == set(out["results"])
    for key, sides in out["cpu_ms_per_op"].items():
        assert sides["client"] > 0 and sides["server"] >= 0, (key, sides)
    both = {k: sides["server"] + sides["client"] for k, sides in out["cpu_ms_per_op"].items()}
    assert diag["cpu_ratio_push"] == pytest.approx(both["raw_upload"] / both["psgrad_push"])
    assert diag["cpu_ratio_pull"] == pytest.approx(both["raw_download"] / both["psgrad_pull"])
    assert out["stream_window_bytes"] is None  # the servers ran with their default window


def test_interleaved_operations_run_forward_then_backward() -> None:
    keys = ["psgrad_push", "raw_upload", "same_process_push"]
    orders = [lib.rep_order(keys, rep) for rep in range(1, 5)]
    assert orders == [keys, keys[::-1], keys, keys[::-1]]


class _Started(Exception):
    pass


def test_transport_window_flag_reaches_both_psgrad_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    import transport

    started: list[tuple[str, list[str]]] = []

    def start_server(name: str, argv: list[str], one_thread: bool = True) -> object:
        started.append((name, list(argv)))
        if len(started) == 3:  # psgrad, raw, psgrad_with_raw: enough to see every command line
            raise _Started
        return object()

    monkeypatch.setattr(transport, "start_server", start_server)
    with pytest.raises(_Started):
        transport.compare_one_shard(1000, 1, "float32", 1 << 20, stream_window_bytes=0)
    argv = dict(started)
    for name in ("psgrad-server", "psgrad-with-raw"):
        tail = argv[name][-2:]
        assert tail == ["--stream-window-bytes", "0"], (name, argv[name])
    assert "--stream-window-bytes" not in argv["raw-grpc"]  # the ceiling keeps gRPC's defaults


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv", [["benchmarks/transport.py"], ["benchmarks/server_bench.py"],
                                  lib.lib_argv("raw_grpc:psgrad_with_raw_main")],
                         ids=["transport", "server_bench", "psgrad_with_raw"])
def test_a_bad_window_is_refused_before_anything_starts(argv: list[str]) -> None:
    res = run_python([*argv, "--stream-window-bytes", "1000"], timeout_s=100)
    assert res.returncode == 2
    assert "stream_window_bytes must be 0" in res.stderr and "got 1000" in res.stderr


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_worker_tiny_measures_both_runs() -> None:
    # 2 workers (the benchmark's fewest): the survivor's run with and without the kill is all it checks
    out = _run("benchmarks/faults.py", "--fault", "worker", "--preset", "tiny", "--modes", "sync", "--workers", "2")
    assert out["benchmark"] == "fault_recovery" and out["fault"] == "worker" and out["workers"] == 2
    (row,) = out["results"]
    assert row["mode"] == "sync" and row["baseline_train_s"] > 0 and row["with_kill_train_s"] > 0


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_scaleout_tiny_reports_the_sweep_the_grid_and_the_cost_model() -> None:
    import scaleout

    out = _run("benchmarks/scaleout.py", "--preset", "tiny")
    preset = scaleout.PRESETS["tiny"]
    assert out["benchmark"] == "scaleout" and out["op"] == "exchange" and out["machine"]["cpus"] >= 1
    for model, counts in preset["sweep"].items():
        sweep = out["sweeps"][model]
        assert sweep["payload_bytes"] == 4 * scaleout.MODELS[model]
        assert [r["workers"] for r in sweep["rows"]] == list(counts)
        for r in sweep["rows"]:
            for key in ("pushes_per_s", "exchange_ms_p50", "exchange_ms_p99", "step_ms_p50", "step_ms_p99",
                        "server_cpu_ms_per_push", "client_cpu_ms_per_step"):
                assert _positive(r[key]), (model, r["workers"], key)
            assert r["exchange_ms_p50"] <= r["exchange_ms_p99"] and r["step_ms_p50"] >= sweep["think_ms"]
            # Each client its own connection (the listening socket besides), as from separate hosts.
            assert r["server_sockets"][0] >= r["workers"] + 1
        memory = sweep["server_memory"]
        assert _positive(memory["idle_rss_bytes"]) and set(memory["rss_bytes"]) == {str(w) for w in counts}
        assert math.isfinite(memory["rss_bytes_per_client"])
        assert set(sweep["saturation"]) >= {"flat_at_workers", "shard_core_at_workers", "saturated_at_workers"}
    grid = out["grid"]
    assert {(r["shards"], r["workers"]) for r in grid["rows"]} == {
        (s, w) for s in preset["grid_shards"] for w in preset["grid_workers"]}
    assert all(_positive(r["pushes_per_s"]) and len(r["server_sockets"]) == r["shards"] for r in grid["rows"])
    fit = out["cost_model"]["server_cpu_s_per_call"]
    assert _positive(fit["a_s"]) and fit["c_s_per_byte"] >= 0
    assert len(out["cost_model"]["extrapolation"]) == (len(scaleout.EXTRAPOLATE_PARAMS) * len(
        scaleout.EXTRAPOLATE_WORKERS) * len(scaleout.EXTRAPOLATE_STEPS_PER_S))
    text = scaleout.markdown(out)
    assert "pushes/s" in text and "S \\ W" in text and "shards needed" in text


def test_scaleout_cost_model_counts_bytes_and_shards() -> None:
    import scaleout

    b = scaleout.bytes_per_iteration(params=1000, shards=4, workers=8)
    assert b["per_worker"] == 8000 and b["per_worker_per_shard"] == 2000 and b["per_shard_all_workers"] == 16000
    assert scaleout.fit_line([(0.0, 1.0), (2.0, 5.0), (4.0, 9.0)]) == pytest.approx((1.0, 2.0))
    # 100 workers x 1 step/s x 1 ms per call = 0.1 core per shard whatever S; the bytes' cost sets S.
    row = scaleout.shards_needed(10_000_000, 100, 1.0, a_s=1e-3, c_s_per_byte=1e-9)
    assert row["fixed_cost_cores_per_shard"] == pytest.approx(0.1)
    assert row["shards_for_cpu"] == 12  # 8e9 bytes/s x 1e-9 s/byte = 8 cores over 0.7 core per shard
    assert row["shards_needed"] == max(row["shards_for_cpu"], row["shards_for_nic"])
    # 1000 calls/s x 1 ms: the fixed cost alone fills a shard, and more shards do not help.
    assert scaleout.shards_needed(100_000, 1000, 1.0, a_s=1e-3, c_s_per_byte=1e-9)["shards_needed"] is None


SPARSE_OPS = {"pull", "raw_pull", "cold_pull", "push", "step", "step_grpc", "raw_put", "raw_tcp_put"}


def check_sparse_rows(out: dict[str, Any], shards: tuple[int, ...]) -> None:
    """benchmarks/transport.py --part sparse-rows's document has every op's figures, per shard count, and its ratios
    to raw gRPC (their values are not checked)."""
    assert out["benchmark"] == "sparse_rows"
    assert [j["shards"] for j in out["jobs"]] == list(shards)
    for job in out["jobs"]:
        assert set(job["results"]) == SPARSE_OPS and sum(job["ids_per_shard"]) == out["ids"]
        for op, r in job["results"].items():
            assert r["rows_per_s"] > 0 and r["mb_per_s"] > 0 and r["call_ms_median"] > 0, op
            assert set(r["cpu_ms_per_call"]) == {"worker", "servers"}
        assert set(job["ratios"]) == {"pull_vs_raw_pull", "cold_pull_vs_raw_pull", "push_vs_raw_put",
                                      "step_vs_raw_put", "step_grpc_vs_raw_put"}
        assert math.isclose(job["ratios"]["pull_vs_raw_pull"],
                            job["results"]["pull"]["rows_per_s"] / job["results"]["raw_pull"]["rows_per_s"])
        # repetition by repetition: each op's batch over its raw op's batch of that repetition
        assert set(job["ratios_by_rep"]) == set(job["ratios"])
        for name, by_rep in job["ratios_by_rep"].items():
            assert by_rep["n"] == out["reps"] and len(by_rep["ratios"]) == out["reps"], name
            assert by_rep["min"] <= by_rep["median"] <= by_rep["max"], name
            assert by_rep["at_goal"] == sum(x >= 0.8 for x in by_rep["ratios"]), name
    assert len(out["targets"]) == 3 * len(shards)  # pull, push and the whole step, per shard count
    for row in out["targets"]:
        assert row["target"] == 0.8 and row["value"] > 0 and row["ceiling"] > 0 and row["by_rep"]["n"] == out["reps"]
    assert out["payload_bytes"]["pull"] == out["ids"] * out["dim"] * 4
    assert out["payload_bytes"]["push"] == out["ids"] * (out["dim"] * 4 + 8) == out["payload_bytes"]["raw_tcp_put"]
    tcp = [f for f in out["figures"] if f["name"].startswith("sparse step rows/s over raw TCP")]
    assert len(tcp) == len(shards) and all(f["ceiling_name"] == "raw TCP raw_tcp_put" for f in tcp)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sparse_rows_quick_reports_pull_and_push_beside_raw_grpc() -> None:
    res = run_python(["benchmarks/transport.py", "--part", "sparse-rows", "--preset", "quick", "--rows", "20000",
                      "--ids", "256", "--reps", "2", "--calls", "2"], timeout_s=110)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    check_sparse_rows(out, (1, 2))
    assert out["network"] == "loopback" and out["link_mb_per_s"] is None
    assert "ratio" in res.stderr and "raw_pull" in res.stderr  # the table


def test_sparse_rows_refuses_a_table_too_small_for_its_cold_pulls() -> None:
    res = run_python(["benchmarks/transport.py", "--part", "sparse-rows", "--rows", "1000", "--ids", "512"], timeout_s=60)
    assert res.returncode != 0 and "raise --rows" in res.stderr


# ---------------------------------------------------------------------------------------------
# The suite's own parts, tiny preset, end to end


@pytest.fixture(scope="module")
def tiny_suite(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return once_per_run("suite-tiny", lambda: _run("benchmarks/suite.py", "--preset", "tiny", "--only",
                                                   "transport,peer,latency"), tmp_path_factory)


def _check_target_row(row: dict[str, Any]) -> None:
    assert {"name", "value", "ceiling", "ratio", "target", "better", "met", "part"} <= set(row)
    assert row["value"] > 0 and row["ceiling"] > 0
    assert math.isclose(row["ratio"], row["value"] / row["ceiling"])
    assert row["met"] == (row["ratio"] >= row["target"] if row["better"] == "higher" else row["ratio"] <= row["target"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_suite_tiny_reports_every_figure_beside_its_ceiling(tiny_suite: dict[str, Any]) -> None:
    doc = tiny_suite
    assert doc["preset"] == "tiny" and doc["errors"] == [] and doc["machine"]["cpus"] >= 1
    assert set(doc["parts"]) == {"transport", "peer", "latency"}
    by_part: dict[str, list[dict[str, Any]]] = {}
    for row in doc["targets"]:
        _check_target_row(row)
        by_part.setdefault(row["part"], []).append(row)
    assert len(by_part["transport"]) == 2  # push and pull through one shard
    assert len(by_part["peer"]) == 2  # 1 and 2 workers
    assert [r["better"] for r in by_part["latency"]] == ["lower", "lower"]  # same host, gRPC only

    transport = doc["parts"]["transport"]
    cells = {(c["shards"], c["workers"]) for c in transport["cells"]}
    assert cells == {(1, 1), (1, 2), (2, 1), (2, 2)}
    for c in transport["cells"]:
        assert c["psgrad"]["gb_per_s"] > 0 and c["raw_grpc"]["gb_per_s"] > 0
        assert len(c["psgrad"]["per_worker_ops_per_s"]) == c["workers"]
    assert set(transport["ceilings"]) == {"tcp_upload_gb_per_s", "tcp_download_gb_per_s",
                                          "memcpy_reused_gb_per_s", "memcpy_fresh_gb_per_s"}
    assert all(v > 0 for v in transport["ceilings"].values())

    peer = doc["parts"]["peer"]["results"]
    assert {r["workers"] for r in peer} == {1, 2}
    for r in peer:
        assert r["rpc"]["ops_per_s"] > 0 and r["psgrad"]["ops_per_s"] > 0
        assert r["used"]["channels"], "TensorPipe's channel choice was not read from its log"

    latency = doc["parts"]["latency"]
    for series in ("iteration_ms", "iteration_grpc_ms", "separate_ms", "raw_unary_ms"):
        assert latency[series]["n"] == 30
        assert latency[series]["p99"] >= latency[series]["median"] > 0


@pytest.mark.slow
@pytest.mark.timeout(300)  # it may run the tiny suite (the fixture), or wait for another worker's run of it
def test_suite_renders_a_saved_run_as_markdown(tiny_suite: dict[str, Any], tmp_path: Path) -> None:
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps(tiny_suite))
    res = run_python(["benchmarks/suite.py", "--from-json", str(saved), "--markdown"], timeout_s=60)
    assert res.returncode == 0, res.stderr
    assert "| target | psgrad | beside | ratio | goal | met |" in res.stdout
    assert res.stdout.count("\n| transport: ") >= 2 and "| peer: " in res.stdout and "| latency: " in res.stdout


# ---------------------------------------------------------------------------------------------
# Suite plumbing, in process


def test_suite_records_a_missing_or_failing_part_and_goes_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "bench_fails.py").write_text("def run(preset):\n    raise RuntimeError('boom ' + preset)\n")
    (tmp_path / "bench_ok.py").write_text(textwrap.dedent("""
        def run(preset):
            return {"targets": [{"name": "x", "value": 2.0, "ceiling": 4.0, "ratio": 0.5, "target": 0.9,
                                 "better": "higher", "met": False}]}
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(suite, "PARTS", {"gone": "no_such_bench_module", "fails": "bench_fails", "ok": "bench_ok"})
    doc = suite.run_suite("tiny", ["gone", "fails", "ok"])
    assert doc["parts"]["gone"] == {"error": "benchmarks/no_such_bench_module.py not found"}
    assert doc["parts"]["fails"]["error"] == "RuntimeError: boom tiny"
    assert doc["errors"] == ["gone", "fails"]
    assert doc["targets"] == [{"part": "ok", "name": "x", "value": 2.0, "ceiling": 4.0, "ratio": 0.5,
                               "target": 0.9, "better": "higher", "met": False}]
    md = suite.markdown(doc)
    assert "| x | 2 | 4 | 0.5 | ≥ 0.9 | **no** |" in md
    assert "- part `fails` failed: RuntimeError: boom tiny" in md


def test_suite_refuses_an_unknown_part() -> None:
    res = run_python(["benchmarks/suite.py", "--only", "transport,bogus"], timeout_s=60)
    assert res.returncode == 2 and "unknown part(s) bogus" in res.stderr and res.stdout == ""


def test_target_rows_compare_in_the_stated_direction() -> None:
    assert lib.target("t", 1.0, 2.0, 0.5, "higher")["met"] is True
    assert lib.target("t", 0.9, 2.0, 0.5, "higher")["met"] is False
    lat = lib.target("t", 6.0, 2.0, 3.0, "lower")
    assert lat["ratio"] == 3.0 and lat["met"] is True
    assert lib.target("t", 6.1, 2.0, 3.0, "lower")["met"] is False
    with pytest.raises(ValueError, match="better"):
        lib.target("t", 1.0, 1.0, 1.0, "more")


def test_summary_statistics_use_nearest_rank_percentiles() -> None:
    s = lib.summarize([float(v) for v in range(1, 101)])
    assert s["n"] == 100 and s["median"] == 50.5 and s["p99"] == 99.0 and s["min"] == 1.0 and s["max"] == 100.0
    assert lib.summarize([3.0, 1.0, 2.0])["median"] == 2.0
    assert lib.percentile([5.0], 99) == 5.0


def test_aggregate_counts_every_operation_over_the_shared_window() -> None:
    replies = [
        {"start": 10.0, "end": 12.0, "pull_s": [0.5, 0.5], "push_s": [0.5, 0.5]},
        {"start": 11.0, "end": 14.0, "pull_s": [1.0], "push_s": [1.0]},
    ]
    agg = lib.aggregate(replies, payload_bytes=1_000_000_000)
    assert agg["window_s"] == 4.0 and agg["ops"] == 6
    assert agg["ops_per_s"] == 1.5 and agg["gb_per_s"] == 1.5
    assert [w["ops_per_s"] for w in agg["per_worker"]] == [2.0, 2 / 3]


# ---------------------------------------------------------------------------------------------
# Ceilings and child processes


@pytest.fixture
def tcp_server() -> Iterator[str]:
    listener, address = ceilings.serve_tcp()
    yield address
    listener.close()


def test_loopback_tcp_moves_the_bytes_both_ways(tcp_server: str) -> None:
    client = ceilings.TcpClient(tcp_server)
    try:
        payload = bytes(range(256)) * 5000  # 1.28 MB: one full 1 MiB send and a partial one
        client.upload(memoryview(payload), chunk=1 << 20)
        dest = bytearray(len(payload))
        client.download(memoryview(dest), chunk=1 << 20)
        assert dest == payload  # the server streams back what it last received
    finally:
        client.close()


def test_memcpy_probe_times_both_copies() -> None:
    probe = ceilings.MemcpyProbe(1 << 20)
    assert probe.reused_s() > 0 and probe.fresh_s() > 0
    assert bool((probe.dst == probe.src).all())


def test_raw_grpc_download_sends_exactly_what_was_asked() -> None:
    server, address = raw_grpc.serve()
    client = raw_grpc.RawClient(address)
    try:
        assert client.upload(memoryview(bytes(3 << 20)), 1 << 20) == 3 << 20
        big = bytearray(3 << 20)
        assert client.download(memoryview(big), 1 << 20) == 3 << 20
        small = bytearray(1_500_000)  # smaller than the server's buffer: the last chunk must be cut
        assert client.download(memoryview(small), 1 << 20) == 1_500_000
        assert client.ping(b"hello") == b"hello"
        rows = bytearray(1 << 20)  # a unary reply of exactly the size asked, whatever came along
        assert client.fetch(bytes(32 << 10), memoryview(rows)) == 1 << 20 and rows == b"\x01" * (1 << 20)
        assert client.put(bytes((1 << 20) + (32 << 10))) == (1 << 20) + (32 << 10)
    finally:
        client.close()
        server.stop(0).wait()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("in_place", [False, True])
def test_raw_sgd_upload_writes_the_next_weights_beside_or_over_the_current_ones(in_place: bool) -> None:
    import torch

    state = raw_grpc._State()
    grad = torch.full((1 << 16,), 1e9)  # lr 1e-9: each weight moves by -1
    chunks = [bytes(memoryview(grad.numpy()).cast("B")[a : a + (1 << 17)]) for a in range(0, 1 << 18, 1 << 17)]
    assert raw_grpc._sgd_upload(state, iter(chunks), in_place) == 1 << 18
    assert state.sgd is not None
    weights, following = state.sgd
    moved = weights[: 1 << 16] if in_place else following[: 1 << 16]
    assert bool((moved == -1.0).all())
    assert bool((weights[: 1 << 16] == 0.0).all()) != in_place  # out of place, the weights stay as they were


def test_raw_handler_refuses_unknown_upload_work() -> None:
    with pytest.raises(ValueError, match="unknown upload work 'sgdd'"):
        raw_grpc.raw_handler("sgdd")


@pytest.mark.timeout(120)
def test_psgrad_with_raw_serves_a_shard_and_the_raw_uploads_on_one_port() -> None:
    import torch

    from psgrad.client.parameter_client import ParameterClient
    from psgrad.config import ClientConfig, JobSpec
    from psgrad.core.sharding import ParamSpec, plan_shards

    server = lib.start_server("psgrad-with-raw", lib.lib_argv("raw_grpc:psgrad_with_raw_main"))
    clients: list = []  # type: ignore[type-arg]
    try:
        address = server.address()
        for service in (raw_grpc.SERVICE, raw_grpc.SGD_SERVICE, raw_grpc.SGD_IN_PLACE_SERVICE):
            raw = raw_grpc.RawClient(address, service)
            clients.append(raw)
            assert raw.upload(memoryview(bytes(3 << 20)), 1 << 20) == 3 << 20
        # An upload of NaNs fails only where Upload does the shard's finiteness check.
        nan = torch.full((1 << 18,), float("nan"))
        assert clients[0].upload(memoryview(nan.numpy()).cast("B"), 1 << 20) == 1 << 20
        for sgd in clients[1:]:
            with pytest.raises(grpc.RpcError):
                sgd.upload(memoryview(nan.numpy()).cast("B"), 1 << 20)
        params = [ParamSpec("w", (1000,), "float32")]
        ps = ParameterClient(
            [address], JobSpec(num_shards=1, lr=0.5), params, plan_shards(params, 1), 0,
            ClientConfig(shared_memory=False),
        )
        clients.append(ps)
        ps.join(initial_weights=lambda: torch.zeros(1000))
        ps.push(torch.ones(1000), 0)
        flat = torch.empty(1000)
        ps.pull(flat, 1)
        assert bool((flat == -0.5).all())
    finally:
        for c in clients:
            c.close()
        lib.stop_all([server])


_ECHO_CHILD = """
import sys
sys.path.insert(0, {bench!r})
from lib import command_loop

def handle(cmd):
    if cmd["op"] == "fail":
        raise ValueError("asked to fail")
    return {{"echo": cmd["value"]}}

command_loop(handle)
"""


def test_children_answer_commands_behind_a_start_barrier(tmp_path: Path) -> None:
    script = tmp_path / "echo_child.py"
    script.write_text(_ECHO_CHILD.format(bench=str(BENCH)))
    kids = [lib.Child(f"echo{i}", [sys.executable, str(script)]) for i in range(2)]
    try:
        replies = lib.run_together(kids, [{"op": "echo", "value": i} for i in range(2)], timeout_s=60)
        assert replies == [{"echo": 0}, {"echo": 1}]
        with pytest.raises(lib.BenchError, match="ValueError: asked to fail"):
            kids[0].call({"op": "fail"}, timeout_s=60)
        assert kids[0].call({"op": "echo", "value": "still here"}, timeout_s=60) == {"echo": "still here"}
    finally:
        lib.stop_all(kids)
    assert [k.popen.returncode for k in kids] == [0, 0]  # they left on the quit command


def test_a_child_that_ignores_quit_and_sigterm_is_killed_and_reaped() -> None:
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"
    child = lib.Child("stubborn", [sys.executable, "-c", code])
    child.wait_line("up", timeout_s=60)
    done = threading.Event()
    threading.Thread(target=lambda: (child.stop(timeout_s=0.5), done.set()), daemon=True).start()
    assert done.wait(timeout=60), "stop() hung on a child that ignores quit and SIGTERM"
    assert child.popen.returncode == -9


def test_a_child_that_dies_is_reported_with_its_stderr() -> None:
    child = lib.Child("dies", [sys.executable, "-c", "import sys; sys.stderr.write('it broke'); sys.exit(3)"])
    try:
        with pytest.raises(lib.BenchError, match=r"(?s)exited with code 3.*it broke"):
            child.recv(timeout_s=60)
    finally:
        child.stop()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_workloads_tiny_trains_each_task_through_psgrad_and_alone() -> None:
    out = _run("benchmarks/workloads.py", "--preset", "tiny")
    assert set(out["results"]) == {"mnist", "charlm"}
    for name, res in out["results"].items():
        assert res["step_ms_one_thread"]["cpu_ms"] > 0 and 100_000 <= res["parameters"] <= 1_000_000
        assert res["single"]["big_batch"]["batch"] == res["single"]["small_batch"]["batch"]  # one worker
        metric = res["recipe"]["metric"]
        assert res["modes"]["sync"][f"final_{metric}"] > 0 and f"--task {name}" in res["modes"]["sync"]["command"]
    assert out["results"]["charlm"]["recipe"]["metric"] == "test_bpb"
    assert {t["name"].split(":")[0] for t in out["targets"]} == {"mnist sync", "charlm sync"}


def test_drift_stream_sets_each_configs_table_and_sums_what_it_measured(tmp_path: Path) -> None:
    """benchmarks/drift_stream.py without running a job: each config's environment and budget, and the
    summary of memory samples, the shards' table counters and the workers' last three evaluations."""
    import drift_stream

    cfg = drift_stream.PRESETS["tiny"]
    env, budget = drift_stream.config_env("lifetime", cfg)
    assert (env["PSGRAD_CTR_MIN_COUNT"], env["PSGRAD_CTR_TTL"], env["PSGRAD_CTR_EVICT"]) == \
        (str(cfg["min_count"]), str(cfg["ttl"]), "1") and budget == cfg["budget_mb"]
    env, budget = drift_stream.config_env("evict", cfg)
    assert (env["PSGRAD_CTR_MIN_COUNT"], env["PSGRAD_CTR_TTL"], env["PSGRAD_CTR_EVICT"], budget) == \
        ("0", "0", "1", cfg["budget_mb"])
    env, budget = drift_stream.config_env("unbounded", cfg)
    assert env["PSGRAD_CTR_EVICT"] == "0" and budget == 0.0
    table = {"kind": "sparse", "rows_touched": 10, "admitted": 30, "expired": 5, "evicted": 15, "dropped": 7}
    status = {"shards": [{"tables": [{"kind": "dense"}, table]}, {"tables": [dict(table, rows_touched=12)]}]}
    for rank in range(2):
        records = [{"step": s, "test_auc": 0.7 + s / 1000 + rank / 100, "bayes_auc": 0.9} for s in (100, 200, 300, 400)]
        (tmp_path / f"worker{rank}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [{"step": 1}, *records]))
    samples = [(float(t), [100.0 + t, 110.0 + t]) for t in range(20)]
    out = drift_stream.summarize("lifetime", 64.0, samples, status, tmp_path)
    assert out["table"] == {"rows_stored": 22, "admitted": 60, "expired": 10, "evicted": 30, "dropped": 14}
    assert out["server_own_mb"]["after_a_tenth"] == 107.0 and out["server_own_mb"]["last"] == 124.0
    assert out["server_own_mb"]["peak"] == 124.0 and out["steps"] == 800
    assert out["test_auc"] == pytest.approx(sum([0.9, 1.0, 1.1, 0.91, 1.01, 1.11]) / 6, abs=1e-4)
    assert out["bayes_auc"] == 0.9


def test_hybrid_summary_sets_each_config_beside_sync() -> None:
    """benchmarks/hybrid.py's summary (no bed): a time only where every seed reached the target, ratios
    and AUC differences to sync's."""
    import hybrid

    def run(t: float | None, auc: float) -> dict[str, Any]:
        return {"time_to_target_s": t, "final_auc": auc, "elapsed_s": 10.0, "samples_per_s": 1000.0,
                "rows_staleness_mean": 0.5}

    out = hybrid.summarize({"sync": [run(40.0, 0.86), run(60.0, 0.88)], "hybrid": [run(20.0, 0.87), run(30.0, 0.87)],
                            "async": [run(10.0, 0.84), run(None, 0.84)]})
    assert out["sync"]["time_over_sync"] == 1.0 and out["hybrid"]["time_over_sync"] == 0.5
    assert out["hybrid"]["final_auc_minus_sync"] == pytest.approx(0.0)
    assert out["async"]["time_to_target_s"] is None and out["async"]["time_over_sync"] is None
    assert out["async"]["final_auc_minus_sync"] == pytest.approx(-0.03)
