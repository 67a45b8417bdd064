"""The real-workload tasks (mnist, fashion-mnist, charlm), their recipes, the LR schedules, emulated
step times, and ranking a comparison by a metric where lower is better."""
from __future__ import annotations

import argparse
import gzip
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from psgrad.cli.flags import apply_recipe
from psgrad.config import WorkerConfig, metric_reached
from psgrad.core.schedule import lr_factor
from psgrad.errors import ConfigError, TaskError
from psgrad.experiments import analysis
from psgrad.tasks import get_task, recipe_for
from psgrad.tasks.charlm import CONTEXT, Windows
from psgrad.tasks.files import FASHION_DIR, FASHION_FILES, find_fashion_files
from psgrad.tasks.images import read_idx
from psgrad.worker.loop import DelayInjector

pytestmark = pytest.mark.timeout(120)


def test_mnist_is_the_5000_real_digits_split_100_per_class() -> None:
    task = get_task("mnist")
    assert task.train_x is not None and task.test_x is not None and task.test_y is not None
    assert task.train_x.shape == (4000, 784) and task.train_x.dtype == torch.uint8
    assert torch.bincount(task.test_y).tolist() == [100] * 10
    model = task.build_model()
    assert 100_000 <= sum(p.numel() for p in model.parameters()) <= 1_000_000
    assert sum(1 for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)) >= 4
    assert model(task.train_x[:3]).shape == (3, 10)


def _write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    data = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(data) if path.suffix == ".gz" else data)


def test_fashion_mnist_reads_idx_files_in_the_torchvision_layout(tmp_path: Path) -> None:
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    shapes = {"train_x": (50, 28, 28), "train_y": (50,), "test_x": (20, 28, 28), "test_y": (20,)}
    for i, (key, stem) in enumerate(FASHION_FILES.items()):
        _write_idx(raw / (stem + (".gz" if i % 2 else "")), rng.integers(0, 10, shapes[key]))
    task = get_task("fashion-mnist", data_dir=str(tmp_path))
    assert task.train_x is not None and task.train_x.shape == (50, 28, 28)
    assert task.test_x is not None and len(task.test_x) == 20
    assert torch.equal(read_idx(raw / "t10k-labels-idx1-ubyte.gz"), task.test_y)
    (raw / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(b"\0\0\x0d\x01xxxx"))
    with pytest.raises(TaskError, match="not an IDX file of unsigned bytes"):
        get_task("fashion-mnist", data_dir=str(tmp_path))
    with pytest.raises(TaskError, match=r"found none in .*empty.*apt-get install dataset-fashion-mnist"):
        find_fashion_files(tmp_path / "empty")
    with pytest.raises(TaskError, match="reads no data directory"):
        get_task("mnist", data_dir=str(tmp_path))


def test_fashion_mnist_from_the_debian_package() -> None:
    if not Path(FASHION_DIR).is_dir():
        pytest.skip(f"Fashion-MNIST is not installed at {FASHION_DIR} (apt-get install dataset-fashion-mnist)")
    task = get_task("fashion-mnist")
    assert task.train_x is not None and task.test_y is not None
    assert task.train_x.shape == (60000, 28, 28) and len(task.test_y) == 10000
    assert torch.bincount(task.test_y).tolist() == [1000] * 10 and task.quick_eval == 1000


def test_charlm_trains_on_the_standard_library_split_by_file() -> None:
    task = get_task("charlm")
    assert isinstance(task.train_set, Windows) and len(task.train_set) > 50_000
    x, y = task.train_set[7]
    assert x.shape == y.shape == (CONTEXT,) and torch.equal(x[1:], y[:-1])  # y is x shifted by one byte
    assert task.test_x is not None and task.test_x.shape == (512, CONTEXT)
    model = task.build_model()
    result = task.evaluate(model, torch.device("cpu"))
    # an untrained model is near uniform over 256 bytes: 8 bits per byte
    assert result["test_bpb"] == pytest.approx(result["test_loss"] / math.log(2)) and 7 < result["test_bpb"] < 10


def test_recipes_fill_only_the_flags_left_out() -> None:
    ns = argparse.Namespace(task="charlm", optimizer=None, lr=None, momentum=None, weight_decay=None, batch_size=64,
                            steps=None, lr_schedule=None, warmup_steps=None)
    recipe = apply_recipe(ns, "compare_steps")
    assert recipe.metric == "test_bpb" and not metric_reached(recipe.target + 0.1, recipe.target, recipe.metric)
    assert (ns.optimizer, ns.lr, ns.batch_size, ns.steps) == ("adamw", recipe.lr, 64, recipe.compare_steps)
    mnist = argparse.Namespace(task="mnist", optimizer="adam", lr=None, momentum=None, weight_decay=None,
                               batch_size=None, steps=None, lr_schedule=None, warmup_steps=None)
    apply_recipe(mnist)
    # another optimizer than the recipe's starts from its own generic settings, not SGD's momentum
    assert (mnist.lr, mnist.momentum, mnist.weight_decay, mnist.steps) == (1e-3, 0.0, 0.0, recipe_for("mnist").steps)
    assert recipe_for("mymodule:make").metric == "test_accuracy"  # a user's task: the generic recipe


def test_warmup_then_cosine_or_linear_decay() -> None:
    f = lr_factor("cosine", 4, 20)
    assert [f(k) for k in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(12) == pytest.approx(0.5) and f(19) < 0.02 and f(25) == 0.0
    assert lr_factor("linear", 0, 10)(5) == 0.5 and lr_factor("constant", 2, 10)(9) == 1.0
    with pytest.raises(ConfigError, match="lr schedule must be one of constant, cosine, linear"):
        lr_factor("step", 0, 10)
    with pytest.raises(ConfigError, match="lr_schedule must be one of"):
        WorkerConfig(servers=(), lr_schedule="exp")


def test_an_emulated_step_takes_at_least_its_time_and_stragglers_multiply_it() -> None:
    def injector(slowdown: float, step_time_ms: float = 0.0) -> DelayInjector:
        return DelayInjector(WorkerConfig((), slowdown=slowdown, step_time_ms=step_time_ms), 1)

    assert injector(1.0, step_time_ms=50).delay_s(0.01) == pytest.approx(0.04)
    assert injector(1.0, step_time_ms=50).delay_s(0.08) == 0.0  # compute is longer: no wait
    assert injector(4.0, step_time_ms=50).delay_s(0.01) == pytest.approx(0.19)
    assert injector(4.0).delay_s(0.01) == pytest.approx(0.03)  # without: 3x the compute
    argv = WorkerConfig(servers=(), step_time_ms=50).to_argv()
    assert argv[argv.index("--step-time-ms") + 1] == "50"
    with pytest.raises(ConfigError, match="step_time_ms must be a finite number >= 0"):
        WorkerConfig(servers=(), step_time_ms=-1)


def test_a_metric_where_lower_is_better_ranks_the_runs() -> None:
    records = {0: [
        {"event": "start", "time": 0.0, "rank": 0, "batch_size": 16},
        {"step": 1, "time": 1.0, "rank": 0, "loss": 4.0, "test_bpb": 5.0, "test_loss": 3.5, "test_accuracy": 0.1},
        {"step": 2, "time": 2.0, "rank": 0, "loss": 2.0, "test_bpb": 2.9, "test_loss": 2.0, "test_accuracy": 0.4},
        {"event": "final", "time": 2.5, "rank": 0, "test_bpb": 2.8, "test_loss": 1.9, "test_accuracy": 0.45},
    ]}
    m = analysis.run_metrics(analysis.RunData("async", 0, records), 3.0, "test_bpb")
    assert m["time_to_target_s"] == 2.0 and m["gradients_to_target"] == 2
    assert m["final_test_bpb"] == 2.8 and m["final_test_accuracy"] == 0.45
    assert [p[2] for p in m["curve"]] == [5.0, 2.9, 2.8]
