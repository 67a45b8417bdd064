"""The server's end of Step calls over a socket (see wire/local_socket.py): an abstract Unix socket
with a random name, offered at Join to workers on this host, and a TCP port of its bound host (in
TLS on a server with TLS), offered to the others; a thread per connection reads a Step request
(or a PullRows one: a forward's read of rows), runs the servicer's handler with a context that
holds the call's metadata and deadline, and writes its reply or its error status back.
Connections are bound to a worker rank by the token of the Join answer, and their number is
capped."""
from __future__ import annotations

import logging
import secrets
import socket
import ssl
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import grpc

from psgrad.errors import InvalidRequestError, PermissionDeniedError
from psgrad.proto import ps_pb2 as pb
from psgrad.server.scheduling import PeerCores, batch_thread
from psgrad.wire import local_socket, protocol
from psgrad.wire.frames import DETACHED_KEY

log = logging.getLogger("psgrad.server")

MAX_CONNECTIONS = 256  # beyond this many open connections, new ones are closed at once


class _Aborted(Exception):
    """context.abort: the call ends with this status (as gRPC's abort, it raises)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class LocalContext:
    """What a Step handler uses of a grpc.ServicerContext, for a call over the socket."""

    def __init__(self, metadata: local_socket.Metadata, timeout_s: float, conn: socket.socket | None = None) -> None:
        self._metadata, self._conn = metadata, conn
        self._deadline = time.monotonic() + timeout_s
        self._trailing: local_socket.Metadata = ()
        self._code: grpc.StatusCode | None = None
        self._callbacks: list[Callable[[], Any]] = []
        self.detached: memoryview | None = None  # the row gradients the body carried before its message

    def invocation_metadata(self) -> local_socket.Metadata:
        return self._metadata

    def time_remaining(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    def is_active(self) -> bool:
        """False once the worker closed its end (a pull waiting at its gate then stops waiting, as
        a cancelled gRPC call's does; the worker sends nothing else while it waits for a reply)."""
        if self._conn is None:
            return True
        try:  # (the connection's own bytes: TLS takes no flags, and a peek of its records consumes nothing)
            return socket.socket.recv(self._conn, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            return True
        except OSError:
            return False

    def add_callback(self, callback: Callable[[], Any]) -> bool:
        self._callbacks.append(callback)
        return True

    def set_trailing_metadata(self, metadata: Any) -> None:
        self._trailing = tuple((str(k), str(v)) for k, v in metadata)

    def trailing_metadata(self) -> local_socket.Metadata:
        return self._trailing

    def send_initial_metadata(self, metadata: Any) -> None:
        """(a Step sends none; accepted and dropped)"""

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self._code = code
        raise _Aborted(code, details)

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def ended(self) -> None:
        """The call ended: its callbacks run, as gRPC runs them when a call terminates."""
        for callback in self._callbacks:
            try:
                callback()
            except Exception:  # noqa: BLE001 (a callback's failure must not end the connection)
                log.exception("a local call's callback failed")


def _message(context: LocalContext, body: bytearray) -> memoryview:
    """The message of a Step request's body: all of it, or, where the metadata says the body
    begins with the push's row gradients (wire.frames DETACHED_KEY), what follows them, which are
    kept in context.detached (the request's rows take them from there, where they arrived).
    Refuses a count that is not one of the body's (INVALID_ARGUMENT)."""
    view = memoryview(body)
    value = next((v for k, v in context.invocation_metadata() if k == DETACHED_KEY), None)
    if value is None:
        return view
    if not value.isdigit() or int(value) > len(body):
        protocol.abort(context, InvalidRequestError(f"a Step call over the socket says its first {value!r} bytes are "
                                                    f"row gradients, of a body of {len(body)} bytes"))
    context.detached = view[: int(value)]
    return view[int(value):]


def detached(context: Any) -> memoryview | None:
    """The row gradients a Step call over the socket carried beside its message (see _message);
    None: none, or a gRPC call's context."""
    return context.detached if isinstance(context, LocalContext) else None


class LocalCalls:
    """The socket, its connections' threads, and the offer Join makes."""

    def __init__(self, step: Callable[[pb.StepRequest, Any], bytes],
                 done: Callable[[str, float, Any], None] | None = None, unix: bool = True,
                 tcp: tuple[str, int] | None = None, tls: ssl.SSLContext | None = None,
                 reads: Callable[[pb.RowsRequest, Any], bytes] | None = None, batch: bool = False,
                 follow: bool = False) -> None:
        """step: the servicer's Step handler; reads: its PullRows handler, where the sockets take
        reads of rows too (None: they take Step calls only); done(method, start, context): a call's end, for the
        server's call metrics (RpcMetrics._done), or None; unix: listen on an abstract Unix socket
        (Linux); tcp: also listen on TCP at (host, port), port 0 a free one (then `tcp_port`), in
        TLS with `tls` (each connection's handshake on its own thread, within HELLO_TIMEOUT_S);
        batch: the sockets' threads run under SCHED_BATCH (see scheduling.py); follow: a Unix
        socket connection's thread runs on its worker's cores (scheduling.py's PeerCores).

        Raises:
            OSError: the TCP port cannot be bound.
        """
        self._step, self._done, self._tls = step, done, tls
        self._reads, self._batch, self._follow = reads, batch, follow
        self._decode = protocol.decoder(pb.StepRequest)
        self._decode_reads = protocol.decoder(pb.RowsRequest)
        self._key = secrets.token_bytes(32)
        name = f"psgrad-{secrets.token_hex(12)}"
        self.name = name if unix else None
        self._listeners: list[socket.socket] = []
        self.tcp_port: int | None = None
        try:
            if unix:
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._listeners.append(listener)
                listener.bind("\0" + name)
            if tcp is not None:
                listener = _tcp_listener(*tcp)
                self._listeners.append(listener)
                self.tcp_port = listener.getsockname()[1]
        except OSError:
            for listener in self._listeners:
                listener.close()
            raise
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._closed = False
        self.calls = 0  # Step calls served (status and tests)
        self.read_calls = 0  # PullRows calls served
        for listener in self._listeners:
            listener.listen(64)
            kind = "tcp" if listener.family != socket.AF_UNIX else "local"
            threading.Thread(target=self._accept, args=(listener,), name=f"psgrad-{kind}-accept", daemon=True).start()

    @property
    def takes_reads(self) -> bool:
        """Whether the sockets take PullRows calls (a Join answer says so: local_socket.READS_KEY)."""
        return self._reads is not None

    def offer(self, rank: int) -> tuple[str, str] | None:
        """The Join answer's metadata entry for worker rank `rank` (on this host), or None (no
        Unix socket)."""
        return local_socket.offer(self.name, self._key, rank) if self.name is not None else None

    def tcp_offer(self, rank: int) -> tuple[str, str] | None:
        """The Join answer's metadata entry offering the TCP socket to worker rank `rank`, or None
        (none)."""
        return local_socket.tcp_offer(self.tcp_port, self._key, rank) if self.tcp_port is not None else None

    def close(self) -> None:
        """Stop listening and end every connection (their workers' next calls go through gRPC)."""
        with self._lock:
            self._closed = True
            socks = list(self._open)
            self._open.clear()
        for s in [*self._listeners, *socks]:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _accept(self, listener: socket.socket) -> None:
        batch_thread(self._batch)  # (the connections' threads it starts inherit the policy)
        while True:
            try:
                conn, _ = listener.accept()
                local_socket.widen(conn)
                local_socket.nodelay(conn)
                if self._tls is not None and listener.family != socket.AF_UNIX:
                    conn = self._tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
            except OSError:
                return  # closed
            with self._lock:
                admitted = not self._closed and len(self._open) < MAX_CONNECTIONS
                if admitted:
                    self._open.add(conn)
            if not admitted:
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="psgrad-local", daemon=True).start()

    def _hello(self, conn: socket.socket) -> int | None:
        """The rank a connection's first message proves (its token), or None (refused, told why);
        over TLS, after the handshake (a peer without a certificate the server requires fails it)."""
        conn.settimeout(local_socket.HELLO_TIMEOUT_S)
        if isinstance(conn, ssl.SSLSocket):
            conn.do_handshake()
        metadata, _, _ = local_socket.receive(conn, max_body=0)
        fields = dict(metadata)
        rank = fields.get("rank", "")
        token = fields.get("token", "").encode(errors="replace")
        if rank.isdigit() and secrets.compare_digest(token, local_socket.token(self._key, int(rank)).encode()):
            local_socket.send(conn, (), 0.0, b"")
            conn.settimeout(None)
            return int(rank)
        local_socket.send(conn, (), 1.0, b"no valid token for the rank named (a Join answer offers one)")
        return None

    def _serve(self, conn: socket.socket) -> None:
        try:
            rank = self._hello(conn)
            cores = PeerCores(conn, self._follow)
            while rank is not None:
                metadata, timeout_s, body = local_socket.receive(conn)
                cores.follow()
                self._call(conn, rank, metadata, timeout_s, body)
        except (local_socket.ChannelLost, OSError):
            pass  # the worker went away, or the server closed the socket
        finally:
            with self._lock:
                self._open.discard(conn)
            conn.close()

    def _call(self, conn: socket.socket, rank: int, metadata: local_socket.Metadata, timeout_s: float,
              body: bytearray) -> None:
        context = LocalContext(metadata, timeout_s, conn)
        method = next((v for k, v in metadata if k == local_socket.METHOD_KEY), "Step")
        start = time.perf_counter()
        try:
            reply = self._read(context, rank, body) if method == "PullRows" else self._stepped(context, rank, method, body)
        except _Aborted as stop:
            self._answer_error(conn, context, stop.code, stop.details)
        except Exception as exc:  # noqa: BLE001 (as gRPC answers a handler's bug: UNKNOWN)
            traceback.print_exc()
            context._code = grpc.StatusCode.UNKNOWN
            self._answer_error(conn, context, grpc.StatusCode.UNKNOWN, f"Exception calling application: {exc}")
        else:
            if method == "PullRows":
                self.read_calls += 1
            else:
                self.calls += 1
            local_socket.send(conn, context.trailing_metadata(), 0.0, reply)
        finally:
            context.ended()
            if self._done is not None:
                self._done(method if method == "PullRows" else "Step", start, context)

    def _stepped(self, context: LocalContext, rank: int, method: str, body: bytearray) -> bytes:
        """A Step call's reply (raises _Aborted where it is refused)."""
        if method != "Step":
            context.abort(grpc.StatusCode.UNIMPLEMENTED, f"method {method!r} is not served over this socket "
                                                         "(Step and PullRows are)")
        request = self._decode(_message(context, body))  # (as gRPC's deserializer: an Undecodable is refused)
        if isinstance(request, protocol.Undecodable):
            protocol.abort(context, request.error)
        elif request.push.rank != rank:
            protocol.abort(context, PermissionDeniedError(f"this connection is worker {rank}'s: it cannot push as "
                                                          f"worker {request.push.rank}"))
        return self._step(request, context)

    def _read(self, context: LocalContext, rank: int, body: bytearray) -> bytes:
        """A PullRows call's reply (raises _Aborted where it is refused)."""
        if self._reads is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this server's sockets take Step calls only")
        assert self._reads is not None
        request = self._decode_reads(memoryview(body))
        if isinstance(request, protocol.Undecodable):
            protocol.abort(context, request.error)
        elif request.rank != rank:
            protocol.abort(context, PermissionDeniedError(f"this connection is worker {rank}'s: it cannot read as "
                                                          f"worker {request.rank}"))
        return self._reads(request, context)

    @staticmethod
    def _answer_error(conn: socket.socket, context: LocalContext, code: grpc.StatusCode, details: str) -> None:
        metadata = (*context.trailing_metadata(), (local_socket.CODE_KEY, code.name))
        local_socket.send(conn, metadata, 1.0, details.encode())


def _tcp_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) (host as gRPC binds it: a name, an address, [V6], or
    0.0.0.0 / [::] for every interface), its buffers widened for the connections it accepts."""
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    family, kind, proto, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    listener = socket.socket(family, kind, proto)
    try:
        local_socket.widen(listener)
        # A restarted server may take its --step-port again while the last one's connections linger
        # in TIME_WAIT (Linux still refuses a port another socket listens on).
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(sockaddr)
    except OSError:
        listener.close()
        raise
    return listener
