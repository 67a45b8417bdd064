"""Sync mode with backup workers (Chen et al., 2016): an iteration applies the mean of the first
N - B gradients computed on its weights; a later one is late and dropped; pure."""
from __future__ import annotations

from psgrad.core.consistency import ClockView, PushDecision, SyncPolicy
from psgrad.errors import RollbackError

# A late push's reply reason starts with this (the client reads it: a late gradient goes to no
# other shard, see ParameterClient.push).
LATE_REASON = "late:"


class BackupSyncPolicy(SyncPolicy):
    """BSP with B backup workers. A gradient belongs to the iteration of the weights it was computed
    on (its base version), not to the worker's clock: the clock only keys duplicates. Iteration v
    completes once quorum() gradients of v were handled (N - B; all live ones when fewer are live);
    a push whose base version is below the shard's version is late. A worker that pushed for v may pull again only once v is
    complete (it gets no second gradient into v), and a late worker's next pull is not held back:
    it gets the newest version and its next gradient counts for the iteration then open."""

    drops_late = True

    def __init__(self, backup_workers: int, num_workers: int) -> None:
        super().__init__(0)
        self.backup_workers = backup_workers
        self.num_workers = num_workers
        self.pushed_for: dict[int, int] = {}  # rank -> the iteration of its last handled push

    def quorum(self, view: ClockView) -> int:
        """Gradients that complete an iteration: N - B of the job's N workers, or every live one
        when fewer are live (no backup left); at least one. A constant while at least N - B workers
        are live, so that shards whose membership changes at slightly different times agree."""
        return max(1, min(self.num_workers - self.backup_workers, len(view.live_clocks)))

    def rank_ready(self, rank: int, clock: int, view: ClockView) -> bool:
        """The sync gate (version >= clock), and the worker's last iteration is complete."""
        return view.version >= clock and view.version > self.pushed_for.get(rank, -1)

    def is_late(self, base_version: int, view: ClockView) -> bool:
        return base_version < view.version

    def handled(self, rank: int, iteration: int) -> None:
        """rank's push for `iteration` was handled (buffered, skipped or dropped as late)."""
        self.pushed_for[rank] = iteration

    def late(self, rank: int, base_version: int, view: ClockView, restored: bool) -> str | None:
        """A push computed on an iteration that is already complete is late (dropped); any push
        handled here is recorded for its worker's gate (buffered, skipped or dropped).

        Raises:
            RollbackError: computed on weights newer than a restored shard's (the job rolls back).
        """
        if restored and base_version > view.version:
            raise RollbackError(
                f"sync push from worker rank {rank} was computed on version {base_version}, but shard is at "
                f"iteration {view.version}: it was restored from a checkpoint, so the job rolls back"
            )
        self.handled(rank, min(base_version, view.version))
        if not self.is_late(base_version, view):
            return None
        return f"{LATE_REASON} iteration {base_version} completed without it (shard at {view.version})"

    def decide_push(self, rank: int, clock: int, view: ClockView, restored: bool = False) -> PushDecision:
        """Buffer: a late push (or one computed on a restored shard's future) never gets here
        (late() drops or refuses it first), and its clock keys duplicates only."""
        return PushDecision.BUFFER

    def iteration_complete(self, iteration: int, view: ClockView, pushed: int) -> bool:
        """Complete once quorum() gradients of the iteration were handled."""
        return pushed >= self.quorum(view)
