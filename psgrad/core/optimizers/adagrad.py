"""Server-side Adagrad like torch.optim.Adagrad (learning-rate decay, initial accumulator, L2 weight
decay), applied in place block by block so that a push allocates nothing."""
from __future__ import annotations

import torch

from psgrad.core.optimizers.base import BLOCK, ShardOptimizer, blocks, scratch
from psgrad.core.unused import Ranges, StepCounts


def adagrad_lr(step_lr: float, step: int, lr_decay: float) -> float:
    """The lr of Adagrad's step number `step` (1, 2, ...): Python floats, as torch.optim.Adagrad's
    single-tensor path computes it."""
    return step_lr / (1 + (step - 1) * lr_decay)


def adagrad_rule(w: torch.Tensor, g: torch.Tensor, acc: torch.Tensor, std: torch.Tensor, clr: float,
                 weight_decay: float, eps: float) -> None:
    """One Adagrad step on a block, in place (g is scratch; std, scratch of the same shape): the one
    statement of the rule, for a dense range and for a sparse table's gathered rows alike."""
    if weight_decay:
        g.add_(w, alpha=weight_decay)
    acc.addcmul_(g, g, value=1)
    torch.sqrt(acc, out=std).add_(eps)
    w.addcdiv_(g, std, value=-clr)


class Adagrad(ShardOptimizer):
    """Adagrad: each element's step is lr / (1 + (t-1) lr_decay) * g / (sqrt(sum of g^2) + eps).

    The sum of squares starts at initial_accumulator_value and is allocated once, here.
    """

    def __init__(
        self,
        numel: int,
        lr: float,
        lr_decay: float = 0.0,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        eps: float = 1e-10,
        block: int = BLOCK,
    ) -> None:
        self.lr = lr
        self.lr_decay = lr_decay
        self.weight_decay = weight_decay
        self.eps = eps
        self.counts = StepCounts(numel)  # each element's step number (parameters a step skipped lag behind)
        self.sum = torch.full((numel,), float(initial_accumulator_value))
        self._block = block
        self._std = scratch(numel, block)

    @property
    def steps(self) -> int:
        """The updates applied (the most any element counted, where some were skipped)."""
        return self.counts.most

    def apply(self, weights: torch.Tensor, grad: torch.Tensor, lr_scale: float = 1.0, lr: float | None = None) -> None:
        self.apply_skipping(weights, grad, (), lr_scale, lr)

    def apply_skipping(self, weights: torch.Tensor, grad: torch.Tensor, skip: Ranges, lr_scale: float = 1.0,
                       lr: float | None = None) -> None:
        step_lr = self.step_lr(lr, lr_scale)
        for start, end, step in self.counts.advance(skip):
            clr = adagrad_lr(step_lr, step, self.lr_decay)
            for lo, hi in blocks(end - start, self._block):
                lo, hi = lo + start, hi + start
                adagrad_rule(weights[lo:hi], grad[lo:hi], self.sum[lo:hi], self._std[: hi - lo], clr,
                             self.weight_decay, self.eps)

    def state_bytes(self) -> int:
        """The sum of squares and a block of scratch: (numel + min(numel, block)) float32 values."""
        return (self.sum.numel() + self._std.numel()) * 4

    def state_dict(self) -> dict[str, torch.Tensor | float | int]:
        return {**self.counts.state(), "sum": self.sum.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor | float | int]) -> None:
        total = state["sum"]
        assert isinstance(total, torch.Tensor)
        self.counts.load(state)
        self.sum.copy_(total)
