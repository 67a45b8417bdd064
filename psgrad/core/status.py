"""One shard's status as a typed value: what the Status RPC carries, `psgrad status` prints and
metrics read; pure."""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from psgrad.core.job import JobSpec
from psgrad.core.modes import mode_of
from psgrad.core.sharding import ParamSpec, TableSpec

LIVE, LEFT, EVICTED = "live", "left", "evicted"


class WorkerStatus(NamedTuple):
    """One worker as a shard sees it."""

    rank: int
    clock: int
    state: str  # LIVE | LEFT | EVICTED (lease expired)
    last_seen_s: float  # seconds since its last call
    pushes: int


@dataclass(frozen=True)
class TransferStatus:
    """The shard's transfers in flight: where a push or a pull is waiting."""

    streaming_pulls: int = 0  # pull streams reading the live weights
    waiting_updates: int = 0  # in-place updates waiting for those streams
    buffers_lent: int = 0  # receive buffers out on loan to pushes
    staged_updates: bool = False  # plain SGD: the next weights are computed as a push arrives
    retired_buffers: int = 0  # former weights a pull stream still reads
    waiting_for_buffer: int = 0  # pushes waiting for a receive buffer (or their turn)
    streams_open: int = 0  # client streams (pushes, init, replica records) open on the server
    streams_cancelled: int = 0  # ... cancelled: a frame late for the read deadline, or a whole push or pull past its own
    streams_refused: int = 0  # ... refused for now: over the per-connection limit or the thread budget
    read_limit_bytes: int = 0  # what the replies to reads of rows may hold at once (--max-read-mb; 0: no limit)
    read_bytes: int = 0  # ... hold now: the reads in progress (built, or being sent)
    read_bytes_peak: int = 0  # ... held at most at once since the server started
    reads_waiting: int = 0  # reads waiting for their turn now
    reads_queued: int = 0  # reads that waited for their turn (ever)
    reads_expired: int = 0  # ... and gave up: their deadline came first, or their call ended (ServerBusyError)
    reads_refused: int = 0  # reads refused as larger than all of --max-read-mb


@dataclass(frozen=True)
class ReplicaStatus:
    """A server's part in its shard's hot standby."""

    role: str = "primary"  # "primary" | "backup" | "fenced" (a former primary its backup replaced)
    epoch: int = 0  # raised by one at each promotion of a backup
    backup: str = ""  # primary: the attached backup's address ("" when none)
    replicated_version: int = 0  # primary: the newest version its backup acknowledged
    primary: str = ""  # backup: the primary it follows


@dataclass(frozen=True)
class DelayStatus:
    """DC-ASGD on a shard (all 0 when off): its copies of the weights each worker pulled."""

    copies: int = 0  # workers whose copy the shard keeps (one per live worker that pulled)
    nbytes: int = 0  # memory of the copies and the compensation's scratch tensors
    compensated: int = 0  # pushes compensated against their worker's copy
    uncompensated: int = 0  # pushes applied as they came: no copy of the weights they were computed on


@dataclass(frozen=True)
class DeltaStatus:
    """Compressed pulls on a shard (all 0 when no worker uses --compress-pull): the copies of what
    each such worker holds, and how their pulls went."""

    copies: int = 0  # workers whose copy the shard keeps
    nbytes: int = 0  # memory of the copies (and their codecs' buffers)
    compressed: int = 0  # pulls sent as a compressed change
    exact: int = 0  # pulls of those workers sent exact: first pulls, copies not held here, resyncs
    resyncs: int = 0  # of the exact ones: periodic, or for the error
    drift: float = 0.0  # the latest such pull: ||weights - copy|| / ||weights|| once applied
    drift_max: float = 0.0  # the largest drift since the server started


@dataclass(frozen=True)
class TableStatus:
    """One table of a shard: what kind it is and what it holds."""

    name: str
    kind: str  # "dense": a range of the flat space; "sparse": rows of an embedding; "frozen": a range of the frozen space
    numel: int = 0  # parameters held (sparse: in the rows made so far)
    nbytes: int = 0  # bytes of its fp32 master weights
    state_bytes: int = 0  # bytes of its optimizer state
    rows: int = 0  # sparse: rows placed on this shard
    rows_touched: int = 0  # sparse: rows made (pulled or updated) so far
    updates: int = 0  # sparse: updates applied to the table (its version); frozen: writes of its values (its version)
    staleness_max: int = 0  # sparse: the most table updates between a pull of rows and their push
    staleness_mean: float = 0.0  # sparse: the mean of that over the pushes applied
    admitted: int = 0  # sparse: rows stored by an update (ever)
    expired: int = 0  # sparse: rows dropped by their table's ttl
    evicted: int = 0  # sparse: rows dropped at the memory budget
    dropped: int = 0  # sparse: row updates not applied, their ids not admitted yet (min_count)
    capacity: int = 0  # sparse: rows its storage holds before it grows again (tables stored together: their arena's)


@dataclass(frozen=True)
class PublishedStatus:
    """Same-host published versions (all 0 until a worker asks for one): the shard's ring of slots
    in /dev/shm that workers map read-only."""

    slots: int = 0  # slots in the ring: one per worker of the job
    nbytes: int = 0  # shared memory the ring holds
    leased: int = 0  # slots a worker leases now
    copies: int = 0  # versions copied into a slot
    leases: int = 0  # pulls served from a slot (zero-copy)
    pinned: int = 0  # pushes that pinned a published copy of their weights: checked as applied, undone on a NaN


@dataclass(frozen=True)
class CheckpointStatus:
    """A server's checkpoints (all defaults: it writes none, no --checkpoint-dir)."""

    enabled: bool = False  # the server writes checkpoints (--checkpoint-dir)
    version: int = -1  # the newest checkpoint written, or restored at the start (-1: none yet)
    age_s: float = -1.0  # seconds since that checkpoint was written (-1: none yet)
    writes: int = 0  # checkpoints this server wrote
    failures: int = 0  # writes that failed (each retried at the next interval)
    failing: bool = False  # the latest write failed: the newest checkpoint is older than the shard
    last_error: str = ""  # why the latest failed write failed ("" if none ever failed)
    error_age_s: float = -1.0  # seconds since that failure (-1: none)


@dataclass(frozen=True)
class ShardStatus:
    """A consistent snapshot of one shard: its range and job, counters, members, staleness."""

    initialized: bool
    index: int = 0
    start: int = 0
    end: int = 0
    fingerprint: str = ""
    spec: JobSpec | None = None
    version: int = 0
    pushes_applied: int = 0
    pushes_duplicate: int = 0
    pushes_rejected: int = 0
    pulls: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    evictions: int = 0
    updates_lost: int = 0  # applied after the checkpoint a restart restored (counted as workers return)
    rolled_back: int = 0  # sync: iterations undone by roll-backs to a checkpoint (recomputed)
    job_lr: float = 0.0  # the learning rate of pushes that carry none: the chief's latest, else the spec's
    job_lr_clock: int = -1  # the chief's clock that set job_lr (-1: the spec's)
    late_dropped: int = 0  # sync with backup workers: gradients that came after their iteration closed
    pushes_plain: int = 0  # with --compress: pushes that came uncompressed (from workers on the server's host)
    pushes_skipped: int = 0  # steps other shards applied that their workers dropped: acknowledged, never applied
    staleness_bound: int = 0  # ssp with --staleness auto: the bound in effect now (0: a fixed bound)
    pending: int = 0  # sync: gradients buffered for the current iteration
    waiting: int = 0  # pulls parked in the gate right now
    uptime_s: float = 0.0
    workers: tuple[WorkerStatus, ...] = ()
    staleness: dict[int, int] = field(default_factory=dict)  # staleness -> updates, ascending
    transfers: TransferStatus = field(default_factory=TransferStatus)
    params: tuple[ParamSpec, ...] = ()  # the model's parameters, only when asked for (export)
    table_specs: tuple[TableSpec, ...] = ()  # the job's sparse tables, only when asked for (export)
    frozen_params: tuple[ParamSpec, ...] = ()  # the frozen parameters the servers keep, only when asked for (export)
    replica: ReplicaStatus = field(default_factory=ReplicaStatus)
    delay: DelayStatus = field(default_factory=DelayStatus)
    delta: DeltaStatus = field(default_factory=DeltaStatus)
    published: PublishedStatus = field(default_factory=PublishedStatus)
    tables: tuple[TableStatus, ...] = ()  # what the shard holds, table by table
    checkpoint: CheckpointStatus = field(default_factory=CheckpointStatus)

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def missing_at_start(self) -> tuple[int, ...]:
        """sync/ssp: the ranks that have not joined while the shard waits for all num_workers to
        start together (empty otherwise)."""
        spec = self.spec
        if spec is None or not mode_of(spec).policy.start_barrier:
            return ()
        if len(self.workers) >= spec.num_workers:
            return ()
        return missing_ranks(spec.num_workers, {w.rank for w in self.workers})

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data: what `psgrad status --json` prints per shard (without params)."""
        hist = dict(sorted(self.staleness.items()))
        total = sum(hist.values())
        return {
            "initialized": self.initialized,
            "shard": self.index,
            "range": [self.start, self.end],
            "numel": self.numel,
            "version": self.version,
            "pushes_applied": self.pushes_applied,
            "pushes_duplicate": self.pushes_duplicate,
            "pushes_rejected": self.pushes_rejected,
            "pulls": self.pulls,
            "evictions": self.evictions,
            "updates_lost": self.updates_lost,
            "rolled_back": self.rolled_back,
            "job_lr": self.job_lr,
            "job_lr_clock": self.job_lr_clock,
            "late_dropped": self.late_dropped,
            "pushes_plain": self.pushes_plain,
            "pushes_skipped": self.pushes_skipped,
            "staleness_bound": self.staleness_bound,
            "pending": self.pending,
            "waiting": self.waiting,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            # The same counts under the names the metrics give them: payload bytes of pushes (gradients as
            # they travel, compressed or not, and row gradients) and of pulls (weights and rows).
            "push_bytes_total": self.bytes_in,
            "pull_bytes_total": self.bytes_out,
            "uptime_s": round(self.uptime_s, 3),
            "fingerprint": self.fingerprint,
            "tables": [dataclasses.asdict(t) for t in self.tables],
            "spec": self.spec.as_dict() if self.spec is not None else None,
            "workers": [
                {"rank": w.rank, "clock": w.clock, "state": w.state, "last_seen_s": round(w.last_seen_s, 3), "pushes": w.pushes}
                for w in self.workers
            ],
            "staleness": {
                "histogram": hist,
                "max": max(hist) if hist else 0,
                "mean": (sum(k * v for k, v in hist.items()) / total) if total else 0.0,
            },
            "transfers": dataclasses.asdict(self.transfers),
            "replica": dataclasses.asdict(self.replica),
            "delay": dataclasses.asdict(self.delay),
            "delta": dataclasses.asdict(self.delta),
            "published": dataclasses.asdict(self.published),
            "checkpoint": dataclasses.asdict(self.checkpoint),
            "missing_at_start": list(self.missing_at_start),
        }


def missing_ranks(num_workers: int, joined: Iterable[int]) -> tuple[int, ...]:
    """The ranks of 0..num_workers-1 not among `joined`."""
    return tuple(sorted(set(range(num_workers)) - set(joined)))


def start_wait_phrase(num_workers: int, missing: Sequence[int]) -> str:
    """'2 of 3 workers joined; rank 2 has not: start it or lower --num-workers' (the start barrier)."""
    ranks = [str(r) for r in missing]
    named = ranks[0] if len(ranks) == 1 else ", ".join(ranks[:-1]) + " and " + ranks[-1]
    which = f"rank {named} has" if len(ranks) == 1 else f"ranks {named} have"
    return (f"{num_workers - len(ranks)} of {num_workers} workers joined; {which} not: start "
            f"{'it' if len(ranks) == 1 else 'them'} or lower --num-workers")
