"""The compiled kernel of a worker's read of rows in place (numba): imported only by
psgrad.client.rows_in_place, on a background thread (importing numba and compiling take a second or
two; the machine code is cached next to this file, or in the user's cache directory where this one
is read-only; where neither can be written it is compiled in every process).

One pass over a forward's ids of several tables (joined, table after table) reads, for one shard
that lends its rows, each of its ids' row: the id's place in the shard's row index, then the row,
written at the id's own position of the caller's rows, where the worker otherwise took, per shard,
a placement of the ids, a gather of the index, a gather of the rows and a scatter into the tables'
rows; the same pass places the ids on the shards (their positions shard by shard, and each table's
count on each shard: what the step's push of their gradients splits them by). rows_in_place.py
checks it against torch's gathers and core/rows.py's placement after compiling."""
from __future__ import annotations

import numba
import numpy as np
from numba import types

_F32 = types.Array(types.float32, 2, "C")
_F32_IN = types.Array(types.float32, 2, "C", readonly=True)
_I64 = types.Array(types.int64, 1, "C")
_I64_IN = types.Array(types.int64, 1, "C", readonly=True)


def _read(ids, starts, bases, num_shards, shard, index, values, out, fresh, order, counts, at):  # pragma: no cover
    # Table t's ids are ids[starts[t]:starts[t + 1]] (global row ids, >= 0), stored at arena id
    # r + bases[t]; the ids on this shard (r mod num_shards == shard) have their slot at
    # index[(r + bases[t]) // num_shards] (-1: never stored) and their row at values[slot]. Copies
    # each stored row to out[position]; appends the positions of ids never stored to fresh (from
    # at[0] on) and the positions of all the shard's ids to order (from at[1] on), and counts each
    # table's ids on the shard (counts[t]); at holds the new ends. Returns 0, or -1 where an index
    # place or a slot lies past what is mapped (the shard moved its files: nothing read is to be
    # used).
    n_index, n_rows, d = index.shape[0], values.shape[0], values.shape[1]
    k, o = at[0], at[1]
    # (a power of two of shards, as most jobs have: a mask and a shift where a division by a
    # number known only now takes tens of cycles, twice an id; the ids and bases are >= 0)
    pow2, low, by = num_shards & (num_shards - 1) == 0, num_shards - 1, 0
    while (1 << by) < num_shards:
        by += 1
    # Two passes: the shard's ids placed and their slots read from the index, then their rows
    # copied. Each pass's loads are independent of each other, so many are in flight at once,
    # where one pass waited on each id's slot before it could read its row.
    o0 = o
    slot_of = np.empty(order.shape[0] - o0, np.int64)
    for t in range(bases.shape[0]):
        base = bases[t]
        counts[t] = 0
        for p in range(starts[t], starts[t + 1]):
            r = ids[p]
            if (r & low if pow2 else r % num_shards) != shard:
                continue
            counts[t] += 1
            order[o] = p
            a = (r + base) >> by if pow2 else (r + base) // num_shards
            if a < 0 or a >= n_index:
                return -1
            s = index[a]
            if s >= n_rows:
                return -1
            if s < 0:
                fresh[k] = p
                k += 1
            slot_of[o - o0] = s
            o += 1
    for q in range(o - o0):
        s = slot_of[q]
        if s >= 0:
            p = order[o0 + q]
            for j in range(d):
                out[p, j] = values[s, j]
    at[0], at[1] = k, o
    return 0


def _compile(cache: bool) -> object:
    i64 = types.int64
    return numba.njit(i64(_I64_IN, _I64_IN, _I64_IN, i64, i64, _I64_IN, _F32_IN, _F32, _I64, _I64, _I64, _I64),
                      cache=cache, nogil=True, boundscheck=False)(_read)


try:
    KERNEL = _compile(cache=True)
except RuntimeError:  # no writable place for the cache
    KERNEL = _compile(cache=False)
