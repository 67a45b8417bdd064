"""Operations, end to end on real server processes: Prometheus /metrics against `psgrad status`, gRPC
health and reflection, JSON logs, the live status view on a pseudo-terminal, worker metrics and
TensorBoard event files."""
from __future__ import annotations

import fcntl
import importlib.metadata
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from conftest import REPO, Proc, cli_in_process as cli, health, run_benchmark, scrape, spawn
from psgrad.wire.protocol import SERVICE_NAME

pytestmark = pytest.mark.timeout(120)

JOB = ["--num-workers", "2", "--lr", "0.1", "--eval-every", "20", "--seed", "1"]


def exported(url: str) -> set[str]:
    """The metric names a /metrics page declares (counters with their _total), samples or not;
    without prometheus_client's X_created timestamps of counters and histograms."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {n for n in re.findall(r"^# TYPE (\S+) ", text, re.M) if not n.endswith("_created")}


PROCESS_METRICS = {"process_cpu_seconds_total", "process_resident_memory_bytes", "process_virtual_memory_bytes",
                   "process_open_fds", "process_max_fds", "process_start_time_seconds"}


def scrape_until(url: str, what: str, ready: Callable[[dict[Any, float]], bool], timeout_s: float = 30.0) -> dict[Any, float]:
    """Scrape url until ready(samples) holds (an HTTP endpoint tells nobody when it changes)."""
    deadline = time.monotonic() + timeout_s
    while not ready(m := scrape(url)):
        assert time.monotonic() < deadline, f"{url}: {what} not seen within {timeout_s} s"
        threading.Event().wait(0.2)
    return m


def readme_metric_names() -> set[str]:
    """The metric names the "Watching a job" section of docs/operations/monitoring.md documents (query
    suffixes dropped)."""
    text = (Path(REPO) / "docs" / "operations" / "monitoring.md").read_text()
    section = text[text.index("## Watching a job"):]
    names = set(re.findall(r"`((?:psgrad|process)_[a-z_]+)", section))
    return {n for n in names if not (n.endswith(("_bucket", "_count", "_sum")) and n.rsplit("_", 1)[0] in names)}


def server(*extra: str) -> tuple[Proc, str, str]:
    """A real `psgrad server` with a metrics endpoint: (process, gRPC address, metrics URL)."""
    proc = spawn(["server", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", *extra])
    try:
        line = proc.wait_for_line("metrics at ")  # logged before it listens (a JSON line with --log-format json)
        url = re.findall(r"http://[^\s\"]+", line)[0]
        address = proc.wait_for_line("psgrad server listening on ").rsplit(" ", 1)[1]
    except BaseException:
        proc.stop()
        raise
    return proc, address, url


@pytest.mark.slow
def test_metrics_agree_with_status_health_follows_init_and_logs_are_json(capsys: pytest.CaptureFixture[str]) -> None:
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    proc, address, url = server("--lease-s", "30", "--log-format", "json")
    try:
        assert health(address) == "NOT_SERVING"  # no job yet: a readiness probe waits
        with grpc.insecure_channel(address) as channel:  # what `grpcurl list` / `describe` do
            db = ProtoReflectionDescriptorDatabase(channel)
            assert {SERVICE_NAME, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= set(
                db.get_services())
            methods = {m.name for m in DescriptorPool(db).FindServiceByName(SERVICE_NAME).methods}
            assert {"Join", "Init", "Push", "Pull", "Step", "Status"} <= methods, methods
        assert scrape(url)[("psgrad_shard_initialized", (("shard", ""),))] == 0.0
        workers = [spawn(["worker", "--servers", address, "--rank", str(r), "--steps", "40", "--mode", "async",
                          "--log-format", "json", *JOB]) for r in range(2)]
        for w in workers:
            assert w.wait(120) == 0, w.output
        assert health(address) == "SERVING"
        res = cli(["status", "--servers", address, "--json"], capsys)
        code, out, err = res.returncode, res.stdout, res.stderr  # the command line, in this process
        assert code == 0, err
        status = json.loads(out)["shards"][0]
        m = scrape(url)
    finally:
        assert proc.stop() == 0
    shard = (("shard", "0"),)
    assert m[("psgrad_pushes_applied_total", shard)] == status["pushes_applied"] == 80
    for metric, key in (("psgrad_pulls_total", "pulls"), ("psgrad_shard_version", "version"),
                        ("psgrad_received_bytes_total", "bytes_in"), ("psgrad_sent_bytes_total", "bytes_out"),
                        ("psgrad_push_bytes_total", "push_bytes_total"), ("psgrad_pull_bytes_total", "pull_bytes_total"),
                        ("psgrad_pushes_duplicate_total", "pushes_duplicate"), ("psgrad_evictions_total", "evictions")):
        assert m[(metric, shard)] == status[key], metric
    hist = {int(k): v for k, v in status["staleness"]["histogram"].items()}
    assert m[("psgrad_staleness_count", shard)] == sum(hist.values()) == 80
    assert m[("psgrad_staleness_sum", shard)] == sum(k * v for k, v in hist.items())
    buckets = {dict(labels)["le"]: v for (name, labels), v in m.items() if name == "psgrad_staleness_bucket"}
    assert buckets.pop("+Inf") == 80 and len(buckets) == 12
    for le, count in buckets.items():
        assert count == sum(v for k, v in hist.items() if k <= float(le)), le
    clocks = {dict(labels)["rank"]: v for (name, labels), v in m.items() if name == "psgrad_shard_worker_clock"}
    assert clocks == {str(w["rank"]): w["clock"] for w in status["workers"]}
    assert m[("psgrad_live_workers", shard)] == 0  # both left
    calls = {labels[0][1]: v for (name, labels), v in m.items() if name == "psgrad_rpc_duration_seconds_count"}
    assert calls.get("Push", 0) + calls.get("Step", 0) >= 80, calls  # one push per step, alone or in a Step
    # Every line the server and workers wrote is one JSON object, but for what scripts read.
    for p in (proc, *workers):
        records = [json.loads(x) for x in p.lines if not x.startswith("psgrad server listening on ")]
        assert records and all({"time", "level", "logger", "message", "pid"} <= set(r) for r in records)
    assert any(json.loads(x)["message"].endswith("stopped (SIGTERM)") for x in proc.lines if x.startswith("{"))
    assert any(json.loads(x)["message"].startswith("worker 0/2: joined 1 shard(s)") for x in workers[0].lines)


STAMPED = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (DEBUG|INFO|WARNING|ERROR) psgrad server: (.*)$")


@pytest.mark.slow
def test_a_servers_log_lines_carry_time_and_level_and_tell_joins_init_leaves_evictions_and_checkpoints(
    tmp_path: Path,
) -> None:
    # The server logged nearly nothing (no join, init, eviction: a sync job stalled a lease without a
    # word), its lines had no time or level, and --log-level debug changed nothing.
    proc = spawn(["server", "--host", "127.0.0.1", "--port", "0", "--lease-s", "2", "--log-level", "debug",
                  "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every-s", "0.5"])
    workers: list[Proc] = []
    try:
        address = proc.wait_for_line("psgrad server listening on ").rsplit(" ", 1)[1]  # printed as it always was
        args = ["worker", "--servers", address, "--mode", "async", "--num-workers", "2", "--lr", "0.1"]
        workers = [spawn([*args, "--rank", "0", "--steps", "40"]), spawn([*args, "--rank", "1", "--steps", "100000"])]
        assert workers[0].wait(120) == 0, workers[0].output
        proc.wait_for_line("worker 1 joined at clock", timeout_s=60)
        workers[1].popen.kill()  # rank 1 dies without a word: its lease runs out
        evicted = proc.wait_for_line("worker 1 evicted at clock", timeout_s=60)
        print(evicted)
    finally:
        for w in workers:
            w.stop(grace_s=5)
        assert proc.stop() == 0
    lines = [x for x in proc.lines if not x.startswith("psgrad server listening on ")]
    print("\n".join(lines))
    parsed = [STAMPED.match(x) for x in lines]
    assert all(parsed), [x for x, m in zip(lines, parsed) if not m]
    said = [(m.group(1), m.group(2)) for m in parsed if m]
    def has(level: str, start: str) -> bool:
        return any(lv == level and text.startswith(start) for lv, text in said)
    assert has("INFO", "initialized by the chief (worker 0): shard 0 of 1, ")
    assert has("INFO", "worker 0 joined at clock 0") and has("INFO", "worker 1 joined at clock 0")
    assert has("INFO", "worker 0 left at clock 40")
    assert has("INFO", "worker 1 evicted at clock ") and "past its lease (--lease-s 2)" in evicted
    assert has("DEBUG", "checkpoint of version ")  # --log-level debug shows what info leaves out
    assert has("INFO", f"{address} stopped (SIGTERM)")


def _read_until(fd: int, pattern: str, timeout_s: float) -> str:
    """Read a pseudo-terminal until pattern occurs (returns everything read); fails after timeout_s."""
    out = b""
    deadline = time.monotonic() + timeout_s
    while re.search(pattern, out.decode(errors="replace"), re.S) is None:
        left = deadline - time.monotonic()
        assert left > 0, f"{pattern!r} not seen in {out.decode(errors='replace')!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the other end closed (the process exited)
                chunk = b""
            assert chunk, f"{pattern!r} not seen before the output ended: {out.decode(errors='replace')!r}"
            out += chunk
    return out.decode(errors="replace")


CLEAR = "\x1b[H\x1b[2J"  # the live view's redraw in place: home, clear


def _read_frames(fd: int, ready: Callable[[str], object], timeout_s: float) -> str:
    """Read the live view on a pseudo-terminal until its third complete frame (a redraw, ended by
    the next one) or a later one satisfies ready(frame); returns that frame. Fails after timeout_s."""
    out = ""
    deadline = time.monotonic() + timeout_s
    checked = 1  # frames[0] is what came before the first redraw
    while True:
        frames = out.split(CLEAR)
        for i in range(checked, len(frames) - 1):  # the last one may be partial
            if i >= 3 and ready(frames[i]):
                return frames[i]
        checked = max(checked, len(frames) - 1)
        left = deadline - time.monotonic()
        assert left > 0, f"no redraw was ready within {timeout_s} s: {out[-3000:]!r}"
        if select.select([fd], [], [], left)[0]:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the other end closed (the process exited)
                chunk = b""
            assert chunk, f"the output ended before a ready redraw: {out[-3000:]!r}"
            out += chunk.decode(errors="replace")


def terminal() -> tuple[int, int]:
    """A pseudo-terminal of 40 rows and 160 columns: (our end, the program's end)."""
    main, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    return main, secondary


@pytest.mark.slow
def test_live_view_on_a_terminal_and_the_exported_names_are_the_readmes(tmp_path: Path) -> None:
    proc, address, url = server("--lease-s", "30", "--checkpoint-dir", str(tmp_path / "ckpt"))
    w = spawn(["worker", "--servers", address, "--rank", "0", "--num-workers", "1", "--steps", "100000",
               "--log-every", "20", "--eval-every", "20", "--mode", "async", "--metrics-port", "0"])
    main, secondary = terminal()
    view = subprocess.Popen([sys.executable, "-m", "psgrad", "status", "--watch", "--interval-s", "0.3", "--servers",
                             address], stdin=secondary, stdout=secondary, stderr=secondary, cwd=REPO)
    os.close(secondary)
    try:
        worker_url = re.findall(r"http://\S+", w.wait_for_line("metrics at ", timeout_s=60))[0]
        w.wait_for_line("step 20/", timeout_s=60)  # training: versions move between refreshes
        # The third complete redraw or later whose row has rates: a frame at a time (a regular
        # expression over all the output read, which piles up while the worker starts, took minutes)
        text = _read_frames(main, lambda frame: re.search(r"^\s+0 \S+\s+\d+\s+\d+\.\d", frame, re.M), 60)
        header = [line for line in text.splitlines() if "push/s" in line][-1].split()
        assert header == ["shard", "address", "version", "push/s", "pull/s", "live", "clocks", "lag", "stale",
                          "p50/p99", "waiting"], header
        row = re.findall(r"^\s+0 (\S+)\s+(\d+)\s+(\d+\.\d)\s+(\d+\.\d)\s+(\d+) (\d+)\.\.(\d+)\s+(\d+)\s+(\d+)/(\d+)"
                         r"\s+(\d+)\s*$", text, re.M)[-1]
        assert row[0] == address and int(row[1]) > 0 and float(row[2]) > 0 and float(row[3]) > 0, row
        assert row[4] == "1" and row[5] == row[6] and row[7] == "0", row  # one live worker: no lag
        assert row[8:10] == ("0", "0") and row[10] == "0", row  # async, alone: staleness 0, nobody waits
        view.send_signal(signal.SIGINT)
        assert view.wait(30) == 0
        # Every name the docs (Monitoring) document is exported, and nothing they do not.
        served = scrape_until(url, "a checkpoint's age", lambda m: ("psgrad_checkpoint_age_seconds", (("shard", "0"),)) in m)
        assert served[("psgrad_live_workers", (("shard", "0"),))] == 1
        scrape_until(worker_url, "an evaluation", lambda m: any(k[0] == "psgrad_worker_evaluation" for k in m))
        names = exported(url) | exported(worker_url)
        assert names == readme_metric_names(), (names ^ readme_metric_names())
        # ... and the generated metrics reference (docs/hooks/reference.py) lists them, and besides them
        # only the sparse tables' (a job with a psgrad.Embedding: this one has none).
        from test_docs import reference
        generated = {m.name for m in reference().metrics()}
        assert names <= generated, names - generated
        assert generated - names == {"psgrad_table_rows", "psgrad_table_rows_touched", "psgrad_table_updates",
                                     "psgrad_table_staleness_max", "psgrad_table_staleness_mean",
                                     "psgrad_table_rows_admitted_total", "psgrad_table_rows_expired_total",
                                     "psgrad_table_rows_evicted_total", "psgrad_table_updates_dropped_total"}
        assert all(re.fullmatch(r"psgrad_[a-z_]+", n) for n in names - PROCESS_METRICS)
        # Both processes say what they cost (CPU, memory, descriptors) and which build they run.
        assert PROCESS_METRICS <= exported(url) and PROCESS_METRICS <= exported(worker_url)
        for m in (scrape(url), scrape(worker_url)):
            assert m[("process_cpu_seconds_total", ())] > 0 and m[("process_open_fds", ())] > 0
            (build,) = [dict(labels) for name, labels in m if name == "psgrad_build_info"]
            assert build["version"] == importlib.metadata.version("psgrad"), build
    finally:
        if view.poll() is None:
            view.kill()
            view.wait()
        os.close(main)
        w.stop(grace_s=5)
        proc.stop()


class _SlowStatus:
    """A gRPC server of the psgrad service whose Status answers only when released (a server busy,
    paused, or cut off mid-call): `called` is set once a Status call arrived."""

    def __init__(self) -> None:
        from concurrent import futures

        from psgrad.proto import ps_pb2 as pb

        self.called = threading.Event()
        self.release = threading.Event()

        def status(request: Any, context: grpc.ServicerContext) -> Any:
            self.called.set()
            self.release.wait(60)
            return pb.StatusReply()

        handlers = {"Status": grpc.unary_unary_rpc_method_handler(
            status, pb.StatusRequest.FromString, pb.StatusReply.SerializeToString)}
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def stop(self) -> None:
        self.release.set()
        self.server.stop(0)


def test_ctrl_c_ends_the_live_view_at_once_while_a_server_is_slow_to_answer() -> None:
    """Ctrl-C waited for the status calls in flight (the view's thread pool joined them), up to
    --timeout-s, and then for the interpreter to collect torch's modules: once at load ~10 the view
    did not exit within 30 s. The view says it runs before its first refresh; the test sends SIGINT
    once the slow server holds the view's call (no sleep: both are waited for)."""
    slow = _SlowStatus()
    view = spawn(["status", "--watch", "--timeout-s", "60", "--interval-s", "0.3", "--servers", slow.address])
    try:
        view.wait_for_line("Ctrl-C to stop", timeout_s=60)
        assert slow.called.wait(60), "the view never asked the server"
        start = time.monotonic()
        view.popen.send_signal(signal.SIGINT)
        assert view.wait(20) == 0, view.lines  # was: the call's deadline, 60 s
        assert time.monotonic() - start < 10
    finally:
        view.stop(grace_s=0)
        slow.stop()


@pytest.mark.slow
def test_a_worker_on_a_terminal_shows_a_progress_bar_and_writes_tensorboard(tmp_path: Path) -> None:
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    quiet = spawn(["server", "--host", "127.0.0.1", "--port", "0", "--log-level", "warning"])
    main, secondary = terminal()
    w = None
    try:
        address = quiet.wait_for_line("psgrad server listening on ").rsplit(" ", 1)[1]  # printed, not logged
        w = subprocess.Popen([sys.executable, "-m", "psgrad", "worker", "--servers", address, "--num-workers", "1",
                              "--steps", "60", "--eval-every", "30", "--tensorboard", str(tmp_path / "tb"),
                              "--lr-schedule", "cosine", "--warmup-steps", "5",
                              "--metrics-out", str(tmp_path / "w0.jsonl")], stdin=secondary, stdout=secondary,
                             stderr=secondary, cwd=REPO)
        os.close(secondary)
        secondary = -1
        # Both, in whichever order the bar's last refresh and the final log line come.
        text = _read_until(main, r"(?=.*60/60 \[.*step/s.*loss=.*test_accuracy=)(?=.*final test_loss)", 90)
        assert re.search(r"worker 0: +\d+%\|", text), text  # the bar, named after the worker
        assert w.wait(30) == 0
    finally:
        if w is not None and w.poll() is None:
            w.kill()
            w.wait()
        if secondary >= 0:
            os.close(secondary)
        os.close(main)
        assert quiet.stop() == 0
    assert not any("stopped" in x for x in quiet.lines), quiet.lines  # info is below --log-level warning
    acc = event_accumulator.EventAccumulator(str(tmp_path / "tb" / "worker0"))
    acc.Reload()
    records = [json.loads(x) for x in (tmp_path / "w0.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 60
    for tag, key in (("train/loss", "loss"), ("train/lr", "lr"), ("train/staleness", "staleness"),
                     ("time/step_s", "step_s"), ("time/compute_s", "compute_s"), ("time/wait_s", "wait_s")):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [r["step"] for r in steps], tag
        assert [e.value for e in events] == pytest.approx([r[key] for r in steps], rel=1e-6), tag
    lrs = [e.value for e in acc.Scalars("train/lr")]  # the schedule's: up over the warmup, then down
    assert lrs[4] == pytest.approx(0.1) and lrs[0] < lrs[4] and lrs[-1] < 0.01
    evals = [r for r in records if "test_accuracy" in r and r.get("event") != "final"]
    accuracy = acc.Scalars("eval/test_accuracy")
    assert [e.step for e in accuracy] == [r["step"] for r in evals] == [30, 60]
    assert [e.value for e in accuracy] == pytest.approx([r["test_accuracy"] for r in evals], rel=1e-6)
    [final] = [r for r in records if r.get("event") == "final"]
    assert [(e.step, e.value) for e in acc.Scalars("final/test_accuracy")] == [(60, pytest.approx(final["test_accuracy"]))]


def test_worker_exporter_serves_its_records() -> None:
    from psgrad.metrics.exporters import PrometheusExporter

    exp = PrometheusExporter(rank=3, host="127.0.0.1", port=0)
    try:
        exp.record({"step": 1, "loss": 2.5, "step_s": 0.02, "compute_s": 0.01, "wait_s": 0.005, "staleness": 2,
                    "clock": 1, "lr": 0.05})
        exp.record({"step": 2, "loss": 1.5, "step_s": 0.03, "test_accuracy": 0.75})
        m = scrape(exp.url)
        rank = (("rank", "3"),)
        assert m[("psgrad_worker_steps_total", rank)] == 2
        assert m[("psgrad_worker_loss", rank)] == 1.5
        assert m[("psgrad_worker_learning_rate", rank)] == 0.05
        assert m[("psgrad_worker_evaluation", (("metric", "test_accuracy"), ("rank", "3")))] == 0.75
        assert m[("psgrad_worker_step_phase_seconds_count", (("phase", "step"), ("rank", "3")))] == 2
        assert m[("psgrad_worker_step_phase_seconds_sum", (("phase", "step"), ("rank", "3")))] == pytest.approx(0.05)
        assert m[("psgrad_worker_push_staleness_sum", rank)] == 2
    finally:
        exp.close()


@pytest.mark.slow
def test_metrics_cost_benchmark_measures_both_sides() -> None:
    out = run_benchmark("feature_cost.py", "--feature", "metrics", "--preset", "tiny")
    assert out["benchmark"] == "metrics_cost" and out["preset"] == "tiny" and out["payload_mb"] == pytest.approx(2.0)
    for name in ("push_s", "pull_s", "step_s"):
        assert set(out["median"][name]) == {"on", "off"} and all(v > 0 for v in out["median"][name].values())
    for kind in ("push_throughput", "pull_throughput", "step_rate"):
        assert out[f"{kind}_ratio_on_off"] > 0 and out[f"paired_{kind}_ratio_on_off"] > 0
    # the worker exporter's endpoint and both metrics servers' (a bulk and a small job) scraped while they served
    assert out["scrapes"] >= 3
