"""One shard's state: master weights, optimizer, version, worker membership and counters; no network."""
from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from psgrad.codec import PayloadWriter, WireBuffer, data_frames
from psgrad.config import ServerConfig, JobSpec
from psgrad.errors import (
    InvalidRequestError,
    JobMismatchError,
    NotInitializedError,
    WorkerStateError,
)
from psgrad.optimizers import ShardOptimizer, make_optimizer
from psgrad.sharding import ParamSpec

NOT_INITIALIZED_HINT = (
    "shard is not initialized: start worker rank 0 (the chief) against these servers first; "
    "it sends the job spec and the initial weights"
)


@dataclass
class Member:
    """What a shard knows about one worker."""

    rank: int
    last_seen: float
    clock: int = 0
    pushes: int = 0
    left: bool = False
    last_push_clock: int = -1  # highest clock whose push was handled (applied or skipped)


@dataclass(frozen=True)
class Layout:
    """What the chief installed: the job, the model's parameters, this shard's range, the fingerprint."""

    spec: JobSpec
    params: tuple[ParamSpec, ...]
    index: int
    start: int
    end: int
    fingerprint: str

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass
class PushResult:
    applied: bool
    reason: str
    version: int
    staleness: int


@dataclass
class _Counters:
    pushes_applied: int = 0
    pushes_duplicate: int = 0
    pushes_rejected: int = 0
    pulls: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    staleness: Counter[int] = field(default_factory=Counter)


def explain_mismatch(mine: Layout, theirs: Layout, rank: int) -> str | None:
    """A message naming the first thing that differs between two layouts, or None if equal."""
    who = f"worker rank {rank}"
    diffs = mine.spec.differences(theirs.spec)
    if diffs:
        parts = "; ".join(f"{n}: shard has {a!r}, {who} sent {b!r}" for n, a, b in diffs)
        return f"job spec differs from the one this shard was initialized with ({parts})"
    if len(mine.params) != len(theirs.params):
        return (
            f"model differs: this shard was initialized with {len(mine.params)} parameters, "
            f"{who} has {len(theirs.params)}"
        )
    for i, (a, b) in enumerate(zip(mine.params, theirs.params)):
        if a != b:
            return (
                f"model differs at parameter {i}: shard has {a.name} {list(a.shape)} {a.dtype}, "
                f"{who} has {b.name} {list(b.shape)} {b.dtype}"
            )
    if (mine.index, mine.start, mine.end) != (theirs.index, theirs.start, theirs.end):
        return (
            f"shard plan differs: this server is shard {mine.index} owning [{mine.start}, {mine.end}), "
            f"{who} expects shard {theirs.index} owning [{theirs.start}, {theirs.end}) "
            "(is --servers in the same order for every worker?)"
        )
    if mine.fingerprint != theirs.fingerprint:
        return f"fingerprint differs: shard has {mine.fingerprint}, {who} sent {theirs.fingerprint}"
    return None


class Shard:
    """Thread-safe state of one parameter shard. Every public method may be called concurrently."""

    def __init__(self, config: ServerConfig, now: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._now = now
        self._cond = threading.Condition()
        self._started = now()
        self.layout: Layout | None = None
        self._weights: torch.Tensor | None = None
        self._optimizer: ShardOptimizer | None = None
        self._pull_wire: WireBuffer | None = None
        self._pool: list[tuple[torch.Tensor, WireBuffer]] = []
        self.version = 0
        self._members: dict[int, Member] = {}
        self._counters = _Counters()

    # ----------------------------------------------------------------- membership
    def _touch(self, rank: int) -> Member:
        member = self._members.get(rank)
        if member is None:
            member = self._members[rank] = Member(rank, self._now())
        member.last_seen = self._now()
        return member

    def touch(self, rank: int) -> int:
        """Renew rank's lease; returns the shard version."""
        with self._cond:
            self._touch(rank)
            return self.version

    def leave(self, rank: int) -> None:
        """Mark rank as having left the job on purpose."""
        with self._cond:
            self._touch(rank).left = True

    def member_state(self, member: Member) -> str:
        if member.left:
            return "left"
        return "expired" if self._now() - member.last_seen > self._config.lease_s else "live"

    # ----------------------------------------------------------------- join / init
    def _require_layout(self, fingerprint: str, rank: int) -> Layout:
        layout = self.layout
        if layout is None:
            raise NotInitializedError(NOT_INITIALIZED_HINT)
        if fingerprint != layout.fingerprint:
            raise JobMismatchError(
                f"worker rank {rank} sent fingerprint {fingerprint or '(none)'}, but this shard was "
                f"initialized for {layout.fingerprint}: the worker's model or job spec differs "
                "(Join reports which field)"
            )
        return layout

    def join(self, rank: int, layout: Layout, wait_s: float = 0.0) -> bool:
        """Check a worker's layout against the installed one; optionally wait for the chief.

        Returns whether the shard is initialized. Raises JobMismatchError naming what differs.
        """
        deadline = self._now() + max(0.0, wait_s)
        with self._cond:
            self._touch(rank)
            while self.layout is None and self._now() < deadline:
                self._cond.wait(timeout=min(1.0, max(0.0, deadline - self._now())))
                self._touch(rank)
            if self.layout is None:
                return False
            problem = explain_mismatch(self.layout, layout, rank)
            if problem:
                raise JobMismatchError(problem)
            return True

    def initialize(self, rank: int, layout: Layout, weights: torch.Tensor) -> bool:
        """Install the job and initial weights. Idempotent for an identical layout.

        Returns True when the shard was already initialized with the same layout (nothing changes).
        """
        if weights.dtype != torch.float32 or weights.numel() != layout.numel:
            raise InvalidRequestError(
                f"initial weights of shard {layout.index} must be {layout.numel} float32 values, "
                f"got {weights.numel()} {weights.dtype}"
            )
        optimizer = make_optimizer(layout.spec, layout.numel)
        with self._cond:
            self._touch(rank)
            if self.layout is not None:
                problem = explain_mismatch(self.layout, layout, rank)
                if problem:
                    raise JobMismatchError(problem)
                return True
            self.layout = layout
            self._weights = weights
            self._optimizer = optimizer
            self._pull_wire = WireBuffer(layout.numel, layout.spec.wire_dtype)
            self._cond.notify_all()
            return False

    # ----------------------------------------------------------------- pull
    def pull_frames(self, rank: int, clock: int, fingerprint: str) -> tuple[int, list[bytes]]:
        """Copy the current weights, as wire frames, together with the version they belong to."""
        with self._cond:
            self._require_layout(fingerprint, rank)
            member = self._touch(rank)
            if member.left:
                raise WorkerStateError(f"worker rank {rank} already left the job; start a new worker")
            assert self._weights is not None and self._pull_wire is not None
            payload = self._pull_wire.encode(self._weights)
            frames = list(data_frames(payload, self._config.chunk_bytes))
            self._counters.pulls += 1
            self._counters.bytes_out += len(payload)
            return self.version, frames

    # ----------------------------------------------------------------- push
    def push_target(
        self, rank: int, clock: int, base_version: int, numel: int, dtype: str, fingerprint: str
    ) -> tuple[torch.Tensor, WireBuffer, PayloadWriter]:
        """Validate a push header and lend a receive buffer (give it back via finish/abort_push)."""
        with self._cond:
            layout = self._require_layout(fingerprint, rank)
            member = self._touch(rank)
            if member.left:
                self._counters.pushes_rejected += 1
                raise WorkerStateError(f"push from worker rank {rank}, which already left the job")
            if numel != layout.numel:
                self._counters.pushes_rejected += 1
                raise InvalidRequestError(
                    f"push from worker rank {rank} has {numel} elements, but shard {layout.index} owns "
                    f"range [{layout.start}, {layout.end}) = {layout.numel} elements"
                )
            if dtype != layout.spec.wire_dtype:
                self._counters.pushes_rejected += 1
                raise InvalidRequestError(
                    f"push from worker rank {rank} is {dtype!r}, the job's wire dtype is "
                    f"{layout.spec.wire_dtype!r}"
                )
            if base_version > self.version:
                self._counters.pushes_rejected += 1
                raise InvalidRequestError(
                    f"push from worker rank {rank} claims base version {base_version}, newer than "
                    f"shard version {self.version}"
                )
            if self._pool:
                grad, wire = self._pool.pop()
            else:
                grad, wire = torch.empty(layout.numel), WireBuffer(layout.numel, dtype)
        writer = PayloadWriter(wire.receive_view(grad), f"push from worker rank {rank}")
        return grad, wire, writer

    def release(self, grad: torch.Tensor, wire: WireBuffer) -> None:
        """Return a receive buffer to the pool."""
        with self._cond:
            self._pool.append((grad, wire))

    def reject(self) -> None:
        """Count a push that failed after its header was accepted."""
        with self._cond:
            self._counters.pushes_rejected += 1

    def apply_push(
        self, rank: int, clock: int, base_version: int, grad: torch.Tensor, wire: WireBuffer, nbytes: int
    ) -> PushResult:
        """Apply a fully received gradient once; duplicates of (rank, clock) are acknowledged only."""
        wire.finish_receive(grad)
        # A sum is non-finite whenever some element is NaN or +-inf, and costs far less than
        # isfinite(grad).all() (no mask allocated); only an overflowing sum needs the exact check.
        finite = math.isfinite(float(grad.sum())) or bool(torch.isfinite(grad).all())
        with self._cond:
            member = self._touch(rank)
            self._counters.bytes_in += nbytes
            if clock <= member.last_push_clock:
                self._counters.pushes_duplicate += 1
                return PushResult(False, f"duplicate push (rank {rank}, clock {clock})", self.version, 0)
            if not finite:
                bad = int((~torch.isfinite(grad)).sum())
                if self._config.nonfinite == "reject":
                    self._counters.pushes_rejected += 1
                    raise InvalidRequestError(
                        f"gradient from worker rank {rank} at clock {clock} has {bad} non-finite values; "
                        "the shard is unchanged (start the server with --nonfinite skip|allow to change this)"
                    )
                if self._config.nonfinite == "skip":
                    self._counters.pushes_rejected += 1
                    member.clock = clock + 1
                    member.last_push_clock = clock
                    return PushResult(False, f"skipped: {bad} non-finite values", self.version, 0)
            assert self._weights is not None and self._optimizer is not None
            staleness = self.version - base_version
            self._optimizer.apply(self._weights, grad)
            self.version += 1
            member.clock = clock + 1
            member.last_push_clock = clock
            member.pushes += 1
            self._counters.pushes_applied += 1
            self._counters.staleness[staleness] += 1
            return PushResult(True, "", self.version, staleness)

    # ----------------------------------------------------------------- status
    def weights_copy(self) -> torch.Tensor | None:
        """A copy of the master weights (tests and checkpoints)."""
        with self._cond:
            return None if self._weights is None else self._weights.clone()

    def status(self) -> dict:
        """A consistent snapshot of counters, membership and the staleness histogram."""
        with self._cond:
            now = self._now()
            c = self._counters
            return {
                "layout": self.layout,
                "version": self.version,
                "pushes_applied": c.pushes_applied,
                "pushes_duplicate": c.pushes_duplicate,
                "pushes_rejected": c.pushes_rejected,
                "pulls": c.pulls,
                "bytes_in": c.bytes_in,
                "bytes_out": c.bytes_out,
                "staleness": dict(sorted(c.staleness.items())),
                "uptime_s": now - self._started,
                "workers": [
                    (m.rank, m.clock, self.member_state(m), now - m.last_seen, m.pushes)
                    for m in sorted(self._members.values(), key=lambda m: m.rank)
                ],
            }

