"""What a shard reports: the results of join and push calls, its counters and staleness
histogram, and the bounded audit history the consistency tests check."""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

HISTORY_LEN = 100_000


@dataclass
class PushResult:
    applied: bool
    reason: str
    version: int
    staleness: int
    deferred: bool = False
    lr: float | None = None  # the learning rate it is applied with (its own, or the job's)
    bound: int = 0  # ssp with --staleness auto: the bound in effect on the shard (0: a fixed bound)


@dataclass
class JoinResult:
    initialized: bool
    ready: bool
    joined: int
    start_clock: int
    version: int
    # every rank that has joined (whatever became of it since); left out of == so that results
    # compare by what the worker acts on
    ranks: tuple[int, ...] = field(default=(), compare=False)
    #: the version of the shard's frozen table (0: none, or not written yet)
    frozen_version: int = 0
    #: this worker's last push the shard handled (-1: none)
    last_push_clock: int = -1
    #: (table, the name its initial rows are drawn under) where that is not its own (TableSpec.drawn_as)
    drawn_as: tuple[tuple[str, str], ...] = field(default=(), compare=False)


@dataclass
class Counters:
    pushes_applied: int = 0
    pushes_duplicate: int = 0
    pushes_rejected: int = 0
    pulls: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    evictions: int = 0
    updates_lost: int = 0  # applied after the checkpoint a restart restored (counted as workers return)
    rolled_back: int = 0  # sync: iterations undone by roll-backs (recomputed by the workers)
    late_dropped: int = 0  # sync with backup workers: gradients that came after their iteration closed
    pushes_plain: int = 0  # with --compress: pushes that came uncompressed (same-host workers)
    pushes_skipped: int = 0  # steps other shards applied that the worker dropped (a skip): acknowledged, never applied
    staleness: Counter[int] = field(default_factory=Counter)

    def saved(self) -> dict[str, Any]:
        """What a snapshot keeps of them, as JSON: every count, and the staleness histogram by
        staleness (a restart continues them: see restored)."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "staleness"}
        out["staleness"] = {str(k): v for k, v in sorted(self.staleness.items())}
        return out

    @classmethod
    def restored(cls, saved: Mapping[str, Any]) -> Counters:
        """The counters a snapshot kept (saved()); those it has not (a checkpoint of an older psgrad
        kept none) start at 0, and names this psgrad does not count are left out.

        Raises:
            ValueError, TypeError, AttributeError: a value that is not a count.
        """
        counts = {f.name: int(saved[f.name]) for f in fields(cls) if f.name != "staleness" and f.name in saved}
        staleness = Counter({int(k): int(v) for k, v in dict(saved.get("staleness", {})).items()})
        return cls(**counts, staleness=staleness)
