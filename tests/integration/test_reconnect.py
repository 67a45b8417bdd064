"""A server restart in process: it checkpoints while serving and a restarted one serves the job at
once; a worker rides it out (calls to a shard that stops answering are retried with backoff until
it is back), or fails naming the shard after the timeout."""
from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import SlowToAnswer, held_address, hold_port, note_first_sleep
from psgrad.client import reconnect
from psgrad.client.parameter_client import ParameterClient
from psgrad.config import ClientConfig, JobSpec, ServerConfig
from psgrad.core.sharding import ParamSpec, plan_shards
from psgrad.errors import ServerUnavailableError
from psgrad.server import checkpoint
from psgrad.server.runtime import start_server

pytestmark = pytest.mark.timeout(90)

PARAMS = [ParamSpec("w", (32,), "float32")]
SPEC = JobSpec(lr=0.5, num_shards=1)


def _client(address: str, reconnect_timeout_s: float) -> ParameterClient:
    config = ClientConfig(connect_timeout_s=5, rpc_timeout_s=5, reconnect_timeout_s=reconnect_timeout_s, shared_memory=False)
    return ParameterClient([address], SPEC, PARAMS, plan_shards(PARAMS, 1), 0, config)


def test_a_push_to_a_restarting_server_is_retried_until_it_is_back_and_applied_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    retrying = note_first_sleep(monkeypatch, reconnect)  # set when the client first backs off
    config = ServerConfig(port=0, threads=8, checkpoint_dir=str(tmp_path))
    server = start_server(config)
    port = int(server.address.rsplit(":", 1)[1])
    out: list[Any] = []
    with _client(server.address, reconnect_timeout_s=30) as c:
        c.join(lambda: torch.zeros(32))
        [first] = c.push(torch.ones(32), 0)
        server.stop(0)  # the last checkpoint holds version 1
        thread = threading.Thread(target=lambda: out.append(c.push(torch.ones(32), 1)))
        thread.start()
        assert retrying.wait(30), "the push never retried"
        again = start_server(ServerConfig(port=port, threads=8, checkpoint_dir=str(tmp_path)))
        try:
            thread.join(30)
            assert not thread.is_alive() and out
            [second] = out[0]
            assert first.applied and second.applied and second.version == 2
            [dup] = c.push(torch.ones(32), 1)  # a retried duplicate is acknowledged, not applied
            assert not dup.applied and again.shard.version == 2
            torch.testing.assert_close(again.shard.weights_copy(), torch.full((32,), -1.0))
        finally:
            again.stop(0)


def test_a_server_that_does_not_come_back_is_named_after_the_reconnect_timeout() -> None:
    # Before the port was held, a parallel test's server once got it and answered the push
    # ("shard is not initialized") instead of the refusal this test is about.
    server = start_server(ServerConfig(port=0, threads=8))
    with _client(server.address, reconnect_timeout_s=0.5) as c:
        c.join(lambda: torch.zeros(32))
        server.stop(0)
        held = hold_port(server.address)
        start = time.monotonic()
        with held, pytest.raises(ServerUnavailableError) as info:
            c.push(torch.ones(32), 0)
        elapsed = time.monotonic() - start
        assert elapsed < 10
        # what happened, for how long of the timeout, and what became of the push
        match = re.fullmatch(
            rf"server {server.address} refused the connection \(nothing listens on that port: is the server running, "
            r"at that address\?\) for (\d+\.\d) s of --reconnect-timeout-s 0.5: the push was not sent", str(info.value))
        assert match, info.value
        assert 0.5 <= float(match.group(1)) <= elapsed + 0.05


def test_a_server_whose_handshake_takes_seconds_is_joined_and_pushed_to() -> None:
    """A connection attempt may take seconds (a busy machine, TLS over a slow link): the client's
    channels had given each about a second (gRPC reads the minimum reconnect backoff as the time
    an attempt may take), so such a server was never reached, even within a long connect timeout."""
    server = start_server(ServerConfig(port=0, threads=8))
    slow = SlowToAnswer(server.address, 1.5)
    try:
        with _client(slow.address, reconnect_timeout_s=5) as c:
            c.join(lambda: torch.zeros(32))
            [pushed] = c.push(torch.ones(32), 0)
        assert pushed.applied and server.shard.version == 1
        torch.testing.assert_close(server.shard.weights_copy(), torch.full((32,), -0.5))
    finally:
        slow.close()
        server.stop(0)


def test_a_push_on_a_new_connection_the_server_takes_but_is_silent_on_is_retried_until_it_speaks() -> None:
    """The connection lost, the next one is taken but not answered for longer than the push's
    deadline (a stopped or starved server): the deadline is diagnosed as that — the push's channel
    still connecting, a plain TCP connection taken — and the push is retried as for a silent
    server, until the handshake completes, and applied once."""
    server = start_server(ServerConfig(port=0, threads=8))
    slow = SlowToAnswer(server.address, 0.0)
    config = ClientConfig(connect_timeout_s=5, rpc_timeout_s=1, reconnect_timeout_s=30, shared_memory=False)
    try:
        with ParameterClient([slow.address], SPEC, PARAMS, plan_shards(PARAMS, 1), 0, config) as c:
            c.join(lambda: torch.zeros(32))
            slow.delay_s = 5.0
            slow.drop()
            start = time.monotonic()
            [pushed] = c.push(torch.ones(32), 0)
            assert time.monotonic() - start >= 1.0  # past its first deadline: retried
        assert pushed.applied and server.shard.version == 1
        torch.testing.assert_close(server.shard.weights_copy(), torch.full((32,), -0.5))
    finally:
        slow.close()
        server.stop(0)


def test_a_server_checkpoints_while_it_runs_and_a_restarted_one_serves_the_job_at_once(tmp_path: Path) -> None:
    params = [ParamSpec("w", (64,), "float32")]
    spec = JobSpec(lr=0.5, num_shards=1)
    config = ServerConfig(port=0, threads=8, checkpoint_dir=str(tmp_path), checkpoint_every_versions=2)
    server = start_server(config)
    try:
        with ParameterClient([server.address], spec, params, plan_shards(params, 1), 0, ClientConfig()) as c:
            c.join(lambda: torch.zeros(64))
            for clock in range(5):
                c.push(torch.full((64,), float(clock)), clock)
        expected = server.shard.weights_copy()
    finally:
        server.stop(0)  # a planned stop writes the last checkpoint (version 5)
    assert [m.name for m in checkpoint.manifests(tmp_path)] == ["ckpt-v000000000005.json", "ckpt-v000000000004.json"]
    again = start_server(ServerConfig(port=0, threads=8, checkpoint_dir=str(tmp_path)))
    try:
        st = again.shard.status()
        assert st.initialized and st.version == 5 and {w.rank: w.clock for w in st.workers} == {0: 5}
        assert torch.equal(again.shard.weights_copy(), expected)
    finally:
        again.stop(0)


def test_a_worker_the_restored_checkpoint_does_not_know_joins_again(tmp_path: Path) -> None:
    """The server crashed before any checkpoint held worker 1: after the restart, worker 1's next
    push joins again first, then goes through."""
    spec = JobSpec(lr=0.5, num_shards=1, num_workers=2)
    server = start_server(ServerConfig(port=0, threads=8))
    port = int(server.address.rsplit(":", 1)[1])
    config = ClientConfig(connect_timeout_s=5, rpc_timeout_s=5, reconnect_timeout_s=30, shared_memory=False)
    plan = plan_shards(PARAMS, 1)
    with ParameterClient([server.address], spec, PARAMS, plan, 0, config) as chief:
        chief.join(lambda: torch.zeros(32))
    checkpoint.save(server.shard.snapshot(), tmp_path)  # worker 1 has not joined yet
    with ParameterClient([server.address], spec, PARAMS, plan, 1, config) as late:
        late.join(None)
        [first] = late.push(torch.ones(32), 0)
        server.stop(0)
        again = start_server(ServerConfig(port=port, threads=8, checkpoint_dir=str(tmp_path)))
        try:
            assert {w.rank for w in again.shard.status().workers} == {0}
            [second] = late.push(torch.ones(32), 1)
            assert first.applied and second.applied and again.shard.version == 1
            assert {w.rank for w in again.shard.status().workers} == {0, 1}
        finally:
            again.stop(0)


def test_a_worker_leaving_after_a_shard_is_gone_waits_one_reconnect_timeout_not_two(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The way out (leaving the job, as `with psgrad.connect(...)` and `psgrad worker` do after an error)
    sent Leave to the shard that was just given up on, and retried it for a second whole
    --reconnect-timeout-s (21.5 s for 10). It is not sent there now; the other shard is left."""
    import psgrad
    from torch import nn

    window = 4.0
    leaves: list[str] = []
    real_call = reconnect.call

    def recording(what: str, fn: Any, timeout_s: float, address: str, *rest: Any) -> Any:
        if what == "the leave request":
            leaves.append(address)
        return real_call(what, fn, timeout_s, address, *rest)

    monkeypatch.setattr(reconnect, "call", recording)
    servers = [start_server(ServerConfig(port=0, threads=8)) for _ in range(2)]
    gone, alive = servers
    config = ClientConfig(connect_timeout_s=5, rpc_timeout_s=5, reconnect_timeout_s=window, shared_memory=False)
    try:
        model = nn.Linear(64, 10)
        with pytest.raises(ServerUnavailableError) as info:
            with psgrad.connect([s.address for s in servers], client=config) as ps:
                opt = ps.optimizer(model)
                model(torch.ones(1, 64)).sum().backward()
                opt.step()
                gone.stop(0)
                held = hold_port(gone.address)  # no other test's server gets it
                start = time.monotonic()
                model(torch.ones(1, 64)).sum().backward()
                with held:
                    opt.step()
        elapsed = time.monotonic() - start
        # (the last answer of the gone server: its port refusing a connection, or, where the last
        # attempt met the server still closing, the connection closed)
        match = re.search(rf"server {gone.address} (refused|closed) the connection .* for (\d+\.\d) s of "
                          "--reconnect-timeout-s 4:", str(info.value))
        assert match, info.value
        assert leaves == [alive.address], leaves  # left the live shard; nothing sent to the gone one
        assert [state for _, _, state, *_ in alive.shard.status().workers] == ["left"]
        assert elapsed < 1.5 * window + 0.5, elapsed  # was >= 2 * window: the leave retried a window of its own
    finally:
        alive.stop(0)


def _join(address: str, config: ClientConfig) -> int:
    with ParameterClient([address], SPEC, PARAMS, plan_shards(PARAMS, 1), 0, config) as c:
        return c.join(None)


def test_a_refused_first_call_is_reported_after_a_short_grace_not_the_connect_timeout() -> None:
    """A refused connection is an answer: the join (and a status request) reported it only once the
    whole connect timeout had passed (10-17 s for a worker, 5 s for `psgrad status`)."""
    from psgrad.cli.status import fetch
    from psgrad.errors import DeadlineExceededError

    held = hold_port()
    address = held_address(held)
    config = ClientConfig(connect_timeout_s=30, rpc_timeout_s=30, reconnect_timeout_s=30, shared_memory=False)
    with held:  # (held for both calls: the port closed after the first went to another test's server once)
        for call in (lambda: _join(address, config), lambda: fetch([address], timeout_s=30)):
            start = time.monotonic()
            with pytest.raises(ServerUnavailableError) as info:
                call()
            elapsed = time.monotonic() - start
            assert not isinstance(info.value, DeadlineExceededError), info.value
            assert re.match(rf"server {address} refused the connection \(nothing listens on that port: is the server "
                            r"running, at that address\?\) for \d\.\d s: the (join|status) request was not sent",
                            str(info.value)), info.value
            assert reconnect.REFUSED_GRACE_S <= elapsed < 10, elapsed  # was 30 s: the whole connect timeout


def test_a_server_that_starts_during_the_grace_is_joined(monkeypatch: pytest.MonkeyPatch) -> None:
    retrying = note_first_sleep(monkeypatch, reconnect)  # set once the first attempt was refused
    held = hold_port()  # refused until the server takes it, and no other test's server gets it meanwhile
    port = held.getsockname()[1]
    config = ClientConfig(connect_timeout_s=30, rpc_timeout_s=30, reconnect_timeout_s=5, shared_memory=False)
    out: list[Any] = []
    with ParameterClient([f"127.0.0.1:{port}"], SPEC, PARAMS, plan_shards(PARAMS, 1), 0, config) as c:
        thread = threading.Thread(target=lambda: out.append(c.join(lambda: torch.zeros(32))))
        thread.start()
        assert retrying.wait(30), "the join was never refused"
        held.close()
        server = start_server(ServerConfig(port=port, threads=8))
        try:
            thread.join(30)
            assert out == [0], out  # joined at clock 0 (the chief initialized the shard)
        finally:
            server.stop(0)


def test_wait_for_servers_waits_the_connect_timeout_through_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    """`psgrad run` (a cluster starts the servers when it likes) and --wait-for-servers: a refused
    connection is waited through, up to the connect timeout; without it, after the grace (0 here)."""
    import grpc

    monkeypatch.setattr(reconnect, "REFUSED_GRACE_S", 0.0)
    held = hold_port()  # refused until the server takes it, and no other test's server gets it meanwhile
    port = held.getsockname()[1]
    config = ClientConfig(connect_timeout_s=30, rpc_timeout_s=30, reconnect_timeout_s=5, shared_memory=False)
    with pytest.raises(ServerUnavailableError, match="refused the connection"):
        _join(f"127.0.0.1:{port}", config)
    waiting = ClientConfig(connect_timeout_s=30, rpc_timeout_s=30, reconnect_timeout_s=5, shared_memory=False,
                           wait_for_servers=True)
    out: list[Any] = []
    with ParameterClient([f"127.0.0.1:{port}"], SPEC, PARAMS, plan_shards(PARAMS, 1), 0, waiting) as c:
        refused = threading.Event()
        c.shards[0]._channel.subscribe(
            lambda state: refused.set() if state == grpc.ChannelConnectivity.TRANSIENT_FAILURE else None)
        thread = threading.Thread(target=lambda: out.append(c.join(lambda: torch.zeros(32))))
        thread.start()
        assert refused.wait(30), "the channel never tried the port"
        held.close()
        server = start_server(ServerConfig(port=port, threads=8))
        try:
            thread.join(30)
            assert out == [0], out
        finally:
            server.stop(0)
