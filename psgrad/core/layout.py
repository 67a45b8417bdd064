"""What a shard was initialized with (job spec, parameters, range, fingerprint), and how to say what differs."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from psgrad.core.job import JobSpec, field_differences
from psgrad.core.optimizer_settings import LR_MAX
from psgrad.core.sharding import ParamSpec, TableSpec, frozen_ranges


@dataclass(frozen=True)
class Layout:
    """What the chief installed: the job, the model's parameters, this shard's range, the fingerprint."""

    spec: JobSpec
    params: tuple[ParamSpec, ...]
    index: int
    start: int
    end: int
    fingerprint: str
    tables: tuple[TableSpec, ...] = ()  # the job's sparse tables (this shard holds its rows of each)
    #: the model's frozen parameters the servers keep (a space of their own: see frozen_ranges)
    frozen: tuple[ParamSpec, ...] = ()

    def table(self, name: str) -> TableSpec | None:
        return next((t for t in self.tables if t.name == name), None)

    @functools.cached_property
    def lr_scale_max(self) -> float:
        """The largest factor a push's lr is applied with here (a parameter group's or table's
        lr_scale; 1: the job's)."""
        return max([1.0, *(p.lr_scale for p in self.params), *(t.lr_scale for t in self.tables)])

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def frozen_range(self) -> tuple[int, int]:
        """This shard's [start, end) of the frozen space (empty without frozen parameters)."""
        if not self.frozen:
            return 0, 0
        return frozen_ranges(self.frozen, self.spec.num_shards)[self.index]

    @property
    def trainable(self) -> int:
        """How many elements of this shard's range are trainable parameters: a prefix of it, since
        buffers follow every parameter in the flat space (the rest take pushed deltas as they are)."""
        params_end = sum(p.numel for p in self.params if not p.buffer)
        return max(0, min(self.end, params_end) - self.start)


def _kept_differently(mine: Layout, theirs: Layout) -> tuple[str, str] | None:
    """(a buffer's name, "synced" or "kept exactly" on this shard) where this shard syncs a buffer
    the other layout keeps exactly, or the other way round (see core/sharding.py, split_buffers)."""
    synced = {p.name for p in mine.params if p.buffer}
    kept = {p.name for p in mine.frozen if p.buffer}
    for p in theirs.frozen:
        if p.buffer and p.name in synced:
            return p.name, "synced"
    for p in theirs.params:
        if p.buffer and p.name in kept:
            return p.name, "kept exactly"
    return None


def _describe(p: ParamSpec) -> str:
    return f"{p.name} {list(p.shape)} {p.dtype}{' (buffer)' if p.buffer else ''}"


def _table(t: TableSpec) -> str:
    rows = t.num_embeddings or "any int64 id (dynamic)"
    return f"{t.name} [{rows}, {t.dim}] (seed {t.seed}, std {t.std:g})"


def explain_mismatch(mine: Layout, theirs: Layout, rank: int) -> str | None:
    """A message naming the first thing that differs between two layouts, or None if equal."""
    who = f"worker rank {rank}"
    diffs = mine.spec.differences(theirs.spec)
    if diffs:
        parts = "; ".join(f"{n}: shard has {a!r}, {who} sent {b!r}" for n, a, b in diffs)
        return f"job spec differs from the one this shard was initialized with ({parts})"
    moved = _kept_differently(mine, theirs)
    if moved is not None:
        name, here = moved
        there = "kept exactly" if here == "synced" else "synced"
        return (f"buffer {name!r} is {here} on this shard and {there} by {who}: a persistent buffer is synced (the "
                "flat space, averaged) where the job's wire dtype holds its every value when ps.optimizer(model) runs, "
                "and kept exactly (the chief's values, never averaged) where it does not (a bool, an int64 id past "
                "2**24, a float64 value float32 rounds): every worker's model must hold the same values of it then")
    if len(mine.params) != len(theirs.params):
        return (
            f"model differs: this shard was initialized with {len(mine.params)} parameters, "
            f"{who} has {len(theirs.params)}"
        )
    for i, (a, b) in enumerate(zip(mine.params, theirs.params)):
        if a != b:
            return f"model differs at parameter {i}: shard has {_describe(a)}, {who} has {_describe(b)}"
    if mine.frozen != theirs.frozen:
        have = ", ".join(_describe(p) for p in mine.frozen) or "none"
        sent = ", ".join(_describe(p) for p in theirs.frozen) or "none"
        return (f"frozen parameters differ: this shard keeps {have}; {who} has {sent} (every worker must freeze the "
                "same parameters and pass the same frozen= to ps.optimizer; a job begun when frozen='local' was the default "
                "keeps its frozen parameters in the workers: pass frozen='local'; the buffers among them are those the "
                "flat space cannot sync exactly, kept there with sync_buffers=True)")
    if mine.tables != theirs.tables:
        if [t.name for t in mine.tables] == [t.name for t in theirs.tables]:  # the same tables: name what differs
            for ta, tb in zip(mine.tables, theirs.tables):
                diffs = field_differences(ta, tb)
                if diffs:
                    parts = "; ".join(f"{n}: shard has {x!r}, {who} has {y!r}" for n, x, y in diffs)
                    return f"sparse table {ta.name!r} differs from the one this shard was initialized with ({parts})"
        have = ", ".join(_table(t) for t in mine.tables) or "none"
        sent = ", ".join(_table(t) for t in theirs.tables) or "none"
        return f"sparse tables differ: this shard was initialized with {have}; {who} has {sent}"
    if (mine.index, mine.start, mine.end) != (theirs.index, theirs.start, theirs.end):
        return (
            f"shard plan differs: this server is shard {mine.index} owning [{mine.start}, {mine.end}), "
            f"{who} expects shard {theirs.index} owning [{theirs.start}, {theirs.end}) "
            "(is --servers in the same order for every worker?)"
        )
    if mine.fingerprint != theirs.fingerprint:
        return f"fingerprint differs: shard has {mine.fingerprint}, {who} sent {theirs.fingerprint}"
    return None


def explain_push_header(
    layout: Layout, rank: int, numel: int, dtype: str, base_version: int, version: int, lr: float | None = None,
    compress: str = "",
) -> str | None:
    """What is wrong with a push header, or None. compress: the payload's codec ("": none)."""
    if lr is not None and not (math.isfinite(lr) and lr >= 0):
        return f"push from worker rank {rank} carries learning rate {lr!r}; it must be a finite number >= 0"
    if lr is not None and lr * layout.lr_scale_max > LR_MAX:
        return (f"push from worker rank {rank} carries learning rate {lr!r}; times the largest lr_scale here "
                f"({layout.lr_scale_max:g}) it must be at most {LR_MAX:.4g} (the servers apply it in float32)")
    if numel != layout.numel:
        return (
            f"push from worker rank {rank} has {numel} elements, but shard {layout.index} owns "
            f"range [{layout.start}, {layout.end}) = {layout.numel} elements"
        )
    if dtype != layout.spec.wire_dtype:
        return f"push from worker rank {rank} is {dtype!r}, the job's wire dtype is {layout.spec.wire_dtype!r}"
    if compress and compress != layout.spec.compress:
        job = layout.spec.compress
        return (f"push from worker rank {rank} is compressed as {compress!r}, but the job's --compress is {job!r}"
                + (" (the job sends plain gradients)" if job == "none" else ""))
    if base_version > version:
        return f"push from worker rank {rank} claims base version {base_version}, newer than shard version {version}"
    return None
