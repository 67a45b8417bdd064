"""Whole pushes and pulls under a deadline from their size (--transfer-allowance-s plus the size at
--min-transfer-rate-mb-s): a push trickled a few bytes per frame (each frame in time for the per-frame
read deadline) and a pull whose client stops reading are cut, and what they held is given back.
In-process servers, real gRPC channels; the deadlines are made short so that each test takes seconds."""
from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
import torch

from conftest import wait_for
from psgrad.client.parameter_client import ParameterClient, shard_status
from psgrad.config import ClientConfig, JobSpec, ServerConfig
from psgrad.core.sharding import ParamSpec, plan_shards
from psgrad.proto import ps_pb2 as pb
from psgrad.server.runtime import RunningServer, start_server
from psgrad.server.streams import transfer_deadline_s
from psgrad.wire.protocol import METHOD_PREFIX

pytestmark = pytest.mark.timeout(60)

SPEC = JobSpec(lr=0.1, num_workers=3, mode="async")
# Payloads through gRPC frames (no shared memory); a client's call fails after 10 s (a push held up for
# good by a trickle made the other worker's Step fail so).
CONFIG = ClientConfig(connect_timeout_s=5, rpc_timeout_s=10, reconnect_timeout_s=0, shared_memory=False)
SLACK_S = 0.75  # how late a cut may come after its deadline (the watchdog's tick, a loaded test machine)


class Logged(list[str]):
    """The server's warnings, and when each was logged (time.monotonic())."""

    def __init__(self) -> None:
        super().__init__()
        self.at: list[float] = []


def serve(allowance_s: float, rate_mb_s: float) -> tuple[RunningServer, Logged]:
    running = start_server(ServerConfig(port=0, threads=8, lease_s=60, transfer_allowance_s=allowance_s,
                                        min_transfer_rate_mb_s=rate_mb_s))
    assert running.streams is not None
    logged = Logged()
    warn = running.streams._warn

    def record(line: str) -> None:
        logged.at.append(time.monotonic())
        logged.append(line)
        warn(line)

    running.streams._warn = record  # type: ignore[method-assign]
    return running, logged


def clients(address: str, numel: int, optimizer: str = "sgd") -> list[ParameterClient]:
    params = [ParamSpec("w", (numel,), "float32")]
    spec = dataclasses.replace(SPEC, optimizer=optimizer)
    made = [ParameterClient([address], spec, params, plan_shards(params, 1), r, CONFIG) for r in range(3)]
    made[0].join(lambda: torch.zeros(numel))
    made[1].join(None)
    made[2].join(None)
    return made


class Trickle:
    """A client stream (a Push, by default) on its own connection: its header frame, then 4 bytes
    every 0.2 s (each frame well within the per-frame read deadline) until the call ends."""

    def __init__(self, address: str, head: bytes, method: str = "Push",
                 data: bytes = pb.PushFrame(data=b"\0\0\0\0").SerializeToString()) -> None:
        self.channel = grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        self._stop = threading.Event()
        self.sent = 0
        self.ended = threading.Event()
        self.end_s = 0.0
        self.started = time.monotonic()
        self.call = self.channel.stream_unary(METHOD_PREFIX + method, None, None).future(
            self._frames(head, data), timeout=30)
        self.call.add_done_callback(self._done)

    def _frames(self, head: bytes, data: bytes) -> Iterator[bytes]:
        yield head
        while not self._stop.wait(0.2):  # the trickle itself: a pause between frames is what it is
            self.sent += 4
            yield data

    def _done(self, _: object) -> None:
        self.end_s = time.monotonic() - self.started
        self._stop.set()
        self.ended.set()

    def close(self) -> None:
        self._stop.set()
        self.call.cancel()
        self.channel.close()


@pytest.mark.parametrize("optimizer", ["sgd", "adam"], ids=["staged", "in-place"])
def test_a_trickling_push_is_cut_at_its_deadline_and_another_workers_step_goes_on(optimizer: str) -> None:
    # Before: only each frame was under a deadline (--stream-read-timeout-s), so 4 bytes every 0.2 s
    # held the shard's only receive buffer (or, plain SGD, its staged turn) for as long as the push
    # lasted (about a day for a real gradient at 4 bytes per 10 s), and the other worker's Step,
    # waiting for it, failed at its own deadline (DEADLINE_EXCEEDED); then it waited until the cut.
    numel = 5000
    deadline_s = transfer_deadline_s(4 * numel, 2.0, 1.0)  # 2 s + 20,000 bytes at 1 MB/s = 2.02 s
    running, logged = serve(2.0, 1.0)
    chief, staller, other = clients(running.address, numel, optimizer)
    trickle = Trickle(running.address, staller._push_header(0, 0).frame())
    try:
        wait_for("the trickling push to hold the receive buffer",
                 lambda: shard_status([running.address], 5)[0].transfers.buffers_lent == 1, timeout_s=10)
        wait_for("the trickle to go on for 0.4 s", lambda: trickle.sent >= 8, timeout_s=10)
        flat = torch.empty(numel)
        asked = time.monotonic()
        outcomes, _ = other.exchange(torch.ones(numel), 0, flat)  # one Step call, beside the trickle
        step_s = time.monotonic() - asked
        trickling = not trickle.ended.is_set()
        assert trickle.ended.wait(10)
        code = trickle.call.exception().code()  # type: ignore[union-attr]
        asked = time.monotonic()
        other.exchange(torch.ones(numel), 1, flat)  # the same Step with no trickle in the way
        plain_s = time.monotonic() - asked
        print(f"a trickling push ({trickle.sent} bytes of {4 * numel} sent) was cut {code.name} after "
              f"{trickle.end_s:.2f} s, its deadline {deadline_s:.2f} s; the other worker's Step meanwhile took "
              f"{step_s:.3f} s (one with nothing in the way: {plain_s:.3f} s)")
        assert code == grpc.StatusCode.CANCELLED
        assert deadline_s <= trickle.end_s <= deadline_s + SLACK_S
        # The Step went ahead beside the trickle (which the floor rate puts behind once it has held the
        # buffer HOLD_GRACE_S, 0.1 s), long before the cut.
        assert outcomes[0].applied and trickling and step_s < deadline_s / 2, (step_s, trickling)
        cut = "cancelled a Push call from "  # (logged by the watchdog just after it cancels)
        wait_for("the server to log the cut", lambda: any(x.startswith(cut) for x in logged), timeout_s=10)
        (line,) = [x for x in logged if x.startswith(cut)]
        assert "(worker rank 1, as its request says" in line and f"of {4 * numel} bytes arrived in" in line, line
        assert "--transfer-allowance-s 2 + 20000 bytes at --min-transfer-rate-mb-s 1" in line, line
        def freed() -> bool:  # (the cut call's handler gives back what it held as it unwinds, just after the cancel)
            transfers = shard_status([running.address], 5)[0].transfers
            return transfers.buffers_lent == 0 and transfers.streams_open == 0

        wait_for("the cut push to give back its receive buffer and stream", freed, timeout_s=10)
        status = shard_status([running.address], 5)[0]
        assert status.transfers.streams_cancelled == 1 and running.streams.transfers_cancelled == 1  # type: ignore[union-attr]
        assert status.pushes_rejected == 1 and status.pushes_applied == 2
    finally:
        trickle.close()
        for c in (chief, staller, other):
            c.close()
        running.stop(0)


def test_a_pull_whose_client_stops_reading_is_cut_at_its_deadline_and_released() -> None:
    # Before: a pull was under no deadline at all: a client that read its header and then nothing more
    # held the stream, a handler thread and the weights it was reading for as long as it kept the
    # connection open.
    numel = 4 << 20  # 16 MiB of weights: far more than the flow-control windows and socket buffers hold
    allowance_s, rate_mb_s = 1.5, 100.0
    running, logged = serve(allowance_s, rate_mb_s)
    chief, staller, other = clients(running.address, numel)
    # No BDP probing: the client's window stays at gRPC's 64 KiB, as a client that stops reading leaves it.
    channel = grpc.insecure_channel(running.address, options=[("grpc.use_local_subchannel_pool", 1),
                                                               ("grpc.http2.bdp_probe", 0)])
    try:
        pull = channel.unary_stream(METHOD_PREFIX + "Pull", pb.PullRequest.SerializeToString, pb.PullFrame.FromString)
        started = time.monotonic()
        call = pull(pb.PullRequest(rank=1, clock=0, fingerprint=staller.fingerprint), timeout=30)
        header = next(call).header  # ... and nothing more is read
        deadline_s = transfer_deadline_s(4 * numel + len(pb.PullFrame(header=header).SerializeToString()),
                                         allowance_s, rate_mb_s)
        wait_for("the stalled pull to hold its stream",
                 lambda: shard_status([running.address], 5)[0].transfers.streaming_pulls == 1, timeout_s=5)
        # (The client sees the end only once it reads again: gRPC gives it the frames it had first.)
        wait_for("the server to cut the stalled pull", lambda: bool(logged), timeout_s=10)
        cut_s = logged.at[0] - started
        wait_for("the server to release the stalled pull's stream",
                 lambda: shard_status([running.address], 5)[0].transfers.streaming_pulls == 0, timeout_s=5)
        with pytest.raises(grpc.RpcError) as ended:
            for _ in call:  # what reached the client before the cut, then the end
                pass
        code = ended.value.code()  # type: ignore[attr-defined]
        flat = torch.empty(numel)
        asked = time.monotonic()
        other.pull(flat, 0)
        pull_s = time.monotonic() - asked
        asked = time.monotonic()
        outcomes, _ = other.exchange(torch.ones(numel), 0, flat)
        step_s = time.monotonic() - asked
        print(f"a pull whose client stopped reading was cut {code.name} after {cut_s:.2f} s, its deadline "
              f"{deadline_s:.2f} s; then another worker's pull took {pull_s:.3f} s and its push and pull {step_s:.3f} s")
        assert code == grpc.StatusCode.CANCELLED
        assert deadline_s <= cut_s <= deadline_s + SLACK_S
        assert torch.equal(flat, torch.full((numel,), -0.1)) and outcomes[0].applied
        (line,) = [x for x in logged if x.startswith("cancelled a Pull call to ")]
        assert "(worker rank 1, as its request says" in line and " bytes sent in " in line, line
        assert "--transfer-allowance-s 1.5 + 16777232 bytes at --min-transfer-rate-mb-s 100" in line, line
        status = shard_status([running.address], 5)[0]
        assert status.transfers.streaming_pulls == 0 and status.transfers.retired_buffers == 0, status.transfers
        assert running.streams.transfers_cancelled == 1  # type: ignore[union-attr]
    finally:
        channel.close()
        for c in (chief, staller, other):
            c.close()
        running.stop(0)


def test_a_pull_of_the_frozen_table_whose_client_stops_reading_is_cut_at_its_deadline() -> None:
    # Before: the frozen table's pull (read at join) ran under no whole-transfer deadline: a client that
    # read its header and nothing more held a copy of the values and a handler thread for as long as
    # it kept the connection open.
    numel = 4 << 20  # 16 MiB of frozen values
    allowance_s, rate_mb_s = 1.5, 100.0
    running, logged = serve(allowance_s, rate_mb_s)
    params, frozen = [ParamSpec("w", (16,), "float32")], [ParamSpec("backbone", (numel,), "float32")]
    chief = ParameterClient([running.address], SPEC, params, plan_shards(params, 1), 0, CONFIG, frozen=frozen)
    chief.join(lambda: torch.zeros(16), initial_frozen=lambda: torch.ones(numel))
    channel = grpc.insecure_channel(running.address, options=[("grpc.use_local_subchannel_pool", 1),
                                                               ("grpc.http2.bdp_probe", 0)])
    try:
        pull = channel.unary_stream(METHOD_PREFIX + "Pull", pb.PullRequest.SerializeToString, pb.PullFrame.FromString)
        started = time.monotonic()
        # (as the chief, which joined: a worker's read from a rank that never joined is refused)
        call = pull(pb.PullRequest(rank=0, table="frozen", fingerprint=chief.fingerprint), timeout=30)
        header = next(call).header  # ... and nothing more is read
        deadline_s = transfer_deadline_s(4 * numel + len(pb.PullFrame(header=header).SerializeToString()),
                                         allowance_s, rate_mb_s)
        wait_for("the server to cut the stalled pull", lambda: bool(logged), timeout_s=10)
        cut_s = logged.at[0] - started
        with pytest.raises(grpc.RpcError) as ended:
            for _ in call:  # what reached the client before the cut, then the end
                pass
        print(f"a frozen-table pull whose client stopped reading was cut after {cut_s:.2f} s, its deadline {deadline_s:.2f} s")
        assert ended.value.code() == grpc.StatusCode.CANCELLED  # type: ignore[attr-defined]
        assert deadline_s <= cut_s <= deadline_s + SLACK_S
        (line,) = [x for x in logged if x.startswith("cancelled a Pull call to ")]
        assert "(worker rank 0, as its request says" in line, line
        got = torch.empty(numel)
        chief.pull_frozen(got)  # the table serves on
        assert torch.equal(got, torch.ones(numel))
    finally:
        channel.close()
        chief.close()
        running.stop(0)


def test_a_trickled_replica_record_is_cut_at_its_deadline() -> None:
    # Before: a replica record's payload (server to server) was read under the per-frame deadline only,
    # so a caller with the servers' credential (or anyone, where the server authenticates no one) could
    # hold a handler thread and a record-sized buffer of the backup by trickling it.
    nbytes = 20000
    deadline_s = transfer_deadline_s(nbytes, 1.0, 1.0)
    running, logged = serve(1.0, 1.0)
    head = pb.ReplicaFrame(header=pb.ReplicaHeader(epoch=1, version=1, kind="gradient", nbytes=nbytes,
                                                   primary="127.0.0.1:1")).SerializeToString()
    trickle = Trickle(running.address, head, "ReplicaApply", pb.ReplicaFrame(data=b"\0\0\0\0").SerializeToString())
    try:
        assert trickle.ended.wait(10)
        code = trickle.call.exception().code()  # type: ignore[union-attr]
        print(f"a trickled replica record ({trickle.sent} of {nbytes} bytes) was cut {code.name} after "
              f"{trickle.end_s:.2f} s, its deadline {deadline_s:.2f} s")
        assert code == grpc.StatusCode.CANCELLED
        assert deadline_s <= trickle.end_s <= deadline_s + SLACK_S
        cut = "cancelled a ReplicaApply call from "  # (logged by the watchdog just after it cancels)
        wait_for("the server to log the cut", lambda: any(x.startswith(cut) for x in logged), timeout_s=10)
        (line,) = [x for x in logged if x.startswith(cut)]
        assert "(primary 127.0.0.1:1)" in line and f"of {nbytes} bytes arrived in" in line, line
        wait_for("the cut record's stream to close", lambda: shard_status([running.address], 5)[0].transfers.streams_open == 0,
                 timeout_s=10)  # (its handler unwinds just after the cancel)
    finally:
        trickle.close()
        running.stop(0)
