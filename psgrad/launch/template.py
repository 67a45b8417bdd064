"""Preloaded children: one process that has imported torch, gRPC and psgrad forks each local psgrad child.

A psgrad process spends most of its start-up importing torch (about 3.5 CPU-seconds on a 2-vCPU
machine, more than a short job's training). A launcher that starts N servers and workers on one host
pays that N times. Instead its first child starts a *template*: `python -m psgrad.launch.template`
imports what every psgrad command imports, then waits. Each child is a fork of it, which takes
milliseconds and shares the imported modules' memory copy-on-write; the child then runs
`python -m psgrad ARGS` (or a Python script: a benchmark) as a fresh interpreter would (its own
environment, working directory, stdin, stdout and stderr, session, process group and signal
dispositions, exit code and exit handlers). A child's own children are forks of the same template
(it keeps a connection to it), and when an asker ends, the children it asked for get SIGTERM.

The template never starts a thread of its own, a gRPC channel or a CUDA context, so a fork of it is
as safe as a fork before any work. What an interpreter reads only as it starts (PYTHON*, LD_*, OpenMP
and BLAS thread settings) is part of the template's identity: a child whose environment differs
there gets a template of its own (OMP_NUM_THREADS excepted: each child sets its torch threads), and
one whose first sys.path entry holds another psgrad package is started the plain way (`subprocess`). So is every child where Linux lacks pidfds, or where
PSGRAD_PRELOAD=0.

Protocol (a SOCK_SEQPACKET socket pair; JSON messages): the parent sends {"argv", "env", "cwd",
"new_session"} with the child's stdin, stdout and stderr descriptors attached (SCM_RIGHTS); the
template answers {"pid"} (or {"error"}), and later {"exited": pid, "rc": code} once it has reaped it.
When the parent goes away (the socket's end, or SIGTERM from the parent-death signal) the template
exits and its children get SIGTERM, as the parent's own children do.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import gc
import io
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import IO

_PR_SET_PDEATHSIG = 1
_MAX_MESSAGE = 1 << 20

# What the template imports: every psgrad command's heavy part (the server, the worker and the CLI).
PRELOAD = ("torch", "grpc", "numpy", "psgrad.cli.main", "psgrad.server.runtime", "psgrad.worker.loop", "psgrad.api")

# Environment read only while an interpreter (or a library it loads at import) starts.
_STARTUP_PREFIXES = ("PYTHON", "LD_", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "MALLOC_", "GRPC_")
# Honoured by each child itself: its stdout's buffering, and its torch threads (torch.set_num_threads,
# which sets OpenMP's and MKL's, as reading the variable at start-up would).
_RUNTIME_ONLY = frozenset({"PYTHONUNBUFFERED", "OMP_NUM_THREADS"})


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    """The garbage collector off for a process's start-up imports (torch, gRPC, psgrad's server or
    worker), then as it was. Those imports make ~180,000 objects, nearly all kept for good, and the
    collections they trigger on the way (three full ones among them) walk them all to free some
    7,000 (cycles, which a later collection frees as well): 0.3-0.6 s of a cold `psgrad server`'s
    3.3 s to listening on a 2-core VM. The template's preload, and the commands that serve, train
    or fetch weights, import under it."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _startup_env(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items()
                        if k.startswith(_STARTUP_PREFIXES) and k not in _RUNTIME_ONLY))


def _send(sock: socket.socket, message: dict[str, object], fds: Sequence[int] = ()) -> None:
    socket.send_fds(sock, [json.dumps(message).encode()], list(fds))


def _receive(sock: socket.socket) -> tuple[dict[str, object] | None, list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MESSAGE, 3)
    return (json.loads(data) if data else None), fds


# ---------------------------------------------------------------------------------------------- parent side
@functools.cache
def die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn that asks Linux to SIGTERM the child when its parent dies (None elsewhere).

    prctl is looked up here, in the parent: between fork and exec the child must not dlopen.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:  # pragma: no cover - runs in the child between fork and exec
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)

    return preexec


class TemplateChild:
    """A child forked by a template, with the part of subprocess.Popen's interface psgrad uses."""

    def __init__(self, template: Template, stdin: IO[str] | None, stdout: IO[str]) -> None:
        self.pid = 0  # (set by Template.spawn)
        self.stdin = stdin
        self.stdout = stdout
        self.returncode: int | None = None
        self._template = template
        self._done = threading.Event()

    def _exited(self, rc: int) -> None:
        self.returncode = rc
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code (subprocess.TimeoutExpired after timeout seconds)."""
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:  # (reaped children are reported before their pid can be reused)
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Template:
    """The parent's handle on one template process (started by `Template.start`)."""

    def __init__(self, proc: subprocess.Popen[bytes] | None, sock: socket.socket) -> None:
        self.proc = proc  # None: the connection a template gave this process, itself one of its children
        self._sock = sock
        self._lock = threading.Lock()  # one request at a time; its answer is the next "pid" message
        self._answers: list[dict[str, object]] = []
        self._answered = threading.Condition()
        self._children: dict[int, TemplateChild] = {}
        self._starting: TemplateChild | None = None  # the child of the request in flight (under _lock)
        self.alive = True
        self._reader = threading.Thread(target=self._read, name="psgrad-template-reader", daemon=True)
        self._reader.start()

    @classmethod
    def start(cls, env: Mapping[str, str],
              wrap: Callable[[list[str]], Sequence[str]] | None = None) -> Template:
        """Start a template with this environment and wait until it has imported everything. wrap, if
        given, turns the template's command line into the one that runs it (one that ends by exec'ing
        it, such as `ip netns exec NS ...`: its children then run where it runs). Such a template is
        this caller's own (SupervisedProcess(template=...)); template_for never hands it out.

        Raises:
            OSError: it could not start, or ended before it was ready.
        """
        return cls.start_all(env, [wrap])[0]

    @classmethod
    def start_all(cls, env: Mapping[str, str],
                  wraps: Sequence[Callable[[list[str]], Sequence[str]] | None]) -> list[Template]:
        """Start one template per wrap (as start does) at once, and wait until all are ready: they
        import in parallel. All or none: where one fails, those started are ended.

        Raises:
            OSError: one could not start, or ended before it was ready.
        """
        started: list[tuple[subprocess.Popen[bytes], socket.socket]] = []
        try:
            for wrap in wraps:
                ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                argv = [sys.executable, "-m", "psgrad.launch.template", str(theirs.fileno())]
                try:
                    proc = subprocess.Popen(
                        list(wrap(argv)) if wrap is not None else argv,
                        stdin=subprocess.DEVNULL, env=dict(env), pass_fds=(theirs.fileno(),),
                        preexec_fn=die_with_parent(),
                    )
                except BaseException:
                    ours.close()
                    raise
                finally:
                    theirs.close()
                started.append((proc, ours))
            for proc, ours in started:
                ready, _fds = _receive(ours)
                if not ready or "ready" not in ready:
                    ours.close()
                    proc.wait()
                    raise OSError(f"the template process ended before it was ready (exit code {proc.returncode})")
        except BaseException:
            for proc, ours in started:
                ours.close()  # (a template whose parent's connection ends exits)
                proc.wait()
            raise
        return [cls(proc, ours) for proc, ours in started]

    def _read(self) -> None:
        while True:
            try:
                message, _fds = _receive(self._sock)
            except OSError:
                message = None
            if message is None:
                break
            if "exited" in message:
                pid, rc = int(message["exited"]), int(message["rc"])  # type: ignore[call-overload]
                with self._answered:
                    child = self._children.pop(pid, None)
                if child is not None:
                    child._exited(rc)
            else:  # the answer to the request in flight: its child is registered before its exit can come
                with self._answered:
                    if "pid" in message and self._starting is not None:
                        self._starting.pid = int(message["pid"])  # type: ignore[call-overload]
                        self._children[self._starting.pid] = self._starting
                    self._answers.append(message)
                    self._answered.notify_all()
        with self._answered:  # the template is gone, and with it every child (their parent-death signal)
            self.alive = False
            orphans, self._children = self._children, {}
            self._answered.notify_all()
        for child in orphans.values():
            child._exited(-signal.SIGTERM)

    def spawn(self, args: Sequence[str], env: Mapping[str, str], cwd: str, new_session: bool,
              fds: tuple[int, int, int], child: TemplateChild) -> None:
        """Fork a child that runs `python ARGS` (preloadable's) with these stdin, stdout and stderr
        descriptors, as `child` (its pid set; its exit delivered to it).

        Raises:
            OSError: the template is gone, or could not fork.
        """
        with self._lock:
            if not self.alive:
                raise OSError("the template process has ended")
            self._starting = child
            try:
                _send(self._sock, {"argv": list(args), "env": dict(env), "cwd": cwd, "new_session": new_session},
                      list(fds))
                with self._answered:
                    while not self._answers and self.alive:
                        self._answered.wait()
                    if not self._answers:
                        raise OSError("the template process ended while starting a child")
                    answer = self._answers.pop(0)
            finally:
                self._starting = None
        if "error" in answer:
            raise OSError(f"the template could not start the child: {answer['error']}")

    def live_pids(self) -> list[int]:
        """The pids of its children that have not exited yet."""
        with self._answered:
            return list(self._children)

    def close(self, timeout_s: float = 10.0) -> None:
        """End the template (its children, if any are left, get SIGTERM) and reap it."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_TEMPLATES: dict[tuple[tuple[str, str], ...], Template] = {}
_TEMPLATES_LOCK = threading.Lock()


def enabled() -> bool:
    """Whether children may be forked from a template here (Linux with pidfds; PSGRAD_PRELOAD unset or 1)."""
    return sys.platform.startswith("linux") and hasattr(os, "pidfd_open") and \
        os.environ.get("PSGRAD_PRELOAD", "1") != "0"


def preloadable(argv: Sequence[str]) -> list[str] | None:
    """What a template runs for this command line (the interpreter's arguments): `sys.executable -m
    psgrad ARGS`, `sys.executable SCRIPT.py ARGS` (a benchmark, say) or `sys.executable -c CODE ARGS`;
    None for any other."""
    if len(argv) >= 3 and argv[0] == sys.executable and argv[1] in ("-m", "-c") and \
            (argv[1] == "-c" or argv[2] == "psgrad"):
        return list(argv[1:])
    if len(argv) >= 2 and argv[0] == sys.executable and argv[1].endswith(".py") and not argv[1].startswith("-"):
        return list(argv[1:])
    return None


def _first_on_path(args: Sequence[str], cwd: str) -> str:
    """The directory the interpreter would put first on sys.path: the working directory for `-m` and
    `-c`, the script's own directory for a script."""
    return cwd if args[0] in ("-m", "-c") else os.path.dirname(os.path.join(cwd, args[0]))


def _shadowed(directory: str) -> bool:
    """Whether a child with this directory first on sys.path would import a psgrad other than this one."""
    import psgrad

    here = os.path.dirname(os.path.abspath(psgrad.__file__))
    there = os.path.join(directory, "psgrad")
    return os.path.isdir(there) and not os.path.samefile(there, here)


def template_for(env: Mapping[str, str], cwd: str, args: Sequence[str] = ("-m", "psgrad")) -> Template | None:
    """The running template for a child with this environment, working directory and arguments
    (preloadable's; started on first use), or None where the child must be started the plain way."""
    if not enabled() or env.get("PSGRAD_PRELOAD", "1") == "0" or _shadowed(_first_on_path(args, cwd)):
        return None
    key = _startup_env(env)
    with _TEMPLATES_LOCK:
        if _INHERITED is not None and key == _INHERITED[1]:  # this process is a template's child: ask it
            if key not in _TEMPLATES:
                _TEMPLATES[key] = Template(None, _INHERITED[0])
                atexit.register(close_all)
        template = _TEMPLATES.get(key)
        if template is not None and not template.alive:
            del _TEMPLATES[key]
            template = None
        if template is None:
            try:
                template = Template.start(env)
            except OSError:
                return None
            if not _TEMPLATES:
                atexit.register(close_all)
            _TEMPLATES[key] = template
        return template


def templates() -> list[Template]:
    """The templates this process runs."""
    with _TEMPLATES_LOCK:
        return list(_TEMPLATES.values())


def close_all() -> None:
    """End every template this process started (at exit, and for tests)."""
    with _TEMPLATES_LOCK:
        running = list(_TEMPLATES.values())
        _TEMPLATES.clear()
    for template in running:
        template.close()


# ---------------------------------------------------------------------------------------------- template side
# In a child of a template: its connection to the template and the template's startup environment,
# so that the children it starts itself (a `psgrad launch` run by a test, say) are forks of it too.
_INHERITED: tuple[socket.socket, tuple[tuple[str, str], ...]] | None = None
_KEY: tuple[tuple[str, str], ...] = ()  # in the template: its startup environment


def _become_child(message: dict[str, object], fds: list[int], keep_closed: Sequence[int], prctl: object,
                  connection: socket.socket) -> None:
    """In the forked child: take on the command's descriptors, environment and signals, run it, exit."""
    global _INHERITED
    code = 1
    try:
        _INHERITED = (connection, _KEY)
        if message.get("new_session"):
            os.setsid()
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)  # type: ignore[operator]
        for fd in keep_closed:
            os.close(fd)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        for signum in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        # SIGINT as the interpreter would have it: Python's handler, unless the template was started ignoring it
        signal.signal(signal.SIGINT, signal.SIG_IGN if _SIGINT_IGNORED else signal.default_int_handler)
        _set_title(message["argv"])  # type: ignore[arg-type]  # (before the environment changes: it needs its memory)
        cwd = str(message["cwd"])
        os.chdir(cwd)
        env = message["env"]
        assert isinstance(env, dict)
        os.environ.clear()
        os.environ.update(env)
        os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")  # as importing psgrad does
        unbuffered = os.environ.get("PYTHONUNBUFFERED", "") not in ("", "0")
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=unbuffered)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), errors="backslashreplace",
                                      line_buffering=True, write_through=True)
        for name in ("stdin", "stdout", "stderr"):  # the originals are these, as in a fresh interpreter
            setattr(sys, f"__{name}__", getattr(sys, name))
        argv = [str(a) for a in message["argv"]]  # type: ignore[attr-defined]
        sys.path[0] = "" if argv[0] == "-c" else _first_on_path(argv, cwd)  # as the interpreter would
        if "numpy.random" in sys.modules:  # a fresh interpreter seeds numpy's global generator anew
            sys.modules["numpy.random"].seed()
        _set_threads(os.environ.get("OMP_NUM_THREADS", ""))
        code = _run(argv)
    except BaseException:  # noqa: BLE001 - the child's own failure, reported as an interpreter would
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _set_threads(value: str) -> None:
    """torch's threads as OMP_NUM_THREADS=value would have set them at start-up (unset or not a
    positive number: one per CPU this process may run on, OpenMP's default)."""
    import torch

    n = int(value) if value.strip().isdigit() and int(value) > 0 else len(os.sched_getaffinity(0))
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)


def _set_title(args: Sequence[str]) -> None:
    """Show the command in ps and /proc/PID/cmdline (with setproctitle installed; else its name in comm)."""
    shown = ["-c", *args[2:]] if args[0] == "-c" else list(args)  # (not the code itself)
    title = " ".join(["python", *shown]).replace("\n", " ")
    try:
        from setproctitle import setproctitle
    except ImportError:
        try:
            ctypes.CDLL(None).prctl(15, title[:15].encode(), 0, 0, 0)  # PR_SET_NAME
        except (OSError, AttributeError):
            pass
        return
    setproctitle(title)


def _run(args: list[str]) -> int:
    """Run `python ARGS` (`-m psgrad ...` or `SCRIPT ...`) in this process as the interpreter would;
    the exit code."""
    import runpy
    import traceback

    code: int
    try:
        if args[0] == "-m":
            sys.argv = ["-m", *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            main = sys.modules["__main__"]
            main.__dict__.clear()
            main.__dict__.update(__name__="__main__", __builtins__=__builtins__)
            exec(compile(args[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv = list(args)
            runpy.run_path(args[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 128 + signal.SIGINT
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # the interpreter waits for non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code & 0xFF


def _serve(root: socket.socket) -> None:
    """The template's loop: fork a child per request, on the parent's connection or on one a child was
    given; report each child's exit, once reaped, on the connection that asked for it. When a child's
    connection ends (it exited), the children it asked for get SIGTERM, as its own children would
    from their parent-death signal; when the parent's ends, the template exits."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        prctl = None
    selector = selectors.DefaultSelector()
    # fd -> (the connection, the children asked for on it, the pid of the child it was given to: 0 for the parent's)
    connections: dict[int, tuple[socket.socket, set[int], int]] = {root.fileno(): (root, set(), 0)}
    asked_by: dict[int, int] = {}  # child pid -> the fd of the connection that asked for it
    selector.register(root, selectors.EVENT_READ, None)
    _send(root, {"ready": True})
    while True:
        for key, _events in selector.select():
            if key.data is not None:  # a child's pidfd: it exited
                pid = key.data
                selector.unregister(key.fd)
                os.close(key.fd)
                _pid, status = os.waitpid(pid, 0)
                owner = connections.get(asked_by.pop(pid, -1))
                if owner is not None:
                    owner[1].discard(pid)
                    try:
                        _send(owner[0], {"exited": pid, "rc": os.waitstatus_to_exitcode(status)})
                    except OSError:
                        pass
                continue
            sock, asked, asker = connections[key.fd]
            try:
                message, fds = _receive(sock)
            except OSError:
                message, fds = None, []
            if message is None:
                if sock is root:
                    return  # the parent is gone: so is the template (its children get SIGTERM)
                selector.unregister(sock)
                del connections[key.fd]
                sock.close()
                for pid in asked:
                    asked_by.pop(pid, None)  # (its fd number may serve another connection next)
                    try:
                        os.kill(pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
                continue
            group = 0  # a child that stays in its asker's session joins the asker's process group
            if not message.get("new_session") and asker:
                try:
                    same = os.getsid(asker) == os.getsid(0)
                    group = os.getpgid(asker)
                except ProcessLookupError:
                    same = False
                if not same:  # a session of its own: the asker starts the child itself
                    for fd in fds:
                        os.close(fd)
                    _send(sock, {"error": "the asker's session is not the template's"})
                    continue
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                pid = os.fork()
            except OSError as exc:
                for fd in fds:
                    os.close(fd)
                ours.close()
                theirs.close()
                _send(sock, {"error": str(exc)})
                continue
            if pid == 0:
                others = [selector.fileno(), ours.fileno()]
                others += [k.fd for k in selector.get_map().values()]
                if group:
                    os.setpgid(0, group)
                _become_child(message, fds, others, prctl, theirs)
            for fd in fds:
                os.close(fd)
            theirs.close()
            pidfd = os.pidfd_open(pid)
            selector.register(pidfd, selectors.EVENT_READ, pid)
            selector.register(ours, selectors.EVENT_READ, None)
            connections[ours.fileno()] = (ours, set(), pid)
            asked.add(pid)
            asked_by[pid] = key.fd
            _send(sock, {"pid": pid})


_SIGINT_IGNORED = False  # whether the template inherited SIGINT ignored (as a child started with `&` does)


def main(argv: Sequence[str]) -> None:
    global _SIGINT_IGNORED, _KEY
    _SIGINT_IGNORED = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    _KEY = _startup_env(os.environ)  # (before importing psgrad, which adds to it)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the parent's to handle (it stops the children)
    sock = socket.socket(fileno=int(argv[0]))
    import importlib

    with collector_off():
        for name in PRELOAD:
            importlib.import_module(name)
    # What the imports made, every child keeps as it is: out of the collector's sight (gc.freeze), a
    # child's full collections neither walk it (~170,000 objects, ~0.2 s a walk on a 2-core VM) nor
    # write to its pages (each page written is copied from the one it shares with the template).
    gc.collect()
    gc.freeze()
    try:
        _serve(sock)
    except (BrokenPipeError, ConnectionResetError):
        pass
    # The parent is gone (or closed it): exit now. The template holds no file, thread or child of its
    # own to finish, and the interpreter's teardown with torch and gRPC loaded took 1-3 s, which the
    # parent's close() (a launch's exit, say) waited for.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":  # (the module's own copy: its globals are the ones children import)
    import importlib

    importlib.import_module("psgrad.launch.template").main(sys.argv[1:])
