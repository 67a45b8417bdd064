"""A worker's cache of hot embedding rows: rows pulled within the last `staleness` steps are served
from the worker's memory instead of the servers, so a skewed (Zipf) workload pulls its hot rows once
every few steps instead of at every forward. Least recently used rows go first once it holds
`capacity` rows per table. Only for async and ssp jobs: a cached row may miss up to `staleness`
steps of updates (the worker's own included), a staleness sync mode does not allow. Vectorized:
each table's entries are kept sorted by id, looked up with searchsorted."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

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
    def __init__(self, dim: int) -> None:
        self.ids = torch.empty(0, dtype=torch.int64)  # sorted
        self.rows = torch.empty(0, dim)
        self.pulled = torch.empty(0, dtype=torch.int64)  # the step each row was pulled at
        self.used = torch.empty(0, dtype=torch.int64)  # the step each row was last served at

    def find(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(whether each id is cached, its place)."""
        if not self.ids.numel():
            return torch.zeros(ids.numel(), dtype=torch.bool), torch.zeros(ids.numel(), dtype=torch.int64)
        at = torch.searchsorted(self.ids, ids).clamp_(max=self.ids.numel() - 1)
        return self.ids[at] == ids, at

    def put(self, ids: torch.Tensor, rows: torch.Tensor, step: int, capacity: int) -> None:
        """Add or refresh rows `ids` (pulled at `step`), then keep the `capacity` most recently used."""
        found, at = self.find(ids)
        if bool(found.any()):
            hit = at[found]
            self.rows[hit], self.pulled[hit], self.used[hit] = rows[found], step, step
        new = ~found
        if bool(new.any()):
            n = int(new.sum())
            self.ids = torch.cat([self.ids, ids[new]])
            self.rows = torch.cat([self.rows, rows[new]])
            self.pulled = torch.cat([self.pulled, torch.full((n,), step)])
            self.used = torch.cat([self.used, torch.full((n,), step)])
            if self.ids.numel() > capacity:  # least recently used go
                keep = torch.argsort(self.used, descending=True, stable=True)[:capacity]
                self._take(keep)
            self._take(torch.argsort(self.ids))

    def _take(self, order: torch.Tensor) -> None:
        self.ids, self.rows = self.ids[order], self.rows[order]
        self.pulled, self.used = self.pulled[order], self.used[order]


class RowCache:
    """A RowSource in front of another (the job's shards) that serves rows pulled within the last
    `staleness` steps of `step()` from memory. Read-only pulls (evaluation) bypass it."""

    def __init__(self, source: RowSource, capacity: int, staleness: int, step: Callable[[], int]) -> None:
        if capacity < 1 or staleness < 1:
            raise ConfigError(f"a row cache needs capacity >= 1 rows and staleness >= 1 steps, got {capacity}, {staleness}")
        self._source, self.capacity, self.staleness, self._step = source, capacity, staleness, step
        self._tables: dict[str, _TableCache] = {}
        self.stats = CacheStats()

    def pull_rows(self, table: str, ids: torch.Tensor, observe: bool) -> torch.Tensor:
        if observe:
            return self._source.pull_rows(table, ids, observe)
        step = self._step()
        cache = self._tables.get(table)
        if cache is None:
            out = self._source.pull_rows(table, ids, observe)
            cache = self._tables[table] = _TableCache(out.shape[1])
            cache.put(ids, out, step, self.capacity)
            self.stats.misses += ids.numel()
            return out
        found, at = cache.find(ids)
        fresh = found.clone()
        fresh[found] = step - cache.pulled[at[found]] < self.staleness
        out = torch.empty(ids.numel(), cache.rows.shape[1])
        hit = at[fresh]
        out[fresh] = cache.rows[hit]
        cache.used[hit] = step
        missing = ~fresh
        if bool(missing.any()):
            pulled = self._source.pull_rows(table, ids[missing], observe)
            out[missing] = pulled
            cache.put(ids[missing], pulled, step, self.capacity)
        hits = int(fresh.sum())
        self.stats.hits += hits
        self.stats.misses += ids.numel() - hits
        return out
