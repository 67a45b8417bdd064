"""Server-side update rules by name: a registry of ShardOptimizer factories (sgd, adam, adamw)."""
from __future__ import annotations

from collections.abc import Callable

from psgrad.config import JobSpec
from psgrad.core.optimizers.adam import ADAM_BLOCK, Adam
from psgrad.core.optimizers.base import ShardOptimizer, UpdateRule
from psgrad.core.optimizers.sgd import SGD
from psgrad.errors import ConfigError

OptimizerFactory = Callable[[int, JobSpec], ShardOptimizer]
# Name -> factory(numel, spec). config.OPTIMIZER_NAMES lists the names for the CLI (which must not
# import torch); a test keeps the two equal.
OPTIMIZERS: dict[str, OptimizerFactory] = {}


def register_optimizer(name: str, factory: OptimizerFactory) -> None:
    """Make `--optimizer NAME` build factory(numel, spec) on every shard."""
    OPTIMIZERS[name] = factory


def _adam(decoupled: bool) -> OptimizerFactory:
    def build(numel: int, spec: JobSpec) -> ShardOptimizer:
        return Adam(numel, spec.lr, spec.beta1, spec.beta2, spec.eps, spec.weight_decay, decoupled)

    return build


register_optimizer("sgd", lambda numel, spec: SGD(numel, spec.lr, spec.momentum, spec.weight_decay))
register_optimizer("adam", _adam(decoupled=False))
register_optimizer("adamw", _adam(decoupled=True))


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
    "Adam",
    "ShardOptimizer",
    "UpdateRule",
    "make_optimizer",
    "register_optimizer",
]
