"""What `psgrad run` works out from a cluster engine's environment: RunOptions in, a resolved Role out."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from psgrad.core.addresses import parse_address
from psgrad.errors import ConfigError

SERVER, WORKER = "server", "worker"
KINDS = (SERVER, WORKER)
ENGINES = ("tf-config", "torchrun", "slurm", "k8s")
DEFAULT_PORT_BASE = 7070


class LaunchEnvironmentError(ConfigError):
    """The cluster engine's environment is missing, malformed or contradicts itself or the flags;
    the message names the variable (a usage error: exit 2)."""


def refuse(message: str) -> LaunchEnvironmentError:
    return LaunchEnvironmentError(message)


@dataclass(frozen=True)
class RunOptions:
    """The flags of `psgrad run` the environment readers use (None: not given)."""

    num_servers: int | None = None
    num_workers: int | None = None
    role: str | None = None  # asserted role; Kubernetes needs it (an index does not say which Job)
    host: str = "0.0.0.0"  # where a server binds
    port_base: int = DEFAULT_PORT_BASE  # SLURM: server i binds P+i; Kubernetes: every server binds P
    advertise_host: str | None = None  # the host name a torchrun server publishes (default: hostname)
    server_names: str | None = None  # Kubernetes: server i's DNS name, a pattern with {i}
    hostname: str = "localhost"  # this machine's name (the CLI passes socket.gethostname())

    def __post_init__(self) -> None:
        if self.role is not None and self.role not in KINDS:
            raise ConfigError(f"--role must be server or worker, got {self.role!r}")
        for name in ("num_servers", "num_workers"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if not 1 <= self.port_base <= 65535:
            raise ConfigError(f"--port-base must be in [1, 65535], got {self.port_base}")
        if not self.host:
            raise ConfigError("--host must not be empty")


@dataclass(frozen=True)
class StoreInfo:
    """Where torchrun's rendezvous TCPStore is, and the keys psgrad uses in it."""

    host: str
    port: int
    is_master: bool  # host the store ourselves (torchrun without the agent's store: global rank 0)
    prefix: str  # psgrad/RUN_ID/RESTART_COUNT: a restarted group never reads the old addresses

    def key(self, shard: int) -> str:
        return f"{self.prefix}/server/{shard}"


@dataclass(frozen=True)
class Role:
    """One process of a job: server shard `index` or worker rank `index`, and how it finds the others.

    A server binds bind_host:port (port 0: any free one) and is reached at advertise_host:PORT.
    A worker uses `servers` when the environment names them, otherwise asks `store`."""

    engine: str
    kind: str
    index: int
    num_servers: int
    num_workers: int
    bind_host: str = "0.0.0.0"
    port: int = 0
    advertise_host: str = ""
    servers: tuple[str, ...] = ()
    store: StoreInfo | None = None

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.kind not in KINDS:
            raise ConfigError(f"role must be server or worker, got {self.kind!r}")
        if self.num_servers < 1 or self.num_workers < 1:
            raise ConfigError(f"a job needs >= 1 server and >= 1 worker, got {self.num_servers} and {self.num_workers}")
        count = self.num_servers if self.kind == SERVER else self.num_workers
        if not 0 <= self.index < count:
            raise ConfigError(f"{self.kind} index must be in [0, {count}), got {self.index}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        for address in self.servers:
            parse_address(address)
        if self.servers and len(self.servers) != self.num_servers:
            raise ConfigError(f"{len(self.servers)} server address(es) for {self.num_servers} server(s): {self.servers}")
        if self.kind == WORKER and not self.servers and self.store is None:
            raise ConfigError("a worker needs the servers' addresses or a store to read them from")
        if self.kind == SERVER and not self.advertise_host:
            raise ConfigError("a server needs a host name to advertise")

    def describe(self) -> str:
        what = f"server {self.index} of {self.num_servers}" if self.kind == SERVER else (
            f"worker rank {self.index} of {self.num_workers}" + (" (the chief)" if self.index == 0 else ""))
        return f"{what}, from the {self.engine} environment"


def need(env: Mapping[str, str], name: str, why: str) -> str:
    """env[name], or a refusal naming the variable."""
    value = env.get(name)
    if value is None or not value.strip():
        raise refuse(f"{name} is not set ({why})")
    return value.strip()


def need_int(env: Mapping[str, str], name: str, why: str, low: int = 0) -> int:
    text = need(env, name, why)
    try:
        value = int(text)
    except ValueError:
        raise refuse(f"{name}={text!r} is not an integer ({why})") from None
    if value < low:
        raise refuse(f"{name}={value} must be >= {low} ({why})")
    return value


def check_flag(flag: str, given: int | None, variable: str, found: int) -> None:
    """A count given as a flag must agree with the one the environment implies."""
    if given is not None and given != found:
        raise refuse(f"{flag} {given} contradicts {variable}, which makes it {found}")


def split_address(text: str, variable: str) -> tuple[str, int]:
    try:
        address = parse_address(text)
    except ConfigError as exc:
        raise refuse(f"{variable}: {exc}") from None
    host, _, port = address.rpartition(":")
    return host, int(port)
