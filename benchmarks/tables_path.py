"""What a step's sparse tables cost both ends, per table: F tables of one width against the same rows
in one table, on one thread of this process, no network: a shard's sparse-table path and a worker's
placement of rows over the shards.

    python benchmarks/tables_path.py --preset full                    # 8 tables of 1M x 32, ~215 ids each
    python benchmarks/tables_path.py --preset full --against ../old   # the same, beside another checkout
    python benchmarks/tables_path.py --preset tiny                    # CI-sized

- shard: a psgrad Shard (server/shard.py) of 2, Adagrad; per push, what a shard does with a
  worker's rows under its lock: check the push (tables, ids, shapes; the memory budget, rows made),
  take the slots its check made after the dense payload (reserve), apply the update, check and read the next
  batch's rows. `warm`: the same 40 batches over and over, every row stored; `new`: fresh ids at
  every push (most of the DLRM benchmark's ids are new to the servers), rows made and read before
  they are stored (their initial values drawn).
- worker: ParameterClient's placement of a step's rows over 2 shards: the push's split of the ids
  and row gradients of the batch the step before read (in turn over 4 batches, so a checkout that
  keeps the read's placement finds it, as in training), the read plan of the next batch's ids,
  each shard's reply placed back into the tables, and each shard's Step request built (its push
  header with the rows, the reads).

`layouts`: `tables` = F tables of R rows (stored in one arena per shard: server/table_groups.py),
`one` = one table of F x R rows holding the same ids (feature f's offset by f x R). With --against
PATH (a checkout whose ps.proto is this one's: protobuf loads one per process), the psgrad of that
checkout is loaded beside this one, into the same process, and every
measurement alternates between the two (the order reversed every other repetition), so machine
noise hits both alike. Figures: the median over --reps repetitions of the mean over a repetition's
pushes (process CPU time). A psgrad with row kernels (server/kernels.py) has them compiled before
the clock starts, as a server has after its first large push. Prints one JSON document; progress
and a table go to stderr.
"""
from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from lib import add_preset, code_version, log, machine_info, overrides, write_json

REPO = Path(__file__).resolve().parents[1]
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"features": 4, "rows": 20_000, "dim": 8, "ids": 50, "batches": 6, "reps": 3},
    "full": {"features": 8, "rows": 1_000_000, "dim": 32, "ids": 215, "batches": 40, "reps": 8},
}
SHARDS = 2
PARTS = ("shard-warm", "shard-new", "worker")


MODULES = ("config", "core.sharding", "core.codecs", "server.shard", "client.parameter_client", "client.transport",
           "wire.rows")


def load_psgrad(root: Path, names: tuple[str, ...] = MODULES) -> dict[str, ModuleType]:
    """The modules of the psgrad under `root`, imported afresh (another checkout's sit beside)."""
    for name in [m for m in sys.modules if m == "psgrad" or m.startswith("psgrad.")]:
        del sys.modules[name]
    sys.path.insert(0, str(root))
    try:
        return {name: importlib.import_module(f"psgrad.{name}") for name in names}
    finally:
        sys.path.remove(str(root))


class Bench:
    """One psgrad's shards (tables and one) and the worker's placement, for the preset's batches."""

    def __init__(self, psgrad: dict[str, ModuleType], p: dict[str, Any]) -> None:
        self.m, self.p = psgrad, p
        self.shards = {layout: self._shard(layout) for layout in ("tables", "one")}

    def _shard(self, layout: str) -> Any:
        config, sharding, shard = self.m["config"], self.m["core.sharding"], self.m["server.shard"]
        spec = config.JobSpec(optimizer="adagrad", lr=0.05, num_shards=SHARDS, num_workers=1)
        params = [sharding.ParamSpec("head.weight", (16, 16), "float32")]
        plan = sharding.plan_shards(params, SHARDS)
        start, end = plan.ranges[0]
        layout_ = shard.Layout(spec, tuple(params), 0, start, end, sharding.fingerprint(params, spec))
        s = shard.Shard(config.ServerConfig())
        s.initialize(0, layout_, torch.zeros(end - start))
        F, R, D = self.p["features"], self.p["rows"], self.p["dim"]
        tables = [(f"f{f}", R, D) for f in range(F)] if layout == "tables" else [("all", F * R, D)]
        s.core.state.add_sparse_tables([(name, n, d, 0, 0.01, None) for name, n, d in tables])
        return s

    def batches(self, layout: str, fresh: bool, gen: torch.Generator) -> list[dict[str, tuple[torch.Tensor, torch.Tensor, int]]]:
        """Shard 0's rows of `batches` pushes: per feature ~ids unique even ids (shard 0's), as the
        tables' or as the one table's (feature f's offset by f x rows)."""
        F, R, D, n = self.p["features"], self.p["rows"], self.p["dim"], self.p["ids"]
        high = R // SHARDS if fresh else max(2, 14 * n)
        out = []
        for _ in range(self.p["batches"]):
            ids = [torch.unique(torch.randint(0, high, (n,), generator=gen)) * SHARDS for _ in range(F)]
            grads = [torch.randn(i.numel(), D, generator=gen) for i in ids]
            if layout == "tables":
                parts = [(f"f{f}", i, g) for f, (i, g) in enumerate(zip(ids, grads))]
            else:
                parts = [("all", torch.cat([i + f * R for f, i in enumerate(ids)]), torch.cat(grads))]
            out.append(self._arrived(parts))
        return out

    def _arrived(self, parts: list[tuple[str, torch.Tensor, torch.Tensor]]) -> Any:
        """A push's rows as the shard has them from the wire: one RowBlock of all its tables (views
        of the message's two buffers), or (checkouts before it) a dict of each table's tensors."""
        block = getattr(self.m["wire.rows"], "RowBlock", None)
        if block is None:
            return {name: (ids, grads, 0) for name, ids, grads in parts}
        msg = block.of([(name, ids) for name, ids, _ in parts], [g for _, _, g in parts], [0] * len(parts)).message()
        return block.from_proto(type(msg).FromString(msg.SerializeToString()), "push", push=True).updates()

    def shard_pushes(self, layout: str, batches: list[dict[str, Any]]) -> float:
        """CPU ms per push of the shard's sparse path over `batches`."""
        s = self.shards[layout]
        state = s.core.state
        fp = state.layout.fingerprint
        start = time.process_time()
        for k, rows in enumerate(batches):
            checked = s.rows.check(state, 0, rows)
            if isinstance(checked, tuple):  # (the slots its check made, taken again by the apply)
                slots = s.rows.reserve(state, rows, may_evict=True, made=checked[1])
            else:  # (checkouts before 2026-11-29: the rows made again)
                slots = s.rows.reserve(state, rows, may_evict=True)
            s.rows.apply(state, rows, None, 1.0, slots)
            reads = [(name, r[0]) for name, r in batches[(k + 1) % len(batches)].items()]
            s.rows.check_reads(0, fp, reads)
            s.rows.pull(0, fp, reads, checked=True)
        return 1e3 * (time.process_time() - start) / len(batches)

    def worker_steps(self, layout: str, gen: torch.Generator) -> Callable[[], float]:
        """A function timing the worker's placement of one step's rows and its requests built (CPU ms a step)."""
        pc = self.m["client.parameter_client"]
        F, R, D, n = self.p["features"], self.p["rows"], self.p["dim"], self.p["ids"]
        sizes = {f"f{f}": R for f in range(F)} if layout == "tables" else {"all": F * R}
        dense = 1_000  # (a step's dense payload per shard: small, as the DLRM model's)
        client = SimpleNamespace(shards=[SimpleNamespace(address=f"shard{i}") for i in range(SHARDS)],
                                 tables={t: SimpleNamespace(num_embeddings=r, dim=D) for t, r in sizes.items()},
                                 row_versions={}, rank=0, incarnation=1, fingerprint="f" * 32, base_versions=[0] * SHARDS,
                                 _placed={},
                                 plan=SimpleNamespace(ranges=[(i * dense, (i + 1) * dense) for i in range(SHARDS)]),
                                 spec=SimpleNamespace(wire_dtype="float32"))
        transport, wire = self.m["client.transport"], self.m["core.codecs"].WireBuffer(dense, "float32")
        payload = memoryview(bytes(4 * dense))
        # (the methods a step calls, on this stand-in client)
        for method in ("_table", "_place", "_placement", "_keep_placement", "_push_header"):
            if hasattr(pc.ParameterClient, method):
                setattr(client, method, getattr(pc.ParameterClient, method).__get__(client))
        def batch() -> dict[str, torch.Tensor]:
            per_feature = [torch.unique(torch.randint(0, R, (2 * n,), generator=gen)) for _ in range(F)]
            if layout == "tables":
                return {f"f{f}": i for f, i in enumerate(per_feature)}
            return {"all": torch.cat([i + f * R for f, i in enumerate(per_feature)])}

        # A step pushes the gradients of the rows the step before read, then reads the next batch's
        # (in that order, as ParameterClient.exchange does): a few batches, in turn.
        batches = [batch() for _ in range(4)]
        grads = [{t: (i, torch.randn(i.numel(), D, generator=gen)) for t, i in lookups.items()} for lookups in batches]
        turn = [0]

        def step() -> None:
            k = turn[0] = (turn[0] + 1) % len(batches)
            split = pc.ParameterClient._split_rows(client, grads[k])
            plan = pc._ReadPlan(client, batches[(k + 1) % len(batches)])
            replies = {i: ([0] * tables, memoryview(bytes(rows * D * 4)))
                       for i, (tables, rows) in enumerate(asked(plan.asks(i)) for i in range(SHARDS))}
            plan.place(replies, False)
            for i in range(SHARDS):  # each shard's Step request: its push (rows and all), the next reads
                head = client._push_header(i, 1, None, "", split[i])
                if hasattr(head, "step_request"):  # PushHead: the rows joined into the request once
                    head.step_request(transport.step_request(plan.asks(i), wire), payload)
                else:  # (checkouts before it: a PushHeader message holding the rows, then serialized)
                    request = transport.step_request(head, plan.asks(i), wire).SerializeToString()
                    b"".join((request, payload))

        def asked(asks: Any) -> tuple[int, int]:  # (tables, ids) a shard is asked for
            if hasattr(asks, "tables"):  # a RowBlock: all tables in one
                return len(asks.tables), asks.ids.numel()
            return len(asks), sum(len(a.ids) // 8 for a in asks)  # (checkouts before it: a TableRows per table)

        def timed(k: int = 50) -> float:
            start = time.process_time()
            for _ in range(k):
                step()
            return 1e3 * (time.process_time() - start) / k

        step()
        return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_preset(parser, PRESETS, "sizes and repetitions: tiny (CI-sized) or full (the DLRM benchmark's tables)")
    parser.add_argument("--features", type=int, help="tables (F)")
    parser.add_argument("--rows", type=int, help="rows per table (R)")
    parser.add_argument("--dim", type=int, help="row width")
    parser.add_argument("--ids", type=int, help="ids a table drawn per push (about as many unique ones)")
    parser.add_argument("--batches", type=int, help="pushes per repetition")
    parser.add_argument("--reps", type=int, help="repetitions (alternating between checkouts with --against)")
    parser.add_argument("--against", type=Path, help="another psgrad checkout to measure beside this one, "
                                                     "loaded into this process (e.g. a git worktree of an older commit)")
    args = parser.parse_args()
    p = overrides(args, PRESETS[args.preset])
    for key in ("features", "rows", "dim", "ids", "batches", "reps"):
        if p[key] < 1:
            raise SystemExit(f"tables_path: --{key} must be >= 1, got {p[key]}")
    if args.against is not None and not (args.against / "psgrad" / "__init__.py").exists():
        raise SystemExit(f"tables_path: --against {args.against}: no psgrad package there")
    torch.set_num_threads(1)
    # The allocator settings of a server and a worker process (both set them at start): fresh rows'
    # blocks come from the heap, not from a fresh mmap (page faults) each.
    load_psgrad(REPO, ("wire.heap",))["wire.heap"].tune_allocator()
    benches = {}
    trees = {"this": REPO} | ({"against": args.against.resolve()} if args.against else {})
    for tag, root in trees.items():
        log(f"tables_path: psgrad from {root}")
        try:
            modules = load_psgrad(root, (*MODULES, "server.kernels"))
        except TypeError as exc:  # (protobuf's one descriptor pool per process holds one ps.proto)
            if "duplicate file name" not in str(exc):
                raise
            raise SystemExit(f"tables_path: --against {args.against}: its protos/psgrad/proto/ps.proto differs from "
                             "this checkout's, and protobuf loads one per process: run each checkout's "
                             "tables_path.py on its own, alternating them") from None
        rows_kernels = getattr(modules["server.kernels"], "rows", None)  # (a checkout before the row kernels: none)
        if rows_kernels is not None and rows_kernels(wait=True) is None:
            log(f"tables_path: the row kernels of {root} are unavailable: its torch ops are measured")
        benches[tag] = Bench(modules, p)
    gen = torch.Generator().manual_seed(0)
    warm = {layout: benches["this"].batches(layout, False, gen) for layout in ("tables", "one")}
    workers = {(tag, layout): b.worker_steps(layout, torch.Generator().manual_seed(1))
               for tag, b in benches.items() for layout in ("tables", "one")}
    for b in benches.values():  # (warm: every row stored once before the clock starts)
        for layout in ("tables", "one"):
            b.shard_pushes(layout, warm[layout])
    times: dict[str, list[float]] = {}
    keys = [(tag, layout) for tag in benches for layout in ("tables", "one")]
    for rep in range(p["reps"]):
        new = {layout: benches["this"].batches(layout, True, gen) for layout in ("tables", "one")}
        for tag, layout in (keys if rep % 2 == 0 else keys[::-1]):
            b = benches[tag]
            times.setdefault(f"{tag} shard-warm {layout}", []).append(b.shard_pushes(layout, warm[layout]))
            times.setdefault(f"{tag} shard-new {layout}", []).append(b.shard_pushes(layout, new[layout]))
            times.setdefault(f"{tag} worker {layout}", []).append(workers[tag, layout]())
        log(f"tables_path: repetition {rep + 1}/{p['reps']} done")
    medians = {k: statistics.median(v) for k, v in times.items()}
    print(f"{p['features']} tables of {p['rows']:,} x {p['dim']} (~{p['ids']} ids each a push) against one table of "
          f"the same rows; CPU ms, medians of {p['reps']}", file=sys.stderr)
    print(f"{'part':<12} {'psgrad':<8} {'tables':>8} {'one':>8} {'tables/one':>10}", file=sys.stderr)
    for part in PARTS:
        for tag in benches:
            a, b = medians[f"{tag} {part} tables"], medians[f"{tag} {part} one"]
            print(f"{part:<12} {tag:<8} {a:>8.3f} {b:>8.3f} {a / b:>10.2f}", file=sys.stderr)
    write_json({"benchmark": "tables_path", "params": p, "against": str(args.against) if args.against else None,
                "ms": medians, "runs_ms": times, "machine": machine_info(), "code": code_version()})


if __name__ == "__main__":
    main()
