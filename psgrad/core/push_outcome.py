"""PushOutcome: what a shard answered to one push (applied, buffered for sync's mean, a duplicate,
refused or dropped as late), as the client hands it to the API; pure."""
from __future__ import annotations

from dataclasses import dataclass

from psgrad.core.backup import LATE_REASON


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

    @property
    def accepted(self) -> bool:
        """The shard applied the gradient or (sync) keeps it for its iteration."""
        return self.applied or self.deferred

    @property
    def late(self) -> bool:
        """Sync with backup workers: computed on an iteration already complete, and dropped."""
        return self.reason.startswith(LATE_REASON)
