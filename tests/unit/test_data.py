"""Sharding data over workers: ShardedSampler gives each rank a disjoint, seeded, epoch-aware part of
any dataset that together covers it; BatchSchedule's batches are a function of the clock."""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from psgrad.errors import ConfigError, TaskError
from psgrad.tasks.data import BatchSchedule, ShardedSampler, batches

pytestmark = pytest.mark.timeout(60)


class Squares(Dataset[tuple[int, int]]):
    """A dataset that is no tensor: example i is computed when asked for."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, int]:
        return i, i * i


@pytest.mark.parametrize("length, replicas", [(10, 3), (12, 4), (7, 1), (5, 5), (1001, 8)])
def test_the_ranks_parts_are_disjoint_and_cover_every_epoch(length: int, replicas: int) -> None:
    for epoch in range(3):
        parts = [ShardedSampler(length, r, replicas, seed=4).indices(epoch).tolist() for r in range(replicas)]
        everything = [i for part in parts for i in part]
        assert sorted(everything) == list(range(length))  # disjoint, and together all of it
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
        assert [len(ShardedSampler(length, r, replicas)) for r in range(replicas)] == list(map(len, parts))
        dropped = [ShardedSampler(length, r, replicas, seed=4, drop_last=True).indices(epoch).tolist()
                   for r in range(replicas)]
        flat = [i for part in dropped for i in part]
        assert len(set(flat)) == len(flat) == length - length % replicas
        assert {len(p) for p in dropped} == {length // replicas}


def test_epochs_and_seeds_reshuffle_and_set_epoch_follows() -> None:
    s = ShardedSampler(100, 1, 4, seed=0)
    first = list(s)
    assert first == s.indices(0).tolist() == ShardedSampler(100, 1, 4, seed=0).indices(0).tolist()
    s.set_epoch(1)
    assert list(s) != first and sorted(list(s)) != sorted(first)  # a different share of the data
    assert ShardedSampler(100, 1, 4, seed=1).indices(0).tolist() != first
    assert ShardedSampler(10, 0, 2, shuffle=False).indices(5).tolist() == [0, 2, 4, 6, 8]


def test_a_dataset_that_is_not_a_tensor_goes_through_a_dataloader() -> None:
    data = Squares(23)
    seen = []
    for rank in range(3):
        sampler = ShardedSampler(data, rank, 3, seed=9)
        sampler.set_epoch(2)
        for i, sq in DataLoader(data, batch_size=4, sampler=sampler):
            assert torch.equal(sq, i * i)
            seen += i.tolist()
    assert sorted(seen) == list(range(23))


def test_bad_ranks_and_tiny_datasets_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"rank must be in \[0, num_replicas=2\), got 2"):
        ShardedSampler(10, 2, 2)
    with pytest.raises(ConfigError, match="3 examples cannot be shared by 4"):
        ShardedSampler(3, 0, 4, drop_last=True)
    with pytest.raises(TaskError, match="3 examples, fewer than the 4 workers"):
        BatchSchedule(Squares(3), 2, seed=0, rank=0, num_workers=4)


def test_batches_are_a_function_of_the_clock_and_disjoint_across_workers() -> None:
    """A worker that rewinds (sync roll-back, resume) gets the batches it had the first time; every
    epoch each worker gets its own part of a fresh permutation of the data."""
    data = TensorDataset(torch.arange(20).float().unsqueeze(1), torch.arange(20))
    a, b = BatchSchedule(data, 4, seed=7, rank=0, num_workers=2), BatchSchedule(data, 4, seed=7, rank=0, num_workers=2)
    other = BatchSchedule(data, 4, seed=7, rank=1, num_workers=2)
    assert a.per_epoch == 3  # 10 examples per worker: 4 + 4 + 2
    forward = [a.at(c)[1].tolist() for c in range(9)]
    assert [b.at(c)[1].tolist() for c in reversed(range(9))] == forward[::-1]  # any order, same batches
    assert [len(f) for f in forward] == [4, 4, 2] * 3
    for e in range(3):
        mine = sum(forward[3 * e : 3 * e + 3], [])
        theirs = sum((other.at(c)[1].tolist() for c in range(3 * e, 3 * e + 3)), [])
        assert sorted(mine + theirs) == list(range(20))
    assert forward[0:3] != forward[3:6]
    assert [BatchSchedule(data, 4, seed=8, rank=0, num_workers=2).at(c)[1].tolist() for c in range(3)] != forward[:3]
    stream = batches(data, 4, seed=7, rank=0, num_workers=2)
    assert [next(stream)[1].tolist() for _ in range(9)] == forward
    assert a.seed_at(3) == b.seed_at(3) != a.seed_at(4) and a.seed_at(3) != other.seed_at(3)
    squares = BatchSchedule(Squares(9), 3, seed=0)
    i, sq = squares.at(0)
    assert torch.equal(sq, i * i)
