"""The compiled kernels of a lookup in embedding tables (numba): imported only by psgrad.nn.lookups,
on a background thread (importing numba and compiling take a second or two; the machine code is
cached next to this file, or in the user's cache directory where this one is read-only; where
neither can be written it is compiled in every process). One pass over the ids of every table of
a lookup finds each table's unique ids (where torch takes a unique per table: a sort of its ids), and
one pools the bags (forward) or spreads the output's gradient over the rows (backward), where torch
takes an embedding_bag, its backward (another sort of the ids, then a pass) and a concatenation per
table.

The layout they take: the tables' ids one table after another (table t's at id_start[t] to
id_start[t + 1]). unique: table t's unique ids, in increasing order, at the start of its place
(counts[t] of them), and each id's index among them (torch.unique's sorted ids and inverse):
a hash table gives each id the index of its first occurrence, then the few unique ids are sorted
(a radix sort, a byte a pass, as many passes as their span needs).
Pooling: the tables' rows in one array [rows, D] (table t's from row_start[t]); each id's row within
its table (`inverse`); each table's bag starts among its ids (`offsets` [T, B]: bag b of table t is
its ids offsets[t, b] to offsets[t, b + 1], the last one to its end); the output [B, T * D], table
t's pooled bags in columns t * D to (t + 1) * D. The arithmetic is torch's, in torch's order: a
bag's sum adds its rows in order from zero, a mean divides that sum by the bag's size; a row's
gradient adds, in the order of the ids, the output gradient of each bag holding it (a mean's times
1 / size). lookups.py checks every result bit for bit against torch's after compiling."""
from __future__ import annotations

import numba
import numpy as np
from numba import types

_F32 = types.Array(types.float32, 2, "C")
_F32_IN = types.Array(types.float32, 2, "C", readonly=True)
_F32_STRIDED_IN = types.Array(types.float32, 2, "A", readonly=True)  # (an output's gradient: rows of any stride)
_I64 = types.Array(types.int64, 1, "C")
_I64_IN = types.Array(types.int64, 1, "C", readonly=True)
_I64_2D_IN = types.Array(types.int64, 2, "C", readonly=True)


def _unique(ids, id_start, unique, inverse, counts):  # pragma: no cover
    T = id_start.shape[0] - 1
    most = 1
    for t in range(T):
        most = max(most, id_start[t + 1] - id_start[t])
    bits = 4  # a hash table of 2^bits places, at least twice the most ids of a table
    while (1 << bits) < 2 * most:
        bits += 1
    mask, shift, mult = (1 << bits) - 1, np.uint64(64 - bits), np.uint64(0x9E3779B97F4A7C15)
    key = np.empty(1 << bits, np.int64)
    at = np.empty(1 << bits, np.int64)  # the index of the id in that place (-1: free)
    firsts = np.empty(most, np.int64)  # the unique ids in the order of their first occurrence
    first_of = np.empty(most, np.int64)  # each id's index among firsts
    rank = np.empty(most, np.int64)
    # the radix sort's (offset from the least id, index among firsts), in two buffers a pass reads
    # and writes in turn, and its counts of a byte's values
    offset, offset_to = np.empty(most, np.uint64), np.empty(most, np.uint64)
    index, index_to = np.empty(most, np.int64), np.empty(most, np.int64)
    count = np.empty(256, np.int64)
    for t in range(T):
        s, e = id_start[t], id_start[t + 1]
        at[:] = -1
        u = 0
        for i in range(s, e):
            x = ids[i]
            h = np.int64((np.uint64(x) * mult) >> shift)  # (Fibonacci hashing: the high bits of x * 2^64 / phi)
            while at[h] >= 0 and key[h] != x:
                h = (h + 1) & mask
            if at[h] < 0:
                at[h], key[h], firsts[u] = u, x, x
                u += 1
            first_of[i - s] = at[h]
        # firsts sorted by a least-significant-byte-first radix sort of their offsets from the least
        # (unsigned: any int64 span), only as many passes as the span has bytes: three for a
        # table of a few million rows, where a comparison sort takes several times as long
        least, greatest = np.int64(0), np.int64(0)
        for j in range(u):
            x = firsts[j]
            if j == 0 or x < least:
                least = x
            if j == 0 or x > greatest:
                greatest = x
        span = np.uint64(greatest) - np.uint64(least)
        for j in range(u):
            offset[j] = np.uint64(firsts[j]) - np.uint64(least)
            index[j] = j
        by = np.uint64(0)
        while u > 1:
            count[:] = 0
            for j in range(u):
                count[np.int64((offset[j] >> by) & np.uint64(255))] += 1
            total = 0
            for d in range(256):
                total, count[d] = total + count[d], total
            for j in range(u):  # (stable: equal bytes keep the order of the pass before)
                d = np.int64((offset[j] >> by) & np.uint64(255))
                offset_to[count[d]], index_to[count[d]] = offset[j], index[j]
                count[d] += 1
            offset, offset_to = offset_to, offset
            index, index_to = index_to, index
            by += np.uint64(8)
            if by == np.uint64(64) or (span >> by) == np.uint64(0):
                break
        for j in range(u):
            rank[index[j]] = j
            unique[s + j] = firsts[index[j]]
        for i in range(s, e):
            inverse[i] = rank[first_of[i - s]]
        counts[t] = u


def _valid(inverse, id_start, offsets, rows_of):  # pragma: no cover
    # Whether every bag start is in order within its table (the first at 0, none past the table's
    # ids) and every id's row within its table's rows (rows_of[t]).
    T, B = offsets.shape
    for t in range(T):
        n = id_start[t + 1] - id_start[t]
        last = np.int64(0)
        for b in range(B):
            s = offsets[t, b]
            if (b == 0 and s != 0) or s < last or s > n:
                return False
            last = s
        for i in range(id_start[t], id_start[t + 1]):
            r = inverse[i]
            if r < 0 or r >= rows_of[t]:
                return False
    return True


def _pool(weight, inverse, id_start, offsets, row_start, mean, apart, out):  # pragma: no cover
    # apart: out is [T * B, D], table t's bags in rows t * B to (t + 1) * B (each table's output
    # a block of its own), else [B, T * D] (see the module doc; several tables' [B, T * D] output
    # is _pool_by_bag's to write)
    T, B = offsets.shape
    d = weight.shape[1]
    total = np.empty(d, np.float32)  # (a mean's sum, divided as it is stored: one pass over the output row)
    for t in range(T):
        first, n, r0 = id_start[t], id_start[t + 1] - id_start[t], row_start[t]
        col = 0 if apart else t * d
        for b in range(B):
            o = t * B + b if apart else b
            s = offsets[t, b]
            e = offsets[t, b + 1] if b + 1 < B else n
            if mean:
                for j in range(d):
                    total[j] = 0
                for i in range(s, e):
                    r = r0 + inverse[first + i]
                    for j in range(d):
                        total[j] += weight[r, j]
                size = np.float32(max(e - s, 1))  # (an empty bag: zeros, divided by nothing)
                for j in range(d):
                    out[o, col + j] = total[j] / size
                continue
            for j in range(d):
                out[o, col + j] = 0
            for i in range(s, e):
                r = r0 + inverse[first + i]
                for j in range(d):
                    out[o, col + j] += weight[r, j]


def _pool_by_bag(weight, inverse, id_start, offsets, row_start, mean, out):  # pragma: no cover
    # _pool's [B, T * D] output, bag after bag: each bag's row of the output written whole, each
    # of its tables in turn (table after table came back to every row of the output once a
    # table: half as long again in a training step, whose servers share the caches). A bag's
    # pooling is _pool's, written again: one function inlined into both loops took a mean's
    # bags 11 % longer (its sum buffer, an argument there, may alias the output for the compiler)
    T, B = offsets.shape
    d = weight.shape[1]
    total = np.empty(d, np.float32)
    for b in range(B):
        for t in range(T):
            first, n, r0, col = id_start[t], id_start[t + 1] - id_start[t], row_start[t], t * d
            s = offsets[t, b]
            e = offsets[t, b + 1] if b + 1 < B else n
            if mean:
                for j in range(d):
                    total[j] = 0
                for i in range(s, e):
                    r = r0 + inverse[first + i]
                    for j in range(d):
                        total[j] += weight[r, j]
                size = np.float32(max(e - s, 1))
                for j in range(d):
                    out[b, col + j] = total[j] / size
                continue
            for j in range(d):
                out[b, col + j] = 0
            for i in range(s, e):
                r = r0 + inverse[first + i]
                for j in range(d):
                    out[b, col + j] += weight[r, j]


def _pool_backward(grad_out, inverse, id_start, offsets, row_start, mean, grad_weight):  # pragma: no cover
    T, B = offsets.shape
    d = grad_weight.shape[1]
    # each bag's output gradient (a mean's times 1 / size, the same product for each of its rows)
    # taken into a buffer of its own first: one the rows' gradients cannot overlap, so the compiler
    # vectorizes their sums (over the output's gradient, of any stride, it did not: twice the time).
    # Bag after bag, each bag's tables in turn: the output's gradient read row by row as it lies
    # (a row's gradients still add in the order of its table's ids: the tables' rows are apart)
    row = np.empty(d, np.float32)
    for b in range(B):
        for t in range(T):
            first, n, r0, col = id_start[t], id_start[t + 1] - id_start[t], row_start[t], t * d
            s = offsets[t, b]
            e = offsets[t, b + 1] if b + 1 < B else n
            if mean:
                scale = np.float32(1) / np.float32(max(e - s, 1))
                for j in range(d):
                    row[j] = scale * grad_out[b, col + j]
            else:
                for j in range(d):
                    row[j] = grad_out[b, col + j]
            for i in range(s, e):
                r = r0 + inverse[first + i]
                for j in range(d):
                    grad_weight[r, j] += row[j]


def _jit(fn, signature, cache: bool):
    # no fused multiply-adds (fastmath off): a mean's gradient is a product, then a sum, as torch's
    return numba.njit(signature, cache=cache, nogil=True, boundscheck=False, error_model="numpy")(fn)


def _compile(cache: bool) -> dict[str, object]:
    b = types.boolean
    return {
        "unique": _jit(_unique, types.void(_I64_IN, _I64_IN, _I64, _I64, _I64), cache),
        "valid": _jit(_valid, b(_I64_IN, _I64_IN, _I64_2D_IN, _I64_IN), cache),
        "pool": _jit(_pool, types.void(_F32_IN, _I64_IN, _I64_IN, _I64_2D_IN, _I64_IN, b, b, _F32), cache),
        "pool_by_bag": _jit(_pool_by_bag, types.void(_F32_IN, _I64_IN, _I64_IN, _I64_2D_IN, _I64_IN, b, _F32), cache),
        "pool_backward": _jit(_pool_backward, types.void(_F32_STRIDED_IN, _I64_IN, _I64_IN, _I64_2D_IN, _I64_IN, b,
                                                         _F32), cache),
    }


try:
    KERNELS = _compile(cache=True)
except RuntimeError:  # no writable place for the cache
    KERNELS = _compile(cache=False)
