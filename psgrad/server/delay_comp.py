"""Delay compensation on one shard (DC-ASGD, Zheng et al., ICML 2017): the weights each worker last
pulled, and the compensated gradient g + lambda * g*g*(w_now - w_pulled) the optimizer then applies.
Not thread-safe on its own: the shard calls it under its lock."""
from __future__ import annotations

import torch

from psgrad.config import JobSpec
from psgrad.core.delay import EPS, MEAN_SQUARE_MOMENTUM
from psgrad.core.status import DelayStatus


class DelayCompensation:
    """Per worker, a copy of the trainable weights it was last served (w_bak) and their version;
    with `adaptive`, the running mean square of the gradients this shard received.

    A push is compensated against its worker's copy only when the copy's version is the version the
    gradient was computed on (the push's base version). Otherwise (no copy: the worker never pulled
    from this server, which was restored from a checkpoint or promoted from backup since; or a
    gradient computed on an older pull) it is applied as it came, w_bak = w_now, and counted in
    `uncompensated`. Memory: 4 bytes per trainable element for each worker's copy, plus one scratch
    tensor of that size (two more with `adaptive`: the mean square and a scratch).
    """

    def __init__(self, lam: float, adaptive: bool, trainable: int) -> None:
        self.lam = lam
        self.adaptive = adaptive
        self._n = trainable
        self._copies: dict[int, tuple[int, torch.Tensor]] = {}  # rank -> (version, w_bak)
        self._diff = torch.empty(0)
        self._mean_square = torch.zeros(trainable if adaptive else 0)
        self._rate = torch.empty(0)  # adaptive: lambda_t per element
        self.compensated = 0
        self.uncompensated = 0

    @classmethod
    def for_job(cls, spec: JobSpec, trainable: int) -> DelayCompensation | None:
        """The job's delay compensation for a shard of `trainable` trainable elements (None: off)."""
        return cls(spec.dc_asgd, spec.dc_asgd_adaptive, trainable) if spec.dc_asgd else None

    @property
    def copies(self) -> int:
        """Workers whose copy this shard keeps."""
        return len(self._copies)

    @property
    def nbytes(self) -> int:
        """The memory the copies, the mean square and the scratch tensors take."""
        tensors = [t for _, t in self._copies.values()] + [self._diff, self._mean_square, self._rate]
        return sum(t.numel() * t.element_size() for t in tensors)

    def status(self) -> DelayStatus:
        return DelayStatus(self.copies, self.nbytes, self.compensated, self.uncompensated)

    def record(self, rank: int, version: int, weights: torch.Tensor, replace: bool = False) -> None:
        """`rank` was served `weights` at `version` (a granted pull, or the chief's initial weights;
        replace: what a compressed pull of that version left the worker with, its copy)."""
        held = self._copies.get(rank)
        if held is not None and held[0] == version and not replace:
            return  # the same version holds the same weights
        copy = held[1] if held is not None else torch.empty(self._n)
        copy.copy_(weights[: self._n])
        self._copies[rank] = (version, copy)

    def keep_only(self, live: set[int]) -> None:
        """Drop the copies of workers that left or were evicted (they pull again if they come back)."""
        for rank in [r for r in self._copies if r not in live]:
            del self._copies[rank]

    def compensate(self, rank: int, base_version: int, weights: torch.Tensor, grad: torch.Tensor) -> None:
        """Replace the trainable prefix of `grad` (pushed by `rank`, computed on the weights of
        `base_version`) in place by g + lambda * g*g*(weights - w_bak), where lambda is the constant
        or, adaptive, lambda0 / sqrt(ms + EPS) after ms took in this g."""
        n = self._n
        g = grad[:n]
        if self.adaptive:
            self._mean_square.mul_(MEAN_SQUARE_MOMENTUM).addcmul_(g, g, value=1 - MEAN_SQUARE_MOMENTUM)
        held = self._copies.get(rank)
        if held is None or held[0] != base_version:
            self.uncompensated += 1
            return
        if self._diff.numel() != n:
            self._diff = torch.empty(n)
        diff = torch.sub(weights[:n], held[1], out=self._diff)
        diff.mul_(g).mul_(g)
        if self.adaptive:  # lambda_t = lambda0 * rsqrt(ms + EPS)
            if self._rate.numel() != n:
                self._rate = torch.empty(n)
            diff.mul_(torch.add(self._mean_square, EPS, out=self._rate).rsqrt_())
        g.add_(diff, alpha=self.lam)
        self.compensated += 1
