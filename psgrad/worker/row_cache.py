"""A worker's cache of hot embedding rows: rows pulled within the last `staleness` steps are served
from the worker's memory instead of the servers, so a skewed (Zipf) workload pulls its hot rows once
every few steps instead of at every forward. Least recently used rows go first once it holds
`capacity` rows per table. Only for async and ssp jobs: a cached row may miss up to `staleness`
steps of updates (the worker's own included), a staleness sync mode does not allow. Vectorized:
each table's entries are kept sorted by id, looked up with searchsorted."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from psgrad.core.rows import PulledRows, oldest
from psgrad.errors import ConfigError
from psgrad.nn.embedding import RowSource


@dataclass
class CacheStats:
    """Rows served from the cache (hits) and pulled from the servers (misses), since the start."""

    hits: int = 0
    misses: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class _TableCache:
    """One table's cached rows: an arena of `capacity` rows, and an index of the cached ids (sorted,
    with each one's slot) that lookups search; inserting moves only the index, and when the arena
    is full the least recently used quarter goes at once (so eviction's cost is shared by many steps)."""

    def __init__(self, dim: int, capacity: int) -> None:
        self.capacity = capacity
        self.keys = np.empty(0, dtype=np.int64)  # cached ids, sorted
        self.slots = np.empty(0, dtype=np.int64)  # each one's slot in the arena
        self.rows = torch.empty(capacity, dim)
        self.pulled = torch.full((capacity,), -1, dtype=torch.int64)  # the step each slot's row was pulled at
        self.used = torch.full((capacity,), -1, dtype=torch.int64)  # the step it was last served at
        self.free = np.arange(capacity - 1, -1, -1, dtype=np.int64)  # unused slots (a stack)
        self.nfree = capacity
        # step -> the versions (by shard) of the table's pulls at that step: a hit's read versions
        self.read_at: dict[int, dict[int, int]] = {}

    def pulled_at(self, step: int, versions: dict[int, int] | None, staleness: int) -> None:
        """Remember the versions of a pull at `step` (forgetting steps no cached row is fresh from)."""
        self.read_at[step] = oldest(self.read_at.get(step), versions)
        for old in [s for s in self.read_at if s <= step - staleness]:
            del self.read_at[old]

    def hit_versions(self, slots: torch.Tensor) -> dict[int, int]:
        """The versions the cached rows in `slots` were read at, by shard: the oldest of the pulls
        they came from (a shard's may be older than its rows' own: the pull's other rows there)."""
        steps = torch.unique(self.pulled[slots]).tolist()
        return oldest(*(self.read_at.get(int(step)) for step in steps))

    def find(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(whether each id is cached, its slot where it is)."""
        if not self.keys.size:
            return torch.zeros(ids.numel(), dtype=torch.bool), torch.zeros(ids.numel(), dtype=torch.int64)
        wanted = ids.numpy()
        at = np.minimum(np.searchsorted(self.keys, wanted), self.keys.size - 1)
        return torch.from_numpy(self.keys[at] == wanted), torch.from_numpy(self.slots[at])

    def put(self, ids: torch.Tensor, rows: torch.Tensor, step: int) -> None:
        """Cache rows `ids` (unique, sorted, none cached now) pulled at `step`, evicting if need be."""
        n = min(ids.numel(), self.capacity)
        ids, rows = ids[:n], rows[:n]
        if n > self.nfree:
            self._evict(max(n - self.nfree, self.capacity // 4))
        slots = self.free[self.nfree - n:self.nfree].copy()
        self.nfree -= n
        taken = torch.from_numpy(slots)
        self.rows[taken], self.pulled[taken], self.used[taken] = rows, step, step
        new = ids.numpy()
        at = np.searchsorted(self.keys, new)
        self.keys, self.slots = np.insert(self.keys, at, new), np.insert(self.slots, at, slots)

    def _evict(self, count: int) -> None:
        """Free the `count` least recently used slots."""
        count = min(count, self.keys.size)
        last_used = self.used[torch.from_numpy(self.slots)]
        gone = torch.topk(last_used, count, largest=False).indices.numpy()
        self.free[self.nfree:self.nfree + count] = self.slots[gone]
        self.nfree += count
        keep = np.ones(self.keys.size, dtype=bool)
        keep[gone] = False
        self.keys, self.slots = self.keys[keep], self.slots[keep]


class RowCache:
    """A RowSource in front of another (the job's shards) that serves rows pulled within the last
    `staleness` steps of `step()` from memory. Read-only pulls (evaluation) bypass it."""

    def __init__(self, source: RowSource, capacity: int, staleness: int, step: Callable[[], int]) -> None:
        if capacity < 1 or staleness < 1:
            raise ConfigError(f"a row cache needs capacity >= 1 rows and staleness >= 1 steps, got {capacity}, {staleness}")
        self._source, self.capacity, self.staleness, self._step = source, capacity, staleness, step
        self._tables: dict[str, _TableCache] = {}
        self.stats = CacheStats()

    def updated_rows(self, table: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The servers' rows of `table` updated at least once (read past the cache)."""
        return self._source.updated_rows(table)

    def pull_tables(self, lookups: Mapping[str, torch.Tensor], observe: bool, checked: bool = False) -> PulledRows:
        """Each table's rows for its ids: the fresh cached ones from memory, the rest pulled from the
        source, every table's misses in one grouped pull; with the versions they were read at (a
        table's: per shard the oldest of its hits' pulls and this one)."""
        if observe:
            read_only = self._source.pull_tables(lookups, observe, checked)
            return read_only if isinstance(read_only, PulledRows) else PulledRows(read_only)
        step = self._step()
        out = PulledRows()
        plans: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # table -> (found, slot, missing)
        misses: dict[str, torch.Tensor] = {}
        for table, ids in lookups.items():
            cache = self._tables.get(table)
            if cache is None:  # a table met for the first time: all of it pulled
                misses[table] = ids
                continue
            found, slot = cache.find(ids)
            fresh = found.clone()
            fresh[found] = step - cache.pulled[slot[found]] < self.staleness
            out[table] = torch.empty(ids.numel(), cache.rows.shape[1])
            hit = slot[fresh]
            out[table][fresh] = cache.rows[hit]
            cache.used[hit] = step
            if hit.numel():
                out.versions[table] = cache.hit_versions(hit)
            missing = ~fresh
            hits = int(fresh.sum())
            self.stats.hits += hits
            self.stats.misses += ids.numel() - hits
            if hits < ids.numel():
                plans[table] = (found, slot, missing)
                misses[table] = ids[missing]
        pulled = self._source.pull_tables(misses, observe, checked) if misses else {}
        read = pulled.versions if isinstance(pulled, PulledRows) else {}
        for table, got in pulled.items():
            ids = lookups[table]
            out.versions[table] = oldest(out.versions.get(table), read.get(table))
            if table not in self._tables:
                self._tables[table] = _TableCache(got.shape[1], self.capacity)
                self._tables[table].pulled_at(step, read.get(table), self.staleness)
                self._tables[table].put(ids, got, step)
                self.stats.misses += ids.numel()
                out[table] = got
                continue
            cache = self._tables[table]
            cache.pulled_at(step, read.get(table), self.staleness)
            found, slot, missing = plans[table]
            rows = out[table]
            rows[missing] = got
            stale = found & missing  # cached, but too old: refreshed in place
            if bool(stale.any()):
                again = slot[stale]
                cache.rows[again], cache.pulled[again], cache.used[again] = rows[stale], step, step
            new = missing & ~found
            if bool(new.any()):
                cache.put(ids[new], rows[new], step)
        return out
