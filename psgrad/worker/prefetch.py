"""Rows fetched ahead of the forward that reads them: `opt.prefetch(...)` (every table of a batch in one
call per shard, whether its tables are one module or many) and a step's exchange that brings the next
batch's rows back with the fresh weights (`opt.step(prefetch=...)`, `opt.pipeline(...)`). A RowSource
in front of the worker's other one: a training forward that asks a table for exactly the ids that
were fetched for it gets those rows (once); any other read goes through.

Rows are held for the forwards before the next step only: a step drops the rows fetched before it
that no forward used (they would miss its update: in sync mode that is no longer the job's state)
and holds the ones it read itself, after its update. A prefetch asked for while a step is pending
(a training forward read rows since the last step: the prefetch sits between the forward, or the
backward, and opt.step()) is not read then but carried by that step, as step(prefetch=...) is:
its rows come back with the step's fresh weights. Each held table keeps the versions its rows were
read at, which the forward's leaves keep, and the push of their gradients reports (the staleness
of a table counts from the read its gradient was computed on, not from a later one)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from psgrad.core.rows import PulledRows
from psgrad.nn.embedding import RowSource


@dataclass
class PrefetchStats:
    """Since the start: served, the tables' reads (one forward's ids of one table) served from rows
    fetched ahead; unused, the rows fetched ahead that no forward used (a forward asked that table
    for other ids, or none asked before the next step or prefetch replaced them)."""

    served: int = 0
    unused: int = 0


class Prefetched:
    """A RowSource that serves rows fetched ahead; everything else goes to `source`."""

    def __init__(self, source: RowSource) -> None:
        self._source = source
        self._held: dict[str, tuple[torch.Tensor, torch.Tensor, dict[int, int] | None]] = {}  # table -> (ids, rows, versions)
        self.stats = PrefetchStats()
        # Whether a training forward read rows since the last step (a step is pending), and the
        # lookups (table -> unique ids) a prefetch asked for meanwhile, for that step to read.
        self.pending = False
        self.deferred: dict[str, torch.Tensor] = {}

    def hold(self, ids: Mapping[str, torch.Tensor], rows: Mapping[str, torch.Tensor]) -> None:
        """Keep the rows fetched for `ids` (by table) for the forward that reads them, with the
        versions they were read at (where `rows` is a PulledRows); rows held before and never read
        are dropped."""
        self.clear()
        versions = rows.versions if isinstance(rows, PulledRows) else {}
        self._held = {table: (ids[table], rows[table], versions.get(table)) for table in ids}

    def defer(self, ids: Mapping[str, torch.Tensor]) -> None:
        """A prefetch while a step is pending: the step reads these rows (replacing an earlier
        such prefetch), after its update."""
        self.deferred = dict(ids)

    def stepped(self, ids: Mapping[str, torch.Tensor] | None = None, rows: Mapping[str, torch.Tensor] | None = None) -> None:
        """A step was taken: drop the rows held from before it (and what was deferred to it, which
        it carried), and hold the rows it read (`ids`, `rows`), if any."""
        self.clear()
        if ids:
            assert rows is not None
            self.hold(ids, rows)
        self.pending, self.deferred = False, {}

    def reset(self) -> None:
        """The clock moved without a step of this worker's (a roll-back, a rejoin): forget every
        row fetched ahead and what was deferred."""
        self.stepped()

    def clear(self) -> None:
        self.stats.unused += sum(int(ids.numel()) for ids, _, _ in self._held.values())
        self._held = {}

    def updated_rows(self, table: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The servers' rows of `table` updated at least once (read past what is held)."""
        return self._source.updated_rows(table)

    def pull_tables(self, lookups: Mapping[str, torch.Tensor], observe: bool) -> PulledRows:
        if observe:
            got = self._source.pull_tables(lookups, observe)
            return got if isinstance(got, PulledRows) else PulledRows(got)
        self.pending = True
        out = PulledRows()
        rest: dict[str, torch.Tensor] = {}
        for table, ids in lookups.items():
            held = self._held.pop(table, None)
            if held is not None and _same(held[0], ids):
                out[table] = held[1]
                if held[2] is not None:
                    out.versions[table] = held[2]
                self.stats.served += 1
            else:
                if held is not None:
                    self.stats.unused += int(held[0].numel())
                rest[table] = ids
            deferred = self.deferred.get(table)
            if deferred is not None and _same(deferred, ids):  # (read now: the step need not read it again)
                del self.deferred[table]
        if rest:
            got = self._source.pull_tables(rest, observe)
            out.update(got)
            if isinstance(got, PulledRows):
                out.versions.update(got.versions)
        return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.shape == b.shape and torch.equal(a, b))
