"""Process allocator settings for streaming large payloads: keep megabyte-sized blocks in the heap.

gRPC hands every received message to Python as a fresh ``bytes`` object and reads the socket into
fresh slices of up to a few MiB. glibc serves blocks above its mmap threshold (128 KiB until the
first such block is freed) with a private ``mmap`` that is unmapped again on free, so every chunk
of a 100 MB transfer paid page faults on first touch and a munmap afterwards: about half of a
shard server's CPU time per push (measured with perf; the process that happened to free a few
large blocks early ran twice as fast, because glibc's *dynamic* threshold had risen).

`tune_allocator` pins what glibc's dynamic rule would reach anyway: blocks below 32 MiB come from
the heap, and up to 64 MiB of free heap is kept instead of being returned to the kernel after
every message. Tensors of a whole shard (hundreds of MB) are still mapped on their own. It also
caps the number of heaps (arenas) at one per CPU: each thread that touches messages would
otherwise get its own (glibc allows 8 per CPU), and each keeps its free memory; with four workers
pushing at once that was 30-90 MB more peak memory on a server (measured, VmHWM), at no cost in
throughput.

`huge_page_block` asks Linux to back a large block (a sparse table's storage and row index) with 2 MiB
transparent huge pages as its pages are first written, where the kernel leaves that to the program
(`/sys/kernel/mm/transparent_hugepage/enabled` = madvise, a common default). A step reads and
updates a few thousand rows scattered over hundreds of MB: on 4 KiB pages nearly every row costs
a TLB miss and a page-table walk. Random Adagrad row updates over a 4M x 32 table on the project's
2-core VM: 2.7-3.2 ms a step of 2,600 rows on 4 KiB pages, 1.7-1.8 ms on huge pages. The memory
cost: the last huge page of each block holds up to 2 MiB not yet used.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import platform
import threading

MMAP_THRESHOLD_BYTES = 32 << 20  # the largest value glibc accepts (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD_BYTES = 2 * MMAP_THRESHOLD_BYTES  # glibc's own dynamic rule keeps trim = 2 x mmap
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_lock = threading.Lock()
_tuned: bool | None = None


def tune_allocator() -> bool:
    """Set glibc's mmap and trim thresholds and its arena limit for this process, once. True when
    they are in effect; False on other C libraries (nothing is changed there)."""
    global _tuned
    with _lock:
        if _tuned is None:
            _tuned = False
            if platform.libc_ver()[0] == "glibc":
                try:
                    mallopt = ctypes.CDLL(None).mallopt
                except (OSError, AttributeError):
                    return False
                mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
                mallopt.restype = ctypes.c_int
                arenas = max(2, os.cpu_count() or 1)
                _tuned = all(
                    mallopt(option, value)
                    for option, value in (
                        (_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
                        (_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
                        (_M_ARENA_MAX, arenas),
                    )
                )
        return _tuned


HUGE_PAGE_BYTES = 2 << 20


def huge_page_block(nbytes: int) -> memoryview | None:
    """A new block of `nbytes` (zeros, as the OS gives pages when first written), in a mapping of
    its own whose pages are asked to be transparent huge pages (madvise MADV_HUGEPAGE), starting on
    a huge page's boundary; freed when the last reference to it goes. A mapping of its own, not
    malloc's: a block from the heap (tune_allocator keeps blocks under 32 MiB there) may lie on
    pages written before, which stay 4 KiB pages. None where nothing was asked for (under two
    huge pages, not Linux, no madvise here) or the mapping failed: the caller allocates as usual."""
    if nbytes < 2 * HUGE_PAGE_BYTES or platform.system() != "Linux" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        block = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        block.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return None
    first = (ctypes.c_char * 1).from_buffer(block)
    address = ctypes.addressof(first)
    del first  # (its hold on the mapping's buffer)
    start = -address % HUGE_PAGE_BYTES
    return memoryview(block)[start:start + nbytes]
