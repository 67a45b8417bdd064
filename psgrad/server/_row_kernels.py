"""The compiled row kernels (numba): imported only by psgrad.server.kernels, on a background thread
(importing numba and compiling take a second or two; the machine code is cached next to this file,
or in the user's cache directory where this one is read-only; where neither can be written it is
compiled in every process). Each does in one pass over a call's rows what the torch ops of a
sparse table do in several (see kernels.py); the arithmetic ones are checked bit for bit against
the row rules after compiling.

Signatures are given, so nothing is compiled at a call: inputs a kernel only reads are typed
read-only (a request's bytes are), which writable arrays also match."""
from __future__ import annotations

import numba
import numpy as np
from numba import types

_F32 = types.Array(types.float32, 2, "C")
_F32_IN = types.Array(types.float32, 2, "C", readonly=True)
_I64 = types.Array(types.int64, 1, "C")
_I64_IN = types.Array(types.int64, 1, "C", readonly=True)


def _locate(ids, counts, sizes, bases, num_shards, index, ascending, find, slot_of, arena_ids, slots):  # pragma: no cover
    # ids: member tables' row ids, concatenated (counts[k] of member k, whose rows are [0, sizes[k])
    # and start at arena id bases[k]). Fills arena_ids and slots (-1: never stored), where find
    # (else it only checks, and reads and writes none of the three arrays); returns (the position
    # of the first id out of range, on another shard, or (ascending) not above the one before it
    # in arena order; -1: none), and the number of ids never stored.
    at, new, last = 0, 0, np.int64(-1)
    # (a power of two of shards, as most jobs have: a mask and a shift where a division by a
    # number known only now takes tens of cycles, twice an id; r and a are >= 0 where they are used)
    pow2, low, by = num_shards & (num_shards - 1) == 0, num_shards - 1, 0
    while (1 << by) < num_shards:
        by += 1
    for k in range(counts.shape[0]):
        size, base = sizes[k], bases[k]
        for _ in range(counts[k]):
            r = ids[at]
            if r < 0 or r >= size or (num_shards > 1 and (r & low if pow2 else r % num_shards) != index):
                return at, new
            a = r + base
            if ascending and a <= last:
                return at, new
            last = a
            at += 1
            if not find:
                continue
            arena_ids[at - 1] = a
            s = slot_of[a >> by if pow2 else a // num_shards]
            slots[at - 1] = s
            if s < 0:
                new += 1
    return -1, new


def _claimed(slots, ids, start, out_slots, fresh):  # pragma: no cover
    # An update's rows never stored (slot -1), in their order, take the next slots from `start`:
    # out_slots is slots with theirs filled in, fresh their ids; returns how many.
    k = 0
    for i in range(slots.shape[0]):
        s = slots[i]
        if s < 0:
            fresh[k] = ids[i]
            s = start + k
            k += 1
        out_slots[i] = s
    return k


def _gather(values, slots, out):  # pragma: no cover
    # out[i] = values[slots[i]] for the stored rows; rows never stored (slot -1) are zeros
    n, d = out.shape
    for i in range(n):
        s = slots[i]
        if s >= 0:
            for j in range(d):
                out[i, j] = values[s, j]
        else:
            for j in range(d):
                out[i, j] = 0


def _touched(values, state, slots, versions):  # pragma: no cover
    # Reads one value of each 64-byte line of each row at slots, of values and of state (a rule's
    # state of the same shape; values again where it has none), and its version, returning their
    # sum so that none is left out. The loads do not depend on one another, so the core has many
    # in flight at once, where an update's pass (each row's arithmetic between its loads) waits
    # for memory row after row: a step's rows lie scattered over a table of millions.
    d = values.shape[1]
    t = np.float32(0)
    for i in range(slots.shape[0]):
        s = slots[i]
        for j in range(0, d, 16):
            t += values[s, j] + state[s, j]
        t += np.float32(versions[s])
    return t


def _sgd_rows(values, slots, grads, alpha, versions, stamp, kept, kept_versions):  # pragma: no cover
    # values[s] + alpha * g as one fused multiply-add (as torch's add_ with alpha computes it). Where
    # kept has rows (one per slot), each row and version is copied there first, as it was (what an
    # undo puts back), in the same pass.
    n, d = grads.shape
    keep = kept.shape[0] > 0
    for i in range(n):
        s = slots[i]
        if keep:
            for j in range(d):
                kept[i, j] = values[s, j]
            kept_versions[i] = versions[s]
        for j in range(d):
            values[s, j] = values[s, j] + alpha * grads[i, j]
        versions[s] = stamp[i]


def _square_sums(acc, slots, grads, out, kept):  # pragma: no cover
    # acc[s] + g * g as one fused multiply-add (as torch's addcmul_ computes it); out[i]: the new sums;
    # where kept has rows, the sums as they were
    n, d = grads.shape
    keep = kept.shape[0] > 0
    for i in range(n):
        s = slots[i]
        if keep:
            for j in range(d):
                kept[i, j] = acc[s, j]
        for j in range(d):
            g = grads[i, j]
            a = acc[s, j] + g * g
            acc[s, j] = a
            out[i, j] = a


def _divided_rows(values, slots, grads, denom, scale, versions, stamp, kept, kept_versions):  # pragma: no cover
    # values[s] + (scale * g) / denom, as torch's addcdiv_ computes it (no fused multiply-add here);
    # where kept has rows, each row and version as it was
    n, d = grads.shape
    keep = kept.shape[0] > 0
    for i in range(n):
        s = slots[i]
        if keep:
            for j in range(d):
                kept[i, j] = values[s, j]
            kept_versions[i] = versions[s]
        for j in range(d):
            values[s, j] = values[s, j] + (scale * grads[i, j]) / denom[i, j]
        versions[s] = stamp[i]


def _merged_rows(ids, slots, ends, grads, scale, out_ids, out_slots, out_grads):  # pragma: no cover
    # ids: runs [ends[k-1], ends[k]) (a sync round's workers' arena ids, rank after rank), each
    # increasing. Fills out_ids with every id once, in increasing order, and out_grads with its rows'
    # sum, run after run (0 + the first + the next..., as index_add_ adds them), times scale; where
    # slots holds one per id (its row's slot: the same for one id in every run), out_slots with each
    # id's; returns how many, or -1 where a run does not increase (nothing else done then).
    w = ends.shape[0]
    heads = np.empty(w, np.int64)
    start = 0
    for k in range(w):
        heads[k] = start
        for i in range(start + 1, ends[k]):
            if ids[i] <= ids[i - 1]:
                return -1
        start = ends[k]
    d = grads.shape[1]
    with_slots = slots.shape[0] == ids.shape[0]
    n = 0
    while True:
        m = np.int64(0)
        found = False
        for k in range(w):
            h = heads[k]
            if h < ends[k] and (not found or ids[h] < m):
                m = ids[h]
                found = True
        if not found:
            return n
        out_ids[n] = m
        for j in range(d):
            out_grads[n, j] = 0.0
        for k in range(w):
            h = heads[k]
            if h < ends[k] and ids[h] == m:
                if with_slots:
                    out_slots[n] = slots[h]
                for j in range(d):
                    out_grads[n, j] = out_grads[n, j] + grads[h, j]
                heads[k] = h + 1
        for j in range(d):
            out_grads[n, j] = out_grads[n, j] * scale
        n += 1


# error_model "numpy": a division by zero gives inf or NaN, as torch's does, where numba's default
# would check every division to raise ZeroDivisionError (and so keep the loop from vectorizing).
def _jit(fn, signature, cache: bool, contract: bool):
    return numba.njit(signature, cache=cache, nogil=True, boundscheck=False, error_model="numpy",
                      fastmath={"contract"} if contract else False)(fn)


def _compile(cache: bool) -> dict[str, object]:
    f32 = types.float32
    return {
        "locate": _jit(_locate, types.UniTuple(types.int64, 2)(_I64_IN, _I64_IN, _I64_IN, _I64_IN, types.int64, types.int64,
                                                               types.boolean, types.boolean, _I64_IN, _I64, _I64),
                       cache, False),
        "claimed": _jit(_claimed, types.int64(_I64_IN, _I64_IN, types.int64, _I64, _I64), cache, False),
        "gather": _jit(_gather, types.void(_F32_IN, _I64_IN, _F32), cache, False),
        "touched": _jit(_touched, types.float32(_F32_IN, _F32_IN, _I64_IN, _I64_IN), cache, False),
        "sgd_rows": _jit(_sgd_rows, types.void(_F32, _I64_IN, _F32_IN, f32, _I64, _I64_IN, _F32, _I64), cache, True),
        "square_sums": _jit(_square_sums, types.void(_F32, _I64_IN, _F32_IN, _F32, _F32), cache, True),
        "merged_rows": _jit(_merged_rows, types.int64(_I64_IN, _I64_IN, _I64_IN, _F32_IN, f32, _I64, _I64, _F32),
                            cache, False),
        "divided_rows": _jit(_divided_rows, types.void(_F32, _I64_IN, _F32_IN, _F32_IN, f32, _I64, _I64_IN, _F32, _I64),
                             cache, False),
    }


try:
    KERNELS = _compile(cache=True)
except RuntimeError:  # no writable place for the cache
    KERNELS = _compile(cache=False)
