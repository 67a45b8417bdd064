"""The claims table of `psgrad compare --preset claims`: each published claim, its check on measured summaries, and the verdict."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any
from psgrad.config import metric_rises

SUPPORTED, NOT_SUPPORTED, NOT_RUN = "supported", "not supported", "not run"
# The thresholds: time-to-target ratios, the share of async's gap to recover, the weight tolerance.
STRAGGLER_RATIO = 0.6
BACKUP_RATIO = 0.75
RECOVERED_SHARE = 0.5
WEIGHT_TOLERANCE = 1e-5

Summary = Mapping[str, Mapping[str, Any]]  # {mode label: analysis.aggregate(...)} of one experiment


@dataclass(frozen=True)
class Verdict:
    """One row of the claims table."""

    claim: str
    source: str
    figures: str  # the measured figures, mean ± std over seeds
    check: str  # the test applied, with the measured value
    verdict: str  # SUPPORTED, NOT_SUPPORTED or NOT_RUN
    why: str = ""  # what decided it, in words (always for "not supported")

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def _entry(summary: Summary | None, label: str, key: str) -> Mapping[str, Any] | None:
    if summary is None or label not in summary:
        return None
    value = summary[label].get(key)
    return value if isinstance(value, Mapping) else None


def _mean(summary: Summary | None, label: str, key: str) -> float | None:
    entry = _entry(summary, label, key)
    mean = None if entry is None else entry.get("mean")
    return float(mean) if mean is not None and math.isfinite(mean) else None


def _fig(summary: Summary | None, label: str, key: str, unit: str = "", decimals: int = 2) -> str:
    entry = _entry(summary, label, key)
    if entry is None or entry.get("mean") is None:
        reached = "" if entry is None or "reached" not in entry else f" (0/{summary[label]['repeats']} reached)"  # type: ignore[index]
        return f"{label}: -{reached}"
    text = f"{label}: {entry['mean']:.{decimals}f} ± {entry['std']:.{decimals}f}{unit}"
    if "reached" in entry:
        text += f" ({entry['reached']}/{summary[label]['repeats']} reached)"  # type: ignore[index]
    return text


def _all_reached(summary: Summary, label: str) -> bool:
    entry = _entry(summary, label, "time_to_target_s")
    return entry is not None and entry.get("reached", 0) == summary[label].get("repeats", -1) > 0


def _absent(summary: Summary | None, labels: Sequence[str]) -> str:
    """Why a claim could not be checked ("" when every mode of labels has results)."""
    if summary is None:
        return "its experiment did not finish (see its output.log files)"
    lacking = [label for label in labels if label not in summary]
    return f"no results for {', '.join(lacking)}" if lacking else ""


def time_ratio_claim(
    claim: str, source: str, summary: Summary | None, fast: Sequence[str], slow: str, limit: float,
) -> Verdict:
    """Each mode of `fast` reaches the target in <= limit x `slow`'s mean wall time (every seed reaching it)."""
    absent = _absent(summary, [slow, *fast])
    if absent or summary is None:
        return Verdict(claim, source, "-", f"time to target <= {limit:g} x {slow}'s", NOT_RUN, absent)
    figures = "; ".join(_fig(summary, label, "time_to_target_s", " s") for label in (slow, *fast))
    base = _mean(summary, slow, "time_to_target_s")
    checks, failures = [], []
    for label in fast:
        t = _mean(summary, label, "time_to_target_s")
        if base is None or t is None or not _all_reached(summary, label) or not _all_reached(summary, slow):
            who = slow if base is None or not _all_reached(summary, slow) else label
            checks.append(f"{label}/{slow} = ?")
            failures.append(f"{who} did not reach the target in every seed, so the ratio is not measured")
            continue
        ratio = t / base
        checks.append(f"{label}/{slow} = {ratio:.2f}")
        if ratio > limit:
            failures.append(f"{label} took {ratio:.2f}x {slow}'s time, above {limit:g}x")
    check = f"{', '.join(checks)} (need <= {limit:g})"
    return Verdict(claim, source, figures, check, NOT_SUPPORTED if failures else SUPPORTED, "; ".join(failures))


def gap_claim(
    claim: str, source: str, summary: Summary | None, fixes: Sequence[str], metric: str,
    bad: str = "async", good: str = "sync",
) -> Verdict:
    """At least one of `fixes` recovers >= RECOVERED_SHARE of the final-metric gap from `bad` to `good`:
    (fix - bad) / (good - bad), signs taken so that better is positive (accuracy up, loss down)."""
    key = f"final_{metric}"
    absent = _absent(summary, [good, bad, *fixes])
    if absent or summary is None:
        return Verdict(claim, source, "-", f"recovers >= {RECOVERED_SHARE:.0%} of the {bad}-{good} gap", NOT_RUN, absent)
    name = metric.removeprefix("test_")
    figures = f"final {name}: " + "; ".join(_fig(summary, label, key, decimals=4) for label in (good, bad, *fixes))
    sign = 1.0 if metric_rises(metric) else -1.0
    g, b = _mean(summary, good, key), _mean(summary, bad, key)
    if g is None or b is None:
        return Verdict(claim, source, figures, "gap not measured", NOT_SUPPORTED, f"no final {name} of {good} or {bad}")
    gap = sign * (g - b)
    if gap <= 0:
        return Verdict(claim, source, figures, f"{good} - {bad} = {gap:+.4f}: no gap", NOT_SUPPORTED,
                       f"{bad} was not behind {good} here, so there was no gap to recover")
    shares = {label: sign * ((_mean(summary, label, key) or math.nan) - b) / gap for label in fixes}
    check = ", ".join(f"{label} recovers {share:.0%}" for label, share in shares.items())
    check += f" of the {gap:.4f} gap (need >= {RECOVERED_SHARE:.0%})"
    best = max((s for s in shares.values() if math.isfinite(s)), default=math.nan)
    ok = math.isfinite(best) and best >= RECOVERED_SHARE
    why = "" if ok else f"the best fix recovered {best:.0%} of the gap"
    return Verdict(claim, source, figures, check, SUPPORTED if ok else NOT_SUPPORTED, why)


def weights_claim(
    claim: str, source: str, diff: Mapping[str, Any] | None, control: Mapping[str, Any] | None = None
) -> Verdict:
    """sync and allreduce end with the same weights: max abs difference of the parameters <= WEIGHT_TOLERANCE.

    control: the same comparison where the summation order cannot differ (2 workers); when it is
    within tolerance and diff is not, the reason given is float rounding amplified by training.
    """
    if diff is None or diff.get("max_abs_diff") is None:
        why = "no final weights to compare" if diff is None else str(diff.get("error", "no final weights"))
        return Verdict(claim, source, "-", f"max |w_sync - w_allreduce| <= {WEIGHT_TOLERANCE:g}", NOT_SUPPORTED, why)
    value = float(diff["max_abs_diff"])
    losses = ""
    if diff.get("loss_sync") is not None and diff.get("loss_allreduce") is not None:
        losses = f"; final test loss sync {diff['loss_sync']:.6f}, allreduce {diff['loss_allreduce']:.6f}"
    figures = (f"max |w_sync - w_allreduce| = {value:.3g} over {diff['parameters']:,} parameters after "
               f"{diff['steps']} steps{losses}")
    ok = value <= WEIGHT_TOLERANCE
    why = "" if ok else f"the weights differ by {value:.3g}"
    if not ok and control is not None and control.get("max_abs_diff") is not None:
        if float(control["max_abs_diff"]) <= WEIGHT_TOLERANCE:
            why += (f"; with 2 workers, whose two gradients sum alike in any order, they differ by "
                    f"{float(control['max_abs_diff']):.3g}: the same algorithm, whose rounding differences "
                    "(summation order) this training amplifies")
        else:
            why += "; the 2-worker control differs too: more than summation order"
    return Verdict(claim, source, figures, f"{value:.3g} <= {WEIGHT_TOLERANCE:g}", SUPPORTED if ok else NOT_SUPPORTED, why)


def table_markdown(verdicts: Sequence[Verdict]) -> list[str]:
    """The claims table as markdown lines."""
    lines = ["| claim | source | measured (mean ± std over seeds) | check | verdict |", "|---|---|---|---|---|"]
    for v in verdicts:
        verdict = f"**{v.verdict}**" + (f": {v.why}" if v.why else "")
        cells = (v.claim, v.source, v.figures, v.check, verdict)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return lines


def parse_table(text: str) -> list[dict[str, str]]:
    """The rows of the claims table in a report.md (what table_markdown wrote), for tests and tools."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("| claim |")), None)
    if start is None:
        return []
    header = [c.strip() for c in lines[start].strip().strip("|").split(" | ")]
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("| "):
            break
        cells = [c.strip() for c in line.strip().removeprefix("|").removesuffix("|").split(" | ")]
        rows.append(dict(zip(header, cells)))
    return rows
