"""Parameter groups on a shard: its range cut into segments whose parameters share a group's
settings (an lr multiplier, a weight decay of their own: no decay on biases and norms, a smaller lr
for a pretrained backbone), each updated by an optimizer of its own over its own state. One
segment of the job's settings (no groups) is the plain optimizer, unchanged."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from psgrad.core.job import JobSpec
from psgrad.core.optimizers.base import ShardOptimizer
from psgrad.core.unused import Ranges, clipped


@dataclass(frozen=True)
class Segment:
    """[start, end) of a shard's trainable range (shard-relative) and its group's settings."""

    start: int
    end: int
    lr_scale: float = 1.0
    weight_decay: float | None = None  # None: the job's

    @property
    def default(self) -> bool:
        return self.lr_scale == 1.0 and self.weight_decay is None


def segments_of(params: Sequence[object], start: int, end: int) -> list[Segment]:
    """The segments of the trainable part of [start, end) of the flat space, from the parameter
    specs (in flat order; each has numel, buffer, lr_scale, weight_decay), neighbours with the same
    settings merged."""
    out: list[Segment] = []
    offset = 0
    for p in params:
        numel, buffer = int(getattr(p, "numel")), bool(getattr(p, "buffer"))
        lo, hi = max(offset, start), min(offset + numel, end)
        offset += numel
        if buffer or lo >= hi:
            continue
        scale, decay = float(getattr(p, "lr_scale")), getattr(p, "weight_decay")
        if out and out[-1].end == lo - start and (out[-1].lr_scale, out[-1].weight_decay) == (scale, decay):
            out[-1] = dataclasses.replace(out[-1], end=hi - start)
        else:
            out.append(Segment(lo - start, hi - start, scale, decay))
    return out


class SegmentedOptimizer(ShardOptimizer):
    """Several optimizers, one per segment of the range, stepped as one: each with its segment's
    weight decay, at lr times its segment's multiplier. Its lr is the job's, set on every segment."""

    def __init__(self, segments: Sequence[Segment], optimizers: Sequence[ShardOptimizer]) -> None:
        self.segments = list(segments)
        self.parts = list(optimizers)
        self.name = self.parts[0].name

    @classmethod
    def build(cls, spec: JobSpec, segments: Sequence[Segment]) -> SegmentedOptimizer:
        from psgrad.core.optimizers import make_optimizer  # (the registry imports this module's users)

        parts = []
        for seg in segments:
            own = spec if seg.weight_decay is None else dataclasses.replace(spec, weight_decay=seg.weight_decay)
            parts.append(make_optimizer(own, seg.end - seg.start))
        return cls(segments, parts)

    @property
    def lr(self) -> float:
        return self.parts[0].lr

    @lr.setter
    def lr(self, value: float) -> None:
        for part in self.parts:
            part.lr = value

    def apply(self, weights: torch.Tensor, grad: torch.Tensor, lr_scale: float = 1.0, lr: float | None = None) -> None:
        for seg, part in zip(self.segments, self.parts):
            part.apply(weights[seg.start : seg.end], grad[seg.start : seg.end], lr_scale * seg.lr_scale, lr)

    def apply_skipping(self, weights: torch.Tensor, grad: torch.Tensor, skip: Ranges, lr_scale: float = 1.0,
                       lr: float | None = None) -> None:
        for seg, part in zip(self.segments, self.parts):
            part.apply_skipping(weights[seg.start : seg.end], grad[seg.start : seg.end], clipped(skip, seg.start, seg.end),
                                lr_scale * seg.lr_scale, lr)

    def reads_grad_only(self) -> bool:
        return all(part.reads_grad_only() for part in self.parts)

    def state_bytes(self) -> int:
        return sum(part.state_bytes() for part in self.parts)

    def state_dict(self) -> dict[str, torch.Tensor | float | int]:
        return {f"segment{i}.{k}": v for i, part in enumerate(self.parts) for k, v in part.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor | float | int]) -> None:
        for i, part in enumerate(self.parts):
            prefix = f"segment{i}."
            part.load_state_dict({k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
