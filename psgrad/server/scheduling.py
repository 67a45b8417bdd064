"""How a server's request threads share the CPU with the processes of their host.

A worker's step wakes each shard in turn: it writes its push to one server's socket, then the next
one's, then waits for the replies. Under Linux's default policy a thread woken by a message may
take the CPU from the task that woke it at once (wake-up preemption): on a host whose cores the
workers and servers share, the first server then runs its half of the step before the worker has
written to the second, which gets its push a millisecond or more late, and a sync iteration waits
for the last shard. Under SCHED_BATCH a woken thread does not preempt: it runs on an idle core, or
when the task on its core waits (the worker, for its replies: a moment later) or uses up its time
slice. On a host of its own a server finds idle cores and is woken as soon as before; the policy
keeps the threads' nice value, and costs no privilege (any thread may take it).

Where the workers are bound to cores of their own (psgrad.bind_cores), a same-host worker's
connection is served by a thread on that worker's cores (PeerCores): the server's work for a call
is done while the worker waits for its reply, so its cores are free then, whereas a thread left to
the kernel is woken where the wake-up puts it, often behind the other worker's compute while
another core idles (on a 2-vCPU VM a core sat idle 22 % of a DLRM job's time while a task waited
on the other). A worker on every core leaves the thread on every core.
"""
from __future__ import annotations

import os
import socket
import struct


def batch_thread(enabled: bool = True) -> bool:
    """Put the calling thread under SCHED_BATCH (where enabled and the platform has it: Linux);
    threads it starts inherit the policy. Returns whether it put the thread under it."""
    if not enabled or not hasattr(os, "sched_setscheduler") or not hasattr(os, "SCHED_BATCH"):
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # (0: this thread, on Linux)
    except OSError:  # (a sandbox that forbids it: the default policy stands)
        return False
    return True


class PeerCores:
    """Keeps the calling thread on the cores of the process at the other end of a Unix socket (its
    worker: its main thread's cores), within the cores the thread had to begin with (a server bound
    to cores of its own stays on them: where it shares none with the worker, nothing moves):
    `follow()`, before each call the connection serves, reads the worker's cores (one system call)
    and moves the thread where they changed. A no-op where the socket is not a Unix one, the
    platform has no CPU affinity, or `enabled` is False."""

    def __init__(self, conn: socket.socket, enabled: bool = True) -> None:
        self._pid = 0
        if enabled and hasattr(os, "sched_setaffinity") and conn.family == socket.AF_UNIX \
                and hasattr(socket, "SO_PEERCRED"):
            try:
                self._pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
                self._home = self._cores = os.sched_getaffinity(0)
                self._seen: set[int] = set()
            except OSError:
                self._pid = 0

    def follow(self) -> None:
        if not self._pid:
            return
        try:
            seen = os.sched_getaffinity(self._pid)
            if seen != self._seen:
                self._seen = seen
                cores = (seen & self._home) or self._home
                if cores != self._cores:
                    os.sched_setaffinity(0, cores)
                    self._cores = cores
        except OSError:  # the worker is gone (its connection ends next), or a sandbox forbids it
            self._pid = 0
