"""Rows read in place on one host: the header a shard shares with the workers of its host, and how
a worker reads rows under it (server/row_share.py lends them, client/rows_in_place.py reads them).

A shard that lends its tables' rows keeps, per shard state, one header file under /dev/shm beside
the files that hold the tables' rows and row indexes (the tables' own storage, mapped shared). The
header says where each shared table lies and at which version it is, and carries a sequence
counter: the shard makes it odd when it takes its lock and even when it lets go (server/row_share.py
SeqLock), so every change to a shared table's rows, index, version or place happens while it is odd.
A worker reads the counter, then the rows, then the counter again: the rows are whole and of the
versions it read only where both reads are the same even number (a seqlock). Where they differ, it
reads again, and after a few tries asks the shard (PullRows), as it does where nothing is shared.

Layout (little-endian int64 words after a 16-byte magic):
    [0:16)   magic
    [16:24)  seq          odd while the shard's lock is held
    [24:32)  generation   moves whenever the description below changes (a table's files moved)
    [32:40)  count        tables described (each has a version slot)
    [40:48)  nbytes       of the description
    [48:48 + 8 * MAX_TABLES)   versions, by slot
    then the description: JSON {"tables": {name: {"values", "rows", "dim", "index", "index_rows",
    "base", "slot", "key", "std"}}, "shards", "shard"}
Only x86-64's memory order (stores seen in the order made, loads not reordered with loads) makes
the plain loads and stores of the counter a seqlock without fences: elsewhere nothing is shared.
"""
from __future__ import annotations

import json
import mmap
import os
import platform
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from psgrad.wire.shm import host_id, make_file

MAGIC = b"psgrad-rows-v1\0\0"  # 16 bytes
MAX_TABLES = 4096
DESCRIPTION_MAX = 1 << 20
SEQ, GENERATION, COUNT, NBYTES = 0, 1, 2, 3  # int64 words after the magic
_WORDS = 4
VERSIONS_AT = 16 + 8 * _WORDS
DESCRIPTION_AT = VERSIONS_AT + 8 * MAX_TABLES
HEADER_BYTES = DESCRIPTION_AT + DESCRIPTION_MAX
METADATA_KEY = "psgrad-rows-in-place"  # a Join request's ask (HOST) and its answer (NAME;HOST)


def ask() -> tuple[str, str]:
    """What a worker adds to its Join request's metadata to be lent rows in place."""
    return METADATA_KEY, host_id()


def answered(metadata: Any) -> str | None:
    """The header a Join answer names, where its shard is on this host (else None)."""
    for key, value in metadata or ():
        if key == METADATA_KEY:
            name, _, host = str(value).partition(";")
            if host == host_id() and name.startswith("psgrad-rows-") and "/" not in name:
                return name
    return None


TRIES = 3  # reads under a moving counter before a worker asks the shard instead
#: How long a read waits for the shard to let its lock go (the counter odd: an update, most often
#: another worker's push being applied) before it asks the shard instead, napping meanwhile (a call
#: would wait for the same lock, and cost both ends a call's CPU besides).
PATIENCE_S = 0.005
_NAP_S = 50e-6
T = TypeVar("T")


def supported() -> bool:
    """Whether this machine's memory order makes the header's counter a seqlock (x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64")


class Header:
    """One header file's mapping: the shard's (writable) or a worker's (read-only)."""

    def __init__(self, mapped: mmap.mmap, writable: bool) -> None:
        self._map = mapped
        self.words = np.frombuffer(mapped, dtype=np.int64, count=_WORDS, offset=16)
        self.versions = np.frombuffer(mapped, dtype=np.int64, count=MAX_TABLES, offset=VERSIONS_AT)
        if not writable:
            self.words.flags.writeable = False
            self.versions.flags.writeable = False

    @classmethod
    def create(cls, path: str) -> Header:
        """Make the header file at `path` (it must not exist; the user's processes only), mapped."""
        mapped = make_file(path, HEADER_BYTES)
        mapped[:16] = MAGIC
        return cls(mapped, writable=True)

    @classmethod
    def open(cls, path: str) -> Header:
        """Map the header file at `path` read-only.

        Raises:
            OSError: no such file, or not a header (bad magic or size).
        """
        fd = os.open(path, os.O_RDONLY)
        try:
            if os.fstat(fd).st_size != HEADER_BYTES:
                raise OSError(f"{path}: not a psgrad rows header (size)")
            mapped = mmap.mmap(fd, HEADER_BYTES, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        if mapped[:16] != MAGIC:
            mapped.close()
            raise OSError(f"{path}: not a psgrad rows header (magic)")
        return cls(mapped, writable=False)

    @property
    def seq(self) -> int:
        return int(self.words[SEQ])

    def describe(self, description: Mapping[str, Any]) -> None:
        """Write a new description (the shard, under its lock: the counter is odd) and move the
        generation on.

        Raises:
            ValueError: more tables than MAX_TABLES, or a description over DESCRIPTION_MAX bytes.
        """
        data = json.dumps(description, sort_keys=True).encode()
        count = len(description.get("tables", {}))
        if count > MAX_TABLES or len(data) > DESCRIPTION_MAX:
            raise ValueError(f"a rows header holds {MAX_TABLES} tables and {DESCRIPTION_MAX} bytes of description")
        self._map[DESCRIPTION_AT:DESCRIPTION_AT + len(data)] = data
        self.words[NBYTES] = len(data)
        self.words[COUNT] = count
        self.words[GENERATION] += 1

    def description(self) -> tuple[int, dict[str, Any]] | None:
        """(generation, description) as one consistent read (None: the shard was changing it, or
        has described nothing yet)."""
        def read() -> tuple[int, bytes]:
            nbytes = int(self.words[NBYTES])
            data = bytes(self._map[DESCRIPTION_AT:DESCRIPTION_AT + nbytes]) if 0 < nbytes <= DESCRIPTION_MAX else b""
            return int(self.words[GENERATION]), data

        got = self.consistent(read)
        return (got[0], json.loads(got[1])) if got is not None and got[1] else None

    def consistent(self, read: Callable[[], T]) -> T | None:
        """read()'s result where the shard changed nothing while it ran (the counter the same even
        number before and after), trying TRIES times, and waiting up to PATIENCE_S for the shard
        to let its lock go where it holds it; None: it was changing something each time, or held
        its lock that long."""
        words = self.words
        tries, until = 0, 0.0
        while tries < TRIES:
            seq = int(words[SEQ])
            if seq & 1:  # (held: wait for the release, which makes it even)
                now = time.monotonic()
                if not until:
                    until = now + PATIENCE_S
                elif now > until:
                    return None
                time.sleep(_NAP_S)
                continue
            got = read()
            if int(words[SEQ]) == seq:
                return got
            tries += 1
        return None

    def close(self) -> None:
        """Unmap (where a view of it is still alive, e.g. a SeqLock's counter, the mapping goes
        with the last one)."""
        del self.words, self.versions
        try:
            self._map.close()
        except BufferError:
            pass


@dataclass(frozen=True)
class TablePlace:
    """Where a shared table's rows lie, as the description says."""

    values: str  # the file of its arena's rows (float32 [rows, dim])
    rows: int
    dim: int
    index: str  # the file of its arena's row index (int64 [index_rows]: slot by local index, -1 never stored)
    index_rows: int
    base: int  # its row r is the arena's row base + r
    slot: int  # its version's slot in the header
    key: int  # its rows' draw key (rows never stored: rows.initial_rows(key, ids, dim, std))
    std: float

    @classmethod
    def of(cls, entry: Mapping[str, Any]) -> TablePlace:
        return cls(str(entry["values"]), int(entry["rows"]), int(entry["dim"]), str(entry["index"]),
                   int(entry["index_rows"]), int(entry["base"]), int(entry["slot"]), int(entry["key"]),
                   float(entry["std"]))
