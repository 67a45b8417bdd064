"""The shard's state as one object: snapshot() copies it, restore() serves it again, exactly."""
from __future__ import annotations

import pytest
import torch

from psgrad.config import JobSpec, ServerConfig
from psgrad.errors import JobMismatchError, NotInitializedError
from psgrad.server.shard import Layout, Shard
from test_shard import make_layout, push, weights_for

pytestmark = pytest.mark.timeout(60)

SPECS = {
    "sgd": JobSpec(lr=0.5, num_shards=2, num_workers=2),
    "momentum": JobSpec(lr=0.1, momentum=0.9, weight_decay=0.01, num_shards=2, num_workers=2),
    "adam": JobSpec(optimizer="adam", lr=0.01, num_shards=2, num_workers=2),
    "ssp-adamw": JobSpec(mode="ssp", staleness=1, optimizer="adamw", lr=0.01, weight_decay=0.1, num_shards=2, num_workers=2),
    "adagrad": JobSpec(optimizer="adagrad", lr=0.1, lr_decay=0.01, num_shards=2, num_workers=2),
    "rmsprop": JobSpec(optimizer="rmsprop", lr=0.01, momentum=0.5, centered=True, num_shards=2, num_workers=2),
    "ssp-adadelta": JobSpec(mode="ssp", staleness=1, optimizer="adadelta", lr=1.0, num_shards=2, num_workers=2),
}


def grad(layout: Layout, seed: int) -> torch.Tensor:
    return torch.randn(layout.numel, generator=torch.Generator().manual_seed(100 + seed))


def started(spec: JobSpec) -> tuple[Shard, Layout]:
    layout = make_layout(spec)
    s = Shard(ServerConfig())
    s.initialize(0, layout, weights_for(layout))
    s.join(1, layout)
    return s, layout


@pytest.mark.parametrize("name", SPECS)
def test_a_restored_shard_continues_bit_for_bit_like_the_original(name: str) -> None:
    original, layout = started(SPECS[name])
    for clock in range(3):
        for rank in (0, 1):
            assert push(original, layout, grad(layout, 2 * clock + rank), rank=rank, clock=clock).applied
    snap = original.snapshot()
    restored = Shard(ServerConfig())
    restored.restore(snap)
    assert restored.version == original.version == 6
    assert torch.equal(restored.weights_copy(), original.weights_copy())
    # the optimizer state came along: the same next gradients give the same weights, bit for bit
    for shard in (original, restored):
        for rank in (0, 1):
            assert push(shard, layout, grad(layout, 50 + rank), rank=rank, clock=3).applied
    assert torch.equal(restored.weights_copy(), original.weights_copy())
    # and so did the per-rank last-applied clock: a retried old push is a duplicate, never applied
    again = push(restored, layout, grad(layout, 0), rank=0, clock=2)
    assert not again.applied and "duplicate" in again.reason
    assert restored.status().pushes_duplicate == 1
    assert {w.rank: w.clock for w in restored.status().workers} == {0: 4, 1: 4}


def test_a_snapshot_shares_no_memory_with_the_shard() -> None:
    s, layout = started(SPECS["momentum"])
    push(s, layout, grad(layout, 0))
    snap = s.snapshot()
    weights, buf = snap.weights.clone(), snap.optimizer["momentum_buffer"]
    assert isinstance(buf, torch.Tensor)
    buf = buf.clone()
    push(s, layout, grad(layout, 1), clock=1)
    assert torch.equal(snap.weights, weights) and torch.equal(snap.optimizer["momentum_buffer"], buf)  # type: ignore[arg-type]
    assert snap.version == 1 and s.version == 2


def test_a_sync_snapshot_is_taken_at_the_start_of_the_iteration() -> None:
    """A gradient the iteration still buffers is not part of the state: its worker owes it again
    after a restore, and the iteration then completes exactly as it would have."""
    spec = JobSpec(mode="sync", lr=0.5, num_shards=2, num_workers=2)
    original, layout = started(spec)
    for rank in (0, 1):
        push(original, layout, grad(layout, rank), rank=rank, clock=0)
    assert original.version == 1
    assert push(original, layout, grad(layout, 10), rank=0, clock=1).deferred
    snap = original.snapshot()
    assert {m.rank: (m.clock, m.last_push_clock) for m in snap.members} == {0: (1, 0), 1: (1, 0)}
    restored = Shard(ServerConfig())
    restored.restore(snap)
    assert restored.status().pending == 0
    for shard in (original, restored):
        if shard is restored:
            assert push(shard, layout, grad(layout, 10), rank=0, clock=1).deferred
        assert push(shard, layout, grad(layout, 11), rank=1, clock=1).applied
    assert restored.version == original.version == 2
    assert torch.equal(restored.weights_copy(), original.weights_copy())


def test_snapshot_needs_a_job_and_restore_a_fresh_shard() -> None:
    with pytest.raises(NotInitializedError, match="rank 0"):
        Shard(ServerConfig()).snapshot()
    s, _ = started(SPECS["sgd"])
    with pytest.raises(JobMismatchError, match="fresh shard"):
        s.restore(s.snapshot())


def test_the_chiefs_lr_is_the_jobs_for_pushes_without_one_and_survives_a_snapshot() -> None:
    """async: pushes that carry no lr (workers other than the chief) are applied with the job's,
    which the chief's pushes set, versioned by its clock (a retried older push never turns it
    back); a snapshot (checkpoint, standby) keeps it."""
    spec = JobSpec(mode="async", lr=0.5, num_shards=2, num_workers=2)
    shard, layout = started(spec)
    w0 = shard.weights_copy()
    g = grad(layout, 1)
    assert push(shard, layout, g, rank=1, clock=0).lr == 0.5  # nothing set yet: the spec's
    torch.testing.assert_close(shard.weights_copy(), w0 - 0.5 * g, rtol=0, atol=0)
    assert push(shard, layout, grad(layout, 2), rank=0, clock=0, lr=0.5).lr == 0.5
    assert push(shard, layout, grad(layout, 3), rank=0, clock=1, lr=0.05).lr == 0.05
    before = shard.weights_copy()
    assert push(shard, layout, g, rank=1, clock=1).lr == 0.05  # follows the chief's schedule
    torch.testing.assert_close(shard.weights_copy(), before - 0.05 * g)
    # a retried push of an older clock is a duplicate and leaves the job's lr as it is
    assert not push(shard, layout, grad(layout, 2), rank=0, clock=0, lr=0.5).applied
    assert push(shard, layout, g, rank=1, clock=2).lr == 0.05
    # a worker other than the chief that sends its own lr gets it, without changing the job's
    assert push(shard, layout, g, rank=1, clock=3, lr=0.2).lr == 0.2
    status = shard.status()
    assert (status.job_lr, status.job_lr_clock) == (0.05, 1)
    restored = Shard(ServerConfig())
    restored.restore(shard.snapshot())
    assert (restored.status().job_lr, restored.status().job_lr_clock) == (0.05, 1)
    assert push(restored, layout, g, rank=1, clock=4).lr == 0.05


def test_the_state_is_made_of_tables_and_status_lists_them() -> None:
    """A shard holds named tables: the dense one is its range of the flat space, with its optimizer's
    state; a snapshot copies each table, and a snapshot whose tables differ is refused on restore."""
    import dataclasses

    from psgrad.errors import InvalidRequestError
    from psgrad.server.tables import DENSE, TableSnapshot

    s, layout = started(JobSpec(optimizer="adam", lr=0.01, num_shards=2, num_workers=2))
    push(s, layout, grad(layout, 1), rank=0, clock=0)
    (table,) = s.status().tables
    assert (table.name, table.kind, table.numel, table.nbytes) == (DENSE, "dense", layout.numel, 4 * layout.numel)
    assert table.state_bytes >= 2 * 4 * layout.numel  # Adam's two moments (and its scratch block)
    snap = s.snapshot()
    assert set(snap.tables) == {DENSE} and snap.tables[DENSE].kind == "dense"
    assert torch.equal(snap.weights, s.weights_copy())
    odd = dataclasses.replace(snap, tables={**snap.tables, "extra": TableSnapshot("rows", {})})
    with pytest.raises(InvalidRequestError, match="table .extra. is of kind .rows., which this psgrad does not know"):
        Shard(ServerConfig()).restore(odd)
