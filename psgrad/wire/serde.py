"""Paired pure conversions between psgrad's Python objects and protobuf messages."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from psgrad.config import JobSpec
from psgrad.proto import ps_pb2 as pb
from psgrad.core.push_outcome import Eviction, PushOutcome
from psgrad.core.sharding import ParamSpec, TableSpec
from psgrad.core.status import (
    CheckpointStatus,
    DelayStatus,
    DeltaStatus,
    PublishedStatus,
    TableStatus,
    ReplicaStatus,
    ShardStatus,
    TransferStatus,
    WorkerStatus,
)

_DEFAULT_SPEC = JobSpec()


def _optional(msg: pb.JobSpec, name: str) -> float:
    """An `optional` field's value, or JobSpec's default when the sender left it out."""
    return float(getattr(msg, name)) if msg.HasField(name) else float(getattr(_DEFAULT_SPEC, name))


def job_spec_to_proto(spec: JobSpec) -> pb.JobSpec:
    fields = spec.as_dict()
    fields["no_error_feedback"] = not fields.pop("error_feedback")  # (proto3: absent is false, i.e. on)
    return pb.JobSpec(**fields)


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
        nesterov=msg.nesterov,
        lr_decay=msg.lr_decay,
        initial_accumulator_value=msg.initial_accumulator_value,
        alpha=_optional(msg, "alpha"),
        centered=msg.centered,
        rho=_optional(msg, "rho"),
        dc_asgd=msg.dc_asgd,
        dc_asgd_adaptive=msg.dc_asgd_adaptive,
        backup_workers=msg.backup_workers,
        staleness_max=msg.staleness_max,
        compress=msg.compress or "none",
        error_feedback=not msg.no_error_feedback,
        tables_mode=msg.tables_mode,
    )


def evictions_to_proto(evicted: Iterable[Eviction]) -> list[pb.Eviction]:
    return [pb.Eviction(rank=e.rank, clock=e.clock, lease_s=e.lease_s, live=e.live) for e in evicted]


def evictions_from_proto(msgs: Iterable[pb.Eviction]) -> tuple[Eviction, ...]:
    return tuple(Eviction(e.rank, e.clock, e.lease_s, e.live) for e in msgs)


def push_outcome_to_proto(outcome: PushOutcome) -> pb.PushReply:
    return pb.PushReply(
        applied=outcome.applied, reason=outcome.reason, version=outcome.version, staleness=outcome.staleness,
        deferred=outcome.deferred, lr=outcome.lr, staleness_bound=outcome.staleness_bound,
        evicted=evictions_to_proto(outcome.evicted), restored_version=outcome.restored_version,
    )


def push_outcome_from_proto(msg: pb.PushReply) -> PushOutcome:
    return PushOutcome(
        applied=msg.applied, reason=msg.reason, version=msg.version, staleness=msg.staleness,
        deferred=msg.deferred, lr=msg.lr if msg.HasField("lr") else None, staleness_bound=msg.staleness_bound,
        evicted=evictions_from_proto(msg.evicted),
        restored_version=msg.restored_version if msg.HasField("restored_version") else None,
    )


def params_to_proto(params: Sequence[ParamSpec]) -> list[pb.ParamSpec]:
    return [pb.ParamSpec(name=p.name, shape=list(p.shape), dtype=p.dtype, buffer=p.buffer, aliases=list(p.aliases),
                         lr_scale=None if p.lr_scale == 1.0 else p.lr_scale, weight_decay=p.weight_decay)
            for p in params]


def params_from_proto(msgs: Sequence[pb.ParamSpec]) -> list[ParamSpec]:
    return [ParamSpec(m.name, tuple(m.shape), m.dtype, m.buffer, tuple(m.aliases),
                      m.lr_scale if m.HasField("lr_scale") else 1.0,
                      m.weight_decay if m.HasField("weight_decay") else None) for m in msgs]


def tables_to_proto(tables: Sequence[TableSpec]) -> list[pb.TableSpec]:
    return [pb.TableSpec(name=t.name, num_embeddings=t.num_embeddings, dim=t.dim, seed=t.seed, std=t.std,
                         lr_scale=None if t.lr_scale == 1.0 else t.lr_scale, settings=dict(t.settings),
                         min_count=t.min_count, ttl=t.ttl, evict=t.evict, optimizer=t.optimizer, aliases=list(t.aliases),
                         drawn_as=t.drawn_as)
            for t in tables]


def tables_from_proto(msgs: Sequence[pb.TableSpec]) -> list[TableSpec]:
    return [TableSpec(m.name, int(m.num_embeddings), int(m.dim), int(m.seed), float(m.std),
                      m.lr_scale if m.HasField("lr_scale") else 1.0, tuple(m.settings.items()),
                      int(m.min_count), int(m.ttl), bool(m.evict), m.optimizer, tuple(m.aliases), m.drawn_as)
            for m in msgs]


def shard_range_to_proto(index: int, start: int, end: int) -> pb.ShardRange:
    return pb.ShardRange(index=index, start=start, end=end)


def shard_range_from_proto(msg: pb.ShardRange) -> tuple[int, int, int]:
    return msg.index, msg.start, msg.end


def status_to_proto(status: ShardStatus) -> pb.StatusReply:
    reply = pb.StatusReply(
        initialized=status.initialized,
        version=status.version,
        pushes_applied=status.pushes_applied,
        pushes_duplicate=status.pushes_duplicate,
        pushes_rejected=status.pushes_rejected,
        pulls=status.pulls,
        bytes_in=status.bytes_in,
        bytes_out=status.bytes_out,
        evictions=status.evictions,
        updates_lost=status.updates_lost,
        rolled_back=status.rolled_back,
        job_lr=status.job_lr,
        job_lr_clock=status.job_lr_clock,
        late_dropped=status.late_dropped,
        pushes_plain=status.pushes_plain,
        pushes_skipped=status.pushes_skipped,
        staleness_bound=status.staleness_bound,
        pending=status.pending,
        waiting=status.waiting,
        uptime_s=status.uptime_s,
        fingerprint=status.fingerprint,
        workers=[pb.WorkerStatus(rank=w.rank, clock=w.clock, state=w.state, last_seen_s=w.last_seen_s, pushes=w.pushes)
                 for w in status.workers],
        staleness=[pb.StalenessBucket(staleness=k, count=v) for k, v in sorted(status.staleness.items())],
        transfers=pb.TransferStatus(**dataclasses.asdict(status.transfers)),
        params=params_to_proto(status.params),
        table_specs=tables_to_proto(status.table_specs),
        frozen_params=params_to_proto(status.frozen_params),
        replica=pb.ReplicaStatus(**dataclasses.asdict(status.replica)),
        delay=pb.DelayStatus(**dataclasses.asdict(status.delay)),
        delta=pb.DeltaStatus(**dataclasses.asdict(status.delta)),
        published=pb.PublishedStatus(**dataclasses.asdict(status.published)),
        tables=[pb.TableStatus(**dataclasses.asdict(t)) for t in status.tables],
        checkpoint=pb.CheckpointStatus(**dataclasses.asdict(status.checkpoint)),
    )
    if status.initialized:
        reply.shard.CopyFrom(shard_range_to_proto(status.index, status.start, status.end))
        if status.spec is not None:
            reply.spec.CopyFrom(job_spec_to_proto(status.spec))
    return reply


def status_from_proto(msg: pb.StatusReply) -> ShardStatus:
    return ShardStatus(
        initialized=msg.initialized,
        index=msg.shard.index,
        start=msg.shard.start,
        end=msg.shard.end,
        fingerprint=msg.fingerprint,
        spec=job_spec_from_proto(msg.spec) if msg.initialized else None,
        version=msg.version,
        pushes_applied=msg.pushes_applied,
        pushes_duplicate=msg.pushes_duplicate,
        pushes_rejected=msg.pushes_rejected,
        pulls=msg.pulls,
        bytes_in=msg.bytes_in,
        bytes_out=msg.bytes_out,
        evictions=msg.evictions,
        updates_lost=msg.updates_lost,
        rolled_back=msg.rolled_back,
        job_lr=msg.job_lr,
        job_lr_clock=msg.job_lr_clock,
        late_dropped=msg.late_dropped,
        pushes_plain=msg.pushes_plain,
        pushes_skipped=msg.pushes_skipped,
        staleness_bound=msg.staleness_bound,
        pending=msg.pending,
        waiting=msg.waiting,
        uptime_s=msg.uptime_s,
        workers=tuple(WorkerStatus(w.rank, w.clock, w.state, w.last_seen_s, w.pushes) for w in msg.workers),
        staleness={int(b.staleness): int(b.count) for b in msg.staleness},
        transfers=TransferStatus(**{f.name: getattr(msg.transfers, f.name) for f in dataclasses.fields(TransferStatus)}),
        replica=ReplicaStatus(**{f.name: getattr(msg.replica, f.name) for f in dataclasses.fields(ReplicaStatus)}),
        delay=DelayStatus(**{f.name: getattr(msg.delay, f.name) for f in dataclasses.fields(DelayStatus)}),
        delta=DeltaStatus(**{f.name: getattr(msg.delta, f.name) for f in dataclasses.fields(DeltaStatus)}),
        published=PublishedStatus(**{f.name: getattr(msg.published, f.name) for f in dataclasses.fields(PublishedStatus)}),
        tables=tuple(TableStatus(**{f.name: getattr(t, f.name) for f in dataclasses.fields(TableStatus)})
                     for t in msg.tables),
        checkpoint=_checkpoint_from_proto(msg),
        params=tuple(params_from_proto(msg.params)),
        table_specs=tuple(tables_from_proto(msg.table_specs)),
        frozen_params=tuple(params_from_proto(msg.frozen_params)),
    )


def _checkpoint_from_proto(msg: pb.StatusReply) -> CheckpointStatus:
    if not msg.HasField("checkpoint"):  # a server from before checkpoints were reported
        return CheckpointStatus()
    c = msg.checkpoint
    return CheckpointStatus(**{f.name: getattr(c, f.name) for f in dataclasses.fields(CheckpointStatus)})
