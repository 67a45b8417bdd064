"""Same-host Step calls over a local socket, both ends (server/local_calls.py, wire/local_socket.py), with
a stand-in Step handler: a connection proves its rank with the Join answer's token and pushes only as
that rank; replies, errors (status code, details, the psgrad error's class), trailing metadata,
callbacks and deadlines travel as a gRPC call's do; a call past its deadline ends its connection; a
closed server ends its connections and takes no new ones."""
from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from psgrad.errors import StalledError
from psgrad.proto import ps_pb2 as pb
from psgrad.server import local_calls
from psgrad.server.local_calls import LocalCalls
from psgrad.wire import local_socket, protocol
from psgrad.wire.frames import DETACHED_KEY
from psgrad.wire.local_socket import ChannelLost, LocalCallError, LocalChannel

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not local_socket.supported(), reason="needs abstract Unix sockets (Linux)")]

Handler = Callable[[pb.StepRequest, Any], bytes]


def echo(req: pb.StepRequest, context: Any) -> bytes:
    """A Step handler's stand-in: the push's clock back as the version, and the call's metadata."""
    context.set_trailing_metadata(tuple(context.invocation_metadata()))
    return pb.StepReply(push=pb.PushReply(version=req.push.clock)).SerializeToString()


@pytest.fixture
def serve() -> Iterator[Callable[[Handler], LocalCalls]]:
    made: list[LocalCalls] = []

    def make(step: Handler = echo) -> LocalCalls:
        made.append(LocalCalls(step))
        return made[-1]

    yield make
    for calls in made:
        calls.close()


def connect(calls: LocalCalls, rank: int) -> LocalChannel:
    name, offered_rank, token = local_socket.offer_in([calls.offer(rank)]) or ("", -1, "")
    assert (name, offered_rank) == (calls.name, rank)
    return LocalChannel(name, rank, token)


def request(rank: int, clock: int = 1) -> bytes:
    return pb.StepRequest(push=pb.PushHeader(rank=rank, clock=clock)).SerializeToString()


def test_a_connection_pushes_only_as_the_rank_its_token_proves(serve) -> None:  # type: ignore[no-untyped-def]
    calls = serve()
    channel = connect(calls, 3)
    reply, call = channel.with_call(request(3, clock=7), 10.0, (("psgrad-shm", "seg;1;2;h"),))
    assert reply.push.version == 7 and calls.calls == 1
    assert ("psgrad-shm", "seg;1;2;h") in call.trailing_metadata()  # the call's metadata reached the handler
    with pytest.raises(LocalCallError) as refused:
        channel.with_call(request(4), 10.0)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert (protocol.ERROR_METADATA_KEY, "PermissionDeniedError") in refused.value.trailing_metadata()
    assert "worker 3's" in refused.value.details() and calls.calls == 1
    channel.with_call(request(3, clock=8), 10.0)  # (a refused call leaves the connection usable)
    channel.close()
    _, _, token_of_3 = local_socket.offer_in([calls.offer(3)]) or ("", 0, "")
    for rank, token in ((4, token_of_3), (3, "0" * 64), (3, local_socket.token(b"another server's key", 3)), (3, "é")):
        with pytest.raises(ChannelLost, match="refused this worker"):
            LocalChannel(calls.name, rank, token)


def test_a_tcp_socket_binds_a_connection_to_a_rank_as_the_local_one_does() -> None:
    import socket

    calls = LocalCalls(echo, unix=False, tcp=("127.0.0.1", 0))
    try:
        assert calls.offer(3) is None and calls.name is None  # no Unix socket asked for
        port, rank, token = local_socket.offer_in([calls.tcp_offer(3)], local_socket.TCP_METADATA_KEY) or ("", -1, "")
        assert (int(port), rank) == (calls.tcp_port, 3)
        channel = LocalChannel(f"127.0.0.1:{port}", 3, token, tcp=("127.0.0.1", int(port)))
        reply, _ = channel.with_call([request(3, clock=5)[:2], request(3, clock=5)[2:]], 10.0)  # (in pieces)
        assert reply.push.version == 5 and calls.calls == 1
        with pytest.raises(LocalCallError) as refused:
            channel.with_call(request(4), 10.0)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        channel.close()
        for rank, tok in ((4, token), (3, "0" * 64)):
            with pytest.raises(ChannelLost, match="step socket 127.0.0.1:.* refused this worker"):
                LocalChannel("127.0.0.1:1", rank, tok, tcp=("127.0.0.1", int(port)))
        with pytest.raises(OSError):  # a port another socket listens on is not taken
            LocalCalls(echo, unix=False, tcp=("127.0.0.1", int(port)))
    finally:
        calls.close()
    with pytest.raises(ChannelLost, match="step socket"):  # closed: refused
        LocalChannel("x", 3, token, tcp=("127.0.0.1", int(port)))
    assert socket.AF_INET in {s.family for s in calls._listeners}


@pytest.mark.parametrize("offer", [["12 3 tok"], ["p 3 tok"], ["12 x tok"], ["12 3"]])
def test_a_tcp_offer_is_read_only_when_well_formed(offer: list[str]) -> None:
    got = local_socket.offer_in([(local_socket.TCP_METADATA_KEY, offer[0])], local_socket.TCP_METADATA_KEY)
    assert got == (("12", 3, "tok") if offer == ["12 3 tok"] else None)
    assert local_socket.offer_in([(local_socket.TCP_METADATA_KEY, offer[0])]) is None  # not the local socket's


def test_errors_metadata_callbacks_and_deadlines_travel_as_a_grpc_calls_do(serve) -> None:  # type: ignore[no-untyped-def]
    seen: dict[str, Any] = {}
    ended = threading.Event()

    def step(req: pb.StepRequest, context: Any) -> bytes:
        seen["remaining"] = context.time_remaining()
        context.add_callback(ended.set)
        if req.push.clock == 1:
            protocol.abort(context, StalledError("waited for worker 1"))
        if req.push.clock == 2:
            raise ValueError("a bug")
        return pb.StepReply().SerializeToString()

    channel = connect(serve(step), 0)
    with pytest.raises(LocalCallError) as stalled:
        channel.with_call(request(0, clock=1), 30.0)
    assert stalled.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # StalledError's status, as over gRPC
    assert stalled.value.details() == "waited for worker 1"
    assert (protocol.ERROR_METADATA_KEY, "StalledError") in stalled.value.trailing_metadata()
    assert 25.0 < seen["remaining"] <= 30.0  # the deadline sent
    assert ended.wait(30)  # callbacks run as the call ends (as with gRPC, perhaps after its answer arrived)
    with pytest.raises(LocalCallError) as bug:
        channel.with_call(request(0, clock=2), 30.0)
    assert bug.value.code() == grpc.StatusCode.UNKNOWN and "a bug" in bug.value.details()
    with pytest.raises(LocalCallError) as garbage:
        channel.with_call(b"\xff\xff\xff", 30.0)
    assert garbage.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid psgrad.StepRequest" in garbage.value.details()
    reply, _ = channel.with_call(request(0, clock=3), 30.0)
    assert reply == pb.StepReply()


def test_a_call_past_its_deadline_ends_its_connection(serve) -> None:  # type: ignore[no-untyped-def]
    release, entered = threading.Event(), threading.Event()

    def slow(req: pb.StepRequest, context: Any) -> bytes:
        entered.set()
        release.wait(30.0)
        return pb.StepReply().SerializeToString()

    calls = serve(slow)
    channel = connect(calls, 0)
    try:
        with pytest.raises(LocalCallError) as late:
            channel.with_call(request(0), 0.3)  # the handler holds the call until released
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and entered.is_set()
        with pytest.raises(ChannelLost):  # closed: its late reply cannot answer a later call
            channel.with_call(request(0), 5.0)
    finally:
        release.set()
    reply, _ = connect(calls, 0).with_call(request(0), 30.0)  # a new connection is served
    assert reply == pb.StepReply()


def test_a_call_whose_worker_hangs_up_is_no_longer_active(serve) -> None:  # type: ignore[no-untyped-def]
    entered, seen = threading.Event(), threading.Event()
    states: list[bool] = []

    def waiting(req: pb.StepRequest, context: Any) -> bytes:  # as a pull parked at its gate re-checks
        states.append(context.is_active())
        entered.set()
        while context.is_active():
            seen.wait(0.01)
        states.append(context.is_active())
        seen.set()
        return pb.StepReply().SerializeToString()

    channel = connect(serve(waiting), 0)
    lost: list[BaseException] = []

    def call() -> None:
        try:
            channel.with_call(request(0), 30.0)
        except ChannelLost as exc:
            lost.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    assert entered.wait(30.0)
    channel._sock.shutdown(2)  # the worker hangs up while its call waits
    caller.join(30.0)
    assert seen.wait(30.0) and states == [True, False] and lost


def test_a_closed_server_ends_its_connections_and_takes_no_new_ones(serve, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    calls = serve()
    channel = connect(calls, 0)
    channel.with_call(request(0), 10.0)
    calls.close()
    with pytest.raises(ChannelLost):
        channel.with_call(request(0), 10.0)
    with pytest.raises(ChannelLost):
        connect(calls, 0)
    monkeypatch.setattr(local_calls, "MAX_CONNECTIONS", 1)
    capped = serve()
    first = connect(capped, 1)
    with pytest.raises(ChannelLost):  # beyond the cap: closed at once
        connect(capped, 2)
    first.with_call(request(1), 10.0)


def test_a_malformed_message_ends_the_connection(serve) -> None:  # type: ignore[no-untyped-def]
    import socket
    import struct

    calls = serve()
    _, _, token = local_socket.offer_in([calls.offer(0)]) or ("", 0, "")
    for junk in (struct.pack("<IId", 0, protocol.MAX_MESSAGE_BYTES + 1, 1.0), struct.pack("<IId", 5, 0, 1.0) + b"{nope"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10.0)
        sock.connect("\0" + calls.name)
        local_socket.send(sock, (("rank", "0"), ("token", token)), 0.0, b"")
        assert local_socket.receive(sock)[1] == 0.0  # admitted
        sock.sendall(junk)
        assert sock.recv(1) == b""  # the server closed it
        sock.close()
    assert calls.calls == 0


def test_row_gradients_beside_the_message_reach_the_handler_where_they_arrived(serve) -> None:  # type: ignore[no-untyped-def]
    seen: list[tuple[pb.StepRequest, bytes | None]] = []

    def keep(req: pb.StepRequest, context: Any) -> bytes:
        grads = local_calls.detached(context)
        seen.append((req, None if grads is None else bytes(grads)))
        return echo(req, context)

    calls = serve(keep)
    channel = connect(calls, 0)
    grads = bytes(range(48))
    reply, _ = channel.with_call([grads, request(0, clock=5)], 10.0, ((DETACHED_KEY, "48"),))
    assert reply.push.version == 5 and seen == [(pb.StepRequest.FromString(request(0, clock=5)), grads)]
    channel.with_call(request(0, clock=6), 10.0)  # (none beside it: the whole body is the message)
    assert seen[-1] == (pb.StepRequest.FromString(request(0, clock=6)), None)
    for count in ("x", "-1", str(len(grads) + len(request(0)) + 1)):  # not a count of the body's bytes
        with pytest.raises(LocalCallError) as refused:
            channel.with_call([grads, request(0)], 10.0, ((DETACHED_KEY, count),))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "row gradients" in refused.value.details()
    assert len(seen) == 2 and calls.calls == 2


@pytest.mark.parametrize("metadata, expected", [
    ([("psgrad-local", "psgrad-ab12 3 f00d")], ("psgrad-ab12", 3, "f00d")),
    ([("psgrad-shm", "x")], None),
    ([("psgrad-local", "psgrad-ab12 three f00d")], None),
    ([("psgrad-local", "psgrad-ab12 3")], None),
    (None, None),
])
def test_an_offer_is_read_only_when_well_formed(metadata: Any, expected: Any) -> None:
    assert local_socket.offer_in(metadata) == expected


class _ShortSends:
    """A socket whose first sendmsg takes only `first` bytes (as a signal can cut a blocking send
    short), the next ones all they are given."""

    def __init__(self, first: int) -> None:
        self.first, self.out, self.calls = first, bytearray(), 0

    def sendmsg(self, parts: list[memoryview]) -> int:
        self.calls += 1
        whole = b"".join(bytes(p) for p in parts)
        taken = whole[:self.first] if self.calls == 1 else whole
        self.out += taken
        return len(taken)


@pytest.mark.parametrize("first", [3, 40, 1900, 10**6])
@pytest.mark.parametrize("pieces", [False, True])
def test_a_message_is_one_send_and_a_short_one_is_finished(first: int, pieces: bool) -> None:
    body = bytes(range(256)) * 7
    sock = _ShortSends(first)
    sent = [body[:5], memoryview(body)[5:1000], b"", body[1000:]] if pieces else body
    local_socket.send(sock, (("k", "v"),), 2.5, sent)  # type: ignore[arg-type]
    a, b = __import__("socket").socketpair()
    with a, b:
        a.sendall(sock.out)
        assert local_socket.receive(b) == ((("k", "v"),), 2.5, bytearray(body))
    assert sock.calls == (1 if first >= len(sock.out) else 2)  # the whole message in one call where it fits


def test_a_message_larger_than_the_sockets_buffer_arrives_whole() -> None:
    """On a socket with a timeout one sendmsg takes what the buffer holds; the rest follows."""
    import socket

    body = bytes(range(256)) * 40_000  # 10 MB, far more than a socket buffer
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(30)
        got: dict[str, Any] = {}
        reader = threading.Thread(target=lambda: got.update(message=local_socket.receive(b, max_body=1 << 30)))
        reader.start()
        local_socket.send(a, (("k", "v"),), 1.0, body)
        reader.join(30)
        assert got["message"] == ((("k", "v"),), 1.0, bytearray(body))


def test_both_ends_of_a_connection_buffer_a_recommenders_step_whole(serve) -> None:  # type: ignore[no-untyped-def]
    """The worker's socket and the server's end of it take SOCKET_BUFFER_BYTES of send and
    receive buffer, or the most the system allows (Linux reports twice what was set)."""
    import socket

    def most(name: str) -> int:
        try:
            with open(f"/proc/sys/net/core/{name}") as f:
                return int(f.read())
        except OSError:
            return local_socket.SOCKET_BUFFER_BYTES
    wanted = {socket.SO_SNDBUF: min(local_socket.SOCKET_BUFFER_BYTES, most("wmem_max")),
              socket.SO_RCVBUF: min(local_socket.SOCKET_BUFFER_BYTES, most("rmem_max"))}
    calls = serve()
    channel = connect(calls, 0)
    try:
        channel.with_call(request(0), 10.0)
        ends = [channel._sock, *calls._open]
        assert len(ends) == 2
        for end in ends:
            for option, size in wanted.items():
                assert end.getsockopt(socket.SOL_SOCKET, option) >= size, (end, option)
    finally:
        channel.close()


def test_a_send_the_other_end_never_takes_times_out_as_a_receive_does() -> None:
    """A request the server does not read within the call's timeout ends as its deadline (the
    caller's LocalCallError DEADLINE_EXCEEDED), not as a lost connection."""
    import socket

    a, b = socket.socketpair()
    with a, b:
        a.settimeout(0.2)
        with pytest.raises(socket.timeout):
            local_socket.send(a, (), 1.0, bytes(64 << 20))  # far more than the socket's buffer


# ---------------------------------------------------------------------------------------------
# A forward's reads of rows (PullRows) over the same connection


def rows(req: pb.RowsRequest, context: Any) -> bytes:
    """A PullRows handler's stand-in: the request's rank and its tables' count back as versions."""
    context.set_trailing_metadata(tuple(context.invocation_metadata()))
    return pb.RowsReply(versions=[req.rank, len(req.block.tables)]).SerializeToString()


def read_request(rank: int, tables: int = 1) -> bytes:
    return pb.RowsRequest(rank=rank, block=pb.RowBlock(tables=[f"t{k}" for k in range(tables)])).SerializeToString()


def offered(calls: LocalCalls, rank: int) -> local_socket.Offered:
    """A worker's view of the socket, as a Join answer offering it (and its reads, where the server
    takes them) leaves it."""
    socket = local_socket.Offered(lambda offer: LocalChannel(*offer))
    answer = [calls.offer(rank)] + ([(local_socket.READS_KEY, "1")] if calls.takes_reads else [])
    socket.set(local_socket.offer_in(answer), local_socket.reads_offered(answer))
    return socket


def test_reads_of_rows_go_over_the_socket_as_the_connections_rank_only() -> None:
    calls = LocalCalls(echo, reads=rows)
    try:
        socket = offered(calls, 2)
        assert socket.reads
        got = socket.read(read_request(2, tables=3), 10.0)
        assert got is not None and pb.RowsReply.FromString(got).versions == [2, 3]
        assert (calls.read_calls, calls.calls, socket.read_calls) == (1, 0, 1)
        with pytest.raises(LocalCallError) as refused:
            socket.read(read_request(3), 10.0)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED and "cannot read as worker 3" in refused.value.details()
        with pytest.raises(LocalCallError) as garbage:
            socket.read(b"\xff\xff\xff", 10.0)
        assert garbage.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # the connection still serves both kinds of call
        channel = socket.channel()
        assert channel is not None
        reply, _ = channel.with_call(request(2, clock=5), 10.0)
        assert reply.push.version == 5 and calls.calls == 1
        assert socket.read(read_request(2), 10.0) is not None and calls.read_calls == 2
    finally:
        calls.close()


def test_a_server_that_takes_no_reads_over_its_socket_is_not_sent_any(serve) -> None:  # type: ignore[no-untyped-def]
    calls = serve()  # (Step calls only)
    socket = offered(calls, 0)
    assert not socket.reads and socket.read(read_request(0), 10.0) is None and socket.read_calls == 0
    channel = connect(calls, 0)
    for method in ("PullRows", "Push"):  # (sent anyway: refused, the connection kept)
        channel.start(read_request(0), 10.0, ((local_socket.METHOD_KEY, method),))
        with pytest.raises(LocalCallError) as refused:
            channel.finish()
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED, method
    reply, _ = channel.with_call(request(0, clock=4), 10.0)
    assert reply.push.version == 4


def test_a_read_never_waits_for_a_step_between_its_stages_and_a_failed_read_gives_the_socket_up() -> None:
    calls = LocalCalls(echo, reads=rows)
    try:
        socket = offered(calls, 1)
        channel = socket.channel()
        assert channel is not None
        staged = socket.calling(channel, request(1, clock=9), 10.0)
        next(staged)  # the Step's request is out, its reply not read yet
        assert socket.read(read_request(1), 10.0) is None  # (through gRPC instead: not after the Step's reply)
        with pytest.raises(StopIteration) as done:
            next(staged)
        assert done.value.value[0].push.version == 9
        assert socket.read(read_request(1), 10.0) is not None
        calls.close()  # the server's socket goes away: the read is for gRPC, and the socket given up
        assert socket.read(read_request(1), 10.0) is None
        assert socket.offer is None and not socket.reads
    finally:
        calls.close()


def test_reads_of_two_servers_in_stages_both_go_out_before_either_reply_is_read() -> None:
    """Offered.reading: the request is sent at the first stage (the caller sends the other
    server's then), the reply read at the second; each server has its request before the
    caller reads any reply, and both replies are the servers' own."""
    seen: list[int] = []
    both = threading.Event()

    def slow_rows(req: pb.RowsRequest, context: Any) -> bytes:
        seen.append(req.rank)
        if len(seen) == 2:
            both.set()
        assert both.wait(10.0), "the other server's request never came before this reply was read"
        return rows(req, context)

    servers = [LocalCalls(echo, reads=slow_rows), LocalCalls(echo, reads=slow_rows)]
    try:
        sockets = [offered(calls, 4) for calls in servers]
        stages = [s.reading(read_request(4, tables=k + 1), 10.0) for k, s in enumerate(sockets)]
        for staged in stages:
            assert next(staged) is None  # (its request sent)
        replies = []
        for staged in stages:
            with pytest.raises(StopIteration) as done:
                next(staged)
            replies.append(pb.RowsReply.FromString(done.value.value).versions)
        assert replies == [[4, 1], [4, 2]] and sorted(seen) == [4, 4]
        assert [s.read_calls for s in sockets] == [1, 1] and [c.read_calls for c in servers] == [1, 1]
    finally:
        for calls in servers:
            calls.close()


def test_a_read_abandoned_between_its_stages_ends_its_connection_and_the_next_one_connects_again() -> None:
    """A staged read closed with its reply unread must not leave that reply to answer the next
    call: its connection is closed, the next call makes a new one, and the socket stays offered."""
    calls = LocalCalls(echo, reads=rows)
    try:
        socket = offered(calls, 2)
        first = socket.channel()
        staged = socket.reading(read_request(2, tables=5), 10.0)
        next(staged)
        staged.close()  # (abandoned: say, the other shard's read failed first)
        assert socket.offer is not None and socket.reads
        got = socket.read(read_request(2, tables=1), 10.0)
        assert got is not None and pb.RowsReply.FromString(got).versions == [2, 1]  # this read's own reply
        assert socket.channel() is not first
        reply, _ = socket.channel().with_call(request(2, clock=7), 10.0)  # type: ignore[union-attr]
        assert reply.push.version == 7
    finally:
        calls.close()


def test_a_staged_read_that_cannot_go_over_the_socket_ends_at_once() -> None:
    """Where no socket takes reads, reading() ends without sending anything (None: the caller reads
    through gRPC). (One that finds another thread's Step on the connection ends so too: read() is
    reading() run through, see the test of a read that never waits for a Step above.)"""
    calls = LocalCalls(echo)  # (Step calls only)
    try:
        staged = offered(calls, 0).reading(read_request(0), 10.0)
        with pytest.raises(StopIteration) as done:
            next(staged)
        assert done.value.value is None and calls.read_calls == 0
    finally:
        calls.close()


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="needs Linux's SCHED_BATCH")
@pytest.mark.parametrize("batch", [True, False])
def test_a_connections_calls_run_under_sched_batch_where_asked(batch: bool) -> None:
    """batch=True: the thread that serves a connection's calls is under SCHED_BATCH (a worker's call
    that wakes it does not preempt the worker); the caller's own thread is left as it was."""
    seen: list[int] = []

    def policy(req: pb.StepRequest, context: Any) -> bytes:
        seen.append(os.sched_getscheduler(0))
        return echo(req, context)

    before = os.sched_getscheduler(0)
    calls = LocalCalls(policy, batch=batch)
    try:
        channel = connect(calls, 0)
        channel.with_call(request(0), 10.0)
        channel.with_call(request(0, clock=2), 10.0)
        channel.close()
    finally:
        calls.close()
    assert seen == [os.SCHED_BATCH if batch else before] * 2
    assert os.sched_getscheduler(0) == before


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and two cores")
@pytest.mark.parametrize("follow", [True, False])
def test_a_connections_calls_run_on_its_workers_cores_where_asked(follow: bool) -> None:
    """follow=True: the thread that serves a connection's calls runs on the cores of the process at
    the other end (here this one: its main thread's cores), read again at each call; follow=False:
    it stays where it started."""
    seen: list[set[int]] = []

    def cores(req: pb.StepRequest, context: Any) -> bytes:
        seen.append(os.sched_getaffinity(0))
        return echo(req, context)

    everywhere = os.sched_getaffinity(0)
    first, last = min(everywhere), max(everywhere)
    main = os.getpid()  # (the peer's cores are its main thread's)
    main_before = os.sched_getaffinity(main)
    calls = LocalCalls(cores, follow=follow)
    try:
        channel = connect(calls, 0)
        os.sched_setaffinity(main, {last})
        channel.with_call(request(0), 10.0)
        os.sched_setaffinity(main, {first})
        channel.with_call(request(0, clock=2), 10.0)
        channel.close()
    finally:
        os.sched_setaffinity(main, main_before)
        calls.close()
    assert seen == ([{last}, {first}] if follow else [everywhere, everywhere])
