"""Row-wise optimizers for sparse (embedding) tables: each update touches only the rows a batch used,
and their state is kept per row — SGD (none), Adagrad (a sum of squares per element of the row, the
usual choice for embeddings) and "lazy" Adam (both moments and a step count per row, so that a row
untouched for a while is not decayed by steps it took no part in). Pure torch; the table gathers
the touched rows, calls apply on them, and scatters them back."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from psgrad.errors import ConfigError

RowState = dict[str, torch.Tensor]


class RowOptimizer(ABC):
    """An update rule over gathered rows: weights [n, dim], their gradients [n, dim] (coalesced:
    one per row id) and their state (each tensor [n, ...], gathered the same way)."""

    name: str = ""
    lr: float = 0.0

    @abstractmethod
    def new_state(self, rows: int, dim: int) -> RowState:
        """The state of `rows` fresh rows (what a row starts with when first touched)."""

    @abstractmethod
    def apply(self, weights: torch.Tensor, grads: torch.Tensor, state: RowState, lr: float | None = None) -> None:
        """Update weights (and state) in place; lr: the learning rate in effect (None: the job's)."""

    def step_lr(self, lr: float | None) -> float:
        return self.lr if lr is None else lr


class RowSGD(RowOptimizer):
    """w -= lr * g on the touched rows."""

    name = "sgd"

    def __init__(self, lr: float) -> None:
        self.lr = lr

    def new_state(self, rows: int, dim: int) -> RowState:
        return {}

    def apply(self, weights: torch.Tensor, grads: torch.Tensor, state: RowState, lr: float | None = None) -> None:
        weights.add_(grads, alpha=-self.step_lr(lr))


class RowAdagrad(RowOptimizer):
    """Adagrad on the touched rows, like torch.optim.Adagrad without lr decay: sum += g*g, then
    w -= lr * g / (sqrt(sum) + eps). A row nobody touches keeps its sum, exactly as a dense Adagrad
    step with a zero gradient would (which is why the two agree bit for bit)."""

    name = "adagrad"

    def __init__(self, lr: float, initial_accumulator_value: float = 0.0, eps: float = 1e-10) -> None:
        self.lr = lr
        self.initial = initial_accumulator_value
        self.eps = eps

    def new_state(self, rows: int, dim: int) -> RowState:
        return {"sum": torch.full((rows, dim), float(self.initial))}

    def apply(self, weights: torch.Tensor, grads: torch.Tensor, state: RowState, lr: float | None = None) -> None:
        acc = state["sum"]
        acc.addcmul_(grads, grads, value=1)
        std = acc.sqrt().add_(self.eps)
        weights.addcdiv_(grads, std, value=-self.step_lr(lr))


class RowAdam(RowOptimizer):
    """Lazy Adam: only the touched rows' moments move, and each row's bias correction uses its own
    step count (how many updates it took part in)."""

    name = "adam"

    def __init__(self, lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8) -> None:
        self.lr = lr
        self.beta1, self.beta2, self.eps = beta1, beta2, eps

    def new_state(self, rows: int, dim: int) -> RowState:
        return {"exp_avg": torch.zeros(rows, dim), "exp_avg_sq": torch.zeros(rows, dim), "step": torch.zeros(rows, 1)}

    def apply(self, weights: torch.Tensor, grads: torch.Tensor, state: RowState, lr: float | None = None) -> None:
        m, v, step = state["exp_avg"], state["exp_avg_sq"], state["step"]
        step.add_(1)
        m.mul_(self.beta1).add_(grads, alpha=1 - self.beta1)
        v.mul_(self.beta2).addcmul_(grads, grads, value=1 - self.beta2)
        correction1 = 1 - torch.pow(self.beta1, step)
        correction2 = 1 - torch.pow(self.beta2, step)
        denom = (v / correction2).sqrt_().add_(self.eps)
        weights.addcdiv_(m / correction1, denom, value=-self.step_lr(lr))


# Name -> factory(lr, settings of the job spec it reads, by attribute).
ROW_OPTIMIZERS: dict[str, Callable[..., RowOptimizer]] = {
    "sgd": lambda spec: RowSGD(spec.lr),
    "adagrad": lambda spec: RowAdagrad(spec.lr, spec.initial_accumulator_value, spec.eps),
    "adam": lambda spec: RowAdam(spec.lr, spec.beta1, spec.beta2, spec.eps),
}


def make_row_optimizer(name: str, spec: object) -> RowOptimizer:
    """The row-wise optimizer `name` with the job spec's settings (lr, eps, betas, ...).

    Raises:
        ConfigError: no row-wise form of that optimizer (the message lists those there are).
    """
    try:
        factory = ROW_OPTIMIZERS[name]
    except KeyError:
        raise ConfigError(
            f"optimizer {name!r} has no row-wise form for sparse tables; valid: {', '.join(ROW_OPTIMIZERS)}"
        ) from None
    optimizer = factory(spec)
    optimizer.name = name
    return optimizer
