"""How long a SIGKILLed worker stalls the others: one run with and one without a kill, per mode.

    python benchmarks/fault_recovery.py --preset full    # 3 workers, 300 steps, sync and ssp
    python benchmarks/fault_recovery.py --preset tiny    # CI-sized

Starts real server and worker processes on this machine (port 0). The survivors' training time
with the kill minus the time without it is the cost of the failure, to be compared with the lease.
Prints one JSON document.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

PRESETS = {"tiny": {"steps": 60, "kill_at": 20}, "full": {"steps": 300, "kill_at": 100}}
ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))


def _psgrad(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "psgrad", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=ENV)


def _wait_line(proc: subprocess.Popen[str], pattern: str) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:
        if re.search(pattern, line):
            return line
    raise RuntimeError(f"process ended before printing {pattern!r}")


def run(mode: str, workers: int, steps: int, lease_s: float, kill_at: int | None) -> dict[str, object]:
    servers = [_psgrad("server", "--port", "0", "--lease-s", str(lease_s)) for _ in range(2)]
    procs = list(servers)
    try:
        addrs = ",".join(_wait_line(s, "listening on").rsplit(" ", 1)[1].strip() for s in servers)
        common = ["--servers", addrs, "--num-workers", str(workers), "--steps", str(steps), "--mode", mode,
                  "--log-every", "10", "--eval-every", str(steps)]
        ws = [_psgrad("worker", "--rank", str(r), *common) for r in range(workers)]
        procs += ws
        if kill_at is not None:
            _wait_line(ws[-1], rf"step {kill_at}/")
            ws[-1].send_signal(signal.SIGKILL)
            ws[-1].wait()
        elapsed = []
        for w in ws[: workers - 1] if kill_at is not None else ws:
            line = _wait_line(w, r"final test_loss")
            elapsed.append(float(re.search(r"in ([\d.]+) s", line).group(1)))  # type: ignore[union-attr]
            if w.wait() != 0:
                raise RuntimeError(f"worker exited with {w.returncode}")
        return {"mode": mode, "killed_at_step": kill_at, "survivor_train_s": max(elapsed)}
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
            p.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="run length (default: tiny)")
    parser.add_argument("--modes", default="sync,ssp", help="comma-separated modes (default: sync,ssp)")
    parser.add_argument("--workers", type=int, default=3, help="workers per run; the last one is killed (default: 3)")
    parser.add_argument("--lease-s", type=float, default=2.0, help="server lease (default: 2)")
    args = parser.parse_args()
    preset = PRESETS[args.preset]
    results = []
    for mode in args.modes.split(","):
        t0 = time.perf_counter()
        base = run(mode, args.workers, preset["steps"], args.lease_s, None)
        killed = run(mode, args.workers, preset["steps"], args.lease_s, preset["kill_at"])
        results.append({
            "mode": mode,
            "baseline_train_s": base["survivor_train_s"],
            "with_kill_train_s": killed["survivor_train_s"],
            "added_s": round(killed["survivor_train_s"] - base["survivor_train_s"], 2),  # type: ignore[operator]
            "lease_s": args.lease_s,
            "bench_wall_s": time.perf_counter() - t0,
        })
    print(json.dumps({"benchmark": "fault_recovery", "preset": args.preset, "workers": args.workers,
                      "steps": preset["steps"], "results": results}, indent=2))


if __name__ == "__main__":
    main()
