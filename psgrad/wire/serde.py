"""Paired pure conversions between psgrad's Python objects and protobuf messages."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from psgrad.config import JobSpec
from psgrad.proto import ps_pb2 as pb
from psgrad.core.sharding import ParamSpec

_DEFAULT_SPEC = JobSpec()


def _optional(msg: pb.JobSpec, name: str) -> float:
    """An `optional` field's value, or JobSpec's default when the sender left it out."""
    return float(getattr(msg, name)) if msg.HasField(name) else float(getattr(_DEFAULT_SPEC, name))


def job_spec_to_proto(spec: JobSpec) -> pb.JobSpec:
    return pb.JobSpec(**spec.as_dict())


def job_spec_from_proto(msg: pb.JobSpec) -> JobSpec:
    return JobSpec(
        mode=msg.mode,
        staleness=msg.staleness,
        num_workers=msg.num_workers,
        optimizer=msg.optimizer,
        lr=msg.lr,
        momentum=msg.momentum,
        weight_decay=msg.weight_decay,
        wire_dtype=msg.wire_dtype,
        num_shards=msg.num_shards,
        staleness_lr=msg.staleness_lr,
        beta1=_optional(msg, "beta1"),
        beta2=_optional(msg, "beta2"),
        eps=_optional(msg, "eps"),
    )


def params_to_proto(params: Sequence[ParamSpec]) -> list[pb.ParamSpec]:
    return [pb.ParamSpec(name=p.name, shape=list(p.shape), dtype=p.dtype) for p in params]


def params_from_proto(msgs: Sequence[pb.ParamSpec]) -> list[ParamSpec]:
    return [ParamSpec(m.name, tuple(m.shape), m.dtype) for m in msgs]


def shard_range_to_proto(index: int, start: int, end: int) -> pb.ShardRange:
    return pb.ShardRange(index=index, start=start, end=end)


def shard_range_from_proto(msg: pb.ShardRange) -> tuple[int, int, int]:
    return msg.index, msg.start, msg.end


def status_to_dict(msg: pb.StatusReply) -> dict[str, Any]:
    """A StatusReply as plain JSON-ready data (what `psgrad status --json` prints per shard)."""
    hist = {int(b.staleness): int(b.count) for b in msg.staleness}
    total = sum(hist.values())
    return {
        "initialized": msg.initialized,
        "shard": msg.shard.index,
        "range": [msg.shard.start, msg.shard.end],
        "numel": msg.shard.end - msg.shard.start,
        "version": msg.version,
        "pushes_applied": msg.pushes_applied,
        "pushes_duplicate": msg.pushes_duplicate,
        "pushes_rejected": msg.pushes_rejected,
        "pulls": msg.pulls,
        "evictions": msg.evictions,
        "pending": msg.pending,
        "waiting": msg.waiting,
        "bytes_in": msg.bytes_in,
        "bytes_out": msg.bytes_out,
        "uptime_s": round(msg.uptime_s, 3),
        "fingerprint": msg.fingerprint,
        "spec": job_spec_from_proto(msg.spec).as_dict() if msg.initialized else None,
        "workers": [
            {
                "rank": w.rank,
                "clock": w.clock,
                "state": w.state,
                "last_seen_s": round(w.last_seen_s, 3),
                "pushes": w.pushes,
            }
            for w in msg.workers
        ],
        "staleness": {
            "histogram": hist,
            "max": max(hist) if hist else 0,
            "mean": (sum(k * v for k, v in hist.items()) / total) if total else 0.0,
        },
    }
