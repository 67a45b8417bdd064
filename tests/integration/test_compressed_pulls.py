"""Compressed pulls through real gRPC servers (in-process) and real clients: in every mode, codec and
transport the worker's copy equals the server's copy of it bit for bit after every pull, and moves
toward the master weights by what the codec sends (error feedback on the server's side); the first
pull, a periodic resync, one for the error and a failover to a standby are exact; observing pulls
and exports read the master weights; the servers count the bytes sent. (The server's half is
psgrad/server/worker_copies.py, the worker's psgrad/client/delta_wire.py.)"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest
import torch

from conftest import cli_in_process, run_in_threads

from psgrad.client.export import export_state_dict
from psgrad.client.parameter_client import ParameterClient
from psgrad.config import ClientConfig, JobSpec, ServerConfig
from psgrad.core.compression import parse_compression
from psgrad.core.sharding import ParamSpec, plan_shards
from psgrad.errors import ConfigError, InvalidRequestError
from psgrad.proto import ps_pb2 as pb
from psgrad.server.runtime import RunningServer, start_server

pytestmark = pytest.mark.timeout(120)

NUMEL = 6000
PARAMS = [ParamSpec("w", (NUMEL,), "float32")]
PLAN = plan_shards(PARAMS, 2)
GRPC = ClientConfig(connect_timeout_s=10, rpc_timeout_s=30, init_timeout_s=30, reconnect_timeout_s=0, shared_memory=False)
W0 = torch.linspace(-1, 1, NUMEL)


def grad(rank: int, clock: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(1000 * rank + clock))


def copy_of(server: RunningServer, rank: int) -> torch.Tensor:
    return server.shard.copies._copies[rank].values


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / a.norm())


def client(addresses: list[str], spec: JobSpec, config: ClientConfig, rank: int = 0) -> ParameterClient:
    return ParameterClient(addresses, spec, PARAMS, PLAN, rank, config)


@contextlib.contextmanager
def joined(make_servers, spec: JobSpec, codec: str, **settings: object  # type: ignore[no-untyped-def]
           ) -> Iterator[tuple[list[RunningServer], ParameterClient, torch.Tensor]]:
    """Two servers, and worker 0 pulling with `codec` (no resync unless `settings` say), joined and
    its first pull made: (servers, client, its weights)."""
    servers = make_servers(2)
    flat = torch.empty(NUMEL)
    config = ClientConfig(**{**GRPC.__dict__, "compress_pull": codec, "pull_resync_error": 0.0, **settings})
    with client([s.address for s in servers], spec, config) as c:
        c.join(lambda: W0.clone())
        c.pull(flat, 0)
        yield servers, c, flat


@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
@pytest.mark.parametrize("codec", ["topk:0.05", "randomk:0.05", "sign", "int8"])
def test_the_workers_copy_is_the_servers_bit_for_bit_and_drifts_by_what_the_codec_leaves_out(
    make_servers, mode: str, codec: str,  # type: ignore[no-untyped-def]
) -> None:
    spec = JobSpec(mode=mode, staleness=1 if mode == "ssp" else 0, lr=0.1, num_shards=2)
    with joined(make_servers, spec, codec) as (servers, c, flat):
        assert torch.equal(flat, W0)  # the first pull is exact
        drifts = []
        for k in range(6):
            c.exchange(grad(0, k), k, flat)
            master = torch.cat([s.shard.weights_copy() for s in servers])
            held = torch.cat([copy_of(s, 0) for s in servers])
            assert torch.equal(flat, held), f"step {k}: the worker's copy is not the server's"
            drifts.append(relative(master, held))
            reported = c.pull_drift()
            assert reported is not None and abs(reported - max(relative(s.shard.weights_copy(), copy_of(s, 0))
                                                                for s in servers)) < 1e-6
        c.leave()
    assert 0 < drifts[-1] < 0.5, drifts  # behind the master, by what the codec left out so far
    for s, (start, end) in zip(servers, PLAN.ranges):
        st = s.shard.status()
        assert (st.delta.copies, st.delta.exact, st.delta.compressed, st.delta.resyncs) == (1, 1, 6, 0)
        # bytes: one exact pull, then six encoded changes
        assert st.bytes_out == 4 * (end - start) + 6 * parse_compression(codec).payload_bytes(end - start)
        assert st.to_dict()["delta"]["drift"] == st.delta.drift > 0
    if mode == "async" and codec == "int8":  # psgrad status says how pulls travel
        from psgrad.cli.status import format_status

        text = format_status([{**servers[0].shard.status().to_dict(), "address": servers[0].address}])
        assert "shard 0: compressed pulls: 6 changes, 1 exact (0 resyncs), drift now 0.0" in text, text


def test_what_a_pull_leaves_out_is_sent_later(make_servers) -> None:  # type: ignore[no-untyped-def]
    """With no update in between, pulls of top-k changes converge on the master weights: the
    server sends what it left out before (error feedback), and the copy ends exact."""
    spec = JobSpec(lr=0.5, num_shards=2)
    with joined(make_servers, spec, "topk:0.25") as (servers, c, flat):
        c.push(grad(0, 0), 0)
        master = torch.cat([s.shard.weights_copy() for s in servers])
        gaps = []
        for _ in range(4):
            c.pull(flat, 1)
            gaps.append(relative(master, flat))
        assert gaps[0] > gaps[1] > gaps[2] > 0 and gaps[3] == 0, gaps  # a quarter of the values each time
        assert torch.equal(flat, master)


@pytest.mark.parametrize("how", ["periodic", "error"])
def test_resyncs_make_the_copy_exact(make_servers, how: str) -> None:  # type: ignore[no-untyped-def]
    spec = JobSpec(lr=0.1, num_shards=2)
    settings = {"pull_resync_every": 3} if how == "periodic" else {"pull_resync_error": 1e-3}
    exact_after = []
    with joined(make_servers, spec, "topk:0.01", **settings) as (servers, c, flat):
        for k in range(7):
            c.exchange(grad(0, k), k, flat)
            master = torch.cat([s.shard.weights_copy() for s in servers])
            exact_after.append(torch.equal(flat, master))
            if how == "error":
                assert relative(master, flat) <= 1e-3  # never further than the bound asked for
    st = servers[0].shard.status().delta
    if how == "periodic":  # versions 3 and 6 (the first pull, at version 0, was exact)
        assert exact_after == [False, False, True, False, False, True, False]
        assert (st.exact, st.resyncs) == (3, 2)
    else:  # top-k 1% of a dense step is too far every time
        assert all(exact_after) and st.resyncs == 7 and st.compressed == 0


def test_same_host_pulls_are_plain_unless_asked_and_compressed_through_the_segment(make_servers) -> None:  # type: ignore[no-untyped-def]
    spec = JobSpec(lr=0.1, num_shards=2)
    servers = make_servers(2)
    flat = torch.empty(NUMEL)
    shm = ClientConfig(connect_timeout_s=10, rpc_timeout_s=30, init_timeout_s=30, reconnect_timeout_s=0,
                       compress_pull="int8", pull_resync_error=0.0)
    with client([s.address for s in servers], spec, shm) as c:
        c.join(lambda: W0.clone())
        c.pull(flat, 0)
        c.exchange(grad(0, 0), 0, flat)
        assert c.transports() == ["shm", "shm"] and c.pull_drift() is None
        assert torch.equal(flat, torch.cat([s.shard.weights_copy() for s in servers]))  # plain: exact
        c.leave()
    assert servers[0].shard.status().delta.copies == 0
    with client([s.address for s in servers], spec, ClientConfig(**{**shm.__dict__, "compress_same_host": True}), 1) as c:
        c.join(None)
        for k in range(3):
            c.exchange(grad(1, k), 1 + k, flat, published=True)
            assert torch.equal(flat, torch.cat([copy_of(s, 1) for s in servers]))
        assert c.transports() == ["shm", "shm"] and c.pull_drift() is not None and c.pull_drift() > 0
        assert c.views() == [None, None]  # a compressed pull is never lent a published version
    assert servers[0].shard.status().delta.compressed == 2


def test_observing_pulls_and_exports_read_the_master_weights(make_servers) -> None:  # type: ignore[no-untyped-def]
    spec = JobSpec(lr=0.1, num_shards=2)
    seen = torch.empty(NUMEL)
    with joined(make_servers, spec, "sign") as (servers, c, flat):
        for k in range(3):
            c.exchange(grad(0, k), k, flat)
        master = torch.cat([s.shard.weights_copy() for s in servers])
        assert not torch.equal(flat, master)
        c.pull(seen, 3, observe=True)
        assert torch.equal(seen, master)
        exported, _ = export_state_dict([s.address for s in servers], client=GRPC)
        assert torch.equal(exported["w"], master)


def test_a_worker_that_fails_over_to_the_standby_resyncs_exactly() -> None:
    running: list[RunningServer] = []

    def start(**kw: object) -> RunningServer:
        s = start_server(ServerConfig(**{"port": 0, "threads": 16, **kw}))  # type: ignore[arg-type]
        running.append(s)
        return s

    try:
        primary = start()
        backup = start(replica_of=primary.address)
        spec = JobSpec(lr=0.1, num_workers=1)
        plan = plan_shards(PARAMS, 1)
        config = ClientConfig(connect_timeout_s=5, rpc_timeout_s=10, reconnect_timeout_s=10, shared_memory=False,
                              compress_pull="topk:0.05", pull_resync_error=0.0)
        flat = torch.empty(NUMEL)
        with ParameterClient([f"{primary.address}|{backup.address}"], spec, PARAMS, plan, 0, config) as c:
            c.join(lambda: W0.clone())
            c.pull(flat, 0)
            for k in range(3):
                c.exchange(grad(0, k), k, flat)
            assert not torch.equal(flat, primary.shard.weights_copy())
            primary.stop(0)
            c.exchange(grad(0, 3), 3, flat)  # fails over: the standby holds no copy of this worker's
            assert c.shards[0].address == backup.address
            assert torch.equal(flat, backup.shard.weights_copy())  # exact
            st = backup.shard.status().delta
            assert (st.exact, st.compressed) == (1, 0)
            c.exchange(grad(0, 4), 4, flat)  # and compressed again from there
            assert backup.shard.status().delta.compressed == 1
            assert torch.equal(flat, backup.shard.copies._copies[0].values)
    finally:
        for s in running:
            s.stop(0)


def test_a_reply_the_worker_never_read_makes_its_next_pull_exact(make_servers) -> None:  # type: ignore[no-untyped-def]
    """The server moved its copy for a pull whose reply was lost: the name the worker sends is no
    longer that copy's, and the server sends the weights rather than a change to the wrong base."""
    spec = JobSpec(lr=0.1, num_shards=2)
    with joined(make_servers, spec, "int8") as (servers, c, flat):
        c.exchange(grad(0, 0), 0, flat)
        wire = c._delta_wires[0]
        assert wire is not None
        lost = pb.PullRequest(rank=0, clock=1, fingerprint=c.fingerprint, delta=wire.ask())
        list(c.shards[0]._pull(lost, timeout=10))  # served (the server's copy moved), never applied here
        c.exchange(grad(0, 1), 1, flat)
        assert torch.equal(flat[: PLAN.ranges[0][1]], servers[0].shard.weights_copy())  # shard 0: exact
        assert servers[0].shard.status().delta.exact == 2 and servers[1].shard.status().delta.exact == 1


def test_bad_asks_are_refused_with_the_grammar(make_servers, capsys) -> None:  # type: ignore[no-untyped-def]
    for flags, message in ((["--compress-pull", "zip"], "unknown compression 'zip'; valid: none, topk:RATIO"),
                           (["--compress-pull", "int8", "--pull-resync-error", "-1"], "--pull-resync-error must be")):
        done = cli_in_process(["worker", "--servers", "127.0.0.1:1", *flags], capsys)
        assert done.returncode == 2 and message in done.stderr, done.stderr
    with pytest.raises(ConfigError, match="unknown compression 'zip'"):
        ClientConfig(compress_pull="zip")
    with pytest.raises(ConfigError, match="pull_resync_error must be a finite number >= 0"):
        ClientConfig(compress_pull="int8", pull_resync_error=-1)
    spec = JobSpec(lr=0.1, num_shards=2)
    servers = make_servers(2)
    with client([s.address for s in servers], spec, GRPC) as c:
        c.join(lambda: W0.clone())
        bad = pb.PullRequest(rank=0, clock=0, fingerprint=c.fingerprint, delta=pb.DeltaAsk(codec="zip"))
        with pytest.raises(InvalidRequestError, match="compressed pull of worker rank 0: unknown compression 'zip'"):
            c.shards[0].pull(bad, torch.empty(PLAN.size(0)), c._pull_wires[0])


def test_two_workers_each_hold_their_own_copy(make_servers) -> None:  # type: ignore[no-untyped-def]
    spec = JobSpec(lr=0.1, num_shards=2, num_workers=2)
    servers = make_servers(2)
    config = ClientConfig(**{**GRPC.__dict__, "compress_pull": "topk:0.1", "pull_resync_error": 0.0})
    barrier = threading.Barrier(2)
    ok = []

    def work(rank: int) -> None:
        flat = torch.empty(NUMEL)
        with client([s.address for s in servers], spec, config, rank) as c:
            c.join((lambda: W0.clone()) if rank == 0 else None)
            c.pull(flat, 0)
            for k in range(5):
                c.exchange(grad(rank, k), k, flat)
            barrier.wait()
            ok.append(all(torch.equal(flat[a:b], copy_of(s, rank)) for s, (a, b) in zip(servers, PLAN.ranges)))
            barrier.wait()

    run_in_threads(2, work)
    assert ok == [True, True]
    assert servers[0].shard.status().delta.copies == 2


def test_dc_asgd_compensates_against_the_workers_copy(make_servers) -> None:  # type: ignore[no-untyped-def]
    spec = JobSpec(lr=0.1, num_shards=2, dc_asgd=0.5)
    with joined(make_servers, spec, "topk:0.05") as (servers, c, flat):
        for k in range(3):
            c.exchange(grad(0, k), k, flat)
            for s in servers:
                dc = s.shard.core.state.dense.dc
                version, kept = dc._copies[0]
                assert version == s.shard.version and torch.equal(kept, copy_of(s, 0))
                assert not torch.equal(kept, s.shard.weights_copy())  # (not the master weights)
        assert servers[0].shard.status().delay.compensated >= 2
