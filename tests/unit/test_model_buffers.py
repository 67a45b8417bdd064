"""Model buffers as the flat space's tail: which buffers, what a push carries (deltas), what a pull
installs, and how a shard applies them (added as they are; async pushes count 1/num_workers)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from psgrad.config import JobSpec, ServerConfig
from psgrad.core.sharding import (ParamSpec, buffer_specs, fingerprint, frozen_space, frozen_tensors, frozen_words,
                                  param_specs, plan_shards, split_buffers)
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


class Lookups(nn.Module):
    """A recommender's buffers beside BatchNorm's: an int64 id map and hash with ids float32
    cannot hold, small int64 ids it can, a float64 constant, a bool mask, a complex one."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(2)
        self.register_buffer("id_map", torch.tensor([2**40 + 1, 123456789012345, 7]))
        self.register_buffer("small_ids", torch.tensor([3, 2**24, -(2**24)]))
        self.register_buffer("scale", torch.tensor([1 / 3], dtype=torch.float64))
        self.register_buffer("halves", torch.tensor([0.5, -2.0], dtype=torch.float64))
        self.register_buffer("mask", torch.tensor([True, False, True]))
        self.register_buffer("phase", torch.tensor([1 + 2j], dtype=torch.complex64))
        self.register_buffer("counts", torch.tensor([1001], dtype=torch.int16))
        self.register_buffer("cache", torch.zeros(3, dtype=torch.int64), persistent=False)


def test_buffers_the_wire_dtype_holds_exactly_are_synced_and_the_others_kept_exactly() -> None:
    """The flat space is float32 (and the wire dtype): a buffer travelling in it was rounded there
    (an int64 id 2**40 + 1 became 2**40, a float64 1/3 0.3333333432674408, silently), and bool or
    complex ones were left out of the job (and of its exports). Now the flat space syncs a buffer
    only where it holds its every value (as the chief's model has them at ps.optimizer), and keeps
    the others exactly, in their own dtype, with the frozen parameters."""
    model = Lookups()
    synced, kept = split_buffers(model)
    assert [n for n, _ in synced] == ["small_ids", "halves", "counts", "bn.running_mean", "bn.running_var",
                                      "bn.num_batches_tracked"]
    assert [n for n, _ in kept] == ["id_map", "scale", "mask", "phase"]
    synced, kept = split_buffers(model, "bfloat16")  # (1001 needs 10 significant bits, bfloat16 has 8)
    assert [n for n, _ in kept] == ["id_map", "scale", "mask", "phase", "counts"]
    model.small_ids[0] = 2**24 + 1
    assert "small_ids" in [n for n, _ in split_buffers(model)[1]]
    specs = buffer_specs(Lookups(), kept=True)
    assert [(s.name, s.dtype, s.buffer) for s in specs] == [("id_map", "int64", True), ("scale", "float64", True),
                                                            ("mask", "bool", True), ("phase", "complex64", True)]
    # a buffer registered in two modules: once, with its other name (an export writes both)
    model = nn.Module()
    model.x, model.y = nn.Module(), nn.Module()
    for owner in (model.x, model.y):
        owner.register_buffer("mean", model.x.mean if hasattr(model.x, "mean") else torch.zeros(2))
        owner.register_buffer("mask", model.x.mask if hasattr(model.x, "mask") else torch.ones(2, dtype=torch.bool))
    assert [(s.name, s.aliases) for s in buffer_specs(model)] == [("x.mean", ("y.mean",))]
    assert [(s.name, s.aliases) for s in buffer_specs(model, kept=True)] == [("x.mask", ("y.mask",))]


def test_the_frozen_space_holds_every_dtype_bit_for_bit() -> None:
    """float32, float16 and bfloat16 values as float32 (one element each, as before); any other
    dtype's bytes, 4 to an element: int64 values whose halves read as float32 NaNs and infinities,
    float64 values float32 would round, bools, complex values; tied names under each name."""
    tensors = {
        "f32": torch.tensor([1.5, -0.0, float("nan")]),
        "bf16": torch.tensor([[0.1, 3.0]], dtype=torch.bfloat16),
        "i64": torch.tensor([2**40 + 1, 0x7FC00001_7F800001, -1, 0x7F800000_FFFFFFFF]),
        "f64": torch.tensor([1 / 3, 1e300, -5e-324], dtype=torch.float64),
        "mask": torch.tensor([True, False, True]),
        "c64": torch.tensor([1 + 2j, -3.5j], dtype=torch.complex64),
        "i8": torch.tensor([-128, 127, 5], dtype=torch.int8),
        "none": torch.empty(0, 3, dtype=torch.float64),
    }
    specs = [ParamSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch."), aliases=("tied",) if n == "f64" else ())
             for n, t in tensors.items()]
    assert [frozen_words(s) for s in specs] == [3, 2, 8, 6, 1, 4, 1, 0]
    space = frozen_space(list(zip(specs, tensors.values())))
    assert space.dtype == torch.float32 and space.numel() == 25
    back = frozen_tensors(specs, space.clone())
    assert list(back) == ["f32", "bf16", "i64", "f64", "tied", "mask", "c64", "i8", "none"]
    for name, t in tensors.items():
        got = back[name]
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(got.view(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name
    assert back["tied"] is back["f64"]
    # a frozen float64 parameter now takes its bytes: another fingerprint than when it took float32 values
    f64 = [ParamSpec("w", (3,), "float64")]
    assert fingerprint([], JobSpec(), (), f64) != fingerprint([], JobSpec(), (), [ParamSpec("w", (3,), "float32")])
