"""Published weight versions: a shard's ring of shared-memory slots that same-host workers map read-only.

A same-host worker asks for it by sending `psgrad-pub: HOST` (its `shm.host_id()`) with a pull
(or a Step call); a server on the same host that can lend a slot copies the version into one
once (every worker then reads that copy), leases it to the worker, and answers with trailing
metadata `psgrad-pub: NAME;NONCE;SLOT_BYTES;SLOTS;SLOT`. The worker maps the ring once, read-only,
and takes the slot's bytes as its weights: a pull is then a version check and a pointer swap.
The server never rewrites a leased slot; a worker's lease ends at its next pull, or when its
membership lease does (evicted, or left). One file per ring: the server unlinks it on close, and a
new ring sweeps the files of dead servers from /dev/shm (a server killed outright leaves its ring).
"""
from __future__ import annotations

import mmap
import os
import re
import secrets
from collections.abc import Iterable

from psgrad.wire.shm import SHM_DIR, SharedMemoryUnavailable, create, host_id, remove, sweep, unmap

METADATA_KEY = "psgrad-pub"
_MAGIC = b"psgrad-pub-v1\0\0\0"  # 16 bytes
_NONCE_BYTES = 16
_ALIGN = 4096  # slots start on page boundaries
_NAME = re.compile(r"^psgrad-pub-([0-9]+)-[0-9a-f]{16}$")


def request() -> tuple[tuple[str, str], ...]:
    """What a worker adds to a pull's metadata to ask for a published version."""
    return ((METADATA_KEY, host_id()),)


def requested(metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
    """Whether a call asks for a published version and comes from this host."""
    return (METADATA_KEY, host_id()) in tuple(metadata or ())


def _stride(slot_bytes: int) -> int:
    return max(_ALIGN, -(-slot_bytes // _ALIGN) * _ALIGN)


def sweep_dead(directory: str = SHM_DIR) -> int:
    """Unlink the rings of servers that are gone (their pid no longer exists); returns how many."""
    return sweep(_NAME, directory)


class Ring:
    """The server's ring: `slots` slots of `slot_bytes` each, in one file under /dev/shm."""

    def __init__(self, slot_bytes: int, slots: int) -> None:
        sweep_dead()
        self.slot_bytes = slot_bytes
        self.slots = slots
        self._stride = _stride(slot_bytes)
        self.name = f"psgrad-pub-{os.getpid()}-{secrets.token_hex(8)}"
        self._nonce = secrets.token_bytes(_NONCE_BYTES)
        # The user's own processes only (the workers map it read-only), like the segments.
        self._map = create(self.name, _ALIGN + slots * self._stride, _MAGIC + self._nonce, 0o600)
        self._view = memoryview(self._map)
        self._linked = True

    @property
    def nbytes(self) -> int:
        """The ring's size in shared memory (pages are allocated as slots are first written)."""
        return self.slots * self._stride

    def slot(self, index: int) -> memoryview:
        """Slot `index`'s bytes, writable (the server copies a version in)."""
        start = _ALIGN + index * self._stride
        return self._view[start : start + self.slot_bytes]

    def answer(self, index: int) -> tuple[tuple[str, str], ...]:
        """The trailing metadata that lends slot `index` to a worker."""
        value = f"{self.name};{self._nonce.hex()};{self.slot_bytes};{self.slots};{index}"
        return ((METADATA_KEY, value),)

    def close(self) -> None:
        if self._linked:
            self._linked = False
            remove(self.name)
        unmap(self._view, self._map)


class RingView:
    """A worker's mapping of a server's ring: private, so that nothing the worker writes reaches
    the server's slots (the file is opened read-only)."""

    def __init__(self, name: str, nonce: bytes, slot_bytes: int, slots: int) -> None:
        if not _NAME.match(name) or len(nonce) != _NONCE_BYTES:
            raise SharedMemoryUnavailable(f"not a psgrad ring name: {name!r}")
        self.name = name
        self.slot_bytes = slot_bytes
        self.slots = slots
        self._stride = _stride(slot_bytes)
        size = _ALIGN + slots * self._stride
        try:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as exc:
            raise SharedMemoryUnavailable(f"cannot open ring {name}: {exc.strerror}") from None
        try:
            if os.fstat(fd).st_size != size:
                raise SharedMemoryUnavailable(f"ring {name} has the wrong size")
            # Private and writable: a model parameter that views a slot and is written over by the
            # user (load_state_dict, nn.init) gets a private copy of the page instead of a segfault
            # (the worker refuses its next step, naming the parameter, and maps the ring afresh).
            self._map = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        if self._map[: len(_MAGIC) + _NONCE_BYTES] != _MAGIC + nonce:
            self._map.close()
            raise SharedMemoryUnavailable(f"ring {name} is not the one described")
        self._view = memoryview(self._map)

    def slot(self, index: int) -> memoryview:
        """Slot `index`'s bytes (a write stays private to this process)."""
        if not 0 <= index < self.slots:
            raise SharedMemoryUnavailable(f"ring {self.name} has no slot {index}")
        start = _ALIGN + index * self._stride
        return self._view[start : start + self.slot_bytes]


def parse_answer(value: str) -> tuple[str, bytes, int, int, int]:
    """(name, nonce, slot_bytes, slots, slot) of a server's answer.

    Raises:
        SharedMemoryUnavailable: the answer is malformed.
    """
    try:
        name, nonce_hex, size, slots, index = value.split(";")
        return name, bytes.fromhex(nonce_hex), int(size), int(slots), int(index)
    except ValueError:
        raise SharedMemoryUnavailable(f"malformed {METADATA_KEY} answer {value!r}") from None


def answer_in(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The server's answer in a call's trailing metadata, if it lent a slot."""
    for key, value in metadata or ():
        if key == METADATA_KEY:
            return value.decode() if isinstance(value, bytes) else value
    return None
