"""A shard's snapshots and what they are for: handing them to a checkpoint writer, serving one after a
restart, and (sync) rolling the shard back to an iteration every shard of the job can return to.
A collaborator of the shard core, acting under its lock."""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from psgrad.errors import CheckpointError, InvalidRequestError, JobMismatchError, NotInitializedError, RollbackError
from psgrad.server.ledger import Counters
from psgrad.server.replica_path import Replica
from psgrad.server.shard_core import RestoreMarks, ShardCore
from psgrad.server.state import NOT_INITIALIZED_HINT, ShardSnapshot, ShardState

_log = logging.getLogger("psgrad.server")


class RollbackSource(Protocol):
    """Where a shard finds the states it can roll back to (its checkpoints)."""

    def versions(self) -> list[int]:
        """The versions of the snapshots on offer."""

    def load(self, version: int) -> ShardSnapshot | None:
        """The snapshot of that version, read back whole; None if there is none (or it is damaged)."""


class Recovery:
    """Snapshots, restore and roll-back of one shard."""

    def __init__(self, core: ShardCore, replica: Replica) -> None:
        self._core = core
        self._replica = replica
        self._snapshot_every = 0
        self._snapshot_sink: Callable[[ShardSnapshot], None] | None = None
        self._rollback_source: RollbackSource | None = None
        core.subscribe(on_update=self._updated)

    def snapshot(self) -> ShardSnapshot:
        """A copy of the shard's state (see ShardState.snapshot), taken under the lock: a memory
        copy of the weights and the optimizer state, nothing slower.

        Raises:
            NotInitializedError: there is no state yet.
        """
        core = self._core
        with core.cond:
            if core.state is None:
                raise NotInitializedError(NOT_INITIALIZED_HINT)
            return core.state.snapshot(frozenset(core.round.pending), core.counters.saved())

    def restore(self, snap: ShardSnapshot) -> None:
        """Serve the state a snapshot holds (a restart or a standby taking over): every member
        continues from its recorded clocks, and a push it had made before is a duplicate; the
        shard's counters (pushes applied, the staleness histogram, ...) continue from those it
        kept (a snapshot that kept none: from 0).

        Raises:
            JobMismatchError: this shard already serves a job.
            CheckpointError: its counters are not counts.
        """
        core = self._core
        try:
            counters = Counters.restored(snap.counters)
        except (ValueError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"a snapshot's counters are not counts ({type(exc).__name__}: {exc})") from None
        with core.cond:
            if core.state is not None:
                raise JobMismatchError("shard already serves a job: restore into a fresh shard")
            core.install(ShardState.restore(snap, core.members, core.now(), core.budget_bytes))
            core.counters = counters
            core.marks = RestoreMarks(True, {m.rank: m.last_push_clock for m in snap.members},
                                      {m.rank for m in snap.members}, version=snap.version)
            core.notify()
            core.reaper_wake.notify_all()

    def snapshot_at_multiples(self, every: int, sink: Callable[[ShardSnapshot], None]) -> None:
        """From now on hand sink a snapshot when the chief initializes the shard (and, where the
        first iteration waits for every worker, again once all have joined), and each time an
        update brings the version to a multiple of `every` (0: never; taken under the lock: a memory
        copy; sink must not block). In sync mode every shard then snapshots the same iterations."""
        with self._core.cond:
            self._snapshot_every, self._snapshot_sink = every, sink

    def offer_snapshot(self) -> None:
        """Hand the sink a snapshot now (caller holds the lock)."""
        core = self._core
        if self._snapshot_sink is not None and core.state is not None:
            self._snapshot_sink(core.state.snapshot(frozenset(core.round.pending), core.counters.saved()))

    def _updated(self) -> None:
        """An update was applied (caller holds the lock): a snapshot to the checkpointer at every
        multiple of K."""
        state = self._core.state
        if state is not None and self._snapshot_every and state.version % self._snapshot_every == 0:
            self.offer_snapshot()

    @property
    def checkpoints_aligned(self) -> bool:
        """Whether only the snapshots handed over at multiples of K are to be written: where the
        policy aggregates (sync), every shard takes them at the same iterations (a roll-back
        target must be on all)."""
        return self._core.state is not None and self._core.policy.aggregates

    # ----------------------------------------------------------------- sync roll-back
    def set_rollback_source(self, source: RollbackSource | None) -> None:
        """Where rollback() finds older states (the server's checkpoints)."""
        with self._core.cond:
            self._rollback_source = source

    def rollback_points(self, rank: int, fingerprint: str) -> tuple[int, list[int]]:
        """(version, the versions this shard can roll back to: its current one and its checkpoints
        up to it, newest first). A live worker asks; its lease is renewed."""
        core = self._core
        with core.cond:
            state = core.require(fingerprint, rank)
            core.members.live(rank)
            source = self._rollback_source
            version = state.version
        older = source.versions() if source is not None else []
        return version, sorted({version, *(v for v in older if v < version)}, reverse=True)

    def rollback(self, rank: int, fingerprint: str, version: int) -> int:
        """Return the shard to iteration `version` (sync): the weights and optimizer state of its
        checkpoint there; every member's clock goes back to it, and the iteration's buffered
        gradients are dropped (their workers compute them again). At that iteration already:
        nothing changes, so every worker of the job may ask. Returns the shard's version.

        Raises:
            InvalidRequestError: the job's policy does not aggregate iterations (not sync).
            RollbackError: the shard is at an earlier iteration than `version`.
            CheckpointError: the shard has no readable checkpoint of that iteration.
        """
        core = self._core
        with core.cond:
            state = core.require(fingerprint, rank)
            core.members.live(rank)
            if not core.policy.aggregates:
                raise InvalidRequestError(f"roll-back is for sync jobs; this one runs in {state.layout.spec.mode} mode")
            if version == state.version:
                return version
            if version > state.version:
                raise RollbackError(
                    f"shard {state.layout.index} is at iteration {state.version}, before {version}: "
                    "roll back to an earlier iteration"
                )
            source = self._rollback_source
        snap = source.load(version) if source is not None else None  # off the lock: a disk read
        if snap is None:
            raise CheckpointError(
                f"shard cannot roll back to iteration {version}: it has no readable checkpoint of it "
                "(checkpoints: --checkpoint-dir, sync mode writes them every --checkpoint-every-versions)"
            )
        with core.cond:
            state = core.require(fingerprint, rank)
            if version == state.version:  # another worker's roll-back came first
                return version
            if version > state.version:
                raise RollbackError(f"shard went back to iteration {state.version} meanwhile, before {version}")
            self._roll_back_to(state, snap)
            return version

    def _roll_back_to(self, state: ShardState, snap: ShardSnapshot) -> None:
        """Install snap's weights and optimizer state; the members stay, their clocks rewound."""
        core = self._core
        _, dropped = core.round.take()
        core.buffers.give_back([(p.grad, p.wire) for p in dropped])
        core.counters.rolled_back += state.version - snap.version
        core.history.append(("rollback", state.version, snap.version))
        _log.info(f"rolled back from iteration {state.version} to the checkpoint of iteration {snap.version} "
                  f"(a shard of the job restarted from it); {len(dropped)} buffered gradients dropped")
        members = core.members.members
        fresh = ShardState.restore(snap, core.members, core.now(), core.budget_bytes)
        for m in members.values():  # the job's members now, not the checkpoint's
            m.clock = min(m.clock, snap.version)
            m.last_push_clock = min(m.last_push_clock, snap.version - 1)
        core.members.members = members
        core.install(fresh)
        self._replica.rolled_back(fresh)
        core.marks = RestoreMarks(True, {}, set(members))
        core.notify()
