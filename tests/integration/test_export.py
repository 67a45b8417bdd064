"""`export_state_dict`: a running job's weights read from its servers as a state_dict that a fresh
model loads and evaluates exactly like the worker that trained it."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import psgrad
from psgrad.client.export import export_state_dict
from psgrad.config import ClientConfig
from psgrad.errors import JobMismatchError, NotInitializedError
from psgrad.tasks import get_task

pytestmark = pytest.mark.timeout(120)

CLIENT = ClientConfig(connect_timeout_s=10, rpc_timeout_s=60, init_timeout_s=30, reconnect_timeout_s=0)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def test_an_export_loaded_into_a_fresh_model_reproduces_the_workers_accuracy(make_servers) -> None:  # type: ignore[no-untyped-def]
    task = get_task("digits")
    running = make_servers(2)
    addresses = [s.address for s in running]
    model = _model()
    gen = torch.Generator().manual_seed(0)
    with psgrad.connect(addresses, optimizer=psgrad.SGD(lr=0.1), client=CLIENT) as ps:
        opt = ps.optimizer(model)
        for _ in range(60):
            idx = torch.randint(0, len(task.train_x), (32,), generator=gen)
            opt.zero_grad()
            nn.functional.cross_entropy(model(task.train_x[idx]), task.train_y[idx]).backward()
            opt.step()
        trained = _accuracy(model, task.test_x, task.test_y)
    state, versions = export_state_dict(addresses)
    assert versions == [60, 60] and list(state) == [name for name, _ in model.named_parameters()]
    fresh = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    fresh.load_state_dict(state)
    assert _accuracy(fresh, task.test_x, task.test_y) == trained > 0.5
    for name, p in model.named_parameters():
        assert torch.equal(state[name], p.detach())


def test_export_names_what_is_wrong(make_servers) -> None:  # type: ignore[no-untyped-def]
    running = make_servers(2)
    addresses = [s.address for s in running]
    with pytest.raises(NotInitializedError, match=f"server {addresses[0]} holds no job yet"):
        export_state_dict(addresses)
    with psgrad.connect(addresses, client=CLIENT) as ps:
        ps.optimizer(_model())
    with pytest.raises(JobMismatchError, match="listed as shard 0: give --servers in shard order"):
        export_state_dict(addresses[::-1])
