"""The processes a benchmark starts, and how it stops them.

- Child: a benchmark child spoken to in JSON, one command per stdin line, one reply per stdout
  line (CommandChild, or command_loop, is the child's side); servers started with start_server are children that
  only announce their address and stop on SIGTERM. stop_all stops and reaps many at once.
- psgrad_server, psgrad_process, psgrad_launch: `python -m psgrad ...` as a user runs it, for the
  benchmarks that measure whole jobs (a fault, a training run).
- lib_argv: the command line of a child that runs a function of lib (its servers and agents).

Every child is a psgrad SupervisedProcess: its output is read on a thread, and it is always reaped.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from lib.procfs import cpu_seconds
from lib.report import log

from psgrad.launch.supervisor import LineNotSeen, SupervisedProcess
from psgrad.launch.template import Template

BENCH = Path(__file__).resolve().parents[1]
REPO = BENCH.parent
# Benchmark children get one OpenMP thread unless asked otherwise: many processes share 2 cores,
# and spinning OpenMP threads would slow the measured ones (psgrad and the baselines alike).
# `psgrad launch` makes the same choice on 2 cores.
ONE_THREAD_ENV = {"OMP_NUM_THREADS": "1"}
# How long a child may take to start and set up (it imports torch and gRPC, on a loaded 2-core machine).
SETUP_TIMEOUT_S = 180.0
# A shard server on loopback, port 0, with a lease no measurement outlives.
PSGRAD_SERVER = ["-m", "psgrad", "server", "--host", "127.0.0.1", "--port", "0", "--lease-s", "600"]


class BenchError(RuntimeError):
    """A benchmark child failed, hung or answered nonsense."""


def lib_argv(entry: str, *args: str) -> list[str]:
    """The arguments after `python` that run lib's `MODULE:FUNCTION` (say "raw_grpc:main") in a child,
    with args as its command line, benchmarks/ on its path whatever its working directory."""
    module, _, function = entry.partition(":")
    code = f"import sys; sys.path.insert(0, {str(BENCH)!r}); from lib.{module} import {function}; {function}()"
    return ["-c", code, *args]


# The raw gRPC ceiling's server (lib/raw_grpc.py), on loopback, port 0.
RAW_SERVER = lib_argv("raw_grpc:main")


# ---------------------------------------------------------------------------------------------
# Children spoken to in JSON


class Child:
    """A benchmark child: psgrad's SupervisedProcess, spoken to in JSON, failing with BenchError.

    Commands are JSON objects, one per stdin line; replies are the child's stdout lines that start
    with "{" (anything else a library prints is kept but skipped). stderr goes to a temporary file
    for error reports.
    """

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None, speaks: bool = True,
                 one_thread: bool = True, template: Template | None = None) -> None:
        """template: fork the child from this one (a test bed host's: NetBed.templates), not the
        preloaded template of this process's environment."""
        self.name = name
        self.speaks = speaks  # True: stopped with a quit command; False (servers): with SIGTERM
        self._address: str | None = None
        self.proc = SupervisedProcess(
            argv, name=f"bench-{name}", cwd=REPO, stdin_pipe=True, stderr_file=True, new_session=False,
            env={**os.environ, **(ONE_THREAD_ENV if one_thread else {}), **(env or {})}, preload=True,
            template=template,
        )
        self.popen = self.proc.popen

    def stderr_text(self) -> str:
        """Everything the child wrote to stderr so far."""
        return self.proc.stderr_text()

    def stderr_tail(self, nchars: int = 2000) -> str:
        return self.stderr_text()[-nchars:]

    def _fail(self, what: str) -> BenchError:
        rc = self.popen.poll()
        state = "is still running" if rc is None else f"exited with code {rc}"
        return BenchError(f"{self.name} {what}; it {state}. Its stderr ends with:\n{self.stderr_tail()}")

    def wait_line(self, marker: str, timeout_s: float, at_start: bool = False) -> str:
        """The first stdout line containing marker, or starting with it when at_start (raises if the
        child exits or time runs out)."""
        try:
            return self.proc.wait_for_line(marker, timeout_s, at_start)
        except LineNotSeen as exc:
            raise self._fail(exc.what) from None

    def address(self, marker: str = "listening on", timeout_s: float = 60.0) -> str:
        """HOST:PORT from the child's 'listening on HOST:PORT' line (read once, then remembered)."""
        if self._address is None:
            self._address = self.wait_line(marker, timeout_s).rsplit(" ", 1)[1].strip()
        return self._address

    def send(self, command: dict[str, Any]) -> None:
        try:
            self.proc.write_line(json.dumps(command))
        except (BrokenPipeError, OSError):
            raise self._fail(f"could not be sent {command.get('op')!r}") from None

    def recv(self, timeout_s: float) -> dict[str, Any]:
        """The next JSON reply; a reply carrying "error" is raised as BenchError."""
        reply: dict[str, Any] = json.loads(self.wait_line("{", timeout_s, at_start=True))
        if "error" in reply:
            raise BenchError(f"{self.name}: {reply['error']}")
        return reply

    def call(self, command: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        self.send(command)
        return self.recv(timeout_s)

    def pause(self) -> None:
        """SIGSTOP: the process uses no CPU until resume() (keeps idle processes out of a measurement)."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGCONT)

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the process has used so far."""
        return cpu_seconds(self.popen.pid)

    def request_stop(self) -> None:
        """Ask the child to end: a quit command if it speaks the protocol, else SIGTERM."""
        if self.popen.poll() is not None:
            return
        if self.speaks:
            try:
                self.send({"op": "quit"})
                return
            except BenchError:
                pass
        self.proc.terminate()

    def stop(self, timeout_s: float = 15.0) -> None:
        """request_stop, then SIGTERM, then SIGKILL, each after timeout_s; always reaps the process."""
        self.resume()
        self.request_stop()
        try:
            self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log(f"{self.name} did not stop within {timeout_s:g} s; terminating it")
        self.proc.stop(grace_s=timeout_s)


def stop_all(children: Iterable[Child], timeout_s: float = 15.0) -> None:
    """Stop every child; all are asked first, so peers that wait on each other (rpc) can end together."""
    kids = list(children)
    t0 = time.monotonic()
    for c in kids:
        c.resume()
        c.request_stop()
    took: dict[str, float] = {}
    for c in kids:
        try:
            c.stop(timeout_s)
        except Exception as exc:  # keep reaping the others
            log(f"stopping {c.name}: {exc!r}")
        took[c.name] = time.monotonic() - t0
    if kids and max(took.values()) > 3:
        slow = ", ".join(f"{name} {t:.1f} s" for name, t in took.items() if t > 1)
        log(f"stopping {len(kids)} processes took {max(took.values()):.1f} s ({slow})")


@contextlib.contextmanager
def paused(children: Iterable[Child]) -> Iterator[None]:
    """SIGSTOP the given children for the duration of the block, then SIGCONT them."""
    kids = list(children)
    for c in kids:
        c.pause()
    try:
        yield
    finally:
        for c in kids:
            c.resume()


def start_server(name: str, argv: Sequence[str], one_thread: bool = True) -> Child:
    """Start `python ARGV` as a server (read its address later with Child.address; stopped by SIGTERM)."""
    return Child(name, [sys.executable, *argv], speaks=False, one_thread=one_thread)


def run_together(children: Sequence[Child], commands: Sequence[dict[str, Any]], timeout_s: float) -> list[dict[str, Any]]:
    """Start barrier: every child prepares its command and says ready; only then do all get 'go'.

    Returns the replies in order. Children measure with time.monotonic(), which is one clock for
    all processes on a Linux host, so their windows can be compared.
    """
    for child, cmd in zip(children, commands, strict=True):
        child.send({**cmd, "barrier": True})
    for child in children:
        child.recv(timeout_s)
    for child in children:
        child.send({"op": "go"})
    return [child.recv(timeout_s) for child in children]


def command_loop(handle: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Child side of Child: answer each JSON command on stdin with one JSON line on stdout.

    A command with "barrier" first answers {"ready": true} and waits for the parent's "go" line.
    Exceptions become {"error": ...} replies; "quit" (or end of stdin) ends the loop.
    """

    def reply(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd.get("op") == "quit":
            return
        try:
            if cmd.pop("barrier", False):
                reply({"ready": True})
                go = sys.stdin.readline()
                if not go:
                    return
            reply(handle(cmd))
        except Exception as exc:
            reply({"error": f"{type(exc).__name__}: {exc}"})


class CommandChild:
    """The child's side of Child, as an object: handle() answers one command; what it opened goes
    into closers, closed last first when the loop ends (quit, or the end of stdin)."""

    def __init__(self) -> None:
        self.closers: list[Callable[[], object]] = []

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        for close in reversed(self.closers):
            close()

    def serve(self) -> None:
        """Answer the parent's commands until it says quit, then close."""
        try:
            command_loop(self.handle)
        finally:
            self.close()


def exit_now(code: int = 0) -> None:
    """End a child whose resources are already released, skipping interpreter teardown (which
    takes about 2 s with torch and grpc loaded, for nothing)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---------------------------------------------------------------------------------------------
# psgrad's own commands, as a user runs them


def psgrad_process(name: str, *args: str, env: Mapping[str, str] | None = None) -> SupervisedProcess:
    """`python -m psgrad ARGS` (stdout and stderr merged, read line by line); env adds to this
    process's environment."""
    return SupervisedProcess([sys.executable, "-m", "psgrad", *args], name=name, new_session=False,
                             env=None if env is None else {**os.environ, **env}, preload=True)


def psgrad_server(name: str, *args: str, env: Mapping[str, str] | None = None,
                  timeout_s: float = 60.0) -> tuple[SupervisedProcess, str]:
    """`psgrad server ARGS`, once it listens: the process and its HOST:PORT."""
    proc = psgrad_process(name, "server", *args, env=env)
    try:
        return proc, proc.wait_for_line("psgrad server listening on ", timeout_s=timeout_s).rsplit(" ", 1)[1]
    except BaseException:
        proc.stop()
        raise


def psgrad_launch(args: Sequence[str], timeout_s: float) -> float:
    """Run `psgrad launch ARGS` to completion (started as psgrad_process starts its commands: a fork of
    the preloaded template, which the launch's servers and workers are forks of too); its wall time in
    seconds. Raises RuntimeError, with the end of its output, if it fails (subprocess.TimeoutExpired,
    the launch stopped, after timeout_s)."""
    argv = [sys.executable, "-m", "psgrad", "launch", *args]
    t0 = time.perf_counter()
    proc = SupervisedProcess(argv, name="psgrad-launch", new_session=False, stderr_file=True, preload=True)
    try:
        rc = proc.wait(timeout_s)
        if rc != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({rc}):\n{proc.output[-3000:]}\n{proc.stderr_text()[-3000:]}")
        return time.perf_counter() - t0
    finally:
        proc.stop()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file (a worker's --metrics-out)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
