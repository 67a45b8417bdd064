"""Sparse rows over the wire: psgrad's pull and push of embedding rows beside raw gRPC unary calls
moving the same bytes, in one run, through 1 and 2 shards; on loopback, or across hosts on links
shaped to 1 Gbit/s.

    python benchmarks/sparse_rows.py --preset full             # 4,096 unique ids x 64 dims a call
    python benchmarks/sparse_rows.py --preset full --netbed    # the same on the shaped test bed
    python benchmarks/sparse_rows.py --preset quick            # CI-sized

The job: one worker (rank 0, async mode, SGD lr 1e-9) whose model is a psgrad.Embedding of
`--rows` x `--dim` (1M x 64 in full: its rows are made on the servers on first touch, so the table
costs nothing until then) and a small nn.Linear, joined through `psgrad.connect(...).optimizer`
with every byte over gRPC (no same-host shared memory). Every server is its own process (`psgrad
server`), as is the worker (an agent that this script starts and sends the addresses to).

One call moves `--ids` unique row ids (a fixed random set, about half on each of 2 shards):
- pull: `ParameterClient.pull_rows` of warm rows (made by an earlier pull): ids out, rows back;
- cold_pull: the same for ids never touched before (the shard makes each row on first touch);
- push: `ParameterClient.push` of a step with the rows' gradients: per shard one Push call whose
  header carries the ids and gradients beside the step's small dense gradient (applied together);
- step: `ParameterClient.exchange`, the traffic of `PSOptimizer.step`: per shard one unary Step
  call (that push, and the dense pull);
- raw_pull, raw_put: per shard one bare gRPC unary call (lib/raw_grpc.py Fetch and Put, identity
  serializers, the same concurrency) moving the same bytes: the ids out and the rows' bytes back,
  or the ids and gradients out and 8 bytes back; one raw server process beside each shard.
Each repetition times `--calls` calls of each, back to back (so tc's 1 MB burst on the test bed
is a small part of the bytes timed), in alternating order; figures are medians over repetitions.
`payload` bytes are those in the heavy direction: the rows for pulls, ids + gradients for pushes.
Ratios are psgrad's over raw gRPC's (rows/s and bytes/s alike: the same rows and bytes); goal
>= 0.8 for pull and push. With --netbed the worker is on host 0 and shard i (and raw server i) on
host i + 1 of lib/netbed.py's bed, every link shaped to --rate-mbit; the ratio to the link's
bytes/s is reported too. CPU per call (the worker's and its servers', from /proc) shows what
the shared cores spent. Prints one JSON document; progress and a table go to stderr.
"""
from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from pathlib import Path
from typing import Any

from lib import (
    PSGRAD_SERVER,
    RAW_SERVER,
    SETUP_TIMEOUT_S,
    BenchError,
    Child,
    command_loop,
    exit_now,
    figure,
    log,
    machine_info,
    overrides,
    rep_order,
    stop_all,
    summarize,
    target,
    write_json,
)
from lib.procfs import cpu_seconds

PRESETS: dict[str, dict[str, Any]] = {
    "quick": {"rows": 100_000, "ids": 512, "dim": 64, "shards": (1, 2), "reps": 3, "calls": 3},
    "full": {"rows": 1_000_000, "ids": 4096, "dim": 64, "shards": (1, 2), "reps": 20, "calls": 10},
}
GOAL = 0.8
TABLE = "emb"
OPS = ("pull", "raw_pull", "cold_pull", "push", "step", "raw_put")
# op -> the raw op it is compared with
VERSUS = {"pull": "raw_pull", "cold_pull": "raw_pull", "push": "raw_put", "step": "raw_put"}


def payload_bytes(op: str, ids: int, dim: int) -> int:
    """Bytes one call moves in its heavy direction: the rows (pulls), ids + gradients (pushes)."""
    return ids * dim * 4 + (0 if "pull" in op else ids * 8)


# ---------------------------------------------------------------------------------------------
# The agent: the worker, in a process of its own (on host 0 of the bed with --netbed)


def _fan(pool: futures.ThreadPoolExecutor, fns: Sequence[Callable[[], object]]) -> None:
    """Run fns concurrently, the first on this thread (as ParameterClient fans out); wait for all."""
    futs = [pool.submit(f) for f in fns[1:]]
    fns[0]()
    for f in futs:
        f.result()


def _cpu(pids: Sequence[int]) -> float:
    return sum(cpu_seconds(p) for p in pids)


def measure_job(cfg: dict[str, Any], job: dict[str, Any], raws: list[Any], pool: futures.ThreadPoolExecutor) -> dict[str, Any]:
    """Every op through one job's shards and as many raw servers, repetitions interleaved."""
    import torch
    from torch import nn

    import psgrad
    from psgrad.config import ClientConfig
    from psgrad.core import rows as placement
    from psgrad.core.codecs import byte_view

    n, dim, reps, calls, S = cfg["ids"], cfg["dim"], cfg["reps"], cfg["calls"], job["shards"]
    model = nn.Module()
    model.emb = psgrad.Embedding(cfg["rows"], dim)
    model.head = nn.Linear(dim, 8)
    session = psgrad.connect(job["servers"], rank=0, num_workers=1, mode="async", optimizer=psgrad.SGD(lr=1e-9),
                             client=ClientConfig(shared_memory=False, rpc_timeout_s=120))
    try:
        opt = session.optimizer(model)
        client = opt.client
        order = torch.randperm(cfg["rows"], generator=torch.Generator().manual_seed(S))
        warm = order[:n].sort().values
        fresh = iter(chunk.sort().values for chunk in order[n:].split(n) if chunk.numel() == n)
        grads = torch.full((n, dim), 1e-3)
        dense, weights = torch.zeros(client.plan.total), torch.zeros(client.plan.total)
        clock = opt.clock

        # raw gRPC: shard i's ids (id mod S == i) out, their rows' bytes back into one buffer
        where = placement.shard_of(warm, S)
        mine = [warm[where == i].contiguous() for i in range(S)]
        theirs = [grads[where == i].contiguous() for i in range(S)]
        out = torch.empty(n, dim)
        byte_out = byte_view(out)
        offsets = [0]
        for m in mine:
            offsets.append(offsets[-1] + m.numel() * dim * 4)

        def fetch(i: int) -> None:
            raws[i].fetch(mine[i].numpy().tobytes(), byte_out[offsets[i]:offsets[i + 1]])

        def put(i: int) -> None:  # the request made from the tensors, as any sender must
            raws[i].put(b"".join((byte_view(mine[i]), byte_view(theirs[i]))))

        def raw_pull() -> None:
            _fan(pool, [functools.partial(fetch, i) for i in range(S)])

        def raw_put() -> None:
            _fan(pool, [functools.partial(put, i) for i in range(S)])

        def push() -> None:
            nonlocal clock
            client.push(dense, clock, rows={TABLE: (warm, grads)})
            clock += 1

        def step() -> None:
            nonlocal clock
            client.exchange(dense, clock, weights, rows={TABLE: (warm, grads)})
            clock += 1

        ops: dict[str, Callable[[], object]] = {
            "pull": lambda: client.pull_rows(TABLE, warm),
            "raw_pull": raw_pull,
            "cold_pull": lambda: client.pull_rows(TABLE, next(fresh)),
            "push": push,
            "step": step,
            "raw_put": raw_put,
        }
        server_pids = {op: job["pids"] if not op.startswith("raw") else cfg["raw_pids"][:S] for op in ops}
        for fn in ops.values():  # warm-up: connections, buffers, and the warm rows made
            for _ in range(calls):
                fn()
        batch_s: dict[str, list[float]] = {op: [] for op in ops}
        call_s: dict[str, list[float]] = {op: [] for op in ops}
        cpu = {op: {"worker": 0.0, "servers": 0.0} for op in ops}
        for rep in range(1, reps + 1):
            for op in rep_order(list(ops), rep):
                fn = ops[op]
                s0, c0 = _cpu(server_pids[op]), time.process_time()
                t0 = time.perf_counter()
                for _ in range(calls):
                    t1 = time.perf_counter()
                    fn()
                    call_s[op].append(time.perf_counter() - t1)
                batch_s[op].append(time.perf_counter() - t0)
                cpu[op]["worker"] += time.process_time() - c0
                cpu[op]["servers"] += _cpu(server_pids[op]) - s0
        per_shard = [int(m.numel()) for m in mine]
        return {"shards": S, "ids_per_shard": per_shard, "batch_s": batch_s, "call_s": call_s,
                "cpu_ms_per_call": {op: {k: 1e3 * v / (reps * calls) for k, v in c.items()} for op, c in cpu.items()}}
    finally:
        session.close()


def agent_main() -> None:
    """The worker's process: answers {"op": "run", ...config} with every job's timings."""
    import torch

    from lib.raw_grpc import RawClient

    torch.set_num_threads(1)

    def handle(cmd: dict[str, Any]) -> dict[str, Any]:
        if cmd.get("op") != "run":
            raise BenchError(f"unknown op {cmd.get('op')!r}")
        raws = [RawClient(a) for a in cmd["raw"]]
        pool = futures.ThreadPoolExecutor(max_workers=max(len(cmd["raw"]), 1))
        try:
            return {"jobs": [measure_job(cmd, job, raws, pool) for job in cmd["jobs"]]}
        finally:
            pool.shutdown()
            for r in raws:
                r.close()

    command_loop(handle)
    exit_now()


# ---------------------------------------------------------------------------------------------
# The driver


def run(p: dict[str, Any], netbed: bool, rate_mbit: float) -> dict[str, Any]:
    """Start the servers (psgrad: a job per shard count; raw: one per shard) and the agent, on
    loopback or on hosts of a shaped bed; collect its timings."""
    need = p["ids"] * (1 + p["calls"] * (p["reps"] + 1))
    if need > p["rows"]:
        raise SystemExit(f"sparse_rows: {p['reps']} repetitions of {p['calls']} cold pulls of {p['ids']} ids need "
                         f"{need:,} rows; the table has {p['rows']:,} (raise --rows or lower --reps/--calls)")
    top = max(p["shards"])
    me = str(Path(__file__).resolve())
    children: list[Child] = []
    bed: Any = None
    try:
        if netbed:
            from lib.netbed import NetBed

            why = NetBed.unavailable()
            if why:
                raise SystemExit(f"sparse_rows: no test bed here: {why}")
            bed = NetBed(1 + top, rate_mbit=rate_mbit).__enter__()
            log(f"sparse_rows: bed up: {1 + top} hosts, every link {rate_mbit:g} Mbit/s")

        def start(name: str, host: int, argv: list[str], speaks: bool = False) -> Child:
            full = [sys.executable, *argv]
            child = Child(name, bed.command(host, full) if bed else full, speaks=speaks)
            children.append(child)
            return child

        def psgrad_argv(host: int) -> list[str]:  # plaintext on the bed: a private network
            if not bed:
                return PSGRAD_SERVER
            return ["-m", "psgrad", "server", "--host", bed.hosts[host].addr, "--port", "0", "--lease-s", "600",
                    "--insecure"]

        def raw_argv(host: int) -> list[str]:
            return [*RAW_SERVER, "--host", bed.hosts[host].addr] if bed else RAW_SERVER

        agent = start("agent", 0, [me, "--agent"], speaks=True)
        jobs = [(S, [start(f"psgrad-{S}s-{i}", 1 + i, psgrad_argv(1 + i)) for i in range(S)]) for S in p["shards"]]
        raws = [start(f"raw-{i}", 1 + i, raw_argv(1 + i)) for i in range(top)]
        cmd = {"op": "run", **{k: p[k] for k in ("rows", "ids", "dim", "reps", "calls")},
               "raw": [r.address(timeout_s=SETUP_TIMEOUT_S) for r in raws], "raw_pids": [r.popen.pid for r in raws],
               "jobs": [{"shards": S, "servers": [c.address(timeout_s=SETUP_TIMEOUT_S) for c in cs],
                         "pids": [c.popen.pid for c in cs]} for S, cs in jobs]}
        log(f"sparse_rows: servers up; {p['ids']:,} ids x {p['dim']} dims a call, {p['reps']} repetitions of "
            f"{p['calls']} calls, shards {', '.join(map(str, p['shards']))}")
        return agent.call(cmd, SETUP_TIMEOUT_S + 600)
    finally:
        stop_all(children)
        if bed is not None:
            bed.__exit__(None, None, None)


def summarize_job(job: dict[str, Any], p: dict[str, Any], link_mb_s: float | None) -> dict[str, Any]:
    """Per op: rows/s and MB/s of the median batch, the median call, CPU; ratios to raw gRPC."""
    n, calls = p["ids"], p["calls"]
    res: dict[str, Any] = {}
    for op in OPS:
        med = summarize(job["batch_s"][op])["median"]
        nbytes = payload_bytes(op, n, p["dim"])
        res[op] = {"rows_per_s": calls * n / med, "mb_per_s": calls * nbytes / med / 1e6,
                   "call_ms_median": 1e3 * summarize(job["call_s"][op])["median"],
                   "call_ms_p99": 1e3 * summarize(job["call_s"][op])["p99"],
                   "cpu_ms_per_call": job["cpu_ms_per_call"][op]}
        if link_mb_s:
            res[op]["vs_link"] = res[op]["mb_per_s"] / link_mb_s
    ratios = {f"{op}_vs_{raw}": res[op]["rows_per_s"] / res[raw]["rows_per_s"] for op, raw in VERSUS.items()}
    return {"shards": job["shards"], "ids_per_shard": job["ids_per_shard"], "results": res, "ratios": ratios}


def report(p: dict[str, Any], raw: dict[str, Any], netbed: bool, rate_mbit: float) -> dict[str, Any]:
    link = rate_mbit / 8 if netbed else None
    where = f"shaped {rate_mbit:g} Mbit/s links" if netbed else "loopback"
    jobs = [summarize_job(j, p, link) for j in raw["jobs"]]
    targets, figures = [], []
    for j in jobs:
        S, r = j["shards"], j["results"]
        for op in ("pull", "push"):
            vs = VERSUS[op]
            targets.append(target(f"sparse {op}: rows/s, {p['ids']:,} ids x {p['dim']}, {S} shard(s), {where}",
                                  r[op]["rows_per_s"], r[vs]["rows_per_s"], GOAL, "higher", "rows/s", f"raw gRPC {vs}"))
        for op in ("pull", "cold_pull", "push", "step"):
            vs = VERSUS[op]
            figures.append(figure(f"sparse {op} rows/s, {S} shard(s), {where}", r[op]["rows_per_s"], "rows/s",
                                  r[vs]["rows_per_s"], f"raw gRPC {vs}"))
            figures.append(figure(f"sparse {op} MB/s, {S} shard(s), {where}", r[op]["mb_per_s"], "MB/s",
                                  r[vs]["mb_per_s"], f"raw gRPC {vs}"))
            if link:
                figures.append(figure(f"sparse {op} MB/s, {S} shard(s), vs the link", r[op]["mb_per_s"], "MB/s",
                                      link, f"{rate_mbit:g} Mbit/s link"))
    return {
        "benchmark": "sparse_rows",
        "network": "netbed" if netbed else "loopback",
        "rate_mbit": rate_mbit if netbed else None,
        "link_mb_per_s": link,
        **{k: p[k] for k in ("rows", "ids", "dim", "reps", "calls")},
        "payload_bytes": {op: payload_bytes(op, p["ids"], p["dim"]) for op in OPS},
        "machine": machine_info(),
        "jobs": jobs,
        "targets": targets,
        "figures": figures,
        "notes": "push = per shard one Push call carrying the rows' ids and gradients in its header with the "
                 "step's small dense gradient, applied together; step = per shard one unary Step call (that push "
                 "and the dense pull), as PSOptimizer.step sends; raw_put = one "
                 "unary call of the same ids + gradients. Pulls move ids out and rows back in one unary call "
                 "per shard, as raw_pull does.",
    }


def table(doc: dict[str, Any]) -> str:
    """The figures as a fixed-width table."""
    link = doc["link_mb_per_s"]
    head = f"{'shards':>6} {'op':<10} {'rows/s':>10} {'MB/s':>8} {'ms/call':>8} {'raw MB/s':>9} {'ratio':>6}"
    head += f" {'vs link':>7}" if link else ""
    head += f" {'cpu ms/call w+s':>16}"
    lines = [f"sparse rows, {doc['ids']:,} ids x {doc['dim']} dims a call ({doc['network']}"
             + (f", {doc['rate_mbit']:g} Mbit/s" if link else "") + f"), medians of {doc['reps']} x {doc['calls']} calls",
             head]
    for j in doc["jobs"]:
        r = j["results"]
        for op in OPS:
            vs = VERSUS.get(op)
            ratio = f"{r[op]['rows_per_s'] / r[vs]['rows_per_s']:6.2f}" if vs else f"{'':>6}"
            raw_mb = f"{r[vs]['mb_per_s']:9.1f}" if vs else f"{'':>9}"
            c = r[op]["cpu_ms_per_call"]
            line = (f"{j['shards']:>6} {op:<10} {r[op]['rows_per_s']:10,.0f} {r[op]['mb_per_s']:8.1f} "
                    f"{r[op]['call_ms_median']:8.2f} {raw_mb} {ratio}")
            line += f" {r[op]['vs_link']:7.2f}" if link else ""
            line += f" {c['worker']:7.2f}+{c['servers']:<7.2f}"
            lines.append(line)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="quick", help="sizes and repetitions (default: quick)")
    parser.add_argument("--netbed", action="store_true", help="worker and servers on hosts of a shaped test bed (root)")
    parser.add_argument("--rate-mbit", type=float, default=1000.0, help="the bed's link rate (default: 1000)")
    parser.add_argument("--rows", type=int, help="override the table's rows")
    parser.add_argument("--ids", type=int, help="override the unique ids a call")
    parser.add_argument("--dim", type=int, help="override the row width")
    parser.add_argument("--reps", type=int, help="override the repetitions")
    parser.add_argument("--calls", type=int, help="override the calls timed together per repetition")
    parser.add_argument("--shards", type=lambda s: tuple(int(x) for x in s.split(",")),
                        help="override the shard counts, e.g. 1,2")
    parser.add_argument("--agent", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.agent:
        agent_main()
        return
    p = overrides(args, PRESETS[args.preset])
    if min(p["shards"]) < 1 or min(p["ids"], p["dim"], p["reps"], p["calls"]) < 1:
        parser.error("shards, ids, dim, reps and calls must be >= 1")
    t0 = time.monotonic()
    raw = run(p, args.netbed, args.rate_mbit)
    doc = {**report(p, raw, args.netbed, args.rate_mbit), "preset": args.preset, "elapsed_s": time.monotonic() - t0}
    print(table(doc), file=sys.stderr, flush=True)
    write_json(doc)


if __name__ == "__main__":
    main()
