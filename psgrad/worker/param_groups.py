"""Parameter groups for a model on the servers (ps.optimizer(model, param_groups=...)): torch's
list of {"params": [...], "lr": ..., "weight_decay": ...} dicts, turned into each parameter's
settings as the servers keep them — a fixed multiplier of the job's lr and a weight decay of its
own (no decay on biases and norms, a smaller lr for a pretrained part)."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from psgrad.config import JobSpec
from psgrad.core.sharding import ParamSpec
from psgrad.errors import ConfigError

GROUP_KEYS = ("params", "lr", "weight_decay")


def with_groups(specs: Sequence[ParamSpec], model: nn.Module, groups: Iterable[Mapping[str, Any]] | None,
                spec: JobSpec) -> list[ParamSpec]:
    """specs with each grouped parameter's lr_scale (its group's lr / the job's lr) and weight
    decay; parameters in no group keep the job's settings.

    Raises:
        ConfigError: a group with another key, a parameter that is not the model's trainable one or
            is in two groups, or an lr / weight decay that is not a finite number >= 0 (named).
    """
    if groups is None:
        return list(specs)
    names = {id(p): name for name, p in model.named_parameters() if p.requires_grad}
    settings: dict[str, tuple[float, float | None]] = {}
    for i, group in enumerate(groups):
        if not isinstance(group, Mapping) or "params" not in group:
            raise ConfigError(f"param_groups[{i}] must be a dict with 'params' (and 'lr', 'weight_decay')")
        unknown = sorted(set(group) - set(GROUP_KEYS))
        if unknown:
            raise ConfigError(f"param_groups[{i}] has {', '.join(map(repr, unknown))}: a group may set only "
                              f"'lr' and 'weight_decay' (the other settings are the job's)")
        lr = _number(group.get("lr", spec.lr), f"param_groups[{i}]['lr']")
        decay = group.get("weight_decay")
        decay = None if decay is None else _number(decay, f"param_groups[{i}]['weight_decay']")
        if spec.lr <= 0 and lr != spec.lr:
            raise ConfigError(f"param_groups[{i}]: a group's lr is a multiple of the job's, which is {spec.lr}")
        params = [group["params"]] if isinstance(group["params"], torch.Tensor) else list(group["params"])
        for p in params:
            name = names.get(id(p))
            if name is None:
                raise ConfigError(f"param_groups[{i}] holds a tensor that is not a trainable parameter of the model")
            if name in settings:
                raise ConfigError(f"parameter {name!r} is in two of param_groups")
            settings[name] = (lr / spec.lr if spec.lr > 0 else 1.0, decay)
    return [dataclasses.replace(s, lr_scale=settings[s.name][0], weight_decay=settings[s.name][1])
            if s.name in settings else s for s in specs]


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{what} must be a finite number >= 0, got {value!r}")
    return float(value)
