"""Where a shard finds a sparse table's rows: the dense index of a table of N rows, and the hash
index of a dynamic table (any int64 id), checked against a plain dict on random 64-bit ids (at
half load, so probes run past taken places; from a capacity of 1, so it grows many times); a dynamic table's placement over the shards by the ids' hash."""
from __future__ import annotations

import pytest
import torch

from psgrad.core import rows
from psgrad.errors import InvalidRequestError
from psgrad.server.row_index import DenseIndex, HashIndex

pytestmark = pytest.mark.timeout(60)


def random_ids(n: int, seed: int) -> torch.Tensor:
    """n distinct int64 ids over the whole range (negative ones included), as 64-bit hashes are."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-(2**63) + 2, 2**63 - 1, (n,), generator=g, dtype=torch.int64)
    return torch.unique(ids)


@pytest.mark.parametrize("capacity", [1, 8, 1024])
def test_a_hash_index_finds_what_was_stored_and_nothing_else(capacity: int) -> None:
    index = HashIndex(capacity)
    truth: dict[int, int] = {}
    stored = 0
    for batch in range(6):
        ids = random_ids(3000, batch)
        ids = ids[[int(i) not in truth for i in ids.tolist()]]
        slots = torch.arange(stored, stored + ids.numel())
        index.assign(ids, slots)
        truth.update(zip(ids.tolist(), slots.tolist()))
        stored += ids.numel()
        probe = torch.cat([torch.tensor(list(truth)), random_ids(500, 100 + batch), torch.tensor([0, -1, 2**63 - 1])])
        assert index.lookup(probe).tolist() == [truth.get(int(i), -1) for i in probe.tolist()]
    assert index.stored == stored and index.nbytes <= 16 * 4 * stored  # at most half of its places used, >= a quarter
    index.clear()
    assert index.lookup(torch.tensor(list(truth)[:10])).tolist() == [-1] * 10


def test_a_dense_index_places_row_r_at_r_div_s() -> None:
    index = DenseIndex(10, 1, 3)  # rows 1, 4, 7 on shard 1
    assert index.rows == 3 and index.nbytes == 24 and index.growth_bytes(3) == 0
    index.assign(torch.tensor([4, 7]), torch.tensor([0, 1]))
    assert index.lookup(torch.tensor([1, 4, 7])).tolist() == [-1, 0, 1]


def test_a_dynamic_tables_ids_spread_over_the_shards_by_their_hash() -> None:
    consecutive = torch.arange(100_000, dtype=torch.int64)
    hashed = random_ids(100_000, 7)
    for ids in (consecutive, hashed, consecutive * 1024):  # strided ids too, which id mod S would not spread
        counts = torch.bincount(rows.shard_of(ids, 4, dynamic=True), minlength=4)
        assert counts.min() > 0.95 * ids.numel() / 4, counts
    assert torch.equal(rows.shard_of(hashed, 4, dynamic=True), rows.shard_of(hashed.clone(), 4, dynamic=True))
    assert rows.shard_of(hashed, 1, dynamic=True).eq(0).all()
    rows.check_ids(torch.tensor([-5, 2**63 - 1]), rows.DYNAMIC, "t")  # any int64 id
    for reserved in rows.RESERVED_IDS:
        with pytest.raises(InvalidRequestError, match="the two smallest int64 ids"):
            rows.check_ids(torch.tensor([5, reserved]), rows.DYNAMIC, "t")
        with pytest.raises(InvalidRequestError, match="the two smallest int64 ids"):  # ordered: the least is first
            rows.check_ids(torch.tensor([reserved, 5]), rows.DYNAMIC, "t", ordered=True)
    rows.check_ids(torch.tensor([0, 3, 9]), 10, "t", ordered=True)  # ordered: the ends are checked
    for bad, ids in ((10, [0, 3, 10]), (-1, [-1, 3, 9])):
        with pytest.raises(InvalidRequestError, match=f"row id {bad} is out of range"):
            rows.check_ids(torch.tensor(ids), 10, "t", ordered=True)


@pytest.mark.parametrize("kind", ["hash", "dense"])
def test_removed_ids_are_gone_moved_ids_are_found_and_the_rest_stay(kind: str) -> None:
    if kind == "hash":
        index: HashIndex | DenseIndex = HashIndex(8)
        ids = random_ids(2000, 3)
    else:
        index = DenseIndex(100_000, 0, 1)
        ids = torch.unique(torch.randint(0, 100_000, (2000,), generator=torch.Generator().manual_seed(3)))
    index.assign(ids, torch.arange(ids.numel()))
    gone, kept = ids[::3], torch.cat([ids[1::3], ids[2::3]])
    index.remove(gone)
    index.move(kept[:10], torch.arange(5000, 5010))
    assert index.lookup(gone).eq(-1).all()
    assert index.lookup(kept[:10]).tolist() == list(range(5000, 5010))
    truth = {int(i): k for k, i in enumerate(ids.tolist())}
    assert index.lookup(kept[10:]).tolist() == [truth[int(i)] for i in kept[10:].tolist()]
    index.assign(gone[:50], torch.arange(9000, 9050))  # stored again (a tombstone's place reused)
    assert index.lookup(gone[:50]).tolist() == list(range(9000, 9050))
    if isinstance(index, HashIndex):
        assert index.stored == kept.numel() + 50
        index.assign(random_ids(5000, 4), torch.arange(20_000, 20_000 + random_ids(5000, 4).numel()))  # rebuilt
        assert index.lookup(kept[10:]).tolist() == [truth[int(i)] for i in kept[10:].tolist()]


def _transparent_huge_pages() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return "unknown"


def _advised_huge(address: int) -> bool:
    """Whether this process's mapping holding `address` was asked for huge pages (madvise
    MADV_HUGEPAGE: "hg" among its VmFlags in /proc/self/smaps). The request, not the pages the
    kernel then gave: those also depend on its memory's fragmentation, which a test cannot fix."""
    holding = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                holding = lo <= address < hi
            elif holding and head == "VmFlags:":
                return "hg" in line.split()[1:]
    return False


@pytest.mark.skipif(_transparent_huge_pages() not in ("madvise", "always"),
                    reason="needs Linux's transparent huge pages (/sys/kernel/mm/transparent_hugepage/enabled: "
                           f"{_transparent_huge_pages()})")
@pytest.mark.parametrize("dynamic", [False, True])
def test_a_tables_rows_and_index_lie_on_huge_pages(dynamic: bool) -> None:
    """A step reads and updates rows scattered over a table's whole storage: on 4 KiB pages each
    costs a TLB miss (wire/heap.py huge_page_block). The rows, their optimizer state and the index
    are asked for huge pages as they are made (a dynamic table's storage too, which grows by
    doubling in blocks small enough for malloc's heap, where pages written before stay small)."""
    from psgrad.core.optimizers.rows import RowAdagrad
    from psgrad.server.tables import SparseTable

    t = SparseTable("t", rows.DYNAMIC if dynamic else 1 << 20, 32, 0, 1, 0, RowAdagrad(0.1), std=0.0)
    ids = torch.arange(200_000) * 3
    t.apply(ids, torch.ones(ids.numel(), 32))
    state = next(iter(t._state.values()))
    index = t._index._keys if dynamic else t._index.slots
    for name, tensor in (("rows", t._values), ("optimizer state", state), ("index", index)):
        middle = tensor.data_ptr() + tensor.numel() * tensor.element_size() // 2
        assert _advised_huge(middle), f"the table's {name} ({tensor.numel() * tensor.element_size():,} bytes) was not asked for huge pages"
