"""`psgrad k8s`: a job's Kubernetes manifests (a JobSet, or two Indexed Jobs and a headless Service) running `psgrad run`."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from psgrad.errors import ConfigError
from psgrad.launch.jobkeys import K8S_TLS_DIR, cluster_argv
from psgrad.launch.roles import DEFAULT_PORT_BASE, SERVER, WORKER

K8S_FORMATS = ("jobset", "jobs")
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY_RE = re.compile(r"^\d+(\.\d+)?(m|Ki|Mi|Gi|Ti|k|M|G|T)?$")
# Flags the manifests set themselves: refused among the job flags.
RESERVED = ("--engine", "--role", "--num-servers", "--num-workers", "--server-names", "--port-base", "--host")


def check_job_args(job_args: tuple[str, ...]) -> None:
    for arg in job_args:
        if arg.split("=", 1)[0] in RESERVED:
            raise ConfigError(f"job flag {arg} is set by the rendered files themselves; leave it out")


@dataclass(frozen=True)
class K8sJob:
    """What `psgrad k8s` renders: names, image, sizes, resources and the job flags of `psgrad run`."""

    name: str
    image: str
    num_servers: int
    num_workers: int
    job_args: tuple[str, ...] = ()
    format: str = "jobset"
    port: int = DEFAULT_PORT_BASE
    namespace: str | None = None
    server_cpu: str = "1"
    server_memory: str = "2Gi"
    worker_cpu: str = "1"
    worker_memory: str = "2Gi"
    worker_gpus: int = 0
    tls_secret: str | None = None  # a Secret holding a `psgrad certs` directory, mounted at K8S_TLS_DIR

    def __post_init__(self) -> None:
        # Pod host names are NAME-server-INDEX (Jobs) or NAME-server-0-INDEX (JobSet): 63 characters at most.
        if not _NAME_RE.match(self.name) or len(self.name) > 40:
            raise ConfigError(f"--name must be a DNS label of <= 40 characters ([a-z0-9-], starting with a "
                              f"letter), got {self.name!r}")
        if not self.image or any(c.isspace() for c in self.image):
            raise ConfigError(f"--image must be an image reference without spaces, got {self.image!r}")
        if self.num_servers < 1 or self.num_workers < 1:
            raise ConfigError(f"a job needs >= 1 server and >= 1 worker, got {self.num_servers} and {self.num_workers}")
        if self.format not in K8S_FORMATS:
            raise ConfigError(f"--format must be one of {', '.join(K8S_FORMATS)}, got {self.format!r}")
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"--port must be in [1, 65535], got {self.port}")
        if self.namespace is not None and not _NAME_RE.match(self.namespace):
            raise ConfigError(f"--namespace must be a DNS label, got {self.namespace!r}")
        for flag, value in (("--server-cpu", self.server_cpu), ("--server-memory", self.server_memory),
                            ("--worker-cpu", self.worker_cpu), ("--worker-memory", self.worker_memory)):
            if not _QUANTITY_RE.match(value):
                raise ConfigError(f"{flag} must be a Kubernetes quantity such as 500m, 2 or 4Gi, got {value!r}")
        if self.worker_gpus < 0:
            raise ConfigError(f"--worker-gpus must be >= 0, got {self.worker_gpus}")
        if self.tls_secret is not None and not _NAME_RE.match(self.tls_secret):
            raise ConfigError(f"--tls-secret must name a Secret (a DNS label), got {self.tls_secret!r}")
        check_job_args(self.job_args)

    def server_names(self) -> str:
        """Server i's DNS name, as a --server-names pattern: the pod's host name and the headless Service."""
        middle = "server-0" if self.format == "jobset" else "server"
        return f"{self.name}-{middle}-{{i}}.{self.name}"


def _metadata(job: K8sJob, name: str, **extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if job.namespace:
        meta["namespace"] = job.namespace
    meta["labels"] = {"app.kubernetes.io/name": "psgrad", "psgrad/job": job.name, **extra}
    return meta


def _threads(cpu: str) -> str:
    """A worker's OpenMP threads: its whole CPUs (at least 1)."""
    return str(max(1, int(float(cpu)))) if cpu.replace(".", "", 1).isdigit() else "1"


def _pod(job: K8sJob, role: str) -> dict[str, Any]:
    serving = role == SERVER
    command = ["psgrad", "run", "--engine", "k8s", "--role", role, "--num-servers", str(job.num_servers),
               "--num-workers", str(job.num_workers), "--server-names", job.server_names(),
               "--port-base", str(job.port), *cluster_argv(K8S_TLS_DIR if job.tls_secret else None, job.job_args),
               *job.job_args]
    cpu, memory = (job.server_cpu, job.server_memory) if serving else (job.worker_cpu, job.worker_memory)
    limits: dict[str, Any] = {"cpu": cpu, "memory": memory}
    if not serving and job.worker_gpus:
        limits["nvidia.com/gpu"] = str(job.worker_gpus)  # a quantity: a string, like cpu and memory
    container: dict[str, Any] = {"name": "psgrad", "image": job.image, "command": command}
    if serving:
        container["ports"] = [{"name": "grpc", "containerPort": job.port}]
        if not job.tls_secret:  # the kubelet's gRPC probe speaks plaintext only (no TLS, no client certificate)
            # The gRPC health service says SERVING once the shard holds the job's state (the Service
            # publishes not-ready addresses, so the chief reaches a server before it is ready).
            container["readinessProbe"] = {"grpc": {"port": job.port}, "periodSeconds": 5}
    container["env"] = [{"name": "OMP_NUM_THREADS", "value": "1" if serving else _threads(cpu)}]
    container["resources"] = {"requests": {"cpu": cpu, "memory": memory}, "limits": limits}
    spec: dict[str, Any] = {"restartPolicy": "Never"}
    if serving and job.format == "jobs":
        spec["subdomain"] = job.name  # with the Job's pod host name: NAME-server-I.NAME resolves
    spec["containers"] = [container]
    if job.tls_secret:
        container["volumeMounts"] = [{"name": "psgrad-tls", "mountPath": K8S_TLS_DIR, "readOnly": True}]
        spec["volumes"] = [{"name": "psgrad-tls", "secret": {"secretName": job.tls_secret, "defaultMode": 0o400}}]
    return {"metadata": {"labels": {"psgrad/job": job.name, "psgrad/role": role}}, "spec": spec}


def _job_spec(job: K8sJob, role: str) -> dict[str, Any]:
    count = job.num_servers if role == SERVER else job.num_workers
    return {"completionMode": "Indexed", "completions": count, "parallelism": count, "backoffLimit": 0,
            "template": _pod(job, role)}


def manifests(job: K8sJob) -> list[dict[str, Any]]:
    """The objects to `kubectl apply`, in order."""
    if job.format == "jobset":
        return [{
            "apiVersion": JOBSET_API, "kind": "JobSet", "metadata": _metadata(job, job.name),
            "spec": {
                "network": {"enableDNSHostnames": True},
                "successPolicy": {"operator": "All", "targetReplicatedJobs": [WORKER]},
                "failurePolicy": {"maxRestarts": 0},
                "replicatedJobs": [{"name": role, "replicas": 1, "template": {"spec": _job_spec(job, role)}}
                                   for role in (SERVER, WORKER)],
            },
        }]
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": _metadata(job, job.name),
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True,
                 "selector": {"psgrad/job": job.name, "psgrad/role": SERVER},
                 "ports": [{"name": "grpc", "port": job.port}]},
    }
    jobs = [{"apiVersion": "batch/v1", "kind": "Job", "metadata": _metadata(job, f"{job.name}-{role}", **{"psgrad/role": role}),
             "spec": _job_spec(job, role)} for role in (SERVER, WORKER)]
    return [service, *jobs]


# --------------------------------------------------------------------------- YAML text
_PLAIN_RE = re.compile(r"^[A-Za-z_/.][A-Za-z0-9_./-]*$")
_YAML_WORDS = {"true", "false", "yes", "no", "on", "off", "null", "y", "n", "~"}


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        plain = _PLAIN_RE.match(value) and value.lower() not in _YAML_WORDS
        return value if plain else json.dumps(value)  # a JSON string is a YAML double-quoted string
    raise ConfigError(f"cannot write {value!r} as YAML")


def _yaml_lines(value: Any, indent: int) -> list[str]:
    pad = " " * indent
    lines: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, (dict, list)) and item:
                lines.append(f"{pad}{_scalar(key)}:")
                lines += _yaml_lines(item, indent + 2)
            else:
                lines.append(f"{pad}{_scalar(key)}: {_scalar(item) if not isinstance(item, (dict, list)) else json.dumps(item)}")
    else:
        for item in value:
            if isinstance(item, (dict, list)) and item:
                inner = _yaml_lines(item, indent + 2)
                lines.append(f"{pad}- {inner[0].lstrip()}")
                lines += inner[1:]
            else:
                lines.append(f"{pad}- {_scalar(item)}")
    return lines


def to_yaml(documents: list[dict[str, Any]]) -> str:
    """Block-style YAML of dicts, lists, strings, ints and bools; strings that could read as anything
    else are double-quoted (JSON escapes)."""
    return "---\n".join("\n".join(_yaml_lines(doc, 0)) + "\n" for doc in documents)
