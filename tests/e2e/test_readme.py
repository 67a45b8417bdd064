"""The Python API examples run as written: the README's (two workers against two real servers, and
alone) and the longer one of docs/guide/python-api.md (alone, with a GPU if there is one)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, communicate_all

MARKER = "<!-- example: train_digits.py"


def readme_example(page: str = "README.md") -> str:
    text = Path(REPO, page).read_text()
    after = text[text.index(MARKER):]
    match = re.search(r"```python\n(.*?)```", after, re.S)
    assert match, f"{page} lost its runnable example"
    return match.group(1)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_readme_example_trains_two_workers(start_servers, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "train_digits.py"
    script.write_text(readme_example())
    servers = ",".join(start_servers(2))
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    workers = [
        subprocess.Popen([sys.executable, str(script), servers, str(rank), "2"], cwd=tmp_path, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)
        for rank in range(2)
    ]
    outputs = communicate_all(workers, timeout_s=200)
    for rank, (w, out) in enumerate(zip(workers, outputs)):
        assert w.returncode == 0, out
        last = re.findall(rf"rank {rank} epoch 4: loss [\d.]+ test accuracy ([\d.]+)", out)
        assert last and float(last[0]) > 0.9, out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("page", ["README.md", "docs/guide/python-api.md"])
def test_the_readme_example_alone_serves_its_own_shards(page: str, tmp_path: Path) -> None:
    """Without server addresses the example starts two shards in its own process (psgrad.serve)."""
    script = tmp_path / "train_digits.py"
    script.write_text(readme_example(page))
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=200, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    last = re.findall(r"rank 0 epoch 4: loss [\d.]+ test accuracy ([\d.]+)", res.stdout)
    assert last and float(last[0]) > 0.9, res.stdout
