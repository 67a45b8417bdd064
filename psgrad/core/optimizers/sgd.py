"""Server-side SGD: heavy-ball or Nesterov momentum and L2 weight decay like torch.optim.SGD, and
plain SGD's element-wise form (its block rule, and without weight decay the axpy w += -lr * g)."""
from __future__ import annotations

import torch

from psgrad.core.optimizers.base import ElementwiseRule, ShardOptimizer, axpy_backend, torch_axpy
from psgrad.core.unused import Ranges, StepCounts, complement
from psgrad.errors import ConfigError


def sgd_rule(w: torch.Tensor, g: torch.Tensor, out: torch.Tensor, step_lr: float, weight_decay: float,
             tmp: torch.Tensor) -> None:
    """SGD without momentum, element by element: out = w - step_lr * (g + weight_decay * w), the
    decayed gradient formed in tmp (g itself, or out where out does not overlap g). The one statement
    of the rule: every form of the update (in place, staged block by block, the rows of a sparse
    table, and the axpy backends where there is no decay: torch's add_, split over two threads, or
    the fused kernel, each checked bit for bit against torch's add_) computes exactly these torch ops."""
    if weight_decay:
        g = torch.add(g, w, alpha=weight_decay, out=tmp)
    torch.add(w, g, alpha=-step_lr, out=out)


class SGD(ShardOptimizer):
    """SGD with optional momentum (heavy-ball, or Nesterov with nesterov=True) and L2 weight decay,
    like torch.optim.SGD (without dampening)."""

    def __init__(
        self, numel: int, lr: float, momentum: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False
    ) -> None:
        if nesterov and not momentum:
            raise ConfigError("nesterov needs momentum > 0 (like torch.optim.SGD)")
        self.lr = lr
        self.momentum = momentum
        self.weight_decay = weight_decay
        self.nesterov = nesterov
        self._buf: torch.Tensor | None = None
        self._numel = numel
        # With momentum: the updates that used each element (0: its buffer is not started yet, as
        # torch's for a parameter that never had a gradient).
        self.counts = StepCounts(numel)

    def _rule(self, w: torch.Tensor, g: torch.Tensor, out: torch.Tensor, step_lr: float, tmp: torch.Tensor) -> None:
        sgd_rule(w, g, out, step_lr, self.weight_decay, tmp)

    def apply(self, weights: torch.Tensor, grad: torch.Tensor, lr_scale: float = 1.0, lr: float | None = None) -> None:
        form = self.elementwise()
        if form is not None:
            step_lr = self.step_lr(lr, lr_scale)
            alpha = form.alpha(step_lr)
            if alpha is not None:  # w += alpha * g: over two threads where the server registered that backend
                (axpy_backend("split") or torch_axpy)(weights, grad, alpha)
            else:
                self._rule(weights, grad, weights, step_lr, tmp=grad)
            return
        if self.counts.uniform is not None:  # every element alike (no step skipped any): one pass
            first = self._buf is None or self.counts.uniform == 0
            self.counts.advance()
            if self.weight_decay:
                grad.add_(weights, alpha=self.weight_decay)
            if first:  # first step: torch.optim.SGD initializes the buffer to the grad
                self._buf = grad.clone()
            else:
                assert self._buf is not None
                self._buf.mul_(self.momentum).add_(grad)
            # Nesterov: step along grad + momentum * buf (grad is scratch: updated in place).
            step = grad.add_(self._buf, alpha=self.momentum) if self.nesterov else self._buf
            weights.add_(step, alpha=-self.step_lr(lr, lr_scale))
            return
        self.apply_skipping(weights, grad, (), lr_scale, lr)

    def apply_skipping(self, weights: torch.Tensor, grad: torch.Tensor, skip: Ranges, lr_scale: float = 1.0,
                       lr: float | None = None) -> None:
        if not skip and (self.momentum == 0 or self.counts.uniform is not None):
            self.apply(weights, grad, lr_scale, lr)
            return
        if self.momentum == 0:  # element-wise: each used range on its own
            for lo, hi in complement(skip, weights.numel()):
                self.apply(weights[lo:hi], grad[lo:hi], lr_scale, lr)
            return
        if self._buf is None:
            self._buf = torch.zeros(self._numel)
        step_lr = self.step_lr(lr, lr_scale)
        for lo, hi, count in self.counts.advance(skip):
            w, g, buf = weights[lo:hi], grad[lo:hi], self._buf[lo:hi]
            if self.weight_decay:
                g.add_(w, alpha=self.weight_decay)
            if count == 1:  # this parameter's first step: its buffer starts at its grad
                buf.copy_(g)
            else:
                buf.mul_(self.momentum).add_(g)
            step = g.add_(buf, alpha=self.momentum) if self.nesterov else buf
            w.add_(step, alpha=-step_lr)

    def reads_grad_only(self) -> bool:
        return not self.momentum and not self.weight_decay

    def elementwise(self) -> ElementwiseRule | None:
        """Plain SGD (no momentum, with or without weight decay): _rule block by block into the out
        block, so the result is bit for bit apply()'s; an axpy without weight decay."""
        if self.momentum:
            return None

        def block(w: torch.Tensor, g: torch.Tensor, out: torch.Tensor, step_lr: float) -> None:
            self._rule(w, g, out, step_lr, tmp=out)

        return ElementwiseRule(block, axpy=not self.weight_decay)

    def state_bytes(self) -> int:
        return 0 if self._buf is None else self._buf.numel() * self._buf.element_size()

    def state_dict(self) -> dict[str, torch.Tensor | float | int]:
        state: dict[str, torch.Tensor | float | int] = {} if self._buf is None else {"momentum_buffer": self._buf.clone()}
        if self.counts.uniform is None:  # some parameters skipped: which buffers have started (else as of old)
            state["step_runs"] = self.counts.state()["step_runs"]
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor | float | int]) -> None:
        buf = state.get("momentum_buffer")
        self._buf = buf.clone() if isinstance(buf, torch.Tensor) else None
        if "step_runs" in state:
            self.counts.load(state)
        else:  # every element's buffer started with the first update, or none has
            self.counts.load({"step": 0 if self._buf is None else 1})
