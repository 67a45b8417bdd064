"""Which workers belong to a shard: their clocks, leases and states, and eviction when a lease
runs out. Not thread-safe on its own: the shard calls it under its lock."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from psgrad.core.status import EVICTED, LEFT, LIVE, WorkerStatus
from psgrad.errors import EvictedError, InvalidRequestError, SupersededError, UnknownWorkerError, WorkerStateError


@dataclass
class Member:
    """What a shard knows about one worker."""

    rank: int
    last_seen: float
    clock: int = 0  # iterations completed (pushes handled, or the clock it joined at)
    pushes: int = 0
    state: str = LIVE
    last_push_clock: int = -1  # highest clock whose push was handled (applied, buffered or skipped)
    fresh: bool = False  # (re)joined and pushed nothing since: its first push may say where it continues
    incarnation: int = 0  # the worker process's number (JoinRequest.incarnation; 0: none said)


STALL_S = 1.0  # the lease reaper this much later than it meant to look: the process stalled (see expire)


class Membership:
    """The members of one shard, keyed by rank."""

    def __init__(self, lease_s: float, now: Callable[[], float]) -> None:
        self.lease_s = lease_s
        self._now = now
        self.members: dict[int, Member] = {}
        self._due: float | None = None  # when the lease reaper means to look next (see reaper_wait_s)
        self.stalled_s = 0.0  # the last stall of this process that expire() found (see there); 0: none since read

    def __len__(self) -> int:
        return len(self.members)

    def get(self, rank: int) -> Member | None:
        return self.members.get(rank)

    def live_clocks(self) -> dict[int, int]:
        """rank -> clock of every live worker."""
        return {r: m.clock for r, m in self.members.items() if m.state == LIVE}

    def live_ranks(self) -> set[int]:
        return {r for r, m in self.members.items() if m.state == LIVE}

    def expire(self) -> list[Member]:
        """Evict the live members whose lease ran out; returns them.

        A shard that did not run does not blame the workers for its own silence: where the lease
        reaper looks more than STALL_S after it meant to (the process was stopped, or starved of
        CPU), every live lease starts again now (stalled_s says for how long), as the workers'
        calls and heartbeats of that time went unanswered, not unsent."""
        now = self._now()
        if self._due is not None and now - self._due > STALL_S:
            self.stalled_s = now - self._due
            for m in self.members.values():
                if m.state == LIVE:
                    m.last_seen = max(m.last_seen, now)
            self._due = None  # (the reaper sets the next)
        gone = [m for m in self.members.values() if m.state == LIVE and now - m.last_seen > self.lease_s]
        for m in gone:
            m.state = EVICTED
        return gone

    def next_expiry_s(self) -> float | None:
        """Seconds until the next lease runs out (None: no live member)."""
        now = self._now()
        times = [m.last_seen + self.lease_s - now for m in self.members.values() if m.state == LIVE]
        return max(0.0, min(times)) + 1e-3 if times else None

    def reaper_wait_s(self) -> float | None:
        """How long the lease reaper may wait before it looks again (None: no live member): until
        the next lease runs out, and at most a quarter lease (and 1 s), so that expire() tells a
        stall of this process from an idle wait."""
        wait = self.next_expiry_s()
        if wait is None:
            self._due = None
            return None
        wait = min(wait, self.lease_s / 4, 1.0)
        self._due = self._now() + wait
        return wait

    def live(self, rank: int, incarnation: int = 0) -> Member:
        """The live member of that rank, its lease renewed; incarnation: the calling process's
        number (0: none said, not checked).

        Raises:
            UnknownWorkerError: it never joined (or the shard restarted without it).
            EvictedError: its lease ran out (the worker may join again).
            WorkerStateError: it left.
            SupersededError: another process joined as that rank since the caller did.
        """
        member = self.members.get(rank)
        if member is None:
            raise UnknownWorkerError(f"worker rank {rank} has not joined this shard (Join first)")
        if member.state == EVICTED:
            raise EvictedError(
                f"worker rank {rank} was evicted: no call for longer than its lease of "
                f"{self.lease_s:g} s (raise --lease-s on the servers if the worker is merely slow); "
                "join again to continue"
            )
        if member.state == LEFT:
            raise WorkerStateError(f"worker rank {rank} already left the job; start it again to rejoin")
        if incarnation and member.incarnation and incarnation != member.incarnation:
            raise SupersededError(
                f"another process joined as worker rank {rank} after this one did, so this one's calls are refused: "
                f"were two workers started with rank {rank}? Give each its own rank (0 to num_workers - 1); a "
                "restarted worker takes its rank over by joining, as that process did")
        member.last_seen = self._now()
        return member

    def register(self, rank: int, start_clock: int, incarnation: int = 0) -> tuple[Member, bool]:
        """Add rank as a live member, or bring a left/evicted one back; returns (member, whether it
        is new or revived). A returning worker continues from a clock at least past its own last
        push, so its new pushes are never mistaken for duplicates. incarnation: the joining
        process's number (0: none said): the rank is its from now on (see live)."""
        member = self.members.get(rank)
        changed = True
        if member is None:
            member = self.members[rank] = Member(rank, self._now(), clock=start_clock)
        elif member.state != LIVE:
            member.state = LIVE
            member.clock = max(start_clock, member.last_push_clock + 1)
        else:
            changed = False
        member.fresh = member.fresh or changed
        member.last_seen = self._now()
        if incarnation:
            member.incarnation = incarnation
        return member, changed

    def leave(self, rank: int, incarnation: int = 0) -> Member | None:
        """Mark a live rank as left on purpose; returns it (None if it was not live, or another
        process than `incarnation`'s holds it: see live)."""
        member = self.members.get(rank)
        if member is None or member.state != LIVE:
            return None
        if incarnation and member.incarnation and incarnation != member.incarnation:
            return None
        member.state = LEFT
        return member

    def ceiling(self, version: int) -> int:
        """The furthest clock a rejoining worker may say it continues from: one past
        the shard's version or any member's clock, whichever is larger. A worker's clock on
        another shard is at most that (every shard sees the same workers' pushes), so a clock
        beyond it is forged or corrupt."""
        return max([version, *(m.clock for m in self.members.values())]) + 1

    def check_clock(self, member: Member, clock: int, announced: bool = False, version: int = 0) -> None:
        """A push's clock must be the worker's next one (a retry repeats an older one, which is
        acknowledged as a duplicate). A worker that has not pushed since it (re)joined continues
        wherever it says — from its last push, or from the largest clock another shard gave it —
        where it rejoined, up to ceiling(version); one whose clocks a restart from a checkpoint lost (`announced`)
        continues wherever it says.

        Raises:
            InvalidRequestError: a clock ahead of the next one, or a rejoining worker's beyond the
                ceiling (a forged clock would make the worker's real pushes look like duplicates);
                nothing is recorded.
        """
        if clock <= member.last_push_clock or announced:
            return
        if member.fresh or member.pushes == 0:
            self.check_announced(member, clock, version)
            return
        if clock == member.clock or clock == member.last_push_clock + 1:  # (async duplex: its next pull came first)
            return
        raise InvalidRequestError(
            f"push from worker rank {member.rank} is for clock {clock}, but its next clock is {member.clock} "
            f"(its last push was {member.last_push_clock}); refused, nothing recorded"
        )

    def check_announced(self, member: Member, clock: int, version: int) -> None:
        """A worker says it continues from `clock` (its first pull or push after joining). One that
        rejoins (it pushed before) may not go beyond ceiling(version); a new one says where it
        starts (the largest clock the job's shards gave it).

        Raises:
            InvalidRequestError: a rejoining worker's clock beyond the ceiling; nothing is recorded.
        """
        if member.pushes == 0:
            return
        ceiling = self.ceiling(version)
        if clock > ceiling:
            raise InvalidRequestError(
                f"worker rank {member.rank} says it continues from clock {clock}, beyond any this shard has seen "
                f"(at most {ceiling}: its version and every worker's clock, plus one); refused, nothing recorded"
            )

    @staticmethod
    def advance(member: Member, clock: int) -> None:
        """member's push for clock was handled: its clock moves past it."""
        member.clock = max(member.clock, clock + 1)
        member.last_push_clock = clock
        member.pushes += 1
        member.fresh = False

    def statuses(self) -> tuple[WorkerStatus, ...]:
        now = self._now()
        return tuple(
            WorkerStatus(m.rank, m.clock, m.state, now - m.last_seen, m.pushes)
            for m in sorted(self.members.values(), key=lambda m: m.rank)
        )
