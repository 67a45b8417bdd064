"""`psgrad compare`: its flags -> CompareConfig, and the claims preset."""
from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from psgrad.cli.flags import apply_recipe
from psgrad.errors import ConfigError

if TYPE_CHECKING:
    from psgrad.experiments.compare_config import CompareConfig
    from psgrad.tasks.recipes import Recipe


def _check_task(ns: argparse.Namespace) -> Recipe:
    """Fail fast on an unknown task or its missing data (before any run starts); fill the flags
    left to its recipe (compare's steps) and return it."""
    from psgrad.tasks import check_task

    check_task(ns.task, ns.data_dir)
    return apply_recipe(ns, "compare_steps")


def compare_config(ns: argparse.Namespace) -> CompareConfig:
    """The CompareConfig of `psgrad compare`'s flags."""
    import time

    from psgrad.experiments.compare_config import CompareConfig
    from psgrad.experiments.modes import parse_modes

    recipe = _check_task(ns)
    out = Path(ns.out) if ns.out else Path("runs") / time.strftime("compare-%Y%m%d-%H%M%S")
    return CompareConfig(
        out_dir=out,
        modes=parse_modes(ns.modes),
        task=ns.task,
        num_servers=ns.num_servers,
        num_workers=ns.num_workers,
        steps=ns.steps,
        batch_size=ns.batch_size,
        optimizer=ns.optimizer,
        lr=ns.lr,
        momentum=ns.momentum,
        weight_decay=ns.weight_decay,
        wire_dtype=ns.wire_dtype,
        metric=recipe.metric,
        target=recipe.target if ns.target is None else ns.target,
        lr_schedule=ns.lr_schedule,
        warmup_steps=ns.warmup_steps,
        step_time_ms=ns.step_time_ms,
        data_dir=ns.data_dir,
        repeats=ns.repeats,
        seed=ns.seed,
        stragglers=tuple(ns.straggler or ()),
        jitter_ms=ns.jitter_ms,
        eval_every=ns.eval_every,
        lease_s=ns.lease_s,
        omp_threads=ns.omp_threads or max(1, (os.cpu_count() or 1) // (ns.num_servers + ns.num_workers)),
        tensorboard=ns.tensorboard,
        security=ns.security,
        straggler_dist=ns.straggler_dist,
        slow_node_rotate=ns.slow_node_rotate,
        sync_lr_scaling=ns.sync_lr_scaling,
        lr_grid=ns.lr_grid or (),
        grid_steps=ns.grid_steps,
        grid_by=ns.grid_by,
        save_weights=ns.save_weights,
    )


def cmd_compare(ns: argparse.Namespace) -> int:
    from psgrad.experiments.compare import run_compare
    from psgrad.experiments.compare_config import DEFAULT_MODES, CompareConfig

    command = " ".join(shlex.quote(a) for a in ["psgrad", *ns.raw_argv])
    if ns.preset == "claims":
        from psgrad.experiments.claims import run_claims

        out = Path(ns.out) if ns.out else None
        return run_claims(out, command, quick=ns.quick, seed=ns.seed, data_dir=ns.data_dir)
    if ns.quick:
        raise ConfigError("--quick shrinks --preset claims; give --preset claims too (or --steps for a short compare)")
    explicit_steps = ns.steps is not None
    cfg = compare_config(ns)
    runs = len(cfg.modes) * cfg.repeats
    defaults = (
        cfg.task == CompareConfig.task and ns.modes == DEFAULT_MODES and not explicit_steps
        and ns.repeats == CompareConfig.repeats and ns.num_workers == CompareConfig.num_workers
        and ns.num_servers == CompareConfig.num_servers
    )
    eta = " (about 20 s on an idle 2-core machine with these defaults, minutes on a busy one)" if defaults else ""
    print(
        f"psgrad compare: {', '.join(m.label for m in cfg.modes)} x {cfg.repeats} repeat(s) = {runs} runs, "
        f"{cfg.num_servers} servers + {cfg.num_workers} workers each, {cfg.steps} steps of {cfg.task} "
        f"({cfg.optimizer} lr {cfg.lr:g}, {cfg.lr_schedule} schedule), target {cfg.metric} {cfg.target:g}{eta}; "
        f"writing to {cfg.out_dir}",
        flush=True,
    )
    run_compare(cfg, command)
    return 0


