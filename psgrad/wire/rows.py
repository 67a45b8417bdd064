"""Rows of sparse tables on the wire, both ends: a call's rows of all its tables as one RowBlock (the
ids a read names; the ids and gradients a push carries; an initialization's ids and starting
values), and the row updates of a replica record (what the primary applied) as TableRows messages,
one table each. Ids are int64 and gradients float32, little-endian."""
from __future__ import annotations

import operator
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from psgrad.core.codecs import joined
from psgrad.errors import InvalidRequestError
from psgrad.proto import ps_pb2 as pb

# torch warns at every view of bytes that they are not writable: these views are never written.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning,
                        module=__name__)


@dataclass(frozen=True)
class RowUpdate:
    """One table's part of an update: row ids [n] (unique), their gradients [n, dim], the table
    version they were pulled at, and (replica records) the learning rate they were applied with
    (None: the job's). A replica record's entry may instead say what the update did to the
    table's row lifetime, with no gradients: rows dropped (removed; expired by the ttl, else
    evicted), ids counted in its admission counts (sighted; see SparseTable.sight), or rows
    stored in this order (made; see SparseTable.make)."""

    table: str
    ids: torch.Tensor
    grads: torch.Tensor
    base_version: int = 0
    lr: float | None = None
    removed: bool = False  # (replica records) the rows `ids` were dropped, not updated: no grads
    expired: bool = False  # (with removed) dropped by the table's ttl, else evicted at the memory budget
    sighted: bool = False  # (replica records) ids counted in the admission counts, not updated: no grads
    made: bool = False  # (replica records) rows stored at their initial values in this order, not updated: no grads


def tensor_from_bytes(data: bytes | memoryview, dtype: torch.dtype, what: str) -> torch.Tensor:
    """A 1-D tensor of the little-endian values `data` holds: a read-only view of the bytes (no
    copy; the row rules only read their gradients, see RowOptimizer.apply).

    Raises:
        InvalidRequestError: the bytes are not a whole number of values.
    """
    size = dtype.itemsize
    if len(data) % size:
        raise InvalidRequestError(f"{what}: {len(data)} bytes is not a whole number of {dtype} values")
    if not data:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype)


def updates_to_proto(updates: Iterable[RowUpdate]) -> list[pb.TableRows]:
    return [pb.TableRows(table=u.table, ids=u.ids.numpy().tobytes(), grads=u.grads.numpy().tobytes(),
                         base_version=u.base_version, lr=u.lr, removed=u.removed, expired=u.expired, sighted=u.sighted,
                         made=u.made)
            for u in updates]


def updates_from_proto(items: Sequence[pb.TableRows], what: str) -> list[RowUpdate]:
    """The row updates of a replica record's TableRows messages (tables without ids left out), in
    the order the primary applied them: a table possibly several times (a record of a sync
    iteration whose tables are async carries each worker's rows).

    Raises:
        InvalidRequestError: bytes that are not whole rows of gradients.
    """
    out: list[RowUpdate] = []
    for item in items:
        ids = tensor_from_bytes(item.ids, torch.int64, f"{what}: row ids of table {item.table!r}")
        grads = tensor_from_bytes(item.grads, torch.float32, f"{what}: row gradients of table {item.table!r}")
        if not ids.numel() and not grads.numel():
            continue
        if not ids.numel() or grads.numel() % ids.numel():
            raise InvalidRequestError(
                f"{what}: {grads.numel()} gradient values for {ids.numel()} row ids of table {item.table!r}")
        out.append(RowUpdate(item.table, ids, grads.view(ids.numel(), -1), int(item.base_version),
                             item.lr if item.HasField("lr") else None, item.removed, item.expired, item.sighted,
                             item.made))
    return out


class RowBlock:
    """A call's rows of several sparse tables, as one RowBlock message carries them: the tables in
    order, each one's count of ids, all their ids in one int64 tensor (table after table) and, in a
    push, all their gradients in one float32 tensor likewise, with each table's row width and the
    version its rows were pulled at. One buffer per kind, whatever the number of tables: a call's
    rows are parsed as one set of arrays (a table's part is a view). True where it holds an id."""

    def __init__(self, tables: Sequence[str], counts: Sequence[int], ids: torch.Tensor,
                 grads: torch.Tensor | None = None, widths: Sequence[int] = (), base_versions: Sequence[int] = ()) -> None:
        self.tables, self.counts = tuple(tables), tuple(counts)
        self.ids = ids  # int64 [sum(counts)]
        self.grads = grads  # float32 [sum(counts[k] * widths[k])] (a push's), else None
        self.widths, self.base_versions = tuple(widths), tuple(base_versions)

    def __bool__(self) -> bool:
        return self.ids.numel() > 0

    @classmethod
    def of(cls, parts: Sequence[tuple[str, torch.Tensor]], grads: Sequence[torch.Tensor] | None = None,
           base_versions: Sequence[int] = ()) -> RowBlock:
        """The block of tables' ids (parts: (table, ids [n])) and a push's gradients of them
        (grads [n, width] each, in the same order): of_groups of a table each."""
        return cls.of_groups([([t], [int(i.numel())], i, None if grads is None else grads[k])
                              for k, (t, i) in enumerate(parts)], base_versions, push=grads is not None)

    @classmethod
    def of_groups(cls, groups: Sequence[tuple[Sequence[str], Sequence[int], torch.Tensor, torch.Tensor | None]],
                  base_versions: Sequence[int] = (), push: bool = True) -> RowBlock:
        """The block of groups of tables whose ids (and a push's gradients, [n, width]) already lie
        one after another: (tables, their counts, ids [sum(counts)], gradients or None). A group
        of one tensor each (a shard's rows of one width, sliced from one gather) goes in as it is."""
        tables = [t for g in groups for t in g[0]]
        counts = [int(c) for g in groups for c in g[1]]
        ids = [g[2].to(torch.int64) for g in groups]
        flat = (joined(ids) if len(ids) > 1 else ids[0]).contiguous() if ids else torch.empty(0, dtype=torch.int64)
        if not push:
            return cls(tables, counts, flat)
        values = [g[3].to(torch.float32) for g in groups if g[3] is not None]
        widths = [int(v.shape[1]) if v.dim() == 2 else 1 for v, g in zip(values, groups) for _ in g[0]]
        if len(values) == 1 or (values and len({tuple(v.shape[1:]) for v in values}) == 1):
            block = (joined(values) if len(values) > 1 else values[0]).contiguous().view(-1)
        else:
            block = torch.cat([v.reshape(-1) for v in values]) if values else torch.empty(0)
        return cls(tables, counts, flat, block, widths, base_versions)

    @classmethod
    def from_proto(cls, msg: pb.RowBlock, what: str, push: bool = False, grads: memoryview | None = None) -> RowBlock:
        """The block a RowBlock message holds: its ids (and, push: gradients) are read-only views of
        the message's bytes; grads: the gradients' bytes, where the call carried them beside the
        message (which then holds none).

        Raises:
            InvalidRequestError: counts (widths, base versions) that do not match the tables, a
                table twice, or buffers that are not the counts' size (each named).
        """
        tables, counts = list(msg.tables), list(msg.counts)
        if len(counts) != len(tables):
            raise InvalidRequestError(f"{what}: {len(counts)} counts of row ids for {len(tables)} tables")
        if len(set(tables)) != len(tables):
            twice = sorted({t for t in tables if tables.count(t) > 1})
            raise InvalidRequestError(f"{what}: rows of table {twice[0]!r} twice in one call")
        ids = tensor_from_bytes(msg.ids, torch.int64, f"{what}: row ids")
        if ids.numel() != sum(counts):
            raise InvalidRequestError(f"{what}: {ids.numel()} row ids for counts summing to {sum(counts)}")
        if not push:
            if msg.grads or msg.widths:
                raise InvalidRequestError(f"{what}: a read of rows carries no gradients")
            return cls(tables, counts, ids)
        widths, bases = list(msg.widths), list(msg.base_versions)
        if len(widths) != len(tables) or len(bases) != len(tables):
            raise InvalidRequestError(f"{what}: {len(widths)} row widths and {len(bases)} base versions "
                                      f"for {len(tables)} tables")
        if widths and min(widths) < 1:
            narrow = [(t, w) for t, w in zip(tables, widths) if w < 1]
            raise InvalidRequestError(f"{what}: table {narrow[0][0]!r} has rows of width {narrow[0][1]}; a row has 1 "
                                      "value or more (its table's embedding_dim)")
        if grads is not None and msg.grads:
            raise InvalidRequestError(f"{what}: row gradients both in the message and beside it")
        values = tensor_from_bytes(msg.grads if grads is None else grads, torch.float32, f"{what}: row gradients")
        expected = sum(map(operator.mul, counts, widths))
        if values.numel() != expected:
            raise InvalidRequestError(f"{what}: {values.numel()} gradient values for row ids and widths "
                                      f"that make {expected}")
        return cls(tables, counts, ids, values, widths, bases)

    def message(self) -> pb.RowBlock:
        """The RowBlock message (its buffers copied into it)."""
        out = pb.RowBlock(tables=self.tables, counts=self.counts, ids=self.ids.numpy().tobytes())
        if self.grads is not None:
            out.widths.extend(self.widths)
            out.base_versions.extend(self.base_versions)
            out.grads = self.grads.numpy().tobytes()
        return out

    def lookups(self) -> BlockLookups:
        """(table, its ids) for each table, in order (views of the ids)."""
        return BlockLookups(zip(self.tables, self.ids.split_with_sizes(self.counts)) if self.tables else (), self.ids)

    def updates(self) -> BlockGradients:
        """A push's row gradients by table (tables with ids only): views of the block."""
        assert self.grads is not None, "a read's block holds no gradients"
        return BlockGradients(self)

    def split(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, int]]:
        """A push's row gradients by table, tables with ids only: (ids, gradients [n, width], base
        version), views of the block."""
        assert self.grads is not None, "a read's block holds no gradients"
        ids = self.ids.split_with_sizes(self.counts)
        if len(set(self.widths)) == 1:
            grads = self.grads.view(-1, self.widths[0]).split_with_sizes(self.counts)
        else:
            sizes = [c * w for c, w in zip(self.counts, self.widths)]
            grads = tuple(g.view(c, w) for g, c, w in zip(self.grads.split_with_sizes(sizes), self.counts, self.widths))
        return {t: (i, g, b) for t, i, g, b, c in zip(self.tables, ids, grads, self.base_versions, self.counts) if c}


class BlockLookups(list[tuple[str, torch.Tensor]]):
    """A read's (table, ids) in the block's order, as RowBlock.lookups gives them: views of the
    block's ids, which `flat` holds whole (int64, every table's one after another)."""

    def __init__(self, lookups: Iterable[tuple[str, torch.Tensor]], flat: torch.Tensor) -> None:
        super().__init__(lookups)
        self.flat = flat


class BlockGradients(Mapping[str, tuple[torch.Tensor, torch.Tensor, int]]):
    """A push's row gradients by table, table -> (ids [n], gradients [n, width], base version), as
    RowBlock.updates gives them: views of the block, made when a table's part is first asked for
    (a shard handles a block of one arena's tables whole, and asks for none: see
    server/rows_path.py), which `flat` hands over whole (one tensor of all the tables' ids or
    gradients, where they are the block's tables in its order: no copy to join them). Its tables
    are those of the block with ids, in its order (`names`); `whole`: every table of the block."""

    def __init__(self, block: RowBlock) -> None:
        self.block = block
        self.whole = 0 not in block.counts
        self.names = block.tables if self.whole else tuple(t for t, c in zip(block.tables, block.counts) if c)
        self._parts: dict[str, tuple[torch.Tensor, torch.Tensor, int]] | None = None

    def __getitem__(self, table: str) -> tuple[torch.Tensor, torch.Tensor, int]:
        if self._parts is None:
            self._parts = self.block.split()
        return self._parts[table]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, table: object) -> bool:
        return table in self.names

    def flat(self, tables: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(ids [n], gradients [n, width]) of `tables` joined in that order, where they are the
        block's tables with ids, in its order, all of one width; else None."""
        b = self.block
        if tuple(tables) != self.names or len(set(b.widths)) != 1:
            return None
        assert b.grads is not None
        return b.ids, b.grads.view(-1, b.widths[0])
