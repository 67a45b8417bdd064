"""Ceilings and plumbing the benchmarks share: loopback TCP and memory-copy bandwidth, child processes
that answer one JSON line per command, machine info, summary statistics and target rows.

Run as a script it serves the TCP ceiling (`python benchmarks/ceilings.py --tcp-serve`) and prints
`tcp listening on HOST:PORT`. Nothing here imports torch at module level, so that server starts fast.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from psgrad.launch.supervisor import LineNotSeen, SupervisedProcess

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MIB = 1 << 20
# Benchmark children get one OpenMP thread unless asked otherwise: many processes share 2 cores,
# and spinning OpenMP threads would slow the measured ones (psgrad and the baselines alike).
# `psgrad launch` makes the same choice on 2 cores.
ONE_THREAD_ENV = {"OMP_NUM_THREADS": "1"}


class BenchError(RuntimeError):
    """A benchmark child failed, hung or answered nonsense."""


def log(message: str) -> None:
    """Progress goes to stderr; stdout carries only the JSON document."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Child processes


class Child:
    """A benchmark child: psgrad's SupervisedProcess, spoken to in JSON, failing with BenchError.

    Commands are JSON objects, one per stdin line; replies are the child's stdout lines that start
    with "{" (anything else a library prints is kept but skipped). stderr goes to a temporary file
    for error reports.
    """

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None, speaks: bool = True,
                 one_thread: bool = True) -> None:
        self.name = name
        self.speaks = speaks  # True: stopped with a quit command; False (servers): with SIGTERM
        self._address: str | None = None
        self.proc = SupervisedProcess(
            argv, name=f"bench-{name}", cwd=REPO, stdin_pipe=True, stderr_file=True, new_session=False,
            env={**os.environ, **(ONE_THREAD_ENV if one_thread else {}), **(env or {})},
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
        with open(f"/proc/{self.popen.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

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


def window_bytes_arg(text: str) -> int:
    """argparse type of the benchmarks' --stream-window-bytes: a window `psgrad server` accepts."""
    from psgrad.config import ServerConfig

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number of bytes: {text!r}") from None
    try:
        ServerConfig(stream_window_bytes=value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def window_argv(window: int | None) -> list[str]:
    """The psgrad server arguments that set its stream window; none for its default (None)."""
    return [] if window is None else ["--stream-window-bytes", str(window)]


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


def exit_now(code: int = 0) -> None:
    """End a child whose resources are already released, skipping interpreter teardown (which
    takes about 2 s with torch and grpc loaded, for nothing)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ---------------------------------------------------------------------------------------------
# Statistics, aggregation and target rows


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def summarize(values: Sequence[float]) -> dict[str, float]:
    """n, median, p99, mean, min and max of a non-empty sequence."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return {
        "n": len(ordered),
        "median": median,
        "p99": percentile(ordered, 99),
        "mean": sum(ordered) / len(ordered),
        "min": ordered[0],
        "max": ordered[-1],
    }


def aggregate(replies: Sequence[dict[str, Any]], payload_bytes: int) -> dict[str, Any]:
    """Combine W workers' timings of one round: each reply has start, end, pull_s and push_s.

    The aggregate window runs from the first start to the last end, so a worker that finishes
    early counts against the total (conservative, and the same rule for psgrad and its ceilings).
    """
    start = min(r["start"] for r in replies)
    end = max(r["end"] for r in replies)
    ops = sum(len(r["pull_s"]) + len(r["push_s"]) for r in replies)
    per_worker = []
    for r in replies:
        n = len(r["pull_s"]) + len(r["push_s"])
        span = r["end"] - r["start"]
        per_worker.append({"ops_per_s": n / span, "gb_per_s": n * payload_bytes / span / 1e9})
    return {
        "window_s": end - start,
        "ops": ops,
        "ops_per_s": ops / (end - start),
        "gb_per_s": ops * payload_bytes / (end - start) / 1e9,
        "per_worker": per_worker,
        "pull_s": [t for r in replies for t in r["pull_s"]],
        "push_s": [t for r in replies for t in r["push_s"]],
    }


def target(name: str, value: float, ceiling: float, goal: float, better: str, unit: str = "",
           ceiling_name: str = "") -> dict[str, Any]:
    """One row of the suite's summary: ratio = value / ceiling, met against goal in direction better."""
    if better not in ("higher", "lower"):
        raise ValueError(f"better must be 'higher' or 'lower', got {better!r}")
    ratio = value / ceiling if ceiling else float("nan")
    met = ratio >= goal if better == "higher" else ratio <= goal
    return {"name": name, "value": value, "ceiling": ceiling, "ratio": ratio, "target": goal, "better": better,
            "met": bool(met), "unit": unit, "ceiling_name": ceiling_name}


def figure(name: str, value: float, unit: str, ceiling: float | None = None, ceiling_name: str = "") -> dict[str, Any]:
    """One row of a part's figures table (a measurement, with the ceiling it was measured beside)."""
    row: dict[str, Any] = {"name": name, "value": value, "unit": unit}
    if ceiling is not None:
        row.update(ceiling=ceiling, ceiling_name=ceiling_name, ratio=value / ceiling if ceiling else float("nan"))
    return row


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """Where the figures were measured: CPUs, memory, versions, and the load when asked."""
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "grpcio": _version("grpcio"),
        "numpy": _version("numpy"),
        "loadavg_1m": os.getloadavg()[0],
    }
    try:
        with open("/proc/cpuinfo") as f:
            models = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        info["cpu_model"] = models[0] if models else None
        with open("/proc/meminfo") as f:
            kb = next(int(ln.split()[1]) for ln in f if ln.startswith("MemTotal:"))
        info["mem_total_gib"] = round(kb / (1 << 20), 1)
    except (OSError, StopIteration, IndexError, ValueError):
        pass
    return info


# ---------------------------------------------------------------------------------------------
# Loopback TCP ceiling: plain sockets, a separate server process, 1 MiB sends, recv_into a reused buffer

_HEADER = 17  # op (1 byte: U upload, D download) + nbytes (8) + chunk (8)


def _recv_exactly(sock: socket.socket, view: memoryview, chunk: int) -> None:
    off = 0
    while off < len(view):
        n = sock.recv_into(view[off : off + chunk])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        off += n


def _serve_connection(conn: socket.socket) -> None:
    buf = bytearray(0)
    header = bytearray(_HEADER)
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            try:
                _recv_exactly(conn, memoryview(header), _HEADER)
            except ConnectionError:
                return
            op = header[0:1]
            nbytes = int.from_bytes(header[1:9], "little")
            chunk = int.from_bytes(header[9:17], "little")
            if len(buf) < nbytes:
                buf = bytearray(nbytes)
            view = memoryview(buf)[:nbytes]
            if op == b"U":
                _recv_exactly(conn, view, chunk)
                conn.sendall(nbytes.to_bytes(8, "little"))
            elif op == b"D":
                for off in range(0, nbytes, chunk):
                    conn.sendall(view[off : off + chunk])
            else:
                return


def serve_tcp(host: str = "127.0.0.1", port: int = 0) -> tuple[socket.socket, str]:
    """A listening socket served by a thread per connection; returns it and its HOST:PORT."""
    listener = socket.create_server((host, port))

    def accept_loop() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=_serve_connection, args=(conn,), daemon=True).start()

    threading.Thread(target=accept_loop, daemon=True).start()
    bound = listener.getsockname()[1]
    return listener, f"{host}:{bound}"


class TcpClient:
    """Upload/download `len(buffer)` bytes over one loopback connection in `chunk`-byte sends."""

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=120)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _header(self, op: bytes, nbytes: int, chunk: int) -> bytes:
        return op + nbytes.to_bytes(8, "little") + chunk.to_bytes(8, "little")

    def upload(self, payload: memoryview, chunk: int = MIB) -> None:
        self.sock.sendall(self._header(b"U", len(payload), chunk))
        for off in range(0, len(payload), chunk):
            self.sock.sendall(payload[off : off + chunk])
        ack = bytearray(8)
        _recv_exactly(self.sock, memoryview(ack), 8)

    def download(self, dest: memoryview, chunk: int = MIB) -> None:
        self.sock.sendall(self._header(b"D", len(dest), chunk))
        _recv_exactly(self.sock, dest, chunk)

    def close(self) -> None:
        self.sock.close()


# ---------------------------------------------------------------------------------------------
# Memory-copy ceiling


class MemcpyProbe:
    """torch copy_ of `nbytes` between two preallocated CPU tensors, and into a fresh allocation.

    The fresh figure pays the page faults of new memory on every copy, which is what any code
    that allocates a new buffer per message pays.
    """

    def __init__(self, nbytes: int) -> None:
        import torch

        self._torch = torch
        self.nbytes = nbytes
        numel = max(1, nbytes // 4)
        self.src = torch.ones(numel)
        self.dst = torch.zeros(numel)
        self.dst.copy_(self.src)  # touch every page once

    def reused_s(self) -> float:
        t0 = time.perf_counter()
        self.dst.copy_(self.src)
        return time.perf_counter() - t0

    def fresh_s(self) -> float:
        t0 = time.perf_counter()
        fresh = self._torch.empty_like(self.src)
        fresh.copy_(self.src)
        elapsed = time.perf_counter() - t0
        del fresh
        return elapsed


def median_gbps(times_s: Sequence[float], nbytes: int) -> float:
    """Bandwidth of the median time."""
    return nbytes / summarize(times_s)["median"] / 1e9


def _serve_main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tcp-serve", action="store_true", help="run the loopback TCP server until SIGTERM")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one")
    args = parser.parse_args()
    if not args.tcp_serve:
        parser.error("nothing to do: pass --tcp-serve")
    listener, address = serve_tcp(args.host, args.port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"tcp listening on {address}", flush=True)
    stop.wait()
    listener.close()


def write_json(obj: Any, out: IO[str] = sys.stdout) -> None:
    json.dump(obj, out, indent=2)
    out.write("\n")
    out.flush()


if __name__ == "__main__":
    _serve_main()
