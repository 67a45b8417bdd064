"""Task "charlm": a byte-level decoder-only transformer language model trained on the Python standard
library's own source files (every install has them: sysconfig.get_paths()["stdlib"]).

The .py files (tests, site-packages and third-party code left out) are split by file with a fixed
seed: 90% to train, 10% to validate. An example is a window of CONTEXT + 1 bytes (predict bytes
1..CONTEXT from 0..CONTEXT-1); the training windows are views of one byte buffer, served by a Dataset
(not a tensor of examples). The metric is validation loss in bits per byte, on a fixed sample of
EVAL_WINDOWS windows of the validation files.
"""
from __future__ import annotations

import math
import sysconfig
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from psgrad.errors import TaskError
from psgrad.tasks.base import Task, register_task

CONTEXT = 64
VOCAB = 256
SPLIT_SEED = 0  # the file split and the validation sample are fixed, independent of the run's seed
VALID_FRACTION = 0.1
EVAL_WINDOWS = 512
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3", "turtledemo"}


class Block(nn.Module):
    """Pre-norm transformer block: causal multi-head self-attention and a GELU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class ByteTransformer(nn.Module):
    """Bytes (N, T) -> next-byte logits (N, T, 256): embeddings, learned positions, blocks, head."""

    def __init__(self, dim: int = 96, layers: int = 2, heads: int = 4, context: int = CONTEXT) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.pos = nn.Parameter(torch.randn(context, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.long()) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross entropy (nats per byte)."""
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1).long())


class Windows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Example i: bytes [i*CONTEXT, i*CONTEXT + CONTEXT] of a buffer, as (input, next bytes)."""

    def __init__(self, data: torch.Tensor, context: int = CONTEXT) -> None:
        self.data, self.context = data, context
        self.count = (len(data) - 1) // context

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.count:
            raise IndexError(i)
        w = self.data[i * self.context : i * self.context + self.context + 1]
        return w[:-1], w[1:]


def stdlib_files(root: Path) -> list[Path]:
    """The standard library's own .py files under root, sorted (tests and installed packages left out)."""
    return sorted(p for p in root.rglob("*.py") if not SKIP_DIRS.intersection(p.relative_to(root).parts[:-1]))


def _concat(files: list[Path]) -> torch.Tensor:
    blob = b"".join(p.read_bytes() + b"\n" for p in files)
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


class CharLMTask(Task):
    """Evaluation in bits per byte (and next-byte accuracy) over windows of the validation files."""

    def evaluate_on(self, model: nn.Module, device: torch.device, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        was_training = model.training
        model.eval()
        nats, correct = 0.0, 0.0
        with torch.no_grad():
            for lo in range(0, len(x), self.eval_batch_size):
                xb, yb = x[lo : lo + self.eval_batch_size].to(device), y[lo : lo + self.eval_batch_size].to(device)
                logits = model(xb)
                nats += float(lm_loss(logits, yb)) * yb.numel()
                correct += float((logits.argmax(-1) == yb.long()).sum())
        model.train(was_training)
        total = y.numel()
        return {"test_loss": nats / total, "test_bpb": nats / total / math.log(2), "test_accuracy": correct / total}


@register_task("charlm")  # its recipe: psgrad/tasks/registry.py
def charlm_task(seed: int = 0) -> Task:
    """About 10 MB of training text (CPython 3.11's standard library) and 512 validation windows."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)
    if len(files) < 20:
        raise TaskError(f"task 'charlm' found only {len(files)} .py files under {root} (the standard library)")
    order = torch.randperm(len(files), generator=torch.Generator().manual_seed(SPLIT_SEED)).tolist()
    n_valid = max(1, int(len(files) * VALID_FRACTION))
    valid = Windows(_concat([files[i] for i in sorted(order[:n_valid])]))
    train = _concat([files[i] for i in sorted(order[n_valid:])])
    pick = torch.randperm(len(valid), generator=torch.Generator().manual_seed(SPLIT_SEED))[:EVAL_WINDOWS]
    test = torch.stack([valid.data[i * CONTEXT : i * CONTEXT + CONTEXT + 1] for i in pick.tolist()])
    return CharLMTask(name="charlm", build_model=ByteTransformer, train_set=Windows(train), test_x=test[:, :-1],
                      test_y=test[:, 1:], loss_fn=lm_loss, eval_batch_size=128)
