"""The compiled plain-SGD kernel (numba): imported only by psgrad.server.kernels, on a background
thread, because importing numba and compiling take about a second (the machine code is cached next
to this file, or in the user's cache directory where this one is read-only; where neither can be
written it is compiled in every process)."""
from __future__ import annotations

import numba
import numpy as np


def _sgd_checked(w: np.ndarray, g: np.ndarray, alpha: np.float32) -> np.float32:  # pragma: no cover (compiled)
    acc = np.float32(0)
    for i in range(w.shape[0]):
        gi = g[i]
        w[i] = w[i] + alpha * gi
        acc += gi * np.float32(0)
    return acc


# contract: `w + alpha * g` becomes one fused multiply-add, as torch's vectorized add_ computes it
# (bit for bit the same; checked after compiling). reassoc: lets the finiteness sum be vectorized;
# it has nothing else to reorder. g * 0 is 0 for every finite g and NaN for NaN and ±inf.
def _jit(cache: bool):
    return numba.njit(cache=cache, nogil=True, boundscheck=False, fastmath={"contract", "reassoc"})(_sgd_checked)


try:
    sgd_checked = _jit(cache=True)
except RuntimeError:  # no writable place for the cache
    sgd_checked = _jit(cache=False)
