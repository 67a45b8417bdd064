"""Rows of sparse tables on the wire, both ends: the row updates a push carries (and a replica record:
what the primary applied) as TableRows messages and back, and the ids a read of rows names. Ids are
int64 and gradients float32, little-endian, one table per message."""
from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from psgrad.errors import InvalidRequestError
from psgrad.proto import ps_pb2 as pb

# torch warns at every view of bytes that they are not writable: these views are never written.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning,
                        module=__name__)


@dataclass(frozen=True)
class RowUpdate:
    """One table's part of an update: row ids [n] (unique), their gradients [n, dim], the table
    version they were pulled at, and (replica records) the learning rate they were applied with
    (None: the job's)."""

    table: str
    ids: torch.Tensor
    grads: torch.Tensor
    base_version: int = 0
    lr: float | None = None
    removed: bool = False  # (replica records) the rows `ids` were dropped, not updated: no grads


def tensor_from_bytes(data: bytes, dtype: torch.dtype, what: str) -> torch.Tensor:
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
                         base_version=u.base_version, lr=u.lr, removed=u.removed) for u in updates]


def updates_from_proto(items: Sequence[pb.TableRows], what: str, in_sequence: bool = False) -> list[RowUpdate]:
    """The row updates of TableRows messages (tables without ids left out); in_sequence: updates
    applied one after another, a table possibly several times (a replica record of a sync
    iteration whose tables are async carries each worker's rows).

    Raises:
        InvalidRequestError: a table twice (unless in_sequence), or bytes that are not whole rows
            of gradients.
    """
    out: list[RowUpdate] = []
    seen: set[str] = set()
    for item in items:
        if item.table in seen and not in_sequence:
            raise InvalidRequestError(f"{what}: row gradients of table {item.table!r} twice")
        seen.add(item.table)
        ids = tensor_from_bytes(item.ids, torch.int64, f"{what}: row ids of table {item.table!r}")
        grads = tensor_from_bytes(item.grads, torch.float32, f"{what}: row gradients of table {item.table!r}")
        if not ids.numel() and not grads.numel():
            continue
        if not ids.numel() or grads.numel() % ids.numel():
            raise InvalidRequestError(
                f"{what}: {grads.numel()} gradient values for {ids.numel()} row ids of table {item.table!r}")
        if item.removed and not in_sequence:
            raise InvalidRequestError(f"{what}: rows of table {item.table!r} marked removed (only a replica record drops rows)")
        out.append(RowUpdate(item.table, ids, grads.view(ids.numel(), -1), int(item.base_version),
                             item.lr if item.HasField("lr") else None, item.removed))
    return out


def lookups_from_proto(items: Sequence[pb.TableRows], what: str) -> list[tuple[str, torch.Tensor]]:
    """The (table, ids) a read of rows names."""
    return [(item.table, tensor_from_bytes(item.ids, torch.int64, f"{what}: row ids of table {item.table!r}"))
            for item in items]


def lookups_to_proto(lookups: Iterable[tuple[str, torch.Tensor]]) -> list[pb.TableRows]:
    return [pb.TableRows(table=table, ids=ids.numpy().tobytes()) for table, ids in lookups]
