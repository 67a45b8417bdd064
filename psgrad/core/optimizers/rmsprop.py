"""Server-side RMSprop like torch.optim.RMSprop (smoothing alpha, eps, momentum, centered, L2 weight
decay), applied in place block by block so that a push allocates nothing."""
from __future__ import annotations

import torch

from psgrad.core.optimizers.base import BLOCK, ShardOptimizer, blocks, scratch
from psgrad.core.unused import Ranges, StepCounts


class RMSprop(ShardOptimizer):
    """RMSprop: g / (sqrt(running mean of g^2) + eps), with centered=True the running mean of g
    subtracted under the root first, and optionally a momentum buffer of those steps.

    Its averages (one, two with centered, three with momentum) are allocated once, here.
    """

    def __init__(
        self,
        numel: int,
        lr: float,
        alpha: float = 0.99,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.0,
        centered: bool = False,
        block: int = BLOCK,
    ) -> None:
        self.lr = lr
        self.alpha = alpha
        self.eps = eps
        self.weight_decay = weight_decay
        self.momentum = momentum
        self.centered = centered
        self.counts = StepCounts(numel)  # each element's step count (parameters a step skipped lag behind)
        self.square_avg = torch.zeros(numel)
        self.grad_avg = torch.zeros(numel) if centered else None
        self.momentum_buffer = torch.zeros(numel) if momentum > 0 else None
        self._block = block
        self._avg = scratch(numel, block)

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
        alpha = self.alpha
        for lo, hi in blocks(end - start, self._block):
            lo, hi = lo + start, hi + start
            w, g, sq = weights[lo:hi], grad[lo:hi], self.square_avg[lo:hi]
            avg = self._avg[: hi - lo]
            if self.weight_decay:
                g.add_(w, alpha=self.weight_decay)
            sq.mul_(alpha).addcmul_(g, g, value=1 - alpha)
            if self.grad_avg is not None:
                ga = self.grad_avg[lo:hi]
                ga.lerp_(g, 1 - alpha)
                torch.addcmul(sq, ga, ga, value=-1, out=avg).sqrt_()
            else:
                torch.sqrt(sq, out=avg)
            avg.add_(self.eps)
            if self.momentum_buffer is not None:
                buf = self.momentum_buffer[lo:hi]
                buf.mul_(self.momentum).addcdiv_(g, avg)
                w.add_(buf, alpha=-lr)
            else:
                w.addcdiv_(g, avg, value=-lr)

    def _tensors(self) -> dict[str, torch.Tensor]:
        named = {"square_avg": self.square_avg, "grad_avg": self.grad_avg, "momentum_buffer": self.momentum_buffer}
        return {k: v for k, v in named.items() if v is not None}

    def state_bytes(self) -> int:
        """Its averages and a block of scratch, float32."""
        return (sum(t.numel() for t in self._tensors().values()) + self._avg.numel()) * 4

    def state_dict(self) -> dict[str, torch.Tensor | float | int]:
        state: dict[str, torch.Tensor | float | int] = dict(self.counts.state())
        state.update({k: v.clone() for k, v in self._tensors().items()})
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor | float | int]) -> None:
        self.counts.load(state)
        for key, mine in self._tensors().items():
            theirs = state[key]
            assert isinstance(theirs, torch.Tensor)
            mine.copy_(theirs)
