"""The --modes grammar of `psgrad compare`: MODE[:OPTION...], e.g. sync:backup=1, async:dc=0.04, ssp:auto, and the job settings each variant becomes."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from psgrad.core.modes import AUTO_STALENESS_MAX, DECLARED, Mode, find_mode
from psgrad.errors import ConfigError

BASELINES = ("allreduce",)  # no mode: compared beside them, on no servers


def _options(mode: Mode) -> tuple[str, ...]:
    """What a mode accepts after its name, from what it promises (one whose pulls are bounded first
    takes its bound: ssp:S or ssp:auto)."""
    return (
        *(("backup=B", "tables=async") if mode.takes_backup_workers else ()),
        *(("slr", "dc=LAMBDA", "dca=LAMBDA") if mode.stale_gradients else ()),
        *(("max=S",) if mode.bounds_staleness else ()),
        "lr=LR", "compress=NAME", "noef",
    )


# What each mode (and baseline) accepts after its name.
OPTIONS = {**{m.name: _options(m) for m in DECLARED}, **{b: ("lr=LR",) for b in BASELINES}}
GRAMMAR = (
    "MODE[:OPTION...] with MODE sync, async, ssp:S (S >= 0) or ssp:auto, allreduce; options: "
    "sync:backup=B (B backup workers), sync:tables=async (hybrid: the embedding tables async), async/ssp: slr (staleness-aware lr), dc=LAMBDA (DC-ASGD), "
    "dca=LAMBDA (adaptive DC-ASGD), ssp:auto:max=S (the adaptive bound's ceiling); any mode: lr=LR; sync/async/ssp: "
    "compress=NAME (--compress: topk:R, randomk:R, sign, int8), noef (without error feedback)"
)


@dataclass(frozen=True)
class ModeRun:
    """One entry of --modes: the label as the user wrote it, the mode, and the job settings of its
    variant (JobSpec's fields of the same names; CompareConfig.job_spec puts them together)."""

    label: str
    mode: str
    staleness: int = 0
    staleness_max: int = 0  # ssp:auto: the bound adapts at run time within [1, staleness_max]
    staleness_lr: bool = False
    lr: float | None = None  # None: the comparison's lr (or the one its --lr-grid picked)
    backup_workers: int = 0
    dc_asgd: float = 0.0
    dc_asgd_adaptive: bool = False
    compress: str = "none"  # --compress of the variant's job (its workers compress to same-host shards too)
    error_feedback: bool = True
    tables_mode: str = ""  # sync:tables=async: the embedding tables async (hybrid)

    @property
    def baseline(self) -> bool:
        """Whether this is a baseline (allreduce: no servers), not a mode."""
        return self.mode in BASELINES

    @property
    def slug(self) -> str:
        """The label as a directory name: 'async:dc=0.04' -> 'async-dc0.04' ('ssp:2' -> 'ssp2', as before)."""
        name, _, bound = self.label.partition(":")
        mode = find_mode(name)
        if mode is not None and mode.bounds_staleness and bound.isdigit():
            return self.label.replace(":", "")
        return self.label.replace(":", "-").replace("=", "")  # 'async:compress=topk:0.01' -> 'async-compresstopk-0.01'

    def averaged(self, num_workers: int) -> int:
        """How many gradients one update averages: N - backup for sync, N for allreduce, 1 otherwise."""
        mode = find_mode(self.mode)
        return num_workers - self.backup_workers if self.baseline or (mode is not None and mode.synchronous) else 1

    def with_lr(self, lr: float) -> ModeRun:
        """This variant at a fixed lr, labelled as before (the lr is reported beside it)."""
        return replace(self, lr=lr)


def _number(item: str, key: str, value: str, integer: bool) -> float:
    try:
        number = int(value) if integer else float(value)
    except ValueError:
        number = math.nan
    if not (math.isfinite(number) and number >= 0 and (integer or number > 0)):
        kind = "an integer >= 0" if integer else "a finite number > 0"
        raise ConfigError(f"mode {item!r} in --modes: {key}= needs {kind}, got {value!r}")
    return number


def _join_compress_ratios(options: list[str]) -> list[str]:
    """['compress=topk', '0.01', 'noef'] -> ['compress=topk:0.01', 'noef']: a codec's ratio follows
    its name after a colon, which also separates options."""
    out: list[str] = []
    for option in options:
        if out and out[-1] in ("compress=topk", "compress=randomk"):
            out[-1] += ":" + option
        else:
            out.append(option)
    return out


def _compression(item: str, value: str) -> str:
    from psgrad.core.compression import normalize

    try:
        return normalize(value)
    except ConfigError as exc:
        raise ConfigError(f"mode {item!r} in --modes: {exc}") from None


def parse_mode(item: str) -> ModeRun:
    """One --modes entry -> ModeRun. Raises ConfigError naming the entry and what it may hold."""
    parts = item.strip().split(":")
    name, options = parts[0], parts[1:]
    if name not in OPTIONS:
        raise ConfigError(f"unknown mode {name!r} in --modes entry {item!r}; valid: {GRAMMAR}")
    mode = find_mode(name)
    staleness, auto = 0, False
    if mode is not None and mode.bounds_staleness:
        bound = options.pop(0) if options else ""
        if bound == "auto":
            auto = True
        elif bound.isdigit():
            staleness = int(bound)
        else:
            raise ConfigError(f"mode {item!r} in --modes: ssp needs its bound first, ssp:S (S >= 0) or ssp:auto")
    run = ModeRun(item.strip(), name, staleness, staleness_max=AUTO_STALENESS_MAX if auto else 0)
    seen: set[str] = set()
    for option in _join_compress_ratios(options):
        key, sep, value = option.partition("=")
        allowed = {o.partition("=")[0]: bool(o.partition("=")[1]) for o in OPTIONS[name]}
        if key not in allowed or sep != ("=" if allowed[key] else ""):
            raise ConfigError(
                f"mode {item!r} in --modes: {option!r} is not an option of {name}; {name} takes "
                f"{', '.join(OPTIONS[name])}" + (" (max= only with ssp:auto)" if key == "max" else "")
            )
        if key in seen:
            raise ConfigError(f"mode {item!r} in --modes: {key} given twice; give it once")
        if {key, *seen} >= {"dc", "dca"}:
            raise ConfigError(f"mode {item!r} in --modes: dc= and dca= exclude each other (dca=LAMBDA is adaptive "
                              "DC-ASGD with its own lambda): give one of them")
        seen.add(key)
        if key == "lr":
            run = replace(run, lr=_number(item, key, value, integer=False))
        elif key == "slr":
            run = replace(run, staleness_lr=True)
        elif key == "backup":
            run = replace(run, backup_workers=int(_number(item, key, value, integer=True)))
        elif key in ("dc", "dca"):
            run = replace(run, dc_asgd=_number(item, key, value, integer=False), dc_asgd_adaptive=key == "dca")
        elif key == "compress":
            run = replace(run, compress=_compression(item, value))
        elif key == "noef":
            run = replace(run, error_feedback=False)
        elif key == "tables":
            if find_mode(value) is None:
                raise ConfigError(f"mode {item!r} in --modes: tables= takes a mode, e.g. sync:tables=async")
            run = replace(run, tables_mode=value)
        elif key == "max":
            if not auto:
                raise ConfigError(f"mode {item!r} in --modes: max= bounds ssp:auto only")
            ceiling = int(_number(item, key, value, integer=True))
            if ceiling < 1:
                raise ConfigError(f"mode {item!r} in --modes: max= needs an integer >= 1, got {value!r}")
            run = replace(run, staleness_max=ceiling)
    if not run.error_feedback and not _feeds_back(run.compress):
        raise ConfigError(f"mode {item!r} in --modes: noef needs compress= a biased codec (topk:R, randomk:R or sign): "
                          f"with compress {run.compress} no push leaves anything out to feed back; e.g. "
                          f"{name}:compress=topk:0.01:noef")
    return run


def _feeds_back(compress: str) -> bool:
    from psgrad.core.compression import feeds_back

    return feeds_back(compress)


def parse_modes(text: str) -> tuple[ModeRun, ...]:
    """'sync,async:slr,ssp:2,allreduce' -> ModeRuns (see GRAMMAR). Raises ConfigError naming a bad entry."""
    out = tuple(parse_mode(item) for item in text.split(","))
    labels = [m.label for m in out]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"--modes lists a mode twice: {text!r}")
    return out
