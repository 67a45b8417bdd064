"""The compiled plain-SGD kernel (numba): imported only by psgrad.server.kernels, on a background
thread, because importing numba and compiling take about a second the first time (the machine code
is then cached next to this file, or in the user's cache directory where this one is read-only)."""
from __future__ import annotations

import numba
import numpy as np


# contract: `w + alpha * g` becomes one fused multiply-add, as torch's vectorized add_ computes it
# (bit for bit the same; checked after compiling). reassoc: lets the finiteness sum be vectorized;
# it has nothing else to reorder. g * 0 is 0 for every finite g and NaN for NaN and ±inf.
@numba.njit(nogil=True, cache=True, boundscheck=False, fastmath={"contract", "reassoc"})
def sgd_checked(w: np.ndarray, g: np.ndarray, alpha: np.float32) -> np.float32:  # pragma: no cover (compiled)
    acc = np.float32(0)
    for i in range(w.shape[0]):
        gi = g[i]
        w[i] = w[i] + alpha * gi
        acc += gi * np.float32(0)
    return acc
