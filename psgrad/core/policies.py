"""The consistency policy of a job spec: its mode's (core/modes.py), with backup workers or an adaptive bound."""
from __future__ import annotations

from typing import Any

from psgrad.core.consistency import ConsistencyPolicy
from psgrad.core.modes import mode_of


def policy_for(spec: Any) -> ConsistencyPolicy:
    """spec (a JobSpec): its mode's policy; sync with backup_workers > 0 and ssp with
    staleness_max > 0 (`--staleness auto`) get their own (Mode.variant).

    Raises:
        ConfigError: an unknown mode.
    """
    return mode_of(spec).policy_for(spec)
