"""psgrad.EmbeddingBagCollection: several embedding-bag tables whose rows live on the servers, looked up
together from keyed features (a dict of id tensors, or TorchRec's KeyedJaggedTensor: keys / values /
lengths), so a forward makes one pull per shard for all its tables. Each table is a
psgrad.EmbeddingBag of its own inside it (a job's table, named by its place in the model), looked up
by one feature or, as TorchRec's `feature_names`, by several; the forward pools each feature's bags
and concatenates the features' outputs, as TorchRec's EmbeddingBagCollection does."""
from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.nn import functional as F

from psgrad.errors import ConfigError
from psgrad.nn import lookups
from psgrad.nn.embedding import EMBEDDING_BAG_MODES, EmbeddingBag, read_together, read_versions, unique_ids_of

# feature -> (ids, bag offsets (None: a 2-D tensor of one bag per row))
Features = dict[str, tuple[torch.Tensor, torch.Tensor | None]]
# feature -> (ids, bag offsets, per-sample weights (None: unweighted))
Parsed = dict[str, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]

# torch.nn.EmbeddingBag's (and TorchRec's) options a collection does not take, and what to do instead
_OTHER_MODULE = "a feature that needs it can be a psgrad.EmbeddingBag of its own beside the collection, which takes it"
REFUSED_OPTIONS = {
    "padding_idx": ("a collection's tables take no padding id; leave the padding ids out of the features (shorter "
                    f"bags: a KeyedJaggedTensor's lengths say how many ids each bag has), or {_OTHER_MODULE}"),
    "include_last_offset": ("a collection's offsets are where each bag starts (or a KeyedJaggedTensor's lengths); "
                            f"pass offsets[:-1] for offsets that end with the ids' count, or {_OTHER_MODULE}"),
    "max_norm": ("psgrad embeddings do not renormalize rows (they live on the servers, which a forward does not "
                 "write); bound what the model sees in its forward instead (out * (max_norm / out.norm(dim=-1, "
                 "keepdim=True)).clamp(max=1)), or the updates with psgrad.clip_grad_norm_"),
    "norm_type": "it is read only with max_norm, which psgrad embeddings do not take",
    "scale_grad_by_freq": _OTHER_MODULE,
    "device": ("the rows live on the servers and the output is on the features' device: build the collection "
               "without one"),
}


class EmbeddingBagCollection(nn.Module):
    """Tables of embedding bags looked up together: `tables` maps each table's name to its
    (num_embeddings, embedding_dim) (num_embeddings None: a dynamic table, any int64 id); each
    table is looked up by the feature of its name or, as TorchRec's `feature_names`, by the
    features `feature_names[table]` lists (several features sharing one table: a two-tower
    model's history and candidate items). forward(features) takes, for every feature, its ids: a
    2-D tensor (one bag per row), a pair (ids 1-D, offsets 1-D: bags starting at each offset), or
    a JaggedTensor-like object (values(), lengths(): TorchRec's kjt.to_dict()), in a dict; or the
    whole batch as a KeyedJaggedTensor-like object (keys(), values(), lengths(): the lengths of
    every bag, key after key), whose keys of no feature here are ignored, as TorchRec's collection
    ignores them (a dict's are refused: a misspelt feature). It returns [batch, sum of the dims]:
    each feature's pooled bags (mode "sum", "mean" or "max"), the tables in the order of
    `tables`, each table's features in the order of its `feature_names`.

    Weights (mode "sum", as torch.nn.EmbeddingBag's per_sample_weights): a triple (ids, offsets,
    weights) or (2-D ids, None, 2-D weights) in the dict gives a feature's weights, always
    applied; a KeyedJaggedTensor's (or JaggedTensor's) weights follow is_weighted, as in TorchRec:
    True, each id's weight multiplies its row (the features must carry weights); False (the
    default), the features must carry none: a KeyedJaggedTensor with weights is refused, naming
    is_weighted=True (TorchRec's unweighted collection ignores them, and psgrad applied them
    before is_weighted existed: neither silently).

    Bound by ps.optimizer(model) like psgrad.EmbeddingBag (its tables are `<name>.bags.<table>`);
    a training forward pulls the unique ids of every table in one call per shard.

    min_count, ttl, evict: every table's row lifetime, as psgrad.EmbeddingBag takes them (an id's
    updates applied once it was seen in min_count updates; a row no update touched in ttl updates
    of its table dropped; evict: at the servers' memory budget the least recently updated rows
    dropped instead of refusing the push), for a collection of dynamic tables above all. Tables
    that need other values go in a collection (or a psgrad.EmbeddingBag) of their own. torch's
    options padding_idx, include_last_offset, max_norm and scale_grad_by_freq are refused (a
    ConfigError saying what to do instead); sparse is accepted and changes nothing, as for
    psgrad.EmbeddingBag.
    """

    def __init__(self, tables: Mapping[str, tuple[int | None, int]], mode: str = "sum", std: float = 1.0,
                 seed: int = 0, *, is_weighted: bool = False, feature_names: Mapping[str, Sequence[str]] | None = None,
                 min_count: int = 0, ttl: int = 0, evict: bool = False, sparse: bool = False, **options: Any) -> None:
        super().__init__()
        for option in options:
            if option in REFUSED_OPTIONS:
                raise ConfigError(f"EmbeddingBagCollection takes no {option}=: {REFUSED_OPTIONS[option]}")
            raise TypeError(f"EmbeddingBagCollection() got an unexpected keyword argument {option!r}")
        if not isinstance(tables, Mapping) or not tables:
            raise ConfigError("an EmbeddingBagCollection needs at least one table: {name: (num_embeddings, dim)}")
        for name, shape in tables.items():
            if not (isinstance(shape, (tuple, list)) and len(shape) == 2
                    and all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in shape)
                    and shape[1] is not None):
                raise ConfigError(f"table {name!r}: give (num_embeddings, embedding_dim) as two integers "
                                  f"(num_embeddings None: a dynamic table, any int64 id), got {shape!r}")
            if not isinstance(name, str) or not name or "." in name or hasattr(nn.ModuleDict, name):
                raise ConfigError(f"table {name!r}: a table's name is the name of its module in the collection's "
                                  "ModuleDict (`bags`), as in TorchRec's: a str without '.', and not one of "
                                  "ModuleDict's attributes (items, keys, values, type, train, ...). Rename the table "
                                  "(say 'item' or 'items_table'); its features may keep any name: feature_names="
                                  "{table: [features]}")
        if mode not in EMBEDDING_BAG_MODES:
            raise ConfigError(f"mode must be one of {', '.join(EMBEDDING_BAG_MODES)}, got {mode!r}")
        if not isinstance(is_weighted, bool):
            raise ConfigError(f"is_weighted must be True or False, got {is_weighted!r}")
        if is_weighted and mode != "sum":
            raise ConfigError(f"is_weighted=True needs mode 'sum' (weights multiply rows in a sum, as "
                              f"torch.nn.EmbeddingBag's per_sample_weights), got mode {mode!r}")
        self.bags = nn.ModuleDict({name: EmbeddingBag(None if n is None else int(n), int(d), mode=mode, std=std,
                                                      seed=seed, min_count=min_count, ttl=ttl, evict=evict,
                                                      sparse=sparse)
                                   for name, (n, d) in tables.items()})
        self.mode = mode
        self._is_weighted = is_weighted
        self._feature_tables = _feature_tables(list(tables), feature_names)

    def is_weighted(self) -> bool:
        """Whether a KeyedJaggedTensor's weights weigh the ids (TorchRec's is_weighted())."""
        return self._is_weighted

    @property
    def features(self) -> list[str]:
        """The features' names, in the order of the output's columns."""
        return list(self._feature_tables)

    @property
    def feature_tables(self) -> dict[str, str]:
        """Each feature's table (a name of `tables`), in the order of the output's columns."""
        return dict(self._feature_tables)

    @property
    def output_dim(self) -> int:
        return sum(self._bag(table).embedding_dim for table in self._feature_tables.values())

    def _bags(self) -> list[EmbeddingBag]:
        return [bag for bag in self.bags.values() if isinstance(bag, EmbeddingBag)]

    def _bag(self, table: str) -> EmbeddingBag:
        bag = self.bags[table]
        assert isinstance(bag, EmbeddingBag)
        return bag

    @property
    def requires_grad(self) -> bool:
        """Whether any of its tables takes gradients (see requires_grad_)."""
        return any(bag.requires_grad for bag in self._bags())

    def requires_grad_(self, requires_grad: bool = True) -> EmbeddingBagCollection:
        """Freeze (False) or unfreeze (True) every table of the collection (psgrad.EmbeddingBag's
        requires_grad_: frozen rows take no gradient, and the servers' rows do not move)."""
        for bag in self._bags():
            bag.requires_grad_(requires_grad)
        super().requires_grad_(requires_grad)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients of the rows its tables' forwards touched since the last step (see
        psgrad.EmbeddingBag.zero_grad)."""
        for bag in self._bags():
            bag.zero_grad(set_to_none)

    def split(self, features: Any) -> Features:
        """Each feature's (ids, offsets) from what forward takes (see the class doc).

        Raises:
            ConfigError: a feature missing or unknown, ids and offsets of shapes that make no bags
                (2-D ids with offsets, 1-D ids without, offsets not 1-D), or lengths that do not add
                up to the ids.
        """
        return {name: (ids, offsets) for name, (ids, offsets, _) in self._parse(features).items()}

    def per_sample_weights(self, features: Any) -> dict[str, torch.Tensor] | None:
        """Each weighted feature's per-sample weights (the shape of its ids), from what forward
        takes; None: no feature is weighted.

        Raises:
            ConfigError: weights that are not floating point, or not one per id; weights of a
                KeyedJaggedTensor that is_weighted does not take, or none where it needs them.
        """
        out = {name: w for name, (_, _, w) in self._parse(features).items() if w is not None}
        return out or None

    def _parse(self, features: Any) -> Parsed:
        """Each feature's (ids, offsets, weights) from what forward takes, checked.

        Raises:
            ConfigError: see split and per_sample_weights.
        """
        known = self._feature_tables
        if _keyed(features):
            keys = [str(k) for k in features.keys()]
            weights = self._carried_weights(features, "keyed features")
            parsed = {key: part for key, part in _jagged(keys, features.values(), features.lengths(), weights,
                                                         "keyed features").items()
                      if key in known}  # (TorchRec's collection ignores the keys of no feature of its)
            unknown: set[str] = set()
        elif isinstance(features, Mapping):
            parsed = {}
            for name, value in features.items():
                name = str(name)
                if isinstance(value, (tuple, list)) and len(value) in (2, 3):
                    parsed[name] = (value[0], value[1], value[2] if len(value) == 3 else None)
                elif isinstance(value, torch.Tensor) and value.dim() == 2:
                    parsed[name] = (value, None, None)
                elif _jagged_tensor(value):  # (TorchRec's JaggedTensor: a KeyedJaggedTensor's to_dict())
                    lengths = value.lengths() if callable(getattr(value, "lengths", None)) else _lengths(value.offsets())
                    weights = self._carried_weights(value, f"feature {name!r}")
                    parsed[name] = _jagged([name], value.values(), lengths, weights, f"feature {name!r}")[name]
                else:
                    raise ConfigError(f"feature {name!r}: give a 2-D tensor of ids (one bag per row), a pair "
                                      "(ids, offsets), a triple (ids, offsets, per-sample weights), or a JaggedTensor")
            unknown = set(parsed) - set(known)
        else:
            raise ConfigError(f"an EmbeddingBagCollection takes a dict of features or a KeyedJaggedTensor, got "
                              f"{type(features).__name__}")
        missing = set(known) - set(parsed)
        if missing or unknown:
            ignored = (" (a KeyedJaggedTensor's other keys are ignored, as TorchRec's collection ignores them; a "
                       "dict's are refused, as a misspelt feature would be)" if unknown else "")
            raise ConfigError(f"features: missing {sorted(missing)}, unknown {sorted(unknown)}; the features are "
                              f"{self.features}{ignored}")
        batch: dict[str, int] = {}
        weighted = False
        for name, (ids, offsets, w) in parsed.items():  # (one pass: a forward's every feature, every step)
            if not isinstance(ids, torch.Tensor) or not (offsets is None or isinstance(offsets, torch.Tensor)):
                raise ConfigError(f"feature {name!r}: ids and offsets must be tensors, got "
                                  f"{type(ids).__name__} and {type(offsets).__name__}")
            if offsets is None:
                if ids.dim() != 2:
                    raise ConfigError(f"feature {name!r}: ids without offsets are one bag per row, so 2-D, got "
                                      f"{ids.dim()}-D {list(ids.shape)}: pass (ids, offsets) for 1-D ids")
                batch[name] = int(ids.shape[0])
            else:
                if ids.dim() != 1 or offsets.dim() != 1:
                    raise ConfigError(f"feature {name!r}: ids with offsets must be 1-D and the offsets 1-D, one per "
                                      f"bag, got ids {list(ids.shape)} and offsets {list(offsets.shape)} (2-D ids are "
                                      "a bag per row: pass them without offsets)")
                batch[name] = int(offsets.shape[0])
            if w is None:
                continue
            weighted = True
            if not (isinstance(w, torch.Tensor) and w.is_floating_point() and tuple(w.shape) == tuple(ids.shape)):
                raise ConfigError(f"feature {name!r}: per-sample weights must be a floating-point tensor shaped as its "
                                  f"ids {list(ids.shape)}, got {getattr(w, 'dtype', type(w).__name__)} "
                                  f"{list(getattr(w, 'shape', []))}")
            parsed[name] = (ids, offsets, w.to(torch.float32))  # (the rows' dtype, as torch's pooling needs)
        if len(set(batch.values())) > 1:
            raise ConfigError(f"features of different batch sizes: {', '.join(f'{n!r} has {b} bags' for n, b in batch.items())}; "
                              "every feature needs one bag per example (an example without ids: an empty bag)")
        if weighted and self.mode != "sum":
            raise ConfigError(f"weighted features need mode 'sum' (as torch.nn.EmbeddingBag's per_sample_weights); "
                              f"this collection's mode is {self.mode!r}")
        return {name: parsed[name] for name in known}

    def _carried_weights(self, features: Any, what: str) -> torch.Tensor | None:
        """The weights a KeyedJaggedTensor (or JaggedTensor) carries, as is_weighted takes them.

        Raises:
            ConfigError: weights and is_weighted=False, or none and is_weighted=True.
        """
        weights = _kjt_weights(features)
        if weights is not None and not self._is_weighted:
            raise ConfigError(
                f"{what}: weights given (weights_or_none()), and this collection is not weighted: build it with "
                "is_weighted=True (mode 'sum') for each id's weight to multiply its row, or pass the features "
                "without weights (TorchRec's unweighted collection ignores them; psgrad applied them before "
                "is_weighted existed, and does neither silently)")
        if weights is None and self._is_weighted:
            raise ConfigError(f"{what}: no weights given (weights_or_none() is None), and this collection is weighted "
                              "(is_weighted=True): give each id its weight, or build the collection without is_weighted")
        return weights

    def _tables_of(self, parts: Sequence[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]
                   ) -> tuple[list[EmbeddingBag], list[torch.Tensor], list[torch.Tensor]]:
        """(the tables, the unique ids each reads, each feature's ids as indices into its table's
        unique ids) for the features' `parts` (in the order of self.features): a table that several
        features look up reads their ids' unique ids together, in one pull."""
        bags = self._bags()
        at: dict[str, list[int]] = {}
        for k, table in enumerate(self._feature_tables.values()):
            at.setdefault(table, []).append(k)
        groups = [at[name] for name in self.bags]
        inputs = [parts[g[0]][0] if len(g) == 1 else torch.cat([parts[k][0].reshape(-1) for k in g]) for g in groups]
        uniques, inverses = [], [torch.empty(0)] * len(parts)
        for g, (unique, inverse) in zip(groups, unique_ids_of(bags, inputs)):
            uniques.append(unique)
            pieces = [inverse] if len(g) == 1 else inverse.split([parts[k][0].numel() for k in g])
            for k, piece in zip(g, pieces):
                shape = parts[k][0].shape
                inverses[k] = piece if piece.shape == shape else piece.view(shape)
        return bags, uniques, inverses

    def lookup(self, features: Any) -> dict[str, torch.Tensor]:
        """The rows a forward of `features` reads, by table (what a prefetch asks the servers for)."""
        bags, uniques, _ = self._tables_of(list(self._parse(features).values()))
        return {bag.table or "": u for bag, u in zip(bags, uniques)}

    def forward(self, features: Any) -> torch.Tensor:
        parts = list(self._parse(features).values())
        tables = list(self._feature_tables.values())
        modules = self.bags._modules  # (every table has a feature: these are all the bags)
        feature_bags = [cast(EmbeddingBag, modules[table]) for table in tables]
        if any(bag._source is None for bag in feature_bags):  # unbound: each bag serves a loaded state, or says why not
            return torch.cat([bag(ids, offsets, w) for bag, (ids, offsets, w) in zip(feature_bags, parts)], dim=1)
        if len(feature_bags) == len(modules):  # (a feature per table: the tables' rows may be one tensor)
            out = self._pooled_together(feature_bags, parts)
            if out is not None:
                return out
        bags, uniques, inverses = self._tables_of(parts)
        source = bags[0].bound_source()
        training = bags[0]._training()
        got = source.pull_tables({bag.table or "": u for bag, u in zip(bags, uniques)}, not training, checked=True)
        device = {table: parts[k][0].device for k, table in reversed(list(enumerate(tables)))}  # its first feature's
        rows = {name: bag.attach_rows(u, got[bag.table or ""], device[name], training, read_versions(got, bag.table or ""))
                for name, bag, u in zip(self.bags, bags, uniques)}
        weights = [rows[table] for table in tables]
        offsets = [o for _, o, _ in parts]
        names = [bag.table or table for bag, table in zip(feature_bags, tables)]
        weighted = any(w is not None for _, _, w in parts)
        dtype = functools.reduce(torch.promote_types, [bag.dtype for bag in bags])  # (the bags': model.half() ...)
        if not weighted and all(bag.plain_bags() and bag.mode == self.mode for bag in bags):  # all in one pass
            out = lookups.pooled(weights, inverses, offsets, self.mode == "mean", names)
            if out is not None:  # (else it checked the offsets it leaves to torch's pooling)
                return out.to(dtype)
        else:  # (max or weighted bags: torch's pooling)
            lookups.check_offsets(inverses, offsets, names)
        return torch.cat([F.embedding_bag(inverse, weight, o, mode=bag.mode, per_sample_weights=w)
                          for bag, weight, inverse, o, (_, _, w) in zip(feature_bags, weights, inverses, offsets, parts)],
                         dim=1).to(dtype)

    def _pooled_together(self, bags: list[EmbeddingBag],
                         parts: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]) -> torch.Tensor | None:
        """A forward of tables looked up by a feature each, of one width, plain sum or mean bags
        without weights, ids and offsets (int64) on the CPU: every table's rows read as one tensor
        (embedding.read_together: for a training forward one leaf, one gradient to accumulate, and
        the step pushes it whole) and pooled from it in one pass each way (lookups.pooled_block).
        None: not such a forward (forward reads and pools table by table)."""
        dim = bags[0].embedding_dim
        if not all(bag.plain_bags() and bag.mode == self.mode and bag.embedding_dim == dim for bag in bags):
            return None
        for ids, offsets, weights in parts:
            if weights is not None or not ids.is_cpu or not (offsets is None or (offsets.dtype == torch.int64
                                                                                and offsets.is_cpu)):
                return None
            if not (ids.shape[0] if offsets is None else offsets.numel()):
                return None  # (a batch of no bags: nothing the pooling serves)
        read = read_together(bags, [ids for ids, _, _ in parts], observe=not bags[0]._training())
        if read is None:
            return None
        sizes = [int(unique.numel()) for unique in read.uniques]
        offsets_ = [offsets for _, offsets, _ in parts]
        names = [bag.table or "" for bag in bags]
        dtype = bags[0].dtype  # (the bags': model.half() ...)
        if any(bag.dtype != dtype for bag in bags):
            dtype = functools.reduce(torch.promote_types, [bag.dtype for bag in bags])
        out = lookups.pooled_block(read.rows, sizes, read.inverses, offsets_, self.mode == "mean", names, read.group,
                                   read.inverse)
        # (None: bags the compiled pooling does not take, whose offsets it found valid: forward reads
        # and pools table by table; the parts read here get no gradient, and are not pushed)
        return None if out is None else out.to(dtype)


def _feature_tables(tables: list[str], feature_names: Mapping[str, Sequence[str]] | None) -> dict[str, str]:
    """Each feature's table, in the order of the output's columns: the tables in order, each
    looked up by the features feature_names lists for it (by default, the feature of its name).

    Raises:
        ConfigError: feature_names of a table the collection does not have, a table with no
            feature, or a feature of two tables.
    """
    if not isinstance(feature_names, (Mapping, type(None))):
        raise ConfigError(f"feature_names maps a table's name to the features that look it up, got "
                          f"{type(feature_names).__name__}")
    names = dict(feature_names or {})
    unknown = [t for t in names if t not in tables]
    if unknown:
        raise ConfigError(f"feature_names names table(s) {unknown} the collection does not have; its tables are {tables}")
    out: dict[str, str] = {}
    for table in tables:
        listed = names.get(table, [table])
        if isinstance(listed, str) or not isinstance(listed, Sequence) or not listed:
            raise ConfigError(f"feature_names[{table!r}]: give a list of one feature or more, got {listed!r}")
        for feature in listed:
            if not isinstance(feature, str):
                raise ConfigError(f"feature_names[{table!r}]: a feature's name is a str, got {feature!r}")
            if feature in out:
                raise ConfigError(f"feature {feature!r} looks up two tables ({out[feature]!r} and {table!r}); a "
                                  "feature looks up one table (list it in feature_names of one)")
            out[feature] = table
    return out


def _keyed(features: Any) -> bool:
    """Whether `features` is a KeyedJaggedTensor-like object (keys(), values(), lengths())."""
    return not isinstance(features, Mapping) and all(callable(getattr(features, name, None))
                                                     for name in ("keys", "values", "lengths"))


def _jagged_tensor(value: Any) -> bool:
    """Whether `value` is a JaggedTensor-like object (values() and lengths() or offsets())."""
    return (not isinstance(value, (torch.Tensor, Mapping, tuple, list)) and callable(getattr(value, "values", None))
            and (callable(getattr(value, "lengths", None)) or callable(getattr(value, "offsets", None))))


def _lengths(offsets: torch.Tensor) -> torch.Tensor:
    """A JaggedTensor's lengths from its offsets (one more than its bags: where each starts, then the end)."""
    return offsets[1:] - offsets[:-1]


def _kjt_weights(features: Any) -> torch.Tensor | None:
    """A KeyedJaggedTensor's weights, or None where it has none (TorchRec's weights() raises then;
    weights_or_none() says so)."""
    if callable(getattr(features, "weights_or_none", None)):
        weights = features.weights_or_none()
    elif callable(getattr(features, "weights", None)):
        try:
            weights = features.weights()
        except (AssertionError, AttributeError, RuntimeError, ValueError):
            return None
    else:
        return None
    return weights if weights is None or isinstance(weights, torch.Tensor) else torch.as_tensor(weights)


def _jagged(keys: list[str], values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None,
            what: str) -> Parsed:
    """Each key's (ids, offsets, weights) from a KeyedJaggedTensor's keys, values, lengths (the
    lengths of every bag, key after key: len(keys) x batch of them) and weights (one per value, or None).

    Raises:
        ConfigError: lengths that are not len(keys) x batch, or do not add up to the values; weights
            not one per value.
    """
    if not isinstance(values, torch.Tensor) or not isinstance(lengths, torch.Tensor):
        raise ConfigError(f"{what}: values and lengths must be tensors, got {type(values).__name__} and "
                          f"{type(lengths).__name__}")
    if not keys or lengths.numel() % len(keys):
        raise ConfigError(f"{what}: {lengths.numel()} lengths for {len(keys)} keys")
    if lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
        raise ConfigError(f"{what}: lengths must be integers, got {lengths.dtype}")
    lengths = lengths.to(torch.int64)
    if lengths.numel() and int(lengths.min()) < 0:
        raise ConfigError(f"{what}: a negative length ({int(lengths.min())}); a bag has 0 ids or more")
    if int(lengths.sum()) != values.numel():
        raise ConfigError(f"{what}: lengths add up to {int(lengths.sum())}, but there are {values.numel()} ids")
    if weights is not None and weights.numel() != values.numel():
        raise ConfigError(f"{what}: {weights.numel()} weights for {values.numel()} ids")
    per_key = lengths.view(len(keys), -1)
    out: Parsed = {}
    start = 0
    for key, bag_lengths in zip(keys, per_key):
        total = int(bag_lengths.sum())
        offsets = torch.zeros_like(bag_lengths)
        offsets[1:] = torch.cumsum(bag_lengths, 0)[:-1]
        w = None if weights is None else weights.reshape(-1)[start:start + total]
        out[str(key)] = (values.reshape(-1)[start:start + total], offsets, w)
        start += total
    return out
