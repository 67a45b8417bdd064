"""psgrad.Embedding / EmbeddingBag as a PyTorch user expects them, on an in-process row source: torch's
module options, computed as torch computes them on the same weights, or refused naming why."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import psgrad
from psgrad.errors import ConfigError
from psgrad.nn import SparseEmbedding

pytestmark = pytest.mark.timeout(60)

ROWS, DIM = 40, 4


class LocalRows:
    """A RowSource holding the whole table in memory."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.clone()

    def pull_rows(self, table: str, ids: torch.Tensor, observe: bool) -> torch.Tensor:
        return self.weight[ids].clone()


def _bound(module: SparseEmbedding, table: str = "emb") -> LocalRows:
    """Bind module to a LocalRows of its initial weight (as table `table`); returns the source."""
    module.table = table
    source = LocalRows(module.initial_weight())
    module.bind(table, source)
    return source


def _torch_twin(mine: SparseEmbedding, kind: type[nn.Module], **options: Any) -> nn.Module:
    """torch's module with the same options, on mine's initial weight (its padding row zero, as torch
    makes it)."""
    theirs = kind(ROWS, DIM, **options)
    with torch.no_grad():
        theirs.weight.copy_(mine.initial_weight())
        if options.get("padding_idx") is not None:
            theirs.weight[options["padding_idx"]] = 0
    return theirs


IDS_2D = torch.tensor([[1, 7, 7, 2], [3, 1, 2, 2], [2, 2, 2, 2]])  # 2: the padding id where there is one
IDS_1D = torch.tensor([1, 7, 7, 2, 3, 1, 5, 2, 2])
OFFSETS = torch.tensor([0, 4, 4, 6])  # bags [0:4], [4:4] (empty), [4:6], [6:]


@pytest.mark.parametrize("options", [
    {}, {"padding_idx": 2}, {"padding_idx": -38}, {"scale_grad_by_freq": True}, {"sparse": True},
    {"padding_idx": 2, "scale_grad_by_freq": True},
], ids=str)
def test_embedding_options_compute_what_torchs_compute(options: dict[str, Any]) -> None:
    mine = psgrad.Embedding(ROWS, DIM, std=0.5, seed=4, **options)
    _bound(mine)
    theirs = _torch_twin(mine, nn.Embedding, **options)
    out = mine(IDS_2D)
    torch.testing.assert_close(out, theirs(IDS_2D))
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    (out * probe).sum().backward()
    (theirs(IDS_2D) * probe).sum().backward()
    ids, grads = mine.take_gradients()
    assert ids.tolist() == torch.unique(IDS_2D).tolist()
    torch.testing.assert_close(grads, _dense_grad(theirs.weight)[ids])
    if options.get("padding_idx") is not None:
        assert not grads[ids.tolist().index(2)].any()  # the padding row takes no gradient


BAG_CASES = [
    {"mode": "sum"}, {"mode": "mean"}, {"mode": "max"},
    {"mode": "sum", "include_last_offset": True}, {"mode": "mean", "include_last_offset": True},
    {"mode": "max", "include_last_offset": True},
    {"mode": "sum", "padding_idx": 2}, {"mode": "mean", "padding_idx": 2}, {"mode": "max", "padding_idx": 2},
    {"mode": "mean", "padding_idx": 2, "include_last_offset": True},
    {"mode": "sum", "scale_grad_by_freq": True}, {"mode": "mean", "scale_grad_by_freq": True, "padding_idx": 2},
    {"mode": "sum", "sparse": True},
]


# Each case with the inputs it applies to: a 2-D input, a 1-D one with offsets, and weighted
# (per_sample_weights: mode "sum" only, torch's rule); include_last_offset is about offsets.
BAG_INPUTS = [(options, layout) for options in BAG_CASES for layout in ("2d", "offsets", "weighted")
              if not (layout == "weighted" and options["mode"] != "sum")
              and not (layout == "2d" and options.get("include_last_offset"))]


def _dense_grad(weight: torch.Tensor) -> torch.Tensor:
    """torch's gradient of a table (sparse=True makes it a sparse tensor)."""
    assert weight.grad is not None
    return weight.grad.to_dense() if weight.grad.is_sparse else weight.grad


@pytest.mark.parametrize("options, layout", BAG_INPUTS, ids=str)
def test_embedding_bag_options_compute_what_torchs_compute(options: dict[str, Any], layout: str) -> None:
    mine = psgrad.EmbeddingBag(ROWS, DIM, std=0.5, seed=4, **options)
    _bound(mine)
    theirs = _torch_twin(mine, nn.EmbeddingBag, **options)
    if layout == "2d":
        args: tuple[Any, ...] = (IDS_2D,)
    else:
        offsets = torch.cat([OFFSETS, torch.tensor([IDS_1D.numel()])]) if options.get("include_last_offset") else OFFSETS
        weights = torch.linspace(0.5, 2.0, IDS_1D.numel()) if layout == "weighted" else None
        args = (IDS_1D, offsets, weights)
    out = mine(*args)
    torch.testing.assert_close(out, theirs(*args))
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(0))
    (out * probe).sum().backward()
    (theirs(*args) * probe).sum().backward()
    ids, grads = mine.take_gradients()
    torch.testing.assert_close(grads, _dense_grad(theirs.weight)[ids])
    assert grads.abs().sum() > 0
    if options.get("padding_idx") is not None:
        assert not grads[ids.tolist().index(2)].any()


def test_options_torch_has_and_psgrad_cannot_honour_are_refused_naming_the_alternative() -> None:
    for make in (lambda **kw: psgrad.Embedding(ROWS, DIM, **kw), lambda **kw: psgrad.EmbeddingBag(ROWS, DIM, **kw)):
        with pytest.raises(ConfigError, match=r"max_norm=1\.0 is not supported.*rows live on the servers.*"
                                              r"out\.norm\(dim=-1"):
            make(max_norm=1.0, norm_type=2.0)
        assert make(norm_type=1.0).norm_type == 1.0  # (read only with max_norm, as in torch)
        assert make(sparse=True).sparse and make(scale_grad_by_freq=True).scale_grad_by_freq
        with pytest.raises(ConfigError, match=f"padding_idx must be within num_embeddings \\({ROWS}\\), got {ROWS}"):
            make(padding_idx=ROWS)
    with pytest.raises(ConfigError, match="scale_grad_by_freq does not go with mode 'max'.*use mode 'sum' or 'mean'"):
        psgrad.EmbeddingBag(ROWS, DIM, mode="max", scale_grad_by_freq=True)
    with pytest.raises(ValueError, match="max mode does not support scaling"):  # torch's own refusal, at the forward
        nn.EmbeddingBag(ROWS, DIM, mode="max", scale_grad_by_freq=True)(IDS_2D)
    assert "sparse=True" in repr(psgrad.Embedding(ROWS, DIM, sparse=True))
