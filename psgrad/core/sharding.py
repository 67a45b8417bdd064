"""The flat space (trainable parameters, then synchronized buffers), its shard plan (contiguous
balanced ranges) and the job fingerprint; pure. torch is imported where a model is read, not at
import: `psgrad status` (ParamSpec, through the status it prints) stays light."""
from __future__ import annotations

import dataclasses

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from psgrad.core.job import JobSpec
from psgrad.core.optimizer_settings import DECLS, with_optimizer
from psgrad.errors import ConfigError

if TYPE_CHECKING:
    import torch


#: the most sightings of an id the servers count (a byte a counter: see the admission sketch in
#: server/row_index.py); a min_count above it would never admit a row
MIN_COUNT_MAX = 255


def check_lifetime(min_count: object, ttl: object, where: str = "") -> None:
    """A table's admission and expiry settings (min_count, ttl): integers >= 0 (0: off), min_count
    at most MIN_COUNT_MAX. where: what the message names first ("table 'x': ").

    Raises:
        ConfigError: either is out of range or not an integer.
    """
    for name, value in (("min_count", min_count), ("ttl", ttl)):
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            raise ConfigError(f"{where}{name} must be an integer >= 0 (0: off), got {value!r}")
    assert isinstance(min_count, int)
    if min_count > MIN_COUNT_MAX:
        raise ConfigError(f"{where}min_count={min_count}: the servers count at most {MIN_COUNT_MAX} sightings of an "
                          f"id, so no row would ever be admitted; use a min_count of {MIN_COUNT_MAX} or less")


@dataclass(frozen=True)
class ParamSpec:
    """One trainable parameter as it appears in named_parameters() order, or (buffer=True) one of
    the model's synchronized buffers, which follow all parameters in the flat space."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    buffer: bool = False
    #: the other names the model's state_dict has for the same tensor (tied weights: an LM's
    #: output layer sharing the embedding); exports write the tensor under each of them too
    aliases: tuple[str, ...] = ()
    #: its parameter group's settings (ps.optimizer(model, param_groups=...)): a multiplier of the
    #: job's lr, and a weight decay of its own (None: the job's)
    lr_scale: float = 1.0
    weight_decay: float | None = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class TableSpec:
    """A sparse (embedding) table of the job: num_embeddings rows of dim float32 values (0: a
    dynamic table, any int64 id), row r on shard r mod S (dynamic: by r's hash, core/rows.py),
    starting as N(0, std²) draws from (seed, name, r), stored at its first update."""

    name: str
    num_embeddings: int
    dim: int
    seed: int = 0
    std: float = 1.0
    #: its parameter group's settings (ps.optimizer(model, param_groups=...)): a multiplier of the
    #: job's lr, and its own values of the job optimizer's settings, as sorted (JobSpec field, value)
    lr_scale: float = 1.0
    settings: tuple[tuple[str, float], ...] = ()
    #: admission: an id's updates are applied once it has been seen in that many updates (0, 1: at once)
    min_count: int = 0
    #: expiry: a row no update touched in that many updates of its table is dropped (0: never)
    ttl: int = 0
    #: at the servers' memory budget, drop the least recently updated rows instead of refusing
    evict: bool = False
    #: its parameter group's own optimizer for its rows (a name of optimizer_settings.DECLS; "": the
    #: job's): its settings then start from that optimizer's torch defaults, not the job's
    optimizer: str = ""
    #: its other names in the model's state_dict (one module registered under several names: a
    #: two-tower model's shared item table); exports write its entries under each of them too. Only
    #: names, not what the job is: neither compared nor in the fingerprint (a worker, or a
    #: checkpoint of an older psgrad, without them is the same job; the chief's Init gives them)
    aliases: tuple[str, ...] = dataclasses.field(default=(), compare=False)
    #: the name its initial rows are drawn under where it is not `name` ("": its own): a loaded
    #: state's (its `table` entry), when a model that loaded a table's state_dict under another
    #: prefix (a wrapper's `module.` added or stripped) starts a job, so the rows the state does not
    #: list start as they did in the job that wrote it. The chief's (its loaded model's), which its
    #: Init gives: not compared, nor in the fingerprint (the other workers need not load the state)
    drawn_as: str = dataclasses.field(default="", compare=False)

    def __post_init__(self) -> None:  # (a checkpoint's JSON gives lists)
        object.__setattr__(self, "settings", tuple(sorted((str(k), float(v)) for k, v in self.settings)))
        object.__setattr__(self, "aliases", tuple(str(a) for a in self.aliases))
        object.__setattr__(self, "drawn_as", "" if self.drawn_as == self.name else str(self.drawn_as))
        check_lifetime(self.min_count, self.ttl, f"table {self.name!r}: ")
        object.__setattr__(self, "evict", bool(self.evict))
        if self.optimizer and self.optimizer not in DECLS:
            raise ConfigError(f"table {self.name!r}: no optimizer {self.optimizer!r}; valid: {', '.join(DECLS)}")

    @property
    def draw_name(self) -> str:
        """The name its initial rows are drawn under (core/rows.py's table_key): drawn_as, or its own."""
        return self.drawn_as or self.name

    @property
    def lifetime(self) -> tuple[int, int, bool]:
        """(min_count, ttl, evict): how the table admits, expires and evicts rows."""
        return self.min_count, self.ttl, self.evict

    @property
    def nbytes(self) -> int:
        """The whole table's bytes (float32)."""
        return self.num_embeddings * self.dim * 4

    @property
    def grouped(self) -> bool:
        """Whether its parameter group sets anything (else: the job's settings)."""
        return self.lr_scale != 1.0 or bool(self.settings) or bool(self.optimizer)

    def job_spec(self, spec: JobSpec) -> JobSpec:
        """The job spec with the table's own optimizer and settings (validated as the job's are):
        the job's optimizer and settings, or the table's own optimizer at its torch defaults; then
        the group's settings over them. The lr stays the job's (the table's is lr_scale times it).

        Raises:
            ConfigError: a setting that is not its optimizer's, or out of its range (named).
        """
        if self.optimizer:
            spec = with_optimizer(spec, self.optimizer)
        if not self.settings:
            return spec
        fields = {f.name: f for f in dataclasses.fields(spec)}
        own: dict[str, object] = {}
        for key, value in self.settings:
            f = fields.get(key)
            if f is None:
                raise ConfigError(f"table {self.name!r}: no optimizer setting {key!r}")
            own[key] = bool(value) if f.type in ("bool", bool) else value
        try:
            return dataclasses.replace(spec, **own)  # type: ignore[arg-type]
        except ConfigError as exc:
            raise ConfigError(f"table {self.name!r}'s param group: {exc}") from None


def _spec(name: str, t: torch.Tensor, buffer: bool = False) -> ParamSpec:
    return ParamSpec(name, tuple(int(d) for d in t.shape), str(t.dtype).removeprefix("torch."), buffer)


def param_specs(model: torch.nn.Module, frozen: bool = False) -> list[ParamSpec]:
    """The model's trainable parameters, in named_parameters() order, each with its other names
    (a parameter tied to another module appears once, under its first name). frozen=True: its
    frozen parameters (requires_grad=False) instead, the same way (see frozen_ranges)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [dataclasses.replace(_spec(name, p), aliases=tuple(names[id(p)][1:]))
            for name, p in model.named_parameters() if p.requires_grad != frozen]


#: The dtypes the frozen space holds as float32 values (float32 holds every value of theirs); any
#: other's values are held as their bytes, 4 to a float32 element (see frozen_words).
FROZEN_AS_FLOAT32 = ("float32", "float16", "bfloat16")


def frozen_words(p: ParamSpec) -> int:
    """How many float32 elements of the frozen space `p` takes: its numel where its dtype is one of
    FROZEN_AS_FLOAT32 (its values, as float32), else its bytes' worth, rounded up (a float64,
    integer, bool or complex tensor held bit for bit: no float32 rounding of its values)."""
    if p.dtype in FROZEN_AS_FLOAT32:
        return p.numel
    import torch

    return -(-p.numel * getattr(torch, p.dtype).itemsize // 4)


def frozen_ranges(frozen: Sequence[ParamSpec], num_shards: int) -> tuple[tuple[int, int], ...]:
    """The frozen space (the frozen parameters and the kept buffers, in order, each as
    frozen_words says: a space of float32 elements of its own, apart from the flat space a step
    pushes and pulls) split into num_shards contiguous ranges whose sizes differ by at most one; a
    shard's range may be empty."""
    total = sum(frozen_words(p) for p in frozen)
    bounds = [(i * total) // num_shards for i in range(num_shards + 1)]
    return tuple(zip(bounds[:-1], bounds[1:]))


def frozen_space(entries: Sequence[tuple[ParamSpec, torch.Tensor]]) -> torch.Tensor:
    """The frozen space of these tensors (float32, CPU): each one's values as float32 where its
    dtype is one of FROZEN_AS_FLOAT32, else its bytes (see frozen_words); frozen_tensors reads it."""
    import torch

    out = torch.zeros(sum(frozen_words(p) for p, _ in entries))
    at = 0
    with torch.no_grad():
        for p, t in entries:
            n = frozen_words(p)
            if p.dtype in FROZEN_AS_FLOAT32:
                out[at:at + n].copy_(t.detach().reshape(-1))
            else:
                raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                out[at:at + n].view(torch.uint8)[:raw.numel()].copy_(raw)
            at += n
    return out


def frozen_tensors(specs: Sequence[ParamSpec], space: torch.Tensor) -> dict[str, torch.Tensor]:
    """The frozen space (as frozen_space writes it) cut into {name: tensor of its shape and dtype},
    in order, each also under its other names (aliases)."""
    import torch

    out: dict[str, torch.Tensor] = {}
    at = 0
    for p in specs:
        n = frozen_words(p)
        dtype = getattr(torch, p.dtype)
        piece = space[at:at + n]
        if p.dtype in FROZEN_AS_FLOAT32:
            value = piece.to(dtype).reshape(p.shape).clone()
        else:  # (a copy first: a view of another dtype needs an aligned start)
            value = piece.contiguous().view(torch.uint8)[:p.numel * dtype.itemsize].clone().view(dtype).reshape(p.shape)
        out[p.name] = value
        for alias in p.aliases:
            out[alias] = value
        at += n
    return out


def _persistent_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor, tuple[str, ...]]]:
    """The model's persistent buffers (those in its state_dict), in named_buffers() order, each
    with its other names (a buffer registered in several modules appears once, under its first)."""
    keys = set(model.state_dict().keys())
    names: dict[int, list[str]] = {}
    for name, b in model.named_buffers(remove_duplicate=False):
        if name in keys:
            names.setdefault(id(b), []).append(name)
    return [(name, b, tuple(names[id(b)][1:])) for name, b in model.named_buffers() if name in keys]


def _wire_holds(b: torch.Tensor, wire_dtype: str) -> bool:
    """Whether every value of `b` comes back from the wire dtype (and float32) as it is."""
    import torch

    if b.dtype == torch.bool or b.is_complex():
        return False
    if b.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return True  # (the weights' own kind: they travel as the weights do, in the wire dtype)
    back = b.to(getattr(torch, wire_dtype)).to(b.dtype)
    same = back == b
    if b.is_floating_point():
        same |= back.isnan() & b.isnan()
    return bool(same.all())


def split_buffers(model: torch.nn.Module, wire_dtype: str = "float32"
                  ) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """The buffers the servers keep for the model (its persistent ones, those in its state_dict, in
    named_buffers() order), as (synced, kept). Synced: those of a float32, float16 or bfloat16
    dtype (BatchNorm's running statistics), and those of another dtype whose every value the wire
    dtype holds exactly (BatchNorm's num_batches_tracked): they are the flat space's tail, moved
    by the workers' averaged deltas (model_buffers.py). Kept: the others (a bool mask, an int64 id
    map with ids past 2**24, a float64 constant float32 would round): held exactly in the frozen
    space, the chief's values, read by every worker as it joins, never averaged. Decided from the
    values when called (ps.optimizer(model)): every worker's model must hold the same such values.
    Non-persistent buffers (masks, caches) stay local."""
    synced: list[tuple[str, torch.Tensor]] = []
    kept: list[tuple[str, torch.Tensor]] = []
    for name, b, _ in _persistent_buffers(model):
        (synced if _wire_holds(b, wire_dtype) else kept).append((name, b))
    return synced, kept


def synced_buffers(model: torch.nn.Module, wire_dtype: str = "float32") -> list[tuple[str, torch.Tensor]]:
    """The buffers the flat space holds for the model: split_buffers' synced ones."""
    return split_buffers(model, wire_dtype)[0]


def buffer_specs(model: torch.nn.Module, wire_dtype: str = "float32", kept: bool = False) -> list[ParamSpec]:
    """The synced buffers of the model (kept=True: its kept ones; see split_buffers) as ParamSpecs
    (buffer=True), each with its other names."""
    aliases = {name: other for name, _, other in _persistent_buffers(model)}
    chosen = split_buffers(model, wire_dtype)[1 if kept else 0]
    return [dataclasses.replace(_spec(name, b, buffer=True), aliases=aliases[name]) for name, b in chosen]


@dataclass(frozen=True)
class ShardPlan:
    """S contiguous [start, end) ranges covering the flat space of `total` elements."""

    total: int
    ranges: tuple[tuple[int, int], ...]

    @property
    def num_shards(self) -> int:
        return len(self.ranges)

    def size(self, shard: int) -> int:
        start, end = self.ranges[shard]
        return end - start

    def pieces(self, params: Sequence[ParamSpec], shard: int) -> list[tuple[str, int, int]]:
        """(parameter name, first element, end element) of each parameter slice inside the shard."""
        start, end = self.ranges[shard]
        out = []
        offset = 0
        for p in params:
            lo, hi = max(start, offset), min(end, offset + p.numel)
            if lo < hi:
                out.append((p.name, lo - offset, hi - offset))
            offset += p.numel
        return out


def plan_shards(params: Sequence[ParamSpec], num_shards: int, tables: bool = False) -> ShardPlan:
    """Split the flat space into num_shards contiguous ranges whose sizes differ by at most one.

    A tensor larger than one shard's share is split across servers; the plan depends only on
    the parameter sizes and num_shards, so every worker computes the same one. tables: the job
    has sparse tables, whose rows every shard holds a part of, so a shard may hold no dense
    element (a recommender whose dense part is a bias, on more servers than it has elements);
    without tables such a server would hold nothing.

    Raises:
        ConfigError: num_shards < 1, or (without tables) fewer elements than shards, none included.
    """
    if num_shards < 1:
        raise ConfigError(f"num_shards must be >= 1, got {num_shards}")
    total = sum(p.numel for p in params)
    if total < num_shards and not tables:
        raise ConfigError(
            f"the model has {total} trainable elements, fewer than {num_shards} shards: a server would hold nothing; "
            "use fewer servers"
        )
    bounds = [(i * total) // num_shards for i in range(num_shards + 1)]
    return ShardPlan(total, tuple(zip(bounds[:-1], bounds[1:])))


def _param_doc(p: ParamSpec) -> list[object]:
    return [p.name, list(p.shape), p.dtype, *(["buffer"] if p.buffer else []),
            *(["aliases", *p.aliases] if p.aliases else []),
            *(["lr_scale", p.lr_scale] if p.lr_scale != 1.0 else []),
            *(["weight_decay", p.weight_decay] if p.weight_decay is not None else [])]


def fingerprint(params: Sequence[ParamSpec], spec: JobSpec, tables: Sequence[TableSpec] = (),
                frozen: Sequence[ParamSpec] = ()) -> str:
    """A hash of the parameter (and buffer) names, shapes, dtypes, the sparse tables, the frozen
    parameters the servers keep and the job spec (which includes S)."""
    job = spec.as_dict()
    for name in ("compress", "error_feedback"):  # (an uncompressed job keeps the fingerprint it always had)
        if job[name] == getattr(JobSpec, name):
            del job[name]
    doc: dict[str, object] = {
        "params": [_param_doc(p) for p in params],
        "spec": job,
    }
    if frozen:  # (a job without frozen parameters on the servers keeps the fingerprint it always had)
        doc["frozen"] = [_param_doc(p) + ([] if p.dtype in FROZEN_AS_FLOAT32 else ["bytes"]) for p in frozen]
    if tables:  # (a job without sparse tables keeps the fingerprint it always had)
        doc["tables"] = [[t.name, t.num_embeddings, t.dim, t.seed, t.std,
                          *(["lr_scale", t.lr_scale] if t.lr_scale != 1.0 else []),
                          *(["settings", [list(kv) for kv in t.settings]] if t.settings else []),
                          *(["lifetime", list(t.lifetime)] if t.lifetime != (0, 0, False) else []),
                          *(["optimizer", t.optimizer] if t.optimizer else [])] for t in tables]
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]
