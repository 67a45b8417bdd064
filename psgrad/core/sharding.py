"""The shard plan (contiguous balanced ranges of the flat parameter space) and the job fingerprint; pure."""
from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from psgrad.config import JobSpec
from psgrad.errors import ConfigError


@dataclass(frozen=True)
class ParamSpec:
    """One trainable parameter as it appears in named_parameters() order."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def param_specs(model: torch.nn.Module) -> list[ParamSpec]:
    """The model's trainable parameters, in named_parameters() order."""
    return [
        ParamSpec(name, tuple(int(d) for d in p.shape), str(p.dtype).removeprefix("torch."))
        for name, p in model.named_parameters()
        if p.requires_grad
    ]


@dataclass(frozen=True)
class ShardPlan:
    """S contiguous [start, end) ranges covering the flat space of `total` elements."""

    total: int
    ranges: tuple[tuple[int, int], ...]

    @property
    def num_shards(self) -> int:
        return len(self.ranges)

    def size(self, shard: int) -> int:
        start, end = self.ranges[shard]
        return end - start

    def pieces(self, params: Sequence[ParamSpec], shard: int) -> list[tuple[str, int, int]]:
        """(parameter name, first element, end element) of each parameter slice inside the shard."""
        start, end = self.ranges[shard]
        out = []
        offset = 0
        for p in params:
            lo, hi = max(start, offset), min(end, offset + p.numel)
            if lo < hi:
                out.append((p.name, lo - offset, hi - offset))
            offset += p.numel
        return out


def plan_shards(params: Sequence[ParamSpec], num_shards: int) -> ShardPlan:
    """Split the flat space into num_shards contiguous ranges whose sizes differ by at most one.

    A tensor larger than one shard's share is split across servers; the plan depends only on
    the parameter sizes and num_shards, so every worker computes the same one.

    Raises:
        ConfigError: num_shards < 1, or fewer elements than shards (a shard would be empty).
    """
    if num_shards < 1:
        raise ConfigError(f"num_shards must be >= 1, got {num_shards}")
    total = sum(p.numel for p in params)
    if total < num_shards:
        raise ConfigError(
            f"the model has {total} trainable elements, fewer than {num_shards} shards; use fewer servers"
        )
    bounds = [(i * total) // num_shards for i in range(num_shards + 1)]
    return ShardPlan(total, tuple(zip(bounds[:-1], bounds[1:])))


def fingerprint(params: Sequence[ParamSpec], spec: JobSpec) -> str:
    """A hash of the parameter names, shapes, dtypes and the job spec (which includes S)."""
    doc = {
        "params": [[p.name, list(p.shape), p.dtype] for p in params],
        "spec": spec.as_dict(),
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]
