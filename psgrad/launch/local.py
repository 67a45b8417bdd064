"""`psgrad launch`: one-box supervisor that starts servers and workers as subprocesses and reaps them."""
from __future__ import annotations

import ctypes
import os
import queue
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

LISTEN_RE = re.compile(r"psgrad server listening on (\S+)")
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Ask Linux to SIGTERM this child if the launcher dies, so nothing is left behind."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[str]
    reader: threading.Thread


@dataclass
class Supervisor:
    """Starts children with prefixed output; reports exits on one queue; always reaps them."""

    out: Callable[[str], None] = field(default=lambda line: print(line, flush=True))
    children: list[Child] = field(default_factory=list)
    events: queue.Queue[tuple[str, str, object]] = field(default_factory=queue.Queue)

    def start(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> Child:
        child_env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
        proc = subprocess.Popen(
            list(argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            env=child_env,
            start_new_session=True,  # Ctrl-C reaches the launcher only; it stops children in order
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        reader = threading.Thread(target=self._pump, args=(name, proc), daemon=True)
        child = Child(name, proc, reader)
        self.children.append(child)
        self.out(f"[launch] started {name} (pid {proc.pid})")
        reader.start()
        return child

    def _pump(self, name: str, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            self.out(f"[{name}] {line}")
            m = LISTEN_RE.search(line)
            if m:
                self.events.put(("listening", name, m.group(1)))
        self.events.put(("exit", name, proc.wait()))

    def stop(self, names: Sequence[str] | None = None, grace_s: float = 5.0) -> None:
        """SIGTERM the named (default: all) children still running, SIGKILL after grace_s; reap all."""
        chosen = [c for c in self.children if names is None or c.name in names]
        for c in chosen:
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        for c in chosen:
            try:
                c.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
            c.reader.join(timeout=grace_s)


class LaunchError(Exception):
    """A child failed to start or exited with an error."""


def _python_psgrad(*args: str) -> list[str]:
    return [sys.executable, "-m", "psgrad", *args]


def _await_servers(sup: Supervisor, names: Sequence[str], timeout_s: float) -> dict[str, str]:
    addresses: dict[str, str] = {}
    while len(addresses) < len(names):
        try:
            kind, name, value = sup.events.get(timeout=timeout_s)
        except queue.Empty:
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
    server_args: Sequence[str],
    worker_args: Callable[[int, str], list[str]],
    status: Callable[[list[str]], None] | None = None,
    out: Callable[[str], None] | None = None,
    start_timeout_s: float = 60.0,
    env: dict[str, str] | None = None,
    worker_command: str = "worker",
) -> int:
    """Start servers, then workers; wait for the workers; stop everything. Returns an exit code.

    worker_args(rank, servers) gives each worker's argv after `psgrad WORKER_COMMAND` (servers is
    "" when num_servers is 0, e.g. for the all-reduce baseline). If a worker fails,
    or a server exits early, every other child is stopped and 1 is returned. Ctrl-C / SIGTERM stop
    all children too (exit code 130 / 143). env: the children's environment (default: ours).
    """
    sup = Supervisor() if out is None else Supervisor(out=out)
    log = sup.out
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_term)
    try:
        server_names = [f"server{i}" for i in range(num_servers)]
        for name in server_names:
            sup.start(name, _python_psgrad("server", "--host", "127.0.0.1", "--port", "0", *server_args), env)
        addresses = _await_servers(sup, server_names, start_timeout_s)
        servers = ",".join(addresses[n] for n in server_names)
        if num_servers:
            log(f"[launch] {num_servers} server(s) up: {servers}; starting {num_workers} worker(s)")
        worker_names = [f"worker{r}" for r in range(num_workers)]
        for rank, name in enumerate(worker_names):
            sup.start(name, _python_psgrad(worker_command, *worker_args(rank, servers)), env)
        running = set(worker_names)
        failed: list[str] = []
        while running:
            kind, name, value = sup.events.get()
            if kind != "exit":
                continue
            if name in running:
                running.discard(name)
                if value != 0:
                    failed.append(f"{name} (exit code {value})")
                    break
            else:
                failed.append(f"{name} exited unexpectedly (exit code {value})")
                break
        if failed:
            log(f"[launch] failed: {', '.join(failed)}; stopping the others")
            return 1
        if status is not None and num_servers:
            status(servers.split(","))
        log(f"[launch] all {num_workers} worker(s) finished")
        return 0
    except LaunchError as exc:
        log(f"[launch] error: {exc}")
        return 1
    except KeyboardInterrupt:
        log("[launch] interrupted; stopping all processes")
        return 130
    finally:
        sup.stop()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)
