"""`psgrad status` output: the shards' status as a table or as JSON."""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


def print_status(addresses: Sequence[str], timeout_s: float, as_json: bool) -> None:
    """Ask every server for its shard's status and print it (a table, or JSON with as_json)."""
    from concurrent.futures import ThreadPoolExecutor

    from psgrad.client.parameter_client import shard_status
    from psgrad.errors import PsgradError

    servers = [a for entry in addresses for a in entry.split("|")]  # a shard's backup gets a row of its own

    def one(address: str) -> dict[str, Any]:
        try:
            return dict(shard_status([address], timeout_s)[0].to_dict(), address=address)
        except PsgradError as exc:
            if "|" not in ",".join(addresses):
                raise  # no backups: as before, a server that does not answer is an error
            return {"address": address, "initialized": False, "error": str(exc)}

    with ThreadPoolExecutor(max_workers=len(servers)) as pool:
        shards = list(pool.map(one, servers))
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
            role = (s.get("replica") or {}).get("role")
            what = ("not answering: " + s["error"]) if "error" in s else (
                "backup without state yet" if role == "backup" else "not initialized (start worker rank 0 first)")
            lines.append(f"{'-':>5} {s['address']:<21} {what}")
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
        rep = s.get("replica") or {}
        if rep.get("backup") or rep.get("role", "primary") != "primary" or rep.get("epoch"):
            attached = f", backup {rep['backup']} attached (replicated to version {rep['replicated_version']})" if rep.get("backup") else ""
            follows = f" of {rep['primary']}" if rep.get("primary") else ""
            lines.append(f"shard {s['shard']}: {s['address']} is {rep['role']}{follows} at epoch {rep['epoch']}{attached}")
        if s["updates_lost"]:
            lines.append(f"shard {s['shard']}: {s['updates_lost']} updates lost to a restart from a checkpoint")
        if s["rolled_back"]:
            lines.append(f"shard {s['shard']}: {s['rolled_back']} iterations rolled back to a checkpoint and recomputed")
        lines.append(f"shard {s['shard']}: staleness histogram {hist} (mean {st['mean']:.2f}, max {st['max']})")
    return "\n".join(lines)
