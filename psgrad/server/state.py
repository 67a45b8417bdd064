"""A shard's state: what a checkpoint saves, a standby holds and a restart restores (the layout,
weights, optimizer state, version, and every worker's clocks), apart from the short-lived
transfer machinery. Not thread-safe on its own: the shard calls it under its lock."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from psgrad.core.layout import Layout
from psgrad.core.optimizers import ShardOptimizer, make_optimizer
from psgrad.errors import InvalidRequestError
from psgrad.server.membership import Member, Membership
from psgrad.server import kernels, transfers
from psgrad.server.transfers import apply_checked, count_nonfinite, on_two_threads

OptimizerState = dict[str, torch.Tensor | float | int]
# Keys of a snapshot's optimizer state that hold the job's lr and the chief's clock that set it.
JOB_LR, JOB_LR_CLOCK = "job_lr", "job_lr_clock"
NOT_INITIALIZED_HINT = (
    "shard is not initialized: start worker rank 0 (the chief) against these servers first; "
    "it sends the job spec and the initial weights"
)
_UIDS = itertools.count(1)


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
    #: The chief's clock whose push set the job's lr (optimizer.lr); -1: still the spec's.
    job_lr_clock: int = -1
    #: Tells this state from any other the process held: (uid, version) names one set of weights.
    uid: int = field(default_factory=lambda: next(_UIDS), compare=False)

    @property
    def key(self) -> tuple[int, int]:
        """(uid, version): the weights as they are now, as a publication of them is labelled."""
        return self.uid, self.version

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
            weights = self.weights
            alpha = self.optimizer.axpy_alpha(lr, lr_scale) if torch.get_num_threads() == 1 else None
            if alpha is None:
                self.optimizer.apply(weights, grad, lr_scale, lr)
            else:  # the optimizer's own add_, element by element: half on the helper thread
                on_two_threads(n, lambda a, b: weights[a:b].add_(grad[a:b], alpha=alpha))
            return
        if n:
            self.optimizer.apply(self.weights[:n], grad[:n], lr_scale, lr)
        self.weights[n:].add_(grad[n:])

    def apply_checked(self, grad: torch.Tensor, lr_scale: float, lr: float | None, restore: torch.Tensor) -> int:
        """Apply an element-wise update that only reads grad (plain SGD), checking grad as it goes:
        in one fused pass (kernels.sgd_checked) where it can, else piece by piece
        (transfers.apply_checked); a non-finite gradient (or an error) restores the weights from
        `restore`, an exact copy of them. Returns the non-finite values (0: applied)."""
        weights, rule = self.weights, self.optimizer
        bad = -1
        try:
            # (a shard of one piece or less gains nothing worth loading numba for)
            alpha = rule.axpy_alpha(lr, lr_scale) if grad.numel() > transfers.PIECE else None
            finite = None if alpha is None else kernels.sgd_checked(weights, grad, alpha)
            if finite is None:
                bad = apply_checked(grad, lambda a, b: rule.apply(weights[a:b], grad[a:b], lr_scale, lr))
            else:
                bad = 0 if finite else count_nonfinite(grad)
        finally:
            if bad:  # undone, exactly: the copy holds the weights as they were
                weights.copy_(restore)
        return bad

    def resolve_lr(self, rank: int, clock: int, lr: float | None) -> float:
        """The learning rate a push is applied with: the one it carries, else the job's. The chief's
        (rank 0's) pushes set the job's lr, which the other workers of an async or ssp job follow
        (their pushes carry none): one schedule for the job, versioned by the chief's clock, so a
        retried or late push of an older clock never turns it back."""
        if lr is None:
            return self.optimizer.lr
        if rank == 0 and clock >= self.job_lr_clock:
            self.optimizer.lr, self.job_lr_clock = lr, clock
        return lr

    def set_job_lr(self, lr: float, clock: int) -> None:
        """Take the job's lr a primary (or a snapshot) says was set at the chief's `clock`."""
        if clock >= self.job_lr_clock:
            self.optimizer.lr, self.job_lr_clock = lr, clock

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
        optimizer = {**self.optimizer.state_dict(), JOB_LR: self.optimizer.lr, JOB_LR_CLOCK: self.job_lr_clock}
        return ShardSnapshot(self.layout, self.weights.clone(), optimizer, self.version, records)

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
        saved = dict(snap.optimizer)
        lr, lr_clock = saved.pop(JOB_LR, None), saved.pop(JOB_LR_CLOCK, None)
        state.optimizer.load_state_dict(saved)
        if lr is not None and lr_clock is not None:  # (checkpoints of older versions have none)
            state.set_job_lr(float(lr), int(lr_clock))
        state.version = snap.version
        state.set_members(snap.members, now)
        return state
