"""psgrad.EmbeddingBagCollection: several embedding-bag tables whose rows live on the servers, looked up
together from keyed features (a dict of id tensors, or keys / values / lengths as in TorchRec's
KeyedJaggedTensor), so a forward makes one pull per shard for all its tables. Each table is a
psgrad.EmbeddingBag of its own inside it (a job's table, named by its place in the model); the
forward pools each feature's bags and concatenates the tables' outputs, as TorchRec's
EmbeddingBagCollection does."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from psgrad.errors import ConfigError
from psgrad.nn import lookups
from psgrad.nn.embedding import EMBEDDING_BAG_MODES, EmbeddingBag, unique_ids_of

# feature -> (ids, bag offsets (None: a 2-D tensor of one bag per row))
Features = dict[str, tuple[torch.Tensor, torch.Tensor | None]]

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
    """Tables of embedding bags looked up together: `tables` maps each feature's name to its
    table's (num_embeddings, embedding_dim) (num_embeddings None: a dynamic table, any int64 id). forward(features) takes, for every feature, its ids:
    a 2-D tensor (one bag per row), a pair (ids 1-D, offsets 1-D: bags starting at each offset),
    or the whole batch as a KeyedJaggedTensor-like object (keys(), values(), lengths(): the
    lengths of every bag, feature after feature); it returns [batch, sum of the dims]: each
    table's pooled bags (mode "sum", "mean" or "max"), concatenated in the order of `tables`.
    Weighted features (mode "sum", as torch.nn.EmbeddingBag's per_sample_weights): a triple
    (ids, offsets, weights) or (2-D ids, None, 2-D weights) for a feature of the dict, or a
    KeyedJaggedTensor with weights (weights_or_none(), one per id).

    Bound by ps.optimizer(model) like psgrad.EmbeddingBag (its tables are `<name>.bags.<feature>`);
    a training forward pulls the unique ids of every feature in one call per shard.

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
                 seed: int = 0, *, min_count: int = 0, ttl: int = 0, evict: bool = False, sparse: bool = False,
                 **options: Any) -> None:
        super().__init__()
        for option in options:
            if option in REFUSED_OPTIONS:
                raise ConfigError(f"EmbeddingBagCollection takes no {option}=: {REFUSED_OPTIONS[option]}")
            raise TypeError(f"EmbeddingBagCollection() got an unexpected keyword argument {option!r}")
        if not isinstance(tables, Mapping) or not tables:
            raise ConfigError("an EmbeddingBagCollection needs at least one table: {feature: (num_embeddings, dim)}")
        for name, shape in tables.items():
            if not (isinstance(shape, (tuple, list)) and len(shape) == 2
                    and all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in shape)
                    and shape[1] is not None):
                raise ConfigError(f"table {name!r}: give (num_embeddings, embedding_dim) as two integers "
                                  f"(num_embeddings None: a dynamic table, any int64 id), got {shape!r}")
            if not isinstance(name, str) or not name or "." in name or hasattr(nn.ModuleDict, name):
                raise ConfigError(f"table {name!r}: a table's name is the name of its module in the collection's "
                                  "ModuleDict (`bags`): a str without '.', and not one of ModuleDict's attributes "
                                  "(items, keys, values, ...)")
        if mode not in EMBEDDING_BAG_MODES:
            raise ConfigError(f"mode must be one of {', '.join(EMBEDDING_BAG_MODES)}, got {mode!r}")
        self.bags = nn.ModuleDict({name: EmbeddingBag(None if n is None else int(n), int(d), mode=mode, std=std,
                                                      seed=seed, min_count=min_count, ttl=ttl, evict=evict,
                                                      sparse=sparse)
                                   for name, (n, d) in tables.items()})
        self.mode = mode

    @property
    def features(self) -> list[str]:
        """The features' names, in the order of the output's columns."""
        return list(self.bags.keys())

    @property
    def output_dim(self) -> int:
        return sum(bag.embedding_dim for bag in self._bags())

    def _bags(self) -> list[EmbeddingBag]:
        return [bag for bag in self.bags.values() if isinstance(bag, EmbeddingBag)]

    def split(self, features: Any) -> Features:
        """Each feature's (ids, offsets) from what forward takes (see the class doc).

        Raises:
            ConfigError: a feature missing or unknown, or lengths that do not add up to the ids.
        """
        if hasattr(features, "lengths") and hasattr(features, "values") and hasattr(features, "keys"):
            parts = _keyed_jagged(list(features.keys()), features.values(), features.lengths())
        elif isinstance(features, Mapping):
            parts = {}
            for name, value in features.items():
                if isinstance(value, (tuple, list)) and len(value) in (2, 3):
                    parts[str(name)] = (value[0], value[1])
                elif isinstance(value, torch.Tensor) and value.dim() == 2:
                    parts[str(name)] = (value, None)
                else:
                    raise ConfigError(f"feature {name!r}: give a 2-D tensor of ids (one bag per row), a pair "
                                      "(ids, offsets), or a triple (ids, offsets, per-sample weights)")
        else:
            raise ConfigError(f"an EmbeddingBagCollection takes a dict of features or a KeyedJaggedTensor, got "
                              f"{type(features).__name__}")
        missing, unknown = set(self.bags) - set(parts), set(parts) - set(self.bags)
        if missing or unknown:
            raise ConfigError(f"features: missing {sorted(missing)}, unknown {sorted(unknown)}; the tables are "
                              f"{self.features}")
        for name, (ids, offsets) in parts.items():
            if not isinstance(ids, torch.Tensor) or not (offsets is None or isinstance(offsets, torch.Tensor)):
                raise ConfigError(f"feature {name!r}: ids and offsets must be tensors, got "
                                  f"{type(ids).__name__} and {type(offsets).__name__}")
        batch = {name: int(ids.shape[0] if offsets is None else offsets.numel()) for name, (ids, offsets) in parts.items()}
        if len(set(batch.values())) > 1:
            raise ConfigError(f"features of different batch sizes: {', '.join(f'{n!r} has {b} bags' for n, b in batch.items())}; "
                              "every feature needs one bag per example (an example without ids: an empty bag)")
        return parts

    def per_sample_weights(self, features: Any, parts: Features | None = None) -> dict[str, torch.Tensor] | None:
        """Each weighted feature's per-sample weights (the shape of its ids), from what forward takes
        (parts: split(features), where the caller has it); None: no feature is weighted.

        Raises:
            ConfigError: weights that are not floating point, or not one per id.
        """
        parts = self.split(features) if parts is None else parts
        out: dict[str, torch.Tensor] = {}
        if hasattr(features, "lengths") and hasattr(features, "values") and hasattr(features, "keys"):
            weights = _kjt_weights(features)
            if weights is not None:
                if weights.numel() != features.values().numel():
                    raise ConfigError(f"keyed features: {weights.numel()} weights for {features.values().numel()} ids")
                start = 0
                for key in features.keys():
                    n = parts[str(key)][0].numel()
                    out[str(key)] = weights[start:start + n]
                    start += n
        elif isinstance(features, Mapping):
            out = {str(name): value[2] for name, value in features.items()
                   if isinstance(value, (tuple, list)) and len(value) == 3 and value[2] is not None}
        for name, w in out.items():
            ids = parts[name][0]
            if not (isinstance(w, torch.Tensor) and w.is_floating_point() and tuple(w.shape) == tuple(ids.shape)):
                raise ConfigError(f"feature {name!r}: per-sample weights must be a floating-point tensor shaped as its "
                                  f"ids {list(ids.shape)}, got {getattr(w, 'dtype', type(w).__name__)} "
                                  f"{list(getattr(w, 'shape', []))}")
        if out and self.mode != "sum":
            raise ConfigError(f"weighted features need mode 'sum' (as torch.nn.EmbeddingBag's per_sample_weights); "
                              f"this collection's mode is {self.mode!r}")
        return out or None

    def lookup(self, features: Any) -> dict[str, torch.Tensor]:
        """The rows a forward of `features` reads, by table (what a prefetch asks the servers for)."""
        bags = self._bags()
        unique = unique_ids_of(bags, [ids for ids, _ in self._ordered(features)])
        return {bag.table or "": u for bag, (u, _) in zip(bags, unique)}

    def _ordered(self, features: Any) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        parts = self.split(features)
        return [parts[name] for name in self.bags]

    def forward(self, features: Any) -> torch.Tensor:
        bags = self._bags()
        split = self.split(features)
        parts = [split[name] for name in self.bags]
        weighted = self.per_sample_weights(features, split) or {}
        per_sample = [weighted.get(name) for name in self.bags]
        if any(bag._source is None for bag in bags):  # unbound: each bag serves a loaded state, or says why not
            return torch.cat([bag(ids, offsets, w) for bag, (ids, offsets), w in zip(bags, parts, per_sample)], dim=1)
        source = bags[0].bound_source()
        training = bags[0]._training()
        unique = unique_ids_of(bags, [ids for ids, _ in parts])
        got = source.pull_tables({bag.table or "": u for bag, (u, _) in zip(bags, unique)}, not training)
        weights = [bag.attach_rows(u, got[bag.table or ""], ids.device, training)
                   for bag, (ids, _), (u, _) in zip(bags, parts, unique)]
        inverses = [inverse for _, inverse in unique]
        names = [bag.table or name for bag, name in zip(bags, self.bags)]  # (as the ids' checks name them)
        if not weighted and all(bag.plain_bags() and bag.mode == self.mode for bag in bags):  # all in one pass
            out = lookups.pooled(weights, inverses, [offsets for _, offsets in parts], self.mode == "mean", names)
            if out is not None:  # (else it checked the offsets it leaves to torch's pooling)
                return out
        else:  # (max or weighted bags: torch's pooling)
            lookups.check_offsets(inverses, [offsets for _, offsets in parts], names)
        return torch.cat([F.embedding_bag(inverse, weight, offsets, mode=bag.mode, per_sample_weights=w)
                          for bag, weight, inverse, (_, offsets), w in zip(bags, weights, inverses, parts, per_sample)],
                         dim=1)


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


def _keyed_jagged(keys: list[str], values: torch.Tensor, lengths: torch.Tensor) -> Features:
    """Each key's (ids, offsets) from a KeyedJaggedTensor's keys, values and lengths (the lengths of
    every bag, key after key: len(keys) x batch of them).

    Raises:
        ConfigError: lengths that are not len(keys) x batch, or do not add up to the values.
    """
    if not keys or lengths.numel() % len(keys):
        raise ConfigError(f"keyed features: {lengths.numel()} lengths for {len(keys)} keys")
    if lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
        raise ConfigError(f"keyed features: lengths must be integers, got {lengths.dtype}")
    lengths = lengths.to(torch.int64)
    if lengths.numel() and int(lengths.min()) < 0:
        raise ConfigError(f"keyed features: a negative length ({int(lengths.min())}); a bag has 0 ids or more")
    if int(lengths.sum()) != values.numel():
        raise ConfigError(f"keyed features: lengths add up to {int(lengths.sum())}, but there are {values.numel()} ids")
    per_key = lengths.view(len(keys), -1)
    out: Features = {}
    start = 0
    for key, bag_lengths in zip(keys, per_key):
        total = int(bag_lengths.sum())
        offsets = torch.zeros_like(bag_lengths)
        offsets[1:] = torch.cumsum(bag_lengths, 0)[:-1]
        out[str(key)] = (values[start:start + total], offsets)
        start += total
    return out
