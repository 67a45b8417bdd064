"""Same-host payloads through shared memory (psgrad.wire.shm, and client/server using it), with the
fallback to gRPC frames when the server cannot open a worker's segment."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from conftest import REPO
from psgrad.client import parameter_client
from psgrad.wire import shm
from psgrad.client.parameter_client import ParameterClient
from psgrad.config import ClientConfig, JobSpec, ServerConfig
from psgrad.errors import InvalidRequestError
from psgrad.server.runtime import RunningServer, start_server
from psgrad.core.sharding import ParamSpec, plan_shards

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not shm.supported(), reason="no /dev/shm on this host"),
]


@pytest.fixture(autouse=True)
def _lend_small_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests' models are small: lend their versions all the same (by default a shard's
    weights below LEND_MIN_BYTES are copied into the segment, not lent)."""
    monkeypatch.setattr(parameter_client, "LEND_MIN_BYTES", 0)

PARAMS = [ParamSpec("w", (300, 7), "float32"), ParamSpec("b", (13,), "float32")]  # 2113 elements
N = 2113


def config(shared: bool) -> ClientConfig:
    return ClientConfig(
        connect_timeout_s=5, rpc_timeout_s=10, init_timeout_s=5, reconnect_timeout_s=0, chunk_bytes=1024, shared_memory=shared
    )


def my_segments() -> list[str]:
    return [n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"psgrad-{os.getpid()}-")]


@pytest.fixture
def servers(request: pytest.FixtureRequest) -> Iterator[list[RunningServer]]:
    running = [start_server(ServerConfig(port=0, threads=8)) for _ in range(getattr(request, "param", 2))]
    yield running
    for s in running:
        s.stop(0)


def client(servers: list[RunningServer], shared: bool = True, rank: int = 0, **spec: object) -> ParameterClient:
    job = JobSpec(num_shards=len(servers), num_workers=2, lr=0.5, **spec)  # type: ignore[arg-type]
    return ParameterClient([s.address for s in servers], job, PARAMS, plan_shards(PARAMS, len(servers)), rank,
                           config(shared))


def initial() -> torch.Tensor:
    return torch.arange(N, dtype=torch.float32) / 1000


def attached(servers: list[RunningServer]) -> int:
    return sum(len(s.servicer._segments) for s in servers)


# ----------------------------------------------------------------------------- segments
def test_segment_attaches_by_name_nonce_and_size() -> None:
    seg = shm.Segment(64)
    try:
        seg.payload[:5] = b"hello"
        (key, value), = seg.metadata()
        assert key == shm.METADATA_KEY
        there = shm.attach(value, 64)
        assert bytes(there.payload[:5]) == b"hello"
        there.payload[5:8] = b"abc"  # both ends see the same memory
        assert bytes(seg.payload[:8]) == b"helloabc"
        with pytest.raises(shm.SharedMemoryUnavailable, match="holds 64 bytes"):
            shm.attach(value, 65)
        name, nonce, size, host = value.split(";")
        assert host == shm.host_id()
        with pytest.raises(shm.SharedMemoryUnavailable, match="not the one described"):
            shm.attach(f"{name};{'00' * 16};{size};{host}", 64)
        with pytest.raises(shm.SharedMemoryUnavailable, match="not a psgrad segment name"):
            shm.attach(f"../etc/passwd;{nonce};{size};{host}", 64)
        with pytest.raises(shm.SharedMemoryUnavailable, match="another host"):
            shm.attach(f"{name};{nonce};{size};{'0' * 16}", 64)  # the name opens here, but it says elsewhere
        with pytest.raises(shm.SharedMemoryUnavailable, match="malformed"):
            shm.attach("nonsense", 64)
        seg.unlink()
        assert seg.opened and seg.name not in os.listdir(shm.SHM_DIR)
        with pytest.raises(shm.SharedMemoryUnavailable, match="cannot open"):
            shm.attach(value, 64)  # a fresh attach needs the name; existing mappings live on
        assert bytes(there.payload[:8]) == b"helloabc"
    finally:
        seg.close()
    assert seg.name not in my_segments()


def test_a_shared_segment_is_attached_window_by_window() -> None:
    """A multi-shard worker's gradient buffer: one segment, a window per shard; each server maps
    its window, and the name goes once every window's server has opened it."""
    shared = shm.Shared(256)
    try:
        first, second = shared.window(0, 64), shared.window(64, 128)
        (_, value), = second.metadata()
        there = shm.attach(value, 128)
        shared.payload[64:69] = b"hello"
        assert bytes(there.payload[:5]) == b"hello" and len(there.payload) == 128
        there.payload[127:128] = b"!"  # the window's last byte is the segment's 192nd
        assert bytes(shared.payload[191:193]) == b"!\0"
        name, nonce, size, host, offset, total = value.split(";")
        assert (size, offset, total) == ("128", "64", "256")
        for bad, match in ((f"{name};{nonce};{size};{host};192;{total}", "outside"),  # past the end
                           (f"{name};{nonce};{size};{host};66;{total}", "outside"),  # not float-aligned
                           (f"{name};{nonce};{size};{host};64;512", "wrong size"),
                           (f"{name};{nonce};{size};{host};64", "malformed")):
            with pytest.raises(shm.SharedMemoryUnavailable, match=match):
                shm.attach(bad, 128)
        with pytest.raises(ValueError, match="outside"):
            shared.window(200, 64)
        second.unlink()  # its server has it open; the first one's has not yet
        assert second.opened and not first.opened and shared.name in my_segments()
        first.close()  # retired without being opened: nobody needs the name any more
        assert shared.name not in my_segments()
        assert bytes(there.payload[:5]) == b"hello"  # mappings live on
    finally:
        shared.close()
    assert my_segments() == []


def test_a_new_gradient_segment_removes_the_names_of_dead_workers() -> None:
    """A worker killed before its servers opened its gradient segment leaves the name behind; the
    next one made on the host removes it (and leaves live makers' names, and other files, alone)."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          timeout=60).stdout.strip()
    names = [f"psgrad-{dead}-{'a' * 16}", f"psgrad-1-{'b' * 16}", f"psgrad-{dead}-not-ours"]
    for name in names:
        with open(os.path.join(shm.SHM_DIR, name), "wb") as f:
            f.write(b"x")
    try:
        shared = shm.Shared(64)
        shared.close()
        left = set(os.listdir(shm.SHM_DIR))
        assert names[0] not in left and {names[1], names[2]} <= left
    finally:
        for name in names:
            shm.remove(name)


def _host_id_in(*unshare: str) -> str:
    code = "from psgrad.wire import shm; print(shm.host_id())"
    out = subprocess.run(["unshare", *unshare, sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="namespaces need root and unshare")
def test_another_network_namespace_or_shm_mount_is_another_host() -> None:
    """A test-bed host (its own network namespace) or a private /dev/shm is not this host, even where the
    same kernel runs it; a plain child process is."""
    here = shm.host_id()
    assert _host_id_in("--fork") == here  # no new namespace: same host
    assert _host_id_in("--net") != here
    private = ["--mount", "sh", "-c", 'mount -t tmpfs tmpfs /dev/shm && exec "$0" "$@"']
    assert _host_id_in(*private) != here


def test_a_worker_tries_shared_memory_only_with_a_server_of_its_host() -> None:
    assert shm.same_host_server(((shm.METADATA_KEY, shm.server_answer()),))
    assert not shm.same_host_server(((shm.METADATA_KEY, f"{shm.SUPPORTED};{'0' * 16}"),))
    assert not shm.same_host_server(((shm.METADATA_KEY, shm.SUPPORTED),))  # an old server's answer
    assert not shm.same_host_server(None)


# ----------------------------------------------------------------------------- through a server
@pytest.mark.parametrize("wire_dtype", ["float32", "bfloat16"])
def test_shared_memory_and_frames_give_the_same_results(wire_dtype: str) -> None:
    results = {}
    for shared in (True, False):
        running = [start_server(ServerConfig(port=0, threads=8)) for _ in range(2)]
        try:
            with client(running, shared, wire_dtype=wire_dtype) as c:
                c.join(initial_weights=initial)
                flat = torch.empty(N)
                grad = torch.linspace(-1, 1, N)
                versions = [c.pull(flat, 0)]
                replies = c.push(grad, 0)
                versions.append(c.pull(flat, 1))
                assert attached(running) == (2 if shared else 0)
                results[shared] = (flat.clone(), versions, [(r.applied, r.version, r.staleness) for r in replies],
                                   [s.shard.weights_copy() for s in running])
        finally:
            for s in running:
                s.stop(0)
    a, b = results[True], results[False]
    assert torch.equal(a[0], b[0]) and a[1:3] == b[1:3]
    assert all(torch.equal(x, y) for x, y in zip(a[3], b[3]))
    assert my_segments() == []  # unlinked once the server had them open


@pytest.mark.parametrize("servers", [2, 3], indirect=True)
def test_shards_on_this_host_read_one_gradient_buffer_in_place(
    servers: list[RunningServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With several shards, gradient_buffer() is one segment and every shard on this host reads its
    range of it where it lies (no copy on the worker); a shard elsewhere gets frames from it."""
    from psgrad.client import same_host

    copies: list[int] = []
    real = same_host.copy_bytes
    monkeypatch.setattr(same_host, "copy_bytes", lambda dst, src: (copies.append(len(src)), real(dst, src))[1])
    with client(servers, mode="async") as c:
        c.join(initial_weights=initial)
        c.shards[-1]._pick(False)  # as if the last shard's server ran on another host: frames
        grad = c.gradient_buffer()
        assert grad is not None and grad.numel() == N
        again = c.gradient_buffer()
        assert again is not None and again.data_ptr() == grad.data_ptr()  # one buffer
        windows = [s.transport.segment if s.same_host else None for s in c.shards]
        assert all(isinstance(w, shm.Window) for w in windows[:-1]) and windows[-1] is None
        flat = torch.empty(N)
        expected = initial()
        for clock in range(3):
            grad.copy_(torch.linspace(-1, 1, N) * (clock + 1))
            expected.add_(grad, alpha=-0.5)
            replies, _ = c.exchange(grad, clock, flat)  # (a step's pull writes the segment: the gradient is consumed)
            assert all(r.applied for r in replies)
            torch.testing.assert_close(flat, expected)
        assert copies == []  # every same-host push was read from the buffer in place
        assert attached(servers) == len(servers) - 1
        assert my_segments() == []  # every server on this host opened it: the name is gone
        grad.fill_(1.0)
        expected -= 0.5
        c.exchange(grad, 3, flat, published=True)  # the same-host shards lend their versions
        assert copies == []
        for (start, end), view in zip(c.plan.ranges, c.views()):
            torch.testing.assert_close(view if view is not None else flat[start:end], expected[start:end])
        assert [v is None for v in c.views()] == [False] * (len(servers) - 1) + [True]
        torch.testing.assert_close(torch.cat([s.shard.weights_copy() for s in servers]), expected)


def test_a_server_that_cannot_open_the_segment_gets_frames(
    servers: list[RunningServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    def elsewhere(value: str, nbytes: int) -> shm.Attached:
        raise shm.SharedMemoryUnavailable("as if on another host")

    monkeypatch.setattr(shm, "attach", elsewhere)
    with client(servers) as c:
        c.join(initial_weights=initial)
        flat = torch.empty(N)
        assert c.push(torch.ones(N), 0)[0].applied  # refused, then sent as frames
        c.pull(flat, 1)
        torch.testing.assert_close(flat, initial() - 0.5)
        assert c.transports() == ["grpc", "grpc"]  # frames from now on
        assert [s.shard.status().pushes_applied for s in servers] == [1, 1]
        assert [s.shard.status().pushes_rejected for s in servers] == [0, 0]
    assert my_segments() == []


def test_a_restarted_server_gets_a_fresh_segment(servers: list[RunningServer]) -> None:
    with client(servers) as c:
        c.join(initial_weights=initial)
        c.push(torch.ones(N), 0)
        for s in servers:  # as after a restart: the unlinked names cannot be opened again
            s.servicer._segments.clear()
        assert all(r.applied for r in c.push(torch.ones(N), 1))  # refused, sent as frames
        assert attached(servers) == 0 and c.transports() == ["shm", "shm"]
        c.push(torch.ones(N), 2)  # a new segment
        assert attached(servers) == 2
        flat = torch.empty(N)
        c.pull(flat, 3)
        torch.testing.assert_close(flat, initial() - 1.5)


def test_a_rejected_shared_push_raises_and_the_next_one_works(servers: list[RunningServer]) -> None:
    with client(servers) as c:
        c.join(initial_weights=initial)
        bad = torch.ones(N)
        bad[7] = float("nan")
        with pytest.raises(InvalidRequestError, match="non-finite"):
            c.push(bad, 0)
        assert all(r.applied for r in c.push(torch.ones(N), 1))
        assert attached(servers) == 2


def test_a_busy_segment_sends_frames(servers: list[RunningServer]) -> None:
    with client(servers) as c:
        c.join(initial_weights=initial)
        c.push(torch.zeros(N), 0)  # both segments exist now
        segs = [s.transport.segment for s in c.shards]
        assert all(seg is not None for seg in segs)
        assert segs[0] is not None and segs[0].lock.acquire(blocking=False)  # as if a pull were using it
        try:
            assert all(r.applied for r in c.push(torch.ones(N), 1))
        finally:
            segs[0].lock.release()
        flat = torch.empty(N)
        c.pull(flat, 2)
        torch.testing.assert_close(flat, initial() - 0.5)


def test_shared_memory_off_makes_no_segments(servers: list[RunningServer]) -> None:
    with client(servers, shared=False) as c:
        c.join(initial_weights=initial)
        c.push(torch.ones(N), 0)
        c.pull(torch.empty(N), 1)
        assert attached(servers) == 0 and my_segments() == []


def test_leaving_unmaps_the_workers_segments(servers: list[RunningServer]) -> None:
    with client(servers) as c:
        c.join(initial_weights=initial)
        c.push(torch.ones(N), 0)
        assert attached(servers) == 2
        c.leave()
        assert attached(servers) == 0


def test_an_evicted_workers_segment_is_unmapped_at_the_next_heartbeat() -> None:
    running = [start_server(ServerConfig(port=0, threads=8, lease_s=1.0)) for _ in range(2)]
    try:
        gone, other = client(running, rank=0), client(running, rank=1)
        with other:
            gone.join(initial_weights=initial)
            gone.push(torch.ones(N), 0)
            other.join(None)
            assert attached(running) == 2
            gone.close()  # no leave, no more heartbeats: its lease runs out
            assert all(s.shard.wait_until(lambda st: st.evictions == 1, 30) for s in running)
            for s in other.shards:  # (its heartbeat thread may have been first)
                s.heartbeat(other.rank, other.fingerprint)
            assert attached(running) == 0
    finally:
        for s in running:
            s.stop(0)


def test_the_rows_segment_is_made_from_inline_rows_grown_and_given_up_after_three_misses_in_a_row() -> None:
    # SharedMemoryTransport's rows segment (the rows a Step call reads, on one host), reply by reply.
    from types import SimpleNamespace

    from psgrad.client.same_host import SharedMemoryTransport
    from psgrad.proto import ps_pb2 as pb
    from psgrad.wire.rows import RowBlock

    t = SharedMemoryTransport(SimpleNamespace(address="here"), None, lambda: None)  # type: ignore[arg-type]
    reads = RowBlock.of([("a", torch.zeros(1, dtype=torch.int64))])
    inline = pb.StepReply(rows=b"r" * 100, row_versions=[1])
    try:
        assert t._rows_read(inline, None) is None and t._rows_segment is None  # nothing read: nothing made
        assert bytes(t._rows_read(inline, reads)[1]) == b"r" * 100  # type: ignore[index]
        first = t._rows_segment
        assert first is not None and first.nbytes == 1 << 16 and t._rows_metadata(reads)[0][0] == shm.ROWS_METADATA_KEY
        first.payload[:4] = b"abcd"  # the server writes the next rows there
        versions, rows = t._rows_read(pb.StepReply(rows_in_segment=4, row_versions=[7]), reads)  # type: ignore[misc]
        assert versions == [7] and bytes(rows) == b"abcd" and t.rows_through_segment == 1
        first.payload[:4] = b"wxyz"
        assert bytes(rows) == b"wxyz"  # a view of the segment, not a copy: placed before the next call writes it
        # ... from which the rows are placed as they are (no copy), as they are from a reply's own
        # bytes (read-only, of any alignment)
        import numpy as np

        from psgrad.client.parameter_client import _float_rows
        assert np.shares_memory(_float_rows(rows, 1, 1), np.frombuffer(rows, dtype=np.uint8))
        inline_rows = memoryview(pb.StepReply(rows=b"xabcdefgh").rows)[1:5]  # (read-only, not aligned for float32)
        assert _float_rows(inline_rows, 1, 1).view(np.uint8).tolist() == [list(b"abcd")]
        big = pb.StepReply(rows=b"b" * 100_000, row_versions=[1])  # outgrows it: a larger one, not a miss
        t._rows_read(big, reads)
        assert t._rows_segment is not first and t._rows_segment.nbytes == 200_000 and t._rows_misses == 0
        for _ in range(2):  # inline although they fit: the server could not open it; a fresh one each time
            t._rows_read(inline, reads)
        assert t._rows_misses == 2 and t._rows_segment is not None
        t._rows_segment.payload[:1] = b"z"
        t._rows_read(pb.StepReply(rows_in_segment=1, row_versions=[1]), reads)
        assert t._rows_misses == 0  # one through it: the misses were not in a row
        for _ in range(3):
            t._rows_read(inline, reads)
        assert t._rows_misses == 3 and t._rows_segment is None and t._rows_metadata(reads) == ()
        with pytest.raises(InvalidRequestError, match="did not offer"):
            t._rows_read(pb.StepReply(rows_in_segment=4, row_versions=[1]), reads)
    finally:
        t.close()
    assert my_segments() == []
