"""Transfers in flight (psgrad.server.transfers and how Shard uses them, no gRPC): lazily framed pull streams,
bounded receive buffers, piecewise finiteness checks, and staged updates swapped in whole."""
from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from conftest import decode_frames
from psgrad.server import transfers as streams
from psgrad.core.codecs import WireBuffer, byte_view
from psgrad.wire.frames import data_frames, frame_payload
from psgrad.config import JobSpec, ServerConfig
from psgrad.errors import ConfigError, InvalidRequestError, WorkerStateError
from psgrad.core.optimizers import SGD, make_optimizer
from psgrad.server.shard import Layout, PushResult, Shard
from psgrad.core.sharding import ParamSpec, fingerprint, plan_shards

pytestmark = pytest.mark.timeout(60)

# Update rules that are computed piece by piece into the receive buffer (push_buffers == 1), and
# one that is not (momentum keeps state), so both ways of applying a push are covered.
STAGED = {"lr": 0.5}
IN_PLACE = {"lr": 0.5, "momentum": 0.9}


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make_shard(
    numel: int = 1000, wire_dtype: str = "float32", spec: dict[str, Any] | None = None, now: Any = None, **config: Any
) -> tuple[Shard, Layout]:
    """A one-shard job whose pulls take several frames (chunk_bytes 1024); ranks 0 and 1 joined."""
    params = (ParamSpec("w", (numel,), "float32"),)
    job = JobSpec(num_shards=1, wire_dtype=wire_dtype, **(spec or STAGED))
    start, end = plan_shards(params, 1).ranges[0]
    layout = Layout(job, params, 0, start, end, fingerprint(params, job))
    s = Shard(ServerConfig(chunk_bytes=1024, **config), **({"now": now} if now else {}))
    s.initialize(0, layout, torch.randn(numel, generator=torch.Generator().manual_seed(0)))
    s.join(1, layout)
    return s, layout


def send(writer: Any, grad: torch.Tensor, wire_dtype: str = "float32", piece: int = 1000) -> None:
    """Feed a gradient to a push writer in pieces of `piece` bytes, each its own read-only bytes
    object as gRPC hands them over (4093: pieces that split values)."""
    payload = WireBuffer(grad.numel(), wire_dtype).encode(grad.contiguous())
    for off in range(0, len(payload), piece):
        writer.write(memoryview(bytes(payload[off : off + piece])))
    writer.finish()


def push(s: Shard, layout: Layout, grad: torch.Tensor, rank: int = 1, clock: int = 0, base: int | None = None,
         piece: int = 1000) -> PushResult:
    base = s.version if base is None else base
    dtype = layout.spec.wire_dtype
    buf, wire, writer = s.push_target(rank, clock, base, grad.numel(), dtype, layout.fingerprint)
    try:
        send(writer, grad, dtype, piece)
    except BaseException:
        s.release(buf, wire)
        raise
    return s.apply_push(rank, clock, base, buf, wire, wire.nbytes)


def as_wire(t: torch.Tensor, wire_dtype: str) -> torch.Tensor:
    return t.to(getattr(torch, wire_dtype)).float()


# ----------------------------------------------------------------------------- pull streams
@pytest.mark.parametrize("wire_dtype", ["float32", "bfloat16", "float16"])
def test_pull_stream_frames_cover_the_weights(wire_dtype: str) -> None:
    s, layout = make_shard(wire_dtype=wire_dtype)
    w = s.weights_copy()
    version, frames = s.pull_frames(1, 0, layout.fingerprint)
    got = list(frames)
    per_frame = 1024 // torch.empty(0, dtype=getattr(torch, wire_dtype)).element_size()
    assert len(got) == -(-layout.numel // per_frame)  # whole elements per frame, the last one shorter
    assert version == 0
    assert torch.equal(decode_frames(got, layout.numel, wire_dtype), as_wire(w, wire_dtype))
    assert s.status().transfers.streaming_pulls == 0  # exhausted: nothing waits for it any more


def test_dropped_or_closed_pull_streams_end() -> None:
    s, layout = make_shard(spec=IN_PLACE)
    assert s.pull_frames(1, 0, layout.fingerprint) is not None  # dropped unread
    assert s.status().transfers.streaming_pulls == 0
    _, frames = s.pull_frames(1, 0, layout.fingerprint)
    next(frames)
    frames.close()
    assert s.status().transfers.streaming_pulls == 0
    assert list(frames) == []  # a closed stream yields nothing more
    assert push(s, layout, torch.ones(layout.numel)).applied


def test_in_place_update_waits_for_a_stream_of_the_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streams, "STALL_S", 600.0)  # however slow this host, nothing counts as stalled
    monkeypatch.setattr(streams, "HOLD_GRACE_S", 600.0)  # ... or behind the floor rate
    s, layout = make_shard(spec=IN_PLACE)
    before = s.weights_copy()
    version, frames = s.pull_frames(1, 0, layout.fingerprint)
    got = [next(frames)]
    result: list[PushResult] = []
    pusher = threading.Thread(target=lambda: result.append(push(s, layout, torch.ones(layout.numel))))
    pusher.start()
    assert s.wait_until(lambda st: st.transfers.waiting_updates == 1, timeout_s=30)
    # A pull granted meanwhile waits for the update (updates are not starved by a stream of pulls).
    later: list[int] = []
    puller = threading.Thread(target=lambda: later.append(s.pull_frames(0, 0, layout.fingerprint)[0]))  # type: ignore[index]
    puller.start()
    assert s.version == 0 and not result
    got += list(frames)  # the stream ends; the update goes ahead
    pusher.join(timeout=30)
    puller.join(timeout=30)
    assert torch.equal(decode_frames(got, layout.numel), before)  # no torn frames
    assert version == 0 and result[0].applied and s.version == 1
    assert later == [1]


@pytest.mark.parametrize("wire_dtype", ["float32", "bfloat16"])
def test_in_place_update_gives_a_stalled_stream_a_copy(monkeypatch: pytest.MonkeyPatch, wire_dtype: str) -> None:
    monkeypatch.setattr(streams, "STALL_S", 0.05)
    s, layout = make_shard(wire_dtype=wire_dtype, spec=IN_PLACE)
    before = s.weights_copy()
    _, frames = s.pull_frames(1, 0, layout.fingerprint)
    first = next(frames)
    assert push(s, layout, torch.ones(layout.numel)).applied  # does not wait for ever
    assert s.status().transfers.streaming_pulls == 0
    assert torch.equal(decode_frames([first, *frames], layout.numel, wire_dtype), as_wire(before, wire_dtype))
    assert not torch.equal(s.weights_copy(), before)


def test_sync_iteration_gives_an_observing_stream_a_copy() -> None:
    s, layout = make_shard(spec={"mode": "sync", "lr": 0.5})
    s.leave(1)
    before = s.weights_copy()
    _, frames = s.pull_frames(0, 0, layout.fingerprint, observe=True)
    first = next(frames)
    assert push(s, layout, torch.ones(layout.numel), rank=0).applied  # completes iteration 0
    assert torch.equal(decode_frames([first, *frames], layout.numel), before)


# ----------------------------------------------------------------------------- receive buffers
@pytest.mark.parametrize("spec", [STAGED, IN_PLACE], ids=["staged", "in-place"])
def test_pushes_beyond_push_buffers_wait(monkeypatch: pytest.MonkeyPatch, spec: dict[str, Any]) -> None:
    monkeypatch.setattr(streams, "STALL_S", 600.0)
    monkeypatch.setattr(streams, "HOLD_GRACE_S", 600.0)
    s, layout = make_shard(spec=spec, push_buffers=1)
    s.join(2, layout)
    grad, wire, writer = s.push_target(1, 0, 0, layout.numel, "float32", layout.fingerprint)
    payload = byte_view(torch.ones(layout.numel))
    writer.write(payload[:2000])  # half received
    second: list[PushResult] = []
    other = threading.Thread(target=lambda: second.append(push(s, layout, torch.ones(layout.numel), rank=2)))
    other.start()
    assert s.wait_until(lambda st: st.transfers.waiting_for_buffer == 1, timeout_s=30)
    assert s.status().transfers.buffers_lent == 1
    writer.write(payload[2000:])
    writer.finish()
    assert s.apply_push(1, 0, 0, grad, wire, wire.nbytes).applied
    other.join(timeout=30)
    assert second[0].applied and s.version == 2
    assert s.status().transfers.buffers_lent == 0


def test_a_stalled_push_does_not_hold_up_in_place_pushes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streams, "STALL_S", 0.05)
    s, layout = make_shard(spec=IN_PLACE, push_buffers=1)
    fp = layout.fingerprint
    stalled = s.push_target(0, 0, 0, layout.numel, "float32", fp)  # never sends a byte
    assert push(s, layout, torch.ones(layout.numel)).applied  # lent a buffer beyond the limit
    s.reject()
    s.release(stalled[0], stalled[1])
    # Buffers beyond push_buffers go back to the allocator: the next two pushes share one.
    a = s.push_target(0, 0, 1, layout.numel, "float32", fp)
    s.release(a[0], a[1])
    b = s.push_target(1, 1, 1, layout.numel, "float32", fp)
    assert b[0] is a[0]
    s.release(b[0], b[1])


@pytest.mark.parametrize("spec", [STAGED, IN_PLACE], ids=["staged", "in-place"])
@pytest.mark.parametrize("bad_at", [0, 500, 999])
def test_nonfinite_found_piece_by_piece(spec: dict[str, Any], bad_at: int) -> None:
    s, layout = make_shard(spec=spec)
    before = s.weights_copy()
    grad = torch.ones(layout.numel)
    grad[bad_at] = float("inf")
    grad[(bad_at + 1) % layout.numel] = float("nan")
    with pytest.raises(InvalidRequestError, match="2 non-finite"):
        push(s, layout, grad)
    assert s.version == 0 and torch.equal(s.weights_copy(), before)
    assert push(s, layout, torch.ones(layout.numel)).applied  # the shard's turn and buffer came back


@pytest.mark.parametrize("spec", [STAGED, IN_PLACE], ids=["staged", "in-place"])
def test_overflowing_sums_of_finite_values_are_applied(spec: dict[str, Any]) -> None:
    s, layout = make_shard(spec={**spec, "lr": 1e-30})
    grad = torch.full((layout.numel,), 3e38)  # every piece's float32 sum overflows; all values finite
    assert push(s, layout, grad).applied


# ----------------------------------------------------------------------------- staged updates
def test_elementwise_form_only_for_element_wise_rules_without_state() -> None:
    plain, decayed = SGD(4, lr=0.1).elementwise(), SGD(4, lr=0.1, weight_decay=0.01).elementwise()
    assert plain is not None and decayed is not None
    assert plain.axpy and plain.alpha(0.25) == -0.25  # w.add_(g, alpha=-step_lr): its backends may take it
    assert not decayed.axpy and decayed.alpha(0.25) is None  # weight decay: not an axpy
    assert (SGD(4, lr=0.1, momentum=0.9)).elementwise() is None
    assert (make_optimizer(JobSpec(optimizer="adam"), 4)).elementwise() is None


@pytest.fixture(params=[2, 1], ids=["two-threads", "one-thread"])
def torch_threads(request: pytest.FixtureRequest) -> Any:
    """With one torch thread a staged push works on whole pieces, else on blocks below the grain."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("staleness_lr", [False, True])
@pytest.mark.parametrize("piece", [4096, 4093])
def test_staged_and_in_place_updates_agree_bit_for_bit(
    weight_decay: float, staleness_lr: bool, piece: int, torch_threads: Any
) -> None:
    numel = 3 * streams.BLOCK + 77  # blocks, pieces and frames all end at different places
    spec = {"lr": 0.37, "weight_decay": weight_decay, "staleness_lr": staleness_lr}
    staged, layout = make_shard(numel, spec=spec, push_buffers=1)
    in_place, _ = make_shard(numel, spec=spec, push_buffers=2)
    assert staged.status().transfers.staged_updates and not in_place.status().transfers.staged_updates
    g = torch.Generator().manual_seed(3)
    for clock in range(4):
        grad = torch.randn(numel, generator=g)
        base = max(0, staged.version - clock % 3)  # some pushes are stale
        a = push(staged, layout, grad.clone(), clock=clock, base=base, piece=piece)
        b = push(in_place, layout, grad.clone(), clock=clock, base=base, piece=5000)
        assert (a.applied, a.version, a.staleness) == (b.applied, b.version, b.staleness)
    assert torch.equal(staged.weights_copy(), in_place.weights_copy())


def test_staged_push_that_breaks_off_changes_nothing() -> None:
    s, layout = make_shard()
    before = s.weights_copy()
    grad, wire, writer = s.push_target(1, 0, 0, layout.numel, "float32", layout.fingerprint)
    writer.write(byte_view(torch.ones(layout.numel))[:3000])  # staged pieces computed, then the stream breaks
    s.reject()
    s.release(grad, wire)
    assert torch.equal(s.weights_copy(), before) and s.version == 0
    assert push(s, layout, torch.ones(layout.numel)).applied
    assert torch.allclose(s.weights_copy(), before - 0.5)


def test_staged_duplicate_is_acknowledged_only() -> None:
    s, layout = make_shard()
    assert push(s, layout, torch.ones(layout.numel), clock=0).applied
    after = s.weights_copy()
    dup = push(s, layout, torch.full((layout.numel,), 7.0), clock=0, base=0)
    assert not dup.applied and "duplicate" in dup.reason
    assert torch.equal(s.weights_copy(), after) and s.version == 1


def test_staged_update_swaps_in_while_a_stream_reads_the_former_weights() -> None:
    s, layout = make_shard()
    before = s.weights_copy()
    _, frames = s.pull_frames(1, 0, layout.fingerprint)
    first = next(frames)
    assert push(s, layout, torch.ones(layout.numel)).applied  # no waiting for the stream
    assert s.status().transfers.retired_buffers == 1  # the former weights, until the stream ends
    assert torch.equal(decode_frames([first, *frames], layout.numel), before)
    assert s.status().transfers.retired_buffers == 0
    # Two tensors in all: the next push receives into the former weights, and so on.
    assert push(s, layout, torch.ones(layout.numel), clock=1).applied
    assert torch.allclose(s.weights_copy(), before - 1.0)


def test_staged_push_waits_for_a_stream_of_the_spare_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streams, "STALL_S", 0.05)
    s, layout = make_shard()
    before = s.weights_copy()
    _, frames = s.pull_frames(1, 0, layout.fingerprint)
    first = next(frames)
    assert push(s, layout, torch.ones(layout.numel)).applied
    # The stream of version 0 stalls: the next push lends itself a new tensor rather than wait.
    assert push(s, layout, torch.ones(layout.numel), clock=1).applied
    assert torch.allclose(s.weights_copy(), before - 1.0)
    assert torch.equal(decode_frames([first, *frames], layout.numel), before)


@pytest.mark.parametrize("spec", [STAGED, {"lr": 0.5, "weight_decay": 0.1}, IN_PLACE],
                         ids=["staged", "staged-decay", "in-place"])
def test_a_push_behind_the_floor_rate_holds_up_no_other(monkeypatch: pytest.MonkeyPatch, spec: dict[str, Any]) -> None:
    # Before: a push that kept sending a few bytes (never idle for STALL_S) held the shard's one
    # receive buffer, or its staged turn, until it ended or was cut, and every other push waited.
    monkeypatch.setattr(streams, "STALL_S", 600.0)  # only the floor rate can put it behind
    monkeypatch.setattr(streams, "HOLD_GRACE_S", 0.05)
    s, layout = make_shard(spec=spec, push_buffers=1, min_transfer_rate_mb_s=1.0)
    s.join(2, layout)
    w0 = s.weights_copy()
    slow_grad = torch.randn(layout.numel, generator=torch.Generator().manual_seed(1))
    grad, wire, writer = s.push_target(1, 0, 0, layout.numel, "float32", layout.fingerprint)
    payload = byte_view(slow_grad)
    writer.write(memoryview(bytes(payload[:2000])))  # 2,000 of 4,000 bytes, then nothing for a while
    fast = push(s, layout, torch.ones(layout.numel), rank=2)  # goes ahead beside it: no thread needed
    assert fast.applied and s.version == 1
    assert s.status().transfers.buffers_lent == 1  # the slow push's, still in flight
    writer.write(memoryview(bytes(payload[2000:])))
    writer.finish()
    assert s.apply_push(1, 0, 0, grad, wire, wire.nbytes).applied and s.version == 2
    # Both applied, in the order they completed: the slow push's staged weights were rebased.
    expected, opt = w0.clone(), make_optimizer(JobSpec(**spec), layout.numel)
    for g in (torch.ones(layout.numel), slow_grad):
        opt.apply(expected, g.clone())
    assert torch.allclose(s.weights_copy(), expected, rtol=0, atol=1e-6)
    transfers = s.status().transfers
    assert transfers.buffers_lent == 0 and transfers.retired_buffers == 0, transfers
    assert push(s, layout, torch.ones(layout.numel), rank=2, clock=1).applied  # the shard goes on


def test_eviction_ends_a_stalled_staged_push(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streams, "STALL_S", 600.0)  # only the eviction lets the other push on
    monkeypatch.setattr(streams, "HOLD_GRACE_S", 600.0)
    clock = FakeClock()
    s, layout = make_shard(now=clock, lease_s=5.0)
    s.join(2, layout)
    before = s.weights_copy()
    grad, wire, writer = s.push_target(1, 0, 0, layout.numel, "float32", layout.fingerprint)
    writer.write(byte_view(torch.ones(layout.numel))[:1000])
    second: list[PushResult] = []
    other = threading.Thread(target=lambda: second.append(push(s, layout, torch.ones(layout.numel), rank=2)))
    other.start()
    assert s.wait_until(lambda st: st.transfers.waiting_for_buffer == 1, timeout_s=30)
    clock.t += 4.0
    s.touch(2)
    clock.t += 2.0
    s.touch(2)  # rank 1's lease ran out: evicted, its push gives up its turn
    other.join(timeout=30)
    assert second[0].applied and s.version == 1
    with pytest.raises(WorkerStateError, match="evicted"):
        writer.write(byte_view(torch.ones(layout.numel))[1000:])
    with pytest.raises(WorkerStateError, match="evicted"):
        s.apply_push(1, 0, 0, grad, wire, wire.nbytes)
    assert torch.allclose(s.weights_copy(), before - 0.5)


@pytest.mark.parametrize("chunk", [1000, 1 << 12])
def test_staged_push_from_real_frames(chunk: int) -> None:
    # Frame payloads start after a 3- or 4-byte prefix: values may sit at unaligned addresses.
    staged, layout = make_shard(5000)
    in_place, _ = make_shard(5000, push_buffers=2)
    grad = torch.randn(5000, generator=torch.Generator().manual_seed(4))
    expected = push(in_place, layout, grad)
    buf, wire, writer = staged.push_target(1, 0, 0, 5000, "float32", layout.fingerprint)
    for frame in data_frames(byte_view(grad), chunk):
        piece = frame_payload(frame)
        assert piece is not None
        writer.write(piece)
    writer.finish()
    assert staged.apply_push(1, 0, 0, buf, wire, wire.nbytes) == expected
    assert torch.equal(staged.weights_copy(), in_place.weights_copy())


def test_push_buffers_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="push_buffers must be >= 1, got 0"):
        ServerConfig(push_buffers=0)
