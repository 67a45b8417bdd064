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
"""
from __future__ import annotations

import os


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
