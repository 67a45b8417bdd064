"""What the shards tell a worker once, in its push (and pull) replies, and what the worker says of it: another
worker evicted (sync: "worker 2 evicted at clock 1 (lease 2 s): continuing with 2 of 3"), and a
restart from a checkpoint that lost updates (the shard's version went back from V to V'); and
where a worker every shard evicted continues."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import run_in_threads
from psgrad.client.parameter_client import ParameterClient
from psgrad.config import ClientConfig, JobSpec, ServerConfig, WorkerConfig
from psgrad.core.push_outcome import Eviction, Restore
from psgrad.core.sharding import ParamSpec, plan_shards
from psgrad.metrics.jsonl import MetricsSink
from psgrad.server import checkpoint
from psgrad.server.runtime import start_server
from psgrad.worker.loop import TrainingLog

pytestmark = pytest.mark.timeout(90)

PARAMS = [ParamSpec("w", (32,), "float32")]
CONFIG = ClientConfig(connect_timeout_s=10, rpc_timeout_s=20, reconnect_timeout_s=30, shared_memory=False)


def _client(address: str, spec: JobSpec, rank: int) -> ParameterClient:
    return ParameterClient([address], spec, PARAMS, plan_shards(PARAMS, 1), rank, CONFIG)


def test_the_survivors_of_a_sync_job_are_told_once_which_worker_was_evicted_and_how_many_go_on() -> None:
    # Before: the server logged the eviction, and the surviving workers said nothing.
    spec = JobSpec(mode="sync", lr=0.1, num_shards=1, num_workers=3)
    server = start_server(ServerConfig(port=0, threads=8, lease_s=2.0))  # generous for a busy host
    clients = [_client(server.address, spec, r) for r in range(3)]
    try:
        run_in_threads(3, lambda r: clients[r].join((lambda: torch.zeros(32)) if r == 0 else None))
        flats = [torch.empty(32) for _ in range(3)]
        run_in_threads(3, lambda r: clients[r].exchange(torch.ones(32), 0, flats[r]))
        clients[2].close()  # no leave, no more heartbeats: as if killed; its lease runs out
        told: dict[int, list[list[Eviction]]] = {0: [], 1: []}

        def two_steps(r: int) -> None:
            for clock in (1, 2):  # the first waits for worker 2 until its eviction completes iteration 1
                outcomes, _ = clients[r].exchange(torch.ones(32), clock, flats[r])
                assert all(o.accepted for o in outcomes)
                told[r].append(clients[r].take_news()[0])

        run_in_threads(2, two_steps)
        for r in (0, 1):
            assert told[r] == [[Eviction(2, 1, 2.0, 2)], []], told  # in the step it happened, once
            assert told[r][0][0].describe(3) == "worker 2 evicted at clock 1 (lease 2 s): continuing with 2 of 3"
        assert server.shard.version == 3
    finally:
        for c in clients[:2]:
            c.close()
        server.stop(0)


def test_a_worker_evicted_while_the_survivors_last_pull_waits_for_it_is_told_in_that_pull() -> None:
    # Before: only push (and Step) replies told of evictions. Survivors that push and pull in separate
    # calls (a payload over one frame to another host does) pushed their last iteration, then pulled;
    # that pull waited at the gate for the dead worker until its eviction, and nobody said so.
    spec = JobSpec(mode="sync", lr=0.1, num_shards=1, num_workers=3)
    server = start_server(ServerConfig(port=0, threads=8, lease_s=2.0))
    clients = [_client(server.address, spec, r) for r in range(3)]
    try:
        run_in_threads(3, lambda r: clients[r].join((lambda: torch.zeros(32)) if r == 0 else None))
        flats = [torch.empty(32) for _ in range(3)]
        run_in_threads(3, lambda r: clients[r].exchange(torch.ones(32), 0, flats[r]))
        clients[2].close()  # as if killed: its lease runs out
        told: dict[int, list[Eviction]] = {}

        def last_iteration(r: int) -> None:
            outcomes = clients[r].push(torch.ones(32), 1)
            assert all(o.deferred for o in outcomes) and clients[r].take_news() == ([], [])  # (not yet)
            clients[r].pull(flats[r], 2)  # waits at the gate until worker 2 is evicted
            told[r] = clients[r].take_news()[0]

        run_in_threads(2, last_iteration)
        assert told == {0: [Eviction(2, 1, 2.0, 2)], 1: [Eviction(2, 1, 2.0, 2)]}, told
        assert server.shard.version == 2
    finally:
        for c in clients[:2]:
            c.close()
        server.stop(0)


def _three_steps_and_a_checkpoint(c: ParameterClient, server: Any, directory: Path) -> torch.Tensor:
    """Join as the chief (zeros), take 3 steps, checkpoint the shard (version 3); returns the weights' buffer."""
    c.join(lambda: torch.zeros(32))
    flat = torch.empty(32)
    for clock in range(3):
        c.exchange(torch.ones(32), clock, flat)
    checkpoint.save(server.shard.snapshot(), directory)  # version 3
    return flat


def test_a_worker_is_told_once_how_many_updates_an_async_restart_lost(tmp_path: Path) -> None:
    # Before: the restored shard served an older version, and the workers said nothing of it.
    spec = JobSpec(mode="async", lr=0.1, num_shards=1)
    server = start_server(ServerConfig(port=0, threads=8))
    port = int(server.address.rsplit(":", 1)[1])
    with _client(server.address, spec, 0) as c:
        flat = _three_steps_and_a_checkpoint(c, server, tmp_path)
        for clock in range(3, 14):
            c.exchange(torch.ones(32), clock, flat)
        assert c.take_news() == ([], []) and server.shard.version == 14
        server.stop(0)  # a crash: no checkpoint after version 3 (this server has no --checkpoint-dir)
        again = start_server(ServerConfig(port=port, threads=8, checkpoint_dir=str(tmp_path)))
        try:
            assert again.shard.version == 3
            c.exchange(torch.ones(32), 14, flat)
            [restore] = c.take_news()[1]
            assert restore == Restore(0, 14, 3) and restore.lost == 11
            assert restore.describe() == ("shard 0 restarted from its checkpoint: its version went back from 14 to 3, "
                                          "11 updates lost")
            c.exchange(torch.ones(32), 15, flat)
            assert c.take_news() == ([], [])  # once
        finally:
            again.stop(0)


def test_a_restart_that_lost_nothing_this_worker_saw_is_told_too() -> None:
    # Before: a worker whose last seen version the checkpoint held heard nothing of the restart.
    restore = Restore(0, 80, 80)
    assert restore.lost == 0
    assert restore.describe() == ("shard 0 restarted from its checkpoint of version 80, which held every update "
                                  "this worker had seen: none lost")


def test_a_worker_that_joins_a_restored_shard_does_not_claim_that_none_were_lost(tmp_path: Path) -> None:
    """A resumed job's workers are new processes: each heard of the restore as it joined and said
    "which held every update this worker had seen: none lost", which claims what it cannot know (the
    stopped job may have applied updates after that checkpoint)."""
    spec = JobSpec(mode="async", lr=0.1, num_shards=1)
    server = start_server(ServerConfig(port=0, threads=8))
    try:
        with _client(server.address, spec, 0) as c:
            flat = _three_steps_and_a_checkpoint(c, server, tmp_path)
            c.exchange(torch.ones(32), 3, flat)  # (applied after the checkpoint: lost below)
            c.leave()
    finally:
        server.stop(0)
    again = start_server(ServerConfig(port=0, threads=8, checkpoint_dir=str(tmp_path)))
    try:
        with _client(again.address, spec, 0) as fresh:  # the resumed job's worker 0
            assert fresh.join(None) == 3
            fresh.exchange(torch.ones(32), 3, torch.empty(32))
            [restore] = fresh.take_news()[1]
    finally:
        again.stop(0)
    assert restore == Restore(0, 3, 3, joined_after=True)
    assert restore.describe() == ("shard 0 was restored from its checkpoint of version 3 before this worker joined (e.g. "
                                  "a resumed job): updates applied after that checkpoint before the restart, if any, "
                                  "are lost, and this worker, which never saw them, cannot count them")
    lines: list[str] = []
    with MetricsSink(tmp_path / "w.jsonl", 0) as sink:
        report = TrainingLog(WorkerConfig(servers=("127.0.0.1:1",), steps=5), _Task(), torch.nn.Linear(1, 1),  # type: ignore[arg-type]
                             torch.device("cpu"), sink, "worker 0/1", lines.append)
        report.news(4, [], [restore], 1)
        final = report.final(1.0)
    record = json.loads((tmp_path / "w.jsonl").read_text().splitlines()[0])
    assert record["updates_lost"] is None and record["joined_after"] is True  # (not 0: not counted)
    assert "updates_lost" not in final and final["restores"][0]["joined_after"] is True


class _Task:
    name = "stub"

    def evaluate(self, model: Any, device: Any) -> dict[str, float]:
        return {"test_loss": 1.0, "test_accuracy": 0.5}

    def evaluate_during_training(self, model: Any, device: Any) -> dict[str, float]:
        return {}


@pytest.mark.timeout(30)
def test_the_worker_logs_each_once_and_its_final_record_carries_the_updates_lost(tmp_path: Path) -> None:
    lines: list[str] = []
    sink = MetricsSink(tmp_path / "w.jsonl", 1)
    report = TrainingLog(WorkerConfig(servers=("127.0.0.1:1",), rank=1, steps=5), _Task(), torch.nn.Linear(1, 1), torch.device("cpu"),  # type: ignore[arg-type]
                         sink, "worker 1/3", lines.append)
    report.news(4, [Eviction(2, 61, 10.0, 2)], [Restore(0, 311, 300)], 3)
    final = report.final(1.0)
    sink.close()
    assert lines[:2] == ["worker 1/3: worker 2 evicted at clock 61 (lease 10 s): continuing with 2 of 3",
                         "worker 1/3: shard 0 restarted from its checkpoint: its version went back from 311 to 300, "
                         "11 updates lost"]
    records = [json.loads(x) for x in (tmp_path / "w.jsonl").read_text().splitlines()]
    assert [r["event"] for r in records] == ["evicted", "restore", "final"]
    assert records[1]["updates_lost"] == 11 and final["updates_lost"] == records[2]["updates_lost"] == 11
    assert records[2]["restores"] == [{"shard": 0, "from_version": 311, "to_version": 300}]


def test_a_sync_worker_every_shard_evicted_rejoins_at_the_furthest_behind_shards_iteration() -> None:
    """Iteration 1 reached shard 1 only when the worker went silent past its lease on both shards
    (a paused server, say): it rejoins at iteration 1 (shard 0's), which shard 1 acknowledges as
    a duplicate, and the job goes on. Before, it continued from iteration 2 (shard 1's): shard 0's
    gate for it never opened, as nobody would push iteration 1 there."""
    spec = JobSpec(mode="sync", lr=0.1, num_shards=2, num_workers=1)
    servers = [start_server(ServerConfig(port=0, threads=8, lease_s=1.0)) for _ in range(2)]
    params = [ParamSpec("w", (64,), "float32")]
    config = ClientConfig(connect_timeout_s=10, rpc_timeout_s=10, reconnect_timeout_s=0, shared_memory=False)
    c = ParameterClient([s.address for s in servers], spec, params, plan_shards(params, 2), 0, config)
    try:
        c.join(lambda: torch.zeros(64))
        flat = torch.empty(64)
        c.exchange(torch.ones(64), 0, flat)
        (start, end) = c.plan.ranges[1]
        c.shards[1].push(c._push_header(1, 1, None, "", c._split_rows(None)[1]),
                         c._push_payload(1, torch.ones(end - start))[0])
        c._halt_heartbeat()  # silent: both shards evict it
        for s in servers:
            assert s.shard.wait_until(lambda st: st.evictions == 1, 30)
        assert [s.shard.version for s in servers] == [1, 2]
        assert c.join(None) == 1
        for clock in (1, 2):
            outcomes, versions = c.exchange(torch.ones(64), clock, flat)
            assert outcomes[0].applied and versions == [clock + 1] * 2
        assert outcomes[1].applied
        torch.testing.assert_close(flat, torch.full((64,), -0.3))  # three updates on both shards
    finally:
        c.close()
        for s in servers:
            s.stop(0)


def test_a_worker_continues_from_the_furthest_behind_shard_only_where_its_own_pushes_are_ahead() -> None:
    """(ParameterClient.join's rule.) Sync: back to the furthest-behind shard's clock where every
    shard ahead of it is ahead by this worker's pushes (a duplicate there); a worker new to the
    job, or one the shards went on without, continues from the furthest-ahead shard's (it skips
    the iteration that completed without it, on every shard alike). Async: furthest ahead."""
    from psgrad.client.parameter_client import continue_from
    from psgrad.proto import ps_pb2 as pb

    def replies(*pairs: tuple[int, int]) -> list[pb.JoinReply]:
        return [pb.JoinReply(start_clock=start, last_push_clock=last) for start, last in pairs]

    assert continue_from(replies((2, 1), (3, 2)), sync=True) == 2  # its push of 2 reached shard 1 only
    assert continue_from(replies((2, 1), (4, 3), (3, 2)), sync=True) == 2
    assert continue_from(replies((2, -1), (3, -1)), sync=True) == 3  # new: shard 1 completed 2 without it
    assert continue_from(replies((2, 0), (3, 0)), sync=True) == 3  # shard 1 went on without it
    assert continue_from(replies((2, 1), (3, 2)), sync=False) == 3
    assert continue_from(replies((5, 4), (5, 4)), sync=True) == 5


@pytest.mark.timeout(30)
def test_a_worker_that_starts_at_its_steps_says_the_job_had_finished_and_a_resumed_one_what_it_trained(
    tmp_path: Path
) -> None:
    """Before: resuming a finished job printed "final ... after 300 steps in 0.0 s", nothing trained."""
    for start, said, final_says in (
        (5, ["worker 0/1: joined at clock 5, and --steps is 5: the job had already finished, nothing is left to train "
             "(give a larger --steps to train on)"], "at clock 5, nothing trained (the job had already finished)"),
        (2, [], "after 5 steps (3 in this run) in 1.0 s"),
        (0, [], "after 5 steps in 1.0 s"),
    ):
        lines: list[str] = []
        with MetricsSink(None, 0) as sink:
            report = TrainingLog(WorkerConfig(servers=("127.0.0.1:1",), steps=5), _Task(), torch.nn.Linear(1, 1),  # type: ignore[arg-type]
                                 torch.device("cpu"), sink, "worker 0/1", lines.append)
            report.start(start, "async")
            report.final(1.0)
        assert lines == [*said, f"worker 0/1: final test_loss 1.0000 test_accuracy 0.5000 {final_says}"], lines


def test_an_eviction_the_shards_tell_at_different_clocks_is_told_once() -> None:
    """Worker 1's push of iteration 1 reached shard 0 only before it went silent: shard 0 evicts it
    at clock 2, shard 1 at clock 1. Worker 0 hears of it once (it heard it twice, one per clock)."""
    spec = JobSpec(mode="sync", lr=0.1, num_shards=2, num_workers=2)
    servers = [start_server(ServerConfig(port=0, threads=8, lease_s=1.0)) for _ in range(2)]
    params = [ParamSpec("w", (64,), "float32")]
    config = ClientConfig(connect_timeout_s=10, rpc_timeout_s=30, reconnect_timeout_s=0, shared_memory=False)
    clients = [ParameterClient([s.address for s in servers], spec, params, plan_shards(params, 2), r, config)
               for r in range(2)]
    try:
        run_in_threads(2, lambda r: clients[r].join((lambda: torch.zeros(64)) if r == 0 else None))
        flats = [torch.empty(64) for _ in range(2)]
        run_in_threads(2, lambda r: clients[r].exchange(torch.ones(64), 0, flats[r]))
        c = clients[1]
        start, end = c.plan.ranges[0]
        c.shards[0].push(c._push_header(0, 1, None, "", c._split_rows(None)[0]), c._push_payload(0, torch.ones(end - start))[0])
        c._halt_heartbeat()  # silent from now on: both shards evict it
        clients[0].exchange(torch.ones(64), 1, flats[0])  # waits for the evictions
        clients[0].exchange(torch.ones(64), 2, flats[0])
        evicted, _ = clients[0].take_news()
        assert [e.rank for e in evicted] == [1], evicted
    finally:
        for c in clients:
            c.close()
        for s in servers:
            s.stop(0)
