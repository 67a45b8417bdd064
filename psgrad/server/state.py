"""A shard's state: what a checkpoint saves, a standby holds and a restart restores (the layout,
weights, optimizer state, version, and every worker's clocks), apart from the short-lived
transfer machinery. Not thread-safe on its own: the shard calls it under its lock."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from psgrad.core.layout import Layout
from psgrad.core.optimizers import ShardOptimizer, make_optimizer
from psgrad.errors import InvalidRequestError
from psgrad.server.membership import Member, Membership

OptimizerState = dict[str, torch.Tensor | float | int]
NOT_INITIALIZED_HINT = (
    "shard is not initialized: start worker rank 0 (the chief) against these servers first; "
    "it sends the job spec and the initial weights"
)


@dataclass(frozen=True)
class MemberRecord:
    """A worker's clocks as a snapshot keeps them; `last_push_clock` is what makes a retried push
    a no-op after a restore."""

    rank: int
    clock: int
    last_push_clock: int
    pushes: int
    state: str


@dataclass(frozen=True)
class ShardSnapshot:
    """A copy of a shard's state, taken at once under the shard's lock; shares no memory with it."""

    layout: Layout
    weights: torch.Tensor
    optimizer: OptimizerState
    version: int
    members: tuple[MemberRecord, ...]


@dataclass
class ShardState:
    """The state of an initialized shard. `weights` is replaced (not only written) by staged
    updates; `membership` also holds each member's lease, which a snapshot leaves out."""

    layout: Layout
    weights: torch.Tensor
    optimizer: ShardOptimizer
    membership: Membership
    version: int = 0

    @classmethod
    def create(cls, layout: Layout, weights: torch.Tensor, membership: Membership) -> ShardState:
        """A new shard of the job `layout` describes, at version 0 with the chief's weights.

        Raises:
            InvalidRequestError: the weights do not fit the shard's range.
        """
        if weights.dtype != torch.float32 or weights.numel() != layout.numel:
            raise InvalidRequestError(
                f"initial weights of shard {layout.index} must be {layout.numel} float32 values, "
                f"got {weights.numel()} {weights.dtype}"
            )
        return cls(layout, weights, make_optimizer(layout.spec, layout.trainable), membership)

    def apply(self, grad: torch.Tensor, lr_scale: float = 1.0, lr: float | None = None) -> None:
        """Apply one update (grad is scratch the optimizer may overwrite): the optimizer to the
        trainable prefix of the range, with the learning rate in effect `lr` (None: the job's)
        times lr_scale; the buffers' part of grad, which holds their deltas, is added as it is."""
        n = self.layout.trainable
        if n == self.weights.numel():
            self.optimizer.apply(self.weights, grad, lr_scale, lr)
            return
        if n:
            self.optimizer.apply(self.weights[:n], grad[:n], lr_scale, lr)
        self.weights[n:].add_(grad[n:])

    def average_buffer_deltas(self, grad: torch.Tensor) -> None:
        """An update of one worker's push (async, ssp): its buffer deltas count 1/num_workers, so
        that the job's buffers move as much per round of pushes as a sync iteration's mean does."""
        n, workers = self.layout.trainable, self.layout.spec.num_workers
        if n < grad.numel() and workers > 1:
            grad[n:].div_(workers)

    def snapshot(self, pending_ranks: frozenset[int] = frozenset()) -> ShardSnapshot:
        """Copy the state. `pending_ranks` (sync) pushed gradients the current iteration still
        buffers: the snapshot is taken at the iteration's start, where they still owe them."""
        records = self.member_records(pending_ranks)
        return ShardSnapshot(self.layout, self.weights.clone(), self.optimizer.state_dict(), self.version, records)

    def member_records(self, pending_ranks: frozenset[int] = frozenset()) -> tuple[MemberRecord, ...]:
        """Every worker's clocks as a snapshot (or a replicated update) keeps them, by rank."""
        records = []
        for m in sorted(self.membership.members.values(), key=lambda m: m.rank):
            clock, last = m.clock, m.last_push_clock
            if m.rank in pending_ranks:
                clock, last = self.version, self.version - 1
            records.append(MemberRecord(m.rank, clock, last, m.pushes - (m.rank in pending_ranks), m.state))
        return tuple(records)

    def set_members(self, records: tuple[MemberRecord, ...], now: float) -> None:
        """Take the members a replicated update carries (or a backup taking over), with leases
        starting at `now`."""
        self.membership.members = {
            r.rank: Member(r.rank, now, r.clock, r.pushes, r.state, r.last_push_clock) for r in records
        }

    @classmethod
    def restore(cls, snap: ShardSnapshot, membership: Membership, now: float) -> ShardState:
        """The state a snapshot holds, with fresh copies of its tensors; members' leases start at
        `now` (a live worker that does not come back is evicted one lease later)."""
        state = cls.create(snap.layout, snap.weights.clone(), membership)
        state.optimizer.load_state_dict(snap.optimizer)
        state.version = snap.version
        state.set_members(snap.members, now)
        return state
