"""A launched job's credentials (`psgrad launch --tls|--tokens`, `psgrad compare`): a fresh CA, certificates and job secret in a private temporary directory, and the flags that hand each process its own."""
from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from psgrad.config import AuthConfig, ClientConfig, TlsConfig
from psgrad.errors import ConfigError

SECURITY_MODES = ("off", "tokens", "tls")
K8S_TLS_DIR = "/etc/psgrad/tls"  # where `psgrad k8s --tls-secret` mounts the Secret


@dataclass(frozen=True)
class JobKeys:
    """What one launched job's processes are given: servers the secret (and with TLS their
    certificate and the CA that signs the workers'), each worker its own token file (and its own
    certificate): never the secret, never on a command line. The launcher keeps the admin's."""

    directory: Path
    mode: str  # "tokens" (no TLS: gRPC's local credentials, this machine only) or "tls" (mutual TLS + tokens)
    secret: bytes

    @property
    def tls(self) -> bool:
        return self.mode == "tls"

    def server_argv(self) -> list[str]:
        argv = ["--job-secret-file", str(self.directory / "job.secret")]
        if self.tls:
            d = self.directory
            argv += ["--tls-cert", str(d / "server.pem"), "--tls-key", str(d / "server.key"), "--tls-ca", str(d / "ca.pem")]
        return argv

    def worker_argv(self, rank: int) -> list[str]:
        argv = ["--token-file", str(self.directory / f"worker-{rank}.token")]
        if self.tls:
            d = self.directory
            argv += ["--tls-ca", str(d / "ca.pem"), "--tls-cert", str(d / f"worker-{rank}.pem"),
                     "--tls-key", str(d / f"worker-{rank}.key")]
        return argv

    def admin(self) -> ClientConfig:
        """The credentials of the launcher's own calls (the final status)."""
        d = self.directory
        tls = TlsConfig(cert=str(d / "admin.pem"), key=str(d / "admin.key"), ca=str(d / "ca.pem")) if self.tls else None
        return ClientConfig(tls=tls, auth=AuthConfig(secret=self.secret))

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def create(mode: str, num_workers: int, parent: str | None = None) -> JobKeys | None:
    """Fresh credentials for a job of num_workers on this machine (None for mode "off"), in a new
    directory readable by this user only (under `parent`, default the system's temporary
    directory). The caller removes it when the job ends."""
    if mode not in SECURITY_MODES:
        raise ConfigError(f"security mode must be one of {', '.join(SECURITY_MODES)}, got {mode!r}")
    if mode == "off":
        return None
    from psgrad.launch.certs import write_job_certs, write_job_secret

    directory = Path(tempfile.mkdtemp(prefix="psgrad-keys-", dir=parent))  # mode 0700
    try:
        secret = write_job_secret(directory, num_workers)
        if mode == "tls":
            write_job_certs(directory, num_workers)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return JobKeys(directory, mode, secret)


def cluster_argv(tls_dir: str | None, job_args: tuple[str, ...]) -> list[str]:
    """The security flags a rendered cluster job passes `psgrad run` (k8s, SLURM): with tls_dir (a
    `psgrad certs` directory as the nodes see it) TLS with a certificate per worker, the job
    secret and the name every server certificate carries; without, --insecure (a cluster job binds
    every interface), unless the job flags already say how."""
    if tls_dir is None:
        given = {a.split("=", 1)[0] for a in job_args}
        return [] if given & {"--insecure", "--tls-cert"} else ["--insecure"]
    from psgrad.launch.certs import SERVER_NAME

    d = tls_dir.rstrip("/")
    return ["--tls-cert", f"{d}/server.pem", "--tls-key", f"{d}/server.key", "--tls-ca", f"{d}/ca.pem",
            "--tls-worker-cert", f"{d}/worker-{{rank}}.pem", "--tls-worker-key", f"{d}/worker-{{rank}}.key",
            "--tls-server-name", SERVER_NAME, "--job-secret-file", f"{d}/job.secret"]
