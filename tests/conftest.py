"""Shared fixtures: real server subprocesses on port 0, and a reaper that leaves no child behind."""
from __future__ import annotations

import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from psgrad.launch.supervisor import LineNotSeen, SupervisedProcess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Templates a module fixture keeps for its tests (a test bed's hosts': test_netbed.py), besides the
# preloaded ones of template.templates(): their children are a test's, they themselves are not.
KEPT_TEMPLATES: list[Any] = []


def _child_pids() -> list[int]:
    """PIDs of this process's live children (from /proc; zombies excluded): its preloaded templates'
    children count as its own, the templates themselves (kept for the next test) do not."""
    from psgrad.launch import template

    running = template.templates() + KEPT_TEMPLATES
    kept = {str(t.proc.pid) for t in running if t.proc is not None}
    me = str(os.getpid())
    out = [pid for t in running for pid in t.live_pids()]
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, ppid = fields[0], fields[1]
        if ppid == me and state != "Z" and entry not in kept:
            out.append(int(entry))
    return out


def process_gone(pid: int) -> bool:
    """The process has exited (no /proc entry, or a zombie its parent has yet to reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.fixture(autouse=True)
def _restore_psgrad_logging() -> Iterator[None]:
    """Give the `psgrad` logger back its handlers after a test: a CLI run in this process (psgrad's
    logs.configure) points them at the test's captured stdout and stderr, which are closed once the
    test ends, and a server thread still logging then (a lease reaper evicting a worker) would print
    "--- Logging error ---" into a later test's output."""
    log = logging.getLogger("psgrad")
    handlers, level, propagate = list(log.handlers), log.level, log.propagate
    yield
    for handler in list(log.handlers):
        if handler not in handlers:
            log.removeHandler(handler)
    for handler in handlers:
        if handler not in log.handlers:
            log.addHandler(handler)
    log.setLevel(level)
    log.propagate = propagate


@pytest.fixture(autouse=True)
def _restore_grpc_verbosity() -> Iterator[None]:
    """Give GRPC_VERBOSITY back its value after a test: a client command run in this process
    (`main(["worker", ...])`, `main(["certs", ...])`) sets it to NONE for its children
    (psgrad.cli.logs.quiet_grpc), and left so, every later child of this test process (a server a
    benchmark starts) logged none of gRPC's lines: a refused TLS handshake's reason among them."""
    verbosity = os.environ.get("GRPC_VERBOSITY")
    yield
    if verbosity is None:
        os.environ.pop("GRPC_VERBOSITY", None)
    else:
        os.environ["GRPC_VERBOSITY"] = verbosity


@pytest.fixture(autouse=True)
def _reap_children() -> Iterator[None]:
    """Kill any child process a test left running, and fail loudly if there was one."""
    yield
    leftovers = _child_pids()
    for pid in leftovers:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
    assert not leftovers, f"test left child processes running: {leftovers}"


class Proc(SupervisedProcess):
    """A psgrad subprocess whose merged stdout/stderr lines are collected (psgrad's supervisor); a
    `python -m psgrad` command is forked from a preloaded template, as `psgrad launch` starts its
    children (preload=False: a cold interpreter)."""

    def __init__(self, argv: Sequence[str], *, preload: bool = True, **kwargs: Any) -> None:
        super().__init__(argv, preload=preload, **kwargs)

    def wait_for_line(self, marker: str, timeout_s: float = 60.0, at_start: bool = False) -> str:
        """Block until a line containing marker is printed; fail the test if the process ends or time runs out."""
        try:
            return super().wait_for_line(marker, timeout_s, at_start)
        except LineNotSeen as exc:
            raise AssertionError(f"{exc}\nall its lines: {self.lines}") from None

    def wait(self, timeout_s: float | None = 120.0) -> int:
        return super().wait(timeout_s)

    def stop(self, grace_s: float = 15.0) -> int:
        return super().stop(grace_s)


def _psgrad(args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "psgrad", *args]


def child_env() -> dict[str, str]:
    """The tests' environment for psgrad children: one OpenMP thread each unless the caller set it
    (several workers and servers share 2 vCPUs; OpenMP threads that spin made them far slower)."""
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def spawn(args: Sequence[str]) -> Proc:
    """Start `python -m psgrad ARGS` with merged, line-buffered output."""
    # In the test's own session: on Linux a session of its own is a scheduler autogroup of its own,
    # and processes whose OpenMP threads spin then ran several times slower on 2 vCPUs.
    return Proc(_psgrad(args), name=f"psgrad-{args[0]}", cwd=REPO, new_session=False, env=child_env())


def run_benchmark(script: str, *args: str, timeout_s: float = 240.0) -> Any:
    """Run `python benchmarks/SCRIPT ARGS` to completion and return the JSON it prints (the test
    fails with the script's stderr if it exits non-zero)."""
    import json

    res = run_python([f"benchmarks/{script}", *args], timeout_s=timeout_s)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)


def run_python(args: Sequence[str], timeout_s: float = 240.0, env: dict[str, str] | None = None,
               cwd: str | os.PathLike[str] = REPO) -> subprocess.CompletedProcess[str]:
    """Run `python ARGS` (a script, `-c CODE` or `-m psgrad ...`) in cwd (default: the repository) to
    completion, forked from the preloaded template as `psgrad launch` starts its children (stdin
    /dev/null), capturing stdout and stderr apart. A fork skips the seconds a cold interpreter spends
    importing torch; it runs the command as a fresh interpreter would (psgrad/launch/template.py).

    Raises subprocess.TimeoutExpired (the process killed and reaped) after timeout_s.
    """
    argv = [sys.executable, *args]
    proc = Proc(argv, name=os.path.basename(args[0]), cwd=cwd, stderr_file=True, new_session=False,
                env=child_env() if env is None else env)
    try:
        rc = proc.wait(timeout_s)
        stdout = "".join(line + "\n" for line in proc.lines)
        return subprocess.CompletedProcess(argv, rc, stdout, proc.stderr_text())
    finally:
        proc.stop(grace_s=0)


def _run_directory(factory: pytest.TempPathFactory) -> Path:
    """This test run's temporary directory, above every xdist worker's own: where they share files."""
    return factory.getbasetemp().parent


def once_per_run(name: str, compute: Callable[[], Any], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """compute() once per test run, its result (JSON) shared by every xdist worker that asks: the first
    to ask computes it under a file lock, the others wait for it and read it. For a module fixture that
    runs a benchmark, whose tests the scheduler may hand to different workers."""
    import json

    from filelock import FileLock

    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return compute()
    path = _run_directory(tmp_path_factory) / f"{name}.json"
    with FileLock(str(path) + ".lock"):
        if path.is_file():
            return json.loads(path.read_text())
        value = compute()
        path.write_text(json.dumps(value))
        return value


def run_cli(args: Sequence[str], timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Run `python -m psgrad ARGS` to completion, capturing stdout and stderr apart.

    Raises subprocess.TimeoutExpired (the process killed and reaped) after timeout_s.
    """
    return run_python(["-m", "psgrad", *args], timeout_s)


def cli_in_process(args: Sequence[str], capsys: pytest.CaptureFixture[str]) -> subprocess.CompletedProcess[str]:
    """`psgrad ARGS` run in this process (the command line's own code: parser, command, errors turned
    into exit codes), its exit code and output as run_cli gives them. For input the CLI refuses before
    it starts anything, and for commands a test runs beside real servers: a child would add only an
    interpreter and its imports. The `psgrad` logger, which main() points at this test's streams, is
    left as it was found."""
    import logging

    from psgrad.cli.main import main

    psgrad_log = logging.getLogger("psgrad")
    saved = (list(psgrad_log.handlers), psgrad_log.level, psgrad_log.propagate)
    verbosity = os.environ.get("GRPC_VERBOSITY")  # (main sets it for the command's children)
    capsys.readouterr()
    try:
        rc = main(list(args))
    except SystemExit as exc:  # argparse's usage errors
        rc = exc.code if isinstance(exc.code, int) else 2
    finally:
        psgrad_log.handlers[:], psgrad_log.level, psgrad_log.propagate = saved
        if verbosity is None:
            os.environ.pop("GRPC_VERBOSITY", None)
        else:
            os.environ["GRPC_VERBOSITY"] = verbosity
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["psgrad", *args], rc, out, err)


@pytest.fixture
def make_servers():  # type: ignore[no-untyped-def]
    """make_servers(n, lease_s=10.0, **ServerConfig fields) -> n in-process gRPC servers on port 0, stopped
    at teardown."""
    from psgrad.config import ServerConfig
    from psgrad.server.runtime import start_server

    running = []

    def make(n: int, lease_s: float = 10.0, **kw):  # type: ignore[no-untyped-def]
        new = [start_server(ServerConfig(port=0, threads=16, lease_s=lease_s, **kw)) for _ in range(n)]
        running.extend(new)
        return new

    yield make
    for s in running:
        s.stop(0)


def hold_port(port: int | str = 0) -> socket.socket:
    """127.0.0.1:port bound, not listening (port 0: a free one; a "host:port" address: its port, a
    stopped server's): a connection to it is refused, and no server of another test (port 0, in
    another process of the parallel run) can be handed it while the socket is open. A stopped
    server's port, left free, once went to such a server, which answered the check meant to find it
    down."""
    if isinstance(port, str):
        port = int(port.rsplit(":", 1)[1])
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (past a stopped server's TIME_WAITs)
    sock.bind(("127.0.0.1", port))
    return sock


def held_address(sock: socket.socket) -> str:
    return f"127.0.0.1:{sock.getsockname()[1]}"


class SlowToAnswer:
    """A TCP proxy in front of a server whose every new connection waits `delay_s` (settable) before
    a byte goes either way: a server too busy to finish a handshake at once (a loaded machine), or
    a link with a long round trip. drop() closes the connections it carries."""

    def __init__(self, target: str, delay_s: float) -> None:
        self.delay_s, self._target = delay_s, target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._closed = threading.Event()
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._open.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        if self._closed.wait(self.delay_s):
            return
        host, port = self._target.rsplit(":", 1)
        upstream = socket.create_connection((host, int(port)))
        self._open.append(upstream)
        for a, b in ((conn, upstream), (upstream, conn)):
            threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def drop(self) -> None:
        """Close every connection it carries (each side sees it closed)."""
        open_now, self._open = self._open, []
        for s in open_now:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        self.drop()


def wait_for(what: str, predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Poll predicate until it holds (another thread or process does the work); fail naming `what`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def run_in_threads(n: int, fn: Callable[[int], None], timeout_s: float = 90.0) -> None:
    """Run fn(0..n-1) in n threads; re-raise the first failure and fail if any thread hangs."""
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            fn(rank)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    if errors:
        raise errors[0]


def decode_frames(frames: Iterable[bytes], numel: int, wire_dtype: str = "float32") -> Any:
    """Reassemble a pull's data frames (in the wire dtype) into a float32 tensor of numel values."""
    import torch

    from psgrad.core.codecs import WireBuffer
    from psgrad.wire.frames import frame_payload

    dest = torch.empty(numel)
    wire = WireBuffer(numel, wire_dtype)
    view = wire.receive_view(dest)
    offset = 0
    for f in frames:
        piece = frame_payload(f)
        assert piece is not None
        view[offset : offset + len(piece)] = piece
        offset += len(piece)
    assert offset == len(view)
    wire.finish_receive(dest)
    return dest


def communicate_all(procs: Sequence[subprocess.Popen[str]], timeout_s: float) -> list[str]:
    """Collect every process's output; kill and reap whatever is still running afterwards."""
    try:
        return [p.communicate(timeout=timeout_s)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


@pytest.fixture
def server_procs() -> Iterator[list[Proc]]:
    """A list to register server subprocesses in; all are stopped at teardown."""
    procs: list[Proc] = []
    yield procs
    for p in procs:
        p.stop()


@pytest.fixture
def start_servers(server_procs: list[Proc]):  # type: ignore[no-untyped-def]
    """start_servers(n, *extra_args) -> list of HOST:PORT of n real server processes on port 0."""

    def start(n: int, *extra: str) -> list[str]:
        addrs = []
        for _ in range(n):
            proc = spawn(["server", "--host", "127.0.0.1", "--port", "0", *extra])
            server_procs.append(proc)
        for proc in server_procs[-n:]:
            line = proc.wait_for_line("psgrad server listening on ")
            addrs.append(line.rsplit(" ", 1)[1])
        return addrs

    return start


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus /metrics page, keyed by (name, sorted labels)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def health(address: str, wait_for: str | None = None, timeout_s: float = 10.0) -> str:
    """The server's gRPC health status ("SERVING", "NOT_SERVING"); with wait_for, watch the health
    service (no polling) until it says that status, failing after timeout_s."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    name = health_pb2.HealthCheckResponse.ServingStatus.Name
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="")
        if wait_for is None:
            return str(name(stub.Check(request, timeout=timeout_s).status))
        seen = []
        try:
            for reply in stub.Watch(request, timeout=timeout_s):
                seen.append(str(name(reply.status)))
                if seen[-1] == wait_for:
                    return wait_for
        except grpc.RpcError as exc:
            raise AssertionError(f"{address} did not report {wait_for} within {timeout_s} s (saw {seen}): {exc}") from None
        raise AssertionError(f"{address}: the health watch ended before {wait_for} (saw {seen})")


@pytest.fixture(params=["torch-ops", "row-kernels"])
def row_kernels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A test of sparse tables run both ways a shard updates and reads rows: by the tables' torch
    ops (the fused kernels turned off) and by the row kernels (compiled first: numba is a
    dependency, so they must be)."""
    from psgrad.server import kernels

    if request.param == "torch-ops":
        monkeypatch.setenv(kernels.ENV, "0")
    else:
        monkeypatch.delenv(kernels.ENV, raising=False)
        assert kernels.rows(wait=True) is not None, "the row kernels must compile and agree with torch's ops"
    return str(request.param)


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - torch import problems show up elsewhere
        return False


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Tests marked `ray` take turns across xdist workers: two Ray clusters at once on 2 vCPUs (each with
    its GCS, raylets and agents) slowed each other past their deadlines. The turn is awaited outside
    the test's timeout (this wrapper runs before pytest-timeout's)."""
    if item.get_closest_marker("ray") is None or not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    import tempfile

    from filelock import FileLock

    factory = getattr(item.config, "_tmp_path_factory", None)
    where = _run_directory(factory) if factory is not None else tempfile.gettempdir()
    with FileLock(os.path.join(where, "ray.lock")):
        yield


def pytest_configure(config: pytest.Config) -> None:
    """One intra-op torch thread in the test processes (as child_env gives their children), unless
    OMP_NUM_THREADS says otherwise: `-n auto` already runs a test process per CPU and one more, and
    OpenMP threads that spin-wait on a busy machine made a 3-second training test take 98 s at load
    8 (one thread: 25 s)."""
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(1)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (the default, see pyproject.toml): one test worker more than the CPUs, at most 12. The
    end-to-end tests spend much of their time waiting on their child processes; on 2 vCPUs 3 workers
    took the suite from 15 to 12 minutes. PYTEST_XDIST_AUTO_NUM_WORKERS or -n N overrides it, -n 0
    runs in this process (for pdb)."""
    return min((os.cpu_count() or 1) + 1, 12)


def _expected_cost(item: pytest.Item) -> float:
    """A test's share of the run, as its timeout states it (the longer a test may take, the more it
    costs): its timeout mark, else the suite's default."""
    mark = item.get_closest_marker("timeout")
    if mark is not None and mark.args:
        return float(mark.args[0])
    return float(item.config.getini("timeout") or 120)


def _worksteal_chunks(count: int, workers: int) -> list[int]:
    """How many tests xdist's worksteal scheduler first sends each worker: the collection in
    contiguous chunks, each the pending count divided by the workers still to serve."""
    sizes = []
    for k in range(workers):
        sizes.append(count // (workers - k))
        count -= sizes[-1]
    return sizes


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest tests first, on every xdist worker: the order is laid out in the contiguous chunks
    xdist's worksteal hands the workers, and each chunk starts with its share of the slow tests
    (heaviest first, shared out by their timeouts), then the quick ones. The tests marked `ray` (they
    take turns, and share a cluster per module) all open the first chunk. A worker that runs out
    steals the tail of another's chunk: quick tests. (In one order, ray then slow then the rest, the
    first chunk held every slow test and the others only quick ones, and the slow tests a worker
    stole ran last, the suite's tail.)
    Tests marked cuda skip (with the reason shown) on machines without a CUDA GPU."""
    ray = [item for item in items if item.get_closest_marker("ray")]
    slow = [item for item in items if item.get_closest_marker("slow") and not item.get_closest_marker("ray")]
    heavy = {id(item) for item in ray + slow}
    quick = [item for item in items if id(item) not in heavy]
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    if workers <= 1:
        items[:] = ray + slow + quick
    else:
        chunks: list[list[pytest.Item]] = [list(ray)] + [[] for _ in range(workers - 1)]
        load = [sum(map(_expected_cost, ray))] + [0.0] * (workers - 1)
        for item in sorted(slow, key=_expected_cost, reverse=True):
            k = min(range(workers), key=lambda c: (load[c], c))
            chunks[k].append(item)
            load[k] += _expected_cost(item)
        rest = iter(quick)
        for chunk, size in zip(chunks, _worksteal_chunks(len(items), workers)):
            chunk.extend(itertools.islice(rest, max(0, size - len(chunk))))
        chunks[-1].extend(rest)
        items[:] = [item for chunk in chunks for item in chunk]
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def note_first_sleep(monkeypatch: pytest.MonkeyPatch, module: Any) -> threading.Event:
    """Give module a `time` whose sleep() sets the returned event first: a test then knows, without
    sleeping itself, that the code under test reached its first wait before a retry."""
    import time

    slept = threading.Event()

    class Clock:
        monotonic = staticmethod(time.monotonic)

        @staticmethod
        def sleep(seconds: float) -> None:
            slept.set()
            time.sleep(seconds)

    monkeypatch.setattr(module, "time", Clock)
    return slept


class SmallDisk:
    """A 2 MB tmpfs mounted at `path`: fill() takes its last free byte, free() gives the space back."""

    def __init__(self, path: Any) -> None:
        self.path = path
        self._filler = path / ".filler"

    def fill(self) -> None:
        fd = os.open(self._filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            chunk = b"\0" * 4096
            while True:
                try:
                    os.write(fd, chunk)
                except OSError:  # ENOSPC: the disk is full
                    if len(chunk) == 1:
                        break
                    chunk = chunk[: len(chunk) // 2]
        finally:
            os.close(fd)

    def free(self) -> None:
        self._filler.unlink(missing_ok=True)


@pytest.fixture
def small_disk(tmp_path: Any) -> Iterator[SmallDisk]:
    """A 2 MB tmpfs (mount needs root: the test is skipped, with the reason, where it cannot mount),
    unmounted at teardown."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    try:
        res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2M", "tmpfs", str(mount)], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a small tmpfs to fill: {exc}")
    if res.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root): {res.stderr.strip()}")
    try:
        yield SmallDisk(mount)
    finally:
        if subprocess.run(["umount", str(mount)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30)
