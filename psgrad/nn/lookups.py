"""A lookup in several embedding tables in compiled passes: each table's unique ids (the rows a
forward pulls) for every table at once, and the bags of every table pooled in one pass forward and
one backward — what psgrad.EmbeddingBagCollection's forward (and a psgrad.EmbeddingBag's, one table)
does per step, where torch takes, per table, a unique (a sort of its ids), an embedding_bag, a
backward that sorts the ids again and then a pass, and a concatenation of the tables' outputs both
ways. On a recommender's step (8 tables, a batch of 512 bags: benchmarks/dlrm.py) a worker's
backward took 2.4 ms of CPU where it took 3.5 (docs/benchmarks/dlrm.md).

The results are torch's: unique ids and inverse as torch.unique(sorted=True, return_inverse=True)
gives them; bags pooled as torch's embedding_bag (a bag's sum adds its rows in order from zero, a
mean divides it by the bag's size, an empty bag is zeros), both checked bit for bit after
compiling. The backward adds a row's gradients in the order of the ids (a mean's each times
1 / size), as index_add_ does; torch's own backward adds them in the order its sort of the ids
leaves them, so a row that several bags share may differ from torch's in the last bits (the same
from run to run, as torch's is).

They serve int64 (or int32) ids and sum and mean bags of float32 rows on the CPU, without
per-sample weights, padding_idx, include_last_offset or scale_grad_by_freq; unique_ids() and
pooled() return None for anything else, and the caller runs torch's own ops. Until the kernels
are compiled (or where numba is missing, or they disagree with torch, or with
PSGRAD_FUSED_APPLY=0), unique_ids() returns None (torch.unique gives the same ids) and pooled()
does the same passes with torch's ops in the same order (embedding_bag forward, index_add_
backward): a job's bits do not depend on when the kernels became ready."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from psgrad.core.codecs import joined
from psgrad.core.compiled import get as _get
from psgrad.core.rows import starts as _starts
from psgrad.errors import InvalidRequestError

#: Ids x width of one lookup (or rows x width of a table bound to a job; any dynamic table) from which
#: the kernels start compiling: a process whose lookups and tables are all smaller (a test's, a toy
#: model's) never loads numba for them; smaller lookups use the kernels once they are compiled all
#: the same.
LOOKUP_KERNEL_MIN = 16384


#: The most ids of one table whose unique ids the kernel finds: its hash table, indices and sort's
#: buffers take about 88 bytes an id (a forward's few thousand ids: kilobytes); more (an
#: evaluation of a huge batch) go to torch.unique, whose sort needs less memory.
UNIQUE_MAX_IDS = 1 << 20


def kernels(start: bool = False, wait: bool = False) -> dict[str, Any] | None:
    """The compiled lookup kernels, or None: not ready yet (start: the call starts compiling them
    on a background thread; wait=True waits for that), turned off, or unavailable here."""
    return _get("lookups", _make, start, wait)


def _make() -> dict[str, Any] | None:
    from psgrad.nn._lookup_kernels import KERNELS

    return KERNELS if _unique_agrees_with_torch(KERNELS) and _pooling_agrees_with_torch(KERNELS) else None


class UniqueIds(list[tuple[torch.Tensor, torch.Tensor]]):
    """unique_ids()'s result: per tensor of ids, (unique, inverse); the least and the greatest of
    each one's unique ids, for a range check of all the tables at once (`within`); and `inverse`,
    every tensor's inverse one after another, flat (theirs are its parts: a pooling of all the
    tables takes it whole, no copy)."""

    def __init__(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], counts: np.ndarray, least: np.ndarray,
                 greatest: np.ndarray, inverse: torch.Tensor) -> None:
        super().__init__(pairs)
        self.counts, self.least, self.greatest, self.inverse = counts, least, greatest, inverse

    def within(self, sizes: Sequence[int]) -> list[bool]:
        """Per tensor of ids, whether all its ids lie in [0, sizes[t]) (no ids: yes; a size of 0,
        a dynamic table's, no: its own check says what it takes)."""
        size = np.asarray(sizes, dtype=np.int64)
        return ((self.counts == 0) | ((size > 0) & (self.least >= 0) & (self.greatest < size))).tolist()


def unique_ids(ids: Sequence[torch.Tensor], dim: int) -> UniqueIds | None:
    """torch.unique(i.reshape(-1), sorted=True, return_inverse=True) of each tensor of ids (of
    tables `dim` wide), as (unique int64, inverse int64 shaped as i), in one pass: or None, where
    the kernels do not serve these ids (see the module doc)."""
    k = kernels()
    if k is None:
        if sum(int(i.numel()) for i in ids) * dim >= LOOKUP_KERNEL_MIN:
            kernels(start=True)
        return None
    if not ids or not all(i.is_cpu and i.dtype in (torch.int64, torch.int32) and i.numel() <= UNIQUE_MAX_IDS
                          for i in ids):
        return None
    return _unique_with(k, ids)


def _unique_with(k: dict[str, Any], ids: Sequence[torch.Tensor]) -> UniqueIds:
    flat = [i if i.dim() == 1 else i.reshape(-1) for i in ids]
    sizes = [int(f.numel()) for f in flat]
    all_ids = (torch.cat(flat) if len(flat) > 1 else flat[0]).to(torch.int64).contiguous()
    unique, inverse, counts = torch.empty_like(all_ids), torch.empty_like(all_ids), np.empty(len(flat), np.int64)
    starts = _starts(sizes)
    u = unique.numpy()
    k["unique"](all_ids.numpy(), starts, u, inverse.numpy(), counts)
    # (each table's unique ids begin its place: one split into them and the rest of each place, one
    # into the inverses; a few torch calls for all the tables, where slicing costs some per table)
    kept = counts.tolist()
    uniques = unique.split_with_sizes([n for c, size in zip(kept, sizes) for n in (c, size - c)])[::2]
    inverses = inverse.split_with_sizes(sizes)
    # (each table's least and greatest unique id, its first and last: read for all the tables at
    # once; a table of no ids reads any place, and counts 0)
    first = np.minimum(starts[:-1], max(len(u) - 1, 0))
    least, greatest = (u[first], u[first + np.maximum(counts - 1, 0)]) if len(u) else (counts, counts)
    return UniqueIds([(uq, inv if i.dim() == 1 else inv.view(i.shape)) for i, uq, inv in zip(ids, uniques, inverses)],
                     counts, least, greatest, inverse)


def pooled(weights: Sequence[torch.Tensor], inverses: Sequence[torch.Tensor],
           offsets: Sequence[torch.Tensor | None], mean: bool, names: Sequence[str] = ()) -> torch.Tensor | None:
    """torch.cat([F.embedding_bag(inverse, weight, offset, mode) for each table], dim=1), one
    autograd node for all the tables: weights[t] the rows table t's bags read ([rows, D], one D for
    all), inverses[t] its ids as rows of weights[t] (1-D with offsets[t], the bags' starts, or 2-D:
    a bag per row). Returns [B, T * D] (recording a gradient for each weight that requires one):
    by the kernels, one pass each way, where they are compiled, else by torch's ops, with the same
    bits either way (the backward adds a row's gradients in the order of the ids, as index_add_
    does, in both); or None: a lookup this does not serve (see the module doc), or bags that are
    not valid for torch (then torch's ops, run by the caller, say why). names: the tables', for
    the message below.

    Raises:
        InvalidRequestError: bag offsets that do not start at 0, decrease, or pass the ids' end
            (torch refuses some of these and pools arbitrary memory for decreasing ones).
    """
    k = kernels()
    if k is None and sum(int(i.numel()) for i in inverses) * int(weights[0].shape[-1]) >= LOOKUP_KERNEL_MIN:
        kernels(start=True)
    plan = _Plan.make(weights, inverses, offsets, mean, k)
    if plan is None:
        check_offsets(inverses, offsets, names)
        return None
    return _Pooled.apply(plan, *weights)


def pooled_apart(weights: Sequence[torch.Tensor], inverses: Sequence[torch.Tensor],
                 offsets: Sequence[torch.Tensor | None], mean: bool, names: Sequence[str] = ()) -> list[torch.Tensor] | None:
    """pooled(), each table's bags a tensor of its own: [F.embedding_bag(inverse, weight, offset,
    mode) for each table], [B, D] each, in one pass each way, as separate modules' forwards would
    give them. A table whose output no backward reaches gets no gradient (its weight's .grad stays
    None, as a lookup of its own left unused gets none), where a slice of pooled()'s one output
    would get zeros. The bits are pooled()'s, table by table. None and the errors: as pooled().
    (GroupedForward pools a forward's modules with pooled_group, their rows one tensor.)"""
    plan = _Plan.make(weights, inverses, offsets, mean, kernels())
    if plan is None:
        check_offsets(inverses, offsets, names)
        return None
    return list(_PooledApart.apply(plan, *weights))


def pooled_group(rows: torch.Tensor, sizes: Sequence[int], inverses: Sequence[torch.Tensor],
                 offsets: Sequence[torch.Tensor | None], mean: bool, names: Sequence[str] = (),
                 group: Any = None, inverse: torch.Tensor | None = None) -> list[torch.Tensor] | None:
    """pooled_apart() of tables whose rows lie in one tensor, one table's after another (rows[:
    sizes[0]] table 0's, and so on: what a forward reads of a group of tables at once), which
    takes their gradient as one: one leaf, one gradient accumulated, where a tensor per table
    takes one each. group: an object (or None) whose hold(reached) the backward calls with, per
    table, whether its output got a gradient (the rows of a table whose output none reached get
    zeros in the one gradient: what they hold is the group's to say, see embedding.GroupRows).
    inverse: the inverses one after another, flat, where the caller has them so (UniqueIds.inverse:
    else they are joined). The bits, None and the errors: as pooled_apart()."""
    plan = _group_plan(rows, sizes, inverses, offsets, mean, names, group, inverse)
    return None if plan is None else list(_PooledApart.apply(plan, rows))


def pooled_block(rows: torch.Tensor, sizes: Sequence[int], inverses: Sequence[torch.Tensor],
                 offsets: Sequence[torch.Tensor | None], mean: bool, names: Sequence[str] = (),
                 group: Any = None, inverse: torch.Tensor | None = None) -> torch.Tensor | None:
    """pooled() of tables whose rows lie in one tensor (as pooled_group() takes them): the bags
    of every table side by side, [B, T * D], one output (an EmbeddingBagCollection's), its
    gradient the rows' one gradient. A backward that reaches the output reaches every table's
    part of it (group.hold is told so). The bits, None and the errors: as pooled()."""
    plan = _group_plan(rows, sizes, inverses, offsets, mean, names, group, inverse)
    return None if plan is None else _Pooled.apply(plan, rows)


def _group_plan(rows: torch.Tensor, sizes: Sequence[int], inverses: Sequence[torch.Tensor],
                offsets: Sequence[torch.Tensor | None], mean: bool, names: Sequence[str], group: Any,
                inverse: torch.Tensor | None) -> _Plan | None:
    """The plan of pooled_group() and pooled_block(); None (the offsets checked) where it serves
    none."""
    plan = _Plan.make([rows], inverses, offsets, mean, kernels(), sizes, inverse)
    if plan is None:
        check_offsets(inverses, offsets, names)
        return None
    plan.group = group
    return plan


def check_offsets(inverses: Sequence[torch.Tensor], offsets: Sequence[torch.Tensor | None], names: Sequence[str]) -> None:
    """Refuse bag offsets no pooling can take (see pooled; torch's embedding_bag pools arbitrary
    memory for decreasing ones), naming the table and the problem.

    Raises:
        InvalidRequestError: offsets that are not integers (torch's error names its `indices`),
            do not start at 0, decrease, or pass the ids' end.
    """
    for t, (i, o) in enumerate(zip(inverses, offsets)):
        where = f"table {names[t]!r}" if t < len(names) else "a table"
        if isinstance(o, torch.Tensor) and (o.is_floating_point() or o.is_complex()):
            raise InvalidRequestError(f"{where}: bag offsets must be an integer tensor (int64 or int32, or another "
                                      f"integer dtype, as torch's embedding_bag takes them), got {o.dtype}")
        if o is None or not isinstance(o, torch.Tensor) or o.dim() != 1 or not o.numel():
            continue  # (torch's ops say what is wrong with those)
        o = o.to("cpu", torch.int64)
        if int(o[0]) != 0:
            raise InvalidRequestError(f"{where}: bag offsets must start at 0, got {int(o[0])}")
        down = torch.nonzero(o[1:] < o[:-1])
        if down.numel():
            b = int(down[0]) + 1
            raise InvalidRequestError(f"{where}: bag offsets must not decrease, got {int(o[b])} after {int(o[b - 1])} "
                                      f"(bag {b})")
        if int(o[-1]) > i.numel():
            raise InvalidRequestError(f"{where}: a bag starts at offset {int(o[-1])}, past the {i.numel()} ids")


class _Plan:
    """One lookup's layout: as the pooling kernels take it (see _lookup_kernels.py), or as tensors
    for torch's ops (k None: the kernels are not compiled here)."""

    def __init__(self, kernels_: dict[str, Any] | None, flat: list[torch.Tensor], starts: list[torch.Tensor],
                 sizes: list[int], dim: int, mean: bool, one_tensor: bool = False,
                 inverse: torch.Tensor | None = None) -> None:
        self.k, self.flat, self.starts, self.sizes, self.dim, self.mean = kernels_, flat, starts, sizes, dim, mean
        self.one_tensor = one_tensor  # (the tables' rows given as one tensor: pooled_group's and pooled_block's)
        self.group: Any = None  # (theirs)
        self.bags = int(starts[0].numel())
        if kernels_ is not None:  # (the kernels' arrays; torch's ops take the tensors)
            self.row_start = _starts(sizes)[:-1]
            counts = [int(f.numel()) for f in flat]
            if inverse is None or inverse.dim() != 1 or inverse.numel() != sum(counts):
                inverse = joined(flat)  # (the caller's whole inverse where it has one: no join)
            self.inverse = inverse.contiguous().numpy()
            self.id_start = _starts(counts)
            self.offsets = (torch.stack(starts) if len(starts) > 1 else starts[0].view(1, -1)).contiguous().numpy()

    @classmethod
    def make(cls, weights: Sequence[torch.Tensor], inverses: Sequence[torch.Tensor],
             offsets: Sequence[torch.Tensor | None], mean: bool, k: dict[str, Any] | None,
             sizes: Sequence[int] | None = None, inverse: torch.Tensor | None = None) -> _Plan | None:
        """The plan of pooled() (a weight per table), or of pooled_group() (`sizes` given: weights
        is one tensor of every table's rows, sizes[t] of them table t's; `inverse`: the inverses
        one after another, where the caller has them so); None where it does not serve these (see
        the module doc)."""
        dim = int(weights[0].shape[-1]) if weights[0].dim() == 2 else -1
        f32, i64 = torch.float32, torch.int64
        if sizes is not None and not (len(weights) == 1 and len(sizes) == len(inverses)
                                      and sum(sizes) == weights[0].shape[0]):
            return None
        for w in weights:  # (is_cpu: a device object compared costs more, per table per step)
            if not (w.dim() == 2 and w.shape[1] == dim and w.dtype == f32 and w.is_cpu):
                return None
        for i in inverses:
            if not (i.is_cpu and i.dtype == i64):
                return None
        starts, flat = [], []
        for i, o in zip(inverses, offsets):
            if o is None:  # 2-D: one bag per row
                if i.dim() != 2 or not i.shape[1]:  # (bags of no ids: torch refuses them)
                    return None
                starts.append(torch.arange(0, i.numel(), int(i.shape[1])))
                flat.append(i.reshape(-1))
            else:
                if i.dim() != 1 or o.dim() != 1 or o.dtype != i64 or not o.is_cpu:
                    return None
                starts.append(o)
                flat.append(i)
        bags = int(starts[0].numel())
        if not bags or any(int(s.numel()) != bags for s in starts):
            return None  # (no bags, or outputs that would not concatenate: torch says so)
        plan = cls(k, flat, starts, [int(w.shape[0]) for w in weights] if sizes is None else list(sizes), dim, mean,
                   sizes is not None, inverse)
        return plan if plan.valid() else None

    def valid(self) -> bool:
        """Whether every table's bag starts are in order (the first at 0, none past its ids) and
        every id's row within its table's rows: the bags torch pools as these passes do."""
        if self.k is not None:
            return bool(self.k["valid"](self.inverse, self.id_start, self.offsets, np.array(self.sizes, dtype=np.int64)))
        for i, o, rows in zip(self.flat, self.starts, self.sizes):
            if int(o[0]) != 0 or int(o[-1]) > i.numel() or (o.numel() > 1 and bool((o[1:] < o[:-1]).any())):
                return False
            if i.numel() and not 0 <= int(i.min()) <= int(i.max()) < rows:
                return False
        return True

    def rows(self, weights: Sequence[torch.Tensor]) -> torch.Tensor:
        """All tables' rows as one [rows, D] tensor: a view where they lie one after another in one
        storage (as a step's prefetched rows of tables of one width do), else a copy."""
        return weights[0].contiguous() if self.one_tensor else joined(list(weights)).contiguous()

    def forward(self, weights: Sequence[torch.Tensor]) -> torch.Tensor:
        """The tables' pooled bags, [B, T * D]."""
        if self.k is None:
            return torch.cat(self._each(weights), dim=1)
        out = torch.empty(self.bags, len(self.sizes) * self.dim)
        if len(self.sizes) > 1:  # (the output written row by row, each bag's tables in turn: see _pool_by_bag)
            self.k["pool_by_bag"](self.rows(weights).detach().numpy(), self.inverse, self.id_start, self.offsets,
                                  self.row_start, self.mean, out.numpy())
        else:
            self.k["pool"](self.rows(weights).detach().numpy(), self.inverse, self.id_start, self.offsets,
                           self.row_start, self.mean, False, out.numpy())
        return out

    def forward_apart(self, weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The tables' pooled bags, [B, D] each, each a tensor of its own (contiguous, its own
        version counter, no view of another: a custom Function's output changed in place must not
        be one), the kernel's written in one pass into one block of memory: each its part of it,
        a storage of its own (torch.from_numpy of the part: half the cost of a tensor set_ to a
        place in the block's storage, which would also have torch.save write the whole block)."""
        if self.k is None:
            return self._each(weights)
        T, B, D = len(self.sizes), self.bags, self.dim
        block = np.empty((T, B, D), np.float32)
        self.k["pool"](self.rows(weights).detach().numpy(), self.inverse, self.id_start, self.offsets, self.row_start,
                       self.mean, True, block.reshape(T * B, D))
        return [torch.from_numpy(part) for part in block]

    def _each(self, weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Torch's embedding_bag of each table (without the kernels)."""
        mode = "mean" if self.mean else "sum"
        each = weights[0].split_with_sizes(self.sizes) if self.one_tensor else weights
        return [torch.nn.functional.embedding_bag(i, w.detach(), o, mode=mode)
                for i, w, o in zip(self.flat, each, self.starts)]

    def backward(self, grad_out: torch.Tensor) -> torch.Tensor:
        """The rows' gradients, [rows of all tables, D]: each bag's output gradient added to its
        rows (a mean's times 1 / size) in the order of the ids."""
        grad_out = grad_out.to(torch.float32)
        if grad_out.stride(1) != 1 or grad_out.stride(0) < 0:
            grad_out = grad_out.contiguous()  # (the kernel takes rows of any stride, their values side by side)
        grad = torch.zeros(sum(self.sizes), self.dim)
        if self.k is not None:
            self.k["pool_backward"](grad_out.numpy(), self.inverse, self.id_start, self.offsets, self.row_start,
                                    self.mean, grad.numpy())
            return grad
        for t, (i, o, part) in enumerate(zip(self.flat, self.starts, grad.split(self.sizes))):
            lengths = torch.diff(o, append=torch.tensor([i.numel()]))
            bag = torch.repeat_interleave(torch.arange(self.bags), lengths)
            source = grad_out[:, t * self.dim:(t + 1) * self.dim].index_select(0, bag)
            if self.mean:
                source = source * (1.0 / lengths.clamp(min=1).to(torch.float32)).index_select(0, bag).unsqueeze(1)
            part.index_add_(0, i, source)
        return grad


class _Pooled(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, plan: _Plan, *weights: torch.Tensor) -> torch.Tensor:
        ctx.plan = plan
        return plan.forward(weights)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        plan: _Plan = ctx.plan
        if plan.one_tensor:  # (pooled_block's: one gradient of every table's rows, each table's reached)
            if plan.group is not None:
                plan.group.hold([True] * len(plan.sizes))
            return (None, plan.backward(grad_out) if ctx.needs_input_grad[1] else None)
        parts = plan.backward(grad_out).split_with_sizes(plan.sizes)
        return (None, *(p if need else None for p, need in zip(parts, ctx.needs_input_grad[1:])))


class _PooledApart(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, plan: _Plan, *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.plan = plan
        ctx.set_materialize_grads(False)  # (an output no backward reached: None, not zeros)
        # (each its own tensor, not a view of one output: a view a custom Function returns must not
        # be changed in place, where a module's output may be)
        return tuple(plan.forward_apart(weights))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        plan: _Plan = ctx.plan
        none = (None,) * len(grads)
        if all(g is None for g in grads):
            return (None, *none)
        grad_out = _columns_of_one(grads, plan.bags, plan.dim)
        if grad_out is None:
            grad_out = torch.cat([torch.zeros(plan.bags, plan.dim) if g is None else g.to(torch.float32)
                                  for g in grads], dim=1)
        if plan.one_tensor:  # (one gradient of every table's rows; the group says whose are gradients)
            if plan.group is not None:
                plan.group.hold([g is not None for g in grads])
            return (None, plan.backward(grad_out) if ctx.needs_input_grad[1] else None)
        parts = plan.backward(grad_out).split_with_sizes(plan.sizes)
        return (None, *(p if g is not None and need else None for p, g, need in zip(parts, grads, ctx.needs_input_grad[1:])))


def _columns_of_one(grads: Sequence[torch.Tensor | None], bags: int, dim: int) -> torch.Tensor | None:
    """The tables' output gradients as the [B, T * D] columns of one tensor they are, side by
    side in table order, where they are (the backward of a stack or concatenation of the outputs
    along dim 1, as a model joins its features' bags, hands them so, within the gradient of what
    it joins them with): no copy to join them. None where they are not (or one is missing)."""
    first = grads[0]
    if first is None or first.dim() != 2:
        return None
    width, strides = len(grads) * dim, first.stride()
    step, at, base, shape = strides[0], first.storage_offset(), first._base, (bags, dim)
    storage = first.untyped_storage().data_ptr() if base is None else 0
    if (bags > 1 and step < width) or strides[1] != 1:
        return None
    for g in grads:  # (views of one tensor share their base: their storage then goes without asking)
        if (g is None or g.storage_offset() != at or g.shape != shape or g.stride() != strides
                or g.dtype != torch.float32 or not g.is_cpu
                or (g._base is not base if base is not None else g.untyped_storage().data_ptr() != storage)):
            return None
        at += dim
    return first.as_strided((bags, width), (step, 1))


def _unique_agrees_with_torch(k: dict[str, Any]) -> bool:
    """Whether the unique kernel gives torch.unique's sorted ids and inverse, for tables of no
    ids, one, repeated ones, ids of either sign and the int64 extremes, and many ids (the hash
    table's probing and growth)."""
    gen = torch.Generator().manual_seed(0)
    cases = [torch.empty(0, dtype=torch.int64), torch.tensor([7]), torch.tensor([3, -2, 3, 3, -2]),
             torch.tensor([-(1 << 63), (1 << 63) - 1, 0, -(1 << 63)]), torch.randint(0, 50, (4, 9), generator=gen),
             torch.randint(-(1 << 62), 1 << 62, (700,), generator=gen), torch.arange(0, 4096, 16).repeat(3)]
    got = _unique_with(k, cases)
    for ids, (unique, inverse) in zip(cases, got):
        u, i = torch.unique(ids.reshape(-1), sorted=True, return_inverse=True)
        if not (torch.equal(unique, u) and torch.equal(inverse, i.view(ids.shape))):
            return False
    return True


def _pooling_agrees_with_torch(k: dict[str, Any]) -> bool:
    """Whether the kernels compute what torch's ops do (pooled() without them: embedding_bag
    forward, index_add_ of each bag's output gradient backward), bit for bit, for sum and mean
    bags of several tables (empty bags, repeated rows, widths that meet every vector loop's tail),
    and refuse the bags torch's way refuses."""
    gen = torch.Generator().manual_seed(0)
    for mean in (False, True):
        for tables, bags, dim, rows in ((1, 1, 1, 3), (3, 7, 5, 4), (2, 100, 33, 10), (4, 64, 16, 1000)):
            weights, inverses, offsets = [], [], []
            for t in range(tables):
                length = torch.randint(0 if t % 2 else 1, 4, (bags,), generator=gen)
                inverses.append(torch.randint(0, rows, (int(length.sum()),), generator=gen))
                offsets.append(torch.cat([torch.zeros(1, dtype=torch.int64), length.cumsum(0)[:-1]]))
                weights.append(torch.randn(rows, dim, generator=gen))
            grad_out = torch.randn(bags, tables * dim, generator=gen)
            got = []
            for kernels_ in (k, None):
                plan = _Plan.make(weights, inverses, offsets, mean, kernels_)
                if plan is None:
                    return False
                leaves = [w.clone().requires_grad_() for w in weights]
                out = _Pooled.apply(plan, *leaves)
                # (the gradient of sum(out * grad_out) at out is grad_out exactly; out.backward(grad_out)
                # itself would import torch's symbolic shapes, and with them sympy: 2 CPU-seconds)
                (out * grad_out).sum().backward()
                got.append([out.detach(), *(leaf.grad for leaf in leaves)])
                # (each table's output apart: the same bits, its own tensor)
                got[-1] += [torch.cat(list(_PooledApart.apply(plan, *weights)), dim=1)]
                # (and the tables' rows as one tensor, pooled_group's: the same bits, one gradient)
                group = _Plan.make([torch.cat(weights)], inverses, offsets, mean, kernels_, [rows] * tables)
                if group is None:
                    return False
                one = torch.cat(weights).requires_grad_()
                joined_out = torch.cat(list(_PooledApart.apply(group, one)), dim=1)
                (joined_out * grad_out).sum().backward()
                got[-1] += [joined_out.detach(), one.grad]
            if not all(a is not None and b is not None and _same_bits(a, b) for a, b in zip(*got)):
                return False
            each_grad = torch.cat([g for g in got[0][1:1 + tables]])
            if not (_same_bits(got[0][-3], got[0][0]) and _same_bits(got[0][-2], got[0][0])
                    and _same_bits(got[0][-1], each_grad)):
                return False
    bad = [torch.tensor([0, 2, 1]), torch.tensor([1, 0, 1]), torch.tensor([0, 1, 9])]  # out of order, not at 0, past
    return all(_Plan.make([torch.zeros(3, 2)], [torch.zeros(4, dtype=torch.int64)], [o], False, kernels_) is None
               for o in bad for kernels_ in (k, None))


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))
