"""The server optimizer interface: an update rule on one shard's float32 range, its state, and (for
rules that allow it) its element-wise form: a block rule applied while a gradient arrives, and for
plain SGD the axpy w += alpha * g, computed by whichever registered backend the caller asks for."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from psgrad.core.unused import Ranges
from psgrad.errors import ConfigError

# (weights block, gradient block, out block, step lr): write the updated weights to out, which is
# either the gradient block itself or does not overlap it. The step lr is ShardOptimizer.step_lr's.
UpdateRule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], None]

# A backend of the axpy rule: fn(w, g, alpha) computes w += alpha * g bit for bit as torch's
# w.add_(g, alpha=alpha) (the tests check each against it). "torch" and "split" return None;
# "checked" also checks g for NaN/inf in the same pass and returns whether it was finite (False:
# the weights were updated all the same), or None where it is not available now: nothing done.
AxpyBackend = Callable[[torch.Tensor, torch.Tensor, float], bool | None]


def torch_axpy(weights: torch.Tensor, grad: torch.Tensor, alpha: float) -> None:
    """The reference backend: torch's own weights.add_(grad, alpha=alpha)."""
    weights.add_(grad, alpha=alpha)


# The axpy rule's backends by name (plain SGD's update, the hottest loop of a shard). core declares
# torch's; the server registers the other two, since it owns threads and compiled kernels (core has
# neither): "split" (torch's add_ over two threads, transfers.py) and "checked" (the fused numba
# kernel, kernels.py).
AXPY_BACKENDS: dict[str, AxpyBackend] = {"torch": torch_axpy}


def register_axpy_backend(name: str, fn: AxpyBackend) -> None:
    """Make fn the "split" or "checked" backend of the axpy rule ("torch" is core's own)."""
    if name not in ("split", "checked"):
        raise ConfigError(f"unknown axpy backend {name!r}; the server registers: split, checked")
    AXPY_BACKENDS[name] = fn


def axpy_backend(name: str) -> AxpyBackend | None:
    """The axpy rule's backend `name` ("torch", "split" or "checked"), or None where it is not
    registered (in a process that has not imported the server)."""
    return AXPY_BACKENDS.get(name)


@dataclass(frozen=True)
class ElementwiseRule:
    """The element-wise form of an update rule without state, whose result for an element depends
    only on that element (ShardOptimizer.elementwise). Both forms give bit for bit what the
    optimizer's apply() gives.

    block: the update as an out-of-place rule on blocks: the shard computes the next weights while
        the gradient arrives (staged pushes).
    axpy: whether the update is exactly weights.add_(grad, alpha=-step_lr) (plain SGD without weight
        decay): then any of its backends (AXPY_BACKENDS) may compute it, split over two threads or
        fused with the gradient's NaN/inf check.
    """

    block: UpdateRule
    axpy: bool = False

    def alpha(self, step_lr: float) -> float | None:
        """The a of the update weights.add_(grad, alpha=a) at this step lr, or None: not an axpy."""
        return -step_lr if self.axpy else None


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

    def apply_skipping(self, weights: torch.Tensor, grad: torch.Tensor, skip: Ranges, lr_scale: float = 1.0,
                       lr: float | None = None) -> None:
        """apply(), leaving the elements in `skip` (the ranges of parameters no worker's backward
        reached: see core/unused.py) exactly as they are: no weight, state or step count of theirs
        changes, as torch.optim skips a parameter whose .grad is None. The built-in rules do so;
        this default (a rule registered without it) applies the whole range, the skipped
        elements with the zero gradient the push carries for them."""
        self.apply(weights, grad, lr_scale, lr)

    @abstractmethod
    def state_bytes(self) -> int:
        """Bytes of optimizer state held (for memory reporting)."""

    def reads_grad_only(self) -> bool:
        """Whether apply() only reads grad (it may then be another process's memory, applied from
        in place). False (the default): grad is scratch the rule may write."""
        return False

    def elementwise(self) -> ElementwiseRule | None:
        """The rule's element-wise form (its block rule, and whether it is an axpy), for rules
        without state whose result for an element depends only on that element. None (the
        default): the rule keeps state, and is applied in place once the push is whole."""
        return None

    @abstractmethod
    def state_dict(self) -> dict[str, torch.Tensor | float | int]:
        """Everything apply() depends on besides the weights (tensors are copies), for
        checkpoints and standbys."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, torch.Tensor | float | int]) -> None:
        """Restore what state_dict() returned (tensors are copied in)."""
