"""PushOutcome: what a shard answered to one push (applied, buffered for sync's mean, a duplicate,
refused or dropped as late), as the client hands it to the API; pure."""
from __future__ import annotations

from dataclasses import dataclass

from psgrad.core.backup import LATE_REASON

# How a shard words its answer to a push whose (rank, clock) it had: a step taken again.
DUPLICATE_REASON = "duplicate push"


@dataclass(frozen=True)
class Eviction:
    """A shard evicted worker `rank` (its lease ran out) while it owed clock `clock`; `live` workers
    were left on the shard. Each shard tells each worker once."""

    rank: int
    clock: int
    lease_s: float
    live: int

    def describe(self, num_workers: int) -> str:
        return (f"worker {self.rank} evicted at clock {self.clock} (lease {self.lease_s:g} s): continuing with "
                f"{self.live} of {num_workers}")


@dataclass(frozen=True)
class Restore:
    """Shard `shard` restarted from its checkpoint of version `to_version` after this worker had
    seen it at `from_version`: the updates in between were lost (at least these: the shard may
    have applied more that this worker never saw). `from_version == to_version`: the checkpoint
    held every update this worker had seen (a restart is told all the same). `joined_after`: this
    worker first heard from the shard after the restart (it joined a resumed job, or a restarted
    server): it saw none of the updates the restart may have lost, so it cannot count them, and
    `lost` (0) says nothing of them."""

    shard: int
    from_version: int
    to_version: int
    joined_after: bool = False

    @property
    def lost(self) -> int:
        return self.from_version - self.to_version

    def describe(self) -> str:
        if self.joined_after:
            return (f"shard {self.shard} was restored from its checkpoint of version {self.to_version} before this "
                    "worker joined (e.g. a resumed job): updates applied after that checkpoint before the restart, "
                    "if any, are lost, and this worker, which never saw them, cannot count them")
        if not self.lost:
            return (f"shard {self.shard} restarted from its checkpoint of version {self.to_version}, which held every "
                    "update this worker had seen: none lost")
        return (f"shard {self.shard} restarted from its checkpoint: its version went back from {self.from_version} "
                f"to {self.to_version}, {self.lost} update{'s' if self.lost != 1 else ''} lost")


@dataclass(frozen=True)
class PushOutcome:
    """One shard's reply to a push (wire/serde.py converts the PushReply message)."""

    applied: bool  # False: a duplicate key, skipped, refused or late (reason says which)
    reason: str = ""
    version: int = 0  # the shard's version after this push
    staleness: int = 0  # version at apply - the push's base version
    deferred: bool = False  # sync: buffered, applied with its iteration's mean
    lr: float | None = None  # the learning rate the push is applied with; None: the shard did not say
    staleness_bound: int = 0  # ssp with `--staleness auto`: the bound in effect (0: a fixed bound)
    evicted: tuple[Eviction, ...] = ()  # workers the shard evicted that it had not told this one of
    restored_version: int | None = None  # the shard restarted from its checkpoint of this version (told once)

    @property
    def accepted(self) -> bool:
        """The shard applied the gradient or (sync) keeps it for its iteration."""
        return self.applied or self.deferred

    @property
    def duplicate(self) -> bool:
        """The shard had this push's (rank, clock) already (a step taken again), and changed nothing."""
        return self.reason.startswith(DUPLICATE_REASON)

    @property
    def late(self) -> bool:
        """Sync with backup workers: computed on an iteration already complete, and dropped."""
        return self.reason.startswith(LATE_REASON)
