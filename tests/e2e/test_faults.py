"""Fault tests with real processes: a worker killed with SIGKILL mid-run must not stall the others
for longer than about one lease, in every mode that waits."""
from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from conftest import run_cli, spawn

LEASE_S = 2.0


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_sigkilled_worker_is_evicted_and_the_others_finish(start_servers, tmp_path: Path, mode: str) -> None:  # type: ignore[no-untyped-def]
    servers = ",".join(start_servers(2, "--lease-s", str(LEASE_S)))
    steps = 150
    common = ["--servers", servers, "--num-workers", "3", "--steps", str(steps), "--mode", mode,
              "--log-every", "10", "--eval-every", "1000"]
    workers = [
        spawn(["worker", "--rank", str(r), *common, "--metrics-out", str(tmp_path / f"w{r}.jsonl")])
        for r in range(3)
    ]
    workers[2].wait_for_line("worker 2/3: step 30/", timeout_s=120)
    workers[2].popen.send_signal(signal.SIGKILL)
    assert workers[2].wait(30) == -signal.SIGKILL
    for w in workers[:2]:
        assert w.wait(240) == 0, w.output
        assert "final test_loss" in w.output
    res = run_cli(["status", "--servers", servers, "--json"])
    assert res.returncode == 0, res.stderr
    for shard in json.loads(res.stdout)["shards"]:
        states = {w["rank"]: w["state"] for w in shard["workers"]}
        assert states == {0: "left", 1: "left", 2: "evicted"}
        assert shard["evictions"] == 1
        if mode == "sync":
            assert shard["staleness"]["max"] == 0
        else:
            # while a worker at clock c computes, each other worker can push clocks c-s .. c+s
            s, others = 2, 2
            assert shard["staleness"]["max"] <= others * (2 * s + 1)
    for r in range(2):
        records = [json.loads(line) for line in (tmp_path / f"w{r}.jsonl").read_text().splitlines()]
        step_times = sorted(rec["step_s"] for rec in records if "step_s" in rec)
        assert len(step_times) == steps
        # the one step that waited for the dead worker waited about one lease, not forever;
        # every other step ran at normal speed
        assert step_times[-1] < LEASE_S + 3.0, step_times[-5:]
        assert step_times[-2] < LEASE_S, step_times[-5:]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("rpc_timeout", ["30", "3"], ids=["within-the-deadline", "past-the-deadline"])
def test_a_server_stopped_past_the_lease_leaves_a_sync_job_running(start_servers, server_procs,  # type: ignore[no-untyped-def]
                                                                   rpc_timeout: str) -> None:
    """SIGSTOP one of two servers for longer than the lease in the middle of a sync job, then
    SIGCONT it: the job finishes. The other server evicts nobody (each shard's heartbeat goes on
    while another shard does not answer), and the stopped one, which did not run, starts every
    lease again instead of evicting (it says so). Before, both shards evicted both workers, which
    rejoined at different clocks, and the job wedged. Stopped for longer than the workers' call
    deadline, it is called again (a quick status call found it silent) until it answers, within
    --reconnect-timeout-s; before, the workers failed at the first deadline."""
    import time

    lease = 3.0
    servers = start_servers(2, "--lease-s", str(lease))
    common = ["--servers", ",".join(servers), "--num-workers", "2", "--steps", "30", "--mode", "sync",
              "--step-time-ms", "100", "--log-every", "1", "--eval-every", "1000", "--rpc-timeout-s", rpc_timeout,
              "--reconnect-timeout-s", "60"]
    workers = [spawn(["worker", "--rank", str(r), *common]) for r in range(2)]
    # (both workers past step 3: the server answered both, and each computes its next step for 100
    # ms. Stopped right after answering one worker of the two, the other would wait on it while the
    # first waited on the other server for it, which explains its deadline: the job then fails by
    # design, "raise --rpc-timeout-s if they are merely slow")
    for r, w in enumerate(workers):
        w.wait_for_line(f"worker {r}/2: step 3/", timeout_s=120)
    stopped = server_procs[-2]
    stopped.popen.send_signal(signal.SIGSTOP)
    try:
        time.sleep(3 * lease)  # the fault itself: the server does not run for three leases
    finally:
        stopped.popen.send_signal(signal.SIGCONT)
    for w in workers:
        assert w.wait(200) == 0, w.output
        assert "final test_loss" in w.output
    stopped.wait_for_line("this server did not run for", timeout_s=30)
    res = run_cli(["status", "--servers", ",".join(servers), "--json"])
    assert res.returncode == 0, res.stderr
    for shard in json.loads(res.stdout)["shards"]:
        assert shard["evictions"] == 0, shard
        assert {w["rank"]: w["state"] for w in shard["workers"]} == {0: "left", 1: "left"}


def _worker_states(servers: str) -> list[dict[int, str]]:
    """Each shard's workers, rank -> state, as `psgrad status --json` reports them."""
    res = run_cli(["status", "--servers", servers, "--json"], timeout_s=60)
    assert res.returncode == 0, res.stderr
    return [{w["rank"]: w["state"] for w in shard["workers"]} for shard in json.loads(res.stdout)["shards"]]


@pytest.mark.timeout(180)
def test_a_worker_stopped_with_ctrl_c_while_it_waits_at_the_start_leaves_the_job(start_servers) -> None:  # type: ignore[no-untyped-def]
    """Ctrl-C during training made a worker leave, but Ctrl-C while it waited for the others at a sync
    job's start did not: the shards counted it live until its lease ended (and a sync job could start
    with it). Now it leaves there too."""
    servers = ",".join(start_servers(2))
    # Children of a shell's background job inherit SIGINT ignored (see test_cli's launch test): the
    # default handler here makes the worker's SIGINT a KeyboardInterrupt, as in a terminal.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        worker = spawn(["worker", "--rank", "0", "--servers", servers, "--num-workers", "2", "--mode", "sync",
                        "--steps", "50"])
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        worker.wait_for_line("waiting at the start", timeout_s=120)  # (said once every shard took its join)
        worker.popen.send_signal(signal.SIGINT)
        assert worker.wait(60) == 130, worker.output
    finally:
        worker.stop()
    assert "interrupted" in worker.output
    assert _worker_states(servers) == [{0: "left"}] * 2


@pytest.mark.timeout(180)
def test_a_worker_stopped_with_sigterm_leaves_the_job_and_exits_143(start_servers) -> None:  # type: ignore[no-untyped-def]
    """An operator's check: SIGTERM (what `scancel`, a deleted pod or a launcher ending the job sends)
    killed a worker where it stood, and the shards counted it live until its lease ended: a sync
    job's other workers waited for it meanwhile. Now it stops as on Ctrl-C: it leaves, exit 143."""
    servers = ",".join(start_servers(2))
    worker = spawn(["worker", "--rank", "0", "--servers", servers, "--num-workers", "1", "--mode", "async",
                    "--steps", "100000", "--step-time-ms", "20", "--log-every", "5"])
    try:
        worker.wait_for_line("step 5/", timeout_s=120)
        worker.popen.send_signal(signal.SIGTERM)
        assert worker.wait(60) == 143, worker.output
    finally:
        worker.stop()
    assert "terminated (SIGTERM)" in worker.output and "Traceback" not in worker.output, worker.output
    assert _worker_states(servers) == [{0: "left"}] * 2


@pytest.mark.timeout(180)
def test_a_second_worker_process_with_a_rank_takes_it_over_and_the_first_exits_saying_so(start_servers) -> None:  # type: ignore[no-untyped-def]
    """An operator's check: two `psgrad worker --rank 0` (a launcher that computed a rank twice) were
    taken as one worker, their async pushes of equal clocks dropped as duplicates with nothing said.
    The later process takes the rank over and trains on; the earlier one's calls are refused, and it
    exits 1 naming what happened (before: both ran to the end, exit 0)."""
    servers = ",".join(start_servers(2))
    common = ["--servers", servers, "--num-workers", "1", "--mode", "async", "--step-time-ms", "20", "--log-every", "5"]
    first = spawn(["worker", "--rank", "0", "--steps", "100000", *common])
    second = None
    try:
        first.wait_for_line("step 5/", timeout_s=120)
        second = spawn(["worker", "--rank", "0", "--steps", "100000", *common])
        assert first.wait(120) == 1, first.output
        second.wait_for_line("step ", timeout_s=120)
        assert second.popen.poll() is None, second.output  # (it trains on)
    finally:
        first.stop()
        if second is not None:
            second.stop()
    assert "another process joined as worker rank 0 after this one did" in first.output, first.output
    assert "Traceback" not in first.output, first.output
