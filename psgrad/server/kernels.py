"""Fused kernels for the shard's hottest loops, compiled with numba in the background the first
time one is asked for (core/compiled.py); until they are ready (or where numba is missing, or a
result would differ from torch's in any bit) callers get None and use the torch ops.
PSGRAD_FUSED_APPLY=0 turns them all off.

- sgd_checked: plain SGD (w += alpha * g) that checks the gradient for NaN/inf in the same pass,
  on two threads. torch has no op that both updates and reduces, so a checked apply otherwise
  reads the gradient twice (a sum, then the update): about 1.3-1.4 x the update's time here.
- the row kernels (rows()): a sparse table's call works through its rows in one pass each where
  torch takes one op per step of it (a gather, each op of the rule, a scatter, a version stamp; a
  check of the ids in several comparisons and reductions, then a lookup): at a few hundred rows
  a table, a call's cost is those ops' overhead more than their arithmetic.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from psgrad.core.compiled import ENV  # noqa: F401 (the switch, named here too)
from psgrad.core.compiled import get as _get
from psgrad.core.optimizers.base import register_axpy_backend
from psgrad.server.transfers import on_two_threads

Kernel = Callable[[np.ndarray, np.ndarray, np.float32], np.float32]


def kernel(wait: bool = False) -> Kernel | None:
    """The compiled SGD kernel, or None: not ready yet (the first call starts compiling it on a
    background thread; wait=True waits for that), turned off, or unavailable here."""
    return _get("sgd", _make_sgd, True, wait)


def _make_sgd() -> Kernel | None:
    from psgrad.server._sgd_kernel import sgd_checked

    return sgd_checked if _agrees_with_torch(sgd_checked) else None


def _agrees_with_torch(fn: Kernel) -> bool:
    """Whether fn computes what torch's add_(g, alpha=a) computes, bit for bit, at every length
    and offset of the vector loops, and flags exactly the gradients with NaN or inf."""
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(300, generator=gen) * 3
    g0 = torch.randn(300, generator=gen) * 1e3
    for alpha in (-1e-3, -0.0123, -1e-9, 0.7):
        for start, end in ((0, 1), (3, 20), (1, 67), (0, 256), (5, 300)):
            w, g = w0[start:end].clone(), g0[start:end]
            expect = w.clone().add_(g, alpha=alpha)
            if not np.isfinite(fn(w.numpy(), g.numpy(), np.float32(alpha))) or not torch.equal(w, expect):
                return False
    for bad in (float("nan"), float("inf"), -float("inf")):
        g = g0.clone()
        g[-1] = bad
        if np.isfinite(fn(w0.clone().numpy(), g.numpy(), np.float32(-1e-3))):
            return False
    return True


def sgd_checked(weights: torch.Tensor, grad: torch.Tensor, alpha: float) -> bool | None:
    """weights += alpha * grad (float32, contiguous, same length), with grad checked in the same
    pass, half on a helper thread. Returns whether every value of grad was finite (False: the
    weights were updated all the same, and the caller restores them), or None where the kernel
    is not ready: nothing was done."""
    fn = kernel()
    if fn is None:
        return None
    w, g, a = weights.numpy(), grad.numpy(), np.float32(alpha)
    if not (w.dtype == g.dtype == np.float32 and w.flags.c_contiguous and g.flags.c_contiguous and g.flags.writeable):
        return None  # compiled (and checked against torch) for writable float32 vectors only
    sums: list[float] = []
    on_two_threads(w.shape[0], lambda s, e: sums.append(float(fn(w[s:e], g[s:e], a))))
    return all(np.isfinite(sums))


register_axpy_backend("checked", lambda w, g, a: sgd_checked(w, g, a))  # (looked up at each call)


# ----------------------------------------------------------------------------------- row kernels

#: Values (rows x width) in one call from which a sparse table starts compiling the row kernels: a
#: process whose calls are all smaller (a test's, a toy model's) never loads numba for them; calls
#: smaller than this use the kernels once they are compiled all the same.
ROW_KERNEL_MIN = 16384
_NO_IDS = torch.empty(0, dtype=torch.int64)  # (the arrays a check alone neither reads nor writes)


class RowKernels:
    """The compiled row kernels (_row_kernels.py) as the tables call them: torch tensors in and
    out, each call one pass over the rows. Arrays must be contiguous, of the dtypes named."""

    def __init__(self, compiled: dict[str, Any]) -> None:
        self._k = compiled

    def locate(self, ids: torch.Tensor, counts: np.ndarray, sizes: np.ndarray, bases: np.ndarray, num_shards: int,
               index: int, ascending: bool, slot_of: torch.Tensor,
               find: bool = True) -> tuple[int, int, torch.Tensor | None, torch.Tensor | None]:
        """Check row ids of several tables of an arena (concatenated, int64; counts[k] of table k,
        of sizes[k] rows, based at bases[k]) and find their rows: (the position of the first id
        out of its table's range, on another shard, or (ascending) not above the one before it in
        arena order, -1 for none; the count of ids never stored; their arena ids; their slots, -1
        where never stored). Past a bad id, arena ids and slots are not filled. find=False: the
        check alone (one pass over the ids, none of the row index read): (bad, 0, None, None)."""
        if not find:
            none = _NO_IDS.numpy()
            bad, _ = self._k["locate"](ids.numpy(), counts, sizes, bases, num_shards, index, ascending, False,
                                       none, none, none)
            return int(bad), 0, None, None
        arena_ids, slots = torch.empty(ids.numel(), dtype=torch.int64), torch.empty(ids.numel(), dtype=torch.int64)
        bad, new = self._k["locate"](ids.numpy(), counts, sizes, bases, num_shards, index, ascending, True,
                                     slot_of.numpy(), arena_ids.numpy(), slots.numpy())
        return int(bad), int(new), arena_ids, slots

    def claimed(self, slots: torch.Tensor, ids: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots with those of the rows never stored (-1) filled in: start, start + 1, ... in
        their order; the ids of those rows, in that order), in one pass: the slots an update's
        new rows take when they are made in that order (int64 arrays of one length)."""
        out, fresh = torch.empty_like(slots), torch.empty_like(ids)
        n = self._k["claimed"](slots.numpy(), ids.numpy(), start, out.numpy(), fresh.numpy())
        return out, fresh[:n]

    def gather(self, values: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """values[slots] (rows [n, dim]), zeros where a slot is -1."""
        out = torch.empty(slots.numel(), values.shape[1])
        self._k["gather"](values.numpy(), slots.numpy(), out.numpy())
        return out

    def merge(self, ids: torch.Tensor, ends: Sequence[int], grads: torch.Tensor, workers: int,
              slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
        """A sync round's row gradients, one per row, in one pass (what aggregation.rows_mean
        computes, bit for bit): ids (int64) and grads [n, dim] (float32) hold each worker's rows in
        turn, worker k's ending at ends[k], each worker's ids increasing; (their ids once, sorted;
        each one's rows summed in that order, divided by `workers`; where slots gives each id's
        row slot (int64, one per id), each unique id's, else None). None: a worker's ids do not
        increase, or the arrays are not the kernels'."""
        g = grads.numpy()
        if ids.dtype != torch.int64 or g.dtype != np.float32 or not g.flags.c_contiguous or g.shape[0] != ids.numel():
            return None
        if not ends or ends[-1] != ids.numel() or any(b < a for a, b in zip([0, *ends], ends)):
            return None  # (runs that do not cover the ids, one after another: the loops are not bounds-checked)
        if slots is not None and (slots.dtype != torch.int64 or slots.numel() != ids.numel()):
            return None
        out_ids, out_grads = torch.empty(ids.numel(), dtype=torch.int64), torch.empty(g.shape)
        out_slots = torch.empty(ids.numel() if slots is not None else 0, dtype=torch.int64)
        n = self._k["merged_rows"](ids.contiguous().numpy(), (_NO_IDS if slots is None else slots.contiguous()).numpy(),
                                   np.asarray(ends, dtype=np.int64), g, np.float32(1.0 / workers), out_ids.numpy(),
                                   out_slots.numpy(), out_grads.numpy())
        if n < 0:
            return None
        return out_ids[:n], out_grads[:n], None if slots is None else out_slots[:n]

    def apply(self, form: tuple[str, float, float], values: torch.Tensor, state: dict[str, torch.Tensor],
              slots: torch.Tensor, grads: torch.Tensor, versions: torch.Tensor, stamp: torch.Tensor,
              kept: dict[str, torch.Tensor] | None = None) -> bool:
        """Apply a row rule's fused form (RowOptimizer.fused) to rows at `slots` (unique) of values and
        their state, in place, and stamp versions[slots] = stamp; False: nothing done (the form or
        the arrays are not the kernels'), the torch ops apply it. kept (an empty dict): filled, where
        done, with what the apply overwrote, copied in the same pass (an undo's copies, see
        RowJournal): "values" and "versions" of the rows, and "state.<name>" of each state it wrote.
        No error can stop a kernel part way: it writes every row or none."""
        kind, scale, eps = form
        if not slots.numel() or int(slots.min()) < 0:  # (a row not made: torch's index ops raise for it)
            return False
        g = grads.numpy()
        if g.dtype != np.float32 or not g.flags.c_contiguous or g.shape != (slots.numel(), values.shape[1]):
            return False
        if kind not in ("sgd", "adagrad"):
            return False
        n = slots.numel() if kept is not None else 0
        old, old_versions = torch.empty(n, values.shape[1]), torch.empty(n, dtype=torch.int64)
        # the rows' lines fetched together first (see _row_kernels._touched)
        self._k["touched"](values.numpy(), (state["sum"] if kind == "adagrad" else values).numpy(), slots.numpy(),
                           versions.numpy())
        if kind == "sgd":
            self._k["sgd_rows"](values.numpy(), slots.numpy(), g, np.float32(scale), versions.numpy(), stamp.numpy(),
                                old.numpy(), old_versions.numpy())
        else:
            # the sums' square roots by torch's sqrt (not always correctly rounded: its vectorized
            # sqrt; the kernels' would be), on a tensor made as the torch path makes its own
            denom = torch.empty_like(grads)
            old_sums = torch.empty(n, values.shape[1])
            self._k["square_sums"](state["sum"].numpy(), slots.numpy(), g, denom.numpy(), old_sums.numpy())
            torch.sqrt(denom, out=denom).add_(eps)
            self._k["divided_rows"](values.numpy(), slots.numpy(), g, denom.numpy(), np.float32(scale),
                                    versions.numpy(), stamp.numpy(), old.numpy(), old_versions.numpy())
            if kept is not None:
                kept["state.sum"] = old_sums
        if kept is not None:
            kept.update(values=old, versions=old_versions)
        return True


def rows(start: bool = False, wait: bool = False) -> RowKernels | None:
    """The compiled row kernels, or None: not ready yet (start: the call starts compiling them on a
    background thread, where nothing did yet; wait=True waits for that), turned off, or
    unavailable here (numba missing, or a rule's kernel differs from its torch ops in a bit)."""
    return _get("rows", _make_rows, start, wait)


def _make_rows() -> RowKernels | None:
    from psgrad.server._row_kernels import KERNELS

    made = RowKernels(KERNELS)
    return made if _rows_agree_with_torch(made) else None


def _rows_agree_with_torch(k: RowKernels) -> bool:
    """Whether each row rule's fused form gives what its torch ops give (the rule's apply on the
    gathered rows, then the scatter), bit for bit, at row widths and counts that meet every vector
    loop's tail, for rows of a table of several times their number."""
    from psgrad.core.optimizers.rows import RowAdagrad, RowSGD

    gen = torch.Generator().manual_seed(0)
    for rule in (RowSGD(0.05), RowAdagrad(0.05, 0.1, 1e-10), RowAdagrad(0.3, 0.0, 1e-6, lr_decay=0.01)):
        for n, dim in ((1, 1), (3, 5), (17, 8), (40, 33), (300, 32)):
            values = torch.randn(4 * n, dim, generator=gen)
            state = {name: t.uniform_(0, 2, generator=gen) for name, t in rule.new_state(4 * n, dim).items()}
            slots = torch.randperm(4 * n, generator=gen)[:n]
            grads = torch.randn(n, dim, generator=gen) * 10 ** float(torch.randint(-4, 3, (), generator=gen))
            expect_values = values.clone()
            expect_state = {name: t.clone() for name, t in state.items()}
            rule.apply_at(expect_values, expect_state, slots, grads, 0.07, 3)
            form = rule.fused(0.07, 3)
            versions, stamp = torch.randint(0, 9, (4 * n,), generator=gen), torch.arange(1, n + 1)
            before = {"values": values[slots], "versions": versions[slots], **{"state." + k_: t[slots] for k_, t in state.items()}}
            kept: dict[str, torch.Tensor] | None = {} if n % 2 else None  # (with and without the undo's copies)
            if form is None or not k.apply(form, values, state, slots, grads, versions, stamp, kept):
                return False
            if not (_same_bits(values, expect_values) and all(_same_bits(state[n_], expect_state[n_]) for n_ in state)
                    and torch.equal(versions[slots], stamp)):
                return False
            if kept is not None and not (set(kept) == set(before) and all(_same_bits(kept[k_], v) if v.is_floating_point()
                                                                          else torch.equal(kept[k_], v)
                                                                          for k_, v in before.items())):
                return False
    return _merge_agrees_with_torch(k)


def _merge_agrees_with_torch(k: RowKernels) -> bool:
    """Whether the sync round's merge gives round_mean's ids and sums, bit for bit, for 1-5 workers
    whose rows overlap in part, at row widths that meet every vector loop's tail."""
    from psgrad.server.aggregation import rows_mean

    gen = torch.Generator().manual_seed(1)
    for workers, dim in ((1, 3), (2, 32), (3, 17), (5, 64)):
        runs = [torch.randperm(60, generator=gen)[:int(torch.randint(0, 40, (), generator=gen))].sort().values
                for _ in range(workers)]
        ids = torch.cat(runs)
        grads = torch.randn(ids.numel(), dim, generator=gen) * 10 ** float(torch.randint(-4, 3, (), generator=gen))
        ends = torch.tensor([r.numel() for r in runs]).cumsum(0).tolist()
        got = k.merge(ids, ends, grads, workers, slots=ids * 7 + 3)  # (a row's slot: any function of its id)
        expect = rows_mean(ids, grads, workers)
        if got is None or got[2] is None or not (torch.equal(got[0], expect[0]) and _same_bits(got[1], expect[1])
                                                 and torch.equal(got[2], expect[0] * 7 + 3)):
            return False
    return k.merge(torch.tensor([2, 1]), [2], torch.zeros(2, 4), 1) is None  # (a run that does not increase)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (torch.equal takes -0.0 for 0.0)."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32))
