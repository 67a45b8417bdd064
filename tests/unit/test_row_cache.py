"""The worker's row cache: hits within the staleness bound, pulls past it, least recently used rows
evicted first, read-only pulls bypass it."""
from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch

from psgrad.core.rows import PulledRows
from psgrad.errors import ConfigError
from psgrad.worker.row_cache import RowCache


class Source:
    """Rows whose values are their id plus how many times the source was asked (so staleness shows)."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []  # the ids of each call (of its first table)
        self.tables: list[list[str]] = []  # the tables of each call

    def pull_tables(self, lookups: Mapping[str, torch.Tensor], observe: bool, checked: bool = False) -> dict[str, torch.Tensor]:
        self.calls.append(next(iter(lookups.values())).tolist())
        self.tables.append(list(lookups))
        return {t: (ids.float() + 1000 * len(self.calls)).unsqueeze(1).repeat(1, 2) for t, ids in lookups.items()}


def pull(cache: RowCache, ids: torch.Tensor, observe: bool = False) -> torch.Tensor:
    return cache.pull_tables({"t": ids}, observe)["t"]


def test_rows_are_served_from_the_cache_until_they_are_staleness_steps_old() -> None:
    source, step = Source(), [0]
    cache = RowCache(source, capacity=10, staleness=2, step=lambda: step[0])
    first = pull(cache, torch.tensor([1, 5, 9]))
    step[0] = 1
    again = pull(cache, torch.tensor([5, 7, 9]))  # 5, 9 cached (1 step old), 7 not
    assert source.calls == [[1, 5, 9], [7]]
    assert again[:, 0].tolist() == [first[1, 0].item(), 7 + 2000, first[2, 0].item()]
    assert (cache.stats.hits, cache.stats.misses) == (2, 4)
    step[0] = 2  # 1, 5, 9 pulled at step 0 are 2 steps old now: pulled again; 7 (step 1) is not
    pull(cache, torch.tensor([1, 7]))
    assert source.calls[-1] == [1]
    pull(cache, torch.tensor([1, 7]), observe=True)  # read-only: always the servers'
    assert source.calls[-1] == [1, 7] and cache.stats.hit_rate == pytest.approx(3 / 8)


def test_the_least_recently_used_rows_go_first() -> None:
    source, step = Source(), [0]
    cache = RowCache(source, capacity=3, staleness=100, step=lambda: step[0])
    pull(cache, torch.tensor([1, 2, 3]))
    step[0] = 1
    pull(cache, torch.tensor([1, 3]))  # 2 is now the least recently used
    step[0] = 2
    pull(cache, torch.tensor([4]))  # evicts 2
    pull(cache, torch.tensor([1, 2, 3, 4]))
    assert source.calls == [[1, 2, 3], [4], [2]]


def test_a_cache_needs_room_and_a_bound() -> None:
    with pytest.raises(ConfigError, match="capacity >= 1 rows and staleness >= 1 steps"):
        RowCache(Source(), capacity=0, staleness=1, step=lambda: 0)


def test_every_tables_misses_go_in_one_pull() -> None:
    source, step = Source(), [0]
    cache = RowCache(source, capacity=10, staleness=1, step=lambda: step[0])
    cache.pull_tables({"a": torch.tensor([1, 2]), "b": torch.tensor([3])}, False)
    got = cache.pull_tables({"a": torch.tensor([1, 2, 4]), "b": torch.tensor([3, 5])}, False)  # (same step: 1, 2, 3 hit)
    assert source.tables == [["a", "b"], ["a", "b"]] and source.calls == [[1, 2], [4]]
    assert got["b"][:, 0].tolist() == [1003, 2005]
    assert (cache.stats.hits, cache.stats.misses) == (3, 5)


def test_a_read_says_the_versions_of_the_pulls_its_cached_rows_came_from() -> None:
    """Each pull of the source is read at a newer version (the number of calls); a read that the cache
    serves in part says, per shard, the oldest version its rows came from: a push of their
    gradients counts their staleness from it (not from the newest pull's)."""

    class Versioned(Source):
        def pull_tables(self, lookups: Mapping[str, torch.Tensor], observe: bool, checked: bool = False) -> PulledRows:
            got = super().pull_tables(lookups, observe)
            return PulledRows(got, {t: {0: len(self.calls)} for t in lookups})

    source, step = Versioned(), [0]
    cache = RowCache(source, capacity=10, staleness=3, step=lambda: step[0])
    assert cache.pull_tables({"t": torch.tensor([1, 2])}, False).versions == {"t": {0: 1}}
    step[0] = 1
    assert cache.pull_tables({"t": torch.tensor([3])}, False).versions == {"t": {0: 2}}
    step[0] = 2
    assert cache.pull_tables({"t": torch.tensor([2, 3, 4])}, False).versions == {"t": {0: 1}}  # 2: step 0's pull
    assert cache.pull_tables({"t": torch.tensor([3, 4])}, False).versions == {"t": {0: 2}}  # all cached
    step[0] = 5  # steps 0-2 too old: every row pulled again
    assert cache.pull_tables({"t": torch.tensor([2, 3])}, False).versions == {"t": {0: 4}}
