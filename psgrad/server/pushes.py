"""The push half of a shard: validating a push header, lending it a receive buffer, and handling
the received gradient once (duplicate, refused, skipped, buffered or applied) as the consistency
policy decides; sync rounds complete here. Mixed into Shard, under the shard's lock."""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from psgrad.config import ServerConfig
from psgrad.core.codecs import WireBuffer, get_codec
from psgrad.core.consistency import ClockView, ConsistencyPolicy, PushDecision
from psgrad.core.layout import explain_push_header
from psgrad.core.optimizers import UpdateRule
from psgrad.core.status import PublishedStatus
from psgrad.errors import EvictedError, InvalidRequestError, NonFiniteGradientError, RollbackError, WorkerStateError
from psgrad.server.aggregation import Pending, SyncRound
from psgrad.server.buffers import Buffers
from psgrad.server.delay_comp import DelayCompensation
from psgrad.server.ledger import Counters, PushResult
from psgrad.server.membership import Member, Membership
from psgrad.server.mode_hooks import drop_if_late
from psgrad.server.state import ShardState
from psgrad.server.transfers import PushWriter, count_nonfinite


class PushPath:
    """Push handling, sharing the state, lock and components of the Shard it is part of."""

    _cond: threading.Condition
    _config: ServerConfig
    _state: ShardState | None
    _members: Membership
    _policy: ConsistencyPolicy
    _rule: UpdateRule | None
    _dc: DelayCompensation | None  # DC-ASGD: each worker's pulled weights
    _buffers: Buffers
    _round: SyncRound
    _counters: Counters
    #: the same-host published versions' status (the servicer's Publisher, once it has one)
    published_status: Callable[[], PublishedStatus] = PublishedStatus
    history: deque[tuple[Any, ...]]
    _restored_clocks: dict[int, int]  # rank -> last push in the checkpoint, until its next push
    _restored: bool  # the shard was restored from a checkpoint
    _bound: int  # --staleness auto: the bound in effect (0: a fixed bound)

    def _require(self, fingerprint: str, rank: int) -> ShardState:
        raise NotImplementedError

    def _refresh(self) -> None:
        raise NotImplementedError

    def _notify(self) -> None:
        raise NotImplementedError

    def _view(self) -> ClockView:
        raise NotImplementedError

    def _updated(self) -> None:
        raise NotImplementedError

    def _before_apply(self, grad: torch.Tensor, lr_scale: float, lr: float | None) -> None:
        raise NotImplementedError

    def _replicate_members(self) -> None:
        raise NotImplementedError

    def push_target(
        self, rank: int, clock: int, base_version: int, numel: int, dtype: str, fingerprint: str,
        lr: float | None = None,
    ) -> tuple[torch.Tensor, WireBuffer, PushWriter]:
        """Validate a push header and lend a receive buffer (apply_push or release gives it back).
        lr: the learning rate in effect for the push (the worker's schedule; None: the job's)."""
        with self._cond:
            state = self._require(fingerprint, rank)
            # A shard restored from a checkpoint is behind the weights its workers pulled before the
            # crash: a gradient computed on those counts as fresh (staleness 0), not as a bad header.
            newest = state.version if not self._restored else max(state.version, base_version)
            problem = explain_push_header(state.layout, rank, numel, dtype, base_version, newest, lr)
            if problem:
                self._counters.pushes_rejected += 1
                raise InvalidRequestError(problem)
            try:
                member = self._members.live(rank)
                if not self._policy.aggregates:  # (sync: the policy takes only the current iteration)
                    Membership.check_clock(member, clock, rank in self._restored_clocks)
            except (WorkerStateError, InvalidRequestError):
                self._counters.pushes_rejected += 1
                raise
            lr = state.resolve_lr(rank, clock, lr)
            grad, wire = self._buffers.lend(state.layout.numel, dtype, lambda: state.weights)
            exact = get_codec(dtype).exact
            writer = PushWriter(rank, grad, wire.receive_view(grad), f"push from worker rank {rank}", exact)
            writer.lr = lr
            # A gradient that the worker's segment holds may be applied from there, in place: by an
            # update rule that only reads it, applied on arrival, to weights without buffers.
            writer.may_borrow = exact and not self._policy.aggregates and state.optimizer.reads_grad_only()
            # (DC-ASGD rewrites the gradient before the apply: never in the worker's memory)
            writer.may_borrow = writer.may_borrow and state.layout.trainable == state.layout.numel and self._dc is None
            writer.target = state.key
            self._buffers.track(grad, writer)
            if self._rule is not None and clock > member.last_push_clock:  # not a duplicate
                scale = self._policy.lr_scale(max(0, state.version - base_version), state.layout.spec.staleness_lr)
                writer.stage(state.weights, self._rule, state.optimizer.step_lr(lr, scale), state.version)
        return grad, wire, writer

    def may_check_as_applied(self) -> bool:
        """Whether a borrowed gradient may be checked as it is applied, on this thread and a helper
        (apply_checked): when it is the only push in flight (among others, each is checked as it
        arrives, beside another's apply) and torch runs one thread (else it spreads ops itself)."""
        return self._buffers.lent < 2 and torch.get_num_threads() == 1

    def release(self, grad: torch.Tensor, wire: WireBuffer) -> None:
        """Return a receive buffer: to the pool, or to the allocator if it was lent beyond the limit."""
        with self._cond:
            self._buffers.release(grad, wire)

    def reject(self) -> None:
        """Count a push that failed after its header was accepted."""
        with self._cond:
            self._counters.pushes_rejected += 1

    def apply_push(
        self, rank: int, clock: int, base_version: int, grad: torch.Tensor, wire: WireBuffer, nbytes: int
    ) -> PushResult:
        """Handle a fully received gradient once, as the policy decides: apply it (async/ssp) or
        buffer it for the iteration's mean (sync). Duplicates of (rank, clock) are acknowledged
        only. Takes ownership of the buffers."""
        kept = False
        with self._cond:
            writer = self._buffers.writer_of(grad)
        try:
            wire.finish_receive(grad)
            staged = writer is not None and writer.staged
            source = writer.borrowed if writer is not None and writer.borrowed is not None else grad
            lr = writer.lr if writer is not None else None
            restore = writer.restore_from if writer is not None and writer.check_deferred else None
            if restore is not None:  # checked as it is applied in place, undone from this copy of the weights
                bad = 0
            else:
                bad = writer.nonfinite if writer is not None and writer.checked else count_nonfinite(grad)
            with self._cond:
                state = self._state
                assert state is not None
                if not staged and not self._policy.aggregates:
                    known = self._members.get(rank)
                    if known is None or clock > known.last_push_clock:  # (re-checked below)
                        # an in-place update must not change weights a pull streams
                        self._buffers.await_reads(state.weights, state.layout.spec.wire_dtype)
                self._refresh()
                self._counters.bytes_in += nbytes
                member = self._members.live(rank)
                if writer is not None and writer.revoked:
                    raise EvictedError(f"worker rank {rank} was evicted while pushing; nothing was applied")
                if clock <= member.last_push_clock:
                    self._counters.pushes_duplicate += 1
                    return PushResult(False, f"duplicate push (rank {rank}, clock {clock})", state.version, 0)
                if self._policy.drops_late:  # sync with backup workers: a late gradient is dropped
                    late = drop_if_late(self._policy, self._view(), member, clock, base_version, self._restored,
                                        self._counters, self.history)
                    if late is not None:
                        self._replicate_members()
                        return late
                try:
                    decision = self._policy.decide_push(rank, clock, self._view(), self._restored)
                    if not self._policy.aggregates:
                        Membership.check_clock(member, clock, rank in self._restored_clocks)
                except (InvalidRequestError, RollbackError):
                    self._counters.pushes_rejected += 1
                    raise
                lost_from = self._restored_clocks.pop(rank, None)
                if lost_from is not None:  # its pushes between the checkpoint and this one were lost
                    self._counters.updates_lost += max(0, clock - lost_from - 1)
                if bad and self._config.nonfinite != "allow":
                    return self._refuse_nonfinite(member, clock, bad, decision)
                if decision is PushDecision.BUFFER:
                    self._round.add(rank, Pending(grad, wire, clock, base_version, lr))
                    self._buffers.keep(grad)
                    kept = True
                    Membership.advance(member, clock)
                    before = state.version
                    self._refresh()
                    if state.version > before:
                        return PushResult(True, "", state.version, 0, lr=lr)
                    return PushResult(False, "buffered until every live worker pushed", state.version, 0, True, lr)
                staleness = max(0, state.version - base_version)
                if staged:  # the buffer holds the next weights: swap them in
                    assert writer is not None and writer.staged_version == state.version
                    old, state.weights = state.weights, grad
                    self._buffers.commit(grad, old, wire)
                    kept = True
                else:
                    scale = self._policy.lr_scale(staleness, state.layout.spec.staleness_lr)
                    state.average_buffer_deltas(source)
                    if self._dc is not None:  # DC-ASGD: compensated for the updates since its pull
                        self._dc.compensate(rank, base_version, state.weights, source)
                    allow = self._config.nonfinite == "allow"
                    if restore is not None and (writer is None or writer.target != state.key or allow):
                        # the weights moved on (another push applied while this one waited), or it need
                        # not be checked: the copy would not undo it; check, then apply
                        restore, bad = None, count_nonfinite(source)
                        if bad and not allow:
                            return self._refuse_nonfinite(member, clock, bad, decision)
                    if restore is not None:  # checked as it is applied, undone from the copy if need be
                        bad = state.apply_checked(source, scale, lr, restore)
                        if bad:
                            return self._refuse_nonfinite(member, clock, bad, decision)
                        self._before_apply(source, scale, lr)
                    else:
                        self._before_apply(source, scale, lr)  # replication: the backup applies the same gradient
                        state.apply(source, scale, lr)
                state.version += 1
                Membership.advance(member, clock)
                self._updated()
                self._counters.pushes_applied += 1
                self._counters.staleness[staleness] += 1
                self.history.append(("apply", state.version, ((rank, clock, staleness),)))
                self._notify()
                return PushResult(True, "", state.version, staleness, lr=lr, bound=self._bound)
        finally:
            if not kept:
                self.release(grad, wire)

    def _refuse_nonfinite(self, member: Member, clock: int, bad: int, decision: PushDecision) -> PushResult:
        """A gradient with NaN/inf: refused (--nonfinite reject) or acknowledged unapplied (skip)."""
        self._counters.pushes_rejected += 1
        if self._config.nonfinite == "reject":
            raise NonFiniteGradientError(
                f"gradient from worker rank {member.rank} at clock {clock} has {bad} non-finite values; "
                "the shard is unchanged (start the server with --nonfinite skip|allow to change this)"
            )
        Membership.advance(member, clock)  # "skip": acknowledged, never applied
        if decision is PushDecision.BUFFER:
            self._round.skip()
            self._refresh()  # the skipped worker no longer owes this iteration
        self._replicate_members()  # a backup that takes over knows the clock moved
        return PushResult(False, f"skipped: {bad} non-finite values", self._state.version if self._state else 0, 0)

    def _complete_iteration(self) -> bool:
        """Apply the mean of the buffered gradients once the policy says the iteration is complete
        (sync: no live worker still owes it)."""
        state = self._state
        if state is None or not self._round.handled:  # nothing buffered: no clock view to build
            return False
        if not self._policy.iteration_complete(state.version, self._view(), self._round.handled):
            return False
        ranks, items = self._round.take()
        if items:  # else every gradient of the iteration was skipped: an empty update
            # only snapshots (observe) can be streaming here; rare
            self._buffers.detach_reads(state.weights, state.layout.spec.wire_dtype)
            mean = SyncRound.mean(items)
            lr = items[0].lr  # the lowest rank's: every worker's schedule gives the iteration's lr
            self._before_apply(mean, 1.0, lr)  # replication: the backup applies the same mean
            state.apply(mean, 1.0, lr)
        applied_at = state.version
        state.version += 1
        self._updated()
        stale = tuple((r, it.clock, applied_at - it.base_version) for r, it in zip(ranks, items))
        for _, _, s in stale:
            self._counters.staleness[s] += 1
        self._counters.pushes_applied += len(items)
        self.history.append(("apply", state.version, stale))
        self._buffers.give_back([(it.grad, it.wire) for it in items])
        return True
