"""PSOptimizer's torch.optim face: the learning rate a scheduler (or the user) sets and which one a
push carries, and a state_dict() that holds what lives in the worker."""
from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from psgrad.errors import ConfigError

STATE_KEY = "psgrad"  # the entry of a PSOptimizer's state_dict() that marks it as one


def _beneath_dynamo_guard(method: Any) -> Any:
    """The torch.optim.Optimizer method beneath torch's lazy `torch._dynamo.disable` wrapper.

    torch wraps add_param_group, zero_grad, state_dict and load_state_dict so that TorchDynamo
    never traces them, and the wrapper's first call imports torch._dynamo: 1.8 CPU-seconds in
    every worker process on a 2-core machine, a third of a worker's start. Nothing traces a
    psgrad optimizer (its step is network I/O), so it calls the undecorated method that
    functools.wraps keeps as `__wrapped__`; where a torch version has no such wrapper, the method
    itself.
    """
    return getattr(method, "__wrapped__", method)


_ADD_PARAM_GROUP = _beneath_dynamo_guard(torch.optim.Optimizer.add_param_group)
_STATE_DICT = _beneath_dynamo_guard(torch.optim.Optimizer.state_dict)


class ScheduledOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer with one parameter group whose lr travels with the pushes.

    Subclasses set `rank`, `mode` and `clock` (the job's place of this worker).
    """

    rank: int
    mode: str
    clock: int

    def __init__(self, params: Sequence[torch.Tensor], lr: float, follows_job_lr: bool) -> None:
        super().__init__([{"params": list(params)}], {"lr": lr})  # (one group, even of no parameters: a model of tables alone)
        self._follows_job_lr = follows_job_lr
        self._job_lr: float | None = None  # the job's lr as the servers last answered (followers)
        self._warned_lr = False

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch.optim.Optimizer.add_param_group for the one group __init__ adds, without the import
        of torch._dynamo (see _beneath_dynamo_guard).

        Raises:
            ConfigError: a second group (opt.add_param_group(...)): the model's parameters are all in
                the first, and per-parameter settings are given to ps.optimizer(model, param_groups=...).
        """
        if self.param_groups:
            raise ConfigError(
                "opt.add_param_group(...) is not supported: psgrad's optimizer holds every parameter of the model "
                "in its one group, whose lr (a scheduler's) the job applies; give per-parameter settings to "
                "ps.optimizer(model, param_groups=[{'params': [...], 'lr': ..., 'weight_decay': ...}]), where "
                "a group of psgrad embeddings may also name an optimizer of its own ('optimizer': psgrad.Adagrad(...))"
            )
        _ADD_PARAM_GROUP(self, param_group)

    @property
    def follows_job_lr(self) -> bool:
        """True for a worker of an async or ssp job other than the chief: its pushes are applied
        with the job's lr, which the chief's schedule sets."""
        return self._follows_job_lr

    @property
    def lr(self) -> float:
        """The learning rate of this worker's next step: param_groups[0]["lr"], which a torch LR
        scheduler sets.

        Raises:
            ConfigError: not a finite number >= 0, or more than one parameter group.
        """
        if len(self.param_groups) != 1:
            raise ConfigError(
                f"psgrad applies one learning rate to the whole model; this optimizer has {len(self.param_groups)} "
                "parameter groups (add_param_group is not supported)"
            )
        return _checked_lr(self.param_groups[0]["lr"], "param_groups[0]['lr']")

    def push_lr(self) -> float | None:
        """The lr this step's push carries: `lr`, or None (the job's) for a worker that follows the
        chief's schedule, which warns once if its own lr was changed (a scheduler of its own):
        the job's is applied instead."""
        lr = self.lr
        if not self._follows_job_lr:
            return lr
        if self._job_lr is not None and lr != self._job_lr and not self._warned_lr:
            self._warned_lr = True
            warnings.warn(
                f"worker rank {self.rank} set its lr to {lr:g}, but in {self.mode} mode the job's learning rate "
                "follows the chief's (rank 0's) schedule: this worker's pushes are applied with the job's "
                f"({self._job_lr:g}); run the LR scheduler on rank 0 (it is enough there)",
                stacklevel=3,
            )
        return None

    def job_lr_answered(self, lr: float | None) -> float | None:
        """A follower learns the job's lr the servers applied its push with: it becomes this
        worker's param_groups lr (what it reports). Returns it (None: not a follower, or none)."""
        if not self._follows_job_lr or lr is None:
            return None
        self._job_lr = self.param_groups[0]["lr"] = lr
        return lr

    def state_dict(self) -> dict[str, Any]:
        """What lives in the worker: the parameter group's settings (the lr a scheduler set, its
        initial_lr) and, for information, this worker's rank, mode and clock. The weights and the
        optimizer's moments live on the servers, which checkpoint them (--checkpoint-dir)."""
        saved = _STATE_DICT(self)
        saved[STATE_KEY] = {"rank": self.rank, "mode": self.mode, "clock": self.clock}
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take back what state_dict() gave (with a scheduler's own load_state_dict, the schedule
        resumes where it was). The clock is not restored: the servers place a worker that joins.

        Raises:
            ConfigError: not a PSOptimizer's state_dict (a torch.optim optimizer's: its
                per-parameter state, such as momentum buffers, is the servers' here), more than
                one parameter group, or an lr that is not a finite number >= 0.
        """
        if not isinstance(state_dict, dict) or STATE_KEY not in state_dict:
            held = f" holding per-parameter state for {len(state_dict['state'])} parameters" if (
                isinstance(state_dict, dict) and state_dict.get("state")) else ""
            raise ConfigError(
                f"not a PSOptimizer state_dict (no {STATE_KEY!r} entry){held}: with psgrad the optimizer's "
                "state (momentum, Adam's moments) lives on the servers, which checkpoint and restore it "
                "(--checkpoint-dir); load a state_dict() of a PSOptimizer here, and the model's weights "
                "come from the servers"
            )
        groups = state_dict.get("param_groups", [])
        if len(groups) != 1:
            raise ConfigError(f"a PSOptimizer state_dict has one parameter group, this one has {len(groups)}")
        if state_dict.get("state"):
            raise ConfigError("a PSOptimizer state_dict holds no per-parameter state, this one does")
        group = {k: v for k, v in groups[0].items() if k != "params"}
        _checked_lr(group.get("lr"), "the state_dict's lr")
        self.param_groups[0].update(group)


def _checked_lr(value: Any, what: str) -> float:
    try:
        lr = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"the learning rate must be a finite number >= 0, got {value!r} ({what})") from None
    if not (math.isfinite(lr) and lr >= 0):
        raise ConfigError(f"the learning rate must be a finite number >= 0, got {lr!r} ({what})")
    return lr
