"""Ceilings measured in the same run as psgrad: loopback TCP (plain sockets, a separate server
process, 1 MiB sends, recv_into a reused buffer) and memory copies.

The TCP server runs as a child (`start_server(name, lib_argv("ceilings:tcp_serve_main"))`, or by
hand: `cd benchmarks && python -m lib.ceilings`) and prints `tcp listening on HOST:PORT`. Nothing
here imports torch at module level, so that server starts fast.
"""
from __future__ import annotations

import argparse
import signal
import socket
import threading
import time
from collections.abc import Callable

MIB = 1 << 20
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


def serve_until_signalled(announce: str, close: Callable[[], object]) -> None:
    """Print `announce` (the parent waits for it), then block until SIGTERM or SIGINT and call close()."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(announce, flush=True)
    stop.wait()
    close()


def tcp_serve_main() -> None:
    parser = argparse.ArgumentParser(prog="lib.ceilings", description="Serve the loopback TCP ceiling until SIGTERM.")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one")
    args = parser.parse_args()
    listener, address = serve_tcp(args.host, args.port)
    serve_until_signalled(f"tcp listening on {address}", listener.close)


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


if __name__ == "__main__":
    tcp_serve_main()
