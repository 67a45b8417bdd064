"""`psgrad server|worker|launch|allreduce|status`: argv -> validated config -> call. The only module that reads argv."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from psgrad import __version__
from psgrad.config import (
    MODES,
    NONFINITE_POLICIES,
    OPTIMIZER_NAMES,
    WIRE_DTYPES,
    ClientConfig,
    JobSpec,
    ServerConfig,
    WorkerConfig,
    parse_servers,
)
from psgrad.errors import ConfigError, PsgradError, TaskError

EXIT_USAGE = 2
COMPARE_STEPS = 400
COMPARE_REPEATS = 2


def _servers_arg(text: str) -> tuple[str, ...]:
    try:
        return parse_servers(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_straggler(text: str) -> tuple[int, float]:
    """'RANK:FACTOR' -> (rank, factor), e.g. '0:4' makes worker 0 four times slower."""
    rank, sep, factor = text.partition(":")
    try:
        if not sep:
            raise ValueError
        r, f = int(rank), float(factor)
    except ValueError:
        raise ConfigError(f"malformed straggler {text!r}: expected RANK:FACTOR, e.g. 0:4") from None
    if r < 0 or not f >= 1.0 or f == float("inf"):
        raise ConfigError(f"straggler {text!r}: rank must be >= 0 and FACTOR a finite number >= 1")
    return r, f


def _straggler_arg(text: str) -> tuple[int, float]:
    try:
        return parse_straggler(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


# --------------------------------------------------------------------------- job options
def _add_job_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("job (every worker must pass the same values)")
    g.add_argument(
        "--task",
        default="digits",
        help="training task: a built-in name (digits, mnist1d) or your own as package.module:function "
        "returning a psgrad.Task; the current directory is searched (default: digits)",
    )
    g.add_argument(
        "--mode",
        default="async",
        choices=MODES,
        help="consistency: async (never wait; fastest, stalest), ssp (bounded staleness, see "
        "--staleness) or sync (BSP: one averaged update per iteration, staleness 0) (default: async)",
    )
    g.add_argument(
        "--staleness",
        type=int,
        default=None,
        help="ssp only: how many iterations a worker may run ahead of the slowest live worker; "
        "larger is faster with stragglers, smaller is fresher (default: 2 for ssp)",
    )
    g.add_argument(
        "--staleness-lr",
        action="store_true",
        help="scale each gradient's step by 1/max(1, staleness) (Zhang et al., IJCAI 2016); "
        "try it when async training with many workers diverges",
    )
    g.add_argument("--steps", type=int, default=1000, help="training steps per worker (default: 1000)")
    g.add_argument("--batch-size", type=_positive_int, default=32, help="examples per step per worker (default: 32)")
    g.add_argument(
        "--optimizer",
        default="sgd",
        choices=OPTIMIZER_NAMES,
        help="update rule the servers apply: sgd (optionally with --momentum), adam (like "
        "torch.optim.Adam; keeps 2 extra floats per parameter on the servers) or adamw (Adam with "
        "decoupled weight decay) (default: sgd)",
    )
    g.add_argument("--lr", type=float, default=0.1, help="server-side learning rate (default: 0.1; adam usually wants ~1e-3)")
    g.add_argument(
        "--momentum",
        type=float,
        default=0.0,
        help="SGD momentum on the servers (default: 0). With many async workers, "
        "effective momentum grows with staleness: lower it if training oscillates",
    )
    g.add_argument(
        "--weight-decay",
        type=float,
        default=0.0,
        help="weight decay: L2 added to the gradient for sgd and adam, decoupled for adamw (default: 0)",
    )
    g.add_argument(
        "--beta1",
        type=float,
        default=0.9,
        help="adam/adamw: decay of the gradient average (Adam's momentum); like --momentum, lower it "
        "(e.g. 0.5) if training with many async workers oscillates (default: 0.9)",
    )
    g.add_argument(
        "--beta2",
        type=float,
        default=0.999,
        help="adam/adamw: decay of the squared-gradient average; lower it (e.g. 0.98) if training "
        "is unstable early on (default: 0.999)",
    )
    g.add_argument(
        "--eps",
        type=float,
        default=1e-8,
        help="adam/adamw: term added to the denominator; raise it (e.g. 1e-6) if parameters whose "
        "gradients are almost zero still take lr-sized steps (default: 1e-8)",
    )
    g.add_argument(
        "--wire-dtype",
        default="float32",
        choices=WIRE_DTYPES,
        help="dtype of pushed gradients and pulled weights on the wire; bfloat16/float16 halve "
        "the bytes, servers keep float32 master weights (default: float32)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed for model init and batch order (default: 0)")
    w = p.add_argument_group("worker")
    w.add_argument(
        "--device",
        default="auto",
        help="auto (cuda if available), cpu, cuda or cuda:N (default: auto)",
    )
    w.add_argument(
        "--jitter-ms",
        type=float,
        default=0.0,
        help="add a random delay of 0..MS milliseconds per step, deterministic given --seed (default: 0)",
    )
    w.add_argument(
        "--overlap",
        action="store_true",
        help="push/pull in the background while the next step computes (async and ssp only); each "
        "gradient is then computed on weights one iteration older (default: off)",
    )
    w.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (default: 0 = 10 times per run)")
    w.add_argument("--log-every", type=int, default=0, help="print progress every N steps (default: 0 = 10 times)")
    w.add_argument(
        "--connect-timeout-s",
        type=float,
        default=10.0,
        help="how long to wait for each server to answer the first call (default: 10)",
    )
    w.add_argument(
        "--rpc-timeout-s",
        type=float,
        default=60.0,
        help="deadline of each pull/push; raise it for very large models on slow links (default: 60)",
    )
    w.add_argument(
        "--init-timeout-s",
        type=float,
        default=120.0,
        help="how long non-chief workers wait for rank 0 to initialize the servers (default: 120)",
    )
    w.add_argument(
        "--shared-memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="move payloads through /dev/shm segments when a server is on this host (falls back to "
        "gRPC frames by itself otherwise); --no-shared-memory forces gRPC (default: on)",
    )


def _staleness(ns: argparse.Namespace) -> int:
    if ns.staleness is None:
        return 2 if ns.mode == "ssp" else 0
    return int(ns.staleness)


def _job_spec(ns: argparse.Namespace, num_workers: int, num_shards: int) -> JobSpec:
    return JobSpec(
        mode=ns.mode,
        staleness=_staleness(ns),
        staleness_lr=ns.staleness_lr,
        num_workers=num_workers,
        optimizer=ns.optimizer,
        lr=ns.lr,
        momentum=ns.momentum,
        weight_decay=ns.weight_decay,
        beta1=ns.beta1,
        beta2=ns.beta2,
        eps=ns.eps,
        wire_dtype=ns.wire_dtype,
        num_shards=num_shards,
    )


def _job_argv(ns: argparse.Namespace) -> list[str]:
    """The job options back as argv (launch passes them to each worker)."""
    out = ["--staleness", str(_staleness(ns))] + (["--staleness-lr"] if ns.staleness_lr else [])
    out += ["--overlap"] if ns.overlap else []
    out += [] if ns.shared_memory else ["--no-shared-memory"]
    for flag in (
        "task", "mode", "steps", "batch_size", "optimizer", "lr", "momentum", "weight_decay", "beta1", "beta2",
        "eps", "wire_dtype", "seed",
        "device", "eval_every", "log_every", "connect_timeout_s", "rpc_timeout_s", "init_timeout_s",
        "jitter_ms",
    ):
        out += ["--" + flag.replace("_", "-"), str(getattr(ns, flag))]
    return out


def _check_task(name: str) -> None:
    """Fail fast (before any process starts) on an unknown task or an import string that does not resolve."""
    from psgrad.tasks import resolve_task

    resolve_task(name)


# --------------------------------------------------------------------------- subcommands
def cmd_server(ns: argparse.Namespace) -> int:
    import torch

    from psgrad.server.runtime import serve_forever

    # Before any other thread starts, so that every handler thread inherits it.
    torch.set_num_threads(ns.torch_threads)

    config = ServerConfig(
        host=ns.host, port=ns.port, lease_s=ns.lease_s, nonfinite=ns.nonfinite, threads=ns.threads,
        push_buffers=ns.push_buffers, stream_window_bytes=ns.stream_window_bytes,
    )

    def announce(address: str) -> None:
        if ns.port_file:
            path = Path(ns.port_file)
            fd, tmp = tempfile.mkstemp(dir=path.parent or ".", prefix=".port-")
            with os.fdopen(fd, "w") as f:
                f.write(address + "\n")
            os.replace(tmp, path)  # atomic: readers never see a partial address
        print(f"psgrad server listening on {address}", flush=True)

    serve_forever(config, announce)
    return 0


def _worker_config(ns: argparse.Namespace, servers: tuple[str, ...], client: ClientConfig) -> WorkerConfig:
    """The WorkerConfig of `psgrad worker` and `psgrad allreduce` from their shared flags."""
    return WorkerConfig(
        servers=servers,
        task=ns.task,
        rank=ns.rank,
        steps=ns.steps,
        batch_size=ns.batch_size,
        device=ns.device,
        seed=ns.seed,
        metrics_out=ns.metrics_out,
        eval_every=ns.eval_every,
        log_every=ns.log_every,
        slowdown=ns.slowdown,
        jitter_ms=ns.jitter_ms,
        overlap=getattr(ns, "overlap", False),
        client=client,
    )


def cmd_worker(ns: argparse.Namespace) -> int:
    from psgrad.metrics.jsonl import MetricsSink
    from psgrad.tasks import get_task
    from psgrad.worker.loop import train

    _check_task(ns.task)
    spec = _job_spec(ns, ns.num_workers, len(ns.servers))
    if ns.rank >= ns.num_workers:
        raise ConfigError(f"--rank must be < --num-workers ({ns.num_workers}), got {ns.rank}")
    client = ClientConfig(
        connect_timeout_s=ns.connect_timeout_s, rpc_timeout_s=ns.rpc_timeout_s, init_timeout_s=ns.init_timeout_s,
        shared_memory=ns.shared_memory,
    )
    config = _worker_config(ns, ns.servers, client)
    task = get_task(ns.task, ns.seed)
    with MetricsSink(ns.metrics_out, ns.rank) as sink:
        train(config, spec, task, sink)
    return 0


def cmd_allreduce(ns: argparse.Namespace) -> int:
    from psgrad.experiments.allreduce import train_allreduce
    from psgrad.metrics.jsonl import MetricsSink
    from psgrad.tasks import get_task

    _check_task(ns.task)
    if ns.rank >= ns.num_workers:
        raise ConfigError(f"--rank must be < --num-workers ({ns.num_workers}), got {ns.rank}")
    store = Path(ns.store)
    if store.is_dir():
        raise ConfigError(f"--store {ns.store!r} is a directory; give the path of a (new) file")
    if not store.parent.is_dir():
        raise ConfigError(f"--store {ns.store!r}: directory {str(store.parent)!r} does not exist")
    # The PS-only options (--mode, --staleness, --wire-dtype, ...) do not apply: all-reduce is
    # synchronous by construction, so the spec says sync and only lr/momentum/weight_decay matter.
    if ns.optimizer != "sgd":
        raise ConfigError(f"the all-reduce baseline applies SGD only, got --optimizer {ns.optimizer}")
    spec = JobSpec(
        mode="sync", num_workers=ns.num_workers, lr=ns.lr, momentum=ns.momentum, weight_decay=ns.weight_decay
    )
    config = _worker_config(ns, (), ClientConfig(init_timeout_s=ns.init_timeout_s))
    task = get_task(ns.task, ns.seed)
    with MetricsSink(ns.metrics_out, ns.rank) as sink:
        train_allreduce(config, spec, task, sink, str(store.absolute()))
    return 0


def cmd_launch(ns: argparse.Namespace) -> int:
    from psgrad.launch.local import run_launch

    _check_task(ns.task)
    from psgrad.api import check_overlap

    check_overlap(_job_spec(ns, ns.num_workers, ns.num_servers), ns.overlap)  # validate before starting anything
    job = _job_argv(ns)
    metrics_dir = Path(ns.metrics_dir) if ns.metrics_dir else None

    slowdowns = dict(ns.straggler or [])
    for rank in slowdowns:
        if rank >= ns.num_workers:
            raise ConfigError(f"--straggler names rank {rank}, but there are only {ns.num_workers} workers")

    def worker_args(rank: int, servers: str) -> list[str]:
        args = ["--servers", servers, "--rank", str(rank), "--num-workers", str(ns.num_workers), *job]
        args += ["--slowdown", str(slowdowns.get(rank, 1.0))]
        if metrics_dir is not None:
            args += ["--metrics-out", str(metrics_dir / f"worker{rank}.jsonl")]
        return args

    server_args = ["--lease-s", str(ns.lease_s), "--nonfinite", ns.nonfinite]
    env = dict(os.environ)
    if ns.omp_threads:
        env["OMP_NUM_THREADS"] = str(ns.omp_threads)
    elif "OMP_NUM_THREADS" not in env:
        # Several processes whose OpenMP threads spin on a few cores run several times slower
        # (like torchrun, give each process its share of the cores).
        share = max(1, (os.cpu_count() or 1) // (ns.num_servers + ns.num_workers))
        env["OMP_NUM_THREADS"] = str(share)
    print(
        f"[launch] {ns.num_servers} server(s) + {ns.num_workers} worker(s), OMP_NUM_THREADS={env['OMP_NUM_THREADS']} each",
        flush=True,
    )
    return run_launch(
        ns.num_servers,
        ns.num_workers,
        server_args,
        worker_args,
        status=lambda a: _print_status(a, 10.0, False),
        env=env,
    )


def _print_status(addresses: Sequence[str], timeout_s: float, as_json: bool) -> None:
    from psgrad.client.parameter_client import shard_status
    from psgrad.wire.serde import status_to_dict

    shards = [dict(status_to_dict(r), address=a) for a, r in zip(addresses, shard_status(addresses, timeout_s))]
    if as_json:
        print(json.dumps({"shards": shards}, indent=2))
        return
    print(format_status(shards), flush=True)


def format_status(shards: Sequence[dict[str, Any]]) -> str:
    """The human-readable table `psgrad status` prints."""
    head = f"{'shard':>5} {'address':<21} {'range':<21} {'version':>8} {'applied':>8} {'dup':>4} {'rej':>4} {'pulls':>7} {'MB in':>9} {'MB out':>9}"
    lines = [head]
    for s in shards:
        if not s["initialized"]:
            lines.append(f"{'-':>5} {s['address']:<21} not initialized (start worker rank 0 first)")
            continue
        rng = f"[{s['range'][0]}, {s['range'][1]})"
        lines.append(
            f"{s['shard']:>5} {s['address']:<21} {rng:<21} {s['version']:>8} {s['pushes_applied']:>8} "
            f"{s['pushes_duplicate']:>4} {s['pushes_rejected']:>4} {s['pulls']:>7} "
            f"{s['bytes_in'] / 1e6:>9.1f} {s['bytes_out'] / 1e6:>9.1f}"
        )
    for s in shards:
        if not s["initialized"]:
            continue
        workers = " ".join(f"{w['rank']}:clock={w['clock']},{w['state']}" for w in s["workers"]) or "none"
        st = s["staleness"]
        hist = " ".join(f"{k}:{v}" for k, v in st["histogram"].items()) or "none"
        lines.append(f"shard {s['shard']}: workers {workers}")
        if s["evictions"] or s["pending"] or s["waiting"]:
            lines.append(
                f"shard {s['shard']}: evictions {s['evictions']}, sync gradients buffered {s['pending']}, "
                f"pulls waiting {s['waiting']}"
            )
        lines.append(f"shard {s['shard']}: staleness histogram {hist} (mean {st['mean']:.2f}, max {st['max']})")
    return "\n".join(lines)


def cmd_compare(ns: argparse.Namespace) -> int:
    import shlex
    import time
    from pathlib import Path as _Path

    from psgrad.experiments.compare import DEFAULT_MODES, CompareConfig, parse_modes, run_compare

    _check_task(ns.task)
    out = _Path(ns.out) if ns.out else _Path("runs") / time.strftime("compare-%Y%m%d-%H%M%S")
    cfg = CompareConfig(
        out_dir=out,
        modes=parse_modes(ns.modes),
        task=ns.task,
        num_servers=ns.num_servers,
        num_workers=ns.num_workers,
        steps=ns.steps,
        batch_size=ns.batch_size,
        optimizer=ns.optimizer,
        lr=ns.lr,
        momentum=ns.momentum,
        weight_decay=ns.weight_decay,
        wire_dtype=ns.wire_dtype,
        target_accuracy=ns.target_accuracy,
        repeats=ns.repeats,
        seed=ns.seed,
        stragglers=tuple(ns.straggler or ()),
        jitter_ms=ns.jitter_ms,
        eval_every=ns.eval_every,
        lease_s=ns.lease_s,
        omp_threads=ns.omp_threads or max(1, (os.cpu_count() or 1) // (ns.num_servers + ns.num_workers)),
    )
    runs = len(cfg.modes) * cfg.repeats
    defaults = (
        ns.modes == DEFAULT_MODES and ns.steps == COMPARE_STEPS and ns.repeats == COMPARE_REPEATS
        and ns.num_workers == 4 and ns.num_servers == 2
    )
    eta = " (about 2 minutes on a 2-core machine with these defaults)" if defaults else ""
    print(
        f"psgrad compare: {', '.join(m.label for m in cfg.modes)} x {cfg.repeats} repeat(s) = {runs} runs, "
        f"{cfg.num_servers} servers + {cfg.num_workers} workers each, {cfg.steps} steps of {cfg.task}, "
        f"target accuracy {cfg.target_accuracy}{eta}; writing to {out}",
        flush=True,
    )
    run_compare(cfg, " ".join(shlex.quote(a) for a in ["psgrad", *ns.raw_argv]))
    return 0


def cmd_status(ns: argparse.Namespace) -> int:
    _print_status(ns.servers, ns.timeout_s, ns.json)
    return 0


# --------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="psgrad",
        description="psgrad: sharded gRPC parameter servers and workers for data-parallel PyTorch training.",
    )
    parser.add_argument("--version", action="version", version=f"psgrad {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("server", help="run one parameter-server shard", description="Run one parameter-server shard until SIGTERM/SIGINT.")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    s.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one (default: 0)")
    s.add_argument("--port-file", help="also write the bound HOST:PORT to this file (atomically)")
    _add_server_policy_args(s)
    s.add_argument("--threads", type=int, default=32, help="RPC handler threads; raise above 2x workers (default: 32)")
    s.add_argument(
        "--push-buffers",
        type=_positive_int,
        default=1,
        help="gradient-sized receive buffers of an async/ssp shard; more concurrent pushes wait for "
        "one. Raise it when many workers on other hosts push at once and memory allows (default: 1)",
    )
    s.add_argument(
        "--stream-window-bytes",
        type=int,
        default=ServerConfig.stream_window_bytes,
        help="bytes gRPC receives ahead per stream: at most this much of a push the shard is slow to "
        "take waits in the server (pushes waiting for their turn send nothing). 0 = gRPC's automatic "
        "windows (tens of MB each), for links with a long round trip "
        f"(default: {ServerConfig.stream_window_bytes})",
    )
    s.add_argument(
        "--torch-threads",
        type=_positive_int,
        default=1,
        help="torch intra-op threads of this process. A shard streams and updates the gradient "
        "piece by piece, memory-bound work one thread does best (more threads are woken per piece "
        "and cost 15-30%% more server CPU per push on 2 vCPUs); raise it for Adam or momentum on "
        "large shards when the host has idle cores (default: 1)",
    )
    s.set_defaults(func=cmd_server)

    w = sub.add_parser("worker", help="run one training worker", description="Train one worker against running servers.")
    w.add_argument("--servers", type=_servers_arg, required=True, help="HOST:PORT[,HOST:PORT...]; shard i is the i-th, same order for every worker")
    _add_rank_args(w, "this worker's rank; rank 0 initializes the servers")
    _add_job_args(w)
    w.set_defaults(func=cmd_worker)

    ar = sub.add_parser(
        "allreduce",
        help="run one rank of the all-reduce baseline (no parameter server)",
        description="Train one rank of synchronous data-parallel SGD without parameter servers: the "
        "ranks average their gradients with torch.distributed all_reduce (gloo on CPU, nccl on CUDA) "
        "and each applies the same SGD step. Start one process per rank, all with the same --store "
        "and job options. The PS-only options --mode, --staleness, --staleness-lr, --wire-dtype, "
        "--connect-timeout-s and --rpc-timeout-s are accepted and ignored; --init-timeout-s bounds "
        "the rendezvous and every all_reduce.",
    )
    _add_rank_args(ar, "this process's rank, 0..N-1")
    ar.add_argument(
        "--store",
        required=True,
        help="rendezvous file (torch.distributed FileStore) on a file system every rank can see, "
        "the same path for all ranks; it must not exist (or be empty) when the job starts: a file "
        "left over from an earlier run can hang or break the rendezvous, so delete it between runs",
    )
    _add_job_args(ar)
    ar.set_defaults(func=cmd_allreduce)

    la = sub.add_parser("launch", help="start servers and workers on this machine", description="Start servers and workers as local subprocesses, prefix their output, stop them all at the end.")
    la.add_argument("--num-servers", type=_positive_int, default=2, help="parameter-server shards (default: 2)")
    la.add_argument("--num-workers", type=_positive_int, default=2, help="training workers (default: 2)")
    la.add_argument("--metrics-dir", help="write each worker's JSONL metrics into this directory")
    la.add_argument(
        "--straggler",
        type=_straggler_arg,
        action="append",
        metavar="RANK:FACTOR",
        help="make worker RANK take FACTOR times its measured compute time per step; repeatable",
    )
    la.add_argument(
        "--omp-threads",
        type=_positive_int,
        default=None,
        help="OpenMP/torch threads per process (default: $OMP_NUM_THREADS if set, else the CPU count "
        "divided among all processes); raise it for large models on a big machine",
    )
    _add_server_policy_args(la)
    _add_job_args(la)
    la.set_defaults(func=cmd_launch)

    co = sub.add_parser(
        "compare",
        help="compare how sync, async and ssp training converge (the main job)",
        description="Run each consistency mode on a fresh local cluster (servers + workers as subprocesses), "
        "repeat, and write summary.json, report.md, convergence.png, staleness.png and every run's raw metrics.",
    )
    co.add_argument("--task", default="digits", help="training task: digits, mnist1d or package.module:function (default: digits)")
    co.add_argument("--num-servers", type=_positive_int, default=2, help="shards per run (default: 2)")
    co.add_argument("--num-workers", type=_positive_int, default=4, help="workers per run (default: 4)")
    co.add_argument(
        "--modes",
        default="sync,async,ssp:2",
        help="comma-separated modes: sync, async, ssp:S, allreduce (the torch.distributed baseline) "
        "(default: sync,async,ssp:2)",
    )
    co.add_argument(
        "--straggler",
        type=_straggler_arg,
        action="append",
        metavar="RANK:FACTOR",
        help="make worker RANK take FACTOR times its measured compute time per step, e.g. 0:4; repeatable",
    )
    co.add_argument(
        "--jitter-ms",
        type=float,
        default=0.0,
        help="random extra delay of 0..MS ms per worker step, deterministic given the seed (default: 0)",
    )
    co.add_argument("--target-accuracy", type=float, default=0.9, help="accuracy whose time to reach is compared (default: 0.9)")
    co.add_argument("--steps", type=_positive_int, default=COMPARE_STEPS, help=f"steps per worker and run (default: {COMPARE_STEPS})")
    co.add_argument(
        "--repeats",
        type=_positive_int,
        default=COMPARE_REPEATS,
        help=f"runs per mode, each with its own seed; 2+ gives mean ± std and bands (default: {COMPARE_REPEATS})",
    )
    co.add_argument("--seed", type=int, default=0, help="seed of the first repeat; repeat k uses seed+k (default: 0)")
    co.add_argument("--out", help="output directory (default: runs/compare-DATE-TIME)")
    co.add_argument("--batch-size", type=_positive_int, default=32, help="examples per step per worker (default: 32)")
    co.add_argument("--lr", type=float, default=0.1, help="learning rate (default: 0.1)")
    co.add_argument(
        "--optimizer", default="sgd", choices=OPTIMIZER_NAMES,
        help="server-side update rule (adam/adamw with their default betas; not with allreduce) (default: sgd)",
    )
    co.add_argument("--momentum", type=float, default=0.0, help="SGD momentum (default: 0)")
    co.add_argument("--weight-decay", type=float, default=0.0, help="L2 weight decay (default: 0)")
    co.add_argument("--wire-dtype", default="float32", choices=WIRE_DTYPES, help="wire dtype (default: float32)")
    co.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (default: 0 = 20 times per run)")
    co.add_argument("--lease-s", type=float, default=10.0, help="server lease in seconds (default: 10)")
    co.add_argument(
        "--omp-threads",
        type=_positive_int,
        default=None,
        help="OpenMP/torch threads per process (default: the CPU count divided among a run's processes)",
    )
    co.set_defaults(func=cmd_compare)

    st = sub.add_parser("status", help="show shard versions, workers and staleness", description="Ask every server for its shard's state.")
    st.add_argument("--servers", type=_servers_arg, required=True, help="HOST:PORT[,HOST:PORT...]")
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")
    st.add_argument("--timeout-s", type=float, default=5.0, help="deadline per server (default: 5)")
    st.set_defaults(func=cmd_status)
    return parser


def _add_rank_args(p: argparse.ArgumentParser, rank_help: str) -> None:
    """Flags of one training process: `psgrad worker` and `psgrad allreduce`."""
    p.add_argument("--rank", type=int, default=0, help=f"{rank_help} (default: 0)")
    p.add_argument("--num-workers", type=_positive_int, default=1, help="workers in the job (default: 1)")
    p.add_argument("--metrics-out", help="write one JSON record per step to this JSONL file")
    p.add_argument(
        "--slowdown",
        type=float,
        default=1.0,
        help="make this worker a straggler: each step takes FACTOR times its measured compute "
        "time (default: 1, no delay)",
    )


def _add_server_policy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lease-s",
        type=float,
        default=10.0,
        help="a worker silent this long counts as expired; raise it if workers on a busy host get evicted (default: 10)",
    )
    p.add_argument(
        "--nonfinite",
        default="reject",
        choices=NONFINITE_POLICIES,
        help="what to do with a gradient holding NaN/Inf: reject (error to the worker, shard unchanged), "
        "skip (acknowledge, do not apply) or allow (default: reject)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    ns.raw_argv = list(argv) if argv is not None else sys.argv[1:]
    func: Callable[[argparse.Namespace], int] = ns.func
    try:
        return func(ns)
    except (ConfigError, TaskError) as exc:
        parser.print_usage(sys.stderr)
        print(f"psgrad {ns.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except PsgradError as exc:
        print(f"psgrad {ns.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"psgrad {ns.command}: interrupted", file=sys.stderr)
        return 130
