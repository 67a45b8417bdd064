"""The row forms of the optimizers, for sparse (embedding) tables: each update touches only the rows
a batch used, and their state is kept per row. The table gathers the touched rows, calls apply on
them, and scatters them back.

A row form is derived from its optimizer's dense rule (the one statement of it, in sgd.py and
adagrad.py), and optimizer_settings.DECLS says, setting by setting, how rows take it:

- EXACT: the row form *is* the dense rule on the gathered rows. That holds where a zero gradient
  leaves a row and its state as they are, so that the rows the batch did not touch are exactly what
  the dense rule would have left: SGD without momentum or weight decay, and Adagrad without weight
  decay (its sum of squares per element; lr_decay counts the dense rule's steps, which the table
  passes in: the shard's updates that used the table, ShardState.table_step). Bit for bit a dense
  table updated by torch with zero gradients on the untouched rows (tests/unit/test_optimizers.py),
  and .grad None on the steps that did not use the table (tests/integration/test_unused_params.py).
- LAZY: a different rule, named so: Adam's row form keeps both moments and a step count per row,
  which move only when the row is updated (the dense rule would decay every row's moments, and so
  move every row, at every step).
- refused: a setting whose dense rule moves untouched rows (momentum, weight decay) is refused by
  name with the alternative (make_row_optimizer), never ignored; so is an optimizer without a row
  form (rmsprop, adadelta, adamw), whose job's tables name one of these in a param group of their
  own (TableSpec.optimizer).
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from psgrad.core.optimizer_settings import DECLS, EXACT, LAZY, ROW_FORMS
from psgrad.core.optimizers.adagrad import adagrad_lr, adagrad_rule
from psgrad.core.optimizers.sgd import sgd_rule
from psgrad.errors import ConfigError

RowState = dict[str, torch.Tensor]


class RowOptimizer(ABC):
    """An update rule over gathered rows: weights [n, dim], their gradients [n, dim] (coalesced:
    one per row id) and their state (each tensor [n, ...], gathered the same way)."""

    name: str = ""
    lr: float = 0.0
    #: EXACT (the dense rule on the touched rows) or LAZY (a rule of its own, named so)
    form: str = EXACT

    @abstractmethod
    def new_state(self, rows: int, dim: int) -> RowState:
        """The state of `rows` fresh rows (what a row starts with when first touched: the same for
        every row, so a table may broadcast one row's)."""

    @abstractmethod
    def apply(self, weights: torch.Tensor, grads: torch.Tensor, state: RowState, lr: float | None = None,
              step: int = 1) -> None:
        """Update weights (and state) in place; grads is only read (it may be a read-only view of the
        request's bytes: no copy is made for the rule). lr: the learning rate in effect
        (None: the job's); step: the dense rule's step number of this update (1, 2, ...)."""

    def step_lr(self, lr: float | None) -> float:
        return self.lr if lr is None else lr

    def apply_at(self, values: torch.Tensor, state: RowState, slots: torch.Tensor, grads: torch.Tensor,
                 lr: float | None = None, step: int = 1) -> None:
        """apply() to rows `slots` (unique) of a table's arrays, in place: the rows and their state
        gathered, updated, and scattered back (the torch ops a fused form must equal)."""
        weights = values.index_select(0, slots)
        gathered = {name: t.index_select(0, slots) for name, t in state.items()}
        self.apply(weights, grads, gathered, lr, step)
        values.index_copy_(0, slots, weights)
        for name, t in gathered.items():
            state[name].index_copy_(0, slots, t)

    def fused(self, lr: float | None = None, step: int = 1) -> tuple[str, float, float] | None:
        """This rule at (lr, step) as the server's fused row kernels compute it, one pass over the
        rows in place of gather, rule and scatter: (its kind, its scale, its eps), or None where
        there is none (the torch ops apply it). A kernel is used only where it gives what apply()
        gives, bit for bit (checked after compiling, server/kernels.py)."""
        return None


class RowSGD(RowOptimizer):
    """SGD's dense rule (sgd_rule, without weight decay) on the touched rows: w -= lr * g. Exact."""

    name = "sgd"

    def __init__(self, lr: float) -> None:
        self.lr = lr

    def new_state(self, rows: int, dim: int) -> RowState:
        return {}

    def apply(self, weights: torch.Tensor, grads: torch.Tensor, state: RowState, lr: float | None = None,
              step: int = 1) -> None:
        sgd_rule(weights, grads, weights, self.step_lr(lr), 0.0, grads)

    def fused(self, lr: float | None = None, step: int = 1) -> tuple[str, float, float] | None:
        return "sgd", -self.step_lr(lr), 0.0  # w + (-lr) * g


class RowAdagrad(RowOptimizer):
    """Adagrad's dense rule (adagrad_rule, without weight decay) on the touched rows, with its
    lr_decay at the dense rule's step number. A row nobody touches keeps its sum and its weights,
    exactly as a dense Adagrad step with a zero gradient leaves them. Exact."""

    name = "adagrad"

    def __init__(self, lr: float, initial_accumulator_value: float = 0.0, eps: float = 1e-10,
                 lr_decay: float = 0.0) -> None:
        self.lr = lr
        self.initial = initial_accumulator_value
        self.eps = eps
        self.lr_decay = lr_decay

    def new_state(self, rows: int, dim: int) -> RowState:
        return {"sum": torch.full((rows, dim), float(self.initial))}

    def apply(self, weights: torch.Tensor, grads: torch.Tensor, state: RowState, lr: float | None = None,
              step: int = 1) -> None:
        clr = adagrad_lr(self.step_lr(lr), step, self.lr_decay)
        adagrad_rule(weights, grads, state["sum"], torch.empty_like(grads), clr, 0.0, self.eps)

    def fused(self, lr: float | None = None, step: int = 1) -> tuple[str, float, float] | None:
        return "adagrad", -adagrad_lr(self.step_lr(lr), step, self.lr_decay), self.eps


class RowAdam(RowOptimizer):
    """Lazy Adam: only the touched rows' moments move, and each row's bias correction uses its own
    step count (how many updates it took part in): each row follows Adam as if the table's steps
    were only those that touched it. Not the dense rule (which decays every row's moments, and so
    moves every row, at every step); equal to it (to rounding) for rows touched at every step."""

    name = "adam"
    form = LAZY

    def __init__(self, lr: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8) -> None:
        self.lr = lr
        self.beta1, self.beta2, self.eps = beta1, beta2, eps

    def new_state(self, rows: int, dim: int) -> RowState:
        return {"exp_avg": torch.zeros(rows, dim), "exp_avg_sq": torch.zeros(rows, dim), "step": torch.zeros(rows, 1)}

    def apply(self, weights: torch.Tensor, grads: torch.Tensor, state: RowState, lr: float | None = None,
              step: int = 1) -> None:
        m, v, steps = state["exp_avg"], state["exp_avg_sq"], state["step"]
        steps.add_(1)
        m.mul_(self.beta1).add_(grads, alpha=1 - self.beta1)
        v.mul_(self.beta2).addcmul_(grads, grads, value=1 - self.beta2)
        correction1 = 1 - torch.pow(self.beta1, steps)
        correction2 = 1 - torch.pow(self.beta2, steps)
        denom = (v / correction2).sqrt_().add_(self.eps)
        weights.addcdiv_(m / correction1, denom, value=-self.step_lr(lr))


# Name -> factory(the table's job spec). Which settings each row form takes, and how, is declared in
# optimizer_settings.DECLS; make_row_optimizer refuses the others.
ROW_OPTIMIZERS: dict[str, Callable[..., RowOptimizer]] = {
    "sgd": lambda spec: RowSGD(spec.lr),
    "adagrad": lambda spec: RowAdagrad(spec.lr, spec.initial_accumulator_value, spec.eps, spec.lr_decay),
    "adam": lambda spec: RowAdam(spec.lr, spec.beta1, spec.beta2, spec.eps),
}
assert set(ROW_OPTIMIZERS) == set(ROW_FORMS), "a row form for each optimizer DECLS gives one"


def check_row_settings(spec: object, table: str | None = None, own: bool = False) -> None:
    """Refuse, by name, an optimizer without a row form or a setting its row form cannot take
    (optimizer_settings.DECLS), naming the alternative. own: the optimizer is the table's own
    (its param group's 'optimizer'), not the job's.

    Raises:
        ConfigError: naming the optimizer or the setting, and what to do instead.
    """
    name = str(getattr(spec, "optimizer"))
    where = f"sparse table {table!r}" if table else "sparse tables"
    decl = DECLS.get(name)
    if decl is None or decl.rows is None:
        why = f" ({decl.no_rows})" if decl is not None and decl.no_rows else ""
        if own:
            raise ConfigError(f"optimizer {name!r}, which the param group of {where} names, has no row-wise "
                              f"form{why}: a table's own optimizer is one of {', '.join(ROW_FORMS)}")
        raise ConfigError(
            f"optimizer {name!r} has no row-wise form for {where}{why}; rows take {', '.join(ROW_FORMS)}: name one "
            f"for {'the table' if table else 'the tables'} in a param group of {'its' if table else 'their'} own "
            f"(ps.optimizer(model, param_groups=[{{'params': [model.<table>], 'optimizer': psgrad.Adagrad(lr=...)}}, "
            f"...]; psgrad's commands: --table-optimizer): the dense parameters keep {name!r})")
    defaults = {f.name: f.default for f in dataclasses.fields(spec)}  # type: ignore[arg-type]
    for setting in decl.settings:
        value = getattr(spec, setting)
        rule = decl.row_rule(setting)
        if rule in (EXACT, LAZY) or value == defaults[setting]:
            continue
        default = defaults[setting]
        raise ConfigError(
            f"{setting} {value!r} of optimizer {name!r} does not apply to the rows of {where}: {rule}. Give the "
            f"table{'' if table else 's'} {setting} {default!r} in a param group of {'its' if table else 'their'} own "
            f"(ps.optimizer(model, param_groups=[{{'params': [model.<table>], {setting!r}: {default!r}}}, ...]): the "
            f"dense parameters keep {setting} {value!r}), or use a torch.nn.Embedding there (a dense parameter)")


def make_row_optimizer(name: str, spec: object, table: str | None = None) -> RowOptimizer:
    """The row form of optimizer `name` with the job spec's settings (lr, eps, betas, ...): the
    table's spec, with its param group's settings.

    Raises:
        ConfigError: no row-wise form of that optimizer (the message lists those there are), or a
            setting its row form cannot take (named, with the alternative).
    """
    if name != getattr(spec, "optimizer", name):
        spec = dataclasses.replace(spec, optimizer=name)  # type: ignore[type-var]
    check_row_settings(spec, table)
    optimizer = ROW_OPTIMIZERS[name](spec)
    optimizer.name = name
    return optimizer
