"""Server-side update rules by name: a registry of ShardOptimizer factories (sgd, adam, adamw,
adagrad, rmsprop, adadelta)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from psgrad.core.job import JobSpec
from psgrad.core.optimizer_settings import DECLS
from psgrad.core.optimizers.adadelta import Adadelta
from psgrad.core.optimizers.adagrad import Adagrad
from psgrad.core.optimizers.adam import ADAM_BLOCK, Adam
from psgrad.core.optimizers.base import ElementwiseRule, ShardOptimizer, UpdateRule
from psgrad.core.optimizers.rmsprop import RMSprop
from psgrad.core.optimizers.sgd import SGD
from psgrad.errors import ConfigError

OptimizerFactory = Callable[[int, JobSpec], ShardOptimizer]
# Name -> factory(numel, spec): one dense rule for each optimizer optimizer_settings.DECLS declares
# (config.OPTIMIZER_NAMES, for the CLI, which must not import torch; a test keeps the two equal).
OPTIMIZERS: dict[str, OptimizerFactory] = {}
# The class of each declared optimizer's rule, and what its constructor takes beyond the settings.
RULES: dict[str, tuple[type[ShardOptimizer], dict[str, Any]]] = {
    "sgd": (SGD, {}),
    "adam": (Adam, {"decoupled": False}),
    "adamw": (Adam, {"decoupled": True}),
    "adagrad": (Adagrad, {}),
    "rmsprop": (RMSprop, {}),
    "adadelta": (Adadelta, {}),
}


def register_optimizer(name: str, factory: OptimizerFactory) -> None:
    """Make `--optimizer NAME` build factory(numel, spec) on every shard."""
    OPTIMIZERS[name] = factory


def _declared(name: str) -> OptimizerFactory:
    """The factory of a declared optimizer: its rule's class with the spec's lr and the settings the
    declaration lists (by name: the constructors take the JobSpec fields' names)."""
    cls, extra = RULES[name]
    settings = DECLS[name].settings

    def build(numel: int, spec: JobSpec) -> ShardOptimizer:
        return cls(numel, spec.lr, **{f: getattr(spec, f) for f in settings}, **extra)  # type: ignore[call-arg]

    return build


for _name in DECLS:
    register_optimizer(_name, _declared(_name))


def make_optimizer(spec: JobSpec, numel: int) -> ShardOptimizer:
    """Build the optimizer the job spec names for a shard of numel elements.

    Raises:
        ConfigError: the name is not registered.
    """
    try:
        factory = OPTIMIZERS[spec.optimizer]
    except KeyError:
        raise ConfigError(
            f"unknown optimizer {spec.optimizer!r}; valid: {', '.join(sorted(OPTIMIZERS))}"
        ) from None
    optimizer = factory(numel, spec)
    optimizer.name = spec.optimizer
    return optimizer


__all__ = [
    "ADAM_BLOCK",
    "OPTIMIZERS",
    "SGD",
    "Adadelta",
    "Adagrad",
    "Adam",
    "ElementwiseRule",
    "RMSprop",
    "ShardOptimizer",
    "UpdateRule",
    "make_optimizer",
    "register_optimizer",
]
