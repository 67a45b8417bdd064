"""The --modes grammar of `psgrad compare`: MODE[:OPTION...], e.g. sync:backup=1, async:dc=0.04, ssp:auto, and the flags each variant becomes."""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace

from psgrad.config import MODES
from psgrad.errors import ConfigError

BASELINES = ("allreduce",)
# What each mode accepts after its name (ssp first takes its bound: ssp:S or ssp:auto).
OPTIONS = {
    "sync": ("backup=B", "lr=LR"),
    "async": ("slr", "dc=LAMBDA", "dca=LAMBDA", "lr=LR"),
    "ssp": ("slr", "dc=LAMBDA", "dca=LAMBDA", "max=S", "lr=LR"),
    "allreduce": ("lr=LR",),
}
GRAMMAR = (
    "MODE[:OPTION...] with MODE sync, async, ssp:S (S >= 0) or ssp:auto, allreduce; options: "
    "sync:backup=B (B backup workers), async/ssp: slr (staleness-aware lr), dc=LAMBDA (DC-ASGD), "
    "dca=LAMBDA (adaptive DC-ASGD), ssp:auto:max=S (the adaptive bound's ceiling); any mode: lr=LR"
)


@dataclass(frozen=True)
class ModeRun:
    """One entry of --modes: the label as the user wrote it, the mode, its staleness bound, and its variant.

    staleness_auto: ssp's bound adapts at run time (--staleness auto), at most staleness_max.
    extra: the flags of variants built by other parts of psgrad (backup workers, DC-ASGD, the
    adaptive bound), added after the job's flags in every worker's command line.
    """

    label: str
    mode: str
    staleness: int = 0
    staleness_lr: bool = False
    lr: float | None = None  # None: the comparison's lr (or the one its --lr-grid picked)
    backup_workers: int = 0
    extra: tuple[str, ...] = ()

    @property
    def slug(self) -> str:
        """The label as a directory name: 'async:dc=0.04' -> 'async-dc0.04' ('ssp:2' -> 'ssp2', as before)."""
        if self.label.startswith("ssp:") and self.label[4:].isdigit():
            return self.label.replace(":", "")
        return self.label.replace(":", "-").replace("=", "")

    def averaged(self, num_workers: int) -> int:
        """How many gradients one update averages: N - backup for sync, N for allreduce, 1 otherwise."""
        return num_workers - self.backup_workers if self.mode in ("sync", *BASELINES) else 1

    def with_lr(self, lr: float) -> ModeRun:
        """This variant at a fixed lr, labelled as before (the lr is reported beside it)."""
        return replace(self, lr=lr)

    def flags(self) -> list[str]:
        """The option names of `extra` (--backup-workers, --dc-asgd, ...): what this psgrad must know.
        ssp:auto needs --staleness-max, which came with `--staleness auto` (--staleness itself is older)."""
        needed = [f for f in self.extra if f.startswith("--") and f != "--staleness"]
        return needed + (["--staleness-max"] if "auto" in self.extra and "--staleness-max" not in needed else [])


def _number(item: str, key: str, value: str, integer: bool) -> float:
    try:
        number = int(value) if integer else float(value)
    except ValueError:
        number = math.nan
    if not (math.isfinite(number) and number >= 0 and (integer or number > 0)):
        kind = "an integer >= 0" if integer else "a finite number > 0"
        raise ConfigError(f"mode {item!r} in --modes: {key}= needs {kind}, got {value!r}")
    return number


def parse_mode(item: str) -> ModeRun:
    """One --modes entry -> ModeRun. Raises ConfigError naming the entry and what it may hold."""
    parts = item.strip().split(":")
    name, options = parts[0], parts[1:]
    if name not in (*MODES, *BASELINES):
        raise ConfigError(f"unknown mode {name!r} in --modes entry {item!r}; valid: {GRAMMAR}")
    staleness, auto = 0, False
    if name == "ssp":
        bound = options.pop(0) if options else ""
        if bound == "auto":
            auto = True
        elif bound.isdigit():
            staleness = int(bound)
        else:
            raise ConfigError(f"mode {item!r} in --modes: ssp needs its bound first, ssp:S (S >= 0) or ssp:auto")
    run = ModeRun(item.strip(), name, staleness)
    seen: set[str] = set()
    extra: list[str] = []
    for option in options:
        key, sep, value = option.partition("=")
        allowed = {o.partition("=")[0]: bool(o.partition("=")[1]) for o in OPTIONS[name]}
        if key not in allowed or sep != ("=" if allowed[key] else ""):
            raise ConfigError(
                f"mode {item!r} in --modes: {option!r} is not an option of {name}; {name} takes "
                f"{', '.join(OPTIONS[name])}" + (" (max= only with ssp:auto)" if key == "max" else "")
            )
        if key in seen or {key, *seen} >= {"dc", "dca"}:
            raise ConfigError(f"mode {item!r} in --modes: {key} given twice (dc and dca exclude each other)")
        seen.add(key)
        if key == "lr":
            run = replace(run, lr=_number(item, key, value, integer=False))
        elif key == "slr":
            run = replace(run, staleness_lr=True)
        elif key == "backup":
            run = replace(run, backup_workers=int(_number(item, key, value, integer=True)))
            extra += ["--backup-workers", str(run.backup_workers)]
        elif key in ("dc", "dca"):
            extra += ["--dc-asgd", repr(_number(item, key, value, integer=False))]
            extra += ["--dc-asgd-adaptive"] if key == "dca" else []
        elif key == "max":
            if not auto:
                raise ConfigError(f"mode {item!r} in --modes: max= bounds ssp:auto only")
            extra += ["--staleness-max", str(int(_number(item, key, value, integer=True)))]
    if auto:
        extra = ["--staleness", "auto", *extra]
    return replace(run, extra=tuple(extra))


def parse_modes(text: str) -> tuple[ModeRun, ...]:
    """'sync,async:slr,ssp:2,allreduce' -> ModeRuns (see GRAMMAR). Raises ConfigError naming a bad entry."""
    out = tuple(parse_mode(item) for item in text.split(","))
    labels = [m.label for m in out]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"--modes lists a mode twice: {text!r}")
    return out


def known_flags() -> set[str]:
    """Every option string `psgrad worker` and `psgrad server` accept in this psgrad."""
    from psgrad.cli.parser import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {flag for command in ("worker", "server") for flag in sub.choices[command]._option_string_actions}


def missing_features(modes: tuple[ModeRun, ...], known: set[str] | None = None) -> dict[str, list[str]]:
    """{label: the flags its variant needs that this psgrad lacks}, for the modes that lack any."""
    have = known_flags() if known is None and any(m.extra for m in modes) else (known or set())
    out = {m.label: [f for f in m.flags() if f not in have] for m in modes}
    return {label: flags for label, flags in out.items() if flags}
