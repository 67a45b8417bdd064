"""A launch relays its children's lines from one reader thread each: print_line keeps every line whole
(print() writes the text and the newline in two calls, and lines of threads printing at once ran
together, e.g. "[worker0] ...[worker1] ...\n\n": a test then missed worker 0's final line)."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import REPO

THREADS, LINES = 4, 5000
CHILD = f"""
import threading
from psgrad.launch.supervisor import print_line

def relay(n):
    for i in range({LINES}):
        print_line(f"[worker{{n}}] step {{i}}")

threads = [threading.Thread(target=relay, args=(n,)) for n in range({THREADS})]
for t in threads:
    t.start()
for t in threads:
    t.join()
"""


@pytest.mark.timeout(120)
def test_lines_printed_from_several_threads_at_once_stay_whole() -> None:
    res = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=100, cwd=REPO)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.split("\n")
    assert lines.pop() == ""
    broken = [line for line in lines if not re.fullmatch(r"\[worker\d\] step \d+", line)]
    assert not broken, f"{len(broken)} lines run together, e.g. {broken[:3]}"
    assert sorted(lines) == sorted(f"[worker{n}] step {i}" for n in range(THREADS) for i in range(LINES))
