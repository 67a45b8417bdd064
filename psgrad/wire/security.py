"""Credentials on the wire, for both ends: channel and server credentials from TlsConfig/AuthConfig,
the token's metadata, and the caller's identity as a server sees it (certificate and token)."""
from __future__ import annotations

import functools
import ssl
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc

from psgrad.config import AuthConfig, ClientConfig, ServerConfig, TlsConfig
from psgrad.core.addresses import host_of
from psgrad.core.credentials import SERVER, Identity, derive_token, is_loopback, role_of_common_name, verify_token
from psgrad.errors import AuthenticationError, ConfigError, PermissionDeniedError

# Where a call carries its token: the standard header, as `Bearer psgrad1:ROLE:HMAC`.
TOKEN_METADATA_KEY = "authorization"
BEARER = "Bearer "
ChannelFactory = Callable[[str, Sequence[tuple[str, int]]], grpc.Channel]


@functools.lru_cache(maxsize=32)
def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None


def token_for(auth: AuthConfig, role: str) -> str | None:
    """The token a client sends: the one given, else the one of `role` derived from the job
    secret, else None."""
    if auth.token is not None:
        return auth.token.strip()
    return None if auth.secret is None else derive_token(auth.secret, role)


# --------------------------------------------------------------------------- the client's end
class _WithToken:
    """A multi-callable whose calls carry the token in their metadata (with any metadata of their own)."""

    def __init__(self, call: Any, metadata: tuple[tuple[str, str], ...]) -> None:
        self._call = call
        self._metadata = metadata

    def _md(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return {**kwargs, "metadata": (*self._metadata, *(kwargs.get("metadata") or ()))}

    def __call__(self, request: Any, **kwargs: Any) -> Any:
        return self._call(request, **self._md(kwargs))

    def with_call(self, request: Any, **kwargs: Any) -> Any:
        return self._call.with_call(request, **self._md(kwargs))

    def future(self, request: Any, **kwargs: Any) -> Any:
        return self._call.future(request, **self._md(kwargs))


class TokenChannel(grpc.Channel):
    """A channel whose every call carries a token. Not grpc's call credentials: gRPC Python runs
    those as a plugin on a thread of its own per call, which cost ~0.2 ms per call here (half a
    small model's step); metadata costs nothing measurable."""

    def __init__(self, channel: grpc.Channel, token: str) -> None:
        self._channel = channel
        self._metadata = ((TOKEN_METADATA_KEY, BEARER + token),)

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _WithToken(self._channel.unary_unary(method, *args, **kwargs), self._metadata)

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _WithToken(self._channel.unary_stream(method, *args, **kwargs), self._metadata)

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _WithToken(self._channel.stream_unary(method, *args, **kwargs), self._metadata)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _WithToken(self._channel.stream_stream(method, *args, **kwargs), self._metadata)

    def subscribe(self, callback: Any, try_to_connect: bool = False) -> None:
        self._channel.subscribe(callback, try_to_connect)

    def unsubscribe(self, callback: Any) -> None:
        self._channel.unsubscribe(callback)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> TokenChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_channel(
    address: str, tls: TlsConfig | None, token: str | None, options: Sequence[tuple[str, int]]
) -> grpc.Channel:
    """A channel to `address`: TLS (verifying the server's certificate and name, presenting ours if
    we have one) when tls is given; without TLS, gRPC's local credentials when a token must be sent
    (loopback only: the server refuses other peers), else plaintext. A token goes in every call's
    metadata (TokenChannel).

    Raises:
        ConfigError: a token without TLS to a server on another host.
    """
    opts: list[tuple[str, int | str]] = list(options)
    if tls is not None:
        creds = grpc.ssl_channel_credentials(
            root_certificates=_read(tls.ca) if tls.ca else None,
            private_key=_read(tls.key) if tls.key else None,
            certificate_chain=_read(tls.cert) if tls.cert else None,
        )
        if tls.server_name:
            opts.append(("grpc.ssl_target_name_override", tls.server_name))
    elif token is not None:
        if not is_loopback(host_of(address)):
            raise ConfigError(f"a token without TLS can only reach a server on this machine, not {address}: "
                              "give --tls-ca (and the servers --tls-cert/--tls-key)")
        creds = grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
    else:
        return grpc.insecure_channel(address, options=opts)
    channel = grpc.secure_channel(address, creds, options=opts)
    return channel if token is None else TokenChannel(channel, token)


def plaintext_channels(address: str, options: Sequence[tuple[str, int]]) -> grpc.Channel:
    """A ChannelFactory without credentials (servers and clients of a job that has none)."""
    return grpc.insecure_channel(address, options=list(options))


def client_channels(config: ClientConfig, role: str) -> ChannelFactory:
    """open_channel with a client's TLS and the token of `role` (a worker's, or the admin's)."""
    token = token_for(config.auth, role)
    return lambda address, options: open_channel(address, config.tls, token, options)


def server_channels(config: ServerConfig) -> ChannelFactory:
    """Channels from a server to the other servers of its shard (replication, fencing): its own
    certificate as the client certificate, its CA to verify them, and the servers' token."""
    tls = config.tls
    if tls is not None:
        tls = TlsConfig(cert=tls.cert, key=tls.key, ca=tls.ca)
    token = None if config.auth.secret is None else derive_token(config.auth.secret, SERVER)
    return lambda address, options: open_channel(address, tls, token, options)


# --------------------------------------------------------------------------- the server's end
def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS (client certificates required when tls.ca is given); gRPC's local credentials for
    tokens without TLS (refuses connections from other hosts); None: plaintext."""
    tls = config.tls
    if tls is not None:
        assert tls.cert is not None and tls.key is not None
        ca = _read(tls.ca) if tls.ca else None
        return grpc.ssl_server_credentials(
            [(_read(tls.key), _read(tls.cert))], root_certificates=ca, require_client_auth=ca is not None
        )
    if config.auth.secret is not None:
        return grpc.local_server_credentials(grpc.LocalConnectionType.LOCAL_TCP)
    return None


def step_socket_context(config: ServerConfig) -> ssl.SSLContext | None:
    """The TLS a server's TCP step socket speaks (wire/local_socket.py): its certificate, and with
    tls.ca client certificates of that CA required, as its gRPC port's; None: plaintext (a server
    without TLS)."""
    tls = config.tls
    if tls is None:
        return None
    assert tls.cert is not None and tls.key is not None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tls.cert, tls.key)
    if tls.ca:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(tls.ca)
    return ctx


def client_step_socket_context(tls: TlsConfig | None) -> ssl.SSLContext | None:
    """The TLS a worker speaks on a server's TCP step socket, as its gRPC channel does: the
    server's certificate verified against tls.ca (None: the system's roots) and its name, ours
    presented if we have one; None: plaintext (a worker without TLS)."""
    if tls is None:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls.ca)
    if tls.cert and tls.key:
        ctx.load_cert_chain(tls.cert, tls.key)
    return ctx


def plaintext(config: ServerConfig) -> bool:
    """Whether the server's calls are plaintext and unchecked (no TLS, no job secret): anyone who
    reaches its port may make any call, as any worker rank."""
    return config.tls is None and config.auth.secret is None


def authenticates(config: ServerConfig) -> bool:
    """Whether the server checks who calls (a job secret, or client certificates)."""
    return config.auth.secret is not None or (config.tls is not None and config.tls.ca is not None)


class Authenticator:
    """Who a call comes from, from its certificate (mutual TLS) and its token (job secret)."""

    def __init__(self, config: ServerConfig) -> None:
        self._secret = config.auth.secret
        self._certs = config.tls is not None and config.tls.ca is not None
        wanted = [w for w, on in (("a client certificate of the job's CA", self._certs),
                                  ("a token derived from the job secret (--job-secret-file, or --token-file)",
                                   self._secret is not None)) if on]
        self._wanted = " and ".join(wanted)
        self._valid: dict[str, Identity] = {}  # tokens already verified (a job has a few): no HMAC per call

    def _from_cert(self, context: grpc.ServicerContext) -> Identity | None:
        if not self._certs:
            return None
        names = context.auth_context().get("x509_common_name") or []
        return role_of_common_name(names[0].decode(errors="replace")) if names else None

    def _from_token(self, context: grpc.ServicerContext) -> Identity | None:
        if self._secret is None:
            return None
        value = next((str(v) for k, v in context.invocation_metadata() or () if k == TOKEN_METADATA_KEY), None)
        if value is None:
            return None
        if not value.startswith(BEARER):
            raise AuthenticationError(f"the {TOKEN_METADATA_KEY} metadata must be `{BEARER.strip()} TOKEN`")
        token = value[len(BEARER):].strip()
        known = self._valid.get(token)
        if known is not None:
            return known
        who = verify_token(self._secret, token)
        if isinstance(who, str):
            raise AuthenticationError(who)
        if len(self._valid) < 4096:  # bounded: valid tokens only, one per role
            self._valid[token] = who
        return who

    def identify(self, context: grpc.ServicerContext) -> Identity:
        """The caller's identity.

        Raises:
            AuthenticationError: no credential, or one that is not this job's (says which is missing).
            PermissionDeniedError: the certificate and the token name different roles.
        """
        cert, token = self._from_cert(context), self._from_token(context)
        if self._secret is not None and token is None:
            raise AuthenticationError(f"no token: this server requires {self._wanted}")
        if self._certs and cert is None:
            raise AuthenticationError("the client certificate names no role of the job (its common name must be "
                                      f"psgrad-worker-R, psgrad-admin or psgrad-server); this server requires {self._wanted}")
        if cert is not None and token is not None and cert != token:
            raise PermissionDeniedError(f"the client certificate is {cert.describe()}'s but the token is "
                                        f"{token.describe()}'s")
        who = token or cert
        assert who is not None  # the server authenticates by at least one of them (see authenticates)
        return who
