"""The compiled draw of sparse tables' initial rows (numba): rows.initial_rows's values, the same
steps in the same order as rows.py's numpy ones (its comment says why they are only +, -, *, / and
sqrt), so the same bits, in one pass over the rows where numpy makes some sixty; rows.py passes
its constants in (DRAW_CONSTANTS), so each is the same double. Imported only by psgrad.core.rows,
on a background thread (core/compiled.py), which checks it against numpy's steps before using it.
The machine code is cached next to this file, or in the user's cache directory where this one is
read-only; where neither can be written it is compiled in every process."""
from __future__ import annotations

import numba
import numpy as np
from numba import types

_U = np.uint64


@numba.njit(inline="always")
def _mix(x, golden, mix1, mix2):  # pragma: no cover
    # splitmix64 (rows.splitmix64)
    x = x + golden
    x = (x ^ (x >> _U(30))) * mix1
    x = (x ^ (x >> _U(27))) * mix2
    return x ^ (x >> _U(31))


@numba.njit(inline="always")
def _poly(c, x):  # pragma: no cover
    # c0 + x (c1 + x (... + x c9)), innermost first (rows._horner)
    return (((((((((c[9] * x + c[8]) * x + c[7]) * x + c[6]) * x + c[5]) * x + c[4]) * x + c[3]) * x + c[2]) * x
             + c[1]) * x + c[0])


@numba.njit(inline="always")
def _normal(a, b, ln2_hi, ln2_lo, sqrt2, log_r, cos_c, sin_c):  # pragma: no cover
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
    if m > sqrt2:
        m = m * 0.5
        e += 1
    k = np.float64(e - 53)
    f = m - 1.0
    s = f / (f + 2.0)
    z = s * s
    r = _poly(log_r, z) * z
    hfsq = (f * 0.5) * f
    r = hfsq - ((r + hfsq) * s + k * ln2_lo)
    r = k * ln2_hi + (f - r)
    radius = np.sqrt(r * -2.0)
    t = b >> _U(11)
    q = (t + _U(1 << 50)) >> _U(51)
    xr = np.float64(np.int64(t - (q << _U(51)))) * 2.0 ** -53
    x2 = xr * xr
    c = _poly(sin_c, x2) * xr if q & _U(1) else _poly(cos_c, x2)
    if (q + _U(1)) & _U(2):
        c = -c
    return radius * c


def _draw(ids, dim, keys, stds, out, mix, co):  # pragma: no cover
    # out[i, j]: element j of row ids[i], of the table keys[i] names, times stds[i] (+0.0 where it is
    # 0). mix: splitmix64's three constants; co: ln 2 (two parts), sqrt 2, then the log's, the
    # cosine's and the sine's 10 coefficients each (rows.DRAW_CONSTANTS), read once into locals.
    golden, mix1, mix2 = mix[0], mix[1], mix[2]
    ln2_hi, ln2_lo, sqrt2 = co[0], co[1], co[2]
    log_r = (co[3], co[4], co[5], co[6], co[7], co[8], co[9], co[10], co[11], co[12])
    cos_c = (co[13], co[14], co[15], co[16], co[17], co[18], co[19], co[20], co[21], co[22])
    sin_c = (co[23], co[24], co[25], co[26], co[27], co[28], co[29], co[30], co[31], co[32])
    for i in range(ids.shape[0]):
        base = _U(ids[i]) * _U(dim)
        key, std = keys[i], stds[i]
        for j in range(dim):
            a = _mix((base + _U(j)) ^ key, golden, mix1, mix2)
            b = _mix(a, golden, mix1, mix2)
            z = _normal(a, b, ln2_hi, ln2_lo, sqrt2, log_r, cos_c, sin_c)
            out[i, j] = np.float32(0.0) if std == 0.0 else np.float32(z * std)


_U64_IN = types.Array(types.uint64, 1, "C", readonly=True)
_F64_IN = types.Array(types.float64, 1, "C", readonly=True)
_SIGNATURE = types.void(types.Array(types.int64, 1, "C", readonly=True), types.int64, _U64_IN, _F64_IN,
                        types.Array(types.float32, 2, "C"), _U64_IN, _F64_IN)


def _compile(cache: bool) -> object:
    # No fused multiply-adds (fastmath off): each step rounds as numpy's does.
    return numba.njit(_SIGNATURE, cache=cache, nogil=True, boundscheck=False, error_model="numpy")(_draw)


try:
    DRAW = _compile(cache=True)
except RuntimeError:  # no writable place for the cache
    DRAW = _compile(cache=False)
