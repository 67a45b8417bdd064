"""Task "pyfunc": which package of the Python standard library a function comes from, told from the
words in its source — a sparse task on real text that every Python install carries.

Data: the functions (and methods) of PACKAGES, twelve packages of the standard library
(`sysconfig.get_paths()["stdlib"]`; their tests left out); the label is the package. Each
package's files are split with a fixed seed, about 80 % of its functions to train and 20 % to test,
so no file gives examples to both (CPython 3.11: about 6,000 functions). An example's features are the first MAX_WORDS identifiers of its
source (names, attributes, keywords) and the pairs of consecutive ones, each hashed to a 64-bit id
(two CRC-32s: stable across processes and machines), padded with id 0: unbounded, never-seen ids
arrive in the test files, as hashed features of recommender traffic do.

Model: fastText-like. A psgrad.EmbeddingBag(None, DIM) — a dynamic table, any int64 id, rows on the
servers stored as they are updated — averages an example's rows (padding left out), and a linear
layer gives the package's logits. The dense variant (what the all-reduce baseline trains) is the
hashing trick: a torch.nn.EmbeddingBag of DENSE_ROWS rows indexed by id mod DENSE_ROWS (collisions).
"""
from __future__ import annotations

import ast
import re
import zlib
from pathlib import Path

import torch
from torch import nn

from psgrad.errors import TaskError
from psgrad.nn.embedding import EmbeddingBag
from psgrad.tasks.base import Task, register_task
from psgrad.tasks.files import STDLIB_PACKAGES, stdlib_packages

PACKAGES = STDLIB_PACKAGES
SKIP_DIRS = {"test", "tests", "idle_test", "__pycache__"}
MAX_WORDS = 64
WIDTH = 2 * MAX_WORDS - 1  # ids per example: the words and their consecutive pairs
DIM = 32
DENSE_ROWS = 1 << 18
SPLIT_SEED = 0
TEST_FRACTION = 0.2
_WORD = re.compile(rb"[A-Za-z_][A-Za-z0-9_]*")
_SECOND = 0x5BD1E995  # the second CRC's start value


def word_id(word: bytes) -> int:
    """A word's (or a pair's) 64-bit id, as a signed int64, never 0 (the padding) nor one of the two
    ids a dynamic table cannot hold (int64's two smallest)."""
    value = (zlib.crc32(word) << 32) | zlib.crc32(word, _SECOND)
    value = value - (1 << 64) if value >= 1 << 63 else value
    return value if value not in (0, -(1 << 63), -(1 << 63) + 1) else 1


def features(source: bytes) -> list[int]:
    """The ids of a function's source: its first MAX_WORDS words, then its consecutive pairs."""
    words = _WORD.findall(source)[:MAX_WORDS]
    return [word_id(w) for w in words] + [word_id(a + b" " + b) for a, b in zip(words, words[1:])]


def package_files(root: Path) -> list[tuple[Path, int]]:
    """(file, its package's index in PACKAGES) of every .py file of the packages under root, sorted."""
    return [(p, label) for label, name in enumerate(PACKAGES) for p in sorted((root / name).rglob("*.py"))
            if not SKIP_DIRS.intersection(p.relative_to(root).parts)]


def functions(path: Path) -> list[list[int]]:
    """The ids of every function (and method) of a file, padded with 0 to WIDTH (none if it does not parse)."""
    source = path.read_bytes()
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
            ids = features(b"\n".join(lines[node.lineno - 1 : node.end_lineno]))
            out.append(ids + [0] * (WIDTH - len(ids)))
    return out


def split(files: list[tuple[Path, int]]) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(train x, y), (test x, y): per package, its files in a fixed random order go to the test set
    until it holds about TEST_FRACTION of the package's functions (a file that would take it past 1.5
    times that goes to training; at least one file is tested), so no file gives examples to both."""
    by_package: dict[int, list[list[list[int]]]] = {}
    for path, label in files:
        found = functions(path)
        if found:
            by_package.setdefault(label, []).append(found)
    sides: tuple[list[list[int]], list[int], list[list[int]], list[int]] = ([], [], [], [])
    rng = torch.Generator().manual_seed(SPLIT_SEED)
    for label in sorted(by_package):
        parts = by_package[label]
        target = TEST_FRACTION * sum(map(len, parts))
        held: list[int] = []
        for i in torch.randperm(len(parts), generator=rng).tolist():  # (a file that would overshoot: to training)
            if sum(len(parts[j]) for j in held) < target and sum(len(parts[j]) for j in held) + len(parts[i]) <= 1.5 * target:
                held.append(i)
        if not held and len(parts) > 1:  # every file was large: the smallest is the package's test file
            held = [min(range(len(parts)), key=lambda j: len(parts[j]))]
        for i, found in enumerate(parts):
            x, y = (sides[2], sides[3]) if i in held else (sides[0], sides[1])
            x.extend(found)
            y.extend([label] * len(found))
    train_x, train_y, test_x, test_y = (torch.tensor(v, dtype=torch.int64) for v in sides)
    return (train_x, train_y), (test_x, test_y)


class FunctionClassifier(nn.Module):
    """ids [n, WIDTH] -> logits [n, len(PACKAGES)]: the mean of the ids' rows, then a linear layer."""

    def __init__(self, dense: bool = False) -> None:
        super().__init__()
        self.dense = dense
        self.words: nn.Module = (nn.EmbeddingBag(DENSE_ROWS, DIM, mode="mean", padding_idx=0) if dense
                                 else EmbeddingBag(None, DIM, mode="mean", padding_idx=0, std=0.1))
        self.head = nn.Linear(DIM, len(PACKAGES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense:  # the hashing trick: collisions, padding kept at 0
            x = torch.where(x == 0, 0, torch.remainder(x, DENSE_ROWS - 1) + 1)
        return self.head(self.words(x))


@register_task("pyfunc")  # its recipe: psgrad/tasks/registry.py
def pyfunc_task(seed: int = 0) -> Task:
    """About 6,000 functions of twelve standard-library packages, split by file."""
    (train_x, train_y), (test_x, test_y) = split(package_files(stdlib_packages()))
    if not len(train_x) or not len(test_x):
        raise TaskError("task 'pyfunc' found no functions in the standard library's packages")
    return Task(name="pyfunc", build_model=FunctionClassifier, train_x=train_x, train_y=train_y, test_x=test_x,
                test_y=test_y, dense_model=lambda: FunctionClassifier(dense=True))
