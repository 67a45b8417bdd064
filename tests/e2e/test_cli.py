"""The command line with real processes (servers on port 0, workers, status, launch, bad input), and its flags <-> the configs."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, Proc, cli_in_process as cli, process_gone, run_cli, spawn
from psgrad.cli import flags
from psgrad.config import ClientConfig, JobSpec, ServerConfig, WorkerConfig
from psgrad.core.stragglers import StragglerModel


def test_server_announces_writes_port_file_and_stops_on_sigterm(tmp_path: Path) -> None:
    port_file = tmp_path / "addr"
    proc = spawn(["server", "--port", "0", "--port-file", str(port_file)])
    line = proc.wait_for_line("psgrad server listening on ")
    address = line.rsplit(" ", 1)[1]
    assert re.fullmatch(r"127\.0\.0\.1:\d+", address)
    assert port_file.read_text().strip() == address
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert "stopped (SIGTERM)" in proc.output


def test_server_on_a_port_in_use_fails_loudly(start_servers) -> None:  # type: ignore[no-untyped-def]
    (address,) = start_servers(1)
    port = address.rsplit(":", 1)[1]
    res = run_cli(["server", "--port", port], timeout_s=60)
    assert res.returncode != 0
    assert port in res.stderr and "cannot bind" in res.stderr


def test_worker_exits_within_its_deadline_when_the_server_does_not_answer() -> None:
    with socket.socket() as silent:  # accepts TCP, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        start = time.monotonic()
        res = run_cli(["worker", "--servers", address, "--steps", "5", "--connect-timeout-s", "2"], timeout_s=90)
        elapsed = time.monotonic() - start
    assert res.returncode == 1
    assert address in res.stderr and "did not answer" in res.stderr
    assert elapsed < 60  # interpreter start + 2 s deadline, not a hang


def test_unknown_task_is_a_usage_error_listing_valid_tasks(capsys: pytest.CaptureFixture[str]) -> None:
    res = cli(["worker", "--servers", "127.0.0.1:1", "--task", "nope"], capsys)
    assert res.returncode == 2
    assert "unknown task 'nope'" in res.stderr and "digits" in res.stderr
    res = cli(["launch", "--task", "nope"], capsys)
    assert res.returncode == 2 and "digits" in res.stderr


@pytest.mark.parametrize("servers", ["localhost", "a:1,,b:2", "host:99999", ""])
def test_malformed_servers_is_a_usage_error(servers: str) -> None:
    res = run_cli(["status", "--servers", servers])
    assert res.returncode == 2
    assert "HOST:PORT" in res.stderr


def test_every_flag_has_help_text() -> None:
    from psgrad.cli.parser import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.dest == "command")
    assert set(subparsers.choices) >= {"server", "worker", "launch", "status"}
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help and len(action.help) > 10, f"psgrad {name} {action.option_strings[0]} has no help"


# Two servers and two async workers started by hand, their JSONL and `psgrad status`: the by-hand
# page's commands are that job, and test_docs checks them as the test here did (one run, not two).


@pytest.mark.slow
def test_second_worker_with_another_lr_is_refused_naming_the_field(start_servers, capsys) -> None:  # type: ignore[no-untyped-def]
    # A real server process; the two workers (what is tested is the server's refusal and how the
    # worker command reports it) run here: 2 steps and a refused join, not 2 x `import torch`.
    servers = ",".join(start_servers(1))
    chief = cli(["worker", "--servers", servers, "--num-workers", "2", "--steps", "2", "--lr", "0.1"], capsys)
    assert chief.returncode == 0, chief.stderr
    res = cli(["worker", "--servers", servers, "--rank", "1", "--num-workers", "2", "--steps", "2", "--lr", "0.3"], capsys)
    assert res.returncode == 1
    assert "lr: shard has 0.1, worker rank 1 sent 0.3" in res.stderr


def _pids(output: str) -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"\[launch\] started (\S+) \(pid (\d+)\)", output)}


# `psgrad launch` of 2 servers and 2 async workers training digits, its relayed output, final status and
# no child left behind: the launch page's command is that job, and test_docs checks it as the test here did.


def test_launch_metrics_ports_go_to_the_workers_then_the_servers_then_their_backups(capsys: pytest.CaptureFixture[str]) -> None:
    from psgrad.cli.commands import server_metrics_argv
    from psgrad.cli.parser import build_parser

    parse = build_parser().parse_args
    ns = parse(["launch", "--num-servers", "2", "--num-workers", "3", "--replicas", "1", "--metrics-port", "9100"])
    assert [server_metrics_argv(ns, i) for i in range(4)] == [
        ["--metrics-port", str(p)] for p in (9103, 9104, 9105, 9106)]  # workers: 9100-9102
    assert server_metrics_argv(parse(["launch", "--metrics-port", "0"]), 1) == ["--metrics-port", "0"]
    assert server_metrics_argv(parse(["launch"]), 0) == []
    res = cli(["launch", "--num-servers", "2", "--num-workers", "2", "--metrics-port", "65533"], capsys)
    assert res.returncode == 2 and "ports up to 65536" in res.stderr, res.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("extra,says", [((), True), (("--compress-same-host",), False), (("--no-shared-memory",), False)])
def test_a_local_launch_with_compress_says_once_that_same_host_pushes_stay_plain(
    extra: tuple[str, ...], says: bool, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    import psgrad.launch.local

    started: list[int] = []
    monkeypatch.setattr(psgrad.launch.local, "run_launch", lambda *a, **k: started.append(1) or 0)
    res = cli(["launch", "--num-servers", "2", "--num-workers", "2", "--compress", "topk:0.01", *extra], capsys)
    assert res.returncode == 0 and started == [1], res.stderr
    note = "[launch] --compress topk:0.01 compresses pushes between hosts only"
    assert res.stdout.count(note) == (1 if says else 0), res.stdout
    if says:
        assert "add --compress-same-host to compress them too" in res.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_launch_gives_every_server_a_metrics_endpoint_of_its_own_and_stops_every_child_on_ctrl_c() -> None:
    """One endless launch (what each of the two tests merged here started): every server has a metrics
    endpoint of its own, then Ctrl-C stops every child."""
    # launch --metrics-port reached the workers only: the servers, where pushes and pulls are
    # counted, had no endpoint.
    from conftest import scrape

    # A shell starts background jobs (`bash .ci/run &`) with SIGINT ignored, children inherit that,
    # and Python then never raises KeyboardInterrupt. A handler here makes exec reset it to the
    # default in the launcher, as in a foreground job that a Ctrl-C reaches.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc: Proc = spawn(["launch", "--num-servers", "2", "--num-workers", "1", "--mode", "async", "--steps",
                            "100000", "--metrics-port", "0"])
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        urls = {}
        while len(urls) < 3:
            line = proc.wait_for_line("metrics at http://", timeout_s=120)
            name = re.match(r"^\[(\w+)\]", line)
            assert name, line
            urls[name.group(1)] = re.findall(r"http://\S+", line)[0]
        assert set(urls) == {"server0", "server1", "worker0"}, urls
        assert len(set(urls.values())) == 3, urls
        for i in (0, 1):
            deadline = time.monotonic() + 60
            while True:  # an HTTP endpoint tells nobody when it changes: scrape until the shard shows
                m = scrape(urls[f"server{i}"])
                if any(name == "psgrad_rpc_duration_seconds_count" and dict(labels)["shard"] == str(i)
                       for name, labels in m):
                    break
                assert time.monotonic() < deadline, f"server{i}: no call timed for shard {i}"
                time.sleep(0.2)
            assert m[("psgrad_shard_initialized", (("shard", str(i)),))] == 1
            assert m[("process_cpu_seconds_total", ())] > 0 and m[("process_open_fds", ())] > 0
            assert any(name == "psgrad_build_info" for name, _ in m)
        proc.popen.send_signal(signal.SIGINT)  # the worker's calls reached both shards: Ctrl-C mid-run
        assert proc.wait(60) == 130
    finally:
        proc.stop()
    pids = _pids(proc.output)
    assert set(pids) == {"server0", "server1", "worker0"}, proc.output
    assert all(process_gone(pid) for pid in pids.values()), proc.output
    assert "interrupted" in proc.output


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_launch_with_replicas_starts_a_backup_per_shard_and_shows_their_roles() -> None:
    # With --tls the servers replicate over mutual TLS with the servers' certificate and token.
    # One worker: the replication under test is between the servers.
    res = run_cli(["launch", "--replicas", "1", "--num-servers", "2", "--num-workers", "1", "--mode", "sync",
                   "--steps", "30", "--tls"], timeout_s=240)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    m = re.search(r"server\(s\) up: (127\.0\.0\.1:\d+)\|(127\.0\.0\.1:\d+),(127\.0\.0\.1:\d+)\|(127\.0\.0\.1:\d+);", out)
    assert m, out
    p0, b0, p1, b1 = m.groups()
    versions = re.findall(r"^\s+\d+ (127\.0\.0\.1:\d+)\s+\[\d+, \d+\)\s+(\d+)", out, re.M)
    assert versions == [(p0, "30"), (b0, "30"), (p1, "30"), (b1, "30")], out  # the backups are in step
    assert f"{p0} is primary at epoch 0, backup {b0} attached (replicated to version 30)" in out
    assert f"{b1} is backup of {p1} at epoch 0" in out
    assert set(_pids(out)) == {"server0", "server1", "server0-backup", "server1-backup", "worker0"}
    assert all(process_gone(pid) for pid in _pids(out).values())


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_launch_fails_and_cleans_up_when_a_worker_fails() -> None:
    # the worker asks for a GPU that does not exist and exits with an error
    res = run_cli(["launch", "--num-servers", "1", "--num-workers", "1", "--steps", "5", "--device", "cuda:99"],
                  timeout_s=150)
    assert res.returncode == 1
    assert re.search(r"worker0 \(exit code 2\)", res.stdout), res.stdout
    assert "cuda:99" in res.stdout
    pids = _pids(res.stdout)
    assert set(pids) == {"server0", "worker0"} and all(process_gone(pid) for pid in pids.values()), res.stdout


def test_launch_bind_cores_gives_each_worker_its_share_of_the_machines_cores() -> None:
    from psgrad.core.cores import share

    res = run_cli(["launch", "--num-servers", "1", "--num-workers", "2", "--steps", "5", "--bind-cores"], timeout_s=150)
    assert res.returncode == 0, res.stdout + res.stderr
    for rank in range(2):
        cores = ",".join(map(str, share(rank, 2)))
        assert f"[worker{rank}] worker {rank} bound to cores {cores}" in res.stdout, res.stdout


def test_a_bound_worker_runs_on_its_cores_with_no_more_torch_threads_than_them() -> None:
    import torch

    from psgrad.cli.commands import bind_worker, cap_threads
    from psgrad.core.cores import host_cores

    cores, threads = host_cores(), torch.get_num_threads()
    try:
        assert bind_worker(WorkerConfig(servers=())) == [] and os.sched_getaffinity(0) == set(cores)
        bound = bind_worker(WorkerConfig(servers=(), bind_cores=True, local_rank=1, local_workers=max(2, len(cores))))
        cap_threads(bound)
        assert bound == [cores[1 % len(cores)]] and os.sched_getaffinity(0) == set(bound)
        assert torch.get_num_threads() == 1
    finally:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)


def test_a_worker_in_a_task_slurm_bound_keeps_its_cores(monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """--bind-cores in a SLURM task that SLURM bound (SLURM_CPU_BIND_TYPE), with no --local-workers
    (nor a count in the environment) and no --local-rank but SLURM's: the task's cores are its
    share, kept and named; given both flags, it is bound to its run of them."""
    from psgrad.cli.commands import bind_worker
    from psgrad.core.cores import host_cores, share

    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_CPU_BIND_TYPE", "mask_cpu:")
    cores = host_cores()
    try:
        with caplog.at_level(logging.INFO, logger="psgrad.worker"):
            assert bind_worker(WorkerConfig(servers=(), rank=3, bind_cores=True)) == cores
        assert os.sched_getaffinity(0) == set(cores)
        assert f"worker 3 keeps cores {','.join(map(str, cores))}: SLURM bound this task" in caplog.text
        # (psgrad run copies the engine's rank into --local-rank: still the engine's binding)
        assert bind_worker(WorkerConfig(servers=(), bind_cores=True, local_rank=1)) == cores
        assert os.sched_getaffinity(0) == set(cores)
        assert bind_worker(WorkerConfig(servers=(), bind_cores=True, local_rank=1, local_workers=2)) == share(1, 2, cores)
    finally:
        os.sched_setaffinity(0, cores)


@pytest.mark.parametrize(("argv", "message"), [
    (["--bind-cores"], "--bind-cores gives each worker of a host its share of the host's cores, and needs --local-rank"),
    (["--bind-cores", "--local-rank", "0"], "needs --local-workers (how many workers share the host), or "
                                            "LOCAL_WORLD_SIZE or SLURM_NTASKS_PER_NODE"),
    (["--bind-cores", "--local-rank", "2", "--local-workers", "2"], "--local-rank must be < --local-workers (2), got 2"),
    (["--local-workers", "0"], "--local-workers"),
])
def test_bind_cores_without_a_share_of_the_host_is_a_usage_error(
    argv: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("LOCAL_RANK", "SLURM_LOCALID", "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    res = cli(["worker", "--servers", "127.0.0.1:1", "--steps", "1", *argv], capsys)
    assert res.returncode == 2 and message in res.stderr, res.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_launch_with_overlap_trains_and_records_the_wait(tmp_path: Path) -> None:
    res = run_cli(
        ["launch", "--num-servers", "1", "--num-workers", "1", "--mode", "async", "--overlap",
         "--steps", "80", "--metrics-dir", str(tmp_path)],
        timeout_s=200,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "mode async, overlap" in res.stdout
    records = [json.loads(line) for line in (tmp_path / "worker0.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and r.get("event") != "final"]
    assert len(steps) == 80 and all("wait_s" in r and "d2h_s" in r for r in steps)
    assert "exchange_s" not in steps[0] and "exchange_s" in steps[1]  # the first exchange completes at step 2
    assert records[-1]["event"] == "final" and records[-1]["test_accuracy"] > 0.5


def test_overlap_in_sync_mode_is_a_usage_error_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    res = cli(["launch", "--mode", "sync", "--overlap"], capsys)
    assert res.returncode == 2
    assert "overlap needs mode async or ssp" in res.stderr and "[launch]" not in res.stdout


def test_transport_flags_reach_the_configs(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import psgrad.server.runtime
    from psgrad.cli.flags import client_config
    from psgrad.cli.parser import build_parser

    ns = build_parser().parse_args(["worker", "--servers", "127.0.0.1:1", "--no-shared-memory"])
    assert ns.shared_memory is False and "--no-shared-memory" in client_config(ns).to_argv()
    ns = build_parser().parse_args(["worker", "--servers", "127.0.0.1:1"])
    assert ns.shared_memory is True and "--no-shared-memory" not in client_config(ns).to_argv()
    assert build_parser().parse_args(["server", "--push-buffers", "3"]).push_buffers == 3
    assert build_parser().parse_args(["server"]).stream_window_bytes == 4 << 20
    monkeypatch.setattr(psgrad.server.runtime, "serve_forever", lambda *_, **__: pytest.fail("a bad flag was served"))
    res = cli(["server", "--stream-window-bytes", "5"], capsys)
    assert res.returncode == 2 and "--stream-window-bytes must be 0" in res.stderr
    res = cli(["server", "--push-buffers", "0"], capsys)
    assert res.returncode == 2 and "must be >= 1" in res.stderr
    from psgrad.cli.flags import server_config

    assert server_config(build_parser().parse_args(["server"])).max_read_mb == 256
    assert server_config(build_parser().parse_args(["server", "--max-read-mb", "16"])).max_read_mb == 16
    res = cli(["server", "--max-read-mb", "4"], capsys)  # (an export's pages are up to 8 MiB)
    assert res.returncode == 2 and "--max-read-mb must be 0 (no limit) or a finite number >= 8" in res.stderr


def test_server_runs_with_the_torch_threads_asked_for(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    import psgrad.server.runtime
    from psgrad.cli.parser import build_parser

    seen: list[int] = []
    monkeypatch.setattr(psgrad.server.runtime, "serve_forever", lambda config, announce, **_: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    try:
        for argv in (["server", "--torch-threads", "3"], ["server"]):
            ns = build_parser().parse_args(argv)
            assert ns.func(ns) == 0
    finally:
        torch.set_num_threads(before)
    assert seen == [3, 1]  # one by default
    res = cli(["server", "--torch-threads", "0"], capsys)
    assert res.returncode == 2 and "--torch-threads" in res.stderr


# --------------------------------------------------------------------------- flags <-> config
def _parse(*argv: str) -> argparse.Namespace:
    from psgrad.cli.parser import build_parser

    return build_parser().parse_args(list(argv))


def _worker_config(ns: argparse.Namespace, servers: tuple[str, ...]) -> WorkerConfig:
    return flags.worker_config(ns, servers, flags.client_config(ns), ns.rank, ns.slowdown, ns.metrics_out)


def test_flag_defaults_are_the_config_defaults(tmp_path: Path) -> None:
    from psgrad.cli.compare import compare_config
    from psgrad.experiments.compare_config import CompareConfig

    assert flags.server_config(_parse("server")) == ServerConfig()
    for argv, servers in ((["worker", "--servers", "127.0.0.1:1"], ("127.0.0.1:1",)), (["allreduce", "--store", "s"], ())):
        ns = _parse(*argv)
        flags.apply_recipe(ns)  # digits' recipe is the config's defaults
        assert flags.job_spec(ns, ns.num_workers, len(servers) or 1) == JobSpec()
        assert _worker_config(ns, servers) == WorkerConfig(servers=servers)
        assert flags.client_config(ns) == ClientConfig()
    ns = _parse("launch")
    flags.apply_recipe(ns)
    assert (ns.num_servers, ns.num_workers) == (2, 2)  # deliberately more than JobSpec's 1 and 1 (parser.py)
    assert flags.job_spec(ns, JobSpec.num_workers, JobSpec.num_shards) == JobSpec()
    assert flags.worker_config(ns, (), flags.client_config(ns), 0, 1.0, None) == WorkerConfig(servers=())
    assert (ns.lease_s, ns.nonfinite) == (ServerConfig.lease_s, ServerConfig.nonfinite)
    ns = _parse("compare")
    assert ns.omp_threads is None  # deliberately not CompareConfig's 1: a share of this machine's cores
    cfg = compare_config(ns)
    assert cfg.omp_threads >= 1
    assert dataclasses.replace(cfg, out_dir=tmp_path, omp_threads=1) == CompareConfig(out_dir=tmp_path)


SPECS = [
    JobSpec(),
    JobSpec(mode="ssp", staleness=3, num_workers=4, lr=0.05, momentum=0.9, weight_decay=1e-4),
    JobSpec(mode="ssp", staleness=0, num_workers=2),  # an explicit 0, not the CLI's 2 for ssp
    JobSpec(mode="async", num_workers=8, optimizer="adam", lr=1e-3, beta1=0.5, beta2=0.98, eps=1e-6,
            staleness_lr=True, wire_dtype="bfloat16"),
    JobSpec(mode="sync", num_workers=3, optimizer="adamw", lr=3e-4, weight_decay=0.01, wire_dtype="float16"),
    JobSpec(mode="sync", num_workers=2, momentum=0.9, nesterov=True, weight_decay=0.01),
    JobSpec(optimizer="adagrad", lr=0.01, lr_decay=0.01, initial_accumulator_value=0.2, eps=1e-9),
    JobSpec(optimizer="rmsprop", lr=0.01, alpha=0.95, centered=True, momentum=0.5, eps=1e-7),
    JobSpec(optimizer="adadelta", lr=1.0, rho=0.85, eps=1e-6),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.mode}-{s.optimizer}-{s.wire_dtype}")
def test_job_spec_to_argv_rebuilds_the_spec(spec: JobSpec) -> None:
    ns = _parse("worker", "--servers", "127.0.0.1:1", *spec.to_argv())
    assert flags.job_spec(ns, ns.num_workers, len(ns.servers)) == spec
    three = dataclasses.replace(spec, num_shards=3)  # num_shards comes from --servers
    ns = _parse("worker", "--servers", "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3", *three.to_argv())
    assert flags.job_spec(ns, ns.num_workers, len(ns.servers)) == three


WORKERS = [
    WorkerConfig(servers=("127.0.0.1:1",)),
    WorkerConfig(
        servers=("127.0.0.1:1", "[::1]:7001"), task="mnist1d", rank=2, steps=7, batch_size=5, device="cpu", seed=9,
        metrics_out="/tmp/w2.jsonl", metrics_append=True, eval_every=3, log_every=4, slowdown=2.5, jitter_ms=1.5,
        overlap=True,
        save_model="/tmp/m.pt", straggler_model=StragglerModel(dist="pareto", shape=1.5, rotate_steps=20, rotate_first=1),
        client=ClientConfig(connect_timeout_s=2.5, rpc_timeout_s=30.0, init_timeout_s=7.0, reconnect_timeout_s=4.5,
                            shared_memory=False),
    ),
]


@pytest.mark.parametrize("config", WORKERS, ids=["defaults", "every-field"])
def test_worker_config_to_argv_rebuilds_the_config(config: WorkerConfig) -> None:
    ns = _parse("worker", *config.to_argv())
    assert flags.client_config(ns) == config.client
    assert _worker_config(ns, ns.servers) == config
    baseline = dataclasses.replace(config, servers=())  # `psgrad allreduce` takes the same flags, no --servers
    assert "--servers" not in baseline.to_argv()
    assert _worker_config(_parse("allreduce", "--store", "s", *baseline.to_argv()), ()) == baseline


def test_the_parser_imports_neither_torch_nor_grpc() -> None:
    code = ("import sys; from psgrad.cli.main import main; from psgrad.cli.parser import build_parser; "
            "build_parser(); print(sorted(m for m in ('torch', 'grpc', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"  # `psgrad --help` stays fast: commands import them when they run


@pytest.mark.slow
def test_dc_asgd_flags_reach_the_job_spec_and_are_refused_where_nothing_is_stale(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from psgrad.cli.flags import apply_recipe, job_spec
    from psgrad.cli.parser import build_parser

    ns = build_parser().parse_args(["worker", "--servers", "127.0.0.1:1", "--dc-asgd", "2", "--dc-asgd-adaptive"])
    apply_recipe(ns)
    spec = job_spec(ns, 1, 1)
    assert (spec.dc_asgd, spec.dc_asgd_adaptive) == (2.0, True) and "--dc-asgd-adaptive" in spec.to_argv()
    res = cli(["launch", "--mode", "sync", "--dc-asgd", "0.04"], capsys)
    assert res.returncode == 2 and "mode 'sync' applies every gradient" in res.stderr and "[launch]" not in res.stdout
    res = cli(["launch", "--overlap", "--dc-asgd", "0.04"], capsys)
    assert res.returncode == 2 and "overlap and --dc-asgd" in res.stderr
    res = cli(["allreduce", "--store", str(tmp_path / "store"), "--dc-asgd", "0.04"], capsys)
    assert res.returncode == 2 and "all-reduce baseline is synchronous" in res.stderr


@pytest.mark.slow
def test_compress_flags_reach_the_job_and_the_worker_and_bad_names_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    from psgrad.cli.flags import apply_recipe, client_config, job_spec
    from psgrad.cli.parser import build_parser

    ns = build_parser().parse_args(["worker", "--servers", "127.0.0.1:1", "--compress", "sign", "--no-error-feedback",
                                    "--compress-same-host"])
    apply_recipe(ns)
    spec = job_spec(ns, 1, 1)
    assert (spec.compress, spec.error_feedback) == ("sign", False)
    assert client_config(ns).compress_same_host and "--compress-same-host" in client_config(ns).to_argv()
    for args, says in ((["worker", "--servers", "127.0.0.1:1", "--compress", "topk"], "topk needs a ratio"),
                       (["launch", "--compress", "zstd"], "unknown compression 'zstd'"),
                       (["compare", "--modes", "async:compress=topk:2"], "0 < RATIO <= 1")):
        res = cli(args, capsys)
        assert res.returncode == 2 and says in res.stderr, res.stderr
