"""Server-side Adadelta like torch.optim.Adadelta (rho, eps, lr, L2 weight decay), applied in place
block by block so that a push allocates nothing."""
from __future__ import annotations

import torch

from psgrad.core.optimizers.base import BLOCK, ShardOptimizer, blocks, scratch
from psgrad.core.unused import Ranges, StepCounts


class Adadelta(ShardOptimizer):
    """Adadelta: the step is g * sqrt(mean of past squared steps + eps) / sqrt(mean of g^2 + eps),
    times lr (1.0 in the paper and in torch), both means decaying with rho.

    Both means are allocated once, here, with two blocks of scratch.
    """

    def __init__(
        self,
        numel: int,
        lr: float = 1.0,
        rho: float = 0.9,
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        block: int = BLOCK,
    ) -> None:
        self.lr = lr
        self.rho = rho
        self.eps = eps
        self.weight_decay = weight_decay
        self.counts = StepCounts(numel)  # each element's step count (parameters a step skipped lag behind)
        self.square_avg = torch.zeros(numel)
        self.acc_delta = torch.zeros(numel)
        self._block = block
        self._std = scratch(numel, block)
        self._delta = scratch(numel, block)

    @property
    def steps(self) -> int:
        """The updates applied (the most any element counted, where some were skipped)."""
        return self.counts.most

    def apply(self, weights: torch.Tensor, grad: torch.Tensor, lr_scale: float = 1.0, lr: float | None = None) -> None:
        self.apply_skipping(weights, grad, (), lr_scale, lr)

    def apply_skipping(self, weights: torch.Tensor, grad: torch.Tensor, skip: Ranges, lr_scale: float = 1.0,
                       lr: float | None = None) -> None:
        lr = self.step_lr(lr, lr_scale)
        for start, end, _ in self.counts.advance(skip):
            self._update(weights, grad, start, end, lr)

    def _update(self, weights: torch.Tensor, grad: torch.Tensor, start: int, end: int, lr: float) -> None:
        rho, eps = self.rho, self.eps
        for lo, hi in blocks(end - start, self._block):
            lo, hi = lo + start, hi + start
            w, g = weights[lo:hi], grad[lo:hi]
            sq, acc = self.square_avg[lo:hi], self.acc_delta[lo:hi]
            std, delta = self._std[: hi - lo], self._delta[: hi - lo]
            if self.weight_decay:
                g.add_(w, alpha=self.weight_decay)
            sq.mul_(rho).addcmul_(g, g, value=1 - rho)
            torch.add(sq, eps, out=std).sqrt_()
            torch.add(acc, eps, out=delta).sqrt_()
            delta.div_(std).mul_(g)
            acc.mul_(rho).addcmul_(delta, delta, value=1 - rho)
            w.add_(delta, alpha=-lr)

    def state_bytes(self) -> int:
        """Both means and two blocks of scratch, float32."""
        return (2 * self.square_avg.numel() + 2 * self._std.numel()) * 4

    def state_dict(self) -> dict[str, torch.Tensor | float | int]:
        return {**self.counts.state(), "square_avg": self.square_avg.clone(), "acc_delta": self.acc_delta.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor | float | int]) -> None:
        sq, acc = state["square_avg"], state["acc_delta"]
        assert isinstance(sq, torch.Tensor) and isinstance(acc, torch.Tensor)
        self.counts.load(state)
        self.square_avg.copy_(sq)
        self.acc_delta.copy_(acc)
