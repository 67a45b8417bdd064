"""Compiled (numba) kernels of a process, by kind: each kind compiled once per process, in the
background, the first time a caller asks for it; until it is ready (or where numba is missing, or
the kind's check after compiling finds one bit different from the code it replaces) callers get
None and run that code. PSGRAD_FUSED_APPLY=0 turns every kind off.

The kinds: the shard's fused SGD update and its row kernels (server/kernels.py), the draw of
sparse tables' initial rows (core/rows.py), which servers, workers and exports share, and a
worker's lookup in its embedding tables: unique ids and pooled bags (nn/lookups.py)."""
from __future__ import annotations

import atexit
import gc
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

_log = logging.getLogger("psgrad")
ENV = "PSGRAD_FUSED_APPLY"


class _Compiled:
    """One process's compiled kernels of one kind: compiled once (a forked child compiles its own)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.fn: Any = None  # None while compiling, or where it is unavailable


_BY_PID: dict[tuple[int, str], _Compiled] = {}
_LOCK = threading.Lock()
_EXITING = False  # the interpreter is exiting: the kernels were let go (see _wait_at_exit)


def enabled() -> bool:
    """Whether compiled kernels may be used at all (PSGRAD_FUSED_APPLY is not 0/false/off/no)."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def get(kind: str, make: Callable[[], Any], start: bool, wait: bool) -> Any:
    """The compiled kernels of `kind` (what make() returns: None where they differ from the code
    they replace), or None: not ready yet (start: a call that starts compiling them on a background
    thread; wait=True waits for that), turned off, or unavailable here."""
    if not enabled() or _EXITING:
        return None
    key = (os.getpid(), kind)
    with _LOCK:
        compiled = _BY_PID.get(key)
        if compiled is None:
            if not (start or wait):
                return None
            compiled = _BY_PID[key] = _Compiled()
            threading.Thread(target=_compile, args=(compiled, kind, make), name="psgrad-compile", daemon=True).start()
    if wait:
        compiled.done.wait(120)
    return compiled.fn


def _wait_at_exit(timeout_s: float = 120.0) -> None:
    """At the interpreter's exit, let this process's compiles in flight end first: numba's compiler
    (LLVM) still running on its daemon thread while the interpreter finalizes aborts the process
    ("terminate called without an active exception", exit 134), which a script that ended within
    a second or two of a table's first lookup met. Then the kernels are let go and collected while
    numba is whole (callers still running get None and run the code they replace): freed during the
    interpreter's finalization instead, LLVM's objects printed "Exception ignored in ObjectRef.__del__
    ... TypeError: 'NoneType' object is not callable" tracebacks at the exit of some scripts."""
    global _EXITING
    deadline = time.monotonic() + timeout_s
    mine = [compiled for (pid, _), compiled in list(_BY_PID.items()) if pid == os.getpid()]
    for compiled in mine:
        compiled.done.wait(max(0.0, deadline - time.monotonic()))
    _EXITING = True
    for compiled in list(_BY_PID.values()):
        compiled.fn = None
    if not _BY_PID:
        return  # (none compiled here, nor in a parent forked from: nothing of numba's to collect, and a
        # full collection costs ~0.2 s)
    # A program that froze its objects for a quick exit (cli/main.py's entry) has frozen the kernels
    # too: they are collected all the same, and the rest frozen again.
    frozen = gc.get_freeze_count() > 0
    if frozen:
        gc.unfreeze()
    gc.collect()
    if frozen:
        gc.freeze()


atexit.register(_wait_at_exit)


def _compile(compiled: _Compiled, kind: str, make: Callable[[], Any]) -> None:
    try:
        compiled.fn = make()
        if compiled.fn is None:
            _log.warning("compiled %s kernels differ from the code they replace on this machine; not using them", kind)
    except Exception as e:  # numba missing or broken here: the code they replace does the work
        _log.info("compiled %s kernels unavailable (%s: %s); not using them", kind, type(e).__name__, e)
    finally:
        compiled.done.set()
