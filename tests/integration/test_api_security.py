"""The Python API against a secured in-process server: a session with its certificate and the job
secret trains; a wrong credential raises the error that names it."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import psgrad
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
