"""The README's Python API example runs as written, and is the user guide's.

The README and docs/guide/python-api.md give the same `train_digits.py` (a `<!-- file: train_digits.py -->`
block each; the test below holds them equal). This file runs it alone, serving its own shards; its
two-worker run by hand is a block of python-api.md, which tests/e2e/test_doc_examples.py runs and
checks (both workers above 0.9 test accuracy)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

MARKER = "<!-- file: train_digits.py -->"


def readme_example(page: str = "README.md") -> str:
    text = Path(REPO, page).read_text()
    assert text.count(MARKER) == 1, f"{page}: expected one {MARKER} block"
    after = text[text.index(MARKER):]
    match = re.match(re.escape(MARKER) + r"\n```python\n(.*?)```", after, re.S)
    assert match, f"{page} lost its runnable example"
    return match.group(1)


def test_the_readme_and_the_guide_give_the_same_train_digits() -> None:
    readme, guide = readme_example("README.md"), readme_example("docs/guide/python-api.md")
    assert readme == guide, "README.md and docs/guide/python-api.md give different train_digits.py: make them one"
    assert "sys.argv" in readme and "psgrad.serve()" in readme  # alone, or one worker of several


@pytest.mark.timeout(240)
def test_the_readme_example_alone_serves_its_own_shards(tmp_path: Path) -> None:
    """Without server addresses the example starts two shards in its own process (psgrad.serve), and
    trains (on a GPU if there is one)."""
    script = tmp_path / "train_digits.py"
    script.write_text(readme_example())
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=200, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    last = re.findall(r"rank 0 epoch 4: loss [\d.]+ test accuracy ([\d.]+)", res.stdout)
    assert last and float(last[0]) > 0.9, res.stdout
