"""Command-line failures an outside check met, each named instead of a traceback, a hang or a
misleading word: a worker's metrics port in use, a --port-file in a folder not made yet, output cut
short by `head`; a script that ends while kernels compile; a usage error shown with the top-level
usage or its command's usage of dozens of lines."""
from __future__ import annotations

import argparse
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, cli_in_process as cli, held_address, hold_port, spawn

from psgrad.cli.commands import worker_exporters
from psgrad.errors import ServerStartError

pytestmark = pytest.mark.timeout(60)


def test_a_workers_metrics_port_in_use_names_the_port_and_the_flag() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ns = argparse.Namespace(metrics_port=port - 1, metrics_host="127.0.0.1", tensorboard=None, progress="off")
        with pytest.raises(ServerStartError, match=f"worker 1: cannot serve metrics on 127.0.0.1:{port} "
                                                   f"\\(--metrics-port {port - 1} \\+ rank 1\\)"):
            worker_exporters(ns, 1, 10, logging.getLogger("test"))


def test_a_servers_port_file_folder_is_made_as_the_metrics_files_are(tmp_path: Path) -> None:
    port_file = tmp_path / "not" / "yet" / "ps0"
    proc = spawn(["server", "--port", "0", "--port-file", str(port_file)])  # (forked from the preloaded template)
    try:
        # the port file is written (atomically) before the server prints its address
        address = proc.wait_for_line("psgrad server listening on ", timeout_s=45).rsplit(" ", 1)[1]
        assert address.startswith("127.0.0.1:") and port_file.read_text() == address + "\n"
    finally:
        proc.stop(grace_s=30)


def test_output_cut_short_is_not_an_error(make_servers) -> None:  # type: ignore[no-untyped-def]
    """`psgrad status ... | head -2` printed a BrokenPipeError traceback: a reader that has read its
    fill is not a failure (here the reader is gone before the first line)."""
    server = make_servers(1)[0]
    read, write = os.pipe()
    os.close(read)
    try:
        res = subprocess.run([sys.executable, "-m", "psgrad", "status", "--servers", server.address], cwd=REPO,
                             stdout=write, stderr=subprocess.PIPE, text=True, timeout=50)
    finally:
        os.close(write)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-2000:]


_EXIT_WHILE_COMPILING = """
import sys, time
from psgrad.core import compiled

def make():
    time.sleep(1.0)  # (a compile still running when the script ends)
    open(sys.argv[1], "w").write("compiled")
    return object()

compiled.get("test-kind", make, start=True, wait=False)
"""


def test_a_script_that_ends_while_kernels_compile_waits_for_them(tmp_path: Path) -> None:
    """Numba's compiler still running on its daemon thread as the interpreter finalized aborted the
    process (exit 134, "terminate called without an active exception"): a short script that ended
    within a second or two of a table's first lookup met it. The exit now waits for compiles in flight."""
    done = tmp_path / "done"
    res = subprocess.run([sys.executable, "-c", _EXIT_WHILE_COMPILING, str(done)], cwd=REPO, capture_output=True,
                         text=True, timeout=50)
    assert res.returncode == 0, res.stderr[-2000:]
    assert done.read_text() == "compiled"  # the compile ended before the process did


# Three jobs of in-process servers, one after another (from_pretrained rows trained in sync and the
# model copied and saved; its state loaded under a wrapper's prefix; a torch weight loaded into a
# dynamic table): the kernels they compiled were freed only as the interpreter finalized.
_THREE_JOBS = """
import copy, io, sys
import torch
from torch import nn
import psgrad
N, D = 20, 3
class M(nn.Module):
    def __init__(s, emb=None):
        super().__init__()
        s.t = emb if emb is not None else psgrad.Embedding(N, D)
        s.b = psgrad.EmbeddingBag(N, D, mode="sum")
        s.h = nn.Linear(D, 1)
    def forward(s, x):
        return s.h(s.t(x) + s.b(x.view(-1, 1))).sum()
class W(nn.Module):
    def __init__(s):
        super().__init__(); s.module = M()
class Dyn(nn.Module):
    def __init__(s):
        super().__init__(); s.t = psgrad.Embedding(None, D); s.h = nn.Linear(D, 1)
def job(model, mode, steps=0):
    srv = [psgrad.serve() for _ in range(2)]
    with psgrad.connect([s.address for s in srv], mode=mode, optimizer=psgrad.SGD(lr=0.1)) as ps:
        opt = ps.optimizer(model)
        for step in range(steps):
            opt.zero_grad(); model(torch.tensor([1, 2, step + 5])).backward(); opt.step()
        state = model.state_dict()
        if steps:
            copy.deepcopy(model); torch.save(model, io.BytesIO())
    for s in srv:
        s.stop()
    return state
state = job(M(psgrad.Embedding.from_pretrained(torch.randn(N, D), freeze=False)), "sync", steps=3)
w = W()
w.load_state_dict({"module." + k: v for k, v in state.items()})
job(w, "sync")
d = Dyn()
d.load_state_dict({"t.weight": torch.randn(N, D), "h.weight": torch.zeros(1, D), "h.bias": torch.zeros(1)})
job(d, "async")
print("done")
"""


def test_a_script_exits_without_tracebacks_from_the_compiled_kernels() -> None:
    """LLVM's objects of the compiled kernels, freed while the interpreter finalized, printed four
    "Exception ignored in: <function ObjectRef.__del__> ... TypeError: 'NoneType' object is not
    callable" tracebacks at the end of this script (found trying psgrad from the outside). The exit
    now lets them go, and collects them, while numba is whole."""
    res = subprocess.run([sys.executable, "-c", _THREE_JOBS], cwd=REPO, capture_output=True, text=True, timeout=100)
    assert res.returncode == 0 and res.stdout.strip().endswith("done"), res.stderr[-2000:]
    assert "Exception ignored" not in res.stderr, res.stderr[-3000:]


@pytest.mark.parametrize("argv, command, error", [
    (["server", "--bogus", "1"], "server", "unrecognized arguments: --bogus 1"),  # (argparse blamed `psgrad`)
    (["server", "--port", "abc"], "server", "argument --port: invalid int value: 'abc'"),
    (["launch", "--num-workers", "two"], "launch", "argument --num-workers"),
])
def test_a_usage_error_shows_its_commands_usage_in_one_line(argv: list[str], command: str, error: str, capsys) -> None:  # type: ignore[no-untyped-def]
    from psgrad.cli.parser import build_parser

    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(argv)
    assert stop.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"usage: psgrad {command} [flags] (psgrad {command} --help: every flag)"
    assert lines[1].startswith(f"psgrad {command}: error: {error}") and len(lines) == 2
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bogus"])  # (no command: the top-level usage, which names them)
    assert "choose from 'server'" in capsys.readouterr().err


def test_grpcs_own_lines_are_muted_on_client_commands_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server's console keeps gRPC's default (why a peer's handshake failed: see test_security);
    a client's is muted; debug shows them anywhere; a GRPC_VERBOSITY the user set wins."""
    from psgrad.cli import logs

    for level, command, expected in (("info", "worker", "NONE"), ("warning", "status", "NONE"),
                                     ("info", "server", None), ("info", "launch", None), ("info", "run", None),
                                     ("debug", "worker", "INFO"), ("debug", "server", "INFO")):
        monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
        logs.quiet_grpc(level, command)
        assert os.environ.get("GRPC_VERBOSITY") == expected, (level, command)
    monkeypatch.setenv("GRPC_VERBOSITY", "ERROR")
    logs.quiet_grpc("info", "worker")
    assert os.environ["GRPC_VERBOSITY"] == "ERROR"


def test_psgrads_own_warnings_are_one_line_on_a_commands_console(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """(A worker printed `.../client/same_host.py:375: UserWarning: ...` and the source line under
    it.) Other packages' warnings keep Python's form."""
    import warnings

    from psgrad.cli import logs
    from psgrad.client import same_host

    others: list[str] = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, category, filename, *rest: others.append(filename))
    logs.one_line_warnings("worker")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn_explicit("the socket broke; Step calls go through gRPC", UserWarning, same_host.__file__, 119)
        warnings.warn_explicit("elsewhere", UserWarning, "/somewhere/else.py", 3)
    assert capsys.readouterr().err.splitlines() == ["psgrad worker: warning: the socket broke; Step calls go through gRPC"]
    assert others == ["/somewhere/else.py"]  # (shown as Python shows them)


def _nothing_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting a worker, an all-reduce process or a launch fails the test."""
    import psgrad.cli.train
    import psgrad.experiments.allreduce
    import psgrad.launch.local

    def started(*_: object, **__: object) -> None:
        pytest.fail("it started")

    monkeypatch.setattr(psgrad.cli.train, "train", started)
    monkeypatch.setattr(psgrad.experiments.allreduce, "train_allreduce", started)
    monkeypatch.setattr(psgrad.launch.local, "run_launch", started)


@pytest.mark.parametrize("command", [["worker", "--servers", "127.0.0.1:1"],
                                     ["allreduce", "--store", "STORE"]])
def test_a_save_model_path_that_cannot_be_written_is_refused_before_anything_starts(
    command: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: a missing folder or a directory given to --save-model was a traceback after training."""
    _nothing_starts(monkeypatch)
    argv = [str(tmp_path / "store") if a == "STORE" else a for a in command]
    for path, says in ((tmp_path / "nodir" / "x.pt", f"folder {str(tmp_path / 'nodir')!r} does not exist"),
                       (tmp_path, "is a directory")):
        res = cli([*argv, "--save-model", str(path)], capsys)
        assert res.returncode == 2, res.stderr
        [error] = [line for line in res.stderr.splitlines() if "error" in line]
        assert error.startswith(f"psgrad {command[0]}: error: --save-model {str(path)!r}") and says in error


def test_a_launch_metrics_dir_that_is_a_file_is_refused_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: every worker failed with a FileExistsError traceback."""
    _nothing_starts(monkeypatch)
    file = tmp_path / "file"
    file.write_text("x")
    for given, says in ((file, f"--metrics-dir {str(file)!r} is a file"),
                        (file / "sub", f"--metrics-dir {str(file / 'sub')!r}: {str(file)!r} is a file")):
        res = cli(["launch", "--metrics-dir", str(given)], capsys)
        assert res.returncode == 2 and f"psgrad launch: error: {says}, not a directory" in res.stderr, res.stderr
        assert "[launch]" not in res.stdout


@pytest.mark.parametrize("argv, error", [
    (["worker", "--servers", "127.0.0.1:1", "--no-error-feedback"],
     "--no-error-feedback needs --compress with a biased codec (topk:RATIO, randomk:RATIO or sign): with --compress "
     "none no push leaves anything out to feed back; leave the flag out, or add --compress topk:0.01 (say)"),
    (["launch", "--compress", "int8", "--no-error-feedback"],
     "--no-error-feedback needs --compress with a biased codec (topk:RATIO, randomk:RATIO or sign): with --compress "
     "int8 no push leaves anything out to feed back; leave the flag out, or add --compress topk:0.01 (say)"),
    (["worker", "--servers", "127.0.0.1:1", "--compress-same-host"],
     "--compress-same-host needs --compress (or --compress-pull): without either nothing is compressed, on this host "
     "or another; leave the flag out, or add --compress topk:0.01 (say)"),
], ids=["worker-noef", "launch-noef-int8", "worker-same-host"])
def test_a_compression_flag_with_nothing_to_act_on_is_refused(argv: list[str], error: str, capsys) -> None:  # type: ignore[no-untyped-def]
    """--no-error-feedback and --compress-same-host without --compress were taken without a word."""
    from psgrad.cli.main import main

    assert main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1].startswith(f"psgrad {argv[0]}: error: {error}"), lines


def test_a_compression_flag_that_acts_is_taken() -> None:
    from psgrad.cli.flags import apply_recipe, job_spec
    from psgrad.cli.parser import build_parser

    for flags in (["--compress", "sign", "--no-error-feedback"], ["--compress-pull", "int8", "--compress-same-host"],
                  ["--compress", "topk:0.01", "--compress-same-host"]):
        ns = build_parser().parse_args(["worker", "--servers", "127.0.0.1:1", *flags])
        apply_recipe(ns)  # (the settings left out: the task's recipe)
        job_spec(ns, 1, 1)


@pytest.mark.parametrize("flags, error", [
    (["--optimizer", "adagrad", "--lr-decay", "-1"], "--lr-decay must be a finite number >= 0, got -1.0"),
    (["--optimizer", "adagrad", "--initial-accumulator-value", "-1"],
     "--initial-accumulator-value must be a finite number >= 0, got -1.0"),
    (["--rho", "0.5"], "--rho applies only to optimizer 'adadelta', got --rho 0.5 with optimizer 'sgd'"),
    (["--dc-asgd", "-1"], "--dc-asgd must be a finite number >= 0 (0: off), got -1.0"),
    (["--backup-workers", "3"], "backup workers apply only to mode 'sync', got --backup-workers 3 with mode 'async'"),
    (["--connect-timeout-s", "0"], "--connect-timeout-s must be > 0, got 0.0"),
], ids=["lr-decay", "initial-accumulator-value", "rho", "dc-asgd", "backup-workers", "connect-timeout-s"])
def test_a_bad_flag_value_is_named_by_its_flag_not_its_field(flags: list[str], error: str, capsys) -> None:  # type: ignore[no-untyped-def]
    """`psgrad worker --lr-decay -1` said 'lr_decay must be ...': the config's field, not the flag given."""
    from psgrad.cli.main import main

    assert main(["worker", "--servers", "127.0.0.1:1", *flags]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"psgrad worker: error: {error}"


def test_only_the_commands_fields_given_bare_become_flags() -> None:
    from psgrad.cli.parser import build_parser, flags_named

    parser = build_parser()
    kept = ("pass client=psgrad.ClientConfig(compress_same_host=True); psgrad.Adagrad(lr=0.1); --lr-decay 1; "
            "/tmp/lr_decay/x; model.weight_decay; rank must be in [0, num_workers=2); the servers refuse it")
    assert flags_named(kept, parser, "worker") == kept
    assert flags_named("lr_decay: shard has 0.0, worker rank 1 sent 0.1", parser, "worker") == \
        "--lr-decay: shard has 0.0, worker rank 1 sent 0.1"  # (a server's JobMismatchError)
    assert flags_named("lease_s must be > 0", parser, "server") == "--lease-s must be > 0"
    assert flags_named("lr_decay must be >= 0", parser, "status") == "lr_decay must be >= 0"  # (not a flag there)


def test_a_servers_step_port_is_checked_and_one_in_use_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    from psgrad.cli.flags import server_config
    from psgrad.cli.parser import build_parser
    from psgrad.config import ServerConfig
    from psgrad.server.runtime import start_server

    for bad in ("70000", "-1", "x"):
        res = cli(["server", "--step-port", bad], capsys)
        assert res.returncode == 2 and f"--step-port: expected a port 0..65535 (0: a free one) or 'off', got '{bad}'" \
            in res.stderr, res.stderr
    parse = build_parser().parse_args
    assert server_config(parse(["server", "--step-port", "off"])).step_port is None
    assert server_config(parse(["server", "--step-port", "7000"])).step_port == 7000
    assert server_config(parse(["server"])).step_port == 0
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ServerStartError, match=f"cannot bind --step-port {port} on 127.0.0.1: .*--step-port 0 "
                                                   "picks a free one"):
            start_server(ServerConfig(port=0, step_port=port))


def test_a_one_shot_status_with_a_server_down_shows_the_others_then_fails(make_servers, capsys) -> None:  # type: ignore[no-untyped-def]
    """An operator's check: with one shard's server down, `psgrad status` printed only that error,
    not the shards that answered. Now it prints every row (the one down says why), then fails with
    its error; where none answers, the error alone."""
    [up] = make_servers(1)
    with hold_port() as held:  # (a stopped server's port, left free, once went to another test's server)
        down = held_address(held)
        addresses = f"{up.address},{down}"
        res = cli(["status", "--servers", addresses, "--timeout-s", "3"], capsys)
        assert res.returncode == 1, res.stderr
        lines = res.stdout.splitlines()
        assert any(up.address in line and "not initialized" in line for line in lines), res.stdout
        assert any(down in line and "not answering" in line for line in lines), res.stdout
        assert f"psgrad status: error: server {down}" in res.stderr, res.stderr
        res = cli(["status", "--servers", down, "--timeout-s", "3"], capsys)
        assert res.returncode == 1 and res.stdout == "" and f"server {down}" in res.stderr, res
