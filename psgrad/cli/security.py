"""The security flags (TLS files, job secret, token, --insecure), where secrets are read (files and the environment, never argv), and `psgrad certs`."""
from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path

from psgrad.config import AuthConfig, TlsConfig
from psgrad.core.credentials import check_secret
from psgrad.errors import ConfigError

SECRET_ENV = "PSGRAD_JOB_SECRET"
TOKEN_ENV = "PSGRAD_TOKEN"
SECRET_FILE = "job.secret"  # what `psgrad certs` writes beside the certificates
RANK = "{rank}"  # `psgrad run`: replaced by the worker's rank in --tls-worker-cert/-key


def add_server_security_args(p: argparse.ArgumentParser | argparse._ArgumentGroup, run: bool = False) -> None:
    """A server's TLS, job secret and --insecure (`psgrad server`; `psgrad run`, whose workers also
    read --tls-ca, --job-secret-file and the worker flags)."""
    g = p.add_argument_group("security (see docs/operations/security.md)") if isinstance(p, argparse.ArgumentParser) else p
    g.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate (`psgrad certs` makes one; "
                   "it must name the host clients connect to); needs --tls-key. Default: plaintext")
    g.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    if run:
        g.add_argument("--tls-ca", metavar="PEM", help="the job's CA: workers verify the servers' certificates with it; "
                       "with --tls-worker-cert the servers also require worker certificates it signed (mutual TLS)")
    else:
        g.add_argument("--tls-ca", metavar="PEM", help="require client certificates signed by this CA (mutual TLS); a "
                       "certificate's common name psgrad-worker-R, psgrad-admin or psgrad-server is the caller's role")
    if run:
        g.add_argument("--tls-worker-cert", metavar="PEM", help=f"worker R's client certificate, {RANK} replaced by "
                       f"R, e.g. /etc/psgrad/tls/worker-{RANK}.pem (when the servers require one: --tls-ca)")
        g.add_argument("--tls-worker-key", metavar="PEM", help=f"its key, e.g. /etc/psgrad/tls/worker-{RANK}.key")
        g.add_argument("--tls-server-name", metavar="NAME", help="workers verify this name in the servers' "
                       "certificates instead of each address's host (`psgrad certs` always includes psgrad-server)")
    g.add_argument("--job-secret-file", metavar="PATH", help=f"the job secret (or ${SECRET_ENV}): every call must then "
                   "carry a token derived from it (a worker derives its own rank's), and a worker may act only as its "
                   "own rank. Never give secrets as flags")
    g.add_argument("--insecure", action="store_true", help="allow binding an address other than loopback without "
                   "TLS: anyone who can reach the port can then read the weights and push gradients (a warning is "
                   "printed); use it only on a network you trust")


def add_client_security_args(p: argparse.ArgumentParser, who: str) -> None:
    """A client's TLS files and credential (`psgrad worker`, `status`, `export`); who: whose
    certificate and derived token it uses ("worker R" or "the admin")."""
    g = p.add_argument_group("security (see docs/operations/security.md)")
    g.add_argument("--tls-ca", metavar="PEM", help="connect with TLS, verifying the servers' certificates with this "
                   "CA (`psgrad certs` writes ca.pem). Default: plaintext")
    g.add_argument("--tls-cert", metavar="PEM", help=f"{who}'s client certificate, for servers that require one "
                   "(mutual TLS); needs --tls-key")
    g.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    g.add_argument("--tls-server-name", metavar="NAME", help="verify this name in the servers' certificates instead "
                   "of each address's host, when servers are reached by names their certificate does not list "
                   "(`psgrad certs` always includes psgrad-server)")
    g.add_argument("--job-secret-file", metavar="PATH", help=f"the job secret (or ${SECRET_ENV}): {who}'s token is "
                   "derived from it. Never give secrets as flags")
    g.add_argument("--token-file", metavar="PATH", help=f"a token already derived for {who} (or ${TOKEN_ENV}; "
                   "`psgrad launch --tls` gives each worker its own): proves that role without the job secret")


def add_launch_security_args(p: argparse.ArgumentParser, ray: bool = False) -> None:
    """`psgrad launch` and `psgrad compare`: credentials made for the job (a fresh temporary directory);
    launch's --insecure for --backend ray on a cluster."""
    g = p.add_argument_group("security (see docs/operations/security.md)")
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--tls", action="store_const", const="tls", dest="security", help="secure the job: a fresh CA, "
                      "TLS with a certificate per worker (mutual TLS) and a token per worker derived from a fresh job "
                      "secret, handed to each process in files; a worker can then act only as its own rank")
    mode.add_argument("--tokens", action="store_const", const="tokens", dest="security", help="a token per worker "
                      "from a fresh job secret, without TLS (gRPC's local credentials: this machine only)")
    p.set_defaults(security="off")
    if ray:
        g.add_argument("--insecure", action="store_true", help="--backend ray with --address: let the server actors "
                       "listen on their nodes' addresses without TLS (--tls and --tokens are not available under Ray "
                       "yet); anyone who can reach those ports can read the weights and push gradients")


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path!r}: {exc.strerror}") from None


def auth_config(ns: argparse.Namespace, env: Mapping[str, str], client: bool) -> AuthConfig:
    """The job secret (--job-secret-file, else $PSGRAD_JOB_SECRET) and, for a client, its token
    (--token-file, else $PSGRAD_TOKEN)."""
    secret: bytes | None = None
    if getattr(ns, "job_secret_file", None):
        secret = check_secret(_read(ns.job_secret_file, "--job-secret-file"),
                              f"--job-secret-file {ns.job_secret_file!r}")
    elif env.get(SECRET_ENV):
        secret = check_secret(env[SECRET_ENV].encode(), f"${SECRET_ENV}")
    token: str | None = None
    if client and getattr(ns, "token_file", None):
        token = _read(ns.token_file, "--token-file").decode(errors="replace").strip()
    elif client and env.get(TOKEN_ENV):
        token = env[TOKEN_ENV].strip()
    if token == "":
        raise ConfigError("the token is empty (--token-file or $PSGRAD_TOKEN)")
    return AuthConfig(secret=secret, token=token)


def _rank(path: str | None, rank: int | None) -> str | None:
    return path if path is None or rank is None else path.replace(RANK, str(rank))


def tls_config(ns: argparse.Namespace, client: bool, rank: int | None = None) -> TlsConfig | None:
    """The TLS files of a client (None: plaintext; given when any TLS flag is) or of a server (None
    without --tls-cert). `psgrad run`'s workers take --tls-worker-cert/-key for rank `rank`."""
    cert, key = getattr(ns, "tls_cert", None), getattr(ns, "tls_key", None)
    ca, name = getattr(ns, "tls_ca", None), getattr(ns, "tls_server_name", None)
    if client and hasattr(ns, "tls_worker_cert"):  # psgrad run: --tls-cert is the servers' (which then use TLS)
        served = cert is not None
        cert, key = _rank(ns.tls_worker_cert, rank), _rank(ns.tls_worker_key, rank)
        return TlsConfig(cert=cert, key=key, ca=ca, server_name=name) if served or cert or key or ca or name else None
    if client:
        return TlsConfig(cert=cert, key=key, ca=ca, server_name=name) if cert or key or ca or name else None
    if hasattr(ns, "tls_worker_cert") and not ns.tls_worker_cert:
        ca = None  # psgrad run: the CA is for the workers to verify the servers; no client certificates asked
    if cert is None and key is None:
        if ca is not None:
            raise ConfigError("--tls-ca on a server needs --tls-cert and --tls-key (the server's own certificate)")
        return None
    return TlsConfig(cert=cert, key=key, ca=ca)


# --------------------------------------------------------------------------- psgrad certs
def add_certs_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    c = sub.add_parser("certs", help="create a job's CA, certificates and secret, for trying TLS out",
                       description="Write a job CA (ca.pem), a server certificate (server.pem/.key, common name "
                       "psgrad-server), an admin certificate (admin.pem/.key: status and export) and one per worker "
                       f"(worker-R.pem/.key), a random job secret ({SECRET_FILE}) and the tokens derived from it "
                       "(worker-R.token, admin.token), into DIR. Keys, secret and tokens are readable by their owner "
                       "only. The CA's key is not kept: nobody can issue more. For production, use your organisation's "
                       "CA.")
    c.add_argument("dir", metavar="DIR", help="directory to write (created; must not hold a ca.pem yet)")
    c.add_argument("--num-workers", type=int, required=True, help="workers in the job: worker-0 .. worker-(N-1)")
    c.add_argument("--names", default="localhost,127.0.0.1,::1", help="comma-separated host names and addresses "
                   "the server certificate is valid for: those the workers connect to (psgrad-server is always "
                   "added, for --tls-server-name) (default: localhost,127.0.0.1,::1)")
    c.add_argument("--days", type=float, default=365.0, help="validity in days (default: 365)")
    c.set_defaults(func=cmd_certs)


def cmd_certs(ns: argparse.Namespace) -> int:
    from psgrad.launch.certs import SERVER_NAME, write_job_certs, write_job_secret

    names = [n.strip() for n in ns.names.split(",") if n.strip()]
    files = write_job_certs(ns.dir, ns.num_workers, names, ns.days)
    write_job_secret(files.directory, ns.num_workers)
    last = ns.num_workers - 1
    valid = list(dict.fromkeys([*names, SERVER_NAME]))  # (psgrad-server given by name too: once)
    print(f"psgrad certs: wrote ca.pem, server.pem/.key (valid for {', '.join(valid)}), admin.pem/"
          f".key, worker-0..{last}.pem/.key, {SECRET_FILE} and the tokens derived from it (admin.token, "
          f"worker-0..{last}.token) to {files.directory}")
    return 0
