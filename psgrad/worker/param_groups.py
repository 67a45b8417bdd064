"""Parameter groups for a model on the servers (ps.optimizer(model, param_groups=...)): torch's
list of {"params": [...], "lr": ..., "weight_decay": ...} dicts, turned into each parameter's
settings as the servers keep them — a fixed multiplier of the job's lr and a weight decay of its
own (no decay on biases and norms, a smaller lr for a pretrained part). A group's params may name
psgrad embeddings (the modules: psgrad.Embedding, EmbeddingBag, or a collection for all its tables),
whose tables then take the group's lr multiple and its own values of the job optimizer's settings
(momentum 0, weight_decay 0, lr_decay, ...), or an optimizer of their own for their rows
('optimizer': a name, or psgrad.Adagrad(...) with its settings: Adagrad rows under an AdamW job, as
recommenders train), the same path as the dense groups: each TableSpec carries them to the servers."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from psgrad.config import JobSpec
from psgrad.core.optimizer_settings import DECLS, DEFAULT_LR, ROW_FORMS, SERVER_OPTIMIZERS, with_optimizer
from psgrad.core.sharding import ParamSpec, TableSpec
from psgrad.errors import ConfigError
from psgrad.nn.embedding import SparseEmbedding

GROUP_KEYS = ("params", "lr", "weight_decay")


def table_keys(spec: JobSpec, optimizer: str = "") -> tuple[str, ...]:
    """What a group of tables may set: its optimizer, its lr, and that optimizer's settings (the
    job's optimizer unless the group names one; Adam's betas as torch names them, or beta1/beta2)."""
    name = optimizer or spec.optimizer
    settings = DECLS[name].settings if name in DECLS else ()
    return ("optimizer", "lr", *settings, *(("betas",) if "beta1" in settings else ()))


def with_groups(specs: Sequence[ParamSpec], model: nn.Module, groups: Iterable[Mapping[str, Any]] | None,
                spec: JobSpec, tables: Sequence[TableSpec] = ()) -> tuple[list[ParamSpec], list[TableSpec]]:
    """specs with each grouped parameter's lr_scale (its group's lr / the job's lr) and weight
    decay, and tables with their group's lr_scale and settings; parameters and tables in no group
    keep the job's settings.

    Raises:
        ConfigError: a group with another key (for its kind: dense parameters take lr and
            weight_decay; tables also an optimizer of their own and its settings, or the job
            optimizer's), a parameter that is not the model's trainable one or is in two groups, a
            module that holds no psgrad embedding, or an lr / weight decay that is not a finite
            number >= 0 (named).
    """
    if groups is None:
        return list(specs), list(tables)
    names = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
    table_names = {id(m): name for name, m in model.named_modules() if isinstance(m, SparseEmbedding)}
    settings: dict[str, tuple[float, float | None]] = {}
    own: dict[str, tuple[float, tuple[tuple[str, float], ...], str]] = {}
    for i, group in enumerate(groups):
        if not isinstance(group, Mapping) or "params" not in group:
            raise ConfigError(f"param_groups[{i}] must be a dict with 'params' (and 'lr', 'weight_decay')")
        optimizer, preset, preset_lr = _table_optimizer(group, i)
        allowed = table_keys(spec, optimizer)
        lr = _number(group.get("lr", preset_lr if preset_lr is not None else DEFAULT_LR[optimizer] if optimizer
                               else spec.lr), f"param_groups[{i}]['lr']")
        decay = group.get("weight_decay")
        decay = None if decay is None else _number(decay, f"param_groups[{i}]['weight_decay']")
        if spec.lr <= 0 and lr != spec.lr:
            raise ConfigError(f"param_groups[{i}]: a group's lr is a multiple of the job's, which is {spec.lr}")
        scale = lr / spec.lr if spec.lr > 0 else 1.0
        raw = group["params"]
        params = [raw] if isinstance(raw, (torch.Tensor, nn.Module)) else list(raw)
        dense = [p for p in params if not isinstance(p, nn.Module)]
        modules = [p for p in params if isinstance(p, nn.Module)]
        if not params:
            raise ConfigError(f"param_groups[{i}] holds no parameter, so its settings would apply to nothing: a psgrad "
                              "embedding has no local parameters (its rows live on the servers), and its .parameters() "
                              "are empty; put the module itself in 'params' ([model.<table>])")
        unknown = sorted(set(group) - set(GROUP_KEYS) - (set(allowed) if modules else set()))
        if unknown:
            raise ConfigError(f"param_groups[{i}] has {', '.join(map(repr, unknown))}: a group may set only "
                              f"'lr' and 'weight_decay' for dense parameters (the other settings are the job's), and "
                              f"for psgrad embeddings (modules in 'params') also 'optimizer' (their own) and "
                              f"{optimizer or spec.optimizer}'s settings: {', '.join(repr(k) for k in allowed[2:]) or 'none'}")
        if dense and set(group) - set(GROUP_KEYS):
            extra = sorted(set(group) - set(GROUP_KEYS))
            raise ConfigError(f"param_groups[{i}] sets {', '.join(map(repr, extra))} and holds dense parameters: a "
                              "dense parameter's group sets only 'lr' and 'weight_decay'; put the psgrad embeddings "
                              "in a group of their own")
        for p in dense:
            name = names.get(id(p))
            if name is None:
                raise ConfigError(f"param_groups[{i}] holds a tensor that is not a trainable parameter of the model")
            if name in settings:
                raise ConfigError(f"parameter {name!r} is in two of param_groups")
            settings[name] = (scale, decay)
        if modules:
            values = _table_settings(group, i, spec, optimizer, preset)
            for m in modules:
                found = [table_names[id(t)] for t in m.modules() if id(t) in table_names]
                if not found:
                    raise ConfigError(f"param_groups[{i}] holds a module that is not a psgrad embedding of the model "
                                      "(nor holds one): give dense parameters as tensors (module.parameters())")
                for name in found:
                    if name in own:
                        raise ConfigError(f"table {name!r} is in two of param_groups")
                    own[name] = (scale, values, optimizer)
    return ([dataclasses.replace(s, lr_scale=settings[s.name][0], weight_decay=settings[s.name][1])
             if s.name in settings else s for s in specs],
            [dataclasses.replace(t, lr_scale=own[t.name][0], settings=own[t.name][1], optimizer=own[t.name][2])
             if t.name in own else t for t in tables])


def _table_optimizer(group: Mapping[str, Any], i: int) -> tuple[str, dict[str, Any], float | None]:
    """A group's own optimizer for its tables' rows: (its name, "" for the job's; the settings an
    optimizer object gives, as JobSpec fields; the lr it gives, None: none).

    Raises:
        ConfigError: neither a known name nor psgrad.SGD / Adam / Adagrad / ... (named), or an
            optimizer object beside keys that set its settings again.
    """
    value = group.get("optimizer")
    if value is None:
        return "", {}, None
    if isinstance(value, str):
        if value not in DECLS:
            raise ConfigError(f"param_groups[{i}]['optimizer'] names no optimizer: {value!r}; the tables' rows take "
                              f"{', '.join(ROW_FORMS)}")
        return value, {}, None
    if isinstance(value, SERVER_OPTIMIZERS):
        fields = value.job_fields()
        name, lr = str(fields.pop("optimizer")), float(fields.pop("lr"))
        again = sorted(set(group) - {"params", "optimizer"})
        if again:
            raise ConfigError(f"param_groups[{i}] gives the tables' optimizer as psgrad.{type(value).__name__}(...) and "
                              f"sets {', '.join(map(repr, again))} beside it: give those as its arguments")
        base = with_optimizer(JobSpec(), name)  # (only the settings it sets away from their defaults)
        return name, {k: v for k, v in fields.items() if v != getattr(base, k)}, lr
    raise ConfigError(f"param_groups[{i}]['optimizer'] must be an optimizer's name ({', '.join(ROW_FORMS)}) or its "
                      f"settings (psgrad.Adagrad(lr=...), ...), got {value!r}")


def _table_settings(group: Mapping[str, Any], i: int, spec: JobSpec, optimizer: str = "",
                    preset: Mapping[str, Any] | None = None) -> tuple[tuple[str, float], ...]:
    """A table group's own optimizer settings, as (JobSpec field, value): preset's (an optimizer
    object's), then the group's keys; checked as the job's are (a JobSpec with them is built: the
    job's, or with the group's own optimizer at its defaults)."""
    values: dict[str, Any] = dict(preset or {})
    for key, value in group.items():
        if key in ("params", "lr", "optimizer"):
            continue
        if key == "betas":
            try:
                values["beta1"], values["beta2"] = (float(v) for v in value)
            except (TypeError, ValueError):
                raise ConfigError(f"param_groups[{i}]['betas'] must be two numbers, got {value!r}") from None
        elif isinstance(value, bool) or isinstance(value, (int, float)):
            values[key] = value
        else:
            raise ConfigError(f"param_groups[{i}][{key!r}] must be a number, got {value!r}")
    try:
        dataclasses.replace(with_optimizer(spec, optimizer) if optimizer else spec, **values)
    except (ConfigError, TypeError) as exc:
        raise ConfigError(f"param_groups[{i}]: {exc}") from None
    return tuple(sorted((k, float(v)) for k, v in values.items()))


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{what} must be a finite number >= 0, got {value!r}")
    return float(value)
