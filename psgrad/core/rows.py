"""Sparse tables' rows: where each row id lives (its shard and its place there) and what a row is
before anyone trained it — a deterministic function of (seed, table, row id), so that a row costs
nothing until touched and comes out the same on any server, after any restart; pure.

Placement: row id r lives on shard r mod S, at local index r div S. Ids that are hot under a Zipf
law are the small ones (or any run of consecutive ids), which this spreads evenly over the shards;
a table of N rows holds ceil((N - i) / S) of them on shard i. A *dynamic* table (num_embeddings
DYNAMIC: any int64 id, as hashed features are) places id r on shard splitmix64(r) mod S, which
spreads any set of ids (hashes, or consecutive ones) evenly, and a shard finds its rows by id in a
hash index, not at a local index.

Initial values: N(0, std²) per element, like torch.nn.Embedding's normal_(0, 1) with std=1, drawn
from a counter-based generator (splitmix64 of the seed, the table's name and the element's index
id * dim + j; Box-Muller from two such draws), so any subset of rows is made without the others."""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import torch

from psgrad.errors import InvalidRequestError

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


# num_embeddings of a dynamic table: no range, any int64 id (psgrad.Embedding(None, dim)) but the
# two smallest, which its index reserves (server/row_index.py).
DYNAMIC = 0
RESERVED_IDS = (-(1 << 63), -(1 << 63) + 1)


def shard_of(ids: torch.Tensor, num_shards: int, dynamic: bool = False) -> torch.Tensor:
    """The shard each row id lives on (dynamic: of a dynamic table, by the ids' hash)."""
    if dynamic and num_shards > 1:
        mixed = splitmix64(ids.to(torch.int64).contiguous().numpy().view(np.uint64))
        return torch.from_numpy((mixed % np.uint64(num_shards)).astype(np.int64))
    return torch.remainder(ids, num_shards)


class TablesOnShards:
    """Several tables' row ids placed on the shards at once (see shard_of): the tables' ids,
    concatenated table after table, regrouped shard by shard, table by table within a shard, each
    table's ids in their order. One stable sort of the shard numbers (numpy's radix sort of small
    integers: several times torch's argsort on a worker's few thousand ids) and one count for every
    table and shard, where placing table by table costs a sort and a split per table (a worker's
    step reads and pushes rows of every table of its model; their number should not count).

    counts[s][t]: how many of table t's ids live on shard s; positions(s): their places in the
    concatenation (table t's first, then t + 1's), or None where one shard holds every id."""

    def __init__(self, ids: Sequence[torch.Tensor], num_shards: int, dynamic: Sequence[bool]) -> None:
        self.sizes = [int(t.numel()) for t in ids]
        self.num_shards = S = num_shards
        T = len(ids)
        self.order: torch.Tensor | None = None
        if S == 1:
            self.counts = [list(self.sizes)]
            return
        flat = (torch.cat(list(ids)) if T > 1 else ids[0]).to(torch.int64).numpy()
        where = _shards_of(flat, S, all(dynamic))
        if any(dynamic) and not all(dynamic):  # (a dynamic table's ids are placed by their hash)
            start = 0
            for size, hashed in zip(self.sizes, dynamic):
                if hashed:
                    where[start:start + size] = _shards_of(flat[start:start + size], S, True)
                start += size
        small = where.astype(np.uint8 if S <= 256 else np.uint16 if S <= 65536 else np.int64)  # (radix-sorted)
        self.order = torch.from_numpy(np.argsort(small, kind="stable"))
        key = where if T == 1 else where * T + np.repeat(np.arange(T), self.sizes)
        self.counts = np.bincount(key, minlength=S * T).reshape(S, T).tolist()

    def positions(self, shard: int) -> torch.Tensor | None:
        if self.order is None:
            return None
        start = sum(sum(row) for row in self.counts[:shard])
        return self.order[start:start + sum(self.counts[shard])]

    def split(self, values: torch.Tensor) -> list[list[torch.Tensor]]:
        """values: the tables' rows (or ids) concatenated in the tables' order, [sum(sizes), ...];
        returns [shard][table] their pieces on each shard (views of one gather)."""
        if self.order is None:
            return [list(values.split_with_sizes(self.sizes))]
        flat = values.index_select(0, self.order).split_with_sizes([c for row in self.counts for c in row])
        T = len(self.sizes)
        return [list(flat[s * T:(s + 1) * T]) for s in range(self.num_shards)]


def _shards_of(ids: np.ndarray, num_shards: int, dynamic: bool) -> np.ndarray:
    """shard_of of int64 ids, in numpy."""
    if dynamic:
        return (splitmix64(ids.view(np.uint64)) % np.uint64(num_shards)).astype(np.int64)
    return ids % num_shards


def local_index(ids: torch.Tensor, num_shards: int) -> torch.Tensor:
    """Each row id's place among the rows of its shard."""
    return torch.div(ids, num_shards, rounding_mode="floor")


def rows_on_shard(num_embeddings: int, index: int, num_shards: int) -> int:
    """How many of a table's rows shard `index` holds."""
    return max(0, -(-(num_embeddings - index) // num_shards))


def check_ids(ids: torch.Tensor, num_embeddings: int, what: str) -> None:
    """Row ids must be a 1-D int64 (or int32) tensor of values in [0, num_embeddings) (any value:
    a dynamic table's).

    Raises:
        InvalidRequestError: another dtype or shape, or an id out of range (the first one named).
    """
    if ids.dtype not in (torch.int64, torch.int32) or ids.dim() != 1:
        raise InvalidRequestError(f"{what}: row ids must be a 1-D int64 tensor, got {ids.dtype} of shape {list(ids.shape)}")
    if ids.numel() and num_embeddings == DYNAMIC:
        if ids.dtype == torch.int64 and bool((ids <= RESERVED_IDS[1]).any()):
            raise InvalidRequestError(f"{what}: row id {int(ids.min())}: the two smallest int64 ids "
                                      f"({RESERVED_IDS[0]}, {RESERVED_IDS[1]}) are the ones a dynamic table cannot hold "
                                      "(its index marks free and removed places with them)")
        return
    if ids.numel():
        low, high = (int(v) for v in torch.aminmax(ids))
        if low < 0 or high >= num_embeddings:
            bad = low if low < 0 else high
            raise InvalidRequestError(f"{what}: row id {bad} is out of range [0, {num_embeddings})")


def splitmix64(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """splitmix64's mix of each uint64 (a counter-based generator: equal inputs, equal outputs);
    into `out` where given (it may be x itself), without temporaries but one."""
    out = np.add(x, _GOLDEN, out=out)
    tmp = np.empty_like(out)
    for shift, factor in ((30, _MIX1), (27, _MIX2), (31, None)):
        np.right_shift(out, np.uint64(shift), out=tmp)
        np.bitwise_xor(out, tmp, out=out)
        if factor is not None:
            np.multiply(out, factor, out=out)
    return out


def table_key(seed: int, table: str) -> int:
    """The generator key of one table of a job: its seed and its name."""
    digest = hashlib.blake2b(table.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") ^ (seed * 0x9E3779B97F4A7C15)) & (2**64 - 1)


def initial_rows(key: int | np.ndarray, ids: torch.Tensor, dim: int, std: float | np.ndarray = 1.0) -> torch.Tensor:
    """The initial values of rows `ids` ([len(ids), dim] float32) of the table whose key this is;
    or, with a key and a std per row (uint64 and float64 arrays of len(ids)), of rows of several
    tables at once, each row its own table's value."""
    n = ids.numel()
    per_row = isinstance(key, np.ndarray)
    if n == 0 or (not per_row and std == 0.0):  # (rows that start at zero: no draws to make)
        return torch.zeros(n, dim)
    keys = key.astype(np.uint64)[:, None] if isinstance(key, np.ndarray) else np.uint64(key)
    # Box-Muller on two splitmix64 draws per value. Each step writes over its input where it can:
    # the values are those of the plain formula, bit for bit (tests/unit/test_sparse_table.py).
    with np.errstate(over="ignore"):
        base = ids.numpy().astype(np.uint64)[:, None] * np.uint64(dim)
        a = np.add(base, np.arange(dim, dtype=np.uint64), dtype=np.uint64)
        np.bitwise_xor(a, keys, out=a)
        splitmix64(a, out=a)
        b = splitmix64(a)
    np.right_shift(a, np.uint64(11), out=a)
    z = a.astype(np.float64)  # u1 = (a >> 11 + 1) 2^-53, in (0, 1]; z: sqrt(-2 log u1)
    np.add(z, 1.0, out=z)
    np.multiply(z, 2.0**-53, out=z)
    np.log(z, out=z)
    np.multiply(z, -2.0, out=z)
    np.sqrt(z, out=z)
    np.right_shift(b, np.uint64(11), out=b)
    c = b.astype(np.float64)  # u2 = (b >> 11) 2^-53, in [0, 1); c: cos(2 pi u2)
    np.multiply(c, 2.0**-53, out=c)
    np.multiply(c, 2.0 * np.pi, out=c)
    np.cos(c, out=c)
    np.multiply(z, c, out=z)
    if isinstance(std, np.ndarray):
        z = np.where(std[:, None] == 0.0, 0.0, z * std[:, None])  # (zero rows: +0.0, as torch.zeros)
    else:
        z *= std
    return torch.from_numpy(z.astype(np.float32))


def materialize(key: int, num_embeddings: int, dim: int, std: float, ids: torch.Tensor, values: torch.Tensor,
                chunk_rows: int = 1 << 18) -> torch.Tensor:
    """The whole table [num_embeddings, dim]: every row's initial value, with rows `ids` replaced by
    `values` (made in chunks, so the temporaries stay small next to the table)."""
    out = torch.empty(num_embeddings, dim)
    for lo in range(0, num_embeddings, chunk_rows):
        hi = min(num_embeddings, lo + chunk_rows)
        out[lo:hi] = initial_rows(key, torch.arange(lo, hi), dim, std)
    if ids.numel():
        out[ids] = values
    return out
