"""A shard's snapshots and what they are for: handing them to a checkpoint writer, serving one after a
restart, and (sync) rolling the shard back to an iteration every shard of the job can return to.
Mixed into Shard, under the shard's lock."""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from psgrad.core.consistency import ConsistencyPolicy
from psgrad.errors import CheckpointError, InvalidRequestError, JobMismatchError, NotInitializedError, RollbackError
from psgrad.server.aggregation import SyncRound
from psgrad.server.buffers import Buffers
from psgrad.server.ledger import Counters
from psgrad.server.membership import Membership
from psgrad.server.state import NOT_INITIALIZED_HINT, ShardSnapshot, ShardState


class RollbackSource(Protocol):
    """Where a shard finds the states it can roll back to (its checkpoints)."""

    def versions(self) -> list[int]:
        """The versions of the snapshots on offer."""

    def load(self, version: int) -> ShardSnapshot | None:
        """The snapshot of that version, read back whole; None if there is none (or it is damaged)."""


class Recovery:
    """Snapshots, restore and roll-back, sharing the state, lock and components of the Shard."""

    _cond: threading.Condition
    _reaper_wake: threading.Condition
    _state: ShardState | None
    _members: Membership
    _policy: ConsistencyPolicy
    _buffers: Buffers
    _round: SyncRound
    _counters: Counters
    history: deque[tuple[Any, ...]]
    _now: Callable[[], float]
    _restored_clocks: dict[int, int]  # rank -> last push in the checkpoint, until its next push
    _restored: bool  # the shard was restored from a checkpoint (or rolled back)
    _rewound: set[int]  # ranks whose clocks a restore or roll-back set, until their next granted pull
    _snapshot_every: int
    _snapshot_sink: Callable[[ShardSnapshot], None] | None
    _rollback_source: RollbackSource | None

    def _install(self, state: ShardState) -> None:
        raise NotImplementedError

    def _notify(self) -> None:
        raise NotImplementedError

    def _require(self, fingerprint: str, rank: int) -> ShardState:
        raise NotImplementedError

    def _replicate(self) -> None:
        raise NotImplementedError

    def _replicate_rollback(self, state: ShardState) -> None:
        raise NotImplementedError

    def snapshot(self) -> ShardSnapshot:
        """A copy of the shard's state (see ShardState.snapshot), taken under the lock: a memory
        copy of the weights and the optimizer state, nothing slower.

        Raises:
            NotInitializedError: there is no state yet.
        """
        with self._cond:
            if self._state is None:
                raise NotInitializedError(NOT_INITIALIZED_HINT)
            return self._state.snapshot(frozenset(self._round.pending))

    def restore(self, snap: ShardSnapshot) -> None:
        """Serve the state a snapshot holds (a restart or a standby taking over): every member
        continues from its recorded clocks, and a push it had made before is a duplicate.

        Raises:
            JobMismatchError: this shard already serves a job.
        """
        with self._cond:
            if self._state is not None:
                raise JobMismatchError("shard already serves a job: restore into a fresh shard")
            self._install(ShardState.restore(snap, self._members, self._now()))
            self._restored_clocks = {m.rank: m.last_push_clock for m in snap.members}
            self._restored = True
            self._rewound = {m.rank for m in snap.members}
            self._notify()
            self._reaper_wake.notify_all()

    def snapshot_at_multiples(self, every: int, sink: Callable[[ShardSnapshot], None]) -> None:
        """From now on hand sink a snapshot when the chief initializes the shard (and, where the
        first iteration waits for every worker, again once all have joined), and each time an
        update brings the version to a multiple of `every` (0: never; taken under the lock: a memory
        copy; sink must not block). In sync mode every shard then snapshots the same iterations."""
        with self._cond:
            self._snapshot_every, self._snapshot_sink = every, sink

    def _offer_snapshot(self) -> None:
        """Hand the sink a snapshot now (caller holds the lock)."""
        if self._snapshot_sink is not None and self._state is not None:
            self._snapshot_sink(self._state.snapshot(frozenset(self._round.pending)))

    def _updated(self) -> None:
        """An update was applied (caller holds the lock): its record goes to the backup, and a
        snapshot to the checkpointer at every multiple of K."""
        self._replicate()
        state = self._state
        if state is not None and self._snapshot_every and state.version % self._snapshot_every == 0:
            self._offer_snapshot()

    @property
    def checkpoints_aligned(self) -> bool:
        """Whether only the snapshots handed over at multiples of K are to be written: sync mode,
        where every shard takes them at the same iterations (a roll-back target must be on all)."""
        return self._state is not None and self._policy.aggregates

    # ----------------------------------------------------------------- sync roll-back
    def set_rollback_source(self, source: RollbackSource | None) -> None:
        """Where rollback() finds older states (the server's checkpoints)."""
        with self._cond:
            self._rollback_source = source

    def rollback_points(self, rank: int, fingerprint: str) -> tuple[int, list[int]]:
        """(version, the versions this shard can roll back to: its current one and its checkpoints
        up to it, newest first). A live worker asks; its lease is renewed."""
        with self._cond:
            state = self._require(fingerprint, rank)
            self._members.live(rank)
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
            InvalidRequestError: the job is not in sync mode.
            RollbackError: the shard is at an earlier iteration than `version`.
            CheckpointError: the shard has no readable checkpoint of that iteration.
        """
        with self._cond:
            state = self._require(fingerprint, rank)
            self._members.live(rank)
            if not self._policy.aggregates:
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
        with self._cond:
            state = self._require(fingerprint, rank)
            if version == state.version:  # another worker's roll-back came first
                return version
            if version > state.version:
                raise RollbackError(f"shard went back to iteration {state.version} meanwhile, before {version}")
            self._roll_back_to(state, snap)
            return version

    def _roll_back_to(self, state: ShardState, snap: ShardSnapshot) -> None:
        """Install snap's weights and optimizer state; the members stay, their clocks rewound."""
        _, dropped = self._round.take()
        self._buffers.give_back([(p.grad, p.wire) for p in dropped])
        self._counters.rolled_back += state.version - snap.version
        self.history.append(("rollback", state.version, snap.version))
        members = self._members.members
        fresh = ShardState.restore(snap, self._members, self._now())
        for m in members.values():  # the job's members now, not the checkpoint's
            m.clock = min(m.clock, snap.version)
            m.last_push_clock = min(m.last_push_clock, snap.version - 1)
        self._members.members = members
        self._install(fresh)
        self._replicate_rollback(fresh)
        self._restored_clocks = {}
        self._restored = True
        self._rewound = set(members)
        self._notify()
