"""Model buffers as the flat space's tail: which buffers, what a push carries (deltas), what a pull
installs, and how a shard applies them (added as they are; async pushes count 1/num_workers)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from psgrad.config import JobSpec, ServerConfig
from psgrad.core.sharding import ParamSpec, buffer_specs, param_specs, plan_shards
from psgrad.server import checkpoint
from psgrad.server.shard import Shard
from psgrad.worker.flat import FlatModel
from test_shard import make_layout, push

pytestmark = pytest.mark.timeout(60)


class WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 4)
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("mask", torch.ones(4), persistent=False)  # local: not in the state_dict
        self.register_buffer("flags", torch.zeros(2, dtype=torch.bool))  # neither float nor integer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x)) * self.mask


def test_the_synced_buffers_are_the_persistent_numeric_ones_after_every_parameter() -> None:
    model = WithBuffers()
    specs = buffer_specs(model)
    assert [(s.name, s.shape, s.dtype, s.buffer) for s in specs] == [
        ("bn.running_mean", (4,), "float32", True),
        ("bn.running_var", (4,), "float32", True),
        ("bn.num_batches_tracked", (), "int64", True),
    ]
    assert not any(p.buffer for p in param_specs(model))


def test_a_push_carries_how_far_the_buffers_moved_and_a_pull_installs_the_jobs() -> None:
    torch.manual_seed(0)
    model = WithBuffers()
    flat = FlatModel(model, sync_buffers=True)
    assert not flat.staged and flat.total == flat.numel + 9  # zero copies: the tail is in the same buffer
    init = flat.host_weights()
    assert torch.equal(init[flat.numel :], torch.tensor([0.0] * 4 + [1.0] * 4 + [0.0]))
    x = torch.randn(8, 3)
    model(x).sum().backward()  # training mode: the running statistics move
    grad = flat.gather_grads()
    tail = grad[flat.numel :]
    torch.testing.assert_close(tail[:4], model.bn.running_mean)
    torch.testing.assert_close(tail[4:8], model.bn.running_var - 1)
    assert tail[8] == 1.0
    # the job's values come back (the counter rounded); the next delta starts from them
    flat.host_flat[flat.numel :] = torch.tensor([0.5] * 4 + [2.0] * 4 + [6.9999])
    flat.weights_pulled()
    assert torch.equal(model.bn.running_mean, torch.full((4,), 0.5)) and int(model.bn.num_batches_tracked) == 7
    model.eval()
    model(x)  # evaluation moves nothing
    assert torch.equal(flat.gather_grads()[flat.numel :], torch.zeros(9))
    model.train()
    model(x)
    assert flat.gather_grads()[flat.numel + 8] == 1.0


def test_overlap_captures_the_moves_before_a_background_pull_replaces_them() -> None:
    model = WithBuffers()
    flat = FlatModel(model, staging=True, sync_buffers=True)
    model(torch.randn(8, 3))
    flat.capture_buffers()
    moved = model.bn.running_mean.clone()
    flat.host_flat[flat.numel :] = 0.0
    flat.weights_pulled()  # the pulled buffers land before the push is gathered
    grad = flat.gather_grads()
    torch.testing.assert_close(grad[flat.numel : flat.numel + 4], moved)


PARAMS = (ParamSpec("w", (6,), "float32"), ParamSpec("m", (4,), "float32", buffer=True))


@pytest.mark.parametrize("index, trainable", [(0, 5), (1, 1)])
def test_a_shard_steps_its_parameters_and_adds_buffer_deltas(index: int, trainable: int) -> None:
    """10 elements over 2 shards: shard 0 has 5 parameters, shard 1 one parameter and the buffer.
    SGD applies to the parameters only; sync adds the mean delta, async each delta / num_workers."""
    for mode, divisor in (("sync", 1), ("async", 2)):
        spec = JobSpec(mode=mode, lr=0.5, num_shards=2, num_workers=2)
        layout = make_layout(spec, params=PARAMS, index=index)
        assert layout.trainable == trainable and plan_shards(PARAMS, 2).ranges[index] == (layout.start, layout.end)
        shard = Shard(ServerConfig())
        w0 = torch.arange(5.0)
        shard.initialize(0, layout, w0.clone())
        shard.join(1, layout)
        g = [torch.full((5,), 2.0), torch.full((5,), 4.0)]
        for rank in (0, 1):
            push(shard, layout, g[rank], rank=rank)
        w = shard.weights_copy()
        assert w is not None
        mean = (g[0] + g[1]) / 2
        if mode == "sync":
            expected = torch.cat([w0[:trainable] - 0.5 * mean[:trainable], w0[trainable:] + mean[trainable:]])
        else:
            expected = torch.cat([w0[:trainable] - 0.5 * (g[0] + g[1])[:trainable],
                                  w0[trainable:] + (g[0] + g[1])[trainable:] / divisor])
        torch.testing.assert_close(w, expected)


def test_a_checkpoint_keeps_which_ranges_are_buffers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    layout = make_layout(JobSpec(lr=0.5, num_shards=2), params=PARAMS, index=1)
    shard = Shard(ServerConfig())
    shard.initialize(0, layout, torch.arange(5.0))
    back = checkpoint.load(checkpoint.save(shard.snapshot(), tmp_path))
    assert back.layout == layout and back.layout.trainable == 1 and back.layout.params[1].buffer


@pytest.mark.parametrize("device", [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("dtype, staging", [(torch.float32, True), (torch.bfloat16, False)], ids=["fp32-staged", "bf16"])
def test_buffers_travel_the_staged_and_device_paths(device: str, dtype: torch.dtype, staging: bool) -> None:
    """Off the zero-copy path (staging, another dtype, a GPU) the tail works the same way: the
    parameters' part of host_flat/host_grad is theirs, the rest the buffers'."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).to(device=device, dtype=dtype)
    flat = FlatModel(model, staging=staging, sync_buffers=True)
    assert flat.staged and flat.host_grad.numel() == flat.numel + 9 and flat.host_grad.device.type == "cpu"
    before = flat.host_weights()
    torch.testing.assert_close(before[: flat.numel], torch.cat([p.detach().float().reshape(-1).cpu() for p in model.parameters()]))
    model(torch.randn(8, 3, device=device, dtype=dtype)).sum().backward()
    grad = flat.gather_grads()
    torch.testing.assert_close(grad[: flat.numel], torch.cat([p.grad.float().reshape(-1).cpu() for p in model.parameters()]))
    torch.testing.assert_close(grad[flat.numel : flat.numel + 4], model[1].running_mean.float().cpu())
    flat.host_flat[flat.numel :] = torch.arange(9.0)
    flat.weights_pulled()
    assert model[1].running_var.device.type == device and int(model[1].num_batches_tracked) == 8
    torch.testing.assert_close(model[1].running_var.float().cpu(), torch.arange(4.0, 8.0))
