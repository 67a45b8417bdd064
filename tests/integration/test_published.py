"""Zero-copy same-host transfers: published weight versions lent from a shard's ring (psgrad.wire.
published, server/publisher.py) and gradients pushed from the worker's shared segment."""
from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable, Iterator

import pytest
import torch

from conftest import REPO, Proc, run_in_threads
from psgrad.client import parameter_client
from psgrad.client.parameter_client import ParameterClient
from psgrad.config import ClientConfig, JobSpec, ServerConfig
from psgrad.core.sharding import ParamSpec, plan_shards
from psgrad.errors import InvalidRequestError, NonFiniteGradientError
from psgrad.server.runtime import RunningServer, start_server
from psgrad.wire import published, shm

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


def make_client(server: RunningServer, rank: int = 0, shared: bool = True, **spec: object) -> ParameterClient:
    job = JobSpec(num_shards=1, num_workers=2, lr=0.5, **spec)  # type: ignore[arg-type]
    cfg = ClientConfig(connect_timeout_s=5, rpc_timeout_s=10, init_timeout_s=10, reconnect_timeout_s=0,
                       chunk_bytes=1024, shared_memory=shared)
    return ParameterClient([server.address], job, PARAMS, plan_shards(PARAMS, 1), rank, cfg)


def initial() -> torch.Tensor:
    return torch.arange(N, dtype=torch.float32) / 1000


def my_rings() -> list[str]:
    return [n for n in os.listdir(shm.SHM_DIR) if n.startswith(f"psgrad-pub-{os.getpid()}-")]


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    running = start_server(ServerConfig(port=0, threads=8, **getattr(request, "param", {})))
    yield running
    running.stop(0)


def test_a_shards_weights_below_the_lending_size_are_copied_not_lent(server: RunningServer,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard's weights of fewer than LEND_MIN_BYTES come into the worker's segment, copied, even
    where a lent version is asked for (a lease costs more than copying them): no slot is leased,
    and the weights are the same; from that size on they are lent. Pulls and Step calls alike."""
    with make_client(server) as c:
        c.join(initial_weights=initial)
        flat = torch.full((N,), -7.0)
        monkeypatch.setattr(parameter_client, "LEND_MIN_BYTES", 4 * N + 1)
        assert c.pull(flat, 0, published=True) == [0] and c.views() == [None]
        assert torch.equal(flat, initial())
        c.exchange(torch.ones(N), 0, flat, published=True)
        assert c.views() == [None]
        torch.testing.assert_close(flat, initial() - 0.5)
        before = server.servicer.publisher
        assert before is None or before.leases == 0  # (no ring is made until a version is lent)
        monkeypatch.setattr(parameter_client, "LEND_MIN_BYTES", 4 * N)
        c.exchange(torch.ones(N), 1, flat, published=True)
        (view,) = c.views()
        publisher = server.servicer.publisher
        assert view is not None and publisher is not None and publisher.held() == {0: 2} and publisher.leases == 1
        torch.testing.assert_close(view, initial() - 1.0)


def test_a_pull_lends_the_version_read_only_and_zero_copy(server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # as `psgrad server` runs: the push pins its weights
    with make_client(server) as c:
        c.join(initial_weights=initial)
        flat = torch.full((N,), -7.0)
        assert c.pull(flat, 0, published=True) == [0]
        (view,) = c.views()
        assert view is not None and torch.equal(view, initial())
        assert torch.equal(flat, torch.full((N,), -7.0))  # nothing was copied into flat
        first = view.data_ptr()
        c.push(torch.ones(N), 0)
        assert c.pull(flat, 1, published=True) == [1]
        (view,) = c.views()
        assert view is not None and view.data_ptr() != first  # a pointer swap to another slot
        torch.testing.assert_close(view, initial() - 0.5)
        c.pull(flat, 1, published=True)  # the same version: the same slot, nothing copied again
        assert c.views()[0] is view
        publisher = server.servicer.publisher
        assert publisher is not None and publisher.copies == 2 and publisher.held() == {0: 1}
        assert publisher.nbytes >= 2 * N * 4  # a slot per worker of the job
        # psgrad status: the ring's size and use, through the proto as the CLI reads it
        from psgrad.cli.status import format_status
        from psgrad.wire import serde

        status = serde.status_from_proto(serde.status_to_proto(server.shard.status()))
        assert dataclasses.astuple(status.published) == (2, publisher.nbytes, 1, 2, 3, 1)
        text = format_status([{**status.to_dict(), "address": server.address}])
        assert "same-host published versions: 1 of 2 slots leased" in text and "2 versions published" in text
        assert c.pull(flat, 1) == [1] and c.views() == [None]  # not asked: copied into flat
        torch.testing.assert_close(flat, initial() - 0.5)
    assert len(my_rings()) == 1
    server.stop(0)
    assert my_rings() == []  # the server removes its ring


def test_the_ring_never_rewrites_a_leased_version(server: RunningServer) -> None:
    with make_client(server, 0) as holder, make_client(server, 1) as busy:
        holder.join(initial_weights=initial)
        busy.join(None)
        flat = torch.empty(N)
        holder.pull(flat, 0, published=True)
        (held,) = holder.views()
        assert held is not None
        kept = held.clone()
        for clock in range(8):  # many versions through a ring of 2 slots
            busy.push(torch.full((N,), 0.01), clock)
            busy.pull(flat, clock + 1, published=True)
            (view,) = busy.views()
            assert view is not None and view.data_ptr() != held.data_ptr()
        assert torch.equal(held, kept)
        holder.pull(flat, 1, published=True)  # the holder moves on: its former slot is free again
        assert server.servicer.publisher is not None and server.servicer.publisher.held() == {0: 8, 1: 8}


@pytest.mark.parametrize("server", [{"lease_s": 1.0}], indirect=True)
def test_an_evicted_workers_version_is_freed_with_its_lease(server: RunningServer) -> None:
    gone, other = make_client(server, 0), make_client(server, 1)
    with other:
        gone.join(initial_weights=initial)
        other.join(None)
        flat = torch.empty(N)
        gone.pull(flat, 0, published=True)
        publisher = server.servicer.publisher
        assert publisher is not None and publisher.held() == {0: 0}
        gone.close()  # no leave, no more heartbeats: as if killed; its lease runs out
        assert server.shard.wait_until(lambda st: st.evictions == 1, 30)
        seen = set()
        for clock in range(4):  # every slot is used again, the evicted worker's too
            other.push(torch.full((N,), 0.01), clock)
            other.pull(flat, clock + 1, published=True)
            view = other.views()[0]
            assert view is not None
            seen.add(view.data_ptr())
        assert len(seen) == 2 and publisher.held() == {1: 4}


def test_no_call_writes_the_callers_gradient(server: RunningServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The gradient buffer is the model's .grad: a version that cannot be lent (no free slot in
    the ring) comes back in the Step call's reply, or through frames for a pull, never into it
    (the weights once overwrote the gradient there). Below the lending size no window is lent."""
    from psgrad.server.publisher import Publisher

    monkeypatch.setattr(Publisher, "lease", lambda *args: None)  # the ring is full
    with make_client(server) as c:
        c.join(initial_weights=initial)
        grad = c.gradient_buffer()
        assert grad is not None
        flat = torch.full((N,), -7.0)
        for clock in range(2):
            grad.copy_(torch.linspace(-1, 1, N))
            c.exchange(grad, clock, flat, published=True)  # one Step call through the window
            assert c.views() == [None] and torch.equal(grad, torch.linspace(-1, 1, N))
            assert c.shards[0].transport.segment is not None and c.shards[0].transport.segment.lent
            torch.testing.assert_close(flat, initial() - 0.5 * (clock + 1) * torch.linspace(-1, 1, N))
        flat.fill_(-7.0)
        assert c.pull(flat, 2, published=True) == [2]
        assert torch.equal(grad, torch.linspace(-1, 1, N)) and c.shards[0].transport.segment.lent
        torch.testing.assert_close(flat, initial() - torch.linspace(-1, 1, N))
    monkeypatch.setattr(parameter_client, "LEND_MIN_BYTES", 4 * N + 1)
    with make_client(server, 1) as c:
        c.join(None)
        assert c.gradient_buffer() is None  # (copied into the shard's own segment, weights come back there)
    monkeypatch.setattr(parameter_client, "LEND_MIN_BYTES", 0)
    job = JobSpec(num_shards=1, num_workers=2, lr=0.5)
    compressed = ClientConfig(rpc_timeout_s=10, reconnect_timeout_s=0, compress_pull="int8", compress_same_host=True)
    with ParameterClient([server.address], job, PARAMS, plan_shards(PARAMS, 1), 1, compressed) as c:
        c.join(None)
        assert c.gradient_buffer() is None  # compressed pulls on this host are never lent: no window either


def test_a_nan_gradient_pushed_from_the_segment_is_refused_whole(server: RunningServer) -> None:
    with make_client(server) as c:
        c.join(initial_weights=initial)
        grad = c.gradient_buffer()
        assert grad is not None and grad.numel() == N
        grad.fill_(1.0)
        assert c.push(grad, 0)[0].applied
        assert c.shards[0].transport.segment is not None
        assert grad.data_ptr() == torch.frombuffer(c.shards[0].transport.segment.payload, dtype=torch.float32).data_ptr()
        grad[N // 2] = float("nan")
        with pytest.raises(InvalidRequestError, match="non-finite"):
            c.push(grad, 1)
        flat = torch.empty(N)
        c.pull(flat, 1)
        torch.testing.assert_close(flat, initial() - 0.5)  # nothing of the NaN push was applied
        st = server.shard.status()
        assert (st.version, st.pushes_applied, st.pushes_rejected) == (1, 1, 1)
    grad[N // 2] = 0.0  # the client is closed: the lent buffer stays mapped while the tensor lives
    assert float(grad.sum()) == N - 1


def fused(on: bool, monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Turn the fused SGD kernel on (compiled before the server sees a push) or off (the torch ops);
    returns what each of its calls said (gradient finite or not)."""
    from psgrad.server import kernels

    said: list[bool] = []
    if not on:
        monkeypatch.setenv(kernels.ENV, "0")
        return said
    assert kernels.kernel(wait=True) is not None, "numba is a dependency: the fused kernel must compile"
    real = kernels.sgd_checked

    def spy(weights: torch.Tensor, grad: torch.Tensor, alpha: float) -> bool | None:
        out = real(weights, grad, alpha)
        assert out is not None
        said.append(out)
        return out

    monkeypatch.setattr(kernels, "sgd_checked", spy)
    return said


@pytest.mark.parametrize("on", [False, True], ids=["torch-ops", "fused"])
@pytest.mark.parametrize("server", [{"nonfinite": "reject"}, {"nonfinite": "skip"}], indirect=True)
def test_a_nan_applied_in_place_after_a_published_pull_is_undone_exactly(
    server: RunningServer, on: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An async push from the segment onto a published version is checked while it is applied, on
    two threads: with torch ops in pieces (a NaN in the last piece is found after most pieces were
    applied), with the fused kernel in two halves (the whole gradient is applied before the NaN is
    known); either way the weights are restored, bitwise, from the published copy."""
    from psgrad.server import tables as state_module
    from psgrad.server import transfers

    said = fused(on, monkeypatch)
    monkeypatch.setattr(transfers, "PIECE", 64)  # 34 pieces of the 2113 values
    pieces: list[int] = []
    real = transfers.apply_checked

    def spy(grad: torch.Tensor, update: Callable[[int, int], None]) -> int:
        pieces.append(0)
        return real(grad, lambda a, b: (pieces.__setitem__(-1, pieces[-1] + 1), update(a, b))[1])

    monkeypatch.setattr(state_module, "apply_checked", spy)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # as `psgrad server` runs (--torch-threads 1)
    with make_client(server, mode="async") as c:
        c.join(initial_weights=initial)
        grad = c.gradient_buffer()
        assert grad is not None
        flat = torch.empty(N)
        grad.copy_(torch.linspace(-1, 1, N))
        c.pull(flat, 0, published=True)
        assert c.push(grad, 0)[0].applied
        assert (pieces, said) == (([], [True]) if on else ([34], []))  # applied whole, from the pinned copy's path
        before = server.shard.weights_copy()
        assert before is not None
        torch.testing.assert_close(before, initial() - 0.5 * torch.linspace(-1, 1, N))
        c.pull(flat, 1, published=True)
        grad[N - 1] = float("nan")
        if server.servicer.config.nonfinite == "reject":
            with pytest.raises(InvalidRequestError, match="1 non-finite"):
                c.push(grad, 1)
        else:
            assert not c.push(grad, 1)[0].applied
        if on:
            assert said == [True, False] and not pieces
        else:  # the first half at least was applied, then undone
            assert len(pieces) == 2 and pieces[1] >= 17
        after = server.shard.weights_copy()
        assert after is not None and torch.equal(after, before)
        st = server.shard.status()
        assert (st.version, st.pushes_applied, st.pushes_rejected, st.published.pinned) == (1, 1, 1, 2)
        grad[N - 1] = 0.0
        c.pull(flat, 2, published=True)  # (skip: the clock moved on; reject: the push may be redone)
        assert c.push(grad, 2)[0].applied and len(pieces) + len(said) == 3


@pytest.mark.parametrize("server", [{"push_buffers": 2}], indirect=True)  # two pushes in flight at once
def test_a_push_whose_weights_moved_on_while_it_waited_is_checked_first(server: RunningServer) -> None:
    """The copy a push pinned names the weights when it was reserved; if another push applied
    meanwhile, restoring from that copy would undo the other push: it is checked, then applied."""
    with make_client(server, 0, mode="async") as c0, make_client(server, 1, mode="async") as c1:
        c0.join(initial_weights=initial)
        c1.join(None)
        grad, wire, writer = server.shard.push_target(0, 0, 0, N, "float32", c0.fingerprint)
        writer.restore_from = torch.zeros(N)  # what a stale copy would restore (never, here)
        writer.check_deferred = True
        assert c1.push(torch.ones(N), 0)[0].applied  # the weights move on
        after_other = server.shard.weights_copy()
        grad.fill_(1.0)
        grad[N - 1] = float("nan")
        with pytest.raises(NonFiniteGradientError):
            server.shard.apply_push(0, 0, 0, grad, wire, 4 * N)
        now = server.shard.weights_copy()
        assert after_other is not None and now is not None and torch.equal(now, after_other)


def test_a_pinned_version_is_not_reused_until_the_push_is_done() -> None:
    import threading

    from psgrad.server.publisher import Publisher
    from psgrad.server.transfers import PullStream

    weights = {v: torch.full((N,), float(v)) for v in range(4)}
    lock = threading.RLock()

    def stream(v: int, origin: int = 7) -> PullStream:
        return PullStream(weights[v], v, torch.float32, 4096, lock, lambda s: None, origin)

    publisher = Publisher(N * 4, 2, lambda: {0, 1})
    try:
        assert publisher.lease(0, 1, stream(1)) is not None
        with publisher.pinned((8, 1)) as other_state:  # the same version of another shard state
            assert other_state is None
        with publisher.pinned((7, 1)) as copy:
            assert copy is not None and torch.equal(copy, weights[1])
            assert publisher.lease(0, 2, stream(2)) is not None  # gives version 1 back: only pinned
            assert publisher.lease(1, 3, stream(3)) is None  # no free slot: served by a copy
            assert torch.equal(copy, weights[1])
        assert publisher.lease(1, 3, stream(3)) is not None  # unpinned: reused
        assert publisher.held() == {0: 2, 1: 3}
    finally:
        publisher.close()


def test_status_under_the_shard_lock_never_waits_for_a_publication() -> None:
    """A publication holds the publisher's lock and copies under the shard's; the shard asks for the
    published status under its own lock (psgrad status, wait_until): that must not wait (it did,
    and `psgrad run` deadlocked)."""
    import threading
    import time

    from psgrad.server.publisher import Publisher
    from psgrad.server.transfers import PullStream

    shard_lock = threading.RLock()
    publisher = Publisher(N * 4, 2, lambda: {0})
    stream = PullStream(torch.ones(N), 1, torch.float32, 4096, shard_lock, lambda s: None, 7)
    answers: list[object] = []
    try:
        with shard_lock:  # the shard, asking for its status
            lease = threading.Thread(target=lambda: answers.append(publisher.lease(0, 1, stream)))
            lease.start()  # takes the publisher's lock, then waits for the shard's to copy
            deadline = time.monotonic() + 10
            while not publisher._lock.locked() and time.monotonic() < deadline:
                time.sleep(0.001)  # (polling for the lease to hold its lock)
            assert publisher._lock.locked()
            status = threading.Thread(target=lambda: answers.append(publisher.status()))
            status.start()
            status.join(timeout=10)
            assert not status.is_alive(), "status waited for the publication"
        lease.join(timeout=10)
        assert answers[0].slots == 2 and answers[1] is not None  # type: ignore[attr-defined]
    finally:
        publisher.close()


def _sync_run(zero_copy: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    server = start_server(ServerConfig(port=0, threads=8))
    pulled: list[torch.Tensor] = []
    try:
        clients = [make_client(server, r, shared=zero_copy, mode="sync") for r in range(2)]

        def run(c: ParameterClient) -> None:
            c.join(initial_weights=initial if c.rank == 0 else None)
            flat = torch.empty(N)
            shared = c.gradient_buffer() if zero_copy else None
            assert (shared is not None) == zero_copy
            grad = shared if shared is not None else torch.empty(N)
            c.pull(flat, 0, published=zero_copy)
            for clock in range(3):
                weights = c.views()[0] if zero_copy else flat
                assert weights is not None
                torch.sin(weights * (c.rank + 1), out=grad)  # a gradient that depends on the weights
                c.exchange(grad, clock, flat, published=zero_copy)
            final = c.views()[0] if zero_copy else flat
            assert final is not None
            pulled.append(final.clone())

        run_in_threads(2, lambda rank: run(clients[rank]))
        for c in clients:
            c.close()
        weights = server.shard.weights_copy()
        assert weights is not None and len(pulled) == 2
        return weights, pulled
    finally:
        server.stop(0)


def test_sync_zero_copy_is_bitwise_equal_to_grpc() -> None:
    zc, frames = _sync_run(True), _sync_run(False)
    assert torch.equal(zc[0], frames[0])
    assert all(torch.equal(a, zc[0]) for a in zc[1] + frames[1])


def test_published_answers_parse_and_refuse_bad_names() -> None:
    ring = published.Ring(64, 2)
    try:
        ((key, value),) = ring.answer(1)
        assert key == published.METADATA_KEY
        name, nonce, size, slots, index = published.parse_answer(value)
        view = published.RingView(name, nonce, size, slots)
        ring.slot(1)[:4] = b"\x01\x02\x03\x04"
        assert bytes(view.slot(1)[:4]) == b"\x01\x02\x03\x04"
        with pytest.raises(shm.SharedMemoryUnavailable):
            published.RingView(name, b"x" * 16, size, slots)  # another nonce
        with pytest.raises(shm.SharedMemoryUnavailable):
            published.RingView("../etc/passwd", nonce, size, slots)
        with pytest.raises(shm.SharedMemoryUnavailable):
            published.parse_answer("garbage")
    finally:
        ring.close()


@pytest.mark.parametrize("shards", [1, 2])
def test_the_optimizers_model_runs_on_lent_versions_and_trains_bitwise_like_grpc(make_servers, shards: int) -> None:  # type: ignore[no-untyped-def]
    """Sync, two workers, a BatchNorm model (buffers synchronized): zero-copy and gRPC frames end
    bitwise equal; with zero copy the parameters are views of the servers' rings and the gradient
    is pushed from the worker's shared segment, each shard's range in place."""
    import psgrad
    from torch import nn

    torch.manual_seed(0)
    init = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 1))
    gen = torch.Generator().manual_seed(3)
    xs = [[torch.randn(8, 6, generator=gen) for _ in range(4)] for _ in range(2)]
    finals: dict[tuple[bool, int], list[torch.Tensor]] = {}
    for shared in (True, False):
        running = make_servers(shards)
        cfg = ClientConfig(connect_timeout_s=10, rpc_timeout_s=60, init_timeout_s=30, reconnect_timeout_s=0,
                           shared_memory=shared)

        def worker(rank: int) -> None:
            model = copy.deepcopy(init)  # (torch's global generator is shared by the threads)
            with psgrad.connect([s.address for s in running], rank=rank, num_workers=2, mode="sync",
                                optimizer=psgrad.SGD(lr=0.1), client=cfg) as ps:
                opt = ps.optimizer(model)
                for x in xs[rank]:
                    opt.zero_grad()
                    model(x).square().mean().backward()
                    grads = [p.grad.clone() for p in model.parameters()]
                    opt.step()
                    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))  # as torch leaves them
                lent = opt.flat._lent
                assert lent == shared, (shared, lent)
                if shared:  # each shard's segment is its range of the gradient buffer
                    for (start, _), s in zip(opt.client.plan.ranges, opt.client.shards):
                        assert isinstance(s.transport.segment, shm.Window)
                        ptr = torch.frombuffer(s.transport.segment.payload, dtype=torch.float32).data_ptr()
                        assert ptr == opt.flat.host_grad[start:].data_ptr()
                finals[(shared, rank)] = [t.detach().clone() for t in model.state_dict().values()]
            # left: the model is the caller's again (memory of its own, the same values, writable; a
            # write into a lent version would fault, and the server may reuse it once given back)
            assert not opt.flat._lent
            model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})  # writes every parameter
            assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), finals[(shared, rank)]))

        run_in_threads(2, worker)
    for rank in range(2):
        diffs = [float((a - b).abs().max()) for a, b in zip(finals[(True, rank)], finals[(False, rank)])]
        assert not any(diffs), (rank, diffs)


@pytest.mark.parametrize("on", [False, True], ids=["torch-ops", "fused"])
def test_an_async_push_from_the_segment_is_applied_in_place_like_frames(on: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from psgrad.server import transfers

    said = fused(on, monkeypatch)

    borrowed: list[bool] = []
    write_all = transfers.PushWriter.write_all

    def spy(self: transfers.PushWriter, payload: memoryview, chunk_bytes: int) -> None:
        write_all(self, payload, chunk_bytes)
        borrowed.append(self.borrowed is not None)

    monkeypatch.setattr(transfers.PushWriter, "write_all", spy)
    # onto a published version, checked as it is applied: in pieces on two threads
    from psgrad.server import tables as state_module

    checked: list[int] = []
    real = transfers.apply_checked
    monkeypatch.setattr(state_module, "apply_checked", lambda g, u: checked.append(real(g, u)) or checked[-1])
    monkeypatch.setattr(transfers, "PIECE", 100)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    results = []
    for shared in (True, False):
        running = start_server(ServerConfig(port=0, threads=8))
        try:
            with make_client(running, shared=shared, mode="async") as c:
                c.join(initial_weights=initial)
                grad = c.gradient_buffer() if shared else torch.empty(N)
                assert grad is not None
                flat = torch.empty(N)
                for clock in range(3):
                    grad.copy_(torch.linspace(-1, 1, N) * (clock + 1))
                    c.exchange(grad, clock, flat, published=shared)
                results.append(running.shard.weights_copy())
        finally:
            running.stop(0)
    assert borrowed == [True] * 3  # the frames path never calls write_all with a segment
    # the first push: no version was published yet (checked, then applied); the frames path
    # computes the next weights as they arrive
    assert (checked, said) == (([0, 0], []) if not on else ([], [True] * 2))
    assert results[0] is not None and results[1] is not None and torch.equal(results[0], results[1])
    expected = initial()
    for clock in range(3):
        expected.add_(torch.linspace(-1, 1, N) * (clock + 1), alpha=-0.5)
    assert torch.equal(results[0], expected)  # bit for bit torch's add_


_HOLDER = """
import sys, torch
from psgrad.client import parameter_client
from psgrad.client.parameter_client import ParameterClient
from psgrad.config import ClientConfig, JobSpec
from psgrad.core.sharding import ParamSpec, plan_shards
parameter_client.LEND_MIN_BYTES = 0  # (a small model's version, lent all the same)
params = [ParamSpec("w", (300, 7), "float32"), ParamSpec("b", (13,), "float32")]
c = ParameterClient([sys.argv[1]], JobSpec(num_shards=1, num_workers=2, lr=0.5), params, plan_shards(params, 1), 1,
                    ClientConfig(connect_timeout_s=5, rpc_timeout_s=10, init_timeout_s=10, reconnect_timeout_s=0))
c.join(None)
c.pull(torch.empty(2113), 0, published=True)
assert c.views()[0] is not None
print("holding", flush=True)
sys.stdin.read()  # until killed
"""


@pytest.mark.parametrize("server", [{"lease_s": 1.0}], indirect=True)
def test_a_killed_worker_holding_a_version_frees_it_with_its_lease(server: RunningServer) -> None:
    import signal
    import sys

    with make_client(server, 0) as chief:
        chief.join(initial_weights=initial)
        # (a process of its own, forked from the preloaded template; its stdin a pipe it waits on)
        holder = Proc([sys.executable, "-c", _HOLDER, server.address], name="holder", cwd=REPO, stdin_pipe=True,
                      new_session=False)
        try:
            holder.wait_for_line("holding", timeout_s=90, at_start=True)
            publisher = server.servicer.publisher
            assert publisher is not None and publisher.held() == {1: 0}
        finally:
            holder.popen.send_signal(signal.SIGKILL)
            assert holder.wait(30) == -signal.SIGKILL
            holder.stop(grace_s=0)
        assert server.shard.wait_until(lambda st: st.evictions == 1, 30)
        flat = torch.empty(N)
        seen = set()
        for clock in range(3):  # both slots serve the live worker: the dead one's lease has ended
            chief.push(torch.full((N,), 0.01), clock)
            chief.pull(flat, clock + 1, published=True)
            view = chief.views()[0]
            assert view is not None
            seen.add(view.data_ptr())
        assert len(seen) == 2 and publisher.held() == {0: 3}
