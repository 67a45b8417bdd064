"""The server optimizers' settings: the API's classes (psgrad.SGD(...), psgrad.Adam(...), ...) and
the JobSpec fields each sets, which optimizer reads which field, valid ranges, and torch.optim's
defaults where they differ. No torch here: the CLI and config use it."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Union

from psgrad.errors import ConfigError

# field -> the optimizers that read it. Set away from its default for any other optimizer, a field
# is refused: it would be ignored without a word.
READERS: dict[str, tuple[str, ...]] = {
    "momentum": ("sgd", "rmsprop"),
    "nesterov": ("sgd",),
    "beta1": ("adam", "adamw"),
    "beta2": ("adam", "adamw"),
    "eps": ("adam", "adamw", "adagrad", "rmsprop", "adadelta"),
    "lr_decay": ("adagrad",),
    "initial_accumulator_value": ("adagrad",),
    "alpha": ("rmsprop",),
    "centered": ("rmsprop",),
    "rho": ("adadelta",),
}
# torch.optim's default eps per optimizer (JobSpec's own default is Adam's); the CLI and the API's
# optimizer classes start from these.
DEFAULT_EPS = {"adam": 1e-8, "adamw": 1e-8, "adagrad": 1e-10, "rmsprop": 1e-8, "adadelta": 1e-6}
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


def check_optimizer_fields(spec: Any) -> None:
    """Validate a JobSpec's optimizer settings (ranges, and none set that its optimizer ignores).

    Raises:
        ConfigError: naming the field and its value.
    """
    for name in _UNIT:
        value = getattr(spec, name)
        _check(math.isfinite(value) and 0 <= value < 1, f"{name} must be in [0, 1), got {value!r}")
    for name in _NONNEG:
        value = getattr(spec, name)
        _check(math.isfinite(value) and value >= 0, f"{name} must be a finite number >= 0, got {value!r}")
    _check(math.isfinite(spec.eps) and spec.eps > 0, f"eps must be a finite number > 0, got {spec.eps!r}")
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
    _check(not spec.nesterov or spec.momentum > 0,
           f"nesterov needs momentum > 0 (like torch.optim.SGD), got momentum {spec.momentum!r}")


# --------------------------------------------------------------------------- the API's classes
@dataclass(frozen=True)
class SGD:
    """Server-side SGD with optional momentum (heavy ball, or nesterov=True) and L2 weight decay
    (like torch.optim.SGD without dampening)."""

    lr: float = 0.1
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self) -> None:
        floats_as_floats(self)  # lr=20 is lr=20.0 (the job fingerprint hashes the values)

    def job_fields(self) -> dict[str, Any]:
        return {"optimizer": "sgd", **dataclasses.asdict(self)}


@dataclass(frozen=True)
class Adam:
    """Server-side Adam (like torch.optim.Adam); decoupled=True gives AdamW's weight decay."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = False

    def __post_init__(self) -> None:
        floats_as_floats(self)  # lr=20 is lr=20.0 (the job fingerprint hashes the values)

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

    lr: float = 1e-2
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0
    eps: float = DEFAULT_EPS["adagrad"]

    def __post_init__(self) -> None:
        floats_as_floats(self)  # lr=20 is lr=20.0 (the job fingerprint hashes the values)

    def job_fields(self) -> dict[str, Any]:
        return {"optimizer": "adagrad", **dataclasses.asdict(self)}


@dataclass(frozen=True)
class RMSprop:
    """Server-side RMSprop (like torch.optim.RMSprop, with its defaults)."""

    lr: float = 1e-2
    alpha: float = 0.99
    eps: float = DEFAULT_EPS["rmsprop"]
    weight_decay: float = 0.0
    momentum: float = 0.0
    centered: bool = False

    def __post_init__(self) -> None:
        floats_as_floats(self)  # lr=20 is lr=20.0 (the job fingerprint hashes the values)

    def job_fields(self) -> dict[str, Any]:
        return {"optimizer": "rmsprop", **dataclasses.asdict(self)}


@dataclass(frozen=True)
class Adadelta:
    """Server-side Adadelta (like torch.optim.Adadelta, with its defaults: lr 1.0)."""

    lr: float = 1.0
    rho: float = 0.9
    eps: float = DEFAULT_EPS["adadelta"]
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        floats_as_floats(self)  # lr=20 is lr=20.0 (the job fingerprint hashes the values)

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
