"""Server-side update rules by name: a registry of ShardOptimizer factories (sgd, adam, adamw,
adagrad, rmsprop, adadelta)."""
from __future__ import annotations

from collections.abc import Callable

from psgrad.core.job import JobSpec
from psgrad.core.optimizers.adadelta import Adadelta
from psgrad.core.optimizers.adagrad import Adagrad
from psgrad.core.optimizers.adam import ADAM_BLOCK, Adam
from psgrad.core.optimizers.base import ShardOptimizer, UpdateRule
from psgrad.core.optimizers.rmsprop import RMSprop
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


register_optimizer("sgd", lambda numel, s: SGD(numel, s.lr, s.momentum, s.weight_decay, s.nesterov))
register_optimizer("adam", _adam(decoupled=False))
register_optimizer("adamw", _adam(decoupled=True))
register_optimizer(
    "adagrad", lambda numel, s: Adagrad(numel, s.lr, s.lr_decay, s.weight_decay, s.initial_accumulator_value, s.eps)
)
register_optimizer(
    "rmsprop", lambda numel, s: RMSprop(numel, s.lr, s.alpha, s.eps, s.weight_decay, s.momentum, s.centered)
)
register_optimizer("adadelta", lambda numel, s: Adadelta(numel, s.lr, s.rho, s.eps, s.weight_decay))


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
    "RMSprop",
    "ShardOptimizer",
    "UpdateRule",
    "make_optimizer",
    "register_optimizer",
]
