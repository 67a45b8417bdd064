"""A worker's view of the whole job: one ShardClient per shard, the shard plan, concurrent fan-out,
join/init, the lease heartbeat, and one iteration's push + pull."""
from __future__ import annotations

import contextlib
import functools
import logging
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from concurrent import futures
from typing import Any, TypeVar

import numpy as np
import torch

from psgrad import errors
from psgrad.client import rows_in_place as in_place
from psgrad.client.delta_wire import DeltaWire
from psgrad.client.shard_client import RowsRead, ShardClient, Stepped
from psgrad.client.status_client import credentials, shard_status  # noqa: F401 (their home before; status needs no torch)
from psgrad.config import READ_LIMIT_MIN_MB, ClientConfig, JobSpec
from psgrad.core.codecs import WireBuffer, byte_view, joined
from psgrad.core.compression import parse_compression
from psgrad.core.credentials import worker_role
from psgrad.core.gradient_codecs import Compressor
from psgrad.core.policies import policy_for
from psgrad.core.push_outcome import Eviction, PushOutcome, Restore
from psgrad.core import rows as row_placement
from psgrad.core.sharding import ParamSpec, ShardPlan, TableSpec, fingerprint, frozen_ranges
from psgrad.core.status import missing_ranks, start_wait_phrase
from psgrad.core.unused import Ranges, clipped, to_bytes
from psgrad.errors import PsgradError
from psgrad.proto import ps_pb2 as pb
from psgrad.wire import serde, shm
from psgrad.wire.frames import PushHead
from psgrad.wire.heap import tune_allocator
from psgrad.wire.rows import RowBlock

T = TypeVar("T")
# table -> (unique row ids [n] int64, their gradients [n, dim] float32): one step's row gradients
RowGradients = dict[str, tuple[torch.Tensor, torch.Tensor]]
# table -> {shard: the version its rows were read at}: the base of a push of gradients computed on them
RowBases = Mapping[str, Mapping[int, int]]
_log = logging.getLogger("psgrad.client")
# A worker waiting at the sync/ssp start asks the shards again at least this often (each answer says
# who has joined), and logs who is missing when that changes or every START_NOTE_S.
START_ROUND_S = 10.0
START_FIRST_ROUND_S = 1.0
START_NOTE_S = 30.0
# A waiting Join's deadline is its round plus this; the server answers half a second before it.
JOIN_MARGIN_S = 0.5
# A same-host shard's weights of fewer bytes are copied into the worker's segment at each pull, not
# lent from the server's ring: a lease's bookkeeping (the ring's slots and holders, the copy into a
# slot, the worker's views) costs both ends ~0.1-0.2 ms a pull, a copy of 1 MiB about as much.
LEND_MIN_BYTES = 1 << 20


def continue_from(replies: Sequence[pb.JoinReply], sync: bool) -> int:
    """The clock a worker continues from after joining every shard: the furthest-ahead shard's,
    except in a sync job (without backup workers) where every shard ahead of the others is ahead
    by this worker's own pushes (it was evicted, or restarted, after a push reached some shards
    only): then from the furthest-behind shard's. It redoes those iterations, which the shards
    that have them acknowledge as duplicates; skipping them instead left the others' gates shut
    when no other worker would push them there (every worker evicted at once: the job wedged)."""
    starts = [int(r.start_clock) for r in replies]
    low = min(starts)
    if sync and all(r.start_clock == low or r.last_push_clock + 1 >= r.start_clock for r in replies):
        return low
    return max(starts)


@dataclass
class UnfinishedStep:
    """A step whose push raised after some shards acknowledged it (applied it, buffered it for its
    iteration, or answered a duplicate: they hold it): its clock and those shards. The others
    refused it (a non-finite gradient, the memory budget) or did not answer (unreachable), and
    applied nothing, or may have (a call that failed after its push was handled)."""

    clock: int
    acked: frozenset[int]


class ParameterClient:
    """A worker's view of the whole job: S shard clients, the shard plan, concurrent fan-out."""

    def __init__(
        self,
        addresses: Sequence[str],
        spec: JobSpec,
        params: Sequence[ParamSpec],
        plan: ShardPlan,
        rank: int,
        config: ClientConfig,
        role: str | None = None,
        tables: Sequence[TableSpec] = (),
        frozen: Sequence[ParamSpec] = (),
    ) -> None:
        """role: whose credential the calls carry (default: worker `rank`'s; export: the admin's);
        tables: the job's sparse tables; frozen: the model's frozen parameters the servers keep (the
        frozen space, split over the shards by frozen_ranges)."""
        if len(addresses) != plan.num_shards or spec.num_shards != plan.num_shards:
            raise errors.ConfigError(
                f"{len(addresses)} server addresses for a plan of {plan.num_shards} shards"
            )
        self.spec = spec
        self.params = list(params)
        self.plan = plan
        self.rank = rank
        # This worker process's number (never 0), said in its joins, pushes, heartbeats and leave:
        # a process that joins as the same rank later takes the rank over, and the shards refuse
        # this one's calls from then on (SupersededError) rather than take two processes' steps
        # as one worker's.
        self.incarnation = secrets.randbits(63) or 1
        self.config = config
        self.tables = {t.name: t for t in tables}
        self.frozen = list(frozen)
        self.frozen_ranges = frozen_ranges(self.frozen, plan.num_shards) if self.frozen else ()
        self.fingerprint = fingerprint(self.params, spec, tuple(tables), self.frozen)
        # Per shard, the version of its frozen table this worker holds (-1: none read yet) and the
        # one its latest join (or rejoin) answered: the table is read again when they differ.
        self.frozen_held = [-1] * plan.num_shards
        self.frozen_seen = [0] * plan.num_shards
        self.drawn_as: dict[str, str] = {}  # table -> the name its rows are drawn under, where another (join's)
        # (table, shard) -> the table version that shard's rows were last pulled at: a push's base
        # for rows whose read it is not told (a push is told each table's oldest read its gradient
        # came from: PSOptimizer passes them, from the rows its forwards were served)
        self.row_versions: dict[tuple[str, int], int] = {}
        # The latest placement of each group of tables (see _place): a step pushes the gradients of
        # the very ids its forward read, which the step before placed when it fetched them.
        self._placed: dict[tuple[str, ...], tuple[list[tuple[weakref.ref[torch.Tensor], int]],
                                                  row_placement.TablesOnShards]] = {}
        tune_allocator()  # megabyte-sized message buffers from the heap, not a fresh mmap each
        self.shards = [ShardClient(a, config, role or worker_role(rank)) for a in addresses]
        self._pool = futures.ThreadPoolExecutor(max_workers=len(addresses), thread_name_prefix="psgrad-fanout")
        self._staged_reads = True  # (False: a read of several shards hands one to a pool thread each, as before)
        self._compiled_reads = True  # (False: reads in place placed and gathered by torch's ops, shard by shard)
        trainable = sum(p.numel for p in self.params if not p.buffer)
        # Separate staging buffers for pulls and pushes, so the two may overlap
        self._pull_wires = [WireBuffer(plan.size(i), spec.wire_dtype) for i in range(plan.num_shards)]
        self._push_wires = [WireBuffer(plan.size(i), spec.wire_dtype) for i in range(plan.num_shards)]
        # --compress-pull: each shard's pull buffer that holds this worker's copy (see DeltaWire)
        pull_codec = parse_compression(config.compress_pull)
        self._delta_wires = [None if pull_codec is None else DeltaWire(
            end - start, spec.wire_dtype, pull_codec, plain=(end - start) - max(0, min(end, trainable) - start),
            resync_every=config.pull_resync_every, resync_error=config.pull_resync_error)
            for start, end in plan.ranges]
        # --compress: each shard's encoder, with its error-feedback residual (see _push_payload)
        # (a range's model buffers, which follow every parameter in the flat space, travel plain)
        codec = parse_compression(spec.compress)
        self._compressors = [None if codec is None else Compressor(
            codec, end - start, spec.wire_dtype, spec.error_feedback, seed=rank * 65_537 + i,
            plain=(end - start) - max(0, min(end, trainable) - start))
            for i, (start, end) in enumerate(plan.ranges)]
        # Per shard, the clock of its encoder's last encode and the last clock it kept (answered
        # other than as a duplicate): a step taken again after one that raised encodes its gradient
        # from where the encoder stood before the push that shard did not keep (see _push_payload).
        self._encoded_at: list[int | None] = [None] * plan.num_shards
        self._kept_at: list[int | None] = [None] * plan.num_shards
        self.base_versions = [0] * plan.num_shards
        # A policy that drops late gradients (sync with backup workers) on several shards: shard 0
        # decides which gradients make an iteration (docs/design/architecture.md)
        self._shard0_decides = policy_for(spec).drops_late and plan.num_shards > 1
        # Async (no gate: a pull need not follow this worker's push): a step to a shard on another
        # host pushes and pulls at once, as two calls (ClientConfig.duplex); the pushes run on
        # threads of their own, beside the fan-out's. Not ssp: its gate counts a worker's clock from
        # its pulls, so a pull that overtook its push would count a push not yet applied.
        self._duplex = config.duplex and not policy_for(spec).gates_pulls
        self._pushers = (futures.ThreadPoolExecutor(max_workers=len(addresses), thread_name_prefix="psgrad-push")
                         if self._duplex else None)
        self._gradient: shm.Shared | None = None  # gradient_buffer(): shards on this host read windows of it
        self._heartbeat: list[threading.Thread] | None = None
        self._stop_heartbeat = threading.Event()
        # What the shards tell once (see _heard): the workers they evicted and restarts that lost
        # updates, until take_news(); with the highest version each shard was seen at.
        self.seen_versions = [0] * plan.num_shards
        self._heard_from = [False] * plan.num_shards  # a push or pull reply of the shard's was heard
        self._evictions: list[Eviction] = []
        self._restores: list[Restore] = []
        # rank -> the shards that told of its latest eviction (every shard tells of it, at the clock
        # it knew the worker at: they differ where its last push reached some shards only)
        self._told: dict[int, set[int]] = {}
        self._news_lock = threading.Lock()
        # A push (or exchange) that raised after some shards acknowledged it: its clock and those
        # shards (see UnfinishedStep); the push of the next clock skips it on the others (skip_unfinished).
        self.unfinished: UnfinishedStep | None = None

    def __enter__(self) -> ParameterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the channels without leaving (the servers drop this worker when its lease ends)."""
        self._halt_heartbeat()
        self._pool.shutdown(wait=True)
        if self._pushers is not None:
            self._pushers.shutdown(wait=True)
        for s in self.shards:
            s.close()
        if self._gradient is not None:  # its name; the caller's tensors keep the memory mapped
            self._gradient.close()

    def _fan_out(self, fn: Callable[[int, ShardClient], T], only: Sequence[int] | None = None) -> list[T]:
        """Run fn on every shard (or those `only` names) concurrently, the first one on this thread
        (a hand-off to another thread costs about as much as a small call); wait for all, then
        re-raise the first failure (in shard order)."""
        chosen = list(range(len(self.shards))) if only is None else list(only)
        if not chosen:
            return []
        futs = [self._pool.submit(fn, i, self.shards[i]) for i in chosen[1:]]
        outcomes: list[tuple[bool, Any]] = []
        try:
            outcomes.append((True, fn(chosen[0], self.shards[chosen[0]])))
        except BaseException as exc:  # the others are already running: let them finish first
            outcomes.append((False, exc))
        for f in futs:
            error = f.exception()
            outcomes.append((False, error) if error is not None else (True, f.result()))
        for ok, value in outcomes:
            if not ok:
                raise value
        return [value for _, value in outcomes]

    def _join_request(self, index: int, wait: bool) -> pb.JoinRequest:
        start, end = self.plan.ranges[index]
        return pb.JoinRequest(
            rank=self.rank,
            spec=serde.job_spec_to_proto(self.spec),
            params=serde.params_to_proto(self.params),
            shard=serde.shard_range_to_proto(index, start, end),
            fingerprint=self.fingerprint,
            wait_for_init=wait,
            incarnation=self.incarnation,
            tables=serde.tables_to_proto(list(self.tables.values())),
            frozen=serde.params_to_proto(self.frozen),
        )

    def join(self, initial_weights: Callable[[], torch.Tensor] | None,
             initial_rows: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
             initial_frozen: Callable[[], torch.Tensor] | None = None) -> int:
        """Join every shard and return the clock this worker continues from.

        The chief passes its initial flat weights and initializes any empty shard, with the rows of
        sparse tables that start from its values (`initial_rows`: table -> (unique ids, values
        [n, dim])) and the frozen parameters (`initial_frozen`: the frozen space, float32; read
        them with pull_frozen); every worker then waits (server side, up to init_timeout_s) until the shards are
        initialized and, in sync/ssp mode, until all num_workers workers have joined. Starts the
        lease heartbeat.
        """
        replies = self._fan_out(
            lambda i, s: s.join(self._join_request(i, wait=False), self.config.connect_timeout_s)
        )
        try:
            return self._start(replies, initial_weights, initial_rows, initial_frozen)
        except KeyboardInterrupt:
            # Stopped (Ctrl-C) while it initialized the shards or waited for the others, after every
            # shard took its join: it leaves, as a worker stopped while it trains does, instead of
            # staying live on the shards until its lease ends (a sync job would count it meanwhile).
            with contextlib.suppress(Exception):
                self.leave()
            raise

    def _start(self, replies: Sequence[pb.JoinReply], initial_weights: Callable[[], torch.Tensor] | None,
               initial_rows: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None,
               initial_frozen: Callable[[], torch.Tensor] | None) -> int:
        """join's rest, every shard joined: initialize the empty ones (the chief), wait for the
        job's start, start the heartbeat; the clock to continue from."""
        if initial_weights is not None and not all(r.initialized for r in replies):
            flat = initial_weights()
            frozen = initial_frozen() if initial_frozen is not None and self.frozen else torch.empty(0)
            split = self._split_rows(initial_rows)  # (the values travel as the blocks' "gradients")

            def init(i: int, s: ShardClient) -> Any:
                if replies[i].initialized:
                    return None
                start, end = self.plan.ranges[i]
                lo, hi = self.frozen_ranges[i] if self.frozen else (0, 0)
                header = pb.InitHeader(join=self._join_request(i, wait=False), numel=end - start,
                                       row_block=RowBlock(split[i].tables, split[i].counts, split[i].ids).message(),
                                       frozen_numel=hi - lo)
                values = split[i].grads
                return s.init(header, [flat[start:end], torch.empty(0) if values is None else values, frozen[lo:hi]])

            self._fan_out(init)
        if not all(r.ready for r in replies):
            replies = self._wait_for_start(min(r.lease_s for r in replies))
        for i, s in enumerate(self.shards):
            s.rejoin = functools.partial(self._rejoin, i, s, self._join_request(i, wait=False))
        self._start_heartbeat(min(r.lease_s for r in replies))
        self.unfinished = None  # (a rejoin continues from the clock the shards give)
        # (the job's: the chief's, which a worker whose model loaded no state does not know)
        self.drawn_as = {table: name for r in replies for table, name in r.drawn_as.items()}
        return continue_from(replies, policy_for(self.spec).aggregates and not self._shard0_decides)

    def _rejoin(self, index: int, shard: ShardClient, req: pb.JoinRequest, timeout_s: float) -> pb.JoinReply:
        """Join shard `index` again (its server restarted, or its backup took over): its answer
        says the version of its frozen table, which a restore may have moved."""
        reply = shard.join(req, timeout_s)
        self.frozen_seen[index] = int(reply.frozen_version)
        return reply

    def frozen_moved(self) -> list[int]:
        """The shards whose frozen table moved (a version other than the one read), or that were
        never read: pull_frozen reads them."""
        if not self.frozen:
            return []
        return [i for i, (held, seen) in enumerate(zip(self.frozen_held, self.frozen_seen))
                if held != seen and self.frozen_ranges[i][1] > self.frozen_ranges[i][0]]

    def pull_frozen(self, dest: torch.Tensor, only: Sequence[int] | None = None, observe: bool = False) -> list[int]:
        """Read the frozen table of every shard (or those `only` names) into dest, the frozen space
        (float32); returns the versions read (remembered unless observe)."""
        wanted = [i for i in (range(len(self.shards)) if only is None else only)
                  if self.frozen_ranges[i][1] > self.frozen_ranges[i][0]]

        def one(i: int, s: ShardClient) -> int:
            lo, hi = self.frozen_ranges[i]
            req = pb.PullRequest(rank=self.rank, fingerprint=self.fingerprint, observe=observe, table="frozen")
            return s.pull_table(req, dest[lo:hi])

        versions = self._fan_out(one, wanted)
        if not observe:
            for i, version in zip(wanted, versions):
                self.frozen_held[i] = self.frozen_seen[i] = version
        return versions

    def _wait_for_start(self, lease_s: float) -> list[pb.JoinReply]:
        """Join again, waiting server side, until every shard is initialized and (sync/ssp) all
        num_workers workers have joined, or init_timeout_s passes. It waits in rounds of at most
        START_ROUND_S (and half a lease, so that each round renews this worker's lease); the
        servers answer each round just before its deadline with who has joined, which is logged.

        Raises:
            NotInitializedError: a shard is not initialized at the end (the chief never came).
            WorkerStateError: workers are missing at the end (their ranks named).
            ServerUnavailableError: a server stopped answering meanwhile.
        """
        t = self.config.init_timeout_s
        started = time.monotonic()
        give_up, noted = started + t, started
        replies: list[pb.JoinReply] | None = None
        said = ""
        while True:
            left = give_up - time.monotonic()
            if left <= 0 and replies is not None:
                break
            first = START_FIRST_ROUND_S if replies is None else START_ROUND_S  # a first word soon
            round_s = max(0.0, min(left, first, lease_s / 2))
            try:  # connected already: a server that stops answering fails the round at once
                replies = self._fan_out(lambda i, s: s.join(
                    self._join_request(i, wait=True), round_s + JOIN_MARGIN_S, wait_for_ready=False))
            except errors.DeadlineExceededError:
                if replies is None and time.monotonic() >= give_up:
                    raise
                continue  # the answer came late (a busy host): ask again
            if all(r.ready for r in replies):
                return replies
            waiting, why = self._start_wait(replies)
            now = time.monotonic()
            if now < give_up and (waiting != said or now - noted >= START_NOTE_S):
                log = _log.warning if now - started >= START_NOTE_S else _log.info
                log("worker rank %d: waiting at the start: %s (%s; %.0f s of --init-timeout-s %g)",
                    self.rank, waiting, why, now - started, t)
                said, noted = waiting, now
        missing = [self.shards[i].address for i, r in enumerate(replies) if not r.initialized]
        if missing:
            raise errors.NotInitializedError(
                f"shards at {', '.join(missing)} were not initialized within {t:g} s (--init-timeout-s): "
                "is worker rank 0 (the chief) running against the same --servers?"
            )
        waiting, why = self._start_wait(replies)
        raise errors.WorkerStateError(f"{waiting} ({why}; waited {t:g} s, --init-timeout-s)")

    def _start_wait(self, replies: Sequence[pb.JoinReply]) -> tuple[str, str]:
        """What the start waits for, from the shards' Join answers, and why: the chief's
        initialization, or the ranks that have not joined every shard ('2 of 3 workers joined;
        rank 2 has not: start it or lower --num-workers', 'sync mode starts all workers together')."""
        if not all(r.initialized for r in replies):
            return "worker rank 0 (the chief) has not initialized every shard", "it sends the job and the weights"
        spec = self.spec
        joined = set.intersection(*(set(r.joined_ranks) for r in replies))
        missing = missing_ranks(spec.num_workers, joined)
        why = f"{spec.mode} mode starts all workers together"
        if not missing:  # the shards count workers outside 0..num_workers-1
            return f"only {min(r.joined for r in replies)} of {spec.num_workers} workers joined", why
        return start_wait_phrase(spec.num_workers, missing), why

    def transports(self) -> list[str]:
        """How each shard's payloads travel now: "shm" (same host) or "grpc"."""
        return [s.transport.name for s in self.shards]

    def _start_heartbeat(self, lease_s: float) -> None:
        """Renew this worker's lease every lease_s/3 while it trains (also while a pull waits)."""
        if self._heartbeat is not None:
            return
        stop = self._stop_heartbeat

        def beat(s: ShardClient) -> None:
            while not stop.wait(lease_s / 3):
                try:
                    s.heartbeat(self.rank, self.fingerprint, self.incarnation)
                except PsgradError:
                    pass  # the training loop's own calls report a lost server or eviction

        # A thread per shard: a shard that does not answer (paused, unreachable) holds up its own
        # heartbeat for the call's deadline, never the other shards' (whose leases would run out).
        self._heartbeat = [threading.Thread(target=beat, args=(s,), name=f"psgrad-heartbeat-{i}", daemon=True)
                           for i, s in enumerate(self.shards)]
        for thread in self._heartbeat:
            thread.start()

    def pull(self, flat: torch.Tensor, clock: int, observe: bool = False, published: bool = False) -> list[int]:
        """Pull every shard into its range of flat (float32, CPU) once the mode's gate for `clock`
        holds; remembers the base versions. observe=True reads a snapshot: no gate, no lease.
        published=True: a same-host shard may lend its version zero-copy instead (see views())."""

        req = pb.PullRequest(rank=self.rank, clock=clock, fingerprint=self.fingerprint, observe=observe)

        def one(i: int, s: ShardClient) -> int:
            start, end = self.plan.ranges[i]
            wire = self._pull_wire(i, observe)
            version = s.pull(req if i == 0 else follow, flat[start:end], wire,
                             published and not observe and self._lends(i, wire))
            self._heard_pulls(i)
            return version

        first, follow = None, req
        if self._shard0_decides and not observe:  # the others' weights of shard 0's iteration (or later)
            first = one(0, self.shards[0])
            follow = pb.PullRequest(rank=self.rank, clock=max(clock, first), fingerprint=self.fingerprint)
        versions = self._fan_out(lambda i, s: first if i == 0 and first is not None else one(i, s))
        if not observe:
            self.base_versions = versions
            self._saw(versions)
        return versions

    def _pull_wire(self, index: int, observe: bool = False) -> WireBuffer:
        """Shard index's pull buffer: with --compress-pull the one holding this worker's copy (see
        DeltaWire), except for observing pulls (exact) and to a shard on this host unless
        --compress-same-host; else the plain one."""
        delta = self._delta_wires[index]
        if delta is None or observe or (self.shards[index].same_host and not self.config.compress_same_host):
            return self._pull_wires[index]
        return delta

    def pull_drift(self) -> float | None:
        """With --compress-pull: the largest distance of this worker's copy from the weights over
        the shards, ||w - copy|| / ||w||, as the servers reported it at the last pulls (None: off)."""
        drifts = [w.drift for w in self._delta_wires if w is not None and w.pulls]
        return max(drifts) if drifts else None

    def _heard(self, index: int, outcome: PushOutcome, pulled: int | None = None) -> PushOutcome:
        """Shard index's answer to a push (and the version a pull after it got): what the shard
        tells once is kept for take_news(). A restart from a checkpoint whose version is below the
        highest this worker saw the shard at lost the updates in between (one at or above it, none)."""
        self._note(index, outcome.evicted, outcome.restored_version)
        self.seen_versions[index] = max(self.seen_versions[index], outcome.version, pulled or 0)
        self._heard_pulls(index)
        return outcome

    def _note(self, index: int, evicted: Sequence[Eviction], restored: int | None) -> None:
        """Keep what shard index told once: other workers it evicted, a restart (and its version)."""
        if not evicted and restored is None:
            return
        with self._news_lock:
            for e in evicted:
                told = self._told.setdefault(e.rank, set())
                if index in told:  # this shard tells of a later eviction of that worker
                    told.clear()
                if not told:  # (reported once, by the first shard that tells)
                    self._evictions.append(e)
                told.add(index)
            if restored is not None:  # (told once per worker: lost or not, a restart is news)
                self._restores.append(Restore(index, max(self.seen_versions[index], restored), restored,
                                              joined_after=not self._heard_from[index]))
                self.seen_versions[index] = restored

    def _heard_pulls(self, index: int) -> None:
        """What shard index's pull headers told since (an eviction while a pull waited at the gate)."""
        for header in self.shards[index].take_pull_news():
            self._note(index, serde.evictions_from_proto(header.evicted),
                       header.restored_version if header.HasField("restored_version") else None)
        self._heard_from[index] = True  # (a restart told from now on came after this worker saw the shard)

    def _saw(self, versions: Sequence[int]) -> None:
        for i, v in enumerate(versions):
            self.seen_versions[i] = max(self.seen_versions[i], v)

    def take_news(self) -> tuple[list[Eviction], list[Restore]]:
        """The evictions of other workers and the restarts that lost updates that the shards told
        of since the last call (each once, whichever shards told it)."""
        with self._news_lock:
            news = self._evictions, self._restores
            self._evictions, self._restores = [], []
            return news

    def _lends(self, index: int, wire: WireBuffer) -> bool:
        """Whether a same-host pull of shard index asks to be lent the version (zero-copy, from the
        server's ring) rather than have it copied into the segment: not a compressed pull's, and
        not below LEND_MIN_BYTES, where the lease's bookkeeping on both ends costs more than the
        copy it saves."""
        return wire is self._pull_wires[index] and wire.nbytes >= LEND_MIN_BYTES

    def _push_payload(self, index: int, grad: torch.Tensor, clock: int | None = None) -> tuple[memoryview, str]:
        """Shard index's range of a gradient as it travels, and its codec ("": the wire dtype's
        plain values): compressed with the job's --compress, except to a shard on this host unless
        --compress-same-host. Encode once per push (error feedback): retries resend these bytes.
        A step taken again (the same clock, after one that raised) is encoded from where the
        encoder stood before the push the shard did not keep (refused, or its answer lost), and a
        push the shard kept already (its answer: a duplicate) leaves the encoder as it was: the
        residual feeds back what the applied pushes left out, each once. (clock None: a push of its
        own, neither taken again nor kept.)"""
        compressor = self._compressors[index]
        if compressor is not None and (self.config.compress_same_host or not self.shards[index].same_host):
            if clock is not None and self._encoded_at[index] == clock and self._kept_at[index] != clock:
                compressor.undo()
            payload = compressor.encode(grad)
            if clock is not None and self._kept_at[index] == clock:
                compressor.undo()
            self._encoded_at[index] = clock
            return payload, self.spec.compress
        return self._push_wires[index].encode(grad), ""

    def _kept(self, index: int, clock: int, outcome: PushOutcome) -> PushOutcome:
        """Shard index answered the push of `clock`: kept unless a duplicate (see _push_payload;
        only an encoder's pushes need it)."""
        if self._compressors[index] is not None and not outcome.duplicate:
            self._kept_at[index] = clock
        return outcome

    def plain_shards(self) -> list[int]:
        """With --compress: the shards that get plain gradients all the same, being on this host
        (shared memory; unless --compress-same-host)."""
        return [i for i, c in enumerate(self._compressors)
                if c is not None and self.shards[i].same_host and not self.config.compress_same_host]

    def compression_note(self) -> str:
        """How pushes and pulls travel, for the worker's start line: '' (plain), or the codecs,
        whether pushes keep error feedback, and which shards are plain all the same (on this host)."""
        note = ""
        if self.spec.compress != "none":
            plain = [str(i) for i in self.plain_shards()]
            ef = any(c is not None and c.residual is not None for c in self._compressors)
            note += f", pushes compressed {self.spec.compress}{' with error feedback' if ef else ''}"
            if plain:
                note += (f" (plain to shard{'s' if len(plain) > 1 else ''} {','.join(plain)} on this host: "
                         "--compress-same-host compresses there too)")
        if self._delta_wires[0] is not None:
            plain = [str(i) for i in range(len(self.shards)) if self._pull_wire(i) is self._pull_wires[i]]
            c = self.config
            resync = " or ".join(([f"every {c.pull_resync_every} versions"] if c.pull_resync_every else [])
                                 + ([f"past drift {c.pull_resync_error:g}"] if c.pull_resync_error else [])) or "never"
            note += f", pulls compressed {self._delta_wires[0].label} (exact again {resync})"
            if plain:
                note += (f" (plain from shard{'s' if len(plain) > 1 else ''} {','.join(plain)} on this host: "
                         "--compress-same-host compresses there too)")
        return note

    def _push_header(
        self, index: int, clock: int, lr: float | None = None, compress: str = "", rows: RowBlock | None = None,
        unused: Ranges = (), unused_tables: Sequence[str] = (),
    ) -> PushHead:
        """Shard index's push header, carrying its part of the step's row gradients (`rows`, on this
        shard: _split_rows') in one block, and of the dense parameters the step left unused
        (`unused`, ranges of the flat space: none for a compressed push, whose error feedback may
        carry values for them), and the sparse tables it did not use (`unused_tables`, to every shard)."""
        start, end = self.plan.ranges[index]
        return PushHead(pb.PushHeader(
            unused_tables=sorted(unused_tables),
            unused=b"" if compress or not unused else to_bytes(clipped(unused, start, end)),
            compress=compress,
            rank=self.rank,
            clock=clock,
            base_version=self.base_versions[index],
            numel=end - start,
            dtype=self.spec.wire_dtype,
            fingerprint=self.fingerprint,
            lr=lr,
            incarnation=self.incarnation,
        ), rows)

    def push(self, flat_grad: torch.Tensor, clock: int, lr: float | None = None,
             rows: RowGradients | None = None, bases: RowBases | None = None, unused: Ranges = (),
             unused_tables: Sequence[str] = ()) -> list[PushOutcome]:
        """Push each shard its range of flat_grad, keyed (rank, clock), with the pull's base versions
        and the learning rate in effect (None: the job's), and its part of the step's row gradients
        of sparse tables (`rows`, computed on rows read at `bases`: see _split_rows) in the same
        call: applied together or not at all; `unused`: the flat ranges of the dense parameters
        the step left unused, which the shards skip (core/unused.py); `unused_tables`: the sparse
        tables it did not use, whose step counts the shards leave. Returns each shard's answer."""
        self.skip_unfinished(clock)
        split = self._split_rows(rows, bases)
        acked: set[int] = set()

        def one(i: int, s: ShardClient) -> PushOutcome:
            start, end = self.plan.ranges[i]
            payload, compress = self._push_payload(i, flat_grad[start:end], clock)
            reply = s.push(self._push_header(i, clock, lr, compress, split[i], unused, unused_tables), payload)
            acked.add(i)
            return self._heard(i, self._kept(i, clock, serde.push_outcome_from_proto(reply)))

        with self._unfinished_if_raises(clock, acked):
            if not self._shard0_decides:
                return self._fan_out(one)
            first = one(0, self.shards[0])  # shard 0 decides whether the gradient is in its iteration
            if first.late:
                return [first] * len(self.shards)  # late: no shard applies it
            return self._fan_out(lambda i, s: first if i == 0 else one(i, s))

    @contextlib.contextmanager
    def _unfinished_if_raises(self, clock: int, acked: set[int]) -> Iterator[None]:
        """Around the push of `clock`: where it raises after shards acknowledged it (`acked`, which
        the calls fill as they are answered), keep them (unfinished: the step taken again adds
        those that acknowledge it then); where it succeeds, no step is unfinished."""
        try:
            yield
        except BaseException:
            prior = self.unfinished
            held = set(acked) | (set(prior.acked) if prior is not None and prior.clock == clock else set())
            if held:
                self.unfinished = UnfinishedStep(clock, frozenset(held))
            elif prior is not None and prior.clock != clock:
                self.unfinished = None
            raise
        self.unfinished = None

    def skip_unfinished(self, clock: int) -> None:
        """Before a push of `clock`: where the step at clock - 1 is unfinished (some shards
        acknowledged it, then it raised) and this worker went on without taking it again
        (PSOptimizer: zero_grad() dropped it), tell the other shards that clock - 1 is skipped
        (ps.proto PushHeader.skip: acknowledged, never applied; one that applied it after all
        answers a duplicate), so that each shard's clock moves to `clock` and none drops this
        push as a duplicate. Logs a warning naming where the step was applied and where skipped.
        A push of the unfinished clock itself (the step taken again) sends nothing; one of any
        other clock (the worker rolled back or rejoined) forgets it.

        Raises:
            PsgradError: a shard refused the skip or is unreachable (the step stays unfinished:
                the next push sends the skip again).
        """
        u = self.unfinished
        if u is None or clock == u.clock:
            return
        if clock != u.clock + 1:
            self.unfinished = None
            return
        others = [i for i in range(len(self.shards)) if i not in u.acked]

        def one(i: int, s: ShardClient) -> PushOutcome:
            start, end = self.plan.ranges[i]
            header = pb.PushHeader(rank=self.rank, clock=u.clock, base_version=self.base_versions[i], numel=end - start,
                                   dtype=self.spec.wire_dtype, fingerprint=self.fingerprint, skip=True,
                                   incarnation=self.incarnation)
            return self._heard(i, serde.push_outcome_from_proto(s.skip(header)))

        outcomes = self._fan_out(one, only=others)
        self.unfinished = None
        applied = sorted(set(u.acked) | {i for i, o in zip(others, outcomes) if o.duplicate})
        skipped = [i for i in others if i not in applied]
        if skipped:
            _log.warning("worker rank %d: the step at clock %d was applied on shard(s) %s and skipped on %s (refused "
                         "or unanswered there, then dropped instead of taken again): its gradient counts on %s only",
                         self.rank, u.clock, applied, skipped, applied)

    def exchange(
        self, flat_grad: torch.Tensor, clock: int, flat: torch.Tensor, lr: float | None = None, published: bool = False,
        rows: RowGradients | None = None, reads: RowReads | None = None, bases: RowBases | None = None,
        unused: Ranges = (), unused_tables: Sequence[str] = (),
    ) -> tuple[list[PushOutcome], list[int]]:
        """One iteration's traffic: push(flat_grad, clock, lr, rows, bases, unused, unused_tables), then pull(flat, clock + 1) and
        the rows `reads` asks for (reads.rows holds them afterwards), per shard in one Step call
        where it fits (same host, or payloads of at most one chunk), else as a push followed by a
        pull and a read of rows. The rows are read once the pull's gate holds (sync: after this
        iteration's update). Each shard goes at its own pace: its pull may wait at its gate while
        another shard still receives the push. Returns each shard's answer to the push and the
        versions pulled (remembered as base versions)."""
        if self._shard0_decides:  # shard 0 first, then the others (see push and pull)
            done = (self.push(flat_grad, clock, lr, rows, bases, unused, unused_tables),
                    self.pull(flat, clock + 1, published=published))
            if reads is not None:
                reads.rows = self.pull_tables(reads.ids, checked=reads.checked)
            return done
        self.skip_unfinished(clock)
        acked: set[int] = set()
        req = pb.PullRequest(rank=self.rank, clock=clock + 1, fingerprint=self.fingerprint)
        split = self._split_rows(rows, bases)
        plan = _ReadPlan(self, reads.ids, reads.checked) if reads is not None else None

        def one(i: int, s: ShardClient) -> Generator[None, None, tuple[PushOutcome, int, RowsRead | None]]:
            start, end = self.plan.ranges[i]
            payload, compress = self._push_payload(i, flat_grad[start:end], clock)
            header = self._push_header(i, clock, lr, compress, split[i], unused, unused_tables)
            asks = plan.asks(i) if plan is not None else None
            wire = self._pull_wire(i)
            lend = published and self._lends(i, wire)
            done: Stepped | None
            if self._pushers is not None and not s.same_host:
                done = self._duplex_step(s, header, payload, req, flat[start:end], wire, asks)
            else:
                done = yield from s.stepping(header, payload, flat[start:end], wire, lend, asks)
            if done is None:
                reply = s.push(header, payload)
                acked.add(i)
                version = s.pull(req, flat[start:end], wire, lend)
                done = reply, version, self._read(s, asks, False) if asks else None
            acked.add(i)
            reply, version, got = done
            return self._heard(i, self._kept(i, clock, serde.push_outcome_from_proto(reply)), version), version, got

        with self._unfinished_if_raises(clock, acked):
            if len(self.shards) > 1 and all(s.staged for s in self.shards):  # (same host: never a duplex push)
                results = _in_stages([one(i, s) for i, s in enumerate(self.shards)])
            else:
                results = self._fan_out(lambda i, s: run_through(one(i, s)))
        self.base_versions = [version for _, version, _ in results]
        if reads is not None and plan is not None:
            reads.rows = plan.place({i: got for i, (_, _, got) in enumerate(results) if got is not None}, False)
        return [outcome for outcome, _, _ in results], list(self.base_versions)

    def _duplex_step(self, s: ShardClient, header: PushHead, payload: memoryview, req: pb.PullRequest,
                     dest: torch.Tensor, wire: WireBuffer, asks: RowBlock | None) -> Stepped:
        """Push and pull (and read the next rows) at once, as separate calls: the gradient goes up
        while the weights come down, where one Step call sends its reply only after the whole
        request arrived. The pull does not wait for this push (async), so the weights it brings
        may or may not hold it (the server counts the staleness either way)."""
        assert self._pushers is not None
        pushing = self._pushers.submit(s.push, header, payload)
        try:
            version = s.pull(req, dest, wire)
            got = self._read(s, asks, False) if asks else None
        except BaseException:
            pushing.exception()  # (let the push end before the pull's failure is raised)
            raise
        return pushing.result(), version, got

    # ----------------------------------------------------------------- sparse tables
    def pull_rows(self, table: str, ids: torch.Tensor, observe: bool = False) -> torch.Tensor:
        """Rows [len(ids), dim] (float32, CPU) of sparse table `table` for row ids (unique, int64,
        CPU): pull_tables of one table."""
        return self.pull_tables({table: ids}, observe)[table]

    def pull_tables(self, lookups: Mapping[str, torch.Tensor], observe: bool = False,
                    checked: bool = False) -> row_placement.PulledRows:
        """Rows [len(ids), dim] (float32, CPU) of every sparse table `lookups` names, for its row
        ids (unique, int64, CPU): one call per shard that holds some of them, whatever the number
        of tables, concurrently, with the versions they were read at (the push of their gradients
        says so; remembered as row_versions too, unless observe). checked: the caller checked the
        ids against their tables' ranges (see RowReads).

        Raises:
            InvalidRequestError: the job has no such table, or an id is out of range.
        """
        read_here = self._read_in_place(lookups, observe, checked)
        if read_here is not None:
            return read_here
        plan = _ReadPlan(self, lookups, checked)
        wanted = [i for i in range(len(self.shards)) if plan.asks(i)]
        replies: dict[int, RowsRead] = {}
        for i in wanted:  # (a shard on this host that lends its rows: read in place)
            lent = self.shards[i].rows_in_place
            if lent is not None:
                got_here = lent.read(plan.asks(i))
                if got_here is not None:
                    replies[i] = got_here
        if replies:
            wanted = [i for i in wanted if i not in replies]
        if self._staged_reads and len(wanted) > 1 and all(self.shards[i].reads_staged for i in wanted):
            # (every request sent, then every reply read, on this thread: as a step's calls, see _in_stages)
            got = _in_stages([self.shards[i].reading_rows(self._rows_request(plan.asks(i), observe)) for i in wanted])
        elif wanted:
            got = self._fan_out(lambda i, s: self._read(s, plan.asks(i), observe), wanted)
        else:
            got = []
        replies.update(zip(wanted, got))
        return plan.place(replies, observe)

    def _read_in_place(self, lookups: Mapping[str, torch.Tensor], observe: bool,
                       checked: bool) -> row_placement.PulledRows | None:
        """pull_tables where every shard lends its rows on this host and the compiled read is
        ready: per group of tables of one row width, each shard's rows written into the group's
        rows in one pass of the kernel over the group's ids (InPlaceRows.read_into), which places
        them on the shards as it goes (kept for the push of their gradients) where the calls'
        read places them first, asks each shard for its part and scatters the replies. None: read
        otherwise (some shard does not lend, or not these tables, or was changing something
        through every try; the kernel is not compiled yet)."""
        lent = [s.rows_in_place for s in self.shards]
        if not (lookups and self._compiled_reads) or None in lent:
            return None
        dims = [self._table(name).dim for name in lookups]
        read = in_place.kernel(start=sum(int(i.numel()) * d for i, d in zip(lookups.values(), dims)) >= in_place.KERNEL_MIN)
        if read is None:
            return None
        if not checked:
            for table, ids in lookups.items():
                row_placement.check_ids(ids, self._table(table).num_embeddings, f"table {table!r}")
        groups: dict[int, list[str]] = {}
        for name, dim in zip(lookups, dims):
            groups.setdefault(dim, []).append(name)
        rows: dict[str, torch.Tensor] = {}
        blocks: dict[tuple[str, ...], torch.Tensor] = {}
        read_at: dict[str, dict[int, int]] = {name: {} for name in lookups}
        for dim, names in groups.items():
            tensors = [lookups[name] for name in names]
            sizes = [int(i.numel()) for i in tensors]
            ids = joined(tensors).to(torch.int64).contiguous()
            flat = ids.numpy()
            starts = row_placement.starts(sizes)
            out, order = torch.empty(len(flat), dim), torch.empty(len(flat), dtype=torch.int64)
            counts, placed = [], 0
            for i, held in enumerate(lent):
                assert held is not None
                got = held.read_into((i, len(lent)), names, flat, starts, out.numpy(), read, order.numpy(), placed)
                if got is None:
                    return None
                for name, version in zip(names, got[0]):
                    read_at[name][i] = version
                counts.append(got[1])
                placed += sum(got[1])
            rows.update(zip(names, out.split_with_sizes(sizes)))
            blocks[tuple(names)] = out
            # (the step's push of these rows' gradients splits them as placed here)
            self._keep_placement(names, tensors, row_placement.TablesOnShards.found(ids, sizes, len(lent), order, counts))
        if not observe:
            for name, by_shard in read_at.items():
                for i, version in by_shard.items():
                    self.row_versions[(name, i)] = version
        return row_placement.PulledRows(rows, read_at, blocks)

    def _read(self, s: ShardClient, asks: RowBlock, observe: bool) -> RowsRead:
        return s.pull_rows(self._rows_request(asks, observe))

    def _rows_request(self, asks: RowBlock, observe: bool) -> pb.RowsRequest:
        return pb.RowsRequest(rank=self.rank, fingerprint=self.fingerprint, observe=observe, block=asks.message())

    def updated_rows(self, table: str, page_rows: int = 1 << 18) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [n] int64, rows [n, dim]) of every row of sparse table `table` updated at least once,
        in order of id, read from each shard in pages of page_rows (read-only: joins nothing)."""
        spec = self._table(table)
        # pages well within a message, and within the least --max-read-mb a server takes
        page_rows = max(1, min(page_rows, int(READ_LIMIT_MIN_MB * 2**20) // (4 * spec.dim + 8)))

        def one(i: int, s: ShardClient) -> tuple[torch.Tensor, torch.Tensor]:
            # (a dynamic table's ids are any int64: from the smallest, sent as the uint64 of its bits)
            ids_parts, row_parts, start = [], [], -(1 << 63) if spec.num_embeddings == row_placement.DYNAMIC else 0
            while True:
                reply = s.updated_rows(pb.RowsRequest(rank=self.rank, fingerprint=self.fingerprint, table=table,
                                                      observe=True, updated=True, from_id=start % (1 << 64),
                                                      limit=page_rows))
                ids = torch.frombuffer(bytearray(reply.ids), dtype=torch.int64) if reply.ids else torch.empty(0, dtype=torch.int64)
                rows = torch.frombuffer(bytearray(reply.rows), dtype=torch.float32) if reply.rows else torch.empty(0)
                ids_parts.append(ids)
                row_parts.append(rows.view(-1, spec.dim))
                if ids.numel() < page_rows or int(ids[-1]) == (1 << 63) - 1:
                    return torch.cat(ids_parts), torch.cat(row_parts)
                start = int(ids[-1]) + 1

        parts = self._fan_out(one)
        ids = torch.cat([p[0] for p in parts])
        order = torch.argsort(ids)
        return ids[order], torch.cat([p[1] for p in parts])[order]

    def _table(self, name: str) -> TableSpec:
        try:
            return self.tables[name]
        except KeyError:
            have = ", ".join(repr(n) for n in self.tables) or "none"
            raise errors.InvalidRequestError(f"the job has no sparse table {name!r}; its tables: {have}") from None

    def _split_rows(self, rows: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None,
                    bases: RowBases | None = None) -> list[RowBlock]:
        """Each shard's part of rows of sparse tables, table -> (ids, their gradients or values), as
        one block per shard (tables with ids there only), with each table's base version on that
        shard: the version its rows were read at (bases[table][shard], the oldest read the
        gradient came from; else that shard's latest read of the table, row_versions): its rows (id mod S; a dynamic table's by the ids' hash, see core/rows.py), placed for all
        tables of one row width at once; a shard's rows of one width are one slice of one gather."""
        S = len(self.shards)
        parts: list[list[tuple[list[str], list[int], torch.Tensor, torch.Tensor | None]]] = [[] for _ in range(S)]
        if rows:
            for names, place in self._place({name: ids for name, (ids, _) in rows.items()},
                                            lambda name: tuple(rows[name][1].shape[1:])):
                ids = place.ids_by_shard()
                # (the tables' values one after another: a forward group's gradient as it is, see TableRows)
                block = rows.blocks.get(tuple(names)) if isinstance(rows, row_placement.TableRows) else None
                values = place.by_shard((joined([rows[name][1] for name in names]) if block is None else block)
                                        .to(torch.float32))
                for i in range(S):
                    counts = place.counts[i]
                    if all(counts):  # (every table has ids on the shard, as most steps' do)
                        parts[i].append((names, counts, ids[i], values[i]))
                        continue
                    kept = [t for t in range(len(names)) if counts[t]]
                    parts[i].append(([names[t] for t in kept], [counts[t] for t in kept], ids[i], values[i]))
        known = bases or {}
        return [RowBlock.of_groups(groups, [known.get(name, {}).get(i, self.row_versions.get((name, i), 0))
                                            for g in groups for name in g[0]])
                for i, groups in enumerate(parts)]

    def _place(self, lookups: Mapping[str, torch.Tensor],
               width: Callable[[str], object]) -> list[tuple[list[str], row_placement.TablesOnShards]]:
        """The tables of `lookups` in groups of one row width (width(name)), each group's ids placed
        on the shards at once."""
        groups: dict[object, list[str]] = {}
        for name in lookups:
            groups.setdefault(width(name), []).append(name)
        return [(names, self._placement(names, [lookups[name] for name in names])) for names in groups.values()]

    def _placement(self, names: list[str], ids: list[torch.Tensor]) -> row_placement.TablesOnShards:
        """The placement of tables' ids on the shards: the one made last for these tables where it
        was made for these very tensors, unchanged since (the ids a step pushes gradients for are
        the ones the step before fetched), else a new one."""
        key = tuple(names)
        held = self._placed.get(key)
        if held is not None and all(ref() is i and version == i._version for (ref, version), i in zip(held[0], ids)):
            return held[1]
        place = row_placement.TablesOnShards(ids, len(self.shards),
                                             [self._table(name).num_embeddings == row_placement.DYNAMIC for name in names])
        self._keep_placement(names, ids, place)
        return place

    def _keep_placement(self, names: list[str], ids: Sequence[torch.Tensor], place: row_placement.TablesOnShards) -> None:
        """Keep tables' placement of these ids for the next call that places them (see _placement)."""
        if len(self._placed) >= 16:  # (a few groups of tables in a model's steps; reads of others come and go)
            self._placed.clear()
        self._placed[tuple(names)] = ([(weakref.ref(i), i._version) for i in ids], place)

    def forget_lent_versions(self) -> None:
        """The model was written over a lent version (a private copy of those pages now): the next
        pull maps each same-host server's ring afresh."""
        for s in self.shards:
            s.forget_ring()

    def views(self) -> list[torch.Tensor | None]:
        """After a pull or exchange with published=True: per shard, its weights as a read-only
        float32 tensor of the version the server lent (valid until the next pull), or None where
        they were written into flat."""
        return [s.view for s in self.shards]

    def gradient_buffer(self) -> torch.Tensor | None:
        """A float32 buffer of the flat space in shared memory that pushes of it are not copied
        from (a zero-copy push: each shard's server on this host reads its range in place; others
        are sent frames from it), or None: no shard on this host lends its versions (see _lends), or
        not a float32 wire. Valid while the client is open; write it only between pushes (a push
        returns once read). No call writes it: the weights come back elsewhere."""
        compressed_here = self.spec.compress != "none" and self.config.compress_same_host
        if not self.plan.total:  # (a model of tables alone: no dense gradient to lend)
            return None
        # Only where the shard lends its versions too (a range of at least LEND_MIN_BYTES): the
        # weights then come back in a ring slot, never into the caller's gradient; a smaller range
        # is copied into the shard's own segment, which the weights come back in.
        lending = [i for i, s in enumerate(self.shards) if s.same_host and self._lends(i, self._pull_wire(i))]
        if self.spec.wire_dtype == "float32" and not compressed_here and self._gradient is None and lending:
            try:
                self._gradient = shm.Shared(4 * self.plan.total)
            except OSError:
                return None
            for i in lending:
                self.shards[i].lend_window(self._gradient.window(4 * self.plan.ranges[i][0], self._push_wires[i].nbytes))
        return None if self._gradient is None else torch.frombuffer(self._gradient.payload, dtype=torch.float32)

    def rollback(self, attempts: int = 5) -> int:
        """Sync mode, after a shard refused a call with RollbackError (it was restored from a
        checkpoint and is behind the job): return every shard to the newest iteration all of them
        can return to, and return that iteration. Every worker of the job does this when it meets
        the refusal; rolling a shard back to where it already is changes nothing.

        Raises:
            CheckpointError: no iteration is common to every shard's checkpoints (named), or a
                shard cannot read its checkpoint of it.
            RollbackError: the shards kept moving back (another shard restarted meanwhile).
        """
        for _ in range(attempts):
            query = pb.RollbackRequest(rank=self.rank, fingerprint=self.fingerprint)
            points = [set(r.points) for r in self._fan_out(lambda i, s: s.rollback(query))]
            common = set.intersection(*points)
            if not common:
                have = "; ".join(f"{s.address}: {sorted(p, reverse=True)}" for s, p in zip(self.shards, points))
                raise errors.CheckpointError(
                    f"no iteration that every shard can return to ({have}): every server needs a "
                    "--checkpoint-dir and the same --checkpoint-every-versions, and checkpoints that were written "
                    "(psgrad status shows each server's last checkpoint and why its writes failed, e.g. a full disk)"
                )
            target = max(common)
            execute = pb.RollbackRequest(rank=self.rank, fingerprint=self.fingerprint, version=target, execute=True)
            try:
                self._fan_out(lambda i, s: s.rollback(execute))
            except errors.RollbackError:
                continue  # a shard went back further meanwhile: ask again
            self.unfinished = None  # (the job computes the iterations since target again)
            return target
        raise errors.RollbackError(f"the shards kept moving back during {attempts} roll-back attempts")

    def leave(self) -> None:
        """Leave the job: nobody waits for this worker any more."""
        self._halt_heartbeat()
        self._fan_out(lambda i, s: s.leave(self.rank, self.fingerprint, self.incarnation))

    def _halt_heartbeat(self) -> None:
        self._stop_heartbeat.set()
        for thread in self._heartbeat or ():
            thread.join()
        self._heartbeat = None
        self._stop_heartbeat = threading.Event()  # (a later join starts it again)


def run_through(stages: Generator[None, None, T]) -> T:
    """What a call in stages (see Transport.stepping) returns, its stages run one after another."""
    while True:
        try:
            next(stages)
        except StopIteration as done:
            return done.value


def _in_stages(calls: Sequence[Generator[None, None, T]]) -> list[T]:
    """Shards' calls in stages (see Transport.stepping), all on this thread: every call's first
    stage (its request sent), then every call's rest (its reply read), in shard order. Each server
    works on its call while the next one's is sent, with no hand-off to another thread (which
    costs about as much CPU as a small call and waits for a core on a busy host). As _fan_out:
    every call runs to its end, then the first failure (in shard order) is raised."""
    outcomes: list[tuple[bool, Any]] = []
    for call in calls:
        try:
            next(call)
            outcomes.append((True, call))  # (sent: its reply is read below)
        except StopIteration as done:
            outcomes.append((True, done.value))
        except BaseException as exc:  # the others run all the same, as a fan-out's would
            outcomes.append((False, exc))
    for k, (ok, value) in enumerate(outcomes):
        if ok and value is calls[k]:
            try:
                outcomes[k] = (True, run_through(calls[k]))
            except BaseException as exc:
                outcomes[k] = (False, exc)
    for ok, value in outcomes:
        if not ok:
            raise value
    return [value for _, value in outcomes]


@dataclass
class RowReads:
    """Rows an exchange reads with its pull: row ids (unique, int64, CPU) by table, and once the
    exchange returned, their rows ([len(ids), dim] float32, CPU) by table. checked: the caller
    checked the ids against their tables' ranges already (a model's embedding modules do, finding
    a forward's unique ids), so the read does not check them again."""

    ids: Mapping[str, torch.Tensor]
    rows: row_placement.PulledRows = field(default_factory=row_placement.PulledRows)
    checked: bool = False


class _ReadPlan:
    """Which rows of which tables a read asks each shard for (row r on shard r mod S), and where the
    rows each shard sends back go: tables of one row width are placed together, and their rows
    from a shard land with one copy. Torch work stays on the caller's thread: the fan-out's threads
    only make the calls (two threads running torch ops at once contend for its OpenMP threads,
    which cost more than the ops)."""

    def __init__(self, client: ParameterClient, lookups: Mapping[str, torch.Tensor], checked: bool = False) -> None:
        self._client = client
        S = len(client.shards)
        if not checked:
            for table, ids in lookups.items():
                row_placement.check_ids(ids, client._table(table).num_embeddings, f"table {table!r}")
        self._groups = client._place(lookups, lambda name: client._table(name).dim)
        # shard -> [(group, table's place in it, table, its count of ids there)], in the order asked
        self._parts: list[list[tuple[int, int, str, int]]] = [[] for _ in range(S)]
        # shard -> its ids of each group (one slice of one gather: the block's buffer as it is)
        asked: list[list[tuple[list[str], list[int], torch.Tensor, None]]] = [[] for _ in range(S)]
        for g, (names, place) in enumerate(self._groups):
            on_shards = place.ids_by_shard()
            for i in range(S):
                kept = [(t, name) for t, name in enumerate(names) if place.counts[i][t]]
                self._parts[i] += [(g, t, name, place.counts[i][t]) for t, name in kept]
                asked[i].append(([name for _, name in kept], [place.counts[i][t] for t, _ in kept], on_shards[i], None))
        self._asks = [RowBlock.of_groups(groups, push=False) for groups in asked]

    def asks(self, index: int) -> RowBlock:
        """What shard `index` is asked for, all tables in one block (empty: none of its rows)."""
        return self._asks[index]

    def place(self, replies: Mapping[int, RowsRead], observe: bool) -> row_placement.PulledRows:
        """Each table's rows from the shards' replies, with the versions they were read at;
        remembers those as the client's row_versions too (not when observe)."""
        dims = [self._client._table(names[0]).dim for names, _ in self._groups]
        out = [torch.empty(sum(place.sizes), dim) for (_, place), dim in zip(self._groups, dims)]
        read: dict[str, dict[int, int]] = {name: {} for names, _ in self._groups for name in names}
        for i, (versions, data) in replies.items():
            address = self._client.shards[i].address
            asked = sum(n * dims[g] * 4 for g, _, _, n in self._parts[i])
            if len(data) != asked or len(versions) != len(self._parts[i]):
                raise errors.InvalidRequestError(
                    f"server {address}: {len(data)} bytes of rows and {len(versions)} table versions for "
                    f"{asked} bytes of {len(self._parts[i])} tables asked for")
            offset = 0
            for g, (_, place) in enumerate(self._groups):
                rows = sum(place.counts[i])
                if not rows:
                    continue
                nbytes = rows * dims[g] * 4
                at = place.positions(i)
                if at is None:  # (one shard holds them all: copied as bytes into the group's rows)
                    byte_view(out[g])[:] = data[offset:offset + nbytes]
                else:  # (numpy's row scatter: torch's index_copy_ of rows this narrow costs half again as much)
                    out[g].numpy()[at.numpy()] = _float_rows(data[offset:offset + nbytes], rows, dims[g])
                offset += nbytes
            for (_, _, table, _), version in zip(self._parts[i], versions):
                read[table][i] = version
                if not observe:
                    self._client.row_versions[(table, i)] = version
        return row_placement.PulledRows({name: rows for (names, place), group in zip(self._groups, out)
                                         for name, rows in zip(names, group.split_with_sizes(place.sizes))}, read,
                                        {tuple(names): group for (names, _), group in zip(self._groups, out)})


def _float_rows(data: memoryview, rows: int, dim: int) -> np.ndarray:
    """Rows [rows, dim] (float32) of a reply's bytes, the source of a row scatter, without a copy:
    numpy reads them where they are (a rows segment's, or a reply's own bytes, which are read-only
    and need not be aligned for float32)."""
    return np.frombuffer(data, dtype=np.float32, count=rows * dim).reshape(rows, dim)
