"""build_parser: the `psgrad` argument parser, one subparser per command, defaults read from the config dataclasses."""
from __future__ import annotations

import argparse
import re
from typing import Any, NoReturn, cast

from psgrad import __version__
from psgrad.cli.launch_ray import add_ray_args
from psgrad.cli.render import add_render_parsers
from psgrad.cli.run import add_run_parser
from psgrad.cli.compare import cmd_compare
from psgrad.cli.commands import cmd_allreduce, cmd_export, cmd_launch, cmd_server, cmd_status, cmd_worker
from psgrad.cli.flags import (
    BUILTIN_TASKS,
    add_checkpoint_args,
    add_data_dir_arg,
    add_drift_arg,
    add_job_args,
    add_rank_args,
    add_recipe_args,
    add_server_policy_args,
    add_step_time_arg,
    add_straggler_dist_arg,
    add_connection_args,
    lr_list_arg,
    flag,
    positive_int,
    servers_arg,
    step_port_arg,
    straggler_arg,
)
from psgrad.cli import helptext, logs
from psgrad.cli.security import (
    add_certs_parser,
    add_client_security_args,
    add_launch_security_args,
    add_server_security_args,
)
from psgrad.config import WIRE_DTYPES, ServerConfig
from psgrad.experiments.compare_config import DEFAULT_MODES, CompareConfig

C = CompareConfig  # the defaults of `psgrad compare`


def _add_server(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    s = sub.add_parser("server", help="run one parameter-server shard", description="Run one parameter-server shard until SIGTERM/SIGINT.")
    flag(s, "--host", ServerConfig.host, "address to bind")
    flag(s, "--port", ServerConfig.port, "port to bind; 0 picks a free one", type=int)
    flag(s, "--step-port", ServerConfig.step_port, "also take workers' step calls over TCP at this port of "
         "--host, offered at join to workers on other hosts (the same request and reply as gRPC's Step, without "
         "gRPC's per-call work; in TLS with --tls-cert/--tls-key, client certificates required with --tls-ca); "
         "0 picks a free one, a fixed one suits a firewall; off: none (workers call through gRPC). A job secret "
         "without TLS (this host only) offers none", type=step_port_arg, metavar="PORT|off")
    s.add_argument("--metrics-port", type=int, metavar="PORT", help="serve Prometheus metrics at http://--host:PORT/"
                   "metrics (pushes, pulls, bytes, RPC latency, refusals by reason, staleness, gate waits, live "
                   "workers, checkpoint age); 0 picks a free port (printed). Default: none. The gRPC health and "
                   "reflection services are always on")
    s.add_argument("--advertise-host", metavar="HOST", help="the host name or address other servers reach this "
                   "one at (a backup tells its primary where to send updates); default: --host, or with --host "
                   "0.0.0.0 this machine's address on the route to the primary")
    s.add_argument("--port-file", help="also write the bound HOST:PORT to this file (atomically)")
    add_server_policy_args(s)
    flag(s, "--threads", ServerConfig.threads, "RPC handler threads; raise above 2x workers", type=int)
    flag(s, "--push-buffers", ServerConfig.push_buffers, "gradient-sized receive buffers of an async/ssp shard; "
         "more concurrent pushes wait for one. Raise it when many workers on other hosts push at once and memory "
         "allows", type=positive_int)
    flag(s, "--stream-window-bytes", ServerConfig.stream_window_bytes, "bytes gRPC receives ahead per stream: at "
         "most this much of a push the shard is slow to take waits in the server (pushes waiting for their turn "
         "send nothing). 0 = gRPC's automatic windows (tens of MB each), for links with a long round trip", type=int)
    add_connection_args(s)
    flag(s, "--torch-threads", 1, "torch intra-op threads of this process. A shard streams and updates the "
         "gradient piece by piece, memory-bound work one thread does best (more threads are woken per piece and "
         "cost 15-30%% more server CPU per push on 2 vCPUs); raise it for Adam or momentum on large shards when "
         "the host has idle cores", type=positive_int)
    c = add_checkpoint_args(s, "checkpoints (a restarted server resumes the job from them)")
    c.add_argument("--checkpoint-dir", metavar="DIR", help="write this shard's checkpoints here, and restore the "
                   "newest readable one at start (the shard then serves the job at once; a damaged one is skipped "
                   "with a warning naming it); one directory per shard (default: no checkpoints)")
    r = s.add_argument_group("hot standby (a backup server per shard)")
    r.add_argument("--replica-of", metavar="HOST:PORT", help="run as the backup of the shard whose primary is at "
                   "HOST:PORT: take its state, apply each of its updates (the primary acknowledges a push only once "
                   "the backup has it), and take over when workers fail over to it (give workers --servers "
                   "PRIMARY|BACKUP). A restarted server rejoins this way as the backup of the one now serving "
                   "(default: none, a primary)")
    flag(r, "--replica-timeout-s", ServerConfig.replica_timeout_s, "how long a primary waits for its backup to "
         "acknowledge an update before it drops the backup and goes on alone", type=float)
    add_server_security_args(s)
    s.set_defaults(func=cmd_server)


def _add_workers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    w = sub.add_parser("worker", help="run one training worker", description="Train one worker against running servers.")
    w.add_argument("--servers", type=servers_arg, required=True, help="SHARD[,SHARD...]; shard i is the i-th, same "
                   "order for every worker. A SHARD is HOST:PORT, or PRIMARY|BACKUP for a shard with a hot-standby "
                   "backup (quote it in a shell): calls fail over to the backup when the primary stops answering")
    add_rank_args(w, "this worker's rank; rank 0 initializes the servers")
    add_job_args(w)
    add_client_security_args(w, "this worker (rank R)")
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
    add_rank_args(ar, "this process's rank, 0..N-1")
    ar.add_argument(
        "--store",
        required=True,
        help="rendezvous file (torch.distributed FileStore) on a file system every rank can see, "
        "the same path for all ranks; it must not exist (or be empty) when the job starts: a file "
        "left over from an earlier run can hang or break the rendezvous, so delete it between runs",
    )
    add_job_args(ar)
    ar.set_defaults(func=cmd_allreduce)


def _add_launch(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    la = sub.add_parser("launch", help="start servers and workers on this machine or a Ray cluster",
                        description="Start servers and workers as local subprocesses (or, with --backend ray, as "
                        "actors on a Ray cluster), prefix their output, stop them all at the end.")
    # Not JobSpec's 1 shard and 1 worker (the least a job can have): a local launch shows a sharded,
    # data-parallel job by default.
    flag(la, "--num-servers", 2, "parameter-server shards", type=positive_int)
    flag(la, "--num-workers", 2, "training workers", type=positive_int)
    flag(la, "--replicas", 0, "hot-standby backups per shard (0 or 1): each shard's backup is started with "
         "--replica-of its primary, and workers get --servers PRIMARY|BACKUP", type=int, choices=(0, 1))
    la.add_argument("--metrics-dir", help="write each worker's JSONL metrics into this directory")
    la.add_argument(
        "--straggler",
        type=straggler_arg,
        action="append",
        metavar="RANK:FACTOR",
        help="make worker RANK take FACTOR times its measured compute time per step; repeatable",
    )
    la.add_argument(
        "--omp-threads",
        type=positive_int,
        default=None,
        help="OpenMP/torch threads per process (default: $OMP_NUM_THREADS if set, else the CPU count "
        "divided among all processes); raise it for large models on a big machine",
    )
    add_ray_args(la)
    add_server_policy_args(la)
    add_launch_security_args(la, ray=True)
    c = add_checkpoint_args(la, "checkpoints and resume (a whole job, stopped, starts again from them)")
    c.add_argument("--checkpoint-dir", metavar="DIR", help="checkpoint every server into DIR/shardI (a directory "
                   "that holds no job yet) and record this command in DIR/launch.json, so that --resume DIR can "
                   "start the job again after every process stopped (default: no checkpoints)")
    c.add_argument("--resume", metavar="DIR", help="start the job checkpointed in DIR again, with the flags it was "
                   "launched with (flags given here are added after them, e.g. a larger --steps): the servers "
                   "restore their shards and the workers continue from their checkpointed clocks")
    add_job_args(la)
    la.set_defaults(func=cmd_launch)


def _add_compare(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    co = sub.add_parser(
        "compare",
        help="compare how sync, async and ssp training converge (the main job)",
        description="Run each consistency mode on a fresh local cluster (servers + workers as subprocesses), "
        "repeat, and write summary.json, report.md, convergence.png, staleness.png and every run's raw metrics.",
    )
    flag(co, "--task", C.task, f"training task: {BUILTIN_TASKS} or package.module:function; its recipe gives the "
         "flags marked 'recipe' (docs/guide/tasks.md)")
    add_data_dir_arg(co)
    add_drift_arg(co)
    flag(co, "--num-servers", C.num_servers, "shards per run", type=positive_int)
    flag(co, "--num-workers", C.num_workers, "workers per run", type=positive_int)
    flag(co, "--modes", DEFAULT_MODES, "comma-separated modes, each MODE[:OPTION...]: sync, async, ssp:S, "
         "ssp:auto, allreduce (the torch.distributed baseline), and variants: sync:backup=B, async:slr "
         "(staleness-aware lr), async:dc=LAMBDA / async:dca=LAMBDA (DC-ASGD, adaptive), ssp:auto:max=S, "
         "sync:tables=async (hybrid), MODE:lr=LR, MODE:compress=NAME[:noef] (docs/guide/compare.md)")
    co.add_argument(
        "--straggler",
        type=straggler_arg,
        action="append",
        metavar="RANK:FACTOR",
        help="make worker RANK take FACTOR times its measured compute time per step, e.g. 0:4; repeatable",
    )
    flag(co, "--jitter-ms", C.jitter_ms, "random extra delay of 0..MS ms per worker step, deterministic given the "
         "seed", type=float)
    add_straggler_dist_arg(co)
    flag(co, "--slow-node-rotate", C.slow_node_rotate, "the one --straggler's role moves to the next rank every "
         "STEPS steps (a slow node that changes over time, e.g. a busy host); 0 keeps it on its rank", type=int)
    g = co.add_argument_group("fair comparison")
    g.add_argument("--lr-grid", type=lr_list_arg, metavar="LR,LR,...", help="first run each mode at each of these "
                   "learning rates (--grid-steps, one seed), then compare every mode at its own best (see "
                   "--grid-by); give it whenever modes are compared at all, since one lr favours some of them. "
                   "Default: every mode at --lr")
    flag(g, "--grid-steps", C.grid_steps, "steps per worker of each grid run; raise it when short runs rank the lrs "
         "differently from full ones", " = half of --steps", type=int)
    flag(g, "--grid-by", C.grid_by, "how the grid picks: time = soonest to --target (runs that miss it: by final "
         "metric), final = best final metric (for comparing final quality)", choices=("time", "final"))
    flag(g, "--sync-lr-scaling", C.sync_lr_scaling, "linear: modes that average k gradients per update (sync: "
         "the workers, less backups; allreduce) train at k x lr (Goyal et al.), since they apply one update "
         "where async applies k", choices=("none", "linear"))
    flag(g, "--save-weights", C.save_weights, "worker 0 of every run writes its final model to "
         "runs/RUN/model.pt (to compare runs' weights)", action="store_true")
    g.add_argument("--preset", choices=("claims",), help="claims: run the experiments that check published claims "
                   "(SSP and backup workers under a straggler, staleness-aware lr and DC-ASGD at 8 workers, sync "
                   "== allreduce) on the mnist CNN with emulated step time, and write a claims table (docs/guide/compare.md); "
                   "the other flags but --out, --seed, --quick and --data-dir are ignored")
    g.add_argument("--quick", action="store_true", help="with --preset claims: tiny settings (a minute), to check "
                   "that it runs, not what it finds")
    co.add_argument("--target", "--target-accuracy", dest="target", type=float, help="the value of the task's "
                    "metric (accuracy, or bits per byte for charlm) whose time to reach is compared (default: "
                    "recipe; 0.9 accuracy for digits)")
    co.add_argument("--steps", type=positive_int, help="steps per worker and run (default: recipe; 400 for digits)")
    flag(co, "--repeats", C.repeats, "runs per mode, each with its own seed; 2+ gives mean ± std and bands",
         type=positive_int)
    flag(co, "--seed", C.seed, "seed of the first repeat; repeat k uses seed+k", type=int)
    co.add_argument("--out", help="output directory (default: runs/compare-DATE-TIME)")
    add_recipe_args(co)
    add_step_time_arg(co)
    flag(co, "--wire-dtype", C.wire_dtype, "wire dtype", choices=WIRE_DTYPES)
    flag(co, "--eval-every", C.eval_every, "evaluate every N steps", " = 20 times per run", type=int)
    flag(co, "--lease-s", C.lease_s, "server lease in seconds", type=float)
    co.add_argument(
        "--omp-threads",
        type=positive_int,
        default=None,  # not CompareConfig's 1: a share of this machine's cores, computed when the run starts
        help="OpenMP/torch threads per process (default: the CPU count divided among a run's processes)",
    )
    co.add_argument("--tensorboard", metavar="DIR", help="also write TensorBoard scalars of every run: DIR/RUN/workerR "
                    "(RUN as under OUT/runs; needs: pip install 'psgrad[tensorboard]')")
    add_launch_security_args(co)
    co.set_defaults(func=cmd_compare)


# The settings' Python names a message may give bare, one word (the others are snake_case): the
# optimizer's, which `psgrad worker` takes as flags of the same names.
_ONE_WORD_FIELDS = frozenset({"lr", "momentum", "eps", "beta1", "beta2", "alpha", "rho", "nesterov", "centered"})
# A Python name in a message: not part of a flag, path, attribute or keyword argument (x.y, --x-y, x=).
_NAME = re.compile(r"(?<![\w./-])([a-z][a-z0-9]*(?:_[a-z0-9]+)*)(?![\w/(=-])")


def flags_named(message: str, parser: argparse.ArgumentParser, command: str) -> str:
    """A message shown to a user of `psgrad COMMAND`, with each setting named by its flag instead of
    the config field behind it ('lr_decay must be ...' -> '--lr-decay must be ...'): the checks live
    in the config dataclasses (JobSpec, ClientConfig, ...), which the Python API shares and which
    name their fields; the CLI's flags are those fields' dests, so the command's parser maps them,
    in this one place. A field already followed by its flag in parentheses gives the flag once.
    parser: build_parser()'s."""
    sub = getattr(parser, "commands", {}).get(command)
    if sub is None:
        return message
    flags: dict[str, str] = {}
    for action in sub._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if longs and action.dest not in flags and ("_" in action.dest or action.dest in _ONE_WORD_FIELDS):
            flags[action.dest] = next((o for o in longs if not o.startswith("--no-")), longs[0])

    def flag(match: re.Match[str]) -> str:
        name = match.group(1)
        return flags.get(name, name)

    for name, option in flags.items():  # "dc_asgd (--dc-asgd LAMBDA)": the flag once
        message = re.sub(rf"(?<![\w./-]){name} \({re.escape(option)}(?: [A-Z]+)?\)", option, message)
    return _NAME.sub(flag, message)


def one_line_usage(command: str) -> str:
    """A command's usage in one line, before its error (its full usage runs to dozens of lines)."""
    return f"usage: psgrad {command} [flags] (psgrad {command} --help: every flag)"


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose commands' usage errors read as psgrad's own: the command's one-line
    usage, then `psgrad COMMAND: error: ...` (exit 2), for an unknown flag too (argparse blames the
    top-level parser for those)."""

    commands: dict[str, argparse.ArgumentParser] = {}

    def error(self, message: str) -> NoReturn:
        if self.prog == "psgrad":
            super().error(message)
        command = self.prog.removeprefix("psgrad ")
        self.exit(2, f"{one_line_usage(command)}\n{self.prog}: error: {message}\n")

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        ns, extra = self.parse_known_args(args, namespace)
        if extra:
            self.commands.get(getattr(ns, "command", ""), self).error(f"unrecognized arguments: {' '.join(extra)}")
        return ns


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="psgrad",
        description="psgrad: sharded gRPC parameter servers and workers for data-parallel PyTorch training.",
    )
    parser.add_argument("--version", action="version", version=f"psgrad {__version__}")
    sub = cast("argparse._SubParsersAction[argparse.ArgumentParser]",  # (its parsers are Parsers)
               parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    parser.commands = sub.choices
    _add_server(sub)
    _add_workers(sub)
    _add_launch(sub)
    add_run_parser(sub)
    add_render_parsers(sub)
    _add_compare(sub)

    st = sub.add_parser("status", help="show shard versions, workers and staleness", description="Ask every server for its shard's state.")
    st.add_argument("--servers", type=servers_arg, required=True, help="SHARD[,SHARD...] (a SHARD is HOST:PORT or "
                    "PRIMARY|BACKUP: both servers are shown, with their role and epoch)")
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")
    st.add_argument("--watch", action="store_true", help="a live view, refreshed every --interval-s until Ctrl-C: "
                    "versions, pushes/s and pulls/s, live workers, their clocks and the slowest one's lag, "
                    "staleness p50/p99, pulls waiting at the gate")
    flag(st, "--interval-s", 1.0, "--watch: seconds between refreshes", type=float)
    st.add_argument("--count", type=positive_int, help="--watch: stop after this many refreshes (default: until "
                    "Ctrl-C)")
    flag(st, "--timeout-s", 5.0, "deadline per server", type=float)
    add_client_security_args(st, "the admin (or a worker)")
    st.set_defaults(func=cmd_status)

    ex = sub.add_parser("export", help="save a running job's current weights as a state_dict",
                        description="Read every shard's current weights (a snapshot; joins nothing, needs no job "
                        "flags) and save them as a state_dict keyed by parameter name: model.load_state_dict("
                        "torch.load(PATH)). In sync mode every shard is read at the same iteration. A sparse (embedding) table "
                        "is written as its rows updated at least once (NAME.ids, NAME.rows) and how the servers make "
                        "the others (NAME.init: rows, dim, seed; NAME.init_std), or with --materialize as the whole "
                        "table (NAME.weight, what torch.nn.Embedding loads).")
    ex.add_argument("--servers", type=servers_arg, required=True, help="SHARD[,SHARD...] in shard order (a SHARD is "
                    "HOST:PORT or PRIMARY|BACKUP)")
    ex.add_argument("--out", required=True, metavar="PATH", help="file to write (torch.save), replaced atomically")
    flag(ex, "--timeout-s", 30.0, "deadline per server, and in sync mode how long the shards may take to agree on "
         "an iteration", type=float)
    ex.add_argument("--materialize", action="store_true", help="write each sparse table whole, as NAME.weight "
                    "[num_embeddings, dim] (untouched rows made from their seed): its full size in memory and on disk")
    add_client_security_args(ex, "the admin")
    ex.set_defaults(func=cmd_export)
    add_certs_parser(sub)
    for command in sub.choices.values():
        lg = command.add_argument_group("logging")
        flag(lg, "--log-level", "info", "the least severe operational message shown (progress and notes are info, "
             "problems warning or error)", choices=logs.LEVELS)
        flag(lg, "--log-format", "text", "text: readable lines; json: one JSON object per line (time, level, logger, "
             "message, pid) for a log collector", choices=logs.FORMATS)
    helptext.decorate(parser, sub.choices)
    return parser
