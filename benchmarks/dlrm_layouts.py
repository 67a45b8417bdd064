"""Two layouts of benchmarks/dlrm.py's psgrad model side by side in one process, by the CPU they cost:
two workers, one per layout (separate modules and one table, by default), each bound to two psgrad
server processes of its own, step alternately, so both see the same machine noise, step by step.
What the throughput comparison of dlrm.py cannot resolve on a noisy shared machine (its runs'
spread is larger than a tenth), this does: the CPU each layout costs per step, on both ends.

    python benchmarks/dlrm_layouts.py --preset full                       # separate vs single, 400 steps x 2
    python benchmarks/dlrm_layouts.py --preset full --layouts separate,collection
    python benchmarks/dlrm_layouts.py --preset tiny                       # CI-sized
    python benchmarks/dlrm_layouts.py --preset full --features 26 --rows 300000  # Criteo's 26 features
    python benchmarks/dlrm_layouts.py --preset full --layouts separate,separate --off _staged_reads
    python benchmarks/dlrm_layouts.py --preset full --layouts separate,separate --off rows_in_place
    python benchmarks/dlrm_layouts.py --preset full --layouts separate,separate --off _compiled_reads
    python benchmarks/dlrm_layouts.py --preset full --layouts separate,local    # against plain PyTorch

The data: dlrm.py's examples (the same generator: 8 features, bags of 1-3 Zipf ids, 13 dense
features), one worker's slice. The model: dlrm.py's PsgradNet of each layout (`separate`: one
psgrad.EmbeddingBag per feature, `single`: the same rows in one table, `collection`: a
psgrad.EmbeddingBagCollection), async Adagrad (lr 0.05, eps 1e-10; --mode sync: sync), one worker per job (its own two
servers, `psgrad server` processes). `local` is the reference without psgrad: the same model in
this process with a torch.nn.EmbeddingBag per feature (sparse=True, rows starting at zero as
psgrad's do) and torch.optim.Adagrad (the same lr and eps), no servers: what the model's own
forward, backward and update cost in plain PyTorch (torch's sparse Adagrad builds its update from
sparse tensors, slower than psgrad's row kernels: compare its forward and backward). Each step of each side: zero_grad, forward and loss, backward,
opt.step(); the main thread's CPU time (time.thread_time) of each phase is summed after --warmup
steps, and the servers' CPU (from /proc) over the same steps. Both sides' steps interleave: A, B, A,
B, ...; the repetitions start each side's job afresh (new servers), the order of the sides reversed
every other one. Figures: per side, the median over repetitions of its CPU ms per step (the main
thread's, by phase; its client's pool threads', which make the calls a read hands to a second
shard's thread; the worker's, both together; and the servers'), and each side over the other (the
ratio's median). --off SWITCH turns a switch of psgrad's client off on the second side (a bool field of
psgrad.ClientConfig, as rows_in_place, the side connects with; else an attribute of its client): with one
layout twice, the two sides differ by that switch alone, and the ratios are what the change behind
it saves, read step by step against the same noise (a measurement across two checkouts in two
runs cannot resolve a few percent on a shared machine).

Prints one JSON document; progress and a table go to stderr. Method and figures:
docs/benchmarks/dlrm.md ("Bags pooled at the forward's start")."""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dlrm import EPS, LR, SEED, ZIPF_S, _SALT_TRAIN, Examples, PsgradNet, psgrad_inputs  # noqa: E402
from lib.args import add_preset, overrides  # noqa: E402
from lib.children import PSGRAD_SERVER, Child, start_server, stop_all  # noqa: E402
from lib.dlrm_model import bce, dense_arch, load_batches, save_examples  # noqa: E402
from lib.report import code_version, log, machine_info, write_json  # noqa: E402

import psgrad  # noqa: E402

PRESETS = {
    "full": {"rows": 1_000_000, "dim": 32, "batch": 512, "warmup": 30, "steps": 400, "reps": 2, "features": 8},
    # (tiny: 100 steps, about 0.2 s a side, so that the servers' CPU, which /proc counts in clock ticks
    # of 10 ms, reads more than a tick or two: at 10 steps a fast machine's read 0)
    "tiny": {"rows": 1_000, "dim": 8, "batch": 64, "warmup": 3, "steps": 100, "reps": 1, "features": 4},
}
LAYOUTS = ("separate", "single", "collection", "local")
LOCAL = "local"  # the model in plain PyTorch, in this process: no psgrad, no servers
BATCHES = 64  # distinct batches, cycled
PHASES = ("forward", "backward", "step")


class LocalNet(nn.Module):
    """dlrm.py's model in plain PyTorch: a torch.nn.EmbeddingBag per feature (sum, sparse
    gradients, rows starting at zero as psgrad's do here) and the same dense part."""

    def __init__(self, features: int, rows: int, dim: int) -> None:
        super().__init__()
        self.arch = dense_arch(features, dim, SEED)
        self.tables = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum", sparse=True) for _ in range(features))
        for t in self.tables:
            nn.init.zeros_(t.weight)

    def forward(self, dense: torch.Tensor, sparse: Any) -> torch.Tensor:
        return self.arch(dense, torch.stack([t(v, o) for t, (v, o) in zip(self.tables, sparse, strict=True)], dim=1))


class Side:
    """One layout's job: its two servers, its session and model, and its CPU so far (`local`: the
    model in plain PyTorch, no servers)."""

    def __init__(self, layout: str, p: dict[str, Any], batches: list[Any], rep: int, off: str | None = None) -> None:
        self.layout = layout
        self.name = layout if off is None else f"{layout} ({off} off)"
        self.phases = dict.fromkeys(PHASES, 0.0)
        self.servers_cpu = 0.0
        self.pool_cpu = 0.0
        self._pool_start: dict[int, float] = {}
        self.session: Any = None
        self.servers: list[Child] = []
        if layout == LOCAL:
            self.inputs = [(b.dense, psgrad_inputs(b, "separate", p["rows"]), b.labels) for b in batches]
            self.model: nn.Module = LocalNet(p["features"], p["rows"], p["dim"])
            self.opt: Any = torch.optim.Adagrad(self.model.parameters(), lr=LR, eps=EPS)
            return
        label = layout if off is None else f"{layout}-{off.strip('_')}-off"  # (one layout twice: servers told apart)
        self.servers = [start_server(f"{label}-server{k}-rep{rep}", PSGRAD_SERVER) for k in range(2)]
        addresses = [s.address() for s in self.servers]
        self.inputs = [(b.dense, psgrad_inputs(b, layout, p["rows"]), b.labels) for b in batches]
        self.model = PsgradNet(layout, p["features"], p["rows"], p["dim"])
        config_switch = off is not None and isinstance(getattr(psgrad.ClientConfig(), off, None), bool)
        self.session = psgrad.connect(addresses, rank=0, num_workers=1, mode=p.get("mode", "async"),
                                      optimizer=psgrad.Adagrad(lr=LR, eps=EPS),
                                      client=psgrad.ClientConfig(**({off: False} if config_switch else {})))
        self.opt = self.session.optimizer(self.model)
        if off is not None and not config_switch:  # (a switch of the client's, True by default: this side's off)
            if not isinstance(getattr(self.opt.client, off, None), bool):
                self.close()
                raise SystemExit(f"dlrm_layouts: --off {off}: this psgrad's client has no such switch")
            setattr(self.opt.client, off, False)

    def _pool_threads(self) -> dict[int, float]:
        """CPU seconds so far of each thread of this side's client's pools (by thread ident): the
        worker's threads besides the main one that work on its steps (a pool thread is made at its
        pool's first call, and kept; none for `local`)."""
        client = getattr(self.opt, "client", None)
        pools = [pool for pool in (getattr(client, "_pool", None), getattr(client, "_pushers", None)) if pool is not None]
        return {t.ident: time.clock_gettime(time.pthread_getcpuclockid(t.ident))
                for pool in pools for t in list(getattr(pool, "_threads", ())) if t.ident is not None and t.is_alive()}

    def start_window(self) -> None:
        self.phases = dict.fromkeys(PHASES, 0.0)
        self.servers_cpu = -sum(s.cpu_s() for s in self.servers)
        self._pool_start = self._pool_threads()

    def end_window(self) -> None:
        self.servers_cpu += sum(s.cpu_s() for s in self.servers)
        self.pool_cpu = sum(cpu - self._pool_start.get(ident, 0.0) for ident, cpu in self._pool_threads().items())

    def step(self, i: int) -> None:
        dense, sparse, labels = self.inputs[i % len(self.inputs)]
        t0 = time.thread_time()
        self.opt.zero_grad()
        loss = bce(self.model(dense, sparse), labels)
        t1 = time.thread_time()
        loss.backward()
        t2 = time.thread_time()
        self.opt.step()
        t3 = time.thread_time()
        for name, took in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2)):
            self.phases[name] += took

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
        stop_all(self.servers)


def repetition(p: dict[str, Any], specs: list[tuple[str, str | None]], batches: list[Any],
               rep: int) -> dict[str, dict[str, Any]]:
    """One repetition: both sides' jobs (specs: each one's layout and the client switch it turns
    off, if any), stepped alternately; per side (by its name) its CPU ms per step."""
    order = specs if rep % 2 == 0 else specs[::-1]
    sides: list[Side] = []
    try:
        for layout, off in order:
            sides.append(Side(layout, p, batches, rep, off))
        for i in range(p["warmup"] + p["steps"]):
            if i == p["warmup"]:
                for s in sides:
                    s.start_window()
            for s in sides:
                s.step(i)
        out = {}
        for s in sides:
            s.end_window()
            main = {name: 1e3 * took / p["steps"] for name, took in s.phases.items()}
            stats = s.opt.prefetched.stats if s.layout != LOCAL else None
            pool_ms = 1e3 * s.pool_cpu / p["steps"]
            lent = [] if s.layout == LOCAL else [c.rows_in_place for c in s.opt.client.shards]
            out[s.name] = {"mode": None if s.layout == LOCAL else s.session.spec.mode,  # (the job's, as its servers run it)
                           "rows_read_in_place": sum(r.reads for r in lent if r is not None),
                           "main_thread_ms": {**main, "total": sum(main.values())},
                           "pool_threads_ms": pool_ms, "worker_ms": sum(main.values()) + pool_ms,
                           "servers_ms": 1e3 * s.servers_cpu / p["steps"],
                           # (pooled: None where this psgrad pools none; no prefetch for `local`)
                           "prefetch": None if stats is None else {"grouped": stats.grouped, "unused": stats.unused,
                                                                   "pooled": getattr(stats, "pooled", None)}}
        return out
    finally:
        for s in sides:
            s.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_preset(parser, PRESETS, "table sizes, steps and repetitions")
    parser.add_argument("--layouts", type=lambda s: s.split(","), default=["separate", "single"],
                        help=f"the two layouts, the first the one measured against the second: of {', '.join(LAYOUTS)} "
                             "(default separate,single)")
    parser.add_argument("--rows", type=int, help="override the rows of each feature's table")
    parser.add_argument("--features", type=int,
                        help="override the categorical features, one table each (8; Criteo's click logs have 26)")
    parser.add_argument("--steps", type=int, help="override the measured steps per side and repetition")
    parser.add_argument("--warmup", type=int, help="override the unmeasured steps before them")
    parser.add_argument("--reps", type=int, help="override the repetitions")
    parser.add_argument("--mode", choices=("async", "sync"), default="async",
                        help="the jobs' mode (default async; sync: each step a round of the one worker, whose "
                             "rows the servers apply as a sync iteration's)")
    parser.add_argument("--off", metavar="SWITCH",
                        help="a switch of psgrad's client turned off on the second side (a bool field of "
                             "psgrad.ClientConfig, e.g. rows_in_place, or a bool attribute of the client, on by "
                             "default): with --layouts L,L, the CPU a change behind that switch saves, both sides "
                             "stepping alternately in this process")
    args = parser.parse_args()
    p = overrides(args, PRESETS[args.preset])
    p["mode"] = args.mode
    layouts = list(args.layouts)
    if len(layouts) != 2 or not set(layouts) <= set(LAYOUTS) or (len(set(layouts)) != 2 and not args.off):
        parser.error(f"--layouts takes two different layouts of {', '.join(LAYOUTS)} (one twice with --off), "
                     f"got {args.layouts}")
    if args.off and layouts[1] == LOCAL:
        parser.error("--off turns a switch of psgrad's client off; the local side has no psgrad client")
    specs: list[tuple[str, str | None]] = [(layouts[0], None), (layouts[1], args.off)]
    names = [layouts[0], layouts[1] if not args.off else f"{layouts[1]} ({args.off} off)"]
    if min(p["rows"], p["steps"], p["reps"], p["features"]) < 1 or p["warmup"] < 0:
        parser.error("rows, steps, reps and features must be >= 1, warmup >= 0")
    torch.set_num_threads(1)
    t0 = time.monotonic()
    examples = Examples(0, p["features"], p["rows"], ZIPF_S)
    ids, lengths, dense, labels, _ = examples.make(_SALT_TRAIN, np.arange(BATCHES * p["batch"]))
    with tempfile.TemporaryDirectory(prefix="psgrad-dlrm-layouts-") as work:
        path = Path(work) / "train.npz"
        save_examples(path, ids, lengths, dense, labels)
        batches = load_batches(path, p["batch"])
    reps = []
    for rep in range(p["reps"]):
        reps.append(repetition(p, specs, batches, rep))
        a, b = (reps[-1][name] for name in names)
        log(f"dlrm_layouts: rep {rep + 1}/{p['reps']}: main thread {a['main_thread_ms']['total']:.2f} against "
            f"{b['main_thread_ms']['total']:.2f} ms a step, worker {a['worker_ms']:.2f} against {b['worker_ms']:.2f}, "
            f"servers {a['servers_ms']:.2f} against {b['servers_ms']:.2f}")
    medians: dict[str, Any] = {}
    for name in names:
        medians[name] = {"main_thread_ms": {k: statistics.median(r[name]["main_thread_ms"][k] for r in reps)
                                            for k in (*PHASES, "total")},
                         **{k: statistics.median(r[name][k] for r in reps)
                              for k in ("pool_threads_ms", "worker_ms", "servers_ms")}}

    def of(r: dict[str, Any], what: str) -> float:
        return r["main_thread_ms"][what] if what in (*PHASES, "total") else r[f"{what}_ms"]

    first, second = names
    # (None where the second side spent none: `local` has no servers)
    ratios = {f"{first} / {second} {what}": statistics.median(of(r[first], what) / of(r[second], what) for r in reps)
              if all(of(r[second], what) > 0 for r in reps) else None for what in (*PHASES, "total", "worker", "servers")}
    width = max(12, *(len(name) + 1 for name in names))
    lines = [f"DLRM layouts by CPU, {p['mode']}, {p['features']} tables of {p['rows']:,} x {p['dim']}, batch {p['batch']}, "
             f"{p['steps']} steps a side, medians of {p['reps']}; ratio: {first} / {second}",
             f"{'layout':<{width}}" + "".join(f"{h:>11}" for h in (*PHASES, "main", "pools", "worker", "servers"))
             + "   (ms of CPU a step)"]
    for name in names:
        m = medians[name]
        lines.append(f"{name:<{width}}" + "".join(f"{m['main_thread_ms'][k]:>11.2f}" for k in (*PHASES, "total"))
                     + "".join(f"{m[k]:>11.2f}" for k in ("pool_threads_ms", "worker_ms", "servers_ms")))
    def shown(k: str) -> str:
        r = ratios[f"{first} / {second} {k}"]
        return f"{'-' if r is None else format(r, '.2f'):>11}"

    lines.append(f"{'ratio':<{width}}" + "".join(shown(k) for k in (*PHASES, "total")) + f"{'':>11}"
                 + "".join(shown(k) for k in ("worker", "servers")))
    print("\n".join(lines), file=sys.stderr, flush=True)
    write_json({"benchmark": "dlrm_layouts", "preset": args.preset, "config": {**p, "layouts": layouts, "off": args.off},
                "machine": machine_info(), "code": code_version(), "repetitions": reps, "medians": medians,
                "ratios": ratios, "elapsed_s": time.monotonic() - t0})


if __name__ == "__main__":
    main()
