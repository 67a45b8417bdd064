"""psgrad/worker/torch_optim.py: the torch.optim face of PSOptimizer."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO, child_env

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
    res = subprocess.run([sys.executable, "-c", _PROGRAM], capture_output=True, text=True, timeout=100, cwd=REPO,
                         env=child_env())
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", res.stdout
