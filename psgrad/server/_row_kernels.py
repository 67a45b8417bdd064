"""The compiled row kernels (numba): imported only by psgrad.server.kernels, on a background thread
(importing numba and compiling take a second or two; the machine code is cached next to this file,
or in the user's cache directory where this one is read-only; where neither can be written it is
compiled in every process). Each does in one pass over a call's rows what the torch ops of a
sparse table do in several (see kernels.py); the arithmetic ones are checked bit for bit against
the row rules after compiling, and the draw of rows never stored against core/rows.py's steps.

Signatures are given, so nothing is compiled at a call: inputs a kernel only reads are typed
read-only (a request's bytes are), which writable arrays also match."""
from __future__ import annotations

import numba
import numpy as np
from numba import types

from psgrad.core import rows

_F32 = types.Array(types.float32, 2, "C")
_F32_IN = types.Array(types.float32, 2, "C", readonly=True)
_I64 = types.Array(types.int64, 1, "C")
_I64_IN = types.Array(types.int64, 1, "C", readonly=True)
_U64_IN = types.Array(types.uint64, 1, "C", readonly=True)
_F64_IN = types.Array(types.float64, 1, "C", readonly=True)


def _locate(ids, counts, sizes, bases, num_shards, index, ascending, slot_of, arena_ids, slots):  # pragma: no cover
    # ids: member tables' row ids, concatenated (counts[k] of member k, whose rows are [0, sizes[k])
    # and start at arena id bases[k]). Fills arena_ids and slots (-1: never stored); returns (the
    # position of the first id out of range, on another shard, or (ascending) not above the one
    # before it in arena order; -1: none), and the number of ids never stored.
    at, new, last = 0, 0, np.int64(-1)
    for k in range(counts.shape[0]):
        size, base = sizes[k], bases[k]
        for _ in range(counts[k]):
            r = ids[at]
            if r < 0 or r >= size or (num_shards > 1 and r % num_shards != index):
                return at, new
            a = r + base
            if ascending and a <= last:
                return at, new
            last = a
            arena_ids[at] = a
            s = slot_of[a // num_shards]
            slots[at] = s
            if s < 0:
                new += 1
            at += 1
    return -1, new


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


def _sgd_rows(values, slots, grads, alpha, versions, stamp):  # pragma: no cover
    # values[s] + alpha * g as one fused multiply-add (as torch's add_ with alpha computes it)
    n, d = grads.shape
    for i in range(n):
        s = slots[i]
        for j in range(d):
            values[s, j] = values[s, j] + alpha * grads[i, j]
        versions[s] = stamp[i]


def _square_sums(acc, slots, grads, out):  # pragma: no cover
    # acc[s] + g * g as one fused multiply-add (as torch's addcmul_ computes it); out[i]: the new sums
    n, d = grads.shape
    for i in range(n):
        s = slots[i]
        for j in range(d):
            g = grads[i, j]
            a = acc[s, j] + g * g
            acc[s, j] = a
            out[i, j] = a


def _divided_rows(values, slots, grads, denom, scale, versions, stamp):  # pragma: no cover
    # values[s] + (scale * g) / denom, as torch's addcdiv_ computes it (no fused multiply-add here)
    n, d = grads.shape
    for i in range(n):
        s = slots[i]
        for j in range(d):
            values[s, j] = values[s, j] + (scale * grads[i, j]) / denom[i, j]
        versions[s] = stamp[i]


# Rows never stored: rows.initial_rows's values, the same steps in the same order (core/rows.py says
# why they are only +, -, *, / and sqrt), one pass; every constant is the same double as there.
_GOLDEN, _MIX1, _MIX2 = rows._GOLDEN, rows._MIX1, rows._MIX2
_LN2_HI, _LN2_LO, _SQRT2 = rows._LN2_HI, rows._LN2_LO, rows._SQRT2
L1, L2, L3, L4, L5, L6, L7, L8, L9, L10 = rows._LOG_R
C0, C1, C2, C3, C4, C5, C6, C7, C8, C9 = rows._COS
S0, S1, S2, S3, S4, S5, S6, S7, S8, S9 = rows._SIN
_U = np.uint64


@numba.njit(inline="always")
def _mix(x):  # pragma: no cover
    # splitmix64 (rows.splitmix64)
    x = x + _GOLDEN
    x = (x ^ (x >> _U(30))) * _MIX1
    x = (x ^ (x >> _U(27))) * _MIX2
    return x ^ (x >> _U(31))


@numba.njit(inline="always")
def _normal(a, b):  # pragma: no cover
    # rows._normal of one value: ln u1 (n = m 2^e: e by halving, m = x 2^-e exactly), then cos(2 pi u2)
    n = (a >> _U(11)) + _U(1)
    x = np.float64(n)
    e, v = 0, n
    for shift in (32, 16, 8, 4, 2, 1):
        high = v >> _U(shift)
        if high != _U(0):
            v = high
            e += shift
    m = x * (np.float64(_U(1) << _U(53 - e)) * 2.0 ** -53)
    if m > _SQRT2:
        m = m * 0.5
        e += 1
    k = np.float64(e - 53)
    f = m - 1.0
    s = f / (f + 2.0)
    z = s * s
    r = (((((((((L10 * z + L9) * z + L8) * z + L7) * z + L6) * z + L5) * z + L4) * z + L3) * z + L2) * z + L1) * z
    hfsq = (f * 0.5) * f
    r = hfsq - ((r + hfsq) * s + k * _LN2_LO)
    r = k * _LN2_HI + (f - r)
    radius = np.sqrt(r * -2.0)
    t = b >> _U(11)
    q = (t + _U(1 << 50)) >> _U(51)
    xr = np.float64(np.int64(t - (q << _U(51)))) * 2.0 ** -53
    x2 = xr * xr
    if q & _U(1):
        c = (((((((((S9 * x2 + S8) * x2 + S7) * x2 + S6) * x2 + S5) * x2 + S4) * x2 + S3) * x2 + S2) * x2 + S1) * x2
             + S0) * xr
    else:
        c = ((((((((C9 * x2 + C8) * x2 + C7) * x2 + C6) * x2 + C5) * x2 + C4) * x2 + C3) * x2 + C2) * x2 + C1) * x2 + C0
    if (q + _U(1)) & _U(2):
        c = -c
    return radius * c


def _draw(ids, dim, keys, stds, out):  # pragma: no cover
    # out[i, j]: element j of row ids[i], of the table keys[i] names, times stds[i] (+0.0 where it is 0)
    for i in range(ids.shape[0]):
        base = _U(ids[i]) * _U(dim)
        key, std = keys[i], stds[i]
        for j in range(dim):
            a = _mix((base + _U(j)) ^ key)
            b = _mix(a)
            out[i, j] = np.float32(0.0) if std == 0.0 else np.float32(_normal(a, b) * std)


# error_model "numpy": a division by zero gives inf or NaN, as torch's does, where numba's default
# would check every division to raise ZeroDivisionError (and so keep the loop from vectorizing).
def _jit(fn, signature, cache: bool, contract: bool):
    return numba.njit(signature, cache=cache, nogil=True, boundscheck=False, error_model="numpy",
                      fastmath={"contract"} if contract else False)(fn)


def _compile(cache: bool) -> dict[str, object]:
    f32 = types.float32
    return {
        "locate": _jit(_locate, types.UniTuple(types.int64, 2)(_I64_IN, _I64_IN, _I64_IN, _I64_IN, types.int64,
                                                               types.int64, types.boolean, _I64_IN, _I64, _I64),
                       cache, False),
        "gather": _jit(_gather, types.void(_F32_IN, _I64_IN, _F32), cache, False),
        "sgd_rows": _jit(_sgd_rows, types.void(_F32, _I64_IN, _F32_IN, f32, _I64, _I64_IN), cache, True),
        "square_sums": _jit(_square_sums, types.void(_F32, _I64_IN, _F32_IN, _F32), cache, True),
        "divided_rows": _jit(_divided_rows, types.void(_F32, _I64_IN, _F32_IN, _F32_IN, f32, _I64, _I64_IN),
                             cache, False),
        "draw": _jit(_draw, types.void(_I64_IN, types.int64, _U64_IN, _F64_IN, _F32), cache, False),
    }


try:
    KERNELS = _compile(cache=True)
except RuntimeError:  # no writable place for the cache
    KERNELS = _compile(cache=False)
