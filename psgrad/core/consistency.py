"""Consistency modes as small policy objects: when a pull may proceed, and what becomes of a push
(apply it, buffer it for the iteration's mean, or refuse it); pure. core/modes.py declares the
modes from these policies and makes a job's policy."""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from psgrad.errors import InvalidRequestError, RollbackError


class PushDecision(enum.Enum):
    """What a shard does with a new (non-duplicate, finite) gradient."""

    APPLY = "apply"  # update the weights now (async, ssp)
    BUFFER = "buffer"  # keep it until the iteration completes, then apply the mean (sync)


@dataclass(frozen=True)
class ClockView:
    """What a policy may look at: the shard version and the clocks of the live workers."""

    version: int
    live_clocks: Mapping[int, int]  # rank -> iterations completed, live workers only

    @property
    def min_clock(self) -> int | None:
        return min(self.live_clocks.values()) if self.live_clocks else None


class ConsistencyPolicy(ABC):
    """Gate and apply rules of one mode (docs/design/architecture.md, "Consistency")."""

    name: ClassVar[str]
    #: True: pushes of one iteration are buffered and their mean applied once (sync). The shard
    #: then keeps a receive buffer per pushing worker instead of lending a bounded few.
    aggregates: ClassVar[bool] = False
    #: True: the first pull waits until num_workers workers have joined (no early head start).
    start_barrier: ClassVar[bool] = False
    #: True: a push computed on an older iteration's weights is dropped as late, and the gate is
    #: per worker (rank_ready): sync with backup workers (core/backup.py).
    drops_late: ClassVar[bool] = False
    #: True: the staleness bound moves at run time (observe_pull): ssp with `--staleness auto`.
    adapts: ClassVar[bool] = False
    #: False: a pull never waits at a gate, so it need not follow the worker's push and may go
    #: beside it (async; ClientConfig.duplex). Gated modes count a worker's clock from its pulls.
    gates_pulls: ClassVar[bool] = True

    def __init__(self, staleness: int = 0) -> None:
        self.staleness = staleness

    @abstractmethod
    def pull_ready(self, clock: int, view: ClockView) -> bool:
        """May a live worker that has completed `clock` iterations pull now?"""

    def rank_ready(self, rank: int, clock: int, view: ClockView) -> bool:
        """The gate a shard asks: may live worker `rank`, having completed `clock` iterations, pull
        now? pull_ready, for policies whose gate does not depend on the worker."""
        return self.pull_ready(clock, view)

    @property
    def reported_bound(self) -> int:
        """The staleness bound a push reply reports: the one in effect where it moves at run time
        (adapts), else 0 (a fixed bound, known from the job spec)."""
        return self.staleness if self.adapts else 0

    def late(self, rank: int, base_version: int, view: ClockView, restored: bool) -> str | None:
        """Whether a worker's new gradient, computed on the weights of `base_version`, comes too
        late to be applied: the reason (the push is then acknowledged, counted and dropped), or
        None (the default: never late). `restored`: the shard was restored since it started.

        Raises:
            RollbackError: computed on weights newer than a restored shard's (the job rolls back).
        """
        return None

    def is_late(self, base_version: int, view: ClockView) -> bool:
        """(drops_late) Was a gradient computed on weights of an iteration already complete?"""
        return False

    def handled(self, rank: int, iteration: int) -> None:
        """(drops_late) rank's push for `iteration` was handled (buffered, skipped or dropped)."""

    def observe_pull(self, waited_s: float, now: float, live: int, version: int) -> bool:
        """(adapts) A pull was granted after waiting waited_s at the gate; True when the bound moved."""
        return False

    def start_clock(self, view: ClockView) -> int:
        """Clock for a worker joining a running job: as far along as the slowest live worker
        (so that a joiner never holds the others back)."""
        return view.min_clock or 0

    def blocking(self, clock: int, view: ClockView) -> list[int]:
        """Ranks a pull at `clock` is waiting for (empty when it may proceed)."""
        return []

    def decide_push(self, rank: int, clock: int, view: ClockView, restored: bool = False) -> PushDecision:
        """What becomes of a worker's gradient for `clock` (after duplicates are filtered out).
        `restored`: the shard was restored from a checkpoint (or rolled back) since it started.

        Raises:
            InvalidRequestError: the push does not fit the mode (named in the message).
            RollbackError: (sync) the shard is behind the worker: the job must roll back.
        """
        return PushDecision.APPLY

    def check_pull(self, rank: int, clock: int, last_push_clock: int, view: ClockView) -> None:
        """Refuse a pull the shard cannot serve in this mode (before the gate is evaluated).

        Raises:
            RollbackError: (sync) the shard is behind the worker: the job must roll back.
        """

    def iteration_complete(self, iteration: int, view: ClockView, pushed: int) -> bool:
        """Whether the buffered gradients of `iteration` are to be applied now (`pushed` counts
        the gradients buffered or skipped for it). Modes that apply on arrival never buffer."""
        return False

    def lr_scale(self, staleness: int, staleness_lr: bool) -> float:
        """Step-size factor for a gradient of this staleness: 1/max(1, tau) when staleness_lr is on
        (Zhang et al., "Staleness-aware Async-SGD", IJCAI 2016), else 1."""
        return 1.0 / max(1, staleness) if staleness_lr else 1.0


class AsyncPolicy(ConsistencyPolicy):
    """ASP: pulls never wait; every push is applied on arrival."""

    name = "async"
    gates_pulls = False

    def pull_ready(self, clock: int, view: ClockView) -> bool:
        return True

    def start_clock(self, view: ClockView) -> int:
        """Nothing waits on clocks in async mode: a new worker counts its iterations from 0."""
        return 0


class SSPPolicy(ConsistencyPolicy):
    """SSP(s): a worker at clock c pulls only while c - (slowest live clock) <= s; pushes apply on arrival."""

    name = "ssp"
    start_barrier = True

    def pull_ready(self, clock: int, view: ClockView) -> bool:
        slowest = view.min_clock
        return slowest is None or clock - slowest <= self.staleness

    def blocking(self, clock: int, view: ClockView) -> list[int]:
        return sorted(r for r, c in view.live_clocks.items() if clock - c > self.staleness)


class SyncPolicy(ConsistencyPolicy):
    """BSP: iteration c's pull waits for version c; the mean of one gradient per live worker is
    applied once every live worker has pushed iteration c."""

    name = "sync"
    aggregates = True
    start_barrier = True

    def pull_ready(self, clock: int, view: ClockView) -> bool:
        return view.version >= clock

    def start_clock(self, view: ClockView) -> int:
        return view.version

    def blocking(self, clock: int, view: ClockView) -> list[int]:
        if self.pull_ready(clock, view):
            return []
        return sorted(r for r, c in view.live_clocks.items() if c <= view.version)

    def decide_push(self, rank: int, clock: int, view: ClockView, restored: bool = False) -> PushDecision:
        """Buffer a push of the current iteration for the mean; refuse any other clock.

        A worker pushes iteration c only after pulling the weights of version c, and a shard's
        version only goes back when it is restored from a checkpoint: a push for a later iteration
        than a restored shard's means the shard is behind, and the job rolls back (RollbackError).
        """
        if restored and clock > view.version:
            raise RollbackError(
                f"sync push from worker rank {rank} is for iteration {clock}, but shard is at iteration "
                f"{view.version}: it was restored from a checkpoint, so the job rolls back"
            )
        if clock != view.version:
            raise InvalidRequestError(
                f"sync push from worker rank {rank} is for iteration {clock}, but shard is at "
                f"iteration {view.version} (pull before pushing)"
            )
        return PushDecision.BUFFER

    def check_pull(self, rank: int, clock: int, last_push_clock: int, view: ClockView) -> None:
        """A pull for iteration c follows the worker's push of c - 1. If the shard is at an earlier
        iteration and holds no push of c - 1 from that worker, the shard lost it (restored from a
        checkpoint, or rolled back): the gate would never open, so the job rolls back."""
        if clock > view.version and last_push_clock < clock - 1:
            raise RollbackError(
                f"sync pull of worker rank {rank} is for iteration {clock}, but shard is at iteration "
                f"{view.version} without its push of iteration {clock - 1}: it was restored from a "
                "checkpoint, so the job rolls back"
            )

    def iteration_complete(self, iteration: int, view: ClockView, pushed: int) -> bool:
        """Iteration `iteration` is complete when someone pushed it (`pushed` counts gradients
        buffered or skipped) and no live worker still owes it (every live clock is past it)."""
        return pushed > 0 and all(c > iteration for c in view.live_clocks.values())
