"""Embedding tables whose rows live on the servers: psgrad.Embedding and psgrad.EmbeddingBag, drop-ins
for torch.nn.Embedding and torch.nn.EmbeddingBag. The module holds no weight: `ps.optimizer(model)`
binds each one to the job as a sparse table (named by its place in the model), a forward pulls
only the rows of the batch's unique ids (one call per shard that holds some, for every table a
prefetch or a collection names), and the optimizer's step pushes their gradients, coalesced per id,
in the same call as the dense gradient of the same step. Rows
start as N(0, std²) draws made on the servers from (seed, table, row id), so an untouched row costs
its server 8 bytes of index, and every row is the same on every server after every restart.

What torch's modules do that these do too: torch's options with torch's semantics (padding_idx,
scale_grad_by_freq, sparse, and for bags include_last_offset and mode "max"; max_norm is refused,
naming why), `state_dict()`/`load_state_dict()` (a table's entries: the rows updated at least once
and how to make the others, the layout `psgrad export` writes; torch's own, `weight`, loads too, as
every row), pickling and `copy.deepcopy` (a
copy is unbound: the rows stay on the servers), dtype conversions (model.half(), .bfloat16(),
.double(), .to(dtype): forwards return that dtype, the rows and their gradients stay float32), and
clip_grad_norm_, whose norm covers the rows' gradients too. A module that loaded a state without being bound serves forwards from it (initial
rows for the ids the state does not list): a trained model evaluates with no servers."""
from __future__ import annotations

import operator
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

import torch
from torch import nn
from torch.nn import functional as F

from psgrad.core import rows
from psgrad.core.codecs import joined
from psgrad.core.sharding import check_lifetime
from psgrad.errors import ConfigError, InvalidRequestError, WorkerStateError
from psgrad.nn import lookups

EMBEDDING_BAG_MODES = ("sum", "mean", "max")
# A table's entries in a state_dict, after the module's prefix (the layout of `psgrad export`'s
# sparse tables, plus the table's name): the rows updated at least once (ids [n] int64, sorted;
# rows [n, dim] float32), how to make the others (init: [num_embeddings, dim, seed] int64; init_std:
# float64), and table: the name their initial rows are drawn under (UTF-8 bytes as uint8; optional
# when loading, where the module's place in the model names it).
STATE_KEYS = ("ids", "rows", "init", "init_std", "table")
REQUIRED_STATE_KEYS = STATE_KEYS[:4]
E = TypeVar("E", bound="SparseEmbedding")


class RowSource(Protocol):
    """Where a bound table's rows come from (the job's shards; see ParameterClient.pull_tables)."""

    def pull_tables(self, lookups: Mapping[str, torch.Tensor], observe: bool,
                    checked: bool = False) -> dict[str, torch.Tensor]:
        """Rows [len(ids), dim] (float32, CPU) of row ids (unique, int64, CPU), by table: one call
        per shard for all of them. A job's sources return a rows.PulledRows, which also says the
        versions the rows were read at (what the push of their gradients reports as its base).
        observe: a read-only read (a forward with autograd off, or after the worker left).
        checked: the caller checked the ids against their tables' ranges (the source need not)."""

    def updated_rows(self, table: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [n] int64 in order, rows [n, dim] float32) of every row of `table` updated at least
        once (read-only)."""


class RowGradient(NamedTuple):
    """A table's row gradients for a push: the ids (unique, sorted, int64), their gradients
    coalesced per id ([n, dim] float32, CPU), and bases: the versions the rows were read at, per
    shard the oldest read a gradient came from ({shard: version}; empty where the source did not
    say)."""

    ids: torch.Tensor
    grads: torch.Tensor
    bases: dict[int, int]


class Touched:
    """The rows one training forward of a table read: their ids, the versions they were read at by
    shard (None: not known), and their leaf, which records their gradient. The leaf is held weakly
    until a backward gives it a gradient, then until the step takes it (or zero_grad() drops it):
    a forward no backward reaches (an evaluation with autograd on, its output gone) keeps nothing
    in the worker, while the graph of one whose backward is still to come keeps its leaf alive.
    What tells it a backward came: a hook on the leaf, run once its gradient is accumulated (rows
    several modules read together are a GroupRows instead, told by the pooling's backward: a hook
    costs ~10 us a leaf to register)."""

    __slots__ = ("ids", "versions", "_ref", "_held")

    def __init__(self, ids: torch.Tensor, leaf: torch.Tensor, versions: Mapping[int, int] | None,
                 kept: bool = False) -> None:
        self.ids, self.versions = ids, None if versions is None else dict(versions)
        self._ref = weakref.ref(leaf)
        self._held: torch.Tensor | None = leaf if kept else None
        if not kept:
            leaf.register_post_accumulate_grad_hook(self._keep)

    def _keep(self, leaf: torch.Tensor) -> None:
        self._held = leaf

    def leaf(self) -> torch.Tensor | None:
        return self._held if self._held is not None else self._ref()

    def gradient(self) -> torch.Tensor | None:
        leaf = self.leaf()
        return None if leaf is None else leaf.grad

    def drop_gradient(self) -> None:
        """zero_grad(): the leaf's gradient is dropped (a backward still to come gives it anew)."""
        leaf = self.leaf()
        if leaf is not None:
            leaf.grad = None
        self._held = None

    def release(self) -> None:
        self._held = None

    def gradient_leaf(self) -> torch.Tensor | None:
        """A tensor whose .grad is the rows' gradient (the leaf), for clip_grad_norm_ to measure
        and scale in place; None: no gradient."""
        leaf = self.leaf()
        return leaf if leaf is not None and leaf.grad is not None else None


class GroupRows:
    """The rows of several tables one forward read together (pool_ahead: one read, one pooling), as
    one leaf, every table's rows one after another, which records their gradient in one tensor:
    one gradient accumulated for the group where a leaf per table takes one each. Each table's
    part of it is a RowsPart, which its module keeps as it keeps a Touched. The leaf is held
    weakly until a backward gives it a gradient (as a Touched's), then until no part has one."""

    __slots__ = ("_ref", "_held", "reached", "sizes", "_views")

    def __init__(self, leaf: torch.Tensor, sizes: Sequence[int]) -> None:
        self._ref = weakref.ref(leaf)
        self._held: torch.Tensor | None = None
        self.sizes = list(sizes)  # each table's rows, one after another
        self.reached = [False] * len(sizes)  # per table: whether a backward gave its rows a gradient
        self._views: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None  # (the gradient, its tables' parts)

    def hold(self, reached: Sequence[bool]) -> None:
        """A backward gives the leaf a gradient, the tables' whose output it reached (called by it,
        before the gradient is accumulated, while its graph still holds the leaf)."""
        self._held = self._ref()
        self.reached = [a or b for a, b in zip(self.reached, reached)]

    def leaf(self) -> torch.Tensor | None:
        return self._held if self._held is not None else self._ref()

    def gradient(self, table: int) -> torch.Tensor | None:
        """Table `table`'s rows' gradient (a view of the group's), or None: it has none."""
        if not self.reached[table]:
            return None
        leaf = self.leaf()
        grad = None if leaf is None else leaf.grad
        if grad is None:
            return None
        views = self._views
        if views is None or views[0] is not grad:  # (every table's view at once: one split)
            views = self._views = (grad, grad.split_with_sizes(self.sizes))
        return views[1][table]

    def drop(self, table: int) -> None:
        """zero_grad() of one table: its rows' gradient is gone (a backward still to come gives
        them anew, into zeros, as torch's zero_grad leaves a weight's); the others' stay."""
        grad = self.gradient(table)
        self.reached[table] = False
        if grad is None:
            return
        if any(self.reached):
            grad.zero_()
        else:
            leaf = self.leaf()
            assert leaf is not None
            leaf.grad, self._held, self._views = None, None, None


class StepRows(NamedTuple):
    """A step's row gradients (step_rows): by table (ids, grads), with the forward groups whose
    gradient is whole in `gradients.blocks`; each table's base versions ({shard: version}); and the
    tables no forward's backward reached (not used in the step)."""

    gradients: rows.TableRows
    bases: dict[str, dict[int, int]]
    unused: list[str]


def step_rows(modules: Sequence[tuple[str, SparseEmbedding]]) -> StepRows:
    """The row gradients a step pushes of `modules` ((table, module) in model order), as each
    module's row_gradients() gives them. Where consecutive modules are a forward group whole (each
    module one part of one GroupRows, the group's parts in order, every part reached and holding
    ids, no padding row to leave out), their gradients are the group's parts and the group's
    gradient is their block (TableRows.blocks): the push takes it whole, and no module's gradient
    is looked at on its own."""
    out = StepRows(rows.TableRows(), {}, [])
    k = 0
    while k < len(modules):
        whole = _whole_group(modules, k)
        if whole is not None:
            grad, parts, sizes = whole
            names = tuple(name for name, _ in modules[k:k + len(parts)])
            for name, part, values in zip(names, parts, grad.split_with_sizes(sizes)):
                out.gradients[name] = (part.ids, values)
                out.bases[name] = part.versions or {}  # (rows.oldest of one read: the part's own copy, read only)
            out.gradients.blocks[names] = grad
            k += len(parts)
            continue
        name, module = modules[k]
        found = module.row_gradients()
        if found is not None:  # (pushed with the versions its rows were read at: their staleness)
            out.gradients[name], out.bases[name] = (found.ids, found.grads), found.bases
        elif not module.reached():  # no forward of it got a backward: a dense twin's .grad None, no step counted
            out.unused.append(name)
        k += 1
    return out


def _whole_group(modules: Sequence[tuple[str, SparseEmbedding]],
                 k: int) -> tuple[torch.Tensor, list[RowsPart], list[int]] | None:
    """(the group's gradient, its parts, their rows' counts) where modules[k:] begin with a forward
    group whole (see step_rows); else None."""
    touched = modules[k][1]._touched
    first = touched[0] if len(touched) == 1 else None
    if not isinstance(first, RowsPart) or first._table != 0 or first._group is None:
        return None
    group = first._group
    count = len(group.reached)
    if count < 2 or k + count > len(modules) or not all(group.reached):
        return None
    parts = [first]
    for _, module in modules[k + 1:k + count]:
        touched = module._touched
        part = touched[0] if len(touched) == 1 else None
        if (not isinstance(part, RowsPart) or part._group is not group or part._table != len(parts)
                or getattr(module, "padding_idx", None) is not None):
            return None
        parts.append(part)
    leaf = group.leaf()
    grad = None if leaf is None else leaf.grad
    if (grad is None or getattr(modules[k][1], "padding_idx", None) is not None or grad.requires_grad
            or not grad.is_cpu or grad.dtype != torch.float32 or not grad.is_contiguous()
            or not all(group.sizes)):
        return None
    return grad, parts, group.sizes


class RowsPart:
    """One table's rows in a GroupRows: what a Touched is for rows read on their own (the ids, the
    versions they were read at by shard, their gradient), its gradient the table's rows of the
    group's, a view of it."""

    __slots__ = ("ids", "versions", "_group", "_table")

    def __init__(self, group: GroupRows, table: int, ids: torch.Tensor, versions: Mapping[int, int] | None) -> None:
        self.ids, self.versions = ids, None if versions is None else dict(versions)
        self._group: GroupRows | None = group
        self._table = table

    def leaf(self) -> torch.Tensor | None:
        return None if self._group is None else self._group.leaf()

    def gradient(self) -> torch.Tensor | None:
        return None if self._group is None else self._group.gradient(self._table)

    def gradient_leaf(self) -> torch.Tensor | None:
        """A stand-in whose .grad is this table's gradient, the group's in place (see Touched)."""
        grad = self.gradient()
        if grad is None:
            return None
        stand_in = torch.empty_strided(grad.shape, (0, 0))  # (one element of memory, the gradient's shape)
        stand_in.grad = grad
        return stand_in

    def drop_gradient(self) -> None:
        if self._group is not None:
            self._group.drop(self._table)

    def release(self) -> None:
        self._group = None


class SparseEmbedding(nn.Module):
    """What psgrad.Embedding and psgrad.EmbeddingBag share: the table's shape and initialisation,
    torch's options, the binding to a job, the forward's pull, the rows a backward gave gradients
    to, and the table's state (state_dict, load_state_dict, copies).

    A forward with autograd on (torch.is_grad_enabled(), in train() or eval() mode alike, as for
    torch's modules) is a training forward: its rows take gradients unless the table is frozen
    (requires_grad_(False), or from_pretrained(freeze=True)), and it may be served rows fetched
    ahead (opt.prefetch, the pipeline) or a row cache's. One under torch.no_grad() or
    torch.inference_mode(), or after the worker left its job, is a read-only read: no gradients,
    and rows read now from the servers. Rows a training forward touched keep their gradients until
    the step pushes them; zero_grad() (the module's, a collection's, or the optimizer's) drops them.

    A module is in one of four states: bound (ps.optimizer(model) bound it: forwards pull rows from
    the job, state_dict() reads the rows updated at least once from its servers), fresh (never
    bound, or ready to be bound again: forwards are refused, state_dict() is the table as it
    starts), loaded (unbound, holding rows load_state_dict() gave it: forwards serve them, read-only)
    and lost (a copy of a bound module, or one whose job was closed: the rows are on the servers,
    not here, so forwards and state_dict() are refused, naming where to get them)."""

    # The name its initial rows are drawn under where it is not self.table: a loaded state's `table`
    # entry (the name in the job that wrote it), kept when a job binds the module under another name
    # (its place in this model: a wrapper's `module.` prefix added or stripped), so the rows the
    # state does not list start as they did there. None: its table's own (a fresh module, a state
    # without the entry). A class default: modules pickled by an older psgrad have none.
    drawn_as: str | None = None
    # The dtype its forwards return: the module's, as model.double() / .half() / .bfloat16() /
    # .to(dtype) convert torch's tables (see _apply). The rows stay float32 (the servers', the
    # pooling's); the output is cast, and its gradient cast back to float32 for the push.
    # A class default: modules pickled by an older psgrad have none.
    dtype: torch.dtype = torch.float32
    # The ids' dtypes a forward takes, as torch's module takes them (and what a refusal says).
    ID_DTYPES: tuple[torch.dtype, ...] = (torch.int64, torch.int32)
    ID_DTYPES_TAKEN = "int64 or int32, as torch.nn.Embedding takes; convert others with ids.long()"

    def __init__(self, num_embeddings: int | None, embedding_dim: int, std: float = 1.0, seed: int = 0, *,
                 max_norm: float | None = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                 sparse: bool = False, min_count: int = 0, ttl: int = 0, evict: bool = False) -> None:
        super().__init__()
        check_lifetime(min_count, ttl)
        # The rows' lifetime on the servers (docs/guide/embeddings.md): an id's updates are applied
        # once it was seen in min_count updates; a row no update touched in ttl updates of its table
        # is dropped; evict: at the servers' memory budget the least recently updated rows are
        # dropped instead of refusing the push. A dropped row reads as new again.
        self.min_count, self.ttl, self.evict = min_count, ttl, bool(evict)
        if num_embeddings is None:  # a dynamic table: any int64 id (core/rows.py), stored as 0
            num_embeddings = rows.DYNAMIC
        elif not (isinstance(num_embeddings, int) and 1 <= num_embeddings < 2**63):
            raise ConfigError(f"num_embeddings must be an integer in [1, 2**63), or None for a dynamic table (any int64 "
                              f"id), got {num_embeddings!r}")
        if not (isinstance(embedding_dim, int) and embedding_dim >= 1):
            raise ConfigError(f"embedding_dim must be an integer >= 1, got {embedding_dim!r}")
        if not (std == std and 0 <= std < float("inf")):
            raise ConfigError(f"std must be a finite number >= 0, got {std!r}")
        try:  # (an integer of any kind: a numpy int too; a float would be truncated)
            seed = operator.index(seed)
        except TypeError:
            raise ConfigError(f"seed must be an integer in [0, 2**63), got {seed!r}") from None
        if not 0 <= seed < 2**63:  # (the job's spec and the state_dict carry it as a 64-bit integer)
            raise ConfigError(f"seed must be an integer in [0, 2**63), got {seed!r}")
        if max_norm is not None:
            raise ConfigError(
                f"max_norm={max_norm!r} is not supported by psgrad embeddings: torch renormalizes each row a forward "
                "looks up in place, in the weight, and these rows live on the servers, which a forward does not write. "
                "Leave max_norm out, and bound what the model sees in its forward instead (out * (max_norm / "
                "out.norm(dim=-1, keepdim=True)).clamp(max=1)), or bound the updates with psgrad.clip_grad_norm_"
            )
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.std, self.seed = float(std), int(seed)
        # torch's options: max_norm is refused above (norm_type is only read with it, as in torch);
        # sparse changes nothing, the gradients pushed being per row always.
        self.max_norm: float | None = None
        self.norm_type = float(norm_type)
        self.scale_grad_by_freq, self.sparse = bool(scale_grad_by_freq), bool(sparse)
        self.table: str | None = None  # its name in the job, once bound (or in the state it loaded)
        self._source: RowSource | None = None
        self._observe = False  # after the worker left: read-only pulls
        self._touched: list[Touched | RowsPart] = []  # the rows of the training forwards since the last step
        self._loaded: tuple[torch.Tensor, torch.Tensor] | None = None  # (ids, rows) a state gave an unbound module
        # requires_grad_(False), from_pretrained(freeze=True): the rows take no gradient, the table does not move
        self.frozen = False
        self._lost: str | None = None  # why an unbound module's rows are not here (a copy, a closed job)
        # the last input's unique ids: (the input, its version counter, unique ids, each id's index)
        self._last_unique: tuple[weakref.ref[torch.Tensor], int, torch.Tensor, torch.Tensor] | None = None

    @property
    def dynamic(self) -> bool:
        """Whether the table takes any int64 id (num_embeddings=None), rows stored as they are updated."""
        return self.num_embeddings == rows.DYNAMIC

    @property
    def nbytes(self) -> int:
        """The whole table's bytes in float32 (what replicating it would cost every worker; 0 for a
        dynamic table, which has no whole)."""
        return self.num_embeddings * self.embedding_dim * 4

    def extra_repr(self) -> str:
        if self._source is not None:
            where = f", table={self.table!r}"
        elif self._loaded is not None:
            where = f", table={self.table!r}, {self._loaded[0].numel()} rows loaded"
        else:
            where = ", unbound"
        # torch's options as torch's repr shows them (a bag's mode always, padding_idx where set), then psgrad's
        torch_options = f", mode={self.mode!r}" if isinstance(self, EmbeddingBag) else ""
        padding_idx = getattr(self, "padding_idx", None)
        torch_options += f", padding_idx={padding_idx}" if padding_idx is not None else ""
        options = "".join(f", {name}=True" for name in ("scale_grad_by_freq", "sparse") if getattr(self, name))
        size = "None (dynamic)" if self.dynamic else str(self.num_embeddings)
        return f"{size}, {self.embedding_dim}{torch_options}, std={self.std:g}{options}{where}"

    def _padding_index(self, padding_idx: int | None) -> int | None:
        """torch's padding_idx, checked and made non-negative; a dynamic table's is an id as it is
        (any int64 id but the two reserved: there is no end to count a negative one from, so -1
        pads id -1).

        Raises:
            ConfigError: not an integer; outside [-num_embeddings, num_embeddings); for a dynamic
                table, not an id it can hold.
        """
        if padding_idx is not None:  # (an int, or one of another integer type: numpy's)
            if isinstance(padding_idx, bool) or not hasattr(type(padding_idx), "__index__"):
                raise ConfigError(f"padding_idx must be an integer (a row id) or None, got {padding_idx!r}")
            padding_idx = operator.index(padding_idx)
        if self.dynamic:  # any id: no wrap-around from the end
            if padding_idx is not None and not rows.RESERVED_IDS[1] < padding_idx < 2**63:
                raise ConfigError(
                    f"padding_idx {padding_idx} is not an id a dynamic table holds: its ids are int64 but the two "
                    f"smallest ({rows.RESERVED_IDS[0]}, {rows.RESERVED_IDS[1]}); give the id your inputs pad with "
                    "(e.g. -1 or 0), as it is: a dynamic table has no end to count a negative padding_idx from")
            return padding_idx
        if padding_idx is not None and padding_idx < 0:
            padding_idx += self.num_embeddings
        if padding_idx is not None and not 0 <= padding_idx < self.num_embeddings:
            raise ConfigError(f"padding_idx must be within num_embeddings ({self.num_embeddings}), got {padding_idx}")
        return padding_idx

    def _apply(self, fn: Any, recurse: bool = True) -> SparseEmbedding:
        """torch's dtype conversions (model.double(), .half(), .bfloat16(), .float(), .to(dtype))
        reach a module through here, applied to its parameters and buffers, of which a table has
        none: the module keeps the floating dtype the conversion makes of a float32 tensor, which
        its forwards return (self.dtype). A device move changes nothing here (rows follow the
        input's device)."""
        out = super()._apply(fn, recurse)
        try:  # (two probes: a conversion makes both its dtype, a device move leaves each its own)
            probes = [fn(torch.empty(0, dtype=d)) for d in (torch.float64, torch.float16)]
        except (RuntimeError, AssertionError, TypeError):  # (a device this process has none of: torch says so on
            return out                                     # the parameters, where there are some)
        if all(isinstance(p, torch.Tensor) and p.is_floating_point() for p in probes) and probes[0].dtype == probes[1].dtype:
            self.dtype = probes[0].dtype
        return out

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        """A forward's output in the module's dtype (computed in float32, the rows' dtype)."""
        return out if out.dtype == self.dtype else out.to(self.dtype)

    # ----------------------------------------------------------------------------- binding

    def prepare_to_bind(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Before a job binds this module (ps.optimizer(model) calls it first, before connecting):
        forget an earlier job or loaded state, making the module fresh. Returns the rows a state or
        pretrained weights gave it, (ids, values), if any: the chief's become the job's initial rows
        of this table (the servers start those rows from them)."""
        loaded = self._loaded if self._loaded is not None and self._loaded[0].numel() else None
        self._source, self._observe, self._loaded, self._lost = None, False, None, None
        self._drop_touched()
        return loaded

    def bound_draw_name(self, table: str) -> str:
        """The name the job's initial rows of this module, bound as table `table`, are drawn under,
        where it is not `table` (TableSpec.drawn_as; "": its own): a loaded state's (see drawn_as),
        so that the rows the state does not list start as they did in the job that wrote it. Read
        before prepare_to_bind (which forgets the loaded state)."""
        if self._loaded is None or self.drawn_as is None or self.drawn_as == table:
            return ""
        return self.drawn_as

    def bind(self, table: str, source: RowSource, drawn_as: str = "") -> None:
        """Make this module table `table` of a job (PSOptimizer does this, after prepare_to_bind; a
        model given to a new job's optimizer is bound to that one), its initial rows drawn under
        `drawn_as` ("": its own name; see bound_draw_name)."""
        self.prepare_to_bind()
        self.table, self._source, self.drawn_as = table, source, drawn_as or None
        if self.dynamic or self.num_embeddings * self.embedding_dim >= lookups.LOOKUP_KERNEL_MIN:
            lookups.kernels(start=True)  # (compiled while the job starts, not in its first steps)

    def read_only(self) -> None:
        """The worker left its job: forwards still read the rows (evaluation), nothing is pushed."""
        self._observe = True
        self._drop_touched()

    def release(self, source: RowSource, why: str) -> None:
        """The job of `source` let its connections go (`why` says how): if this module is bound to
        it, it is lost (its rows are on that job's servers, not here)."""
        if self._source is source:
            self._source, self._lost = None, why
            self._drop_touched()

    def __getstate__(self) -> dict[str, Any]:
        """Pickles and copies (torch.save(model), copy.deepcopy) leave the binding out: its RowSource
        holds the job's connections, and the rows stay on the servers. A copy of a bound module is
        lost (see the class doc); loaded rows are copied."""
        state: dict[str, Any] = super().__getstate__()
        if self._source is not None:
            state["_lost"] = (f"it is a copy (copy.deepcopy, pickle, torch.save) of a module bound to table {self.table!r}, "
                              "and a copy does not carry the rows, which live on the job's servers")
        state.update(_source=None, _observe=False, _touched=[], _last_unique=None)
        state.pop("_ahead", None)
        return state

    def _what(self) -> str:
        table = f" (table {self.table!r})" if self.table else ""
        return f"{type(self).__name__}({self.num_embeddings}, {self.embedding_dim}){table}"

    def _unbound_error(self) -> WorkerStateError:
        if self._lost is not None:
            return WorkerStateError(
                f"{self._what()} is not bound to a job: {self._lost}. Bind it with ps.optimizer(model), or "
                "load_state_dict() a state_dict() the bound model gave, to evaluate it without servers")
        return WorkerStateError(
            f"{self._what()} is not bound to a job: its rows live on the servers; build ps.optimizer(model) (or "
            "psgrad.connect(...).optimizer) first, or load_state_dict() a trained model's state_dict() to evaluate "
            "it without servers")

    # ----------------------------------------------------------------------------- forwards

    def initial_weight(self) -> torch.Tensor:
        """The whole table as the servers draw it before any update ([num_embeddings, dim] float32:
        N(0, std²) from the seed, the name the rows are drawn under and each id): for a local copy
        of a small table (tests, a dense baseline); a large one costs its full size.

        The name is the job's, so a module must know it: bound (or lost: its job's), the table's,
        or a loaded state's it started from (a wrapper's prefix added or stripped); unbound after
        load_state_dict(), the state's, which a job started from it draws the rows the state does
        not list under. Rows a state or from_pretrained() loaded are not in it: they are the
        values a job started from them begins with for those ids (its first update, sent by the
        chief), over these draws, and what an unbound loaded module serves; from_pretrained's
        embeddings are every row of the table.

        Raises:
            ConfigError: a dynamic table, which has no whole.
            WorkerStateError: a module never bound that loaded no named state (fresh, or
                from_pretrained): its rows are drawn under its name in the job, its place in the
                model, which binding gives it; call it after ps.optimizer(model).
        """
        if self.dynamic:
            raise ConfigError("a dynamic table (num_embeddings=None) has no whole table to make: its ids are any "
                              "int64; read the rows of the ids you need")
        if self.table is None and self.drawn_as is None:
            pretrained = (" (from_pretrained: every row a job starts from is the embeddings it was given; use those)"
                          if self._loaded is not None else "")
            raise WorkerStateError(
                f"initial_weight() of {self._what()}, which is not bound to a job: a table's initial rows are drawn "
                "under its name in the job, its place in the model, which binding gives it (its rows drawn now "
                "would be another table's). Bind first, then read it: opt = ps.optimizer(model); "
                f"module.initial_weight(){pretrained}")
        return rows.initial_rows(self._key(), torch.arange(self.num_embeddings), self.embedding_dim, self.std)

    def _key(self) -> int:
        return rows.table_key(self.seed, self.drawn_as if self.drawn_as is not None else self.table or "")

    def _rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(inverse, rows, unique): each id's index into rows, which are the rows of the batch's
        unique ids (sorted, CPU) pulled from the servers (a leaf that records its gradient when
        training), or, unbound, made from the loaded state (read-only)."""
        if self._source is None and self._loaded is None:
            raise self._unbound_error()
        unique, inverse = self.unique_ids(ids)
        if self._source is None:
            return inverse, self._local_rows(unique).to(ids.device), unique
        # Training pulls are the step's (rows fetched ahead or a row cache may serve them; their
        # versions are what the push says it computed on); read-only ones are read now.
        training = self._training()
        got = self._source.pull_tables({self.table or "": unique}, not training, checked=True)
        return inverse, self.attach_rows(unique, got[self.table or ""], ids.device, training,
                                         read_versions(got, self.table or "")), unique

    def bound_source(self) -> RowSource:
        """The job's rows this module is bound to.

        Raises:
            WorkerStateError: it is not bound (named how to bind it, or why its rows are not here).
        """
        if self._source is None:
            raise self._unbound_error()
        return self._source

    def _training(self) -> bool:
        """Whether a forward now is a training forward (autograd on, the worker in its job): its
        rows take gradients (unless frozen) and may be served from what was fetched ahead, where
        a read-only read is not. Not self.training: torch's embeddings train in eval() mode too
        (fine-tuning with dropout off and BatchNorm statistics fixed), and so do these."""
        return torch.is_grad_enabled() and not self._observe

    @property
    def requires_grad(self) -> bool:
        """Whether the rows take gradients (torch's weight.requires_grad): False once frozen by
        requires_grad_(False) or from_pretrained(freeze=True)."""
        return not self.frozen

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        self.requires_grad_(value)

    def requires_grad_(self: E, requires_grad: bool = True) -> E:
        """Freeze (False) or unfreeze (True) the table, as torch's requires_grad_ does a module's
        weight: a frozen table's forwards give its rows no gradient, so no step pushes any and its
        rows on the servers do not move (the rule from_pretrained(freeze=True) sets). Gradients of
        forwards before it stay until the step or zero_grad(), as torch's .grad does. A parent's
        requires_grad_ does not reach this module (torch's walks parameters(), and a table has
        none): call it on the table (or the collection), or on each of model.modules()."""
        super().requires_grad_(requires_grad)
        self.frozen = not requires_grad
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients of the rows this module's forwards touched since the last step (torch's
        zero_grad of the table's weight): they are not pushed. A forward whose backward comes after
        this still gives its rows gradients. set_to_none: accepted as torch's (a row's gradient
        either way is gone: a row without one is not pushed)."""
        if self._parameters or self._modules or self.__dict__.get("_is_replica", False):
            super().zero_grad(set_to_none)  # (a table has neither of its own: torch's walk of none costs ~8 us a table a step)
        for touched in self._touched:
            touched.drop_gradient()

    def unique_ids(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the unique ids of a forward's input, sorted, int64 on the CPU; each id's index into them).

        Raises:
            InvalidRequestError: not an integer tensor, or an id out of range.
        """
        return unique_ids_of([self], [ids])[0]

    def _remembered(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """unique_ids of `ids` where this module computed them last (a prefetch and the forward it
        serves look at the same tensor, unchanged since), else None."""
        last = self._last_unique
        if last is not None and last[0]() is ids and last[1] == ids._version:
            return last[2], last[3]
        if not isinstance(ids, torch.Tensor):
            raise InvalidRequestError(f"table {self.table!r}: row ids must be an integer tensor ({self.ID_DTYPES_TAKEN}), "
                                      f"got a {type(ids).__name__} (torch.tensor(...) of it)")
        if ids.dtype not in self.ID_DTYPES:
            raise InvalidRequestError(f"table {self.table!r}: row ids must be an integer tensor ({self.ID_DTYPES_TAKEN}), "
                                      f"got {ids.dtype}")
        return None

    def _remember(self, ids: torch.Tensor, unique: torch.Tensor, inverse: torch.Tensor,
                  checked: bool = False, keep: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Check the unique ids of `ids` (checked: the caller found them in range) and keep them for
        the next unique_ids of the same tensor (keep=False: checked only)."""
        if not checked:
            rows.check_ids(unique, self.num_embeddings, f"table {self.table!r}", ordered=True)
        if keep:  # (not through nn.Module.__setattr__, which looks for a parameter, buffer or module
            # of the name first: a step sets this for every table)
            self.__dict__["_last_unique"] = (weakref.ref(ids), ids._version, unique, inverse)
        return unique, inverse

    def lookup(self, input: torch.Tensor) -> dict[str, torch.Tensor]:
        """The rows a forward of `input` reads, by table (what a prefetch asks the servers for)."""
        return {self.table or "": self.unique_ids(input)[0]}

    def attach_rows(self, unique: torch.Tensor, weight: torch.Tensor, device: torch.device, training: bool,
                    versions: Mapping[int, int] | None = None) -> torch.Tensor:
        """The pulled rows of `unique` as this forward uses them: on the input's device and, when
        training (and not frozen), a leaf that records its gradient (taken by take_gradients), with
        the versions the rows were read at by shard (the base of the push of that gradient)."""
        if not weight.is_cpu or device.type != "cpu":
            weight = weight.to(device)
        if not training or self.frozen:
            return weight
        weight.requires_grad_(True)
        self._keep_touched(Touched(unique, weight, versions))
        return weight

    def _keep_touched(self, touched: Touched | RowsPart) -> None:
        """Keep a training forward's rows (until the step or zero_grad)."""
        if len(self._touched) >= 64:  # (forwards no backward reached, their outputs gone: nothing to keep)
            self.__dict__["_touched"] = [t for t in self._touched if t.leaf() is not None]
        self._touched.append(touched)

    def _pretrained(self, embeddings: torch.Tensor, freeze: bool) -> None:
        """Hold `embeddings` as every row's loaded value (see from_pretrained)."""
        values = embeddings.detach().to("cpu", torch.float32).contiguous()
        self._loaded, self.frozen = (torch.arange(self.num_embeddings), values), bool(freeze)
        self.drawn_as = None

    def _local_rows(self, unique: torch.Tensor) -> torch.Tensor:
        """Rows `unique` of an unbound module's loaded state: the loaded ones, the others initial."""
        assert self._loaded is not None
        out = rows.initial_rows(self._key(), unique, self.embedding_dim, self.std)
        ids, values = self._loaded
        if ids.numel() and unique.numel():
            at = torch.searchsorted(ids, unique).clamp_(max=ids.numel() - 1)
            found = ids[at] == unique
            out[found] = values[at[found]]
        return out

    def take_gradients(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The gradients of the rows the forwards since the last call touched, coalesced per id:
        (unique ids [n] int64, their gradients [n, dim] float32, CPU); None when none has one.
        Rows a forward pulled but no backward reached (or whose gradient zero_grad() dropped) have
        none. The padding id's row (padding_idx), which takes no gradient, is left out: pushed, its
        zero gradient would make the servers store the row (a dynamic table's too), count it for
        admission and step its optimizer state (Adam's moments decay), where torch leaves the
        padding row as it is."""
        taken = self.take_row_gradients()
        return None if taken is None else (taken.ids, taken.grads)

    def reached(self) -> bool:
        """Whether a forward since the last step (or zero_grad) got a backward: the table is used
        in this step (a dense twin's weight has a .grad), even where its rows' gradient is only the
        padding row's, which is not pushed."""
        return any(t.gradient() is not None for t in self._touched)

    def take_row_gradients(self) -> RowGradient | None:
        """take_gradients(), with the versions the rows were read at: per shard the oldest read
        among the forwards whose rows have a gradient (two forwards before one step: the first's,
        where it read that shard), what the push reports as the rows' base."""
        taken = self.row_gradients()
        self._drop_touched()
        return taken

    def row_gradients(self) -> RowGradient | None:
        """take_row_gradients() without taking them: the gradients stay until rows_pushed() (the
        step's exchange succeeded) or zero_grad() drops them, so a step that fails (a push the
        servers refused, a connection lost) leaves them for the step taken again, as torch leaves
        .grad in place when optimizer.step() raises."""
        touched = self._touched
        if len(touched) == 1:  # (one forward since the step, as most: no list of them, no merge)
            grad = touched[0].gradient()
            parts = [] if grad is None else [(touched[0].ids, grad, touched[0].versions)]
        else:
            parts = [(t.ids, grad, t.versions) for t in touched for grad in [t.gradient()] if grad is not None]
        if not parts:
            return None
        if len(parts) == 1:
            ids, grad, versions = parts[0]
            bases = dict(versions or {})  # (rows.oldest of one read)
            if grad.requires_grad or not grad.is_cpu or grad.dtype != torch.float32 or not grad.is_contiguous():
                grad = grad.detach().to("cpu", torch.float32).contiguous()  # (else as it is: a few us a table a step)
            kept = self._without_padding(ids, grad)
        else:
            bases = rows.oldest(*(versions for _, _, versions in parts))
            all_ids = torch.cat([ids for ids, _, _ in parts])
            grads = torch.cat([g.detach().to("cpu", torch.float32) for _, g, _ in parts])
            unique, inverse = torch.unique(all_ids, sorted=True, return_inverse=True)
            summed = torch.zeros(unique.numel(), self.embedding_dim).index_add_(0, inverse, grads)
            kept = self._without_padding(unique, summed)
        return None if kept is None else RowGradient(kept[0], kept[1], bases)

    def rows_pushed(self) -> None:
        """The step pushed the rows' gradients (row_gradients()): forget the rows touched since the
        last step, as take_row_gradients() does."""
        self._drop_touched()

    def _without_padding(self, ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(ids, grads) without the padding id's row (ids: unique, sorted); None when nothing is left."""
        padding = getattr(self, "padding_idx", None)
        if padding is not None and ids.numel():
            at = int(torch.searchsorted(ids, padding))
            if at < ids.numel() and int(ids[at]) == padding:
                keep = torch.ones(ids.numel(), dtype=torch.bool)
                keep[at] = False
                ids, grads = ids[keep], grads[keep]
        return (ids, grads) if ids.numel() else None

    def row_gradient_leaves(self) -> list[torch.Tensor]:
        """The touched rows' leaves with a gradient, merged into one leaf per id when several
        forwards touched rows (its .grad: what the step pushes), for clip_grad_norm_ to measure and
        scale in place."""
        leaves = [leaf for leaf in (t.gradient_leaf() for t in self._touched) if leaf is not None]
        if len(leaves) < 2:
            return leaves
        pending = [t for t in self._touched if t.leaf() is not None and t.gradient() is None]  # (a backward may come)
        taken = self.take_row_gradients()
        if taken is None:  # (the padding row alone: nothing to push, nothing to measure)
            self._touched = [*pending]
            return []
        merged = torch.zeros_like(taken.grads)  # (its values are never read: a step pushes gradients only)
        merged.grad = taken.grads
        self._touched = [Touched(taken.ids, merged, taken.bases, kept=True), *pending]
        return [merged]

    def _drop_touched(self) -> list[Touched | RowsPart]:
        """Forget the rows touched since the last step; returns them (their leaves held until then)."""
        touched = self._touched
        self.__dict__["_touched"] = []  # (as _last_unique: not through nn.Module.__setattr__)
        for t in touched:
            t.release()
        return touched

    # ----------------------------------------------------------------------------- state

    def stored_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [n] int64 in order, rows [n, dim] float32) of the rows that differ from their
        initial values: read from the job's servers when bound, the loaded ones when loaded, none
        when fresh.

        Raises:
            WorkerStateError: the module is lost (a copy of a bound one, or its job was closed).
        """
        if self._source is not None:
            return self._source.updated_rows(self.table or "")
        if self._loaded is not None:
            return self._loaded
        if self._lost is not None:
            raise WorkerStateError(
                f"state_dict() of {self._what()}: {self._lost}. Take state_dict() of the bound model (inside its "
                "job, before ps.close()), or read the job's rows with psgrad.fetch_state_dict(servers) while its "
                "servers run")
        return torch.empty(0, dtype=torch.int64), torch.empty(0, self.embedding_dim)

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        ids, values = self.stored_rows()
        name = self.drawn_as if self.drawn_as is not None else self.table if self.table is not None else prefix[:-1]
        destination[prefix + "ids"] = ids
        destination[prefix + "rows"] = values
        destination[prefix + "init"] = torch.tensor([self.num_embeddings, self.embedding_dim, self.seed], dtype=torch.int64)
        destination[prefix + "init_std"] = torch.tensor(self.std, dtype=torch.float64)
        destination[prefix + "table"] = torch.tensor(list(name.encode()), dtype=torch.uint8)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any],
                              strict: bool, missing_keys: list[str], unexpected_keys: list[str],
                              error_msgs: list[str]) -> None:
        # torch.nn.Embedding's layout (`weight`, the whole table) where the state has none of this one's
        weight = state_dict.get(prefix + "weight") if not any(prefix + k in state_dict for k in STATE_KEYS) else None
        unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k[len(prefix):] not in STATE_KEYS
                               and not (weight is not None and k == prefix + "weight"))
        missing = [prefix + k for k in REQUIRED_STATE_KEYS if prefix + k not in state_dict]
        if missing and weight is None:
            missing_keys.extend(missing)
            return
        where = f"{type(self).__name__} at {prefix[:-1] or 'the top'!r}"
        if self._source is not None:
            torch_state = (f" A torch.nn.{type(self).__name__}'s state ({prefix}weight) loads the same way: into the "
                           f"model before ps.optimizer(model), as psgrad.{type(self).__name__}.from_pretrained(weight) "
                           "starts a table from it" if weight is not None else "")
            raise ConfigError(
                f"load_state_dict() into {where}, bound to table {self.table!r}: a bound table's rows are the job's, "
                "on its servers, and a running job's rows change only by its updates. Load the state before "
                "ps.optimizer(model) (the chief's loaded rows become the job's initial rows), or into an unbound copy "
                "(copy.deepcopy(model), or a new model), which serves the loaded rows, or resume the job's rows from "
                f"its servers' checkpoints (--checkpoint-dir).{torch_state}")
        if weight is not None:
            self._load_weight(weight, prefix, where)
            return
        num, dim, seed = (int(v) for v in state_dict[prefix + "init"].tolist())
        if (num, dim) != (self.num_embeddings, self.embedding_dim):
            raise ConfigError(
                f"load_state_dict(): {prefix}init describes a table of {num} x {dim} rows, and {where} is "
                f"{self.num_embeddings} x {self.embedding_dim}: build it with num_embeddings={num}, embedding_dim={dim}")
        if seed < 0:
            raise ConfigError(f"load_state_dict(): {prefix}init gives the seed {seed}: a table's seed is an integer in "
                              "[0, 2**63)")
        raw_ids = state_dict[prefix + "ids"]
        if not isinstance(raw_ids, torch.Tensor) or raw_ids.is_floating_point() or raw_ids.is_complex() \
                or raw_ids.dtype == torch.bool:
            what = raw_ids.dtype if isinstance(raw_ids, torch.Tensor) else type(raw_ids).__name__
            raise ConfigError(f"load_state_dict(): {prefix}ids must be an integer tensor of row ids (int64, as "
                              f"state_dict() writes it), got {what}")
        ids = raw_ids.to("cpu", torch.int64).reshape(-1)
        values = state_dict[prefix + "rows"].detach().to("cpu", torch.float32)
        if values.shape != (ids.numel(), dim):
            raise ConfigError(f"load_state_dict(): {prefix}rows has shape {list(values.shape)}, not [{ids.numel()}, {dim}] "
                              f"(one row of {dim} per id of {prefix}ids)")
        try:
            rows.check_ids(ids, num, f"load_state_dict(): {prefix}ids")
        except InvalidRequestError as exc:
            raise ConfigError(str(exc)) from None
        ids, order = torch.sort(ids)
        if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise ConfigError(f"load_state_dict(): {prefix}ids lists a row id more than once")
        std = float(state_dict[prefix + "init_std"])
        if not (std == std and 0 <= std < float("inf")):
            raise ConfigError(f"load_state_dict(): {prefix}init_std is {std!r}: a table's std is a finite number >= 0")
        name = state_dict.get(prefix + "table")
        try:
            self.table = bytes(name.to(torch.uint8).tolist()).decode() if name is not None else prefix[:-1]
        except UnicodeDecodeError:
            raise ConfigError(f"load_state_dict(): {prefix}table is not a table name (UTF-8 bytes, as state_dict() "
                              "writes it)") from None
        # (the state names the table its rows were drawn under: a job that binds this module under
        # another name draws them under that one, see bound_draw_name; a state without the entry
        # is named by the module's place in the model)
        self.drawn_as = self.table if name is not None else None
        self.seed, self.std = seed, std
        self._loaded, self._lost = (ids, values[order].contiguous()), None

    def _load_weight(self, weight: Any, prefix: str, where: str) -> None:
        """Take torch.nn.Embedding's state, the whole table as `weight` [rows, dim]: every row
        loaded, as from_pretrained loads them (row i is id i; a dynamic table takes ids 0..rows-1,
        its other ids start as their initial values).

        Raises:
            ConfigError: not a tensor of this table's shape.
        """
        shape = list(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        fits = isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[1] == self.embedding_dim
        if not fits or (not self.dynamic and weight.shape[0] != self.num_embeddings):
            size = "any number of" if self.dynamic else f"{self.num_embeddings}"
            raise ConfigError(
                f"load_state_dict(): {prefix}weight (a torch.nn.{type(self).__name__}'s whole table) has shape {shape}, and "
                f"{where} takes [{size} rows, {self.embedding_dim}]: build it with the weight's shape "
                "(num_embeddings, embedding_dim)")
        values = weight.detach().to("cpu", torch.float32).contiguous()
        self.table, self.drawn_as = prefix[:-1], None
        self._loaded, self._lost = (torch.arange(values.shape[0]), values), None


class Embedding(SparseEmbedding):
    """torch.nn.Embedding(num_embeddings, embedding_dim) with its rows on the parameter servers.

    Rows start as N(0, std²) (torch's default: std 1), drawn from (seed, the table's name, row id).
    padding_idx: that row's output is zeros and it takes no gradient, as in torch; its row is never
    pushed, so the servers never store or update it (it keeps its initial value, unused, and no
    optimizer state); a dynamic table's is an id as it is (-1 pads id -1: there is no last row to
    count from). scale_grad_by_freq: each row's gradient is divided by
    how often its id occurs in the forward's input, as in torch. sparse: accepted, changes nothing
    (the rows' gradients are pushed per row always). max_norm: refused (ConfigError naming why).
    """

    def __init__(self, num_embeddings: int | None, embedding_dim: int, padding_idx: int | None = None,
                 std: float = 1.0, seed: int = 0, *, max_norm: float | None = None, norm_type: float = 2.0,
                 scale_grad_by_freq: bool = False, sparse: bool = False, min_count: int = 0, ttl: int = 0,
                 evict: bool = False) -> None:
        super().__init__(num_embeddings, embedding_dim, std, seed, max_norm=max_norm, norm_type=norm_type,
                         scale_grad_by_freq=scale_grad_by_freq, sparse=sparse, min_count=min_count, ttl=ttl,
                         evict=evict)
        self.padding_idx = self._padding_index(padding_idx)

    @classmethod
    def from_pretrained(cls, embeddings: torch.Tensor, freeze: bool = True, padding_idx: int | None = None,
                        max_norm: float | None = None, norm_type: float = 2.0, scale_grad_by_freq: bool = False,
                        sparse: bool = False, *, std: float = 1.0, seed: int = 0, **options: Any) -> Embedding:
        """torch.nn.Embedding.from_pretrained, with torch's arguments in torch's order (psgrad's
        own, std, seed and the row lifetime's, by name): a table of embeddings' shape whose rows
        start from `embeddings` — the job's initial rows when the chief's model binds it
        (ps.optimizer), or the rows an unbound module serves. freeze (torch's default, True): its
        rows take no gradient, so the servers' table never moves.

        Raises:
            ConfigError: embeddings that are not a 2-D tensor, or an option the constructor refuses.
        """
        module = cls(*_shape(embeddings), padding_idx=padding_idx, std=std, seed=seed, max_norm=max_norm,
                     norm_type=norm_type, scale_grad_by_freq=scale_grad_by_freq, sparse=sparse, **options)
        module._pretrained(embeddings, freeze)
        return module

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """The rows of `input`'s ids (any shape; int64 or int32), [*input.shape, embedding_dim], as
        torch.nn.Embedding's forward: read from the job's servers when bound (a training forward's
        rows take a gradient, which opt.step() pushes), else from the loaded state.

        Raises:
            InvalidRequestError: ids that are not an integer tensor, or out of the table's range
                (the table named).
            WorkerStateError: a module neither bound nor loaded (named how to bind it).
        """
        inverse, weight, _ = self._rows(input)
        out = self._output(F.embedding(inverse, weight, scale_grad_by_freq=self.scale_grad_by_freq))
        if self.padding_idx is not None:
            out = out * (input != self.padding_idx).unsqueeze(-1).to(out.dtype)
        return out


class EmbeddingBag(SparseEmbedding):
    """torch.nn.EmbeddingBag(num_embeddings, embedding_dim, mode) with its rows on the parameter
    servers: the sum, mean or max of each bag's rows (a 2-D input: one bag per row; a 1-D input with
    offsets: bags starting at each offset), optionally weighted per sample (mode "sum").

    torch's options, with torch's semantics: include_last_offset (offsets has one more entry, the
    end of the last bag), padding_idx (that id takes no part in its bag, mean's count included, and
    no gradient: its row is never pushed; a dynamic table's is an id as it is, -1 pads id -1), scale_grad_by_freq (not with mode "max", which torch refuses too), sparse
    (accepted, changes nothing: the rows' gradients are pushed per row always). max_norm: refused.
    """

    # torch's embedding_bag takes ids of any integer dtype and bool (converted), as these do
    ID_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
    ID_DTYPES_TAKEN = "int64, int32, int16, int8, uint8 or bool, as torch.nn.EmbeddingBag takes"

    def __init__(self, num_embeddings: int | None, embedding_dim: int, mode: str = "mean",
                 std: float = 1.0, seed: int = 0, *, max_norm: float | None = None, norm_type: float = 2.0,
                 scale_grad_by_freq: bool = False, sparse: bool = False, include_last_offset: bool = False,
                 padding_idx: int | None = None, min_count: int = 0, ttl: int = 0, evict: bool = False) -> None:
        super().__init__(num_embeddings, embedding_dim, std, seed, max_norm=max_norm, norm_type=norm_type,
                         scale_grad_by_freq=scale_grad_by_freq, sparse=sparse, min_count=min_count, ttl=ttl,
                         evict=evict)
        if mode not in EMBEDDING_BAG_MODES:
            raise ConfigError(f"mode must be one of {', '.join(EMBEDDING_BAG_MODES)}, got {mode!r}")
        if mode == "max" and scale_grad_by_freq:
            raise ConfigError("scale_grad_by_freq does not go with mode 'max' (torch refuses it at the forward too): "
                              "use mode 'sum' or 'mean', or leave scale_grad_by_freq out")
        self.mode = mode
        self.include_last_offset = bool(include_last_offset)
        self.padding_idx = self._padding_index(padding_idx)

    @classmethod
    def from_pretrained(cls, embeddings: torch.Tensor, freeze: bool = True, max_norm: float | None = None,
                        norm_type: float = 2.0, scale_grad_by_freq: bool = False, mode: str = "mean",
                        sparse: bool = False, include_last_offset: bool = False, padding_idx: int | None = None, *,
                        std: float = 1.0, seed: int = 0, **options: Any) -> EmbeddingBag:
        """torch.nn.EmbeddingBag.from_pretrained, with torch's arguments in torch's order (see
        Embedding.from_pretrained): the third is max_norm, not mode.

        Raises:
            ConfigError: embeddings that are not a 2-D tensor, a mode given in max_norm's place, or
                an option the constructor refuses.
        """
        if isinstance(max_norm, str):
            raise ConfigError(f"EmbeddingBag.from_pretrained takes torch's arguments in torch's order: the third is "
                              f"max_norm, not mode: pass mode={max_norm!r} by name")
        module = cls(*_shape(embeddings), mode=mode, std=std, seed=seed, max_norm=max_norm, norm_type=norm_type,
                     scale_grad_by_freq=scale_grad_by_freq, sparse=sparse, include_last_offset=include_last_offset,
                     padding_idx=padding_idx, **options)
        module._pretrained(embeddings, freeze)
        return module

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Each bag's sum, mean or max of its rows, [bags, embedding_dim], as torch.nn.EmbeddingBag's
        forward: 2-D ids without offsets (a bag per row), or 1-D ids with `offsets` (where each bag
        starts; with include_last_offset, the end of the last too); per_sample_weights (mode "sum"):
        one per id, multiplying its row. The rows are read from the job's servers when bound (a
        training forward's take a gradient, which opt.step() pushes), else from the loaded state.

        Raises:
            InvalidRequestError: ids out of range or not integers, offsets that do not start at 0,
                decrease or pass the ids, shapes torch's embedding_bag refuses, per-sample weights
                not one per id (the table named).
            ConfigError: per-sample weights with mode "mean" or "max".
            WorkerStateError: a module neither bound nor loaded (named how to bind it).
        """
        ahead: _Ahead | None = self.__dict__.get("_ahead")
        if ahead is not None and per_sample_weights is None and ahead.serves(input, offsets) and self._training():
            del self.__dict__["_ahead"]
            return self._output(ahead.out)
        self._check_bags(input, offsets, per_sample_weights)
        inverse, weight, unique = self._rows(input)
        if per_sample_weights is not None and per_sample_weights.dtype == self.dtype != torch.float32:
            per_sample_weights = per_sample_weights.to(torch.float32)  # (the rows' dtype, as torch's pooling needs)
        padding = None  # the padding id's index among the pulled rows, where the input has it
        if self.padding_idx is not None:
            at = int(torch.searchsorted(unique, self.padding_idx))
            padding = at if at < unique.numel() and int(unique[at]) == self.padding_idx else None
        if padding is None and self.plain_bags() and per_sample_weights is None:
            out = lookups.pooled([weight], [inverse], [offsets], self.mode == "mean", [self.table or "embedding bag"])
            if out is not None:  # (else it checked the offsets it leaves to torch's pooling)
                return self._output(out)
        elif offsets is not None:  # (max bags, padding_idx, ...: torch's pooling, which does not check all of them)
            lookups.check_offsets([inverse], [offsets], [self.table or "embedding bag"])
        return self._output(F.embedding_bag(inverse, weight, offsets, mode=self.mode, per_sample_weights=per_sample_weights,
                                            scale_grad_by_freq=self.scale_grad_by_freq,
                                            include_last_offset=self.include_last_offset, padding_idx=padding))

    def _check_bags(self, input: Any, offsets: Any, per_sample_weights: Any) -> None:
        """Refuse, before any row is read, the bag layouts and weights that torch's embedding_bag
        refuses with messages that name neither the table nor what to pass instead.

        Raises:
            InvalidRequestError: ids that are neither 1-D with offsets nor 2-D without; offsets
                that are not 1-D; per-sample weights not of the ids' shape, or not floating point.
            ConfigError: per-sample weights for a module whose mode is not "sum".
        """
        if not isinstance(input, torch.Tensor):
            return  # (unique_ids says what it takes)
        where = f"table {self.table!r}" if self.table else "embedding bag"
        if input.dim() == 2 and offsets is not None:
            raise InvalidRequestError(f"{where}: 2-D ids are one bag per row and take no offsets: pass offsets=None, "
                                      "or the ids flattened to 1-D with the offsets where each bag starts")
        if input.dim() == 1 and offsets is None:
            raise InvalidRequestError(f"{where}: 1-D ids need offsets, where each bag starts (torch.tensor([0]) for one "
                                      "bag of them all), or pass 2-D ids, one bag per row")
        if input.dim() not in (1, 2):
            raise InvalidRequestError(f"{where}: ids must be 1-D (with offsets) or 2-D (one bag per row), got "
                                      f"{input.dim()}-D {list(input.shape)}")
        if isinstance(offsets, torch.Tensor) and offsets.dim() != 1:
            raise InvalidRequestError(f"{where}: bag offsets must be 1-D, one per bag, got {offsets.dim()}-D "
                                      f"{list(offsets.shape)}")
        if per_sample_weights is None:
            return
        if self.mode != "sum":
            raise ConfigError(f"{where}: per_sample_weights need mode 'sum' (as torch.nn.EmbeddingBag's do); this "
                              f"module's mode is {self.mode!r}: build it with mode='sum' (for a weighted mean, divide "
                              "each bag's weights by their sum)")
        if not (isinstance(per_sample_weights, torch.Tensor) and per_sample_weights.is_floating_point()
                and per_sample_weights.shape == input.shape):
            raise InvalidRequestError(f"{where}: per_sample_weights must be a floating-point tensor shaped as the ids "
                                      f"{list(input.shape)}, got {getattr(per_sample_weights, 'dtype', type(per_sample_weights).__name__)} "
                                      f"{list(getattr(per_sample_weights, 'shape', []))}")

    def plain_bags(self) -> bool:
        """Whether this module's bags are plain sums or means (no padding_idx, include_last_offset
        or scale_grad_by_freq): what the compiled pooling serves (psgrad/nn/lookups.py)."""
        return (self.mode != "max" and self.padding_idx is None and not self.include_last_offset
                and not self.scale_grad_by_freq)

    def take_ahead(self) -> int | None:
        """Drop bags pooled ahead for a forward that did not come (pool_ahead); returns how many
        rows they read (None: none were waiting, the forward took them)."""
        ahead: _Ahead | None = self.__dict__.pop("_ahead", None)
        return None if ahead is None else ahead.rows


def _same_tensor(a: torch.Tensor | None, b: Any) -> bool:
    """Whether b is a, or a view of the same storage laid out as a is (a view taken again)."""
    if a is None or a is b:
        return a is b
    return (isinstance(b, torch.Tensor) and b.dtype == a.dtype and b.shape == a.shape and b.stride() == a.stride()
            and b.storage_offset() == a.storage_offset() and b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr())


class _Ahead(NamedTuple):
    """A module's next forward's bags, pooled at the model's forward start (pool_ahead), for a call
    with this input and these offsets, unchanged since (their version counters)."""

    input: torch.Tensor
    offsets: torch.Tensor | None
    versions: tuple[int, int]
    out: torch.Tensor
    rows: int  # the rows read for it

    def serves(self, input: Any, offsets: Any) -> bool:
        return (_same_tensor(self.input, input) and _same_tensor(self.offsets, offsets)
                and self.versions == _versions(input, offsets))


def _versions(input: torch.Tensor, offsets: torch.Tensor | None) -> tuple[int, int]:
    return input._version, 0 if offsets is None else offsets._version


def pool_key(module: EmbeddingBag, input: Any, offsets: Any) -> tuple[bool, int, int] | None:
    """The group pool_ahead pools (module, input, offsets) in: (mean, width, bags); None where it
    does not pool them (the forward pools its own)."""
    if not (module.plain_bags() and module._source is not None and module._training() and isinstance(input, torch.Tensor)
            and input.is_cpu):  # (the kernels pool on the CPU)
        return None
    if offsets is None and input.dim() == 2:
        return module.mode == "mean", module.embedding_dim, int(input.shape[0])
    if isinstance(offsets, torch.Tensor) and offsets.dim() == 1 and offsets.dtype == torch.int64 and input.dim() == 1:
        return module.mode == "mean", module.embedding_dim, int(offsets.numel())
    return None


def pool_ahead(calls: Sequence[tuple[EmbeddingBag, Any, Any]],
               read: Callable[[dict[str, torch.Tensor]], Mapping[str, torch.Tensor]] | None = None,
               keys: Sequence[tuple[bool, int, int] | None] | None = None) -> list[EmbeddingBag]:
    """Pool the bags of several psgrad.EmbeddingBag modules' coming training forwards, (module,
    input, offsets) each, in one pass each way (lookups.pooled_group) where each forward would
    pool its own: each group's rows are read now, in one call (served from rows fetched ahead,
    where they were), as one leaf (GroupRows), and each module's next forward with this very input
    and offsets, unchanged, returns what was pooled. Serves plain sum and mean bags without per-sample weights (plain_bags), 1-D ids with
    1-D int64 offsets or 2-D ids; modules grouped by mode, width and bag count (pool_key). Returns
    the modules whose bags wait; the others' forwards pool their own. take_ahead() drops what a
    forward did not come for. read: where given, what reads a group's rows (table -> unique ids,
    checked against the tables' ranges: the rows, a PulledRows), in place of the modules' source
    (a forward's grouped read, nothing fetched ahead: see GroupedForward). keys: the calls'
    pool_key()s, where the caller has them.

    Raises:
        InvalidRequestError: ids or offsets a forward refuses (it would say the same).
    """
    groups: dict[tuple[bool, int, int], list[tuple[EmbeddingBag, torch.Tensor, torch.Tensor | None]]] = {}
    for (m, input, offsets), key in zip(calls, keys if keys is not None else [pool_key(*call) for call in calls]):
        if key is not None:
            groups.setdefault(key, []).append((m, input, offsets))
    waiting = []
    for (mean, _, _), group in groups.items():
        read_ = read_together([m for m, _, _ in group], [i for _, i, _ in group], read)
        if read_ is None:
            continue  # (modules of several jobs, or a table twice: each forward reads and pools its own)
        outs = lookups.pooled_group(read_.rows, [int(u.numel()) for u in read_.uniques], read_.inverses,
                                    [offsets for _, _, offsets in group], mean, [m.table or "" for m, _, _ in group],
                                    read_.group, read_.inverse)
        if outs is None:
            continue  # (each forward pools its own, as torch's ops do; the rows read here reach no backward)
        for (m, input, offsets), out, unique in zip(group, outs, read_.uniques):
            m.__dict__["_ahead"] = _Ahead(input, offsets, _versions(input, offsets), out, int(unique.numel()))
            waiting.append(m)
    return waiting


class ReadTogether(NamedTuple):
    """read_together's rows: per module its ids' inverse and unique ids; the rows read, one
    module's after another in one tensor; their GroupRows (None: no module takes gradients)."""

    inverses: list[torch.Tensor]
    uniques: list[torch.Tensor]
    rows: torch.Tensor
    group: GroupRows | None
    inverse: torch.Tensor | None  # the inverses one after another, where they were found so (UniqueIds.inverse)


def read_together(modules: Sequence[SparseEmbedding], inputs: Sequence[Any],
                  read: Callable[[dict[str, torch.Tensor]], Mapping[str, torch.Tensor]] | None = None,
                  observe: bool = False) -> ReadTogether | None:
    """The rows of each module's input (of tables of one width), read in one call of their source
    (or of `read`, see pool_ahead), as one tensor of them all: for a training forward a leaf (a
    GroupRows), each module whose rows take gradients (not frozen) keeping its part of it, a
    RowsPart; observe: a read-only read, no leaf. None where the modules do not share one source,
    or name one table twice (each forward then reads its own).

    Raises:
        InvalidRequestError: ids that are not an integer tensor, or out of a module's range.
    """
    names = [m.table or "" for m in modules]
    source = modules[0].bound_source()
    if len(set(names)) < len(names) or any(m._source is not source for m in modules):
        return None
    found = unique_ids_of(modules, inputs, remember=False)  # (the caller serves the forwards what it pools)
    uniques, inverses = [unique for unique, _ in found], [inverse for _, inverse in found]
    asked = dict(zip(names, uniques))
    got = source.pull_tables(asked, observe, checked=True) if read is None else read(asked)  # (checked: unique_ids_of)
    block = got.blocks.get(tuple(names)) if isinstance(got, rows.PulledRows) else None
    # (the read's block of them where it wrote them so, else a view where they lie so, else a copy)
    rows_ = block if block is not None else joined([got[name] for name in names])
    whole = found.inverse if isinstance(found, lookups.UniqueIds) else None
    if observe or all(m.frozen for m in modules):
        return ReadTogether(inverses, uniques, rows_, None, whole)
    group_ = GroupRows(rows_.requires_grad_(True), [int(unique.numel()) for unique in uniques])
    for t, (m, name, unique) in enumerate(zip(modules, names, uniques)):
        if not m.frozen:
            m._keep_touched(RowsPart(group_, t, unique, read_versions(got, name)))
    return ReadTogether(inverses, uniques, rows_, group_, whole)


def _shape(embeddings: torch.Tensor) -> tuple[int, int]:
    """(num_embeddings, embedding_dim) of pretrained embeddings.

    Raises:
        ConfigError: not a 2-D tensor.
    """
    if not isinstance(embeddings, torch.Tensor) or embeddings.dim() != 2:
        raise ConfigError(f"from_pretrained takes a 2-D tensor of embeddings, got {getattr(embeddings, 'shape', embeddings)!r}")
    return int(embeddings.shape[0]), int(embeddings.shape[1])


def read_versions(got: Mapping[str, torch.Tensor], table: str) -> dict[int, int] | None:
    """The versions a source's read of `table` was made at, by shard (None: it did not say)."""
    return got.versions.get(table) if isinstance(got, rows.PulledRows) else None


def unique_ids_of(modules: Sequence[SparseEmbedding], inputs: Sequence[torch.Tensor],
                  remember: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each module's unique_ids of its input: those it does not remember computed for all of them
    in one pass (psgrad/nn/lookups.py) where the kernels serve them, else by torch.unique each.
    Where none was remembered and the kernels found them all, the list is their lookups.UniqueIds,
    whose `inverse` holds every input's inverse one after another. remember=False: the modules
    do not keep them for a later unique_ids of the same tensor (a caller that serves the
    forwards itself: pool_ahead), only check them.

    Raises:
        InvalidRequestError: ids that are not an integer tensor, or out of a module's range.
    """
    out = [m._remembered(i) for m, i in zip(modules, inputs)]
    todo = [k for k, o in enumerate(out) if o is None]
    if not todo:
        return out  # type: ignore[return-value]
    fused = lookups.unique_ids([inputs[k] for k in todo], max(modules[k].embedding_dim for k in todo))
    # (the kernel's ids in range for all the tables at once: checked each on its own, where one is not)
    fine = fused.within([modules[k].num_embeddings for k in todo]) if fused is not None else []
    if fused is not None and len(todo) == len(out):  # (all found in one pass: the result keeps its whole inverse)
        if not remember and all(fine):
            return fused  # (nothing to check or keep, module by module)
        out = fused  # type: ignore[assignment]
    for n, k in enumerate(todo):
        if fused is not None:
            unique, inverse = fused[n]
        else:
            unique, inverse = torch.unique(inputs[k].reshape(-1), sorted=True, return_inverse=True)
            unique, inverse = unique.to("cpu", torch.int64), inverse.view(inputs[k].shape)
        out[k] = modules[k]._remember(inputs[k], unique, inverse, checked=bool(fine and fine[n]), keep=remember)
    return out  # type: ignore[return-value]


def sparse_modules(model: nn.Module) -> list[tuple[str, SparseEmbedding]]:
    """The model's psgrad embeddings with their names in it (each module once), in module order.

    Raises:
        ConfigError: an embedding without a name (the model itself is one).
    """
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, SparseEmbedding)]
    for name, _ in found:
        if not name:
            raise ConfigError("the model itself is a psgrad embedding: wrap it in a module (its tables are named by "
                              "their place in the model)")
    return found


def sparse_aliases(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Each psgrad embedding's other names in the model (a module registered under several, as a
    two-tower model shares its item table), by its first name (the one sparse_modules gives);
    the model's state_dict() holds its entries under every one."""
    names: dict[int, list[str]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        if isinstance(m, SparseEmbedding):
            names.setdefault(id(m), []).append(name)
    return {found[0]: tuple(dict.fromkeys(found[1:])) for found in names.values()}


def clip_grad_norm_(parameters: nn.Module | torch.Tensor | Iterable[torch.Tensor], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for models with psgrad embeddings: given the model, the norm
    covers its parameters' gradients and the gradients of the rows its psgrad embeddings' forwards
    touched since the last step (coalesced per id, as the step pushes them and as a dense table's
    gradient holds them), and scales them all alike; returns the total norm, as torch does. Call it
    between backward() and opt.step(). Given tensors (model.parameters()), it is torch's: the rows
    are left out, which is why it takes the model."""
    if isinstance(parameters, nn.Module):
        tensors: list[torch.Tensor] = list(parameters.parameters())
        for module in parameters.modules():
            if isinstance(module, SparseEmbedding):
                tensors += module.row_gradient_leaves()
        return torch.nn.utils.clip_grad_norm_(tensors, max_norm, norm_type, error_if_nonfinite, foreach)
    return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, foreach)
