"""The subcommands: one cmd_* function per `psgrad COMMAND`, from parsed flags to a running server, worker or job."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from psgrad.cli.flags import (
    apply_recipe,
    check_ops_args,
    check_out_dir,
    check_out_file,
    client_config,
    credentials_config,
    job_spec,
    server_config,
    worker_config,
)
from psgrad.cli.status import print_status
from psgrad.config import REFUSED_GRACE_S, WAIT_FOR_SERVERS_HINT, ClientConfig, ServerConfig, WorkerConfig
from psgrad.core.addresses import REFUSED, refusing_shard
from psgrad.core.modes import SYNC, mode_named
from psgrad.errors import ConfigError, ServerStartError, ServerUnavailableError, Terminated

if TYPE_CHECKING:
    from psgrad.core.status import ShardStatus
    from psgrad.metrics.jsonl import Exporter, MetricsSink
    from psgrad.tasks.recipes import Recipe


def _check_task(ns: argparse.Namespace, steps_key: str = "steps", data: bool = False) -> Recipe:
    """Fail fast (before any process starts) on an unknown task or an import string that does not
    resolve, and with `data` (a launcher, whose workers read the data on this machine) on a
    built-in task's missing data (--data-dir); fill the flags left to the task's recipe, and return
    it. Not `data` for `psgrad run` (a server reads none) and the cluster renderers (the data is on
    the cluster)."""
    from psgrad.tasks import check_task, known_task

    if data:
        check_task(ns.task, ns.data_dir)
    else:
        known_task(ns.task)
    return apply_recipe(ns, steps_key)


def _check_rank(ns: argparse.Namespace) -> None:
    if ns.rank >= ns.num_workers:
        raise ConfigError(f"--rank must be < --num-workers ({ns.num_workers}), got {ns.rank}")


def serve(
    config: ServerConfig, torch_threads: int, port_file: str | None = None,
    on_address: Callable[[str], None] | None = None, until: Callable[[ShardStatus], bool] | None = None,
    linger_s: float = 0.0,
) -> int:
    """What `psgrad server` runs (and `psgrad run` as a server): serve one shard until stopped."""
    from psgrad.launch.template import collector_off  # (the start-up imports: see there)

    with collector_off():
        import torch

        from psgrad.server.runtime import serve_forever

    # Before any other thread starts, so that every handler thread inherits it.
    torch.set_num_threads(torch_threads)

    def announce(address: str) -> None:
        if port_file:
            path = Path(port_file)
            fd, tmp = tempfile.mkstemp(dir=path.parent or ".", prefix=".port-")
            with os.fdopen(fd, "w") as f:
                f.write(address + "\n")
            os.replace(tmp, path)  # atomic: readers never see a partial address
        print(f"psgrad server listening on {address}", flush=True)
        if on_address is not None:
            on_address(address)

    serve_forever(config, announce, until=until, linger_s=linger_s)
    return 0


def cmd_server(ns: argparse.Namespace) -> int:
    if ns.port_file:  # (its folder made as --metrics-out's is, before the server binds: a failure named now)
        try:
            Path(ns.port_file).absolute().parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--port-file {ns.port_file!r}: cannot make its folder: {exc.strerror or exc}") from None
    return serve(server_config(ns), ns.torch_threads, ns.port_file)


def train_worker(
    ns: argparse.Namespace, servers: tuple[str, ...], rank: int, num_workers: int, metrics_out: str | None,
    slowdown: float = WorkerConfig.slowdown,
) -> int:
    """What `psgrad worker` runs (and `psgrad run` as a worker): train rank `rank` of the job flags in ns."""
    _check_task(ns)
    check_ops_args(ns)
    spec = job_spec(ns, num_workers, len(servers))
    config = worker_config(ns, servers, client_config(ns, rank), rank, slowdown, metrics_out)
    cores = bind_worker(config)  # before any thread starts: the threads it starts inherit the cores
    if not config.client.wait_for_servers:  # a wrong port is said before torch is imported (seconds)
        refused = refusing_shard(servers, REFUSED_GRACE_S)
        if refused is not None:
            address, waited_s = refused
            raise ServerUnavailableError(f"server {address} {REFUSED} for {waited_s:.1f} s: the join request was "
                                         f"not sent{WAIT_FOR_SERVERS_HINT}")
    from psgrad.launch.template import collector_off  # (the start-up imports: see there)

    with collector_off():
        from psgrad.cli.train import train
        from psgrad.metrics.jsonl import MetricsSink
        from psgrad.tasks import get_task

    cap_threads(cores)
    task = get_task(ns.task, ns.seed, ns.data_dir)
    log = logging.getLogger("psgrad.worker")
    with MetricsSink(metrics_out, rank, worker_exporters(ns, rank, config.steps, log),
                     append=config.metrics_append) as sink, _redirected(sink), _sigterm_stops():
        train(config, spec, task, sink, log=log.info)
    return 0


def bind_worker(config: WorkerConfig) -> list[int]:
    """--bind-cores: bind this process to the worker's share of its host's cores (psgrad.bind_cores,
    from --local-rank and --local-workers or the engine's variables), and say so; the cores, or []
    where nothing was bound (no --bind-cores, or no CPU affinity on this platform). A task its
    engine bound already (a SLURM task under --cpu-bind), given no --local-workers and no
    --local-rank but the engine's, keeps its cores.

    Raises:
        ConfigError: --bind-cores without --local-rank or --local-workers where no engine's variable
            gives them, or a rank outside the workers.
    """
    if not config.bind_cores:
        return []
    from psgrad.core.cores import LOCAL_RANK_VARIABLES, LOCAL_WORKERS_VARIABLES, bind_cores, engine_binding, host_cores
    from psgrad.launch.env import local_rank, local_workers

    log = logging.getLogger("psgrad.worker")
    kept = engine_binding(os.environ, config.local_rank, config.local_workers)  # (its share already)
    if kept is not None and hasattr(os, "sched_setaffinity"):
        cores = host_cores()
        log.info("worker %d keeps cores %s: %s", config.rank, ",".join(map(str, cores)), kept)
        return cores
    rank = local_rank(os.environ) if config.local_rank is None else config.local_rank
    workers = local_workers(os.environ) if config.local_workers is None else config.local_workers
    for value, name, variables, what in ((rank, "--local-rank", LOCAL_RANK_VARIABLES, "this worker's index among them"),
                                         (workers, "--local-workers", LOCAL_WORKERS_VARIABLES,
                                          "how many workers share the host")):
        if value is None:
            raise ConfigError(f"--bind-cores gives each worker of a host its share of the host's cores, and needs "
                              f"{name} ({what}), or {' or '.join(variables)} in the environment as torchrun and "
                              f"SLURM set; psgrad launch gives both")
    cores = bind_cores(rank, workers)
    if cores:
        log.info("worker %d bound to cores %s", config.rank, ",".join(map(str, cores)))
    return cores


def cap_threads(cores: list[int]) -> None:
    """No more torch threads than a bound worker's cores (more would only take turns on them)."""
    import torch

    if cores and torch.get_num_threads() > len(cores):
        torch.set_num_threads(len(cores))


@contextlib.contextmanager
def _sigterm_stops() -> Iterator[None]:
    """SIGTERM raises Terminated in this (the main) thread meanwhile: the worker leaves the job as on
    Ctrl-C, instead of dying where it stands and staying live on the shards until its lease ends (a
    sync job's iteration waits for it until then)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def ops_argv(ns: argparse.Namespace, worker: bool) -> list[str]:
    """The logging (and, for workers, metrics) flags a launcher passes on to its children."""
    argv = ["--log-level", ns.log_level, "--log-format", ns.log_format]
    if worker:
        if ns.metrics_port is not None:
            argv += ["--metrics-port", str(ns.metrics_port), "--metrics-host", ns.metrics_host]
        if ns.tensorboard is not None:
            argv += ["--tensorboard", ns.tensorboard]
    return argv


def server_metrics_argv(ns: argparse.Namespace, index: int) -> list[str]:
    """`launch --metrics-port P`: server `index`'s own endpoint, after the workers' P..P+W-1: P + W +
    index (backups: index num_servers + i); with P = 0, a free port each (printed)."""
    from psgrad.cli.launch_ray import server_metrics_port

    port = server_metrics_port(ns, index)
    return [] if port is None else ["--metrics-port", str(port)]


def worker_exporters(ns: argparse.Namespace, rank: int, steps: int, log: logging.Logger) -> list[Exporter]:
    """The worker's Prometheus endpoint, TensorBoard writer and progress bar, as its flags ask."""
    from psgrad.metrics import exporters

    out: list[Exporter] = []
    if ns.metrics_port is not None:
        port = ns.metrics_port + rank if ns.metrics_port else 0
        try:
            prom = exporters.PrometheusExporter(rank, ns.metrics_host, port)
        except ImportError as exc:
            raise ConfigError(f"worker {rank}: {exc}") from None
        except OSError as exc:  # (as a server's: the address and the flag named, a run-time failure)
            raise ServerStartError(f"worker {rank}: cannot serve metrics on {ns.metrics_host}:{port} (--metrics-port "
                                   f"{ns.metrics_port} + rank {rank}): {exc.strerror or exc}") from None
        out.append(prom)
        log.info(f"worker {rank}: metrics at {prom.url}")
    try:
        if ns.tensorboard is not None:
            out.append(exporters.TensorBoardExporter(ns.tensorboard, rank))
        if ns.progress == "on" or (ns.progress == "auto" and sys.stderr.isatty()):
            out.append(exporters.ProgressExporter(steps, f"worker {rank}"))
    except (OSError, ImportError) as exc:
        for exporter in out:
            exporter.close()
        raise ConfigError(f"worker {rank}: {exc}") from None
    return out


@contextlib.contextmanager
def _redirected(sink: MetricsSink) -> Iterator[None]:
    """With a progress bar, log lines are written above it instead of through it."""
    from psgrad.metrics.exporters import ProgressExporter

    if not any(isinstance(e, ProgressExporter) for e in sink.exporters):
        yield
        return
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm(loggers=[logging.getLogger("psgrad")]):
        yield


def cmd_worker(ns: argparse.Namespace) -> int:
    _check_task(ns)
    job_spec(ns, ns.num_workers, len(ns.servers))  # the job's flags first, as before
    _check_rank(ns)
    return train_worker(ns, ns.servers, ns.rank, ns.num_workers, ns.metrics_out, ns.slowdown)


def cmd_allreduce(ns: argparse.Namespace) -> int:
    from psgrad.launch.template import collector_off  # (the start-up imports: see there)

    with collector_off():
        from psgrad.experiments.allreduce import train_allreduce
        from psgrad.metrics.jsonl import MetricsSink
        from psgrad.tasks import get_task

    _check_task(ns)
    _check_rank(ns)
    store = Path(ns.store)
    check_out_file("--store", ns.store)
    # The PS-only options (--mode, --staleness, --wire-dtype, ...) do not apply: all-reduce is
    # synchronous by construction, so the spec says sync and only the optimizer's settings matter.
    if ns.dc_asgd or ns.dc_asgd_adaptive:
        raise ConfigError("--dc-asgd compensates stale gradients on parameter servers; the all-reduce baseline "
                          "is synchronous (nothing is stale) and has no servers: drop --dc-asgd")
    job = job_spec(ns, ns.num_workers, 1)
    spec = dataclasses.replace(job, mode=SYNC.name, staleness=0, staleness_max=0, backup_workers=0, staleness_lr=False,
                               wire_dtype="float32", compress="none")
    client = ClientConfig(init_timeout_s=ns.init_timeout_s)
    config = worker_config(ns, (), client, ns.rank, ns.slowdown, ns.metrics_out)
    cap_threads(bind_worker(config))  # (no thread of the worker's has started yet)
    task = get_task(ns.task, ns.seed, ns.data_dir)
    check_ops_args(ns)
    exporters = worker_exporters(ns, ns.rank, config.steps, logging.getLogger("psgrad.worker"))
    with MetricsSink(ns.metrics_out, ns.rank, exporters, append=config.metrics_append) as sink, _redirected(sink):
        train_allreduce(config, spec, task, sink, str(store.absolute()))
    return 0


def cmd_launch(ns: argparse.Namespace) -> int:
    """`psgrad launch`; with --resume DIR, ns holds the flags the job was launched with, then the
    ones given now (main.resumed_launch parsed them) and ns.resume still names DIR."""
    from psgrad.cli.launch_ray import launch_on_ray, ray_config
    from psgrad.launch import jobdir, jobkeys
    from psgrad.launch.local import run_launch

    resuming = ns.resume is not None
    _check_task(ns, data=ns.backend != "ray")  # on a Ray cluster the workers read the data on their nodes
    from psgrad.core.job import check_overlap, check_row_cache

    spec = job_spec(ns, ns.num_workers, ns.num_servers)
    check_overlap(spec, ns.overlap)  # validate before starting anything
    check_row_cache(spec, ns.row_cache_rows)
    ray = ray_config(ns)
    # Absolute: under --backend ray the workers run elsewhere (on one machine it changes nothing).
    metrics_dir = Path(ns.metrics_dir).absolute() if ns.metrics_dir else None
    if ns.metrics_dir:
        check_out_dir("--metrics-dir", ns.metrics_dir)

    slowdowns = dict(ns.straggler or [])
    for rank in slowdowns:
        if rank >= ns.num_workers:
            raise ConfigError(f"--straggler names rank {rank}, but there are only {ns.num_workers} workers")
    # Every worker's config but its servers, rank, slowdown and metrics file (validated here too).
    base = worker_config(ns, (), client_config(ns), 0, WorkerConfig.slowdown, None)

    def worker_args(rank: int, servers: str) -> list[str]:
        metrics_out = None if metrics_dir is None else str(metrics_dir / f"worker{rank}.jsonl")
        config = dataclasses.replace(
            base, servers=tuple(servers.split(",")), rank=rank,
            slowdown=slowdowns.get(rank, WorkerConfig.slowdown), metrics_out=metrics_out,
            metrics_append=resuming and metrics_out is not None,  # (the stopped run's records stay)
            local_rank=rank,  # one machine: --device auto gives worker r GPU r mod GPUs
            local_workers=ns.num_workers if ns.bind_cores else None,  # --bind-cores: the machine's cores split W ways
        )
        return [*config.to_argv(), *spec.to_argv(), *ops_argv(ns, worker=True), *(keys.worker_argv(rank) if keys else [])]

    check_ops_args(ns)
    if ns.metrics_port:  # the workers' ports, then the servers' (and their backups')
        last = ns.metrics_port + ns.num_workers + ns.num_servers * (1 + ns.replicas) - 1
        if last > 65535:
            raise ConfigError(f"--metrics-port {ns.metrics_port}: the workers and servers would need ports up to "
                              f"{last} (P .. P + num_workers + num_servers{' x 2' if ns.replicas else ''} - 1), "
                              "past 65535: give a lower port")
    if ray is not None and ns.security != "off":
        raise ConfigError("--tls and --tokens work with --backend local only for now (the credential files would have "
                          "to reach every node); on a Ray cluster you trust, give --insecure")
    if ray is not None and ray.address is not None and not ns.insecure:
        raise ConfigError("--backend ray --address: the server actors listen on their nodes' addresses, and TLS is not "
                          "available under Ray yet: give --insecure to run without it, on a network only the cluster "
                          "reaches")
    if ns.insecure and ray is None:
        raise ConfigError("--insecure is for --backend ray (a local launch binds loopback only)")
    if resuming:  # (a job whose checkpoints hold every worker at --steps: nothing is started)
        reached = jobdir.reached_clock(Path(ns.checkpoint_dir), ns.num_servers, ns.num_workers)
        if reached is not None and reached >= ns.steps:
            print(f"[launch] the job in {ns.resume} had already finished: its checkpoints hold every worker at clock "
                  f"{reached} and --steps is {ns.steps}, so nothing is left to train and nothing was started "
                  "(to train on, resume it with a larger --steps)", flush=True)
            return 0
    keys = jobkeys.create(ns.security, ns.num_workers)

    def status(addresses: list[str]) -> None:
        print_status(addresses, 10.0, False, keys.admin() if keys else None)

    recorded = ns.checkpoint_dir is not None and not resuming
    if recorded:  # everything checked: record the new job
        jobdir.start_new(Path(ns.checkpoint_dir), ns.raw_argv[1:])

    def ended(code: int) -> int:  # (a launch that failed before any checkpoint leaves no record behind)
        if code != 0 and recorded:
            jobdir.forget_unstarted(Path(ns.checkpoint_dir))
        return code

    if ray is not None:
        return ended(launch_on_ray(ns, ray, worker_args, status))
    server_args = ["--lease-s", str(ns.lease_s), "--nonfinite", ns.nonfinite, *ops_argv(ns, worker=False),
                   *([] if ns.memory_budget_mb is None else ["--memory-budget-mb", str(ns.memory_budget_mb)]),
                   *([] if ns.max_read_mb == ServerConfig.max_read_mb else ["--max-read-mb", str(ns.max_read_mb)]),
                   *([] if ns.batch_scheduling else ["--no-batch-scheduling"]),
                   *([] if ns.follow_worker_cores else ["--no-follow-worker-cores"]),
                   *(keys.server_argv() if keys else [])]
    if ns.checkpoint_dir is not None:
        server_args += ["--checkpoint-every-s", str(ns.checkpoint_every_s),
                        "--checkpoint-every-versions", str(ns.checkpoint_every_versions)]

    def shard_args(index: int) -> list[str]:
        """Server `index`'s flags (index num_servers + i: server i's backup): its metrics port after the
        workers' (P + num_workers + index), its checkpoint directory."""
        own = [*server_args, *server_metrics_argv(ns, index)]
        if ns.checkpoint_dir is None or index >= ns.num_servers:
            return own
        return [*own, "--checkpoint-dir", str(jobdir.shard_dir(Path(ns.checkpoint_dir), index))]
    env = dict(os.environ)
    if ns.omp_threads:
        env["OMP_NUM_THREADS"] = str(ns.omp_threads)
    elif "OMP_NUM_THREADS" not in env:
        # Several processes whose OpenMP threads spin on a few cores run several times slower
        # (like torchrun, give each process its share of the cores).
        share = max(1, (os.cpu_count() or 1) // (ns.num_servers * (1 + ns.replicas) + ns.num_workers))
        env["OMP_NUM_THREADS"] = str(share)
    secured = {"tls": ", mutual TLS and a token per worker", "tokens": ", a token per worker"}.get(ns.security, "")
    print(
        f"[launch] {ns.num_servers} server(s){' with a backup each' if ns.replicas else ''} + {ns.num_workers} "
        f"worker(s), OMP_NUM_THREADS={env['OMP_NUM_THREADS']} each{secured}",
        flush=True,
    )
    if spec.compress != "none" and base.client.shared_memory and not base.client.compress_same_host:
        print(f"[launch] --compress {spec.compress} compresses pushes between hosts only: every server of this launch "
              "shares the workers' host, so the workers push plain gradients through shared memory (fewer bytes "
              "save nothing there; `psgrad status` counts them); add --compress-same-host to compress them too",
              flush=True)
    try:
        return ended(run_launch(
            ns.num_servers,
            ns.num_workers,
            shard_args,
            worker_args,
            status=status,
            env=env,
            replicas=ns.replicas,
        ))
    finally:
        if keys is not None:
            keys.remove()


def cmd_status(ns: argparse.Namespace) -> int:
    if ns.watch:
        from psgrad.cli.status import watch_status

        if ns.json:
            raise ConfigError("--watch shows a table; leave out --json (or poll `psgrad status --json`)")
        if not ns.interval_s > 0:
            raise ConfigError(f"--interval-s must be > 0, got {ns.interval_s}")
        try:
            watch_status(ns.servers, ns.timeout_s, ns.interval_s, ns.count, client=credentials_config(ns))
        except KeyboardInterrupt:
            pass  # Ctrl-C is how a watch ends
        return 0
    print_status(ns.servers, ns.timeout_s, ns.json, credentials_config(ns))
    return 0


def cmd_export(ns: argparse.Namespace) -> int:
    from psgrad.launch.template import collector_off  # (the start-up imports: see there)

    with collector_off():
        from psgrad.client.export import fetch_model, write_state_dict

    out = Path(ns.out)
    check_out_file("--out", ns.out)
    snap = fetch_model(ns.servers, ns.timeout_s, credentials_config(ns), materialize=ns.materialize)
    write_state_dict(snap.state_dict, out)
    values = sum(t.numel() for t in snap.state_dict.values())
    at = (f"iteration {snap.versions[0]} on every shard" if mode_named(snap.mode).synchronous else
          f"shard versions {snap.versions}" + ("" if snap.consistent else " (pushes were in flight: each shard as of its own)"))
    print(f"psgrad export: wrote {len(snap.state_dict)} tensors ({values:,} values) at {at} to {out}")
    return 0
