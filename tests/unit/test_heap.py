"""psgrad.wire.heap: the allocator settings apply once, and only where the C library is glibc."""
from __future__ import annotations

import platform

import pytest

from psgrad.wire.heap import tune_allocator

pytestmark = pytest.mark.timeout(30)


def test_tune_allocator_is_idempotent_and_reports_glibc() -> None:
    first = tune_allocator()
    assert tune_allocator() is first
    assert first == (platform.libc_ver()[0] == "glibc")
