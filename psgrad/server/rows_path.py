"""The sparse-table path of a shard: pulls of rows by id, and row gradients held per worker until its
push of the same clock, then applied with it — at once (async, ssp), or (sync) with the iteration:
summed over its workers in rank order and divided by their number, like the dense mean, so the
update does not depend on the order pushes arrived in. A collaborator of the shard core, acting
under its lock; it tells the replica when rows changed."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from psgrad.errors import InvalidRequestError, NonFiniteGradientError
from psgrad.server.replica_path import Replica
from psgrad.server.shard_core import ShardCore
from psgrad.server.state import ShardState
from psgrad.server.transfers import count_nonfinite

# table -> (row ids [n] int64, their gradients [n, dim] float32, the table version they were pulled at)
RowGradients = dict[str, tuple[torch.Tensor, torch.Tensor, int]]


@dataclass
class Staged:
    """One worker's row gradients of one clock, by table."""

    clock: int
    tables: RowGradients = field(default_factory=dict)


class Rows:
    """Sparse-table calls of one shard."""

    def __init__(self, core: ShardCore, replica: Replica) -> None:
        self._core = core
        self._replica = replica
        self._staged: dict[int, Staged] = {}  # rank -> its row gradients awaiting its push

    def pull(self, rank: int, fingerprint: str, table: str, ids: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(the table's version, rows [len(ids), dim]) of rows `ids` of sparse table `table`. No gate:
        a worker pulls a step's rows after its dense pull passed the mode's.

        Raises:
            InvalidRequestError: no such table, or ids out of range, of another dtype or shard.
            MemoryBudgetError: making the rows never touched would pass the server's budget.
        """
        core = self._core
        with core.cond:
            state = core.require(fingerprint, rank)
            t = state.sparse(table, rank)
            values = t.rows(ids)
            core.counters.bytes_out += values.numel() * 4
            return t.version, values

    def updated(self, rank: int, fingerprint: str, table: str, from_id: int, limit: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(the table's version, ids, rows) of a page of the rows of `table` updated at least once
        (see SparseTable.updated_rows).

        Raises:
            InvalidRequestError: no such table, or a limit of 0.
        """
        if limit < 1:
            raise InvalidRequestError(f"a read of updated rows needs a limit >= 1, got {limit}")
        core = self._core
        with core.cond:
            t = core.require(fingerprint, rank).sparse(table, rank)
            ids, values = t.updated_rows(from_id, limit)
            core.counters.bytes_out += values.numel() * 4 + ids.numel() * 8
            return t.version, ids, values

    def stage(self, rank: int, clock: int, fingerprint: str, table: str, ids: torch.Tensor, grads: torch.Tensor,
              base_version: int) -> int:
        """Hold a worker's row gradients of (clock, table) until its push of that clock (another
        clock's held rows are dropped; those of a clock whose push was handled already are a resent
        copy, not held); returns the table's version.

        Raises:
            InvalidRequestError: no such table; ids repeated, out of range or on another shard;
                gradients of another shape.
            NonFiniteGradientError: NaN/inf in the gradients (--nonfinite reject).
        """
        core = self._core
        with core.cond:
            state = core.require(fingerprint, rank)
            t = state.sparse(table, rank)
            t.check_update(ids, grads)
            member = core.members.live(rank)
            if clock <= member.last_push_clock:  # its push was handled: a resent copy, dropped
                return t.version
            bad = count_nonfinite(grads)
            if bad and core.config.nonfinite != "allow":
                if core.config.nonfinite == "reject":
                    core.counters.pushes_rejected += 1
                    raise NonFiniteGradientError(
                        f"row gradients of table {table!r} from worker rank {rank} at clock {clock} have {bad} non-finite "
                        "values; nothing was applied (start the server with --nonfinite skip|allow to change this)")
                ids, grads = ids[:0], grads[:0]  # skip: held as none, so the push still finds them
            staged = self._staged.get(rank)
            if staged is None or staged.clock != clock:
                staged = self._staged[rank] = Staged(clock)
            staged.tables[table] = (ids, grads, base_version)
            core.counters.bytes_in += grads.numel() * 4 + ids.numel() * 8
            return t.version

    def held(self, rank: int, clock: int) -> int:
        """How many tables' row gradients of (rank, clock) the shard holds."""
        staged = self._staged.get(rank)
        return len(staged.tables) if staged is not None and staged.clock == clock else 0

    def take(self, rank: int, clock: int) -> RowGradients:
        """The row gradients of (rank, clock), no longer held (none: an empty dict)."""
        staged = self._staged.pop(rank, None)
        return staged.tables if staged is not None and staged.clock == clock else {}

    def apply(self, state: ShardState, rows: RowGradients, lr: float | None, lr_scale: float = 1.0) -> None:
        """Apply one worker's row gradients (async, ssp) with the push's lr (None: the job's)."""
        for name in sorted(rows):
            ids, grads, base = rows[name]
            t = state.sparse(name, -1)
            if ids.numel():
                t.apply(ids, grads, _scaled(lr, t.optimizer.lr, lr_scale), base)
        if rows:
            self._replica.rows_changed()

    def apply_round(self, state: ShardState, per_rank: Sequence[RowGradients], workers: int, lr: float | None) -> None:
        """Apply a sync iteration's row gradients (one dict per worker, in rank order): per table and
        row, their sum over the workers divided by `workers` (the iteration's gradients: rows a
        worker did not touch count as its zero gradient, as in the mean of the workers' losses)."""
        names = sorted({name for rows in per_rank for name in rows})
        for name in names:
            parts = [rows[name] for rows in per_rank if name in rows and rows[name][0].numel()]
            if not parts:
                continue
            t = state.sparse(name, -1)
            ids = torch.cat([p[0] for p in parts])
            grads = torch.cat([p[1] for p in parts])
            unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
            total = torch.zeros(unique.numel(), t.dim).index_add_(0, inverse, grads)  # in rank order
            total.mul_(1.0 / workers)
            t.apply(unique, total, lr, min(p[2] for p in parts))
        if names:
            self._replica.rows_changed()


def _scaled(lr: float | None, job_lr: float, scale: float) -> float | None:
    if scale == 1.0:
        return lr
    return (job_lr if lr is None else lr) * scale
