"""Sharding a dataset over workers: ShardedSampler (each rank's disjoint, seeded, epoch-aware part of
any dataset, like torch's DistributedSampler without a process group) and BatchSchedule (a
worker's minibatch as a function of its clock, built on it)."""
from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler, TensorDataset, default_collate

from psgrad.errors import ConfigError, TaskError


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence([p % 2**32 for p in parts]).generate_state(1)[0])


class ShardedSampler(Sampler[int]):
    """Rank `rank`'s part of range(len(data)) for one epoch: every epoch is one permutation of the
    whole dataset, seeded by (seed, epoch) and the same on every rank, and rank r takes every
    num_replicas-th index of it from position r. So within an epoch the ranks' parts are disjoint and
    together cover the dataset (sizes differ by at most one; with drop_last every rank gets
    len // num_replicas and the few left over differ from epoch to epoch). Only indices are
    handled, so the dataset can be anything with a length: a file-backed Dataset, a list, a count.

        sampler = ShardedSampler(dataset, rank, num_workers, seed=0)
        loader = DataLoader(dataset, batch_size=32, sampler=sampler)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)   # a new permutation, like DistributedSampler
            for x, y in loader: ...

    Raises:
        ConfigError: a rank outside [0, num_replicas), or an empty dataset.
    """

    def __init__(
        self, data: Sized | int, rank: int = 0, num_replicas: int = 1, seed: int = 0, shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        self.length = data if isinstance(data, int) else len(data)
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ConfigError(f"rank must be in [0, num_replicas={num_replicas}), got {rank}")
        if self.length < 1 or (drop_last and self.length < num_replicas):
            raise ConfigError(f"a dataset of {self.length} examples cannot be shared by {num_replicas} replicas")
        self.rank, self.num_replicas, self.seed = rank, num_replicas, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Use epoch's permutation from now on (call it before each epoch, on every rank)."""
        self.epoch = epoch

    def indices(self, epoch: int | None = None) -> torch.Tensor:
        """This rank's indices for epoch (default: the current one), in order."""
        epoch = self.epoch if epoch is None else epoch
        if self.shuffle:
            order = torch.randperm(self.length, generator=torch.Generator().manual_seed(_seed(self.seed, 0, epoch)))
        else:
            order = torch.arange(self.length)
        if self.drop_last:
            order = order[: self.length - self.length % self.num_replicas]
        return order[self.rank :: self.num_replicas]

    def __len__(self) -> int:
        if self.drop_last:
            return self.length // self.num_replicas
        return len(range(self.rank, self.length, self.num_replicas))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())


def fetch(data: Dataset[Any], idx: torch.Tensor) -> Any:
    """The examples at idx as one batch: tensor datasets are indexed at once, as is a dataset with a
    `batch(idx)` method (one that makes its examples, such as ctr's); any other dataset one example
    at a time, collated as a DataLoader would."""
    if isinstance(data, TensorDataset):
        return tuple(t[idx] for t in data.tensors)
    batch = getattr(data, "batch", None)
    if callable(batch):
        return batch(idx)
    return default_collate([data[i] for i in idx.tolist()])


class BatchSchedule:
    """A worker's shuffled minibatches as a function of its clock: batch `clock` is the same whenever
    it is asked for, so a worker that rewinds (a sync roll-back, a resumed job) computes exactly the
    gradients it computed the first time. Epoch e is the ShardedSampler's part of rank `rank` for
    epoch e (drop_last, so every rank's epochs line up), cut into ceil(part / batch_size) batches,
    the last one shorter: in any epoch the workers see disjoint examples."""

    def __init__(self, data: Dataset[Any], batch_size: int, seed: int, rank: int = 0, num_workers: int = 1) -> None:
        length = len(data)  # type: ignore[arg-type]
        if length < num_workers:
            raise TaskError(f"the training data has {length} examples, fewer than the {num_workers} workers")
        self.data, self.batch_size, self.seed = data, batch_size, seed
        self.sampler = ShardedSampler(length, rank, num_workers, seed, drop_last=True)
        self.per_epoch = -(-len(self.sampler) // batch_size)
        self._epoch, self._order = -1, torch.empty(0, dtype=torch.long)

    def seed_at(self, clock: int) -> int:
        """A seed for the step at `clock` (stochastic layers such as dropout), per rank."""
        return _seed(self.seed, 1, self.sampler.rank, clock)

    def indices_at(self, clock: int) -> torch.Tensor:
        """The dataset indices of iteration `clock` (0-based). A stream in time order (a dataset
        whose `in_time_order` is true: examples whose index is their time, ctr's drifting clicks)
        is read in order, never shuffled nor repeated: iteration c of rank r is the batch at
        (c * num_workers + r) * batch_size, so every step trains on the stream's newest examples."""
        if getattr(self.data, "in_time_order", False):
            start = (clock * self.sampler.num_replicas + self.sampler.rank) * self.batch_size
            return torch.arange(start, start + self.batch_size)
        epoch, i = divmod(clock, self.per_epoch)
        if epoch != self._epoch:
            self._epoch, self._order = epoch, self.sampler.indices(epoch)
        return self._order[i * self.batch_size : (i + 1) * self.batch_size]

    def at(self, clock: int) -> Any:
        """The minibatch of iteration `clock` (0-based): (x, y) for a task's data."""
        return fetch(self.data, self.indices_at(clock))


def batches(data: Dataset[Any], batch_size: int, seed: int, rank: int = 0, num_workers: int = 1) -> Iterator[Any]:
    """Endless shuffled minibatches from clock 0 on: BatchSchedule(...).at(0), at(1), ..."""
    schedule = BatchSchedule(data, batch_size, seed, rank, num_workers)
    clock = 0
    while True:
        yield schedule.at(clock)
        clock += 1
