"""`psgrad certs`: a job's certificate authority and its certificates (server, admin, one per worker rank), for trying TLS and mutual TLS out."""
from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from psgrad.errors import ConfigError

# The names each certificate's common name carries: the server reads the caller's role from it
# (wire/security.py), so only this job's CA can grant a role.
DEFAULT_SERVER_NAMES = ("localhost", "127.0.0.1", "::1")
# Every server certificate is valid for this name too, so that clients may verify it whatever
# address they reach a server at (--tls-server-name psgrad-server; the job's CA is what they trust).
SERVER_NAME = "psgrad-server"


@dataclass(frozen=True)
class CertFiles:
    """Where `write_job_certs` put a job's files (PEM)."""

    directory: Path
    num_workers: int

    @property
    def ca(self) -> Path:
        return self.directory / "ca.pem"

    def pair(self, who: str) -> tuple[Path, Path]:
        """(certificate, key) of "server", "admin" or "worker-R"."""
        return self.directory / f"{who}.pem", self.directory / f"{who}.key"


def _lazy() -> Any:
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:  # pragma: no cover - a dependency; a broken install only
        raise ConfigError("psgrad certs needs the `cryptography` package: pip install cryptography") from None
    return x509, hashes, serialization, ec, ExtendedKeyUsageOID, NameOID


def _san(names: Sequence[str]) -> list[Any]:
    x509 = _lazy()[0]
    out: list[Any] = []
    for name in names:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(name.strip("[]"))))
        except ValueError:
            out.append(x509.DNSName(name))
    return out


class CertificateAuthority:
    """A job's CA: a key and a self-signed certificate that sign the job's certificates (the key
    stays in memory: `write_job_certs` writes no ca.key, so nobody can issue more later)."""

    def __init__(self, common_name: str, not_before: datetime.datetime, days: float) -> None:
        x509, hashes, _, ec, _, NameOID = _lazy()
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        self.not_before = not_before
        self.not_after = not_before + datetime.timedelta(days=days)
        self.cert = (
            x509.CertificateBuilder().subject_name(self.name).issuer_name(self.name)
            .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(self.not_before).not_valid_after(self.not_after)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
            .sign(self.key, hashes.SHA256())
        )

    def issue(
        self, common_name: str, names: Sequence[str] = (), server: bool = False,
        not_before: datetime.datetime | None = None, days: float | None = None,
    ) -> tuple[bytes, bytes]:
        """(certificate PEM, key PEM) for common_name, valid for `names` (a server's host names and
        addresses, checked by its clients); usable as a client certificate, and a server's too.
        Valid as long as the CA unless not_before/days say otherwise (tests make expired ones)."""
        x509, hashes, serialization, ec, EKU, NameOID = _lazy()
        key = ec.generate_private_key(ec.SECP256R1())
        start = not_before or self.not_before
        end = self.not_after if days is None else start + datetime.timedelta(days=days)
        usages = [EKU.CLIENT_AUTH, *([EKU.SERVER_AUTH] if server else [])]
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self.name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        )
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(_san(names)), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return cert.public_bytes(serialization.Encoding.PEM), key_pem

    def pem(self) -> bytes:
        return bytes(self.cert.public_bytes(_lazy()[2].Encoding.PEM))


def new_ca(days: float = 365.0) -> CertificateAuthority:
    """A fresh job CA, valid from a few minutes ago (clocks differ a little) for `days`."""
    start = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
    return CertificateAuthority(f"psgrad job CA {os.urandom(4).hex()}", start, days)


def write_pair(files: CertFiles, who: str, pair: tuple[bytes, bytes]) -> tuple[Path, Path]:
    """Write an issued (certificate, key) as WHO.pem and WHO.key (mode 0600); returns their paths."""
    cert_path, key_path = files.pair(who)
    _write(key_path, pair[1], secret=True)
    _write(cert_path, pair[0], secret=False)
    return cert_path, key_path


def _write(path: Path, data: bytes, secret: bool) -> None:
    """Write a file readable by its owner only when it holds a key (created with that mode)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if secret else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def write_job_certs(
    directory: str | os.PathLike[str], num_workers: int, server_names: Sequence[str] = DEFAULT_SERVER_NAMES,
    days: float = 365.0, ca: CertificateAuthority | None = None,
) -> CertFiles:
    """Create a job CA and its certificates in `directory`: ca.pem; server.pem/.key (common name
    psgrad-server, valid for server_names and SERVER_NAME); admin.pem/.key (psgrad-admin: status and export);
    worker-R.pem/.key (psgrad-worker-R) for each rank. Keys are written with mode 0600. `ca`: sign
    with this CA (default: a new one, valid for `days`).

    Raises:
        ConfigError: bad arguments, or the directory already holds a ca.pem.
    """
    from psgrad.core.credentials import ADMIN, CERT_PREFIX, SERVER, worker_role

    if num_workers < 1:
        raise ConfigError(f"--num-workers must be >= 1, got {num_workers}")
    if not days > 0:
        raise ConfigError(f"--days must be > 0, got {days}")
    names = list(dict.fromkeys([*(n.strip() for n in server_names if n.strip()), SERVER_NAME]))
    out = Path(directory)
    files = CertFiles(out, num_workers)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} exists and is not a directory")
    if files.ca.exists():
        raise ConfigError(f"{files.ca} exists: this directory already holds a job's certificates (use another)")
    out.mkdir(parents=True, exist_ok=True)
    ca = ca or new_ca(days)
    _write(files.ca, ca.pem(), secret=False)
    for who, san, server in [(SERVER, names, True), (ADMIN, [], False),
                             *((worker_role(r), [], False) for r in range(num_workers))]:
        write_pair(files, who, ca.issue(f"{CERT_PREFIX}{who}", san, server))
    return files


def write_job_secret(directory: str | os.PathLike[str], num_workers: int) -> bytes:
    """A fresh job secret in DIR/job.secret, and the tokens derived from it: worker-R.token for each
    rank and admin.token (each file mode 0600, created anew). A worker given its token file proves
    its rank without holding the secret. Returns the secret."""
    from psgrad.core.credentials import ADMIN, derive_token, worker_role

    out = Path(directory)
    secret = os.urandom(32).hex().encode()
    files = [("job.secret", secret), (f"{ADMIN}.token", derive_token(secret, ADMIN).encode())]
    files += [(f"{worker_role(r)}.token", derive_token(secret, worker_role(r)).encode()) for r in range(num_workers)]
    for name, data in files:
        fd = os.open(out / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data + b"\n")
    return secret
