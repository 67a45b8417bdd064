"""What a feature costs a shard: the same traffic to a server with the feature and to one without,
in one run, rounds alternating, so machine noise hits both alike.

    python benchmarks/feature_cost.py --feature checkpoint --preset full   # 25M float32 (100 MB), checkpoints
                                                                           # every 10 s; the write part: an
                                                                           # Adam shard (300 MB of state)
    python benchmarks/feature_cost.py --feature checkpoint --preset tiny   # CI-sized: 1M parameters, every 0.25 s
    python benchmarks/feature_cost.py --feature metrics --preset full      # 100 MB push/pull x 30, 300
                                                                           # small-model steps a round
    python benchmarks/feature_cost.py --feature metrics --preset full --reps 20   # a preset, one size changed
    python benchmarks/feature_cost.py --feature tls --preset full          # 100 MB push + pull x 8 rounds,
                                                                           # 300 small-model steps per round

Prints one JSON document ("benchmark": checkpoint_cost, metrics_cost or tls_cost); progress goes to
stderr. Flags that set one value of a preset apply to the features named in their help.

--feature checkpoint. Throughput (`throughput`): two `psgrad server` processes for one shard each,
one with `--checkpoint-dir DIR --checkpoint-every-s S`, one without a checkpoint directory, and one
client in this process pulling and pushing the whole model through one of them at a time (async,
SGD, lr 1e-9; the gRPC path, or shared memory with --shared-memory). Rounds of `round_s` seconds
alternate between the two servers, in alternating order; the server not measured is stopped
(SIGSTOP) for the round, so neither its checkpoint writes nor anything else lands in the other's
round. Its checkpoint clock runs on while it is stopped, so a checkpoint that fell due meanwhile is
written as soon as its round begins; `measured_s_per_checkpoint` is the interval the measured rounds
actually had (about S, or less: the expensive side). The checkpoints written inside the measured
rounds are counted from the directory (a thread here lists it every `poll_s`; a manifest stays until
two newer ones are written).
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
`--parts throughput` or `--parts write` runs one part alone. The checkpoint files go under --dir
(default: the system's temporary directory), which should be on the disk the servers would write to.

--feature metrics. For each model, `psgrad server` processes run side by side: "on" with
`--metrics-port 0` (every call timed by the interceptor, /metrics scraped every --scrape-s seconds
by a thread here, harsher than Prometheus' usual 15 s), "off" without, and (preset full) "off2",
also without: the off2/off ratios are what noise alone does to the same comparison. Each round
sends the same calls to all three, taking turns (each side in each place in rotation), so all see
the same machine noise:
- a push and a pull of a --mb float32 model (one shard, gRPC frames: the path across hosts);
- --steps small-model iterations (push + pull of 100K parameters as one Step call), turn by turn
  step by step; on the metrics side each step's record also goes to a worker's Prometheus
  exporter (scraped too), as `psgrad worker --metrics-port` does, so the step latency carries both
  ends' metrics.
Reports medians and the ratios on/off (throughput: goal >= 0.98; latency: off/on, the same way up),
as the ratio of the medians and as the median of the ratios of back-to-back turns (paired_*),
beside the noise ratios off2/off, computed the same ways.

--feature tls. `psgrad server` processes on loopback, one per model and side:
- plain: no TLS, no credential (what a job without security runs);
- tls: mutual TLS and a token per call (what `psgrad launch --tls` runs: a certificate per worker,
  checked at the handshake, and the job secret's token checked on every call by the server's guard);
- tokens (small model only): the token without TLS, over gRPC's local credentials (`--tokens`).
Each round sends, per side in alternating order, a push and a pull of a --mb float32 model (one
shard, gRPC frames: the path across hosts; the same-host shared-memory path is off, since it would
bypass TLS) and --steps iterations of a 100K-parameter model (push + pull as one Step call).
Reports medians and ratios against plaintext: throughput secured/plain (1.0 = free) and step
latency secured/plain (1.0 = free).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lib import (
    PSGRAD_SERVER,
    SETUP_TIMEOUT_S,
    Child,
    figure,
    log,
    machine_info,
    overrides,
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
from psgrad.config import AuthConfig, ClientConfig, JobSpec, ServerConfig, TlsConfig
from psgrad.core.codecs import byte_view
from psgrad.core.credentials import derive_token
from psgrad.core.layout import Layout
from psgrad.core.sharding import ParamSpec, fingerprint, plan_shards
from psgrad.core.status import LIVE
from psgrad.launch.certs import CertFiles, write_job_certs
from psgrad.metrics.exporters import PrometheusExporter
from psgrad.server import checkpoint
from psgrad.server.shard import Shard
from psgrad.server.state import MemberRecord, ShardSnapshot
from psgrad.server.tables import DENSE, TableSnapshot
from psgrad.wire.heap import tune_allocator

FEATURES = ("checkpoint", "metrics", "tls")
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "checkpoint": {
        "tiny": {"params": 1_000_000, "every_s": 0.25, "round_s": 0.75, "reps": 2, "poll_s": 0.05,
                 "write_params": 1_000_000, "write_reps": 2},
        "full": {"params": 25_000_000, "every_s": 10.0, "round_s": 10.0, "reps": 12, "poll_s": 0.25,
                 "write_params": 25_000_000, "write_reps": 7},
    },
    "metrics": {  # noise: also run the off2 servers
        "tiny": {"mb": 2.0, "reps": 2, "steps": 10, "scrape_s": 0.2, "noise": 0},  # no off2: 4 servers, not 6
        "full": {"mb": 100.0, "reps": 30, "steps": 300, "scrape_s": 1.0, "noise": 1},
    },
    "tls": {"tiny": {"mb": 4.0, "reps": 2, "steps": 20}, "full": {"mb": 100.0, "reps": 8, "steps": 300}},
}
# flag (its dest) -> the features it applies to; --reps applies to every one
FLAGS: dict[str, tuple[str, ...]] = {
    "params": ("checkpoint",), "write_params": ("checkpoint",), "every_s": ("checkpoint",), "round_s": ("checkpoint",),
    "shared_memory": ("checkpoint",), "parts": ("checkpoint",), "dir": ("checkpoint",),
    "mb": ("metrics", "tls"), "steps": ("metrics", "tls"), "scrape_s": ("metrics",),
}
SMALL = 100_000  # the small model's parameters (metrics, tls)


def _joined(address: str, params: int, spec: JobSpec, config: ClientConfig) -> tuple[ParameterClient, list[int]]:
    """Rank 0 of a one-shard job of `params` float32 values, joined (it initializes the shard with
    zeros), and its clock in a list, to be advanced in place."""
    specs = [ParamSpec("weight", (params,), "float32")]
    client = ParameterClient([address], spec, specs, plan_shards(specs, 1), 0, config)
    return client, [client.join(initial_weights=lambda: torch.zeros(params))]


# =============================================================================================
# --feature checkpoint

THROUGHPUT_GOAL = 0.95
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
        spec = JobSpec(num_shards=1, lr=1e-9)
        cfg = ClientConfig(rpc_timeout_s=300, init_timeout_s=SETUP_TIMEOUT_S, shared_memory=shared_memory)
        flat = torch.zeros(params)
        grad = torch.full((params,), 1e-3)
        conns: dict[str, ParameterClient] = {}
        for key, server in servers.items():
            conns[key], _ = _joined(server.address(timeout_s=SETUP_TIMEOUT_S), params, spec, cfg)
            clients.append(conns[key])
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
    tensors = {"weights": torch.randn(params, generator=gen),
               **{"optimizer." + k: v for k, v in optimizer.items() if isinstance(v, torch.Tensor)}}
    scalars = {k: v for k, v in optimizer.items() if not isinstance(v, torch.Tensor)}
    snap = ShardSnapshot(layout, {DENSE: TableSnapshot("dense", tensors, scalars)}, 100,
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



def run_checkpoint(preset: str, p: dict[str, Any], parts: set[str], shared_memory: bool,
                   directory: Path | None) -> dict[str, Any]:
    """The parts asked for (throughput, write) with the preset's values p; the files under directory."""
    t0 = time.monotonic()
    tp = wr = None
    with tempfile.TemporaryDirectory(prefix="psgrad-ckpt-cost-", dir=directory) as tmp:
        work = Path(tmp)
        if "throughput" in parts:
            tp = measure_throughput(p["params"], p["every_s"], p["round_s"], p["reps"], p["poll_s"],
                                    shared_memory, work)
        if "write" in parts:
            wr = measure_write(p["write_params"], p["write_reps"], work)
    targets, figures = _figures(tp, wr)
    out: dict[str, Any] = {"benchmark": "checkpoint_cost", "feature": "checkpoint", "preset": preset,
                           "machine": machine_info()}
    if tp is not None:
        out["throughput"] = tp
    if wr is not None:
        out["write"] = wr
    return {**out, "targets": targets, "figures": figures, "elapsed_s": time.monotonic() - t0}


# =============================================================================================
# --feature metrics

RATIOS = (("push", "push_throughput"), ("pull", "pull_throughput"), ("step", "step_rate"))
SIDES = ("on", "off", "off2")  # off2: a second server without metrics, the noise floor (off2 vs off)


def _scrape(url: str, stop: threading.Event, every_s: float, count: list[int]) -> None:
    """Scrape `url` every `every_s` seconds until `stop`, counting the scrapes answered (one the
    endpoint refuses, as a server's before it listens, is not counted)."""
    while not stop.wait(every_s):
        try:
            urllib.request.urlopen(url, timeout=10).read()
        except OSError:
            continue
        count[0] += 1


def measure_metrics(mb: float, reps: int, steps: int, scrape_s: float, noise: bool) -> dict[str, Any]:
    big = int(mb * 1e6 / 4)
    sides = SIDES if noise else SIDES[:2]
    children: list[Child] = []
    clients: list[ParameterClient] = []
    stop, scrapes = threading.Event(), [0]
    exporter = PrometheusExporter(rank=0, host="127.0.0.1", port=0)  # the metrics side's worker endpoint
    threading.Thread(target=_scrape, args=(exporter.url, stop, scrape_s, scrapes), daemon=True).start()
    try:
        for job in ("bulk", "small"):  # a server serves one model: one set of sides per model
            for side in sides:
                children.append(start_server(f"{job}-{side}", [*PSGRAD_SERVER, *(
                    ["--metrics-port", "0"] if side == "on" else [])]))
        urls = [exporter.url]
        for child in children[::len(sides)]:
            urls.append(child.wait_line("metrics at ", timeout_s=180).rsplit(" ", 1)[1])  # logged before it listens
            threading.Thread(target=_scrape, args=(urls[-1], stop, scrape_s, scrapes), daemon=True).start()
        addrs = [c.address(timeout_s=180) for c in children]
        spec, config = JobSpec(mode="async", num_workers=2, num_shards=1, lr=1e-9), ClientConfig(shared_memory=False)
        bulk = {side: _joined(addrs[i], big, spec, config) for i, side in enumerate(sides)}
        grad, flat = torch.full((big,), 1e-3), torch.empty(big)
        small = {side: _joined(addrs[len(sides) + i], SMALL, spec, config) for i, side in enumerate(sides)}
        clients += [c for c, _ in (*bulk.values(), *small.values())]
        clocks = {side: [bulk[side][1][0], small[side][1][0]] for side in sides}
        sgrad, sflat = torch.full((SMALL,), 1e-3), torch.empty(SMALL)
        push: dict[str, list[float]] = {s: [] for s in sides}
        pull: dict[str, list[float]] = {s: [] for s in sides}
        step: dict[str, list[float]] = {s: [] for s in sides}
        log(f"metrics_cost: {reps} rounds of a {mb:g} MB push + pull and {steps} small steps per side")
        turns = [sides[k:] + sides[:k] for k in range(len(sides))]  # each side in each place in turn
        for rep in range(reps + 1):  # round 0 warms up
            for side in turns[rep % len(turns)]:
                client, c = bulk[side][0], clocks[side]
                t0 = time.perf_counter()
                client.push(grad, c[0])
                t1 = time.perf_counter()
                client.pull(flat, c[0] + 1)
                t2 = time.perf_counter()
                c[0] += 1
                if rep:
                    push[side].append(t1 - t0)
                    pull[side].append(t2 - t1)
            for i in range(steps):  # step by step in turn: every side sees the same moment's load
                for side in turns[(rep * steps + i) % len(turns)]:
                    c = clocks[side]
                    s0 = time.perf_counter()
                    replies, _ = small[side][0].exchange(sgrad, c[1], sflat)
                    if side == "on":
                        took = time.perf_counter() - s0
                        exporter.record({"step": c[1] + 1, "clock": c[1], "loss": 1.0, "lr": 1e-9, "step_s": took,
                                         "staleness": max(r.staleness for r in replies), "exchange_s": took,
                                         "wait_s": took, "compute_s": 0.0})
                    if rep:
                        step[side].append(time.perf_counter() - s0)
                    c[1] += 1
        # Every endpoint scraped once more while its server still serves (those scraped in the
        # background depend on how long the rounds took: a fast machine's tiny run left some none).
        for url in urls:
            urllib.request.urlopen(url, timeout=30).read()
            scrapes[0] += 1
    finally:
        stop.set()
        exporter.close()
        for client in clients:
            client.close()
        stop_all(children)
    series = {"push": push, "pull": pull, "step": step}
    med = {f"{name}_s": {side: summarize(values[side])["median"] for side in sides} for name, values in series.items()}

    def paired(name: str, base: str, other: str) -> float:
        """The median over turns of base's time / other's: each pair measured back to back, so a
        load that changes from second to second cancels out."""
        return summarize([b / o for b, o in zip(series[name][base], series[name][other], strict=True)])["median"]

    out: dict[str, Any] = {
        "payload_mb": big * 4 / 1e6,
        "reps": reps,
        "steps_per_round": steps,
        "scrapes": scrapes[0],
        "median": med,
        # throughput (or step rate) with metrics over without: ratios of the medians, and the median
        # of the ratios of back-to-back turns
        **{f"{name}_ratio_on_off": med[f"{key}_s"]["off"] / med[f"{key}_s"]["on"] for key, name in RATIOS},
        **{f"paired_{name}_ratio_on_off": paired(key, "off", "on") for key, name in RATIOS},
        "goal": 0.98,
    }
    if noise:  # the same between the two servers without metrics: how far apart noise alone puts them
        out.update({f"noise_{name}_ratio_off2_off": med[f"{key}_s"]["off"] / med[f"{key}_s"]["off2"] for key, name in RATIOS})
        out.update({f"noise_paired_{name}_ratio_off2_off": paired(key, "off", "off2") for key, name in RATIOS})
    return out



# =============================================================================================
# --feature tls


class TlsSides:
    """Each side's server flags and the worker-0 client config that reaches it."""

    def __init__(self, root: Path) -> None:
        self.files: CertFiles = write_job_certs(root / "tls", 1)
        self.secret = os.urandom(32).hex().encode()
        self.secret_file = root / "job.secret"
        self.secret_file.write_bytes(self.secret)
        os.chmod(self.secret_file, 0o600)

    def server_argv(self, side: str) -> list[str]:
        f = self.files
        if side == "plain":
            return []
        argv = ["--job-secret-file", str(self.secret_file)]
        if side == "tls":
            argv += ["--tls-cert", str(f.pair("server")[0]), "--tls-key", str(f.pair("server")[1]), "--tls-ca", str(f.ca)]
        return argv

    def client(self, side: str) -> ClientConfig:
        base = ClientConfig(rpc_timeout_s=300, shared_memory=False)
        if side == "plain":
            return base
        cert, key = self.files.pair("worker-0")
        tls = TlsConfig(ca=str(self.files.ca), cert=str(cert), key=str(key)) if side == "tls" else None
        return ClientConfig(rpc_timeout_s=300, shared_memory=False, tls=tls,
                            auth=AuthConfig(token=derive_token(self.secret, "worker-0")))



def measure_tls(mb: float, reps: int, steps: int) -> dict[str, Any]:
    big = int(mb * 1e6 / 4)
    bulk_sides, small_sides = ("plain", "tls"), ("plain", "tokens", "tls")
    children: list[Child] = []
    clients: list[ParameterClient] = []
    push: dict[str, list[float]] = {s: [] for s in bulk_sides}
    pull: dict[str, list[float]] = {s: [] for s in bulk_sides}
    step: dict[str, list[float]] = {s: [] for s in small_sides}
    round_ratios: dict[str, list[float]] = {"push_tls": [], "pull_tls": [], "step_tls": [], "step_tokens": []}
    with tempfile.TemporaryDirectory(prefix="psgrad-tls-cost-") as tmp:
        sides = TlsSides(Path(tmp))
        try:
            jobs = [("bulk", s) for s in bulk_sides] + [("small", s) for s in small_sides]
            for job, side in jobs:  # a server serves one model: one per model and side
                children.append(start_server(f"{job}-{side}", [*PSGRAD_SERVER, *sides.server_argv(side)]))
            addrs = {key: c.address(timeout_s=180) for key, c in zip(jobs, children)}
            spec = JobSpec(mode="async", num_workers=1, num_shards=1, lr=1e-9)
            bulk = {s: _joined(addrs[("bulk", s)], big, spec, sides.client(s)) for s in bulk_sides}
            small = {s: _joined(addrs[("small", s)], SMALL, spec, sides.client(s)) for s in small_sides}
            clients += [c for c, _ in (*bulk.values(), *small.values())]
            grad, flat = torch.full((big,), 1e-3), torch.empty(big)
            sgrad, sflat = torch.full((SMALL,), 1e-3), torch.empty(SMALL)
            log(f"tls_cost: {reps} rounds of a {mb:g} MB push + pull per side and {steps} small steps per side")
            for rep in range(reps + 1):  # round 0 warms up (connections, handshakes, allocator)
                times: dict[str, float] = {}
                for side in (bulk_sides if rep % 2 else bulk_sides[::-1]):
                    client, clock = bulk[side]
                    t0 = time.perf_counter()
                    client.push(grad, clock[0])
                    t1 = time.perf_counter()
                    client.pull(flat, clock[0] + 1)
                    times[f"push_{side}"], times[f"pull_{side}"] = t1 - t0, time.perf_counter() - t1
                    clock[0] += 1
                for side in (small_sides if rep % 2 else small_sides[::-1]):
                    client, clock = small[side]
                    lat = []
                    for _ in range(steps):
                        s0 = time.perf_counter()
                        client.exchange(sgrad, clock[0], sflat)
                        lat.append(time.perf_counter() - s0)
                        clock[0] += 1
                    times[f"step_{side}"] = summarize(lat)["median"]
                    if rep:
                        step[side].extend(lat)
                if rep:
                    for side in bulk_sides:
                        push[side].append(times[f"push_{side}"])
                        pull[side].append(times[f"pull_{side}"])
                    round_ratios["push_tls"].append(times["push_plain"] / times["push_tls"])
                    round_ratios["pull_tls"].append(times["pull_plain"] / times["pull_tls"])
                    round_ratios["step_tls"].append(times["step_tls"] / times["step_plain"])
                    round_ratios["step_tokens"].append(times["step_tokens"] / times["step_plain"])
        finally:
            for client in clients:
                client.close()
            stop_all(children)
    med = {"push_s": {s: summarize(push[s])["median"] for s in bulk_sides},
           "pull_s": {s: summarize(pull[s])["median"] for s in bulk_sides},
           "step_s": {s: summarize(step[s])["median"] for s in small_sides}}
    nbytes = big * 4
    return {
        "payload_mb": nbytes / 1e6,
        "reps": reps,
        "steps_per_round": steps,
        "median": med,
        "gbps": {f"{what}_{s}": nbytes / med[f"{what}_s"][s] / 1e9 for what in ("push", "pull") for s in bulk_sides},
        "push_throughput_ratio_tls_plain": med["push_s"]["plain"] / med["push_s"]["tls"],
        "pull_throughput_ratio_tls_plain": med["pull_s"]["plain"] / med["pull_s"]["tls"],
        "step_latency_ratio_tls_plain": med["step_s"]["tls"] / med["step_s"]["plain"],
        "step_latency_ratio_tokens_plain": med["step_s"]["tokens"] / med["step_s"]["plain"],
        "per_round": round_ratios,
    }


# =============================================================================================


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--feature", choices=FEATURES, required=True, help="the feature whose cost is measured")
    parser.add_argument("--preset", choices=["tiny", "full"], default="tiny", help="sizes and durations (default: tiny)")
    parser.add_argument("--reps", type=int, help="override the number of measured rounds (a round per side each)")
    ck = parser.add_argument_group("--feature checkpoint")
    ck.add_argument("--params", type=int, help="override the throughput model's float32 parameters")
    ck.add_argument("--write-params", type=int, help="override the Adam shard's parameters (write part)")
    ck.add_argument("--every-s", type=float, help="override --checkpoint-every-s of the checkpointing server")
    ck.add_argument("--round-s", type=float, help="override the length of one measured round")
    ck.add_argument("--shared-memory", action="store_true", default=None,
                    help="the client moves payloads through shared memory (default: the gRPC path)")
    ck.add_argument("--parts", help="comma-separated parts to run: throughput, write (default: both)")
    ck.add_argument("--dir", type=Path, help="where the checkpoint files go (default: a temporary directory)")
    mt = parser.add_argument_group("--feature metrics and tls")
    mt.add_argument("--mb", type=float, help="model size in MB for the push/pull (full: 100)")
    mt.add_argument("--steps", type=int, help="small-model steps per side and round (full: 300)")
    mt.add_argument("--scrape-s", type=float, help="seconds between scrapes of /metrics (metrics only; full: 1)")
    args = parser.parse_args()
    wrong = [f"--{k.replace('_', '-')}" for k, features in FLAGS.items()
             if getattr(args, k) is not None and args.feature not in features]
    if wrong:
        parser.error(f"{', '.join(wrong)}: not a flag of --feature {args.feature}")
    p = overrides(args, PRESETS[args.feature][args.preset])
    if args.feature == "checkpoint":
        parts = {part.strip() for part in (args.parts or "throughput,write").split(",") if part.strip()}
        if not parts or parts - {"throughput", "write"}:
            parser.error(f"--parts takes throughput, write or both, got {args.parts!r}")
        write_json(run_checkpoint(args.preset, p, parts, bool(args.shared_memory), args.dir))
        return
    if p["mb"] <= 0 or p["reps"] < 1 or p["steps"] < 1 or p.get("scrape_s", 1) <= 0:
        parser.error("--mb and --scrape-s must be > 0, --reps and --steps >= 1")
    if args.feature == "metrics":
        out = measure_metrics(p["mb"], int(p["reps"]), int(p["steps"]), p["scrape_s"], bool(p["noise"]))
    else:
        out = measure_tls(p["mb"], int(p["reps"]), int(p["steps"]))
    write_json({"benchmark": f"{args.feature}_cost", "feature": args.feature, "preset": args.preset, **out,
                "machine": machine_info()})


if __name__ == "__main__":
    main()
