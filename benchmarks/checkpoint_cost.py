"""What checkpointing costs a shard: push+pull throughput with checkpoints beside the same without,
and the time to snapshot, write and read back one checkpoint beside plain memory copies and file I/O
of the same bytes, all in one run.

    python benchmarks/checkpoint_cost.py --preset full    # 25M float32 (100 MB), checkpoints every 10 s;
                                                          # the write part: an Adam shard (300 MB of state)
    python benchmarks/checkpoint_cost.py --preset tiny    # CI-sized: 1M parameters, every 0.5 s

Throughput (`throughput`): two `psgrad server` processes for one shard each, one with
`--checkpoint-dir DIR --checkpoint-every-s S`, one without a checkpoint directory, and one client in
this process pulling and pushing the whole model through one of them at a time (async, SGD, lr
1e-9; the gRPC path, or shared memory with --shared-memory). Rounds of `round_s` seconds alternate
between the two servers, in alternating order; the server not measured is stopped (SIGSTOP) for
the round, so neither its checkpoint writes nor anything else lands in the other's round. Its
checkpoint clock runs on while it is stopped, so a checkpoint that fell due meanwhile is written
as soon as its round begins; `measured_s_per_checkpoint` is the interval the measured rounds
actually had (about S, or less: the expensive side). The checkpoints written inside
the measured rounds are counted from the directory (a thread here lists it every `poll_s`; a
manifest stays until two newer ones are written).

Write and read (`write`): in this process, a Shard restored with random weights and Adam moments
(3 x params float32) is timed for `Shard.snapshot()` (the part that holds the shard's lock: a
memory copy), `checkpoint.save(snapshot, dir)` (what the server's checkpoint thread does, off the
lock: safetensors file, fsync, SHA-256, manifest, rename, keep two), and what a restarted server
does: `checkpoint.load(manifest)` then `Shard.restore` into a fresh shard (`load_and_restore`;
`load` alone is timed too: it checks the SHA-256 and maps the file, and the tensors' bytes are
read when restore copies them); beside, in the same repetitions in alternating order: a memory copy
of the same bytes into a fresh allocation, a plain open/write/fsync of the same bytes, and a plain
read of the checkpoint file into a fresh buffer (from the page cache, as the load reads it here).
The SHA-256 of the file, which save and load both compute, is timed as a diagnostic.

`--parts throughput` or `--parts write` runs one part alone.

Prints one JSON document; progress goes to stderr. The checkpoint files go under --dir (default: the
system's temporary directory), which should be on the disk the servers would write to.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lib import (
    PSGRAD_SERVER,
    Child,
    figure,
    log,
    machine_info,
    paused,
    rep_order,
    start_server,
    stop_all,
    summarize,
    target,
    write_json,
)
from lib.ceilings import MemcpyProbe

from psgrad.client.parameter_client import ParameterClient
from psgrad.config import ClientConfig, JobSpec, ServerConfig
from psgrad.core.codecs import byte_view
from psgrad.core.layout import Layout
from psgrad.core.sharding import ParamSpec, fingerprint, plan_shards
from psgrad.core.status import LIVE
from psgrad.server import checkpoint
from psgrad.server.shard import Shard
from psgrad.server.state import MemberRecord, ShardSnapshot
from psgrad.wire.heap import tune_allocator

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"params": 1_000_000, "every_s": 0.5, "round_s": 1.5, "reps": 2, "poll_s": 0.05,
             "write_params": 1_000_000, "write_reps": 2},
    "full": {"params": 25_000_000, "every_s": 10.0, "round_s": 10.0, "reps": 12, "poll_s": 0.25,
             "write_params": 25_000_000, "write_reps": 7},
}
THROUGHPUT_GOAL = 0.95
SETUP_TIMEOUT_S = 180.0
PLAIN, CHECKPOINTING = "no_checkpoints", "checkpoints"


# ---------------------------------------------------------------------------------------------
# Counting the checkpoints a server writes


class ManifestWatcher:
    """Lists a checkpoint directory every poll_s from a thread and keeps every manifest it saw:
    name, version, the manifest's created_unix_s (when the tensors file was complete) and the size
    of its tensors file. A manifest is deleted only once two newer ones exist, so a poll much
    shorter than the checkpoint interval sees every one."""

    def __init__(self, directory: Path, poll_s: float) -> None:
        self.directory = directory
        self.poll_s = poll_s
        self.seen: dict[str, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="manifest-watcher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        while True:
            self.poll()
            if self._stop.wait(self.poll_s):
                return

    def poll(self) -> None:
        for path in checkpoint.manifests(self.directory):
            if path.name in self.seen:
                continue
            entry: dict[str, Any] = {"name": path.name, "first_seen_unix_s": time.time()}
            try:
                meta = json.loads(path.read_text(encoding="utf-8"))
                entry["version"] = int(meta["version"])
                entry["created_unix_s"] = float(meta["created_unix_s"])
                entry["file_bytes"] = (self.directory / meta["tensors"]["file"]).stat().st_size
            except (OSError, ValueError, KeyError):  # pruned between the listing and the read
                pass
            self.seen[path.name] = entry

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        self._thread.join()
        self.poll()
        return sorted(self.seen.values(), key=lambda e: e["name"])


# ---------------------------------------------------------------------------------------------
# Throughput with and without checkpoints


def _round(client: ParameterClient, flat: torch.Tensor, grad: torch.Tensor, clock: int,
           round_s: float) -> dict[str, Any]:
    """Pull+push iterations until round_s has passed; clocks from `clock` on (async: each push a new one)."""
    start_unix, t0 = time.time(), time.perf_counter()
    iters = 0
    while True:
        client.pull(flat, clock + iters)
        client.push(grad, clock + iters)
        iters += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= round_s:
            break
    return {"start_unix_s": start_unix, "end_unix_s": start_unix + elapsed, "seconds": elapsed, "iters": iters}


def measure_throughput(params: int, every_s: float, round_s: float, reps: int, poll_s: float,
                       shared_memory: bool, work: Path) -> dict[str, Any]:
    """Alternating rounds through a server that checkpoints every every_s and one without."""
    ckpt_dir = work / "shard0"
    children: list[Child] = []
    clients: list[ParameterClient] = []
    watcher: ManifestWatcher | None = None
    try:
        # Like transport.py's one-shard comparison: servers with torch's default thread count.
        servers = {
            PLAIN: start_server("psgrad-no-checkpoints", PSGRAD_SERVER, one_thread=False),
            CHECKPOINTING: start_server("psgrad-checkpoints", [*PSGRAD_SERVER, "--checkpoint-dir", str(ckpt_dir),
                                                               "--checkpoint-every-s", str(every_s)], one_thread=False),
        }
        children += servers.values()
        param_specs = [ParamSpec("weight", (params,), "float32")]
        spec = JobSpec(num_shards=1, lr=1e-9)
        cfg = ClientConfig(rpc_timeout_s=300, init_timeout_s=SETUP_TIMEOUT_S, shared_memory=shared_memory)
        flat = torch.zeros(params)
        grad = torch.full((params,), 1e-3)
        conns: dict[str, ParameterClient] = {}
        for key, server in servers.items():
            conns[key] = ParameterClient([server.address(timeout_s=SETUP_TIMEOUT_S)], spec, param_specs,
                                         plan_shards(param_specs, 1), 0, cfg)
            clients.append(conns[key])
            conns[key].join(initial_weights=lambda: flat)
        clock = 1
        for key in servers:  # warm-up: first use allocates server and client buffers
            for i in range(2):
                conns[key].pull(flat, clock + i)
                conns[key].push(grad, clock + i)
        clock += 2
        log(f"checkpoint_cost: servers up; {reps} repetitions of 2 x {round_s:g} s rounds")

        watcher = ManifestWatcher(ckpt_dir, poll_s)
        watcher.start()
        rounds: dict[str, list[dict[str, Any]]] = {PLAIN: [], CHECKPOINTING: []}
        for rep in range(1, reps + 1):
            for key in rep_order([CHECKPOINTING, PLAIN], rep):
                other = [c for k, c in servers.items() if k != key]
                server = servers[key]
                with paused(other):
                    cpu0 = server.cpu_s()
                    r = _round(conns[key], flat, grad, clock, round_s)
                    r["server_cpu_s"] = server.cpu_s() - cpu0
                clock += r["iters"]
                rounds[key].append(r)
            log(f"checkpoint_cost: repetition {rep}/{reps} done, {len(watcher.seen)} manifests seen so far")
        seen = watcher.stop()
        watcher = None
    finally:
        if watcher is not None:
            watcher.stop()
        for c in clients:
            c.close()
        stop_all(children)

    payload = 4 * params
    windows = [(r["start_unix_s"], r["end_unix_s"]) for r in rounds[CHECKPOINTING]]

    def in_round(entry: dict[str, Any]) -> bool:
        t = entry.get("created_unix_s")
        return t is not None and any(a <= t <= b for a, b in windows)

    written = [e for e in seen if in_round(e)]
    per_round = [sum(1 for e in written if a <= e["created_unix_s"] <= b) for a, b in windows]
    gbps = {k: [2 * r["iters"] * payload / r["seconds"] / 1e9 for r in v] for k, v in rounds.items()}
    total = {k: 2 * sum(r["iters"] for r in v) * payload / sum(r["seconds"] for r in v) / 1e9 for k, v in rounds.items()}
    measured_s = sum(r["seconds"] for r in rounds[CHECKPOINTING])
    ratio = total[CHECKPOINTING] / total[PLAIN]
    per_rep = [c / p for c, p in zip(gbps[CHECKPOINTING], gbps[PLAIN])]
    sizes = [e["file_bytes"] for e in seen if "file_bytes" in e]
    return {
        "params": params,
        "payload_bytes": payload,
        "path": "shared memory" if shared_memory else "gRPC",
        "checkpoint_every_s": every_s,
        "round_s": round_s,
        "reps": reps,
        "poll_s": poll_s,
        # (pulls + pushes) x payload / seconds, over all rounds of each server
        "gb_per_s": total,
        "ratio": ratio,
        "goal": THROUGHPUT_GOAL,
        "met": ratio >= THROUGHPUT_GOAL,
        "ratio_per_rep": per_rep,
        # the median of the paired rounds' ratios: less swayed by a burst of load in one round
        "ratio_median_per_rep": summarize(per_rep)["median"],
        "round_gb_per_s": gbps,
        "server_cpu_s_per_gb": {k: sum(r["server_cpu_s"] for r in v) / (2 * sum(r["iters"] for r in v) * payload / 1e9)
                                for k, v in rounds.items()},
        "checkpoints_written": len(written),  # completed inside the measured rounds
        "checkpoints_per_round": per_round,
        "measured_s": measured_s,
        "measured_s_per_checkpoint": measured_s / len(written) if written else None,
        "checkpoint_file_bytes": max(sizes) if sizes else None,
        "manifests_seen": seen,
        "rounds": rounds,
    }


# ---------------------------------------------------------------------------------------------
# Snapshot, write and read of one checkpoint, beside plain copies and file I/O


def _adam_shard(params: int) -> Shard:
    """A fresh Shard restored from random weights and Adam moments (what a trained Adam shard holds)."""
    spec = JobSpec(optimizer="adam", lr=1e-3)
    param_specs = (ParamSpec("weight", (params,), "float32"),)
    layout = Layout(spec, param_specs, 0, 0, params, fingerprint(param_specs, spec))
    gen = torch.Generator().manual_seed(0)
    optimizer: dict[str, torch.Tensor | float | int] = {"step": 100, "exp_avg": 1e-3 * torch.randn(params, generator=gen),
                 "exp_avg_sq": 1e-6 * torch.rand(params, generator=gen)}
    snap = ShardSnapshot(layout, torch.randn(params, generator=gen), optimizer, 100,
                         (MemberRecord(0, 100, 99, 100, LIVE),))
    shard = Shard(ServerConfig())
    shard.restore(snap)
    return shard


def _tensors(snap: ShardSnapshot) -> list[torch.Tensor]:
    return [snap.weights, *(v for v in snap.optimizer.values() if isinstance(v, torch.Tensor))]


def _same_state(a: ShardSnapshot, b: ShardSnapshot) -> bool:
    """Equal version, weights and optimizer state (tensors bit for bit)."""
    if a.version != b.version or not torch.equal(a.weights, b.weights) or a.optimizer.keys() != b.optimizer.keys():
        return False
    for key, mine in a.optimizer.items():
        theirs = b.optimizer[key]
        if isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor):
            if not torch.equal(mine, theirs):
                return False
        elif mine != theirs:
            return False
    return True


def _plain_write(path: Path, tensors: list[torch.Tensor]) -> None:
    with open(path, "wb") as f:
        for t in tensors:
            f.write(byte_view(t))
        f.flush()
        os.fsync(f.fileno())


def _plain_read(path: Path) -> torch.Tensor:
    buf = torch.empty(path.stat().st_size, dtype=torch.uint8)
    with open(path, "rb", buffering=0) as f:
        view = byte_view(buf)
        off = 0
        while off < len(view):
            n = f.readinto(view[off:])
            if not n:
                raise EOFError(f"{path} ended at byte {off}")
            off += n
    return buf


def measure_write(params: int, reps: int, work: Path) -> dict[str, Any]:
    """Snapshot / save / load of an Adam shard of `params` parameters, each beside its ceiling."""
    tune_allocator()  # the allocator settings of a server process (shard-sized tensors are still mmapped)
    shard = _adam_shard(params)
    directory = work / "adam-shard"
    plain = work / "plain-write.bin"
    snap = shard.snapshot()
    state_bytes = sum(t.numel() * t.element_size() for t in _tensors(snap))
    memcpy = MemcpyProbe(state_bytes)
    version = snap.version
    manifest = checkpoint.save(snap, directory)  # warm-up: directory, first file
    _plain_write(plain, _tensors(snap))
    plain.unlink()
    times: dict[str, list[float]] = {k: [] for k in ("snapshot", "memcpy_fresh", "memcpy_reused", "save", "plain_write",
                                                     "load", "load_and_restore", "plain_read", "sha256")}
    roundtrip_exact = True

    cpu: dict[str, list[float]] = {k: [] for k in ("snapshot", "save", "load_and_restore")}

    def timed(key: str, fn: Callable[[], Any]) -> Any:
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn()
        times[key].append(time.perf_counter() - t0)
        if key in cpu:
            cpu[key].append(time.process_time() - c0)
        return out

    for rep in range(1, reps + 1):
        # Pairs, each in alternating order: the part under the lock beside a memory copy, the write
        # beside a plain write, the read beside a plain read.
        for op in rep_order(["snapshot", "memcpy_fresh", "memcpy_reused"], rep):
            if op == "snapshot":
                snap = timed("snapshot", shard.snapshot)
            elif op == "memcpy_fresh":
                times[op].append(memcpy.fresh_s())
            else:
                times[op].append(memcpy.reused_s())
        version += 1  # a new checkpoint each time, as the server writes them (the third newest pruned)
        snap = dataclasses.replace(snap, version=version)
        for op in rep_order(["save", "plain_write"], rep):
            if op == "save":
                manifest = timed("save", lambda: checkpoint.save(snap, directory))
            else:
                timed("plain_write", lambda: _plain_write(plain, _tensors(snap)))
                plain.unlink()
        data = manifest.with_suffix(".safetensors")
        for op in rep_order(["load", "plain_read", "sha256"], rep):
            if op == "load":
                c0, t0 = time.process_time(), time.perf_counter()
                back = checkpoint.load(manifest)
                t1 = time.perf_counter()
                restored = Shard(ServerConfig())
                restored.restore(back)
                times["load"].append(t1 - t0)
                times["load_and_restore"].append(time.perf_counter() - t0)
                cpu["load_and_restore"].append(time.process_time() - c0)
                again = restored.snapshot()
                roundtrip_exact &= _same_state(again, snap)
                del back, restored, again
            elif op == "plain_read":
                timed("plain_read", lambda: _plain_read(data))
            else:
                timed("sha256", lambda: checkpoint._sha256(data))
        log(f"checkpoint_cost: write repetition {rep}/{reps} done")
    file_bytes = data.stat().st_size
    med = {k: summarize(v)["median"] for k, v in times.items()}
    return {
        "params": params,
        "optimizer": "adam",
        "state_bytes": state_bytes,  # weights + exp_avg + exp_avg_sq
        "checkpoint_file_bytes": file_bytes,
        "reps": reps,
        "torch_threads": torch.get_num_threads(),
        "roundtrip_exact": roundtrip_exact,
        "checkpoints_kept": len(checkpoint.manifests(directory)),
        "median_s": med,
        "times_s": {k: summarize(v) for k, v in times.items()},
        "samples_s": times,
        # CPU seconds (all threads of this process) per operation, median: what a checkpoint takes
        # from the cores a server shares with its workers
        "cpu_s": {k: summarize(v)["median"] for k, v in cpu.items()},
        "ratios": {  # psgrad's time / the ceiling's (lower is better; 1 = as fast as the plain operation)
            "snapshot_vs_memcpy_fresh": med["snapshot"] / med["memcpy_fresh"],
            "save_vs_plain_write": med["save"] / med["plain_write"],
            "load_and_restore_vs_plain_read": med["load_and_restore"] / med["plain_read"],
        },
        "gb_per_s": {k: state_bytes / v / 1e9 for k, v in med.items()},
    }


def _figures(tp: dict[str, Any] | None, wr: dict[str, Any] | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    targets: list[dict[str, Any]] = []
    if tp is not None:
        targets.append(target(f"checkpoint: pull+push GB/s, {tp['payload_bytes'] / 1e6:.0f} MB, {tp['path']}, "
                              f"checkpoints every {tp['checkpoint_every_s']:g} s ({tp['checkpoints_written']} written)",
                              tp["gb_per_s"][CHECKPOINTING], tp["gb_per_s"][PLAIN], THROUGHPUT_GOAL, "higher", "GB/s",
                              "the same without a checkpoint directory"))
    if wr is None:
        return targets, []
    state_mb = wr["state_bytes"] / 1e6
    med = wr["median_s"]
    figures = [
        figure(f"checkpoint: Shard.snapshot() (under the lock), Adam, {state_mb:.0f} MB", med["snapshot"], "s",
               med["memcpy_fresh"], "memory copy into a fresh allocation, same bytes"),
        figure(f"checkpoint: checkpoint.save(), Adam, {state_mb:.0f} MB (off the lock)", med["save"], "s",
               med["plain_write"], "open/write/fsync of the same bytes"),
        figure(f"checkpoint: checkpoint.load() + Shard.restore(), Adam, {state_mb:.0f} MB", med["load_and_restore"],
               "s", med["plain_read"], "plain read of the same file into a fresh buffer (page cache)"),
        figure(f"checkpoint: SHA-256 of the {state_mb:.0f} MB file (part of save and of load)", med["sha256"], "s"),
    ]
    return targets, figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="sizes and durations (default: tiny)")
    parser.add_argument("--params", type=int, help="override the throughput model's float32 parameters")
    parser.add_argument("--write-params", type=int, help="override the Adam shard's parameters (write part)")
    parser.add_argument("--every-s", type=float, help="override --checkpoint-every-s of the checkpointing server")
    parser.add_argument("--round-s", type=float, help="override the length of one measured round")
    parser.add_argument("--reps", type=int, help="override the number of repetitions (a round per server each)")
    parser.add_argument("--shared-memory", action="store_true",
                        help="the client moves payloads through shared memory (default: the gRPC path)")
    parser.add_argument("--parts", default="throughput,write",
                        help="comma-separated parts to run: throughput, write (default: both)")
    parser.add_argument("--dir", type=Path, help="where the checkpoint files go (default: a temporary directory)")
    args = parser.parse_args()
    parts = {part.strip() for part in args.parts.split(",") if part.strip()}
    if not parts or parts - {"throughput", "write"}:
        parser.error(f"--parts takes throughput, write or both, got {args.parts!r}")
    p = PRESETS[args.preset]
    t0 = time.monotonic()
    tp = wr = None
    with tempfile.TemporaryDirectory(prefix="psgrad-ckpt-cost-", dir=args.dir) as tmp:
        work = Path(tmp)
        if "throughput" in parts:
            tp = measure_throughput(args.params or p["params"], args.every_s or p["every_s"],
                                    args.round_s or p["round_s"], args.reps or p["reps"], p["poll_s"],
                                    args.shared_memory, work)
        if "write" in parts:
            wr = measure_write(args.write_params or p["write_params"], p["write_reps"], work)
    targets, figures = _figures(tp, wr)
    out: dict[str, Any] = {"benchmark": "checkpoint_cost", "preset": args.preset, "machine": machine_info()}
    if tp is not None:
        out["throughput"] = tp
    if wr is not None:
        out["write"] = wr
    write_json({**out, "targets": targets, "figures": figures, "elapsed_s": time.monotonic() - t0})


if __name__ == "__main__":
    main()
