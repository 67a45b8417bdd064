"""The compiled draw of sparse tables' initial rows (core/_draw_kernel.py, through core/compiled.py):
the values of numpy's steps (core/rows.py) bit for bit, used by rows.initial_rows wherever it is
ready — servers, workers, exports — compiled by the first large draw and never by small ones, and
left unused where its check after compiling finds one bit different."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from conftest import run_python
from psgrad.core import compiled, rows

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def draw(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.delenv(compiled.ENV, raising=False)
    fn = rows.draw_kernel(wait=True)
    assert fn is not None, "numba is a dependency: the draw kernel must compile and agree with numpy's steps"
    return fn


@pytest.mark.parametrize("n,dim", [(1, 1), (6, 7), (300, 33), (2000, 64)])
def test_the_draw_kernel_gives_numpys_values_bit_for_bit(draw, n: int, dim: int) -> None:  # type: ignore[no-untyped-def]
    """For ids of either sign (a dynamic table's), rows of several tables (keys and stds per row, 0
    among them: +0.0)."""
    gen = torch.Generator().manual_seed(n)
    ids = torch.randint(-(1 << 62), 1 << 62, (n,), generator=gen)
    ids[0] = rows.RESERVED_IDS[1] + 1
    keys = np.array([rows.table_key(i % 3, f"t{i % 5}") for i in range(n)], dtype=np.uint64)
    stds = np.array([(1.0, 0.0, 0.02, 7.5)[i % 4] for i in range(n)])
    out = np.empty((n, dim), np.float32)
    draw(ids.numpy(), dim, keys, stds, out)
    assert out.tobytes() == rows._numpy_rows(keys, ids, dim, stds).tobytes()
    assert not np.abs(out[1::4]).any() and not np.signbit(out[1::4]).any()


def test_initial_rows_use_it_once_ready_with_numpys_bits(draw, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    calls: list[int] = []

    def counting(ids, dim, keys, stds, out):  # type: ignore[no-untyped-def]
        calls.append(ids.size)
        draw(ids, dim, keys, stds, out)

    monkeypatch.setattr(rows, "draw_kernel", lambda start=False, wait=False: counting)
    key, ids = rows.table_key(5, "emb"), torch.arange(-3, 500)
    single = rows.initial_rows(key, ids, 32, 0.5)
    several = rows.initial_rows(np.full(503, key, np.uint64), ids.to(torch.int32), 32, np.full(503, 0.5))
    assert calls == [503, 503]
    assert single.numpy().tobytes() == several.numpy().tobytes() == rows._numpy_rows(key, ids, 32, 0.5).tobytes()


def test_a_broken_draw_is_not_used(draw) -> None:  # type: ignore[no-untyped-def]
    """The check after compiling: a draw one bit off numpy's steps is left unused."""
    assert rows._draw_agrees(draw)

    def one_bit_off(ids, dim, keys, stds, out):  # type: ignore[no-untyped-def]
        draw(ids, dim, keys, stds, out)
        out.view(np.int32)[-1, -1] ^= 1

    assert not rows._draw_agrees(one_bit_off)


def _python(code: str, **env: str) -> str:
    """code's output in a process of its own (forked from the preloaded template, which has imported
    psgrad but neither numba nor a kernel), with env added (PSGRAD_FUSED_APPLY unset unless given)."""
    import os

    inherited = {k: v for k, v in os.environ.items() if k != compiled.ENV}
    out = run_python(["-c", code], timeout_s=100, env={**inherited, **env})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_small_draws_do_not_compile_it_and_a_large_one_does() -> None:
    code = (
        "import sys, torch\n"
        "from psgrad.core import rows\n"
        "key = rows.table_key(0, 't')\n"
        "rows.initial_rows(key, torch.arange(100), 32)\n"
        "print('numba' in sys.modules, rows.draw_kernel() is None)\n"
        "first = rows.initial_rows(key, torch.arange(1000), 32)\n"
        "print(rows.draw_kernel(wait=True) is not None)\n"
        "print(torch.equal(rows.initial_rows(key, torch.arange(1000), 32), first))\n"
    )
    assert _python(code).split() == ["False", "True", "True", "True"]


def test_turned_off_or_without_numba_numpy_draws_the_same_values() -> None:
    code = (
        "import sys, torch\n"
        "from psgrad.core import rows\n"
        "v = rows.initial_rows(rows.table_key(0, 't'), torch.arange(1000), 32)\n"
        "print(rows.draw_kernel(wait=True) is None, v.numpy().tobytes().hex()[:40], float(v.sum()))\n"
    )
    off = _python(code, PSGRAD_FUSED_APPLY="0").split()
    missing = _python("import sys; sys.modules['numba'] = None\n" + code).split()
    on = _python(code.replace("is None", "is not None")).split()
    assert off[0] == missing[0] == on[0] == "True"
    assert off[1:] == missing[1:] == on[1:]


def test_a_whole_table_is_the_rows_drawn_one_by_one_with_the_stored_ones_in_place(draw) -> None:  # type: ignore[no-untyped-def]
    key = rows.table_key(2, "emb")
    whole = rows.materialize(key, 300_000, 32, 0.1, torch.tensor([5, 299_999]), torch.ones(2, 32), chunk_rows=70_000)
    some = torch.tensor([0, 4, 6, 69_999, 70_000, 299_998])
    assert torch.equal(whole[some], rows.initial_rows(key, some, 32, 0.1))
    assert torch.equal(whole[torch.tensor([5, 299_999])], torch.ones(2, 32))
