"""Every code block of the user guide (docs/guide/*.md) and of docs/tutorial.md runs as written.

The page-block convention (the same for every page; docs/development.md says it for writers):

1. A ```bash block is run: all of a page's bash blocks, in page order, as one `set -euo pipefail`
   script in a fresh directory, `psgrad` being this checkout's and `python` this interpreter with
   the repository on PYTHONPATH (test_docs.py's `_run_script`); what it leaves in the background is
   killed at the end.
2. A ```python block after the line `<!-- file: NAME.py -->` is written to NAME.py before the script
   runs. A bash block runs it (`python NAME.py ...`); if no bash block of the page names NAME.py,
   the runner runs `python NAME.py` itself, where the block stands in the page.
3. A ```python block with no marker is run on its own (`python blockK_lineL.py`), where it stands.
4. `<!-- fragment of NAME.py -->` before a ```python block: not run; its non-blank lines must appear,
   in order, in the `file: NAME.py` block of the same page (or, if the page has none, of any page
   under docs/ or README.md). Lines are compared without their indentation, so a fragment may
   show a loop's body that the file has inside a `with` block.
5. `<!-- not run: WHY -->` before a block: skipped; WHY is required, and the skipped blocks are counted.
6. Blocks of any other language (```text for expected output, ```yaml, ...) are shown, not run.

A marker is the line right above the fence (indented as the fence is, inside a list item).
"""
from __future__ import annotations

import py_compile
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import REPO
from test_docs import _run_script

DOCS = Path(REPO, "docs")


def pages() -> list[Path]:
    """The pages whose blocks run: the user guide's, and the tutorial once it exists."""
    out = sorted((DOCS / "guide").glob("*.md"))
    if (DOCS / "tutorial.md").is_file():
        out.append(DOCS / "tutorial.md")
    return out


def page_id(path: Path) -> str:
    return path.relative_to(DOCS).as_posix()


FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<code>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)
MARKER = re.compile(r"<!--\s*(file:|fragment of|not run:)(.*?)-->")
NAME = re.compile(r"[\w.-]+\.py")
RUNNABLE = ("python", "bash")


@dataclass(frozen=True)
class Block:
    lang: str
    code: str  # without the fence's indentation
    line: int  # the fence's line in the page (1-based)
    file: str | None = None  # `<!-- file: NAME.py -->`
    fragment: str | None = None  # `<!-- fragment of NAME.py -->`
    skipped: str | None = None  # `<!-- not run: WHY -->`: WHY


class PageError(AssertionError):
    """A page breaks the convention (a bad marker, a fragment not in its file, ...)."""


def page_blocks(text: str, where: str = "page") -> list[Block]:
    """The fenced blocks of a page, in order, each with the marker on the line right above it."""
    blocks = []
    for m in FENCE.finditer(text):
        indent, lang = m.group("indent"), m.group("lang")
        code = "".join(line[len(indent):] if line.startswith(indent) else line.lstrip(" \t")
                       for line in m.group("code").splitlines(keepends=True))
        line = text.count("\n", 0, m.start()) + 1
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1].strip() if line > 1 else ""
        marker = MARKER.fullmatch(before)
        if before.startswith("<!--") and re.search(r"file|fragment|not run", before) and not marker:
            raise PageError(f"{where}:{line}: a marker this runner does not know: {before!r}")
        kind, arg = (marker.group(1), marker.group(2).strip()) if marker else (None, "")
        if kind in ("file:", "fragment of") and not NAME.fullmatch(arg):
            raise PageError(f"{where}:{line}: {before!r} needs a file name NAME.py")
        if kind in ("file:", "fragment of") and lang != "python":
            raise PageError(f"{where}:{line}: {before!r} marks a ```{lang} block; it takes a ```python one")
        if kind == "not run:" and not arg:
            raise PageError(f"{where}:{line}: `not run` needs its reason: <!-- not run: WHY -->")
        blocks.append(Block(lang, code, line, file=arg if kind == "file:" else None,
                            fragment=arg if kind == "fragment of" else None,
                            skipped=arg if kind == "not run:" else None))
    return blocks


@dataclass
class Plan:
    """What the runner does with a page: files to write, one script to run, and the counts."""
    files: dict[str, str] = field(default_factory=dict)  # name -> contents, written before the script runs
    script: str = ""
    counts: dict[str, int] = field(default_factory=lambda: {"ran": 0, "wrote": 0, "fragments": 0, "skipped": 0})

    def summary(self, page: str) -> str:
        c = self.counts
        return f"{page}: ran {c['ran']}, wrote {c['wrote']}, fragments {c['fragments']}, skipped {c['skipped']}"


def written_files(path: Path) -> dict[str, str]:
    return {b.file: b.code for b in page_blocks(path.read_text(), str(path)) if b.file and b.skipped is None}


def other_files(name: str) -> list[tuple[str, str]]:
    """(where, code) of every `file: NAME` block under docs/ and in README.md."""
    out = []
    for path in [Path(REPO, "README.md"), *sorted(DOCS.rglob("*.md"))]:
        code = written_files(path).get(name)
        if code is not None:
            out.append((path.relative_to(REPO).as_posix(), code))
    return out


def in_order(fragment: str, whole: str) -> str | None:
    """None if the fragment's non-blank lines appear in whole in order (indentation aside), else the first that does not."""
    lines = iter(line.strip() for line in whole.splitlines())
    for wanted in (line.strip() for line in fragment.splitlines() if line.strip()):
        if not any(wanted == line for line in lines):
            return wanted
    return None


def plan(blocks: list[Block], where: str = "page") -> Plan:
    """The runner's plan for a page's blocks (the convention above); raises PageError where the page breaks it."""
    p = Plan()
    bash = "\n".join(b.code for b in blocks if b.lang == "bash" and b.skipped is None)
    parts: list[str] = []
    for k, b in enumerate(blocks):
        label = f"{where}, block {k} (line {b.line})"
        if b.skipped is not None:
            p.counts["skipped"] += 1
        elif b.lang == "bash":
            parts.append(f"echo '### {label}'\n{b.code}")
            p.counts["ran"] += 1
        elif b.lang == "python" and b.file:
            if b.file in p.files:
                raise PageError(f"{label}: {b.file} is written twice")
            p.files[b.file] = b.code
            p.counts["wrote"] += 1
            if not re.search(rf"(?<![\w.-]){re.escape(b.file)}", bash):
                parts.append(f"echo '### {label}: python {b.file}'\npython {b.file}")
                p.counts["ran"] += 1
        elif b.lang == "python" and b.fragment:
            p.counts["fragments"] += 1
        elif b.lang == "python":
            name = f"block{k}_line{b.line}.py"
            p.files[name] = b.code
            parts.append(f"echo '### {label}'\npython {name}")
            p.counts["ran"] += 1
    for k, b in enumerate(blocks):
        if b.fragment and b.skipped is None:
            label = f"{where}, block {k} (line {b.line})"
            if b.fragment in p.files:
                homes = [(where, p.files[b.fragment])]
            else:
                homes = other_files(b.fragment)
                if not homes:
                    raise PageError(f"{label} is a fragment of {b.fragment}, which no page writes (<!-- file: {b.fragment} -->)")
            misses = [(home, in_order(b.code, code)) for home, code in homes]
            if all(miss is not None for _, miss in misses):
                home, miss = misses[0]
                raise PageError(f"{label}: fragment line {miss!r} is not in {b.fragment} ({home}), in this order")
    p.script = "\n".join(parts)
    return p


def page_plan(path: Path) -> Plan:
    return plan(page_blocks(path.read_text(), page_id(path)), page_id(path))


def run_page(p: Plan, cwd: Path, timeout_s: float,
             check: Callable[[str, Path], None] | None = None) -> subprocess.CompletedProcess[str]:
    """Write the plan's files into cwd and run its script there (test_docs.py's runner)."""
    for name, code in p.files.items():
        (cwd / name).write_text(code)
    return _run_script(p.script, cwd, timeout_s=timeout_s, check=check)


# ------------------------------------------------------------------------------ what pages print

def python_api_two_workers_train(out: str, cwd: Path) -> None:
    """python-api.md: both workers of train_digits.py (by hand, two servers) end above 0.9."""
    for rank in range(2):  # (not anchored at line ends: both print to one terminal, see test_tutorial.py)
        last = re.findall(rf"rank {rank} epoch 4: loss [\d.]+ test accuracy (\d\.\d{{3}})", out)
        assert last and float(last[-1]) > 0.9, (rank, out[-3000:])


def embeddings_tables_train(out: str, cwd: Path) -> None:
    """embeddings.md: clicks.py shows the table's input and trains (its loss falls); the saved model
    predicts without servers as it did in the job; the DLRM trains through the pipeline."""
    assert re.search(r"^ids \[6\] int64, offsets \[4\] int64: 4 bags$", out, re.M), out[-3000:]
    losses = [float(v) for v in re.findall(r"^step \d+: loss ([\d.]+)$", out, re.M)]
    assert len(losses) >= 2 and losses[-1] < losses[0], losses
    assert re.search(r"^same predictions without servers: True$", out, re.M), out[-3000:]
    assert re.search(r"^dlrm: \d+ steps, loss [\d.]+ -> [\d.]+, prefetched reads \d+$", out, re.M), out[-3000:]


def compare_runs_the_variants_and_the_claims_preset(out: str, cwd: Path) -> None:
    """compare.md: the three variants each ran (summary.json), and the claims preset's quick run wrote
    its whole report (tests/e2e/test_compare.py's checks of it)."""
    import json

    from test_compare import claims_quick_report_is_complete

    summary = json.loads((cwd / "runs" / "variants" / "summary.json").read_text())
    assert "async:dc=0.04" in json.dumps(summary) and "ssp:auto" in json.dumps(summary), summary
    assert re.search(r"^ssp:auto\s+0\.1\s", out, re.M), out[-3000:]
    claims_quick_report_is_complete(cwd / "runs" / "claims")


def tutorial_check() -> Callable[[str, Path], None] | None:
    """The tutorial's own checks of what it prints (tests/e2e/test_tutorial.py), where that exists."""
    try:
        from test_tutorial import tutorial_prints_what_it_promises  # type: ignore[import-not-found]
    except ImportError:
        return None
    return tutorial_prints_what_it_promises  # type: ignore[no-any-return]


PAGE_CHECKS: dict[str, Callable[[], Callable[[str, Path], None] | None]] = {
    "guide/python-api.md": lambda: python_api_two_workers_train,
    "guide/embeddings.md": lambda: embeddings_tables_train,
    "guide/compare.md": lambda: compare_runs_the_variants_and_the_claims_preset,
    "tutorial.md": tutorial_check,
}
TIMEOUT_S = {"guide/compare.md": 450, "tutorial.md": 420}  # the script's limit (default 300)
SERVERS = re.compile(r"psgrad (server|launch|compare|run|worker)\b|psgrad\.(serve|connect)\(")


def _params() -> list[object]:
    out = []
    for path in pages():
        try:
            p = page_plan(path)
        except PageError:  # the test fails on it, naming the block (and so does the one below)
            out.append(pytest.param(page_id(path), marks=[pytest.mark.slow]))
            continue
        if not p.script:
            continue  # nothing to run (its blocks are counted by the test below)
        starts_servers = SERVERS.search(p.script + "".join(p.files.values()))
        out.append(pytest.param(page_id(path), marks=[pytest.mark.slow] if starts_servers else []))
    return out


@pytest.mark.timeout(540)
@pytest.mark.parametrize("page", _params())
def test_every_block_of_the_page_runs(page: str, tmp_path: Path) -> None:
    """The page's files written, its script run in a fresh directory: it exits 0, and prints what the
    page says it prints where PAGE_CHECKS holds a check for it."""
    p = page_plan(DOCS / page)
    print(p.summary(page))
    res = run_page(p, tmp_path, timeout_s=TIMEOUT_S.get(page, 300), check=PAGE_CHECKS.get(page, lambda: None)())
    print(res.stdout[-5000:])
    assert res.returncode == 0, f"{page}: exit {res.returncode}\n{res.stdout[-6000:]}"


FENCE_LINE = re.compile(r"^[ \t]*```", re.M)
ALIASES = {"py", "python3", "pycon", "sh", "shell", "console", "zsh"}  # would be shown, not run: use python or bash


@pytest.mark.timeout(120)
def test_every_python_and_bash_block_is_accounted_for(tmp_path: Path) -> None:
    """No servers: every fence of every page opens or closes a block the runner sees (none lost to an
    indentation it cannot pair), none is Python or shell under another name (```py, ```sh: shown and
    never run), and every ```python and ```bash block is run, written, a fragment found in its file,
    or not run with a reason. Every file the runner writes compiles and every shell block parses
    (bash -n). Prints the counts per page and in all."""
    total = {"ran": 0, "wrote": 0, "fragments": 0, "skipped": 0}
    seen = 0
    for path in pages():
        where, text = page_id(path), path.read_text()
        blocks = page_blocks(text, where)
        assert len(FENCE_LINE.findall(text)) == 2 * len(blocks), f"{where}: a fence the runner cannot pair"
        for b in blocks:
            assert b.lang not in ALIASES, f"{where}:{b.line}: ```{b.lang} is never run: write ```python or ```bash"
        p = plan(blocks, where)  # raises on a fragment not in its file
        runnable = [b for b in blocks if b.lang in RUNNABLE]
        kinds = {"run": 0, "written": 0, "fragment": 0, "not run": 0}
        for b in runnable:
            kind = ("not run" if b.skipped is not None else "written" if b.file else "fragment" if b.fragment
                    else "run")
            kinds[kind] += 1
        assert kinds["written"] == p.counts["wrote"] and kinds["fragment"] == p.counts["fragments"]
        assert kinds["not run"] <= p.counts["skipped"]  # (a `not run` block of another language counts too)
        assert kinds["run"] <= p.counts["ran"]  # plus the written files no bash block runs
        seen += len(runnable)
        for name, code in p.files.items():
            target = tmp_path / where.replace("/", "_") / name
            target.parent.mkdir(exist_ok=True)
            target.write_text(code)
            py_compile.compile(str(target), doraise=True)
        for b in runnable:
            if b.lang == "bash" and b.skipped is None:
                res = subprocess.run(["bash", "-n"], input=b.code, capture_output=True, text=True, timeout=30)
                assert res.returncode == 0, f"{where}:{b.line}: {res.stderr}"
        print(f"{p.summary(where)} ({len(runnable)} python/bash blocks)")
        for key in total:
            total[key] += p.counts[key]
    print(f"in all: {seen} python/bash blocks on {len(pages())} pages; ran {total['ran']}, wrote {total['wrote']}, "
          f"fragments {total['fragments']}, skipped {total['skipped']}")
    assert seen > 0 and total["ran"] > 0


def test_the_convention_catches_what_breaks_it() -> None:
    """A fragment whose lines are not in its file (or not in its order), a fragment of a file no page
    writes, a file written twice, `not run` without a reason and a misspelt marker are refused,
    naming the block; a file no bash block names is run by the runner, one a bash block names is not."""
    page = ("<!-- file: a.py -->\n```python\nimport torch\nwith torch.no_grad():\n    x = torch.zeros(2)\n"
            "    print(x)\n```\n\n<!-- fragment of a.py -->\n```python\nx = torch.zeros(2)\nprint(x)\n```\n")
    assert plan(page_blocks(page)).counts == {"ran": 1, "wrote": 1, "fragments": 1, "skipped": 0}
    with pytest.raises(PageError, match="'print\\(y\\)' is not in a.py"):
        plan(page_blocks(page + "<!-- fragment of a.py -->\n```python\nx = torch.zeros(2)\nprint(y)\n```\n"))
    with pytest.raises(PageError, match="not in a.py"):
        plan(page_blocks(page + "<!-- fragment of a.py -->\n```python\nprint(x)\nimport torch\n```\n"))
    with pytest.raises(PageError, match="which no page writes"):
        plan(page_blocks("<!-- fragment of nowhere_at_all.py -->\n```python\nx = 1\n```\n"))
    with pytest.raises(PageError, match="written twice"):
        plan(page_blocks(page + "<!-- file: a.py -->\n```python\nx = 1\n```\n"))
    with pytest.raises(PageError, match="needs its reason"):
        page_blocks("<!-- not run: -->\n```bash\nexit 1\n```\n")
    with pytest.raises(PageError, match="does not know"):
        page_blocks("<!-- file a.py -->\n```python\nx = 1\n```\n")
    with pytest.raises(PageError, match="takes a ```python one"):
        page_blocks("<!-- file: a.py -->\n```bash\nexit 0\n```\n")
    alone = plan(page_blocks("<!-- file: b.py -->\n```python\nprint(1)\n```\n"))
    assert alone.script.endswith("python b.py") and alone.counts["ran"] == 1
    named = plan(page_blocks("<!-- file: b.py -->\n```python\nprint(1)\n```\n```bash\npython b.py --flag\n```\n"))
    assert named.script.count("python b.py") == 1
    assert named.counts == {"ran": 1, "wrote": 1, "fragments": 0, "skipped": 0}
    indented = page_blocks("- a list item:\n\n  <!-- not run: a cluster -->\n  ```bash\n  srun x\n  ```\n")
    assert [(b.code, b.skipped) for b in indented] == [("srun x\n", "a cluster")]


@pytest.mark.timeout(120)
def test_the_runner_fails_on_an_injected_name_error(tmp_path: Path) -> None:
    """No servers: embeddings.md's clicks.py without its `from torch import nn` (the issue's
    `NameError: nn`), as a page of its own, fails the runner with that error before anything starts."""
    (block,) = [b for b in page_blocks((DOCS / "guide" / "embeddings.md").read_text()) if b.file == "clicks.py"]
    assert "from torch import nn\n" in block.code
    broken = block.code.replace("from torch import nn\n", "")
    p = plan(page_blocks(f"<!-- file: clicks.py -->\n```python\n{broken}```\n"))
    assert p.script.endswith("python clicks.py")
    res = run_page(p, tmp_path, timeout_s=90)
    assert res.returncode != 0, res.stdout
    assert "NameError: name 'nn' is not defined" in res.stdout, res.stdout


# ------------------------------------------------------------------------------------ Next links

NEXT = re.compile(r"^Next: \[(?P<title>[^\]]+)\]\((?P<target>[^)#\s]+)(#[^)]*)?\)\.?$")


def _nav_pages(section: str) -> list[str]:
    import yaml

    class Loader(yaml.SafeLoader):  # mkdocs.yml may hold !!python tags elsewhere: ignore them
        pass

    Loader.add_multi_constructor("", lambda loader, suffix, node: None)
    nav = yaml.load(Path(REPO, "mkdocs.yml").read_text(), Loader=Loader)["nav"]
    (entries,) = [entry[section] for entry in nav if isinstance(entry, dict) and section in entry]
    return [next(iter(e.values())) if isinstance(e, dict) else e for e in entries]


def test_every_guide_page_ends_with_a_next_link_in_nav_order() -> None:
    """Each page of the User guide section ends with `Next: [Title](page.md)`, the next page of the
    nav; the last one points at the first page of Operations. The target exists."""
    guide = _nav_pages("User guide")
    following = [*guide[1:], _nav_pages("Operations")[0]]
    assert sorted(guide) == sorted(f"guide/{p.name}" for p in (DOCS / "guide").glob("*.md")), guide
    for page, nxt in zip(guide, following):
        last = (DOCS / page).read_text().rstrip().splitlines()[-1]
        m = NEXT.match(last)
        assert m, f"{page} ends with {last!r}, not a Next link"
        target = (DOCS / page).parent / m.group("target")
        assert target.resolve() == (DOCS / nxt).resolve(), f"{page}: Next points at {m.group('target')}, the nav says {nxt}"
        assert target.is_file(), target
