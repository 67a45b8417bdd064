"""The consistency policy of a job spec: the three modes, with backup workers or an adaptive bound."""
from __future__ import annotations

from typing import Any

from psgrad.core.adaptive import AdaptiveSSPPolicy
from psgrad.core.backup import BackupSyncPolicy
from psgrad.core.consistency import ConsistencyPolicy, make_policy


def policy_for(spec: Any) -> ConsistencyPolicy:
    """spec (a JobSpec): its mode's policy; sync with backup_workers > 0 and ssp with
    staleness_max > 0 (`--staleness auto`) get their own."""
    if spec.mode == "sync" and spec.backup_workers:
        return BackupSyncPolicy(spec.backup_workers, spec.num_workers)
    if spec.mode == "ssp" and spec.staleness_max:
        return AdaptiveSSPPolicy(spec.staleness_max)
    return make_policy(spec.mode, spec.staleness)
