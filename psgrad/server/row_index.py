"""Where a shard finds a sparse table's stored rows: row id -> arena slot (-1: never stored). A table
of N rows keeps a dense index (8 bytes per row it places, row r at local index r div S); a dynamic
table (any int64 id) keeps a hash index whose size follows the rows stored. Both answer a batch of
ids with tensor operations, not a Python loop over them. Not thread-safe: the table's shard calls
them under its lock."""
from __future__ import annotations

import math

import torch

from psgrad.core import rows
from psgrad.core.sharding import MIN_COUNT_MAX
from psgrad.wire.heap import huge_page_block

_EMPTY, _GONE = rows.RESERVED_IDS  # a free place's key; a removed id's (a tombstone: lookups probe
# past it, inserts reuse it): the two ids a dynamic table cannot hold
_MAX_LOAD = 0.5  # a hash index grows (doubles) before more than half of its places are used
_MIX = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: Fibonacci hashing's multiplier


def storage(shape: tuple[int, ...], dtype: torch.dtype, fill: int | None = None) -> torch.Tensor:
    """A new tensor of a table's storage (its rows and their state, or its index), on huge pages
    where the OS gives them (see wire/heap.py huge_page_block: a step's rows are scattered over
    all of it), its pages given as first written; filled with `fill` (None: left as allocated).

    Raises:
        RuntimeError: the machine would not give that much memory (as torch.empty's)."""
    nbytes = math.prod(shape) * dtype.itemsize
    block = huge_page_block(nbytes)
    if block is None:
        t = torch.empty(shape, dtype=dtype)
    else:
        t = torch.frombuffer(block, dtype=torch.uint8).view(dtype).view(shape)
    return t if fill is None else t.fill_(fill)


class DenseIndex:
    """Rows [0, num_embeddings) of a table placed on shard `index` of `num_shards`: an array of
    slots by local index. Its memory is fixed: 8 bytes per row placed here."""

    def __init__(self, num_embeddings: int, index: int, num_shards: int) -> None:
        self.num_shards, self._index = num_shards, index
        self.rows = rows.rows_on_shard(num_embeddings, index, num_shards)
        self._slot = storage((self.rows,), torch.int64, -1)

    @staticmethod
    def bytes_for(placed: int) -> int:
        """What an index of `placed` rows holds (its memory, charged before it is made)."""
        return 8 * placed

    @property
    def nbytes(self) -> int:
        return self.bytes_for(self.rows)

    def growth_bytes(self, stored: int) -> int:
        """Bytes more the index needs to hold `stored` rows in all (fixed: none)."""
        return 0

    @property
    def room(self) -> int:
        """Rows it holds without growing: every row it places."""
        return self.rows

    def _local(self, ids: torch.Tensor) -> torch.Tensor:
        return ids.long() if self.num_shards == 1 else rows.local_index(ids.long(), self.num_shards)

    @property
    def slots(self) -> torch.Tensor:
        """The slot of each local index, -1 where never stored (the row kernels read it)."""
        return self._slot

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each id (checked), -1 where never stored."""
        return self._slot.index_select(0, self._local(ids))

    def assign(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Ids (unique, not stored yet) are stored at `slots` from now on."""
        self._slot[self._local(ids)] = slots

    def move(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Ids (stored) are at `slots` from now on."""
        self._slot[self._local(ids)] = slots

    def remove(self, ids: torch.Tensor) -> None:
        """Ids (stored) are no longer stored."""
        self._slot[self._local(ids)] = -1

    def clear(self) -> None:
        self._slot.fill_(-1)

    def extend(self, num_embeddings: int) -> int:
        """Place rows [0, num_embeddings) from now on (at least those placed now; the new ones
        never stored); returns the bytes more it holds."""
        more = rows.rows_on_shard(num_embeddings, self._index, self.num_shards) - self.rows
        if more > 0:
            slot = storage((self.rows + more,), torch.int64)
            slot[: self.rows] = self._slot
            slot[self.rows:] = -1
            self._slot = slot
            self.rows += more
        return 8 * max(more, 0)


class HashIndex:
    """Any int64 ids (but the smallest, int64's minimum) -> slots, by open addressing with linear
    probing in a power-of-two array of keys and one of slots: 16 bytes per place, at most half the
    places used, so 32-64 bytes per stored row. A batch is looked up (and inserted) in rounds of
    tensor operations: each round settles the ids whose probe found their key or a free place, and
    moves the others one place on (a few rounds at this load)."""

    INITIAL = 1024  # places of a new index

    def __init__(self, capacity: int = INITIAL) -> None:
        self._keys = storage((capacity,), torch.int64, _EMPTY)
        self._slots = storage((capacity,), torch.int64, -1)
        self.stored = 0
        self._gone = 0  # tombstones: places of removed ids (they count as used until a rehash)

    @property
    def nbytes(self) -> int:
        return 16 * self._keys.numel()

    @property
    def capacity(self) -> int:
        """Its places (a power of two; at most half of them used)."""
        return self._keys.numel()

    def reserve(self, capacity: int) -> None:
        """Grow to `capacity` places (a power of two) if it has fewer (another index's, adopted)."""
        if capacity > self._keys.numel():
            self._rehash(capacity)

    @staticmethod
    def _capacity_for(stored: int, capacity: int) -> int:
        while stored > _MAX_LOAD * capacity:
            capacity *= 2
        return capacity

    def growth_bytes(self, stored: int) -> int:
        """Bytes more the index needs to hold `stored` rows in all."""
        capacity = self._keys.numel()
        return 16 * (self._capacity_for(stored, capacity) - capacity)

    @property
    def room(self) -> int:
        """Rows it holds without growing (half its places)."""
        return int(_MAX_LOAD * self._keys.numel())

    def _places(self, ids: torch.Tensor) -> torch.Tensor:
        """Each stored id's place in the arrays (-1 where not stored)."""
        ids = ids.long()
        out = torch.full((ids.numel(),), -1, dtype=torch.int64)
        pending = torch.arange(ids.numel())
        at = self._home(ids)
        mask = self._keys.numel() - 1
        while pending.numel():
            keys = self._keys.index_select(0, at)
            found = keys == ids.index_select(0, pending)
            out[pending[found]] = at[found]
            go_on = ~found & (keys != _EMPTY)  # another id's place, or a tombstone: probe the next one
            pending, at = pending[go_on], (at[go_on] + 1) & mask
        return out

    def _home(self, ids: torch.Tensor) -> torch.Tensor:
        bits = self._keys.numel().bit_length() - 1
        return torch.bitwise_right_shift(ids * _MIX, 64 - bits) & (self._keys.numel() - 1) if bits else ids * 0

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each id, -1 where not stored."""
        places = self._places(ids)
        found = places >= 0
        out = torch.full((ids.numel(),), -1, dtype=torch.int64)
        out[found] = self._slots.index_select(0, places[found])
        return out

    def assign(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Ids (unique, not stored yet) are stored at `slots` from now on (the index grows, or is
        rebuilt without its tombstones, first where they would load it past half)."""
        ids = ids.long()
        capacity = self._keys.numel()
        if self.stored + self._gone + ids.numel() > _MAX_LOAD * capacity:
            self._rehash(self._capacity_for(self.stored + ids.numel(), capacity))
        self._insert(ids, slots)
        self.stored += ids.numel()

    def move(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Ids (stored) are at `slots` from now on."""
        self._slots[self._places(ids)] = slots

    def remove(self, ids: torch.Tensor) -> None:
        """Ids (stored) are no longer stored: their places become tombstones."""
        places = self._places(ids)
        self._keys[places] = _GONE
        self._slots[places] = -1
        self.stored -= ids.numel()
        self._gone += ids.numel()

    def _insert(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        mask = self._keys.numel() - 1
        at = self._home(ids)
        while ids.numel():
            keys = self._keys.index_select(0, at)
            free = (keys == _EMPTY) | (keys == _GONE)  # (ids inserted are not stored: a tombstone may take one)
            # Of the ids whose probe found a free place, one per place wins it (the last write);
            # the others, and those that found a taken place, probe the next one.
            self._keys.index_put_((at[free],), ids[free])
            won = free & (self._keys.index_select(0, at) == ids)
            self._slots.index_put_((at[won],), slots[won])
            lost = ~won
            ids, slots, at = ids[lost], slots[lost], (at[lost] + 1) & mask

    def _rehash(self, capacity: int) -> None:
        used = (self._keys != _EMPTY) & (self._keys != _GONE)
        keys, slots = self._keys[used], self._slots[used]
        self._keys = storage((capacity,), torch.int64, _EMPTY)
        self._slots = storage((capacity,), torch.int64, -1)
        self._gone = 0
        self._insert(keys, slots)

    def clear(self) -> None:
        self._keys.fill_(_EMPTY)
        self._slots.fill_(-1)
        self.stored = self._gone = 0


class Sightings:
    """How many updates have named each id not stored yet (admission, a table's min_count): a
    count-min sketch of DEPTH rows of WIDTH saturating 8-bit counters, each id counted at one
    counter per row (chosen by a mix of the id), its count the smallest of them. Its memory is fixed
    whatever the number of ids: DEPTH x WIDTH bytes (2 MiB), nothing per id; a count is never too
    low, and too high only where other ids share every counter of it (rare below a few hundred
    thousand ids counted at once), so an id may be admitted early, never late."""

    DEPTH, WIDTH = 2, 1 << 20

    def __init__(self) -> None:
        self.counts = torch.zeros(self.DEPTH, self.WIDTH, dtype=torch.uint8)

    @property
    def nbytes(self) -> int:
        return self.counts.numel()

    def _cells(self, ids: torch.Tensor) -> torch.Tensor:
        """[DEPTH, n] counter indices of each id, one mix per row."""
        mixed = torch.stack([(ids.long() + 0x2545F4914F6CDD1D * (d + 1)) * _MIX for d in range(self.DEPTH)])
        return torch.bitwise_right_shift(mixed, 64 - (self.WIDTH.bit_length() - 1)) & (self.WIDTH - 1)

    def count(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's count (int64)."""
        if not ids.numel():
            return torch.empty(0, dtype=torch.int64)
        cells = self._cells(ids)
        return torch.stack([self.counts[d].index_select(0, cells[d]) for d in range(self.DEPTH)]).min(0).values.long()

    def add(self, ids: torch.Tensor) -> torch.Tensor:
        """Count one more sighting of each id (unique) and return their counts."""
        cells = self._cells(ids)
        for d in range(self.DEPTH):
            row = self.counts[d]
            row.index_put_((cells[d],), (row.index_select(0, cells[d]).long() + 1).clamp_(max=MIN_COUNT_MAX).to(torch.uint8))
        return self.count(ids)
