"""Sync mode's round: the gradients of the current iteration, buffered until the policy says the
iteration is complete, then averaged in rank order (so the mean does not depend on arrival order)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from psgrad.core.codecs import WireBuffer


@dataclass
class Pending:
    """One worker's buffered gradient of the current iteration."""

    grad: torch.Tensor
    wire: WireBuffer
    clock: int
    base_version: int
    lr: float | None = None  # the learning rate the push carried (None: the job's)
    #: its row gradients of sparse tables (see rows_path.RowGradients): table -> (ids, grads, base version)
    rows: Mapping[str, tuple[torch.Tensor, torch.Tensor, int]] = field(default_factory=dict)
    #: the dense ranges its worker's step left unused (core/unused.py; the iteration skips those no worker used)
    skip: tuple[tuple[int, int], ...] = ()
    #: the sparse tables its worker's step did not use (the iteration skips those no worker used)
    skip_tables: frozenset[str] = frozenset()
    #: what the reserve of its rows gave (rows_path.Slots: their arena ids and slots), which the
    #: iteration's apply uses where it still holds (None: not kept)
    reserved: Mapping[str, torch.Tensor] | None = None


class SyncRound:
    """The gradients buffered (or skipped as non-finite) for the current iteration. The iteration
    is applied from them (items, mean) and only then taken (take): an apply that fails leaves the
    round as it was, for the next attempt (see Pushes.complete_iteration)."""

    def __init__(self) -> None:
        self.pending: dict[int, Pending] = {}
        self.skipped = 0  # pushes of the current iteration skipped as non-finite
        # A mean computed for an apply that failed: the rank whose buffer holds it, the ranks it is
        # the mean of (what a second attempt reuses, or folds later gradients into).
        self._held: tuple[int, frozenset[int]] | None = None

    @property
    def handled(self) -> int:
        """Gradients buffered or skipped for the current iteration."""
        return len(self.pending) + self.skipped

    def add(self, rank: int, item: Pending) -> None:
        self.pending[rank] = item

    def skip(self) -> None:
        self.skipped += 1

    def items(self) -> tuple[list[int], list[Pending]]:
        """The buffered gradients in rank order (the round keeps them: see take)."""
        ranks = sorted(self.pending)
        return ranks, [self.pending[r] for r in ranks]

    def take(self) -> tuple[list[int], list[Pending]]:
        """The buffered gradients in rank order; the round starts over."""
        ranks, items = self.items()
        self.pending.clear()
        self.skipped, self._held = 0, None
        return ranks, items

    def mean(self) -> torch.Tensor:
        """The mean of the buffered gradients, summed in rank order into the lowest rank's buffer
        (which then holds it; the others are only read). Asked again before take() (the apply that
        used it failed, and is tried again), the same tensor: the mean computed then, with the
        gradients buffered since (a worker that joined meanwhile owes the iteration too) folded in."""
        ranks, items = self.items()
        if self._held is None:
            holder, done = ranks[0], frozenset(ranks[:1])
            total = items[0].grad
        else:
            holder, done = self._held
            total = self.pending[holder].grad
            if done == frozenset(ranks):
                return total
            total.mul_(len(done))  # back to their sum (to rounding), then the others added
        for rank, item in zip(ranks, items):
            if rank not in done:
                total.add_(item.grad)
        total.mul_(1.0 / len(items))
        self._held = (holder, frozenset(ranks))
        return total


def rows_mean(ids: torch.Tensor, grads: torch.Tensor, workers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sync round's row gradients by torch's ops (rows_path.round_mean, which the row kernels
    also compute): (the ids once, sorted; each one's rows added in the order given, rank order, as
    the dense mean adds its workers', and divided by `workers`)."""
    unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    total = torch.zeros(unique.numel(), grads.shape[1]).index_add_(0, inverse, grads)
    return unique, total.mul_(1.0 / workers)
