"""SLURM's compressed lists, expanded: host lists (`node[01-03,07],gpu5`) and task counts (`2(x3),1`)."""
from __future__ import annotations

import re

from psgrad.errors import ConfigError

_COUNT_RE = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _split_top(text: str) -> list[str]:
    """Split on the commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ConfigError(f"malformed host list {text!r}: nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"malformed host list {text!r}: ']' without '['")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"malformed host list {text!r}: '[' without ']'")
    parts.append(text[start:])
    return parts


def _expand_range(text: str, item: str) -> list[str]:
    """'01-03' -> ['01', '02', '03'] (zero padding kept); '7' -> ['7']."""
    low, sep, high = item.partition("-")
    if not low.isdigit() or (sep and not high.isdigit()):
        raise ConfigError(f"malformed host list {text!r}: bad range {item!r} (expected N or N-M)")
    if not sep:
        return [low]
    a, b = int(low), int(high)
    if b < a:
        raise ConfigError(f"malformed host list {text!r}: range {item!r} runs backwards")
    width = len(low) if low.startswith("0") else 0
    return [str(n).zfill(width) for n in range(a, b + 1)]


def _expand_one(text: str, part: str) -> list[str]:
    """One comma-free host expression: 'gpu5', 'node[01-03,07]', 'rack[1-2]-n[1-2]' (the product)."""
    m = re.search(r"\[([^\]]*)\]", part)
    if m is None:
        return [part]
    head, tail = part[: m.start()], part[m.end() :]
    values = [v for item in m.group(1).split(",") for v in _expand_range(text, item)]
    return [head + v + rest for v in values for rest in _expand_one(text, tail)]


def expand_hostlist(text: str) -> list[str]:
    """SLURM's compressed host list in order, e.g. 'node[01-03,07],gpu5' -> node01 node02 node03 node07 gpu5."""
    text = text.strip()
    if not text:
        raise ConfigError("malformed host list '': it names no host")
    hosts = [h for part in _split_top(text) for h in _expand_one(text, part)]
    if any(not h for h in hosts):
        raise ConfigError(f"malformed host list {text!r}: empty host name")
    return hosts


def expand_counts(text: str) -> list[int]:
    """SLURM's compressed per-node counts, e.g. '2(x3),1' -> [2, 2, 2, 1]."""
    out: list[int] = []
    for item in text.strip().split(","):
        m = _COUNT_RE.match(item.strip())
        if m is None:
            raise ConfigError(f"malformed task counts {text!r}: bad item {item!r} (expected N or N(xM))")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def node_of_tasks(nodes: list[str], counts: list[int]) -> list[str]:
    """Each task's node under block distribution: the first counts[0] tasks on nodes[0], and so on."""
    if len(nodes) != len(counts):
        raise ConfigError(f"{len(nodes)} node(s) {nodes} but task counts for {len(counts)}: {counts}")
    return [node for node, count in zip(nodes, counts) for _ in range(count)]
