"""The Python API against a secured in-process server: a session with its certificate and the job
secret trains; a wrong credential raises the error that names it."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import psgrad
from conftest import SlowToAnswer
from psgrad.config import AuthConfig, ClientConfig, ServerConfig, TlsConfig
from psgrad.launch.certs import CertFiles, write_job_certs
from psgrad.server.runtime import RunningServer, start_server

pytestmark = pytest.mark.timeout(120)

SECRET = b"api-test-secret-0123456789abcdef"


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[tuple[RunningServer, CertFiles]]:
    files = write_job_certs(tmp_path / "tls", 2)
    cert, key = files.pair("server")
    server = start_server(ServerConfig(port=0, tls=TlsConfig(cert=str(cert), key=str(key), ca=str(files.ca)),
                                       auth=AuthConfig(secret=SECRET)))
    yield server, files
    server.stop(0)


def client(files: CertFiles, who: str, secret: bytes = SECRET) -> ClientConfig:
    cert, key = files.pair(who)
    return ClientConfig(tls=TlsConfig(ca=str(files.ca), cert=str(cert), key=str(key)), auth=AuthConfig(secret=secret),
                        connect_timeout_s=5, reconnect_timeout_s=0)


def test_a_session_with_its_credentials_trains(secured: tuple[RunningServer, CertFiles]) -> None:
    server, files = secured
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    with psgrad.connect(server.address, client=client(files, "worker-0"), optimizer=psgrad.SGD(lr=0.1)) as ps:
        opt = ps.optimizer(model)
        for _ in range(5):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            assert opt.step().accepted
    assert server.shard.version == 5


def test_a_tls_server_whose_handshake_takes_seconds_is_reached_and_trains(secured: tuple[RunningServer, CertFiles]) -> None:
    """TLS over a link with a long round trip: each new connection held 1.5 s before a byte passes
    (a proxy). A connection attempt had about a second, so the session never reached the server."""
    server, files = secured
    slow = SlowToAnswer(server.address, 1.5)
    model = nn.Linear(4, 2)
    try:
        config = dataclasses.replace(client(files, "worker-0"), connect_timeout_s=20)
        with psgrad.connect(slow.address, client=config, optimizer=psgrad.SGD(lr=0.1)) as ps:
            opt = ps.optimizer(model)
            model(torch.ones(2, 4)).sum().backward()
            assert opt.step().accepted
    finally:
        slow.close()
    assert server.shard.version == 1


def test_a_wrong_credential_raises_the_error_that_names_it(secured: tuple[RunningServer, CertFiles]) -> None:
    server, files = secured
    model = nn.Linear(4, 2)
    wrong_job = client(files, "worker-0", secret=b"another-job-secret-0123456789abc")
    with pytest.raises(psgrad.AuthenticationError, match="not derived from this job's secret"):
        with psgrad.connect(server.address, client=wrong_job) as ps:
            ps.optimizer(model)
    # worker 1's certificate with a session of rank 0: the token (rank 0's) and the certificate disagree
    with pytest.raises(psgrad.PermissionDeniedError, match="certificate is worker 1's but the token is worker 0's"):
        with psgrad.connect(server.address, client=client(files, "worker-1")) as ps:
            ps.optimizer(model)
    assert server.shard.layout is None  # nobody initialized it


def test_a_push_stream_without_a_credential_is_refused_before_its_first_frame_is_awaited() -> None:
    # The guard read the stream's first frame (the header) before it looked at the credential: a
    # caller with none could hold a handler thread by opening a push and sending nothing.
    import threading
    import time

    import grpc

    from psgrad.wire.protocol import METHOD_PREFIX

    server = start_server(ServerConfig(port=0, auth=AuthConfig(secret=SECRET), stream_read_timeout_s=60))
    channel = grpc.secure_channel(server.address, grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP))
    release = threading.Event()

    def nothing() -> Iterator[bytes]:
        release.wait(30)  # opens the stream, never sends a frame
        yield from ()

    try:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            channel.stream_unary(METHOD_PREFIX + "Push", None, None)(nothing(), timeout=20)
        took = time.monotonic() - started
        print(f"{refused.value.code()} after {took:.2f} s: {refused.value.details()}")
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED and "no token" in refused.value.details()
        assert took < 10  # at once, not at the stream's deadline
    finally:
        release.set()
        channel.close()
        server.stop(0)


def test_64_connections_of_one_identity_hold_no_more_streams_than_its_cap() -> None:
    # The cap was per connection: a worker opening 64 connections held 12 pushes (every stream the
    # thread budget allows), not --max-streams-per-peer's 2. Now it counts per identity.
    import threading

    import grpc

    from psgrad.core.credentials import derive_token
    from psgrad.wire.protocol import METHOD_PREFIX
    from psgrad.wire.security import open_channel

    from conftest import wait_for

    cap = 2
    server = start_server(ServerConfig(port=0, threads=16, auth=AuthConfig(secret=SECRET), stream_read_timeout_s=60,
                                       max_streams_per_peer=cap))
    release = threading.Event()

    def nothing() -> Iterator[bytes]:
        release.wait(60)  # opens the stream, sends nothing: holds it (until the read deadline)
        yield from ()

    def channel(role: str) -> grpc.Channel:  # a connection of its own (no shared subchannel)
        return open_channel(server.address, None, derive_token(SECRET, role), [("grpc.use_local_subchannel_pool", 1)])

    channels = [channel("worker-1") for _ in range(64)]
    calls = []
    try:
        for ch in channels:
            calls.append(ch.stream_unary(METHOD_PREFIX + "Push", None, None).future(nothing(), timeout=60))
        wait_for("64 - cap streams refused", lambda: server.shard.stream_counts()[2] >= 64 - cap)
        # the server counts a refusal before its status reaches the client: wait for the clients too
        wait_for("64 - cap refusals received", lambda: sum(c.done() for c in calls) >= 64 - cap)
        refused = [c for c in calls if c.done()]
        assert len(refused) == 64 - cap and all(c.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for c in refused)
        assert "client streams are open from worker-1 (over all its connections)" in refused[0].details()
        assert server.shard.stream_counts()[0] == cap
        other = channel("worker-2")  # another identity has a cap of its own
        channels.append(other)
        calls.append(other.stream_unary(METHOD_PREFIX + "Push", None, None).future(nothing(), timeout=60))
        wait_for("worker 2's stream admitted", lambda: server.shard.stream_counts()[0] == cap + 1)
        assert server.shard.stream_counts()[2] == 64 - cap
    finally:
        release.set()
        for c in calls:
            c.cancel()
        for ch in channels:
            ch.close()
        server.stop(0)


def train_steps(opt: psgrad.PSOptimizer, model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> None:
    """`steps` steps of cross-entropy on (x, y), each accepted."""
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        assert opt.step().accepted


def test_a_tls_sessions_reads_of_rows_go_over_the_tcp_socket_in_tls_as_its_own_rank(secured: tuple[RunningServer, CertFiles]) -> None:
    """A forward's read of rows takes the TLS step socket too, as the worker's own rank, and reads
    the rows a read through gRPC reads."""
    import dataclasses

    server, files = secured

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = psgrad.Embedding(50, 4, std=0.1, seed=3)
            self.head = nn.Linear(4, 2)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(ids))

    torch.manual_seed(0)
    model = Model()
    ids, y = torch.randint(0, 50, (16,)), torch.randint(0, 2, (16,))
    config = dataclasses.replace(client(files, "worker-0"), shared_memory=False)
    with psgrad.connect(server.address, client=config, optimizer=psgrad.SGD(lr=0.1)) as ps:
        opt = ps.optimizer(model)
        train_steps(opt, model, ids, y, 3)
        socket = opt.client.shards[0].frames.socket
        assert (socket.read_calls, server.servicer.local.read_calls) == (3, 3)
        over_socket = model.emb(ids).detach()
        socket.reads = False  # (this read through gRPC)
        assert torch.equal(model.emb(ids).detach(), over_socket) and socket.read_calls == 4


def test_a_tls_sessions_step_calls_go_over_the_tcp_socket_in_tls(secured: tuple[RunningServer, CertFiles]) -> None:
    """A worker with its payloads in frames (as on another host) makes its Step calls over the
    server's TCP step socket, in TLS with the certificates of the gRPC port; a connection without
    TLS, or without a client certificate of the job's CA, gets no further than the handshake."""
    import dataclasses
    import ssl

    from psgrad.wire import local_socket
    from psgrad.wire.security import client_step_socket_context

    server, files = secured
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    config = dataclasses.replace(client(files, "worker-0"), shared_memory=False)
    with psgrad.connect(server.address, client=config, optimizer=psgrad.SGD(lr=0.1)) as ps:
        opt = ps.optimizer(model)
        train_steps(opt, model, x, y, 5)
        assert [s.frames.socket.calls for s in opt.client.shards] == [5]
    assert server.shard.version == 5 and server.servicer.local.calls == 5
    port = server.servicer.local.tcp_port
    offer = local_socket.offer_in([server.servicer.local.tcp_offer(0)], local_socket.TCP_METADATA_KEY)
    assert offer is not None and offer[0] == str(port)
    token = offer[2]
    no_cert = ssl.create_default_context(cafile=str(files.ca))
    verified = client_step_socket_context(config.tls)
    assert verified is not None
    for tls in (None, no_cert):  # plaintext to a TLS port; TLS without the client certificate the server requires
        with pytest.raises(local_socket.ChannelLost):
            channel = local_socket.LocalChannel("s", 0, token, tcp=("127.0.0.1", port), tls=tls)
            channel.with_call(b"", 5.0)  # (TLS 1.3: a refused certificate may surface at the first read)
    channel = local_socket.LocalChannel("s", 0, token, tcp=("127.0.0.1", port), tls=verified)  # (the worker's own)
    channel.close()
