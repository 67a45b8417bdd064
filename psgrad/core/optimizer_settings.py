"""The server optimizers, declared once (DECLS): each one's name, its torch.optim twin, the JobSpec
fields it reads with torch's defaults, and how sparse tables' rows take each setting; derived from
them: which optimizer reads which field, valid ranges, and the API's classes (psgrad.SGD(...),
psgrad.Adam(...), ...). No torch here: the CLI and config use it."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Union

from psgrad.errors import ConfigError

# --------------------------------------------------------------------------- the declarations
# How a sparse table's rows take a setting (core/optimizers/rows.py implements them):
EXACT = "exact"  # the row form is the dense rule: untouched rows have a zero gradient and the rule leaves them be
LAZY = "lazy"  # the row form is a different rule, named lazy: a row's state moves only when the row is updated


@dataclass(frozen=True)
class OptimizerDecl:
    """One optimizer, declared once: its name, the torch.optim class it equals, the JobSpec fields it
    reads (besides lr) with torch's defaults where JobSpec's differ, and how a sparse table's rows take
    each setting: EXACT, LAZY, or (any other text) refused away from its default, for the reason given.
    Everything else (config's OPTIMIZER_NAMES, the CLI's choices and defaults, READERS, DEFAULT_EPS, the
    all-reduce baseline's torch optimizer, the server registry, the docs' table) is derived from these."""

    name: str
    torch: str  # the torch.optim class
    settings: tuple[str, ...]  # JobSpec fields read, in torch's keyword order (beta1, beta2: its betas)
    lr: float  # torch's default lr
    eps: float | None = None  # torch's default eps (None: no eps)
    weight_decay: float = 0.0  # torch's default weight_decay (AdamW's is 0.01)
    rows: str | None = EXACT  # the row form as a whole: EXACT, LAZY, or None (no row form)
    no_rows: str = ""  # rows None: why
    refused: dict[str, str] = dataclasses.field(default_factory=dict)  # setting -> why rows cannot take it

    def row_rule(self, setting: str) -> str:
        """EXACT or LAZY (the row form's), or the reason rows refuse the setting."""
        return self.refused.get(setting, self.rows or self.no_rows)

    def torch_kwargs(self, spec: Any) -> dict[str, Any]:
        """The torch.optim keyword arguments of a JobSpec's settings."""
        kwargs: dict[str, Any] = {"lr": spec.lr}
        for name in self.settings:
            if name == "beta1":
                kwargs["betas"] = (spec.beta1, spec.beta2)
            elif name != "beta2":
                kwargs[name] = getattr(spec, name)
        return kwargs


_DECAY_MOVES_ROWS = ("an L2 weight decay moves every row at every step (a dense table's rows the batch did not touch "
                     "decay too), which the rows, updated only when touched, do not")
_MOMENTUM_MOVES_ROWS = ("momentum keeps moving every row whose buffer is not zero at every step, rows the batch did not "
                        "touch too, which the rows, updated only when touched, do not")
DECLS: dict[str, OptimizerDecl] = {d.name: d for d in (
    OptimizerDecl("sgd", "SGD", ("momentum", "weight_decay", "nesterov"), lr=0.1,
                  refused={"momentum": _MOMENTUM_MOVES_ROWS, "nesterov": _MOMENTUM_MOVES_ROWS,
                           "weight_decay": _DECAY_MOVES_ROWS}),
    OptimizerDecl("adam", "Adam", ("beta1", "beta2", "eps", "weight_decay"), lr=1e-3, eps=1e-8, rows=LAZY,
                  refused={"weight_decay": _DECAY_MOVES_ROWS}),
    OptimizerDecl("adamw", "AdamW", ("beta1", "beta2", "eps", "weight_decay"), lr=1e-3, eps=1e-8, weight_decay=0.01,
                  rows=None,
                  no_rows="AdamW's decoupled decay moves every row at every step; use adam (lazy) for the tables"),
    OptimizerDecl("adagrad", "Adagrad", ("lr_decay", "weight_decay", "initial_accumulator_value", "eps"), lr=1e-2,
                  eps=1e-10, refused={"weight_decay": _DECAY_MOVES_ROWS}),
    OptimizerDecl("rmsprop", "RMSprop", ("alpha", "eps", "weight_decay", "momentum", "centered"), lr=1e-2, eps=1e-8,
                  rows=None, no_rows="its running averages decay at every step, rows the batch did not touch too"),
    OptimizerDecl("adadelta", "Adadelta", ("rho", "eps", "weight_decay"), lr=1.0, eps=1e-6, rows=None,
                  no_rows="its running averages decay at every step, rows the batch did not touch too"),
)}
ROW_FORMS = tuple(name for name, d in DECLS.items() if d.rows)  # the optimizers sparse tables take

# field -> the optimizers that read it. Set away from its default for any other optimizer, a field
# is refused: it would be ignored without a word.
READERS: dict[str, tuple[str, ...]] = {
    field: tuple(d.name for d in DECLS.values() if field in d.settings)
    for field in dict.fromkeys(f for d in DECLS.values() for f in d.settings)
}
# torch.optim's default eps per optimizer (JobSpec's own default is Adam's); the CLI and the API's
# optimizer classes start from these.
DEFAULT_EPS = {d.name: d.eps for d in DECLS.values() if d.eps is not None}
# torch.optim's default lr per optimizer (the CLI's, for an optimizer other than the recipe's).
DEFAULT_LR = {d.name: d.lr for d in DECLS.values()}
# torch.optim's default weight_decay per optimizer: 0, but 0.01 for AdamW. The CLI (an optimizer other
# than the recipe's), recipes and the API's optimizer classes start from these; JobSpec's own is 0.
DEFAULT_WEIGHT_DECAY = {d.name: d.weight_decay for d in DECLS.values()}


def with_optimizer(spec: Any, name: str) -> Any:
    """A JobSpec with optimizer `name` and every optimizer setting at that optimizer's torch default
    (the job's lr and everything else kept): where a sparse table's own optimizer (its param group's)
    starts, since the job optimizer's settings belong to another rule.

    Raises:
        ConfigError: no optimizer of that name (the valid ones named).
    """
    if name not in DECLS:
        raise ConfigError(f"no optimizer {name!r}; valid: {', '.join(DECLS)}")
    defaults = {f.name: f.default for f in dataclasses.fields(spec) if f.name in READERS}
    defaults["eps"] = DEFAULT_EPS.get(name, defaults["eps"])
    return dataclasses.replace(spec, optimizer=name, **defaults)


#: the largest learning rate: the servers apply it in float32 (a larger one overflowed as it was
#: applied, after the push had been taken)
LR_MAX = 3.4028234663852886e38
_UNIT = ("momentum", "beta1", "beta2", "alpha", "rho")  # decay rates: [0, 1)
_NONNEG = ("weight_decay", "lr_decay", "initial_accumulator_value")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def floats_as_floats(obj: Any) -> None:
    """Make every int in a frozen dataclass's float fields (and float pairs) a float, in place:
    lr=20 and lr=20.0 are one job (the fingerprint hashes the values as JSON, where 20 is not 20.0;
    the servers hold their spec as doubles). Bools and other types are left as they are."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.type in ("float", float) and isinstance(value, int) and not isinstance(value, bool):
            object.__setattr__(obj, f.name, float(value))
        elif f.type == "tuple[float, float]" and isinstance(value, (tuple, list)):
            object.__setattr__(obj, f.name, tuple(
                float(v) if isinstance(v, int) and not isinstance(v, bool) else v for v in value))


_BOOLS = ("nesterov", "centered", "decoupled")


def check_settings(values: dict[str, Any], spelled: dict[str, str] | None = None) -> None:
    """Check the types and ranges of the optimizer settings in `values` (by JobSpec field name; those
    absent are not checked): lr and eps finite and > 0, the decay rates in [0, 1), weight_decay,
    lr_decay and initial_accumulator_value finite and >= 0, the flags bools. JobSpec and the API's
    classes (psgrad.SGD(...), ...) both check theirs here. spelled: how the caller's user names a
    field, where that differs (Adam's betas[0] for beta1).

    Raises:
        TypeError: a setting of the wrong type (a number given as a string), named.
        ConfigError: a setting out of its range, named with its value.
    """
    def named(name: str) -> str:
        return (spelled or {}).get(name, name)

    for name, value in values.items():
        if name in _BOOLS:
            if not isinstance(value, bool):
                raise TypeError(f"{named(name)} must be True or False, got {value!r}")
        elif not isinstance(value, (int, float)) or isinstance(value, bool):
            raise TypeError(f"{named(name)} must be a number, got {value!r} ({type(value).__name__})")
    for name in ("lr", "eps"):
        if name in values:
            _check(math.isfinite(values[name]) and values[name] > 0,
                   f"{named(name)} must be a finite number > 0, got {values[name]!r}")
    if "lr" in values:
        _check(values["lr"] <= LR_MAX, f"{named('lr')} must be at most {LR_MAX:.4g} (the servers apply it in float32), "
                                       f"got {values['lr']!r}")
    for name in _UNIT:
        if name in values:
            _check(math.isfinite(values[name]) and 0 <= values[name] < 1,
                   f"{named(name)} must be in [0, 1), got {values[name]!r}")
    for name in _NONNEG:
        if name in values:
            _check(math.isfinite(values[name]) and values[name] >= 0,
                   f"{named(name)} must be a finite number >= 0, got {values[name]!r}")


def check_nesterov(momentum: float, nesterov: bool) -> None:
    """Raises ConfigError for nesterov without momentum."""
    _check(not nesterov or momentum > 0, f"nesterov needs momentum > 0 (like torch.optim.SGD), got momentum {momentum!r}")


def check_optimizer_fields(spec: Any) -> None:
    """Validate a JobSpec's optimizer settings (types, ranges, and none set that its optimizer ignores).

    Raises:
        TypeError: a setting of the wrong type, named.
        ConfigError: naming the field and its value.
    """
    check_settings({name: getattr(spec, name) for name in ("lr", *READERS)})
    defaults = {f.name: f.default for f in dataclasses.fields(spec)}
    for name, readers in READERS.items():
        value = getattr(spec, name)
        if spec.optimizer in readers or value == defaults[name]:
            continue
        hint = " (Adam's momentum is beta1)" if name == "momentum" and spec.optimizer.startswith("adam") else ""
        raise ConfigError(
            f"{name} applies only to optimizer {' or '.join(repr(r) for r in readers)}{hint}, "
            f"got {name} {value!r} with optimizer {spec.optimizer!r}"
        )
    check_nesterov(spec.momentum, spec.nesterov)


def _check_api_settings(obj: Any) -> None:
    """An API class's settings (psgrad.SGD(...), ...), checked as it is built, by the rules JobSpec
    checks them with (check_settings), in the names its constructor takes: lr, betas, eps, ..."""
    values = dataclasses.asdict(obj)
    try:
        betas = values.pop("betas", None)
        if betas is not None:
            if not isinstance(betas, tuple) or len(betas) != 2:
                raise TypeError(f"betas must be a pair of numbers (beta1, beta2), got {betas!r}")
            values["beta1"], values["beta2"] = betas
        check_settings(values, spelled={"beta1": "betas[0]", "beta2": "betas[1]"})
        if "nesterov" in values:
            check_nesterov(values["momentum"], values["nesterov"])
    except (TypeError, ConfigError) as exc:  # (which class was given the setting)
        raise type(exc)(f"psgrad.{type(obj).__name__}: {exc}") from None


# --------------------------------------------------------------------------- the API's classes
@dataclass(frozen=True)
class SGD:
    """Server-side SGD with optional momentum (heavy ball, or nesterov=True) and L2 weight decay
    (like torch.optim.SGD without dampening)."""

    lr: float = DEFAULT_LR["sgd"]
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self) -> None:
        floats_as_floats(self)  # lr=20 is lr=20.0 (the job fingerprint hashes the values)
        _check_api_settings(self)  # as torch.optim's constructors do, not at connect

    def job_fields(self) -> dict[str, Any]:
        return {"optimizer": "sgd", **dataclasses.asdict(self)}


@dataclass(frozen=True)
class Adam:
    """Server-side Adam (like torch.optim.Adam); decoupled=True is AdamW (like torch.optim.AdamW),
    whose weight_decay left out is torch.optim.AdamW's default, 0.01 (Adam's: 0)."""

    lr: float = DEFAULT_LR["adam"]
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = DEFAULT_EPS["adam"]
    weight_decay: float | None = None  # None: torch's default, 0.01 with decoupled=True (AdamW), else 0
    decoupled: bool = False

    def __post_init__(self) -> None:
        if self.weight_decay is None:
            object.__setattr__(self, "weight_decay", DEFAULT_WEIGHT_DECAY["adamw" if self.decoupled else "adam"])
        floats_as_floats(self)  # lr=20 is lr=20.0 (the job fingerprint hashes the values)
        _check_api_settings(self)  # as torch.optim's constructors do, not at connect

    def job_fields(self) -> dict[str, Any]:
        return {
            "optimizer": "adamw" if self.decoupled else "adam",
            "lr": self.lr,
            "beta1": self.betas[0],
            "beta2": self.betas[1],
            "eps": self.eps,
            "weight_decay": self.weight_decay,
        }


@dataclass(frozen=True)
class Adagrad:
    """Server-side Adagrad (like torch.optim.Adagrad, with its defaults)."""

    lr: float = DEFAULT_LR["adagrad"]
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    eps: float = DEFAULT_EPS["adagrad"]

    def __post_init__(self) -> None:
        floats_as_floats(self)  # lr=20 is lr=20.0 (the job fingerprint hashes the values)
        _check_api_settings(self)  # as torch.optim's constructors do, not at connect

    def job_fields(self) -> dict[str, Any]:
        return {"optimizer": "adagrad", **dataclasses.asdict(self)}


@dataclass(frozen=True)
class RMSprop:
    """Server-side RMSprop (like torch.optim.RMSprop, with its defaults)."""

    lr: float = DEFAULT_LR["rmsprop"]
    alpha: float = 0.99
    eps: float = DEFAULT_EPS["rmsprop"]
    weight_decay: float = 0.0
    momentum: float = 0.0
    centered: bool = False

    def __post_init__(self) -> None:
        floats_as_floats(self)  # lr=20 is lr=20.0 (the job fingerprint hashes the values)
        _check_api_settings(self)  # as torch.optim's constructors do, not at connect

    def job_fields(self) -> dict[str, Any]:
        return {"optimizer": "rmsprop", **dataclasses.asdict(self)}


@dataclass(frozen=True)
class Adadelta:
    """Server-side Adadelta (like torch.optim.Adadelta, with its defaults: lr 1.0)."""

    lr: float = DEFAULT_LR["adadelta"]
    rho: float = 0.9
    eps: float = DEFAULT_EPS["adadelta"]
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        floats_as_floats(self)  # lr=20 is lr=20.0 (the job fingerprint hashes the values)
        _check_api_settings(self)  # as torch.optim's constructors do, not at connect

    def job_fields(self) -> dict[str, Any]:
        return {"optimizer": "adadelta", **dataclasses.asdict(self)}


# What `psgrad.connect(optimizer=...)` takes.
ServerOptimizer = Union[SGD, Adam, Adagrad, RMSprop, Adadelta]
SERVER_OPTIMIZERS = (SGD, Adam, Adagrad, RMSprop, Adadelta)


def check_server_optimizer(optimizer: object) -> None:
    """Raises ConfigError unless optimizer is one of the API's optimizer settings (psgrad.SGD, ...):
    a torch.optim optimizer cannot be sent to the servers, which apply the update themselves."""
    if isinstance(optimizer, SERVER_OPTIMIZERS):
        return
    names = ", ".join(f"psgrad.{c.__name__}" for c in SERVER_OPTIMIZERS[:-1]) + f" or psgrad.{SERVER_OPTIMIZERS[-1].__name__}"
    kind = type(optimizer)
    if kind.__module__.startswith("torch.optim"):
        what = f"torch.optim.{kind.__name__}"
        twin = next((c.__name__ for c in SERVER_OPTIMIZERS if c.__name__ == kind.__name__), None)
        twin = twin or ("Adam" if kind.__name__ == "AdamW" else None)
        hint = (f": the servers apply the update, so give its settings as psgrad.{twin}(lr=..., ...)"
                f"{' with decoupled=True' if kind.__name__ == 'AdamW' else ''}" if twin else
                ": the servers apply the update, and they have only these rules")
        raise ConfigError(
            f"optimizer must be {names} (the servers' update rule and its settings), got a {what}{hint}; "
            "ps.optimizer(model) then gives you the torch.optim.Optimizer to step"
        )
    raise ConfigError(f"optimizer must be {names} (the servers' update rule and its settings), got {optimizer!r}")
