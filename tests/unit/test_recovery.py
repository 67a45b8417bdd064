"""Sync roll-back: a restored shard that is behind the job refuses the workers' next calls with
RollbackError, and rollback() returns a live shard to a checkpointed iteration, rewinding every
member, so that recomputing the same gradients gives the same weights bit for bit."""
from __future__ import annotations

import threading

import pytest
import torch

from psgrad.config import JobSpec, ServerConfig
from psgrad.errors import CheckpointError, InvalidRequestError, RollbackError
from psgrad.server.shard import Layout, Shard
from psgrad.server.state import ShardSnapshot
from test_shard import make_layout, push, weights_for

pytestmark = pytest.mark.timeout(60)

SYNC = JobSpec(mode="sync", lr=0.5, momentum=0.9, num_shards=2, num_workers=2)


class Source:
    """A RollbackSource holding snapshots in memory (the server's is its checkpoint directory)."""

    def __init__(self, *snaps: ShardSnapshot) -> None:
        self.snaps = {s.version: s for s in snaps}
        self.loaded: list[int] = []

    def versions(self) -> list[int]:
        return sorted(self.snaps, reverse=True)

    def load(self, version: int) -> ShardSnapshot | None:
        self.loaded.append(version)
        return self.snaps.get(version)


def grad(layout: Layout, rank: int, clock: int) -> torch.Tensor:
    """The gradient worker `rank` computes at `clock` (the same whenever it is recomputed)."""
    return torch.randn(layout.numel, generator=torch.Generator().manual_seed(1000 * rank + clock))


def started(spec: JobSpec = SYNC) -> tuple[Shard, Layout]:
    layout = make_layout(spec)
    s = Shard(ServerConfig())
    s.initialize(0, layout, weights_for(layout))
    s.join(1, layout)
    return s, layout


def iterate(s: Shard, layout: Layout, clocks: range) -> None:
    for clock in clocks:
        for rank in (0, 1):
            push(s, layout, grad(layout, rank, clock), rank=rank, clock=clock)
    assert s.version == clocks.stop


def test_a_restored_sync_shard_that_is_behind_asks_the_job_to_roll_back() -> None:
    original, layout = started()
    iterate(original, layout, range(2))
    snap = original.snapshot()  # a checkpoint at iteration 2
    iterate(original, layout, range(2, 5))
    restored = Shard(ServerConfig())
    restored.restore(snap)
    # the workers are at iteration 5: their next push, and a pull after a push the shard lost
    with pytest.raises(RollbackError, match="iteration 5, but shard is at iteration 2"):
        push(restored, layout, grad(layout, 0, 5), rank=0, clock=5)
    with pytest.raises(RollbackError, match="without its push of iteration 5"):
        restored.pull_frames(1, 6, layout.fingerprint, timeout_s=0)
    assert restored.status().pushes_rejected == 1 and restored.version == 2
    # pulling the iteration the shard is at is what a worker does after the roll-back: granted
    assert restored.pull_frames(1, 2, layout.fingerprint, timeout_s=0) is not None


def test_a_push_ahead_of_a_shard_never_restored_is_a_bad_request_not_a_roll_back() -> None:
    s, layout = started()
    with pytest.raises(InvalidRequestError, match="pull before pushing"):
        push(s, layout, grad(layout, 0, 3), rank=0, clock=3)


def test_a_joiner_that_pulls_ahead_of_a_restored_shard_is_not_taken_for_a_lost_push() -> None:
    """A worker joining after the restore announces its clock with its first pull (the job's other
    shard may be one iteration further): that is no reason to roll back."""
    original, layout = started()
    iterate(original, layout, range(2))
    restored = Shard(ServerConfig())
    restored.restore(original.snapshot())
    restored.join(2, layout)  # not in the checkpoint
    assert restored.pull_frames(2, 3, layout.fingerprint, timeout_s=0) is None  # waits at the gate, no error


def test_roll_back_returns_to_the_checkpoint_and_the_recomputed_iterations_match_bit_for_bit() -> None:
    s, layout = started()
    iterate(s, layout, range(3))
    at3 = s.snapshot()
    iterate(s, layout, range(3, 6))
    expected = s.weights_copy()
    source = Source(at3)
    s.set_rollback_source(source)
    assert s.rollback_points(0, layout.fingerprint) == (6, [6, 3])
    assert s.rollback(0, layout.fingerprint, 3) == 3
    st = s.status()
    assert st.version == 3 and st.rolled_back == 3 and {w.rank: w.clock for w in st.workers} == {0: 3, 1: 3}
    assert torch.equal(s.weights_copy(), at3.weights)
    assert s.rollback(1, layout.fingerprint, 3) == 3  # the other worker's roll-back changes nothing
    assert source.loaded == [3] and s.status().rolled_back == 3
    iterate(s, layout, range(3, 6))  # momentum state came back too: the same weights, exactly
    assert torch.equal(s.weights_copy(), expected)


def test_roll_back_to_the_current_iteration_keeps_what_it_buffered() -> None:
    s, layout = started()
    iterate(s, layout, range(2))
    assert push(s, layout, grad(layout, 0, 2), rank=0, clock=2).deferred
    s.set_rollback_source(Source())
    assert s.rollback(1, layout.fingerprint, 2) == 2
    assert s.status().pending == 1  # rank 0's gradient of iteration 2 is still there
    push(s, layout, grad(layout, 1, 2), rank=1, clock=2)
    assert s.version == 3


def test_roll_back_drops_the_gradients_the_rolled_back_iteration_buffered() -> None:
    s, layout = started()
    iterate(s, layout, range(2))
    at2 = s.snapshot()
    iterate(s, layout, range(2, 4))
    assert push(s, layout, grad(layout, 0, 4), rank=0, clock=4).deferred
    s.set_rollback_source(Source(at2))
    s.rollback(1, layout.fingerprint, 2)
    st = s.status()
    assert st.pending == 0 and st.transfers.buffers_lent == 0
    # rank 0 pushes iteration 2 again: not a duplicate, it is buffered for the mean
    assert push(s, layout, grad(layout, 0, 2), rank=0, clock=2).deferred


def test_roll_back_refusals_name_the_problem() -> None:
    s, layout = started()
    iterate(s, layout, range(2))
    with pytest.raises(RollbackError, match="at iteration 2, before 5"):
        s.rollback(0, layout.fingerprint, 5)
    with pytest.raises(CheckpointError, match="no readable checkpoint of it"):
        s.rollback(0, layout.fingerprint, 1)  # no source at all
    s.set_rollback_source(Source())
    with pytest.raises(CheckpointError, match="iteration 1"):
        s.rollback(0, layout.fingerprint, 1)
    assert s.version == 2
    a, alayout = started(JobSpec(lr=0.5, num_shards=2, num_workers=2))
    with pytest.raises(InvalidRequestError, match="sync jobs"):
        a.rollback(0, alayout.fingerprint, 0)


def test_a_pull_waiting_at_the_gate_is_woken_by_a_roll_back_and_told_to_roll_back() -> None:
    s, layout = started()
    iterate(s, layout, range(2))
    at2 = s.snapshot()
    iterate(s, layout, range(2, 4))
    s.set_rollback_source(Source(at2))
    push(s, layout, grad(layout, 0, 4), rank=0, clock=4)
    outcome: list[object] = []

    def waiting_pull() -> None:
        try:
            outcome.append(s.pull_frames(0, 5, layout.fingerprint, timeout_s=30))
        except RollbackError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=waiting_pull)
    thread.start()
    assert s.wait_until(lambda st: st.waiting == 1, timeout_s=10)
    s.rollback(1, layout.fingerprint, 2)
    thread.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], RollbackError)


def test_every_worker_joined_is_in_the_first_sync_checkpoint() -> None:
    """Version 0 is offered again once all workers joined, so that a shard restored from it waits
    for every one of them, not just the chief that initialized it."""
    layout = make_layout(SYNC)
    s = Shard(ServerConfig())
    offered: list[ShardSnapshot] = []
    s.snapshot_at_multiples(10, offered.append)
    s.initialize(0, layout, weights_for(layout))
    s.join(1, layout)
    assert [(snap.version, [m.rank for m in snap.members]) for snap in offered] == [(0, [0]), (0, [0, 1])]
