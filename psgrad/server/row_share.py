"""A shard's side of rows read in place on one host (see wire/row_share.py): the shard lock that
keeps the shared header's counter odd while held (SeqLock), and the tables' rows and row indexes
lent to the workers of its host in files under /dev/shm (RowShare)."""
from __future__ import annotations

import logging
import math
import os
import re
import secrets
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from psgrad.server.row_index import DenseIndex
from psgrad.server.table_groups import GroupedTable
from psgrad.server.tables import SparseTable
from psgrad.wire import row_share, shm

_log = logging.getLogger(__name__)


class SeqLock:
    """The shard's reentrant lock, as threading.RLock (and as the lock of its Conditions), that
    keeps a shared counter odd while it is held: each outermost acquire moves it to odd and each
    outermost release, after `before_release` (which writes what readers read with the rows: the
    tables' versions), to even; a Condition's wait lets the lock go (even) and takes it back (odd).
    Without a counter (nothing shared) it is an RLock with a depth count."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._depth = 0  # (only the owner reads or writes it)
        self._counter: np.ndarray | None = None
        self.before_release: Callable[[], None] | None = None

    def attach(self, counter: np.ndarray) -> None:
        """Keep `counter` (an int64 array's first element, shared) from now on. Called by the
        owner, holding the lock: the counter goes odd now, even at the release."""
        assert self._depth > 0, "attach holding the lock"
        if not int(counter[0]) & 1:
            counter[0] += 1
        self._counter = counter

    def detach(self) -> None:
        """Stop keeping the counter (left even). Called by the owner, holding the lock."""
        counter, self._counter = self._counter, None
        if counter is not None and int(counter[0]) & 1:
            counter[0] += 1

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not self._lock.acquire(blocking, timeout):
            return False
        self._depth += 1
        if self._depth == 1 and self._counter is not None:
            self._counter[0] += 1
        return True

    def release(self) -> None:
        try:
            if self._depth == 1:
                self._let_go()
        finally:
            self._depth -= 1
            self._lock.release()

    def _let_go(self) -> None:
        counter = self._counter
        if counter is not None:
            try:
                if self.before_release is not None:
                    self.before_release()
            finally:
                counter[0] += 1

    __enter__ = acquire

    def __exit__(self, *exc: Any) -> None:
        self.release()

    # threading.Condition's protocol for a reentrant lock: a wait lets go of every level at once.
    def _release_save(self) -> tuple[Any, int]:
        depth = self._depth
        try:
            self._let_go()
        finally:
            self._depth = 0
        return self._lock._release_save(), depth  # type: ignore[attr-defined]

    def _acquire_restore(self, saved: tuple[Any, int]) -> None:
        state, depth = saved
        self._lock._acquire_restore(state)  # type: ignore[attr-defined]
        self._depth = depth
        if self._counter is not None:
            self._counter[0] += 1

    def _is_owned(self) -> bool:
        return self._lock._is_owned()  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------
# The shard's shared tables

_NAME = re.compile(r"^psgrad-rows-([0-9]+)-[0-9a-f]{12}-")  # psgrad-rows-PID-TOKEN-WHAT


def _file_tensor(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A new tensor over a new file at `path` (the user's processes only), mapped shared; its pages
    are given as first written, as a table's own storage's are."""
    mapped = shm.make_file(path, max(1, math.prod(shape) * dtype.itemsize))
    return torch.frombuffer(mapped, dtype=torch.uint8)[: math.prod(shape) * dtype.itemsize].view(dtype).view(shape)


def shareable(t: Any) -> bool:
    """Whether a worker may read table t's rows in place: a sparse table of fixed size (a dense row
    index) whose rows come and go only by its updates (no admission, expiry or eviction)."""
    return (isinstance(t, SparseTable) and not t.dynamic and t.min_count <= 1 and not t.ttl and not t.evict
            and isinstance((t.arena if isinstance(t, GroupedTable) else t)._index, DenseIndex))


class RowShare:
    """A shard's tables lent to the workers of its host: their rows and row indexes kept in files
    under /dev/shm (moved there under the lock when first lent, and again whenever the table's
    storage is made anew: a room grown past its reservation, a restore), described in a header
    whose counter the shard lock keeps odd while held (SeqLock). Made when a worker of this host
    joins; the files go when the shard stops (and a later server sweeps a killed one's)."""

    def __init__(self, lock: SeqLock, state: Callable[[], Any], directory: str = shm.SHM_DIR) -> None:
        """state: the shard's state now (None before Init)."""
        self._lock = lock
        self._core_state = state
        self._dir = directory
        self._prefix = f"psgrad-rows-{os.getpid()}-{secrets.token_hex(6)}-"
        self._count = 0
        self.header: row_share.Header | None = None
        self.name: str | None = None
        self._state: Any = None
        self._held: dict[int, tuple[SparseTable, torch.Tensor, torch.Tensor, str, str]] = {}  # id(holder) ->
        self._lent: list[tuple[int, SparseTable]] = []  # (version slot, table) of the tables described
        self._slots: dict[str, int] = {}
        self._refused: set[int] = set()  # holders /dev/shm had no room for
        self._tables_of: tuple[Any, int, list[tuple[str, SparseTable]], list[SparseTable]] | None = None
        self._failed = False
        self._table_count = -1
        # each holder's room, rows and row index as last looked at (see _unmoved)
        self._watch: list[tuple[SparseTable, Any, Any, Any]] = []

    def offer(self) -> str | None:
        """The header's name, made (and the lock's counter attached) the first time. Under the lock.
        None: this machine cannot (not x86-64, no /dev/shm, or the file cannot be made)."""
        if self.header is None:
            if not (row_share.supported() and shm.supported()):
                return None
            shm.sweep(_NAME, self._dir)
            name = self._prefix + "header"
            try:
                self.header = row_share.Header.create(os.path.join(self._dir, name))
            except OSError as exc:
                _log.warning("rows are not lent in place on this host: %s", exc)
                return None
            self.name = name
            self._lock.before_release = self._before_release
            self._lock.attach(self.header.words[row_share.SEQ:row_share.SEQ + 1])
        return self.name

    def _path(self, what: str) -> str:
        self._count += 1
        return os.path.join(self._dir, f"{self._prefix}{self._count}-{what}")

    def _before_release(self) -> None:
        """At each release of the lock (the counter odd): lend new or moved storage, say so, and
        write the tables' versions. Where that fails, nothing is lent from then on (the header
        describes nothing: every worker reads through calls), and the shard goes on."""
        if self._failed:
            return
        try:
            self._update()
        except Exception as exc:  # (a bug must not stop the shard: its reads go through calls)
            self._failed = True
            _log.warning("rows are no longer lent in place: %s", exc, exc_info=True)
            header = self.header
            if header is not None:
                header.words[row_share.NBYTES] = 0
                header.words[row_share.COUNT] = 0
                header.words[row_share.GENERATION] += 1

    def _update(self) -> None:
        state = self._core_state()
        header = self.header
        if state is None or header is None:
            return
        if state is not self._state or len(state.tables) != self._table_count or not self._unmoved():
            self._relend(state)
        versions = header.versions
        for slot, t in self._lent:
            versions[slot] = t.version

    def _unmoved(self) -> bool:
        """Whether no table's storage was made anew since the last look (the same room, rows and
        row index objects: what a lock hold of a step leaves them; anything else is looked at)."""
        for holder, room, values, slot in self._watch:
            now = holder._room
            if now is not room or (now is not None and now["values"] is not values) \
                    or getattr(holder._index, "_slot", None) is not slot:
                return False
        return True

    def _relend(self, state: Any) -> None:
        """Lend new or moved storage of the shard's state now, and describe it where that changed
        anything."""
        known = self._tables_of
        moved = known is None or known[0] is not state or known[1] != len(state.tables)  # (new tables: described)
        if moved:
            tables = [(name, t) for name, t in state.tables.items() if shareable(t)]
            holders = list({id(h): h for h in (t.arena if isinstance(t, GroupedTable) else t for _, t in tables)}.values())
            known = self._tables_of = (state, len(state.tables), tables, holders)
        assert known is not None
        _, _, tables, holders = known
        if state is not self._state:
            moved = True
            mine = {id(h) for h in holders}
            for key in [k for k, held in self._held.items() if k not in mine or held[0] not in holders]:
                self._unlend(key)
        for holder in holders:
            moved |= self._lend(holder)
        if moved:
            self._state = state
            self._describe(tables)
        self._table_count = len(state.tables)
        self._watch = [(h, h._room, None if h._room is None else h._room["values"], getattr(h._index, "_slot", None))
                       for h in holders]

    def _lend(self, holder: SparseTable) -> bool:
        """Keep holder's rows and row index in files (moved there if they are not); True where
        that moved them."""
        room = holder._room
        index = holder._index
        held = self._held.get(id(holder))
        if room is None or id(holder) in self._refused or not isinstance(index, DenseIndex):
            if held is not None:  # (its storage was dropped, a restore: not lent until it is made again)
                self._unlend(id(holder))
                return True
            return False
        values = room["values"]
        if held is not None and held[0] is holder and held[1].data_ptr() == values.data_ptr() \
                and held[2].data_ptr() == index._slot.data_ptr():
            return False
        need = values.numel() * 4 + index._slot.numel() * 8
        try:
            st = os.statvfs(self._dir)
            if st.f_bavail * st.f_frsize < 2 * need:  # (a file's pages past the filesystem's room: SIGBUS)
                raise OSError(f"{self._dir} has {st.f_bavail * st.f_frsize:,} bytes free, the rows need {need:,}")
            v_path, i_path = self._path("rows"), self._path("index")
            new_values = _file_tensor(v_path, tuple(values.shape), values.dtype)
            new_slot = _file_tensor(i_path, tuple(index._slot.shape), torch.int64)
        except OSError as exc:
            self._refused.add(id(holder))
            _log.warning("rows of %s are not lent in place: %s", holder.name, exc)
            return held is not None
        new_values[: holder.touched] = values[: holder.touched]
        new_slot.copy_(index._slot)
        room["values"] = new_values
        holder._values = new_values[: holder._values.shape[0]]
        index._slot = new_slot
        if held is not None:
            self._unlend(id(holder))
        self._held[id(holder)] = (holder, new_values, new_slot, v_path, i_path)
        return True

    def _unlend(self, key: int) -> None:
        """Forget a holder's files (unlinked: workers that mapped them keep their mappings, and see
        the generation move before they read them again)."""
        held = self._held.pop(key, None)
        if held is not None:
            for path in held[3:]:
                shm.remove(os.path.basename(path))

    def _describe(self, tables: list[tuple[str, SparseTable]]) -> None:
        assert self.header is not None
        out: dict[str, Any] = {}
        lent: list[tuple[int, SparseTable]] = []
        for name, t in tables:
            holder = t.arena if isinstance(t, GroupedTable) else t
            held = self._held.get(id(holder))
            if held is None:
                continue
            slot = self._slots.setdefault(name, len(self._slots))
            if slot >= row_share.MAX_TABLES:
                continue
            lent.append((slot, t))  # (its version written by _update, after this)
            out[name] = {"values": os.path.basename(held[3]), "rows": int(held[1].shape[0]), "dim": holder.dim,
                         "index": os.path.basename(held[4]), "index_rows": int(held[2].numel()),
                         "base": t.base if isinstance(t, GroupedTable) else 0, "slot": slot, "key": t.key,
                         "std": t.std}
        self._lent = lent
        first = next(iter(tables), None)
        self.header.describe({"tables": out, "shards": first[1].num_shards if first else 1,
                              "shard": first[1].index if first else 0})

    def close(self) -> None:
        """Describe nothing (a worker still mapping the header reads through calls from now on,
        which find the server gone), then unlink every file (workers keep their mappings). Under
        the lock."""
        if self.header is not None:
            self.header.words[row_share.NBYTES] = 0
            self.header.words[row_share.COUNT] = 0
            self.header.words[row_share.GENERATION] += 1
        self._lock.detach()
        self._lock.before_release = None
        for key in list(self._held):
            self._unlend(key)
        if self.name is not None:
            shm.remove(self.name)
        if self.header is not None:
            self.header.close()
        self.header = self.name = None
