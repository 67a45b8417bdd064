"""`psgrad slurm`: a job's sbatch script, running `psgrad run` with `srun --multi-prog` or as a heterogeneous job."""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from psgrad.errors import ConfigError
from psgrad.launch.jobkeys import cluster_argv
from psgrad.launch.k8s import check_job_args
from psgrad.launch.roles import DEFAULT_PORT_BASE, SERVER, WORKER

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
_TIME_RE = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$")


@dataclass(frozen=True)
class SlurmJob:
    """What `psgrad slurm` renders: sizes, resources, the launch style and the job flags of `psgrad run`."""

    name: str
    num_servers: int
    num_workers: int
    job_args: tuple[str, ...] = ()
    het: bool = False  # a heterogeneous job (component 0: servers, 1: workers), else srun --multi-prog
    port_base: int = DEFAULT_PORT_BASE
    time: str = "01:00:00"
    partition: str | None = None
    server_cpus: int = 1
    worker_cpus: int = 2
    worker_gpus: int = 0
    psgrad: str = "psgrad"  # the command that runs psgrad on the nodes (e.g. a venv's bin/psgrad)
    tls_dir: str | None = None  # a `psgrad certs` directory on storage every node sees

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise ConfigError(f"--name must be letters, digits, '_', '.' or '-', got {self.name!r}")
        if self.num_servers < 1 or self.num_workers < 1:
            raise ConfigError(f"a job needs >= 1 server and >= 1 worker, got {self.num_servers} and {self.num_workers}")
        if not 1 <= self.port_base <= 65535 - self.num_servers + 1:
            raise ConfigError(f"--port-base must leave room for {self.num_servers} ports below 65536, got {self.port_base}")
        if not _TIME_RE.match(self.time):
            raise ConfigError(f"--time must be SLURM's [D-]HH[:MM[:SS]], got {self.time!r}")
        if self.partition is not None and not _NAME_RE.match(self.partition):
            raise ConfigError(f"--partition must be a partition name, got {self.partition!r}")
        for flag, value, low in (("--server-cpus", self.server_cpus, 1), ("--worker-cpus", self.worker_cpus, 1),
                                 ("--worker-gpus", self.worker_gpus, 0)):
            if value < low:
                raise ConfigError(f"{flag} must be >= {low}, got {value}")
        if not self.psgrad.strip():
            raise ConfigError("--psgrad must name the command that runs psgrad on the nodes")
        if self.tls_dir is not None and (not self.tls_dir.startswith("/") or "%" in self.tls_dir):
            raise ConfigError(f"--tls-dir must be an absolute path without '%', got {self.tls_dir!r}")
        check_job_args(self.job_args)
        if any("%" in a for a in self.job_args) and not self.het:
            raise ConfigError("job flags must not contain '%' (srun --multi-prog replaces %t and %o)")

    def command(self, role: str) -> str:
        argv = [*shlex.split(self.psgrad), "run", "--engine", "slurm", "--role", role,
                "--num-servers", str(self.num_servers), "--port-base", str(self.port_base),
                *cluster_argv(self.tls_dir, self.job_args), *self.job_args]
        return shlex.join(argv)


def _resources(cpus: int, gpus: int) -> str:
    return f"--cpus-per-task={cpus}" + (f" --gpus-per-task={gpus}" if gpus else "")


def sbatch_script(job: SlurmJob) -> str:
    """The sbatch script's text. Servers are the first tasks (het: component 0); server i listens on
    --port-base + i on its node; tasks are placed in order (--distribution=block), which is how every
    task computes the servers' addresses from the node list."""
    s, w = job.num_servers, job.num_workers
    head = ["#!/bin/bash", f"#SBATCH --job-name={job.name}", f"#SBATCH --time={job.time}"]
    head += [f"#SBATCH --partition={job.partition}"] if job.partition else []
    head += [f"#SBATCH --output={job.name}-%j.out"]
    about = [
        f"# Rendered by `psgrad slurm`: {s} server(s) and {w} worker(s) running `psgrad run`.",
        f"# Servers are the first {s} task(s); server i listens on port {job.port_base}+i of its node, and every",
        "# task computes those addresses from the step's node list (block distribution). The servers exit",
        "# once every worker has left, so the step ends with the training.",
        "set -euo pipefail",
    ]
    srun = "srun --distribution=block --kill-on-bad-exit=1"
    if job.het:
        head += [f"#SBATCH --ntasks={s} {_resources(job.server_cpus, 0)}", "#SBATCH hetjob",
                 f"#SBATCH --ntasks={w} {_resources(job.worker_cpus, job.worker_gpus)}"]
        body = [f"{srun} \\", f"    {job.command(SERVER)} \\", f"    : {job.command(WORKER)}"]
    else:
        # One step for both roles, so every task gets the worker's resources.
        head += [f"#SBATCH --ntasks={s + w}", f"#SBATCH {_resources(max(job.server_cpus, job.worker_cpus), job.worker_gpus)}"]
        last_server = "0" if s == 1 else f"0-{s - 1}"
        last_worker = str(s) if w == 1 else f"{s}-{s + w - 1}"
        body = [
            f'conf="{job.name}-${{SLURM_JOB_ID}}.conf"',
            "cat > \"$conf\" <<'EOF'",
            f"{last_server} {job.command(SERVER)}",
            f"{last_worker} {job.command(WORKER)}",
            "EOF",
            f'{srun} --multi-prog "$conf"',
        ]
    return "\n".join([*head, "", *about, "", *body]) + "\n"
