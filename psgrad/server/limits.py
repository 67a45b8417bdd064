"""A server's file descriptors against connections that hold them: the soft RLIMIT_NOFILE raised to
the hard limit at start (a default soft limit of 1024 ran out at about a thousand idle TCP
connections), gRPC's options that bound what connections hold (a cap below the limit, a deadline
for the handshake of a connection that sends nothing, idle connections closed), and a watch that
says, naming the cause, when descriptors run short."""
from __future__ import annotations

import logging
import os
import resource
import threading
from collections.abc import Callable

_log = logging.getLogger("psgrad.server")

# A connection that completed its handshake and has no call open for this long is closed (GOAWAY:
# a client of the job reconnects by itself at its next call; a worker's heartbeats keep its own open).
IDLE_CONNECTION_MS = 60_000
WATCH_S = 1.0  # how often the watch counts the open descriptors
MAX_SOFT = 1 << 20  # where the hard limit is unlimited


def raise_fd_limit() -> tuple[int, int]:
    """Raise this process's soft limit of open files to its hard limit; returns (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = MAX_SOFT if hard == resource.RLIM_INFINITY else hard
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):  # (a container's nr_open below the hard limit)
        return soft, soft
    return soft, target


def connection_cap(fd_limit: int) -> int:
    """How many connections the server takes at once: its descriptor limit, less what its threads,
    files and shared-memory segments need (an eighth of it, 64 to 1024)."""
    return max(16, fd_limit - min(1024, max(64, fd_limit // 8)))


def connection_options(fd_limit: int, handshake_timeout_s: float) -> list[tuple[str, int]]:
    """gRPC server arguments: connections past connection_cap(fd_limit) are closed as they come
    (so that accepting never runs out of descriptors: gRPC then stops accepting anyone, for as long
    as it takes the silent ones to time out), a connection must complete its handshake within
    handshake_timeout_s (gRPC's default: 120 s), and one without calls is closed after a minute."""
    return [
        ("grpc.max_allowed_incoming_connections", connection_cap(fd_limit)),
        ("grpc.server_handshake_timeout_ms", int(handshake_timeout_s * 1000)),
        ("grpc.max_connection_idle_ms", IDLE_CONNECTION_MS),
    ]


def _open_fds() -> list[str] | None:
    try:
        return os.listdir("/proc/self/fd")
    except OSError:  # not Linux
        return None


def count_sockets(fds: list[str], pid: int | str = "self") -> int:
    """How many of a process's open descriptors `fds` (names in /proc/PID/fd) are sockets."""
    count = 0
    for fd in fds:
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return count


class FdWatch:
    """Logs once when open descriptors pass 80 % of the limit or the connections reach the cap, naming
    the cause (how many are sockets, the cap, the handshake deadline), and once when they are back
    under 60 %."""

    def __init__(self, fd_limit: int, cap: int, handshake_timeout_s: float,
                 warn: Callable[[str], None] = _log.warning, note: Callable[[str], None] = _log.info) -> None:
        self.fd_limit, self.cap, self.handshake_timeout_s = fd_limit, cap, handshake_timeout_s
        self._warn, self._note = warn, note
        self._stop = threading.Event()
        self.short = False  # warned, and not back under 60 % since
        self._thread = threading.Thread(target=self._loop, name="psgrad-fd-watch", daemon=True)

    def start(self) -> None:
        if _open_fds() is not None:
            self._thread.start()

    def check(self) -> None:
        fds = _open_fds()
        if fds is None:
            return
        used = len(fds)
        if not self.short and used >= 0.6 * self.fd_limit:
            sockets = count_sockets(fds)
            if used >= 0.8 * self.fd_limit or sockets >= self.cap:
                self.short = True
                self._warn(
                    f"file descriptors are running short: {used} of {self.fd_limit} open (RLIMIT_NOFILE), {sockets} "
                    f"of them sockets; the server takes at most {self.cap} connections at once and closes new ones "
                    f"past that, so a client may not get in. Many connections that send nothing (idle or half-open "
                    f"clients, a port scan, a flood) hold them until their handshake deadline "
                    f"(--handshake-timeout-s {self.handshake_timeout_s:g}); raise the hard limit (ulimit -Hn) if "
                    "the job needs more")
        elif self.short and used < 0.6 * self.fd_limit:
            self.short = False
            self._note(f"file descriptors are back to {used} of {self.fd_limit} open")

    def _loop(self) -> None:
        while not self._stop.wait(WATCH_S):
            self.check()

    def stop(self) -> None:
        self._stop.set()
