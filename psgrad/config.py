"""Frozen, self-validating configuration: JobSpec (defined in core/job.py, named here too), ServerConfig, ClientConfig, WorkerConfig, RayConfig, and the worker flags that reproduce them."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from psgrad.core.credentials import check_bind
from psgrad.core.stragglers import StragglerModel
from psgrad.core.addresses import parse_address, parse_servers, parse_shard  # noqa: F401 (config's names, as before)
from psgrad.core.job import WIRE_DTYPES, JobSpec  # noqa: F401 (config's names: JobSpec lives in core, which imports nothing above it)
from psgrad.core.modes import MODES  # noqa: F401 (config's name, as before)
from psgrad.core.schedule import LR_SCHEDULES  # noqa: F401 (config's name, as before)
from psgrad.core.compression import check_text, parse_compression
from psgrad.errors import ConfigError
from psgrad.core.optimizer_settings import DECLS, ROW_FORMS

NONFINITE_POLICIES = ("reject", "skip", "allow")
# The optimizers' names, as optimizer_settings.DECLS declares them (the CLI's choices; the server
# registry, optimizers.OPTIMIZERS, registers a rule for each: tests/unit/test_optimizers.py checks).
OPTIMIZER_NAMES = tuple(DECLS)
# What a task's evaluation reports and compare can rank by: accuracy and AUC rise, the others fall.
METRICS = ("test_accuracy", "test_loss", "test_bpb", "test_auc")


def metric_rises(metric: str) -> bool:
    """Whether higher values of metric are better (accuracy, AUC)."""
    return metric.endswith(("accuracy", "auc"))


def metric_reached(value: float, target: float, metric: str) -> bool:
    """Whether an evaluation's value of metric is at or past target (above for accuracy and AUC, below else)."""
    return value >= target if metric_rises(metric) else value <= target
DEFAULT_CHUNK_BYTES = 1 << 20


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _finite_nonneg(name: str, value: float) -> None:
    _check(math.isfinite(value) and value >= 0, f"{name} must be a finite number >= 0, got {value!r}")


def _check_key_pair(cert: str, key: str) -> None:
    """Refuse a certificate and key that do not belong together (gRPC would only say so in its log,
    and a server then fails to bind, a client to connect, as if the port or the network were at fault).

    Raises:
        ConfigError: naming both files and what OpenSSL found.
    """
    import ssl

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert, key, password=lambda: b"")
    except ssl.SSLError as exc:
        raise ConfigError(f"--tls-cert {cert!r} and --tls-key {key!r} are not a certificate and its private key (a "
                          f"key of another certificate, the two swapped, an encrypted key, or not PEM files): "
                          f"{exc.reason or exc}") from None


@dataclass(frozen=True)
class TlsConfig:
    """TLS files (PEM paths). A server: its certificate and key; with `ca`, it requires client
    certificates of that CA (mutual TLS). A client: `ca` verifies servers (None: system roots), its
    certificate and key if servers require one, the name to verify (None: the address's host)."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        _check((self.cert is None) == (self.key is None), "--tls-cert and --tls-key go together (give both)")
        for name in ("cert", "key", "ca"):
            path = getattr(self, name)
            _check(path is None or os.path.isfile(path), f"--tls-{name} {path!r} is not a file")
        _check(self.server_name is None or bool(self.server_name.strip()), "--tls-server-name must not be empty")
        if self.cert is not None and self.key is not None:
            _check_key_pair(self.cert, self.key)

    def to_argv(self) -> list[str]:
        """The flags that reproduce this config."""
        names = ("cert", "key", "ca", "server_name")
        return [a for n in names if getattr(self, n) for a in (f"--tls-{n.replace('_', '-')}", getattr(self, n))]


@dataclass(frozen=True)
class AuthConfig:
    """Tokens (never printed nor passed as flags). A server with the job `secret` requires a token derived
    from it on every call; a client sends `token`, or derives its role's from `secret`."""

    secret: bytes | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)


# The bytes the replies to reads of rows may hold at once on a server (ServerConfig.max_read_mb, in
# MiB): a few times a DLRM step's rows for every worker (a few MB each), and 4 of the largest reply
# one message carries (64 MiB); at least READ_LIMIT_MIN_MB where there is one (an export's page).
MAX_READ_MB = 256.0
READ_LIMIT_MIN_MB = 8.0


@dataclass(frozen=True)
class ServerConfig:
    """How one parameter-server process binds and treats requests."""

    host: str = "127.0.0.1"
    port: int = 0
    # The server also takes workers' Step calls over TCP at this port of its host (0: a free one;
    # None: none), offered at Join to workers whose payloads go through gRPC frames (another host,
    # or no shared memory): the same request and reply as the gRPC call, without gRPC's per-call
    # work (wire/local_socket.py); in TLS with the server's certificates where it has TLS. A job
    # secret without TLS (callers of this host only): none.
    step_port: int | None = 0
    lease_s: float = 10.0
    nonfinite: str = "reject"
    threads: int = 32
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    grace_s: float = 2.0
    # Gradient-sized receive buffers an async/ssp shard keeps; more pushes arriving at once wait
    # for one (large ones send nothing until they have it). With 1 and plain SGD the update is computed
    # as the gradient arrives. Raise it when the server has memory to spare and many workers on
    # separate hosts push at once. Sync mode keeps one per live worker regardless.
    push_buffers: int = 1
    # Bytes gRPC receives ahead for one stream (a push) before its sender must wait: at most this
    # much of a push the shard is slow to take waits in the server (pushes waiting for a receive
    # buffer send nothing: see PushGated in ps.proto). 0: gRPC's own windows, which its
    # bandwidth-delay probing grows to tens of MB per stream (for links with a long round trip,
    # where 4 MiB in flight would limit a stream to 4 MiB per round trip).
    stream_window_bytes: int = 4 << 20
    # A client stream (a push, the chief's init, a primary's replica record) whose next frame does not
    # arrive within this many seconds is cancelled, and what it held (its receive buffer, a handler
    # thread) given back: a peer that opens a push and stops sending cannot hold up the others.
    stream_read_timeout_s: float = 30.0
    # A whole push (from the moment it holds a receive buffer), a pull being sent and the chief's init
    # must move their bytes within transfer_allowance_s + their size at min_transfer_rate_mb_s (MB/s,
    # 10^6 bytes a second), or they are cancelled and what they held given back: a peer that trickles
    # a push (each frame in time) or stops reading a pull cannot hold a buffer, the weights or a thread
    # for long. 0 MB/s: no such deadline.
    transfer_allowance_s: float = 10.0
    min_transfer_rate_mb_s: float = 1.0
    # Client streams one connection may have open at once (more are refused for now: ServerBusyError,
    # which workers retry). In all, client streams may take 3/4 of `threads` (status, heartbeats,
    # joins, pulls and Step calls keep the rest).
    max_streams_per_peer: int = 8
    # A connection must complete its handshake (TLS, HTTP/2) within this many seconds, or it is closed:
    # connections that send nothing cannot hold the server's descriptors (gRPC's default is 120 s).
    handshake_timeout_s: float = 10.0
    # Where the shard's checkpoints go (None: no checkpoints). A server started again with the same
    # directory restores the newest readable one and serves the job at once.
    checkpoint_dir: str | None = None
    # A checkpoint when this many seconds passed and the shard changed since the last one.
    checkpoint_every_s: float = 10.0
    # Also one whenever the version reaches a multiple of this (0: off). In sync mode every shard
    # then checkpoints the same iterations, which is what a job-wide roll back needs.
    checkpoint_every_versions: int = 0
    # Serve Prometheus metrics over HTTP at http://HOST:PORT/metrics (HOST: the server's host; 0: a
    # free port). None: no HTTP endpoint (the health and reflection services are always on).
    metrics_port: int | None = None
    # The host name or address other servers reach this one at (a backup tells its primary where to
    # send updates). None: the bound host, or, bound to every interface, the address of the
    # interface that routes to the primary.
    advertise_host: str | None = None
    # Hot standby: serve as the backup of the primary at this HOST:PORT (None: a primary). The
    # backup takes the primary's state, applies each of its updates, and takes over (a higher
    # epoch) when a worker fails over to it.
    replica_of: str | None = None
    # How long a primary waits for its backup to acknowledge an update before it drops the backup
    # and goes on alone (a push is acknowledged only once its backup has it).
    replica_timeout_s: float = 10.0
    # TLS (None: plaintext); with tls.ca, clients must present a certificate of that CA.
    tls: TlsConfig | None = None
    # With auth.secret, every call must carry a token derived from the job secret (see AuthConfig).
    auth: AuthConfig = field(default_factory=AuthConfig)
    # Allow binding a non-loopback address without TLS (see check_bind).
    insecure: bool = False
    # What the shard's sparse (embedding) tables may hold in all, in MiB: their row index (8 bytes per
    # row placed here) and the rows made so far with their optimizer state. A table that would grow
    # past it refuses the rows (MemoryBudgetError, naming it). None: 3/4 of the machine's memory; 0: no limit.
    memory_budget_mb: float | None = None
    # What the replies to reads of rows (a worker's rows of a step, PullRows, an export's pages) and
    # to pulls of the dense weights through gRPC (a Pull's frames, a Step's reply with the weights) may
    # hold at once, in MiB, counted from each request (ids x width x 4 bytes; the shard's weights at
    # the wire's width) and held until the reply was sent: reads past it wait their turn (in order
    # of arrival, within their deadline); a read of rows larger than all of it is refused naming this
    # limit, a pull of a shard's weights larger than it goes alone (nothing else in flight).
    # 0: no limit. At least READ_LIMIT_MIN_MB otherwise (an export reads pages of up to that much).
    max_read_mb: float = MAX_READ_MB
    # The server's request threads (gRPC's and the local sockets') run under Linux's SCHED_BATCH
    # policy: a call that wakes one does not take the CPU from the process that sent it, which then
    # writes its step to every shard before any of them runs (see server/scheduling.py). False: the
    # default policy. Nothing changes elsewhere (no such policy: other systems).
    batch_scheduling: bool = True
    # A same-host worker's connection (its Unix socket) is served by a thread on that worker's
    # cores: where the worker is bound to cores of its own (psgrad.bind_cores), the server's work
    # for its calls runs on them while it waits, not behind another worker (see
    # server/scheduling.py). A worker on every core leaves the thread on every core.
    follow_worker_cores: bool = True

    def __post_init__(self) -> None:
        _check(bool(self.host), "host must not be empty")
        _check(self.tls is None or self.tls.cert is not None, "a server's TLS needs --tls-cert and --tls-key")
        check_bind(self.host, self.tls is not None, self.insecure, self.auth.secret is not None)
        _check(self.metrics_port is None or 0 <= self.metrics_port <= 65535,
               f"metrics_port must be 0..65535, got {self.metrics_port!r}")
        _check(self.advertise_host is None or bool(self.advertise_host.strip()), "advertise_host must not be empty")
        if self.replica_of is not None:
            parse_address(self.replica_of)
        _check(
            math.isfinite(self.replica_timeout_s) and self.replica_timeout_s > 0,
            f"replica_timeout_s must be a finite number > 0, got {self.replica_timeout_s!r}",
        )
        _check(0 <= self.port <= 65535, f"port must be in [0, 65535], got {self.port}")
        _check(self.step_port is None or 0 <= self.step_port <= 65535,
               f"step_port must be in [0, 65535] or None (none), got {self.step_port}")
        _check(
            math.isfinite(self.lease_s) and self.lease_s > 0, f"lease_s must be a finite number > 0, got {self.lease_s}"
        )
        _check(
            self.nonfinite in NONFINITE_POLICIES,
            f"nonfinite must be one of {', '.join(NONFINITE_POLICIES)}, got {self.nonfinite!r}",
        )
        _check(self.threads >= 2, f"threads must be >= 2, got {self.threads}")
        _check(self.chunk_bytes >= 1024, f"chunk_bytes must be >= 1024, got {self.chunk_bytes}")
        _finite_nonneg("grace_s", self.grace_s)
        _check(self.push_buffers >= 1, f"push_buffers must be >= 1, got {self.push_buffers}")
        _check(math.isfinite(self.stream_read_timeout_s) and self.stream_read_timeout_s > 0,
               f"stream_read_timeout_s must be a finite number > 0, got {self.stream_read_timeout_s!r}")
        _check(math.isfinite(self.transfer_allowance_s) and self.transfer_allowance_s > 0,
               f"transfer_allowance_s must be a finite number > 0, got {self.transfer_allowance_s!r}")
        _check(math.isfinite(self.min_transfer_rate_mb_s) and self.min_transfer_rate_mb_s >= 0,
               f"min_transfer_rate_mb_s must be a finite number >= 0 (0: no deadline), got {self.min_transfer_rate_mb_s!r}")
        _check(self.max_streams_per_peer >= 1, f"max_streams_per_peer must be >= 1, got {self.max_streams_per_peer}")
        _check(math.isfinite(self.handshake_timeout_s) and self.handshake_timeout_s > 0,
               f"handshake_timeout_s must be a finite number > 0, got {self.handshake_timeout_s!r}")
        _check(
            self.stream_window_bytes == 0 or self.stream_window_bytes >= 65536,
            f"stream_window_bytes must be 0 (gRPC's automatic windows) or >= 65536, got {self.stream_window_bytes}",
        )
        _check(self.checkpoint_dir is None or bool(self.checkpoint_dir), "checkpoint_dir must not be empty")
        _check(
            math.isfinite(self.checkpoint_every_s) and self.checkpoint_every_s > 0,
            f"checkpoint_every_s must be a finite number > 0, got {self.checkpoint_every_s!r}",
        )
        _check(self.memory_budget_mb is None or (math.isfinite(self.memory_budget_mb) and self.memory_budget_mb >= 0),
               f"memory_budget_mb must be a finite number >= 0 (0: no limit), got {self.memory_budget_mb!r}")
        _check(self.max_read_mb == 0 or (math.isfinite(self.max_read_mb) and self.max_read_mb >= READ_LIMIT_MIN_MB),
               f"max_read_mb must be 0 (no limit) or a finite number >= {READ_LIMIT_MIN_MB:g} (an export reads pages "
               f"of up to {READ_LIMIT_MIN_MB:g} MiB), got {self.max_read_mb!r}")
        _check(
            self.checkpoint_every_versions >= 0,
            f"checkpoint_every_versions must be >= 0 (0: off), got {self.checkpoint_every_versions}",
        )


# A first call (a worker's Join, a status request) to a server that refuses the connection (nothing
# listens on its port), or whose address cannot be resolved or reached, is retried this long and
# then reported (client/reconnect.py, first_call): a refused connection is an answer, and a server
# being started binds its port within this. ClientConfig.wait_for_servers (`psgrad run`,
# `--wait-for-servers`) waits the whole connect timeout instead, for servers started later.
REFUSED_GRACE_S = 2.0
# Compressed pulls (ClientConfig.compress_pull): the copy a worker holds is made exact again every
# this many versions of a shard, and whenever it would be this far from the weights (relative).
PULL_RESYNC_EVERY = 0
PULL_RESYNC_ERROR = 0.1
WAIT_FOR_SERVERS_HINT = (" (--wait-for-servers, or ClientConfig(wait_for_servers=True), waits up to --connect-timeout-s "
                         "for a server that starts later)")


@dataclass(frozen=True)
class ClientConfig:
    """Deadlines and transfer settings of a worker's connection to the shards."""

    connect_timeout_s: float = 10.0
    rpc_timeout_s: float = 60.0
    init_timeout_s: float = 120.0
    # How long calls to a shard that stopped answering (UNAVAILABLE: a server restarting from its
    # checkpoint) are retried, with backoff, before the worker gives up naming the shard; 0: at once.
    reconnect_timeout_s: float = 60.0
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    # Move payloads to and from a shard on the same host through shared memory (the calls carry
    # only headers); off another host, or where the server cannot open the segment, gRPC frames
    # as usual. Turn it off to measure the gRPC path alone, or to save the worker one shard-sized
    # segment per server.
    shared_memory: bool = True
    # With shared_memory: make each step's Step call to a server on this host over the local socket
    # the server offers at Join (a Unix socket; a connection is bound to this worker's rank by a
    # token in the Join answer), not gRPC, which costs both ends more CPU per call than a small
    # model's push; a failed connection sends the calls through gRPC again. Off: gRPC.
    local_socket: bool = True
    # With shared_memory: read a forward's rows of a sparse table from a server on this host in
    # place, from the files under /dev/shm the server keeps them in once a worker of its host asks
    # (its Join answer names them), not through a PullRows call; a read the server was changing
    # something under, or a table it does not lend, goes through the call. x86-64 only. Off: calls.
    rows_in_place: bool = True
    # Make each step's Step call to a server on another host (or with shared_memory off) over the TCP
    # socket the server offers at Join (in TLS where this client has TLS), not gRPC, which costs both
    # ends about a millisecond of CPU more per call; a connection that fails sends the calls through
    # gRPC again (warned once). Off: gRPC.
    step_socket: bool = True
    # With a job's --compress: compress pushes to shards on this host too (through shared memory,
    # where fewer bytes save nothing and encoding costs CPU). Off: those shards get the gradient
    # itself, so a one-host job trains as uncompressed unless this is on.
    compress_same_host: bool = False
    # Async: push a step's gradient and pull the next weights at once, as two calls, to a shard on
    # another host, so both directions of the link carry data together (one Step call sends its
    # reply only after the whole request arrived). The weights pulled then may not hold the
    # worker's own last push yet (a step staler). Off, and in sync and ssp (whose pulls follow the
    # push): one Step call (where it fits).
    duplex: bool = False
    # Pull the change of the weights since the copy this worker holds, compressed with a push codec
    # (topk:R, randomk:R, sign, int8; "none": the weights themselves), error feedback kept by the
    # server per worker (docs/guide/compression.md, "Compressed pulls"). To shards on other hosts,
    # or on this host too with compress_same_host. Costs each such shard a copy of its range per
    # worker, and the worker a copy of the whole model. The copy is made exact again every
    # pull_resync_every versions of a shard (0: never), and whenever it would be further than
    # pull_resync_error from the weights (relative: ||w - copy|| / ||w||; 0: never).
    compress_pull: str = "none"
    pull_resync_every: int = PULL_RESYNC_EVERY
    pull_resync_error: float = PULL_RESYNC_ERROR
    # A first call to a server that refuses the connection (nothing listens on its port) reports it
    # after REFUSED_GRACE_S; True waits up to connect_timeout_s for servers that start later
    # (`psgrad run`: a cluster starts its processes in any order).
    wait_for_servers: bool = False
    tls: TlsConfig | None = None  # None: plaintext, or gRPC's local credentials when sending a token
    auth: AuthConfig = field(default_factory=AuthConfig)  # the credential each call carries

    def __post_init__(self) -> None:
        for name in ("connect_timeout_s", "rpc_timeout_s", "init_timeout_s"):
            value = getattr(self, name)
            _check(math.isfinite(value) and value > 0, f"{name} must be > 0, got {value!r}")
        _check(
            math.isfinite(self.reconnect_timeout_s) and self.reconnect_timeout_s >= 0,
            f"reconnect_timeout_s must be a finite number >= 0, got {self.reconnect_timeout_s!r}",
        )
        _check(self.chunk_bytes >= 1024, f"chunk_bytes must be >= 1024, got {self.chunk_bytes}")
        check_text(self.compress_pull, "compress_pull")
        parse_compression(self.compress_pull)  # (ConfigError naming the grammar)
        _check(self.pull_resync_every >= 0, f"pull_resync_every must be >= 0 (0: never), got {self.pull_resync_every}")
        _check(math.isfinite(self.pull_resync_error) and self.pull_resync_error >= 0,
               f"pull_resync_error must be a finite number >= 0 (0: never), got {self.pull_resync_error!r}")

    def to_argv(self) -> list[str]:
        """The `psgrad worker` flags that reproduce this config. chunk_bytes has no flag: a worker
        started with these flags has its default; nor have the secrets of `auth` (a launcher passes
        them in files or the environment, never on a command line)."""
        return [
            "--connect-timeout-s", str(self.connect_timeout_s), "--rpc-timeout-s", str(self.rpc_timeout_s),
            "--init-timeout-s", str(self.init_timeout_s), "--reconnect-timeout-s", str(self.reconnect_timeout_s),
            "--shared-memory" if self.shared_memory else "--no-shared-memory",
            *([] if self.local_socket else ["--no-local-socket"]),
            *([] if self.rows_in_place else ["--no-rows-in-place"]),
            *([] if self.step_socket else ["--no-step-socket"]),
            *(["--compress-same-host"] if self.compress_same_host else []),
            *(["--duplex"] if self.duplex else []),
            *(["--compress-pull", self.compress_pull, "--pull-resync-every", str(self.pull_resync_every),
               "--pull-resync-error", str(self.pull_resync_error)] if self.compress_pull != "none" else []),
            *(["--wait-for-servers"] if self.wait_for_servers else []),
            *(self.tls.to_argv() if self.tls is not None else []),
        ]


@dataclass(frozen=True)
class WorkerConfig:
    """One worker's training run: which servers, task, rank, how many steps."""

    servers: tuple[str, ...]
    task: str = "digits"
    rank: int = 0
    steps: int = 1000
    batch_size: int = 32
    device: str = "auto"
    seed: int = 0
    metrics_out: str | None = None
    metrics_append: bool = False  # write metrics_out after the records it holds (a resumed job), not anew
    eval_every: int = 0  # 0: about 10 evaluations per run
    log_every: int = 0  # 0: about 10 progress lines per run
    slowdown: float = 1.0  # straggler: each step takes this many times its measured compute time
    jitter_ms: float = 0.0  # random extra delay per step, uniform in [0, jitter_ms]
    overlap: bool = False  # push/pull in the background while the next step computes (async/ssp)
    save_model: str | None = None  # write the final model's state_dict here (torch.save)
    # This worker's index among the processes on its host (torchrun's LOCAL_RANK, SLURM_LOCALID):
    # device "auto" on a host with G GPUs takes cuda:(local_rank mod G), one worker per GPU.
    local_rank: int | None = None
    # Bind this worker to its share of its host's cores before its threads start (psgrad.bind_cores:
    # worker local_rank of local_workers gets the local_rank-th of local_workers equal runs of cores;
    # None: from torchrun's or SLURM's variables), and run no more torch threads than those cores.
    bind_cores: bool = False
    local_workers: int | None = None
    # The learning rate each step pushes: the job's lr times a schedule of the clock (a torch
    # LambdaLR on the PSOptimizer): linear warmup over warmup_steps, then constant, or cosine or
    # linear decay to 0 at `steps`.
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    # Emulated accelerator: every step takes at least this long (compute, then wait the rest);
    # a straggler's slowdown multiplies it. 0: steps take their compute time (x slowdown).
    step_time_ms: float = 0.0
    data_dir: str | None = None  # where a task that reads files finds them (fashion-mnist)
    straggler_model: StragglerModel = field(default_factory=StragglerModel)  # random slow steps, a moving slow node
    # psgrad embeddings: up to this many hot rows per table kept in the worker and served for
    # row_cache_staleness steps (async/ssp; 0: every forward pulls its rows)
    row_cache_rows: int = 0
    row_cache_staleness: int = 1
    # psgrad embeddings: an optimizer of their own for their rows ("": the job's) and their lr (None:
    # the job's, or torch's default lr of table_optimizer), in one param group of all the model's tables
    table_optimizer: str = ""
    table_lr: float | None = None
    client: ClientConfig = field(default_factory=ClientConfig)

    def __post_init__(self) -> None:
        _check(
            isinstance(self.servers, tuple),
            f"servers must be a tuple of HOST:PORT addresses (empty only for the all-reduce baseline), "
            f"got {self.servers!r}",
        )
        for entry in self.servers:
            parse_shard(entry)
        _check(self.rank >= 0, f"rank must be >= 0, got {self.rank}")
        _check(self.steps >= 0, f"steps must be >= 0, got {self.steps}")
        _check(self.batch_size >= 1, f"batch_size must be >= 1, got {self.batch_size}")
        _check(self.eval_every >= 0, f"eval_every must be >= 0, got {self.eval_every}")
        _check(self.log_every >= 0, f"log_every must be >= 0, got {self.log_every}")
        _check(
            math.isfinite(self.slowdown) and self.slowdown >= 1.0,
            f"slowdown must be a finite number >= 1, got {self.slowdown!r}",
        )
        _finite_nonneg("jitter_ms", self.jitter_ms)
        _check(
            self.device in ("auto", "cpu") or self.device.startswith("cuda"),
            f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}",
        )
        _check(self.local_rank is None or self.local_rank >= 0, f"local_rank must be >= 0, got {self.local_rank}")
        _check(self.local_workers is None or self.local_workers >= 1,
               f"local_workers must be >= 1, got {self.local_workers}")
        _check(self.local_rank is None or self.local_workers is None or self.local_rank < self.local_workers,
               f"local_rank must be < local_workers ({self.local_workers}), got {self.local_rank}")
        _check(self.lr_schedule in LR_SCHEDULES,
               f"lr_schedule must be one of {', '.join(LR_SCHEDULES)}, got {self.lr_schedule!r}")
        _check(self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}")
        _finite_nonneg("step_time_ms", self.step_time_ms)
        _check(self.row_cache_rows >= 0, f"row_cache_rows must be >= 0 (0: no cache), got {self.row_cache_rows}")
        _check(self.row_cache_staleness >= 1, f"row_cache_staleness must be >= 1 step, got {self.row_cache_staleness}")
        _check(not self.table_optimizer or self.table_optimizer in ROW_FORMS,
               f"table_optimizer must be one of {', '.join(ROW_FORMS)} (the optimizers with a row form), "
               f"got {self.table_optimizer!r}")
        _check(self.table_lr is None or (math.isfinite(self.table_lr) and self.table_lr > 0),
               f"table_lr must be a finite number > 0, got {self.table_lr!r}")

    def table_groups(self) -> dict[str, Any] | None:
        """The param group of the model's psgrad embeddings these settings make (without "params"),
        or None: the tables take the job's optimizer and lr."""
        if not self.table_optimizer and self.table_lr is None:
            return None
        return {**({"optimizer": self.table_optimizer} if self.table_optimizer else {}),
                **({"lr": self.table_lr} if self.table_lr is not None else {})}

    def to_argv(self) -> list[str]:
        """The `psgrad worker` flags that reproduce this config, its client's included. With no servers
        (the all-reduce baseline) there is no --servers: `psgrad allreduce` takes the rest."""
        argv = ["--servers", ",".join(self.servers)] if self.servers else []
        argv += [
            "--task", self.task, "--rank", str(self.rank), "--steps", str(self.steps),
            "--batch-size", str(self.batch_size), "--device", self.device, "--seed", str(self.seed),
            "--eval-every", str(self.eval_every), "--log-every", str(self.log_every),
            "--slowdown", str(self.slowdown), "--jitter-ms", str(self.jitter_ms),
        ]
        argv += [] if self.metrics_out is None else ["--metrics-out", self.metrics_out]
        argv += ["--metrics-append"] if self.metrics_append else []
        argv += ["--overlap"] if self.overlap else []
        argv += [] if self.save_model is None else ["--save-model", self.save_model]
        argv += [] if self.local_rank is None else ["--local-rank", str(self.local_rank)]
        argv += ["--bind-cores"] if self.bind_cores else []
        argv += [] if self.local_workers is None else ["--local-workers", str(self.local_workers)]
        argv += ["--lr-schedule", self.lr_schedule, "--warmup-steps", str(self.warmup_steps),
                 "--step-time-ms", str(self.step_time_ms)]
        argv += [] if self.data_dir is None else ["--data-dir", self.data_dir]
        argv += ["--row-cache-rows", str(self.row_cache_rows), "--row-cache-staleness", str(self.row_cache_staleness)]
        argv += ["--table-optimizer", self.table_optimizer] if self.table_optimizer else []
        argv += [] if self.table_lr is None else ["--table-lr", str(self.table_lr)]
        return argv + self.straggler_model.to_argv() + self.client.to_argv()


@dataclass(frozen=True)
class RayConfig:
    """Where `psgrad launch --backend ray` runs the job's actors, and what each asks Ray for."""

    # None: start a Ray instance on this machine for the job; "auto": the running cluster
    # (RAY_ADDRESS, else the one started on this machine); HOST:PORT of the head, or ray://HOST:PORT.
    address: str | None = None
    server_cpus: float = 1.0
    worker_cpus: float = 1.0
    worker_gpus: float | None = None  # None: a GPU per worker where the cluster has GPUs (shared if too few), else 0
    # How often Ray may restart a server actor that died; it restores from its checkpoint, so
    # without a checkpoint directory there are no restarts.
    server_restarts: int = 3
    object_store_mb: int = 128  # the object store of the instance started for the job (address None)
    start_timeout_s: float = 120.0  # every actor up (a cluster may first have to add a node)

    def __post_init__(self) -> None:
        _check(self.address is None or bool(self.address.strip()), "address must not be empty")
        for name in ("server_cpus", "worker_cpus"):
            _finite_nonneg(name, getattr(self, name))
        if self.worker_gpus is not None:
            _finite_nonneg("worker_gpus", self.worker_gpus)
            _check(self.worker_gpus <= 1 or self.worker_gpus == int(self.worker_gpus),
                   f"worker_gpus must be a fraction of one GPU or a whole number, got {self.worker_gpus!r}")
        _check(self.server_restarts >= 0, f"server_restarts must be >= 0, got {self.server_restarts}")
        # Ray refuses an object store below 75 MiB.
        _check(self.object_store_mb >= 75, f"object_store_mb must be >= 75 (Ray's minimum), got {self.object_store_mb}")
        _check(math.isfinite(self.start_timeout_s) and self.start_timeout_s > 0,
               f"start_timeout_s must be a finite number > 0, got {self.start_timeout_s!r}")
