"""The documentation site builds (`mkdocs build --strict`), and its getting-started pages work as
written: every shell block of docs/getting-started/ runs, in a fresh directory, and succeeds."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from conftest import REPO, process_gone, run_python

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


def _run_script(
    script: str, cwd: Path, timeout_s: float, check: Callable[[str, Path], None] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a page's shell blocks as one bash script (set -euo pipefail), `psgrad` being this checkout's,
    in a session of its own so that nothing it started in the background outlives it; check(output,
    cwd), if given, runs once the script has ended successfully, before that cleanup."""
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
        if check is not None and proc.returncode == 0:
            check(log.read_text(), cwd)
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


def launch_page_trains_reports_status_and_leaves_nothing_behind(out: str, cwd: Path) -> None:
    """launch.md's `psgrad launch` (2 servers, 2 async workers, 300 steps): each worker's final line under
    its prefix, every server's output relayed, the final status of both shards (each applied every push:
    2 x 300), metrics files, and no child left once launch has exited (test_cli's launch test, which ran
    the same job, folded in here)."""
    assert re.search(r"^\[worker0\] worker 0/2: final test_loss", out, re.M), out
    assert re.search(r"^\[worker1\] worker 1/2: final test_loss", out, re.M), out
    assert re.search(r"^\[server1\] psgrad server listening on", out, re.M), out
    versions = re.findall(r"^\s+\d+ 127\.0\.0\.1:\d+\s+\[\d+, \d+\)\s+(\d+)", out, re.M)
    assert versions == ["600", "600"], out
    pids = {m.group(1): int(m.group(2)) for m in re.finditer(r"\[launch\] started (\S+) \(pid (\d+)\)", out)}
    assert set(pids) == {"server0", "server1", "worker0", "worker1"}, out
    assert all(process_gone(pid) for pid in pids.values()), pids
    assert (cwd / "metrics" / "worker0.jsonl").exists() and (cwd / "metrics" / "worker1.jsonl").exists()


def by_hand_page_trains_and_its_status_adds_up(out: str, cwd: Path) -> None:
    """by-hand.md's two servers and two async workers (300 steps each): both train (>= 0.7 test accuracy,
    chance being 0.1; async with momentum 0.9 varies with how the pushes interleave: 0.867-0.975 seen on
    a busy 2-core VM, 0.786 once with the suite beside four busy loops),
    their JSONL has every step, and `psgrad status` shows every push applied, each worker's clock and
    that it left, and the staleness of every push (test_cli's by-hand test, which ran the same
    processes, folded in here)."""
    steps = 300
    for r in range(2):
        records = [json.loads(line) for line in (cwd / f"w{r}.jsonl").read_text().splitlines()]
        assert all({"time", "rank", "step"} <= rec.keys() and rec["rank"] == r for rec in records)
        assert records[0]["event"] == "start"
        assert records[-1]["event"] == "final" and records[-1]["step"] == steps
        assert records[-1]["test_accuracy"] >= 0.7, records[-1]
        assert sum("test_accuracy" in rec for rec in records) >= 3
        assert [rec["step"] for rec in records[1:-1]] == list(range(1, steps + 1))
    rows = re.findall(r"^\s+(\d+) 127\.0\.0\.1:\d+\s+\[(\d+), (\d+)\)\s+(\d+)\s+(\d+) ", out, re.M)
    assert [(shard, version, applied) for shard, _, _, version, applied in rows] == [
        ("0", "600", "600"), ("1", "600", "600")], out
    assert rows[0][2] == rows[1][1]  # shard 0 ends where shard 1 begins
    assert f"shard 0: workers 0:clock={steps},left 1:clock={steps},left" in out, out
    (hist,) = re.findall(r"^shard 0: staleness histogram (.*) \(mean", out, re.M)
    assert sum(int(pair.split(":")[1]) for pair in hist.split()) == 2 * steps, hist


PAGE_CHECKS: dict[str, Callable[[str, Path], None]] = {
    "launch.md": launch_page_trains_reports_status_and_leaves_nothing_behind,
    "by-hand.md": by_hand_page_trains_and_its_status_adds_up,
}


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("page", [p.name for p in GETTING_STARTED if any(run for run, _ in shell_blocks(p))])
def test_every_shell_block_of_a_getting_started_page_runs(page: str, tmp_path: Path) -> None:
    """Every page's blocks succeed; the pages whose job the CLI tests ran too are checked as those did
    (PAGE_CHECKS: one run of the job instead of two)."""
    script = "\n".join(code for run, code in shell_blocks(DOCS / "getting-started" / page) if run)
    res = _run_script(script, tmp_path, timeout_s=360, check=PAGE_CHECKS.get(page))
    print(res.stdout[-5000:])
    assert res.returncode == 0, f"{page}: exit {res.returncode}\n{res.stdout[-5000:]}"


@pytest.mark.timeout(300)
def test_the_site_builds_strictly(tmp_path: Path) -> None:
    """`mkdocs build --strict`: no broken link, no missing page, no docstring mkdocstrings cannot render,
    the generated reference included (.ci/run installs the docs extra, so CI runs this)."""
    pytest.importorskip("mkdocs", reason="mkdocs is not installed: pip install -e '.[docs]' (.ci/run does)")
    pytest.importorskip("material", reason="mkdocs-material is not installed: pip install -e '.[docs]'")
    pytest.importorskip("mkdocstrings_handlers.python", reason="mkdocstrings[python] is not installed: "
                        "pip install -e '.[docs]'")
    env = {**os.environ, "PYTHONPATH": REPO, "NO_MKDOCS_2_WARNING": "1"}
    # `python -m mkdocs build ...`, forked from the preloaded template (its hooks import psgrad, and so torch)
    mkdocs = "import runpy, sys; sys.argv[0] = 'mkdocs'; runpy.run_module('mkdocs', run_name='__main__', alter_sys=True)"
    res = run_python(["-c", mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], timeout_s=240, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    for page in ("reference/cli", "reference/metrics", "reference/api", "reference/api-training", "reference/api-errors",
                 "getting-started/by-hand"):
        assert (tmp_path / "site" / page / "index.html").is_file(), page
    cli = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    assert "--staleness-max" in cli and "psgrad certs" in cli  # from the parser, not copied by hand
    config = (tmp_path / "site" / "reference" / "api-config" / "index.html").read_text()
    assert "--connect-timeout-s" in config and "<!-- fields:" not in config  # the field tables were filled


def test_the_generated_reference_covers_every_command_flag_and_api_name() -> None:
    ref = reference()
    cli = ref.cli_markdown()
    for name, command in ref._commands().items():
        assert f"## psgrad {name}\n" in cli
        for action in command._actions:
            for option in (action.option_strings if action.dest != "help" else ()):
                assert f"`{option}`" in cli, (name, option)
    import psgrad

    pages = "".join((DOCS / page).read_text() for page in ref.API_PAGES)
    index = ref.api_markdown()  # asserts that every exported name is on a page
    for name in psgrad.__all__:
        if name != "__version__":
            assert re.search(rf"^::: [\w.]+\.{name}$", pages, re.M), name
            assert f"[`psgrad.{name}`](" in index, name


def test_the_api_pages_document_every_parameter_field_and_error() -> None:
    """The hand-written parts of the per-topic API pages keep up with the code: connect's table has
    every parameter of its signature (and the guide's signature each with its default), StepStats'
    table every field, the errors page every error class, and each configuration class's generated
    table every field."""
    import dataclasses
    import inspect

    import psgrad
    import psgrad.errors
    from psgrad.worker.step_stats import StepStats

    ref = reference()
    training = (DOCS / "reference" / "api-training.md").read_text()
    guide = (DOCS / "guide" / "python-api.md").read_text()
    signature = re.search(r"```text\n(psgrad\.connect\(.*?\) -> Session)\n```", guide, re.S)
    assert signature, "python-api.md lost connect's signature"
    shown = " ".join(signature.group(1).split())
    for name, param in inspect.signature(psgrad.connect).parameters.items():
        assert re.search(rf"^\| `{name}` \|", training, re.M), f"connect's {name} is not in api-training.md's table"
        default = "" if param.default is inspect.Parameter.empty else "=" + repr(param.default).replace("'", '"')
        assert f"{name}{default}" in shown, f"python-api.md's connect signature lacks {name}{default}"
    for f in dataclasses.fields(StepStats):
        assert re.search(rf"^\| [^|]*`{f.name}`[^|]*\|", training, re.M), f"StepStats.{f.name} is not in api-training.md"
    errors = (DOCS / "reference" / "api-errors.md").read_text()
    classes = [c for c in vars(psgrad.errors).values()
               if isinstance(c, type) and issubclass(c, (psgrad.PsgradError, Warning)) and c.__module__ == "psgrad.errors"]
    for cls in classes:
        exported = f"psgrad.{cls.__name__}" if cls.__name__ in psgrad.__all__ else f"psgrad.errors.{cls.__name__}"
        assert f"| `{exported}` |" in errors, f"{exported} has no row on api-errors.md"
        assert f"::: psgrad.errors.{cls.__name__}\n" in errors, cls
    config = (DOCS / "reference" / "api-config.md").read_text()
    for marker in ref.FIELDS.finditer(config):
        table = ref.fields_markdown(marker.group(1), marker.group(2), marker.group(3) or "")
        cls = getattr(psgrad, marker.group(1))
        assert [row.split("`")[1] for row in table.splitlines()[2:]] == [f.name for f in dataclasses.fields(cls)]
    for name in ("ClientConfig", "TlsConfig", "ServerConfig", "JobSpec", "WorkerConfig"):
        assert f"<!-- fields: {name} " in config, name


def test_every_help_ends_with_two_examples_that_parse_and_docs_that_exist() -> None:
    from psgrad.cli.helptext import EXAMPLES
    from psgrad.cli.parser import build_parser

    parser = build_parser()
    commands = reference()._commands()
    assert set(EXAMPLES) == set(commands)
    for name, command in commands.items():
        text = command.format_help()
        examples = [line.strip() for line in text[text.index("\nexamples:\n"):].splitlines()
                    if "psgrad " in line and not line.strip().startswith("#") and not line.startswith("docs:")]
        assert len(examples) == 2, (name, examples)
        for example in examples:
            argv = shlex.split(example.replace("$SERVERS", "127.0.0.1:7000,127.0.0.1:7001"))
            argv = argv[argv.index("psgrad") + 1:]
            assert argv[0] == name, example
            parser.parse_args(argv)  # exits 2 (SystemExit) on a flag that is not there
        docs = re.findall(r"docs/[\w/.-]+\.md", text)
        assert docs, name
        for path in docs:
            assert Path(REPO, path).is_file(), (name, path)


def test_long_group_headings_wrap_in_help(monkeypatch: pytest.MonkeyPatch) -> None:
    from psgrad.cli.parser import build_parser

    monkeypatch.setenv("COLUMNS", "80")
    text = reference()._commands()["worker"].format_help()
    assert max(len(line) for line in text.split("\nexamples:\n")[0].splitlines()
               if not line.startswith(("usage:", " "))) <= 80
    assert build_parser().format_help().rstrip().splitlines()[-1].startswith("docs: ")


def test_readme_commands_are_the_getting_started_pages_and_the_install_is_cis() -> None:
    """The README's path commands are blocks of the getting-started pages (so the test above runs
    them); its install and quick-start commands install torch as .ci/run does."""
    readme = Path(REPO, "README.md").read_text()
    pages = "".join(p.read_text() for p in GETTING_STARTED)
    ci = Path(REPO, ".ci", "run").read_text()
    (torch_pin,) = set(re.findall(r"pip install --quiet (torch==[\d.]+)", ci))
    for code in re.findall(r"```bash\n(.*?)```", readme, re.S):
        if "pip install" in code or code.strip() == "bash .ci/run":
            assert "pip install torch" not in code or torch_pin in code, code
            continue
        assert f"```bash\n{code}```" in pages, f"a README block that no getting-started page runs:\n{code}"
    for run, code in (b for p in GETTING_STARTED for b in shell_blocks(p)):
        if "pip install torch" in code:
            assert torch_pin in code, code
    assert "'.[docs]'" in ci or ".[docs" in ci or "docs]" in ci, "the docs extra is not installed in CI"


def test_the_docs_stand_alone() -> None:
    """Every relative link of the README points into the repository, and no page names a path outside it."""
    readme = Path(REPO, "README.md").read_text()
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme):
        if not target.startswith("http"):
            assert Path(REPO, target).exists(), target
    for page in [Path(REPO, "README.md"), *DOCS.rglob("*.md")]:
        assert "../shared" not in page.read_text(), page


MID_TOKEN = "-_=|/([{."  # a span wrapped after one of these gains a space inside a token when rendered


def broken_spans(text: str) -> list[int]:
    """The lines (1-based) after which an inline code span wraps inside a token. Spans are found as
    CommonMark finds them: a run of N backticks opens one, the next run of exactly N closes it; fenced
    blocks are left out, and a blank line ends a paragraph (and any span left open in it)."""
    lines, fenced = [], False
    for line in text.splitlines():
        fence = line.lstrip().startswith("```")
        lines.append("" if fenced or fence else line)
        fenced ^= fence
    out: list[int] = []
    opener = None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            opener = None
            continue
        for run in re.findall(r"`+", line):
            opener = run if opener is None else None if run == opener else opener
        if opener and line.rstrip()[-1] in MID_TOKEN:
            out.append(n)
    return out


def test_no_inline_code_span_breaks_inside_a_word() -> None:
    """An inline code span may wrap where its text has a space (the line break renders as one), but
    not inside a token: `--no-error-` + newline + `feedback` renders, and copies, as
    `--no-error- feedback`."""
    assert broken_spans("a `--no-error-\nfeedback` b\n\n`ok\nhere` and ` ```text ` too\n") == [1]
    bad = [f"{page.relative_to(REPO)}:{n}" for page in [Path(REPO, "README.md"), *sorted(DOCS.rglob("*.md"))]
           for n in broken_spans(page.read_text())]
    assert not bad, "inline code broken inside a word at " + ", ".join(bad)


def _source_strings() -> list[str]:
    """Every string literal of psgrad/ as the parser joins it (implicit concatenation merged), an
    f-string's literal parts split where a value is formatted in."""
    import ast

    out: list[str] = []
    for path in Path(REPO, "psgrad").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.append(node.value)
            elif isinstance(node, ast.JoinedStr):
                out.extend(v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
    return out


VARYING = re.compile(r"\.\.\.|\b[A-Z][A-Z_]*\b(?![a-z])|\d[\d,.]*|'[^']*'|ipv4:\S+")


def message_fragments(message: str) -> list[str]:
    """A quoted message's fixed parts: cut where it varies (`...`, CAPITALS, figures, quoted names)."""
    return [f.strip(" :;,()") for f in VARYING.split(message) if len(f.strip(" :;,()")) >= 12]


def _triples(text: str) -> set[tuple[str, ...]]:
    words = re.findall(r"[\w-]+", text.lower())
    return {tuple(words[k:k + 2]) for k in range(len(words) - 1)}


def test_troubleshooting_quotes_messages_psgrad_prints() -> None:
    """Each message shown on the troubleshooting page (its ```text blocks) is psgrad's: cut where it
    varies (`...`, CAPITALS, figures, quoted names), at least two in three of its fixed word pairs
    are in psgrad's string literals. Messages are built from parts (a method's name
    formatted in, a clause per cause), so a fixed part need not be one literal; a page that
    paraphrases, or a message that changed, fails here."""
    page = (DOCS / "operations" / "troubleshooting.md").read_text()
    known: set[tuple[str, ...]] = set()
    for text in _source_strings():
        known |= _triples(text)

    def unknown(message: str) -> float:
        """The share of the message's fixed word triples that psgrad's strings do not hold."""
        triples = [t for frag in message_fragments(message) for t in _triples(frag)]
        return sum(t not in known for t in triples) / max(1, len(triples))

    assert message_fragments("server ADDRESS refused the connection (nothing listens on that port: ...) for 60.0 s") \
        == ["refused the connection (nothing listens on that port"]
    assert unknown("server ADDRESS rejected our connection attempt (no process is bound to the port): ...") > 1 / 3
    blocks = re.findall(r"^```text\n(.*?)^```$", page, re.S | re.M)
    assert len(blocks) >= 10, len(blocks)
    shares = {line: unknown(line) for block in blocks for line in block.splitlines()}
    print("\n".join(f"{share:.2f} {line[:90]}" for line, share in shares.items()))
    missing = [line for line, share in shares.items() if share > 1 / 3]
    assert not missing, "more than a third of these messages' words are not psgrad's:\n" + "\n".join(missing)


# The glossary's terms, linked where a page first uses them (in prose: not in code, headings or
# another link's text).
GLOSSARY_TERMS = ("shard", "chief", "clock", "lease", "gate", "fingerprint", "staleness")
NOT_PROSE = re.compile(r"(`+)(?:.(?!\1))*?.?\1|!?\[[^\]]*\]\([^)]*\)|<!--.*?-->|<https?://[^>]*>")


def _code_spans(lines: list[str]):
    """Per line, the (start, end) of inline code on it, spans carried across lines as CommonMark
    does (a run of N backticks opens, the next run of exactly N closes; a blank line ends it)."""
    opener = None
    for line in lines:
        spans, start = [], 0
        if not line.strip():
            opener = None
        for m in re.finditer(r"`+", line):
            if opener is None:
                opener, start = m.group(), m.start()
            elif m.group() == opener:
                spans.append((start, m.end()))
                opener = None
        if opener is not None:
            spans.append((start, len(line)))
        yield spans


NOT_PROSE = re.compile(r"!?\[[^\]]*\]\([^)]*\)|<!--.*?-->|<https?://[^>]*>")


def _prose_uses(text: str, term: str):
    """(line index, start, end, linked) of each prose use of term (or its plural), in order; linked:
    already a link to the glossary."""
    word = re.compile(rf"(?<![\w/.\-#]){term}s?(?![\w\-/])", re.I)
    lines, fenced = [], False
    for line in text.split("\n"):
        fence = line.lstrip().startswith("```")
        lines.append("" if fenced or fence else line)
        fenced ^= fence
    for n, (line, code) in enumerate(zip(lines, _code_spans(lines))):
        if line.lstrip().startswith("#"):
            continue
        spans = list(code)
        for m in NOT_PROSE.finditer(line):
            if any(a <= m.start() < b for a, b in code):
                continue
            spans.append((m.start(), m.end()))
            if m.group().startswith("[") and f"glossary.md#{term}" in m.group():
                yield n, m.start(), m.end(), True
        for m in word.finditer(line):
            if not any(a <= m.start() < b for a, b in spans):
                yield n, m.start(), m.end(), False


def _first_use(text: str, term: str):
    uses = sorted(_prose_uses(text, term), key=lambda u: (u[0], u[1]))
    return uses[0] if uses else None



GLOSSED_PAGES = ["index.md", "concepts.md", "faq.md", "tutorial.md", "getting-started/*.md", "guide/*.md", "operations/*.md"]


def test_each_page_links_a_glossary_term_where_it_first_uses_it() -> None:
    """On the pages people read in order (home, concepts, FAQ, tutorial, getting started, the guide,
    operations), the first prose use of shard, chief, clock, lease, gate, fingerprint and staleness
    links to its glossary entry, and the glossary has an entry for each."""
    glossary = (DOCS / "glossary.md").read_text()
    for term in GLOSSARY_TERMS:
        assert re.search(rf"^### {term}$", glossary, re.M), f"the glossary has no entry {term!r}"
    assert _first_use("A `shard` here, then a [shard](glossary.md#shard).", "shard")[3]
    assert not _first_use("Each shard, then a [shard](glossary.md#shard).", "shard")[3]
    assert _first_use("`code\nshard` then [shards](glossary.md#shard)", "shard")[3]  # a span across lines
    unlinked = []
    for pattern in GLOSSED_PAGES:
        for page in sorted(DOCS.glob(pattern)):
            text = page.read_text()
            for term in GLOSSARY_TERMS:
                use = _first_use(text, term)
                if use is not None and not use[3]:
                    unlinked.append(f"{page.relative_to(DOCS)}:{use[0] + 1}: {term}")
    assert not unlinked, "first used without a glossary link: " + ", ".join(unlinked)
