"""Pure tests of psgrad.server.shard.Shard (no gRPC): init, join, pull, push, duplicates, non-finite, leases."""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import pytest
import torch

from conftest import decode_frames, wait_for
from psgrad.core.unused import Ranges
from psgrad.core.codecs import WireBuffer, byte_view
from psgrad.config import JobSpec, ServerConfig
from psgrad.errors import ApplyFailedError, InvalidRequestError, JobMismatchError, NotInitializedError, WorkerStateError
from psgrad.server.shard import JoinResult, Layout, PushResult, Shard
from psgrad.core.sharding import ParamSpec, fingerprint, plan_shards

pytestmark = pytest.mark.timeout(60)

PARAMS = (ParamSpec("fc.weight", (4, 3), "float32"), ParamSpec("fc.bias", (4,), "float32"))  # 16 elements


def make_layout(spec: JobSpec | None = None, params=PARAMS, index: int = 0) -> Layout:  # type: ignore[no-untyped-def]
    spec = spec or JobSpec(lr=0.5, num_shards=2)
    plan = plan_shards(params, spec.num_shards)
    start, end = plan.ranges[index]
    return Layout(spec, tuple(params), index, start, end, fingerprint(params, spec))


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def weights_for(layout: Layout, seed: int = 0) -> torch.Tensor:
    return torch.randn(layout.numel, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def layout() -> Layout:
    return make_layout()


@pytest.fixture
def shard(layout: Layout) -> Shard:
    s = Shard(ServerConfig())
    assert s.initialize(0, layout, weights_for(layout)) is False
    return s


def push(
    shard: Shard,
    layout: Layout,
    grad: torch.Tensor,
    rank: int = 0,
    clock: int = 0,
    base_version: int | None = None,
    lr: float | None = None,
) -> PushResult:
    """The server's push sequence: header -> receive bytes -> finish -> apply. apply_push owns the
    buffers (it gives them back itself); they are released here only if it is never reached."""
    base = shard.version if base_version is None else base_version
    dtype = layout.spec.wire_dtype
    buf, wire, writer = shard.push_target(rank, clock, base, grad.numel(), dtype, layout.fingerprint, lr)
    try:
        sender = WireBuffer(grad.numel(), dtype)
        writer.write(sender.encode(grad.contiguous()))
        writer.finish()
    except BaseException:
        shard.release(buf, wire)
        raise
    return shard.apply_push(rank, clock, base, buf, wire, wire.nbytes)


# ----------------------------------------------------------------------------- before initialize
def test_pull_and_push_before_initialize(layout: Layout) -> None:
    s = Shard(ServerConfig())
    with pytest.raises(NotInitializedError, match="rank 0"):
        s.pull_frames(1, 0, layout.fingerprint)
    with pytest.raises(NotInitializedError, match="rank 0"):
        s.push_target(1, 0, 0, layout.numel, "float32", layout.fingerprint)
    assert s.weights_copy() is None
    assert not s.status().initialized
    assert s.version == 0


def test_serving_is_reported_when_the_shard_gets_state_and_when_it_closes(layout: Layout) -> None:
    s = Shard(ServerConfig())
    seen: list[bool] = []
    s.watch_serving(seen.append)
    assert seen == [False]  # told at once
    s.initialize(0, layout, weights_for(layout))
    assert seen[-1] is True
    s.close()  # a stopping or fenced server
    assert seen[-1] is False


# ----------------------------------------------------------------------------- initialize / join
def test_initialize_installs_weights(layout: Layout) -> None:
    s = Shard(ServerConfig())
    w = weights_for(layout, seed=5)
    assert s.initialize(0, layout, w.clone()) is False
    assert torch.equal(s.weights_copy(), w)
    assert s.layout == layout
    assert s.version == 0


def test_initialize_is_idempotent_for_identical_layout(shard: Shard, layout: Layout) -> None:
    before = shard.weights_copy()
    other_weights = before + 100.0
    same = dataclasses.replace(layout)  # equal, not the same object
    assert shard.initialize(1, same, other_weights) is True
    assert torch.equal(shard.weights_copy(), before)
    assert shard.version == 0


def test_initialize_refuses_wrong_weights(layout: Layout) -> None:
    s = Shard(ServerConfig())
    with pytest.raises(InvalidRequestError) as info:
        s.initialize(0, layout, torch.zeros(layout.numel + 1))
    assert str(layout.numel) in str(info.value) and str(layout.numel + 1) in str(info.value)
    with pytest.raises(InvalidRequestError, match="float64"):
        s.initialize(0, layout, torch.zeros(layout.numel, dtype=torch.float64))
    assert s.layout is None


def test_initialize_with_different_spec_names_field_and_values(shard: Shard, layout: Layout) -> None:
    before = shard.weights_copy()
    spec = dataclasses.replace(layout.spec, lr=0.25)
    other = make_layout(spec)
    with pytest.raises(JobMismatchError) as info:
        shard.initialize(1, other, weights_for(other))
    msg = str(info.value)
    assert "lr" in msg and "0.5" in msg and "0.25" in msg
    assert "rank 1" in msg
    assert torch.equal(shard.weights_copy(), before)
    assert shard.layout == layout
    # join reports the same problem
    with pytest.raises(JobMismatchError, match="lr"):
        shard.join(1, other)


def test_initialize_with_different_shape_names_parameter(shard: Shard, layout: Layout) -> None:
    params = (ParamSpec("fc.weight", (3, 4), "float32"), PARAMS[1])  # same numel, other shape
    other = make_layout(layout.spec, params=params)
    assert (other.start, other.end) == (layout.start, layout.end)
    with pytest.raises(JobMismatchError) as info:
        shard.initialize(1, other, weights_for(other))
    msg = str(info.value)
    assert "fc.weight" in msg and "[4, 3]" in msg and "[3, 4]" in msg
    with pytest.raises(JobMismatchError, match="fc.weight"):
        shard.join(1, other)


def test_initialize_with_different_range_names_shard_plan(shard: Shard, layout: Layout) -> None:
    other = make_layout(layout.spec, index=1)
    assert other.fingerprint == layout.fingerprint
    assert other.numel == layout.numel
    with pytest.raises(JobMismatchError) as info:
        shard.initialize(1, other, weights_for(other))
    msg = str(info.value)
    assert "shard plan" in msg
    assert f"[{layout.start}, {layout.end})" in msg and f"[{other.start}, {other.end})" in msg


def test_join(shard: Shard, layout: Layout) -> None:
    # async, num_workers=1: no start barrier; the chief (registered by initialize) plus rank 3.
    assert shard.join(3, layout) == JoinResult(initialized=True, ready=True, joined=2, start_clock=0, version=0)
    assert shard.join(3, layout).ranks == (0, 3)
    assert [(w[0], w[2]) for w in shard.status().workers] == [(0, "live"), (3, "live")]
    assert shard.history[-1] == ("join", 3, 0)
    # Joining again is idempotent: still two members, no second "join" event.
    assert shard.join(3, layout).joined == 2
    assert sum(1 for e in shard.history if e[0] == "join") == 2


def test_join_returns_not_initialized_when_nobody_initializes(layout: Layout) -> None:
    s = Shard(ServerConfig())
    assert s.join(1, layout) == JoinResult(initialized=False, ready=False, joined=0, start_clock=0, version=0)
    assert s.join(1, layout, wait_s=0.02) == JoinResult(False, False, 0, 0, 0)
    assert s.layout is None
    assert s.status().workers == ()  # nobody is registered before the chief installs the job


def test_pull_push_and_touch_require_join(shard: Shard, layout: Layout) -> None:
    before = shard.weights_copy()
    with pytest.raises(WorkerStateError, match="rank 4 has not joined"):
        shard.pull_frames(4, 0, layout.fingerprint)
    with pytest.raises(WorkerStateError, match="rank 4 has not joined"):
        shard.push_target(4, 0, 0, layout.numel, "float32", layout.fingerprint)
    with pytest.raises(WorkerStateError, match="rank 4 has not joined"):
        shard.touch(4)
    assert shard.status().pushes_rejected == 1
    assert [w[0] for w in shard.status().workers] == [0]
    assert torch.equal(shard.weights_copy(), before) and shard.version == 0
    # observe=True is an ungated snapshot: no membership needed.
    version, frames = shard.pull_frames(4, 0, layout.fingerprint, observe=True)
    assert version == 0 and torch.equal(decode_frames(frames, layout.numel, "float32"), before)
    # Once joined, the same calls work.
    shard.join(4, layout)
    assert shard.pull_frames(4, 0, layout.fingerprint, timeout_s=0) is not None
    assert push(shard, layout, torch.ones(layout.numel), rank=4, clock=0).applied


def test_join_waits_for_the_chief(layout: Layout) -> None:
    joiner_calls = 0
    joining = threading.Event()
    main = threading.get_ident()

    def now() -> float:
        nonlocal joiner_calls
        if threading.get_ident() == main:
            joiner_calls += 1
            if joiner_calls >= 2:  # the joiner holds the shard lock by its second clock read
                joining.set()
        return time.monotonic()

    s = Shard(ServerConfig(), now=now)
    outcome: list[object] = []

    def chief() -> None:
        try:
            assert joining.wait(timeout=20)
            outcome.append(s.initialize(0, layout, weights_for(layout)))
        except BaseException as exc:  # pragma: no cover - reported below
            outcome.append(exc)

    thread = threading.Thread(target=chief, daemon=True)
    thread.start()
    joiner_calls = 0  # count only calls made by join() below
    result = s.join(1, layout, wait_s=20)
    thread.join(timeout=20)
    assert not thread.is_alive()
    assert outcome == [False]
    assert result == JoinResult(initialized=True, ready=True, joined=2, start_clock=0, version=0)


@pytest.mark.parametrize("then", ["leaves", "is taken over"])
def test_a_join_waiting_at_the_start_does_not_bring_back_a_worker_that_left_or_was_taken_over(then: str) -> None:
    # A sync job's worker waits at the start in a Join that registers its rank again each time it
    # wakes. Ctrl-C there makes the worker leave while that call still waits: the leave woke it, and
    # it registered the rank again, live (CI at c0888a9 caught it in tests/e2e/test_faults.py). So
    # too a Join of a process another one took the rank from: it would take it back at each wake.
    layout = make_layout(JobSpec(lr=0.5, num_shards=2, mode="sync", num_workers=3))  # (rank 2 never comes)
    s = Shard(ServerConfig())
    s.initialize(0, layout, weights_for(layout))
    waited: list[JoinResult] = []
    thread = threading.Thread(target=lambda: waited.append(s.join(1, layout, wait_s=50, incarnation=7)), daemon=True)
    thread.start()
    wait_for("the join to register rank 1", lambda: s.core.members.get(1) is not None)
    if then == "leaves":
        s.leave(1, incarnation=7)
    else:
        s.join(1, layout, incarnation=8)
    thread.join(timeout=25)  # (well before its 50 s)
    assert not thread.is_alive() and len(waited) == 1  # (it stopped waiting: nothing left to wait for)
    member = s.core.members.get(1)
    assert member is not None
    assert (member.state, member.incarnation) == (("left", 7) if then == "leaves" else ("live", 8))


# ----------------------------------------------------------------------------- pull
@pytest.mark.parametrize("wire_dtype", ["float32", "bfloat16", "float16"])
def test_pull_frames_carry_weights_and_version(wire_dtype: str) -> None:
    layout = make_layout(JobSpec(lr=0.5, num_shards=2, wire_dtype=wire_dtype))
    s = Shard(ServerConfig(chunk_bytes=1024))
    w = torch.randn(layout.numel)
    s.initialize(0, layout, w.clone())
    s.join(1, layout)
    version, frames = s.pull_frames(1, 0, layout.fingerprint)
    assert version == 0
    got = decode_frames(frames, layout.numel, wire_dtype)
    assert torch.equal(got, w.to(getattr(torch, wire_dtype)).float())
    st = s.status()
    assert st.pulls == 1
    assert st.bytes_out == WireBuffer(layout.numel, wire_dtype).nbytes


def test_pull_frames_are_a_snapshot(shard: Shard, layout: Layout) -> None:
    before = shard.weights_copy()
    shard.join(1, layout)
    _, frames = shard.pull_frames(1, 0, layout.fingerprint)
    push(shard, layout, torch.ones(layout.numel))
    assert torch.equal(decode_frames(frames, layout.numel, "float32"), before)


def test_pull_with_wrong_fingerprint(shard: Shard, layout: Layout) -> None:
    with pytest.raises(JobMismatchError) as info:
        shard.pull_frames(1, 0, "not-the-fingerprint")
    assert "not-the-fingerprint" in str(info.value) and layout.fingerprint in str(info.value)


# ----------------------------------------------------------------------------- push
def test_push_applies_sgd_and_bumps_version(shard: Shard, layout: Layout) -> None:
    old = shard.weights_copy()
    grad = torch.randn(layout.numel, generator=torch.Generator().manual_seed(9))
    result = push(shard, layout, grad, rank=0, clock=0, base_version=0)
    assert result.applied is True
    assert result.version == 1 and shard.version == 1
    assert result.staleness == 0
    assert torch.allclose(shard.weights_copy(), old - 0.5 * grad, rtol=1e-6, atol=1e-7)
    st = shard.status()
    assert st.pushes_applied == 1
    assert st.bytes_in == layout.numel * 4
    assert st.staleness == {0: 1}


def test_push_bf16_wire(layout: Layout) -> None:
    bf_layout = make_layout(JobSpec(lr=0.5, num_shards=2, wire_dtype="bfloat16"))
    s = Shard(ServerConfig())
    w = weights_for(bf_layout)
    s.initialize(0, bf_layout, w.clone())
    grad = torch.randn(bf_layout.numel) / 3
    assert push(s, bf_layout, grad).applied
    expected = w - 0.5 * grad.to(torch.bfloat16).float()
    assert torch.allclose(s.weights_copy(), expected, rtol=1e-6, atol=1e-7)
    with pytest.raises(InvalidRequestError, match="bfloat16"):
        s.push_target(0, 1, 0, bf_layout.numel, "float32", bf_layout.fingerprint)


def test_staleness_is_version_minus_base_version(shard: Shard, layout: Layout) -> None:
    g = torch.full((layout.numel,), 0.1)
    shard.join(1, layout)
    shard.join(2, layout)
    # Three workers pull version 0, then push one after another.
    results = [push(shard, layout, g, rank=r, clock=0, base_version=0) for r in range(3)]
    assert [r.staleness for r in results] == [0, 1, 2]
    assert [r.version for r in results] == [1, 2, 3]
    # Worker 0 pulls version 3 and pushes again: staleness 0; worker 1 pushes on base 1: 2.
    assert push(shard, layout, g, rank=0, clock=1, base_version=3).staleness == 0
    assert push(shard, layout, g, rank=1, clock=1, base_version=2).staleness == 2
    st = shard.status()
    assert st.staleness == {0: 2, 1: 1, 2: 2}
    assert st.version == 5 == st.pushes_applied
    clocks = {rank: clock for rank, clock, *_ in st.workers}
    assert clocks == {0: 2, 1: 2, 2: 1}


def test_push_with_base_version_from_the_future(shard: Shard, layout: Layout) -> None:
    with pytest.raises(InvalidRequestError) as info:
        shard.push_target(0, 0, 5, layout.numel, "float32", layout.fingerprint)
    assert "5" in str(info.value)
    assert shard.status().pushes_rejected == 1


@pytest.mark.parametrize("delta", [-1, 1, 1000])
def test_push_with_wrong_numel(shard: Shard, layout: Layout, delta: int) -> None:
    before = shard.weights_copy()
    wrong = layout.numel + delta
    with pytest.raises(InvalidRequestError) as info:
        shard.push_target(0, 0, 0, wrong, "float32", layout.fingerprint)
    msg = str(info.value)
    assert str(wrong) in msg and str(layout.numel) in msg
    assert torch.equal(shard.weights_copy(), before)
    assert shard.version == 0
    assert shard.status().pushes_rejected == 1


def test_push_with_too_few_bytes_leaves_shard_unchanged(shard: Shard, layout: Layout) -> None:
    before = shard.weights_copy()
    buf, wire, writer = shard.push_target(0, 0, 0, layout.numel, "float32", layout.fingerprint)
    writer.write(byte_view(torch.ones(layout.numel - 1)))
    with pytest.raises(InvalidRequestError, match=str(layout.numel * 4)):
        writer.finish()
    with pytest.raises(InvalidRequestError):
        writer.write(byte_view(torch.ones(2)))
    shard.reject()
    shard.release(buf, wire)
    assert torch.equal(shard.weights_copy(), before)
    assert shard.version == 0
    assert shard.status().pushes_rejected == 1


def test_duplicate_push_changes_nothing(shard: Shard, layout: Layout) -> None:
    g = torch.randn(layout.numel)
    shard.join(1, layout)
    shard.join(2, layout)
    assert push(shard, layout, g, rank=1, clock=0).applied
    after_first = shard.weights_copy()
    dup = push(shard, layout, g, rank=1, clock=0, base_version=0)
    assert dup.applied is False
    assert "duplicate" in dup.reason
    assert dup.version == 1 and shard.version == 1
    assert torch.equal(shard.weights_copy(), after_first)
    # An older clock is also a duplicate; another rank at the same clock is not.
    assert push(shard, layout, g, rank=1, clock=1).applied
    assert push(shard, layout, g, rank=1, clock=0, base_version=0).applied is False
    assert push(shard, layout, g, rank=2, clock=0).applied
    st = shard.status()
    assert st.pushes_applied == 3 and st.pushes_duplicate == 2 and st.version == 3


def test_buffers_are_reused_without_leaking_old_gradients(shard: Shard, layout: Layout) -> None:
    old = shard.weights_copy()
    g1, g2 = torch.full((layout.numel,), 2.0), torch.full((layout.numel,), -1.0)
    push(shard, layout, g1, clock=0)
    push(shard, layout, g2, clock=1)
    assert torch.allclose(shard.weights_copy(), old - 0.5 * g1 - 0.5 * g2)


def _bad_grad(layout: Layout) -> torch.Tensor:
    g = torch.ones(layout.numel)
    g[1] = float("nan")
    g[3] = float("inf")
    return g


def test_nonfinite_reject() -> None:
    layout = make_layout()
    s = Shard(ServerConfig(nonfinite="reject"))
    s.initialize(0, layout, weights_for(layout))
    s.join(2, layout)
    before = s.weights_copy()
    with pytest.raises(InvalidRequestError) as info:
        push(s, layout, _bad_grad(layout), rank=2, clock=0)
    assert "2 non-finite" in str(info.value) and "rank 2" in str(info.value)
    assert torch.equal(s.weights_copy(), before)
    assert s.version == 0
    assert s.status().pushes_rejected == 1
    # The rejected key was not consumed: a corrected retry of the same (rank, clock) is applied.
    assert push(s, layout, torch.ones(layout.numel), rank=2, clock=0).applied


def test_nonfinite_detection_edge_cases() -> None:
    layout = make_layout()
    s = Shard(ServerConfig(nonfinite="reject"))
    s.initialize(0, layout, weights_for(layout))
    s.join(1, layout)
    # Finite values whose sum overflows float32 are still finite: applied.
    huge = torch.full((layout.numel,), 3e38)
    assert push(s, layout, huge, rank=1, clock=0).applied
    assert bool(torch.isfinite(s.weights_copy()).all())
    # +inf and -inf together (their sum is NaN) and a lone -inf are both refused.
    both = torch.zeros(layout.numel)
    both[0], both[-1] = float("inf"), float("-inf")
    with pytest.raises(InvalidRequestError, match="2 non-finite"):
        push(s, layout, both, rank=1, clock=1)
    lone = torch.zeros(layout.numel)
    lone[4] = float("-inf")
    with pytest.raises(InvalidRequestError, match="1 non-finite"):
        push(s, layout, lone, rank=1, clock=1)
    assert s.version == 1


def test_nonfinite_skip() -> None:
    layout = make_layout()
    s = Shard(ServerConfig(nonfinite="skip"))
    s.initialize(0, layout, weights_for(layout))
    s.join(2, layout)
    before = s.weights_copy()
    result = push(s, layout, _bad_grad(layout), rank=2, clock=0)
    assert result.applied is False
    assert "non-finite" in result.reason
    assert torch.equal(s.weights_copy(), before)
    assert s.version == 0
    st = s.status()
    assert st.pushes_rejected == 1 and st.pushes_applied == 0
    assert {r: c for r, c, *_ in st.workers}[2] == 1  # the worker may go on to its next clock


def test_nonfinite_allow() -> None:
    layout = make_layout()
    s = Shard(ServerConfig(nonfinite="allow"))
    s.initialize(0, layout, weights_for(layout))
    s.join(2, layout)
    result = push(s, layout, _bad_grad(layout), rank=2, clock=0)
    assert result.applied is True
    assert s.version == 1
    w = s.weights_copy()
    assert torch.isnan(w[1]) and not torch.isfinite(w[3])
    assert torch.isfinite(w[0])


# ----------------------------------------------------------------------------- membership
def test_leave_then_push_or_pull(shard: Shard, layout: Layout) -> None:
    shard.join(1, layout)
    shard.join(2, layout)
    assert push(shard, layout, torch.ones(layout.numel), rank=1, clock=0).applied
    shard.leave(1)
    assert shard.history[-1] == ("leave", 1, 1)
    before = shard.weights_copy()
    with pytest.raises(WorkerStateError, match="rank 1 already left"):
        shard.push_target(1, 1, 1, layout.numel, "float32", layout.fingerprint)
    with pytest.raises(WorkerStateError, match="rank 1 already left"):
        shard.pull_frames(1, 1, layout.fingerprint)
    with pytest.raises(WorkerStateError, match="rank 1 already left"):
        shard.touch(1)
    assert shard.status().pushes_rejected == 1
    assert torch.equal(shard.weights_copy(), before)
    # Other workers are unaffected.
    assert push(shard, layout, torch.ones(layout.numel), rank=2, clock=0).applied


def test_rejoin_after_leave_continues_past_last_push(shard: Shard, layout: Layout) -> None:
    g = torch.ones(layout.numel)
    shard.join(1, layout)
    assert push(shard, layout, g, rank=1, clock=0).applied
    assert push(shard, layout, g, rank=1, clock=1).applied
    shard.leave(1)
    # Back again: its clock continues past its last push (async start clock is the slowest live
    # clock, here the chief's 0), so an old clock is still a duplicate and a new one is applied.
    result = shard.join(1, layout)
    assert result.start_clock == 2
    assert {r: (c, st) for r, c, st, *_ in shard.status().workers}[1] == (2, "live")
    assert shard.history[-1] == ("join", 1, 2)
    dup = push(shard, layout, g, rank=1, clock=1)
    assert dup.applied is False and "duplicate" in dup.reason
    assert push(shard, layout, g, rank=1, clock=2).applied
    assert shard.version == 3


def test_apply_push_gives_its_buffers_back_once(layout: Layout) -> None:
    # apply_push owns the receive buffers and returns them to the pool exactly once on every path
    # (applied, duplicate, rejected): they are reused, yet two pushes in flight never share one
    # (which would mix their gradients).
    shard = Shard(ServerConfig(push_buffers=2))
    shard.initialize(0, layout, weights_for(layout))
    shard.join(1, layout)
    fp = layout.fingerprint
    lent = shard.push_target(0, 0, 0, layout.numel, "float32", fp)
    lent[2].write(byte_view(torch.ones(layout.numel)))
    lent[2].finish()
    assert shard.apply_push(0, 0, 0, lent[0], lent[1], lent[1].nbytes).applied
    dup = push(shard, layout, torch.ones(layout.numel), rank=0, clock=0)  # duplicate path
    assert dup.applied is False
    bad = torch.ones(layout.numel)
    bad[0] = float("nan")
    with pytest.raises(InvalidRequestError):  # rejected path
        push(shard, layout, bad, rank=0, clock=1)
    a = shard.push_target(0, 1, 1, layout.numel, "float32", fp)
    b = shard.push_target(1, 0, 1, layout.numel, "float32", fp)
    assert a[0] is lent[0] and a[1] is lent[1]  # reused, not leaked
    assert b[0].data_ptr() != a[0].data_ptr() and b[1] is not a[1]
    shard.release(a[0], a[1])
    shard.release(b[0], b[1])


def test_lease_expiry_and_leave(layout: Layout) -> None:
    clock = FakeClock()
    s = Shard(ServerConfig(lease_s=5.0), now=clock)
    s.initialize(0, layout, weights_for(layout))
    s.join(1, layout)
    s.join(2, layout)

    def states() -> dict[int, str]:
        return {rank: state for rank, _, state, _, _ in s.status().workers}

    assert states() == {0: "live", 1: "live", 2: "live"}
    clock.t += 3.0
    assert s.touch(2) == 0  # renews only rank 2's lease; returns the version
    clock.t += 2.0
    assert states() == {0: "live", 1: "live", 2: "live"}  # exactly lease_s: still held
    clock.t += 0.5
    assert states() == {0: "evicted", 1: "evicted", 2: "live"}
    assert s.status().evictions == 2
    assert ("evict", 0, 0) in s.history and ("evict", 1, 0) in s.history
    last_seen = {rank: ago for rank, _, _, ago, _ in s.status().workers}
    assert last_seen == {0: 5.5, 1: 5.5, 2: 2.5}
    assert s.touch(2) == 0
    # An evicted worker's calls fail until it joins again.
    with pytest.raises(WorkerStateError, match="rank 1 was evicted"):
        s.touch(1)
    with pytest.raises(WorkerStateError, match="evicted"):
        s.pull_frames(1, 0, layout.fingerprint, timeout_s=0)
    assert states()[1] == "evicted"
    assert s.join(1, layout).initialized
    assert states()[1] == "live"
    assert s.touch(1) == 0
    s.leave(1)
    assert states()[1] == "left"
    clock.t += 100
    assert states() == {0: "evicted", 1: "left", 2: "evicted"}
    assert s.status().evictions == 3  # rank 0 is not evicted twice; a left worker never is
    assert s.status().uptime_s == pytest.approx(105.5)
    assert [e for e in s.history if e[0] != "join"][-1] == ("evict", 2, 0)


def test_a_stall_of_the_server_itself_starts_every_lease_again(layout: Layout, caplog: pytest.LogCaptureFixture) -> None:
    """A server that did not run (SIGSTOP, a starved host) does not evict the workers whose calls
    it left unanswered: where the lease reaper looks more than STALL_S after it meant to, every
    live lease starts again (and the server says so). On time, leases run out as before."""
    from psgrad.server.membership import STALL_S

    clock = FakeClock()
    s = Shard(ServerConfig(lease_s=4.0), now=clock)
    s.initialize(0, layout, weights_for(layout))
    s.join(1, layout)
    members = s.core.members

    def states() -> dict[int, str]:
        return {rank: state for rank, _, state, _, _ in s.status().workers}

    assert members.reaper_wait_s() == 1.0  # a quarter lease: a stall is told from an idle wait
    clock.t += 1.0 + STALL_S + 10.0  # stopped for 10 s past the lease
    with caplog.at_level(logging.WARNING, logger="psgrad.server"):
        assert states() == {0: "live", 1: "live"}
    assert "this server did not run for 11.0 s" in caplog.text and "2 live worker(s)" in caplog.text
    clock.t += 3.0
    s.touch(1)
    members.reaper_wait_s()
    clock.t += 1.0 + STALL_S - 0.01  # late, but within STALL_S: no stall; rank 0 has been silent 5 s
    assert states() == {0: "evicted", 1: "live"}
    assert members.stalled_s == 0.0 and s.status().evictions == 1


def test_joins_the_chiefs_init_evictions_and_leaves_are_logged_with_rank_clock_and_lease(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The server said nothing of them: a sync job stalled one lease for an evicted worker without a word.
    layout = make_layout(JobSpec(lr=0.5, num_shards=2, num_workers=2))
    clock = FakeClock()
    s = Shard(ServerConfig(lease_s=5.0), now=clock)
    with caplog.at_level(logging.DEBUG, logger="psgrad.server"):
        s.initialize(0, layout, weights_for(layout))
        s.join(1, layout)
        s.join(1, layout)  # joined already: nothing new to say
        push(s, layout, torch.ones(layout.numel), rank=0, clock=0)  # nothing per push
        clock.t += 3.0
        s.touch(0)
        clock.t += 2.5
        s.status()  # rank 1's lease ran out
        s.leave(0)
    lines = [(r.levelname, r.name, r.getMessage()) for r in caplog.records]
    print("\n".join(m for _, _, m in lines))
    assert [m for _, _, m in lines] == [
        "initialized by the chief (worker 0): shard 0 of 2, [0, 8) = 8 parameters; async mode, 2 workers, "
        "optimizer sgd, lr 0.5",
        "worker 0 joined at clock 0 (1 live of 2)",
        "worker 1 joined at clock 0 (2 live of 2)",
        "worker 1 evicted at clock 0: no call for 5.5 s, past its lease (--lease-s 5); nobody waits for it now "
        "(1 live), and it joins again by itself if it is alive",
        "worker 0 left at clock 1 (0 live)",
    ]
    assert {(level, name) for level, name, _ in lines} == {("INFO", "psgrad.server")}


def test_a_worker_joining_again_within_its_lease_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    # A worker restarted within its lease joined again without a word: the server logged every join but that one.
    layout = make_layout(JobSpec(lr=0.5, num_workers=2))
    s = Shard(ServerConfig(lease_s=5.0), now=FakeClock())
    s.initialize(0, layout, weights_for(layout))
    s.join(1, layout)
    push(s, layout, torch.ones(layout.numel), rank=1, clock=0)
    with caplog.at_level(logging.DEBUG, logger="psgrad.server"):
        s.join(1, layout)  # a round of waiting at the start: nothing new to say
        assert s.join(1, layout, rejoin=True).start_clock == 1
    assert [r.getMessage() for r in caplog.records] == [
        "worker 1 joined again at clock 1, within its lease (2 live of 2)"]
    assert [r.levelname for r in caplog.records] == ["INFO"]


def test_a_forged_clock_is_refused_after_leave_and_rejoin_too(shard: Shard, layout: Layout) -> None:
    """Leave, join again, push (or pull at) clock 10^12: refused, nothing recorded — else that worker's
    real gradients would be dropped as duplicates from then on. Its real clock still works."""
    g = torch.ones(layout.numel)
    assert push(shard, layout, g, clock=0).applied
    assert push(shard, layout, g, clock=1).applied
    shard.leave(0)
    shard.join(0, layout)
    before = shard.weights_copy()
    with pytest.raises(InvalidRequestError, match="beyond any this shard has seen"):
        push(shard, layout, g, clock=10**12)
    with pytest.raises(InvalidRequestError, match="continues from clock 1000000000000"):
        shard.pull_frames(0, 10**12, layout.fingerprint, timeout_s=1.0)
    assert torch.equal(shard.weights_copy(), before) and shard.status().workers[0].clock == 2
    assert push(shard, layout, g, clock=2).applied  # where it really continues
    assert not push(shard, layout, g, clock=2).applied  # (a retry of it is still a duplicate)


def test_a_negative_or_future_table_base_version_is_refused_at_the_header_and_changes_nothing() -> None:
    """A table's base version (the table version its rows were read at) is 0 to the table's version
    on the shard. The wire's uint64 cannot say -1, but a caller of the shard can: before, -1 was taken
    and counted as a staleness of the table's version + 1; one past the table's counted as 0. Now
    both are refused at the header (push_target: nothing received, nothing applied). A shard
    restored from a checkpoint is behind what its workers read: there only a negative one is."""
    from psgrad.core.sharding import TableSpec

    spec = JobSpec(lr=0.5, num_shards=1, optimizer="adagrad")
    tables = (TableSpec("emb", 100, 4, 1, 0.1),)
    lay = Layout(spec, PARAMS, 0, 0, 16, fingerprint(PARAMS, spec, tables), tables=tables)
    s = Shard(ServerConfig())
    s.initialize(0, lay, weights_for(lay))
    ids = torch.tensor([1, 4])

    def push_rows(clock: int, base: int) -> PushResult:
        buf, wire, writer = s.push_target(0, clock, s.version, 16, "float32", lay.fingerprint,
                                          rows={"emb": (ids, torch.ones(2, 4), base)})
        writer.write(WireBuffer(16, "float32").encode(torch.zeros(16)))
        writer.finish()
        return s.apply_push(0, clock, s.version, buf, wire, wire.nbytes)

    assert push_rows(0, 0).applied
    table = s.core.state.sparse("emb", 0)  # type: ignore[union-attr]
    before = (s.version, table.status("emb"), table.rows(ids).clone(), s.status().pushes_rejected)
    for base in (-1, -(2**63), 2, 2**70):
        with pytest.raises(InvalidRequestError, match=f"table 'emb''s rows claim base version {base}, but the table "
                                                      "is at version 1 on this shard"):
            push_rows(1, base)
    assert (s.version, table.status("emb")) == before[:2] and torch.equal(table.rows(ids), before[2])
    assert s.status().pushes_rejected == before[3] + 4
    assert push_rows(1, 1).applied and table.status("emb").updates == 2  # the clock stayed open
    # Behind what its workers read, no upper bound: a backup that took over (a worker may have read
    # rows its former primary never replicated), a shard restored from a checkpoint or rolled back.
    s.core.took_over = True
    assert push_rows(2, 7).applied
    s.core.took_over, s.core.marks.restored = False, True
    assert push_rows(3, 9).applied
    with pytest.raises(InvalidRequestError, match="claim base version -1"):
        push_rows(4, -1)


def _sync_shard(joined: int = 2) -> tuple[Shard, Layout]:
    """A sync shard of 2 workers (`joined` of them joined: one past num_workers is a new worker)
    with a sparse table "emb", its SGD at lr 0.5."""
    from psgrad.core.sharding import TableSpec

    spec = JobSpec(lr=0.5, num_shards=1, mode="sync", num_workers=2)
    tables = (TableSpec("emb", 100, 4, 1, 0.1),)
    lay = Layout(spec, PARAMS, 0, 0, 16, fingerprint(PARAMS, spec, tables), tables=tables)
    s = Shard(ServerConfig())
    s.initialize(0, lay, weights_for(lay))
    for rank in range(1, joined):
        s.join(rank, lay)
    return s, lay


def _sync_push(s: Shard, lay: Layout, rank: int, clock: int = 0) -> PushResult:
    """Worker `rank`'s push of iteration `clock`: a dense gradient and rows of "emb" of its own."""
    g = torch.Generator().manual_seed(10 * rank + clock)
    ids = torch.unique(torch.randint(0, 100, (6,), generator=g))
    rows = {"emb": (ids, torch.randn(ids.numel(), 4, generator=g), 0)}
    grad = torch.randn(16, generator=g)
    buf, wire, writer = s.push_target(rank, clock, s.version, 16, "float32", lay.fingerprint, rows=rows)
    writer.write(WireBuffer(16, "float32").encode(grad))
    writer.finish()
    return s.apply_push(rank, clock, s.version, buf, wire, wire.nbytes)


def _weights_and_rows(s: Shard) -> tuple[torch.Tensor, torch.Tensor]:
    state = s.core.state
    assert state is not None
    return state.weights.clone(), state.sparse("emb", 0).rows(torch.arange(100))


def _fail_once(monkeypatch: pytest.MonkeyPatch, s: Shard) -> list[int]:
    """Make the shard's next row update raise once it has written its rows (an apply that fails
    part way: undone, see RowJournal); returns the calls seen."""
    state = s.core.state
    assert state is not None
    table = state.sparse("emb", 0)
    apply, calls = table.apply, []

    def failing(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(1)
        out = apply(*args, **kwargs)
        if len(calls) == 1:
            raise RuntimeError("injected: the apply failed")
        return out

    monkeypatch.setattr(table, "apply", failing)
    return calls


@pytest.fixture(params=["torch ops", "row kernels"])
def row_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> tuple[str, list[bool]]:
    """The rows' updates by the rule's torch ops (the undo's copies taken before they write), or by
    the compiled row kernels (which copy what they overwrite in the same pass); returns (which, the
    journaled kernel applies seen: True where one applied)."""
    from psgrad.server import kernels

    seen: list[bool] = []
    if request.param == "torch ops":
        monkeypatch.setenv("PSGRAD_FUSED_APPLY", "0")
        return request.param, seen
    if kernels.rows(wait=True) is None:
        pytest.skip("the row kernels are not available here (numba)")
    apply = kernels.RowKernels.apply

    def spy(self: kernels.RowKernels, *args: Any) -> bool:
        done = apply(self, *args)
        if len(args) > 7 and args[7] is not None:
            seen.append(done)
        return done

    monkeypatch.setattr(kernels.RowKernels, "apply", spy)
    return request.param, seen


def test_a_sync_iteration_whose_apply_fails_is_kept_and_completed_by_the_retry(monkeypatch: pytest.MonkeyPatch,
                                                                               row_path: tuple[str, list[bool]]) -> None:
    """Before: complete_iteration took the round's gradients and then applied them; an apply that
    raised lost them, and the shard waited for an iteration nobody would push again (the job wedged).
    Now the round is taken once the update is applied: the failed apply leaves everything as it
    was (weights, rows, version, the buffered gradients, no record for the standby), and the retry
    of the push that completed the round applies it: bit for bit the iteration of a shard where
    nothing failed. Both ways of updating rows (torch's ops, the row kernels) are undone so."""
    reference, lay = _sync_shard()
    for rank in range(2):
        _sync_push(reference, lay, rank)
    assert reference.version == 1
    s, _ = _sync_shard()
    before = _weights_and_rows(s)
    calls = _fail_once(monkeypatch, s)
    path, kernel_applies = row_path
    kernel_applies.clear()
    assert _sync_push(s, lay, 0).deferred
    with pytest.raises(ApplyFailedError, match="injected.*undone"):
        _sync_push(s, lay, 1)  # it completes the round, whose apply fails (after writing rows: undone)
    assert calls == [1] and s.version == 0 and len(s.core.round.pending) == 2  # the round is kept
    assert all(torch.equal(a, b) for a, b in zip(_weights_and_rows(s), before))
    assert kernel_applies == ([True] if path == "row kernels" else [])  # (the failed apply's way, journaled)
    assert s.replica._payload is None and s.replica._rows == []  # (nothing of it for a record)
    retried = _sync_push(s, lay, 1)  # the worker's retry: its refresh applies the iteration first
    assert not retried.applied and retried.reason.startswith("duplicate") and retried.version == 1
    assert calls == [1, 1] and s.version == 1 and s.status().pending == 0
    assert all(torch.equal(a, b) for a, b in zip(_weights_and_rows(s), _weights_and_rows(reference)))
    assert [e for e in s.history if e[0] == "apply"] == [e for e in reference.history if e[0] == "apply"]
    for rank in range(2):  # and the job goes on
        assert _sync_push(s, lay, rank, clock=1).deferred or s.version == 2
    assert s.version == 2


def test_a_sync_iteration_whose_dense_apply_fails_leaves_the_shard_refusing_pushes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dense apply is an iteration's last write (its rows go first, journaled); one that fails may
    have written part of the weights, which nothing cheap undoes: its rows are undone, and the shard
    refuses every push from then on, naming why, so that no retry (a push's, a refresh's) applies the
    iteration a second time over the part written."""
    s, lay = _sync_shard()
    _, rows_before = _weights_and_rows(s)
    state = s.core.state
    assert state is not None

    def failing(grad: torch.Tensor, lr_scale: float = 1.0, lr: float | None = None, skip: Ranges = ()) -> None:
        raise RuntimeError("injected: the dense apply failed")

    monkeypatch.setattr(state.dense, "apply", failing)
    _sync_push(s, lay, 0)
    with pytest.raises(ApplyFailedError, match="refuses every push from now on"):
        _sync_push(s, lay, 1)
    assert torch.equal(_weights_and_rows(s)[1], rows_before) and state.sparse("emb", 0).version == 0
    monkeypatch.undo()
    with pytest.raises(ApplyFailedError, match="injected: the dense apply failed"):
        _sync_push(s, lay, 1)  # the retry: refused, not applied
    assert not s.core.complete_round() and s.version == 0  # nor by a refresh


def test_a_worker_that_joins_while_a_failed_iteration_waits_is_folded_into_its_mean(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker that joins after the round's apply failed owes the iteration too (a sync worker
    joins at the current one): the mean computed for the failed apply, kept, takes its gradient in
    (to rounding: the mean is scaled back to the sum), as if the three had pushed."""
    reference, lay = _sync_shard(3)
    for rank in range(3):
        _sync_push(reference, lay, rank)
    s, _ = _sync_shard()
    _fail_once(monkeypatch, s)
    _sync_push(s, lay, 0)
    with pytest.raises(ApplyFailedError, match="injected"):
        _sync_push(s, lay, 1)
    s.join(2, lay)  # a new worker (past num_workers): it owes the current iteration
    assert s.version == 0 and len(s.core.round.pending) == 2
    assert _sync_push(s, lay, 2).applied and s.version == 1
    for a, b in zip(_weights_and_rows(s), _weights_and_rows(reference)):
        torch.testing.assert_close(a, b)


def test_the_lease_reaper_survives_a_failed_iteration_and_completes_it(monkeypatch: pytest.MonkeyPatch,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """The lease reaper refreshes the shard at least every second, which tries a kept iteration
    again: one whose apply fails there too is logged and tried at its next look (the reaper used to
    die with the exception, and no lease ran out after it)."""
    s, lay = _sync_shard()
    state = s.core.state
    assert state is not None
    table = state.sparse("emb", 0)
    apply, calls = table.apply, []

    def failing(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(threading.current_thread().name)
        if len(calls) <= 2:  # the push's refresh, then the reaper's first look
            raise RuntimeError("injected: the apply failed")
        return apply(*args, **kwargs)

    monkeypatch.setattr(table, "apply", failing)
    _sync_push(s, lay, 0)
    reaper = s.start_reaper()
    try:
        with caplog.at_level(logging.ERROR, logger="psgrad.server"):
            with pytest.raises(ApplyFailedError, match="injected"):
                _sync_push(s, lay, 1)
            # no call of a worker's (nor status(), which refreshes): the reaper alone completes it
            wait_for("the reaper to apply the iteration", lambda: s.version == 1, timeout_s=20)
        assert calls[1:] == ["psgrad-lease-reaper"] * 2 and reaper.is_alive()
        assert "the lease reaper's refresh failed; it looks again" in caplog.text
    finally:
        s.close()
        reaper.join(timeout=10)


# ----------------------------------------------------------------------------- skips
def test_a_skip_acknowledges_a_refused_clock_unapplied_and_the_next_push_is_applied() -> None:
    """Async. A push refused for a NaN recorded nothing; the worker drops that step (other shards
    applied it): the skip of its clock changes no weight, moves the worker's clock past it and is
    counted (pushes_skipped), so its next clock is applied, not refused as a jump. A skip of a
    clock the shard applied answers a duplicate; one ahead of the worker's next clock is refused,
    nothing recorded."""
    layout = make_layout()
    s = Shard(ServerConfig())
    s.initialize(0, layout, weights_for(layout))
    assert push(s, layout, torch.ones(layout.numel), rank=0, clock=0).applied
    with pytest.raises(InvalidRequestError, match="non-finite"):
        push(s, layout, _bad_grad(layout), rank=0, clock=1)
    with pytest.raises(InvalidRequestError, match="next clock is 1"):  # the clock jump the skip makes good
        push(s, layout, torch.ones(layout.numel), rank=0, clock=2)
    before = s.weights_copy()
    with pytest.raises(InvalidRequestError, match="next clock is 1"):
        s.skip_push(0, 2, s.version, layout.fingerprint)
    result = s.skip_push(0, 1, s.version, layout.fingerprint)
    assert (result.applied, result.reason, result.version) == (False, "skipped: worker rank 0 dropped its step at clock 1", 1)
    assert torch.equal(s.weights_copy(), before)
    again = s.skip_push(0, 0, s.version, layout.fingerprint)  # (a clock it applied)
    assert not again.applied and again.reason == "duplicate push (rank 0, clock 0)"
    assert push(s, layout, torch.ones(layout.numel), rank=0, clock=2).applied
    st = s.status()
    assert (st.pushes_skipped, st.pushes_duplicate, st.pushes_applied, st.version) == (1, 1, 2, 2)
    assert {w.rank: w.clock for w in st.workers} == {0: 3}


def test_in_sync_a_skip_completes_the_iteration_without_the_worker_and_survives_a_checkpoint() -> None:
    """Sync, 2 workers: worker 1's gradient is buffered; worker 0's skip of the iteration completes
    it with worker 1's gradient alone (the mean of one). A snapshot then restored keeps the count
    and the clocks: the skip sent again is a duplicate there, and the next iteration goes on."""
    s, lay = _sync_shard()
    w0 = s.weights_copy()
    assert w0 is not None
    assert _sync_push(s, lay, 1).deferred
    assert s.version == 0
    result = s.skip_push(0, 0, 0, lay.fingerprint)
    assert not result.applied and result.version == 1
    g = torch.Generator().manual_seed(10)  # worker 1's dense gradient of iteration 0 (as _sync_push draws it)
    ids = torch.unique(torch.randint(0, 100, (6,), generator=g))
    torch.randn(ids.numel(), 4, generator=g)
    torch.testing.assert_close(s.weights_copy(), w0 - 0.5 * torch.randn(16, generator=g))
    status = s.status()
    assert (status.pushes_skipped, status.pushes_applied, status.version) == (1, 1, 1)
    restored = Shard(ServerConfig())
    restored.restore(s.snapshot())
    st = restored.status()
    assert st.pushes_skipped == 1 and {w.rank: w.clock for w in st.workers} == {0: 1, 1: 1}
    assert restored.skip_push(0, 0, 0, lay.fingerprint).reason == "duplicate push (rank 0, clock 0)"
    assert _sync_push(restored, lay, 0, clock=1).deferred
    assert _sync_push(restored, lay, 1, clock=1).applied and restored.version == 2
