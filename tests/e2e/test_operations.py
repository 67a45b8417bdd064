"""Operations, end to end on real server processes: Prometheus /metrics against `psgrad status`, gRPC
health and reflection, JSON logs, the live status view on a pseudo-terminal, worker metrics and
TensorBoard event files."""
from __future__ import annotations

import fcntl
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
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from conftest import REPO, Proc, run_benchmark, run_cli, spawn

pytestmark = pytest.mark.timeout(120)

JOB = ["--num-workers", "2", "--lr", "0.1", "--eval-every", "20", "--seed", "1"]


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a /metrics page, keyed by (name, sorted labels)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def server(*extra: str) -> tuple[Proc, str, str]:
    """A real `psgrad server` with a metrics endpoint: (process, gRPC address, metrics URL)."""
    proc = spawn(["server", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", *extra])
    try:
        url = proc.wait_for_line("metrics at ").rsplit(" ", 1)[1]  # logged before it listens
        address = proc.wait_for_line("psgrad server listening on ").rsplit(" ", 1)[1]
    except BaseException:
        proc.stop()
        raise
    return proc, address, url


def health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return int(health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status)


def test_metrics_agree_with_status_and_count_refusals(tmp_path: Path) -> None:
    proc, address, url = server("--lease-s", "30")
    try:
        assert scrape(url)[("psgrad_shard_initialized", (("shard", ""),))] == 0.0
        workers = [spawn(["worker", "--servers", address, "--rank", str(r), "--steps", "40", "--mode", "async", *JOB])
                   for r in range(2)]
        for w in workers:
            assert w.wait(120) == 0, w.output
        # A worker of another job is refused: counted by method and reason.
        other = run_cli(["worker", "--servers", address, "--rank", "0", "--num-workers", "2", "--lr", "0.5",
                         "--steps", "1", "--connect-timeout-s", "5"])
        assert other.returncode != 0
        status = json.loads(run_cli(["status", "--servers", address, "--json"]).stdout)["shards"][0]
        m = scrape(url)
        shard = (("shard", "0"),)
        assert m[("psgrad_pushes_applied_total", shard)] == status["pushes_applied"] == 80
        assert m[("psgrad_pulls_total", shard)] == status["pulls"]
        assert m[("psgrad_shard_version", shard)] == status["version"]
        assert m[("psgrad_received_bytes_total", shard)] == status["bytes_in"]
        hist = {int(k): v for k, v in status["staleness"]["histogram"].items()}
        assert m[("psgrad_staleness_count", shard)] == sum(hist.values()) == 80
        assert m[("psgrad_staleness_sum", shard)] == sum(k * v for k, v in hist.items())
        for bound in (0, 1, 2, 4, 8):
            le = tuple(sorted({"shard": "0", "le": str(bound)}.items()))
            assert m[("psgrad_staleness_bucket", le)] == sum(v for k, v in hist.items() if k <= bound)
        calls = {labels[0][1]: v for (name, labels), v in m.items() if name == "psgrad_rpc_duration_seconds_count"}
        assert calls.get("Push", 0) + calls.get("Step", 0) >= 80, calls  # one push per step, alone or in a Step
        refused = {labels: v for (name, labels), v in m.items() if name == "psgrad_rpc_refused_total"}
        assert refused.get((("method", "Join"), ("reason", "JobMismatchError"))) == 1.0, refused
        assert m[("psgrad_live_workers", shard)] == 0  # both left
    finally:
        proc.stop()


def test_health_is_not_serving_until_initialized_and_reflection_lists_the_service() -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    proc, address, _ = server()
    try:
        assert health(address) == health_pb2.HealthCheckResponse.NOT_SERVING
        with grpc.insecure_channel(address) as channel:
            services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
            assert "psgrad.ParameterServer" in services or any(s.endswith(".ParameterServer") for s in services), services
            assert "grpc.health.v1.Health" in services
        w = spawn(["worker", "--servers", address, "--rank", "0", "--steps", "5", "--num-workers", "1"])
        assert w.wait(120) == 0, w.output
        assert health(address) == health_pb2.HealthCheckResponse.SERVING
    finally:
        proc.stop()


def test_json_logs_are_one_object_per_line(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    proc = spawn(["server", "--port", "0", "--log-format", "json", "--checkpoint-dir", str(ckpt),
                  "--metrics-port", "0"])
    try:
        line = proc.wait_for_line('"metrics at ')
        proc.wait_for_line("psgrad server listening on ")
        record = json.loads(line)
        assert record["level"] == "info" and record["logger"] == "psgrad.server" and record["pid"] > 0
        assert record["message"].startswith("metrics at http://127.0.0.1:")
    finally:
        assert proc.stop() == 0
    stopped = [json.loads(x) for x in proc.lines if x.startswith("{") and "stopped" in x]
    assert stopped and stopped[0]["message"].endswith("stopped (SIGTERM)")
    quiet = spawn(["server", "--port", "0", "--log-level", "warning", "--metrics-port", "0"])
    try:
        quiet.wait_for_line("psgrad server listening on ")  # what scripts read is not a log message
    finally:
        assert quiet.stop() == 0
    assert not any("metrics at" in x or "stopped" in x for x in quiet.lines), quiet.lines


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


def terminal() -> tuple[int, int]:
    """A pseudo-terminal of 40 rows and 160 columns: (our end, the program's end)."""
    main, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    return main, secondary


def test_live_view_redraws_on_a_terminal_until_ctrl_c() -> None:
    proc, address, _ = server("--lease-s", "30")
    w = spawn(["worker", "--servers", address, "--rank", "0", "--num-workers", "1", "--steps", "100000",
               "--log-every", "20", "--mode", "async"])
    main, secondary = terminal()
    view = subprocess.Popen([sys.executable, "-m", "psgrad", "status", "--watch", "--interval-s", "0.3", "--servers",
                             address], stdin=secondary, stdout=secondary, stderr=secondary, cwd=REPO)
    os.close(secondary)
    try:
        w.wait_for_line("step ", timeout_s=60)  # training: versions move between refreshes
        text = _read_until(main, r"(\x1b\[H\x1b\[2J.*?){3}push/s.*\n\s+0 \S+\s+\d+\s+\d+\.\d", 60)
        assert "\x1b[H\x1b[2J" in text  # redrawn in place
        row = re.findall(r"^\s+0 (\S+)\s+(\d+)\s+(\d+\.\d)\s+(\d+\.\d)\s+(\d+)\s+(\S+)\s+(\S+)", text, re.M)[-1]
        assert row[0] == address and int(row[1]) > 0 and float(row[2]) > 0 and row[4] == "1"
        view.send_signal(signal.SIGINT)
        assert view.wait(30) == 0
    finally:
        if view.poll() is None:
            view.kill()
            view.wait()
        os.close(main)
        w.stop(grace_s=5)
        proc.stop()


def test_a_worker_on_a_terminal_shows_a_progress_bar() -> None:
    proc, address, _ = server()
    main, secondary = terminal()
    w = subprocess.Popen([sys.executable, "-m", "psgrad", "worker", "--servers", address, "--num-workers", "1",
                          "--steps", "60", "--eval-every", "30"], stdin=secondary, stdout=secondary, stderr=secondary,
                         cwd=REPO)
    os.close(secondary)
    try:
        text = _read_until(main, r"60/60 \[.*step/s.*loss=.*test_accuracy=", 90)
        assert re.search(r"worker 0: +\d+%\|", text), text  # the bar, named after the worker
        assert "final test_loss" in _read_until(main, "final test_loss", 30)  # log lines still show, above it
        assert w.wait(30) == 0
    finally:
        if w.poll() is None:
            w.kill()
            w.wait()
        os.close(main)
        proc.stop()


def test_worker_metrics_endpoint_and_tensorboard_events(tmp_path: Path) -> None:
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    EventAccumulator = event_accumulator.EventAccumulator

    proc, address, _ = server()
    try:
        w = spawn(["worker", "--servers", address, "--rank", "0", "--num-workers", "1", "--steps", "30",
                   "--eval-every", "10", "--metrics-port", "0", "--tensorboard", str(tmp_path / "tb"),
                   "--metrics-out", str(tmp_path / "w0.jsonl")])
        url = w.wait_for_line("metrics at ").rsplit(" ", 1)[1]
        assert url.startswith("http://127.0.0.1:")
        assert w.wait(120) == 0, w.output
    finally:
        proc.stop()
    runs = list((tmp_path / "tb" / "worker0").iterdir())
    assert runs, "no event file"
    acc = EventAccumulator(str(tmp_path / "tb" / "worker0"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "eval/test_accuracy", "time/step_s"} <= tags, tags
    losses = acc.Scalars("train/loss")
    records = [json.loads(x) for x in (tmp_path / "w0.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert [e.step for e in losses] == sorted(by_step)
    assert all(abs(e.value - by_step[e.step]) < 1e-6 for e in losses)
    evals = [r for r in records if "test_accuracy" in r and r.get("event") != "final"]
    assert [round(e.value, 6) for e in acc.Scalars("eval/test_accuracy")][: len(evals)] == [
        round(r["test_accuracy"], 6) for r in evals]


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


def test_metrics_cost_benchmark_measures_both_sides() -> None:
    out = run_benchmark("metrics_cost.py", "--mb", "2", "--reps", "2", "--steps", "10", "--scrape-s", "0.2")
    assert out["payload_mb"] == pytest.approx(2.0)
    for name in ("push_s", "pull_s", "step_s"):
        assert set(out["median"][name]) == {"on", "off"} and all(v > 0 for v in out["median"][name].values())
    for ratio in ("push_throughput_ratio_on_off", "pull_throughput_ratio_on_off", "step_rate_ratio_on_off"):
        assert out[ratio] > 0
    assert out["scrapes"] >= 1  # the metrics side was scraped while it served
