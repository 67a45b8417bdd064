"""Who a caller is: the roles of a job (worker R, admin, server), the tokens derived from the job secret, the roles certificates name, and where a server may listen without TLS; pure (no gRPC)."""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
from dataclasses import dataclass

from psgrad.errors import ConfigError

WORKER, ADMIN, SERVER = "worker", "admin", "server"
TOKEN_PREFIX = "psgrad1"  # versions the derivation: a token is psgrad1:ROLE:HEX
CERT_PREFIX = "psgrad-"  # a certificate's common name is psgrad-ROLE (see launch/certs.py)
MIN_SECRET_BYTES = 16
_ROLE_RE = re.compile(r"^(?:worker-(0|[1-9][0-9]{0,8})|admin|server)$")


def worker_role(rank: int) -> str:
    return f"{WORKER}-{rank}"


@dataclass(frozen=True)
class Identity:
    """An authenticated caller: worker `rank`, the job's admin (status, export) or one of its
    servers (replication); the chief is worker 0."""

    kind: str
    rank: int = -1

    @property
    def role(self) -> str:
        return worker_role(self.rank) if self.kind == WORKER else self.kind

    def describe(self) -> str:
        return f"worker {self.rank}" if self.kind == WORKER else f"the job's {self.kind}"


def parse_role(role: str) -> Identity | None:
    """'worker-3' -> Identity(worker, 3), 'admin', 'server'; None for anything else."""
    m = _ROLE_RE.match(role)
    if m is None:
        return None
    return Identity(WORKER, int(m.group(1))) if m.group(1) is not None else Identity(role)


def check_secret(secret: bytes, source: str = "") -> bytes:
    """The job secret with surrounding whitespace removed (a file's trailing newline), checked.
    source: where it was read (a file's flag and path, an environment variable), for the message.

    Raises:
        ConfigError: shorter than MIN_SECRET_BYTES (naming the source).
    """
    secret = secret.strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"the job secret{f' in {source}' if source else ''} has {len(secret)} bytes; use at least "
            f"{MIN_SECRET_BYTES} random ones, e.g. `head -c 32 /dev/urandom | base64 > job.secret`"
        )
    return secret


def derive_token(secret: bytes, role: str) -> str:
    """The credential of `role` in the job whose secret this is: psgrad1:ROLE:HMAC-SHA256(secret,
    'psgrad1:ROLE') in hex. A worker holding its token can prove its rank and nothing else; the
    servers, holding the secret, check any token without a list of them."""
    if parse_role(role) is None:
        raise ConfigError(f"no such role {role!r}: worker-R, admin or server")
    mac = hmac.new(check_secret(secret), f"{TOKEN_PREFIX}:{role}".encode(), hashlib.sha256).hexdigest()
    return f"{TOKEN_PREFIX}:{role}:{mac}"


def verify_token(secret: bytes, token: str) -> Identity | str:
    """The identity a token proves, or why it proves none (a message for the caller)."""
    prefix, _, rest = token.partition(":")
    role, _, mac = rest.rpartition(":")
    if prefix != TOKEN_PREFIX or not role or not mac:
        return "the token is malformed (expected psgrad1:ROLE:HMAC, derived from the job secret)"
    who = parse_role(role)
    if who is None:
        return f"the token names no role of a job ({role[:40]!r})"
    if not hmac.compare_digest(derive_token(secret, role), token):
        return f"the token for {who.describe()} was not derived from this job's secret (another job's credential?)"
    return who


def role_of_common_name(common_name: str) -> Identity | None:
    """The identity a certificate of the job's CA grants: its common name psgrad-worker-R,
    psgrad-admin or psgrad-server; None for other names."""
    if not common_name.startswith(CERT_PREFIX):
        return None
    return parse_role(common_name[len(CERT_PREFIX):])


def is_loopback(host: str) -> bool:
    """Whether host is this machine's loopback (localhost, 127.0.0.0/8, ::1). Names other than
    localhost count as not: nothing is resolved."""
    host = host.strip("[]")
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, tls: bool, insecure: bool, secret: bool) -> None:
    """The one rule for where a server may listen (ServerConfig checks it): loopback, or any address
    with TLS; anywhere else without TLS only with --insecure, and never with a job secret (its
    tokens would cross the network in the clear: without TLS they travel over gRPC's local
    credentials, loopback only).

    Raises:
        ConfigError: the address needs TLS (the message says how to give it).
    """
    if tls or is_loopback(host):
        return
    if secret:
        raise ConfigError(f"a job secret without TLS works on loopback only, and {host} is not: give --tls-cert and "
                          "--tls-key (`psgrad certs` makes them)")
    if not insecure:
        raise ConfigError(f"binding {host} without TLS lets anyone who can reach the port read the weights and push "
                          "gradients: give --tls-cert and --tls-key (`psgrad certs` makes them), or --insecure on a "
                          "network you trust")
