"""Task "digits": scikit-learn's bundled 8x8 handwritten digits (no download) with a small MLP.

The images come from scikit-learn's own data file, read with NumPy, and are split as
`sklearn.model_selection.train_test_split(..., stratify=labels)` splits them (`stratified_split`,
checked against it by the tests): importing scikit-learn pulls in SciPy and pandas and took 0.9 s of
CPU in every worker's start, more than the rest of psgrad's imports together.
"""
from __future__ import annotations

import gzip
import importlib.util
from math import ceil
from pathlib import Path

import numpy as np
import torch
from torch import nn

from psgrad.tasks.base import Task, register_task

TEST_FRACTION = 0.2
SPLIT_SEED = 0  # the split is fixed, independent of the run's seed


def build_mlp(hidden: int = 128) -> nn.Module:
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def digits_file() -> Path:
    """scikit-learn's digits data (a gzipped CSV: 64 pixel values and the label a row), found without
    importing scikit-learn."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("task digits reads the digits scikit-learn bundles: pip install scikit-learn")
    return Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / "digits.csv.gz"


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(pixels, labels): 1,797 rows of 64 float64 values in 0..16, and int labels 0..9 (what
    `sklearn.datasets.load_digits(return_X_y=True)` returns)."""
    with gzip.open(digits_file(), "rt", encoding="utf-8") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1], data[:, -1].astype(int)


def _approximate_mode(counts: np.ndarray, draws: int, rng: np.random.RandomState) -> np.ndarray:
    """How many of `draws` to take from each class: proportional, floored, the rest given to the
    largest remainders (ties broken by rng), as scikit-learn's stratified splits do."""
    continuous = counts / counts.sum() * draws
    taken = np.floor(continuous)
    missing = int(draws - taken.sum())
    if missing > 0:
        remainder = continuous - taken
        for value in np.sort(np.unique(remainder))[::-1]:
            (tied,) = np.where(remainder == value)
            add = min(len(tied), missing)
            taken[rng.choice(tied, size=add, replace=False)] += 1
            missing -= add
            if missing == 0:
                break
    return taken.astype(int)


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, test indices): each class in both parts in proportion, shuffled; the indices
    `train_test_split(range(n), test_size=test_fraction, random_state=seed, stratify=labels)` gives."""
    n = len(labels)
    n_test = ceil(test_fraction * n)
    n_train = n - n_test
    _, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    by_class = np.split(np.argsort(inverse, kind="stable"), np.cumsum(counts)[:-1])
    rng = np.random.RandomState(seed)
    train_counts = _approximate_mode(counts, n_train, rng)
    test_counts = _approximate_mode(counts - train_counts, n_test, rng)
    train: list[int] = []
    test: list[int] = []
    for members, k_train, k_test in zip(by_class, train_counts, test_counts):
        shuffled = members.take(rng.permutation(len(members)), mode="clip")
        train.extend(shuffled[:k_train])
        test.extend(shuffled[k_train : k_train + k_test])
    return rng.permutation(train), rng.permutation(test)


@register_task("digits")
def digits_task(seed: int = 0) -> Task:
    """1,437 training and 360 test images, pixels scaled to [0, 1]; 10 classes."""
    pixels, labels = load_digits_arrays()
    x = torch.tensor(pixels, dtype=torch.float32) / 16.0
    y = torch.tensor(labels, dtype=torch.long)
    idx_train, idx_test = (torch.from_numpy(i) for i in stratified_split(labels, TEST_FRACTION, SPLIT_SEED))
    return Task(
        name="digits",
        build_model=build_mlp,
        train_x=x[idx_train],
        train_y=y[idx_train],
        test_x=x[idx_test],
        test_y=y[idx_test],
    )
