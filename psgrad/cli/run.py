"""`psgrad run`: one entry point for every process of a cluster job; its role comes from the environment."""
from __future__ import annotations

import argparse
import ipaddress
import math
import os
import logging
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psgrad.cli.commands import _check_task, serve, train_worker
from psgrad.cli.flags import (
    add_checkpoint_args,
    add_connection_args,
    add_job_args,
    add_server_policy_args,
    check_out_dir,
    flag,
    job_spec,
    positive_int,
)
from psgrad.cli.security import add_server_security_args, auth_config, tls_config
from psgrad.config import ServerConfig
from psgrad.errors import ConfigError
from psgrad.launch.roles import DEFAULT_PORT_BASE, ENGINES, KINDS, SERVER, Role, RunOptions

if TYPE_CHECKING:  # the parser imports this module: no torch at import time
    from psgrad.core.status import ShardStatus

STORE_TIMEOUT_S = 300.0
# A cluster schedules (and pulls the image of) the server pods or tasks when it likes, maybe minutes
# after the workers: a worker waits this long for a server to answer its first call.
CONNECT_TIMEOUT_S = 300.0
LINGER_S = 5.0
_log = logging.getLogger("psgrad.run")


def add_run_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    r = sub.add_parser(
        "run", help="run one process of a cluster job; its role comes from the cluster's environment",
        description="Run the server or worker this process is, as the cluster engine's environment says: "
        "TF_CONFIG (Kubeflow: ps tasks serve, chief/workers train), torchrun (ROLE_NAME server|worker groups, "
        "or one group whose first --num-servers ranks serve; addresses through the rendezvous store), SLURM "
        "(srun: the first --num-servers tasks serve, or component 0 of a heterogeneous job; server i listens on "
        "--port-base + i) or a Kubernetes Indexed Job (JOB_COMPLETION_INDEX with --role and --server-names). "
        "Then it runs exactly what `psgrad server` or `psgrad worker` runs. A missing or contradictory "
        "environment is refused naming the variable (exit 2).",
    )
    g = r.add_argument_group("cluster")
    flag(g, "--engine", "auto", "whose environment to read: auto (the first of TF_CONFIG, torchrun, Kubernetes, "
         "SLURM that is set), " + ", ".join(ENGINES), choices=("auto", *ENGINES))
    g.add_argument("--role", choices=KINDS, help="server or worker: required for a Kubernetes Indexed Job (the "
                   "index does not say which Job the pod is in); elsewhere checked against the environment")
    g.add_argument("--num-servers", type=positive_int, help="servers in the job: torchrun with one group and "
                   "SLURM's srun (the first S ranks/tasks serve), Kubernetes; elsewhere checked")
    g.add_argument("--num-workers", type=positive_int, help="workers in the job: Kubernetes; elsewhere checked "
                   "against what the environment implies")
    flag(g, "--host", "0.0.0.0", "address a server binds (all interfaces by default: give TLS flags, or --insecure)")
    flag(g, "--port-base", DEFAULT_PORT_BASE, "SLURM: server i listens on PORT_BASE + i on its node; Kubernetes: "
         "every server listens on it (TF_CONFIG: the ps entry's port; torchrun: a free port)", type=positive_int)
    g.add_argument("--advertise-host", help="torchrun: the host name a server publishes for workers to reach it "
                   "(default: this machine's host name; never 127.0.0.1 unless the whole job is on this machine)")
    g.add_argument("--server-names", metavar="PATTERN", help="Kubernetes: server i's DNS name with {i} for the "
                   "index, e.g. myjob-server-{i}.myjob (pods of an Indexed Job behind a headless Service)")
    flag(g, "--store-timeout-s", STORE_TIMEOUT_S, "torchrun: how long to wait for the rendezvous store and for "
         "every server to publish its address", type=float)
    flag(g, "--exit-when-done", True, "a server exits (code 0) once every worker of the job has left, so the "
         "cluster's job completes; --no-exit-when-done serves until stopped", action=argparse.BooleanOptionalAction)
    flag(g, "--linger-s", LINGER_S, "with --exit-when-done: how long a server keeps serving after the last worker "
         "left (workers read the final weights just after leaving)", type=float)
    s = r.add_argument_group("server")
    add_server_policy_args(s)
    flag(s, "--threads", ServerConfig.threads, "RPC handler threads; raise above 2x workers", type=int)
    flag(s, "--push-buffers", ServerConfig.push_buffers, "gradient-sized receive buffers of an async/ssp shard",
         type=positive_int)
    flag(s, "--stream-window-bytes", ServerConfig.stream_window_bytes, "bytes gRPC receives ahead per stream "
         "(0: gRPC's automatic windows)", type=int)
    flag(s, "--torch-threads", 1, "torch intra-op threads of a server process", type=positive_int)
    add_connection_args(s)
    c = add_checkpoint_args(r, "server checkpoints")
    c.add_argument("--checkpoint-dir", metavar="DIR", help="server i checkpoints into DIR/shardI and restores "
                   "the newest readable one at start (DIR on storage every server's node sees, or per node)")
    r.add_argument("--metrics-dir", metavar="DIR", help="worker r writes its JSONL metrics to DIR/workerR.jsonl")
    add_job_args(r, connect_timeout_s=CONNECT_TIMEOUT_S, wait_for_servers=True)
    add_server_security_args(r, run=True)
    r.set_defaults(func=cmd_run)


def run_options(ns: argparse.Namespace) -> RunOptions:
    return RunOptions(
        num_servers=ns.num_servers, num_workers=ns.num_workers, role=ns.role, host=ns.host, port_base=ns.port_base,
        advertise_host=ns.advertise_host, server_names=ns.server_names, hostname=socket.gethostname(),
    )


def every_worker_left(status: ShardStatus) -> bool:
    """The job is over for this shard: every rank of its job has joined and left (none evicted or live)."""
    from psgrad.core.status import LEFT

    if not status.initialized or status.spec is None:
        return False
    left = {w.rank for w in status.workers if w.state == LEFT}
    return left >= set(range(status.spec.num_workers))


def _is_loopback(host: str) -> bool:
    """Whether host resolves to this machine's loopback only (unresolvable names count as not)."""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


def server_config(ns: argparse.Namespace, role: Role) -> ServerConfig:
    """Server `role`'s config from `psgrad run`'s flags (the bind rule checked: TLS or --insecure
    off loopback)."""
    return ServerConfig(
        host=role.bind_host, port=role.port, lease_s=ns.lease_s, nonfinite=ns.nonfinite, threads=ns.threads,
        memory_budget_mb=ns.memory_budget_mb, max_read_mb=ns.max_read_mb, batch_scheduling=ns.batch_scheduling,
        follow_worker_cores=ns.follow_worker_cores,
        push_buffers=ns.push_buffers, stream_window_bytes=ns.stream_window_bytes,
        stream_read_timeout_s=ns.stream_read_timeout_s, max_streams_per_peer=ns.max_streams_per_peer,
        transfer_allowance_s=ns.transfer_allowance_s, min_transfer_rate_mb_s=ns.min_transfer_rate_mb_s,
        handshake_timeout_s=ns.handshake_timeout_s,
        checkpoint_dir=None if ns.checkpoint_dir is None else str(Path(ns.checkpoint_dir) / f"shard{role.index}"),
        checkpoint_every_s=ns.checkpoint_every_s, checkpoint_every_versions=ns.checkpoint_every_versions,
        metrics_port=ns.metrics_port, tls=tls_config(ns, client=False),
        auth=auth_config(ns, os.environ, client=False), insecure=ns.insecure,
    )


def _serve(ns: argparse.Namespace, role: Role) -> int:
    from psgrad.launch import rendezvous

    config = server_config(ns, role)  # before anything connects: a bad bind is a usage error
    store: Any = None
    if role.store is not None:  # torchrun: publish the address in the rendezvous store once bound
        if _is_loopback(role.advertise_host) and not _is_loopback(role.store.host):
            _log.warning(f"{role.advertise_host!r} resolves to a loopback address, which workers on other hosts "
                         f"cannot reach (the store is at {role.store.host}); pass --advertise-host NAME_OR_IP")
        store = rendezvous.connect_store(role.store, ns.store_timeout_s)

    def on_address(bound: str) -> None:
        advertised = f"{role.advertise_host}:{bound.rpartition(':')[2]}"
        if store is not None and role.store is not None:
            rendezvous.publish_server(store, role.store, role.index, advertised)
        print(f"psgrad run: server {role.index} reachable at {advertised}", flush=True)

    until = every_worker_left if ns.exit_when_done else None
    return serve(config, ns.torch_threads, on_address=on_address, until=until, linger_s=ns.linger_s)


def _train(ns: argparse.Namespace, role: Role) -> int:
    from psgrad.launch import rendezvous

    servers, store = role.servers, None
    if not servers and role.store is not None:
        store = rendezvous.connect_store(role.store, ns.store_timeout_s)  # kept: it may host the store
        servers = rendezvous.server_addresses(store, role.store, role.num_servers, ns.store_timeout_s)
    print(f"psgrad run: servers {','.join(servers)}", flush=True)
    metrics_out = None if ns.metrics_dir is None else os.path.join(ns.metrics_dir, f"worker{role.index}.jsonl")
    return train_worker(ns, servers, role.index, role.num_workers, metrics_out)


def cmd_run(ns: argparse.Namespace) -> int:
    from psgrad.launch.env import local_rank, resolve

    _check_task(ns)
    for name, low_ok in (("store_timeout_s", False), ("linger_s", True)):
        value = getattr(ns, name)
        if not math.isfinite(value) or value < 0 or (value == 0 and not low_ok):
            raise ConfigError(f"--{name.replace('_', '-')} must be a finite number {'>=' if low_ok else '>'} 0, "
                              f"got {value!r}")
    role = resolve(os.environ, run_options(ns), ns.engine)
    if ns.local_rank is None:  # a worker of a multi-GPU host takes GPU LOCAL_RANK (mod GPUs) under --device auto
        ns.local_rank = local_rank(os.environ)
    job_spec(ns, role.num_workers, role.num_servers)  # the job flags are checked before anything starts
    if role.kind == SERVER:
        server_config(ns, role)  # the bind rule (TLS or --insecure) is checked before anything starts
    elif ns.metrics_dir is not None:
        check_out_dir("--metrics-dir", ns.metrics_dir)
    _log.info(role.describe())
    return _serve(ns, role) if role.kind == SERVER else _train(ns, role)
