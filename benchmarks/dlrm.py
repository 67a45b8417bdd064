"""A DLRM-style recommender trained by psgrad (sync and async, 2 servers) and by TorchRec's
DistributedModelParallel, in the same run, on exactly the same examples: training samples/s and
test AUC side by side.

    python benchmarks/dlrm.py --preset full                   # 8 tables of 1M x 32; TorchRec beside psgrad
    python benchmarks/dlrm.py --preset full --layouts separate,single --reps 3
    python benchmarks/dlrm.py --preset tiny --no-torchrec     # CI-sized, psgrad only
    python benchmarks/dlrm.py --preset full --features 26 --steps 400 --reps 2 --layouts separate,single,collection

TorchRec is not a psgrad dependency: it runs from an interpreter of its own (--torchrec-python,
default /work/torchrec-venv/bin/python when it exists), made once with (torchrec 1.9.x does not
load on torch 2.13):

    python3 -m venv /work/torchrec-venv
    /work/torchrec-venv/bin/pip install torch==2.13.0
    /work/torchrec-venv/bin/pip install --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0
    /work/torchrec-venv/bin/pip install numpy tensordict torchmetrics==1.0.3 pyre-extensions tqdm

Without it the TorchRec rows say skipped, with that command, and psgrad is measured alone.

The data: F categorical features (8), each with a table of its own (1M rows x 32 in full), a bag
of 1-3 ids per feature and example, the ids Zipf-like (the inverse CDF of a continuous power law
with exponent --zipf on [1, rows + 1), floored: small ids are hot), and 13 dense features. Every
example is a function of (seed, its index) alone (counter-based draws, splitmix64, as
psgrad/tasks/ctr.py makes its examples). Labels come from a planted model: logit = bias + an effect
per hot id (the HOT_IDS smallest ids of each feature, N(0, EFFECT_STD^2) drawn from (feature, id))
summed over the bags + a linear function of the dense features + one pairwise product of them; the
label is a Bernoulli draw of its sigmoid, and the planted logit's test AUC (`bayes_auc`) is the
best a model can do. The driver writes each worker's slice (worker r: examples r*N to (r+1)*N - 1)
and the test set (--test examples of another salt) to files both systems read, batched before the
clock starts.

The model (lib/dlrm_model.py, the same module on both sides, the same initial dense weights): the
features' bags pooled by sum (one D-vector each), a bottom MLP of the dense features (13-64-D),
DLRM's dot interaction (the pairwise dot products of the F + 1 vectors), a top MLP (-64-1), BCE
loss; batch --batch per worker (512 in full), Adagrad with lr 0.05 and eps 1e-10 everywhere, two
workers. Embedding rows start at zero on both sides (lib/dlrm_model.py INIT_STD: psgrad's and
TorchRec's random initial rows could not be the same), so a psgrad sync run and TorchRec's start
from the same model.

- psgrad: 2 shard servers and 2 worker processes. A server is psgrad.serve (what `psgrad server`
  runs) in a process of its own, kept from run to run, a fresh server per run (a server holds one
  job for life). The workers use the Python API: psgrad.connect(..., optimizer=psgrad.Adagrad(lr,
  eps)).optimizer(model); the servers apply Adagrad to the dense weights and, per element with
  lazy per-row state, to the rows. --modes sync and/or async, the same-host defaults (each shard's
  transport of the dense part is recorded: "shm" or "grpc"; rows travel in gRPC messages). --layouts:
  `separate` = F psgrad.EmbeddingBag(rows, D, mode="sum") modules, as the docs teach;
  `single` = one psgrad.EmbeddingBag holding all F features' rows (feature f's ids offset by
  f x rows): the same rows in one table, the reference for separate (goal separate >= 0.9 x
  single); `collection` = psgrad.EmbeddingBagCollection({name: (rows, D)}, mode="sum"), reported
  as skipped where this psgrad has none; `+pipeline`: each step reads the next batch's rows
  (opt.pipeline); `+grpc` after any of them: the workers make their Step calls through gRPC
  (ClientConfig(local_socket=False)), not over the servers' local sockets, psgrad's default on one
  host (the comparison that measures it). A worker's last step is followed by rank 0 reading the
  servers' latest weights (opt.refresh) and scoring the test set.
- TorchRec (lib/torchrec_worker.py, 2 processes of a gloo process group on CPU):
  DistributedModelParallel over an EmbeddingBagCollection of F EmbeddingBagConfigs (pooling sum),
  KeyedJaggedTensor input, the planner constrained to table-wise sharding (row-wise is refused
  on CPU), the tables' Adagrad fused into the backward (fbgemm's EXACT_ADAGRAD: per element, as
  torch.optim.Adagrad, through apply_optimizer_in_backward), the dense part under
  DistributedDataParallel with torch.optim.Adagrad; both ranks score half the test set each.

In sync mode psgrad applies the mean of the two workers' gradients; TorchRec's dense gradient is
that mean too (DDP), its rows' gradients the sum over ranks of each rank's batch-mean (Adagrad's
step does not change with a gradient's scale, eps aside). psgrad async applies each push alone.

Each run trains --warmup + --steps steps per worker (full: 20 + 800, about 8 s a run: 200 timed
steps left the runs short against the machine's slow phases, and compared test AUC while async
psgrad was still ahead of sync early in training; see docs/benchmarks/dlrm.md); samples/s = both
workers' timed samples over the window from the first worker's first timed step to the last
one's end (both sides time with time.monotonic, one clock for the host's processes). The runs
alternate, psgrad then TorchRec (psgrad sync, TorchRec, psgrad async, TorchRec, ... per layout),
the order reversed every other repetition, for --reps repetitions; the side not running is
stopped (SIGSTOP). With --bind-cores
each worker of both systems is bound to its share of the cores from its start (rank r of 2: the
r-th half; psgrad's by psgrad.bind_cores, TorchRec's ranks by the same rule), the servers left on
every core; without it (the default, as each system runs unless asked) the kernel places them. Figures are
medians over repetitions; the ratios are psgrad's over TorchRec's (goal >= 1.0, with the test
AUC within 0.002) and separate's over single's (goal >= 0.9). Beside each ratio of medians, the
same ratio run by run ("paired": each psgrad run over the TorchRec runs just before and after it,
a layout's over the single table's run of its repetition): their range and how many reach the
goal say whether it is met steadily, which a noisy machine's medians alone cannot. Prints one
JSON document; progress and a table go to stderr. Method and figures: docs/benchmarks/dlrm.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lib import (
    SETUP_TIMEOUT_S,
    BenchError,
    Child,
    add_preset,
    code_version,
    command_loop,
    exit_now,
    log,
    machine_info,
    overrides,
    paused,
    rep_order,
    run_by_run,
    run_together,
    stop_all,
    summarize,
    target,
    write_json,
)
from lib.dlrm_model import (
    DENSE,
    INIT_STD,
    MAX_BAG,
    Batch,
    dense_arch,
    load_batches,
    save_examples,
    train,
    training_batches,
)

import psgrad

# task ctr's counter-based draws (splitmix64 of seed, salt, index and column) and its rank AUC
from psgrad.tasks.ctr import _uniforms as uniforms
from psgrad.tasks.ctr import auc as rank_auc

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"features": 8, "rows": 20_000, "dim": 8, "batch": 64, "warmup": 3, "steps": 12, "test": 4_000,
             "eval_batch": 1_000, "reps": 1, "layouts": ["separate", "single", "collection", "collection+pipeline"],
             "modes": ["sync", "async"]},
    "full": {"features": 8, "rows": 1_000_000, "dim": 32, "batch": 512, "warmup": 20, "steps": 800, "test": 20_000,
             "eval_batch": 2_000, "reps": 3, "layouts": ["separate", "single", "collection", "separate+pipeline", "collection+pipeline"],
             "modes": ["sync", "async"]},
}
LAYOUTS = ("separate", "single", "collection", "separate+pipeline", "collection+pipeline")


def base_layout(layout: str) -> tuple[str, bool]:
    """(the tables' layout, whether each step fetches the next batch's rows: opt.pipeline)."""
    base, *more = layout.split("+")
    return base, "pipeline" in more


def steps_over_grpc(layout: str) -> bool:
    """Whether a layout's workers make their Step calls through gRPC (`+grpc`: ClientConfig(local_socket=False)),
    not over the servers' local sockets (psgrad's default on one host)."""
    return layout.endswith("+grpc")
MODES = ("sync", "async")
WORKERS = 2  # per system; psgrad has as many servers
LR, EPS, SEED = 0.05, 1e-10, 0
ZIPF_S = 1.2
HOT_IDS, EFFECT_STD, DENSE_STD, BIAS = 20, 0.5, 0.3, -1.0
_SALT_TRAIN, _SALT_TEST, _SALT_PLANTED = 1, 2, 3
GOAL_SPEED, GOAL_AUC_GAP, GOAL_LAYOUT = 1.0, 0.002, 0.9
TORCHREC_VENV = Path("/work/torchrec-venv")
TORCHREC_INSTALL = (f"python3 -m venv {TORCHREC_VENV} && {TORCHREC_VENV}/bin/pip install torch==2.13.0 && "
                    f"{TORCHREC_VENV}/bin/pip install --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0 && "
                    f"{TORCHREC_VENV}/bin/pip install numpy tensordict torchmetrics==1.0.3 pyre-extensions tqdm")
TORCHREC_WORKER = Path(__file__).resolve().parent / "lib" / "torchrec_worker.py"
TORCHREC = "torchrec"


# ---------------------------------------------------------------------------------------------
# The examples


class Examples:
    """The examples and their planted logits, as functions of (seed, index)."""

    def __init__(self, seed: int, features: int, rows: int, zipf: float) -> None:
        self.seed, self.features, self.rows, self.zipf = seed, features, rows, zipf
        planted = np.random.default_rng([seed, _SALT_PLANTED])
        self.effects = planted.normal(0.0, EFFECT_STD, (features, min(HOT_IDS, rows)))
        self.dense_w = planted.normal(0.0, DENSE_STD, DENSE)

    def make(self, salt: int, index: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(ids [n, F, MAX_BAG] (-1 past a bag's end), lengths [n, F], dense [n, 13], labels [n],
        planted logits [n])."""
        F = self.features
        u = uniforms(self.seed, salt, index, F + F * MAX_BAG + 2 * DENSE + 1)
        lengths = np.minimum(1 + np.floor(u[:, :F] * MAX_BAG), MAX_BAG).astype(np.int64)
        a = 1.0 - self.zipf  # inverse CDF of a power law on [1, rows + 1), floored, minus 1
        x = ((self.rows + 1.0) ** a - 1.0) * u[:, F:F + F * MAX_BAG].reshape(-1, F, MAX_BAG) + 1.0
        ids = np.clip(np.floor(x ** (1.0 / a)) - 1.0, 0, self.rows - 1).astype(np.int64)
        ids[np.arange(MAX_BAG) >= lengths[:, :, None]] = -1
        u1, u2 = u[:, F + F * MAX_BAG:-1 - DENSE], u[:, -1 - DENSE:-1]
        dense = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
        logit = BIAS + dense @ self.dense_w + 0.5 * dense[:, 0] * dense[:, 1]
        hot = (ids >= 0) & (ids < self.effects.shape[1])
        effect = self.effects[np.arange(F)[None, :, None], np.where(hot, ids, 0)]
        logit += np.where(hot, effect, 0.0).sum(axis=(1, 2))
        labels = (u[:, -1] < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        return ids, lengths, dense.astype(np.float32), labels, logit


def write_data(p: dict[str, Any], zipf: float, work: Path) -> dict[str, Any]:
    """Each worker's slice and the test set as files; what they hold."""
    gen = Examples(SEED, p["features"], p["rows"], zipf)
    per_worker = (p["warmup"] + p["steps"]) * p["batch"]
    files: dict[str, Any] = {"train": []}
    for rank in range(WORKERS):
        ids, lengths, dense, labels, _ = gen.make(_SALT_TRAIN, np.arange(rank * per_worker, (rank + 1) * per_worker))
        files["train"].append(str(work / f"train-{rank}.npz"))
        save_examples(Path(files["train"][-1]), ids, lengths, dense, labels)
    ids, lengths, dense, labels, logit = gen.make(_SALT_TEST, np.arange(p["test"]))
    files["test"] = str(work / "test.npz")
    save_examples(Path(files["test"]), ids, lengths, dense, labels)
    files["labels"] = labels
    # what a batch looks like: unique ids per feature (a table's rows one step touches, per worker)
    first = ids[:p["batch"]]
    unique = [len(np.unique(first[:, f][first[:, f] >= 0])) for f in range(p["features"])]
    return {**files, "bayes_auc": auc(logit, labels), "positive_rate": float(labels.mean()),
            "unique_ids_per_feature_per_batch": float(np.mean(unique)), "ids_per_batch": int((first >= 0).sum())}


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Test AUC (task ctr's rank AUC, ties counted half), one function for both systems' scores."""
    return rank_auc(torch.from_numpy(np.asarray(scores, dtype=np.float64)), torch.from_numpy(labels))


# ---------------------------------------------------------------------------------------------
# psgrad's worker, in a process of its own


class PsgradNet(nn.Module):
    """The model with the layout's psgrad tables, and the dense part of lib/dlrm_model.py."""

    def __init__(self, layout: str, features: int, rows: int, dim: int) -> None:
        super().__init__()
        self.layout, self.features, self.dim = layout, features, dim
        self.arch = dense_arch(features, dim, SEED)
        if layout == "separate":
            self.tables = nn.ModuleList(psgrad.EmbeddingBag(rows, dim, mode="sum", std=INIT_STD)
                                        for _ in range(features))
        elif layout == "single":
            self.table = psgrad.EmbeddingBag(features * rows, dim, mode="sum", std=INIT_STD)
        else:
            self.collection = psgrad.EmbeddingBagCollection(
                {f"f{f}": (rows, dim) for f in range(features)}, mode="sum", std=INIT_STD, seed=0)

    def lookups(self, sparse: Any) -> dict[nn.Module, Any]:
        """What each psgrad module's forward takes for this input (opt.pipeline fetches it ahead)."""
        if self.layout == "separate":
            return {t: v for t, (v, _) in zip(self.tables, sparse, strict=True)}
        if self.layout == "single":
            return {self.table: sparse[0]}
        return {self.collection: sparse}

    def forward(self, dense: torch.Tensor, sparse: Any) -> torch.Tensor:
        B = dense.shape[0]
        if self.layout == "separate":
            pooled = torch.stack([t(v, o) for t, (v, o) in zip(self.tables, sparse, strict=True)], dim=1)
        elif self.layout == "single":  # bags feature after feature: [F * B, D] -> [B, F, D]
            pooled = self.table(*sparse).view(self.features, B, self.dim).transpose(0, 1)
        else:
            pooled = self.collection(sparse).view(B, self.features, self.dim)
        return self.arch(dense, pooled)


def psgrad_inputs(batch: Batch, layout: str, rows: int) -> Any:
    """The batch's ids as the layout's forward takes them (made before the clock starts)."""
    if layout == "separate":
        return list(zip(batch.values, batch.offsets))
    if layout == "collection":
        return {f"f{f}": (v, o) for f, (v, o) in enumerate(zip(batch.values, batch.offsets))}
    starts = np.cumsum([0] + [v.numel() for v in batch.values[:-1]])
    values = torch.cat([v + f * rows for f, v in enumerate(batch.values)])
    offsets = torch.cat([o + int(s) for o, s in zip(batch.offsets, starts)])
    return values, offsets


class PsgradAgent:
    """A psgrad worker answering the driver: run (train a job), eval (score the test set), close."""

    def __init__(self) -> None:
        self.session: Any = None
        self.opt: Any = None
        self.model: Any = None

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd["op"] == "run":
            return self.run(cmd)
        if cmd["op"] == "eval":
            return self.evaluate(cmd)
        raise BenchError(f"unknown op {cmd['op']!r}")

    def run(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.close()
        layout, pipelined = base_layout(cmd["layout"])
        inputs = [(b.dense, psgrad_inputs(b, layout, cmd["rows"]), b.labels) for b in training_batches(cmd)]
        self.model = PsgradNet(layout, cmd["features"], cmd["rows"], cmd["dim"])
        self.session = psgrad.connect(cmd["servers"], rank=cmd["rank"], num_workers=cmd["workers"], mode=cmd["mode"],
                                      optimizer=psgrad.Adagrad(lr=cmd["lr"], eps=cmd["eps"]),
                                      client=psgrad.ClientConfig(local_socket=not steps_over_grpc(cmd["layout"])))
        self.opt = self.session.optimizer(self.model)
        model = self.model
        loop = self.opt.pipeline(inputs, lambda b: model.lookups(b[1])) if pipelined else None
        trained = train(self.model, self.opt, inputs, cmd["warmup"], loop, watch=cmd["server_pids"] if cmd["rank"] == 0 else ())
        stepped = trained.pop("stepped")
        transports = self.opt.client.transports()
        prefetch = self.opt.prefetched.stats  # (rows fetched ahead: grouped forwards, served reads, unused rows)
        # (each shard's reads served in place and those handed to the shard: PullRows calls)
        lent = [s.rows_in_place for s in self.opt.client.shards if s.rows_in_place is not None]
        in_place = {"reads": sum(r.reads for r in lent), "missed": sum(r.missed for r in lent)}
        self.session.leave()
        if not cmd["evaluate"]:  # only the worker that scores the test set keeps its session
            self.close()
        return {**trained, "batch": cmd["batch"], "transports": transports,
                "exchange_ms_per_step": 1e3 * sum(s.wait_s or 0.0 for s in stepped) / len(stepped),
                "prefetch": dataclasses.asdict(prefetch), "rows_in_place": in_place}

    def evaluate(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """The servers' latest weights (every worker's pushes), the test set's scores to a file."""
        self.opt.refresh()
        self.model.eval()
        with torch.no_grad():
            scores = torch.cat([self.model(b.dense, psgrad_inputs(b, base_layout(cmd["layout"])[0], cmd["rows"]))
                                for b in load_batches(cmd["test"], cmd["eval_batch"])])
        np.save(cmd["scores"], scores.numpy())
        self.close()
        return {"scored": int(scores.numel())}

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
        self.session = self.opt = self.model = None


def server_host_main() -> None:
    """A shard server's process, kept from run to run: "start" serves a fresh shard in it (what
    `psgrad server` runs: psgrad.serve, torch on one thread) and answers its address; "stop" stops
    it. A server holds one job for life, and a process of its own per run costs seconds of start."""
    torch.set_num_threads(1)
    running: list[Any] = []

    def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd["op"] == "start":
            running.append(psgrad.serve(lease_s=600.0))
            return {"address": running[-1].address}
        if cmd["op"] == "stop":
            while running:
                running.pop().stop()
            return {}
        raise BenchError(f"unknown op {cmd['op']!r}")

    try:
        command_loop(handle)
    finally:
        for server in running:
            server.stop()
    exit_now()


def agent_main(bind_rank: int | None = None) -> None:
    torch.set_num_threads(1)
    if bind_rank is not None:  # (before any thread starts: psgrad's threads inherit the binding)
        psgrad.bind_cores(bind_rank, WORKERS)
    agent = PsgradAgent()
    try:
        command_loop(agent.handle)
    finally:
        agent.close()
    exit_now()


# ---------------------------------------------------------------------------------------------
# The driver


def window(replies: list[dict[str, Any]]) -> dict[str, Any]:
    """Samples/s of one run: every worker's timed samples over the window from the first worker's
    first timed step to the last worker's end."""
    start, end = min(r["start"] for r in replies), max(r["end"] for r in replies)
    samples = sum(r["steps"] * r["batch"] for r in replies)
    # CPU per 1,000 samples: the workers' own, and the servers' (read by worker 0 over its window)
    cpu = {"workers": 1e6 * sum(r["cpu_s"] for r in replies) / samples,
           "servers": 1e6 * sum(r["watched_cpu_s"] for r in replies) / samples}
    return {"samples_per_s": samples / (end - start), "window_s": end - start, "samples": samples,
            "cpu_ms_per_1k_samples": cpu,
            "per_worker_samples_per_s": [r["steps"] * r["batch"] / (r["end"] - r["start"]) for r in replies],
            "losses": [r["losses"] for r in replies], "loss_last": [r["losses"][-1] for r in replies],
            "prefetch": [r.get("prefetch") for r in replies],
            "phase_ms_per_step": {k: sum(r["phase_ms_per_step"][k] for r in replies) / len(replies)
                                  for k in replies[0]["phase_ms_per_step"]}}


def torchrec_probe(python: str | None) -> dict[str, Any]:
    """Whether TorchRec's interpreter is there and loads torchrec; its versions, or why it is skipped."""
    if not python or not Path(python).exists():
        return {"available": False, "python": python,
                "skipped": f"no TorchRec interpreter ({python or 'none given'}); make one with: {TORCHREC_INSTALL}"}
    code = ("import json, importlib.metadata as m, torchrec, fbgemm_gpu, torch; print(json.dumps({d: m.version(d) "
            "for d in ('torch', 'torchrec', 'fbgemm-gpu-cpu', 'numpy')}))")
    res = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=SETUP_TIMEOUT_S,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if res.returncode != 0:
        return {"available": False, "python": python, "skipped": f"{python} does not load torchrec "
                f"({res.stderr.strip().splitlines()[-1] if res.stderr.strip() else res.returncode}); make it with: "
                f"{TORCHREC_INSTALL}"}
    return {"available": True, "python": python, "versions": json.loads(res.stdout.strip().splitlines()[-1])}


class Runner:
    """The worker processes of both systems (started once, for every run), and one run at a time."""

    def __init__(self, p: dict[str, Any], data: dict[str, Any], work: Path, torchrec_python: str | None,
                 bind: bool = False) -> None:
        """bind: each worker of either system on its share of the host's cores (psgrad.bind_cores'
        rule, rank r of WORKERS), the servers on every core."""
        self.p, self.data, self.work = p, data, work
        me = str(Path(__file__).resolve())
        self.agents = [Child(f"psgrad-worker-{r}", [sys.executable, me, "--agent",
                                                    *(["--bind-rank", str(r)] if bind else [])]) for r in range(WORKERS)]
        self.servers = [Child(f"psgrad-server-{i}", [sys.executable, me, "--server-host"]) for i in range(WORKERS)]
        self.torchrec: list[Child] = []
        if torchrec_python:
            store = str(work / "torchrec-store")
            self.torchrec = [Child(f"torchrec-{r}", [torchrec_python, str(TORCHREC_WORKER), "--rank", str(r),
                                                     "--world", str(WORKERS), "--store", store,
                                                     *(["--bind-cores"] if bind else [])])
                             for r in range(WORKERS)]
        self.runs = 0

    def children(self) -> list[Child]:
        return [*self.agents, *self.servers, *self.torchrec]

    def common(self) -> dict[str, Any]:
        return {**{k: self.p[k] for k in ("features", "rows", "dim", "batch", "warmup", "steps", "eval_batch")},
                "lr": LR, "eps": EPS, "seed": SEED, "test": self.data["test"]}

    def run_psgrad(self, mode: str, layout: str) -> dict[str, Any]:
        self.runs += 1
        addresses = [s.call({"op": "start"}, SETUP_TIMEOUT_S)["address"] for s in self.servers]
        try:
            cmds = [{"op": "run", **self.common(), "servers": addresses, "rank": r, "workers": WORKERS, "mode": mode,
                     "layout": layout, "train": self.data["train"][r], "evaluate": r == 0,
                     "server_pids": [s.popen.pid for s in self.servers]} for r in range(WORKERS)]
            with paused(self.torchrec):
                replies = run_together(self.agents, cmds, SETUP_TIMEOUT_S + 900)
                scores = self.work / f"scores-{self.runs}.npy"
                self.agents[0].call({"op": "eval", **self.common(), "layout": layout, "scores": str(scores)},
                                    SETUP_TIMEOUT_S)
        finally:
            for s in self.servers:
                s.call({"op": "stop"}, SETUP_TIMEOUT_S)
        return {**window(replies), "test_auc": auc(np.load(scores), self.data["labels"]),
                "exchange_ms_per_step": [r["exchange_ms_per_step"] for r in replies],
                "rows_in_place": [r["rows_in_place"] for r in replies],
                "transports": replies[0]["transports"]}

    def run_torchrec(self) -> dict[str, Any]:
        self.runs += 1
        scores = self.work / f"scores-{self.runs}.npy"
        cmds = [{"op": "run", **self.common(), "train": self.data["train"][r], "scores": str(scores)}
                for r in range(WORKERS)]
        with paused([*self.agents, *self.servers]):  # (the servers' processes: no server runs in them now)
            replies = run_together(self.torchrec, cmds, SETUP_TIMEOUT_S + 900)
        return {**window(replies), "test_auc": auc(np.load(scores), self.data["labels"]), "plan": replies[0]["plan"],
                "backend": replies[0]["backend"]}


def run_key(system: str, mode: str = "", layout: str = "") -> str:
    return TORCHREC if system == TORCHREC else f"psgrad {mode} {layout}"


def schedule(modes: list[str], layouts: list[str], with_torchrec: bool) -> list[str]:
    """One repetition's runs: each psgrad (mode, layout), each followed by TorchRec when it runs."""
    runs = []
    for layout in layouts:
        for mode in modes:
            runs.append(run_key("psgrad", mode, layout))
            if with_torchrec:
                runs.append(TORCHREC)
    return runs


def measure(p: dict[str, Any], layouts: list[str], torchrec: dict[str, Any], zipf: float,
            bind: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="psgrad-dlrm-") as tmp:
        work = Path(tmp)
        t0 = time.monotonic()
        data = write_data(p, zipf, work)
        log(f"dlrm: data written in {time.monotonic() - t0:.1f} s: {WORKERS} x {p['warmup'] + p['steps']} batches of "
            f"{p['batch']}, {p['test']:,} test examples (planted AUC {data['bayes_auc']:.4f}, "
            f"{data['unique_ids_per_feature_per_batch']:.0f} unique ids per feature and batch)")
        runner = Runner(p, data, work, torchrec["python"] if torchrec["available"] else None, bind)
        runs: list[dict[str, Any]] = []
        order = schedule(p["modes"], layouts, torchrec["available"])
        try:
            for rep in range(1, p["reps"] + 1):
                for i, key in enumerate(rep_order(order, rep)):
                    t1 = time.monotonic()
                    if key == TORCHREC:
                        row = {"system": TORCHREC, "mode": "sync", "layout": "table-wise", **runner.run_torchrec()}
                    else:
                        _, mode, layout = key.split()
                        row = {"system": "psgrad", "mode": mode, "layout": layout, **runner.run_psgrad(mode, layout)}
                    runs.append({"key": key, "rep": rep, **row, "run_s": time.monotonic() - t1,
                                 "loadavg": list(os.getloadavg())})
                    log(f"dlrm: rep {rep}/{p['reps']} run {i + 1}/{len(order)} {key}: {row['samples_per_s']:,.0f} "
                        f"samples/s, test AUC {row['test_auc']:.4f} ({time.monotonic() - t1:.0f} s)")
        finally:
            stop_all(runner.children())
        return {"runs": runs, "data": {k: v for k, v in data.items() if k not in ("train", "test", "labels")}}


def loss_gaps(runs: list[dict[str, Any]]) -> None:
    """A psgrad sync run trains the model TorchRec trains, on the same examples from the same
    initial weights: each worker's loss, step by step, differs only by the order of float sums.
    Adds the largest difference from the first TorchRec run to each sync run, then drops the losses."""
    base = next((r for r in runs if r["system"] == TORCHREC), None)
    for r in runs:
        if base is not None and r["system"] == "psgrad" and r["mode"] == "sync":
            pairs = zip(r["losses"], base["losses"], strict=True)  # per worker
            r["max_loss_gap_vs_torchrec"] = max(abs(a - b) for mine, theirs in pairs
                                                for a, b in zip(mine, theirs, strict=True))
    for r in runs:
        del r["losses"]


def summarize_runs(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per system/mode/layout: medians (and ranges) over repetitions."""
    out: dict[str, dict[str, Any]] = {}
    for key in dict.fromkeys(r["key"] for r in runs):
        mine = [r for r in runs if r["key"] == key]
        speed, aucs = summarize([r["samples_per_s"] for r in mine]), summarize([r["test_auc"] for r in mine])
        out[key] = {"system": mine[0]["system"], "mode": mine[0]["mode"], "layout": mine[0]["layout"],
                    "runs": len(mine), "samples_per_s": speed["median"], "samples_per_s_min": speed["min"],
                    "samples_per_s_max": speed["max"], "test_auc": aucs["median"], "test_auc_min": aucs["min"],
                    "test_auc_max": aucs["max"]}
        for role in ("workers", "servers"):
            out[key][f"cpu_ms_per_1k_samples_{role}"] = summarize([r["cpu_ms_per_1k_samples"][role] for r in mine])["median"]
        if mine[0]["system"] == "psgrad":
            out[key]["transports"] = mine[0]["transports"]
        gaps = [r["max_loss_gap_vs_torchrec"] for r in mine if "max_loss_gap_vs_torchrec" in r]
        if gaps:
            out[key]["max_loss_gap_vs_torchrec"] = max(gaps)
    return out


def paired_ratios(runs: list[dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """Per psgrad run key, each of its runs' samples/s over the peer that ran beside it: "torchrec",
    over the TorchRec runs just before and just after it in time (their mean where both ran; the
    runs alternate, so every psgrad run has one or two); "single", a layout's over the one table's
    run of its mode in the same repetition. Run after run, what a shared machine's slow and fast
    phases do to both sides of a pair alike cancels out, which the ratio of two medians taken over
    the whole measurement does not: how steady a ratio is reads from these. `runs` in the order
    they ran."""
    out: dict[str, dict[str, list[float]]] = {}
    for i, r in enumerate(runs):
        if r["system"] != "psgrad":
            continue
        mine = out.setdefault(r["key"], {"torchrec": [], "single": []})
        beside = [runs[j]["samples_per_s"] for j in (i - 1, i + 1)
                  if 0 <= j < len(runs) and runs[j]["system"] == TORCHREC]
        if beside:
            mine["torchrec"].append(r["samples_per_s"] / (sum(beside) / len(beside)))
        if r["layout"] != "single":
            single = next((s for s in runs if s["system"] == "psgrad" and s["rep"] == r["rep"]
                           and s["mode"] == r["mode"] and s["layout"] == "single"), None)
            if single is not None:
                mine["single"].append(r["samples_per_s"] / single["samples_per_s"])
    return out


def compare(results: dict[str, dict[str, Any]],
            paired: dict[str, dict[str, list[float]]] | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Ratios to TorchRec and to the single table, with the goals' rows (not for `+grpc` layouts:
    comparisons, not psgrad as it runs); each ratio of medians with the run-by-run ratios to the
    same peer (`paired`: paired_ratios of the runs), where there are some."""
    ratios: dict[str, Any] = {}
    targets: list[dict[str, Any]] = []
    base = results.get(TORCHREC)
    paired = paired or {}
    for key, r in results.items():
        if r["system"] != "psgrad":
            continue
        goals = targets if not steps_over_grpc(r["layout"]) else []
        pairs = paired.get(key, {})
        if base:
            gap = r["test_auc"] - base["test_auc"]
            ratios[f"{key} / torchrec"] = {"samples_per_s": r["samples_per_s"] / base["samples_per_s"], "auc_gap": gap}
            goals.append(target(f"DLRM samples/s, {key} vs TorchRec DMP table-wise", r["samples_per_s"],
                                base["samples_per_s"], GOAL_SPEED, "higher", "samples/s", "TorchRec DMP"))
            if pairs.get("torchrec"):
                ratios[f"{key} / torchrec"]["paired"] = goals[-1]["paired"] = run_by_run(pairs["torchrec"], GOAL_SPEED)
            goals.append({"name": f"DLRM test AUC, {key} vs TorchRec", "value": r["test_auc"],
                          "ceiling": base["test_auc"], "gap": gap, "target": GOAL_AUC_GAP, "better": "within",
                          "met": abs(gap) <= GOAL_AUC_GAP, "unit": "AUC", "ceiling_name": "TorchRec DMP"})
        single = results.get(run_key("psgrad", r["mode"], "single"))
        if r["layout"] != "single" and single:
            ratios[f"{key} / single"] = {"samples_per_s": r["samples_per_s"] / single["samples_per_s"],
                                         "auc_gap": r["test_auc"] - single["test_auc"]}
            goals.append(target(f"DLRM samples/s, psgrad {r['mode']}: {r['layout']} tables vs one table",
                                r["samples_per_s"], single["samples_per_s"], GOAL_LAYOUT, "higher", "samples/s",
                                f"psgrad {r['mode']} single"))
            if pairs.get("single"):
                ratios[f"{key} / single"]["paired"] = goals[-1]["paired"] = run_by_run(pairs["single"], GOAL_LAYOUT)
    return ratios, targets


def table(doc: dict[str, Any]) -> str:
    """The medians as a fixed-width table, then the goals."""
    p = doc["config"]

    def ratio(key: str, field: str, fmt: str) -> str:
        r = doc["ratios"].get(key)
        return format(r[field], fmt) if r else ""

    lines = [f"DLRM, {p['features']} tables of {p['rows']:,} x {p['dim']}, batch {p['batch']} x {WORKERS} workers, "
             f"{p['steps']} timed steps after {p['warmup']}; medians of {p['reps']} repetitions "
             f"(planted AUC {doc['data']['bayes_auc']:.4f})"
             f"{'; each worker bound to its cores (--bind-cores)' if p.get('bind_cores') else ''}",
             f"{'run':<26} {'samples/s':>10} {'range':>17} {'test AUC':>9} {'/TorchRec':>9} {'AUC gap':>8} "
             f"{'/single':>8} {'CPU ms/1k samples: workers+servers':>34}"]
    for key, r in doc["results"].items():
        span = f"{r['samples_per_s_min']:,.0f}-{r['samples_per_s_max']:,.0f}"
        lines.append(f"{key:<26} {r['samples_per_s']:10,.0f} {span:>17} {r['test_auc']:9.4f} "
                     f"{ratio(key + ' / torchrec', 'samples_per_s', '.2f'):>9} "
                     f"{ratio(key + ' / torchrec', 'auc_gap', '+.4f'):>8} "
                     f"{ratio(key + ' / single', 'samples_per_s', '.2f'):>8} "
                     f"{r['cpu_ms_per_1k_samples_workers']:>22.1f}+{r['cpu_ms_per_1k_samples_servers']:<11.1f}")
    for key, why in doc["skipped"].items():
        lines.append(f"{key:<26} skipped: {why}")
    for t in doc["targets"]:
        shown = round(t.get("gap", 0.0), 4)  # (as printed: a gap of +0.0000 is equal)
        side = "psgrad's higher" if shown > 0 else "psgrad's lower" if shown < 0 else "equal"
        got = (f"AUC gap {t['gap']:+.4f}, {side} (goal within {t['target']})" if t["better"] == "within"
               else f"{t['ratio']:.2f} (goal >= {t['target']})")
        pairs = t.get("paired")
        if pairs and pairs["n"] > 1:
            got += (f"; run by run, beside its peer: {pairs['min']:.2f}-{pairs['max']:.2f}, median "
                    f"{pairs['median']:.2f}, {pairs['at_goal']} of {pairs['n']} at the goal")
        lines.append(f"goal {'met' if t['met'] else 'MISSED'}: {t['name']}: {got}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_preset(parser, PRESETS, "table sizes, steps and repetitions")
    parser.add_argument("--features", type=int,
                        help="override the categorical features, one table each (8; Criteo's click logs have 26)")
    parser.add_argument("--rows", type=int, help="override the rows of each feature's table")
    parser.add_argument("--dim", type=int, help="override the embedding width")
    parser.add_argument("--batch", type=int, help="override the batch per worker")
    parser.add_argument("--warmup", type=int, help="override the untimed steps per run")
    parser.add_argument("--steps", type=int, help="override the timed steps per run")
    parser.add_argument("--test", type=int, help="override the test examples (a multiple of 2 x eval batch)")
    parser.add_argument("--reps", type=int, help="override the repetitions")
    parser.add_argument("--layouts", type=lambda s: s.split(","), help=f"psgrad's tables: of {', '.join(LAYOUTS)}; "
                        "any of them +grpc: the workers' Step calls through gRPC, not the servers' local sockets")
    parser.add_argument("--modes", type=lambda s: s.split(","), help=f"psgrad's modes: of {', '.join(MODES)}")
    parser.add_argument("--zipf", type=float, default=ZIPF_S, help=f"the ids' power-law exponent (default {ZIPF_S})")
    default_python = TORCHREC_VENV / "bin" / "python"
    parser.add_argument("--torchrec-python", default=str(default_python) if default_python.exists() else None,
                        help=f"TorchRec's interpreter (default: {default_python} when it exists)")
    parser.add_argument("--no-torchrec", action="store_true", help="measure psgrad alone")
    parser.add_argument("--bind-cores", action=argparse.BooleanOptionalAction, default=False,
                        help="bind each worker of both systems to its share of the host's cores (psgrad.bind_cores' rule: "
                        "rank r of 2 on the r-th half), the servers left on every core; without it the kernel places "
                        "every process (default: off)")
    parser.add_argument("--agent", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bind-rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--server-host", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.agent or args.server_host:
        agent_main(args.bind_rank) if args.agent else server_host_main()
        return
    p = overrides(args, PRESETS[args.preset])
    bad = sorted({layout for layout in p["layouts"] if layout.removesuffix("+grpc") not in LAYOUTS}) + sorted(
        set(p["modes"]) - set(MODES))
    if bad:
        parser.error(f"unknown layouts or modes: {', '.join(bad)}")
    if min(p["features"], p["rows"], p["dim"], p["batch"], p["steps"], p["reps"]) < 1 or p["warmup"] < 0 or args.zipf <= 1:
        parser.error("features, rows, dim, batch, steps and reps must be >= 1, warmup >= 0, --zipf > 1")
    if p["test"] % (WORKERS * p["eval_batch"]):
        parser.error(f"--test must be a multiple of {WORKERS * p['eval_batch']} (TorchRec's ranks score halves)")
    load_before, t0 = list(os.getloadavg()), time.monotonic()
    skipped: dict[str, str] = {}
    layouts = list(p["layouts"])
    if "collection" in layouts and getattr(psgrad, "EmbeddingBagCollection", None) is None:
        layouts.remove("collection")
        why = "psgrad.EmbeddingBagCollection does not exist in this psgrad"
        for mode in p["modes"]:
            skipped[run_key("psgrad", mode, "collection")] = why
    torchrec = ({"available": False, "python": args.torchrec_python, "skipped": "--no-torchrec"} if args.no_torchrec
                else torchrec_probe(args.torchrec_python))
    if not torchrec["available"]:
        skipped[TORCHREC] = torchrec["skipped"]
        log(f"dlrm: TorchRec skipped: {torchrec['skipped']}")
    measured = measure(p, layouts, torchrec, args.zipf, args.bind_cores)
    loss_gaps(measured["runs"])
    results = summarize_runs(measured["runs"])
    ratios, targets = compare(results, paired_ratios(measured["runs"]))
    doc = {"benchmark": "dlrm", "preset": args.preset,
           "config": {**p, "layouts": layouts, "zipf": args.zipf, "bind_cores": args.bind_cores, "lr": LR, "eps": EPS,
                      "workers": WORKERS, "psgrad_servers": WORKERS, "max_bag": MAX_BAG, "dense_features": DENSE, "init_std": INIT_STD},
           "optimizers": {"psgrad": "psgrad.Adagrad on the servers: the dense weights, and the rows per element "
                                    "with lazy per-row state",
                          "torchrec": "tables: fbgemm's fused EXACT_ADAGRAD (per element), applied in the backward; "
                                      "dense part: torch.optim.Adagrad after DDP's all-reduce (gloo)"},
           "transport_note": "psgrad's transports: per shard, how the dense weights and gradients travelled ('shm': "
                             "same-host shared memory, psgrad's default; 'grpc': inside the messages); pushed rows "
                             "travel in the push's header, rows read in a Step call come back through a segment "
                             "with 'shm' and in the reply with 'grpc'",
           "machine": machine_info(), "code": code_version(), "loadavg_before": load_before,
           "loadavg_after": list(os.getloadavg()), "torchrec": torchrec, "data": measured["data"],
           "results": results, "ratios": ratios, "targets": targets, "skipped": skipped,
           "goals": {"samples_per_s_vs_torchrec": GOAL_SPEED, "auc_gap_within": GOAL_AUC_GAP,
                     "separate_vs_single": GOAL_LAYOUT},
           "runs": measured["runs"], "elapsed_s": time.monotonic() - t0}
    print(table(doc), file=sys.stderr, flush=True)
    write_json(doc)


if __name__ == "__main__":
    main()
