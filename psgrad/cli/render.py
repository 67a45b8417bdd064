"""`psgrad k8s` and `psgrad slurm`: write a job's Kubernetes manifests or sbatch script (runs nothing)."""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from psgrad.cli.flags import flag, positive_int
from psgrad.errors import ConfigError
from psgrad.launch.jobkeys import K8S_TLS_DIR
from psgrad.launch.k8s import K8S_FORMATS, K8sJob, manifests, to_yaml
from psgrad.launch.roles import DEFAULT_PORT_BASE
from psgrad.launch.slurm import SlurmJob, sbatch_script

JOB_ARGS_HELP = ("the `psgrad run` job flags, after --, e.g. -- --task digits --mode sync --steps 1000 "
                 "(checked now; the layout flags are the rendered files' own)")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", required=True, help="the job's name (Kubernetes: a DNS label; it names the pods)")
    p.add_argument("--num-servers", type=positive_int, required=True, help="parameter-server shards")
    p.add_argument("--num-workers", type=positive_int, required=True, help="training workers")
    p.add_argument("--out", metavar="FILE", help="write to FILE (replaced atomically) instead of stdout")
    p.add_argument("job_args", nargs=argparse.REMAINDER, help=JOB_ARGS_HELP)


def add_render_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    k = sub.add_parser("k8s", help="write Kubernetes manifests that run a job with `psgrad run`",
                       description="Write a JobSet (or two Indexed Jobs and a headless Service) whose pods run "
                       "`psgrad run`: the server pods serve on --port, the worker pods train; apply with "
                       "`kubectl apply -f FILE`.")
    _common(k)
    k.add_argument("--image", required=True, help="container image with psgrad installed (its `psgrad` on PATH)")
    flag(k, "--format", "jobset", "jobset (needs the JobSet controller) or jobs (two Indexed Jobs and a headless "
         "Service: plain Kubernetes >= 1.24)", choices=K8S_FORMATS)
    flag(k, "--output-format", "yaml", "yaml or json (a JSON list of the objects)", choices=("yaml", "json"))
    flag(k, "--port", DEFAULT_PORT_BASE, "the port every server listens on", type=positive_int)
    k.add_argument("--namespace", help="namespace of the objects (default: kubectl's current one)")
    flag(k, "--server-cpu", K8sJob.server_cpu, "CPU request and limit of a server pod")
    flag(k, "--server-memory", K8sJob.server_memory, "memory request and limit of a server pod")
    flag(k, "--worker-cpu", K8sJob.worker_cpu, "CPU request and limit of a worker pod (its OMP_NUM_THREADS too)")
    flag(k, "--worker-memory", K8sJob.worker_memory, "memory request and limit of a worker pod")
    flag(k, "--worker-gpus", K8sJob.worker_gpus, "nvidia.com/gpu limit of a worker pod", type=int)
    k.add_argument("--tls-secret", metavar="NAME", help="secure the job with the Secret NAME holding a `psgrad certs` "
                   "directory (kubectl create secret generic NAME --from-file=DIR), mounted read-only at "
                   f"{K8S_TLS_DIR}: mutual TLS with a certificate per worker and the job secret. Default: the pods run "
                   "--insecure (plaintext inside the cluster network)")
    k.set_defaults(func=cmd_k8s)

    s = sub.add_parser("slurm", help="write an sbatch script that runs a job with `psgrad run`",
                       description="Write an sbatch script whose tasks run `psgrad run`: one `srun --multi-prog` "
                       "step (the first --num-servers tasks serve), or with --het a heterogeneous job (component "
                       "0 serves, component 1 trains). Submit it with `sbatch FILE`.")
    _common(s)
    s.add_argument("--het", action="store_true", help="a heterogeneous job: servers and workers get their own "
                   "resources (default: one srun --multi-prog step, every task with the workers' resources)")
    flag(s, "--port-base", DEFAULT_PORT_BASE, "server i listens on PORT_BASE + i on its node", type=positive_int)
    flag(s, "--time", SlurmJob.time, "the job's time limit, [D-]HH[:MM[:SS]]")
    s.add_argument("--partition", help="partition to submit to (default: the cluster's default)")
    flag(s, "--server-cpus", SlurmJob.server_cpus, "CPUs per server task", type=positive_int)
    flag(s, "--worker-cpus", SlurmJob.worker_cpus, "CPUs per worker task", type=positive_int)
    flag(s, "--worker-gpus", SlurmJob.worker_gpus, "GPUs per worker task", type=int)
    flag(s, "--psgrad", SlurmJob.psgrad, "the command that runs psgrad on the nodes, e.g. /shared/venv/bin/psgrad")
    s.add_argument("--tls-dir", metavar="DIR", help="secure the job with the `psgrad certs` directory DIR (absolute, "
                   "on storage every node sees, readable by the job's user only): mutual TLS with a certificate per "
                   "worker and the job secret. Default: the tasks run --insecure (plaintext on the cluster network)")
    s.set_defaults(func=cmd_slurm)


def job_args(ns: argparse.Namespace) -> tuple[str, ...]:
    """The job flags after --, checked by parsing them as `psgrad run` would (a typo fails here, not on the cluster)."""
    from psgrad.cli.run import add_run_parser

    args = list(ns.job_args)
    if args and args[0] == "--":
        args = args[1:]
    if args and not args[0].startswith("-"):
        raise ConfigError(f"unexpected argument {args[0]!r}: put the `psgrad run` job flags after --")
    holder = argparse.ArgumentParser(prog="psgrad", exit_on_error=False)
    subs = holder.add_subparsers()
    add_run_parser(subs)
    run = subs.choices["run"]
    run.exit_on_error = False
    try:
        parsed, unknown = run.parse_known_args(args)
    except argparse.ArgumentError as exc:
        raise ConfigError(f"job flag {exc}") from None
    if unknown:
        raise ConfigError(f"unknown job flag(s) {' '.join(unknown)} (see `psgrad run --help`)")
    from psgrad.cli.commands import _check_task
    from psgrad.cli.flags import job_spec

    _check_task(parsed)
    job_spec(parsed, ns.num_workers, ns.num_servers)
    return tuple(args)


def _write(ns: argparse.Namespace, text: str) -> None:
    if ns.out is None:
        print(text, end="")
        return
    path = Path(ns.out)
    if path.is_dir() or not (path.parent if str(path.parent) else Path(".")).is_dir():
        raise ConfigError(f"--out {ns.out!r} must be a file in an existing directory")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".render-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the file from the cluster's other users
    os.replace(tmp, path)


def cmd_k8s(ns: argparse.Namespace) -> int:
    job = K8sJob(
        name=ns.name, image=ns.image, num_servers=ns.num_servers, num_workers=ns.num_workers, job_args=job_args(ns),
        format=ns.format, port=ns.port, namespace=ns.namespace, server_cpu=ns.server_cpu,
        server_memory=ns.server_memory, worker_cpu=ns.worker_cpu, worker_memory=ns.worker_memory,
        worker_gpus=ns.worker_gpus, tls_secret=ns.tls_secret,
    )
    docs = manifests(job)
    _write(ns, to_yaml(docs) if ns.output_format == "yaml" else json.dumps(docs, indent=2) + "\n")
    return 0


def cmd_slurm(ns: argparse.Namespace) -> int:
    job = SlurmJob(
        name=ns.name, num_servers=ns.num_servers, num_workers=ns.num_workers, job_args=job_args(ns), het=ns.het,
        port_base=ns.port_base, time=ns.time, partition=ns.partition, server_cpus=ns.server_cpus,
        worker_cpus=ns.worker_cpus, worker_gpus=ns.worker_gpus, psgrad=ns.psgrad, tls_dir=ns.tls_dir,
    )
    _write(ns, sbatch_script(job))
    return 0
