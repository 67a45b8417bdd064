"""The shard's hooks for sync with backup workers (late pushes dropped) and `--staleness auto`
(the bound adjusted as pulls are granted); called under the shard's lock, only in those modes."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from psgrad.core.backup import LATE_REASON
from psgrad.core.consistency import ClockView, ConsistencyPolicy
from psgrad.errors import RollbackError
from psgrad.server.ledger import Counters, PushResult
from psgrad.server.membership import Member, Membership


def drop_if_late(
    policy: ConsistencyPolicy, view: ClockView, member: Member, clock: int, base_version: int, restored: bool,
    counters: Counters, history: deque[tuple[Any, ...]],
) -> PushResult | None:
    """A push computed on an iteration that is already complete: counted, recorded ("late", rank,
    clock, base version, shard version) and dropped, its clock handled; None when it is on time
    (then the worker's iteration is recorded for its gate).

    Raises:
        RollbackError: computed on weights newer than a restored shard's (the job rolls back).
    """
    if restored and base_version > view.version:
        raise RollbackError(
            f"sync push from worker rank {member.rank} was computed on version {base_version}, but shard is at "
            f"iteration {view.version}: it was restored from a checkpoint, so the job rolls back"
        )
    policy.handled(member.rank, min(base_version, view.version))
    if not policy.is_late(base_version, view):
        return None
    Membership.advance(member, clock)
    counters.late_dropped += 1
    history.append(("late", member.rank, clock, base_version, view.version))
    return PushResult(
        False, f"{LATE_REASON} iteration {base_version} completed without it (shard at {view.version})", view.version, 0
    )


def observe_pull(
    policy: ConsistencyPolicy, parked_at: float, now: float, view: ClockView, history: deque[tuple[Any, ...]],
    notify: Callable[[], None],
) -> int:
    """A pull granted at `now` (parked at the gate since parked_at; 0: it did not wait), for the
    adaptive bound. A change of s is recorded ("bound", s, version) and notified (a raised bound
    may open the gate for parked pulls). Returns the bound in effect."""
    waited = now - parked_at if parked_at else 0.0
    if policy.observe_pull(waited, now, len(view.live_clocks), view.version):
        history.append(("bound", policy.staleness, view.version))
        notify()
    return policy.staleness
