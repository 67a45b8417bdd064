"""The servers' addresses through torchrun's rendezvous store: servers set theirs, workers wait for all."""
from __future__ import annotations

from datetime import timedelta
from typing import Any

from psgrad.errors import ConfigError, ServerUnavailableError
from psgrad.launch.roles import StoreInfo


def connect_store(info: StoreInfo, timeout_s: float) -> Any:
    """A torch.distributed.TCPStore client of torchrun's store (or the store itself, where this
    process is the one to host it). Keep the object alive while others may still use it."""
    from torch.distributed import TCPStore

    try:
        return TCPStore(
            info.host, info.port, is_master=info.is_master, timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except (RuntimeError, ValueError) as exc:
        role = "host" if info.is_master else "reach"
        raise ServerUnavailableError(
            f"cannot {role} torchrun's rendezvous store at MASTER_ADDR:MASTER_PORT = {info.host}:{info.port} "
            f"within {timeout_s:g} s: {exc}"
        ) from None


def publish_server(store: Any, info: StoreInfo, shard: int, address: str) -> None:
    """Shard `shard` is reachable at `address` (HOST:PORT)."""
    store.set(info.key(shard), address)


def server_addresses(store: Any, info: StoreInfo, num_servers: int, timeout_s: float) -> tuple[str, ...]:
    """Every shard's address, in shard order; waits up to timeout_s for the servers to publish them."""
    keys = [info.key(i) for i in range(num_servers)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except RuntimeError:
        missing = [k for k in keys if not store.check([k])]
        raise ServerUnavailableError(
            f"{len(missing)} of {num_servers} server(s) did not publish an address in torchrun's store "
            f"({info.host}:{info.port}) within --store-timeout-s {timeout_s:g}: {', '.join(missing)}"
        ) from None
    addresses = tuple(bytes(store.get(k)).decode() for k in keys)
    if len(set(addresses)) != len(addresses):
        raise ConfigError(f"servers published the same address twice: {addresses}; give each its own "
                          "--advertise-host or let them bind port 0")
    return addresses
