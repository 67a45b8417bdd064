"""Server addresses as users write them: HOST:PORT, a shard's PRIMARY|BACKUP, and --servers lists."""
from __future__ import annotations

from psgrad.errors import ConfigError


def parse_address(text: str) -> str:
    """Validate one HOST:PORT (IPv6 as [::1]:PORT) and return it stripped."""
    addr = text.strip()
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ConfigError(
            f"malformed server address {text!r}: expected HOST:PORT with a port in 1..65535, "
            "e.g. 127.0.0.1:7000 or [::1]:7000"
        )
    if host.startswith("[") != host.endswith("]"):
        raise ConfigError(f"malformed server address {text!r}: unbalanced brackets around IPv6 host")
    return addr


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
