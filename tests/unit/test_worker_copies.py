"""Compressed pulls without a network: the server's copies (server/worker_copies.py) against the
worker's pull buffer (client/delta_wire.py) fed the same payloads. The two copies stay equal bit for
bit; the copy's distance from the weights stays within the documented bound
||e|| <= q / (1 - q) * D (q = sqrt(1 - d), d: the share of a vector's squared norm the codec keeps,
D: the largest change between two pulls); a codec no smaller than the weights sends them exact; the
wire dtype's rounding is the copy's."""
from __future__ import annotations

import math

import pytest
import torch

from psgrad.client.delta_wire import DeltaWire
from psgrad.core.compression import parse_compression
from psgrad.proto import ps_pb2 as pb
from psgrad.server.worker_copies import WorkerCopies

pytestmark = pytest.mark.timeout(60)

N = 5000


def pull(copies: WorkerCopies, wire: DeltaWire, weights: torch.Tensor, version: int, dest: torch.Tensor,
         wire_dtype: str = "float32", plain: int = 0) -> str:
    """One pull: the server serves the worker's ask, the worker reads the payload; returns its codec."""
    out = copies.serve(0, wire.ask(), weights.clone(), version, wire_dtype, plain)
    wire.expect(out.compress, out.copy, out.drift)
    wire.load(dest, out.payload)
    return out.compress


@pytest.mark.parametrize("codec,share", [("topk:0.1", 0.1), ("int8", None), ("sign", None), ("randomk:0.2", None)])
def test_copies_stay_equal_and_the_drift_within_its_bound(codec: str, share: float | None) -> None:
    gen = torch.Generator().manual_seed(0)
    copies, wire = WorkerCopies(), DeltaWire(N, "float32", parse_compression(codec), plain=10)
    w, dest = torch.randn(N, generator=gen), torch.empty(N)
    assert pull(copies, wire, w, 0, dest, plain=10) == ""  # the first pull is exact
    assert torch.equal(dest, w)
    largest = 0.0
    for version in range(1, 60):
        step = 0.01 * torch.randn(N, generator=gen)
        w += step
        largest = max(largest, float(step.norm()))
        assert pull(copies, wire, w, version, dest, plain=10) == codec
        held = copies._copies[0].values
        assert torch.equal(dest, held) and wire.held is not None and torch.equal(wire.held, held)
        assert torch.equal(dest[-10:], w[-10:]) or torch.allclose(dest[-10:], w[-10:], atol=1e-6)  # plain tail
        error = float((w - held).norm())
        assert abs(wire.drift - error / float(w.norm())) < 1e-6
        if share is not None:  # top-k keeps at least its share of the squared norm: the bound holds
            q = math.sqrt(1 - share)
            assert error <= q / (1 - q) * largest + 1e-5
    assert 0 < wire.drift < 0.05
    status = copies.status()
    assert (status.copies, status.exact, status.compressed, status.resyncs) == (1, 1, 59, 0)


def test_a_codec_no_smaller_than_the_weights_sends_them_exact() -> None:
    copies, wire = WorkerCopies(), DeltaWire(N, "float32", parse_compression("topk:0.6"))
    w, dest = torch.randn(N), torch.empty(N)
    for version in range(3):
        assert pull(copies, wire, w + version, version, dest) == ""
        assert torch.equal(dest, w + version)
    assert copies.status().resyncs == 0  # (not counted as resyncs: there was nothing to resync from)


def test_with_bfloat16_pulls_the_copy_is_the_rounded_weights() -> None:
    copies, wire = WorkerCopies(), DeltaWire(N, "bfloat16", parse_compression("topk:0.2"))
    w, dest = torch.randn(N), torch.empty(N)
    pull(copies, wire, w, 0, dest, "bfloat16")
    assert torch.equal(dest, w.bfloat16().float()) and torch.equal(copies._copies[0].values, dest)
    w += 0.01
    assert pull(copies, wire, w, 1, dest, "bfloat16") == "topk:0.2"
    assert torch.equal(dest, copies._copies[0].values)


def test_a_change_to_no_copy_or_in_another_codec_is_refused() -> None:
    from psgrad.errors import InvalidRequestError

    wire = DeltaWire(N, "float32", parse_compression("int8"))
    with pytest.raises(InvalidRequestError, match="holds no copy"):
        wire.expect("int8", 5, 0.0)
    with pytest.raises(InvalidRequestError, match="a compressed pull in sign, asked for int8"):
        wire.expect("sign", 5, 0.0)
    ask = wire.ask()
    assert (ask.codec, ask.holds) == ("int8", 0) and isinstance(ask, pb.DeltaAsk)
