"""The protocol both ends share: service and field names, message limits, channel options, and how
a PsgradError crosses the wire (a gRPC status plus its class name in trailing metadata)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from psgrad import errors
from psgrad.core.addresses import REFUSED
from psgrad.errors import PsgradError, ServerUnavailableError
from psgrad.proto import ps_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ParameterServer"].full_name
METHOD_PREFIX = f"/{SERVICE_NAME}/"
# Step messages carry their payload in a `bytes data` field appended by hand after the headers.
STEP_REPLY_DATA = pb.StepReply.DESCRIPTOR.fields_by_name["data"].number
STEP_REQUEST_DATA = pb.StepRequest.DESCRIPTOR.fields_by_name["data"].number
# So do PullRows and Step replies, their rows.
ROWS_REPLY_ROWS = pb.RowsReply.DESCRIPTOR.fields_by_name["rows"].number
STEP_REPLY_ROWS = pb.StepReply.DESCRIPTOR.fields_by_name["rows"].number
# Trailing-metadata key naming the PsgradError class a server raised.
ERROR_METADATA_KEY = "psgrad-error"
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# A client's channel tries to reconnect to a lost server at least once a second (gRPC's default
# backs off to 120 s between attempts, and calls fail at once in between), so a worker notices a
# restarted server within about a second. An attempt may take up to CONNECT_ATTEMPT_S, as long as
# a server gives a handshake by default (--handshake-timeout-s): gRPC reads its minimum reconnect
# backoff as that allowance, and at the backoff's 1 s a server whose TCP, TLS and HTTP/2 handshake
# took longer (a busy machine, TLS over a slow link) could never be reached at all.
CONNECT_ATTEMPT_S = 10.0
CLIENT_CHANNEL_OPTIONS: list[tuple[str, int]] = [
    *CHANNEL_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", int(CONNECT_ATTEMPT_S * 1000)),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# Pushes through frames above this size wait for the server's go-ahead before sending (PushGated):
# a push waiting for its turn at a busy shard would otherwise park up to a stream window of its
# gradient (tens of MB with gRPC's automatic windows) in the server. Smaller ones skip the extra
# round trip, since they can park little more than themselves.
GATED_PUSH_BYTES = 8 << 20

_STATUS_OF: dict[type[PsgradError], grpc.StatusCode] = {
    errors.InvalidRequestError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.ConfigError: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotInitializedError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.JobMismatchError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.WorkerStateError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.UnknownWorkerError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.EvictedError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.StalledError: grpc.StatusCode.DEADLINE_EXCEEDED,
    errors.RollbackError: grpc.StatusCode.ABORTED,
    errors.CheckpointError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.NotPrimaryError: grpc.StatusCode.UNAVAILABLE,  # retried, on the shard's other server
    errors.StaleEpochError: grpc.StatusCode.FAILED_PRECONDITION,
    errors.AuthenticationError: grpc.StatusCode.UNAUTHENTICATED,
    errors.PermissionDeniedError: grpc.StatusCode.PERMISSION_DENIED,
    errors.MemoryBudgetError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.ServerBusyError: grpc.StatusCode.RESOURCE_EXHAUSTED,  # retried by workers, on the same server
}


class Undecodable:
    """A request whose bytes are not its method's message (see decoder)."""

    def __init__(self, type_name: str, problem: str) -> None:
        self.error = errors.InvalidRequestError(f"the request is not a valid {type_name}: {problem}")


def decoder(message_type: Any) -> Callable[[bytes | bytearray | memoryview], Any]:
    """A request deserializer that never fails: bytes that do not parse become an Undecodable, which
    the handler refuses with INVALID_ARGUMENT (gRPC would answer INTERNAL, as if the server broke)."""
    name = message_type.DESCRIPTOR.full_name

    def decode(data: bytes | bytearray | memoryview) -> Any:
        try:
            return message_type.FromString(data)
        except DecodeError as exc:
            return Undecodable(name, str(exc))

    return decode


def refusing_undecodable(handler: Callable[[Any, grpc.ServicerContext], Any]) -> Callable[[Any, grpc.ServicerContext], Any]:
    """handler, with an Undecodable request refused (INVALID_ARGUMENT) before it runs."""

    def checked(request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            abort(context, request.error)
        return handler(request, context)

    return checked


def abort(context: grpc.ServicerContext, exc: PsgradError) -> None:
    """End a call with the status code of exc's class and its name in the trailing metadata
    (raises, like context.abort)."""
    code = next((_STATUS_OF[c] for c in type(exc).__mro__ if c in _STATUS_OF), grpc.StatusCode.INTERNAL)
    context.set_trailing_metadata(((ERROR_METADATA_KEY, type(exc).__name__),))
    context.abort(code, str(exc))


# What a server that accepts TCP connections but answers no gRPC is said to have done.
NO_GRPC = ("took the TCP connection but did not speak gRPC (a stopped or overloaded process, another program on "
           "that port, TLS on one side only, or a TLS handshake that failed: a --tls-ca that did not sign the "
           "server's certificate?)")
# What an UNAVAILABLE status's details say happened to the connection (matched in lower case), in
# words, and whether the request surely never reached the server. gRPC's texts, as seen with
# grpcio 1.85: "Failed to connect to remote host: Connection refused", "connect failed: ... error:
# No route to host" / "Network is unreachable", "errors resolving HOST: ... Domain name not found",
# "connection attempt timed out before receiving SETTINGS frame" (TCP accepted, gRPC silent).
_PROBLEMS: tuple[tuple[tuple[str, ...], str, bool], ...] = (
    (("connection refused",), REFUSED, True),
    (("domain name not found", "errors resolving", "name or service not known", "dns resolution"),
     "could not be resolved (is the host name right?)", True),
    (("no route to host", "network is unreachable", "host is unreachable"),
     "is unreachable (no route to that address: is it right, is the network up?)", True),
    (("before receiving settings frame", "handshake"), NO_GRPC, True),
    (("socket closed", "connection reset", "broken pipe", "goaway", "end of tcp stream"),
     "closed the connection (did it stop or crash, or did its TLS refuse this client: plaintext against TLS, "
     "another CA, a missing or expired certificate? The server logs why)", False),
)


def connection_problem(details: str) -> tuple[str, bool] | None:
    """What an UNAVAILABLE status's details say happened to the connection, in words, and whether
    the request surely never reached the server; None where they say nothing more."""
    low = details.lower()
    for needles, words, unsent in _PROBLEMS:
        if any(n in low for n in needles):
            return words, unsent
    return None


def not_sent(what: str) -> str:
    """'the push was not sent', 'the push and pull were not sent'."""
    return f"{what} {'were' if ' and ' in what else 'was'} not sent"


def to_psgrad_error(
    exc: grpc.RpcError, address: str, what: str, timeout_s: float | None, waited: str = "", diagnosis: str = "",
    note: str = "",
) -> PsgradError:
    """Map a gRPC error to the PsgradError the server raised, or to a ServerUnavailableError saying
    what happened to the call: refused, unresolvable, unreachable, closed, or no answer before
    its deadline. `waited` says how long the caller kept trying (" for 12.0 s of
    --reconnect-timeout-s 60"), `note` is added at the end; `diagnosis`, for a deadline, is what a
    quick second call found."""
    code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    name = None
    if isinstance(exc, grpc.Call):
        for key, value in exc.trailing_metadata() or ():
            if key == ERROR_METADATA_KEY:
                name = value
    cls = errors.ERRORS_BY_NAME.get(name or "")
    if cls is not None:
        return cls(f"server {address}: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        within = f" within {timeout_s:g} s" if timeout_s else ""
        why = diagnosis or ("is it paused or overloaded, or does a firewall or network partition drop the packets "
                            "to it?")
        return errors.DeadlineExceededError(
            f"server {address} did not answer {what}{within}{waited} (deadline exceeded): {why}{note}")
    if code == grpc.StatusCode.UNAVAILABLE:
        problem = connection_problem(details or "")
        if problem is None:
            return ServerUnavailableError(f"server {address} did not answer {what}{waited} (UNAVAILABLE: {details}){note}")
        words, unsent = problem
        outcome = not_sent(what) if unsent else f"{what} failed"
        return ServerUnavailableError(f"server {address} {words}{waited}: {outcome}{note}")
    return PsgradError(f"server {address}: {what} failed with {code.name}: {details}")
