"""`psgrad status` output: the shards' status as a table or as JSON."""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


def print_status(addresses: Sequence[str], timeout_s: float, as_json: bool) -> None:
    """Ask every server for its shard's status and print it (a table, or JSON with as_json)."""
    from psgrad.client.parameter_client import shard_status

    shards = [dict(s.to_dict(), address=a) for a, s in zip(addresses, shard_status(addresses, timeout_s))]
    if as_json:
        print(json.dumps({"shards": shards}, indent=2))
        return
    print(format_status(shards), flush=True)


def format_status(shards: Sequence[dict[str, Any]]) -> str:
    """The human-readable table `psgrad status` prints."""
    head = f"{'shard':>5} {'address':<21} {'range':<21} {'version':>8} {'applied':>8} {'dup':>4} {'rej':>4} {'pulls':>7} {'MB in':>9} {'MB out':>9}"
    lines = [head]
    for s in shards:
        if not s["initialized"]:
            lines.append(f"{'-':>5} {s['address']:<21} not initialized (start worker rank 0 first)")
            continue
        rng = f"[{s['range'][0]}, {s['range'][1]})"
        lines.append(
            f"{s['shard']:>5} {s['address']:<21} {rng:<21} {s['version']:>8} {s['pushes_applied']:>8} "
            f"{s['pushes_duplicate']:>4} {s['pushes_rejected']:>4} {s['pulls']:>7} "
            f"{s['bytes_in'] / 1e6:>9.1f} {s['bytes_out'] / 1e6:>9.1f}"
        )
    for s in shards:
        if not s["initialized"]:
            continue
        workers = " ".join(f"{w['rank']}:clock={w['clock']},{w['state']}" for w in s["workers"]) or "none"
        st = s["staleness"]
        hist = " ".join(f"{k}:{v}" for k, v in st["histogram"].items()) or "none"
        lines.append(f"shard {s['shard']}: workers {workers}")
        if s["evictions"] or s["pending"] or s["waiting"]:
            lines.append(
                f"shard {s['shard']}: evictions {s['evictions']}, sync gradients buffered {s['pending']}, "
                f"pulls waiting {s['waiting']}"
            )
        if s["updates_lost"]:
            lines.append(f"shard {s['shard']}: {s['updates_lost']} updates lost to a restart from a checkpoint")
        if s["rolled_back"]:
            lines.append(f"shard {s['shard']}: {s['rolled_back']} iterations rolled back to a checkpoint and recomputed")
        lines.append(f"shard {s['shard']}: staleness histogram {hist} (mean {st['mean']:.2f}, max {st['max']})")
    return "\n".join(lines)
