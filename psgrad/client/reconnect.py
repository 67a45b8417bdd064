"""Calls that ride out a server restart or fail over to a shard's backup: each attempt under its
deadline, retried while the shard does not answer (UNAVAILABLE) — on the shard's other server at
once, else with backoff — joining again where the server does not know the worker, until the
reconnect timeout; gRPC errors become PsgradError."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from psgrad.config import ClientConfig
from psgrad.errors import NotPrimaryError, PsgradError, ServerUnavailableError, UnknownWorkerError
from psgrad.wire.protocol import ERROR_METADATA_KEY, to_psgrad_error

T = TypeVar("T")
RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
RECONNECT_BACKOFF_S = 0.1
MAX_RECONNECT_BACKOFF_S = 2.0
# A shard with a backup: how long joining again may wait for a server that may be dead (the
# retry then goes to the other one), rather than the whole reconnect timeout.
FAILOVER_JOIN_S = 2.0


def _names(exc: grpc.RpcError, cls: type[PsgradError]) -> bool:
    """Whether a failed call carries the name of the server's error class cls."""
    trailing = exc.trailing_metadata() if isinstance(exc, grpc.Call) else None
    return (ERROR_METADATA_KEY, cls.__name__) in tuple(trailing or ())


def join_any(
    run: Callable[[float], T], timeout_s: float, current: Callable[[], str], failover: Callable[[str], str | None]
) -> T:
    """run(deadline_s) (a Join) on a shard with a backup: where the server in use does not answer
    (dead, not started yet: the call does not wait for it to connect) or does not serve (a backup
    without state, a fenced primary), on the other, in turn with backoff, until timeout_s.

    Raises:
        ServerUnavailableError, NotPrimaryError: neither served within timeout_s (the last error).
    """
    give_up = time.monotonic() + timeout_s
    backoff_s = RECONNECT_BACKOFF_S
    tried: set[str] = set()
    while True:
        address = current()
        try:
            return run(max(0.1, give_up - time.monotonic()))
        except (ServerUnavailableError, NotPrimaryError):
            now = time.monotonic()
            tried.add(address)
            other = failover(address)
            if now >= give_up or other is None:
                raise
            if other in tried:  # both tried: back off before the next round
                time.sleep(min(backoff_s, give_up - now))
                backoff_s = min(2 * backoff_s, MAX_RECONNECT_BACKOFF_S)


def call(
    what: str,
    fn: Callable[[], T],
    timeout_s: float,
    address: str,
    config: ClientConfig,
    rejoin: Callable[[float], object] | None,
    retry: bool = True,
    failover: Callable[[str], str | None] | None = None,
) -> T:
    """fn(), each attempt under its deadline; while the shard does not answer (UNAVAILABLE: a
    server restarting, dead, or fenced), retried for up to reconnect_timeout_s: at once on the
    shard's other server when failover(address) gives one (fn must call the server in use), with
    backoff when both were tried. Retrying a push is safe: pushes are keyed by (rank, clock), so
    the shard applies one at most once.

    Raises:
        ServerUnavailableError: the shard did not come back within reconnect_timeout_s (named).
        PsgradError: the error the server raised, or the call failed otherwise.
    """
    give_up = None
    backoff_s = RECONNECT_BACKOFF_S
    rejoined = False
    tried = {address}
    while True:
        try:
            return fn()
        except grpc.RpcError as exc:
            if retry and not rejoined and rejoin is not None and _names(exc, UnknownWorkerError):
                rejoined = True  # the shard restarted from a checkpoint taken before this worker joined
                try:
                    rejoin(config.connect_timeout_s)
                    continue
                except PsgradError:
                    pass
            if not (retry and isinstance(exc, grpc.Call) and exc.code() in RETRYABLE):
                raise to_psgrad_error(exc, address, what, timeout_s) from None
            now = time.monotonic()
            give_up = now + config.reconnect_timeout_s if give_up is None else give_up
            if now >= give_up:
                if not config.reconnect_timeout_s:
                    raise to_psgrad_error(exc, address, what, timeout_s) from None
                who = f"server {address} did not" if len(tried) < 2 else f"neither server of the shard ({', '.join(sorted(tried))}) did"
                raise ServerUnavailableError(
                    f"{who} come back within --reconnect-timeout-s "
                    f"{config.reconnect_timeout_s:g} s ({what}: {exc.code().name}: {exc.details()})"
                ) from None
            other = failover(address) if failover is not None else None
            if other is not None and other not in tried:  # the backup: at once
                tried.add(other)
            else:
                time.sleep(min(backoff_s, give_up - now))  # back off before reconnecting
                backoff_s = min(2 * backoff_s, MAX_RECONNECT_BACKOFF_S)
            address = other or address
            if rejoin is not None:  # a restarted server may not know this worker yet
                left = max(0.1, give_up - time.monotonic())
                try:
                    rejoin(min(left, FAILOVER_JOIN_S) if other is not None else left)
                except PsgradError:
                    pass  # still down (or refusing): the call's own retry says what happened
