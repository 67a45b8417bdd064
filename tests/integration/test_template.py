"""Preloaded children (psgrad/launch/template.py): a fork of the template behaves as a fresh
`python -m psgrad ...` would (output, exit code, environment, process title), a child's own children
are forks of the same template, children die with whoever asked for them, and anything the template
cannot serve is started the plain way."""
from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO, Proc

import psgrad
from psgrad.launch import template


def _psgrad(*args: str) -> list[str]:
    return [sys.executable, "-m", "psgrad", *args]


def _watch(pid: int) -> int:
    """A pidfd for a process known to be running now. Open it before anything may end the process:
    once it has ended and been reaped, its pid can name another process (the suite's many threads
    wrap Linux's pid counter within minutes), and a pidfd opened then would watch that one."""
    return os.pidfd_open(pid)


def _ended_within(pidfd: int, timeout_s: float) -> bool:
    """Wait (on the pidfd, no polling) until its process has exited (or become a zombie); closes it."""
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout_s)
        return bool(ready)
    finally:
        os.close(pidfd)


def _describe(pid: int) -> str:
    """What a process that did not end is doing: its state, and each thread's name and kernel wait."""
    def read(path: str) -> str:
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError as exc:
            return f"({exc.strerror})"

    state = [line for line in read(f"/proc/{pid}/status").splitlines() if line.startswith(("State", "SigBlk", "SigCgt"))]
    threads = []
    for tid in sorted(os.listdir(f"/proc/{pid}/task")) if os.path.isdir(f"/proc/{pid}/task") else []:
        threads.append(f"{read(f'/proc/{pid}/task/{tid}/comm')}: {read(f'/proc/{pid}/task/{tid}/wchan')}")
    return f"pid {pid}: {'; '.join(state)}; threads: {', '.join(threads)}"


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.timeout(120)
def test_a_forked_child_is_the_command_with_its_output_exit_code_environment_and_title() -> None:
    ok = Proc(_psgrad("--version"), cwd=REPO)
    assert ok.wait(60) == 0 and ok.lines == [f"psgrad {psgrad.__version__}"]
    assert isinstance(ok.popen, template.TemplateChild)  # forked, not a cold interpreter
    usage = Proc(_psgrad("worker"), cwd=REPO, stderr_file=True)
    assert usage.wait(60) == 2 and "--servers" in usage.stderr_text() and usage.lines == []
    # The child's environment is its own (the same template serves both: nothing here is read at start-up).
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TF_CONFIG", "JOB_COMPLETION", "SLURM"))}
    runs = [Proc(_psgrad("run", "--num-servers", "1", "--task", "digits"), cwd=REPO, env={**clean, **extra})
            for extra in ({}, {"JOB_COMPLETION_INDEX": "0"})]
    assert [r.wait(60) for r in runs] == [2, 2]
    assert "TF_CONFIG" in runs[0].output and "--role" in runs[1].output, [r.lines for r in runs]
    assert runs[0].popen._template is runs[1].popen._template  # type: ignore[union-attr]
    server = Proc(_psgrad("server", "--host", "127.0.0.1", "--port", "0"), cwd=REPO)
    try:
        server.wait_for_line("psgrad server listening on ")
        with open(f"/proc/{server.popen.pid}/cmdline", "rb") as f:
            assert f.read().startswith(b"python -m psgrad server --host 127.0.0.1 --port 0")  # what ps shows
        server.popen.kill()
        assert server.wait(60) == -signal.SIGKILL  # as Popen reports a signal
    finally:
        server.stop()


@pytest.mark.timeout(180)
def test_a_launchs_children_are_forks_of_the_same_template_and_die_with_the_launch() -> None:
    """`psgrad launch`, itself forked from the tests' template, asks that template for its servers and
    workers (no second torch import); SIGKILL of the launch, which gives it no chance to stop them,
    still ends them: the template sends SIGTERM to the children of an asker that has gone."""
    launch = Proc(_psgrad("launch", "--num-servers", "1", "--num-workers", "1", "--steps", "100000",
                          "--task", "digits"), cwd=REPO)
    try:
        pids = {}
        for name in ("server0", "worker0"):
            line = launch.wait_for_line(f"[launch] started {name} (pid ", timeout_s=90)
            pids[name] = int(re.search(r"pid (\d+)", line).group(1))  # type: ignore[union-attr]
        launch.wait_for_line("[worker0] ", timeout_s=90)
        ours = launch.popen._template  # type: ignore[union-attr]
        assert ours.proc is not None
        assert {name: _parent_of(pid) for name, pid in pids.items()} == {n: ours.proc.pid for n in pids}
        watched = {name: _watch(pid) for name, pid in pids.items()}
        launch.popen.kill()
        assert launch.wait(60) == -signal.SIGKILL
        ended = {name: _ended_within(fd, 60) for name, fd in watched.items()}
        if not all(ended.values()):  # (printed whole: pytest shortens an assertion's message)
            print("\n".join([_describe(pids[name]) for name, done in ended.items() if not done] + launch.lines))
        assert all(ended.values()), ended
    finally:
        launch.stop()


@pytest.mark.timeout(120)
def test_the_templates_children_get_sigterm_when_the_parent_is_killed(tmp_path: Path) -> None:
    """The parent-death signal, as for its plain children: the template ends with its parent, and
    its children with it."""
    code = textwrap.dedent(f"""
        import sys
        from psgrad.launch.supervisor import SupervisedProcess
        p = SupervisedProcess([sys.executable, "-m", "psgrad", "server", "--host", "127.0.0.1", "--port", "0"],
                              cwd={REPO!r}, preload=True)
        p.wait_for_line("listening on", 90)
        print("child", p.popen.pid, flush=True)
        sys.stdin.read()
    """)
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              cwd=REPO)
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()
        assert line.startswith("child "), line
        child = _watch(int(line.split()[1]))
        parent.kill()
        parent.wait(30)
        assert _ended_within(child, 60)
    finally:
        parent.kill()
        parent.wait(30)


@pytest.mark.timeout(60)
def test_what_a_template_cannot_serve_starts_the_plain_way(tmp_path: Path) -> None:
    off = Proc(_psgrad("--version"), cwd=REPO, env={**os.environ, "PSGRAD_PRELOAD": "0"})
    assert off.wait(60) == 0 and isinstance(off.popen, subprocess.Popen)
    (tmp_path / "psgrad").mkdir()  # another psgrad package in the working directory: `-m psgrad` would take it
    (tmp_path / "psgrad" / "__main__.py").write_text("print('the other psgrad')\n")
    (tmp_path / "psgrad" / "__init__.py").write_text("")
    other = Proc(_psgrad("--version"), cwd=tmp_path)
    assert other.wait(60) == 0 and isinstance(other.popen, subprocess.Popen) and other.lines == ["the other psgrad"]
    plain = Proc(["/bin/sh", "-c", "echo hi"])
    assert plain.wait(60) == 0 and isinstance(plain.popen, subprocess.Popen) and plain.lines == ["hi"]


_SCRIPT = """
import json, os, sys
from psgrad.launch.supervisor import SupervisedProcess
child = SupervisedProcess([sys.executable, "-m", "psgrad", "--version"], new_session=False, preload=True)
assert child.wait(60) == 0, child.lines
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "name": __name__, "cwd": os.getcwd(),
                  "preloaded": "torch" in sys.modules, "pgid": os.getpgid(0), "child": child.lines,
                  "child_forked": type(child.popen).__name__}))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("form", ["script", "-c"])
def test_a_script_runs_as_python_would_run_it_and_its_children_share_its_process_group(tmp_path: Path,
                                                                                         form: str) -> None:
    """A benchmark script (or `python -c CODE`) is forked too, with sys.argv, sys.path[0] and __main__ as
    the interpreter gives them; its own child, asked to stay in its session, is a fork of the same
    template in its process group."""
    import json

    script = tmp_path / "probe.py"
    script.write_text(_SCRIPT)
    head = [str(script)] if form == "script" else ["-c", _SCRIPT]
    proc = Proc([sys.executable, *head, "--flag", "x"], cwd=REPO, new_session=False)
    assert proc.wait(60) == 0, proc.lines
    assert isinstance(proc.popen, template.TemplateChild)
    seen = json.loads(proc.lines[-1])
    if form == "script":
        assert seen["argv"] == [str(script), "--flag", "x"] and seen["path0"] == str(tmp_path)
    else:
        assert seen["argv"] == ["-c", "--flag", "x"] and seen["path0"] == ""
    assert seen["name"] == "__main__" and seen["cwd"] == REPO and seen["preloaded"]
    assert seen["child"] == [f"psgrad {psgrad.__version__}"] and seen["child_forked"] == "TemplateChild"
    assert seen["pgid"] == os.getpgid(0)  # new_session=False: the tests' own group, as a plain child's


@pytest.mark.timeout(120)
def test_templates_started_through_a_wrapper_serve_only_who_names_them() -> None:
    """Template.start_all(env, wraps) starts templates through a command that execs them (here `env
    VAR=...`, on a test bed `ip netns exec ...`) and waits until all are ready; SupervisedProcess(
    template=T) forks the command from T (its environment, where it was started), never from the
    template of this process's environment, and refuses what a template cannot run instead of
    starting it the plain way. The template exits at once when closed."""
    from psgrad.launch.supervisor import SupervisedProcess

    wrapped = template.Template.start_all(
        dict(os.environ), [lambda argv, n=n: ["env", f"PSGRAD_TEST_WRAPPED={n}", *argv] for n in (0, 1)])
    try:
        assert all(t not in template.templates() for t in wrapped)  # never handed out by template_for
        code = "import os; print(os.getppid(), open(f'/proc/{os.getppid()}/environ').read().count('PSGRAD_TEST_WRAPPED=1'))"
        child = SupervisedProcess([sys.executable, "-c", code], template=wrapped[1], cwd=REPO)
        assert child.wait(60) == 0, child.output
        assert child.lines == [f"{wrapped[1].proc.pid} 1"]  # a fork of the second template (`env` exec'd it)
        with pytest.raises(OSError, match="a template runs"):
            SupervisedProcess(["/bin/true"], template=wrapped[0])
    finally:
        pidfds = [_watch(t.proc.pid) for t in wrapped if t.proc is not None]
        for t in wrapped:
            t.close()
    assert all(_ended_within(fd, 0) for fd in pidfds)
    assert [t.proc.returncode for t in wrapped if t.proc is not None] == [0, 0]


# Loaded first by an interpreter whose PYTHONPATH starts with its directory: records each collection
# the garbage collector starts while torch and psgrad's server are being imported (from the moment
# torch's import begins until psgrad.server.runtime is whole), one generation a line.
_GC_WATCH = '''
import gc, os, sys
_log = open(os.environ["PSGRAD_TEST_GC_LOG"], "a", buffering=1)
def _importing():
    runtime = sys.modules.get("psgrad.server.runtime")
    return "torch" in sys.modules and getattr(runtime, "serve_forever", None) is None
gc.callbacks.append(lambda phase, info: phase == "start" and _importing() and _log.write(f"{os.getpid()} {info['generation']}\\n"))
'''


@pytest.mark.timeout(120)
@pytest.mark.parametrize("start", ["cold", "template"])
def test_torch_and_the_server_are_imported_with_the_collector_off(tmp_path: Path, start: str) -> None:
    """A cold `psgrad server` (and a template, whose children are servers already imported) imports
    torch and the server without a garbage collection on the way (template.collector_off): the
    collections those imports triggered (three full ones) took 0.3-0.6 s of a server's start."""
    (tmp_path / "sitecustomize.py").write_text(_GC_WATCH)
    log = tmp_path / "collections"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), REPO]), "PSGRAD_TEST_GC_LOG": str(log)}
    server = Proc(_psgrad("server", "--port", "0"), cwd=REPO, env=env, preload=start == "template")
    try:
        server.wait_for_line("listening on", timeout_s=90)
    finally:
        assert server.stop() == 0, server.output
        if start == "template":  # (its environment is this test's alone: no other child will ask for it)
            ours = template.template_for(env, REPO)
            if ours is not None:
                ours.close()
    assert log.is_file(), "the interpreter did not load the test's sitecustomize"
    assert log.read_text() == "", f"collections while torch and the server were imported (pid, generation):\n{log.read_text()}"
