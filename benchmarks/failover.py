"""What losing a primary costs a job whose shards have hot-standby backups: SIGKILL the primary of
shard 0 mid-run, no restart, and compare with an uninterrupted run of the same seed; and what the
backup costs while nothing fails: push + pull throughput of a large model with a backup vs none.

    python benchmarks/failover.py --preset full    # 5 kills per mode (the killed server rejoins as
                                                   # the backup between kills), 100 MB throughput
    python benchmarks/failover.py --preset tiny    # CI-sized: one kill per mode, 8 MB throughput

Throughput: one shard (a server process, and a backup process or none), `workers` clients in
this process exchanging (push + pull, through shared memory as on one host) a model of that many
MB for a number of steps; rounds of one run without a backup and one with, each round's ratio
and their median (async: 1 worker, one record per gradient; sync: 3 workers, one record per
iteration, the mean).

Real server and worker processes on this machine: 2 shards, each a primary and a backup
(`--replica-of`), 3 workers given `--servers P0|B0,P1|B1`. Per mode and kill: each worker's stall
(the longest wait between two of its completed steps after the kill, before the next kill) and the
worst over the workers; the checks: every worker finished, every push was applied exactly once on
the survivors (sync: version = steps; async: version = workers x steps, so no acknowledged update
was lost and none applied twice), and in sync mode the final weights are bitwise equal to the
uninterrupted run's (which has no backups at all). With several kills, the killed server is
started again on its port as the backup of the survivor, and the next kill waits until it caught
up. Prints one JSON document.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from psgrad.client.export import export_state_dict
from psgrad.client.parameter_client import ParameterClient, shard_status
from psgrad.config import ClientConfig, JobSpec
from psgrad.core.sharding import ParamSpec, plan_shards
from psgrad.launch.supervisor import SupervisedProcess

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"steps": 60, "kills": 1, "first_kill": 20, "kill_every": 0, "modes": ["sync", "async"],
             "throughput_mb": 8, "throughput_steps": 8, "throughput_rounds": 1},
    "full": {"steps": 400, "kills": 5, "first_kill": 40, "kill_every": 60, "modes": ["sync", "async"],
             "throughput_mb": 100, "throughput_steps": 10, "throughput_rounds": 3},
}
WORKERS = 3
SHARDS = 2
LOG_EVERY = 10


def _psgrad(name: str, *args: str) -> SupervisedProcess:
    return SupervisedProcess([sys.executable, "-m", "psgrad", *args], name=name, new_session=False)


def _server(name: str, *extra: str, port: int = 0) -> tuple[SupervisedProcess, str]:
    proc = _psgrad(name, "server", "--port", str(port), "--lease-s", "30", *extra)
    return proc, proc.wait_for_line("psgrad server listening on ", timeout_s=60).rsplit(" ", 1)[1]


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _stall(records: list[dict[str, Any]], start: float, end: float) -> float | None:
    """The longest wait between two consecutive completed steps, the later one in [start, end):
    the outage as this worker saw it. None: it completed no step in that window."""
    times = [rec["time"] for rec in records if "step_s" in rec]
    gaps = [b - a for a, b in zip(times, times[1:]) if start < b <= end]
    return round(max(gaps), 3) if gaps else None


def _caught_up(backup: str, primary: str, timeout_s: float = 60.0) -> None:
    """Wait until `primary` reports `backup` attached and acknowledging its current version."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        [st] = shard_status([primary], 5.0)
        if st.replica.backup == backup and st.replica.replicated_version >= st.version > 0:
            return
        time.sleep(0.1)  # polling a status from outside the job; nothing to wait on
    raise RuntimeError(f"backup {backup} did not catch up with {primary} within {timeout_s:g} s")


def run(mode: str, steps: int, kill_steps: list[int], seed: int, work: Path, backups: bool) -> dict[str, Any]:
    """One job; at each of kill_steps (worker 0's step count) the primary of shard 0 is killed."""
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
        common = ["--servers", servers, "--num-workers", str(WORKERS), "--steps", str(steps), "--mode", mode,
                  "--seed", str(seed), "--log-every", str(LOG_EVERY), "--eval-every", str(steps),
                  "--reconnect-timeout-s", "30", "--device", "cpu"]
        workers = [_psgrad(f"worker{r}", "worker", "--rank", str(r), *common, "--metrics-out",
                           str(work / f"w{r}.jsonl")) for r in range(WORKERS)]
        procs += workers
        kills: list[float] = []
        serving = shards[0][0]  # shard 0's primary
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
        for w in workers:
            if w.wait(600) != 0:
                raise RuntimeError(f"{w.name} exited with {w.popen.returncode}: {w.output[-3000:]}")
        survivors = [serving] + [s[0] for s in shards[1:]]
        status = shard_status(survivors, 10.0)
        weights, _ = export_state_dict(survivors, 30.0)
        records = [_records(work / f"w{r}.jsonl") for r in range(WORKERS)]
        out: dict[str, Any] = {
            "versions": [s.version for s in status],
            "pushes_duplicate": [s.pushes_duplicate for s in status],
            "epochs": [s.replica.epoch for s in status],
            "final_accuracy": [next(x["test_accuracy"] for x in rs if x.get("event") == "final") for rs in records],
            "weights": weights,
        }
        if kills:
            bounds = kills[1:] + [float("inf")]
            out["stall_s"] = [[_stall(rs, a, b) for rs in records] for a, b in zip(kills, bounds)]
        return out
    finally:
        for p in reversed(procs):
            p.stop()


def throughput(megabytes: int, mode: str, workers: int, steps: int, backup: bool) -> dict[str, float]:
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
        for p in reversed(procs):
            p.stop()


def bench(preset: str, seed: int = 0) -> dict[str, Any]:
    p = PRESETS[preset]
    kill_steps = [p["first_kill"] + k * p["kill_every"] for k in range(p["kills"])]
    results = []
    for mode in p["modes"]:
        with tempfile.TemporaryDirectory(prefix="psgrad-failover-") as a, \
                tempfile.TemporaryDirectory(prefix="psgrad-failover-") as b:
            base = run(mode, p["steps"], [], seed, Path(a), backups=False)
            killed = run(mode, p["steps"], kill_steps, seed, Path(b), backups=True)
        expected = p["steps"] if mode == "sync" else WORKERS * p["steps"]
        worst = [max(s for s in per_kill if s is not None) for per_kill in killed["stall_s"]]
        row: dict[str, Any] = {
            "mode": mode,
            "kills": len(kill_steps),
            "stall_s_worst_worker_per_kill": worst,
            "stall_s_median": statistics.median(worst),
            "stall_s": killed["stall_s"],
            "versions": killed["versions"],
            "expected_version": expected,
            "every_push_applied_once": all(v == expected for v in killed["versions"]),
            "epochs": killed["epochs"],
            "final_accuracy_uninterrupted": base["final_accuracy"],
            "final_accuracy_with_kills": killed["final_accuracy"],
        }
        if mode == "sync":
            row["weights_bitwise_equal"] = list(base["weights"]) == list(killed["weights"]) and all(
                torch.equal(base["weights"][k], killed["weights"][k]) for k in base["weights"]
            )
        results.append(row)
    mb, n = p["throughput_mb"], p["throughput_steps"]
    cost = {}
    for mode, workers in (("async", 1), ("sync", 3)):
        row: dict[str, Any] = {"workers": workers}
        runs = []
        for _ in range(p["throughput_rounds"]):  # a round: one run without a backup, one with
            runs.append((throughput(mb, mode, workers, n, backup=False), throughput(mb, mode, workers, n, backup=True)))
        for key in ("mean", "best"):
            ratios = [w[key] / x[key] for x, w in runs]
            row[key] = {"mb_per_s_no_backup": [round(x[key], 1) for x, _ in runs],
                        "mb_per_s_with_backup": [round(w[key], 1) for _, w in runs],
                        "ratios": [round(r, 3) for r in ratios], "ratio_median": round(statistics.median(ratios), 3),
                        # the fastest run with a backup against the fastest without: the least disturbed pair
                        "ratio_of_bests": round(max(w[key] for _, w in runs) / max(x[key] for x, _ in runs), 3)}
        cost[mode] = row
    return {"benchmark": "failover", "preset": preset, "workers": WORKERS, "shards": SHARDS, "steps": p["steps"],
            "kill_steps": kill_steps, "results": results, "throughput_mb": mb, "throughput": cost}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="run length (default: tiny)")
    parser.add_argument("--seed", type=int, default=0, help="seed of both runs of a mode (default: 0)")
    args = parser.parse_args()
    print(json.dumps(bench(args.preset, args.seed), indent=2))


if __name__ == "__main__":
    main()
