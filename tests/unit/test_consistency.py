"""Consistency modes: pure tests of psgrad.core.consistency's policies, and Shard-level tests of the
sync/ssp/async gates and apply rules with an injected fake clock (no network, no sleeps)."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from psgrad import config as config_module
from psgrad.core.codecs import WireBuffer
from psgrad.config import JobSpec, ServerConfig
from psgrad.core.consistency import (
    AsyncPolicy,
    ClockView,
    ConsistencyPolicy,
    PushDecision,
    SSPPolicy,
    SyncPolicy,
)
from psgrad.core.modes import POLICIES, make_policy
from psgrad.errors import ConfigError, InvalidRequestError, WorkerStateError
from psgrad.server.shard import JoinResult, Layout, PushResult, Shard
from psgrad.core.sharding import ParamSpec, fingerprint, plan_shards

pytestmark = pytest.mark.timeout(60)

PARAMS = (ParamSpec("fc.weight", (4, 3), "float32"), ParamSpec("fc.bias", (4,), "float32"))  # 16 elements
LR = 0.5
LEASE_S = 5.0


# ============================================================================= pure policy tests
def view(version: int, **clocks: int) -> ClockView:
    """ClockView(version, {rank: clock}) written as view(3, r0=1, r2=4)."""
    return ClockView(version, {int(k[1:]): v for k, v in clocks.items()})


def test_clock_view_min_clock() -> None:
    assert view(0).min_clock is None
    assert view(5, r0=3, r1=1, r7=9).min_clock == 1
    assert view(0, r4=0).min_clock == 0


def test_policies_match_config_modes() -> None:
    assert tuple(POLICIES) == config_module.MODES == ("async", "ssp", "sync")
    for mode, cls in POLICIES.items():
        assert cls.name == mode


def test_async_policy() -> None:
    p = AsyncPolicy()
    assert (p.name, p.aggregates, p.start_barrier) == ("async", False, False)
    # Pulls never wait, however far ahead the caller is.
    assert p.pull_ready(0, view(0))
    assert p.pull_ready(1000, view(0, r0=0, r1=1000))
    assert p.blocking(1000, view(0, r0=0, r1=1000)) == []
    # Nothing waits on clocks: a joiner counts its own iterations from 0.
    assert p.start_clock(view(7, r0=4, r1=2, r2=9)) == 0
    assert p.start_clock(view(7)) == 0


def test_ssp_policy_gate_and_blocking() -> None:
    p = SSPPolicy(2)
    assert (p.name, p.staleness, p.aggregates, p.start_barrier) == ("ssp", 2, False, True)
    v = view(10, r0=5, r1=3, r2=4)
    assert p.pull_ready(5, v)  # 5 - 3 = 2 <= 2
    assert not p.pull_ready(6, v)  # 6 - 3 = 3 > 2
    assert p.blocking(5, v) == []
    assert p.blocking(6, v) == [1]
    assert p.blocking(7, v) == [1, 2]  # 7 - 4 = 3 > 2 too; sorted by rank
    assert p.pull_ready(3, view(0))  # nobody live: nothing to wait for
    assert p.start_clock(v) == 3
    assert p.start_clock(view(10)) == 0
    s0 = SSPPolicy(0)  # bound 0: lock-step with the slowest live worker
    assert s0.pull_ready(3, view(0, r0=3, r1=3)) and not s0.pull_ready(4, view(0, r0=4, r1=3))


def test_sync_policy_gate_blocking_start_and_completion() -> None:
    p = SyncPolicy()
    assert (p.name, p.aggregates, p.start_barrier) == ("sync", True, True)
    # Pull(c) waits for version c (iteration c - 1 applied), whatever the clocks say.
    assert p.pull_ready(3, view(3, r0=0))
    assert p.pull_ready(2, view(3, r0=0))
    assert not p.pull_ready(4, view(3, r0=4, r1=9))
    # Waiting for the live workers that still owe the current iteration (clock <= version).
    v = view(3, r0=4, r1=3, r2=2, r3=4)
    assert p.blocking(4, v) == [1, 2]
    assert p.blocking(3, v) == []
    # A joiner starts at the current iteration, not at the slowest clock.
    assert p.start_clock(view(5, r0=2, r1=6)) == 5
    assert p.start_clock(view(0)) == 0
    # Complete when someone pushed and no live worker still owes it.
    assert p.iteration_complete(3, view(3, r0=4, r1=4), pushed=2)
    assert not p.iteration_complete(3, view(3, r0=4, r1=3), pushed=1)
    assert not p.iteration_complete(3, view(3, r0=4, r1=4), pushed=0)
    assert p.iteration_complete(3, view(3), pushed=1)  # the rest left: nobody owes it


@pytest.mark.parametrize("policy", [AsyncPolicy(), SSPPolicy(3), SyncPolicy()], ids=lambda p: p.name)
def test_lr_scale(policy) -> None:  # type: ignore[no-untyped-def]
    # 1 / max(1, staleness) when staleness_lr is on, 1 otherwise.
    assert [policy.lr_scale(t, True) for t in (0, 1, 2, 4, 10)] == [1.0, 1.0, 0.5, 0.25, 0.1]
    assert [policy.lr_scale(t, False) for t in (0, 1, 2, 4, 10)] == [1.0] * 5


def test_make_policy() -> None:
    assert type(make_policy("async")) is AsyncPolicy
    assert type(make_policy("sync")) is SyncPolicy
    ssp = make_policy("ssp", 4)
    assert type(ssp) is SSPPolicy and ssp.staleness == 4
    assert make_policy("ssp").staleness == 0


@pytest.mark.parametrize("mode", ["bsp", "", "SYNC", "asp"])
def test_make_policy_unknown_mode_lists_valid_ones(mode: str) -> None:
    with pytest.raises(ConfigError) as info:
        make_policy(mode)
    msg = str(info.value)
    assert repr(mode) in msg
    assert "async, ssp, sync" in msg


# ============================================================================= Shard-level helpers
class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make_layout(mode: str, num_workers: int, staleness: int = 0, staleness_lr: bool = False) -> Layout:
    spec = JobSpec(
        mode=mode, staleness=staleness, num_workers=num_workers, lr=LR, num_shards=2, staleness_lr=staleness_lr
    )
    start, end = plan_shards(PARAMS, spec.num_shards).ranges[0]
    return Layout(spec, PARAMS, 0, start, end, fingerprint(PARAMS, spec))


def make_shard(layout: Layout, ranks: tuple[int, ...] = (), seed: int = 0) -> tuple[Shard, FakeClock]:
    """An initialized shard (chief rank 0) on a fake clock, with `ranks` joined."""
    clock = FakeClock()
    s = Shard(ServerConfig(lease_s=LEASE_S), now=clock)
    assert s.initialize(0, layout, randn(layout.numel, seed)) is False
    for r in ranks:
        assert s.join(r, layout).initialized
    return s, clock


def randn(n: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale


def push(
    shard: Shard, layout: Layout, grad: torch.Tensor, rank: int, clock: int, base: int | None = None
) -> PushResult:
    """The server's push sequence; apply_push owns the buffers once it is called."""
    base = shard.version if base is None else base
    dtype = layout.spec.wire_dtype
    buf, wire, writer = shard.push_target(rank, clock, base, grad.numel(), dtype, layout.fingerprint)
    try:
        writer.write(WireBuffer(grad.numel(), dtype).encode(grad.contiguous()))
        writer.finish()
    except BaseException:
        shard.release(buf, wire)
        raise
    return shard.apply_push(rank, clock, base, buf, wire, wire.nbytes)


def can_pull(shard: Shard, layout: Layout, rank: int, clock: int) -> bool:
    """Probe the gate without blocking: a granted pull returns frames, a gated one None."""
    return shard.pull_frames(rank, clock, layout.fingerprint, timeout_s=0) is not None


def states(shard: Shard) -> dict[int, str]:
    return {rank: state for rank, _, state, _, _ in shard.status().workers}


def clocks(shard: Shard) -> dict[int, int]:
    return {rank: clock for rank, clock, *_ in shard.status().workers}


def applies(shard: Shard) -> list[tuple]:  # type: ignore[type-arg]
    return [e for e in shard.history if e[0] == "apply"]


# ============================================================================= sync
def test_sync_applies_the_mean_once_every_live_worker_pushed() -> None:
    layout = make_layout("sync", num_workers=3)
    s, _ = make_shard(layout, ranks=(0, 1, 2))
    w0 = s.weights_copy()
    grads = [randn(layout.numel, 10 + r) for r in range(3)]
    for r in range(3):
        assert can_pull(s, layout, r, 0)
    assert [e for e in s.history if e[0] == "pull"] == [("pull", r, 0, 0, 0) for r in range(3)]

    for r in (0, 1):
        result = push(s, layout, grads[r], rank=r, clock=0, base=0)
        assert result == PushResult(False, result.reason, 0, 0, deferred=True, lr=0.5)
        assert s.version == 0
        assert torch.equal(s.weights_copy(), w0)
        assert s.status().pending == r + 1
        # Iteration 1 may not start before iteration 0's mean is applied.
        assert not can_pull(s, layout, 0, 1)
        assert s.blocking(0, 1) == [x for x in (1, 2) if x > r]
    assert applies(s) == []

    last = push(s, layout, grads[2], rank=2, clock=0, base=0)
    assert last.applied is True and last.deferred is False
    assert last.version == 1 == s.version
    expected = w0 - LR * torch.stack(grads).mean(dim=0)
    assert torch.allclose(s.weights_copy(), expected, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(s.weights_copy(), w0 - LR * grads[2], rtol=1e-6, atol=1e-6)
    st = s.status()
    assert st.staleness == {0: 3}
    assert (st.pushes_applied, st.pending, st.version) == (3, 0, 1)
    assert applies(s) == [("apply", 1, ((0, 0, 0), (1, 0, 0), (2, 0, 0)))]
    for r in range(3):
        assert can_pull(s, layout, r, 1)
        assert s.blocking(r, 1) == []
    assert not can_pull(s, layout, 0, 2)


def w_after(grads: list[torch.Tensor], order: tuple[int, ...]) -> torch.Tensor:
    """What the weights of a fresh shard would be with the gradients summed in `order`."""
    total = grads[order[0]].clone()
    for i in order[1:]:
        total.add_(grads[i])
    return randn(grads[0].numel(), 0) - LR * (total / len(order))


def test_sync_mean_is_independent_of_arrival_order() -> None:
    layout = make_layout("sync", num_workers=3)
    # Two large gradients that cancel and a small one: float sums in arrival order differ between
    # these orders far beyond the weights' rounding, so only a fixed summation order is bitwise stable.
    big = randn(layout.numel, 20, 1e8)
    grads = [big, randn(layout.numel, 21, 1.0), -big]
    orders = [(0, 1, 2), (2, 0, 1), (1, 2, 0)]
    naive = [w_after(grads, order) for order in orders]
    assert not torch.equal(naive[0], naive[1])
    results = []
    for order in orders:
        s, _ = make_shard(layout, ranks=(0, 1, 2))
        for r in order:
            assert can_pull(s, layout, r, 0)
        outcomes = [push(s, layout, grads[r].clone(), rank=r, clock=0, base=0) for r in order]
        assert [o.deferred for o in outcomes] == [True, True, False]
        assert s.version == 1
        results.append(s.weights_copy())
    assert torch.equal(results[0], results[1])
    assert torch.equal(results[0], results[2])


def test_sync_worker_that_leaves_stops_being_waited_for() -> None:
    layout = make_layout("sync", num_workers=3)
    s, _ = make_shard(layout, ranks=(0, 1, 2))
    g = {(r, c): randn(layout.numel, 100 * r + c) for r in range(3) for c in range(4)}
    # Iteration 0: everybody.
    for r in range(3):
        assert can_pull(s, layout, r, 0)
        push(s, layout, g[r, 0], rank=r, clock=0)
    assert s.version == 1
    # Iteration 1: ranks 0 and 1 push, rank 2 (fewer steps) leaves instead: its leave completes it.
    for r in (0, 1):
        assert can_pull(s, layout, r, 1)
        assert push(s, layout, g[r, 1], rank=r, clock=1).deferred
    assert s.version == 1 and not can_pull(s, layout, 0, 2)
    w1 = s.weights_copy()
    s.leave(2)
    assert s.version == 2
    assert torch.allclose(s.weights_copy(), w1 - LR * (g[0, 1] + g[1, 1]) / 2, rtol=1e-6, atol=1e-6)
    assert list(s.history)[-2:] == [("leave", 2, 1), ("apply", 2, ((0, 1, 0), (1, 1, 0)))]
    # Iterations 2 and 3 complete with the two remaining workers alone.
    for c in (2, 3):
        for r in (0, 1):
            assert can_pull(s, layout, r, c)
        w = s.weights_copy()
        assert push(s, layout, g[0, c], rank=0, clock=c).deferred
        done = push(s, layout, g[1, c], rank=1, clock=c)
        assert done.applied and not done.deferred and s.version == c + 1
        assert torch.allclose(s.weights_copy(), w - LR * (g[0, c] + g[1, c]) / 2, rtol=1e-6, atol=1e-6)
    assert s.status().staleness == {0: 3 + 2 + 2 + 2}
    with pytest.raises(WorkerStateError, match="left"):
        s.push_target(2, 1, 1, layout.numel, "float32", layout.fingerprint)


def test_sync_evicted_worker_blocks_only_until_its_lease_passes() -> None:
    layout = make_layout("sync", num_workers=3)
    s, clock = make_shard(layout, ranks=(0, 1, 2))
    t0 = clock.t
    g = {(r, c): randn(layout.numel, 100 * r + c) for r in range(3) for c in range(3)}
    for r in range(3):
        assert can_pull(s, layout, r, 0)
        push(s, layout, g[r, 0], rank=r, clock=0)
    assert s.version == 1
    w1 = s.weights_copy()
    # Rank 2 goes silent after iteration 0; ranks 0 and 1 push iteration 1 and keep their leases.
    clock.t = t0 + 3
    for r in (0, 1):
        assert can_pull(s, layout, r, 1)
        assert push(s, layout, g[r, 1], rank=r, clock=1).deferred
    clock.t = t0 + LEASE_S  # exactly the lease: rank 2 is still held, the iteration still waits
    for r in (0, 1):
        s.touch(r)
    assert s.version == 1 and not can_pull(s, layout, 0, 2)
    assert s.blocking(0, 2) == [2]
    assert states(s)[2] == "live"
    clock.t = t0 + LEASE_S + 0.5
    assert s.touch(0) == 2  # this refresh evicts rank 2 and completes iteration 1 without it
    s.touch(1)
    assert states(s) == {0: "live", 1: "live", 2: "evicted"}
    assert s.status().evictions == 1
    assert ("evict", 2, 1) in s.history
    assert applies(s)[-1] == ("apply", 2, ((0, 1, 0), (1, 1, 0)))
    assert torch.allclose(s.weights_copy(), w1 - LR * (g[0, 1] + g[1, 1]) / 2, rtol=1e-6, atol=1e-6)
    assert can_pull(s, layout, 0, 2) and can_pull(s, layout, 1, 2)
    # The evicted worker's late push of iteration 1 is refused and changes nothing.
    before = s.weights_copy()
    with pytest.raises(WorkerStateError, match="evicted"):
        push(s, layout, g[2, 1], rank=2, clock=1)
    with pytest.raises(WorkerStateError, match="evicted"):
        s.pull_frames(2, 1, layout.fingerprint, timeout_s=0)
    assert torch.equal(s.weights_copy(), before) and s.version == 2
    st = s.status()
    assert st.evictions == 1 and st.pending == 0 and st.pushes_rejected == 1


def test_sync_push_for_the_wrong_iteration_is_refused() -> None:
    layout = make_layout("sync", num_workers=2)
    s, _ = make_shard(layout, ranks=(0, 1))
    w0 = s.weights_copy()
    g = randn(layout.numel, 3)
    with pytest.raises(InvalidRequestError) as info:
        push(s, layout, g, rank=0, clock=1)  # the shard is at iteration 0
    msg = str(info.value)
    assert "rank 0" in msg and "iteration 1" in msg and "iteration 0" in msg
    st = s.status()
    assert (st.pushes_rejected, st.pending, st.version) == (1, 0, 0)
    assert torch.equal(s.weights_copy(), w0)
    assert clocks(s) == {0: 0, 1: 0}
    # The refused push consumed nothing: the right iteration is still accepted and completes.
    assert push(s, layout, g, rank=0, clock=0).deferred
    assert push(s, layout, g, rank=1, clock=0).applied
    assert s.version == 1
    # A push for an iteration already past (not a duplicate of this worker's) is refused too.
    s.join(2, layout)
    with pytest.raises(InvalidRequestError, match="iteration 0"):
        push(s, layout, g, rank=2, clock=0, base=0)


def test_sync_iteration_whose_pushes_were_all_skipped_still_completes() -> None:
    layout = make_layout("sync", num_workers=2)
    s = Shard(ServerConfig(lease_s=LEASE_S, nonfinite="skip"), now=FakeClock())
    s.initialize(0, layout, randn(layout.numel, 0))
    s.join(1, layout)
    w0 = s.weights_copy()
    bad = torch.full((layout.numel,), float("nan"))
    for r in (0, 1):
        assert can_pull(s, layout, r, 0)
        result = push(s, layout, bad, rank=r, clock=0)
        assert result.applied is False and "non-finite" in result.reason
    assert clocks(s) == {0: 1, 1: 1}
    assert torch.equal(s.weights_copy(), w0)  # nothing was applied...
    # ...but iteration 0 is over: nobody owes it, so iteration 1 must be able to start.
    assert can_pull(s, layout, 0, 1) and can_pull(s, layout, 1, 1)
    assert s.version == 1


def test_sync_skipped_push_for_the_wrong_iteration_is_refused() -> None:
    layout = make_layout("sync", num_workers=2)
    s = Shard(ServerConfig(lease_s=LEASE_S, nonfinite="skip"), now=FakeClock())
    s.initialize(0, layout, randn(layout.numel, 0))
    s.join(1, layout)
    bad = torch.full((layout.numel,), float("nan"))
    with pytest.raises(InvalidRequestError, match="iteration 5"):
        push(s, layout, bad, rank=1, clock=5)
    assert clocks(s) == {0: 0, 1: 0}
    assert push(s, layout, randn(layout.numel, 1), rank=0, clock=0).deferred  # still waits for rank 1


# ============================================================================= ssp
def test_ssp_worker_waits_for_the_slowest_live_worker() -> None:
    layout = make_layout("ssp", num_workers=2, staleness=1)
    s, _ = make_shard(layout, ranks=(0, 1))
    a, b = 0, 1
    g = randn(layout.numel, 5)
    # A runs ahead while B is stuck at clock 0.
    assert can_pull(s, layout, a, 0)
    push(s, layout, g, rank=a, clock=0)
    assert can_pull(s, layout, a, 1)  # 1 - 0 <= 1
    push(s, layout, g, rank=a, clock=1)
    assert not can_pull(s, layout, a, 2)  # 2 - 0 > 1
    assert s.blocking(a, 2) == [b]
    assert s.version == 2  # ssp applies pushes on arrival
    # B is never held back by the faster worker.
    assert can_pull(s, layout, b, 0)
    push(s, layout, g, rank=b, clock=0, base=0)
    assert s.blocking(a, 2) == []
    assert can_pull(s, layout, a, 2)
    assert not can_pull(s, layout, a, 3)  # 3 - 1 > 1
    assert [e for e in s.history if e[0] == "pull" and e[1] == a][-1] == ("pull", a, 2, 1, 3)
    # Invariant: no granted pull is more than s ahead of the slowest live worker.
    for _, _, c, slowest, _ in (e for e in s.history if e[0] == "pull"):
        assert c - slowest <= 1
    assert s.status().staleness == {0: 2, 2: 1}


def test_ssp_slow_worker_that_leaves_releases_the_others() -> None:
    layout = make_layout("ssp", num_workers=2, staleness=1)
    s, _ = make_shard(layout, ranks=(0, 1))
    g = randn(layout.numel, 6)
    push(s, layout, g, rank=0, clock=0)
    push(s, layout, g, rank=0, clock=1)
    assert not can_pull(s, layout, 0, 2)
    s.leave(1)
    assert can_pull(s, layout, 0, 2)
    assert can_pull(s, layout, 0, 50)  # alone: nobody to wait for


# ============================================================================= async
def test_async_pulls_never_wait() -> None:
    layout = make_layout("async", num_workers=2)
    s, _ = make_shard(layout, ranks=(0, 1))
    assert can_pull(s, layout, 1, 50)  # rank 0 is still at clock 0
    assert s.blocking(1, 50) == []
    assert can_pull(s, layout, 0, 0)
    assert [e for e in s.history if e[0] == "pull"] == [("pull", 1, 50, 0, 0), ("pull", 0, 0, 0, 0)]


@pytest.mark.parametrize("staleness_lr", [True, False])
def test_async_staleness_lr_scales_the_step(staleness_lr: bool) -> None:
    layout = make_layout("async", num_workers=3, staleness_lr=staleness_lr)
    s, _ = make_shard(layout, ranks=(0, 1, 2))
    w = s.weights_copy()
    g = [randn(layout.numel, 30 + r) for r in range(3)]
    # All three pulled version 0; their pushes arrive with staleness 0, 1 and 2.
    assert push(s, layout, g[0], rank=0, clock=0, base=0).staleness == 0
    assert push(s, layout, g[1], rank=1, clock=0, base=0).staleness == 1
    w2 = s.weights_copy()
    # staleness 0 and 1 both use the full step (1 / max(1, tau)).
    assert torch.allclose(w2, w - LR * g[0] - LR * g[1], rtol=1e-6, atol=1e-6)
    result = push(s, layout, g[2], rank=2, clock=0, base=0)
    assert result.applied and result.staleness == 2 and result.version == 3
    scale = 0.5 if staleness_lr else 1.0
    assert torch.allclose(s.weights_copy(), w2 - scale * LR * g[2], rtol=1e-6, atol=1e-6)
    other = 1.0 if staleness_lr else 0.5
    assert not torch.allclose(s.weights_copy(), w2 - other * LR * g[2], rtol=1e-6, atol=1e-6)
    assert s.status().staleness == {0: 1, 1: 1, 2: 1}


# ============================================================================= join
def test_sync_joiner_of_a_running_job_starts_at_the_current_iteration() -> None:
    layout = make_layout("sync", num_workers=2)
    s, _ = make_shard(layout, ranks=(0, 1))
    g = randn(layout.numel, 7)
    for c in range(3):
        for r in (0, 1):
            assert can_pull(s, layout, r, c)
            push(s, layout, g, rank=r, clock=c)
    assert s.version == 3
    assert s.join(2, layout) == JoinResult(initialized=True, ready=True, joined=3, start_clock=3, version=3)
    assert s.history[-1] == ("join", 2, 3)
    assert clocks(s)[2] == 3
    # From now on iteration 3 waits for the newcomer too.
    assert can_pull(s, layout, 2, 3)
    assert push(s, layout, g, rank=0, clock=3).deferred
    assert push(s, layout, g, rank=1, clock=3).deferred
    assert s.blocking(0, 4) == [2]
    assert push(s, layout, g, rank=2, clock=3).applied
    assert applies(s)[-1] == ("apply", 4, ((0, 3, 0), (1, 3, 0), (2, 3, 0)))


def test_sync_joiner_after_everybody_left_starts_at_the_current_iteration() -> None:
    layout = make_layout("sync", num_workers=2)
    s, _ = make_shard(layout, ranks=(0, 1))
    g = randn(layout.numel, 9)
    for c in range(2):
        for r in (0, 1):
            push(s, layout, g, rank=r, clock=c)
    s.leave(0)
    s.leave(1)
    assert s.version == 2
    # No live clocks at all: the newcomer still starts at iteration 2, not 0.
    assert s.join(5, layout).start_clock == 2
    assert can_pull(s, layout, 5, 2)
    assert push(s, layout, g, rank=5, clock=2).applied  # alone, it completes iteration 2 by itself
    assert s.version == 3


def test_ssp_joiner_starts_at_the_slowest_live_clock() -> None:
    layout = make_layout("ssp", num_workers=2, staleness=3)
    s, _ = make_shard(layout, ranks=(0, 1))
    g = randn(layout.numel, 8)
    for c in range(3):
        push(s, layout, g, rank=0, clock=c)
    for c in range(2):
        push(s, layout, g, rank=1, clock=c)
    assert clocks(s) == {0: 3, 1: 2}
    result = s.join(2, layout)
    assert result == JoinResult(initialized=True, ready=True, joined=3, start_clock=2, version=5)
    assert s.history[-1] == ("join", 2, 2)
    assert clocks(s) == {0: 3, 1: 2, 2: 2}


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_start_barrier_until_num_workers_joined(mode: str) -> None:
    layout = make_layout(mode, num_workers=2)
    s, _ = make_shard(layout)  # only the chief is registered
    assert s.join(0, layout) == JoinResult(initialized=True, ready=False, joined=1, start_clock=0, version=0)
    assert s.join(0, layout, wait_s=0).ready is False
    assert s.join(0, layout).ranks == (0,)  # who joined: the waiting worker names the missing rank 1
    assert s.status().missing_at_start == (1,)
    assert s.join(1, layout) == JoinResult(initialized=True, ready=True, joined=2, start_clock=0, version=0)
    assert s.join(0, layout).ready is True and s.join(0, layout).ranks == (0, 1)
    assert s.status().missing_at_start == ()


def test_async_has_no_start_barrier() -> None:
    layout = make_layout("async", num_workers=2)
    s, _ = make_shard(layout)
    assert s.join(0, layout) == JoinResult(initialized=True, ready=True, joined=1, start_clock=0, version=0)
    assert s.status().missing_at_start == ()  # nothing waits for rank 1


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_join_waits_for_the_other_workers(mode: str) -> None:
    layout = make_layout(mode, num_workers=2)
    armed = False
    waiter_calls = 0
    waiting = threading.Event()
    main = threading.get_ident()

    def now() -> float:
        nonlocal waiter_calls
        if armed and threading.get_ident() == main:
            waiter_calls += 1
            if waiter_calls >= 2:  # the waiter holds the shard lock by its second clock read
                waiting.set()
        return time.monotonic()

    s = Shard(ServerConfig(), now=now)
    s.initialize(0, layout, randn(layout.numel, 0))
    outcome: list[object] = []

    def other() -> None:
        try:
            assert waiting.wait(timeout=20)
            outcome.append(s.join(1, layout))
        except BaseException as exc:  # pragma: no cover - reported below
            outcome.append(exc)

    thread = threading.Thread(target=other, daemon=True)
    thread.start()
    armed = True  # count only the clock reads of the join below
    result = s.join(0, layout, wait_s=20)
    thread.join(timeout=20)
    assert not thread.is_alive()
    assert outcome == [JoinResult(initialized=True, ready=True, joined=2, start_clock=0, version=0)]
    assert result == JoinResult(initialized=True, ready=True, joined=2, start_clock=0, version=0)


# ----------------------------------------------------------------------------- push decisions
@pytest.mark.parametrize("policy", [AsyncPolicy(), SSPPolicy(2)], ids=lambda p: p.name)
def test_modes_that_apply_on_arrival_apply_any_clock_and_never_complete_a_round(policy: ConsistencyPolicy) -> None:
    view = ClockView(5, {0: 1, 1: 9})
    assert policy.decide_push(0, 1, view) is PushDecision.APPLY
    assert policy.decide_push(1, 9, view) is PushDecision.APPLY
    assert not policy.aggregates and not policy.iteration_complete(5, view, pushed=2)


def test_sync_buffers_the_current_iteration_and_refuses_any_other() -> None:
    view = ClockView(3, {0: 3, 1: 4})
    assert SyncPolicy().decide_push(0, 3, view) is PushDecision.BUFFER
    for clock in (2, 4):
        with pytest.raises(InvalidRequestError, match=f"iteration {clock}, but shard is at iteration 3"):
            SyncPolicy().decide_push(0, clock, view)
    assert SyncPolicy().aggregates
