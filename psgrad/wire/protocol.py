"""The protocol both ends share: service and field names, message limits, channel options, and how
a PsgradError crosses the wire (a gRPC status plus its class name in trailing metadata)."""
from __future__ import annotations

import grpc

from psgrad import errors
from psgrad.errors import PsgradError, ServerUnavailableError
from psgrad.proto import ps_pb2 as pb

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["ParameterServer"].full_name
METHOD_PREFIX = f"/{SERVICE_NAME}/"
# Step messages carry their payload in a `bytes data` field appended by hand after the headers.
STEP_REPLY_DATA = pb.StepReply.DESCRIPTOR.fields_by_name["data"].number
STEP_REQUEST_DATA = pb.StepRequest.DESCRIPTOR.fields_by_name["data"].number
# Trailing-metadata key naming the PsgradError class a server raised.
ERROR_METADATA_KEY = "psgrad-error"
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# A client's channel tries to reconnect to a lost server at least once a second (gRPC's default
# backs off to 120 s between attempts, and calls fail at once in between), so a worker notices a
# restarted server within about a second.
CLIENT_CHANNEL_OPTIONS: list[tuple[str, int]] = [
    *CHANNEL_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
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
}


def abort(context: grpc.ServicerContext, exc: PsgradError) -> None:
    """End a call with the status code of exc's class and its name in the trailing metadata
    (raises, like context.abort)."""
    code = next((_STATUS_OF[c] for c in type(exc).__mro__ if c in _STATUS_OF), grpc.StatusCode.INTERNAL)
    context.set_trailing_metadata(((ERROR_METADATA_KEY, type(exc).__name__),))
    context.abort(code, str(exc))


def to_psgrad_error(exc: grpc.RpcError, address: str, what: str, timeout_s: float | None) -> PsgradError:
    """Map a gRPC error to the PsgradError the server raised, or to ServerUnavailableError."""
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
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        within = f" within {timeout_s:g} s" if timeout_s else ""
        return ServerUnavailableError(
            f"server {address} did not answer {what}{within} ({code.name}: {details}); "
            "is it running and reachable?"
        )
    return PsgradError(f"server {address}: {what} failed with {code.name}: {details}")
