"""The Python API: connect to a job's servers once, wrap the model, keep your own training loop.

    ps = psgrad.connect(["127.0.0.1:7000", "127.0.0.1:7001"], rank=0, num_workers=2,
                        mode="ssp", staleness=2, optimizer=psgrad.SGD(lr=0.1, momentum=0.9))
    opt = ps.optimizer(model)        # joins the job and pulls the initial weights into the model
    for x, y in loader:
        opt.zero_grad(); loss_fn(model(x), y).backward()
        opt.step()                   # pushes the gradients, pulls fresh weights (mode-aware)
    ps.close()                       # leaves the job; `with psgrad.connect(...) as ps:` also works

`psgrad worker` trains through this same API (psgrad.cli.train.train).
"""
from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent import futures
from typing import Any, TypeVar

import torch
from torch import nn

from psgrad.client.parameter_client import ParameterClient, RowReads
from psgrad.config import ClientConfig, JobSpec
from psgrad.core.addresses import parse_servers
from psgrad.core.compression import BIASED, NONE, feeds_back
from psgrad.errors import (CompressionWarning, ConfigError, EvictedError, InvalidRequestError, PsgradError, RollbackError,
                           WorkerStateError)
from psgrad.core.modes import AUTO_STALENESS_MAX, find_mode, mode_of
from psgrad.core.job import check_overlap, check_row_cache
from psgrad.core.optimizer_settings import SGD, Adam, ServerOptimizer, check_server_optimizer  # noqa: F401 (Adam: psgrad.api.Adam, as before)
from psgrad.worker.flat import FlatModel
from psgrad.worker.param_groups import with_groups
from psgrad.worker.step_stats import ExchangeResult, StepStats
from psgrad.worker.torch_optim import ScheduledOptimizer
from psgrad.core.optimizers.rows import check_row_settings
from psgrad.core.rows import PulledRows
from psgrad.core.sharding import TableSpec, buffer_specs, frozen_space, frozen_tensors, frozen_words, param_specs, plan_shards
from psgrad.core.unused import Ranges
from psgrad.nn.collection import EmbeddingBagCollection
from psgrad.nn.embedding import RowSource, SparseEmbedding, sparse_aliases, sparse_modules, step_rows, unique_ids_of
from psgrad.worker.prefetch import GroupedForward, Prefetched, read_ids
from psgrad.worker.row_cache import RowCache

_log = logging.getLogger("psgrad.api")
B = TypeVar("B")
# What a forward of each psgrad embedding module (Embedding, EmbeddingBag, EmbeddingBagCollection)
# will take: its first argument (ids, or a collection's features), by module; a list of them for a
# module several forwards call (one registered under several names: a two-tower model's shared
# table). Or (module, input) pairs, a module in as many as forwards call it.
Lookups = Mapping[nn.Module, Any] | Iterable[tuple[nn.Module, Any]]


def serve(port: int = 0, host: str = "127.0.0.1", **settings: Any) -> Any:
    """Start one shard server in this process (its gRPC threads serve in the background) and return
    it: `.address` is the HOST:PORT workers connect to, `.stop()` stops it, and `with` stops it at
    the end of the block (keep the handle: the server stops when it is garbage-collected). port 0 picks a free port. settings: the server's other settings, by
    their names in psgrad.config.ServerConfig (lease_s, nonfinite, checkpoint_dir,
    checkpoint_every_s, metrics_port, ...; the same as `psgrad server`'s flags). A job's S shards
    are S servers, given to every worker in the same order:

        servers = [psgrad.serve() for _ in range(2)]
        with psgrad.connect([s.address for s in servers]) as ps: ...

    Raises:
        ConfigError: an unknown or invalid setting (named).
        ServerStartError: the address cannot be bound.
    """
    import dataclasses

    from psgrad.config import ServerConfig
    from psgrad.server.runtime import start_server  # (the server side, loaded when asked for)

    known = {f.name for f in dataclasses.fields(ServerConfig)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ConfigError(f"psgrad.serve() has no setting {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
    return start_server(ServerConfig(host=host, port=port, **settings))


def connect(
    servers: str | Sequence[str],
    rank: int = 0,
    num_workers: int = 1,
    mode: str = "async",
    staleness: int | str | None = None,
    optimizer: ServerOptimizer | None = None,
    wire_dtype: str = "float32",
    staleness_lr: bool = False,
    client: ClientConfig | None = None,
    dc_asgd: float = 0.0,
    dc_asgd_adaptive: bool = False,
    backup_workers: int = 0,
    staleness_max: int = AUTO_STALENESS_MAX,
    compress: str = "none",
    error_feedback: bool = True,
    tables_mode: str = "",
) -> Session:
    """Describe this worker's place in a job; nothing is sent until `optimizer(model)`.

    servers: the shard servers' HOST:PORT (a list or a comma-separated string), same order for
    every worker. staleness: the SSP bound (default 2 for mode "ssp", 0 otherwise), or "auto": the
    servers adapt it within [1, staleness_max]. backup_workers (sync): an iteration applies the first
    num_workers - backup_workers gradients. dc_asgd: DC-ASGD's lambda (0: off; async/ssp),
    dc_asgd_adaptive its adaptive variant (docs/guide/dc-asgd.md). compress: how pushed gradients
    travel ("topk:0.01", "randomk:0.01", "sign", "int8"; shards on this host get plain ones unless
    `client=ClientConfig(compress_same_host=True)`; docs/guide/compression.md), error_feedback:
    whether the biased codecs (topk, randomk, sign) add what a push left out to the next gradient.
    tables_mode: the embedding tables' mode where it differs from `mode` ("async" with mode "sync":
    each worker's row gradients are applied as they arrive, the dense part once per iteration;
    docs/guide/embeddings.md). Every worker of a job must pass the same job settings; the servers
    refuse a mismatch, naming the field.

    Raises:
        ConfigError: an invalid address or job setting (the message names it), or an optimizer
            that is not psgrad.SGD, Adam, Adagrad, RMSprop or Adadelta (a torch.optim one, say).
        TypeError: a setting of the wrong type, named (compress=0.01 for "topk:0.01").
    """
    addresses = parse_servers(servers) if isinstance(servers, str) else parse_servers(",".join(servers))
    optimizer = optimizer or SGD()
    check_server_optimizer(optimizer)  # a torch.optim optimizer: say what to give instead
    if staleness is None:  # the mode's default (an unknown mode: JobSpec names it below)
        known = find_mode(mode)
        staleness = known.default_staleness if known is not None else 0
    auto = staleness == "auto"
    if isinstance(staleness, str) and not auto:
        raise ConfigError(f"staleness must be an integer >= 0 or 'auto', got {staleness!r}")
    spec = JobSpec(
        mode=mode,
        staleness=0 if auto else int(staleness),
        staleness_max=staleness_max if auto else 0,
        backup_workers=backup_workers,
        num_workers=num_workers,
        wire_dtype=wire_dtype,
        num_shards=len(addresses),
        staleness_lr=staleness_lr,
        dc_asgd=dc_asgd,
        dc_asgd_adaptive=dc_asgd_adaptive,
        compress=compress,
        error_feedback=error_feedback,
        tables_mode=tables_mode,
        **optimizer.job_fields(),
    )
    client = client or ClientConfig()
    # Settings with nothing to act on are refused rather than ignored (JobSpec keeps error feedback on).
    if not error_feedback and not feeds_back(spec.compress):
        raise ConfigError(f"error_feedback=False needs compress= a biased codec ({BIASED}): with compress="
                          f"{spec.compress!r} no push leaves anything out to feed back; leave error_feedback out, "
                          "or pass compress='topk:0.01' (say)")
    if client.compress_same_host and spec.compress == NONE and client.compress_pull == NONE:
        raise ConfigError("ClientConfig(compress_same_host=True) needs compress= (or the client's compress_pull=) a "
                          "codec: with compress='none' nothing is compressed, on this host or another; leave "
                          "compress_same_host out, or pass compress='topk:0.01' (say)")
    return Session(addresses, spec, rank, client)


def _forwards(lookups: Lookups) -> list[tuple[nn.Module, Any]]:
    """(module, the input of one of its forwards) for every forward `lookups` names: a mapping's
    list value is one input per forward of its module; pairs are taken as they are.

    Raises:
        ConfigError: lookups that are neither a mapping nor (module, input) pairs.
    """
    items = lookups.items() if isinstance(lookups, Mapping) else lookups
    out: list[tuple[nn.Module, Any]] = []
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise ConfigError(f"prefetch lookups: give {{module: its next input}} (a list of inputs for a module "
                              f"called several times) or (module, input) pairs, got {type(item).__name__} {item!r:.60}")
        module, value = item
        out.extend((module, one) for one in (value if isinstance(value, list) else [value]))
    return out


class Session:
    """One worker's membership in a job: which servers, which job spec, which rank."""

    def __init__(self, servers: Sequence[str], spec: JobSpec, rank: int, client: ClientConfig | None = None) -> None:
        if len(servers) != spec.num_shards:
            raise ConfigError(f"{len(servers)} server addresses for a job of {spec.num_shards} shards")
        if not 0 <= rank < spec.num_workers:
            raise ConfigError(f"rank must be in [0, num_workers={spec.num_workers}), got {rank}")
        self.servers = tuple(servers)
        self.spec = spec
        self.rank = rank
        self.client_config = client or ClientConfig()
        self._optimizer: PSOptimizer | None = None
        self._closed = False

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # leaving is still polite, but must not hide the error that ended the block
            self.close()
        except PsgradError:
            pass

    def optimizer(self, model: nn.Module, overlap: bool = False, sync_buffers: bool = True,
                  param_groups: Sequence[Mapping[str, Any]] | None = None, frozen: str = "servers",
                  row_cache: int = 0, row_cache_staleness: int = 1, group_lookups: bool = True) -> PSOptimizer:
        """Join the job with this model and pull its weights; return the optimizer to step.

        The chief (rank 0) initializes empty servers with the model's current weights. Put the
        model on its device first (`model.to(device)`): its parameters become views of flat
        buffers psgrad owns. overlap=True pushes and pulls in the background while the next
        step computes (async and ssp only; see PSOptimizer). sync_buffers=True keeps the model's
        persistent buffers (BatchNorm running statistics) on the servers too, averaged over the
        workers, but a buffer whose values the wire dtype cannot hold exactly now (a bool mask, an
        int64 id map past 2**24, a float64 constant) is kept exactly with the frozen parameters (the
        chief's values, never averaged); False leaves each worker's own. param_groups: torch's list of {"params": [...],
        "lr": ..., "weight_decay": ...} dicts (e.g. no weight decay on biases and norms); a group's
        lr is kept as a fixed multiple of the job's (so a schedule scales every group alike), and
        parameters in no group take the job's settings; a group of psgrad embeddings (the modules in
        "params") may also set its optimizer's settings, or name an optimizer of its own for their
        rows ("optimizer": "adagrad" or psgrad.Adagrad(lr=...)). Every worker must pass the same groups.
        frozen: where the frozen parameters (requires_grad=False) live: "servers" (the default:
        part of the job, in a table of their own that no step pushes or pulls; the chief writes
        them at init, every worker reads them as it joins, and exports, fetch_state_dict and
        checkpoints hold the whole model) or "local" (each worker keeps its own; nothing frozen
        travels, and exports lack them). row_cache: keep up
        to this many hot rows of each psgrad embedding (psgrad.Embedding/EmbeddingBag: tables whose rows
        live on the servers) in this worker, served for row_cache_staleness steps before they are
        pulled again (async and ssp only; `opt.row_cache.stats` counts hits and misses).
        group_lookups: a training forward of the model reads, at its start, the rows of every psgrad
        embedding called with one of its arguments (or what a list, tuple or dict among them
        holds), all tables in one call per shard (learned from the first forward: see
        psgrad.worker.prefetch.GroupedForward; `opt.prefetched.stats.grouped` counts them); False:
        each module's forward reads its own.

        Raises:
            PsgradError: a server is unreachable or refuses the job (ConfigError, JobMismatchError, ...).
            TypeError: model is not an nn.Module (a list of parameters, as torch.optim takes).
        """
        if self._closed:
            raise WorkerStateError("this session is closed; call psgrad.connect(...) again")
        if self._optimizer is not None:
            raise WorkerStateError("this session already has an optimizer: one model per job")
        if not isinstance(model, nn.Module):  # (torch.optim's first argument: parameters)
            what = f"a {type(model).__name__}" + (" of parameters" if isinstance(model, (list, tuple)) else "")
            raise TypeError(
                f"ps.optimizer(model) takes the model, an nn.Module, got {what}: psgrad makes the model's parameters "
                "views of buffers it exchanges with the servers, so pass the module itself (ps.optimizer(model)); "
                "per-parameter settings go in param_groups=[{'params': [...], 'lr': ...}]")
        if frozen not in ("local", "servers"):
            raise ConfigError(f"frozen must be 'local' or 'servers', got {frozen!r}")
        self._optimizer = PSOptimizer(self, model, overlap, sync_buffers, param_groups, frozen == "servers",
                                      row_cache, row_cache_staleness, group_lookups)
        return self._optimizer

    def leave(self) -> None:
        """Finish in-flight pushes and leave the job (nobody waits for this worker any more).
        The optimizer can still refresh() the weights afterwards."""
        if self._optimizer is not None:
            self._optimizer.leave()

    def close(self) -> None:
        """Leave the job (if not yet left) and close the connections. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._optimizer is not None:
            self._optimizer.close()


class PSOptimizer(ScheduledOptimizer):
    """Steps a model against the parameter servers; a drop-in for a torch optimizer in the loop.

    step() pushes the flat gradient keyed by this worker's clock, then pulls the weights for the
    next clock (the pull waits as the mode requires: never in async, until the slowest live worker
    is within the bound in ssp, until every worker's push is applied in sync) and writes them into
    the model.

    It is a torch.optim.Optimizer with one parameter group whose "lr" starts at the job's lr, so a
    torch LR scheduler drives it (StepLR, LambdaLR, OneCycleLR without cycle_momentum, SequentialLR
    of LinearLR warmup and CosineAnnealingLR, ...) as does setting `param_groups[0]["lr"]` by hand.
    The schedule is the job's: in sync mode every worker's push carries its lr, and the servers
    apply the iteration's mean with the lowest rank's (every worker's, when their schedules follow
    their clocks). In async and ssp mode the chief's (rank 0's) pushes carry its lr, which becomes
    the job's on every shard (versioned by the chief's clock); the other workers' pushes carry none
    and are applied with the job's, which the servers answer with and step() writes into their
    param_groups (a schedule of their own is ignored, with a warning). The other optimizer
    settings are the job's and stay on the servers.

    state_dict() holds what lives in the worker: the param group's settings (the lr a scheduler
    set) and the clock. The weights and the optimizer's moments live on the servers, which
    checkpoint them (--checkpoint-dir): load_state_dict() takes a state_dict() of a PSOptimizer
    back (the lr; a scheduler's own state_dict() restores the schedule) and refuses per-parameter
    state, such as a torch.optim optimizer's momentum buffers, which the servers keep instead.

    overlap=True runs each step's push + pull in a background thread while the caller computes the
    next step, and installs the pulled weights at the following step() call. The gradient of
    clock c is then computed on the weights pulled at clock c-1 instead of c: one iteration more
    staleness (ssp(s) behaves like ssp(s+1) as seen by the gradients; async gradients are one step
    older). Sync mode promises staleness 0, which leaves nothing to overlap, so it is refused.
    """

    def __init__(self, session: Session, model: nn.Module, overlap: bool = False, sync_buffers: bool = True,
                 param_groups: Sequence[Mapping[str, Any]] | None = None, frozen: bool = False,
                 row_cache: int = 0, row_cache_staleness: int = 1, group_lookups: bool = True) -> None:
        spec = session.spec
        check_overlap(spec, overlap)
        check_row_cache(spec, row_cache)
        # Sparse tables: the model's psgrad embeddings, named by their place in it.
        self.embeddings = sparse_modules(model)
        if self.embeddings and overlap:
            raise ConfigError("overlap does not go with psgrad embeddings (their rows are pulled by each forward, "
                              "after the step's push): leave out overlap, and fetch the next batch's rows with the "
                              "step instead (opt.pipeline)")
        aliases = sparse_aliases(model)  # (a table registered under several names: exports write each)
        # (drawn_as: a loaded state's name for its rows, where the model loaded it under another prefix)
        tables = [TableSpec(name, m.num_embeddings, m.embedding_dim, m.seed, m.std, min_count=m.min_count, ttl=m.ttl,
                            evict=m.evict, aliases=aliases.get(name, ()), drawn_as=m.bound_draw_name(name))
                  for name, m in self.embeddings]
        dense_specs, tables = with_groups(param_specs(model), model, param_groups, spec, tables)
        for t in tables:  # every setting applies to the rows as the declarations say, or is refused by name
            check_row_settings(t.job_spec(spec), t.name, own=bool(t.optimizer))
        # (before the model's state_dict() below: it then reads no rows) Rows that a state_dict or
        # pretrained weights gave the chief's model become the job's initial rows of their tables.
        loaded = {name: module.prepare_to_bind() for name, module in self.embeddings}
        initial_rows = {name: rows for name, rows in loaded.items() if rows is not None}
        # Frozen parameters on the servers: a table of their own, read at join (see _sync_frozen),
        # with the buffers the flat space cannot sync exactly (split_buffers: a bool mask, an int64
        # id map past 2**24, a float64 constant), kept bit for bit
        # (the buffers are found in the model's state_dict(), read after prepare_to_bind: no rows).
        frozen_specs = param_specs(model, frozen=True) if frozen else []
        frozen_specs += buffer_specs(model, spec.wire_dtype, kept=True) if sync_buffers else []
        named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        self._frozen = [(s, named[s.name]) for s in frozen_specs]
        self.session = session
        self.model = model
        self.overlap = overlap
        self.flat = FlatModel(model, staging=overlap, sync_buffers=sync_buffers, tables=bool(self.embeddings),
                              wire_dtype=spec.wire_dtype)
        self.rank, self.mode, self.clock = session.rank, spec.mode, 0
        super().__init__(self.flat.params, spec.lr, follows_job_lr=not mode_of(spec).synchronous and session.rank != 0)
        self.params = dense_specs
        self.params += buffer_specs(model, spec.wire_dtype) if self.flat.buffers is not None else []
        self.plan = plan_shards(self.params, spec.num_shards, tables=bool(tables))
        self.client = ParameterClient(session.servers, spec, self.params, self.plan, session.rank, session.client_config,
                                      tables=tables, frozen=frozen_specs)
        self._frozen_flat = torch.empty(sum(frozen_words(s) for s in frozen_specs))
        self.row_cache: RowCache | None = None
        source: RowSource = self.client
        if row_cache and self.embeddings:
            source = self.row_cache = RowCache(self.client, row_cache, row_cache_staleness, lambda: self.clock)
        self.prefetched = Prefetched(source)  # rows fetched ahead (prefetch, step(prefetch=...), pipeline)
        self._next_lookups: Lookups | None = None  # pipeline(): the next batch's, for the next step()
        self._pool: futures.ThreadPoolExecutor | None = None
        self._pending: futures.Future[ExchangeResult] | None = None
        self._versions: list[int] = []
        self._left = False
        self.grouping: GroupedForward | None = None  # a forward's reads grouped at its start (group_lookups)
        self._closed = False
        self._zero_copy = False
        try:
            chief = session.rank == 0
            self.start_clock = self.client.join(initial_weights=self.flat.host_weights if chief else None,
                                                initial_rows=initial_rows if chief else None,
                                                initial_frozen=self._frozen_values if chief else None)
            self.clock = self.start_clock
            # Bound once joined, their rows drawn under the job's names (TableSpec.drawn_as, as the join
            # answers them: a state this worker loaded counts only where it initialized the servers).
            for name, module in self.embeddings:
                module.bind(name, self.prefetched, self.client.drawn_as.get(name, ""))
            self.grouping = (GroupedForward(model, self.prefetch, self._may_group, self.prefetched.stats,
                                            self._grouped_read) if self.embeddings and group_lookups else None)
            self.rollbacks = 0
            self.rejoins = 0
            # Same host, CPU float32: pushes read the gradient in place, and pulls lend versions
            # that the parameters become views of (zero-copy; they are read-only between steps).
            self._zero_copy = self.flat.zero_copy and session.client_config.shared_memory
            grad = self.client.gradient_buffer() if self._zero_copy else None
            if grad is not None:
                self.flat.adopt_grad_buffer(grad)
            try:
                self._versions = self._pull(self.clock)
            except RollbackError:  # a resumed sync job whose shards checkpointed different iterations
                self.start_clock = self._roll_back()
        except BaseException:
            self.client.close()
            raise
        plain = self.client.plain_shards()
        if plain:  # say so once: the job's codec leaves these pushes as they are
            warnings.warn(
                f"compress={spec.compress!r} compresses pushes between hosts only: shard(s) "
                f"{', '.join(map(str, plain))} share this host, and pushes to them travel plain through shared "
                "memory (fewer bytes save nothing there); pass client=psgrad.ClientConfig(compress_same_host=True) "
                "to compress them too", CompressionWarning, stacklevel=3)
        if overlap:
            self._pool = futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="psgrad-overlap")

    @property
    def device(self) -> Any:
        return self.flat.device

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the flat gradient (set_to_none is accepted for torch compatibility; the buffers stay)
        and drop the gradients of the rows the model's psgrad embeddings touched since the last step
        (either way: a row without a gradient is not pushed), as torch's zero_grad clears a table's
        weight.grad. A backward after it (of a forward before it, too) gives gradients anew.

        After a step that raised once some shards had applied it (its push refused by another
        shard: a non-finite gradient in that shard's range, its memory budget; or another shard
        unreachable), zero_grad() drops that step: it tells the shards that did not apply it that
        it is skipped (acknowledged there, never applied; logged as a warning), its clock is spent
        (the next step pushes the next one), and the model takes the weights of that next clock
        (as the step would have brought them: in sync, once the iteration is complete), for the
        next batch's forward. Taking the step again instead (opt.step() before zero_grad())
        applies it once on every shard."""
        self.flat.zero_grad()
        for _, module in self.embeddings:
            module.zero_grad(set_to_none)
        unfinished = self.client.unfinished
        if unfinished is not None and unfinished.clock == self.clock and self._pending is None:
            self._drop_unfinished()

    def _drop_unfinished(self) -> None:
        """zero_grad() after a step some shards applied before it raised: skip it on the others,
        spend its clock and pull the next clock's weights. Where a shard does not answer (or
        refuses), zero_grad() does not raise: the clock is spent all the same, and the next step
        sends the skip again before its push (ParameterClient.skip_unfinished), its gradient
        computed on the weights the model holds."""
        dropped = self.clock
        try:
            self.client.skip_unfinished(dropped + 1)
        except PsgradError as exc:
            self.clock = dropped + 1
            _log.warning("worker rank %d: the step at clock %d that it dropped could not be skipped on every shard "
                         "yet (%s); its next step tries again", self.rank, dropped, exc)
            return
        self.clock = dropped + 1
        self.prefetched.reset()  # rows read before the dropped step, which some shards applied
        try:
            self._versions = self._pull(self.clock)
        except PsgradError as exc:  # (its next step meets it again: a roll-back, an eviction, ...)
            _log.warning("worker rank %d: after dropping the step at clock %d, the weights of clock %d could not be "
                         "pulled (%s); the next batch's gradient is computed on those the model holds",
                         self.rank, dropped, self.clock, exc)

    def _exchange(self, grad: Any, clock: int, base: list[int], lr: float | None,
                  reads: RowReads | None = None, unused: Ranges = ()) -> ExchangeResult:
        """Push grad as clock (computed on weights of versions `base`) with lr, the row gradients
        of the model's psgrad embeddings and the dense parameters the step left unused (`unused`,
        which the servers skip), then pull clock + 1 (and the rows `reads` asks for). The rows'
        gradients are dropped once the exchange succeeded: one that raises leaves them for the
        step taken again (the same clock, which a shard that applied it already acknowledges as a
        duplicate: applied once), and for zero_grad() to drop."""
        t0 = time.perf_counter()
        self.client.base_versions = base
        rows, bases, unused_tables = step_rows(self.embeddings)
        replies, versions = self.client.exchange(grad, clock, self.flat.host_flat, lr, self._zero_copy, rows, reads,
                                                 bases, unused, unused_tables)
        self._rows_pushed()
        evicted, restores = self.client.take_news()
        return ExchangeResult(
            exchange_s=time.perf_counter() - t0,
            staleness=max(r.staleness for r in replies),
            accepted=all(r.accepted for r in replies),
            versions=versions,
            lr=next((r.lr for r in replies if r.lr is not None), None),
            bound=max(r.staleness_bound for r in replies),
            evicted=evicted,
            restores=restores,
        )

    def _rows_pushed(self) -> None:
        """A step's exchange succeeded: the row gradients it pushed are dropped (after a roll-back or
        a rejoin, with the step's gradient: the step returns, the clock moved)."""
        for _, module in self.embeddings:
            module.rows_pushed()

    def _finish_pending(self, stats: StepStats) -> None:
        """Wait for the background exchange, install its weights, fill stats."""
        if self._pending is None:
            return
        t0 = time.perf_counter()
        try:
            done = self._pending.result()
        finally:
            self._pending = None
        stats.wait_s = time.perf_counter() - t0
        self._record(done, stats)

    def _pull(self, clock: int, observe: bool = False) -> list[int]:
        """Pull the weights for clock into the model (zero-copy where a same-host shard lends them)."""
        versions = self.client.pull(self.flat.host_flat, clock, observe, self._zero_copy)
        self._install()
        return versions

    def _install(self) -> None:
        views = self.client.views() if self._zero_copy else []
        self.flat.weights_pulled([(start, v) for (start, _), v in zip(self.plan.ranges, views)])
        self._sync_frozen()

    def _frozen_values(self) -> torch.Tensor:
        """The model's frozen parameters and kept buffers as the frozen space (float32 elements,
        CPU; see frozen_space): the chief's init."""
        return frozen_space(self._frozen)

    def _sync_frozen(self) -> None:
        """Read the frozen table of the shards where it moved since this worker read it (at join:
        every shard; later only after a shard's restore, which a rejoin reports) into the model's
        frozen parameters and kept buffers, exactly. A step's push and pull never carry them."""
        moved = self.client.frozen_moved()
        if not moved:
            return
        self.client.pull_frozen(self._frozen_flat, moved)
        values = frozen_tensors([s for s, _ in self._frozen], self._frozen_flat)
        with torch.no_grad():
            for s, p in self._frozen:
                p.copy_(values[s.name])

    def _record(self, done: ExchangeResult, stats: StepStats) -> None:
        self._install()
        self._versions = done.versions
        stats.h2d_s = self.flat.h2d_s
        stats.exchange_s = done.exchange_s
        stats.staleness, stats.accepted = done.staleness, done.accepted
        if self.job_lr_answered(done.lr) is not None:  # a follower reports the job's lr
            stats.lr = self.lr
        stats.staleness_bound = done.bound or None
        stats.evicted, stats.restores = done.evicted, done.restores

    def prefetch(self, lookups: Lookups) -> None:
        """Fetch the rows that training forwards of these inputs will read, every table in one call
        per shard, however many psgrad embedding modules hold them: `lookups` maps each module
        (psgrad.Embedding, EmbeddingBag or EmbeddingBagCollection of this model) to the first
        argument its forward will get (ids, or a collection's features), or to a list of them, one
        per forward, for a module that several forwards call (one registered under several names,
        as a two-tower model's towers share the item table); (module, input) pairs do the same, a
        module in as many pairs as forwards call it. A table several forwards read (a collection's
        table that a module of its own reads too, as well) is read once, for all their ids. Each
        module's next training forward with exactly those ids, before the next step, is served
        these rows; any other read pulls as usual. So separate modules cost one call per shard per
        forward, like one table.

        When: with no step pending (after opt.step(), before the next forward) the rows are read
        now. While a step is pending (a training forward read rows since the last step: the
        prefetch sits after the forward or the backward), they are read by that step instead, in
        its calls, after its update (as step(prefetch=...) reads them): a forward never gets rows
        that miss the step before it, so a sync job equals the one without prefetch, and async
        and ssp count each table's staleness from the read the gradient was computed on. A step
        drops rows fetched before it that no forward used (PrefetchStats.unused). A prefetch
        replaces the rows of an earlier one not yet used.

        Raises:
            ConfigError: a module that is not one of this model's psgrad embeddings.
            InvalidRequestError: an id out of its table's range, or not an integer tensor (named).
        """
        wanted = self._lookup_ids(lookups)
        if self.prefetched.pending:  # (rows read now would miss the pending step's update)
            self.prefetched.defer(wanted)
            return
        ids = read_ids(wanted)
        self.prefetched.hold(wanted, ids, self.client.pull_tables(ids, checked=True))

    def _grouped_read(self, ids: dict[str, torch.Tensor]) -> PulledRows:
        """A grouped forward's read of the rows its pooled bags take (by table, unique ids checked
        against the table's range by their lookup): read now, in one call per shard, as a training
        forward's read through self.prefetched, which holds nothing then (_may_group), would be."""
        self.prefetched.pending = True
        return self.client.pull_tables(ids, checked=True)

    def _may_group(self) -> bool:
        """Whether a forward starting now reads its tables' rows ahead, grouped (GroupedForward): a
        training forward (autograd on) of a worker in its job, with nothing fetched or pending
        (no forward since the last step, no prefetch or pipeline rows held), and no row cache,
        which may serve the rows without a call."""
        return not self._left and self.row_cache is None and torch.is_grad_enabled() and self.prefetched.idle

    def _lookup_ids(self, lookups: Lookups) -> dict[str, list[torch.Tensor]]:
        """The unique ids that forwards of `lookups` read, by table, one entry per forward (a table
        that several forwards read has several: a module called twice, a collection's table that a
        module of its own reads too); checked against their tables' ranges, as a forward's are."""
        mine = {id(m) for _, m in self.embeddings}
        wanted: dict[str, list[torch.Tensor]] = {}
        single: list[tuple[SparseEmbedding, torch.Tensor]] = []  # modules of a table each: found together
        for module, value in _forwards(lookups):
            tables = list(module.bags.values()) if isinstance(module, EmbeddingBagCollection) else [module]
            if not isinstance(module, (SparseEmbedding, EmbeddingBagCollection)) or any(id(t) not in mine for t in tables):
                raise ConfigError(f"prefetch: {type(module).__name__} is not a psgrad embedding of this optimizer's "
                                  "model (psgrad.Embedding, EmbeddingBag or EmbeddingBagCollection)")
            if isinstance(module, SparseEmbedding):
                single.append((module, value))
            else:
                for table, unique in module.lookup(value).items():
                    wanted.setdefault(table, []).append(unique)
        if single:  # every table's unique ids in one pass (nn/lookups.py)
            found = unique_ids_of([m for m, _ in single], [v for _, v in single])
            for (m, _), (unique, _) in zip(single, found):
                wanted.setdefault(m.table or "", []).append(unique)
        return wanted

    def pipeline(self, batches: Iterable[B], lookups: Callable[[B], Lookups]) -> Iterator[B]:
        """The batches of `batches`, each with its rows fetched ahead: the first one's before it is
        yielded (prefetch), each next one's by the step() in between, in the same call per shard
        as that step's push and pull (step(prefetch=...)): a training step then makes one call per
        shard, every table both ways. `lookups(batch)` names what each psgrad embedding module's
        forward takes for that batch ({module: ids or features}; a list of them for a module called
        several times, or (module, input) pairs: see prefetch()). In sync mode the rows of batch
        i+1 are read after iteration i's update (the same rows a pull in its forward would get);
        in async and ssp mode their staleness counts from that read, as for any pull of rows.

            for x, y in opt.pipeline(loader, lambda b: {model.users: b[0][:, 0], model.items: b[0][:, 1]}):
                opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()

        Batch k is iteration start + k (start: opt.clock at the first batch). When a step rolls the
        job back (sync: a server restored its checkpoint; StepStats.rolled_back_to) or the worker
        rejoins (StepStats.rejoined_at), the clock moves: `batches` that can be indexed (a list, a
        Dataset: len() and [k]) go on from batch opt.clock - start, so that a sync job recomputes
        the same iterations and ends as if never interrupted; an iterator cannot go back, so a
        roll-back raises RollbackError (start a new pipeline from batch opt.clock), and after a
        rejoin it goes on with its next batch.

        Raises:
            RollbackError: the job rolled back, and `batches` cannot be indexed or the iteration
                it went back to comes before this pipeline's first batch (named).
        """
        indexed = hasattr(batches, "__getitem__") and hasattr(batches, "__len__")
        it = None if indexed else iter(batches)
        start, k = self.clock, 0

        def at(index: int) -> tuple[bool, B | None]:
            if it is None:
                return (True, batches[index]) if index < len(batches) else (False, None)  # type: ignore[index, arg-type]
            try:
                return True, next(it)
            except StopIteration:
                return False, None

        ok, current = at(0)
        if not ok:
            return
        self.prefetch(lookups(current))  # type: ignore[arg-type]
        while True:
            more, following = at(k + 1)
            self._next_lookups = lookups(following) if more else None  # type: ignore[arg-type]
            moved = (self.rollbacks, self.rejoins)
            try:
                yield current  # type: ignore[misc]
            finally:
                self._next_lookups = None
            if (self.rollbacks, self.rejoins) == moved or (it is not None and self.rollbacks == moved[0]):
                k += 1  # (an iterator after a rejoin: its next batch)
            else:
                k = self.clock - start
                if it is not None or k < 0:
                    raise RollbackError(
                        f"opt.pipeline: the job rolled back to iteration {self.clock} (a server restored its checkpoint), "
                        + ("and this pipeline's batches cannot go back (an iterator): " if it is not None else
                           f"before this pipeline's first batch (iteration {start}): ")
                        + f"start a new pipeline from the batch of iteration {self.clock} (opt.clock), or give the "
                        "pipeline batches it can index (a list, a Dataset) to have it recompute by itself")
                more, following = at(k)
                if more:  # (the step that moved fetched no rows: fetch this batch's now)
                    self.prefetch(lookups(following))  # type: ignore[arg-type]
            if not more:
                return
            current = following

    def step(self, closure: Any = None, prefetch: Lookups | None = None) -> StepStats:  # type: ignore[override]
        """Push this step's gradients with the lr in effect and bring fresh weights into the model
        (see the class doc). A closure (torch's signature) is refused: the loss is computed once.
        prefetch: {module: its next forward's input}: those rows come back with the fresh weights
        in the same calls (see pipeline()), for the next forward to use; so do the rows of a
        prefetch() made since the last step (after this step's forward), and in a pipeline the next
        batch's.

        A bad id in the rows a step fetches ahead (InvalidRequestError, naming it), or lookups it
        cannot read (ConfigError: a collection's feature missing, a module not of this model), stop
        the step before it sends anything. The rows of the pipeline's next batch are then dropped,
        so opt.step() again pushes this step without them, and that batch's forward reads its rows
        itself (refusing the same input, for the loop to skip the batch); a step(prefetch=...) is
        taken again without prefetch= (or with good lookups).

        A step that raises otherwise (a push the servers refused: the memory budget, a non-finite
        gradient, ServerBusyError; a server unreachable) leaves the gradients in place, the rows'
        too, and what it was to fetch ahead: opt.step() again pushes them with the same clock (a
        shard that applied the step already acknowledges a duplicate, so each applies it once) and
        fetches the next batch's rows; opt.zero_grad() drops them instead. Where some shards had
        applied the step, dropping it spends its clock: the next step tells the other shards it is
        skipped, then pushes the next clock (see zero_grad), so no shard mistakes the next batch
        for the dropped step (before: acknowledged there as a duplicate, and lost).

        Raises:
            PsgradError: a server refused the push or became unreachable.
            WorkerStateError: the worker has left the job.
            ConfigError: a closure, a learning rate that is not a finite number >= 0, a parameter
                changed in place, or one the model converted or replaced since ps.optimizer(model)
                (model.double(), .half(), .to(device)).
        """
        if closure is not None:
            raise ConfigError("PSOptimizer.step() takes no closure: compute the loss, backward(), then step()")
        if self._left:
            raise WorkerStateError("this worker has left the job: step() after leave()/close()")
        self._check_attached()
        edited = self._edited()
        if edited is not None:
            raise ConfigError(
                f"parameter {edited!r} was changed in place after ps.optimizer(model) (load_state_dict, nn.init, "
                "or an in-place op): the servers hold the job's weights, and its next pull would overwrite the "
                "change. Load or initialize the weights before ps.optimizer(model) (the chief's model becomes "
                "the job's initial weights); opt.refresh() takes the job's weights back into the model"
            )
        clock = self.clock
        push_lr = self.push_lr()
        stats = StepStats(clock=clock, lr=self.lr if push_lr is None else push_lr)
        if self.overlap:
            assert self._pool is not None
            base = self._versions  # the weights this step's gradient was computed on
            self.flat.capture_buffers()  # before the background pull's buffers replace them
            try:
                self._finish_pending(stats)  # frees host_grad; installs the weights for the next step
            except EvictedError:  # the background exchange found this worker evicted
                stats.rejoined_at = self._rejoin()
                stats.versions = list(self._versions)
                return stats
            grad = self.flat.gather_grads()
            stats.d2h_s = self.flat.d2h_s
            self._pending = self._pool.submit(self._exchange, grad, clock, list(base), push_lr, None, self.flat.unused)
        else:
            if prefetch is None and self._next_lookups is not None and not isinstance(self._next_lookups, (Mapping, list)):
                self._next_lookups = list(self._next_lookups)  # (pairs from an iterator: the same for a step taken again)
            ahead = prefetch if prefetch is not None else self._next_lookups
            try:
                wanted = {**self.prefetched.deferred, **(self._lookup_ids(ahead) if ahead else {})}
            except Exception as exc:  # (nothing sent yet: the step can be taken again)
                if prefetch is None:  # the pipeline's next batch: a step again goes on without its rows
                    self._next_lookups = None  # (whatever refused them: a bad id, a feature missing, a module not of the model)
                    how = ("opt.step() again pushes this step without fetching them, and that batch's forward then "
                           "reads its rows itself (and refuses the same input: skip the batch there)")
                else:
                    how = "take the step again without prefetch= (or with valid lookups)"
                if not isinstance(exc, (InvalidRequestError, ConfigError)):
                    raise
                raise type(exc)(f"the next batch's rows, which this step fetches ahead (opt.pipeline, "
                                f"step(prefetch=...)): {exc}; this step pushed nothing: {how}") from None
            grad = self.flat.gather_grads()
            stats.d2h_s = self.flat.d2h_s
            reads = RowReads(read_ids(wanted), checked=True) if wanted else None
            try:
                done = self._exchange(grad, clock, self._versions, push_lr, reads, self.flat.unused)
            except RollbackError:
                stats.rolled_back_to = self._roll_back()
                self._rows_pushed()  # (the step returns, the clock moved: its gradient is dropped, the rows' too)
                stats.versions = list(self._versions)
                return stats
            except EvictedError:
                stats.rejoined_at = self._rejoin()
                self._rows_pushed()
                stats.versions = list(self._versions)
                return stats
            stats.wait_s = done.exchange_s
            self._record(done, stats)
            # rows fetched before this step miss its update: dropped; the ones it read are held
            self.prefetched.stepped(wanted, reads.ids if reads is not None else None, reads.rows if reads is not None else None)
        stats.versions = list(self._versions)
        self.clock = clock + 1
        return stats

    def _roll_back(self, attempts: int = 5) -> int:
        """Sync: a shard restored from a checkpoint is behind the job. Return every shard to the
        newest iteration all of them have (every worker that meets the refusal does the same;
        it is idempotent), pull its weights, and continue from it: the caller computes the
        iterations since then again. Returns that iteration.

        Raises:
            CheckpointError: no iteration common to every shard's checkpoints (named).
        """
        self.prefetched.reset()  # rows read before the roll-back
        for attempt in range(attempts):
            target = self.client.rollback()
            try:
                self._versions = self._pull(target)
            except RollbackError:  # another shard went back meanwhile
                if attempt == attempts - 1:
                    raise
                continue
            self.clock = target
            self.rollbacks += 1
            return target
        raise AssertionError("unreachable")

    def _rejoin(self) -> int:
        """The shards evicted this worker (no call of its arrived within its lease): join again,
        as a worker joining a running job does, pull the weights of the clock the shards give,
        and continue from it. Returns that clock."""
        self.prefetched.reset()
        self.clock = self.client.join(initial_weights=None)
        self._versions = self._pull(self.clock)
        self.rejoins += 1
        return self.clock

    def synchronize(self) -> StepStats | None:
        """Wait for a background exchange (overlap) and install its weights; returns its stats."""
        if self._pending is None:
            return None
        stats = StepStats(clock=self.clock - 1)
        self._finish_pending(stats)
        stats.versions = list(self._versions)
        return stats

    def refresh(self) -> list[int]:
        """Read the servers' latest weights into the model without a gate or lease (e.g. to
        evaluate after leave(), or to undo an in-place edit); returns their versions."""
        self.synchronize()
        self._check_attached()
        self._edited()
        return self._pull(self.clock, observe=True)

    def _check_attached(self) -> None:
        """Refuse a step or refresh once a parameter left the flat buffers (model.double(), ...):
        they would then push and pull weights the model no longer uses, training nothing."""
        detached = self.flat.detached()
        if detached is not None:
            raise ConfigError(
                f"{detached} after ps.optimizer(model) (model.double(), .half(), .to(...), or a new parameter): "
                "the model no longer uses the buffers the job's pushes and pulls go through, so steps would train "
                "nothing; convert the model before ps.optimizer(model) (mid-run: ps.close(), then "
                "ps.optimizer(model) on a new psgrad.connect(...))"
            )

    def _edited(self) -> str | None:
        """A parameter written in place since the job's weights were installed (or None); a
        same-host version the change was written over (a private copy of its pages now) is
        mapped afresh by the next pull."""
        edited = self.flat.edited_in_place()
        if edited is not None:
            self.client.forget_lent_versions()
        return edited

    def leave(self) -> None:
        if self._left:
            return
        try:
            self.synchronize()
            self.flat.own_weights()  # the model keeps the weights it has, in memory of its own
        finally:
            self._left = True
            for _, module in self.embeddings:  # forwards still read rows (evaluation), without a lease
                module.read_only()
            self.client.leave()

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.leave()
        finally:
            self._closed = True
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            if self.grouping is not None:
                self.grouping.remove()
            for _, module in self.embeddings:
                module.release(self.prefetched, "its job was closed (ps.close(), or the end of `with psgrad.connect(...)`)")
            self.client.close()
