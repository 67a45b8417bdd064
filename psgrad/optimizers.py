"""Server-side update rules applied in place to one shard's float32 range, chosen by name."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from psgrad.config import JobSpec
from psgrad.errors import ConfigError


class ShardOptimizer(ABC):
    """Applies one gradient to a shard's master weights (both float32, same length)."""

    @abstractmethod
    def apply(self, weights: torch.Tensor, grad: torch.Tensor, lr_scale: float = 1.0) -> None:
        """Update weights in place. grad is scratch space the optimizer may overwrite."""

    @abstractmethod
    def state_bytes(self) -> int:
        """Bytes of optimizer state held (for memory reporting)."""


class SGD(ShardOptimizer):
    """SGD with optional (heavy-ball) momentum and L2 weight decay, like torch.optim.SGD."""

    def __init__(self, numel: int, lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        self.lr = lr
        self.momentum = momentum
        self.weight_decay = weight_decay
        self._buf: torch.Tensor | None = None
        self._numel = numel

    def apply(self, weights: torch.Tensor, grad: torch.Tensor, lr_scale: float = 1.0) -> None:
        if self.weight_decay:
            grad.add_(weights, alpha=self.weight_decay)
        step = grad
        if self.momentum:
            if self._buf is None:  # first step: torch.optim.SGD initializes the buffer to the grad
                self._buf = grad.clone()
            else:
                self._buf.mul_(self.momentum).add_(grad)
            step = self._buf
        weights.add_(step, alpha=-self.lr * lr_scale)

    def state_bytes(self) -> int:
        return 0 if self._buf is None else self._buf.numel() * self._buf.element_size()


OPTIMIZERS: dict[str, Callable[[int, JobSpec], ShardOptimizer]] = {
    "sgd": lambda numel, spec: SGD(numel, spec.lr, spec.momentum, spec.weight_decay),
}


def make_optimizer(spec: JobSpec, numel: int) -> ShardOptimizer:
    """Build the optimizer the job spec names for a shard of numel elements.

    Raises:
        ConfigError: the name is not registered.
    """
    try:
        factory = OPTIMIZERS[spec.optimizer]
    except KeyError:
        raise ConfigError(
            f"unknown optimizer {spec.optimizer!r}; valid: {', '.join(sorted(OPTIMIZERS))}"
        ) from None
    return factory(numel, spec)
