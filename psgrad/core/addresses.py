"""Server addresses as users write them: HOST:PORT, a shard's PRIMARY|BACKUP, and --servers lists."""
from __future__ import annotations

import socket
import time
from collections.abc import Sequence

from psgrad.errors import ConfigError

# What a connection refused means, in the words every such error uses (wire/protocol.py's too).
REFUSED = "refused the connection (nothing listens on that port: is the server running, at that address?)"


def parse_address(text: str) -> str:
    """Validate one HOST:PORT (IPv6 as [::1]:PORT) and return it stripped."""
    addr = text.strip()
    if "://" in addr or "/" in addr:
        raise ConfigError(f"malformed server address {text!r}: expected HOST:PORT, without a scheme or a path "
                          "(gRPC's, not a URL), e.g. 127.0.0.1:7000 or [::1]:7000")
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ConfigError(
            f"malformed server address {text!r}: expected HOST:PORT with a port in 1..65535, "
            "e.g. 127.0.0.1:7000 or [::1]:7000"
        )
    if host.startswith("[") != host.endswith("]"):
        raise ConfigError(f"malformed server address {text!r}: unbalanced brackets around IPv6 host")
    return addr


def host_of(address: str) -> str:
    """The host part of HOST:PORT ([V6]:PORT gives V6)."""
    host = address.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def parse_shard(text: str) -> tuple[str, ...]:
    """One shard's servers: 'PRIMARY' or 'PRIMARY|BACKUP' (HOST:PORT each) -> their addresses."""
    parts = text.split("|")
    if len(parts) > 2:
        raise ConfigError(f"malformed shard {text!r}: expected HOST:PORT or PRIMARY|BACKUP (one backup at most)")
    return tuple(parse_address(p) for p in parts)


def parse_servers(text: str) -> tuple[str, ...]:
    """Parse 'SHARD[,SHARD...]' into a tuple with one entry per shard (shard i is the i-th); a SHARD
    is HOST:PORT, or PRIMARY|BACKUP for a shard with a hot-standby backup ('A|B', addresses stripped)."""
    parts = [p for p in text.split(",")]
    if not text.strip() or any(not p.strip() for p in parts):
        raise ConfigError(
            f"malformed --servers {text!r}: expected HOST:PORT[,HOST:PORT...], e.g. 127.0.0.1:7000,127.0.0.1:7001"
        )
    shards = [parse_shard(p) for p in parts]
    addrs = tuple(a for shard in shards for a in shard)
    if len(set(addrs)) != len(addrs):
        raise ConfigError(
            f"--servers lists the same address twice: {text!r}; give each shard's HOST:PORT once, "
            "e.g. 127.0.0.1:7000,127.0.0.1:7001"
        )
    return tuple("|".join(shard) for shard in shards)


# What a plain TCP connection to a server finds (tcp_answer).
ACCEPTED, REFUSES, NO_ANSWER, FAILED = "accepted", "refused", "no answer", "failed"


def tcp_answer(address: str, timeout_s: float) -> str:
    """What a TCP connection to HOST:PORT finds within timeout_s: ACCEPTED (something listens),
    REFUSES (nothing does), NO_ANSWER (the packets are dropped, or the host is down), or FAILED
    (anything else: an unresolvable name, no route)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return ACCEPTED
    except ConnectionRefusedError:
        return REFUSES
    except TimeoutError:
        return NO_ANSWER
    except OSError:
        return FAILED


def _refuses(address: str, timeout_s: float) -> bool:
    """Whether a TCP connection to HOST:PORT is refused (anything else, a connection made included: no)."""
    return tcp_answer(address, timeout_s) == REFUSES


def refusing_shard(shards: Sequence[str], grace_s: float) -> tuple[str, float] | None:
    """(an address, the seconds waited) of a shard whose every server refused TCP connections
    throughout grace_s (nothing listens on their ports), or None: each shard has a server that
    accepts, or fails some other way (which the gRPC path reports). A plain socket, no gRPC or torch:
    a worker checks its servers with it before it imports them, and reports a wrong port at once."""
    started = time.monotonic()
    pending = [parse_shard(shard) for shard in shards]
    backoff_s = 0.05
    while True:
        pending = [servers for servers in pending if all(_refuses(a, 1.0) for a in servers)]
        now = time.monotonic()
        if not pending:
            return None
        if now - started >= grace_s:
            return pending[0][0], now - started
        time.sleep(min(backoff_s, grace_s - (now - started)))  # a server just starting binds its port soon
        backoff_s = min(2 * backoff_s, 0.5)
