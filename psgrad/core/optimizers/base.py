"""The server optimizer interface: an update rule on one shard's float32 range, its state, and
(for rules that allow it) a fused piecewise form applied while a gradient arrives."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator

import torch

from psgrad.errors import ConfigError

# (weights block, gradient block, out block, step lr): write the updated weights to out, which is
# either the gradient block itself or does not overlap it. The step lr is ShardOptimizer.step_lr's.
UpdateRule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], None]

# Faster ways to compute the update w += alpha * g (plain SGD's, the hottest loop of a shard), bit
# for bit torch's w.add_(g, alpha=alpha): registered by the server, which owns threads and compiled
# kernels (core has neither). "split": fn(w, g, alpha) -> None, over two threads; "checked":
# fn(w, g, alpha) -> bool | None, with g checked for NaN/inf in the same pass (False: not finite,
# the weights updated all the same; None: not available now, nothing done).
AXPY_PATHS: dict[str, Callable[[torch.Tensor, torch.Tensor, float], bool | None]] = {}


def register_axpy_path(name: str, fn: Callable[[torch.Tensor, torch.Tensor, float], bool | None]) -> None:
    """Make fn the "split" or "checked" way of computing w += alpha * g."""
    if name not in ("split", "checked"):
        raise ConfigError(f"unknown axpy path {name!r}; valid: split, checked")
    AXPY_PATHS[name] = fn


def axpy(weights: torch.Tensor, grad: torch.Tensor, alpha: float) -> None:
    """weights += alpha * grad, by the registered split path where there is one."""
    split = AXPY_PATHS.get("split")
    if split is None:
        weights.add_(grad, alpha=alpha)
    else:
        split(weights, grad, alpha)


def axpy_checked(weights: torch.Tensor, grad: torch.Tensor, alpha: float) -> bool | None:
    """weights += alpha * grad with grad checked in the same pass (see AXPY_PATHS); None where no
    checked path is available: nothing was done."""
    checked = AXPY_PATHS.get("checked")
    return None if checked is None else checked(weights, grad, alpha)


# Rules with per-element state work through the shard in blocks of this many elements, so that
# their scratch values need a few MiB, not more bytes per parameter (see adam.py's ADAM_BLOCK).
BLOCK = 1 << 20


def blocks(numel: int, block: int) -> Iterator[tuple[int, int]]:
    """[lo, hi) ranges of at most `block` elements covering [0, numel), in order."""
    for lo in range(0, numel, block):
        yield lo, min(numel, lo + block)


def scratch(numel: int, block: int) -> torch.Tensor:
    """A block of scratch space for a rule applied `block` elements at a time.

    Raises:
        ConfigError: block < 1.
    """
    if block < 1:
        raise ConfigError(f"block must be >= 1, got {block}")
    return torch.empty(min(numel, block))


class ShardOptimizer(ABC):
    """Applies one gradient to a shard's master weights (both float32, same length)."""

    #: The registry name (set by register_optimizer).
    name: str = ""
    #: The job's learning rate: the one in effect when a push carries none.
    lr: float = 0.0

    def step_lr(self, lr: float | None, lr_scale: float) -> float:
        """The learning rate of one update: the one in effect (a worker's schedule sends it with the
        push; None: the job's) times the staleness scale."""
        return (self.lr if lr is None else lr) * lr_scale

    @abstractmethod
    def apply(self, weights: torch.Tensor, grad: torch.Tensor, lr_scale: float = 1.0, lr: float | None = None) -> None:
        """Update weights in place with step_lr(lr, lr_scale). grad is scratch space the optimizer
        may overwrite."""

    @abstractmethod
    def state_bytes(self) -> int:
        """Bytes of optimizer state held (for memory reporting)."""

    def reads_grad_only(self) -> bool:
        """Whether apply() only reads grad (it may then be another process's memory, applied from
        in place). False (the default): grad is scratch the rule may write."""
        return False

    def axpy_alpha(self, lr: float | None, lr_scale: float) -> float | None:
        """The a of an update that is exactly weights.add_(grad, alpha=a), or None (the default):
        element by element, so the shard may split it over two threads, and a fused kernel may
        compute it, checking grad in the same pass."""
        return None

    def piecewise_rule(self) -> UpdateRule | None:
        """The update as an out-of-place rule on blocks, for rules without state whose result for
        an element depends only on that element: the shard then computes the next weights while
        the gradient arrives. None (the default): the rule keeps state, and is applied in place
        once the push is whole. A rule must give bit for bit what apply() gives."""
        return None

    @abstractmethod
    def state_dict(self) -> dict[str, torch.Tensor | float | int]:
        """Everything apply() depends on besides the weights (tensors are copies), for
        checkpoints and standbys."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, torch.Tensor | float | int]) -> None:
        """Restore what state_dict() returned (tensors are copied in)."""
