"""Same-host payloads through shared memory: a worker's segment per shard (or one for its whole
gradient, windows of it per shard), and a server's view of it.

A worker that shares a host with a shard can put its gradient into, and get the weights out of,
a POSIX shared-memory segment (a file under /dev/shm) instead of streaming them through gRPC: the
calls carry only headers (through gRPC, or a step's Step call over the server's local socket:
wire/local_socket.py) and name the segment in the call metadata (`psgrad-shm: NAME;NONCE;NBYTES;HOST`). The segment starts with a magic string and a random nonce the
server checks, so a name can only ever resolve to the segment that the worker made. Both ends must
be on one host: HOST is the maker's `host_id()` (kernel boot, network namespace and /dev/shm
filesystem), which the server compares with its own before it opens anything, and the server's Join
answer carries its id so a worker on another host never tries. A server on another host (or in
another /dev/shm or network namespace) refuses, whatever its /dev/shm holds; the worker then
moves that shard's payloads through gRPC frames, as without this module. Nothing else changes:
the server treats the segment's bytes exactly as it treats received frames.

The worker unlinks the name once the server has opened it, so a crashed process leaves nothing
behind in /dev/shm; both ends keep their mappings.
"""
from __future__ import annotations

import functools
import hashlib
import mmap
import os
import re
import secrets
import threading
from collections.abc import Iterable

SHM_DIR = "/dev/shm"
METADATA_KEY = "psgrad-shm"
ROWS_METADATA_KEY = "psgrad-rows-shm"  # a Step call's segment for the rows its reply reads (see ps.proto)
REFUSED = "unavailable"  # the server's answer (trailing metadata) when it cannot use the segment
NOT_LENT = "not-lent"  # its answer to a pull naming a window (see Window) when it could not lend the version
SUPPORTED = "supported"  # the server's Join answer (initial metadata): "supported;HOST", it takes segments
_MAGIC = b"psgrad-shm-v1\0\0\0"  # 16 bytes
_NONCE_BYTES = 16
HEADER_BYTES = 64  # magic, nonce, padding: the payload starts 64-byte aligned
_NAME = re.compile(r"^psgrad-([0-9]+)-[0-9a-f]{16}$")  # psgrad-PID-...


class SharedMemoryUnavailable(Exception):
    """The segment named by a call cannot be used here (another host, or a bad name/size)."""


def supported() -> bool:
    """Whether this host has a POSIX shared-memory directory."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


@functools.lru_cache(maxsize=1)
def host_id() -> str:
    """This process's host, as far as shared memory goes: two processes may share a segment only when
    their ids are equal. The kernel's boot id tells machines apart, the network namespace tells
    containers and test-bed hosts apart, and /dev/shm's filesystem tells private mounts apart."""
    parts = []
    for path in ("/proc/sys/kernel/random/boot_id",):
        try:
            with open(path) as f:
                parts.append(f.read().strip())
        except OSError:
            parts.append("")
    for path in ("/proc/self/ns/net", SHM_DIR):
        try:
            st = os.stat(path)
            parts.append(f"{st.st_dev}:{st.st_ino}")
        except OSError:
            parts.append("")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def server_answer() -> str:
    """What a server that takes segments says at Join (initial metadata)."""
    return f"{SUPPORTED};{host_id()}"


def same_host_server(metadata: Iterable[tuple[str, str | bytes]] | None) -> bool:
    """Whether a Join answer's initial metadata says the server takes segments and shares our host."""
    return (METADATA_KEY, server_answer()) in tuple(metadata or ())


class Segment:
    """A worker's segment for one shard's payload (push and pull take turns, see `lock`)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.name = f"psgrad-{os.getpid()}-{secrets.token_hex(8)}"
        self._nonce = secrets.token_bytes(_NONCE_BYTES)
        self._map = create(self.name, HEADER_BYTES + nbytes, _MAGIC + self._nonce, 0o600)
        self.payload = memoryview(self._map)[HEADER_BYTES:]
        self.lock = threading.Lock()  # one transfer at a time uses the segment
        self._linked = True
        self.lent = False  # the caller's buffer (a gradient): close() leaves it mapped

    def metadata(self, key: str = METADATA_KEY) -> tuple[tuple[str, str], ...]:
        return ((key, f"{self.name};{self._nonce.hex()};{self.nbytes};{host_id()}"),)

    @property
    def opened(self) -> bool:
        """A server has used the segment (its name is gone)."""
        return not self._linked

    def unlink(self) -> None:
        """Remove the name (the server has opened it); the memory lives while either end maps it."""
        if self._linked:
            self._linked = False
            remove(self.name)

    def close(self) -> None:
        """Unlink, and unmap unless lent (tensors over a lent payload keep it mapped until they go)."""
        self.unlink()
        if not self.lent:
            unmap(self.payload, self._map)


def sweep(pattern: re.Pattern[str], directory: str = SHM_DIR) -> int:
    """Unlink the files in `directory` whose names match `pattern` (group 1: the maker's pid) and
    whose maker is gone (a process killed outright leaves its names); returns how many."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        m = pattern.match(name)
        if m is None or int(m.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(1)), 0)
            continue  # alive (or not ours to signal): keep it
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            os.unlink(os.path.join(directory, name))
            removed += 1
        except OSError:
            pass
    return removed


class Shared:
    """One segment for a worker's whole flat gradient (its gradient buffer): each same-host shard's
    payloads go through its window (its range of the flat space), so the gradient the caller
    writes there is read in place by every same-host shard's server. The name is unlinked once
    every window's server has opened it (or the window was retired), or at close()."""

    def __init__(self, nbytes: int) -> None:
        # It lives until its servers have opened it: a worker killed before that leaves its name
        # (and so may one killed mid-call with a segment of its own), which the next one removes.
        sweep(_NAME)
        self.nbytes = nbytes
        self.name = f"psgrad-{os.getpid()}-{secrets.token_hex(8)}"
        self.nonce = secrets.token_bytes(_NONCE_BYTES)
        self._map = create(self.name, HEADER_BYTES + nbytes, _MAGIC + self.nonce, 0o600)
        self.payload = memoryview(self._map)[HEADER_BYTES:]  # lent to the caller: mapped while used
        self._lock = threading.Lock()
        self._pending = 0  # windows whose server has not opened the name yet
        self._linked = True

    def window(self, offset: int, nbytes: int) -> Window:
        """The part [offset, offset + nbytes) of the payload, as one shard's segment."""
        if offset < 0 or offset % 4 or offset + nbytes > self.nbytes:
            raise ValueError(f"window [{offset}, {offset + nbytes}) outside the segment's {self.nbytes} bytes")
        with self._lock:
            self._pending += 1
        return Window(self, offset, nbytes)

    def done(self) -> None:
        """A window's server has opened the name, or the window is retired."""
        with self._lock:
            self._pending -= 1
            last = self._pending <= 0
        if last:
            self.close()

    def close(self) -> None:
        """Unlink the name (the memory stays mapped: the caller's gradient buffer)."""
        with self._lock:
            linked, self._linked = self._linked, False
        if linked:
            remove(self.name)


class Window:
    """One shard's segment inside a Shared one: what a Segment offers a shard client (a lock per
    transfer, the call metadata, unlink once the server has it), always lent to the caller."""

    def __init__(self, shared: Shared, offset: int, nbytes: int) -> None:
        self.nbytes = nbytes
        self.name = shared.name
        self.payload = shared.payload[offset : offset + nbytes]
        self.lock = threading.Lock()
        self.lent = True  # the caller's gradient buffer: never unmapped here
        self._shared = shared
        self._offset = offset
        self._open = True  # not yet opened by the server, nor retired

    def metadata(self) -> tuple[tuple[str, str], ...]:
        s = self._shared
        value = f"{s.name};{s.nonce.hex()};{self.nbytes};{host_id()};{self._offset};{s.nbytes}"
        return ((METADATA_KEY, value),)

    @property
    def opened(self) -> bool:
        return not self._open

    def unlink(self) -> None:
        if self._open:
            self._open = False
            self._shared.done()

    def close(self) -> None:
        self.unlink()


# What a shard client's payloads go through: a segment of its own, or its window of a shared one.
AnySegment = Segment | Window


def create(name: str, size: int, header: bytes, mode: int) -> mmap.mmap:
    """Make /dev/shm/NAME (it must not exist) of `size` bytes starting with `header`, mapped."""
    mapped = make_file(os.path.join(SHM_DIR, name), size, mode)
    mapped[: len(header)] = header
    return mapped


def make_file(path: str, size: int, mode: int = 0o600) -> mmap.mmap:
    """Make the file at `path` (it must not exist) of `size` bytes, mapped shared (its pages given
    as first written); unlinked again where it cannot be sized or mapped."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode)
    try:
        os.ftruncate(fd, size)
        mapped = mmap.mmap(fd, size)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return mapped


def remove(name: str) -> None:
    """Unlink /dev/shm/NAME if it is still there."""
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def unmap(view: memoryview, mapped: mmap.mmap) -> None:
    """Release a view of a mapping and close the mapping (unless another view is still alive: it
    then goes with the last one)."""
    view.release()
    try:
        mapped.close()
    except BufferError:
        pass


class Attached:
    """A server's mapping of a worker's segment."""

    def __init__(self, name: str, nbytes: int, payload: memoryview, keep: mmap.mmap, window: bool = False) -> None:
        self.name = name
        # A window of the worker's gradient buffer (its parameters' .grad): read, never written.
        self.window = window
        self.nbytes = nbytes
        self.payload = payload
        self._map = keep


def described_bytes(value: str) -> int:
    """The size a segment's metadata value (see attach) describes.

    Raises:
        SharedMemoryUnavailable: a malformed value.
    """
    try:
        return int(value.split(";")[2])
    except (IndexError, ValueError):
        raise SharedMemoryUnavailable(f"malformed segment metadata {value!r}") from None


def attach(value: str, nbytes: int) -> Attached:
    """Open the segment a call's metadata names (`NAME;NONCE;NBYTES;HOST`, or a window of a shared
    one: `...;OFFSET;TOTAL`), checking its host, name, size and nonce.

    Raises:
        SharedMemoryUnavailable: made on another host, no such segment here, or it is not the one described.
    """
    try:
        name, nonce_hex, size_text, host, *window = value.split(";")
        size = int(size_text)
        nonce = bytes.fromhex(nonce_hex)
        offset, total = (int(window[0]), int(window[1])) if len(window) == 2 else (0, size)
        if window and len(window) != 2:
            raise ValueError(value)
    except ValueError:
        raise SharedMemoryUnavailable(f"malformed {METADATA_KEY} metadata {value!r}") from None
    if host != host_id():
        raise SharedMemoryUnavailable(f"segment {name} was made on another host")
    if not _NAME.match(name) or len(nonce) != _NONCE_BYTES:
        raise SharedMemoryUnavailable(f"not a psgrad segment name: {name!r}")
    if size != nbytes:
        raise SharedMemoryUnavailable(f"segment {name} holds {size} bytes, the payload is {nbytes}")
    if offset < 0 or offset % 4 or offset + size > total:
        raise SharedMemoryUnavailable(f"segment {name}: a window [{offset}, {offset + size}) outside its {total} bytes")
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_NOFOLLOW)
    except OSError as exc:
        raise SharedMemoryUnavailable(f"cannot open segment {name}: {exc.strerror}") from None
    try:
        if os.fstat(fd).st_size != HEADER_BYTES + total:
            raise SharedMemoryUnavailable(f"segment {name} has the wrong size")
        mapped = mmap.mmap(fd, HEADER_BYTES + total)
    finally:
        os.close(fd)
    if mapped[: len(_MAGIC) + _NONCE_BYTES] != _MAGIC + nonce:
        mapped.close()
        raise SharedMemoryUnavailable(f"segment {name} is not the one described")
    start = HEADER_BYTES + offset
    return Attached(name, nbytes, memoryview(mapped)[start : start + nbytes], mapped, window=bool(window))
