"""The documentation site builds (`mkdocs build --strict`), and its getting-started pages work as
written: every shell block of docs/getting-started/ runs, in a fresh directory, and succeeds."""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from conftest import REPO

DOCS = Path(REPO, "docs")
GETTING_STARTED = sorted((DOCS / "getting-started").glob("*.md"))
SKIP = re.compile(r"<!-- not run: [^>]+ -->\n")
BLOCK = re.compile(r"(<!-- not run: [^>]+ -->\n)?```bash\n(.*?)```", re.S)


def shell_blocks(path: Path) -> list[tuple[bool, str]]:
    """(run it?, code) of each ```bash block of a page; a block right after `<!-- not run: WHY -->` is not run."""
    return [(not m.group(1), m.group(2)) for m in BLOCK.finditer(path.read_text())]


def reference() -> ModuleType:
    """docs/hooks/reference.py, the generator of the reference pages (not a package module)."""
    spec = importlib.util.spec_from_file_location("psgrad_docs_reference", DOCS / "hooks" / "reference.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_script(script: str, cwd: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run a page's shell blocks as one bash script (set -euo pipefail), `psgrad` being this checkout's,
    in a session of its own so that nothing it started in the background outlives it."""
    bin_dir = cwd / ".bin"
    bin_dir.mkdir()
    (bin_dir / "psgrad").write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m psgrad \"$@\"\n")
    (bin_dir / "psgrad").chmod(0o755)
    env = {**os.environ, "PYTHONPATH": REPO, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}"}
    log = cwd / ".output"
    with log.open("w") as out:  # a file, not a pipe: a server left in the background would hold a pipe open
        proc = subprocess.Popen(["bash", "-c", "set -euo pipefail\n" + script], cwd=cwd, env=env, text=True,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"timed out after {timeout_s} s:\n{log.read_text()[-5000:]}") from None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything the script left in the background
        except ProcessLookupError:
            pass
        proc.wait()
    out = log.read_text()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


@pytest.mark.timeout(420)
@pytest.mark.parametrize("page", [p.name for p in GETTING_STARTED if any(run for run, _ in shell_blocks(p))])
def test_every_shell_block_of_a_getting_started_page_runs(page: str, tmp_path: Path) -> None:
    script = "\n".join(code for run, code in shell_blocks(DOCS / "getting-started" / page) if run)
    res = _run_script(script, tmp_path, timeout_s=360)
    print(res.stdout[-5000:])
    assert res.returncode == 0, f"{page}: exit {res.returncode}\n{res.stdout[-5000:]}"
