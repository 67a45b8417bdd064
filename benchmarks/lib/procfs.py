"""Readings from /proc (Linux): a process's CPU time and memory, and how busy the whole machine was."""
from __future__ import annotations

import os
import threading


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # fields[0] is the state (field 3 of stat(5)); utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_bytes(pid: int) -> dict[str, int]:
    """VmHWM (peak resident), VmRSS, RssAnon, RssFile and RssShmem of a process, in bytes.
    `own` = RssAnon + RssFile: resident memory without shared-memory pages (such as the workers'
    same-host segments a server maps)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) * 1024  # the kernel reports kB
    out["own"] = out.get("RssAnon", 0) + out.get("RssFile", 0)
    return out


class OwnPeak:
    """Samples each process's `own` memory (see memory_bytes) every interval_s in a thread and
    keeps the highest value seen: the kernel keeps a peak (VmHWM) only for all resident pages."""

    def __init__(self, pids: dict[str, int], interval_s: float = 0.02) -> None:
        self.peak = {n: memory_bytes(pid)["own"] for n, pid in pids.items()}
        self._pids = pids
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(interval_s,), daemon=True)
        self._thread.start()

    def _loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.sample()

    def sample(self) -> None:
        """Take one reading of every process now."""
        for n, pid in self._pids.items():
            try:
                self.peak[n] = max(self.peak[n], memory_bytes(pid)["own"])
            except (OSError, ValueError):
                pass  # the process is gone (shutdown): the peak stays

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    total = sum(values[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    tick = os.sysconf("SC_CLK_TCK")
    return (total - idle) / tick, total / tick


def busy_fraction(before: tuple[float, float], after: tuple[float, float]) -> float:
    """Share of all CPUs' time that was busy between two machine_busy() readings (within [0, 1]:
    the readings are tick counts divided into seconds, so two ticks' difference may come out a
    rounding above the other's, 0.02 / 0.02 as 1.0000000007)."""
    total = after[1] - before[1]
    return min(1.0, max(0.0, (after[0] - before[0]) / total)) if total > 0 else 0.0
