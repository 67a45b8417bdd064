"""Calls that ride out a server restart or fail over to a shard's backup: each attempt under its
deadline, retried while the shard does not answer (UNAVAILABLE) — on the shard's other server at
once, else with backoff — joining again where the server does not know the worker, until the
reconnect timeout; gRPC errors become PsgradError."""
from __future__ import annotations

import queue
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from psgrad.config import REFUSED_GRACE_S, ClientConfig
from psgrad.core.addresses import ACCEPTED, NO_ANSWER, REFUSED, REFUSES, tcp_answer
from psgrad.errors import NotPrimaryError, PsgradError, ServerBusyError, ServerUnavailableError, UnknownWorkerError
from psgrad.wire.protocol import ERROR_METADATA_KEY, NO_GRPC, connection_problem, to_psgrad_error

T = TypeVar("T")
RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)  # and a deadline a silent server let pass (worth_retrying)
RECONNECT_BACKOFF_S = 0.1
MAX_RECONNECT_BACKOFF_S = 2.0
# A shard with a backup: how long joining again may wait for a server that may be dead (the
# retry then goes to the other one), rather than the whole reconnect timeout.
FAILOVER_JOIN_S = 2.0
# How long the quick status call that explains a deadline waits for its answer (see diagnose).
PROBE_S = 1.0
SILENT = f"a status call got no answer within {PROBE_S:g} s"  # what diagnose() says of a server that is silent
# ... and of one that is silent on the connections it takes: each may come back (see worth_retrying)
SILENT_OR_STOPPED = (SILENT, f"a second call found that it {NO_GRPC}")
# What connection_problem() says of a connection that failed with an answer: refused, or an
# address that could not be resolved, or reached (the first two: maybe a server not started yet),
# or a connection the server closed at once (its TLS refused this client, or it was stopping).
ANSWERS = ("refused", "could not be resolved", "is unreachable", "closed the connection")


def _names(exc: grpc.RpcError, cls: type[PsgradError]) -> bool:
    """Whether a failed call carries the name of the server's error class cls."""
    trailing = exc.trailing_metadata() if isinstance(exc, grpc.Call) else None
    return (ERROR_METADATA_KEY, cls.__name__) in tuple(trailing or ())


def _names_any(exc: grpc.RpcError) -> bool:
    """Whether a failed call carries the name of a server error (the server answered)."""
    trailing = exc.trailing_metadata() if isinstance(exc, grpc.Call) else None
    return any(key == ERROR_METADATA_KEY for key, _ in tuple(trailing or ()))


def connected(channel: grpc.Channel, timeout_s: float = PROBE_S) -> bool:
    """Whether channel holds a connection to its server now (gRPC's READY)."""
    states: queue.SimpleQueue[grpc.ChannelConnectivity] = queue.SimpleQueue()
    channel.subscribe(states.put, try_to_connect=False)  # told the state it is in at once
    try:
        return states.get(timeout=timeout_s) == grpc.ChannelConnectivity.READY
    except queue.Empty:
        return False
    finally:
        channel.unsubscribe(states.put)


def diagnose(probe: Callable[[float], object], channel: grpc.Channel, address: str) -> str:
    """After a call ran out of time: what probe(PROBE_S), a quick status call to the same server
    that does not wait for a connection, finds — it answers (the call was slow), it refuses or
    cannot be reached now, or it does not answer at all. Where it does not answer and channel
    (the probe's) holds no connection, still connecting, a plain TCP connection to address says
    whether something takes it (a server that does not speak gRPC), refuses it, or drops it."""
    try:
        probe(PROBE_S)
    except grpc.RpcError as exc:
        code = exc.code() if isinstance(exc, grpc.Call) else None
        details = (exc.details() if isinstance(exc, grpc.Call) else "") or ""
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            found = NO_ANSWER if connected(channel) else tcp_answer(address, PROBE_S)
            if found in (ACCEPTED, REFUSES):
                return f"a second call found that it {NO_GRPC if found == ACCEPTED else REFUSED}"
            return (f"{SILENT} either: is it paused or overloaded, or does a "
                    "firewall or network partition drop the packets to it?")
        if code == grpc.StatusCode.UNAVAILABLE:
            problem = connection_problem(details)
            return f"a second call found that it {problem[0]}" if problem else f"a status call failed too ({details})"
    return ("it answers other calls, so this one took too long: a busy server or a slow link (raise the deadline if "
            "that is expected)")


def worth_retrying(exc: grpc.RpcError, config: ClientConfig, diagnose: Callable[[], str] | None) -> bool:
    """Whether a failed call may be tried again (for up to reconnect_timeout_s):
    the shard did not answer (UNAVAILABLE: restarting, dead, fenced), or the call's deadline passed
    with the server silent (a quick status call got no answer either: stopped, or starved of CPU,
    which it may come back from; or it takes a new connection and says nothing on it). Not a
    deadline the server explained (a sync pull still waiting for the other workers), nor one a
    server that answers other calls let pass."""
    if not isinstance(exc, grpc.Call):
        return False
    if exc.code() in RETRYABLE:
        return True
    return (config.reconnect_timeout_s > 0 and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not _names_any(exc)
            and diagnose is not None and diagnose().startswith(SILENT_OR_STOPPED))


def as_error(exc: grpc.RpcError, address: str, diagnose: Callable[[], str], what: str, timeout_s: float) -> PsgradError:
    """exc as a PsgradError; a deadline the server did not explain is diagnosed (see diagnose)."""
    late = isinstance(exc, grpc.Call) and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and not _names_any(exc)
    return to_psgrad_error(exc, address, what, timeout_s, diagnosis=diagnose() if late else "")


def first_call(
    what: str,
    attempt: Callable[[float, bool], T],
    timeout_s: float,
    address: str,
    config: ClientConfig,
    diagnose: Callable[[], str],
    hint: str = "",
) -> T:
    """attempt(deadline_s, wait_for_ready), a server's first call: it waits up to timeout_s for an
    answer, but a connection refused (nothing listens on the port), an address that cannot be
    resolved or reached, or a connection the server closed at once (its TLS refused this client:
    plaintext against TLS, another CA) — answers — is retried with backoff for REFUSED_GRACE_S
    only, then reported (refused or unresolvable with `hint`), not at the end of timeout_s (gRPC's
    wait_for_ready waits through refusals until the deadline). Any other connection failure (a
    handshake that timed out: a busy or stopped server) is waited through until timeout_s, as
    before. With config.wait_for_servers, everything is waited through until timeout_s.

    Raises:
        ServerUnavailableError: refused (or unresolvable, unreachable) for the grace period, or no
            answer within timeout_s (DeadlineExceededError, with what a quick second call found).
        PsgradError: the error the server raised.
    """
    started = time.monotonic()
    give_up = started + timeout_s
    patience = started + min(REFUSED_GRACE_S, timeout_s)
    backoff_s = RECONNECT_BACKOFF_S
    ready = config.wait_for_servers
    while True:
        try:
            # without wait_for_ready a call fails at once where the connection does
            return attempt(max(0.01, give_up - time.monotonic()), ready)
        except grpc.RpcError as exc:
            now = time.monotonic()
            code = exc.code() if isinstance(exc, grpc.Call) else None
            problem = connection_problem(exc.details() or "") if isinstance(exc, grpc.Call) else None
            answered = (not ready and code == grpc.StatusCode.UNAVAILABLE and not _names_any(exc)
                        and problem is not None and problem[0].startswith(ANSWERS))
            if not answered:
                if ready or code != grpc.StatusCode.UNAVAILABLE or _names_any(exc) or now >= give_up:
                    raise as_error(exc, address, diagnose, what, timeout_s) from None
                ready = True  # a busy or stopped server: wait for it until the deadline, as before
                continue
            if now >= patience:
                waited = f" for {now - started:.1f} s" if now - started >= 0.05 else ""
                later = problem is not None and problem[0].startswith(ANSWERS[:2])
                raise to_psgrad_error(exc, address, what, timeout_s, waited, note=hint if later else "") from None
            time.sleep(min(backoff_s, patience - now))  # a server just starting: it binds its port soon
            backoff_s = min(2 * backoff_s, MAX_RECONNECT_BACKOFF_S)


def join_any(
    run: Callable[[float], T], timeout_s: float, current: Callable[[], str], failover: Callable[[str], str | None]
) -> T:
    """run(deadline_s) (a Join) on a shard with a backup: where the server in use does not answer
    (dead, not started yet: the call does not wait for it to connect, though it waits for an
    attempt to connect to end) or does not serve (a backup without state, a fenced primary), on the
    other, in turn with backoff, until timeout_s. Each server is given FAILOVER_JOIN_S in the first
    round, twice that in the next, and so on: one that drops the packets (its host is down) holds
    the join up that long, not the whole timeout, and one that answers slowly is still joined.

    Raises:
        ServerUnavailableError, NotPrimaryError: neither served within timeout_s (the last error's
            kind, naming what each server answered last: a dead primary's refused connection and a
            backup's "no state from its primary yet" both).
    """
    give_up = time.monotonic() + timeout_s
    backoff_s = RECONNECT_BACKOFF_S
    patience_s = FAILOVER_JOIN_S
    tried: set[str] = set()
    last: dict[str, Exception] = {}  # what each server answered last
    while True:
        address = current()
        try:
            return run(max(0.1, min(patience_s, give_up - time.monotonic())))
        except (ServerUnavailableError, NotPrimaryError) as exc:
            now = time.monotonic()
            tried.add(address)
            last[address] = exc
            other = failover(address)
            if now >= give_up or other is None:
                before = last.get(other) if other is not None else None
                if before is None:
                    raise
                raise type(exc)(f"neither server of the shard served: {exc}; and {before}") from exc
            if other in tried:  # both tried: back off before the next round
                time.sleep(min(backoff_s, give_up - now))
                backoff_s = min(2 * backoff_s, MAX_RECONNECT_BACKOFF_S)
                patience_s *= 2


def call(
    what: str,
    fn: Callable[[], T],
    timeout_s: float,
    address: str,
    config: ClientConfig,
    rejoin: Callable[[float], object] | None,
    retry: bool = True,
    failover: Callable[[str], str | None] | None = None,
    diagnose: Callable[[], str] | None = None,
) -> T:
    """fn(), each attempt under its deadline; while the shard does not answer (UNAVAILABLE: a
    server restarting, dead, or fenced) or refuses it for now (ServerBusyError: too many pushes open
    there; retried on the same server, with backoff), retried for up to reconnect_timeout_s: at once on the
    shard's other server when failover(address) gives one (fn must call the server in use), with
    backoff when both were tried. Retrying a push is safe: pushes are keyed by (rank, clock), so
    the shard applies one at most once. diagnose() says, after a deadline ran out, what a quick
    second call finds (see ShardClient.diagnose).

    Raises:
        ServerUnavailableError: the shard refused, could not be reached, or did not answer in time,
            and did not come back within reconnect_timeout_s (named, with what happened and for how long).
        PsgradError: the error the server raised, or the call failed otherwise.
    """
    started = time.monotonic()
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
            if retry and _names(exc, ServerBusyError):  # the server sheds load: the same one, after a pause
                now = time.monotonic()
                give_up = now + config.reconnect_timeout_s if give_up is None else give_up
                if now >= give_up:
                    raise to_psgrad_error(exc, address, what, timeout_s) from None
                time.sleep(min(backoff_s, give_up - now))
                backoff_s = min(2 * backoff_s, MAX_RECONNECT_BACKOFF_S)
                continue
            if not (retry and worth_retrying(exc, config, diagnose)):
                raise as_error(exc, address, diagnose or (lambda: ""), what, timeout_s) from None
            now = time.monotonic()
            give_up = now + config.reconnect_timeout_s if give_up is None else give_up
            if now >= give_up:
                if not config.reconnect_timeout_s:
                    raise to_psgrad_error(exc, address, what, timeout_s, note=" (not retried: --reconnect-timeout-s 0)") from None
                waited = f" for {now - started:.1f} s of --reconnect-timeout-s {config.reconnect_timeout_s:g}"
                if len(tried) < 2:
                    raise to_psgrad_error(exc, address, what, timeout_s, waited) from None
                last = to_psgrad_error(exc, address, what, timeout_s)
                raise ServerUnavailableError(
                    f"neither server of the shard ({', '.join(sorted(tried))}) came back{waited}; the last one tried: {last}"
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
