"""The push path of a shard: validating a push header, lending it a receive buffer, and handling
the received gradient once (duplicate, late, refused, skipped, buffered or applied) as the
consistency policy decides; sync rounds complete here. A collaborator of the shard core: it acts
under the core's lock, on the core's state, and tells the replica what it applies."""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import NoReturn

import torch

from psgrad.core.codecs import WireBuffer, get_codec
from psgrad.core.consistency import PushDecision
from psgrad.core.gradient_codecs import CompressedWire, RangeCodec
from psgrad.core.layout import explain_push_header
from psgrad.core.modes import tables_mode_of
from psgrad.core.push_outcome import DUPLICATE_REASON
from psgrad.core.unused import from_bytes, intersection
from psgrad.errors import (
    ApplyFailedError,
    EvictedError,
    InvalidRequestError,
    MemoryBudgetError,
    NonFiniteGradientError,
    PsgradError,
    RollbackError,
    WorkerStateError,
)
from psgrad.server.aggregation import Pending
from psgrad.server.ledger import PushResult
from psgrad.server.membership import Member, Membership
from psgrad.server.replica_path import Replica
from psgrad.server.rows_path import RowGradients, Rows
from psgrad.server.shard_core import ShardCore
from psgrad.server.state import ShardState
from psgrad.server.tables import RowJournal
from psgrad.server.transfers import PushWriter, count_nonfinite

_log = logging.getLogger(__name__)


class Pushes:
    """Push handling of one shard."""

    def __init__(self, core: ShardCore, replica: Replica, rows: Rows) -> None:
        self._core = core
        self._replica = replica
        self._rows = rows
        self._kept = 0  # the row updates the next replica record carried before the update being applied
        core.complete_round = self.complete_iteration

    def push_target(
        self, rank: int, clock: int, base_version: int, numel: int, dtype: str, fingerprint: str,
        lr: float | None = None, rows: RowGradients | None = None, compress: str = "", unused: bytes = b"",
        unused_tables: Sequence[str] = (), incarnation: int = 0,
    ) -> tuple[torch.Tensor, WireBuffer, PushWriter]:
        """Validate a push header and lend a receive buffer (apply_push or release gives it back).
        lr: the learning rate in effect for the push (the worker's schedule; None: the job's);
        rows: the row gradients of sparse tables it carries, checked in full here (and their rows
        made; in sync, those of tables that evict are made by the iteration, and the room for
        them checked here) before any of its data is received, so a push refused for them changes nothing;
        compress: the payload's codec ("": plain values; else the job's --compress, decoded once received);
        unused: the dense parameters the worker's step left unused (PushHeader.unused), which the
        update skips (sync: those no worker of the iteration used); unused_tables: the sparse
        tables it did not use (PushHeader.unused_tables), whose step count the update leaves;
        incarnation: the pushing process's number (PushHeader.incarnation, see Membership.live).

        Raises:
            InvalidRequestError, WorkerStateError: the header or its rows are refused (named).
            MemoryBudgetError: the rows it touches would not fit the server's budget.
        """
        core = self._core
        with core.cond:
            self._refuse_if_broken()
            state = core.require(fingerprint, rank)
            # A shard restored from a checkpoint is behind the weights its workers pulled before the
            # crash: a gradient computed on those counts as fresh (staleness 0), not as a bad header.
            newest = state.version if not core.marks.restored else max(state.version, base_version)
            problem = explain_push_header(state.layout, rank, numel, dtype, base_version, newest, lr, compress)
            if problem:
                core.counters.pushes_rejected += 1
                raise InvalidRequestError(problem)
            try:
                member = core.members.live(rank, incarnation)
                if not core.policy.aggregates:  # (sync: the policy takes only the current iteration)
                    core.members.check_clock(member, clock, rank in core.marks.last_pushes, state.version)
                rows_nonfinite, reserved = self._rows.check(state, rank, rows, self._round_rows()) if rows else (0, None)
            except (WorkerStateError, InvalidRequestError, MemoryBudgetError):
                core.counters.pushes_rejected += 1
                raise
            try:
                skip = from_bytes(unused, state.dense.trainable, f"push from worker rank {rank}")
                skip_tables = frozenset(unused_tables)
                for name in sorted(skip_tables):
                    state.sparse(name, rank)  # (refuses a table the job does not have, naming those it has)
                    if rows is not None and name in rows and rows[name][0].numel():
                        raise InvalidRequestError(f"push from worker rank {rank}: table {name!r} is named unused "
                                                  "but the push carries rows of it")
            except InvalidRequestError:
                core.counters.pushes_rejected += 1
                raise
            lr = state.resolve_lr(rank, clock, lr)
            if not compress and state.layout.spec.compress != "none":
                core.counters.pushes_plain += 1  # (a worker on this host: see `psgrad status`)
            grad, wire = core.buffers.lend(state.layout.numel, dtype, lambda: state.weights)
            exact = get_codec(dtype).exact and not compress
            if compress:
                codec = RangeCodec(state.layout.spec.compression, state.layout.numel, dtype,
                                   plain=state.layout.numel - state.layout.trainable)  # (model buffers: plain)
                wire = CompressedWire(wire, codec)
            writer = PushWriter(rank, grad, wire.receive_view(grad), f"push from worker rank {rank}", exact)
            writer.lr = lr
            writer.skip = skip
            writer.skip_tables = skip_tables
            writer.rows, writer.rows_nonfinite, writer.rows_reserved = rows or {}, rows_nonfinite, reserved
            # A gradient that the worker's segment holds may be applied from there, in place: by an
            # update rule that only reads it, applied on arrival.
            writer.may_borrow = exact and not core.policy.aggregates and state.dense.may_borrow()
            writer.target = state.key
            core.buffers.track(grad, writer)
            rule = state.dense.rule
            if rule is not None and clock > member.last_push_clock and not skip:  # staged, and not a duplicate
                scale = core.policy.lr_scale(max(0, state.version - base_version), state.layout.spec.staleness_lr)
                writer.stage(state.weights, rule, state.optimizer.step_lr(lr, scale))
        return grad, wire, writer

    def _round_rows(self) -> list[RowGradients] | None:
        """Sync, where the tables take the iteration's mean: the row gradients of the pushes
        buffered for the iteration so far (a push's rows of tables that evict are made by the
        iteration, not as it arrives: see Rows.check_round); None otherwise. Under the lock."""
        core = self._core
        state = core.state
        if state is None or not core.policy.aggregates or not tables_mode_of(state.layout.spec).synchronous:
            return None
        return [item.rows for item in core.round.pending.values()]

    def may_check_as_applied(self) -> bool:
        """Whether a borrowed gradient may be checked as it is applied, on this thread and a helper
        (apply_checked): when it is the only push in flight (among others, each is checked as it
        arrives, beside another's apply) and torch runs one thread (else it spreads ops itself)."""
        return self._core.buffers.lent < 2 and torch.get_num_threads() == 1

    def release(self, grad: torch.Tensor, wire: WireBuffer) -> None:
        """Return a receive buffer: to the pool, or to the allocator if it was lent beyond the limit."""
        with self._core.cond:
            self._core.buffers.release(grad, wire)

    def reject(self) -> None:
        """Count a push that failed after its header was accepted."""
        with self._core.cond:
            self._core.counters.pushes_rejected += 1

    def apply_push(
        self, rank: int, clock: int, base_version: int, grad: torch.Tensor, wire: WireBuffer, nbytes: int
    ) -> PushResult:
        """Handle a fully received gradient once, as the policy decides: apply it (async/ssp) or
        buffer it for the iteration's mean (sync). Duplicates of (rank, clock) are acknowledged
        only. Takes ownership of the buffers."""
        core = self._core
        kept = False
        with core.cond:
            writer = core.buffers.writer_of(grad)
        try:
            try:
                wire.finish_receive(grad)
            except InvalidRequestError:  # a compressed payload that does not decode: nothing applied
                self.reject()
                raise
            wire = wire.pooled  # (a compressed push's payload is decoded into grad now)
            staged = writer is not None and writer.staged
            source = writer.borrowed if writer is not None and writer.borrowed is not None else grad
            lr = writer.lr if writer is not None else None
            skip = writer.skip if writer is not None else ()
            skip_tables = writer.skip_tables if writer is not None else frozenset()
            restore = writer.restore_from if writer is not None and writer.check_deferred else None
            if restore is not None:  # checked as it is applied in place, undone from this copy of the weights
                bad = 0
            else:
                bad = writer.nonfinite if writer is not None and writer.checked else count_nonfinite(grad)
            with core.cond:
                self._refuse_if_broken()
                state = core.state
                assert state is not None
                policy = core.policy
                if not staged and not policy.aggregates:
                    known = core.members.get(rank)
                    if known is None or clock > known.last_push_clock:  # (re-checked below)
                        # an in-place update must not change weights a pull streams
                        core.buffers.await_reads(state.weights, state.layout.spec.wire_dtype)
                core.refresh()
                core.counters.bytes_in += nbytes
                member = core.members.live(rank)
                if writer is not None and writer.revoked:
                    raise EvictedError(f"worker rank {rank} was evicted while pushing; nothing was applied")
                # Its row gradients go with it: applied or buffered below, dropped on every other way out.
                rows = writer.rows if writer is not None else {}
                bad += writer.rows_nonfinite if writer is not None else 0
                decision = self._admit(member, rank, clock, base_version, state.version)
                if isinstance(decision, PushResult):  # a duplicate, or late
                    return decision
                if bad and core.config.nonfinite != "allow":
                    return self._refuse_nonfinite(member, clock, bad, decision)
                round_rows = self._round_rows() if decision is PushDecision.BUFFER else None
                try:  # (a restore, or rows dropped since the header, may have undone what its check made)
                    if round_rows is not None and rows:  # (under this lock until it is buffered)
                        self._rows.check_round(state, rows, round_rows)
                    slots = self._rows.reserve(state, rows, may_evict=True, sync=round_rows is not None,
                                               made=writer.rows_reserved if writer is not None else None)
                except MemoryBudgetError:
                    core.counters.pushes_rejected += 1
                    raise
                what = f"the push of worker rank {rank} at clock {clock}"
                if decision is PushDecision.BUFFER:
                    if rows and not tables_mode_of(state.layout.spec).synchronous:
                        # hybrid (--tables-mode async): the tables take each worker's rows as they come
                        self._apply_rows(lambda: self._rows.apply(state, rows, lr, 1.0, slots), what, count=True)
                        rows = {}
                    core.round.add(rank, Pending(grad, wire, clock, base_version, lr, rows, skip, skip_tables, slots))
                    core.buffers.keep(grad)
                    kept = True
                    Membership.advance(member, clock)
                    before = state.version
                    core.refresh()
                    if state.version > before:
                        return PushResult(True, "", state.version, 0, lr=lr)
                    return PushResult(False, "buffered until every live worker pushed", state.version, 0, True, lr)
                staleness = max(0, state.version - base_version)
                scale = policy.lr_scale(staleness, state.layout.spec.staleness_lr)
                if not staged:
                    state.dense.prepare(rank, base_version, source, averaged=False)  # (writes the gradient only)
                    allow = core.config.nonfinite == "allow"
                    if restore is not None and (writer is None or writer.target != state.key or allow or skip):
                        # the weights moved on (another push applied while this one waited), or it need
                        # not be checked, or it skips unused ranges: the copy would not undo it (or the
                        # checked apply would not skip); check, then apply
                        restore, bad = None, count_nonfinite(source)
                        if bad and not allow:
                            return self._refuse_nonfinite(member, clock, bad, decision)
                update_rows = functools.partial(self._rows.apply, state, rows, lr, scale, slots) if rows else None

                def apply_rows(undo: Callable[[], object] | None = None) -> RowJournal:
                    return self._apply_rows(update_rows, what, count=True, undo_dense=undo)

                if staged:  # the buffer holds the next weights: swap them in (after the rows: it cannot fail)
                    assert writer is not None
                    apply_rows()
                    if writer.base is not state.weights:  # staged beside a slow push, which was applied first
                        writer.rebase(state.weights)
                    old, state.weights = state.weights, grad
                    core.buffers.commit(grad, old)
                    kept = True
                elif restore is not None:  # checked as it is applied, undone from the copy if need be
                    try:
                        bad = state.dense.apply_checked(source, scale, lr, restore)
                    except BaseException as exc:  # (the weights are restored from the copy: nothing of it stays)
                        self._kept = self._replica.rows_kept()  # (nothing of it for the record yet)
                        self._failed(RowJournal(), exc, what, dense_written=False, count=True)
                    if bad:
                        return self._refuse_nonfinite(member, clock, bad, decision)
                    # then the rows: where they fail, the weights go back to the copy too (plain SGD: no
                    # optimizer state)
                    apply_rows(lambda: state.weights.copy_(restore))
                    self._replica.before_apply(source, scale, lr)
                else:
                    # The rows first, journaled (undone if they fail part way), then the dense part,
                    # which is the update's last write (see _apply_rows).
                    journal = apply_rows()
                    self._replica.before_apply(source, scale, lr, skip)  # the backup applies the same gradient
                    try:
                        state.dense.apply(source, scale, lr, skip)
                    except BaseException as exc:
                        self._failed(journal, exc, what, dense_written=True, count=True)
                self._skip_tables(state, skip_tables)  # (cannot fail: counts only)
                state.version += 1
                Membership.advance(member, clock)
                core.counters.pushes_applied += 1  # (before the update's hooks: a snapshot of it counts it)
                core.counters.staleness[staleness] += 1
                core.updated()
                core.history.append(("apply", state.version, ((rank, clock, staleness),)))
                core.notify()
                return PushResult(True, "", state.version, staleness, lr=lr, bound=policy.reported_bound)
        finally:
            if not kept:
                self.release(grad, wire)

    def _refuse_if_broken(self) -> None:
        """Refuse a push to a shard an update broke (see _failed). Under the lock."""
        if self._core.broken is not None:
            raise ApplyFailedError(self._core.broken)

    def _apply_rows(self, apply: Callable[[], None] | None, what: str, count: bool = False,
                    undo_dense: Callable[[], object] | None = None) -> RowJournal:
        """Apply an update's rows (apply()), journaled: where it fails part way, what it wrote is
        undone (see _failed; undo_dense: how to undo a dense part applied before, exactly) and the
        error raised; else the journal, for undoing them if the rest of the update fails. Rows go
        before the dense part (but where that part is undone exactly from a copy): the dense apply
        is then an update's last write, so nothing but itself is left to fail after it began.
        Under the lock."""
        journal = RowJournal()
        self._kept = self._replica.rows_kept()  # (what the next record carries from before this update)
        if apply is None:  # (no rows: nothing to journal)
            return journal
        try:
            with journal.record():
                apply()
        except BaseException as exc:
            written = False
            if undo_dense is not None:
                try:
                    undo_dense()
                except BaseException:
                    written = True
            self._failed(journal, exc, what, dense_written=written, count=count)
        return journal

    def _failed(self, journal: RowJournal, exc: BaseException, what: str, dense_written: bool,
                count: bool) -> NoReturn:
        """An update failed as it was applied (under the lock): its rows are undone from the journal
        and nothing of it stays (not its version, its record for the backup, or a sync round's
        take), so that its retry applies it once: the error raised as ApplyFailedError (a
        PsgradError as it is). Where that cannot be done exactly (the dense apply failed after it
        may have begun writing the weights, or rows moved since they were written), the shard
        refuses every push from now on (ApplyFailedError, logged) rather than apply part of an
        update twice."""
        self._replica.abandon(self._kept)
        if count:
            self._core.counters.pushes_rejected += 1
        undone = journal.undo()
        if dense_written or not undone:
            part = "the dense weights" if dense_written else "rows that moved since"
            self._break(f"{what} failed part way ({type(exc).__name__}: {exc}), after writing {part}, which cannot be "
                        "undone exactly", exc)
        if isinstance(exc, PsgradError) or not isinstance(exc, Exception):
            raise exc
        raise ApplyFailedError(f"{what} failed as it was applied ({type(exc).__name__}: {exc}); what it wrote was "
                               "undone, nothing of it applied: its retry applies it once") from exc

    def _break(self, why: str, exc: BaseException | None = None) -> NoReturn:
        """Refuse every push from now on (see _failed)."""
        core = self._core
        core.broken = (f"{why}: this shard refuses every push from now on rather than apply part of an update twice; "
                       "restart it from its checkpoint (psgrad server --checkpoint-dir ...), or stop it so its "
                       "standby takes over")
        _log.error("%s", core.broken)
        raise ApplyFailedError(core.broken) from exc

    def _admit(self, member: Member, rank: int, clock: int, base_version: int, version: int) -> PushResult | PushDecision:
        """What every push (or skip) of rank's `clock` goes through first, under the lock: a clock
        it handled already is a duplicate (acknowledged, counted), one whose iteration completed
        without it is late (dropped); else the policy's decision, with the clock's order checked
        (refused, counted), and the pushes a restart from a checkpoint lost before it counted.
        Returns the answer where the push ends here, else the decision.

        Raises:
            InvalidRequestError, RollbackError: the clock does not fit (nothing recorded).
        """
        core = self._core
        policy = core.policy
        if clock <= member.last_push_clock:
            core.counters.pushes_duplicate += 1
            return PushResult(False, f"{DUPLICATE_REASON} (rank {rank}, clock {clock})", version, 0)
        late = policy.late(rank, base_version, core.view(), core.marks.restored)
        if late is not None:  # (sync with backup workers) its iteration completed without it
            return self._drop_late(member, clock, base_version, late)
        try:
            decision = policy.decide_push(rank, clock, core.view(), core.marks.restored)
            if not policy.aggregates:
                core.members.check_clock(member, clock, rank in core.marks.last_pushes, version)
        except (InvalidRequestError, RollbackError):
            core.counters.pushes_rejected += 1
            raise
        lost_from = core.marks.last_pushes.pop(rank, None)
        if lost_from is not None:  # its pushes between the checkpoint and this one were lost
            core.counters.updates_lost += max(0, clock - lost_from - 1)
        return decision

    def skip_push(self, rank: int, clock: int, base_version: int, fingerprint: str, incarnation: int = 0) -> PushResult:
        """A skip (PushHeader.skip): rank's step at `clock`, which other shards applied, was dropped
        by its worker. Handled as a push whose gradient --nonfinite skip skips: acknowledged and
        never applied, the worker's clock moved past it (in sync the iteration no longer waits for
        it, and completes once the others pushed), counted (pushes_skipped), and the backup told
        (as a skip: the members' record). A shard that handled the clock already (it applied the
        step) answers a duplicate; a clock the worker may not push (ahead of its next one, or not
        the current iteration in sync) is refused as a push would be.

        Raises:
            NotInitializedError, JobMismatchError, UnknownWorkerError, EvictedError, WorkerStateError:
                as for a push.
            InvalidRequestError, RollbackError: the clock does not fit (nothing recorded).
        """
        core = self._core
        with core.cond:
            state = core.require(fingerprint, rank)
            core.refresh()
            member = core.members.live(rank, incarnation)
            decision = self._admit(member, rank, clock, base_version, state.version)
            if isinstance(decision, PushResult):  # a duplicate, or late
                return decision
            Membership.advance(member, clock)  # acknowledged, never applied
            core.counters.pushes_skipped += 1
            if decision is PushDecision.BUFFER:
                core.round.skip()
                core.refresh()  # the worker no longer owes this iteration
            core.members_changed()  # a backup that takes over knows the clock moved
            core.notify()
            return PushResult(False, f"skipped: worker rank {rank} dropped its step at clock {clock}", core.version, 0)

    def _skip_tables(self, state: ShardState, names: frozenset[str]) -> None:
        """The update being applied did not use these sparse tables: their step counts stay (and
        the backup's, told with the update's record)."""
        if names:
            state.skip_tables(names)
            self._replica.tables_skipped(names)

    def _drop_late(self, member: Member, clock: int, base_version: int, reason: str) -> PushResult:
        """A push the policy found late: counted, recorded ("late", rank, clock, base version,
        shard version) and dropped, its clock handled."""
        core = self._core
        Membership.advance(member, clock)
        core.counters.late_dropped += 1
        core.history.append(("late", member.rank, clock, base_version, core.version))
        core.members_changed()
        return PushResult(False, reason, core.version, 0)

    def _refuse_nonfinite(self, member: Member, clock: int, bad: int, decision: PushDecision) -> PushResult:
        """A gradient with NaN/inf: refused (--nonfinite reject) or acknowledged unapplied (skip)."""
        core = self._core
        core.counters.pushes_rejected += 1
        if core.config.nonfinite == "reject":
            raise NonFiniteGradientError(
                f"gradient from worker rank {member.rank} at clock {clock} has {bad} non-finite values; "
                "the shard is unchanged (start the server with --nonfinite skip|allow to change this)"
            )
        Membership.advance(member, clock)  # "skip": acknowledged, never applied
        if decision is PushDecision.BUFFER:
            core.round.skip()
            core.refresh()  # the skipped worker no longer owes this iteration
        core.members_changed()  # a backup that takes over knows the clock moved
        return PushResult(False, f"skipped: {bad} non-finite values", core.version, 0)

    def complete_iteration(self) -> bool:
        """Apply the mean of the buffered gradients once the policy says the iteration is complete
        (sync: no live worker still owes it); under the lock. The round is taken once the update is
        applied: an apply that raises leaves the round (and the mean it computed) in place, so the
        next call (any refresh: a push, its retry, a pull, the lease reaper) completes the iteration
        instead of the job waiting for gradients it lost. The rows are applied first, journaled, and
        undone if they fail part way; the dense apply is the last write, and one that fails leaves
        the shard refusing pushes (see _failed): an iteration is never applied in part, nor twice."""
        core = self._core
        state = core.state
        if state is None or not core.round.handled or core.broken is not None:  # (nothing buffered: no clock view)
            return False
        if not core.policy.iteration_complete(state.version, core.view(), core.round.handled):
            return False
        ranks, items = core.round.items()
        if items:  # else every gradient of the iteration was skipped: an empty update
            # only snapshots (observe) can be streaming here; rare
            core.buffers.detach_reads(state.weights, state.layout.spec.wire_dtype)
            mean = core.round.mean()
            lr = items[0].lr  # the lowest rank's: every worker's schedule gives the iteration's lr
            skip = items[0].skip  # what no worker of the iteration used (one used by some takes the mean, zeros and all)
            skip_tables = items[0].skip_tables
            for item in items[1:]:
                skip = intersection(skip, item.skip)
                skip_tables &= item.skip_tables
            what = f"the update of iteration {state.version}"
            try:
                self._replica.before_apply(mean, 1.0, lr, skip)  # the backup applies the same mean
            except BaseException:
                # (its record is made again when the iteration is applied; a hybrid job's rows applied
                # as its pushes came stay for it)
                self._replica.abandon(self._replica.rows_kept())
                raise
            per_rank = [it.rows for it in items]
            reserved = [it.reserved for it in items]
            journal = self._apply_rows((lambda: self._rows.apply_round(state, per_rank, len(items), lr, reserved))
                                       if any(per_rank) else None, what)
            try:
                state.dense.apply(mean, 1.0, lr, skip)
            except BaseException as exc:
                self._failed(journal, exc, what, dense_written=True, count=False)
            self._skip_tables(state, skip_tables)  # (cannot fail: counts only)
        core.round.take()
        applied_at = state.version
        state.version += 1
        stale = tuple((r, it.clock, applied_at - it.base_version) for r, it in zip(ranks, items))
        for _, _, s in stale:  # (before the update's hooks: a snapshot of the iteration counts its pushes)
            core.counters.staleness[s] += 1
        core.counters.pushes_applied += len(items)
        core.updated()
        core.history.append(("apply", state.version, stale))
        core.buffers.give_back([(it.grad, it.wire) for it in items])
        return True
