"""SupervisedProcess: one child process, its output read line by line on a thread, stopped and always reaped."""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Union

from psgrad.launch import template
from psgrad.launch.template import Template, TemplateChild, die_with_parent

# A child process: a subprocess.Popen, or a fork of a preloaded template (template.TemplateChild).
Child = Union["subprocess.Popen[str]", TemplateChild]



# Held while a whole line is written to stdout (print_line), and by whoever prints several lines that
# must not be split by children's lines (a launch's final status).
PRINT_LOCK = threading.RLock()


def print_line(line: str) -> None:
    """Print one line and flush, safely from any thread: print() writes the text and the newline in two
    calls, and the lines of children relayed by several reader threads at once ran together."""
    with PRINT_LOCK:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


class LineNotSeen(Exception):
    """wait_for_line gave up: the process ended (ended=True), or time ran out, before the line came."""

    def __init__(self, name: str, what: str, ended: bool, tail: Sequence[str]) -> None:
        shown = "".join(f"\n  {line}" for line in tail)
        super().__init__(f"{name} {what}" + (f"; its last lines:{shown}" if tail else ""))
        self.what = what
        self.ended = ended


class CtrlC:
    """Ctrl-C that is never lost, for a main thread that waits in slices: while active, SIGINT is
    noted and raises KeyboardInterrupt as usual, and check() raises it again where Python swallowed
    it — raised inside an at-fork hook (starting a child: logging's _releaseLock), a __del__ or a
    weakref callback, it is only printed ("Exception ignored in ...") and the program went on.
    Outside the main thread, or where SIGINT is not Python's default (ignored), it does nothing."""

    def __init__(self) -> None:
        self.seen = False
        self._previous: Callable[..., object] | int | None = None

    def __enter__(self) -> CtrlC:
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def _on_sigint(self, signum: int, frame: object) -> None:
        self.seen = True
        raise KeyboardInterrupt

    def check(self) -> None:
        """Raise KeyboardInterrupt if Ctrl-C came (again, where it was swallowed)."""
        if self.seen:
            raise KeyboardInterrupt

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


class SupervisedProcess:
    """A child process whose stdout a thread reads as text lines; stop() always reaps it.

    stderr is merged into stdout, or with stderr_file kept in a temporary file (stderr_text()).
    Each line goes to on_line and, with collect, to `lines` and to the queue wait_for_line reads;
    at the end of its output on_exit gets the exit code. stdin is /dev/null, or with stdin_pipe a
    pipe for write_line. The child runs in a session of its own unless new_session=False (a Ctrl-C
    reaches only the parent, which stops it) and on Linux gets SIGTERM when the parent dies, so
    nothing is left behind. preload=True: a `sys.executable -m psgrad ...` (or `sys.executable
    SCRIPT.py ...`) command is started as a fork of a process that has already imported torch and
    psgrad (template.py), in milliseconds instead of seconds; any other command, or where that
    cannot be done, the plain way. template=T: a fork of that template (Template.start(env, wrap):
    one running in another network namespace, say), or OSError; never the plain way.
    """

    def __init__(
        self,
        argv: Sequence[str],
        *,
        name: str = "",
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        stdin_pipe: bool = False,
        stderr_file: bool = False,
        new_session: bool = True,
        collect: bool = True,
        on_start: Callable[[Child], None] | None = None,
        on_line: Callable[[str], None] | None = None,
        on_exit: Callable[[int], None] | None = None,
        preload: bool = False,
        template: Template | None = None,
    ) -> None:
        self.name = name or os.path.basename(argv[0])
        self.lines: list[str] = []
        self._collect = collect
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._on_line = on_line
        self._on_exit = on_exit
        self._terminated = False
        self._stderr: IO[str] | None = None
        if stderr_file:
            self._stderr = tempfile.TemporaryFile(mode="w+", prefix=f"psgrad-{self.name}-stderr-")
        env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
        try:
            forked = self._fork(argv, env, cwd, stdin_pipe, new_session, template) \
                if preload or template is not None else None
            self.popen: Child = forked if forked is not None else subprocess.Popen(
                list(argv),
                stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT if self._stderr is None else self._stderr,
                text=True,
                bufsize=1,
                cwd=cwd,
                env=env,
                # Ctrl-C reaches the parent only; it stops its children in order. On Linux a session of
                # its own is also a scheduler autogroup of its own, which lengthened the measured
                # round trip between a benchmark's client and its server processes by about 7 %
                # (benchmarks/transport.py --part latency, 2 vCPUs), and made the tests' psgrad
                # processes, whose OpenMP threads spin, several times slower: benchmarks and tests
                # keep their children in their own session.
                start_new_session=new_session,
                preexec_fn=die_with_parent(),
            )
        except BaseException:
            if self._stderr is not None:
                self._stderr.close()
            raise
        if on_start is not None:
            on_start(self.popen)  # before the reader starts: nothing the child prints comes first
        self._reader = threading.Thread(target=self._pump, name=f"read-{self.name}", daemon=True)
        self._reader.start()

    def _fork(self, argv: Sequence[str], env: dict[str, str], cwd: str | os.PathLike[str] | None,
              stdin_pipe: bool, new_session: bool, given: Template | None = None) -> TemplateChild | None:
        """Start `python -m psgrad ARGS` as a fork of a preloaded template (see template.py); None where
        that does not apply (another command, a template that cannot serve this environment). With a
        template given, a fork of that one or an error (OSError), never None: it runs where the plain
        command would not (another network namespace, say)."""
        args = template.preloadable(argv)
        if given is not None and args is None:
            raise OSError(f"a template runs `python -m psgrad ...`, `python -c ...` or `python SCRIPT.py ...`, "
                          f"not {list(argv)!r}")
        if args is None or (given is None and not template.enabled()):
            return None
        where = os.path.abspath(os.fspath(cwd) if cwd is not None else os.getcwd())
        tmpl = given if given is not None else template.template_for(env, where, args)
        if tmpl is None:
            return None
        out_r, out_w = os.pipe()
        in_r, in_w = os.pipe() if stdin_pipe else (os.open(os.devnull, os.O_RDONLY), -1)
        err = out_w if self._stderr is None else self._stderr.fileno()
        child = template.TemplateChild(tmpl, os.fdopen(in_w, "w", buffering=1) if in_w >= 0 else None,
                                       os.fdopen(out_r, "r"))
        try:
            tmpl.spawn(args, env, where, new_session, (in_r, out_w, err), child)
        except OSError:
            for stream in (child.stdin, child.stdout):
                if stream is not None:
                    stream.close()
            if given is not None:
                raise
            return None
        finally:
            os.close(out_w)  # (the child has its own copies)
            os.close(in_r)
        return child

    def _pump(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            line = raw.rstrip("\n")
            if self._collect:
                self.lines.append(line)
                self._queue.put(line)
            if self._on_line is not None:
                self._on_line(line)
        self._queue.put(None)
        if self._on_exit is not None:
            self._on_exit(self.popen.wait())

    @property
    def output(self) -> str:
        """Every line read so far."""
        return "\n".join(self.lines)

    def wait_for_line(self, marker: str, timeout_s: float = 60.0, at_start: bool = False) -> str:
        """The next line containing marker (starting with it, with at_start); earlier lines are passed over.

        Raises LineNotSeen when the output ends or timeout_s passes first.
        """
        if not self._collect:
            raise RuntimeError(f"{self.name} was started with collect=False: its lines are not kept")
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                what = f"printed no line with {marker!r} within {timeout_s:g} s"
                raise LineNotSeen(self.name, what, False, self.lines[-20:]) from None
            if line is None:
                self._queue.put(None)  # later waits fail fast too
                try:
                    self.popen.wait(timeout=5)  # the output ended: the exit status follows shortly
                except subprocess.TimeoutExpired:
                    pass
                raise LineNotSeen(self.name, f"ended before printing {marker!r}", True, self.lines[-20:])
            if line.startswith(marker) if at_start else marker in line:
                return line

    def write_line(self, text: str) -> None:
        """Send one line to the child's stdin (stdin_pipe). Raises OSError (BrokenPipeError) once it is gone."""
        assert self.popen.stdin is not None, f"{self.name} was started without stdin_pipe"
        self.popen.stdin.write(text + "\n")
        self.popen.stdin.flush()

    def stderr_text(self) -> str:
        """Everything the child wrote to stderr so far (with stderr_file; else it is in the lines)."""
        if self._stderr is None or self._stderr.closed:
            return ""
        self._stderr.flush()
        self._stderr.seek(0)
        return self._stderr.read()

    def wait(self, timeout_s: float | None = None) -> int:
        """The exit code, once every line the process printed has been read (subprocess.TimeoutExpired
        after timeout_s)."""
        rc = self.popen.wait(timeout=timeout_s)
        self._reader.join(timeout=timeout_s)
        return rc

    def terminate(self) -> None:
        """SIGTERM the process if it still runs; only once, so a graceful stop is not cut short."""
        if not self._terminated and self.popen.poll() is None:
            self._terminated = True
            self.popen.send_signal(signal.SIGTERM)

    def stop(self, grace_s: float = 5.0) -> int:
        """terminate(), then SIGKILL if it still runs after grace_s; always reaps it. Returns the exit code."""
        self.terminate()
        try:
            rc = self.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            rc = self.popen.wait()
        self._reader.join(timeout=grace_s)
        for stream in (self.popen.stdin, None if self._reader.is_alive() else self.popen.stdout, self._stderr):
            if stream is not None:
                try:
                    stream.close()
                except OSError:  # a broken pipe's unflushed line
                    pass
        return rc
