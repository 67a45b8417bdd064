"""Sync with backup workers (`--backup-workers B`): shard-level tests of the K-of-N rule with a fake
clock (no network, no sleeps) — the first N-B gradients of an iteration make it, late ones are
counted and dropped, late workers continue — and the validation of the job spec and its flags."""
from __future__ import annotations

import pytest
import torch

from psgrad.cli.parser import build_parser
from psgrad.cli.flags import apply_recipe, job_spec
from psgrad.config import JobSpec, ServerConfig
from psgrad.core.backup import LATE_REASON, BackupSyncPolicy
from psgrad.core.codecs import WireBuffer
from psgrad.core.consistency import ClockView, SyncPolicy
from psgrad.core.policies import policy_for
from psgrad.core.sharding import ParamSpec, fingerprint, plan_shards
from psgrad.errors import ConfigError
from psgrad.server.shard import Layout, PushResult, Shard

pytestmark = pytest.mark.timeout(60)

PARAMS = (ParamSpec("w", (6,), "float32"),)
LR = 0.5
LEASE_S = 5.0


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def make_shard(num_workers: int, backup: int) -> tuple[Shard, Layout, FakeClock]:
    spec = JobSpec(mode="sync", num_workers=num_workers, backup_workers=backup, lr=LR)
    start, end = plan_shards(PARAMS, 1).ranges[0]
    layout = Layout(spec, PARAMS, 0, start, end, fingerprint(PARAMS, spec))
    clock = FakeClock()
    shard = Shard(ServerConfig(lease_s=LEASE_S), now=clock)
    shard.initialize(0, layout, torch.zeros(6))
    for r in range(1, num_workers):
        shard.join(r, layout)
    return shard, layout, clock


def grad(seed: int) -> torch.Tensor:
    return torch.randn(6, generator=torch.Generator().manual_seed(seed))


def push(shard: Shard, layout: Layout, g: torch.Tensor, rank: int, clock: int, base: int) -> PushResult:
    buf, wire, writer = shard.push_target(rank, clock, base, g.numel(), "float32", layout.fingerprint)
    writer.write(WireBuffer(g.numel(), "float32").encode(g))
    writer.finish()
    return shard.apply_push(rank, clock, base, buf, wire, wire.nbytes)


def can_pull(shard: Shard, layout: Layout, rank: int, clock: int) -> int | None:
    got = shard.pull_frames(rank, clock, layout.fingerprint, timeout_s=0)
    return None if got is None else got[0]


def applies(shard: Shard) -> list[tuple]:  # type: ignore[type-arg]
    return [e for e in shard.history if e[0] == "apply"]


def test_zero_backup_workers_is_plain_sync() -> None:
    # B=0 is the same job (same spec, same fingerprint) and the same policy object: bit-identical.
    assert JobSpec(mode="sync", num_workers=3, backup_workers=0) == JobSpec(mode="sync", num_workers=3)
    policy = policy_for(JobSpec(mode="sync", num_workers=3))
    assert type(policy) is SyncPolicy and not policy.drops_late
    assert isinstance(policy_for(JobSpec(mode="sync", num_workers=3, backup_workers=1)), BackupSyncPolicy)


def test_quorum_is_n_minus_b_or_every_live_worker_when_fewer_are_live() -> None:
    p = BackupSyncPolicy(2, num_workers=4)
    assert p.quorum(ClockView(0, {0: 0, 1: 0, 2: 0, 3: 0})) == 2
    assert p.quorum(ClockView(0, {0: 0, 1: 0, 2: 0, 3: 0, 4: 0})) == 2  # a joiner beyond N: a spare
    assert p.quorum(ClockView(0, {0: 0, 1: 0, 2: 0})) == 2  # one gone: the backups cover it
    assert p.quorum(ClockView(0, {0: 0})) == 1  # fewer than N - B live: all of them
    assert p.quorum(ClockView(0, {})) == 1
    assert not p.iteration_complete(0, ClockView(0, {0: 0, 1: 0, 2: 0, 3: 0}), 1)
    assert p.iteration_complete(0, ClockView(0, {0: 0, 1: 0, 2: 0, 3: 0}), 2)


def test_first_n_minus_b_gradients_make_the_iteration_and_the_late_one_is_dropped() -> None:
    shard, layout, _ = make_shard(num_workers=3, backup=1)
    g = [grad(10 + r) for r in range(3)]
    for r in range(3):
        assert can_pull(shard, layout, r, 0) == 0
    first = push(shard, layout, g[2], rank=2, clock=0, base=0)
    assert first.deferred and shard.version == 0
    second = push(shard, layout, g[0], rank=0, clock=0, base=0)
    assert second.applied and shard.version == 1
    expected = torch.zeros(6) - LR * ((g[0] + g[2]) * 0.5)  # summed in rank order: 0, then 2
    assert torch.equal(shard.weights_copy(), expected)
    assert applies(shard) == [("apply", 1, ((0, 0, 0), (2, 0, 0)))]

    late = push(shard, layout, g[1], rank=1, clock=0, base=0)  # computed on version 0: late
    assert not late.applied and not late.deferred and late.reason.startswith(LATE_REASON)
    assert torch.equal(shard.weights_copy(), expected)  # never applied, now or later
    assert shard.status().late_dropped == 1
    assert ("late", 1, 0, 0, 1) in shard.history
    assert push(shard, layout, g[1], rank=1, clock=0, base=0).reason.startswith("duplicate")  # a retry

    # The late worker goes on at once with the newest weights; its next gradient counts.
    assert can_pull(shard, layout, 1, 1) == 1
    assert can_pull(shard, layout, 0, 1) == 1
    assert push(shard, layout, g[1], rank=1, clock=1, base=1).deferred
    # A worker that pushed for iteration 1 may not pull it again (one gradient per iteration) ...
    assert can_pull(shard, layout, 1, 2) is None
    assert push(shard, layout, g[0], rank=0, clock=1, base=1).applied
    assert applies(shard)[-1] == ("apply", 2, ((0, 1, 0), (1, 1, 0)))
    # ... and worker 2, two iterations behind, is late once and then back in step.
    assert push(shard, layout, g[2], rank=2, clock=1, base=0).reason.startswith(LATE_REASON)
    assert can_pull(shard, layout, 2, 2) == 2
    st = shard.status()
    assert (st.late_dropped, st.pushes_applied, st.version, st.staleness) == (2, 4, 2, {0: 4})


def test_a_gradient_of_an_old_iteration_is_dropped_however_far_behind() -> None:
    shard, layout, _ = make_shard(num_workers=3, backup=2)  # quorum 1: every push completes an iteration
    for v in range(4):
        assert push(shard, layout, grad(v), rank=0, clock=v, base=v).applied
    w = shard.weights_copy()
    assert push(shard, layout, grad(99), rank=1, clock=0, base=0).reason.startswith(LATE_REASON)
    assert torch.equal(shard.weights_copy(), w) and shard.version == 4
    assert can_pull(shard, layout, 1, 1) == 4  # its next pull gets the newest weights


def test_dead_workers_lower_the_quorum() -> None:
    # An iteration applies min(N - B, L) gradients of L live workers: a dead worker is not waited for.
    shard, layout, clock = make_shard(num_workers=4, backup=1)
    assert push(shard, layout, grad(0), rank=0, clock=0, base=0).deferred
    assert push(shard, layout, grad(1), rank=1, clock=0, base=0).deferred  # quorum 3
    for r in (0, 1):
        shard.touch(r)
    clock.t += LEASE_S - 1
    for r in (0, 1):
        shard.touch(r)
    clock.t += 2  # ranks 2 and 3 missed their lease: evicted, quorum min(4 - 1, 2) = 2
    assert shard.live_ranks() == {0, 1}
    assert shard.version == 1
    assert applies(shard) == [("apply", 1, ((0, 0, 0), (1, 0, 0)))]
    assert push(shard, layout, grad(2), rank=0, clock=1, base=1).deferred  # both survivors now
    assert push(shard, layout, grad(3), rank=1, clock=1, base=1).applied


def test_spec_validation_names_the_problem() -> None:
    with pytest.raises(ConfigError, match="backup_workers must be < num_workers"):
        JobSpec(mode="sync", num_workers=2, backup_workers=2)
    with pytest.raises(ConfigError, match="backup workers apply only to mode 'sync'.*'async'"):
        JobSpec(mode="async", num_workers=3, backup_workers=1)
    with pytest.raises(ConfigError, match="backup_workers must be >= 0"):
        JobSpec(mode="sync", num_workers=3, backup_workers=-1)


def _spec(*argv: str) -> JobSpec:
    ns = build_parser().parse_args(["worker", "--servers", "127.0.0.1:1", *argv])
    apply_recipe(ns)
    return job_spec(ns, ns.num_workers, 1)


def test_backup_workers_flag_round_trips() -> None:
    spec = _spec("--mode", "sync", "--num-workers", "4", "--backup-workers", "1")
    assert spec.backup_workers == 1
    assert _spec(*spec.to_argv()) == spec
    with pytest.raises(ConfigError, match="backup_workers must be < num_workers"):
        _spec("--mode", "sync", "--num-workers", "2", "--backup-workers", "2")
    with pytest.raises(ConfigError, match="only to mode 'sync'"):
        _spec("--mode", "ssp", "--num-workers", "3", "--backup-workers", "1")


def test_python_api_takes_backup_workers_and_the_adaptive_bound() -> None:
    import psgrad

    s = psgrad.connect("127.0.0.1:1,127.0.0.1:2", rank=0, num_workers=4, mode="sync", backup_workers=1)
    assert (s.spec.backup_workers, s.spec.staleness_max) == (1, 0)
    a = psgrad.connect("127.0.0.1:1", num_workers=2, mode="ssp", staleness="auto", staleness_max=5)
    assert (a.spec.staleness, a.spec.staleness_max) == (0, 5)
    with pytest.raises(ConfigError, match="'auto'"):
        psgrad.connect("127.0.0.1:1", num_workers=2, mode="ssp", staleness="soon")
    with pytest.raises(ConfigError, match="backup_workers must be < num_workers"):
        psgrad.connect("127.0.0.1:1", num_workers=2, mode="sync", backup_workers=2)
