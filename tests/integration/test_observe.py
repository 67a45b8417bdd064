"""A server's outside view in process: refusals counted by reason and every call timed by method on
/metrics, and a server restored from a checkpoint is SERVING at once with its checkpoint's age."""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from conftest import SmallDisk, health, run_in_threads, scrape, wait_for
from psgrad.cli.status import format_status
from psgrad.client.parameter_client import ParameterClient, shard_status
from psgrad.config import ClientConfig, JobSpec, ServerConfig
from psgrad.core.sharding import ParamSpec, plan_shards
from psgrad.errors import JobMismatchError, NonFiniteGradientError
from psgrad.server import checkpoint
from psgrad.server.runtime import RunningServer, start_server

pytestmark = pytest.mark.timeout(60)

NUMEL = 1000
PARAMS = [ParamSpec("w", (NUMEL,), "float32")]
SPEC = JobSpec(lr=0.1, num_workers=1)
CONFIG = ClientConfig(connect_timeout_s=5, rpc_timeout_s=10, reconnect_timeout_s=1, shared_memory=False)


@pytest.fixture
def servers() -> Iterator[Callable[..., RunningServer]]:
    """servers(**ServerConfig fields) -> a started in-process server serving /metrics, stopped at teardown."""
    running: list[RunningServer] = []

    def start(**kw: object) -> RunningServer:
        s = start_server(ServerConfig(**{"host": "127.0.0.1", "port": 0, "threads": 8, "metrics_port": 0, **kw}))  # type: ignore[arg-type]
        running.append(s)
        return s

    yield start
    for s in running:
        s.stop(0)


def client(address: str, spec: JobSpec = SPEC, params: list[ParamSpec] = PARAMS) -> ParameterClient:
    return ParameterClient([address], spec, params, plan_shards(params, 1), 0, CONFIG)


def test_refusals_are_counted_by_reason_and_every_call_is_timed(servers: Callable[..., RunningServer]) -> None:
    server = servers()
    flat = torch.empty(NUMEL)
    with client(server.address) as c:
        c.join(lambda: torch.zeros(NUMEL))
        c.push(torch.ones(NUMEL), 0)  # Push
        c.pull(flat, 1)  # Pull
        c.exchange(torch.ones(NUMEL), 1, flat)  # Step: a push and its pull in one call
        nan = torch.ones(NUMEL)
        nan[7] = float("nan")
        with pytest.raises(NonFiniteGradientError, match="1 non-finite"):
            c.push(nan, 2)
    with client(server.address, spec=JobSpec(lr=0.5, num_workers=1)) as other, pytest.raises(JobMismatchError):
        other.join(None)  # another job's worker
    m = scrape(server.metrics_url)
    refused = {labels: v for (name, labels), v in m.items() if name == "psgrad_rpc_refused_total"}
    assert refused == {(("method", "Push"), ("reason", "NonFiniteGradientError"), ("shard", "0")): 1.0,
                       (("method", "Join"), ("reason", "JobMismatchError"), ("shard", "0")): 1.0}, refused
    shard = (("shard", "0"),)
    assert m[("psgrad_pushes_rejected_total", shard)] == 1 and m[("psgrad_pushes_applied_total", shard)] == 2
    calls = {dict(labels)["method"]: v for (name, labels), v in m.items() if name == "psgrad_rpc_duration_seconds_count"}
    assert calls["Push"] == 2 and calls["Pull"] == 1 and calls["Step"] == 1 and calls["Init"] == 1, calls
    for method in ("Push", "Pull", "Step"):  # latency histograms: every call falls in the +Inf bucket
        labels = (("le", "+Inf"), ("method", method), ("shard", "0"))
        assert m[("psgrad_rpc_duration_seconds_bucket", labels)] == calls[method]
        assert m[("psgrad_rpc_duration_seconds_sum", (("method", method), ("shard", "0")))] > 0
    # The calls before the chief's init have no shard yet.
    assert m[("psgrad_rpc_duration_seconds_count", (("method", "Join"), ("shard", "")))] >= 1


def test_a_restored_server_serves_at_once_and_reports_its_checkpoint_age(
    servers: Callable[..., RunningServer], tmp_path: Path,
) -> None:
    first = servers(checkpoint_dir=str(tmp_path))
    assert health(first.address) == "NOT_SERVING"
    assert ("psgrad_checkpoint_age_seconds", (("shard", ""),)) not in scrape(first.metrics_url)  # none yet
    with client(first.address) as c:
        c.join(lambda: torch.zeros(NUMEL))
        assert health(first.address) == "SERVING"
        for clock in range(3):
            c.push(torch.ones(NUMEL), clock)
    first.stop(0)  # a last checkpoint, of version 3
    restored = servers(checkpoint_dir=str(tmp_path))
    assert health(restored.address) == "SERVING"  # no worker needed: the checkpoint is the job's state
    m = scrape(restored.metrics_url)
    shard = (("shard", "0"),)
    assert m[("psgrad_shard_initialized", shard)] == 1 and m[("psgrad_shard_version", shard)] == 3
    assert 0 <= m[("psgrad_checkpoint_age_seconds", shard)] < 60


def test_a_full_disk_never_ends_checkpointing_and_each_failure_is_reported_until_space_returns(
    servers: Callable[..., RunningServer], small_disk: SmallDisk,
) -> None:
    # safetensors' own error killed the checkpoint thread: nothing was written again after the disk
    # had space, and a later restart restored a stale state without a word anywhere.
    directory = small_disk.path / "ckpt"
    server = servers(checkpoint_dir=str(directory), checkpoint_every_s=0.1)
    shard = (("shard", "0"),)
    with client(server.address) as c:
        c.join(lambda: torch.zeros(NUMEL))
        c.push(torch.ones(NUMEL), 0)
        wait_for("the first checkpoint", lambda: checkpoint.versions(directory)[:1] == [1])
        small_disk.fill()
        for clock in (1, 2):
            c.push(torch.ones(NUMEL), clock)
        wait_for("two failed writes", lambda: shard_status([server.address], 5)[0].checkpoint.failures >= 2)
        status = shard_status([server.address], 5)[0]
        m = scrape(server.metrics_url)
        text = format_status([dict(status.to_dict(), address=server.address)])
        print(f"disk full:\n{text}")
        assert status.checkpoint.failing and status.checkpoint.version == 1 and status.version == 3
        assert "No space left on device" in status.checkpoint.last_error
        assert m[("psgrad_checkpoint_failures_total", shard)] >= 2 and m[("psgrad_checkpoint_failing", shard)] == 1
        assert "shard 0: last checkpoint: version 1, " in text and "FAILING now" in text
        small_disk.free()
        wait_for("a checkpoint of version 3 once the disk has space", lambda: checkpoint.versions(directory)[:1] == [3])
        c.push(torch.ones(NUMEL), 3)  # the shard served on all along
    wait_for("the status to say so", lambda: not shard_status([server.address], 5)[0].checkpoint.failing)
    recovered = shard_status([server.address], 5)[0].checkpoint
    print(f"disk freed: {recovered}")
    assert recovered.version >= 3 and recovered.writes >= 2
    assert scrape(server.metrics_url)[("psgrad_checkpoint_failing", shard)] == 0


def test_a_pull_parked_at_the_sync_gate_is_timed(servers: Callable[..., RunningServer]) -> None:
    server = servers()
    spec = JobSpec(mode="sync", lr=0.1, num_workers=2)
    a, b = (ParameterClient([server.address], spec, PARAMS, plan_shards(PARAMS, 1), r, CONFIG) for r in (0, 1))
    with a, b:
        run_in_threads(2, lambda r: (a, b)[r].join((lambda: torch.zeros(NUMEL)) if r == 0 else None), timeout_s=20)
        a.push(torch.ones(NUMEL), 0)
        parked = threading.Thread(target=a.pull, args=(torch.empty(NUMEL), 1))
        parked.start()  # waits at the gate for rank 1's gradient
        assert server.shard.wait_until(lambda s: s.waiting == 1, 10)
        b.push(torch.ones(NUMEL), 0)
        parked.join(10)
        assert not parked.is_alive()
    m = scrape(server.metrics_url)
    shard = (("shard", "0"),)
    assert m[("psgrad_gate_wait_seconds_count", shard)] == 1 and m[("psgrad_gate_wait_seconds_sum", shard)] > 0


# What `python -m psgrad ARGS` imported: the command runs as in a shell, then the wrapper says.
_IMPORTS = """
import runpy, sys
sys.argv = ["psgrad", *sys.argv[1:]]
try:
    runpy.run_module("psgrad", run_name="__main__")
finally:
    print("imported:", *(m for m in ("torch", "numpy") if m in sys.modules), file=sys.stderr)
"""


def test_psgrad_status_does_not_import_torch(servers: Callable[..., RunningServer]) -> None:
    """`psgrad status` imported torch (1.6-1.9 s and 242 MB per call) through the client it asked with;
    a table, JSON and the live view of a job with workers (and of a server that refuses) do without."""
    import subprocess
    import sys

    from conftest import REPO, child_env

    server = servers()
    with ParameterClient([server.address], SPEC, PARAMS, plan_shards(PARAMS, 1), 0, CONFIG) as c:
        c.join(lambda: torch.zeros(NUMEL))
        c.push(torch.ones(NUMEL), 0)
        for args in (["status", "--servers", server.address], ["status", "--servers", server.address, "--json"],
                     ["status", "--watch", "--count", "2", "--interval-s", "0.1", "--servers", server.address],
                     ["status", "--servers", server.address + "|127.0.0.1:1"]):
            res = subprocess.run([sys.executable, "-c", _IMPORTS, *args], capture_output=True, text=True, cwd=REPO,
                                 env=child_env(), timeout=60)
            assert res.returncode == 0, res.stderr
            assert "shard" in res.stdout and server.address in res.stdout, res.stdout
            assert res.stderr.splitlines()[-1] == "imported:", (args, res.stderr)  # neither torch nor numpy
