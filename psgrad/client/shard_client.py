"""One shard's channel: every call under a deadline, reconnecting with backoff, gRPC status ->
PsgradError; its payloads through the transport picked at Join (see client/transport.py): the
frames transport here (gRPC frames, or inline in a Step call), or shared memory (client/same_host.py)."""
from __future__ import annotations

import logging
import ssl
import sys
import threading
import warnings
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import TypeVar

import grpc
import torch

from psgrad import errors
from psgrad.client import reconnect
from psgrad.client.rows_in_place import InPlaceRows
from psgrad.client.same_host import SharedMemoryTransport
from psgrad.client.transport import (
    RowsRead, Stepped, Transport, asking, check_pull_header, checked_rows, pull_header, rows_read, step_request,
)
from psgrad.wire import local_socket, row_share, shm
from psgrad.core.codecs import WireBuffer, byte_view
from psgrad.wire.frames import (
    FrameParser,
    PayloadWriter,
    PushHead,
    data_frames,
    parse_frame,
    trailing_bytes_field,
    write_frames,
)
from psgrad.config import WAIT_FOR_SERVERS_HINT, ClientConfig
from psgrad.core.addresses import host_of
from psgrad.errors import InvalidRequestError
from psgrad.wire.rows import RowBlock
from psgrad.proto import ps_pb2 as pb
from psgrad.wire.protocol import (
    CLIENT_CHANNEL_OPTIONS,
    GATED_PUSH_BYTES,
    ROWS_REPLY_ROWS,
    SERVICE_NAME,
)
from psgrad.core.credentials import ADMIN
from psgrad.wire.security import client_channels, client_step_socket_context

T = TypeVar("T")
__all__ = ["FramesTransport", "RowsRead", "ShardClient"]


_log = logging.getLogger(__name__)


class ShardClient:
    """Calls to one shard: its server, or 'PRIMARY|BACKUP' (calls fail over to the other one when
    the one in use stops answering). Methods raise PsgradError subclasses, never grpc.RpcError."""

    def __init__(self, address: str, config: ClientConfig, role: str = ADMIN) -> None:
        """role: whose token to derive from config.auth's job secret (a worker's, or the admin's)."""
        self.addresses = tuple(address.split("|"))
        self.config = config
        self._channels_of = client_channels(config, role)
        self._channels: list[grpc.Channel] = []  # every one used; closed by close()
        self._bind_lock = threading.Lock()
        self._bind(self.addresses[0])
        # The payloads' transport: frames until a Join answer picks (see _pick)
        self.frames = FramesTransport(self)
        # What pull headers told once (evictions of other workers, a restart: ps.proto PullHeader),
        # until taken (take_pull_news).
        self._pull_news: list[pb.PullHeader] = []
        self._news_lock = threading.Lock()
        self.transport: Transport = self.frames
        self._shared: SharedMemoryTransport | None = None  # made at the first Join that picks shared memory
        self._may_share = config.shared_memory and shm.supported()  # until refused for good
        # Set once this worker has joined: sends the same Join again (deadline in seconds), before
        # a call is retried after the shard stopped answering.
        self.rejoin: Callable[[float], object] | None = None
        # Set when a call gave up on the shard (it did not come back within --reconnect-timeout-s,
        # or did not answer within its deadline): leaving does not wait for it a second time.
        self.given_up: errors.ServerUnavailableError | None = None
        # The shard's rows lent in place (its Join answer named their header: same host), or None
        self.rows_in_place: InPlaceRows | None = None

    @property
    def same_host(self) -> bool:
        """Whether payloads go through shared memory (the server said at Join that it shares this
        host and takes segments, and this worker may use them), not gRPC frames."""
        return self.transport is not self.frames

    def _pick(self, server_shares: bool, local: tuple[str, int, str] | None = None,
              tcp: tuple[str, int, str] | None = None, reads: bool = False) -> None:
        """After a Join answer: payloads through shared memory where the server said it shares this
        host and takes segments and this worker may use them (ClientConfig shared_memory, a host
        with /dev/shm, not refused for good), else through frames. The same answer keeps the
        transport (a rejoin to the same server); another server's may change it (a failover). A
        switch back to shared memory maps the server's ring afresh at its next lend. local: the
        local socket the answer offers for Step calls (see wire/local_socket.py), or None; tcp:
        the TCP socket it offers for the frames transport's Step calls, or None; reads: whether the
        answer says its sockets take reads of rows (PullRows) too."""
        with self._bind_lock:
            self.frames.socket.set(tcp if self.config.step_socket else None, reads)
            if not (server_shares and self._may_share):
                self.transport = self.frames
            elif self.transport is self.frames:
                if self._shared is None:
                    self._shared = SharedMemoryTransport(self, self.frames, self._refused)
                else:
                    self._shared.forget_ring()
                self.transport = self._shared
            if self._shared is not None:
                self._shared.socket.set(local if self.config.local_socket else None, reads)

    def _lent_rows(self, name: str | None) -> None:
        """After a Join answer: read rows in place from the header it names (kept where it is the
        one mapped already), or from none."""
        held = self.rows_in_place
        if held is not None and held.name == name:
            return
        self.rows_in_place = None
        if held is not None:
            held.close()
        if name is not None:
            try:
                self.rows_in_place = InPlaceRows(name)
            except (OSError, ValueError) as exc:
                _log.info("rows of %s are read through calls: %s", self.address, exc)

    def _refused(self) -> None:
        """Shared memory is refused for good (this host cannot make a segment, or the server cannot
        open this worker's): frames from now on, whatever a later Join answers."""
        with self._bind_lock:
            self._may_share = False
            self.transport = self.frames

    @property
    def view(self) -> torch.Tensor | None:
        """After a pull or step with published=True: the version the server lent (see Transport)."""
        return self.transport.view

    def lend_window(self, window: shm.Window) -> bool:
        """Make `window` this shard's segment: pushes of it are read in place (see SharedMemoryTransport)."""
        return self.transport.lend_window(window)

    def forget_ring(self) -> None:
        """Map the server's ring afresh at its next lend (see SharedMemoryTransport)."""
        self.transport.forget_ring()

    def failover(self, failed: str) -> str | None:
        """The server at `failed` does not answer: use the shard's other server (if it has one and
        this is still the one in use; another thread may have switched already). Returns the
        address now in use, or None when there is no other."""
        if len(self.addresses) < 2:
            return None
        with self._bind_lock:
            if self.address == failed:
                self._bind(self.addresses[1 - self.addresses.index(failed)])
            return self.address

    def _bind(self, address: str) -> None:
        """Send calls to `address` (a channel of its own; calls on the former one run on)."""
        self.address = address
        self._channel = self._channels_of(address, CLIENT_CHANNEL_OPTIONS)
        self._channels.append(self._channel)
        prefix = f"/{SERVICE_NAME}/"
        ch = self._channel
        self._join = ch.unary_unary(prefix + "Join", pb.JoinRequest.SerializeToString, pb.JoinReply.FromString)
        self._init = ch.stream_unary(prefix + "Init", None, pb.InitReply.FromString)
        self._pull = ch.unary_stream(prefix + "Pull", pb.PullRequest.SerializeToString, None)
        self._push = ch.stream_unary(prefix + "Push", None, pb.PushReply.FromString)
        self._push_gated = ch.stream_stream(prefix + "PushGated", None, pb.PushProgress.FromString)
        self._status = ch.unary_unary(
            prefix + "Status", pb.StatusRequest.SerializeToString, pb.StatusReply.FromString
        )
        self._heartbeat = ch.unary_unary(
            prefix + "Heartbeat", pb.HeartbeatRequest.SerializeToString, pb.HeartbeatReply.FromString
        )
        self._leave = ch.unary_unary(prefix + "Leave", pb.LeaveRequest.SerializeToString, pb.LeaveReply.FromString)
        self._rollback = ch.unary_unary(
            prefix + "Rollback", pb.RollbackRequest.SerializeToString, pb.RollbackReply.FromString
        )
        self._pull_rows = ch.unary_unary(prefix + "PullRows", pb.RowsRequest.SerializeToString, None)
        # Same-host payloads: the Push method called with its header frame only, the gradient in
        # the segment (a client stream of one message is a unary call on the wire).
        self._push_header_only = ch.unary_unary(prefix + "Push", None, pb.PushReply.FromString)
        self._pull_header_only = ch.unary_unary(prefix + "Pull", pb.PullRequest.SerializeToString, None)
        self._step = ch.unary_unary(prefix + "Step", None, pb.StepReply.FromString)

    def close(self) -> None:
        if self._shared is not None:
            self._shared.close()
        self.frames.close()
        for channel in self._channels:
            channel.close()

    def _call(self, what: str, fn: Callable[[], T], timeout_s: float, retry: bool = True) -> T:
        """fn(), reconnecting (or failing over) while the shard does not answer (see reconnect.call)."""
        rejoin = self.rejoin if retry else None
        try:
            result = reconnect.call(what, fn, timeout_s, self.address, self.config, rejoin, retry, self.failover, self.diagnose)
        except errors.ServerUnavailableError as exc:
            if retry:  # retried for the whole reconnect timeout (or out of time): the shard is gone
                self.given_up = exc
            raise
        self.given_up = None  # it answers (again)
        return result

    def diagnose(self) -> str:
        """After a call to the server in use ran out of time: what a quick status call finds."""
        return reconnect.diagnose(lambda t: self._status(pb.StatusRequest(), timeout=t), self._channel, self.address)

    def join(self, req: pb.JoinRequest, timeout_s: float, wait_for_ready: bool = True) -> pb.JoinReply:
        """Join. As a first call (wait_for_ready) it waits up to timeout_s for the server to answer,
        but reports a refused connection after a short grace (see reconnect.first_call); a shard
        with a backup tries its servers in turn (see reconnect.join_any). Learns whether the server
        takes payloads through shared memory, which picks the payloads' transport (see _pick)."""
        asks = (row_share.ask(),) if (self.config.shared_memory and self.config.rows_in_place and row_share.supported()
                                      and shm.supported()) else ()

        def attempt(t: float, ready: bool = False) -> pb.JoinReply:
            reply, call = self._join.with_call(req, timeout=t, wait_for_ready=ready, metadata=asks or None)
            answer = call.initial_metadata()
            self._lent_rows(row_share.answered(answer) if asks else None)
            self._pick(shm.same_host_server(answer), local_socket.offer_in(answer),
                       local_socket.offer_in(answer, local_socket.TCP_METADATA_KEY), local_socket.reads_offered(answer))
            return reply

        if len(self.addresses) < 2 and wait_for_ready:
            return reconnect.first_call("the join request", attempt, timeout_s, self.address, self.config,
                                        self.diagnose, WAIT_FOR_SERVERS_HINT)

        def run(t: float) -> pb.JoinReply:
            return self._call("the join request", lambda: attempt(t), t, retry=False)

        if len(self.addresses) < 2:
            return run(timeout_s)
        return reconnect.join_any(run, timeout_s, lambda: self.address, self.failover)

    def init(self, header: pb.InitHeader, payloads: Sequence[torch.Tensor]) -> pb.InitReply:
        """Stream a shard's initial float32 weights and the values of the rows its header names,
        in order (sent once, by the chief)."""
        def frames() -> Iterator[bytes]:
            yield pb.InitFrame(header=header).SerializeToString()
            for payload in payloads:
                yield from data_frames(byte_view(payload.contiguous()), self.config.chunk_bytes)

        t = self.config.rpc_timeout_s
        return self._call("the init stream", lambda: self._init(frames(), timeout=t), t)

    # ----------------------------------------------------------------- payloads, through the transport
    def pull(self, req: pb.PullRequest, dest: torch.Tensor, wire: WireBuffer, published: bool = False) -> int:
        """Pull the shard's weights into dest (float32 slice of the flat space), or with published
        (same host) into `view` where the server lends a slot; returns their version."""
        return self.transport.pull(req, dest, wire, published)

    def push(self, head: PushHead, payload: memoryview) -> pb.PushReply:
        """Push one gradient slice (already in the wire dtype) and the row gradients head carries.
        Retries are safe: pushes are keyed."""
        return self.transport.push(head, payload)

    def skip(self, header: pb.PushHeader) -> pb.PushReply:
        """Send a skip (ps.proto PushHeader.skip: this worker dropped its step at header.clock,
        which other shards applied): a Push call of the header frame alone, through gRPC whatever
        the payloads' transport. Retries are safe (a shard that handled the clock answers a duplicate)."""
        t = self.config.rpc_timeout_s
        frame = PushHead(header).frame()
        return self._call("the skip", lambda: self._push(iter([frame]), timeout=t), t)

    def stepping(
        self, head: PushHead, payload: memoryview, dest: torch.Tensor, wire: WireBuffer, published: bool = False,
        reads: RowBlock | None = None,
    ) -> Generator[None, None, Stepped | None]:
        """Push one gradient slice as head.header.clock (with the row gradients head carries),
        then pull the weights for the next clock into dest and the rows `reads` names (ids by
        table), in one unary Step call: through this shard's segment (same host), else with both
        payloads in the messages when they fit one chunk. A generator (see Transport.stepping:
        where `staged`, it yields while the server works on the call) that returns the push
        reply, the pulled version and the rows read (None: none asked for); None when a Step call
        does not fit (a large payload to another host) or was refused: then push and pull
        separately. Retries are safe (pushes are keyed)."""
        return self.transport.stepping(head, payload, dest, wire, published, reads)

    @property
    def staged(self) -> bool:
        """Whether stepping() yields while the server works (see Transport.staged)."""
        return self.transport.staged

    def heard(self, header: pb.PullHeader) -> pb.PullHeader:
        """Keep what a pull's header tells once (a transport calls this for every pull it reads)."""
        if header.evicted or header.HasField("restored_version"):
            with self._news_lock:
                self._pull_news.append(header)
        return header

    def take_pull_news(self) -> list[pb.PullHeader]:
        """The pull headers that told something since the last call."""
        if not self._pull_news:
            return []
        with self._news_lock:
            news, self._pull_news = self._pull_news, []
            return news

    def pull_table(self, req: pb.PullRequest, dest: torch.Tensor) -> int:
        """Pull a whole table the request names (req.table: the frozen one) into dest (float32, its
        size), through gRPC frames (read at join: no segment); returns the table's version."""
        t = self.config.rpc_timeout_s
        what = f"the pull of table {req.table!r} from {self.address}"

        def run() -> int:
            stream = self._pull(req, timeout=t)
            first = next(stream, None)
            header = pb.PullFrame.FromString(first).header if first is not None else None
            if header is None or header.numel != dest.numel() or header.dtype != "float32":
                raise InvalidRequestError(f"{what}: expected {dest.numel()} float32 values, the header says "
                                          f"{'nothing' if header is None else f'{header.numel} {header.dtype}'}")
            write_frames(stream, PayloadWriter(byte_view(dest), what), FrameParser(pb.PullFrame, what))
            return int(header.version)

        return self._call(f"the pull of table {req.table!r}", run, t)

    # ----------------------------------------------------------------- sparse tables
    def pull_rows(self, req: pb.RowsRequest) -> RowsRead:
        """Rows of sparse tables by id (req.block; see ps.proto PullRows): each table's version and
        the rows' bytes, table after table, a view of the reply (the server puts them last; parsed
        by protobuf if not there)."""
        t = self.config.rpc_timeout_s
        return self._rows_of(req, self._call("the pull of rows", lambda: self._read_rows(req, t), t))

    def reading_rows(self, req: pb.RowsRequest) -> Generator[None, None, RowsRead]:
        """pull_rows(req) in stages: where the server takes reads over the socket its Step calls use
        (reads_staged), it yields once the request is sent (the caller sends its other shards'
        reads meanwhile, on this thread: no hand-off to another, see ParameterClient.pull_tables),
        then reads the reply; else, or where that call failed or could not be made, as pull_rows
        (without yielding)."""
        t = self.config.rpc_timeout_s
        failed: list[local_socket.LocalCallError] = []
        try:
            got = yield from self.transport.socket.reading(req.SerializeToString(), t)
        except local_socket.LocalCallError as exc:
            failed.append(exc)  # the client's retry rules decide on it, as on a gRPC call's failure
        else:
            if got is not None:
                self.given_up = None  # (it answers)
                return self._rows_of(req, got)

        def attempt() -> bytes | bytearray:
            if failed:  # (the socket's call as the first attempt: rejoin, back off, retry or raise, as for gRPC's)
                raise failed.pop()
            return self._read_rows(req, t)

        return self._rows_of(req, self._call("the pull of rows", attempt, t))

    @property
    def reads_staged(self) -> bool:
        """Whether reading_rows() yields while the server works on the read (its socket takes reads)."""
        return self.transport.socket.reads

    def _rows_of(self, req: pb.RowsRequest, reply: bytes | bytearray) -> RowsRead:
        """The rows a PullRows reply to `req` carries (see pull_rows)."""
        what = f"the pull of rows from {self.address}"
        split = trailing_bytes_field(reply, ROWS_REPLY_ROWS)
        if split is not None:
            head, rows = split
            msg = parse_frame(pb.RowsReply, bytes(head), what)
        else:
            msg = parse_frame(pb.RowsReply, reply, what)
            rows = memoryview(msg.rows)
        return checked_rows(self.address, list(msg.versions), rows, len(req.block.tables), "the pull of rows")

    def _read_rows(self, req: pb.RowsRequest, timeout_s: float) -> bytes | bytearray:
        """A PullRows call's reply: over the socket the transport's Step calls use, where the server
        takes reads there, else (or where the socket is busy or failed) through gRPC."""
        socket = self.transport.socket
        got = socket.read(req.SerializeToString(), timeout_s) if socket.reads else None
        return got if got is not None else self._pull_rows(req, timeout=timeout_s)

    def updated_rows(self, req: pb.RowsRequest) -> pb.RowsReply:
        """A page of a sparse table's updated rows with their ids (req.updated; see ps.proto PullRows)."""
        t = self.config.rpc_timeout_s
        reply: bytes = self._call("the read of updated rows", lambda: self._pull_rows(req, timeout=t), t)
        return parse_frame(pb.RowsReply, reply, f"the read of updated rows from {self.address}")

    def status(self, timeout_s: float | None = None, with_params: bool = False) -> pb.StatusReply:
        """The shard's status, as a first call (a refused connection is reported after a short grace)."""
        req = pb.StatusRequest(with_params=with_params)
        return reconnect.first_call(
            "the status request", lambda t, ready: self._status(req, timeout=t, wait_for_ready=ready),
            timeout_s or self.config.rpc_timeout_s, self.address, self.config, self.diagnose)

    def heartbeat(self, rank: int, fp: str, incarnation: int = 0) -> pb.HeartbeatReply:
        t = min(self.config.rpc_timeout_s, 5.0)
        req = pb.HeartbeatRequest(rank=rank, fingerprint=fp, incarnation=incarnation)
        return self._call("the heartbeat", lambda: self._heartbeat(req, timeout=t), t, retry=False)

    def rollback(self, req: pb.RollbackRequest) -> pb.RollbackReply:
        """Ask for the shard's roll-back points, or (req.execute) roll it back (sync; see ps.proto).
        A roll-back may read a checkpoint from disk: it gets the init deadline."""
        t = max(self.config.rpc_timeout_s, self.config.init_timeout_s) if req.execute else self.config.rpc_timeout_s
        return self._call("the roll-back request", lambda: self._rollback(req, timeout=t), t)

    def leave(self, rank: int, fp: str, incarnation: int = 0) -> None:
        """Leave the shard, retried as any call; not sent to a shard a call gave up on already (the
        worker is on its way out because of it, and waiting another reconnect timeout to say goodbye
        would double its exit time: the shard drops the worker when its lease ends). A worker being
        stopped (a KeyboardInterrupt, or SIGTERM's Terminated, on its way out) says goodbye once,
        without retries: a launcher stopping the whole job stops the servers too, and kills what
        has not exited within seconds."""
        if self.given_up is not None:
            return
        t = self.config.rpc_timeout_s
        stopping = isinstance(sys.exc_info()[1], KeyboardInterrupt)
        req = pb.LeaveRequest(rank=rank, fingerprint=fp, incarnation=incarnation)
        self._call("the leave request", lambda: self._leave(req, timeout=t), t, retry=not stopping)


class FramesTransport:
    """A shard client's payloads through gRPC frames (the Transport of a server on another host, or
    with shared memory off): pulls and pushes streamed in frames of config.chunk_bytes, a push
    larger than GATED_PUSH_BYTES with a go-ahead, and a Step call with both payloads inline when
    they fit one chunk. It calls through the client's channel (the server in use, its reconnect
    and failover). Lends nothing: `view` stays None, a lent window is retired.

    Its Step calls go over the TCP socket the server in use offered at Join, where it offers one
    (see wire/local_socket.py; in TLS where this client has TLS, as its gRPC channel) and
    ClientConfig step_socket allows: the same request and reply, without gRPC's per-call work. A
    call there that fails counts as the call's first attempt: the client's rules for a failed call
    (reconnect, failover, rejoin, back-off; a refusal raised as it is) go on from it through gRPC
    (a push is keyed: never applied twice); a connection that fails is given up until a Join
    offers a socket again, and the call made through gRPC."""

    name = "grpc"
    view: torch.Tensor | None = None

    def __init__(self, client: ShardClient) -> None:
        self._client = client
        self.socket = local_socket.Offered(self._connect)  # the TCP socket, where the last Join offered it
        self._tls: ssl.SSLContext | None = None  # (made at the first connection, where the client has TLS)

    def close(self) -> None:
        """Its connection to the server's TCP socket, if any (the client closes the channels)."""
        self.socket.set(None)

    @property
    def staged(self) -> bool:
        """Whether stepping() yields between sending its request and reading the reply: its Step
        calls go over the server's TCP socket (one is offered); through gRPC a call blocks its
        thread until it is answered."""
        return self.socket.staged

    def _connect(self, offer: local_socket.Offer) -> local_socket.LocalChannel:
        """A connection to the TCP socket offered, at the host the server's gRPC port is reached at,
        in TLS where this client has TLS."""
        port, rank, token = offer
        host = host_of(self._client.address)
        tls = self._client.config.tls
        if tls is not None and self._tls is None:
            self._tls = client_step_socket_context(tls)
        return local_socket.LocalChannel(f"{host}:{port}", rank, token, tcp=(host, int(port)), tls=self._tls,
                                         server_name=tls.server_name if tls else None)

    def _step_calling(self, head: PushHead, pull: pb.StepRequest, payload: memoryview,
                      timeout_s: float) -> Generator[None, None, pb.StepReply]:
        """The Step call of the push `head` with `payload` and the pull part `pull`: over the
        server's TCP socket where there is one (yielding once the request is sent), else, or where
        that call failed, through gRPC (see the class doc). A socket this worker could not connect
        to is warned of once the server answered through gRPC (a server that died refuses both, and
        its gRPC call says so)."""
        c = self._client
        channel = self.socket.channel()
        failed: list[local_socket.LocalCallError] = []
        if channel is not None:
            try:
                pieces, metadata = head.step_socket_request(pull, payload)
                reply, _ = yield from self.socket.calling(channel, pieces, timeout_s, metadata)
                return reply
            except local_socket.LocalCallError as exc:
                failed.append(exc)  # the client's retry rules decide on it, as on a gRPC call's failure
            except local_socket.ChannelLost:
                pass  # (given up until a Join offers a socket again)
        request = head.step_request(pull, payload)

        def attempt() -> pb.StepReply:
            if failed:  # (the socket's call as the first attempt: rejoin, back off, retry or raise, as for gRPC's)
                raise failed.pop()
            reply: pb.StepReply = c._step(request, timeout=timeout_s)
            return reply

        got = c._call("the push and pull", attempt, timeout_s)
        if self.socket.failed is not None:  # (the server answers: its TCP port is what this worker cannot reach)
            warnings.warn(f"server {c.address}: {self.socket.failed}; Step calls go through gRPC (a worker that "
                          "cannot reach that port: psgrad worker --no-step-socket)", stacklevel=4)
            self.socket.failed = None
        return got

    def stepping(
        self, head: PushHead, payload: memoryview, dest: torch.Tensor, wire: WireBuffer, published: bool = False,
        reads: RowBlock | None = None,
    ) -> Generator[None, None, Stepped | None]:
        """The Step call with both payloads inline (the gradient in the request, the weights in the
        reply); None when the gradient does not fit one chunk: then push and pull separately. Over
        the server's TCP socket it yields once the request went out (see staged)."""
        c = self._client
        if len(payload) > c.config.chunk_bytes:
            return None
        reply = yield from self._step_calling(head, step_request(reads, wire), payload, c.config.rpc_timeout_s)
        c.heard(check_pull_header(c.address, reply.pull, dest, wire))
        data = memoryview(reply.data)
        if len(data) != wire.nbytes:
            raise InvalidRequestError(
                f"server {c.address}: step returned {len(data)} bytes of weights, expected {wire.nbytes}"
            )
        wire.load(dest, data)
        return reply.push, int(reply.pull.version), rows_read(c.address, reply, reads)

    def lend_window(self, window: shm.Window) -> bool:
        window.close()
        return False

    def forget_ring(self) -> None:
        """No ring: nothing lent."""

    def pull(self, req: pb.PullRequest, dest: torch.Tensor, wire: WireBuffer, published: bool = False) -> int:
        """Pull the shard's weights into dest through frames (nothing is lent: published is moot)."""
        c = self._client
        t = c.config.rpc_timeout_s

        def run() -> int:
            stream = c._pull(asking(req, wire), timeout=t)
            header = c.heard(pull_header(c.address, next(stream, None), dest, wire))
            writer = PayloadWriter(wire.receive_view(dest), f"pull from {c.address}")
            write_frames(stream, writer, FrameParser(pb.PullFrame, f"pull from {c.address}"))
            wire.finish_receive(dest)
            return int(header.version)

        return c._call("the pull", run, t)

    def push(self, head: PushHead, payload: memoryview) -> pb.PushReply:
        """Push through gRPC frames: with a go-ahead (PushGated) when the payload is larger than
        GATED_PUSH_BYTES, so that it waits for its turn without sending; else in one stream."""
        c = self._client
        t = c.config.rpc_timeout_s
        first = head.frame()
        if len(payload) > GATED_PUSH_BYTES:
            return c._call("the push", lambda: self._gated(first, payload, t), t)

        def frames() -> Iterator[bytes]:
            yield first
            yield from data_frames(payload, c.config.chunk_bytes)

        return c._call("the push", lambda: c._push(frames(), timeout=t), t)

    def _gated(self, head: bytes, payload: memoryview, timeout_s: float) -> pb.PushReply:
        """One PushGated call: the header, the server's `ready`, the data frames, the reply.

        While the data goes out this thread waits on an event of its own, not on the call: gRPC
        wakes every thread waiting on a call at each message sent, and a waiter woken 100 times
        per 100 MB push cost the worker 1.5-4 ms of CPU (GIL hand-offs) on 2 vCPUs."""
        c = self._client
        go = threading.Event()  # set on `ready`, and whenever the call ends
        send = [False]  # whether to send the data once go is set
        sent = threading.Event()  # the request stream is done, or the call ended

        def frames() -> Iterator[bytes]:
            try:
                yield head
                go.wait()  # the call's deadline ends the wait at the latest (see finally)
                if send[0]:
                    yield from data_frames(payload, c.config.chunk_bytes)
            finally:
                sent.set()

        call = c._push_gated(frames(), timeout=timeout_s)
        call.add_done_callback(lambda _: sent.set())  # a call ended mid-stream may leave frames() suspended
        try:
            first = next(call, None)
            if first is None or first.WhichOneof("kind") != "ready":
                raise InvalidRequestError(f"server {c.address}: push expected `ready`, got {first}")
            send[0] = True
            go.set()
            sent.wait(timeout_s)  # the deadline ends the call, and so the wait, at the latest
            last = next(call, None)
            if last is None or last.WhichOneof("kind") != "reply":
                raise InvalidRequestError(f"server {c.address}: push expected its reply, got {last}")
            reply: pb.PushReply = last.reply
            return reply
        except grpc.RpcError:
            raise
        except BaseException:
            call.cancel()
            raise
        finally:
            go.set()  # a call that failed before `ready` ends its request stream unsent
