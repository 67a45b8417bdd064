"""Rows fetched ahead of the forward that reads them: `opt.prefetch(...)` (every table of a batch in one
call per shard, whether its tables are one module or many) and a step's exchange that brings the next
batch's rows back with the fresh weights (`opt.step(prefetch=...)`, `opt.pipeline(...)`). A RowSource
in front of the worker's other one: a training forward that asks a table for exactly the ids that
were fetched for it gets those rows (once); any other read goes through. A table several forwards
read (one module registered under several names, as a two-tower model shares its item table, or a
collection's table that a module of its own reads too) is read once, for the union of their ids, and
each forward's ids are held apart, for that forward.

Rows are held for the forwards before the next step only: a step drops the rows fetched before it
that no forward used (they would miss its update: in sync mode that is no longer the job's state)
and holds the ones it read itself, after its update. A prefetch asked for while a step is pending
(a training forward read rows since the last step: the prefetch sits between the forward, or the
backward, and opt.step()) is not read then but carried by that step, as step(prefetch=...) is:
its rows come back with the step's fresh weights. Each held table keeps the versions its rows were
read at, which the forward's leaves keep, and the push of their gradients reports (the staleness
of a table counts from the read its gradient was computed on, not from a later one).

Without any of these, the model's own forward groups its tables' reads (GroupedForward): where the
psgrad embedding modules are called with inputs that are among the model's arguments (as passed,
or held in a list, tuple or dict of them), their rows are read at the start of the model's forward,
every table in one call per shard, and each module's forward is served from them; the bags of the
psgrad.EmbeddingBag modules among them are pooled there too, in one pass (and one backward), and
each module's forward returns its own. Where the inputs come from is learned from one training
forward, by identity, and learned again when rows read so go unused."""
from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from psgrad.core.rows import PulledRows
from psgrad.errors import ConfigError, InvalidRequestError
from psgrad.nn.collection import EmbeddingBagCollection
from psgrad.nn.embedding import EmbeddingBag, RowSource, SparseEmbedding, pool_ahead, pool_key


@dataclass
class PrefetchStats:
    """Since the start: served, the tables' reads (one forward's ids of one table) served from rows
    fetched ahead (by a prefetch, a step, or the model's forward at its start: GroupedForward);
    unused, the rows fetched ahead that no forward used (no forward asked that table for exactly
    those ids before the next step or prefetch replaced them); grouped, the model's
    forwards whose tables were read at their start, in one call per shard (GroupedForward); pooled,
    the EmbeddingBag forwards served bags pooled at the model's forward start, together with the
    other modules' (GroupedForward)."""

    served: int = 0
    unused: int = 0
    grouped: int = 0
    pooled: int = 0


# What a prefetch or a step reads: by table, each forward's unique ids (several where several
# forwards read one table), and the ids read: each table's union of them.
Wanted = Mapping[str, Sequence[torch.Tensor]]


def read_ids(wanted: Wanted) -> dict[str, torch.Tensor]:
    """The ids to read of each table `wanted` names: its forwards' unique ids, together (unique,
    sorted, int64; one forward's as they are)."""
    return {table: ids[0] if len(ids) == 1 else torch.unique(torch.cat(list(ids)), sorted=True)
            for table, ids in wanted.items() if len(ids)}


class Prefetched:
    """A RowSource that serves rows fetched ahead; everything else goes to `source`."""

    def __init__(self, source: RowSource) -> None:
        self._source = source
        # table -> [(one forward's ids, their rows, the versions they were read at)]
        self._held: dict[str, list[tuple[torch.Tensor, torch.Tensor, dict[int, int] | None]]] = {}
        self.stats = PrefetchStats()
        # Whether a training forward read rows since the last step (a step is pending), and the
        # lookups (table -> each forward's unique ids) a prefetch asked for meanwhile, for that step to read.
        self.pending = False
        self.deferred: dict[str, list[torch.Tensor]] = {}

    def hold(self, wanted: Wanted, ids: Mapping[str, torch.Tensor], rows: Mapping[str, torch.Tensor]) -> None:
        """Keep the rows fetched for `wanted` (by table, each forward's ids), which were read as `ids`
        (read_ids(wanted)) into `rows`, for the forwards that read them, with the versions they were
        read at (where `rows` is a PulledRows); rows held before and never read are dropped."""
        self.clear()
        versions = rows.versions if isinstance(rows, PulledRows) else {}
        self._held = {}
        for table, forwards in wanted.items():
            read, got = ids[table], rows[table]
            self._held[table] = [(mine, got if mine is read else got[torch.searchsorted(read, mine)], versions.get(table))
                                 for mine in forwards]

    def defer(self, wanted: Wanted) -> None:
        """A prefetch while a step is pending: the step reads these rows (replacing an earlier
        such prefetch), after its update."""
        self.deferred = {table: list(ids) for table, ids in wanted.items()}

    def stepped(self, wanted: Wanted | None = None, ids: Mapping[str, torch.Tensor] | None = None,
                rows: Mapping[str, torch.Tensor] | None = None) -> None:
        """A step was taken: drop the rows held from before it (and what was deferred to it, which
        it carried), and hold the rows it read (`wanted`, read as `ids` into `rows`), if any."""
        self.clear()
        if wanted:
            assert ids is not None and rows is not None
            self.hold(wanted, ids, rows)
        self.pending, self.deferred = False, {}

    def reset(self) -> None:
        """The clock moved without a step of this worker's (a roll-back, a rejoin): forget every
        row fetched ahead and what was deferred."""
        self.stepped()

    @property
    def idle(self) -> bool:
        """Whether nothing is held, deferred or pending: no forward read rows since the last step,
        and no rows wait for one."""
        return not (self.pending or self._held or self.deferred)

    def clear(self) -> None:
        self.stats.unused += sum(int(ids.numel()) for held in self._held.values() for ids, _, _ in held)
        self._held = {}

    def updated_rows(self, table: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The servers' rows of `table` updated at least once (read past what is held)."""
        return self._source.updated_rows(table)

    def pull_tables(self, lookups: Mapping[str, torch.Tensor], observe: bool, checked: bool = False) -> PulledRows:
        if observe:
            got = self._source.pull_tables(lookups, observe, checked)
            return got if isinstance(got, PulledRows) else PulledRows(got)
        self.pending = True
        out = PulledRows()
        rest: dict[str, torch.Tensor] = {}
        for table, ids in lookups.items():
            held = _take(self._held, table, ids, lambda entry: entry[0])
            if held is not None:  # (rows held for other ids stay, for the forward that asks for them)
                out[table] = held[1]
                if held[2] is not None:
                    out.versions[table] = held[2]
                self.stats.served += 1
            else:
                rest[table] = ids
            _take(self.deferred, table, ids, lambda entry: entry)  # (read now: the step need not read it again)
        if rest:
            got = self._source.pull_tables(rest, observe, checked)
            out.update(got)
            if isinstance(got, PulledRows):  # (and the blocks it wrote them in: a forward group takes its whole)
                out.versions.update(got.versions)
                out.blocks.update(got.blocks)
        return out


T = TypeVar("T")


def _take(by_table: dict[str, list[T]], table: str, ids: torch.Tensor, key: Callable[[T], torch.Tensor]) -> T | None:
    """Remove and return the first entry of `table` in `by_table` whose key is exactly `ids`; None
    where there is none."""
    entries = by_table.get(table, [])
    for k, entry in enumerate(entries):
        if _same(key(entry), ids):
            del entries[k]
            if not entries:
                del by_table[table]
            return entry
    return None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.shape == b.shape and torch.equal(a, b))


# ---------------------------------------------------------------------------------------------
# A training forward's reads, grouped at its start

# Where an input lies among a forward's arguments: the argument (an int: its position; a str: its
# keyword), then the keys or indexes down the lists, tuples and dicts that hold it.
Path = tuple[Any, ...]
# How deep into the arguments' lists, tuples and dicts, and how many objects, a forward that learns
# looks (a batch is a handful of tensors, maybe in a dict or a list of pairs: far less than these).
_MAX_DEPTH = 4
_MAX_OBJECTS = 4096


Layout = tuple[tuple[int, ...], tuple[int, ...], int]  # a tensor's size, stride and storage offset
NO_OFFSETS: Path = ("no offsets",)  # an EmbeddingBag called without offsets (2-D ids: a bag per row)


def _layout(t: torch.Tensor) -> Layout:
    return tuple(t.shape), tuple(t.stride()), int(t.storage_offset())


def _span(layout: Layout) -> tuple[int, int]:
    """The first and last storage elements a non-empty tensor of this layout reaches."""
    size, stride, offset = layout
    low = offset + sum((n - 1) * st for n, st in zip(size, stride) if st < 0)
    high = offset + sum((n - 1) * st for n, st in zip(size, stride) if st > 0)
    return low, high


@dataclass(frozen=True)
class _View:
    """The last step of a path to a view of an argument's tensor (`x[:, f]`, `x[f]`, `x.view(...)`):
    the view's layout in that tensor's storage, taken of a tensor laid out as the learned one was
    (another layout, say a smaller last batch: TypeError, and the forward learns again)."""

    base: Layout
    view: Layout

    def of(self, t: Any) -> torch.Tensor:
        if not isinstance(t, torch.Tensor) or _layout(t) != self.base:
            raise TypeError("not a tensor of the learned layout")
        try:
            return t.as_strided(*self.view)
        except RuntimeError as exc:  # (a view outside what this storage holds)
            raise TypeError(str(exc)) from None


class _Paths:
    """Where objects lie among a forward's arguments: by identity, each argument and what the lists,
    tuples and dicts among them hold (the first path of an object found at several); and the
    tensors among them by their storage, for a view one of them shares it with."""

    def __init__(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        self.by_id: dict[int, Path] = {}
        self.by_storage: dict[int, tuple[Path, torch.Tensor]] = {}
        todo: list[tuple[Path, Any]] = [((k,), v) for k, v in kwargs.items()][::-1] + [((k,), v) for k, v in enumerate(args)][::-1]
        while todo and len(self.by_id) < _MAX_OBJECTS:
            path, obj = todo.pop()
            self.by_id.setdefault(id(obj), path)
            if isinstance(obj, torch.Tensor):
                self.by_storage.setdefault(obj.untyped_storage().data_ptr(), (path, obj))
            elif len(path) <= _MAX_DEPTH and isinstance(obj, (list, tuple)):
                todo.extend(((*path, k), v) for k, v in reversed(list(enumerate(obj))))
            elif len(path) <= _MAX_DEPTH and isinstance(obj, Mapping):
                todo.extend(((*path, k), v) for k, v in reversed(list(obj.items())))

    def of(self, obj: Any) -> Path | None:
        """The path of `obj`, or of the argument's tensor it is a view of; None: not among them."""
        path = self.by_id.get(id(obj))
        if path is not None or not isinstance(obj, torch.Tensor) or obj.numel() == 0:
            return path
        found = self.by_storage.get(obj.untyped_storage().data_ptr())
        if found is None:
            return None
        base_path, base = found
        view = _layout(obj)
        if base.dtype != obj.dtype or base.numel() == 0 or not _within(_span(view), _span(_layout(base))):
            return None  # (a view as another dtype, or of storage past the argument's own elements)
        return (*base_path, _View(_layout(base), view))


def _within(inner: tuple[int, int], outer: tuple[int, int]) -> bool:
    return outer[0] <= inner[0] and inner[1] <= outer[1]


def _resolve(path: Path, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """The object at `path` among these arguments.

    Raises:
        LookupError, TypeError: there is none (the arguments have another shape).
    """
    head, *rest = path
    obj = args[head] if isinstance(head, int) else kwargs[head]
    for key in rest:
        obj = key.of(obj) if isinstance(key, _View) else obj[key]
    return obj


class GroupedForward:
    """Reads the rows of every psgrad embedding module a training forward of `model` calls with one
    of the model's own arguments (or an object a list, tuple or dict among them holds), at the
    start of that forward and in one call per shard (`read`: the optimizer's prefetch), where each
    module would otherwise read its own in its forward. The modules' forwards are then served from
    those rows, exactly as from a prefetch with no step pending (the same rows, read moments
    earlier: a sync job computes bit for bit what it computes without this).

    Where each module's input comes from is learned from the first training forward, by identity
    (the tensor a module gets is the one the model got), or as a view of an argument's tensor
    (`x[:, f]`: the same layout in its storage, taken of the next batch's tensor where that is
    laid out alike); modules fed something else the forward computed (`ids % n`) read their own
    rows, as before. When rows read so go unused (the model routed another batch differently),
    the next forward learns again; where it learns the same routes and their rows go unused again
    (a forward that changes its inputs in place before its modules read them), it stops reading
    ahead for good. Forwards that `may_read` says no to (a step pending, rows already fetched
    ahead by a prefetch or the pipeline, evaluation under torch.no_grad(), a worker that left)
    read nothing ahead. A refused input (a bad id, a missing feature) is left to its module's
    forward, which raises the error it always raised.

    EmbeddingBag modules whose offsets lie among the arguments too (or that take 2-D ids without
    offsets), each called once by the forward, have their bags pooled right after the read, all in
    one pass (pool_ahead: one autograd node, its backward one pass); each module's forward with
    that input and those offsets, unchanged, returns its own output, and an output the loss does
    not reach gives its rows no gradient, as before. Bags pooled for a forward that does not come
    count as unused rows."""

    def __init__(self, model: nn.Module, read: Callable[[list[tuple[nn.Module, Any]]], None],
                 may_read: Callable[[], bool], stats: PrefetchStats,
                 read_rows: Callable[[dict[str, torch.Tensor]], Mapping[str, torch.Tensor]] | None = None) -> None:
        self._modules = [m for m in model.modules() if isinstance(m, (SparseEmbedding, EmbeddingBagCollection))]
        self._read, self._may_read, self._stats = read, may_read, stats
        # (what reads rows of ids checked against their tables' ranges now, as a step pending: where
        # every module of the routes has its bags pooled, in one group, the pooling reads them)
        self._read_rows = read_rows
        self._routes: list[tuple[nn.Module, Path]] | None = None  # None: to learn at the next forward
        self._learning: _Paths | None = None  # the paths of the forward that learns
        self._seen: list[tuple[nn.Module, Path | None, Path | None]] = []
        # Per route, where an EmbeddingBag's offsets lie (NO_OFFSETS: called without; None: not
        # among the arguments, or not a module whose bags are pooled ahead)
        self._offsets: list[Path | None] = []
        self._pooled: list[EmbeddingBag] = []  # the modules whose bags this forward pooled at its start
        self._watching: list[RemovableHandle] = []
        self._depth = 0
        self._unused = 0  # stats.unused after the last grouped read
        self._checking = False  # a grouped read was made: the next forward looks whether its rows were used
        self._failed: list[tuple[nn.Module, Path]] | None = None  # routes whose rows went unused, learning again
        self._strikes = 0  # routes learned again equal to those that failed, since a grouped read was used whole
        self._handles = [model.register_forward_pre_hook(_Hook(self, "start"), with_kwargs=True),
                         model.register_forward_hook(_Hook(self, "end"), with_kwargs=True, always_call=True)]

    @property
    def routes(self) -> list[tuple[nn.Module, Path]] | None:
        """The modules whose rows a forward reads at its start, each with where its input lies
        among the forward's arguments; None: not learned (yet, or again)."""
        return None if self._routes is None else list(self._routes)

    def start(self, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        self._depth += 1
        if self._depth > 1:  # (the model's forward calling the model)
            return
        self._unwatch()
        if not self._may_read():
            return
        if self._checking:  # were the rows the last grouped read brought used?
            self._checking = False
            if self._stats.unused > self._unused:  # no: learn again
                self._failed, self._routes, self._unused = self._routes, None, self._stats.unused
            else:
                self._strikes = 0
        lookups = []
        if self._routes:
            try:
                lookups = [(m, _resolve(path, args, kwargs)) for m, path in self._routes]
            except (LookupError, TypeError):  # arguments of another shape: learn from this forward
                self._routes = None
        if self._routes is None:
            self._learning, self._seen = _Paths(args, kwargs), []
            self._watching = [m.register_forward_pre_hook(_Hook(self, "seen"), with_kwargs=True) for m in self._modules]
            return
        if not lookups:
            return
        calls = self._calls(lookups, args, kwargs)
        keys = [pool_key(*call) for call in calls] if self._read_rows is not None and len(calls) == len(lookups) else []
        if keys and None not in keys and len(set(keys)) == 1:
            # (every module's bags pooled together, in one group: the pooling reads their rows, in
            # one call per shard, where a read ahead of it and a second look at what it held cost
            # per table)
            try:
                self._pooled = pool_ahead(calls, self._read_rows, keys)
            except (InvalidRequestError, ConfigError):
                return  # (each module's forward reads its own rows, and raises what is wrong with its input)
            self._counted()
            self._stats.served += len(self._pooled)  # (their reads served from the rows read at the start, as held ones)
            return
        try:
            self._read(lookups)
        except (InvalidRequestError, ConfigError):
            return  # (each module's forward reads its own rows, and raises what is wrong with its input)
        self._counted()
        if len(calls) > 1:
            try:
                self._pooled = pool_ahead(calls)
            except (InvalidRequestError, ConfigError):
                self._pooled = []  # (each module's forward pools its own bags, and says what is wrong with them)

    def _counted(self) -> None:
        """A grouped read was made: the next forward looks whether its rows were used."""
        self._unused, self._checking = self._stats.unused, True
        self._stats.grouped += 1

    def _calls(self, lookups: list[tuple[nn.Module, Any]], args: tuple[Any, ...],
               kwargs: Mapping[str, Any]) -> list[tuple[EmbeddingBag, Any, Any]]:
        """The (module, input, offsets) of the EmbeddingBag modules (of `lookups`, the routes'
        modules and inputs) whose offsets are among the arguments too: those whose bags are pooled
        at the forward's start, in one pass (pool_ahead), their forwards then returning them."""
        calls: list[tuple[EmbeddingBag, Any, Any]] = []
        for (m, input), offsets in zip(lookups, self._offsets):
            if offsets is not None and isinstance(m, EmbeddingBag):
                try:
                    calls.append((m, input, None if offsets == NO_OFFSETS else _resolve(offsets, args, kwargs)))
                except (LookupError, TypeError):
                    continue
        return calls

    def seen(self, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        """A watched module's forward, while the model's forward learns: where its input lies (and
        an EmbeddingBag's offsets)."""
        if self._learning is None:
            return
        first = args[0] if args else next(iter(kwargs.values()), None)
        offsets: Path | None = None
        if isinstance(module, EmbeddingBag) and len(args) + len(kwargs) <= 2 and "per_sample_weights" not in kwargs:
            given = args[1] if len(args) > 1 else kwargs.get("offsets")
            offsets = NO_OFFSETS if given is None else self._learning.of(given)
        self._seen.append((module, self._learning.of(first) if first is not None else None, offsets))

    def end(self, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth:
            return
        self._drop_pooled()
        if self._learning is None:
            return
        self._unwatch()
        seen = [(m, path, offsets) for m, path, offsets in self._seen if path is not None]
        routes = [(m, path) for m, path, _ in seen]
        if self._failed is not None and routes == self._failed:  # the same routes as those whose rows went unused
            self._strikes += 1
        self._failed = None
        # (one module reading alone gains nothing; and routes that failed twice in a row without a
        # grouped read used whole between, a forward that changes its inputs before its modules read
        # them, say in place, would fail again: given up for good)
        self._routes = routes if len(routes) > 1 and self._strikes < 2 else []
        # (a module called more than once pools its own: which call a pooling would serve is not known)
        once = {id(m) for m, _ in routes if sum(r is m for r, _ in routes) == 1}
        self._offsets = [offsets if id(m) in once else None for m, _, offsets in seen] if self._routes else []
        self._learning, self._seen = None, []

    def _drop_pooled(self) -> None:
        """The forward is over: bags pooled at its start that no forward of their module took are
        dropped, their rows counted as unused (the next forward learns again)."""
        for m in self._pooled:
            unused = m.take_ahead()
            if unused is None:
                self._stats.pooled += 1
            else:
                self._stats.unused += unused
        self._pooled = []

    def _unwatch(self) -> None:
        for handle in self._watching:
            handle.remove()
        self._watching = []

    def remove(self) -> None:
        """Take the hooks off the model and its modules."""
        self._unwatch()
        self._drop_pooled()
        for handle in self._handles:
            handle.remove()
        self._handles = []


class _Hook:
    """A forward hook of a GroupedForward (on the model, or on a module while it learns). Pickled or
    copied with the model (torch.save(model), copy.deepcopy) it becomes one that does nothing:
    the copy is not bound to the job."""

    def __init__(self, owner: GroupedForward, what: str) -> None:
        self._owner = weakref.ref(owner)
        self._what = what

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *output: Any) -> None:
        owner = self._owner()
        if owner is not None:
            getattr(owner, self._what)(module, args, kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Inert, ())


class _Inert:
    """What a GroupedForward's hook becomes in a copy of the model: nothing."""

    def __call__(self, *args: Any) -> None:
        return None
