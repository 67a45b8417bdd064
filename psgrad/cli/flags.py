"""The flag groups several subcommands share, their argparse types, and parsed flags -> config dataclasses."""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psgrad.cli import security
from psgrad.config import (
    LR_SCHEDULES,
    MODES,
    NONFINITE_POLICIES,
    OPTIMIZER_NAMES,
    READ_LIMIT_MIN_MB,
    REFUSED_GRACE_S,
    WIRE_DTYPES,
    ClientConfig,
    JobSpec,
    ServerConfig,
    WorkerConfig,
)
from psgrad.core.addresses import parse_servers
from psgrad.core.compression import BIASED, NONE, feeds_back
from psgrad.core.stragglers import StragglerModel, parse_dist, parse_rotation
from psgrad.core.modes import AUTO_STALENESS_MAX, DEFAULT_SSP_STALENESS, find_mode
from psgrad.errors import ConfigError
from psgrad.core.optimizer_settings import DEFAULT_EPS, DEFAULT_LR, DEFAULT_WEIGHT_DECAY, ROW_FORMS
from psgrad.tasks.registry import BUILT_IN, recipe_for

if TYPE_CHECKING:
    from psgrad.tasks.recipes import Recipe


def servers_arg(text: str) -> tuple[str, ...]:
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


def straggler_arg(text: str) -> tuple[int, float]:
    try:
        return parse_straggler(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def dist_arg(text: str) -> tuple[str, float]:
    try:
        return parse_dist(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def lr_list_arg(text: str) -> tuple[float, ...]:
    try:
        lrs = tuple(float(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LR,LR,... (numbers > 0), got {text!r}") from None
    if not all(lr > 0 and lr != float("inf") for lr in lrs) or len(set(lrs)) != len(lrs):
        raise argparse.ArgumentTypeError(f"expected distinct finite learning rates > 0, got {text!r}")
    return lrs


def add_straggler_dist_arg(p: argparse._ActionsContainer) -> None:
    p.add_argument("--straggler-dist", type=dist_arg, default=("none", 0.0), metavar="lognormal:SIGMA|pareto:ALPHA",
                   help="random slow steps with a heavy tail on every worker: each step's time (--step-time-ms, or "
                   "its compute) is multiplied by a draw >= 1, seeded per (seed, rank, step): max(1, exp(SIGMA*Z)) "
                   "or Pareto(ALPHA) (heavier as ALPHA falls), capped at 100x. Use it to test a mode against "
                   "occasional slow steps rather than one slow node (default: none)")


def straggler_model(ns: argparse.Namespace) -> StragglerModel:
    """The worker's StragglerModel of --straggler-dist and --slow-node-rotate STEPS:FIRST (absent: none)."""
    dist, shape = getattr(ns, "straggler_dist", None) or ("none", 0.0)
    rotate = getattr(ns, "slow_node_rotate", None)
    steps, first = parse_rotation(rotate) if rotate else (0, 0)
    return StragglerModel(dist=dist, shape=shape, rotate_steps=steps, rotate_first=first)


def int_at_least(text: str, low: int, alternative: str = "") -> int:
    """An integer >= low (argparse type); `alternative` names what else the flag takes."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer{alternative}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}{alternative}, got {value}")
    return value


def positive_int(text: str) -> int:
    return int_at_least(text, 1)


def flag(p: argparse._ActionsContainer, name: str, default: Any, help: str, note: str = "", **kw: Any) -> None:
    """add_argument with its default shown once, from the value: help + " (default: VALUE[note])"."""
    shown = default
    if isinstance(default, bool):
        shown = "on" if default else "off"
    elif isinstance(default, float):
        shown = format(default, "g")
    p.add_argument(name, default=default, help=f"{help} (default: {shown}{note})", **kw)


BUILTIN_TASKS = ", ".join(BUILT_IN)  # (the registry imports no torch)
# The flags that default to the task's recipe (psgrad.tasks.recipes.Recipe), and the generic values
# an optimizer other than the recipe's starts from.
RECIPE_FLAGS = ("optimizer", "lr", "momentum", "weight_decay", "batch_size", "steps", "lr_schedule", "warmup_steps")
OPTIMIZER_LR = DEFAULT_LR  # torch's default lr of each optimizer (optimizer_settings.DECLS)


# --------------------------------------------------------------------------- flag groups
def add_data_dir_arg(p: argparse._ActionsContainer) -> None:
    p.add_argument("--data-dir", metavar="DIR", help="where a task that reads files finds them: fashion-mnist's "
                   "IDX files (DIR, DIR/raw or DIR/FashionMNIST/raw; default /usr/share/datasets/fashion-mnist, "
                   "from Debian's dataset-fashion-mnist)")


def add_drift_arg(p: argparse._ActionsContainer) -> None:
    p.add_argument("--drift", metavar="RATE", type=float, default=None,
                   help="task ctr only: a drifting click stream read in time order (item popularity and "
                   "preferences move, new ids keep arriving; test AUC on the most recent window); RATE 1: the hot "
                   "ids move 2,000 ranks and preferences a quarter turn per million examples; sets "
                   "PSGRAD_CTR_DRIFT for this process and the ones it starts (default: none)")


def apply_drift(ns: argparse.Namespace) -> None:
    """--drift RATE: checked, and given to the ctr task (and every process this one starts) as
    PSGRAD_CTR_DRIFT.

    Raises:
        ConfigError: not task ctr, or not a number >= 0.
    """
    rate = getattr(ns, "drift", None)
    if rate is None:
        return
    if getattr(ns, "task", None) != "ctr":
        raise ConfigError(f"--drift is for --task ctr (a drifting click stream), not task {getattr(ns, 'task', None)!r}")
    if not 0 <= rate < float("inf"):
        raise ConfigError(f"--drift must be a number >= 0 (0: no drift), got {rate!r}")
    os.environ["PSGRAD_CTR_DRIFT"] = repr(rate)


def add_step_time_arg(p: argparse._ActionsContainer) -> None:
    flag(p, "--step-time-ms", WorkerConfig.step_time_ms, "emulate an accelerator: every step takes at least MS "
         "milliseconds (compute, then wait the rest; a straggler's factor multiplies it), so a small machine can "
         "stand in for a cluster whose step is MS long. Emulation only: no real device work is done", ", off",
         type=float)


def add_recipe_args(g: argparse._ActionsContainer) -> None:
    """The training settings that default to the task's recipe (None until apply_recipe)."""
    g.add_argument("--batch-size", type=positive_int, help="examples per step per worker (default: recipe; "
                   f"{WorkerConfig.batch_size} for digits)")
    g.add_argument("--optimizer", choices=OPTIMIZER_NAMES, help="update rule the servers apply, each like its "
                   "torch.optim namesake: sgd (optionally with --momentum, --nesterov), adam, adamw (Adam with "
                   "decoupled weight decay), adagrad, rmsprop or adadelta; all but plain sgd keep 1-3 extra floats "
                   "per parameter on the servers (default: recipe; sgd for digits)")
    g.add_argument("--lr", type=float, help="learning rate (the servers apply it; see --lr-schedule) (default: "
                   f"recipe; {JobSpec.lr} for digits; with an optimizer other than the recipe's, 0.1 for sgd, "
                   "and torch's defaults for the others: 1e-3 for adam/adamw, 1e-2 for adagrad/rmsprop, 1.0 for adadelta)")
    g.add_argument("--momentum", type=float, help="sgd and rmsprop: momentum on the servers; with many async "
                   "workers, effective momentum grows with staleness: lower it if training oscillates "
                   "(default: recipe; 0)")
    g.add_argument("--weight-decay", type=float, help="weight decay: L2 added to the gradient, except adamw's, "
                   "which is decoupled (default: recipe; with an optimizer other than the recipe's, torch's: "
                   f"{DEFAULT_WEIGHT_DECAY['adamw']:g} for adamw, 0 for the others)")
    g.add_argument("--lr-schedule", choices=LR_SCHEDULES, help="the lr each step pushes: --lr times a schedule "
                   "of the step (a torch LambdaLR on the worker's optimizer): constant, or cosine/linear decay to 0 "
                   "at --steps, after --warmup-steps of linear warmup (default: recipe; constant for digits)")
    g.add_argument("--warmup-steps", type=int, help="steps of linear lr warmup; raise it if early steps diverge "
                   "(default: recipe; 0 for digits)")


def apply_recipe(ns: argparse.Namespace, steps_key: str = "steps") -> Recipe:
    """Fill the recipe flags left out (None) from the task's recipe; returns the recipe. An
    --optimizer other than the recipe's takes torch's lr and weight decay for it (0.01 for adamw, else
    0; sgd's lr is 0.1) and no momentum."""
    recipe = recipe_for(ns.task)  # (a built-in's module is not imported)
    own = ns.optimizer is None or ns.optimizer == recipe.optimizer
    generic = {"lr": OPTIMIZER_LR.get(ns.optimizer or "", JobSpec.lr), "momentum": 0.0,
               "weight_decay": DEFAULT_WEIGHT_DECAY.get(ns.optimizer or "", JobSpec.weight_decay)}
    for name in RECIPE_FLAGS:
        if getattr(ns, name, 0) is None:
            value = getattr(recipe, steps_key if name == "steps" else name)
            setattr(ns, name, value if own or name not in generic else generic[name])
    return recipe


def add_job_args(
    p: argparse.ArgumentParser, connect_timeout_s: float = ClientConfig.connect_timeout_s,
    wait_for_servers: bool = ClientConfig.wait_for_servers,
) -> None:
    """The job (JobSpec) and worker (WorkerConfig, ClientConfig) flags of worker, allreduce, launch and run
    (whose workers may start long before their servers: it passes a longer connect_timeout_s, and
    waits through refused connections)."""
    g = p.add_argument_group("job (every worker must pass the same values; flags marked 'recipe' default to the "
                             "task's recipe, see docs/guide/tasks.md)")
    flag(g, "--task", WorkerConfig.task, "training task: a built-in name (" + BUILTIN_TASKS + ") or your own "
         "as package.module:function returning a psgrad.Task; the current directory is searched")
    add_data_dir_arg(g)
    add_drift_arg(g)
    flag(g, "--mode", JobSpec.mode, "consistency: async (never wait; fastest, stalest), ssp (bounded staleness, "
         "see --staleness) or sync (BSP: one averaged update per iteration, staleness 0)", choices=MODES)
    g.add_argument(
        "--staleness",
        type=staleness_arg,
        default=None,  # not JobSpec.staleness: the default depends on --mode (core.modes.Mode.default_staleness)
        help="ssp only: how many iterations a worker may run ahead of the slowest live worker; "
        "larger is faster with stragglers, smaller is fresher; 'auto': each server adapts it at run time "
        "within [1, --staleness-max] from how long pulls wait for the slowest worker (docs/design/architecture.md, 'Adaptive staleness bound') "
        f"(default: {DEFAULT_SSP_STALENESS} for ssp)",
    )
    flag(g, "--staleness-max", AUTO_STALENESS_MAX, "with --staleness auto: the largest bound the servers may "
         "adopt; lower it to cap how stale gradients may get under a persistent straggler", type=positive_int)
    g.add_argument("--tables-mode", choices=MODES, default=None, help="the embedding tables' consistency, where it "
                   "differs from --mode: with --mode sync, 'async' applies each worker's row gradients as they "
                   "arrive while the dense part stays one averaged update per iteration (hybrid, as Persia "
                   "trains; docs/guide/embeddings.md) (default: --mode's)")
    flag(g, "--backup-workers", JobSpec.backup_workers, "sync only: an iteration applies the mean of the first "
         "N-B gradients of its N live workers and drops the rest as late (Chen et al. 2016); try 1 when one "
         "slow worker holds every iteration back; must be < --num-workers", type=int)
    g.add_argument(
        "--staleness-lr",
        action="store_true",
        help="scale each gradient's step by 1/max(1, staleness) (Zhang et al., IJCAI 2016); "
        "try it when async training with many workers diverges",
    )
    flag(g, "--dc-asgd", JobSpec.dc_asgd, "async/ssp: delay-compensated ASGD (Zheng et al., ICML 2017) with this "
         "LAMBDA: the servers apply g + LAMBDA*g*g*(w_now - w_pulled) for a gradient g computed on the weights "
         "w_pulled; try e.g. 0.04 when stale gradients hurt; costs the servers one copy of the weights "
         "per worker", ", off", type=float, metavar="LAMBDA")
    flag(g, "--dc-asgd-adaptive", JobSpec.dc_asgd_adaptive, "with --dc-asgd LAMBDA0: DC-ASGD-a, whose lambda is "
         "LAMBDA0/sqrt(mean square of the gradients) per element (e.g. LAMBDA0 2); try it when one "
         "lambda does not suit every layer's gradient scale", action="store_true")
    g.add_argument("--steps", type=int, help="training iterations per worker: a worker trains until its clock "
                   "reaches this, so a resumed worker, or one joining a running sync/ssp job, trains the rest "
                   f"(default: recipe; {WorkerConfig.steps} for digits)")
    add_recipe_args(g)
    flag(g, "--nesterov", JobSpec.nesterov, "sgd with --momentum: Nesterov's momentum (a look-ahead step) instead "
         "of heavy ball; try it when heavy-ball momentum overshoots", action="store_true")
    flag(g, "--beta1", JobSpec.beta1, "adam/adamw: decay of the gradient average (Adam's momentum); like "
         "--momentum, lower it (e.g. 0.5) if training with many async workers oscillates", type=float)
    flag(g, "--beta2", JobSpec.beta2, "adam/adamw: decay of the squared-gradient average; lower it (e.g. 0.98) "
         "if training is unstable early on", type=float)
    g.add_argument("--eps", type=float, default=None, help="adam, adamw, adagrad, rmsprop, adadelta: term added "
                   "to the denominator; raise it (e.g. 1e-6) if parameters whose gradients are almost zero still "
                   "take lr-sized steps (default: torch's for the optimizer: "
                   + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_EPS.items()) + ")")
    flag(g, "--lr-decay", JobSpec.lr_decay, "adagrad: step t uses lr / (1 + (t-1) * LR_DECAY); raise it to "
         "anneal the learning rate as the servers apply updates", type=float)
    flag(g, "--initial-accumulator-value", JobSpec.initial_accumulator_value, "adagrad: where the sum of squared "
         "gradients starts; raise it (e.g. 0.1) if the first steps are too large", type=float)
    flag(g, "--alpha", JobSpec.alpha, "rmsprop: decay of the squared-gradient average; lower it (e.g. 0.9) to "
         "follow changing gradient scales faster", type=float)
    flag(g, "--centered", JobSpec.centered, "rmsprop: normalize by the gradient's variance rather than its "
         "second moment (more stable on some problems, one more float per parameter)", action="store_true")
    flag(g, "--rho", JobSpec.rho, "adadelta: decay of its running averages; lower it (e.g. 0.8) to adapt "
         "faster", type=float)
    flag(g, "--wire-dtype", JobSpec.wire_dtype, "dtype of pushed gradients and pulled weights on the wire; "
         "bfloat16/float16 halve the bytes, servers keep float32 master weights", choices=WIRE_DTYPES)
    flag(g, "--compress", JobSpec.compress, "compress pushed gradients: topk:RATIO or randomk:RATIO (that fraction "
         "of the values, with their indices), sign (1 bit a value and a scale per 1,024), int8 (8 bits, stochastic "
         "rounding, unbiased); e.g. topk:0.01 sends 2%% of the bytes; pulls stay in --wire-dtype (see "
         "--compress-pull); shards on the worker's host get plain gradients unless --compress-same-host",
         metavar="NAME")
    g.add_argument("--no-error-feedback", dest="error_feedback", action="store_false", default=JobSpec.error_feedback,
                   help="with --compress topk/randomk/sign: drop what a push leaves out instead of adding it to the "
                   "worker's next gradient (error feedback is on by default for these biased codecs; int8 never "
                   "needs it); for comparisons")
    flag(g, "--seed", WorkerConfig.seed, "seed for model init and batch order", type=int)
    w = p.add_argument_group("worker")
    flag(w, "--device", WorkerConfig.device, "auto (cuda if available: cuda:(--local-rank mod GPUs)), cpu, "
         "cuda or cuda:N")
    flag(w, "--local-rank", WorkerConfig.local_rank, "this worker's index among the processes on its host, so "
         "that --device auto gives each worker of a multi-GPU host its own GPU; psgrad run takes it from "
         "LOCAL_RANK (torchrun) or SLURM_LOCALID, psgrad launch gives worker r r", " = cuda:0 under auto", type=int)
    flag(w, "--bind-cores", WorkerConfig.bind_cores, "bind this worker to its share of its host's cores before its "
         "threads start (psgrad.bind_cores: the cores split into --local-workers equal runs, run --local-rank its own), "
         "and run no more torch threads than those cores; a server on the host then serves this worker's calls on "
         "those cores (--follow-worker-cores). For several workers on one host, so that two never queue on one core "
         "while another idles. psgrad launch gives worker r rank r of --num-workers; psgrad run takes both from "
         "torchrun or SLURM; a SLURM task that SLURM bound (--cpu-bind) keeps its cores", action="store_true")
    flag(w, "--local-workers", WorkerConfig.local_workers, "how many workers share this worker's host, for "
         "--bind-cores; psgrad run takes it from LOCAL_WORLD_SIZE (torchrun) or SLURM_NTASKS_PER_NODE, psgrad "
         "launch gives --num-workers", type=positive_int)
    flag(w, "--jitter-ms", WorkerConfig.jitter_ms, "add a random delay of 0..MS milliseconds per step, "
         "deterministic given --seed", type=float)
    add_step_time_arg(w)
    flag(w, "--overlap", WorkerConfig.overlap, "push/pull in the background while the next step computes "
         "(async and ssp only); each gradient is then computed on weights one iteration older", action="store_true")
    flag(w, "--row-cache-rows", WorkerConfig.row_cache_rows, "keep up to N hot rows of each psgrad embedding table in "
         "the worker and serve them from there for --row-cache-staleness steps (async and ssp only; 0: every "
         "forward pulls its rows)", type=int)
    flag(w, "--row-cache-staleness", WorkerConfig.row_cache_staleness, "steps a cached row is served before it is "
         "pulled again (it may miss that many steps of updates)", type=int)
    w.add_argument("--table-optimizer", choices=ROW_FORMS, default=WorkerConfig.table_optimizer, help="an optimizer "
                   "of their own for the rows of the task's psgrad embedding tables, at torch's defaults: e.g. "
                   "adagrad rows with --optimizer adamw, which has no row form (docs/guide/embeddings.md) (default: "
                   "--optimizer's, with its settings)")
    w.add_argument("--table-lr", type=float, default=WorkerConfig.table_lr, metavar="LR", help="the tables' "
                   "learning rate, kept as a multiple of --lr so that --lr-schedule scales both (default: --lr, or "
                   "torch's default lr of --table-optimizer)")
    flag(w, "--eval-every", WorkerConfig.eval_every, "evaluate every N steps", " = 10 times per run", type=int)
    flag(w, "--log-every", WorkerConfig.log_every, "print progress every N steps", " = 10 times", type=int)
    flag(w, "--connect-timeout-s", connect_timeout_s, "how long to wait for each server to answer the first call "
         "(a cluster may start the servers after the workers)", type=float)
    flag(w, "--wait-for-servers", wait_for_servers, "at the first call, wait up to --connect-timeout-s for a "
         "server that refuses the connection (one that starts later); --no-wait-for-servers reports a refused "
         f"connection after {REFUSED_GRACE_S:g} s", action=argparse.BooleanOptionalAction)
    flag(w, "--rpc-timeout-s", ClientConfig.rpc_timeout_s, "deadline of each pull/push; raise it for very large "
         "models on slow links", type=float)
    flag(w, "--init-timeout-s", ClientConfig.init_timeout_s, "how long non-chief workers wait for rank 0 to "
         "initialize the servers", type=float)
    flag(w, "--reconnect-timeout-s", ClientConfig.reconnect_timeout_s, "how long to keep reconnecting to a "
         "server that stopped answering (one restarting from its --checkpoint-dir) before exiting with an error "
         "naming it; raise it if servers take longer to come back, 0 fails at once", type=float)
    w.add_argument("--metrics-port", type=int, metavar="PORT", help="serve this worker's Prometheus metrics "
                   "(steps, step-phase times, loss, lr, staleness, evaluations) at http://--metrics-host:PORT+RANK/"
                   "metrics (psgrad launch: server I at PORT+NUM_WORKERS+I, backups after them); 0 picks a free port "
                   "(printed). Default: none")
    flag(w, "--metrics-host", "127.0.0.1", "address the worker's metrics endpoint binds (0.0.0.0: every interface)")
    w.add_argument("--tensorboard", metavar="DIR", help="also write TensorBoard scalars (loss, lr, staleness, step "
                   "time, evaluations) under DIR/workerRANK (needs: pip install 'psgrad[tensorboard]')")
    flag(w, "--progress", "auto", "a progress bar (steps/s, loss, latest evaluation) on stderr: auto = when stderr "
         "is a terminal", choices=("auto", "on", "off"))
    flag(w, "--shared-memory", ClientConfig.shared_memory, "move payloads through /dev/shm segments when a "
         "server is on this host (falls back to gRPC frames by itself otherwise); --no-shared-memory forces "
         "gRPC", action=argparse.BooleanOptionalAction)
    flag(w, "--local-socket", ClientConfig.local_socket, "with --shared-memory: make each step's call to a server "
         "on this host over the local socket it offers at join (a Unix socket bound to this worker's rank), not "
         "gRPC; --no-local-socket keeps the calls on gRPC", action=argparse.BooleanOptionalAction)
    flag(w, "--rows-in-place", ClientConfig.rows_in_place, "with --shared-memory: read a forward's rows of a "
         "sparse table from a server on this host in place (from the files under /dev/shm it keeps them in), "
         "not through a call; x86-64 only; --no-rows-in-place keeps the calls", action=argparse.BooleanOptionalAction)
    flag(w, "--step-socket", ClientConfig.step_socket, "make each step's call to a server on another host (or "
         "with --no-shared-memory) over the TCP port it offers at join (see psgrad server --step-port; in TLS "
         "with --tls-*), not gRPC; a connection that fails (a firewall) warns and uses gRPC; --no-step-socket "
         "keeps the calls on gRPC", action=argparse.BooleanOptionalAction)
    flag(w, "--compress-same-host", ClientConfig.compress_same_host, "with --compress: compress pushes to shards "
         "on this host too (through shared memory fewer bytes save nothing, and encoding costs CPU)",
         action="store_true")
    flag(w, "--duplex", ClientConfig.duplex, "async: push a step's gradient and pull the next weights at once, as "
         "two calls, to shards on other hosts (both directions of the link busy together; the weights pulled "
         "may miss this worker's last push, a step staler); off: one Step call per shard, which sends the reply "
         "after the whole request (sync and ssp always do)",
         action=argparse.BooleanOptionalAction)
    flag(w, "--compress-pull", ClientConfig.compress_pull, "pull the change of the weights since the copy this "
         "worker holds, compressed with a push codec (topk:RATIO, randomk:RATIO, sign, int8; none: the weights "
         "themselves); what a pull leaves out the server keeps per worker and sends later (error feedback); "
         "to shards on other hosts, or this one too with --compress-same-host; costs each shard a copy of its "
         "range per such worker", metavar="NAME")
    flag(w, "--pull-resync-every", ClientConfig.pull_resync_every, "with --compress-pull: pull the exact weights "
         "again once the worker's copy was last exact this many versions of a shard ago (0: never)", type=int)
    flag(w, "--pull-resync-error", ClientConfig.pull_resync_error, "with --compress-pull: pull the exact weights "
         "instead whenever the worker's copy would be further than this from them, ||w - copy|| / ||w|| (0: never)",
         type=float)


def add_rank_args(p: argparse.ArgumentParser, rank_help: str) -> None:
    """Flags of one training process: `psgrad worker` and `psgrad allreduce`."""
    flag(p, "--rank", WorkerConfig.rank, rank_help, type=int)
    flag(p, "--num-workers", JobSpec.num_workers, "workers in the job", type=positive_int)
    p.add_argument("--metrics-out", help="write one JSON record per step to this JSONL file")
    p.add_argument("--metrics-append", action="store_true", help="add the records after those --metrics-out holds "
                   "(psgrad launch --resume passes it, so that a resumed job's files keep the stopped run's records); "
                   "default: the file is written anew")
    flag(p, "--slowdown", WorkerConfig.slowdown, "make this worker a straggler: each step takes FACTOR times "
         "its measured compute time (FACTOR x --step-time-ms when that is set)", ", no delay", type=float)
    add_straggler_dist_arg(p)
    p.add_argument("--slow-node-rotate", metavar="STEPS:FIRST", help="the slow node moves: rank FIRST takes "
                   "--slowdown times as long for STEPS steps, then the next rank (mod --num-workers), and so on; "
                   "every worker of the job gets the same value and the slow node's --slowdown (psgrad compare "
                   "--slow-node-rotate sets both). Default: --slowdown applies to this worker on every step")
    p.add_argument("--save-model", metavar="PATH", help="write the final model's state_dict here (torch.save; "
                   "load it with model.load_state_dict(torch.load(PATH)))")


def add_server_policy_args(p: argparse._ActionsContainer) -> None:
    """The ServerConfig flags `psgrad server` and `psgrad launch` share."""
    flag(p, "--lease-s", ServerConfig.lease_s, "a worker silent this long counts as expired; raise it if "
         "workers on a busy host get evicted", type=float)
    flag(p, "--nonfinite", ServerConfig.nonfinite, "what to do with a gradient holding NaN/Inf: reject (error "
         "to the worker, shard unchanged), skip (acknowledge, do not apply) or allow", choices=NONFINITE_POLICIES)
    p.add_argument("--memory-budget-mb", type=float, default=None, metavar="MB", help="what the server's sparse "
                   "(embedding) tables may hold in all: 8 bytes per row placed on it, plus the rows touched so far "
                   "with their optimizer state; a table that would grow past it is refused with an error naming it "
                   "(default: 3/4 of the machine's memory; 0: no limit)")
    flag(p, "--batch-scheduling", ServerConfig.batch_scheduling, "run the server's request threads under Linux's "
         "SCHED_BATCH policy: a worker's call that wakes one does not take the CPU from that worker, which then "
         "writes its step to every shard before they run (on a host whose cores workers and servers share); "
         "--no-batch-scheduling keeps the default policy", action=argparse.BooleanOptionalAction)
    flag(p, "--follow-worker-cores", ServerConfig.follow_worker_cores, "serve a worker on this host (its Unix "
         "socket connection) from a thread on that worker's cores: a worker bound to cores of its own (--bind-cores, or "
         "psgrad.bind_cores() in its script) has the server's work for its calls done there while it waits, not queued "
         "behind another worker; a worker on every core leaves the thread on every core; "
         "--no-follow-worker-cores: the kernel places the threads", action=argparse.BooleanOptionalAction)
    flag(p, "--max-read-mb", ServerConfig.max_read_mb, "what the replies to reads of rows (a worker's rows of a "
         "step, pulls of rows, an export's pages) and to pulls of the dense weights through gRPC (a pull's frames, a "
         "step's reply) may hold on the server at once, counted from each request (ids x width x 4 bytes; the "
         "shard's weights) until its reply was sent; reads store no rows, so --memory-budget-mb does not "
         "bound them. Reads past it wait their turn within their deadline; a read of rows larger than all of it "
         "is refused naming the value it needs, a pull of a shard's weights larger than it goes alone. 0: no "
         f"limit; else at least {READ_LIMIT_MIN_MB:g} (an export's page)",
         type=float, metavar="MB")


def add_checkpoint_args(p: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    """The checkpoint intervals `psgrad server` and `psgrad launch` share, in a group of their own
    (returned, for the command's directory flags)."""
    c = p.add_argument_group(title)
    flag(c, "--checkpoint-every-s", ServerConfig.checkpoint_every_s, "async/ssp: write one when this many seconds "
         "passed and the shard changed; lower it to lose fewer updates to a crash, at the price of one copy of the "
         "weights and optimizer state per checkpoint", type=float)
    flag(c, "--checkpoint-every-versions", ServerConfig.checkpoint_every_versions, "also write one whenever the "
         "version reaches a multiple of this. Sync mode checkpoints only then (and at the start), the same "
         "iterations on every shard, so that a restarted shard rolls the job back to one: set it for sync jobs; "
         "lower it to recompute fewer iterations after a crash", ", off", type=int)
    return c


# --------------------------------------------------------------------------- parsed flags -> config
def staleness_arg(text: str) -> int | str:
    """--staleness: a bound >= 0, or 'auto'."""
    return text if text == "auto" else int_at_least(text, 0, " or 'auto'")


def staleness(ns: argparse.Namespace) -> int:
    if ns.staleness is None:  # the mode's default (--mode's choices are the modes)
        known = find_mode(ns.mode)
        return known.default_staleness if known is not None else 0
    return 0 if ns.staleness == "auto" else int(ns.staleness)


def staleness_max(ns: argparse.Namespace) -> int:
    """JobSpec.staleness_max: --staleness-max with --staleness auto, else 0 (a fixed bound)."""
    return int(ns.staleness_max) if getattr(ns, "staleness", None) == "auto" else 0


def job_spec(ns: argparse.Namespace, num_workers: int, num_shards: int) -> JobSpec:
    """The JobSpec of the job flags; flags with nothing to act on (--no-error-feedback without a
    biased codec, --compress-same-host without --compress or --compress-pull) are refused by name."""
    spec = _job_spec(ns, num_workers, num_shards)
    if not ns.error_feedback and not feeds_back(spec.compress):
        raise ConfigError(f"--no-error-feedback needs --compress with a biased codec ({BIASED}): with --compress "
                          f"{spec.compress} no push leaves anything out to feed back; leave the flag out, or add "
                          "--compress topk:0.01 (say)")
    if getattr(ns, "compress_same_host", False) and spec.compress == NONE and getattr(ns, "compress_pull", NONE) == NONE:
        raise ConfigError("--compress-same-host needs --compress (or --compress-pull): without either nothing is "
                          "compressed, on this host or another; leave the flag out, or add --compress topk:0.01 (say)")
    return spec


def _job_spec(ns: argparse.Namespace, num_workers: int, num_shards: int) -> JobSpec:
    return JobSpec(
        mode=ns.mode, staleness=staleness(ns), staleness_lr=ns.staleness_lr, num_workers=num_workers,
        optimizer=ns.optimizer, lr=ns.lr, momentum=ns.momentum, weight_decay=ns.weight_decay, beta1=ns.beta1,
        beta2=ns.beta2, eps=DEFAULT_EPS.get(ns.optimizer, JobSpec.eps) if ns.eps is None else ns.eps,
        nesterov=ns.nesterov, lr_decay=ns.lr_decay, initial_accumulator_value=ns.initial_accumulator_value,
        alpha=ns.alpha, centered=ns.centered, rho=ns.rho, wire_dtype=ns.wire_dtype, num_shards=num_shards,
        dc_asgd=ns.dc_asgd, dc_asgd_adaptive=ns.dc_asgd_adaptive, compress=ns.compress,
        error_feedback=ns.error_feedback, backup_workers=ns.backup_workers, staleness_max=staleness_max(ns),
        tables_mode=ns.tables_mode or "",
    )


def client_config(ns: argparse.Namespace, rank: int | None = None) -> ClientConfig:
    """The worker's ClientConfig, credentials included (`psgrad run`: worker `rank`'s certificate)."""
    return ClientConfig(
        connect_timeout_s=ns.connect_timeout_s, rpc_timeout_s=ns.rpc_timeout_s, init_timeout_s=ns.init_timeout_s,
        reconnect_timeout_s=ns.reconnect_timeout_s, shared_memory=ns.shared_memory, local_socket=ns.local_socket,
        rows_in_place=ns.rows_in_place,
        step_socket=ns.step_socket,
        wait_for_servers=ns.wait_for_servers,
        compress_same_host=ns.compress_same_host, duplex=ns.duplex, compress_pull=ns.compress_pull,
        pull_resync_every=ns.pull_resync_every, pull_resync_error=ns.pull_resync_error,
        tls=security.tls_config(ns, client=True, rank=rank), auth=security.auth_config(ns, os.environ, client=True),
    )


def credentials_config(ns: argparse.Namespace) -> ClientConfig:
    """Only the credentials of a client command's flags (status, export): the admin's."""
    return ClientConfig(tls=security.tls_config(ns, client=True), auth=security.auth_config(ns, os.environ, client=True))


def worker_config(
    ns: argparse.Namespace, servers: tuple[str, ...], client: ClientConfig, rank: int, slowdown: float,
    metrics_out: str | None,
) -> WorkerConfig:
    """The WorkerConfig of the job flags (add_job_args), for one rank; a --save-model that cannot be
    written is refused now, not after training (ConfigError)."""
    if getattr(ns, "save_model", None) is not None:
        check_out_file("--save-model", ns.save_model)
    return WorkerConfig(
        servers=servers, task=ns.task, rank=rank, steps=ns.steps, batch_size=ns.batch_size, device=ns.device,
        seed=ns.seed, metrics_out=metrics_out, metrics_append=getattr(ns, "metrics_append", False),
        eval_every=ns.eval_every, log_every=ns.log_every,
        slowdown=slowdown, jitter_ms=ns.jitter_ms, overlap=ns.overlap, client=client,
        save_model=getattr(ns, "save_model", None), local_rank=getattr(ns, "local_rank", None),
        bind_cores=getattr(ns, "bind_cores", False), local_workers=getattr(ns, "local_workers", None),
        lr_schedule=ns.lr_schedule, warmup_steps=ns.warmup_steps, step_time_ms=ns.step_time_ms, data_dir=ns.data_dir,
        straggler_model=straggler_model(ns), row_cache_rows=ns.row_cache_rows, row_cache_staleness=ns.row_cache_staleness,
        table_optimizer=ns.table_optimizer, table_lr=ns.table_lr,
    )


def check_out_file(flag: str, value: str) -> None:
    """A file a command writes (export --out, --save-model, allreduce --store), checked before
    anything starts: not a directory, and in a folder that exists.

    Raises:
        ConfigError: naming the flag as typed, the path and what to do.
    """
    path = Path(value)
    if path.is_dir():
        raise ConfigError(f"{flag} {value!r} is a directory: give the path of a file to write (in it, or elsewhere)")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise ConfigError(f"{flag} {value!r}: folder {str(folder)!r} does not exist: create it, or give a file in a "
                          "folder that exists")


def check_out_dir(flag: str, value: str) -> None:
    """A directory the command's processes write files into (launch --metrics-dir), made if missing:
    checked before anything starts, so that it is not (in) a regular file.

    Raises:
        ConfigError: naming the flag as typed, the path and what to do.
    """
    path = Path(value).absolute()
    for existing in (path, *path.parents):
        if existing.exists():
            if not existing.is_dir():
                what = "is a file" if existing == path else f": {str(existing)!r} is a file"
                raise ConfigError(f"{flag} {value!r}{' ' if existing == path else ''}{what}, not a directory: give a "
                                  "directory (it is made if missing)")
            return


def check_ops_args(ns: argparse.Namespace) -> None:
    """The operations flags' values (port ranges), before anything starts."""
    port = getattr(ns, "metrics_port", None)
    if port is not None and not 0 <= port <= 65535:
        raise ConfigError(f"--metrics-port must be 0..65535, got {port}")


def add_connection_args(g: argparse._ActionsContainer) -> None:
    """A server's defences against peers that hold its threads, buffers and descriptors (`psgrad
    server`, `psgrad run`)."""
    flag(g, "--stream-read-timeout-s", ServerConfig.stream_read_timeout_s, "cancel a push (or another client "
         "stream) whose next frame does not arrive within this many seconds, and give back what it held",
         type=float)
    flag(g, "--transfer-allowance-s", ServerConfig.transfer_allowance_s, "a whole push (once it holds a receive "
         "buffer), a pull being sent and the chief's init must end within this many seconds plus their size at "
         "--min-transfer-rate-mb-s, or they are cancelled, what they held is given back and the server logs the peer",
         type=float)
    flag(g, "--min-transfer-rate-mb-s", ServerConfig.min_transfer_rate_mb_s, "the slowest rate (MB/s, 10^6 bytes a "
         "second) a whole push or pull is given on top of --transfer-allowance-s (with both defaults a 100 MB push "
         "may take 10 + 100 s); one slower than this for 0.1 s no longer holds up others, who go ahead beside it; "
         "0: no whole-transfer deadline", type=float)
    flag(g, "--max-streams-per-peer", ServerConfig.max_streams_per_peer, "pushes and other client streams one "
         "caller may have open at once, however many connections it opens (a caller: its authenticated identity, "
         "a worker rank or the admin, else its host); more are refused for now (workers retry). In all they may "
         "take 3/4 of --threads", type=positive_int)
    flag(g, "--handshake-timeout-s", ServerConfig.handshake_timeout_s, "close a connection that has not completed "
         "its handshake (TLS, HTTP/2) within this many seconds, so that connections which send nothing cannot hold "
         "the server's file descriptors", type=float)


def step_port_arg(text: str) -> int | None:
    """--step-port: a port (0: a free one), or `off`."""
    if text.strip().lower() in ("off", "none"):
        return None
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port 0..65535 (0: a free one) or 'off', got {text!r}")
    return port


def server_config(ns: argparse.Namespace) -> ServerConfig:
    return ServerConfig(
        host=ns.host, port=ns.port, step_port=ns.step_port, lease_s=ns.lease_s, nonfinite=ns.nonfinite, threads=ns.threads,
        memory_budget_mb=ns.memory_budget_mb, max_read_mb=ns.max_read_mb, batch_scheduling=ns.batch_scheduling,
        follow_worker_cores=ns.follow_worker_cores,
        push_buffers=ns.push_buffers, stream_window_bytes=ns.stream_window_bytes, checkpoint_dir=ns.checkpoint_dir,
        stream_read_timeout_s=ns.stream_read_timeout_s, max_streams_per_peer=ns.max_streams_per_peer,
        transfer_allowance_s=ns.transfer_allowance_s, min_transfer_rate_mb_s=ns.min_transfer_rate_mb_s,
        handshake_timeout_s=ns.handshake_timeout_s,
        checkpoint_every_s=ns.checkpoint_every_s, checkpoint_every_versions=ns.checkpoint_every_versions,
        replica_of=ns.replica_of, replica_timeout_s=ns.replica_timeout_s, advertise_host=ns.advertise_host,
        metrics_port=ns.metrics_port, tls=security.tls_config(ns, client=False),
        auth=security.auth_config(ns, os.environ, client=False), insecure=ns.insecure,
    )
