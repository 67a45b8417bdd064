"""Task "digits": scikit-learn's bundled 8x8 handwritten digits (no download) with a small MLP."""
from __future__ import annotations

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from psgrad.tasks.base import Task, register_task

TEST_FRACTION = 0.2
SPLIT_SEED = 0  # the split is fixed, independent of the run's seed


def build_mlp(hidden: int = 128) -> nn.Module:
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


@register_task("digits")
def digits_task(seed: int = 0) -> Task:
    """1,437 training and 360 test images, pixels scaled to [0, 1]; 10 classes."""
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    idx_train, idx_test = train_test_split(
        range(len(y)), test_size=TEST_FRACTION, random_state=SPLIT_SEED, stratify=data.target
    )
    return Task(
        name="digits",
        build_model=build_mlp,
        train_x=x[idx_train],
        train_y=y[idx_train],
        test_x=x[idx_test],
        test_y=y[idx_test],
    )
