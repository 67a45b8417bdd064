"""Compressed pushes through real gRPC servers (in-process) and real clients: in every mode and codec
the shards apply exactly what the worker's encoder sent (error feedback included), over gRPC frames
and shared memory; same-host shards get plain gradients unless asked; servers count the bytes; a
checkpoint restores a compressed job."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import run_in_threads
from psgrad.client.parameter_client import ParameterClient
from psgrad.config import ClientConfig, JobSpec, ServerConfig
from psgrad.core.compression import parse_compression
from psgrad.core.gradient_codecs import Codec, Compressor
from psgrad.core.sharding import ParamSpec, plan_shards
from psgrad.errors import InvalidRequestError
from psgrad.proto import ps_pb2 as pb
from psgrad.server.runtime import start_server

pytestmark = pytest.mark.timeout(120)

NUMEL = 5000
PARAMS = [ParamSpec("w", (NUMEL,), "float32")]
PLAN = plan_shards(PARAMS, 2)
GRPC = ClientConfig(connect_timeout_s=10, rpc_timeout_s=30, init_timeout_s=30, reconnect_timeout_s=0, shared_memory=False)
SHM = ClientConfig(connect_timeout_s=10, rpc_timeout_s=30, init_timeout_s=30, reconnect_timeout_s=0)
W0 = torch.linspace(-1, 1, NUMEL)


def grad(clock: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(clock))


def expected_weights(spec: JobSpec, clocks: int, rank: int = 0, compressed: bool = True) -> torch.Tensor:
    """W0 after `clocks` plain-SGD steps (lr 1) of what one worker's encoders send each shard."""
    w = W0.clone()
    for i, (start, end) in enumerate(PLAN.ranges):
        n = end - start
        codec = spec.compression
        mirror = Compressor(codec, n, spec.wire_dtype, spec.error_feedback, seed=rank * 65_537 + i)
        decoder, out = Codec(codec, n, spec.wire_dtype), torch.empty(n)
        for clock in range(clocks):
            g = grad(clock)[start:end]
            if compressed:
                decoder.decode(mirror.encode(g), out)
            else:
                out = g
            w[start:end] -= out
    return w


def train(addresses: list[str], spec: JobSpec, config: ClientConfig, clocks: int, first: int = 0) -> torch.Tensor:
    """One worker (rank 0) pushes grad(first) .. grad(clocks - 1); returns the weights it pulls last."""
    flat = torch.empty(NUMEL)
    with ParameterClient(addresses, spec, PARAMS, PLAN, 0, config) as c:
        clock = c.join(lambda: W0.clone())
        assert clock == first
        c.pull(flat, clock)
        for k in range(first, clocks):
            c.exchange(grad(k), k, flat)
        transports = c.transports()
        c.leave()
    expected = ["shm", "shm"] if config.shared_memory else ["grpc", "grpc"]
    assert transports == expected
    return flat


@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
@pytest.mark.parametrize("name", ["topk:0.05", "randomk:0.05", "sign", "int8"])
def test_the_shards_apply_what_the_encoder_sent(make_servers, mode: str, name: str) -> None:  # type: ignore[no-untyped-def]
    spec = JobSpec(mode=mode, staleness=1 if mode == "ssp" else 0, lr=1.0, num_shards=2, compress=name)
    servers = make_servers(2)
    got = train([s.address for s in servers], spec, GRPC, 4)
    assert torch.allclose(got, expected_weights(spec, 4), atol=1e-5)
    assert not torch.allclose(got, expected_weights(spec, 4, compressed=False), atol=1e-3)
    # the servers counted the compressed payloads
    for status, (start, end) in zip([s.shard.status() for s in servers], PLAN.ranges):
        assert status.bytes_in == 4 * spec.compression.payload_bytes(end - start)
        assert status.to_dict()["push_bytes_total"] == status.bytes_in
        assert status.to_dict()["pull_bytes_total"] == status.bytes_out == 5 * 4 * (end - start)
    if mode == "async" and name == "sign":  # psgrad status says how pushes travel
        from psgrad.cli.status import format_status

        text = format_status([{**servers[0].shard.status().to_dict(), "address": servers[0].address}])
        assert "shard 0: pushes compressed sign: 325 bytes a push, 0.033 of plain" in text, text


def test_without_error_feedback_what_a_push_drops_is_lost(make_servers) -> None:  # type: ignore[no-untyped-def]
    spec = JobSpec(lr=1.0, num_shards=2, compress="topk:0.05", error_feedback=False)
    servers = make_servers(2)
    got = train([s.address for s in servers], spec, GRPC, 3)
    assert torch.allclose(got, expected_weights(spec, 3), atol=1e-5)
    with_ef = JobSpec(lr=1.0, num_shards=2, compress="topk:0.05")
    assert not torch.allclose(got, expected_weights(with_ef, 3), atol=1e-3)


def test_bfloat16_values_of_a_sparse_codec(make_servers) -> None:  # type: ignore[no-untyped-def]
    spec = JobSpec(lr=1.0, num_shards=2, compress="topk:0.05", wire_dtype="bfloat16")
    servers = make_servers(2)
    got = train([s.address for s in servers], spec, GRPC, 3)
    # pulls travel in bfloat16 too: the weights are those rounded
    assert torch.allclose(got, expected_weights(spec, 3).bfloat16().float(), atol=1e-6)


@pytest.mark.parametrize("compress_same_host,name", [(False, "sign"), (True, "sign"), (True, "topk:0.9")])
def test_same_host_shards_get_plain_gradients_unless_asked(make_servers, compress_same_host: bool, name: str) -> None:  # type: ignore[no-untyped-def]
    """(topk:0.9's payload is larger than the plain one: the segment takes the larger.)"""
    spec = JobSpec(mode="sync", lr=1.0, num_shards=2, compress=name)
    servers = make_servers(2)
    config = ClientConfig(**{**SHM.__dict__, "compress_same_host": compress_same_host})
    got = train([s.address for s in servers], spec, config, 3)
    assert torch.allclose(got, expected_weights(spec, 3, compressed=compress_same_host), atol=1e-5)
    sent = sum(s.shard.status().bytes_in for s in servers)
    plain = 3 * 4 * NUMEL
    assert sent == (3 * sum(spec.compression.payload_bytes(e - s) for s, e in PLAN.ranges) if compress_same_host else plain)
    # the servers count the pushes that came plain, and `psgrad status` says why the ratio is 1
    from psgrad.cli.status import format_status

    assert [s.shard.status().pushes_plain for s in servers] == [0 if compress_same_host else 3] * 2
    text = format_status([{**servers[0].shard.status().to_dict(), "address": servers[0].address}])
    because = "shard 0: 3 of 3 pushes came uncompressed, from workers on this server's host"
    assert (because in text) != compress_same_host, text


@pytest.mark.parametrize("compress_same_host", [False, True])
def test_the_python_api_warns_once_that_same_host_pushes_stay_plain(make_servers, compress_same_host: bool) -> None:  # type: ignore[no-untyped-def]
    import warnings

    import psgrad

    servers = make_servers(2)
    model = torch.nn.Linear(4, 2)
    config = ClientConfig(**{**SHM.__dict__, "compress_same_host": compress_same_host})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with psgrad.connect([s.address for s in servers], compress="sign", client=config) as ps:
            opt = ps.optimizer(model)
            for _ in range(2):
                model(torch.ones(3, 4)).sum().backward()
                opt.step()
    ours = [w for w in caught if issubclass(w.category, psgrad.CompressionWarning)]
    said = [str(w.message) for w in ours]
    if compress_same_host:
        assert said == []
    else:
        assert len(said) == 1 and "shard(s) 0, 1 share this host" in said[0], said
        assert "ClientConfig(compress_same_host=True)" in said[0]
        assert ours[0].filename == __file__  # points at the user's line (ps.optimizer)


def test_a_push_in_another_codec_is_refused_and_a_bad_payload_applies_nothing(make_servers) -> None:  # type: ignore[no-untyped-def]
    spec = JobSpec(lr=1.0, num_shards=1, compress="topk:0.5")
    params = [ParamSpec("w", (10,), "float32")]
    (server,) = make_servers(1)
    with ParameterClient([server.address], spec, params, plan_shards(params, 1), 0, GRPC) as c:
        c.join(lambda: torch.zeros(10))
        shard = c.shards[0]
        header = c._push_header(0, 0, None, "sign")
        with pytest.raises(InvalidRequestError, match="compressed as 'sign', but the job's --compress is 'topk:0.5'"):
            shard.push(header, memoryview(bytes(Codec(parse_compression("sign"), 10).nbytes)))  # type: ignore[arg-type]
        codec = Codec(spec.compression, 10)
        payload = bytearray(codec.encode(torch.ones(10)))
        payload[0:4] = (99).to_bytes(4, "little")
        with pytest.raises(InvalidRequestError, match=r"index outside \[0, 10\)"):
            shard.push(c._push_header(0, 0, None, spec.compress), memoryview(payload))
        assert server.shard.status().version == 0  # nothing applied
        assert server.shard.status().pushes_rejected == 2
        reply = shard.push(c._push_header(0, 0, None, spec.compress), codec.encode(torch.ones(10)))
        assert isinstance(reply, pb.PushReply) and reply.applied


def test_two_sync_workers_apply_the_mean_of_their_decoded_gradients(make_servers) -> None:  # type: ignore[no-untyped-def]
    spec = JobSpec(mode="sync", lr=1.0, num_workers=2, num_shards=2, compress="int8")
    servers = make_servers(2)
    addresses = [s.address for s in servers]
    results: dict[int, torch.Tensor] = {}

    def work(rank: int) -> None:
        flat = torch.empty(NUMEL)
        with ParameterClient(addresses, spec, PARAMS, PLAN, rank, GRPC) as c:
            clock = c.join((lambda: W0.clone()) if rank == 0 else None)
            c.pull(flat, clock)
            for k in range(3):
                c.exchange(grad(10 * rank + k), k, flat)
            results[rank] = flat
            c.leave()

    run_in_threads(2, work)
    assert torch.equal(results[0], results[1])
    expected = W0.clone()
    for i, (start, end) in enumerate(PLAN.ranges):
        n = end - start
        encoders = [Compressor(spec.compression, n, seed=r * 65_537 + i) for r in range(2)]
        decoder, out = Codec(spec.compression, n), torch.empty(n)
        for k in range(3):
            total = torch.zeros(n)
            for r in range(2):
                decoder.decode(encoders[r].encode(grad(10 * r + k)[start:end]), out)
                total += out
            expected[start:end] -= total / 2
    assert torch.allclose(results[0], expected, atol=1e-5)


def test_a_checkpoint_restores_a_compressed_sync_job(tmp_path: Path) -> None:
    spec = JobSpec(mode="sync", lr=1.0, num_shards=2, compress="topk:0.05")
    configs = [ServerConfig(port=0, threads=16, checkpoint_dir=str(tmp_path / f"s{i}"), checkpoint_every_versions=1)
               for i in range(2)]
    servers = [start_server(c) for c in configs]
    try:
        before = train([s.address for s in servers], spec, GRPC, 3)
        ports = [int(s.address.rsplit(":", 1)[1]) for s in servers]
    finally:
        for s in servers:
            s.stop(0)
    servers = [start_server(ServerConfig(**{**c.__dict__, "port": p})) for c, p in zip(configs, ports)]
    try:
        assert [s.shard.status().version for s in servers] == [3, 3]
        flat = torch.empty(NUMEL)
        with ParameterClient([s.address for s in servers], spec, PARAMS, PLAN, 0, GRPC) as c:
            clock = c.join(None)
            assert clock == 3
            c.pull(flat, clock)
            assert torch.equal(flat, before)
            c.exchange(grad(3), 3, flat)  # a fresh encoder (the residual was the worker's): still applied as sent
            c.leave()
        mine = [Compressor(spec.compression, e - s, seed=i) for i, (s, e) in enumerate(PLAN.ranges)]
        expected = before.clone()
        for i, (start, end) in enumerate(PLAN.ranges):
            out = torch.empty(end - start)
            Codec(spec.compression, end - start).decode(mine[i].encode(grad(3)[start:end]), out)
            expected[start:end] -= out
        assert torch.allclose(flat, expected, atol=1e-5)
    finally:
        for s in servers:
            s.stop(0)


def test_the_python_api_trains_with_compressed_pushes(make_servers) -> None:  # type: ignore[no-untyped-def]
    """psgrad.connect(compress=...) through ps.optimizer(model): a digits model learns with 1% of the
    gradient's values a push, and the servers received about 2% of the plain bytes."""
    import psgrad
    from psgrad.tasks import get_task

    task = get_task("digits")
    servers = make_servers(2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    gen = torch.Generator().manual_seed(0)
    losses = []
    with psgrad.connect([s.address for s in servers], compress="topk:0.01", optimizer=psgrad.SGD(lr=0.2),
                        client=GRPC) as ps:
        opt = ps.optimizer(model)
        for _ in range(150):
            idx = torch.randint(0, len(task.train_x), (32,), generator=gen)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(task.train_x[idx]), task.train_y[idx])
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert sum(losses[-20:]) / 20 < 0.6 * sum(losses[:20]) / 20
    numel = sum(p.numel() for p in model.parameters())
    sent = sum(s.shard.status().bytes_in for s in servers)
    assert sent / (150 * 4 * numel) < 0.03


@pytest.mark.parametrize("name", ["sign", "topk:0.05"])
def test_model_buffers_deltas_travel_plain(make_servers, name: str) -> None:  # type: ignore[no-untyped-def]
    """A range that holds model buffers (BatchNorm's statistics follow the parameters in the flat space)
    gets their deltas exactly as a plain push would; only the parameters' part is compressed."""
    params = [ParamSpec("w", (3000,), "float32"), ParamSpec("bn.running_var", (64,), "float32", buffer=True)]
    plan = plan_shards(params, 2)  # shard 1: parameters, then the buffer
    n = 3064
    w0 = torch.rand(n) + 0.5

    def one_push(spec: JobSpec) -> torch.Tensor:
        (a, b) = make_servers(2)
        flat = torch.empty(n)
        with ParameterClient([a.address, b.address], spec, params, plan, 0, GRPC) as c:
            c.join(lambda: w0.clone())
            c.pull(flat, 0)
            c.exchange(grad(7)[:n], 0, flat)
            c.leave()
        return flat

    plain = one_push(JobSpec(lr=1.0, num_shards=2))
    compressed = one_push(JobSpec(lr=1.0, num_shards=2, compress=name))
    assert torch.equal(compressed[3000:], plain[3000:])  # the statistics, exactly
    assert not torch.allclose(compressed[:3000], plain[:3000], atol=1e-3)  # the parameters, compressed


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("name", ["topk:0.05", "randomk:0.05", "sign", "int8"])
def test_a_step_refused_on_one_shard_and_taken_again_feeds_back_as_if_it_never_failed(
        make_servers, mode: str, name: str) -> None:  # type: ignore[no-untyped-def]
    """Step 2's gradient holds NaNs in shard 0's range: shard 0 refuses the push, shard 1 applies
    its part. The step is taken again, mended, with the same clock: shard 0 applies it, shard 1
    answers a duplicate. Each encoder's residual and random draws go on as if step 2 had been
    pushed once, so the weights end exactly as a job whose steps never failed (before: shard 0's
    residual was dropped for the NaN, and shard 1's fed back step 2 twice)."""
    from psgrad.errors import NonFiniteGradientError

    spec = JobSpec(mode=mode, lr=1.0, num_shards=2, compress=name)
    servers = make_servers(2)
    flat = torch.empty(NUMEL)
    with ParameterClient([s.address for s in servers], spec, PARAMS, PLAN, 0, GRPC) as c:
        c.pull(flat, c.join(lambda: W0.clone()))
        for k in range(5):
            if k == 2:
                bad = grad(k)
                bad[: PLAN.ranges[0][1]] = float("nan")  # (shard 0's range: whichever values a codec sends)
                with pytest.raises(NonFiniteGradientError):
                    c.exchange(bad, k, flat)
            outcomes, _ = c.exchange(grad(k), k, flat)
            assert [o.duplicate for o in outcomes] == [False, k == 2]
        c.leave()
    torch.testing.assert_close(flat, expected_weights(spec, 5), atol=1e-5, rtol=0)
    assert [s.shard.status().pushes_duplicate for s in servers] == [0, 1]
