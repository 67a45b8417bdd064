"""A shard server process: the gRPC method table, binding (port 0 included), graceful stop, and
running until SIGTERM/SIGINT."""
from __future__ import annotations

import signal
import socket
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from psgrad.config import ServerConfig
from psgrad.core.credentials import is_loopback
from psgrad.core.status import ShardStatus
from psgrad.errors import ServerStartError
from psgrad.proto import ps_pb2 as pb
from psgrad.server import checkpoint, limits
from psgrad.server.checkpointer import Checkpointer, note, warn
from psgrad.server.guard import Guard
from psgrad.server.local_calls import LocalCalls
from psgrad.server.observe import Observability
from psgrad.server.replica_servicer import ReplicaServicer, attach_to_primary, send_fence
from psgrad.server.replication import BACKUP, Replication
from psgrad.server.scheduling import batch_thread
from psgrad.server.servicer import ParameterServicer
from psgrad.server.shard import Shard
from psgrad.server.streams import StreamLimits, stream_budget
from psgrad.wire.heap import tune_allocator
from psgrad.wire import local_socket, security, shm
from psgrad.wire.protocol import CHANNEL_OPTIONS, SERVICE_NAME, decoder, refusing_undecodable


def _generic_handler(servicer: ParameterServicer, replica: ReplicaServicer) -> grpc.GenericRpcHandler:
    """Method table; Init/Pull/Push frames, PushGated messages, Step and PullRows replies pass as raw
    bytes (serializer None). Requests that do not parse are refused as INVALID_ARGUMENT (decoder)."""

    def unary(fn: Callable[..., Any], req: Any, rep: Any) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(
            refusing_undecodable(fn), request_deserializer=decoder(req), response_serializer=rep.SerializeToString
        )

    return grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            "Join": unary(servicer.Join, pb.JoinRequest, pb.JoinReply),
            "Init": grpc.stream_unary_rpc_method_handler(
                servicer.Init, response_serializer=pb.InitReply.SerializeToString
            ),
            "Pull": grpc.unary_stream_rpc_method_handler(
                refusing_undecodable(servicer.Pull), request_deserializer=decoder(pb.PullRequest)
            ),
            "Push": grpc.stream_unary_rpc_method_handler(
                servicer.Push, response_serializer=pb.PushReply.SerializeToString
            ),
            "PushGated": grpc.stream_stream_rpc_method_handler(servicer.PushGated),
            "Step": grpc.unary_unary_rpc_method_handler(
                refusing_undecodable(servicer.Step), request_deserializer=decoder(pb.StepRequest)
            ),
            "Status": unary(servicer.Status, pb.StatusRequest, pb.StatusReply),
            "Heartbeat": unary(servicer.Heartbeat, pb.HeartbeatRequest, pb.HeartbeatReply),
            "Leave": unary(servicer.Leave, pb.LeaveRequest, pb.LeaveReply),
            "Rollback": unary(servicer.Rollback, pb.RollbackRequest, pb.RollbackReply),
            "PullRows": grpc.unary_unary_rpc_method_handler(
                refusing_undecodable(servicer.PullRows), request_deserializer=decoder(pb.RowsRequest)
            ),
            **replica.handlers(),
        },
    )


class RunningServer:
    """A started shard server: its bound address, its state, and a graceful stop."""

    def __init__(
        self, grpc_server: grpc.Server, servicer: ParameterServicer, address: str, checkpointer: Checkpointer | None = None,
        observability: Observability | None = None, streams: StreamLimits | None = None,
        fd_watch: limits.FdWatch | None = None,
    ) -> None:
        self._server = grpc_server
        self.servicer = servicer
        self.address = address
        self.checkpointer = checkpointer
        self.observability = observability or Observability()
        self.streams = streams  # the client streams' limits and read deadline
        self.fd_watch = fd_watch  # says when file descriptors run short
        self.stopped = threading.Event()

    @property
    def metrics_url(self) -> str:
        """http://HOST:PORT/metrics when the server serves Prometheus metrics, else ""."""
        return self.observability.metrics_address

    @property
    def shard(self) -> Shard:
        return self.servicer.shard

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, grace_s: float | None = None) -> None:
        grace = self.servicer.config.grace_s if grace_s is None else grace_s
        self.stopped.set()
        self.observability.health.enter_graceful_shutdown()
        self.shard.close()  # waiting pulls return at once instead of holding up the shutdown
        if self.servicer.local is not None:  # workers' Step calls go through gRPC, and find it stopping
            self.servicer.local.close()
        if self.shard.replication is not None:  # ... and replies waiting for the backup
            self.shard.replication.close()
        self._server.stop(grace).wait()
        if self.streams is not None:
            self.streams.close()
        if self.fd_watch is not None:
            self.fd_watch.stop()
        self.servicer.close()
        if self.checkpointer is not None:  # a planned stop loses nothing: one last checkpoint
            self.checkpointer.stop()
        self.observability.stop()

    def wait(self, timeout_s: float | None = None) -> bool:
        return bool(self._server.wait_for_termination(timeout_s))


def server_options(config: ServerConfig) -> list[tuple[str, int]]:
    """gRPC server arguments: message size limits, no port sharing, and the stream window.

    A fixed window replaces gRPC's bandwidth-delay probing, which grows each connection's window
    to tens of MB, all of it buffered in the server when the shard takes a push slower than the
    network brings it (100 MB SGD shard, gRPC pushers, VmHWM - idle, against a 264 MB target:
    255-276 MB with gRPC's windows in two sessions; 259-261 with 16 MiB; 249-255 with 8 MiB;
    232-240 with 4 MiB). The window costs push speed: the push vs raw upload ratio was a median
    0.04 higher with 8 or 16 MiB or gRPC's windows than with 4 MiB in the same round of
    interleaved runs (docs/design/decisions.md), and 2 MiB cost 10-15 % more (the sender waits for
    window updates). 4 MiB keeps the memory target with room to spare; none of the wider
    windows made the push reach 0.9 x raw reliably on 2 vCPUs. Measure both sides on your
    machine with `benchmarks/transport.py` and `benchmarks/server_bench.py --stream-window-bytes N`.
    Pushes waiting for their turn hold nothing whatever the window, since they send after
    `ready` (PushGated)."""
    options: list[tuple[str, int]] = [*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)]
    if config.stream_window_bytes:
        options += [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", config.stream_window_bytes)]
    return options


def reachable_address(config: ServerConfig, port: int) -> str:
    """HOST:PORT at which other servers reach this one: the advertised host; else the bound host;
    else (bound to every interface) this machine's address on the route to the primary, which the
    primary can reach (a wildcard address or the host name may mean loopback to the others)."""
    host = config.advertise_host
    if host is None and config.host in ("0.0.0.0", "::", "[::]") and config.replica_of is not None:
        peer, _, peer_port = config.replica_of.rpartition(":")
        peer = peer.strip("[]")
        try:
            infos = socket.getaddrinfo(peer, int(peer_port), type=socket.SOCK_DGRAM)
            with socket.socket(infos[0][0], socket.SOCK_DGRAM) as probe:
                probe.connect(infos[0][4])  # UDP: picks the route and source address, sends nothing
                host = str(probe.getsockname()[0])
        except OSError:
            host = None
    host = host or config.host
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def start_server(config: ServerConfig, extra_handlers: Sequence[grpc.GenericRpcHandler] = ()) -> RunningServer:
    """Bind and start a shard server; port 0 picks a free port (see .address). `extra_handlers`
    serve other services on the same gRPC server (psgrad_with_raw_main in benchmarks/lib/raw_grpc.py
    adds bare gRPC methods, to compare them with psgrad's in the same process).

    With config.checkpoint_dir, the newest readable checkpoint there is restored first (the shard
    then serves that job at once), and checkpoints are written while it runs.

    Raises:
        ServerStartError: the address cannot be bound (for example the port is in use).
        CheckpointError: the directory holds checkpoints, but none can be read.
        ConfigError: another server holds the checkpoint directory (see checkpoint.DirectoryLock).
    """
    # One server a checkpoint directory: held from before its checkpoint is read until the server stops.
    lock = checkpoint.DirectoryLock(Path(config.checkpoint_dir)) if config.checkpoint_dir is not None else None
    try:
        return _start(config, extra_handlers, lock)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _start(config: ServerConfig, extra_handlers: Sequence[grpc.GenericRpcHandler],
           lock: checkpoint.DirectoryLock | None) -> RunningServer:
    tune_allocator()  # megabyte-sized message buffers from the heap, not a fresh mmap each
    before, fd_limit = limits.raise_fd_limit()  # connections hold descriptors: take all the system allows
    if fd_limit != before:
        note(f"raised the open-file limit (RLIMIT_NOFILE) from {before} to {fd_limit}")
    shard = Shard(config)
    checkpointer = None
    if config.checkpoint_dir is not None:
        directory = Path(config.checkpoint_dir)
        # A backup takes its primary's state instead (its checkpoints start from that).
        snap = checkpoint.load_latest(directory, warn) if config.replica_of is None else None
        if snap is not None:
            shard.restore(snap)
            note(f"restored shard {snap.layout.index} at version {snap.version} from {directory}")
        checkpointer = Checkpointer(shard, directory, config.checkpoint_every_s, config.checkpoint_every_versions,
                                    lock=lock)
        shard.set_rollback_source(checkpointer)
    servicer = ParameterServicer(shard, config)
    obs = Observability()
    # Calls are timed only where someone can read the figures (refusals by the guard included).
    interceptors: list[grpc.ServerInterceptor] = [obs.rpc] if config.metrics_port is not None else []
    # Client streams read under a deadline and admitted within limits (per caller identity where the
    # server authenticates, else per host), before the guard reads their header.
    guard = Guard(config) if security.authenticates(config) else None
    streams = StreamLimits(config.stream_read_timeout_s, stream_budget(config.threads), config.max_streams_per_peer,
                           identify=guard.owner if guard is not None else None,
                           allowance_s=config.transfer_allowance_s, min_rate_mb_s=config.min_transfer_rate_mb_s)
    servicer.streams = streams  # whole pushes and pulls under a deadline from their size
    interceptors.append(streams)
    shard.stream_counts = streams.counts
    if guard is not None:
        interceptors.append(guard)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=config.threads, thread_name_prefix="psgrad-rpc",
                                   initializer=batch_thread, initargs=(config.batch_scheduling,)),
        options=[*server_options(config), *limits.connection_options(fd_limit, config.handshake_timeout_s)],
        interceptors=interceptors,
    )
    fd_watch = limits.FdWatch(fd_limit, limits.connection_cap(fd_limit), config.handshake_timeout_s)
    server.add_generic_rpc_handlers((_generic_handler(servicer, ReplicaServicer(shard, streams)), *extra_handlers))
    obs.add_services(server)
    obs.watch(shard.status, lambda: "" if shard.layout is None else str(shard.layout.index))
    shard.watch_serving(obs.set_serving)  # health: SERVING while the shard holds a job's state
    shard.on_gate_wait = obs.observe_gate_wait
    host = config.host
    bind_host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    target = f"{bind_host}:{config.port}"
    credentials = security.server_credentials(config)
    try:
        port = server.add_insecure_port(target) if credentials is None else server.add_secure_port(target, credentials)
    except RuntimeError as exc:
        raise ServerStartError(f"cannot bind {target}: {exc} (is another process using the port?)") from None
    if port == 0:
        raise ServerStartError(f"cannot bind {target} (is another process using the port?)")
    address = f"{bind_host}:{port}"
    reachable = reachable_address(config, port)
    channels = security.server_channels(config)
    replication = shard.replication = Replication(
        reachable, config.chunk_bytes, config.replica_timeout_s, warn, channels
    )
    replication.note = note
    replication.on_fenced = shard.close  # waiting calls end, and find the server fenced
    replication.on_dropped = lambda backup, epoch: threading.Thread(
        target=send_fence, args=(backup, epoch, True, channels), name="psgrad-drop", daemon=True
    ).start()
    if config.replica_of is not None:
        replication.role, replication.primary = BACKUP, config.replica_of
    # Step calls over a socket: workers on this host over a Unix one, the others over TCP (step_port), in
    # TLS where the gRPC port speaks TLS (not offered where a job secret goes without TLS: this host only).
    unix = shm.supported() and local_socket.supported()
    tcp = (host, config.step_port) if config.step_port is not None and (
        config.tls is not None or security.plaintext(config)) else None
    if unix or tcp is not None:
        try:
            servicer.local = LocalCalls(servicer.Step, obs.rpc._done if config.metrics_port is not None else None,
                                        unix=unix, tcp=tcp, tls=security.step_socket_context(config),
                                        reads=servicer.PullRows, batch=config.batch_scheduling,
                                        follow=config.follow_worker_cores)
        except OSError as exc:
            server.stop(0)
            raise ServerStartError(f"cannot bind --step-port {config.step_port} on {host}: {exc} (is another "
                                   "process using the port? --step-port 0 picks a free one)") from None
    server.start()
    if config.replica_of is not None:
        try:  # the state and the updates arrive as ReplicaApply calls, from now on
            epoch = attach_to_primary(config.replica_of, reachable, config.replica_timeout_s, channels)
        except ServerStartError:
            server.stop(0)
            if servicer.local is not None:
                servicer.local.close()
            raise
        replication.epoch = max(replication.epoch, epoch)
        note(f"backup of {config.replica_of} (epoch {epoch})")
    if config.tls is None and not is_loopback(config.host):  # allowed by --insecure only (check_bind)
        warn(f"serving {address} without TLS (--insecure): anyone who can reach it can read the weights and "
             "push gradients")
    elif not security.authenticates(config) and not is_loopback(config.host):
        warn(f"serving {address} with TLS but without checking callers: anyone who can reach it can read the "
             "weights and push gradients (give --tls-ca to require client certificates, or --job-secret-file)")
    shard.start_reaper()
    fd_watch.start()
    if checkpointer is not None:
        checkpointer.start()
    running = RunningServer(server, servicer, address, checkpointer, obs, streams, fd_watch)
    if config.metrics_port is not None:
        try:
            note(f"metrics at {obs.serve_http(config.host, config.metrics_port)}")
        except OSError as exc:
            running.stop(0)
            raise ServerStartError(f"cannot serve metrics on {config.host}:{config.metrics_port}: {exc}") from None
    return running


def serve_forever(
    config: ServerConfig, announce: Callable[[str], None], extra_handlers: Sequence[grpc.GenericRpcHandler] = (),
    until: Callable[[ShardStatus], bool] | None = None, linger_s: float = 0.0,
) -> None:
    """Run a server until SIGTERM or SIGINT, then stop gracefully. With `until`, also stop linger_s
    seconds after until(status) first holds (re-checked on every change of the shard's state), e.g.
    once every worker of the job has left (`psgrad run`)."""
    running = start_server(config, extra_handlers)
    stop = threading.Event()
    received: list[str] = []

    def on_signal(signum: int, _frame: object) -> None:
        # Only noted: a handler runs between two bytecodes of the main thread, which may be holding
        # `stop`'s lock just then (setting the event here could wait on it forever); the main
        # thread looks every tenth of a second (a stop waits for that, not half a second).
        received.append(signal.Signals(signum).name)

    def watch(predicate: Callable[[ShardStatus], bool]) -> None:
        while not stop.is_set():
            if running.shard.wait_until(lambda s: stop.is_set() or predicate(s), 3600.0):
                break
        # A worker reads the final weights just after it leaves: give such calls time to arrive.
        if not stop.wait(linger_s):
            received.append("every worker left")
            stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    announce(running.address)
    if until is not None:
        threading.Thread(target=watch, args=(until,), name="psgrad-until", daemon=True).start()
    while not received and not stop.wait(0.1):
        pass
    stop.set()  # (the watch thread ends with it)
    running.stop()
    announce_stop = received[0] if received else "request"
    note(f"{running.address} stopped ({announce_stop})")
