"""psgrad embeddings' state in a real job: a trained DLRM-like model's state_dict(), saved with
torch.save, gives the same predictions in a fresh process with no servers; the same model given to
a new job on the servers binds again."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import psgrad
from conftest import REPO, child_env
from psgrad.config import ClientConfig
from psgrad.errors import ConfigError, WorkerStateError

CLIENT = ClientConfig(connect_timeout_s=10, rpc_timeout_s=60, init_timeout_s=30, reconnect_timeout_s=0)

# The model and its data, defined once for this process and the fresh one.
MODEL = '''
import torch
from torch import nn
import psgrad


class Dlrm(nn.Module):
    """Dense features through a bottom MLP; two categorical features from psgrad tables (a bag of
    item ids with offsets, one user id with padding); their pairwise dot products; a top MLP."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.bottom = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.items = psgrad.EmbeddingBag(500, 8, mode="sum", std=0.1, seed=5, include_last_offset=True)
        self.user = psgrad.Embedding(300, 8, padding_idx=0, std=0.1, seed=6)
        self.top = nn.Sequential(nn.Linear(8 + 3, 8), nn.ReLU(), nn.Linear(8, 1))

    def forward(self, dense, items, offsets, user):
        z = [self.bottom(dense), self.items(items, offsets), self.user(user)]
        dots = torch.stack([(z[i] * z[j]).sum(-1) for i, j in ((0, 1), (0, 2), (1, 2))], dim=1)
        return self.top(torch.cat([z[0], dots], dim=1)).squeeze(-1)


def batch(seed, n=32):
    """(dense, items, offsets, user, labels) of n examples, from seed."""
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(n, 4, generator=g)
    lengths = torch.randint(1, 4, (n,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    items = torch.randint(0, 500, (int(lengths.sum()),), generator=g)
    user = torch.randint(0, 300, (n,), generator=g)
    return dense, items, offsets, user, (dense[:, 0] + items[offsets[:-1]] % 2 > 0.5).float()
'''
FRESH = MODEL + '''
import sys

state_path, out = sys.argv[1], sys.argv[2]
model = Dlrm()
model.load_state_dict(torch.load(state_path))  # weights_only (torch's default), strict
model.eval()
with torch.no_grad():
    torch.save(model(*batch(99)[:4]), out)
'''


def _definitions() -> dict[str, Any]:
    names: dict[str, Any] = {}
    exec(MODEL, names)
    return names


@pytest.mark.timeout(120)
def test_a_trained_models_state_dict_predicts_the_same_in_a_fresh_process_without_servers(tmp_path: Path) -> None:
    defs = _definitions()
    Dlrm, batch = defs["Dlrm"], defs["batch"]
    servers = [psgrad.serve() for _ in range(2)]
    try:
        addresses = [s.address for s in servers]
        model = Dlrm()
        initial = model.items.initial_weight()
        with psgrad.connect(addresses, mode="async", optimizer=psgrad.Adagrad(lr=0.1), client=CLIENT) as ps:
            opt = ps.optimizer(model, row_cache=1000, row_cache_staleness=2)  # (the state reads past the cache)
            for step in range(6):
                *x, y = batch(step)
                opt.zero_grad()
                nn.functional.binary_cross_entropy_with_logits(model(*x), y).backward()
                opt.step()
            model.eval()
            with torch.no_grad():
                expected = model(*batch(99)[:4])
            state = model.state_dict()
            exported = psgrad.fetch_state_dict(addresses)  # psgrad export's layout: the same tables
            assert model.state_dict(keep_vars=True)["top.2.weight"] is model.top[2].weight
            with pytest.raises(ConfigError, match="into EmbeddingBag at 'items', bound to table 'items'"):
                model.load_state_dict(state)
        ids = state["items.ids"]
        assert ids.numel() > 0 and state["user.ids"].numel() > 0
        assert not torch.allclose(state["items.rows"], initial[ids])  # the rows moved
        for key in ("items.ids", "items.rows", "user.ids", "user.rows", "top.2.weight"):
            assert torch.equal(exported[key], state[key]), key
        # the job closed: the rows are on its servers, and the model says so
        with pytest.raises(WorkerStateError, match="not bound to a job: its job was closed"):
            model(*batch(99)[:4])
        with pytest.raises(WorkerStateError, match="its job was closed.*psgrad.fetch_state_dict"):
            model.state_dict()
        # given to a new job on the same servers, the model binds again and reads the job's rows
        with psgrad.connect(addresses, mode="async", optimizer=psgrad.Adagrad(lr=0.1), client=CLIENT) as ps:
            ps.optimizer(model)
            with torch.no_grad():
                torch.testing.assert_close(model(*batch(99)[:4]), expected, rtol=0, atol=0)
        from_export = Dlrm()
        from_export.load_state_dict(exported)
        from_export.eval()
        with torch.no_grad():
            torch.testing.assert_close(from_export(*batch(99)[:4]), expected, rtol=0, atol=0)
    finally:
        for s in servers:
            s.stop()
    path, out = tmp_path / "model.pt", tmp_path / "predictions.pt"
    torch.save(state, path)
    res = subprocess.run([sys.executable, "-c", FRESH, str(path), str(out)], capture_output=True, text=True,
                         timeout=90, cwd=REPO, env=child_env())
    assert res.returncode == 0, res.stderr[-3000:]
    torch.testing.assert_close(torch.load(out), expected, rtol=1e-6, atol=1e-6)

