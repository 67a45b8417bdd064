"""A shard's tables: the unit of parameters a shard holds, each with its own layout, optimizer state
and apply rule. A *dense* table is a contiguous range of the job's flat space (its trainable prefix
takes the optimizer, the synchronized buffers after it take deltas), updated as one vector; other
kinds (a sparse row table) hold their parameters their own way behind the same interface: apply an
update, snapshot and restore, say what they hold. Not thread-safe on their own: the shard core
calls them under its lock."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch

from psgrad.config import JobSpec
from psgrad.core.optimizers import ShardOptimizer, UpdateRule, make_optimizer
from psgrad.core.optimizers.base import axpy_checked
from psgrad.core.status import DelayStatus, TableStatus
from psgrad.errors import InvalidRequestError
from psgrad.server import kernels, transfers  # (they register the axpy paths)
from psgrad.server.delay_comp import DelayCompensation
from psgrad.server.transfers import apply_checked, count_nonfinite

#: The name of the dense table: the job's flat space (every shard of a job holds one).
DENSE = "dense"

Tensors = dict[str, torch.Tensor]
Scalars = dict[str, float | int]


@dataclass(frozen=True)
class TableSnapshot:
    """A table's state as a checkpoint keeps it: its kind, named tensors (copies) and scalars."""

    kind: str
    tensors: Tensors
    scalars: Scalars = field(default_factory=dict)


class Table(Protocol):
    """What the shard core, checkpoints, replication and status need of any table."""

    kind: ClassVar[str]
    optimizer: ShardOptimizer

    def snapshot(self) -> TableSnapshot:
        """A copy of the table's state (its weights and optimizer state)."""

    def load(self, snap: TableSnapshot) -> None:
        """Take the state a snapshot holds (tensors are copied in)."""

    def status(self, name: str) -> TableStatus:
        """What it holds, for `psgrad status` and metrics."""

    def forget_workers(self, live: set[int]) -> None:
        """Drop per-worker state of workers that are no longer live."""


class DenseTable:
    """A contiguous range of the flat space: fp32 master weights, the optimizer on its trainable
    prefix, deltas added as they are to the buffers after it, and (with --dc-asgd) each worker's
    copy of the weights it pulled, against which its gradients are compensated."""

    kind: ClassVar[str] = "dense"

    def __init__(self, spec: JobSpec, weights: torch.Tensor, trainable: int) -> None:
        self.weights = weights
        self.trainable = trainable
        self.num_workers = spec.num_workers
        self.optimizer = make_optimizer(spec, trainable)
        self.dc = DelayCompensation.for_job(spec, trainable)  # DC-ASGD (None: off)
        #: staged updates: the optimizer's out-of-place rule, computed as a push arrives (see configure)
        self.rule: UpdateRule | None = None

    @property
    def numel(self) -> int:
        return self.weights.numel()

    def configure(self, applies_on_arrival: bool, exact_wire: bool, push_buffers: int) -> None:
        """Decide whether pushes are staged: the next weights computed into the receive buffer while
        the gradient arrives. That takes a push applied on arrival (not a sync mean), an exact wire,
        one receive buffer, an optimizer with a piecewise rule (plain SGD), no buffers in the range
        (they take deltas) and no delay compensation (it rewrites the gradient first)."""
        staged = applies_on_arrival and exact_wire and push_buffers == 1
        staged = staged and self.trainable == self.numel and self.dc is None
        self.rule = self.optimizer.piecewise_rule() if staged else None

    def may_borrow(self) -> bool:
        """Whether a push may be applied from the worker's own memory (a same-host segment): an
        update rule that only reads the gradient, on weights without buffers, and no compensation
        (which rewrites the gradient before the apply)."""
        return self.optimizer.reads_grad_only() and self.trainable == self.numel and self.dc is None

    # ----------------------------------------------------------------- updates
    def on_pull(self, rank: int, version: int) -> None:
        """A worker was served the weights of `version` (DC-ASGD keeps its copy of them)."""
        if self.dc is not None:
            self.dc.record(rank, version, self.weights)

    def forget_workers(self, live: set[int]) -> None:
        if self.dc is not None:
            self.dc.keep_only(live)

    def prepare(self, rank: int, base_version: int, grad: torch.Tensor, averaged: bool) -> None:
        """Make one worker's pushed gradient the update to apply (in place): its buffer deltas count
        1/num_workers unless `averaged` (a sync mean already is), and DC-ASGD compensates it for
        the updates since its pull."""
        n = self.trainable
        if not averaged and n < grad.numel() and self.num_workers > 1:
            grad[n:].div_(self.num_workers)
        if self.dc is not None:
            self.dc.compensate(rank, base_version, self.weights, grad)

    def apply(self, grad: torch.Tensor, lr_scale: float = 1.0, lr: float | None = None) -> None:
        """Apply one update (grad is scratch the optimizer may overwrite): the optimizer to the
        trainable prefix, with the learning rate `lr` (None: the job's) times lr_scale; the
        buffers' part of grad, their deltas, is added as it is."""
        n = self.trainable
        if n == self.numel:
            self.optimizer.apply(self.weights, grad, lr_scale, lr)
            return
        if n:
            self.optimizer.apply(self.weights[:n], grad[:n], lr_scale, lr)
        self.weights[n:].add_(grad[n:])

    def apply_checked(self, grad: torch.Tensor, lr_scale: float, lr: float | None, restore: torch.Tensor) -> int:
        """Apply an element-wise update that only reads grad (plain SGD), checking grad as it goes:
        by the registered checked axpy path (one fused pass) where it can, else piece by piece
        (transfers.apply_checked); a non-finite gradient (or an error) restores the weights from
        `restore`, an exact copy of them. Returns the non-finite values (0: applied)."""
        weights, rule = self.weights, self.optimizer
        bad = -1
        try:
            # (a shard of one piece or less gains nothing worth loading numba for)
            alpha = rule.axpy_alpha(lr, lr_scale) if grad.numel() > transfers.PIECE else None
            finite = None if alpha is None else axpy_checked(weights, grad, alpha)
            if finite is None:
                bad = apply_checked(grad, lambda a, b: rule.apply(weights[a:b], grad[a:b], lr_scale, lr))
            else:
                bad = 0 if finite else count_nonfinite(grad)
        finally:
            if bad:  # undone, exactly: the copy holds the weights as they were
                weights.copy_(restore)
        return bad

    # ----------------------------------------------------------------- state
    def snapshot(self) -> TableSnapshot:
        tensors: Tensors = {"weights": self.weights.clone()}
        scalars: Scalars = {}
        for key, value in self.optimizer.state_dict().items():
            if isinstance(value, torch.Tensor):
                tensors["optimizer." + key] = value
            else:
                scalars[key] = value
        return TableSnapshot(self.kind, tensors, scalars)

    def load(self, snap: TableSnapshot) -> None:
        weights = snap.tensors["weights"]
        if weights.dtype != torch.float32 or weights.numel() != self.numel:
            raise InvalidRequestError(f"a dense table of {self.numel} float32 values cannot take {weights.numel()} {weights.dtype}")
        self.weights.copy_(weights)
        state: dict[str, torch.Tensor | float | int] = dict(snap.scalars)
        state.update({k[len("optimizer."):]: v for k, v in snap.tensors.items() if k.startswith("optimizer.")})
        self.optimizer.load_state_dict(state)

    def status(self, name: str) -> TableStatus:
        return TableStatus(name, self.kind, self.numel, self.numel * 4, self.optimizer.state_bytes())

    def delay_status(self) -> DelayStatus:
        return self.dc.status() if self.dc is not None else DelayStatus()

