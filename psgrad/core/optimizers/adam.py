"""Server-side Adam and AdamW like torch.optim's, applied in place block by block so that a push
allocates nothing."""
from __future__ import annotations

import torch

from psgrad.core.optimizers.base import ShardOptimizer, scratch
from psgrad.core.unused import Ranges, StepCounts

# Adam works through the shard in blocks of this many elements so that its denominator needs a
# 4 MiB scratch buffer, not another 4 bytes per parameter. On 2 vCPUs, blocks of 2**20 ran as fast
# as one pass over a 25M range; much smaller blocks pay torch's per-call overhead many times.
ADAM_BLOCK = 1 << 20


class Adam(ShardOptimizer):
    """Adam with bias correction, like torch.optim.Adam (weight_decay is L2, added to the gradient);
    decoupled=True decays the weights directly instead, like torch.optim.AdamW.

    Both moments are allocated once, here; apply() allocates nothing.
    """

    def __init__(
        self,
        numel: int,
        lr: float,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decoupled: bool = False,
        block: int = ADAM_BLOCK,
    ) -> None:
        self.lr = lr
        self.beta1 = beta1
        self.beta2 = beta2
        self.eps = eps
        self.weight_decay = weight_decay
        self.decoupled = decoupled
        self.counts = StepCounts(numel)  # each element's step number (parameters a step skipped lag behind)
        self.exp_avg = torch.zeros(numel)
        self.exp_avg_sq = torch.zeros(numel)
        self._block = block
        self._denom = scratch(numel, block)  # refuses block < 1

    @property
    def steps(self) -> int:
        """The updates applied (the most any element counted, where some were skipped)."""
        return self.counts.most

    def apply(self, weights: torch.Tensor, grad: torch.Tensor, lr_scale: float = 1.0, lr: float | None = None) -> None:
        self.apply_skipping(weights, grad, (), lr_scale, lr)

    def apply_skipping(self, weights: torch.Tensor, grad: torch.Tensor, skip: Ranges, lr_scale: float = 1.0,
                       lr: float | None = None) -> None:
        step_lr = self.step_lr(lr, lr_scale)
        for lo, hi, step in self.counts.advance(skip):
            self._update(weights, grad, lo, hi, step, step_lr)

    def _update(self, weights: torch.Tensor, grad: torch.Tensor, start: int, end: int, step: int, lr: float) -> None:
        """Adam's step number `step` on [start, end)."""
        # Python floats, the same arithmetic as torch.optim.Adam's single-tensor path.
        step_size = lr / (1 - self.beta1**step)
        bias_correction2_sqrt = (1 - self.beta2**step) ** 0.5
        decay = self.weight_decay
        for lo in range(start, end, self._block):
            hi = min(end, lo + self._block)
            w, g = weights[lo:hi], grad[lo:hi]
            m, v = self.exp_avg[lo:hi], self.exp_avg_sq[lo:hi]
            denom = self._denom[: hi - lo]
            if decay and self.decoupled:
                w.mul_(1 - lr * decay)
            elif decay:
                g.add_(w, alpha=decay)
            m.lerp_(g, 1 - self.beta1)
            v.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
            torch.sqrt(v, out=denom)
            denom.div_(bias_correction2_sqrt).add_(self.eps)
            w.addcdiv_(m, denom, value=-step_size)

    def state_bytes(self) -> int:
        """Both moments and the scratch block: (2 * numel + min(numel, block)) float32 values."""
        return sum(t.numel() * t.element_size() for t in (self.exp_avg, self.exp_avg_sq, self._denom))

    def state_dict(self) -> dict[str, torch.Tensor | float | int]:
        return {**self.counts.state(), "exp_avg": self.exp_avg.clone(), "exp_avg_sq": self.exp_avg_sq.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor | float | int]) -> None:
        m, v = state["exp_avg"], state["exp_avg_sq"]
        assert isinstance(m, torch.Tensor) and isinstance(v, torch.Tensor)
        self.counts.load(state)
        self.exp_avg.copy_(m)
        self.exp_avg_sq.copy_(v)
