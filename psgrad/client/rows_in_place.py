"""A worker's reads of rows in place (see wire/row_share.py): a shard on this host
that lends its tables' rows names its header in its Join answer; the worker maps the header, and
the files it describes, read-only, and reads a forward's rows from them under the header's counter
instead of calling PullRows. Where the shard was changing something through every try, where a
table is not lent, or where the header says it moved its files since, the read goes to the shard.

Where every shard of the job lends its rows, a read of several tables goes through a compiled
kernel (read_into: one pass over the tables' ids per shard, each row written where the caller
wants it); until it is compiled, or where some shard does not lend, each shard's part of the read
is placed and gathered with torch's ops (read)."""
from __future__ import annotations

import mmap
import os
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from psgrad.core import rows as row_placement
from psgrad.core.codecs import byte_view
from psgrad.core.compiled import get as _get
from psgrad.wire import row_share, shm
from psgrad.wire.rows import RowBlock

#: Ids x width of a read from which the kernel starts compiling: a process whose reads are all
#: smaller (a test's, a toy model's) never loads numba for it.
KERNEL_MIN = 16384


def kernel(start: bool = False, wait: bool = False) -> Any:
    """The compiled read (see _rows_in_place_kernel.py), or None: not ready yet (start: the call
    starts compiling it on a background thread; wait=True waits for that), turned off
    (PSGRAD_FUSED_APPLY=0), or unavailable here."""
    return _get("rows in place", _make, start, wait)


def _make() -> Any:
    from psgrad.client._rows_in_place_kernel import KERNEL

    return KERNEL if _agrees_with_torch(KERNEL) else None


def _agrees_with_torch(k: Any) -> bool:
    """Whether the kernel reads what torch's gathers read (tables of no ids, some, several bases;
    one shard and several, a power of two of them or not): each id on the shard its stored row,
    the positions of those never stored, other rows untouched; the positions of the shard's ids and
    each table's count of them (as core/rows.py's TablesOnShards places them); and -1 for an index
    place or a slot past what is mapped."""
    gen = torch.Generator().manual_seed(0)
    bases = np.array([0, 60, 120], np.int64)
    for shards, shard in ((1, 0), (2, 1), (3, 2), (4, 3)):
        values = torch.randn(50, 5, generator=gen)
        index = torch.randint(-1, 50, (180 // shards + 1,), generator=gen)
        ids = [torch.randint(0, 60, (n,), generator=gen).unique() for n in (0, 7, 30)]
        flat, starts = torch.cat(ids), row_placement.starts([int(i.numel()) for i in ids])
        out, fresh = torch.full((flat.numel(), 5), 7.0), np.empty(flat.numel(), np.int64)
        order, counts, at = np.empty(flat.numel() + 2, np.int64), np.empty(3, np.int64), np.array([0, 2], np.int64)
        got = k(flat.numpy(), starts, bases, shards, shard, index.numpy(), values.numpy(), out.numpy(), fresh, order,
                counts, at)
        expect, expect_fresh = torch.full_like(out, 7.0), []
        for p, r in enumerate(flat.tolist()):
            t = int(np.searchsorted(starts, p, "right")) - 1
            if r % shards == shard:
                slot = int(index[(r + int(bases[t])) // shards])
                if slot < 0:
                    expect_fresh.append(p)
                else:
                    expect[p] = values[slot]
        place = row_placement.TablesOnShards(ids, shards, [False] * 3)
        mine = place.positions(shard)
        if got != 0 or at.tolist() != [len(expect_fresh), 2 + sum(place.counts[shard])] or \
                fresh[:at[0]].tolist() != expect_fresh or not torch.equal(out, expect) or \
                counts.tolist() != place.counts[shard] or \
                order[2:at[1]].tolist() != (mine.tolist() if mine is not None else list(range(flat.numel()))):
            return False
    one, zero = np.array([0, 1], np.int64), np.zeros(1, np.int64)
    rows, out_, one_ = np.zeros((4, 2), np.float32), np.zeros((1, 2), np.float32), np.empty(1, np.int64)
    return (k(np.array([3], np.int64), one, zero, 1, 0, np.zeros(3, np.int64), rows, out_, one_, one_, one_,
              np.zeros(2, np.int64)) == -1
            and k(np.array([0], np.int64), one, zero, 1, 0, np.array([4], np.int64), rows, out_, one_, one_, one_,
                  np.zeros(2, np.int64)) == -1)


def _mapped(name: str, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """A lent file under /dev/shm, mapped read-only (only ever gathered from: a write would fault)."""
    fd = os.open(os.path.join(shm.SHM_DIR, name), os.O_RDONLY)
    try:
        if os.fstat(fd).st_size < nbytes:
            raise OSError(f"{name}: shorter than described")
        mapped = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():  # (torch warns of a tensor over a read-only buffer: read here, never written)
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(memoryview(mapped), dtype=torch.uint8).view(dtype)


def _initial_rows(p: row_share.TablePlace, ids: torch.Tensor) -> torch.Tensor | float:
    """The initial values of rows `ids` of a lent table that the shard never stored, as the shard
    computes them (0.0 for a table whose rows start at zero: nothing to draw)."""
    return row_placement.initial_rows(p.key, ids, p.dim, p.std) if p.std else 0.0


#: A run of tables lent in one arena: (its first table, one past its last, the arena's rows, its row
#: index, each table's base in it)
_Run = tuple[int, int, np.ndarray, np.ndarray, np.ndarray]


class InPlaceRows:
    """One shard's lent rows, as this worker maps them."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.header = row_share.Header.open(os.path.join(shm.SHM_DIR, name))
        self._generation = -1
        self._places: dict[str, row_share.TablePlace] = {}
        self._files: dict[str, torch.Tensor] = {}
        self._shards = 1
        self._shard = 0
        # tables read together -> their places, their runs of one arena's files and their version slots
        self._plans: dict[tuple[str, ...], tuple[list[row_share.TablePlace], list[_Run], np.ndarray]] = {}
        self.reads = 0  # reads served in place
        self.missed = 0  # reads it handed to the shard

    def _refresh(self) -> bool:
        """Map what the header describes now, if it moved since; False: nothing usable."""
        if int(self.header.words[row_share.GENERATION]) == self._generation:
            return True
        got = self.header.description()
        if got is None:
            return False
        generation, desc = got
        places = {name: row_share.TablePlace.of(e) for name, e in desc.get("tables", {}).items()}
        files: dict[str, torch.Tensor] = {}
        try:
            for p in places.values():
                if p.values not in files:
                    files[p.values] = _mapped(p.values, p.rows * p.dim * 4, torch.float32).view(p.rows, p.dim)
                if p.index not in files:
                    files[p.index] = _mapped(p.index, p.index_rows * 8, torch.int64)
        except (OSError, ValueError, RuntimeError):
            return False
        self._generation, self._places, self._files, self._shards = generation, places, files, int(desc["shards"])
        self._shard = int(desc.get("shard", 0))
        self._plans = {}
        return True

    def read(self, asks: RowBlock) -> tuple[list[int], memoryview] | None:
        """The rows shard's part of a read asks for (each table's version, the rows' bytes table
        after table, as a PullRows answer carries them), read in place; None: ask the shard."""
        if not asks.tables or not self._refresh():
            self.missed += 1
            return None
        try:
            places = [self._places[name] for name in asks.tables]
        except KeyError:
            self.missed += 1
            return None
        ids = asks.ids
        counts = list(asks.counts)
        bases = [p.base for p in places]
        arena_ids = ids if not any(bases) else ids + torch.repeat_interleave(
            torch.tensor(bases, dtype=torch.int64), torch.tensor(counts, dtype=torch.int64))
        local = arena_ids // self._shards if self._shards > 1 else arena_ids
        # runs of tables in one arena (the same files): one gather each
        runs: list[tuple[row_share.TablePlace, int, int]] = []
        start = 0
        for p, n in zip(places, counts):
            if runs and (runs[-1][0].values, runs[-1][0].index) == (p.values, p.index):
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + n)
            else:
                runs.append((p, start, start + n))
            start += n
        generation = self._generation
        files = self._files

        def gather() -> tuple[list[int], list[torch.Tensor], torch.Tensor] | None:
            if int(self.header.words[row_share.GENERATION]) != generation:
                return None  # (moved since it was mapped: not these files)
            slot_parts, parts = [], []
            for p, lo, hi in runs:
                slots = files[p.index].index_select(0, local[lo:hi])
                slot_parts.append(slots)
                parts.append(files[p.values].index_select(0, slots.clamp(min=0)))
            versions = [int(self.header.versions[p.slot]) for p in places]
            return versions, parts, torch.cat(slot_parts) if len(slot_parts) > 1 else slot_parts[0]

        try:
            done = self.header.consistent(gather)
        except (IndexError, RuntimeError):  # (an index read past what was mapped: the shard moved it)
            done = None
        if done is None:
            self._generation = -1
            self.missed += 1
            return None
        versions, parts, slots = done
        fresh = slots < 0
        if bool(fresh.any()):  # rows never stored: their initial values, as the shard computes them
            table_start = 0
            for p, n in zip(places, counts):
                mine = fresh[table_start:table_start + n]
                if n and bool(mine.any()):
                    k = next(k for k, (_, lo, hi) in enumerate(runs) if lo <= table_start < hi)
                    at = torch.nonzero(mine).squeeze(1)
                    values = _initial_rows(p, ids[table_start + at])
                    parts[k][at + (table_start - runs[k][1])] = values
                table_start += n
        self.reads += 1
        out = torch.cat([part.reshape(-1) for part in parts]) if len(parts) > 1 else parts[0]
        return versions, byte_view(out.contiguous())

    def read_into(self, shard: tuple[int, int], names: Sequence[str], ids: np.ndarray, starts: np.ndarray,
                  out: np.ndarray, read: Any, order: np.ndarray, placed: int) -> tuple[list[int], list[int]] | None:
        """This shard's rows of tables `names` read in place by the compiled read `read` (see
        kernel()), written into `out` at their ids' positions: ids holds every table's ids (int64,
        unique per table, in range), table t's at starts[t] to starts[t + 1], the rows of all
        shards together, [len(ids), dim] float32 (rows of ids on other shards are not touched).
        The positions of the shard's ids go to order from `placed` on (room for len(ids) there).
        Returns (each table's version on this shard, each table's count of ids on it), or None:
        ask the shards (a table not lent, the files moved, or the shard changing something through
        every try, or another place in the job than `shard`, (index, shards), says), with `out` and
        `order` partly written."""
        if not self._refresh() or shard != (self._shard, self._shards):
            return None
        key = tuple(names)
        plan = self._plans.get(key)
        if plan is None:
            try:
                plan = self._plan(key)
            except KeyError:
                return None
        places, runs, slots = plan
        if any(run[2].shape[1] != out.shape[1] for run in runs):
            return None  # (rows of another width than the job's table: the kernel writes whole rows)
        header, generation = self.header, self._generation
        index_, shards = shard
        fresh, counts, at = np.empty(len(ids), np.int64), np.empty(len(names), np.int64), np.empty(2, np.int64)

        def gather() -> list[int] | None:
            if int(header.words[row_share.GENERATION]) != generation:
                return None  # (moved since it was mapped: not these files)
            at[:] = (0, placed)
            for first, end, values, index, bases in runs:
                if read(ids, starts[first:end + 1], bases, shards, index_, index, values, out, fresh, order,
                        counts[first:end], at) < 0:
                    return None  # (an index read past what was mapped: the shard moved it)
            return header.versions[slots].tolist()

        versions = header.consistent(gather)
        if versions is None:
            self._generation = -1
            return None
        if at[0]:  # rows never stored: their initial values, as the shard computes them
            new = fresh[:at[0]]
            tables = np.searchsorted(starts, new, "right") - 1
            for t in np.unique(tables).tolist():
                p, mine = places[t], new[tables == t]
                out[mine] = _initial_rows(p, torch.from_numpy(ids[mine]))
        self.reads += 1
        return versions, counts.tolist()

    def _plan(self, key: tuple[str, ...]) -> tuple[list[row_share.TablePlace], list[_Run], np.ndarray]:
        """The places of tables `key` as mapped now, their runs of tables in one arena (one pass of
        the read each) and their version slots, kept until the files move.

        Raises:
            KeyError: a table the shard does not lend.
        """
        places = [self._places[name] for name in key]
        runs: list[_Run] = []
        for t, p in enumerate(places):
            if runs and places[runs[-1][0]].values == p.values and places[runs[-1][0]].index == p.index:
                first, _, values, index, bases = runs[-1]
                runs[-1] = (first, t + 1, values, index, np.append(bases, p.base))
            else:
                runs.append((t, t + 1, self._files[p.values].numpy(), self._files[p.index].numpy(),
                             np.array([p.base], np.int64)))
        if len(self._plans) >= 16:  # (a model's few groups of tables; reads of others come and go)
            self._plans.clear()
        plan = self._plans[key] = (places, runs, np.array([p.slot for p in places], np.int64))
        return plan

    def close(self) -> None:
        self._plans.clear()
        self._files.clear()
        self.header.close()
