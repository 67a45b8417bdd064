"""A worker's reads of rows in place (see wire/row_share.py): a shard on this host
that lends its tables' rows names its header in its Join answer; the worker maps the header, and
the files it describes, read-only, and reads a forward's rows from them under the header's counter
instead of calling PullRows. Where the shard was changing something through every try, where a
table is not lent, or where the header says it moved its files since, the read goes to the shard."""
from __future__ import annotations

import mmap
import os
import warnings

import torch

from psgrad.core import rows as row_placement
from psgrad.core.codecs import byte_view
from psgrad.wire import row_share, shm
from psgrad.wire.rows import RowBlock


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


class InPlaceRows:
    """One shard's lent rows, as this worker maps them."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.header = row_share.Header.open(os.path.join(shm.SHM_DIR, name))
        self._generation = -1
        self._places: dict[str, row_share.TablePlace] = {}
        self._files: dict[str, torch.Tensor] = {}
        self._shards = 1
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
                    values = row_placement.initial_rows(p.key, ids[table_start + at], p.dim, p.std) if p.std else 0.0
                    parts[k][at + (table_start - runs[k][1])] = values
                table_start += n
        self.reads += 1
        out = torch.cat([part.reshape(-1) for part in parts]) if len(parts) > 1 else parts[0]
        return versions, byte_view(out.contiguous())

    def close(self) -> None:
        self._files.clear()
        self.header.close()
