"""`psgrad compare --preset claims`: the experiments that check published claims about the modes, run in one command, and their claims table."""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from psgrad.experiments.compare import run_compare
from psgrad.experiments.compare_config import CompareConfig
from psgrad.errors import PsgradError
from psgrad.experiments.modes import parse_modes
from psgrad.experiments.verdicts import (
    BACKUP_RATIO, NOT_RUN, STRAGGLER_RATIO, Verdict, gap_claim, table_markdown, time_ratio_claim, weights_claim,
)

# The full preset: the CNN of "Tasks" with an emulated accelerator step, so that the waits, not this
# machine's 2 cores, set the pace; settings chosen before looking at what the modes achieve. The
# straggler claims run on mnist (bundled, quick to evaluate); the gap claims on fashion-mnist, where
# async is measurably behind sync with the recipe's momentum 0.9 (on mnist the gap is within noise).
STEP_TIME_MS = 60.0
STRAGGLER = (0, 4.0)  # rank 0 takes 4x the step time
STRAGGLER_MODES = "sync,sync:backup=1,async,ssp:2,ssp:auto"
# Random slow steps on every worker, the setting of Ho et al.'s and Chen et al.'s stragglers (a
# persistent slow node stalls SSP too once it is S iterations behind).
TAIL = ("lognormal", 1.0)
TAIL_MODES = "sync,sync:backup=1,ssp:2"
WIDE_MODES = "sync,async,async:slr,async:dc=0.04,async:dca=2"  # DC-ASGD's lambdas: Zheng et al.'s
WEIGHT_MODES = "sync,allreduce"
WEIGHT_LABELS = tuple(WEIGHT_MODES.split(","))  # its runs' labels (runs/LABEL-r0/)
WEIGHT_STEPS = 100
# The check runs 4 workers; the control, 2 workers, whose two gradients sum to the same float
# in either order, so that the only difference left between sync and allreduce is the algorithm.
WEIGHT_RUNS = {"allreduce": 4, "allreduce2": 2}
# The recipe of both image tasks (docs/guide/tasks.md), and its target, per task.
RECIPE: dict[str, Any] = dict(num_servers=2, optimizer="sgd", lr=0.05, momentum=0.9, weight_decay=5e-4,
                              lr_schedule="cosine", omp_threads=1)


@dataclass(frozen=True)
class Experiment:
    """One comparison of the preset: a name (its directory under the output), what it tests, its config."""

    name: str
    purpose: str
    config: CompareConfig


def preset(out: Path, quick: bool = False, seed: int = 0, data_dir: str | None = None) -> list[Experiment]:
    """The experiments of --preset claims (quick: one tiny comparison of every mode on digits that
    stands in for all three, to check the machinery, not the claims; with every straggler model)."""
    if quick:
        labels = dict.fromkeys(",".join((STRAGGLER_MODES, TAIL_MODES, WIDE_MODES, WEIGHT_MODES)).split(","))
        modes = parse_modes(",".join(labels))
        cfg = CompareConfig(out_dir=out / "quick", modes=modes, task="digits", num_servers=1, num_workers=2,
                            steps=30, target=0.5, repeats=1, seed=seed, stragglers=((0, 2.0),), step_time_ms=5.0,
                            save_weights=True, omp_threads=1, straggler_dist=("pareto", 3.0), slow_node_rotate=10)
        return [Experiment(name, "every mode, tiny", cfg) for name in ("stragglers", "tail", "workers8", *WEIGHT_RUNS)]
    mnist = dict(RECIPE, task="mnist", warmup_steps=15, target=0.95, seed=seed)
    fashion = dict(RECIPE, task="fashion-mnist", warmup_steps=30, target=0.85, seed=seed, data_dir=data_dir)
    return [
        Experiment("stragglers", f"mnist, 4 workers, worker {STRAGGLER[0]} takes {STRAGGLER[1]:g}x the "
                   f"{STEP_TIME_MS:g} ms step: time to target by mode", CompareConfig(
                       out_dir=out / "stragglers", modes=parse_modes(STRAGGLER_MODES), num_workers=4, steps=120,
                       repeats=2, stragglers=(STRAGGLER,), step_time_ms=STEP_TIME_MS, eval_every=10, **mnist)),
        Experiment("tail", f"mnist, 4 workers, every step {TAIL[0]}-stretched (sigma {TAIL[1]:g}) from the "
                   f"{STEP_TIME_MS:g} ms step: time to target by mode", CompareConfig(
                       out_dir=out / "tail", modes=parse_modes(TAIL_MODES), num_workers=4, steps=120, repeats=2,
                       straggler_dist=TAIL, step_time_ms=STEP_TIME_MS, eval_every=10, **mnist)),
        Experiment("workers8", f"fashion-mnist, 8 workers, a {2 * STEP_TIME_MS:g} ms step, no straggler: final "
                   "accuracy of async and its fixes against sync", CompareConfig(
                       out_dir=out / "workers8", modes=parse_modes(WIDE_MODES), num_workers=8, steps=120,
                       repeats=2, step_time_ms=2 * STEP_TIME_MS, eval_every=40, **fashion)),
        *(Experiment(name, f"mnist, {workers} workers, {WEIGHT_STEPS} steps: final weights of sync and allreduce",
                     CompareConfig(out_dir=out / name, modes=parse_modes(WEIGHT_MODES), num_workers=workers,
                                   steps=WEIGHT_STEPS, repeats=1, save_weights=True, **mnist))
          for name, workers in WEIGHT_RUNS.items()),
    ]


def weight_difference(run_dir: Path, task: str, steps: int, loss: Mapping[str, float | None]) -> dict[str, Any]:
    """Max abs difference of the parameters (not BatchNorm's running statistics, which each
    allreduce rank keeps to itself) in runs/sync-r0/model.pt and runs/allreduce-r0/model.pt."""
    import torch

    from psgrad.tasks import get_task

    paths = {mode: run_dir / "runs" / f"{mode}-r0" / "model.pt" for mode in WEIGHT_LABELS}
    if not all(p.exists() for p in paths.values()):
        return {"error": "a final model was not saved: " + ", ".join(str(p) for p in paths.values() if not p.exists())}
    names = [name for name, _ in get_task(task).build_model().named_parameters()]
    sync, ring = (torch.load(p, map_location="cpu", weights_only=True) for p in paths.values())
    diff = max(float((sync[n].double() - ring[n].double()).abs().max()) for n in names)
    return {"max_abs_diff": diff, "parameters": sum(sync[n].numel() for n in names), "steps": steps,
            "loss_sync": loss.get("sync"), "loss_allreduce": loss.get("allreduce")}


def emulation_check(directory: Path, step_time_ms: float) -> dict[str, Any] | None:
    """How well the emulated step time held in an experiment's runs (grid runs aside): the median
    compute time of a step and the share of steps (the first of each worker aside) whose compute
    alone took longer than the emulated step, so that no wait was left (a busy machine)."""
    from psgrad.metrics.jsonl import read_jsonl

    if step_time_ms <= 0:
        return None
    steps = [r for path in sorted(directory.glob("runs/*-r*/worker*.jsonl")) for r in read_jsonl(path)
             if "event" not in r and int(r.get("step", 0)) >= 2 and "delay_s" in r]
    if not steps:
        return None
    compute = sorted(float(r["compute_s"]) for r in steps)
    overran = sum(float(r["delay_s"]) <= 0.0 for r in steps)
    return {"step_time_ms": step_time_ms, "median_compute_ms": 1000 * compute[len(compute) // 2],
            "overrun_share": overran / len(steps), "steps": len(steps)}


def verdicts(
    results: Mapping[str, Mapping[str, Any] | None], weights: Mapping[str, Mapping[str, Any] | None],
    metric: str = "test_accuracy",
) -> list[Verdict]:
    """The claims table's rows from each experiment's summary ({mode: aggregate}; None: not run)."""
    straggle, tail, wide = results.get("stragglers"), results.get("tail"), results.get("workers8")
    return [
        time_ratio_claim("SSP (and async) beat BSP with a straggler (one worker 4x slower throughout)",
                         "Ho et al., NIPS'13", straggle, ["ssp:2", "async"], "sync", STRAGGLER_RATIO),
        time_ratio_claim("SSP beats BSP with random slow steps (log-normal, sigma 1, on every worker)",
                         "Ho et al., NIPS'13", tail, ["ssp:2"], "sync", STRAGGLER_RATIO),
        _with_bound(time_ratio_claim("an adaptive staleness bound keeps SSP's advantage (4x straggler)",
                                     "psgrad (--staleness auto)", straggle, ["ssp:auto"], "sync", STRAGGLER_RATIO),
                    straggle, "ssp:auto"),
        time_ratio_claim("sync with b = 1 backup worker beats plain sync (4x straggler)", "Chen et al., 2016",
                         straggle, ["sync:backup=1"], "sync", BACKUP_RATIO),
        time_ratio_claim("sync with b = 1 backup worker beats plain sync (random slow steps)", "Chen et al., 2016",
                         tail, ["sync:backup=1"], "sync", BACKUP_RATIO),
        gap_claim("dividing the step by the staleness rescues async", "Zhang et al., IJCAI'16",
                  wide, ["async:slr"], metric),
        gap_claim("delay compensation closes most of async's gap", "Zheng et al., ICML'17 (DC-ASGD)",
                  wide, ["async:dc=0.04", "async:dca=2"], metric),
        weights_claim("sync and allreduce are the same algorithm", "psgrad (float summation order aside)",
                      weights.get("allreduce"), control=weights.get("allreduce2")),
        weights_claim("sync and allreduce are the same algorithm, 2 workers (no summation order to differ)",
                      "psgrad (control)", weights.get("allreduce2")),
    ]


def _with_bound(verdict: Verdict, summary: Mapping[str, Any] | None, label: str) -> Verdict:
    """The adaptive bound's mean and largest value (over the run's steps, mean over seeds) beside its times."""
    agg = (summary or {}).get(label, {})
    mean, top = (agg.get(k, {}).get("mean") for k in ("staleness_bound_mean", "staleness_bound_max"))
    if mean is None or top is None:
        return verdict
    return replace(verdict, figures=f"{verdict.figures}; {label}'s bound: mean {mean:.1f}, max {top:.1f}")


def _final_loss(summary: Mapping[str, Any] | None, label: str) -> float | None:
    entry = (summary or {}).get(label, {}).get("final_test_loss") or {}
    return entry.get("mean")


def run_claims(
    out: Path | None, command: str, quick: bool = False, seed: int = 0, data_dir: str | None = None,
    progress: bool = True, log: Callable[[str], None] = print,
) -> int:
    """Run the preset, then write out/report.md (the claims table, each experiment's figures) and
    out/claims.json. Returns 0 (a claim that does not hold is a finding, not an error).

    Raises:
        TaskError: an experiment's task cannot find its data (before anything starts).
    """
    from psgrad.tasks import check_task

    out = out if out is not None else Path("runs") / time.strftime("claims-%Y%m%d-%H%M%S")
    experiments = preset(out, quick, seed, data_dir)
    for task, task_dir in dict.fromkeys((e.config.task, e.config.data_dir) for e in experiments):
        check_task(task, task_dir)  # fashion-mnist's files missing: exit 2 before anything starts
    out.mkdir(parents=True, exist_ok=True)
    start, load_before = time.monotonic(), os.getloadavg()
    done: dict[Path, Mapping[str, Any] | None] = {}
    failed: dict[str, str] = {}
    results: dict[str, Mapping[str, Any] | None] = {}
    for exp in experiments:
        if exp.config.out_dir not in done:
            log(f"== claims: {exp.name}: {exp.purpose}")
            try:
                done[exp.config.out_dir] = run_compare(exp.config, f"{command}  # experiment {exp.name}", progress,
                                                       log)["modes"]
            except PsgradError as exc:  # one failed run costs its experiment's rows, not the others'
                log(f"== claims: {exp.name} failed: {exc}")
                failed[exp.name], done[exp.config.out_dir] = str(exc), None
        results[exp.name] = done[exp.config.out_dir]
    emulation = {e.name: emulation_check(e.config.out_dir, e.config.step_time_ms) for e in experiments}
    weights = {e.name: weight_difference(e.config.out_dir, e.config.task, e.config.steps,
                                         {m: _final_loss(results[e.name], m) for m in WEIGHT_LABELS})
               for e in experiments if e.name in WEIGHT_RUNS}
    rows = verdicts(results, weights)
    elapsed, load_after = time.monotonic() - start, os.getloadavg()
    document = {"command": command, "quick": quick, "wall_s": elapsed, "loadavg_start": load_before,
                "loadavg_end": load_after, "claims": [r.as_dict() for r in rows], "weights": weights,
                "failed": failed, "experiments": {e.name: e.purpose for e in experiments},
                "emulation": emulation}
    (out / "claims.json").write_text(json.dumps(document, indent=2, default=str))
    write_claims_report(out, experiments, rows, document)
    for row in rows:
        log(f"{row.verdict:>13}  {row.claim}: {row.check}")
    log(f"wrote {out}/report.md and claims.json in {elapsed / 60:.1f} min")
    return 0


def write_claims_report(out: Path, experiments: list[Experiment], rows: list[Verdict], doc: Mapping[str, Any]) -> Path:
    """out/report.md: the command, the claims table, how each was checked, and each experiment's figures."""
    lines = ["# psgrad compare --preset claims", "", "Command:", "", "```", doc["command"], "```", "",
             f"Wall time {doc['wall_s'] / 60:.1f} min; load average (1, 5, 15 min) at the start "
             f"{', '.join(f'{x:.1f}' for x in doc['loadavg_start'])}, at the end "
             f"{', '.join(f'{x:.1f}' for x in doc['loadavg_end'])}; {os.cpu_count()} CPUs.", ""]
    if doc["quick"]:
        lines += ["**Quick mode**: one tiny digits comparison stands in for every experiment; it checks that "
                  "the preset runs, and its verdicts say nothing about the claims.", ""]
    lines += ["## Claims", "", *table_markdown(rows), "",
              "Verdicts compare means over the seeds with the thresholds in the check column (time ratios are "
              f"of mean wall time to the target, every seed having reached it). \"{NOT_RUN}\": a run of the "
              "experiment failed (below, and its output.log says why).", "",
              *(f"- **{name} failed**: {why}" for name, why in doc["failed"].items()),
              "## Experiments", ""]
    seen: set[Path] = set()
    for exp in experiments:
        directory = exp.config.out_dir
        if directory in seen:
            continue
        seen.add(directory)
        rel = directory.relative_to(out)
        lines += [f"### {exp.name}: {exp.purpose}", "",
                  f"Modes {', '.join(m.label for m in exp.config.modes)}; "
                  f"{exp.config.repeats} seed(s) from "
                  f"{exp.config.seed}; {exp.config.steps} steps per worker; full table in [{rel}/report.md]({rel}/report.md).",
                  ""]
        emulated = doc["emulation"].get(exp.name)
        if emulated is not None:
            lines += [f"Emulation: a step's median compute took {emulated['median_compute_ms']:.0f} ms against the "
                      f"emulated {emulated['step_time_ms']:g} ms; {emulated['overrun_share']:.0%} of "
                      f"{emulated['steps']:,} steps overran it (no wait left: their time is this machine's, "
                      "not the emulated accelerator's; a large share means the machine was too busy for the "
                      "wall-time figures to mean what they should).", ""]
        for name, title in (("convergence.png", "convergence"), ("staleness.png", "staleness")):
            if (directory / name).exists():
                lines += [f"![{exp.name}: {title}]({rel}/{name})", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
