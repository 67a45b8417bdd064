"""SSP with an adaptive bound (`--staleness auto`): each shard moves its s within [1, S_MAX] from
the fraction of the workers' time its pulls spent blocked at the gate; pure (time is passed in)."""
from __future__ import annotations

from collections import deque

from psgrad.core.consistency import SSPPolicy

# --staleness auto: the default of --staleness-max, and where the bound starts (clamped to the max).
AUTO_STALENESS_MAX = 8
AUTO_STALENESS_START = 2

# The rule (docs/design/architecture.md, "Consistency"): every WINDOW_PULLS granted pulls per live worker, the blocked
# fraction f = (seconds the window's pulls waited at the gate) / (window seconds x live workers).
# f > RAISE_ABOVE: s + 1 (workers wait for the slowest: let them run further ahead);
# f < LOWER_BELOW: s - 1 (nobody waits: tighten, fresher gradients for free); else s stays.
WINDOW_PULLS = 8
RAISE_ABOVE = 0.25
LOWER_BELOW = 0.05
S_MIN = 1
TRAJECTORY_LEN = 10_000


class AdaptiveSSPPolicy(SSPPolicy):
    """SSP(s) with s adjusted by observe_pull; the gate and the staleness bound are SSP's, with
    the s in effect when the pull is granted."""

    adapts = True

    def __init__(self, staleness_max: int) -> None:
        super().__init__(max(S_MIN, min(AUTO_STALENESS_START, staleness_max)))
        self.s_max = staleness_max
        self._window_start: float | None = None
        self._waited = 0.0
        self._pulls = 0
        self.trajectory: deque[tuple[float, int, int]] = deque(maxlen=TRAJECTORY_LEN)  # (time, version, s)

    def observe_pull(self, waited_s: float, now: float, live: int, version: int) -> bool:
        """A pull was granted after waiting waited_s at the gate. Returns True when s changed."""
        if self._window_start is None:
            self._window_start = now - waited_s
            self.trajectory.append((now, version, self.staleness))
        self._waited += waited_s
        self._pulls += 1
        if self._pulls < WINDOW_PULLS * max(1, live):
            return False
        elapsed = now - self._window_start
        blocked = self._waited / (elapsed * max(1, live)) if elapsed > 0 else 0.0
        self._window_start, self._waited, self._pulls = now, 0.0, 0
        before = self.staleness
        if blocked > RAISE_ABOVE:
            self.staleness = min(self.s_max, self.staleness + 1)
        elif blocked < LOWER_BELOW:
            self.staleness = max(S_MIN, self.staleness - 1)
        if self.staleness == before:
            return False
        self.trajectory.append((now, version, self.staleness))
        return True
