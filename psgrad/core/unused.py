"""Parameters a step left unused: torch gives them no gradient (.grad None) and torch.optim leaves
them alone (no weight decay, no moment, no step counted). A worker's push names them as ranges of
the flat space (only when there are some), and a shard's update rule skips those ranges; per-range
step counts (StepCounts) keep each parameter's own step number, as torch.optim's per-parameter state
does.

Ranges are [start, end) pairs of ints, sorted, disjoint and not touching (merged), as `Ranges`.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from psgrad.errors import InvalidRequestError

Ranges = tuple[tuple[int, int], ...]


def merged(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """The ranges sorted, empty ones dropped, overlapping or touching ones merged."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted((int(a), int(b)) for a, b in ranges if b > a):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)


def clipped(ranges: Ranges, start: int, end: int) -> Ranges:
    """The parts of `ranges` inside [start, end), relative to start."""
    return tuple((max(lo, start) - start, min(hi, end) - start) for lo, hi in ranges if hi > start and lo < end)


def intersection(a: Ranges, b: Ranges) -> Ranges:
    """The elements in both a and b."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


def complement(ranges: Ranges, numel: int) -> Ranges:
    """The elements of [0, numel) not in ranges."""
    out, at = [], 0
    for lo, hi in ranges:
        if lo > at:
            out.append((at, min(lo, numel)))
        at = max(at, hi)
    if at < numel:
        out.append((at, numel))
    return tuple((lo, hi) for lo, hi in out if lo < hi)


def to_bytes(ranges: Ranges) -> bytes:
    """The wire form: int64 little-endian start, end pairs (b"" for none)."""
    if not ranges:
        return b""
    return torch.tensor(ranges, dtype=torch.int64).reshape(-1).numpy().astype("<i8").tobytes()


def from_bytes(data: bytes, numel: int, what: str) -> Ranges:
    """Parse to_bytes' form, checked: pairs inside [0, numel), sorted, each non-empty and disjoint.

    Raises:
        InvalidRequestError: anything else (named with `what`).
    """
    if not data:
        return ()
    if len(data) % 16:
        raise InvalidRequestError(f"{what}: unused ranges of {len(data)} bytes (int64 start, end pairs expected)")
    values = torch.frombuffer(bytearray(data), dtype=torch.int64).tolist()
    pairs = tuple(zip(values[0::2], values[1::2]))
    at = 0
    for lo, hi in pairs:
        if not at <= lo < hi <= numel:
            raise InvalidRequestError(f"{what}: unused ranges must be sorted, disjoint, non-empty and inside "
                                      f"[0, {numel}); got {list(pairs)[:8]}")
        at = hi
    return pairs


class StepCounts:
    """Each element's step count (the updates that used it) over [0, numel), piecewise constant:
    runs of (start, end, count). One run while every update used every element."""

    def __init__(self, numel: int, count: int = 0) -> None:
        self.numel = numel
        self.runs: list[tuple[int, int, int]] = [(0, numel, count)] if numel else []

    @property
    def uniform(self) -> int | None:
        """The count every element has, or None where they differ."""
        counts = {c for _, _, c in self.runs}
        return counts.pop() if len(counts) == 1 else (0 if not counts else None)

    @property
    def most(self) -> int:
        return max((c for _, _, c in self.runs), default=0)

    def advance(self, skip: Ranges = ()) -> list[tuple[int, int, int]]:
        """One update that used every element but those in `skip`: their counts go up by one.
        Returns the used pieces with their new count (each a step number), in order."""
        if not skip:
            self.runs = [(lo, hi, c + 1) for lo, hi, c in self.runs]
            return list(self.runs)
        used = complement(skip, self.numel)
        runs: list[tuple[int, int, int]] = []
        pieces: list[tuple[int, int, int]] = []
        for lo, hi, c in self.runs:
            at = lo
            for a, b in clipped(used, lo, hi):
                a, b = a + lo, b + lo
                if a > at:
                    runs.append((at, a, c))
                runs.append((a, b, c + 1))
                pieces.append((a, b, c + 1))
                at = b
            if at < hi:
                runs.append((at, hi, c))
        self.runs = self._merge(runs)
        return pieces

    @staticmethod
    def _merge(runs: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        out: list[tuple[int, int, int]] = []
        for lo, hi, c in runs:
            if out and out[-1][1] == lo and out[-1][2] == c:
                out[-1] = (out[-1][0], hi, c)
            else:
                out.append((lo, hi, c))
        return out

    def state(self) -> dict[str, torch.Tensor | float | int]:
        """For a state_dict: {"step": the count} while uniform (the format of old), else also
        "step_runs", an int64 [runs, 3] tensor of (start, end, count)."""
        uniform = self.uniform
        if uniform is not None:
            return {"step": uniform}
        return {"step": self.most, "step_runs": torch.tensor(self.runs, dtype=torch.int64)}

    def load(self, state: dict[str, torch.Tensor | float | int]) -> None:
        runs = state.get("step_runs")
        if isinstance(runs, torch.Tensor):
            self.runs = self._merge([(int(a), int(b), int(c)) for a, b, c in runs.reshape(-1, 3).tolist()])
            if (self.runs[0][0] if self.runs else 0) != 0 or (self.runs[-1][1] if self.runs else 0) != self.numel:
                raise InvalidRequestError(f"step counts cover {self.runs[:1]}..{self.runs[-1:]}, not [0, {self.numel})")
        else:
            self.runs = [(0, self.numel, int(state["step"]))] if self.numel else []
