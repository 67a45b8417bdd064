"""CtrlC: a Ctrl-C that Python swallowed (its KeyboardInterrupt raised inside a __del__ or an
at-fork hook is only printed) is raised again by check(), so launch, compare and status --watch stop."""
from __future__ import annotations

import signal
import sys
from typing import Any

import pytest

from psgrad.launch.supervisor import CtrlC

pytestmark = pytest.mark.timeout(30)


class _Swallowing:
    """Its __del__ is where the signal's handler runs: Python prints "Exception ignored in ..." and
    drops the KeyboardInterrupt (as it did in logging's at-fork hook while compare started a child)."""

    def __del__(self) -> None:
        signal.raise_signal(signal.SIGINT)


def test_a_swallowed_ctrl_c_is_raised_again_by_check(monkeypatch: pytest.MonkeyPatch) -> None:
    dropped: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: dropped.append(u.exc_type))  # what Python prints
    with CtrlC() as ctrl_c:
        ctrl_c.check()  # nothing yet
        _Swallowing()  # collected at once: the KeyboardInterrupt is lost there
        assert dropped == [KeyboardInterrupt]
        with pytest.raises(KeyboardInterrupt):
            ctrl_c.check()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_a_ctrl_c_that_comes_through_still_raises_where_it_lands() -> None:
    with CtrlC() as ctrl_c, pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)
    assert ctrl_c.seen


def test_an_ignored_sigint_stays_ignored() -> None:
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with CtrlC() as ctrl_c:
            signal.raise_signal(signal.SIGINT)
            ctrl_c.check()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
