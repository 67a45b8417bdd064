"""`psgrad launch` on one machine: servers, then workers, as supervised children with prefixed output; all reaped."""
from __future__ import annotations

import queue
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence

from psgrad.launch.supervisor import PRINT_LOCK, CtrlC, SupervisedProcess, print_line

LISTEN_RE = re.compile(r"psgrad server listening on (\S+)")
# The launcher's main thread waits for its children's events at most this long at a time.
WAKE_S = 0.5
# What the children report to run_launch: ("listening", name, address) or ("exit", name, code).
Events = queue.Queue[tuple[str, str, object]]


class LaunchError(Exception):
    """A child failed to start or exited with an error."""


def _python_psgrad(*args: str) -> list[str]:
    return [sys.executable, "-m", "psgrad", *args]


def _start(
    name: str, argv: Sequence[str], env: dict[str, str] | None, out: Callable[[str], None], events: Events
) -> SupervisedProcess:
    """Start one child: each line it prints goes to out prefixed with [name]; its address and exit to events."""

    def on_line(line: str) -> None:
        out(f"[{name}] {line}")
        m = LISTEN_RE.search(line)
        if m:
            events.put(("listening", name, m.group(1)))

    return SupervisedProcess(
        argv, name=name, env=env, collect=False, on_line=on_line,
        on_start=lambda popen: out(f"[launch] started {name} (pid {popen.pid})"),
        on_exit=lambda code: events.put(("exit", name, code)),
        preload=True,  # forks of one process that imported torch once (template.py), not N cold starts
    )


def _without_checkpoints(argv: Sequence[str]) -> list[str]:
    """A server's flags without its --checkpoint-dir: a backup takes its state from its primary
    (only primaries write checkpoints)."""
    out = list(argv)
    if "--checkpoint-dir" in out:
        i = out.index("--checkpoint-dir")
        del out[i : i + 2]
    return out


def _await_servers(
    events: Events, names: Sequence[str], timeout_s: float, check: Callable[[], None] = lambda: None,
) -> dict[str, str]:
    """name -> address of each server, as they report listening; check() runs at least every WAKE_S."""
    addresses: dict[str, str] = {}
    deadline = time.monotonic() + timeout_s
    while len(addresses) < len(names):
        check()
        try:
            kind, name, value = events.get(timeout=max(0.0, min(WAKE_S, deadline - time.monotonic())))
        except queue.Empty:
            if time.monotonic() < deadline:
                continue
            missing = ", ".join(n for n in names if n not in addresses)
            raise LaunchError(f"{missing} did not report a listening address within {timeout_s:g} s") from None
        if kind == "listening":
            addresses[name] = str(value)
        elif kind == "exit":
            raise LaunchError(f"{name} exited with code {value} before listening")
    return addresses


def run_launch(
    num_servers: int,
    num_workers: int,
    server_args: Sequence[str] | Callable[[int], Sequence[str]],
    worker_args: Callable[[int, str], list[str]],
    status: Callable[[list[str]], None] | None = None,
    out: Callable[[str], None] | None = None,
    start_timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
    worker_command: str = "worker",
    replicas: int = 0,
) -> int:
    """Start servers, then workers; wait for the workers; stop everything. Returns an exit code.

    server_args: every server's flags after `psgrad server --host 127.0.0.1 --port 0`, or a function
    of the server's index giving them (the backup of server i, with replicas, is index num_servers + i). worker_args(rank, servers) gives each worker's argv after
    `psgrad WORKER_COMMAND` (servers is
    "" when num_servers is 0, e.g. for the all-reduce baseline). If a worker fails,
    or a server exits early, every other child is stopped and 1 is returned. Ctrl-C / SIGTERM stop
    all children too (exit code 130 / 143). env: the children's environment (default: ours).
    replicas=1 starts a hot-standby backup per server (`--replica-of` it, once it listens);
    the workers' servers are then "PRIMARY|BACKUP" per shard.
    """
    log = out if out is not None else print_line
    children: list[SupervisedProcess] = []
    events: Events = queue.Queue()
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_term)
    ctrl_c = CtrlC().__enter__()  # a Ctrl-C swallowed while a child starts (an at-fork hook) is raised again
    try:
        server_names = [f"server{i}" for i in range(num_servers)]
        for i, name in enumerate(server_names):
            own = server_args(i) if callable(server_args) else server_args
            argv = _python_psgrad("server", "--host", "127.0.0.1", "--port", "0", *own)
            children.append(_start(name, argv, env, log, events))
        addresses = _await_servers(events, server_names, start_timeout_s, ctrl_c.check)
        if replicas:
            for i, name in enumerate(server_names):
                own = _without_checkpoints(server_args(num_servers + i) if callable(server_args) else server_args)
                argv = _python_psgrad("server", "--host", "127.0.0.1", "--port", "0", *own,
                                      "--replica-of", addresses[name])
                children.append(_start(f"{name}-backup", argv, env, log, events))
            backups = _await_servers(events, [f"{n}-backup" for n in server_names], start_timeout_s, ctrl_c.check)
            addresses = {n: f"{addresses[n]}|{backups[n + '-backup']}" for n in server_names}
        servers = ",".join(addresses[n] for n in server_names)
        if num_servers:
            log(f"[launch] {num_servers} server(s) up: {servers}; starting {num_workers} worker(s)")
        worker_names = [f"worker{r}" for r in range(num_workers)]
        for rank, name in enumerate(worker_names):
            children.append(_start(name, _python_psgrad(worker_command, *worker_args(rank, servers)), env, log, events))
        running = set(worker_names)
        failed: list[str] = []
        while running:
            ctrl_c.check()
            try:  # in slices: Python runs the Ctrl-C handler in this thread, and a signal that another
                kind, name, value = events.get(timeout=WAKE_S)  # thread received wakes no wait
            except queue.Empty:
                continue
            if kind != "exit":
                continue
            if name in running:
                running.discard(name)
                if value != 0:
                    failed.append(f"{name} (exit code {value})")
                    break
            elif replicas:  # the shard's other server serves on; workers fail if neither does
                log(f"[launch] {name} exited (exit code {value}); its shard's other server serves on")
            else:
                failed.append(f"{name} exited unexpectedly (exit code {value})")
                break
        if failed:
            log(f"[launch] failed: {', '.join(failed)}; stopping the others")
            return 1
        if status is not None and num_servers:
            with PRINT_LOCK:  # its lines together, not split by a child's
                status(servers.split(","))  # a PRIMARY|BACKUP entry shows both servers
        log(f"[launch] all {num_workers} worker(s) finished")
        return 0
    except LaunchError as exc:
        log(f"[launch] error: {exc}")
        return 1
    except KeyboardInterrupt:
        log("[launch] interrupted; stopping all processes")
        return 130
    finally:
        for child in children:  # SIGTERM them all first, then give each 5 s before SIGKILL
            child.terminate()
        for child in children:
            child.stop(grace_s=5.0)
        ctrl_c.__exit__()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)
