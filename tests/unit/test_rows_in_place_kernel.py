"""The compiled read of rows in place (client/_rows_in_place_kernel.py): checked against torch's
gathers and the placement of core/rows.py, as a worker checks it after compiling, and that check
able to tell a kernel that differs."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from psgrad.client import rows_in_place as in_place

pytestmark = pytest.mark.timeout(120)

numba = pytest.importorskip("numba")


@pytest.fixture(scope="module")
def kernel() -> Any:
    from psgrad.client._rows_in_place_kernel import KERNEL

    return KERNEL


def test_the_kernel_reads_and_places_what_torch_does(kernel: Any) -> None:
    assert in_place._agrees_with_torch(kernel)


@pytest.mark.parametrize("fault", ["row", "fresh", "order", "count", "bounds"])
def test_the_check_tells_a_kernel_that_differs(kernel: Any, fault: str) -> None:
    def wrong(ids, starts, bases, shards, shard, index, values, out, fresh, order, counts, at):  # type: ignore[no-untyped-def]
        if fault == "bounds" and (index.shape[0] < 4 or values.shape[0] < 5):
            return 0  # (reads past what is mapped, unrefused)
        got = kernel(ids, starts, bases, shards, shard, index, values, out, fresh, order, counts, at)
        if fault == "row" and out.shape[0] > 3:
            out[3] += 1.0
        elif fault == "fresh" and at[0]:
            at[0] -= 1
        elif fault == "order" and at[1] > 3:
            order[at[1] - 1], order[at[1] - 2] = order[at[1] - 2], order[at[1] - 1]
        elif fault == "count" and counts.shape[0] > 2:
            counts[2] += 1
        return got

    assert not in_place._agrees_with_torch(wrong)


def test_an_index_place_past_the_mapped_is_refused(kernel: Any) -> None:
    rows = np.arange(8, dtype=np.float32).reshape(4, 2)
    out, fresh, order, counts, at = (np.zeros((2, 2), np.float32), np.empty(2, np.int64), np.empty(2, np.int64),
                                     np.empty(1, np.int64), np.zeros(2, np.int64))
    starts, bases = np.array([0, 2], np.int64), np.zeros(1, np.int64)
    index = np.array([2, -1], np.int64)
    assert kernel(np.array([0, 1], np.int64), starts, bases, 1, 0, index, rows, out, fresh, order, counts, at) == 0
    assert out[0].tolist() == [4.0, 5.0] and at.tolist() == [1, 2] and fresh[0] == 1 and counts[0] == 2
    assert kernel(np.array([0, 2], np.int64), starts, bases, 1, 0, index, rows, out, fresh, order, counts,
                  np.zeros(2, np.int64)) == -1
