"""Same-host Step calls over a local socket: a worker on a server's host makes its per-iteration Step
call through a Unix socket the server listens on, not through gRPC.

Why: on one host a Step call's payloads already travel through shared memory (wire/shm.py), and
what is left of the call is gRPC's own per-call work — HTTP/2 framing, completion queues, the
hand-off from gRPC's polling thread to a handler thread, and back — which costs both ends about a
millisecond of CPU a call on this project's 2-core machine, more than the shard's handling of a
small model's push. A socket carries the same request bytes and reply bytes, with a blocking
read on each side (benchmarks/dlrm.py: docs/benchmarks/dlrm.md).

What it is: the server listens on an abstract Unix socket (Linux; a random name, in the server's
network namespace, so another host or test-bed host cannot reach it) and offers it in a Join's
answer (initial metadata `psgrad-local: NAME RANK TOKEN`), with a token that binds a connection to
the joining worker's rank: HMAC-SHA256 of the rank under a key the server draws at start. Only a
caller the server authenticated as that rank (or anyone, on a server that checks no one, which
takes anyone's gRPC calls too) ever sees the token. A connection's first message names the rank
and the token; every Step request on it must push as that rank. Everything else a Step does is the
gRPC handler's own: the server calls the same method with a context that carries the call's
metadata and deadline, and answers with its reply, or its status code, details and trailing
metadata (the psgrad error's class), which the worker raises as a gRPC error
(LocalCallError), so retries, failover and error messages are those of the gRPC call.

A training forward's read of rows (PullRows, where no step brought them: a model without a
pipeline) goes over the same connection, where the server's Join answer says it takes them
(`psgrad-socket-reads: 1`): metadata `psgrad-method: PullRows`, the serialized RowsRequest, whose
rank must be the connection's, and the RowsReply's bytes back. A read never waits for a Step call
of another thread on the connection: it goes through gRPC then (Offered.read). A read is safe to
make again, so one whose connection fails goes through gRPC at once.

A worker whose connection fails (the server restarted, or closed it) makes that call, and every
later one, through gRPC until a Join offers a socket again; a push is keyed, so a call that may
have reached the server is safe to make again.

Messages, both ways: a header `<I I d` (metadata length, body length, a number: the request's
timeout in seconds; the reply's status, 0 for OK), the metadata as JSON (a list of [key, value]
pairs), then the body (the serialized StepRequest; the StepReply, or an error's details in UTF-8).
A request whose push carries row gradients sends them first, beside the message rather than in it
(metadata `psgrad-detached: N`, wire.frames DETACHED_KEY: the body's first N bytes), so that the
server's rows are a view of the bytes that arrived: protobuf would copy a megabyte of them twice
more, parsing the request and reading the field (about a sixth of a server's CPU a call in
benchmarks/transport.py --part sparse-rows). Both ends widen their socket's buffers (widen) so
that a message goes in one piece.

Across hosts, the same messages go over TCP: a server also listens on a TCP port of its bound host
and offers it at Join (`psgrad-step-socket: PORT RANK TOKEN`); a worker whose payloads go through
gRPC frames (another host, or --no-shared-memory) makes its Step calls there, at the host it
reaches the server's gRPC port at. What that saves is gRPC's per-call work, which for a
recommender's step (a megabyte of row gradients) is most of the call: a 1 MB request and a small
reply take about 0.35 ms a round trip over loopback TCP, 3.3 ms as one gRPC unary call
(benchmarks/transport.py --part sparse-rows). A server with TLS speaks TLS there, with the
certificates of its gRPC port (client certificates of its CA required where it requires them
there); a server without TLS and without a job secret checks no caller on its gRPC port either
(anyone who reaches it may call Step as any rank), so its plaintext socket opens nothing new. A
server with a job secret but no TLS (gRPC's local credentials: this host only) offers none. A
worker that cannot connect (a firewall, a load balancer in front of one port) warns once and
stays on gRPC until a Join offers a socket again.
"""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import socket
import ssl
import struct
import sys
import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

import grpc

from psgrad.proto import ps_pb2 as pb
from psgrad.wire.protocol import MAX_MESSAGE_BYTES

METADATA_KEY = "psgrad-local"  # a Join answer's offer: "NAME RANK TOKEN"
TCP_METADATA_KEY = "psgrad-step-socket"  # a Join answer's offer of its TCP socket: "PORT RANK TOKEN"
CODE_KEY = "psgrad-local-code"  # an error reply's status code (its name), among its metadata
METHOD_KEY = "psgrad-method"  # a request's method, where it is not Step: "PullRows"
READS_KEY = "psgrad-socket-reads"  # a Join answer's word that its sockets take PullRows calls too: "1"
_HEADER = struct.Struct("<IId")
_MAX_METADATA = 1 << 16
SOCKET_BUFFER_BYTES = 4 << 20  # each end's send and receive buffers (see widen)
HELLO_TIMEOUT_S = 5.0  # a connection that does not name its rank and token within this is closed

Metadata = tuple[tuple[str, str], ...]


def widen(sock: socket.socket) -> None:
    """Let a Step's request or reply go into the socket in one piece: buffers of SOCKET_BUFFER_BYTES
    (or the system's limit, net.core.wmem_max / rmem_max, where that is less). A recommender's
    request (a few thousand row gradients) passes Linux's default 208 KiB; then the sender waits
    for the reader to drain the buffer and wakes it again for the rest, which cost both ends
    half again as much CPU as the copies (a 270 KB request and a 220 KB reply: about 150 µs of
    CPU each end a round trip, 95 with the wider buffers, and half the time)."""
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        except OSError:  # (the system refuses: its default stands)
            pass


def supported() -> bool:
    """Whether this platform has abstract Unix sockets (Linux)."""
    return sys.platform.startswith("linux") and hasattr(socket, "AF_UNIX")


def token(key: bytes, rank: int) -> str:
    """The token that binds a connection to worker rank `rank` (see the module doc)."""
    return hmac.new(key, f"psgrad-local-rank-{rank}".encode(), hashlib.sha256).hexdigest()


def offer(name: str, key: bytes, rank: int) -> tuple[str, str]:
    """The Join answer's metadata entry offering the socket `name` to worker rank `rank`."""
    return METADATA_KEY, f"{name} {rank} {token(key, rank)}"


def offer_in(metadata: Sequence[tuple[str, Any]] | None, key: str = METADATA_KEY) -> tuple[str, int, str] | None:
    """(name, rank, token) of the socket a Join answer offers; None where it offers none. With
    key=TCP_METADATA_KEY: (port, rank, token) of its TCP socket (the port as text)."""
    value = next((str(v) for k, v in metadata or () if k == key), None)
    parts = value.split() if value is not None else []
    if len(parts) != 3 or not parts[1].isdigit() or (key == TCP_METADATA_KEY and not parts[0].isdigit()):
        return None
    return parts[0], int(parts[1]), parts[2]


def reads_offered(metadata: Sequence[tuple[str, Any]] | None) -> bool:
    """Whether a Join answer says the server's sockets take PullRows calls (READS_KEY)."""
    return any(k == READS_KEY and str(v) == "1" for k, v in metadata or ())


def tcp_offer(port: int, key: bytes, rank: int) -> tuple[str, str]:
    """The Join answer's metadata entry offering the TCP socket at `port` to worker rank `rank`."""
    return TCP_METADATA_KEY, f"{port} {rank} {token(key, rank)}"


class ChannelLost(Exception):
    """The connection failed or was closed (the call may or may not have reached the server)."""


Body = bytes | bytearray | memoryview | Sequence[bytes | memoryview]


def send(sock: socket.socket, metadata: Sequence[tuple[str, str]], number: float, body: Body) -> None:
    """One message (see the module doc); body: its bytes, or pieces of them (sent as they are).

    Raises:
        ChannelLost: the connection failed.
        socket.timeout: the other end took none of it within the socket's timeout (as receive).
    """
    parts = [body] if isinstance(body, (bytes, bytearray, memoryview)) else body
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    md = json.dumps([list(p) for p in metadata]).encode() if metadata else b""
    head = _HEADER.pack(len(md), sum(len(v) for v in views), number) + md
    # One system call for the whole message: the reader, waiting for the header, wakes once for
    # all of it (two sends cost a wake-up and a context switch more per message).
    views.insert(0, memoryview(head))
    try:
        if isinstance(sock, ssl.SSLSocket):  # (TLS takes no scattered sends: one buffer, encrypted in records)
            sock.sendall(b"".join(views))
            return
        while views:
            sent = sock.sendmsg(views)
            # (a send stops short where the socket's buffer fills before its timeout, or a signal)
            while views and sent >= len(views[0]):
                sent -= len(views.pop(0))
            if sent:
                views[0] = views[0][sent:]
    except socket.timeout:
        raise
    except OSError as exc:
        raise ChannelLost(str(exc)) from None


def _exactly(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    # (a blocking socket's read returns once all of it came: one system call, where a megabyte
    # otherwise takes several, as it arrives; TLS takes no flags)
    flags = 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_WAITALL
    while got < n:
        try:
            k = sock.recv_into(view[got:], n - got, flags)
        except socket.timeout:
            raise
        except OSError as exc:
            raise ChannelLost(str(exc)) from None
        if not k:
            raise ChannelLost("the other end closed the connection")
        got += k
    return buf


def receive(sock: socket.socket, max_body: int = MAX_MESSAGE_BYTES) -> tuple[Metadata, float, bytearray]:
    """One message: (metadata, its number, body).

    Raises:
        ChannelLost: the connection ended, or the message is malformed or too large (nothing
            sensible can follow it on this connection).
        socket.timeout: none arrived within the socket's timeout.
    """
    md_len, body_len, number = _HEADER.unpack(_exactly(sock, _HEADER.size))
    if md_len > _MAX_METADATA or body_len > max_body:
        raise ChannelLost(f"a message of {md_len} + {body_len} bytes, more than a call may carry")
    try:
        pairs = json.loads(bytes(_exactly(sock, md_len))) if md_len else []
        metadata = tuple((str(k), str(v)) for k, v in pairs)
    except (ValueError, TypeError) as exc:
        raise ChannelLost(f"malformed metadata: {exc}") from None
    return metadata, number, _exactly(sock, body_len) if body_len else bytearray()


class LocalCallError(grpc.RpcError, grpc.Call):
    """A Step call over the socket ended with an error status: raised as the gRPC call's would be."""

    def __init__(self, code: grpc.StatusCode, details: str, trailing: Metadata = ()) -> None:
        super().__init__(details)
        self._code, self._details, self._trailing = code, details, trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> Metadata:
        return self._trailing

    def initial_metadata(self) -> Metadata:
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> float | None:
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Any) -> bool:
        return False


class LocalCall:
    """What a finished call tells besides its reply (as grpc.Call does): its metadata."""

    def __init__(self, trailing: Metadata) -> None:
        self._trailing = trailing

    def trailing_metadata(self) -> Metadata:
        return self._trailing

    def initial_metadata(self) -> Metadata:
        return ()


class LocalChannel:
    """A worker's connection to one server's socket, bound to its rank (one call at a time: the
    caller serializes them, as a shard's Step calls are).

    Raises (connect):
        ChannelLost: the socket cannot be reached, or the server refused the rank and token.
    """

    def __init__(self, name: str, rank: int, token_: str, tcp: tuple[str, int] | None = None,
                 tls: ssl.SSLContext | None = None, server_name: str | None = None) -> None:
        """name: the server's abstract Unix socket; or with tcp=(host, port), its TCP socket (name
        then only names it in messages), with tls over TLS (the server's certificate checked for
        server_name, else the host)."""
        self.name = name
        what = f"local socket {name}" if tcp is None else f"step socket {name}"
        try:
            if tcp is not None:  # (widened before it connects: the window a TCP connection offers is set then)
                self._sock = connect_tcp(tcp, HELLO_TIMEOUT_S)
                if tls is not None:
                    self._sock = tls.wrap_socket(self._sock, server_hostname=server_name or tcp[0])
            else:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                widen(self._sock)
                self._sock.settimeout(HELLO_TIMEOUT_S)
                self._sock.connect("\0" + name)
            send(self._sock, (("rank", str(rank)), ("token", token_)), 0.0, b"")
            _, status, body = receive(self._sock)
        except (OSError, ChannelLost) as exc:
            self.close()
            raise ChannelLost(f"{what}: {exc}") from None
        if status:
            self.close()
            raise ChannelLost(f"{what} refused this worker: {bytes(body).decode(errors='replace')}")

    def with_call(self, request: Body, timeout: float, metadata: Metadata = ()) -> tuple[pb.StepReply, LocalCall]:
        """The Step call: (its reply, its call) as gRPC's with_call returns them (start, then finish).

        Raises:
            LocalCallError: the server answered with an error status, or the deadline passed (the
                connection is closed then: a late reply must not answer the next call).
            ChannelLost: the connection failed (closed).
        """
        self.start(request, timeout, metadata)
        return self.finish()

    def start(self, request: Body, timeout: float, metadata: Metadata = ()) -> None:
        """Send a Step call's request; its reply is read by finish (a caller may send other
        servers' calls in between: each server works on its call meanwhile).

        Raises:
            LocalCallError: the deadline passed before the request was taken (closed).
            ChannelLost: the connection failed (closed).
        """
        with self._failures():
            self._sock.settimeout(timeout)
            send(self._sock, metadata, float(timeout), request)

    def finish(self) -> tuple[pb.StepReply, LocalCall]:
        """The reply to the request start sent: (the reply, its call).

        Raises:
            LocalCallError: the server answered with an error status, or the deadline passed (the
                connection is closed then: a late reply must not answer the next call).
            ChannelLost: the connection failed (closed).
        """
        body, call = self.finish_bytes()
        return pb.StepReply.FromString(body), call  # (parsed as it lies: no bytes() of it first)

    def finish_bytes(self) -> tuple[bytearray, LocalCall]:
        """The reply to the request start sent, as its bytes (raises as finish)."""
        with self._failures():
            md, status, body = receive(self._sock)
        if status:
            code = next((v for k, v in md if k == CODE_KEY), "UNKNOWN")
            trailing = tuple((k, v) for k, v in md if k != CODE_KEY)
            raise LocalCallError(grpc.StatusCode[code] if code in grpc.StatusCode.__members__ else grpc.StatusCode.UNKNOWN,
                                 bytes(body).decode(errors="replace"), trailing)
        return body, LocalCall(md)

    @contextlib.contextmanager
    def _failures(self) -> Iterator[None]:
        """A socket's failure as the call's: the deadline passed (LocalCallError), or the connection
        failed (ChannelLost); the connection is closed either way."""
        try:
            yield
        except socket.timeout:
            self.close()
            raise LocalCallError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except ChannelLost:
            self.close()
            raise
        except OSError as exc:  # (closed already)
            self.close()
            raise ChannelLost(str(exc)) from None

    def close(self) -> None:
        try:
            self._sock.close()
        except (OSError, AttributeError):  # (AttributeError: a connection never made)
            pass


Offer = tuple[str, int, str]  # what a Join answer offers: (name or port, rank, token)


class Offered:
    """A worker's Step calls to one server's socket (its local or its TCP one): the offer the last
    Join answer made, the connection made to it at the first call after, and the calls made over
    it. A connection that cannot be made, or fails during a call, is given up until a Join offers
    a socket again (`failed` says why it could not be made, for the transport to warn); a call past
    its deadline, or abandoned between its stages, closes its connection (its late reply must not
    answer the next call), and the next call connects again."""

    def __init__(self, connect: Callable[[Offer], LocalChannel]) -> None:
        self._connect = connect
        self.offer: Offer | None = None  # (None: none offered, or given up)
        self.reads = False  # whether the server takes PullRows calls over it (its Join answer said so)
        self._channel: LocalChannel | None = None
        self.failed: str | None = None  # why the last connection could not be made (cleared by whoever warns)
        self.calls = 0  # Step calls made over it
        self.read_calls = 0  # PullRows calls made over it
        # Whether a call is on the connection (a Step between its stages, or a read): one at a time
        self._busy = False
        self._turn = threading.Condition()

    def set(self, offer: Offer | None, reads: bool = False) -> None:
        """A Join answer offered this socket (None: none), and said whether it takes reads: a
        connection to another one is closed."""
        self.reads = reads and offer is not None
        if offer != self.offer:
            channel, self._channel, self.offer = self._channel, None, offer
            if channel is not None:
                channel.close()

    @property
    def staged(self) -> bool:
        """Whether the Step calls go over the socket, in stages (one is offered)."""
        return self.offer is not None

    def channel(self) -> LocalChannel | None:
        """The connection for a Step call (made now where there is none); None where no socket is
        offered or connecting failed."""
        if self._channel is None and self.offer is not None:
            try:
                self._channel = self._connect(self.offer)
            except ChannelLost as exc:
                self.failed, self.offer = str(exc), None
        return self._channel

    def calling(self, channel: LocalChannel, request: Body, timeout_s: float, metadata: Metadata = ()
                ) -> Generator[None, None, tuple[pb.StepReply, LocalCall]]:
        """The Step call over `channel` (this object's), yielding once its request is sent.

        Raises:
            LocalCallError: the server answered with an error status, or the deadline passed.
            ChannelLost: the connection failed (the server may or may not have the call).
        """
        self._take_turn(wait=True)  # (a read of another thread finishes first: reads are short, and never wait)
        try:
            with self._failures(channel):
                body, call = yield from self._staged(channel, request, timeout_s, metadata)
                done = pb.StepReply.FromString(body), call  # (parsed as it lies: no bytes() of it first)
        finally:
            self._done()
        self.calls += 1
        return done

    def _staged(self, channel: LocalChannel, request: Body, timeout_s: float, metadata: Metadata
                ) -> Generator[None, None, tuple[bytearray, LocalCall]]:
        """One call's two stages on `channel` (the caller holds its turn): its request sent, a
        yield, its reply's bytes read (LocalChannel.finish_bytes). Abandoned between them, with its
        reply unread, the connection is closed: that reply must not answer the next call."""
        channel.start(request, timeout_s, metadata)
        try:
            yield
        except GeneratorExit:
            self._channel = None
            channel.close()
            raise
        return channel.finish_bytes()

    def read(self, request: bytes, timeout_s: float) -> bytearray | None:
        """A PullRows call over the socket: the RowsReply's bytes; None where it cannot go over the
        socket now (none offered, or it takes no reads, or another thread's call is on the
        connection, or the connection failed: given up until a Join offers a socket again), for
        the caller to make it through gRPC (a read is safe to make again).

        Raises:
            LocalCallError: the server answered with an error status, or the deadline passed.
        """
        stages = self.reading(request, timeout_s)
        while True:
            try:
                next(stages)
            except StopIteration as done:
                return done.value

    def reading(self, request: bytes, timeout_s: float) -> Generator[None, None, bytearray | None]:
        """read() in stages: it yields once the request is sent (a caller sends its other servers'
        reads meanwhile, on its thread), then reads the reply; where the read cannot go over the
        socket now it returns None without yielding (or, where the connection fails after the
        request went out, once it did), and raises as read."""
        if not self.reads or not self._take_turn(wait=False):
            return None
        try:
            channel = self.channel()
            if channel is None:
                return None
            with self._failures(channel):
                body, _ = yield from self._staged(channel, request, timeout_s, ((METHOD_KEY, "PullRows"),))
        except ChannelLost:
            return None
        finally:
            self._done()
        self.read_calls += 1
        return body

    @contextlib.contextmanager
    def _failures(self, channel: LocalChannel) -> Iterator[None]:
        """A call's failure as this socket's: past its deadline, the connection (closed by the
        channel) is made again at the next call; lost, the socket is given up until a Join offers
        one again (not where a Join offered another one meanwhile)."""
        try:
            yield
        except LocalCallError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and self._channel is channel:
                self._channel = None
            raise
        except ChannelLost:
            if self._channel is channel:
                self._channel, self.offer, self.reads = None, None, False
            raise

    def _take_turn(self, wait: bool) -> bool:
        """Take the connection for one call (wait: until another thread's call ends; else False
        where one is on it)."""
        with self._turn:
            while self._busy:
                if not wait:
                    return False
                self._turn.wait()
            self._busy = True
            return True

    def _done(self) -> None:
        with self._turn:
            self._busy = False
            self._turn.notify_all()

def nodelay(sock: socket.socket) -> None:
    """A TCP message goes out at once, not held back for more (Nagle): each is one call's whole."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def connect_tcp(address: tuple[str, int], timeout_s: float) -> socket.socket:
    """A widened, unbuffered TCP connection to (host, port), made within timeout_s.

    Raises:
        OSError: no address of host answers there.
    """
    host, port = address
    last: OSError = OSError(f"{host} has no address")
    for family, kind, proto, _, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            widen(sock)
            nodelay(sock)
            sock.settimeout(timeout_s)
            sock.connect(sockaddr)
            return sock
        except OSError as exc:
            sock.close()
            last = exc
    raise last
