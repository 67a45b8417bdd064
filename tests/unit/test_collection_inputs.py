"""What psgrad.EmbeddingBagCollection takes: torch's options it does not take refused by name, and
each of a table's errors naming it one way."""
from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch

import psgrad
from psgrad.errors import ConfigError, InvalidRequestError

pytestmark = pytest.mark.timeout(60)


class Rows:
    """A RowSource serving fixed rows of every table (the job's servers' part), counting pulls."""

    def __init__(self, tables: Mapping[str, torch.Tensor]) -> None:
        self.tables, self.pulls = tables, []

    def pull_tables(self, lookups: Mapping[str, torch.Tensor], observe: bool) -> dict[str, torch.Tensor]:
        self.pulls.append({name: ids.clone() for name, ids in lookups.items()})
        return {name: self.tables[name][ids].clone() for name, ids in lookups.items()}

    def updated_rows(self, table: str) -> tuple[torch.Tensor, torch.Tensor]:
        raise AssertionError("not read here")


GEN = torch.Generator().manual_seed(3)
TABLES = {"ebc.bags.a": torch.randn(20, 4, generator=GEN), "ebc.bags.b": torch.randn(30, 2, generator=GEN)}
A = (torch.tensor([1, 2, 19, 4]), torch.tensor([2, 0, 2]))  # (values, lengths): 3 bags
B = (torch.tensor([5, 5, 6]), torch.tensor([1, 1, 1]))
WEIGHTS = {"a": torch.tensor([0.5, -2.0, 3.0, 1.5]), "b": torch.tensor([1.0, 2.0, 0.25])}


def bound(mode: str = "sum", **options: object) -> tuple[psgrad.EmbeddingBagCollection, Rows]:
    ebc = psgrad.EmbeddingBagCollection({"a": (20, 4), "b": (30, 2)}, mode=mode, **options)  # type: ignore[arg-type]
    source = Rows(TABLES)
    for name, bag in ebc.bags.items():
        bag.bind(f"ebc.bags.{name}", source)  # type: ignore[operator]
    return ebc, source


@pytest.mark.parametrize("option, value", [("padding_idx", 0), ("include_last_offset", True), ("max_norm", 1.0),
                                           ("scale_grad_by_freq", True)])
def test_torchs_options_a_collection_does_not_take_are_refused_naming_what_to_do(option: str, value: object) -> None:
    """They raised a bare TypeError (unexpected keyword argument)."""
    with pytest.raises(ConfigError, match=f"EmbeddingBagCollection takes no {option}=: .*"
                                          f"{'clip_grad_norm_' if option == 'max_norm' else 'psgrad.EmbeddingBag'}"):
        psgrad.EmbeddingBagCollection({"a": (10, 4)}, **{option: value})  # type: ignore[arg-type]
    psgrad.EmbeddingBagCollection({"a": (10, 4)}, sparse=True)  # (accepted: changes nothing, as for EmbeddingBag)
    with pytest.raises(TypeError, match="unexpected keyword argument 'moed'"):
        psgrad.EmbeddingBagCollection({"a": (10, 4)}, moed="sum")  # type: ignore[call-arg]
    for name in ("items", "a.b", ""):  # (torch's ModuleDict raised a bare KeyError)
        with pytest.raises(ConfigError, match=f"table {name!r}: a table's name is the name of its module"):
            psgrad.EmbeddingBagCollection({name: (20, 4)})


@pytest.mark.parametrize("mode", ["sum", "max"])
def test_a_tables_errors_name_it_as_the_job_does(mode: str) -> None:
    """Bad offsets named the table by its feature ('a'), an id out of range by its name in the job
    ('ebc.bags.a'): both name it 'ebc.bags.a' now, as psgrad status does."""
    ebc, _ = bound(mode)
    b = (B[0], torch.arange(3))
    with pytest.raises(InvalidRequestError, match="^table 'ebc.bags.a': bag offsets must start at 0"):
        ebc({"a": (A[0], torch.tensor([1, 2, 2])), "b": b})
    with pytest.raises(InvalidRequestError, match="^table 'ebc.bags.a': row id 20 is out of range"):
        ebc({"a": (torch.tensor([1, 20]), torch.tensor([0, 1, 1])), "b": b})
    with pytest.raises(InvalidRequestError, match="^table 'ebc.bags.a': row ids must be an integer tensor"):
        ebc({"a": (torch.tensor([1.0, 2.0]), torch.tensor([0, 1, 1])), "b": b})
