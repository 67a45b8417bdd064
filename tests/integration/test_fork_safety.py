"""Children started while gRPC is busy in the parent run: gRPC's fork handlers (grpcio >= 1.80)
would restart its poller in the forked child, whose epoll descriptor subprocess closes before exec,
and abort the child (grpc/grpc#43055); importing psgrad turns them off."""
from __future__ import annotations

import os
import threading

import pytest

from psgrad.client.shard_client import ShardClient
from psgrad.config import ClientConfig
from psgrad.launch.supervisor import SupervisedProcess


@pytest.mark.timeout(120)
def test_children_start_while_the_parents_channels_and_server_are_busy(make_servers) -> None:  # type: ignore[no-untyped-def]
    """60 children through psgrad's supervisor (which forks: its die-with-parent preexec_fn rules
    out vfork) while two threads keep calling an in-process server: every child runs and exits 0.
    Before the fix about 3 % of such children died of SIGABRT here, so 60 tries miss it rarely."""
    assert os.environ["GRPC_ENABLE_FORK_SUPPORT"] == "false"
    server = make_servers(1)[0]
    stop = threading.Event()
    calls = [0, 0]

    def busy(i: int) -> None:
        client = ShardClient(server.address, ClientConfig(rpc_timeout_s=10))
        try:
            while not stop.is_set():
                client.status()
                calls[i] += 1
        finally:
            client.close()

    threads = [threading.Thread(target=busy, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    codes = []
    try:
        for k in range(60):
            child = SupervisedProcess(["/bin/sh", "-c", "exit 0"], name=f"child-{k}")
            try:
                codes.append(child.wait(timeout_s=30))
            finally:
                child.stop()
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
    assert min(calls) > 0  # the parent's gRPC was busy all along
    assert codes == [0] * 60, [c for c in codes if c != 0]
