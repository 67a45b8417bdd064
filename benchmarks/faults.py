"""What a SIGKILLed process costs a job: the same job with the kill and without (same seed), per
mode, on real server and worker processes on this machine (port 0). Prints one JSON document
("benchmark": fault_recovery, server_restart or failover).

    python benchmarks/faults.py --fault worker --preset full     # 3 workers, 300 steps, sync and ssp
    python benchmarks/faults.py --fault server --preset full     # 2 servers, 3 workers, 300 steps, each mode
    python benchmarks/faults.py --fault server --preset full --modes async,ssp --repeats 3
    python benchmarks/faults.py --fault primary --preset full    # 5 kills per mode (the killed server
                                                                  # rejoins as the backup between kills),
                                                                  # 100 MB throughput
    python benchmarks/faults.py --fault primary --preset tiny    # CI-sized (every fault has a tiny preset;
                                                                  # primary's: 2 workers, one kill per mode,
                                                                  # sync alone run uninterrupted too)

--fault worker: how long a SIGKILLed worker stalls the others. Two servers, and the last of the
workers killed once it has logged step kill_at; the survivors' training time with the kill minus
the time without it is the cost of the failure, to be compared with the lease (--lease-s).

--fault server: what a server crash costs a job that checkpoints. One of two servers is killed
once worker 0 has logged step kill_at, restarted with the same --checkpoint-dir on the same port.
Per mode: the final test accuracy of every worker with and without the kill, the updates the
restarted shard lost (applied after its last checkpoint), how long the server took to come back,
and each worker's stall: the longest wait between two of its completed steps after the kill. In
sync mode the job rolls back to the newest iteration both shards checkpointed and the workers
recompute from there: the final weights of every worker are compared with the uninterrupted
run's, bitwise, and the iterations rolled back are reported. `--task` picks the workers' task
(default digits): with `--task ctr` the model's embedding rows live on the servers, and the job
the servers hold at the end (`psgrad export`: dense weights and every updated row of the sparse
table) is compared with the uninterrupted run's too (`final_servers_bitwise_equal`).

--fault primary: what losing a primary costs a job whose shards have hot-standby backups: the
primary of shard 0 is killed mid-run, no restart; and what the backup costs while nothing fails:
push + pull throughput of a large model with a backup vs none. Throughput: one shard (a server
process, and a backup process or none), `workers` clients in this process exchanging (push + pull,
through shared memory as on one host) a model of that many MB for a number of steps; rounds of one
run without a backup and one with, each round's ratio and their median (async: 1 worker, one
record per gradient; sync: 3 workers, one record per iteration, the mean). The kills: 2 shards,
each a primary and a backup (`--replica-of`), the preset's workers (full: 3; tiny: 2) given
`--servers P0|B0,P1|B1`. Per mode
and kill: each worker's stall (the longest wait between two of its completed steps after the kill,
before the next kill) and the worst over the workers; the checks: every worker finished, every
push was applied exactly once on the survivors (sync: version = steps; async: version = workers x
steps, so no acknowledged update was lost and none applied twice), and in sync mode the final
weights are bitwise equal to the uninterrupted run's (which has no backups at all; the tiny preset
runs no uninterrupted async job, whose accuracy without kills it reports as None). With several
kills, the killed server is started again on its port as the backup of the survivor, and the next
kill waits until it caught up.

A kill follows worker 0's log line. On a busy machine the job can outrun it and finish before the
kill lands; a run where some worker had already finished its steps at a kill (its stall is None)
measured no outage and is run again, up to 3 times ("kill_attempts" in each row).
"""
from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from lib import psgrad_process, psgrad_server, read_jsonl, write_json

from psgrad.client.export import export_state_dict
from psgrad.client.parameter_client import ParameterClient, shard_status
from psgrad.config import ClientConfig, JobSpec
from psgrad.core.sharding import ParamSpec, plan_shards
from psgrad.launch.supervisor import SupervisedProcess

FAULTS = ("worker", "server", "primary")
MODES = ("sync", "async", "ssp")
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "worker": {
        "tiny": {"steps": 60, "kill_at": 20, "modes": ["sync", "ssp"]},
        "full": {"steps": 300, "kill_at": 100, "modes": ["sync", "ssp"]},
    },
    "server": {
        "tiny": {"steps": 60, "kill_at": 30, "modes": ["async", "sync"]},
        "full": {"steps": 300, "kill_at": 100, "modes": ["sync", "async", "ssp"]},
    },
    "primary": {
        # tiny: what CI checks (a kill per mode; sync's bitwise equality to its uninterrupted run) in
        # as few processes as that takes: 2 workers, and no uninterrupted async run (nothing to compare
        # an async run with bit for bit; its accuracy without the kill is reported as None)
        "tiny": {"steps": 60, "kills": 1, "first_kill": 20, "kill_every": 0, "modes": ["sync", "async"],
                 "workers": 2, "uninterrupted_modes": ["sync"],
                 "throughput_mb": 8, "throughput_steps": 8, "throughput_rounds": 1},
        "full": {"steps": 400, "kills": 5, "first_kill": 40, "kill_every": 60, "modes": ["sync", "async"],
                 "workers": 3, "uninterrupted_modes": ["sync", "async"],
                 "throughput_mb": 100, "throughput_steps": 10, "throughput_rounds": 3},
    },
}
WORKERS = 3  # the server fault's workers (--fault primary: the preset's; --fault worker: --workers)
SHARDS = 2
CHECKPOINT_EVERY_VERSIONS = 20  # --fault server
CHECKPOINT_EVERY_S = 2.0
KILL_ATTEMPTS = 3  # runs of a job with a kill, at most, until every kill landed mid-run (_until_mid_run)


# ---------------------------------------------------------------------------------------------
# What the three share: the workers, and what their records say


# --worker-flags: more `psgrad worker` flags for every worker of every job (e.g. compressed pulls)
WORKER_FLAGS: list[str] = []


def _worker_args(servers: str, workers: int, steps: int, mode: str, seed: int, task: str = "digits") -> list[str]:
    """`psgrad worker` arguments every rank of a job gets."""
    return ["--servers", servers, "--num-workers", str(workers), "--steps", str(steps), "--mode", mode,
            "--seed", str(seed), "--log-every", "10", "--eval-every", str(steps), "--task", task, *WORKER_FLAGS]


def _start_workers(count: int, args: list[str], work: Path | None = None, save_model: bool = False,
                   env: dict[str, str] | None = None) -> list[SupervisedProcess]:
    """Ranks 0..count-1 of `psgrad worker ARGS`; with work, rank R writes its records to work/wR.jsonl
    (and with save_model its final model to work/modelR.pt)."""
    def own(r: int) -> list[str]:
        if work is None:
            return []
        return ["--metrics-out", str(work / f"w{r}.jsonl"), *(["--save-model", str(work / f"model{r}.pt")] if save_model else [])]

    return [psgrad_process(f"worker{r}", "worker", "--rank", str(r), *args, *own(r), env=env) for r in range(count)]


def _all_joined(workers: list[SupervisedProcess]) -> None:
    """Wait until every worker has joined its shards: a server killed before a slow-starting worker's
    first call would make that worker fail its join (refused), not ride out the kill."""
    for w in workers:
        w.wait_for_line(": joined ", timeout_s=300)


def _wait_all(workers: list[SupervisedProcess]) -> None:
    for w in workers:
        if w.wait(600) != 0:
            raise RuntimeError(f"{w.name} exited with {w.popen.returncode}: {w.output[-3000:]}")


def _final_accuracy(records: list[dict[str, Any]]) -> float:
    return float(next(rec["test_accuracy"] for rec in records if rec.get("event") == "final"))


def _stall(records: list[dict[str, Any]], start: float, end: float = math.inf) -> float | None:
    """The longest wait between two consecutive completed steps, the later one in (start, end]: the
    outage as this worker saw it (a step already under way at the kill may still end). None: it
    completed no step in that window (it had finished before the kill)."""
    times = [rec["time"] for rec in records if "step_s" in rec]
    gaps = [b - a for a, b in zip(times, times[1:]) if start < b <= end]
    return round(max(gaps), 3) if gaps else None


def _until_mid_run(run: Callable[[Path], dict[str, Any]], work: Path) -> tuple[dict[str, Any], Path]:
    """run(directory) -- a job with its kill(s), returning "stall_s" per worker (a list per kill with
    several) -- in a fresh directory under work, again while some worker had already finished its
    steps when a kill landed (its stall is None). The kill follows worker 0's log line, read by this
    process: on a busy machine the job can outrun it by the few hundred milliseconds its remaining
    steps take, and such a run measured no outage at all. At most KILL_ATTEMPTS runs; the last is
    returned as it is, with "attempts" set."""
    for attempt in range(1, KILL_ATTEMPTS + 1):
        directory = work / f"attempt{attempt}"
        directory.mkdir()
        out = run(directory)
        stalls = out["stall_s"]
        flat = [s for per_kill in stalls for s in per_kill] if stalls and isinstance(stalls[0], list) else stalls
        if all(s is not None for s in flat) or attempt == KILL_ATTEMPTS:
            return out | {"attempts": attempt}, directory
        print(f"faults.py: a kill landed after a worker had finished its steps (stall_s {stalls}): the run "
              f"measured no outage; running it again ({attempt + 1}/{KILL_ATTEMPTS})", file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


def _stop_all(procs: list[SupervisedProcess]) -> None:
    for p in reversed(procs):
        p.stop()


# ---------------------------------------------------------------------------------------------
# --fault worker


def run_worker_kill(mode: str, workers: int, steps: int, lease_s: float, kill_at: int | None,
                    seed: int) -> dict[str, object]:
    """One job; with kill_at, the last worker is killed once it has logged that step."""
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    procs: list[SupervisedProcess] = []
    try:
        servers = [psgrad_server(f"server{i}", "--port", "0", "--lease-s", str(lease_s), env=env) for i in range(2)]
        procs += [p for p, _ in servers]
        ws = _start_workers(workers, _worker_args(",".join(a for _, a in servers), workers, steps, mode, seed), env=env)
        procs += ws
        if kill_at is not None:
            ws[-1].wait_for_line(f"step {kill_at}/", timeout_s=300)
            ws[-1].popen.kill()
            ws[-1].wait(30)
        elapsed = []
        survivors = ws[: workers - 1] if kill_at is not None else ws
        for w in survivors:
            line = w.wait_for_line("final test_loss", timeout_s=600)
            elapsed.append(float(re.search(r"in ([\d.]+) s", line).group(1)))  # type: ignore[union-attr]
        _wait_all(survivors)
        return {"mode": mode, "killed_at_step": kill_at, "survivor_train_s": max(elapsed)}
    finally:
        _stop_all(procs)


def bench_worker(preset: str, seed: int, modes: list[str] | None, workers: int, lease_s: float) -> dict[str, Any]:
    p = PRESETS["worker"][preset]
    results = []
    for mode in modes or p["modes"]:
        t0 = time.perf_counter()
        base = run_worker_kill(mode, workers, p["steps"], lease_s, None, seed)
        killed = run_worker_kill(mode, workers, p["steps"], lease_s, p["kill_at"], seed)
        results.append({
            "mode": mode,
            "baseline_train_s": base["survivor_train_s"],
            "with_kill_train_s": killed["survivor_train_s"],
            "added_s": round(killed["survivor_train_s"] - base["survivor_train_s"], 2),  # type: ignore[operator]
            "lease_s": lease_s,
            "bench_wall_s": time.perf_counter() - t0,
        })
    return {"benchmark": "fault_recovery", "fault": "worker", "preset": preset, "workers": workers,
            "steps": p["steps"], "results": results}


# ---------------------------------------------------------------------------------------------
# --fault server


def _checkpointing_server(directory: Path, port: int = 0) -> tuple[SupervisedProcess, str]:
    return psgrad_server(f"server-{directory.name}", "--port", str(port), "--checkpoint-dir", str(directory),
                         "--checkpoint-every-versions", str(CHECKPOINT_EVERY_VERSIONS),
                         "--checkpoint-every-s", str(CHECKPOINT_EVERY_S), "--lease-s", "30")


def run_server_kill(mode: str, steps: int, kill_at: int | None, seed: int, work: Path, task: str = "digits") -> dict[str, Any]:
    """One job; with kill_at, server 0 is killed once worker 0 has logged that step, and restarted.
    At the end the servers' model (sparse rows included) is exported to work/export.pt."""
    dirs = [work / f"shard{i}" for i in range(2)]
    procs: list[SupervisedProcess] = []
    try:
        servers = [_checkpointing_server(d) for d in dirs]
        procs += [p for p, _ in servers]
        addresses = [a for _, a in servers]
        common = [*_worker_args(",".join(addresses), WORKERS, steps, mode, seed, task),
                  "--reconnect-timeout-s", "60", "--device", "cpu"]
        workers = _start_workers(WORKERS, common, work, save_model=True)
        procs += workers
        killed_at = restart_s = None
        if kill_at is not None:
            _all_joined(workers)
            workers[0].wait_for_line(f"step {kill_at}/", timeout_s=300)
            killed_at = time.time()
            servers[0][0].popen.kill()
            servers[0][0].wait(30)
            port = int(addresses[0].rsplit(":", 1)[1])
            again, _ = _checkpointing_server(dirs[0], port)
            procs.append(again)
            restart_s = time.time() - killed_at
        _wait_all(workers)
        status = shard_status(addresses, 10.0)
        torch.save(export_state_dict(addresses, 60.0)[0], work / "export.pt")
        out: dict[str, Any] = {"updates_lost": [s.updates_lost for s in status], "versions": [s.version for s in status],
                               "rolled_back": [s.rolled_back for s in status]}
        finals, stalls, rollbacks = [], [], []
        for r in range(WORKERS):
            records = read_jsonl(work / f"w{r}.jsonl")
            finals.append(_final_accuracy(records))
            rollbacks.append([rec["to_clock"] for rec in records if rec.get("event") == "rollback"])
            if killed_at is not None:
                stalls.append(_stall(records, killed_at))
        out["final_accuracy"] = finals
        out["worker_rollbacks_to"] = rollbacks
        if killed_at is not None:
            out |= {"stall_s": stalls, "restart_s": round(restart_s or 0.0, 3)}
        return out
    finally:
        _stop_all(procs)


def _same_tensors(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> bool:
    """The same names in the same order, every tensor bit for bit."""
    return list(x) == list(y) and all(torch.equal(x[k], y[k]) for k in x)


def _weights_compared(a: Path, b: Path) -> dict[str, Any]:
    """Every worker's saved final model in run a against the same worker's in run b, and the model
    the servers held at the end (an export: sparse tables' rows included)."""
    equal, diff = [], 0.0
    for r in range(WORKERS):
        x, y = torch.load(a / f"model{r}.pt"), torch.load(b / f"model{r}.pt")
        equal.append(_same_tensors(x, y))
        diff = max([diff, *((x[k] - y[k]).abs().max().item() for k in x if k in y and x[k].is_floating_point())])
    servers = _same_tensors(torch.load(a / "export.pt"), torch.load(b / "export.pt"))
    return {"final_weights_bitwise_equal": equal, "final_weights_max_abs_diff": diff,
            "final_servers_bitwise_equal": servers}


def bench_server(preset: str, seed: int, modes: list[str] | None, repeats: int, task: str = "digits") -> dict[str, Any]:
    p = PRESETS["server"][preset]
    results = []
    for repeat in range(repeats):
        for mode in modes or p["modes"]:
            with tempfile.TemporaryDirectory(prefix="psgrad-restart-") as a, tempfile.TemporaryDirectory(prefix="psgrad-restart-") as b:
                base = run_server_kill(mode, p["steps"], None, seed + repeat, Path(a), task)
                killed, where = _until_mid_run(
                    lambda d: run_server_kill(mode, p["steps"], p["kill_at"], seed + repeat, d, task), Path(b))  # noqa: B023
                compared = _weights_compared(Path(a), where)
            results.append({
                "mode": mode,
                "seed": seed + repeat,
                "accuracy_uninterrupted": statistics.mean(base["final_accuracy"]),
                "accuracy_with_kill": statistics.mean(killed["final_accuracy"]),
                "accuracy_points_lost": round(100 * (statistics.mean(base["final_accuracy"]) - statistics.mean(killed["final_accuracy"])), 2),
                "updates_lost_on_killed_shard": killed["updates_lost"][0],
                "iterations_rolled_back": killed["rolled_back"],
                "restart_s": killed["restart_s"],
                "kill_attempts": killed["attempts"],
                "stall_s": killed["stall_s"],
                **compared,
                "uninterrupted": base,
                "with_kill": killed,
            })
    return {"benchmark": "server_restart", "fault": "server", "preset": preset, "task": task, "workers": WORKERS, "steps": p["steps"],
            "kill_at_step": p["kill_at"], "checkpoint_every_versions": CHECKPOINT_EVERY_VERSIONS,
            "checkpoint_every_s": CHECKPOINT_EVERY_S, "results": results}


# ---------------------------------------------------------------------------------------------
# --fault primary


def _caught_up(backup: str, primary: str, timeout_s: float = 60.0) -> None:
    """Wait until `primary` reports `backup` attached and acknowledging its current version."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        [st] = shard_status([primary], 5.0)
        if st.replica.backup == backup and st.replica.replicated_version >= st.version > 0:
            return
        time.sleep(0.1)  # polling a status from outside the job; nothing to wait on
    raise RuntimeError(f"backup {backup} did not catch up with {primary} within {timeout_s:g} s")


def _server(name: str, *extra: str, port: int = 0) -> tuple[SupervisedProcess, str]:
    return psgrad_server(name, "--port", str(port), "--lease-s", "30", *extra)


def run_primary_kill(mode: str, steps: int, kill_steps: list[int], seed: int, work: Path,
                     backups: bool, workers_count: int = WORKERS) -> dict[str, Any]:
    """One job of workers_count workers; at each of kill_steps (worker 0's step count) the primary of
    shard 0 is killed."""
    procs: list[SupervisedProcess] = []
    try:
        prim = [_server(f"primary{i}") for i in range(SHARDS)]
        procs += [p for p, _ in prim]
        shards = [[a] for _, a in prim]
        live = {a: p for p, a in prim}
        if backups:
            for i in range(SHARDS):
                proc, addr = _server(f"backup{i}", "--replica-of", shards[i][0])
                procs.append(proc)
                shards[i].append(addr)
                live[addr] = proc
        servers = ",".join("|".join(s) for s in shards)
        common = [*_worker_args(servers, workers_count, steps, mode, seed), "--reconnect-timeout-s", "30", "--device", "cpu"]
        workers = _start_workers(workers_count, common, work)
        procs += workers
        kills: list[float] = []
        serving = shards[0][0]  # shard 0's primary
        _all_joined(workers)
        for k, at in enumerate(kill_steps):
            workers[0].wait_for_line(f"step {at}/", timeout_s=300)
            victim = live.pop(serving)
            victim.popen.kill()
            kills.append(time.time())
            victim.wait(30)
            survivor = next(a for a in shards[0] if a != serving)
            if k + 1 < len(kill_steps):  # the killed server rejoins, on its port, as the survivor's backup
                port = int(serving.rsplit(":", 1)[1])
                again, _ = _server(f"rejoined{k}", "--replica-of", survivor, port=port)
                procs.append(again)
                live[serving] = again
                _caught_up(serving, survivor)
            serving = survivor
        _wait_all(workers)
        survivors = [serving] + [s[0] for s in shards[1:]]
        status = shard_status(survivors, 10.0)
        weights, _ = export_state_dict(survivors, 30.0)
        records = [read_jsonl(work / f"w{r}.jsonl") for r in range(workers_count)]
        out: dict[str, Any] = {
            "versions": [s.version for s in status],
            "pushes_duplicate": [s.pushes_duplicate for s in status],
            "epochs": [s.replica.epoch for s in status],
            "final_accuracy": [_final_accuracy(rs) for rs in records],
            "weights": weights,
            # --compress-pull (--worker-flags): the survivors' pulls sent as changes, and exact
            "pulls_compressed": sum(s.delta.compressed for s in status),
            "pulls_exact": sum(s.delta.exact for s in status),
        }
        if kills:
            bounds = kills[1:] + [math.inf]
            out["stall_s"] = [[_stall(rs, a, b) for rs in records] for a, b in zip(kills, bounds)]
        return out
    finally:
        _stop_all(procs)


def backup_throughput(megabytes: int, mode: str, workers: int, steps: int, backup: bool) -> dict[str, float]:
    """Push + pull megabytes per second of `workers` clients (threads of this process, each a
    worker's ParameterClient) against one shard, with or without a backup attached: over the
    whole run ("mean"), and at its fastest step ("best": the least disturbed by other load on a
    shared machine; in sync mode a step is the slowest worker's)."""
    numel = megabytes * (1 << 20) // 4
    params = [ParamSpec("w", (numel,), "float32")]
    spec = JobSpec(mode=mode, num_workers=workers, lr=1e-6, num_shards=1)
    procs: list[SupervisedProcess] = []
    try:
        proc, address = _server("tp-primary")
        procs.append(proc)
        if backup:
            proc, backup_address = _server("tp-backup", "--replica-of", address)
            procs.append(proc)
            address = f"{address}|{backup_address}"
        config = ClientConfig(rpc_timeout_s=120)
        clients = [ParameterClient([address], spec, params, plan_shards(params, 1), r, config) for r in range(workers)]
        barrier = threading.Barrier(workers)
        times: list[float] = []
        per_step: list[list[float]] = [[] for _ in range(workers)]

        def work(rank: int) -> None:
            c = clients[rank]
            c.join((lambda: torch.zeros(numel)) if rank == 0 else None)
            flat, grad = torch.zeros(numel), torch.full((numel,), 1e-3)
            c.pull(flat, 0)
            c.exchange(grad, 0, flat)  # warm-up: buffers, segments, connections
            barrier.wait()
            start = time.perf_counter()
            for clock in range(1, steps + 1):
                t0 = time.perf_counter()
                c.exchange(grad, clock, flat)
                per_step[rank].append(time.perf_counter() - t0)
            times.append(time.perf_counter() - start)
            c.leave()

        threads = [threading.Thread(target=work, args=(r,)) for r in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        for c in clients:
            c.close()
        if len(times) != workers:
            raise RuntimeError("a throughput client failed")
        step_s = min(max(s) for s in zip(*per_step))
        return {"mean": 2 * megabytes * workers * steps / max(times), "best": 2 * megabytes * workers / step_s}
    finally:
        _stop_all(procs)


def bench_primary(preset: str, seed: int, modes: list[str] | None, throughput: bool = True) -> dict[str, Any]:
    p = PRESETS["primary"][preset]
    kill_steps = [p["first_kill"] + k * p["kill_every"] for k in range(p["kills"])]
    job_workers = p["workers"]  # (the throughput part's own counts are `workers` below)
    results = []
    for mode in modes or p["modes"]:
        with tempfile.TemporaryDirectory(prefix="psgrad-failover-") as a, \
                tempfile.TemporaryDirectory(prefix="psgrad-failover-") as b:
            # sync always has its uninterrupted run: its weights are compared bit for bit
            base = (run_primary_kill(mode, p["steps"], [], seed, Path(a), backups=False, workers_count=job_workers)
                    if mode == "sync" or mode in p["uninterrupted_modes"] else None)
            killed, _ = _until_mid_run(lambda d: run_primary_kill(mode, p["steps"], kill_steps, seed, d, backups=True,  # noqa: B023
                                                                  workers_count=job_workers), Path(b))
        expected = p["steps"] if mode == "sync" else job_workers * p["steps"]
        # None: every worker had finished when that kill landed (see _until_mid_run)
        worst = [max((s for s in per_kill if s is not None), default=None) for per_kill in killed["stall_s"]]
        row: dict[str, Any] = {
            "mode": mode,
            "kills": len(kill_steps),
            "kill_attempts": killed["attempts"],
            "stall_s_worst_worker_per_kill": worst,
            "stall_s_median": statistics.median(landed) if (landed := [w for w in worst if w is not None]) else None,
            "stall_s": killed["stall_s"],
            "versions": killed["versions"],
            "expected_version": expected,
            "every_push_applied_once": all(v == expected for v in killed["versions"]),
            "epochs": killed["epochs"],
            "final_accuracy_uninterrupted": None if base is None else base["final_accuracy"],
            "final_accuracy_with_kills": killed["final_accuracy"],
            "pulls_compressed_exact_on_survivors": [killed["pulls_compressed"], killed["pulls_exact"]],
        }
        if base is not None and mode == "sync":
            row["weights_bitwise_equal"] = _same_tensors(base["weights"], killed["weights"])
        results.append(row)
    mb, n = p["throughput_mb"], p["throughput_steps"]
    cost: dict[str, Any] = {}
    for mode, workers in (("async", 1), ("sync", 3)) if throughput else ():
        cost_row: dict[str, Any] = {"workers": workers}
        runs = []
        for _ in range(p["throughput_rounds"]):  # a round: one run without a backup, one with
            runs.append((backup_throughput(mb, mode, workers, n, backup=False),
                         backup_throughput(mb, mode, workers, n, backup=True)))
        for key in ("mean", "best"):
            ratios = [w[key] / x[key] for x, w in runs]
            cost_row[key] = {"mb_per_s_no_backup": [round(x[key], 1) for x, _ in runs],
                        "mb_per_s_with_backup": [round(w[key], 1) for _, w in runs],
                        "ratios": [round(r, 3) for r in ratios], "ratio_median": round(statistics.median(ratios), 3),
                        # the fastest run with a backup against the fastest without: the least disturbed pair
                        "ratio_of_bests": round(max(w[key] for _, w in runs) / max(x[key] for x, _ in runs), 3)}
        cost[mode] = cost_row
    return {"benchmark": "failover", "fault": "primary", "preset": preset, "workers": job_workers, "shards": SHARDS, "steps": p["steps"],
            "kill_steps": kill_steps, "results": results, "throughput_mb": mb, "throughput": cost}


# ---------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fault", choices=FAULTS, required=True, help="the process killed (see above)")
    parser.add_argument("--preset", choices=["tiny", "full"], default="tiny", help="run length (default: tiny)")
    parser.add_argument("--seed", type=int, default=0, help="seed of both runs of a mode (default: 0)")
    parser.add_argument("--modes", type=lambda s: s.split(","), default=None,
                        help="comma-separated modes to run, e.g. async,ssp (default: the preset's)")
    parser.add_argument("--repeats", type=int, help="--fault server: run each mode this many times, with seeds "
                        "SEED, SEED+1, ... (default: 1)")
    parser.add_argument("--workers", type=int, help="--fault worker: workers per run; the last one is killed (default: 3)")
    parser.add_argument("--lease-s", type=float, help="--fault worker: the servers' lease (default: 2)")
    parser.add_argument("--task", help="--fault server: the workers' task, e.g. ctr (its embedding rows on the "
                        "servers; size it with PSGRAD_CTR_ROWS) (default: digits)")
    parser.add_argument("--worker-flags", default="", help="more `psgrad worker` flags for every worker, in one "
                        "string, e.g. \"--compress-pull int8 --compress-same-host\" (default: none)")
    parser.add_argument("--no-throughput", dest="throughput", action="store_false",
                        help="--fault primary: skip the throughput part (what a backup costs while nothing fails)")
    args = parser.parse_args()
    WORKER_FLAGS[:] = shlex.split(args.worker_flags)
    bad = sorted(set(args.modes or []) - set(MODES))
    if bad:
        parser.error(f"--modes takes {', '.join(MODES)} (got {', '.join(bad)})")
    only = {"--repeats": ("server", args.repeats), "--workers": ("worker", args.workers),
            "--lease-s": ("worker", args.lease_s), "--task": ("server", args.task)}
    wrong = [flag for flag, (fault, value) in only.items() if value is not None and fault != args.fault]
    if wrong:
        parser.error(f"{', '.join(wrong)}: not a flag of --fault {args.fault}")
    if args.fault == "worker":
        if args.workers is not None and args.workers < 2:
            parser.error("--workers must be >= 2 (the last one is killed)")
        doc = bench_worker(args.preset, args.seed, args.modes, args.workers or 3,
                           2.0 if args.lease_s is None else args.lease_s)
    elif args.fault == "server":
        if args.repeats is not None and args.repeats < 1:
            parser.error("--repeats must be >= 1")
        doc = bench_server(args.preset, args.seed, args.modes, args.repeats or 1, args.task or "digits")
    else:
        doc = bench_primary(args.preset, args.seed, args.modes, args.throughput)
    doc["worker_flags"] = WORKER_FLAGS
    write_json(doc)


if __name__ == "__main__":
    main()
