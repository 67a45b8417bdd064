"""Rows fetched ahead of the forward that reads them: `opt.prefetch(...)` (every table of a batch in one
call per shard, whether its tables are one module or many) and a step's exchange that brings the next
batch's rows back with the fresh weights (`opt.step(prefetch=...)`, `opt.pipeline(...)`). A RowSource
in front of the worker's other one: a training forward that asks a table for exactly the ids that
were fetched for it gets those rows (once); any other read goes through. A table several forwards
read (one module registered under several names, as a two-tower model shares its item table, or a
collection's table that a module of its own reads too) is read once, for the union of their ids, and
each forward's ids are held apart, for that forward.

Rows are held for the forwards before the next step only: a step drops the rows fetched before it
that no forward used (they would miss its update: in sync mode that is no longer the job's state)
and holds the ones it read itself, after its update. A prefetch asked for while a step is pending
(a training forward read rows since the last step: the prefetch sits between the forward, or the
backward, and opt.step()) is not read then but carried by that step, as step(prefetch=...) is:
its rows come back with the step's fresh weights. Each held table keeps the versions its rows were
read at, which the forward's leaves keep, and the push of their gradients reports (the staleness
of a table counts from the read its gradient was computed on, not from a later one)."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from psgrad.core.rows import PulledRows
from psgrad.nn.embedding import RowSource


@dataclass
class PrefetchStats:
    """Since the start: served, the tables' reads (one forward's ids of one table) served from rows
    fetched ahead; unused, the rows fetched ahead that no forward used (no forward asked that table
    for exactly those ids before the next step or prefetch replaced them)."""

    served: int = 0
    unused: int = 0


# What a prefetch or a step reads: by table, each forward's unique ids (several where several
# forwards read one table), and the ids read: each table's union of them.
Wanted = Mapping[str, Sequence[torch.Tensor]]


def read_ids(wanted: Wanted) -> dict[str, torch.Tensor]:
    """The ids to read of each table `wanted` names: its forwards' unique ids, together (unique,
    sorted, int64; one forward's as they are)."""
    return {table: ids[0] if len(ids) == 1 else torch.unique(torch.cat(list(ids)), sorted=True)
            for table, ids in wanted.items() if len(ids)}


class Prefetched:
    """A RowSource that serves rows fetched ahead; everything else goes to `source`."""

    def __init__(self, source: RowSource) -> None:
        self._source = source
        # table -> [(one forward's ids, their rows, the versions they were read at)]
        self._held: dict[str, list[tuple[torch.Tensor, torch.Tensor, dict[int, int] | None]]] = {}
        self.stats = PrefetchStats()
        # Whether a training forward read rows since the last step (a step is pending), and the
        # lookups (table -> each forward's unique ids) a prefetch asked for meanwhile, for that step to read.
        self.pending = False
        self.deferred: dict[str, list[torch.Tensor]] = {}

    def hold(self, wanted: Wanted, ids: Mapping[str, torch.Tensor], rows: Mapping[str, torch.Tensor]) -> None:
        """Keep the rows fetched for `wanted` (by table, each forward's ids), which were read as `ids`
        (read_ids(wanted)) into `rows`, for the forwards that read them, with the versions they were
        read at (where `rows` is a PulledRows); rows held before and never read are dropped."""
        self.clear()
        versions = rows.versions if isinstance(rows, PulledRows) else {}
        self._held = {}
        for table, forwards in wanted.items():
            read, got = ids[table], rows[table]
            self._held[table] = [(mine, got if mine is read else got[torch.searchsorted(read, mine)], versions.get(table))
                                 for mine in forwards]

    def defer(self, wanted: Wanted) -> None:
        """A prefetch while a step is pending: the step reads these rows (replacing an earlier
        such prefetch), after its update."""
        self.deferred = {table: list(ids) for table, ids in wanted.items()}

    def stepped(self, wanted: Wanted | None = None, ids: Mapping[str, torch.Tensor] | None = None,
                rows: Mapping[str, torch.Tensor] | None = None) -> None:
        """A step was taken: drop the rows held from before it (and what was deferred to it, which
        it carried), and hold the rows it read (`wanted`, read as `ids` into `rows`), if any."""
        self.clear()
        if wanted:
            assert ids is not None and rows is not None
            self.hold(wanted, ids, rows)
        self.pending, self.deferred = False, {}

    def reset(self) -> None:
        """The clock moved without a step of this worker's (a roll-back, a rejoin): forget every
        row fetched ahead and what was deferred."""
        self.stepped()

    def clear(self) -> None:
        self.stats.unused += sum(int(ids.numel()) for held in self._held.values() for ids, _, _ in held)
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
            held = _take(self._held, table, ids, lambda entry: entry[0])
            if held is not None:  # (rows held for other ids stay, for the forward that asks for them)
                out[table] = held[1]
                if held[2] is not None:
                    out.versions[table] = held[2]
                self.stats.served += 1
            else:
                rest[table] = ids
            _take(self.deferred, table, ids, lambda entry: entry)  # (read now: the step need not read it again)
        if rest:
            got = self._source.pull_tables(rest, observe)
            out.update(got)
            if isinstance(got, PulledRows):
                out.versions.update(got.versions)
        return out


T = TypeVar("T")


def _take(by_table: dict[str, list[T]], table: str, ids: torch.Tensor, key: Callable[[T], torch.Tensor]) -> T | None:
    """Remove and return the first entry of `table` in `by_table` whose key is exactly `ids`; None
    where there is none."""
    entries = by_table.get(table, [])
    for k, entry in enumerate(entries):
        if _same(key(entry), ids):
            del entries[k]
            if not entries:
                del by_table[table]
            return entry
    return None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.shape == b.shape and torch.equal(a, b))
