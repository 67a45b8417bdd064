"""SLURM's compressed host lists and task counts, expanded; malformed ones refused naming the text."""
from __future__ import annotations

import pytest

from psgrad.errors import ConfigError
from psgrad.launch.hostlist import expand_counts, expand_hostlist, node_of_tasks

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("gpu5", ["gpu5"]),
        ("a,b", ["a", "b"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),  # no padding without a leading zero
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
        ("cn[5]", ["cn5"]),
        (" node[1-2] ", ["node1", "node2"]),
    ],
)
def test_expand_hostlist(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["", "node[01-", "node]1[", "n[[1]]", "n[3-1]", "n[a-b]", "a,,b", "n[1-]", "n[]"])
def test_malformed_hostlists_are_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="malformed host list"):
        expand_hostlist(text)


def test_expand_counts_and_place_tasks_in_blocks() -> None:
    assert expand_counts("2(x3),1") == [2, 2, 2, 1]
    assert expand_counts("4") == [4]
    assert node_of_tasks(["a", "b"], [2, 1]) == ["a", "a", "b"]
    for bad in ("", "2(x)", "x2", "2(3)"):
        with pytest.raises(ConfigError, match="malformed task counts"):
            expand_counts(bad)
    with pytest.raises(ConfigError, match="2 node"):
        node_of_tasks(["a", "b"], [1])
