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
id * dim + j; Box-Muller from two such draws, by the arithmetic the comment above normal() says), so any
subset of rows is made without the others, and the same on any machine."""
from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from psgrad.core import compiled
from psgrad.core.codecs import joined
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


#: Up to this many shards, TablesOnShards finds each shard's ids in a pass of its own; more, by one
#: stable sort of the shard numbers.
_FEW_SHARDS = 8


class TablesOnShards:
    """Several tables' row ids placed on the shards at once (see shard_of): the tables' ids,
    concatenated table after table, regrouped shard by shard, table by table within a shard, each
    table's ids in their order. One stable sort of the shard numbers (numpy's radix sort of small
    integers: several times torch's argsort on a worker's few thousand ids) and one count for every
    table and shard, where placing table by table costs a sort and a split per table (a worker's
    step reads and pushes rows of every table of its model; their number should not count).

    counts[s][t]: how many of table t's ids live on shard s; positions(s): their places in the
    concatenation (table t's first, then t + 1's), or None where one shard holds every id;
    ids_by_shard(): the ids themselves, by shard (made once: a step's push places the ids its read
    placed)."""

    def __init__(self, ids: Sequence[torch.Tensor], num_shards: int, dynamic: Sequence[bool]) -> None:
        self.sizes = [int(t.numel()) for t in ids]
        self.num_shards = S = num_shards
        T = len(ids)
        self.order: torch.Tensor | None = None
        self._ids: torch.Tensor | list[torch.Tensor] = list(ids)  # (joined once asked for, where not yet)
        self._by_shard: list[torch.Tensor] | None = None
        if S == 1:
            self.counts = [list(self.sizes)]
            return
        self._ids = (torch.cat(list(ids)) if T > 1 else ids[0]).to(torch.int64)
        flat = self._ids.numpy()
        where = _shards_of(flat, S, all(dynamic))
        if any(dynamic) and not all(dynamic):  # (a dynamic table's ids are placed by their hash)
            start = 0
            for size, hashed in zip(self.sizes, dynamic):
                if hashed:
                    where[start:start + size] = _shards_of(flat[start:start + size], S, True)
                start += size
        if S <= _FEW_SHARDS:
            # (a pass per shard: its ids' places, in order, and each table's count of them where
            # the tables' boundaries fall among those places; the same order as the stable sort
            # below, at a fraction of its cost and of the bincount's for a worker's few thousand ids)
            bounds = starts(self.sizes)
            places, counts = [], []
            for s in range(S):
                found = np.flatnonzero(where == s)
                places.append(found)
                counts.append(np.diff(found.searchsorted(bounds)).tolist())
            self.order = torch.from_numpy(np.concatenate(places))
            self.counts = counts
            return
        small = where.astype(np.uint8 if S <= 256 else np.uint16 if S <= 65536 else np.int64)  # (radix-sorted)
        self.order = torch.from_numpy(np.argsort(small, kind="stable"))
        key = where if T == 1 else where * T + np.repeat(np.arange(T), self.sizes)
        self.counts = np.bincount(key, minlength=S * T).reshape(S, T).tolist()

    @classmethod
    def found(cls, ids: torch.Tensor, sizes: Sequence[int], num_shards: int, order: torch.Tensor,
              counts: list[list[int]]) -> TablesOnShards:
        """The placement a pass over the ids found elsewhere (a read of rows in place finds it as
        it reads them: client/rows_in_place.py): ids the tables' joined (int64), order and counts
        as made above (order: each shard's positions among them, shard after shard)."""
        place = cls.__new__(cls)
        place.sizes, place.num_shards, place._ids, place._by_shard = list(sizes), num_shards, ids, None
        place.order, place.counts = (order, counts) if num_shards > 1 else (None, [list(sizes)])
        return place

    def positions(self, shard: int) -> torch.Tensor | None:
        if self.order is None:
            return None
        start = sum(sum(row) for row in self.counts[:shard])
        return self.order[start:start + sum(self.counts[shard])]

    def ids_by_shard(self) -> list[torch.Tensor]:
        """The tables' ids (int64) as by_shard gives them, made the first time."""
        if self._by_shard is None:
            ids = self._ids if isinstance(self._ids, torch.Tensor) else joined(self._ids).to(torch.int64)
            self._by_shard = self.by_shard(ids)
        return self._by_shard

    def by_shard(self, values: torch.Tensor) -> list[torch.Tensor]:
        """values: the tables' rows (or ids) concatenated in the tables' order, [sum(sizes), ...];
        returns each shard's, its tables' one after another (counts[s]): views of one gather."""
        if self.order is None:
            return [values]
        sizes = [sum(row) for row in self.counts]
        if values.dtype == torch.float32 and values.dim() == 2 and values.is_cpu and not values.requires_grad:
            # (numpy's gather of rows: torch's index_select of rows this narrow costs half again as much)
            return list(torch.from_numpy(values.numpy().take(self.order.numpy(), axis=0)).split_with_sizes(sizes))
        return list(values.index_select(0, self.order).split_with_sizes(sizes))


def starts(sizes: Sequence[int]) -> np.ndarray:
    """[0, sizes[0], sizes[0] + sizes[1], ...]: where each part of a concatenation starts, and its
    end (int64; a Python sum: numpy's cumsum of a short list costs more than its arithmetic)."""
    return np.array([0, *itertools.accumulate(sizes)], dtype=np.int64)


def _shards_of(ids: np.ndarray, num_shards: int, dynamic: bool) -> np.ndarray:
    """shard_of of int64 ids, in numpy."""
    if dynamic:
        return (splitmix64(ids.view(np.uint64)) % np.uint64(num_shards)).astype(np.int64)
    if not num_shards & (num_shards - 1):  # (a power of two: the low bits, as the floored mod has them for any sign)
        return ids & (num_shards - 1)
    return ids % num_shards


class PulledRows(dict[str, torch.Tensor]):
    """Rows read from a job's shards, by table ([len(ids), dim] float32, CPU), with `versions`: the
    version each table had on each shard its rows came from (table -> {shard: version}). A push of
    gradients computed on these rows says so (its per-table base version on each shard), and the
    table's staleness counts from it. `blocks`: where a read wrote tables' rows one after another
    in one tensor (a group of one width), that tensor by their names in that order: what a caller
    taking them together would otherwise find by looking at each table's part (as read, not
    changed since)."""

    def __init__(self, rows: Mapping[str, torch.Tensor] | None = None,
                 versions: Mapping[str, Mapping[int, int]] | None = None,
                 blocks: Mapping[tuple[str, ...], torch.Tensor] | None = None) -> None:
        super().__init__(rows or {})
        self.versions: dict[str, dict[int, int]] = {t: dict(v) for t, v in (versions or {}).items()}
        self.blocks: dict[tuple[str, ...], torch.Tensor] = dict(blocks or {})


class TableRows(dict[str, tuple[torch.Tensor, torch.Tensor]]):
    """Rows of tables by name, (ids, values [n, dim]) each (a step's row gradients), with `blocks`:
    where tables' values lie one after another in one tensor (the gradient of a forward's group
    of tables, see nn/embedding.GroupRows), that tensor by their names in that order: what the
    push's split of them by shard would otherwise find by looking at each table's part."""

    def __init__(self, rows: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
                 blocks: Mapping[tuple[str, ...], torch.Tensor] | None = None) -> None:
        super().__init__(rows or {})
        self.blocks: dict[tuple[str, ...], torch.Tensor] = dict(blocks or {})


def oldest(*versions: Mapping[int, int] | None) -> dict[int, int]:
    """Each shard's oldest version among reads' versions ({shard: version} each; None: a read
    whose versions are not known, left out)."""
    out: dict[int, int] = {}
    for read in versions:
        for shard, version in (read or {}).items():
            out[shard] = min(version, out.get(shard, version))
    return out


def local_index(ids: torch.Tensor, num_shards: int) -> torch.Tensor:
    """Each row id's place among the rows of its shard."""
    return torch.div(ids, num_shards, rounding_mode="floor")


def rows_on_shard(num_embeddings: int, index: int, num_shards: int) -> int:
    """How many of a table's rows shard `index` holds."""
    return max(0, -(-(num_embeddings - index) // num_shards))


def check_ids(ids: torch.Tensor, num_embeddings: int, what: str, ordered: bool = False) -> None:
    """Row ids must be a 1-D int64 (or int32) tensor of values in [0, num_embeddings) (any value:
    a dynamic table's). ordered: the caller knows them in increasing order (unique ids, sorted), so
    the first and the last are the least and the greatest.

    Raises:
        InvalidRequestError: another dtype or shape, or an id out of range (the first one named).
    """
    if ids.dtype not in (torch.int64, torch.int32) or ids.dim() != 1:
        raise InvalidRequestError(f"{what}: row ids must be a 1-D int64 tensor, got {ids.dtype} of shape {list(ids.shape)}")
    if ids.numel() and num_embeddings == DYNAMIC:
        reserved = int(ids[0]) <= RESERVED_IDS[1] if ordered else bool((ids <= RESERVED_IDS[1]).any())
        if ids.dtype == torch.int64 and reserved:
            raise InvalidRequestError(f"{what}: row id {int(ids.min())}: the two smallest int64 ids "
                                      f"({RESERVED_IDS[0]}, {RESERVED_IDS[1]}) are the ones a dynamic table cannot hold "
                                      "(its index marks free and removed places with them)")
        return
    if ids.numel():
        if ordered:  # (the ends; through numpy on the CPU: a tensor's item costs several us, once per table per step)
            ends = ids.numpy() if ids.device.type == "cpu" else ids[[0, -1]].cpu().numpy()
            low, high = int(ends[0]), int(ends[-1])
        else:
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


# Box-Muller's normal, sqrt(-2 ln u1) cos(2 pi u2), by the arithmetic below: only +, -, *, / and sqrt of
# IEEE doubles (each correctly rounded, everywhere), in a fixed order, where a math library's log and
# cos give results that differ in their last bits from one library, or one CPU's vector unit, to the
# next. So a row's initial value is the same wherever it is drawn: numpy here, the compiled draw
# (core/_draw_kernel.py, the same steps), any machine. Both factors are within about 1.5 units
# in the last place of a double of their exact values, so the float32 a row holds is the exact
# normal's rounding but in the rarest cases (tests/unit/test_sparse_table.py).
#
# ln u1, u1 = n 2^-53 (n = (a >> 11) + 1, 1 <= n <= 2^53, exact as a double): with n = m 2^e, m in
# [sqrt(1/2), sqrt(2)), ln u1 = (e - 53) ln 2 + ln m, and ln m = ln(1 + f) = 2 atanh(s), s = f / (2 + f),
# as f - (f^2/2 - s (f^2/2 + R)), R = sum 2 s^2k / (2k + 1) (k = 1..10: |s| <= 0.172, the rest < 1e-18),
# ln 2 in two parts (the first with 21 significant bits, so that (e - 53) times it is exact).
_LN2_HI = float.fromhex("0x1.62e42p-1")
_LN2_LO = float.fromhex("0x1.fdf473de6af28p-22")
_SQRT2 = float.fromhex("0x1.6a09e667f3bcdp+0")
_LOG_R = tuple(2.0 / (2 * k + 1) for k in range(1, 11))
# cos(2 pi u2), u2 = t 2^-53 (t = b >> 11): t = q 2^51 + r, |r| <= 2^50 (q quarter turns, exactly), so
# cos(2 pi u2) is cos(2 pi x), -sin, -cos or sin(2 pi x) for q mod 4 = 0, 1, 2, 3, x = r 2^-53 in
# [-1/8, 1/8]: Taylor series in x^2 of (2 pi)^2k / (2k)! and (2 pi)^(2k+1) / (2k+1)! (k = 0..9: the
# rest < 1e-17), their coefficients rounded to doubles once.
_COS = tuple(float.fromhex(h) for h in (
    "0x1.0000000000000p+0", "-0x1.3bd3cc9be45dep+4", "0x1.03c1f081b5ac4p+6", "-0x1.55d3c7e3cbffap+6",
    "0x1.e1f506891babbp+5", "-0x1.a6d1f2a204a8cp+4", "0x1.f9d38a3763cc3p+2", "-0x1.b6e24f44b128fp+0",
    "0x1.20c62c2f2d7f5p-2", "-0x1.2a0c591af8314p-5"))
_SIN = tuple(float.fromhex(h) for h in (
    "0x1.921fb54442d18p+2", "-0x1.4abbce625be53p+5", "0x1.466bc6775aae2p+6", "-0x1.32d2cce62bd86p+6",
    "0x1.50783487ee782p+5", "-0x1.e3074fde8871fp+3", "0x1.e8f434d018d63p+1", "-0x1.6fadb9f155744p-1",
    "0x1.aaec32af93359p-4", "-0x1.8a404211f9547p-7"))


# What the compiled draw is given (core/_draw_kernel.py): splitmix64's constants, and this arithmetic's.
DRAW_CONSTANTS = (np.array([_GOLDEN, _MIX1, _MIX2], dtype=np.uint64),
                  np.array([_LN2_HI, _LN2_LO, _SQRT2, *_LOG_R, *_COS, *_SIN], dtype=np.float64))

_CHUNK = 16384  # values a pass of normal() works through at once (its temporaries stay in the cache)


def _horner(coefficients: tuple[float, ...], x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """c0 + x (c1 + x (c2 + ...)), innermost first, into out."""
    out.fill(coefficients[-1])
    for c in coefficients[-2::-1]:
        np.multiply(out, x, out=out)
        np.add(out, c, out=out)
    return out


def normal(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Box-Muller's first normal (float64, of a's shape) of the uint64 draws a and b (same shape,
    contiguous), by the arithmetic the comment above says; a and b are written over."""
    out = np.empty(a.shape, np.float64)
    flat_a, flat_b, flat_out = a.reshape(-1), b.reshape(-1), out.reshape(-1)
    scratch = np.empty((6, min(_CHUNK, flat_out.size)), np.float64)
    for lo in range(0, flat_out.size, _CHUNK):
        hi = min(lo + _CHUNK, flat_out.size)
        _normal(flat_a[lo:hi], flat_b[lo:hi], flat_out[lo:hi], scratch[:, :hi - lo])
    return out


def _normal(a: np.ndarray, b: np.ndarray, out: np.ndarray, scratch: np.ndarray) -> None:
    f, s, z, r, k, c = scratch
    # ln u1 (see above), into r. m = x 2^-e, e = x's exponent (+ 1 where that m > sqrt 2): x times
    # a power of two made from its bits, exact.
    n = np.right_shift(a, np.uint64(11), out=a)
    np.add(n, np.uint64(1), out=n)
    x = n.astype(np.float64)
    e = np.right_shift(x.view(np.uint64), np.uint64(52), out=n).view(np.int64)
    e -= 1023
    scale = np.empty_like(e)
    np.subtract(1023, e, out=scale)
    np.left_shift(scale, 52, out=scale)
    np.multiply(x, scale.view(np.float64), out=f)
    big = np.greater(f, _SQRT2)
    e += big
    np.subtract(1023, e, out=scale)
    np.left_shift(scale, 52, out=scale)
    np.multiply(x, scale.view(np.float64), out=f)
    e -= 53
    np.copyto(k, e, casting="unsafe")
    np.subtract(f, 1.0, out=f)
    np.add(f, 2.0, out=s)
    np.divide(f, s, out=s)
    np.multiply(s, s, out=z)
    _horner(_LOG_R, z, r)
    np.multiply(r, z, out=r)
    hfsq = np.multiply(f, 0.5, out=z)
    np.multiply(hfsq, f, out=hfsq)
    np.add(r, hfsq, out=r)
    np.multiply(r, s, out=r)
    np.add(r, np.multiply(k, _LN2_LO, out=s), out=r)
    np.subtract(hfsq, r, out=r)
    np.subtract(f, r, out=r)
    np.multiply(k, _LN2_HI, out=k)
    np.add(k, r, out=r)
    # sqrt(-2 ln u1), into out
    np.multiply(r, -2.0, out=out)
    np.sqrt(out, out=out)
    # cos(2 pi u2) (see above): the cosine's or the sine's series (q even or odd), negated (its sign
    # bit flipped) for q mod 4 = 1, 2
    t = np.right_shift(b, np.uint64(11), out=b)
    q = np.add(t, np.uint64(1 << 50), out=a)
    np.right_shift(q, np.uint64(51), out=q)
    np.subtract(t, np.left_shift(q, np.uint64(51)), out=t)  # (mod 2^64: r's two's complement)
    np.copyto(f, t.view(np.int64), casting="unsafe")
    np.multiply(f, 2.0 ** -53, out=f)
    np.multiply(f, f, out=z)
    _horner(_COS, z, c)
    _horner(_SIN, z, s)
    np.multiply(s, f, out=s)
    c[:] = np.where(np.bitwise_and(q, np.uint64(1), out=t) != 0, s, c)
    np.add(q, np.uint64(1), out=q)
    np.bitwise_and(q, np.uint64(2), out=q)
    np.left_shift(q, np.uint64(62), out=q)
    np.bitwise_xor(c.view(np.uint64), q, out=c.view(np.uint64))
    np.multiply(out, c, out=out)


def draws(key: np.ndarray | np.uint64, ids: torch.Tensor, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """The two splitmix64 draws (uint64 [len(ids), dim] each) of every element of rows `ids`:
    element j of row r counts r * dim + j, keyed (a key, or one per row, uint64 [len(ids), 1])."""
    with np.errstate(over="ignore"):
        base = ids.numpy().astype(np.uint64)[:, None] * np.uint64(dim)
        a = np.add(base, np.arange(dim, dtype=np.uint64), dtype=np.uint64)
        np.bitwise_xor(a, key, out=a)
        splitmix64(a, out=a)
        b = splitmix64(a)
    return a, b


#: Values (rows x width) from which a draw starts compiling the draw kernel: a process whose draws
#: are all smaller (a test's, a toy model's) never loads numba for them.
DRAW_KERNEL_MIN = 16384


def draw_kernel(start: bool = False, wait: bool = False) -> Callable[..., None] | None:
    """The compiled draw (core/_draw_kernel.py: numpy's steps below in one pass, the same bits), or
    None: not ready yet (start: this call starts compiling it in the background; wait=True waits
    for that), turned off (PSGRAD_FUSED_APPLY=0), or unavailable here."""
    return compiled.get("draw", _make_draw, start, wait)


def _make_draw() -> Callable[..., None] | None:
    from psgrad.core._draw_kernel import DRAW

    def draw(ids: np.ndarray, dim: int, keys: np.ndarray, stds: np.ndarray, out: np.ndarray) -> None:
        DRAW(ids, dim, keys, stds, out, *DRAW_CONSTANTS)  # type: ignore[operator]

    return draw if _draw_agrees(draw) else None


def _draw_agrees(draw: Callable[..., None]) -> bool:
    """Whether a draw kernel gives numpy's values bit for bit, at row widths that meet every vector
    loop's tail, for ids of either sign, several tables' keys and stds (0 among them)."""
    gen = np.random.default_rng(0)
    for n, dim in ((1, 1), (5, 7), (40, 33), (64, 64)):
        ids = torch.from_numpy(gen.integers(-(1 << 62), 1 << 62, n))
        keys = np.array([table_key(s, "t") for s in range(n)], dtype=np.uint64)
        stds = np.array([(0.0, 1.0, 0.01, 3.5)[i % 4] for i in range(n)])
        out = np.empty((n, dim), np.float32)
        draw(ids.numpy(), dim, keys, stds, out)
        if out.tobytes() != _numpy_rows(keys, ids, dim, stds).tobytes():
            return False
    return True


def initial_rows(key: int | np.ndarray, ids: torch.Tensor, dim: int, std: float | np.ndarray = 1.0) -> torch.Tensor:
    """The initial values of rows `ids` ([len(ids), dim] float32) of the table whose key this is;
    or, with a key and a std per row (uint64 and float64 arrays of len(ids)), of rows of several
    tables at once, each row its own table's value. Drawn by the compiled draw where it is ready
    (a draw of DRAW_KERNEL_MIN values or more starts compiling it), else by numpy's steps: the
    same bits."""
    n = ids.numel()
    per_row = isinstance(key, np.ndarray)
    if n == 0 or (not per_row and std == 0.0):  # (rows that start at zero: no draws to make)
        return torch.zeros(n, dim)
    fused = draw_kernel(start=n * dim >= DRAW_KERNEL_MIN)
    if fused is None:
        return torch.from_numpy(_numpy_rows(key, ids, dim, std))
    keys = key.astype(np.uint64) if isinstance(key, np.ndarray) else np.full(n, key, np.uint64)
    stds = std.astype(np.float64) if isinstance(std, np.ndarray) else np.full(n, float(std))
    out = torch.empty(n, dim)
    fused(ids.to(torch.int64).contiguous().numpy(), dim, keys, stds, out.numpy())
    return out


def _numpy_rows(key: int | np.ndarray, ids: torch.Tensor, dim: int, std: float | np.ndarray) -> np.ndarray:
    """initial_rows by numpy's steps (float32 [len(ids), dim])."""
    keys = key.astype(np.uint64)[:, None] if isinstance(key, np.ndarray) else np.uint64(key)
    z = normal(*draws(keys, ids, dim))
    if isinstance(std, np.ndarray):
        z = np.where(std[:, None] == 0.0, 0.0, z * std[:, None])  # (zero rows: +0.0, as torch.zeros)
    else:
        z *= std
    return z.astype(np.float32)


def materialize(key: int, num_embeddings: int, dim: int, std: float, ids: torch.Tensor, values: torch.Tensor,
                chunk_rows: int = 1 << 18) -> torch.Tensor:
    """The whole table [num_embeddings, dim]: every row's initial value, with rows `ids` replaced by
    `values` (made in chunks, so the temporaries stay small next to the table)."""
    out = torch.empty(num_embeddings, dim)
    if std and num_embeddings * dim >= 1 << 23:  # (compiling once costs less than numpy's steps here)
        draw_kernel(wait=True)
    for lo in range(0, num_embeddings, chunk_rows):
        hi = min(num_embeddings, lo + chunk_rows)
        out[lo:hi] = initial_rows(key, torch.arange(lo, hi), dim, std)
    if ids.numel():
        out[ids] = values
    return out
