"""docs/tutorial.md works as written. The page is run by the runner of every guide page
(tests/e2e/test_doc_examples.py: files written, shell blocks run as one script in a fresh directory,
fragments checked, `not run` blocks skipped), which calls `tutorial_prints_what_it_promises` below
on its output; this file holds the page's own checks: its shape, and what each step prints."""
from __future__ import annotations

import json
import py_compile
import re
from pathlib import Path

import pytest

from conftest import REPO
from test_doc_examples import Block, PageError, page_blocks, plan

PAGE = Path(REPO, "docs", "tutorial.md")


def test_the_tutorial_blocks_are_what_the_runner_expects(tmp_path: Path) -> None:
    """No servers: the page has its seven steps' files and commands, the install block (the README's) is
    the only one skipped, every file compiles, and a fragment that is not in its file is caught."""
    blocks = page_blocks(PAGE.read_text(), "tutorial.md")
    p = plan(blocks, "tutorial.md")
    assert p.counts == {"ran": 7, "wrote": 3, "fragments": 0, "skipped": 1}, p.counts
    assert set(p.files) == {"train_digits.py", "train_pixels.py", "evaluate.py"}
    install = next(b.code for b in blocks if b.skipped)
    assert f"```bash\n{install}```" in Path(REPO, "README.md").read_text(), "the install is not the README's"
    for name, code in p.files.items():
        (tmp_path / name).write_text(code)
        py_compile.compile(str(tmp_path / name), doraise=True)
    assert sum(b.lang == "text" for b in blocks) >= 7  # an expected output per step
    with pytest.raises(PageError, match="is not in train_pixels.py"):
        plan(blocks + [Block("python", "model = PixelMLP()\nundefined_name()\n", line=0, fragment="train_pixels.py")])


def accuracy(line_re: str, text: str) -> list[float]:
    return [float(v) for v in re.findall(line_re + r" test accuracy (\d\.\d{3})", text)]


def tutorial_prints_what_it_promises(out: str, cwd: Path) -> None:
    """The checks of the page's output (the whole script's, in order) and of the files it left in cwd."""
    # the steps' output, cut where each step's first line appears
    compare = out.index("psgrad compare: sync, async")
    pixels = out.index("table input for 2 test images")
    ckpt = out.index("ckpt-v", pixels)
    certs = out.index("psgrad certs: wrote")
    steps12, step3, step4, steps56, step7 = (out[:compare], out[compare:pixels], out[pixels:ckpt],
                                             out[ckpt:certs], out[certs:])

    # 1 and 2: one process, then two workers, each ending above 0.85. (Not anchored at line ends: two
    # workers print to one terminal, and a print's text and its newline are two writes, which the
    # other process's line may come between.)
    done = re.findall(r"rank (\d) done: test accuracy (\d\.\d{3})", steps12)
    assert [r for r, _ in done[:1]] == ["0"] and sorted(r for r, _ in done[1:]) == ["0", "1"], steps12
    assert all(float(a) > 0.85 for _, a in done), done
    assert steps12.count("rank 0 epoch 4: ") == 2 and "rank 1 epoch 4: " in steps12
    assert "initialized by the chief (worker 0): shard 0 of 2" in steps12 and "stopped (SIGTERM)" in steps12

    # 3: the comparison's table has both modes, each trained
    rows = dict(re.findall(r"^(sync|async)\s+0\.1\s+(.*)$", step3, re.M))
    assert set(rows) == {"sync", "async"}, step3
    for mode, row in rows.items():
        final = re.search(r"(\d\.\d{4}) ± \d\.\d{4}", row)
        assert final and float(final.group(1)) > 0.8, (mode, row)
    summary = json.loads((cwd / "runs" / "modes" / "summary.json").read_text())
    assert "sync" in json.dumps(summary) and (cwd / "runs" / "modes" / "report.md").is_file()

    # 4: the table's input shown, and the model with the table trains
    assert "torch.int64 [2, 64]; image 0, pixels 0-7: [0, 0, 2, 13, 16, 9, 0, 0] -> ids [0, 17, 36, 64, 84, " \
        "94, 102, 119]" in step4, step4
    assert accuracy(r"rank 0 done:", step4) and accuracy(r"rank 0 done:", step4)[0] > 0.85, step4

    # 5: shard 0 was killed, restarted from a checkpoint of a version > 0, and both workers were told so
    #    and trained on to the end
    (restored,) = map(int, re.findall(r"restored shard 0 at version (\d+) from ckpt/shard0", steps56))
    assert restored > 0, steps56
    finals = []
    for rank in range(2):
        log = (cwd / f"worker{rank}.log").read_text()
        told = re.findall(rf"^rank {rank}: shard 0 restarted from its checkpoint: its version went back from "
                          rf"(\d+) to (\d+), (\d+) updates? lost$", log, re.M)
        told += [(v, v, "0") for v in re.findall(rf"^rank {rank}: shard 0 restarted from its checkpoint of version "
                                                 rf"(\d+), which held every update this worker had seen: none lost$",
                                                 log, re.M)]  # (the crash came right after a checkpoint)
        assert len(told) == 1 and int(told[0][1]) == restored and int(told[0][0]) >= restored, log
        assert f"rank {rank} epoch 5: " in log, log
        finals += accuracy(rf"rank {rank} done:", log)
    assert len(finals) == 2 and min(finals) > 0.85, finals

    # 6: the export loads into plain torch modules and scores what the last worker to finish saw
    assert "'pixels.weight': [1088, 128]" in steps56, steps56
    (exported,) = accuracy(r"plain PyTorch:", steps56)
    assert exported in finals, (exported, finals)

    # 7: the TLS job trained, the admin read it, a plaintext client was refused
    tls_done = re.findall(r"rank (\d) done: test accuracy (\d\.\d{3})", step7)  # (as in 1 and 2)
    assert sorted(r for r, _ in tls_done) == ["0", "1"] and all(float(a) > 0.85 for _, a in tls_done), step7
    assert re.search(r"^shard 1: workers 0:clock=\d+,left 1:clock=\d+,left$", step7, re.M), step7
    assert "did its TLS refuse this client" in step7 and "exit 1: refused without the job's credentials" in step7
    assert "initialized by the chief" in (cwd / "server0.log").read_text()
