"""psgrad/worker/torch_optim.py: the torch.optim face of PSOptimizer."""
from __future__ import annotations


import pytest

from conftest import run_python
from psgrad.errors import ConfigError

_PROGRAM = """
import sys, torch
from psgrad.worker.torch_optim import ScheduledOptimizer

class Opt(ScheduledOptimizer):
    rank, mode, clock = 1, "async", 7

    def step(self, closure=None):
        return None

opt = Opt([torch.zeros(3, requires_grad=True)], 0.25, follows_job_lr=True)
saved = opt.state_dict()
assert saved["param_groups"][0]["lr"] == 0.25 and saved["psgrad"] == {"rank": 1, "mode": "async", "clock": 7}, saved
opt.param_groups[0]["lr"] = 0.5
opt.load_state_dict(saved)
assert opt.lr == 0.25
print(sorted(m for m in sys.modules if m.startswith("torch._dynamo")))
"""


@pytest.mark.timeout(120)
def test_building_and_saving_the_optimizer_never_imports_torch_dynamo() -> None:
    """torch.optim.Optimizer's add_param_group and state_dict import torch._dynamo on their first
    call (1.8 CPU-s in each worker process); psgrad's optimizer skips that wrapper."""
    # (a process forked from the preloaded template, which has imported torch and psgrad but not torch._dynamo)
    res = run_python(["-c", _PROGRAM], timeout_s=100)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", res.stdout


@pytest.mark.timeout(60)
def test_add_param_group_is_refused_at_the_call_saying_where_groups_go() -> None:
    """opt.add_param_group(...) was taken, and only the next step() failed, with a message about one
    learning rate."""
    import torch

    from psgrad.worker.torch_optim import ScheduledOptimizer

    class Opt(ScheduledOptimizer):
        rank, mode, clock = 0, "async", 0

        def step(self, closure: object = None) -> None:  # type: ignore[override]
            return None

    opt = Opt([torch.zeros(3, requires_grad=True)], 0.25, follows_job_lr=False)
    with pytest.raises(ConfigError, match=r"^opt.add_param_group\(...\) is not supported: .* give per-parameter settings "
                                          r"to ps.optimizer\(model, param_groups=\[\{'params': \[...\], 'lr': ..."):
        opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)], "lr": 0.1})
    assert len(opt.param_groups) == 1 and opt.lr == 0.25
