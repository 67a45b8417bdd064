"""The ceiling psgrad is measured against: raw gRPC streaming of bytes, no protobuf, ~1 MiB chunks.

Methods on generic handlers with identity (de)serializers: Upload (client streams chunks, the
server copies them into a reused buffer), Download (the server streams chunks of a buffer), Ping
(a unary echo: the round-trip ceiling for small calls), and two unary calls of one message each
way, the ceiling of unary transfers such as sparse rows: Fetch (a small request naming a reply
size, answered with that many bytes of a buffer) and Put (a request copied into a reused buffer,
answered with its length). Concurrent uploads each get
their own receive buffer from a pool, so W client processes can be measured at once.

The server runs as a child (`start_server(name, lib_argv("raw_grpc:main"))`, or by hand:
`cd benchmarks && python -m lib.raw_grpc`) and prints `raw grpc listening on HOST:PORT`; import
this module for the client side. With `--upload-work sgd` the server does, per uploaded chunk,
what a psgrad shard does with a float32 push instead of the copy: a finiteness sum and an
out-of-place SGD update of a weight vector (torch, one thread). That is not a ceiling but a
diagnostic: how fast bare gRPC goes with the parameter server's own arithmetic.
`--upload-work sgd-in-place` updates the weights in place instead, as psgrad does not (a push
must apply whole or not at all, and a pull must never see half of one): it shows what writing
the next weights beside the current ones costs over overwriting them.

psgrad_with_raw_main runs a psgrad shard server whose gRPC server also serves these methods, three
times over: `rawbench.Raw` (Upload copies each chunk, the ceiling's work), `rawbench.RawSgd`
(Upload does a shard's per-chunk finiteness sum and SGD update into the next weights) and
`rawbench.RawSgdInPlace` (the same update, in place). A psgrad push and the three raw uploads then
share one server process, its gRPC settings and its memory, so comparing them leaves out what
differs between processes (on a shared 2-vCPU machine two instances of the same server can differ
by 15%). It prints `psgrad server listening on HOST:PORT` and stops on SIGTERM; transport.py uses
it for `diagnostics`.
"""
from __future__ import annotations

import argparse
import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import numpy as np

from lib.args import window_bytes_arg
from lib.ceilings import serve_until_signalled

SERVICE = "rawbench.Raw"
SGD_SERVICE = "rawbench.RawSgd"
SGD_IN_PLACE_SERVICE = "rawbench.RawSgdInPlace"
UPLOAD_WORK = ("copy", "sgd", "sgd-in-place")
OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


class _State:
    def __init__(self) -> None:
        self.buf = np.zeros(0, dtype=np.uint8)  # the download source
        self.lock = threading.Lock()
        self.free: list[np.ndarray] = []  # receive buffers not in use by an upload
        self.sgd: tuple[Any, Any] | None = None  # (weights, next weights) for --upload-work sgd[-in-place]

    def take(self) -> np.ndarray:
        with self.lock:
            return self.free.pop() if self.free else np.zeros(0, dtype=np.uint8)

    def give(self, buf: np.ndarray) -> None:
        with self.lock:
            self.free.append(buf)


def _sgd_upload(state: _State, chunks: Iterator[bytes], in_place: bool) -> int:
    """Per chunk: sum it (a NaN/inf check) and write weights - 1e-9 * chunk into the next weights
    (in_place: into the weights themselves)."""
    import math

    import torch

    off = 0
    for chunk in chunks:
        g = torch.frombuffer(chunk, dtype=torch.float32)
        a, b = off // 4, off // 4 + g.numel()
        with state.lock:
            if state.sgd is None or state.sgd[0].numel() < b:
                state.sgd = (torch.zeros(2 * b), torch.empty(2 * b))
            w, out = state.sgd
        if not math.isfinite(float(g.sum())):
            raise ValueError("non-finite chunk")
        torch.add(w[a:b], g, alpha=-1e-9, out=w[a:b] if in_place else out[a:b])
        off += len(chunk)
    return off


def raw_handler(work: str = "copy", service: str = SERVICE) -> grpc.GenericRpcHandler:
    """The raw methods under `service`; Upload does `work` (one of UPLOAD_WORK, see --upload-work)."""
    if work not in UPLOAD_WORK:
        raise ValueError(f"unknown upload work {work!r}: expected one of {', '.join(UPLOAD_WORK)}")
    state = _State()

    def upload(chunks: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        """Receive chunks and copy each into a reused buffer (what any receiver must do)."""
        if work != "copy":
            return _sgd_upload(state, chunks, in_place=work == "sgd-in-place").to_bytes(8, "little")
        buf = state.take()
        off = 0
        try:
            for chunk in chunks:
                n = len(chunk)
                if off + n > len(buf):
                    grown = np.empty(off + n, dtype=np.uint8)
                    grown[:off] = buf[:off]
                    buf = grown
                buf[off : off + n] = np.frombuffer(chunk, dtype=np.uint8)
                off += n
        finally:
            state.give(buf)
        return off.to_bytes(8, "little")

    def download(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        """Stream `nbytes` from a buffer, making one bytes object per chunk (what any sender must do)."""
        nbytes = int.from_bytes(request[:8], "little")
        chunk = int.from_bytes(request[8:16], "little")
        with state.lock:
            if len(state.buf) < nbytes:
                state.buf = np.ones(nbytes, dtype=np.uint8)
            view = state.buf.data[:nbytes]
        for off in range(0, nbytes, chunk):
            yield bytes(view[off : off + chunk])

    def fetch(request: bytes, context: grpc.ServicerContext) -> bytes:
        """Answer with the number of bytes the request's first 8 name (the rest is payload the
        caller sends along, such as row ids), copied from a buffer into one bytes object."""
        nbytes = int.from_bytes(request[:8], "little")
        with state.lock:
            if len(state.buf) < nbytes:
                state.buf = np.ones(nbytes, dtype=np.uint8)
            view = state.buf.data[:nbytes]
        return bytes(view)

    def put(request: bytes, context: grpc.ServicerContext) -> bytes:
        """Copy the request into a reused buffer; answer with its length."""
        buf = state.take()
        try:
            if len(buf) < len(request):
                buf = np.empty(len(request), dtype=np.uint8)
            buf[: len(request)] = np.frombuffer(request, dtype=np.uint8)
        finally:
            state.give(buf)
        return len(request).to_bytes(8, "little")

    return grpc.method_handlers_generic_handler(
        service,
        {
            "Upload": grpc.stream_unary_rpc_method_handler(upload),
            "Download": grpc.unary_stream_rpc_method_handler(download),
            "Ping": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req),
            "Fetch": grpc.unary_unary_rpc_method_handler(fetch),
            "Put": grpc.unary_unary_rpc_method_handler(put),
        },
    )


def serve(host: str = "127.0.0.1", port: int = 0, upload_work: str = "copy") -> tuple[grpc.Server, str]:
    if upload_work != "copy":
        import torch

        torch.set_num_threads(1)  # as a psgrad shard server runs by default
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=[*OPTIONS, ("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((raw_handler(upload_work),))
    bound = server.add_insecure_port(f"{host}:{port}")
    server.start()
    return server, f"{host}:{bound}"


class RawClient:
    """Client of the raw service; upload/download move `payload` bytes in `chunk`-byte messages."""

    def __init__(self, address: str, service: str = SERVICE) -> None:
        self.channel = grpc.insecure_channel(address, options=OPTIONS)
        self._upload = self.channel.stream_unary(f"/{service}/Upload")
        self._download = self.channel.unary_stream(f"/{service}/Download")
        self._ping = self.channel.unary_unary(f"/{service}/Ping")
        self._fetch = self.channel.unary_unary(f"/{service}/Fetch")
        self._put = self.channel.unary_unary(f"/{service}/Put")

    def upload(self, payload: memoryview, chunk: int) -> int:
        def gen() -> Iterator[bytes]:
            for off in range(0, len(payload), chunk):
                yield bytes(payload[off : off + chunk])

        return int.from_bytes(self._upload(gen(), timeout=120), "little")

    def download(self, dest: memoryview, chunk: int) -> int:
        req = len(dest).to_bytes(8, "little") + chunk.to_bytes(8, "little")
        off = 0
        for piece in self._download(req, timeout=120):
            dest[off : off + len(piece)] = piece
            off += len(piece)
        return off

    def ping(self, payload: bytes = b"x") -> bytes:
        """One unary round trip with a tiny request and reply."""
        return self._ping(payload, timeout=10)

    def fetch(self, payload: bytes, dest: memoryview) -> int:
        """One unary call: send payload, receive len(dest) bytes into dest."""
        reply = self._fetch(len(dest).to_bytes(8, "little") + payload, timeout=120)
        dest[:] = reply
        return len(reply)

    def put(self, payload: bytes) -> int:
        """One unary call carrying payload; the server's count of the bytes it received."""
        return int.from_bytes(self._put(payload, timeout=120), "little")

    def close(self) -> None:
        self.channel.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="lib.raw_grpc", description="Serve the raw gRPC ceiling until SIGTERM.")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one")
    parser.add_argument(
        "--upload-work",
        choices=UPLOAD_WORK,
        default="copy",
        help="what Upload does with each chunk: copy it into a buffer (the ceiling; default), a "
        "psgrad shard's finiteness sum and SGD update of float32 weights into the next weights "
        "(sgd), or the same update in place (sgd-in-place); the last two are diagnostics",
    )
    args = parser.parse_args()
    server, address = serve(args.host, args.port, args.upload_work)
    serve_until_signalled(f"raw grpc listening on {address}", lambda: server.stop(0).wait())


def psgrad_with_raw_main() -> None:
    """What `psgrad server` runs (default settings, torch on one thread, 127.0.0.1, port 0), with
    the raw methods added to its gRPC server (see the module's docstring)."""
    from psgrad.config import ServerConfig

    parser = argparse.ArgumentParser(prog="lib.raw_grpc psgrad-with-raw",
                                     description="A psgrad shard server that also serves raw gRPC uploads.")
    parser.add_argument("--lease-s", type=float, default=600.0, help="worker lease in seconds (default: 600)")
    parser.add_argument(
        "--stream-window-bytes",
        type=window_bytes_arg,
        default=ServerConfig.stream_window_bytes,
        help="as `psgrad server --stream-window-bytes` (0 = gRPC's automatic windows; "
        f"default: {ServerConfig.stream_window_bytes})",
    )
    args = parser.parse_args()
    import torch

    from psgrad.server.runtime import serve_forever

    torch.set_num_threads(1)  # as `psgrad server` (its --torch-threads default)
    extra = (
        raw_handler("copy", SERVICE),
        raw_handler("sgd", SGD_SERVICE),
        raw_handler("sgd-in-place", SGD_IN_PLACE_SERVICE),
    )
    config = ServerConfig(host="127.0.0.1", port=0, lease_s=args.lease_s, stream_window_bytes=args.stream_window_bytes)
    serve_forever(config, lambda address: print(f"psgrad server listening on {address}", flush=True), extra)


if __name__ == "__main__":
    main()
