"""Frozen parameters (requires_grad=False) on the servers, ps.optimizer's default: a table of their own
per shard that the chief writes at init and every worker reads as it joins. A step's push and pull never
carry them (the same bytes as the model without them); a restart from a checkpoint and a standby's
failover keep them; frozen="local" leaves them in each worker."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import psgrad
from psgrad.config import ClientConfig
from psgrad.errors import JobMismatchError

pytestmark = pytest.mark.timeout(60)

CLIENT = ClientConfig(connect_timeout_s=10, rpc_timeout_s=60, init_timeout_s=30, reconnect_timeout_s=0)
WIDTH = 256  # the backbone: 256 x 256 + 256 frozen values (257 KiB), the head 2,570 trainable ones
STEPS = 3


def _finetune(backbone: bool = True, seed: int = 0) -> nn.Sequential:
    """A head on a frozen backbone (or the head alone: the same trainable parameters)."""
    torch.manual_seed(seed)
    model = nn.Sequential(*([nn.Linear(WIDTH, WIDTH), nn.Tanh()] if backbone else []), nn.Linear(WIDTH, 10))
    if backbone:
        model[0].requires_grad_(False)
    return model


def _steps(model: nn.Module, opt: psgrad.PSOptimizer, steps: int = STEPS) -> None:
    gen = torch.Generator().manual_seed(1)
    device = next(model.parameters()).device
    for _ in range(steps):
        x, y = torch.randn(8, WIDTH, generator=gen).to(device), torch.randint(0, 10, (8,), generator=gen).to(device)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _bytes(running: list[Any]) -> tuple[int, int]:
    """Payload bytes the servers received and sent so far (pushes; pulls of weights, rows, tables)."""
    statuses = [s.shard.status() for s in running]
    return sum(st.bytes_in for st in statuses), sum(st.bytes_out for st in statuses)


def test_a_frozen_backbone_on_the_servers_adds_no_bytes_to_a_step(make_servers: Any) -> None:
    """The same job with and without a frozen backbone moves the same bytes per step (the trainable
    head's, each way); the backbone crosses once, when the worker joins."""
    joined: dict[bool, tuple[int, int]] = {}
    per_step: dict[bool, tuple[float, float]] = {}
    for backbone in (False, True):
        running = make_servers(2)
        with psgrad.connect([s.address for s in running], client=CLIENT) as ps:
            model = _finetune(backbone)
            opt = ps.optimizer(model)  # frozen="servers": the default
            joined[backbone] = before = _bytes(running)
            _steps(model, opt)
            after = _bytes(running)
        per_step[backbone] = ((after[0] - before[0]) / STEPS, (after[1] - before[1]) / STEPS)
    head = 4 * (WIDTH * 10 + 10)
    assert per_step[True] == per_step[False] == (head, head)
    frozen = 4 * (WIDTH * WIDTH + WIDTH)
    assert joined[True][1] - joined[False][1] == frozen  # read once, at join


@pytest.mark.parametrize("device, overlap", [("cpu", False), ("cpu", True), pytest.param("cuda", False, marks=pytest.mark.cuda)])
def test_every_worker_reads_the_chiefs_frozen_values_as_it_joins(make_servers: Any, device: str, overlap: bool) -> None:
    running = make_servers(2)
    addresses = [s.address for s in running]
    chief_model, other = _finetune(seed=0), _finetune(seed=1).to(device)
    assert not torch.equal(chief_model[0].weight, other[0].weight.cpu())
    backbone = [p.detach().clone().to(device) for p in chief_model[0].parameters()]
    with psgrad.connect(addresses, num_workers=2, client=CLIENT) as chief:
        chief.optimizer(chief_model)
        with psgrad.connect(addresses, rank=1, num_workers=2, client=CLIENT) as ps:
            opt = ps.optimizer(other, overlap=overlap)
            assert all(torch.equal(a, b) for a, b in zip(other[0].parameters(), backbone))
            _steps(other, opt)
            opt.synchronize()
            assert all(torch.equal(a, b) for a, b in zip(other[0].parameters(), backbone))  # never moved
            assert opt.client.frozen_moved() == []
    tables = [t for s in running for t in s.shard.status().tables if t.kind == "frozen"]
    assert [t.name for t in tables] == ["frozen", "frozen"]  # every shard keeps a range of them
    assert sum(t.numel for t in tables) == WIDTH * WIDTH + WIDTH and {t.updates for t in tables} == {1}


def test_frozen_local_keeps_each_workers_own_and_the_job_says_so(make_servers: Any) -> None:
    """frozen="local": nothing frozen reaches the servers (no frozen table, an export without them);
    a worker that would keep them on the servers is refused by such a job, naming why."""
    running = make_servers(1)
    addresses = [s.address for s in running]
    chief_model, other = _finetune(seed=0), _finetune(seed=1)
    own = other[0].weight.detach().clone()
    with psgrad.connect(addresses, num_workers=2, client=CLIENT) as chief:
        chief.optimizer(chief_model, frozen="local")
        with psgrad.connect(addresses, rank=1, num_workers=2, client=CLIENT) as ps:
            opt = ps.optimizer(other, frozen="local")
            _steps(other, opt)
            assert torch.equal(other[0].weight, own)
        with psgrad.connect(addresses, rank=1, num_workers=2, client=CLIENT) as ps:
            with pytest.raises(JobMismatchError, match="frozen parameters differ"):
                ps.optimizer(_finetune(seed=1))
    assert [t.kind for t in running[0].shard.status().tables] == ["dense"]
    assert "0.weight" not in psgrad.fetch_state_dict(addresses)


def test_frozen_values_survive_a_restart_from_a_checkpoint(make_servers: Any, tmp_path: Path) -> None:
    [first] = make_servers(1, checkpoint_dir=str(tmp_path))
    model = _finetune()
    with psgrad.connect([first.address], client=CLIENT) as ps:
        _steps(model, ps.optimizer(model))
    first.stop(0)  # a last checkpoint
    [restored] = make_servers(1, checkpoint_dir=str(tmp_path))
    table = restored.shard.core.state.frozen
    assert table is not None and table.version == 1  # restored, not written again
    fresh = _finetune(seed=5)
    fresh.load_state_dict(psgrad.fetch_state_dict([restored.address]))  # strict
    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name


def test_frozen_values_survive_a_failover_to_the_standby(make_servers: Any) -> None:
    [primary] = make_servers(1)
    [backup] = make_servers(1, replica_of=primary.address)
    shard = [f"{primary.address}|{backup.address}"]
    config = ClientConfig(connect_timeout_s=5, rpc_timeout_s=10, reconnect_timeout_s=10, shared_memory=False)
    chief_model = _finetune(seed=0)
    with psgrad.connect(shard, num_workers=2, client=config) as chief:
        opt = chief.optimizer(chief_model)
        _steps(chief_model, opt, 1)
        primary.stop(0)
        _steps(chief_model, opt, 1)  # fails over; the standby's frozen table is the primary's
        assert opt.client.frozen_moved() == []
        late = _finetune(seed=1)
        with psgrad.connect(shard, rank=1, num_workers=2, client=config) as ps:
            ps.optimizer(late)  # lists the dead primary first
            assert torch.equal(late[0].weight, chief_model[0].weight) and torch.equal(late[0].bias, chief_model[0].bias)


class Recommender(nn.Module):
    """A recommender's state the flat float32 space rounded or left out: an int64 id map with ids
    past 2**24, a frozen float64 scale, a bool mask; beside a trainable part with BatchNorm."""

    def __init__(self, ids: tuple[int, ...] = (2**40 + 1, 123456789012345, 7), scale: float = 1 / 3,
                 mask: tuple[bool, ...] = (True, False, True)) -> None:
        super().__init__()
        self.items = psgrad.Embedding(20, 8)
        self.proj = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.scale = nn.Parameter(torch.tensor([scale], dtype=torch.float64), requires_grad=False)
        self.register_buffer("id_map", torch.tensor(ids))
        self.register_buffer("mask", torch.tensor(mask))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.proj(self.items(x))) * self.scale.float()


def _exact(model: nn.Module) -> dict[str, torch.Tensor]:
    return {"id_map": model.id_map.clone(), "scale": model.scale.detach().clone(), "mask": model.mask.clone()}


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)


def test_int64_and_bool_buffers_and_float64_frozen_values_stay_exact(make_servers: Any) -> None:
    """With ps.optimizer's defaults, an int64 buffer [2**40 + 1, 123456789012345] became
    [1099511627776, 123456788103168] in the worker's own model the moment it joined, and a frozen
    float64 1/3 0.3333333432674408 (both went through float32), silently; a bool buffer was left out
    of the job, so fetch_state_dict did not load strictly (Missing key(s): "mask"). Now they are
    kept bit for bit: the chief's, in every worker as it joins and after its steps, and in the
    export, which loads strictly. A worker whose id map float32 could hold is refused, by name."""
    addresses = [s.address for s in make_servers(2)]
    torch.manual_seed(0)
    chief = Recommender()
    want = _exact(chief)
    x = torch.randint(0, 20, (6,))
    with psgrad.connect(addresses, num_workers=2, client=CLIENT) as ps:
        opt = ps.optimizer(chief)
        assert _same(_exact(chief), want)
        other = Recommender(ids=(2**41 + 3, 5, 9), scale=2 / 3, mask=(False, True, False))
        with psgrad.connect(addresses, rank=1, num_workers=2, client=CLIENT) as ps1:
            opt1 = ps1.optimizer(other)
            assert _same(_exact(other), want)  # the chief's values, exactly
            for model, o in [(chief, opt), (other, opt1)] * 2:
                o.zero_grad()
                model(x).pow(2).mean().backward()
                o.step()
            assert _same(_exact(chief), want) and _same(_exact(other), want)
            synced = [p.name for p in opt.params if p.buffer]
            assert synced == ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]  # (float32 holds them)
        with psgrad.connect(addresses, rank=1, num_workers=2, client=CLIENT) as ps2:
            with pytest.raises(JobMismatchError, match="buffer 'id_map' is kept exactly on this shard and "
                                                       "synced by worker rank 1"):
                ps2.optimizer(Recommender(ids=(1, 2, 3)))
        opt.refresh()  # (async: the other worker's last push came after the chief's pull)
        chief.eval()
        with torch.no_grad():
            in_job = chief(x)
        own = chief.state_dict()
        fetched = psgrad.fetch_state_dict(addresses)
    assert set(fetched) == set(own)
    for key in own:
        assert own[key].dtype == fetched[key].dtype and torch.equal(own[key], fetched[key]), key
    fresh = Recommender(ids=(0, 0, 0), scale=0.0, mask=(False, False, False))
    fresh.load_state_dict(fetched)  # strict
    assert _same(_exact(fresh), want)
    fresh.eval()
    with torch.no_grad():
        assert torch.equal(fresh(x), in_job)


def test_exact_values_survive_a_restart_from_a_checkpoint(make_servers: Any, tmp_path: Path) -> None:
    [first] = make_servers(1, checkpoint_dir=str(tmp_path))
    model = Recommender()
    want = _exact(model)
    with psgrad.connect([first.address], client=CLIENT) as ps:
        opt = ps.optimizer(model)
        opt.zero_grad()
        model(torch.arange(6)).sum().backward()
        opt.step()
    first.stop(0)  # a last checkpoint
    [restored] = make_servers(1, checkpoint_dir=str(tmp_path))
    fresh = Recommender(ids=(0, 0, 0))
    fresh.load_state_dict(psgrad.fetch_state_dict([restored.address]))  # strict
    assert _same(_exact(fresh), want)
