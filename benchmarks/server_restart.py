"""What a server crash costs a job that checkpoints: SIGKILL one of two servers mid-run, restart it
with the same --checkpoint-dir on the same port, and compare with an uninterrupted run of the same
seed, per mode.

    python benchmarks/server_restart.py --preset full    # 2 servers, 3 workers, 300 steps, each mode
    python benchmarks/server_restart.py --preset tiny    # CI-sized
    python benchmarks/server_restart.py --preset full --modes async,ssp --repeats 3

Real server and worker processes on this machine. Per mode: the final test accuracy of every worker
with and without the kill, the updates the restarted shard lost (applied after its last checkpoint),
how long the server took to come back, and each worker's stall: the longest wait between two of
its completed steps after the kill. In sync mode the job rolls back to the newest iteration both
shards checkpointed and the workers recompute from there: the final weights of every worker are
compared with the uninterrupted run's, bitwise, and the iterations rolled back are reported.
Prints one JSON document.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from psgrad.client.parameter_client import shard_status
from psgrad.launch.supervisor import SupervisedProcess

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"steps": 60, "kill_at": 30, "modes": ["async", "sync"]},
    "full": {"steps": 300, "kill_at": 100, "modes": ["sync", "async", "ssp"]},
}
WORKERS = 3
CHECKPOINT_EVERY_VERSIONS = 20
CHECKPOINT_EVERY_S = 2.0


def _psgrad(name: str, *args: str) -> SupervisedProcess:
    return SupervisedProcess([sys.executable, "-m", "psgrad", *args], name=name, new_session=False)


def _server(directory: Path, port: int = 0) -> tuple[SupervisedProcess, str]:
    proc = _psgrad(f"server-{directory.name}", "server", "--port", str(port), "--checkpoint-dir", str(directory),
                   "--checkpoint-every-versions", str(CHECKPOINT_EVERY_VERSIONS),
                   "--checkpoint-every-s", str(CHECKPOINT_EVERY_S), "--lease-s", "30")
    return proc, proc.wait_for_line("psgrad server listening on ", timeout_s=60).rsplit(" ", 1)[1]


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _stall(records: list[dict[str, Any]], killed_at: float) -> float | None:
    """The longest wait between two consecutive completed steps of a worker that ended after the
    kill: the outage as that worker saw it (a step already under way at the kill may still end).
    None: the worker had completed all its steps before the kill."""
    times = [rec["time"] for rec in records if "step_s" in rec]
    gaps = [b - a for a, b in zip(times, times[1:]) if b > killed_at]
    return round(max(gaps), 3) if gaps else None


def run(mode: str, steps: int, kill_at: int | None, seed: int, work: Path) -> dict[str, Any]:
    """One job; with kill_at, server 0 is killed once worker 0 has logged that step, and restarted."""
    dirs = [work / f"shard{i}" for i in range(2)]
    procs: list[SupervisedProcess] = []
    try:
        servers = [_server(d) for d in dirs]
        procs += [p for p, _ in servers]
        addresses = [a for _, a in servers]
        common = ["--servers", ",".join(addresses), "--num-workers", str(WORKERS), "--steps", str(steps),
                  "--mode", mode, "--seed", str(seed), "--log-every", "10", "--eval-every", str(steps),
                  "--reconnect-timeout-s", "60", "--device", "cpu"]
        workers = [_psgrad(f"worker{r}", "worker", "--rank", str(r), *common, "--metrics-out",
                           str(work / f"w{r}.jsonl"), "--save-model", str(work / f"model{r}.pt")) for r in range(WORKERS)]
        procs += workers
        killed_at = restart_s = None
        if kill_at is not None:
            workers[0].wait_for_line(f"step {kill_at}/", timeout_s=300)
            killed_at = time.time()
            servers[0][0].popen.kill()
            servers[0][0].wait(30)
            port = int(addresses[0].rsplit(":", 1)[1])
            again, _ = _server(dirs[0], port)
            procs.append(again)
            restart_s = time.time() - killed_at
        for w in workers:
            if w.wait(600) != 0:
                raise RuntimeError(f"{w.name} exited with {w.popen.returncode}: {w.output[-2000:]}")
        status = shard_status(addresses, 10.0)
        out: dict[str, Any] = {"updates_lost": [s.updates_lost for s in status], "versions": [s.version for s in status],
                               "rolled_back": [s.rolled_back for s in status]}
        finals, stalls, rollbacks = [], [], []
        for r in range(WORKERS):
            records = _records(work / f"w{r}.jsonl")
            finals.append(next(rec["test_accuracy"] for rec in records if rec.get("event") == "final"))
            rollbacks.append([rec["to_clock"] for rec in records if rec.get("event") == "rollback"])
            if killed_at is not None:
                stalls.append(_stall(records, killed_at))
        out["final_accuracy"] = finals
        out["worker_rollbacks_to"] = rollbacks
        if killed_at is not None:
            out |= {"stall_s": stalls, "restart_s": round(restart_s or 0.0, 3)}
        return out
    finally:
        for p in reversed(procs):
            p.stop()


def _weights_compared(a: Path, b: Path) -> dict[str, Any]:
    """Every worker's saved final model in run a against the same worker's in run b."""
    equal, diff = [], 0.0
    for r in range(WORKERS):
        x, y = torch.load(a / f"model{r}.pt"), torch.load(b / f"model{r}.pt")
        equal.append(list(x) == list(y) and all(torch.equal(x[k], y[k]) for k in x))
        diff = max([diff, *((x[k] - y[k]).abs().max().item() for k in x if k in y)])
    return {"final_weights_bitwise_equal": equal, "final_weights_max_abs_diff": diff}


def bench(preset: str, seed: int = 0, modes: list[str] | None = None, repeats: int = 1) -> dict[str, Any]:
    p = PRESETS[preset]
    results = []
    for repeat in range(repeats):
        for mode in modes or p["modes"]:
            with tempfile.TemporaryDirectory(prefix="psgrad-restart-") as a, tempfile.TemporaryDirectory(prefix="psgrad-restart-") as b:
                base = run(mode, p["steps"], None, seed + repeat, Path(a))
                killed = run(mode, p["steps"], p["kill_at"], seed + repeat, Path(b))
                compared = _weights_compared(Path(a), Path(b))
            results.append({
                "mode": mode,
                "seed": seed + repeat,
                "accuracy_uninterrupted": statistics.mean(base["final_accuracy"]),
                "accuracy_with_kill": statistics.mean(killed["final_accuracy"]),
                "accuracy_points_lost": round(100 * (statistics.mean(base["final_accuracy"]) - statistics.mean(killed["final_accuracy"])), 2),
                "updates_lost_on_killed_shard": killed["updates_lost"][0],
                "iterations_rolled_back": killed["rolled_back"],
                "restart_s": killed["restart_s"],
                "stall_s": killed["stall_s"],
                **compared,
                "uninterrupted": base,
                "with_kill": killed,
            })
    return {"benchmark": "server_restart", "preset": preset, "workers": WORKERS, "steps": p["steps"],
            "kill_at_step": p["kill_at"], "checkpoint_every_versions": CHECKPOINT_EVERY_VERSIONS,
            "checkpoint_every_s": CHECKPOINT_EVERY_S, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="run length (default: tiny)")
    parser.add_argument("--seed", type=int, default=0, help="seed of both runs of a mode (default: 0)")
    parser.add_argument("--modes", type=lambda s: s.split(","), default=None,
                        help="comma-separated modes to run, e.g. async,ssp (default: the preset's)")
    parser.add_argument("--repeats", type=int, default=1, help="run each mode this many times, with seeds "
                        "SEED, SEED+1, ... (default: 1)")
    args = parser.parse_args()
    bad = sorted(set(args.modes or []) - {"sync", "async", "ssp"})
    if bad or args.repeats < 1:
        parser.error(f"--modes takes sync, async and ssp (got {', '.join(bad)})" if bad else "--repeats must be >= 1")
    print(json.dumps(bench(args.preset, args.seed, args.modes, args.repeats), indent=2))


if __name__ == "__main__":
    main()
