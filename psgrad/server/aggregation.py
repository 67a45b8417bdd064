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


class SyncRound:
    """The gradients buffered (or skipped as non-finite) for the current iteration."""

    def __init__(self) -> None:
        self.pending: dict[int, Pending] = {}
        self.skipped = 0  # pushes of the current iteration skipped as non-finite

    @property
    def handled(self) -> int:
        """Gradients buffered or skipped for the current iteration."""
        return len(self.pending) + self.skipped

    def add(self, rank: int, item: Pending) -> None:
        self.pending[rank] = item

    def skip(self) -> None:
        self.skipped += 1

    def take(self) -> tuple[list[int], list[Pending]]:
        """The buffered gradients in rank order; the round starts over."""
        ranks = sorted(self.pending)
        items = [self.pending.pop(r) for r in ranks]
        self.skipped = 0
        return ranks, items

    @staticmethod
    def mean(items: list[Pending]) -> torch.Tensor:
        """The mean of the gradients, summed in rank order into the first one's buffer."""
        total = items[0].grad
        for item in items[1:]:
            total.add_(item.grad)
        total.mul_(1.0 / len(items))
        return total


def rows_mean(ids: torch.Tensor, grads: torch.Tensor, workers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A sync round's row gradients by torch's ops (rows_path.round_mean, which the row kernels
    also compute): (the ids once, sorted; each one's rows added in the order given, rank order, as
    the dense mean adds its workers', and divided by `workers`)."""
    unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    total = torch.zeros(unique.numel(), grads.shape[1]).index_add_(0, inverse, grads)
    return unique, total.mul_(1.0 / workers)
