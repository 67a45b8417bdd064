"""What benchmarks/dlrm.py's two sides share: the examples' files, their batches, and the dense part
of the model (bottom MLP, DLRM dot interaction, top MLP). torch and numpy only: TorchRec's workers
(lib/torchrec_worker.py) import it from TorchRec's own interpreter, which has no psgrad.

An examples file (.npz, written by the driver) holds N examples of F categorical features:
`ids` [N, F, MAX_BAG] int64 (a bag's ids first, the rest -1), `lengths` [N, F] int64 (1..MAX_BAG),
`dense` [N, DENSE] float32, `labels` [N] float32.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

try:  # (imported as lib.dlrm_model beside psgrad; as dlrm_model from TorchRec's interpreter, lib's folder on its path)
    from lib.procfs import cpu_seconds
except ImportError:
    from procfs import cpu_seconds  # type: ignore[no-redef]

DENSE = 13  # dense features per example
MAX_BAG = 3  # ids per bag: 1..MAX_BAG
BOTTOM, TOP = 64, 64  # hidden widths of the bottom and top MLPs
# The embedding rows' initial spread: psgrad draws N(0, std^2) from (seed, table, id), TorchRec
# uniform numbers with the same variance, which cannot be the same rows; at 0 both start from the
# same (zero) rows, as they do from the same dense weights, and a sync run differs from TorchRec's
# only by the order of float sums. (Training moves off zero: the pooled bags' products with the
# bottom MLP's output give them their first gradients.)
INIT_STD = 0.0


@dataclass(frozen=True)
class Batch:
    """One batch: per feature its bags' ids (values, example-major) and where each bag starts."""

    dense: torch.Tensor  # [B, DENSE] float32
    labels: torch.Tensor  # [B] float32
    values: list[torch.Tensor]  # per feature: 1-D int64 ids
    lengths: list[torch.Tensor]  # per feature: [B] int64 ids per bag
    offsets: list[torch.Tensor]  # per feature: [B] int64 start of each bag in values

    @property
    def size(self) -> int:
        return int(self.labels.numel())


def save_examples(path: Path, ids: np.ndarray, lengths: np.ndarray, dense: np.ndarray, labels: np.ndarray) -> None:
    np.savez(path, ids=ids.astype(np.int64), lengths=lengths.astype(np.int64), dense=dense.astype(np.float32),
             labels=labels.astype(np.float32))


def load_batches(path: str | Path, batch: int) -> list[Batch]:
    """The file's examples cut into batches of `batch` (the last one may be smaller), made up front
    so that a timed step does no data work."""
    with np.load(path) as f:
        ids, lengths, dense, labels = f["ids"], f["lengths"], f["dense"], f["labels"]
    out = []
    slots = np.arange(MAX_BAG)
    for lo in range(0, len(labels), batch):
        hi = min(lo + batch, len(labels))
        values, lens, offsets = [], [], []
        for f_ in range(ids.shape[1]):
            n = lengths[lo:hi, f_]
            values.append(torch.from_numpy(np.ascontiguousarray(ids[lo:hi, f_][slots < n[:, None]])))
            lens.append(torch.from_numpy(np.ascontiguousarray(n)))
            offsets.append(torch.from_numpy(np.concatenate([[0], np.cumsum(n)[:-1]]).astype(np.int64)))
        out.append(Batch(torch.from_numpy(dense[lo:hi].copy()), torch.from_numpy(labels[lo:hi].copy()),
                         values, lens, offsets))
    return out


def training_batches(cmd: dict[str, Any]) -> list[Batch]:
    """The warmup + steps batches a run's command names (its worker's examples file, its batch size).

    Raises:
        ValueError: the file holds fewer.
    """
    need = cmd["warmup"] + cmd["steps"]
    batches = load_batches(cmd["train"], cmd["batch"])[:need]
    if len(batches) < need:
        raise ValueError(f"{cmd['train']} holds {len(batches)} batches of {cmd['batch']}, the run needs {need}")
    return batches


class DenseArch(nn.Module):
    """DLRM's dense part: a bottom MLP of the dense features to one more D-vector, the pairwise dot
    products of the F + 1 vectors, and a top MLP of [bottom output, products] to one logit."""

    pairs: torch.Tensor

    def __init__(self, features: int, dim: int) -> None:
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(DENSE, BOTTOM), nn.ReLU(), nn.Linear(BOTTOM, dim), nn.ReLU())
        self.register_buffer("pairs", torch.triu_indices(features + 1, features + 1, 1), persistent=False)
        self.top = nn.Sequential(nn.Linear(self.pairs.shape[1] + dim, TOP), nn.ReLU(), nn.Linear(TOP, 1))

    def forward(self, dense: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """Logits [B] of dense [B, DENSE] and the pooled embeddings [B, F, D]."""
        d = self.bottom(dense)
        z = torch.cat([d.unsqueeze(1), pooled], dim=1)  # [B, F + 1, D]
        inter = torch.bmm(z, z.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]
        return self.top(torch.cat([d, inter], dim=1)).squeeze(1)


def dense_arch(features: int, dim: int, seed: int) -> DenseArch:
    """The dense part with the same initial weights on both sides (torch's init from `seed`)."""
    torch.manual_seed(seed)
    return DenseArch(features, dim)


def bce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, labels)


def train(model: nn.Module, opt: Any, inputs: Sequence[tuple[torch.Tensor, Any, torch.Tensor]],
          warmup: int, loop: Iterable[tuple[torch.Tensor, Any, torch.Tensor]] | None = None,
          watch: Sequence[int] = ()) -> dict[str, Any]:
    """Train on inputs, (dense, the model's sparse input, labels) a step, as `loop` yields them if
    given (psgrad's opt.pipeline of them); the steps after `warmup` are timed: their window on
    time.monotonic (one clock for every process of the host), the wall time of their forwards,
    backwards and optimizer steps, what each opt.step() returned, and the CPU seconds this process
    and the processes `watch` (pids on this host: the servers) spent in the window."""
    losses: list[float] = []
    stepped: list[Any] = []
    phases = {"forward": 0.0, "backward": 0.0, "step": 0.0}
    start = cpu = watched = 0.0
    model.train()
    for i, (dense, sparse, labels) in enumerate(inputs if loop is None else loop):
        if i == warmup:
            start = time.monotonic()
            cpu, watched = time.process_time(), sum(cpu_seconds(pid) for pid in watch)
            phases = dict.fromkeys(phases, 0.0)
            stepped.clear()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = bce(model(dense, sparse), labels)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        stepped.append(opt.step())
        t3 = time.perf_counter()
        for name, took in (("forward", t1 - t0), ("backward", t2 - t1), ("step", t3 - t2)):
            phases[name] += took
        losses.append(float(loss.detach()))
    timed = len(inputs) - warmup
    return {"start": start, "end": time.monotonic(), "steps": timed, "losses": losses, "stepped": stepped,
            "phase_ms_per_step": {k: 1e3 * v / timed for k, v in phases.items()},
            "cpu_s": time.process_time() - cpu, "watched_cpu_s": sum(cpu_seconds(pid) for pid in watch) - watched}
