"""The public API's value types: what one PSOptimizer.step() did (StepStats) and what one exchange
with the shards brought back (the optimizer settings are in psgrad/core/optimizer_settings.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from psgrad.core.push_outcome import Eviction, Restore


@dataclass
class StepStats:
    """What one PSOptimizer.step() did. Times in seconds.

    exchange_s is the push and the pull after it, together: where a shard takes both in one call
    (same host, or a small model) they cannot be timed apart. With overlap, exchange_s/staleness/
    accepted/versions describe the most recent exchange that has *completed* (the previous step's,
    run in the background; None before the first completes), and wait_s is how long step() blocked
    on it. Without overlap, wait_s = exchange_s.
    """

    clock: int  # the clock of the gradient this step pushed (or started pushing)
    # the learning rate this step's gradient is applied with: param_groups[0]["lr"], or in async and
    # ssp for workers other than the chief, the job's (the chief's schedule), as the servers answered
    lr: float = 0.0
    d2h_s: float = 0.0  # gradient gather + device->host copy
    h2d_s: float = 0.0  # pulled weights host->device (or into the model)
    exchange_s: float | None = None  # push + pull, including any wait at the sync/ssp gate
    wait_s: float = 0.0
    staleness: int | None = None  # the largest staleness any shard reported for the push
    accepted: bool | None = None  # every shard applied or (sync) deferred the push (False: dropped as late)
    staleness_bound: int | None = None  # ssp with staleness "auto": the largest bound a shard had in effect
    versions: list[int] = field(default_factory=list)  # base versions of the weights now in the model
    # sync: a restored shard was behind, so the job rolled back to this iteration and this step's
    # gradient was not applied; the optimizer's clock is now that iteration (compute it again)
    rolled_back_to: int | None = None
    # the shards had evicted this worker (its lease ran out, e.g. in a network partition): the
    # gradient was not applied; the worker joined again and continues from this clock
    rejoined_at: int | None = None
    # other workers the shards evicted (their lease ran out), told of since the last step: each once
    evicted: list[Eviction] = field(default_factory=list)
    # shards that restarted from a checkpoint older than the version this worker had seen them at
    # (the updates in between were lost), told of since the last step: each once
    restores: list[Restore] = field(default_factory=list)


@dataclass
class ExchangeResult:
    """What one background or foreground push + pull returned (PSOptimizer fills StepStats from it)."""

    exchange_s: float
    staleness: int
    accepted: bool
    versions: list[int]
    lr: float | None = None  # the learning rate the (first) shard applies the push with
    bound: int = 0  # the largest adaptive staleness bound a shard reported (0: fixed bounds)
    evicted: list[Eviction] = field(default_factory=list)  # see StepStats
    restores: list[Restore] = field(default_factory=list)
