"""The server's door: an interceptor that authenticates every call and lets it through only as the
caller's own rank (the one place the rank in each request, frames included, is checked)."""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from psgrad.config import ServerConfig
from psgrad.core.credentials import ADMIN, SERVER, WORKER, Identity
from psgrad.errors import InvalidRequestError, PermissionDeniedError, PsgradError
from psgrad.proto import ps_pb2 as pb
from psgrad.wire import protocol
from psgrad.wire.frames import parse_frame
from psgrad.wire.protocol import METHOD_PREFIX, Undecodable
from psgrad.wire.security import Authenticator

# Services every caller may use: health checks (probes hold no credential) and reflection (the
# schema, which is public); they reveal nothing of the job.
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
CHIEF = 0


@dataclass(frozen=True)
class Rule:
    """Who may call a method: `kinds` of caller; a worker only as the rank its request names
    (`rank` reads it from the request, or from the first frame of a client stream); `chief`: only
    worker 0; `observe_admin`: the admin too, for read-only pulls."""

    kinds: tuple[str, ...]
    rank: Callable[[Any], tuple[int, bool]] | None = None  # request -> (rank, observe)
    frame: Any = None  # a client stream's frame type: the rank is in its first frame (the header)
    chief: bool = False


def _plain(req: Any) -> tuple[int, bool]:
    return int(req.rank), False


def _header(frame_type: Any, first: bytes | None) -> Any:
    if first is None:
        raise InvalidRequestError("empty stream, expected a header frame first")
    msg = parse_frame(frame_type, first, "the first frame")
    if msg.WhichOneof("kind") != "header":
        raise InvalidRequestError("the first frame must be the header")
    return msg.header


RULES: dict[str, Rule] = {
    "Join": Rule((WORKER,), _plain),
    "Init": Rule((WORKER,), lambda h: (int(h.join.rank), False), pb.InitFrame, chief=True),
    "Pull": Rule((WORKER, ADMIN), lambda r: (int(r.rank), bool(r.observe))),
    "Push": Rule((WORKER,), _plain, pb.PushFrame),
    "PushGated": Rule((WORKER,), _plain, pb.PushFrame),
    "Step": Rule((WORKER,), lambda r: (int(r.push.rank), False)),
    "Heartbeat": Rule((WORKER,), _plain),
    "Leave": Rule((WORKER,), _plain),
    "Rollback": Rule((WORKER,), _plain),
    "PullRows": Rule((WORKER, ADMIN), lambda r: (int(r.rank), bool(r.observe))),
    "Status": Rule((WORKER, ADMIN)),
    "ReplicaAttach": Rule((SERVER,)),
    "ReplicaApply": Rule((SERVER,)),
    "Fence": Rule((SERVER,)),
}


def permit(method: str, rule: Rule, who: Identity, request: Any) -> None:
    """Whether `who` may make this call with this request (its header, for a client stream).

    Raises:
        PermissionDeniedError: not allowed; the message says what the caller's credential allows.
    """
    rank, observe = rule.rank(request) if rule.rank is not None else (-1, False)
    if who.kind == ADMIN and ADMIN in rule.kinds and (rule.rank is None or observe):
        return
    if who.kind not in rule.kinds or (who.kind == ADMIN and not observe):
        allowed = " or ".join("the job's servers" if k == SERVER else f"the {k}" if k == ADMIN else "workers"
                              for k in rule.kinds)
        raise PermissionDeniedError(f"{method} is for {allowed}{' (read-only pulls)' if ADMIN in rule.kinds else ''}; "
                                    f"this credential is {who.describe()}'s")
    if rule.chief and who.rank != CHIEF:
        raise PermissionDeniedError(f"only the chief (worker 0) may initialize a shard; this credential is "
                                    f"{who.describe()}'s")
    if rule.rank is not None and rank != who.rank:
        raise PermissionDeniedError(f"{method} as worker rank {rank} refused: this credential is {who.describe()}'s, "
                                    "and a worker may act only as its own rank")


class Guard(grpc.ServerInterceptor):
    """Authenticates each call of the parameter and replication services (Authenticator) and
    checks it against RULES before the servicer sees it; other services are refused, except the
    open ones (health, reflection)."""

    def __init__(self, config: ServerConfig) -> None:
        self._auth = Authenticator(config)
        self._wrapped: dict[str, tuple[Any, Any]] = {}  # method -> (its handler, the guarded one)

    def owner(self, context: grpc.ServicerContext) -> str | None:
        """The caller's role ('worker-3', 'admin', 'server'), or None where its credential is missing
        or not valid (the guard refuses its call): whose cap a client stream counts against."""
        try:
            return self._auth.identify(context).role
        except PsgradError:
            return None

    def _identify(self, context: grpc.ServicerContext) -> Identity:
        try:
            return self._auth.identify(context)
        except PsgradError as exc:
            protocol.abort(context, exc)
            raise  # unreachable: abort raises

    def _check(self, method: str, rule: Rule, context: grpc.ServicerContext, request: Any,
               who: Identity | None = None) -> None:
        try:
            who = who or self._auth.identify(context)
            if not isinstance(request, Undecodable):  # (its handler refuses it: it names no rank)
                permit(method, rule, who, request)
        except PsgradError as exc:
            protocol.abort(context, exc)

    def intercept_service(self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        full = details.method
        if handler is None or full.startswith(OPEN_SERVICES):
            return handler
        cached = self._wrapped.get(full)
        if cached is not None and cached[0] is handler:  # the method table's handlers never change
            return cached[1]
        guarded = self._guard(full, handler)
        self._wrapped[full] = (handler, guarded)
        return guarded

    def _guard(self, full: str, handler: Any) -> Any:
        """handler, checking each call before it runs (see intercept_service)."""
        method = full[len(METHOD_PREFIX):] if full.startswith(METHOD_PREFIX) else ""
        rule = RULES.get(method)
        check, identify = self._check, self._identify
        if rule is None:
            def refuse(request: Any, context: grpc.ServicerContext) -> Any:
                protocol.abort(context, PermissionDeniedError(f"{full} is not served to anyone"))

            return grpc.unary_unary_rpc_method_handler(refuse)
        if handler.request_streaming:
            behavior = handler.stream_unary or handler.stream_stream

            def streaming(frames: Iterator[bytes], context: grpc.ServicerContext) -> Any:
                # Who calls, from the TLS session and the metadata, before a byte of the stream is read:
                # a caller without a credential holds no thread waiting for its frames.
                who = identify(context)
                first = next(frames, None)
                try:
                    header = _header(rule.frame, first) if rule.frame is not None else None
                except InvalidRequestError as exc:
                    protocol.abort(context, InvalidRequestError(f"{method}: {exc}"))
                check(method, rule, context, header, who)
                return behavior(itertools.chain(() if first is None else (first,), frames), context)

            kind = "stream_unary" if handler.stream_unary else "stream_stream"
            wrapped: Callable[..., Any] = streaming
        else:
            behavior = handler.unary_unary or handler.unary_stream

            def single(request: Any, context: grpc.ServicerContext) -> Any:
                check(method, rule, context, request)
                return behavior(request, context)

            kind = "unary_unary" if handler.unary_unary else "unary_stream"
            wrapped = single
        return getattr(grpc, f"{kind}_rpc_method_handler")(
            wrapped, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
