"""The model a running job holds, read from its servers: every shard's weights (and synchronized
buffers) as of now (an ungated snapshot that joins nothing), laid out as a `state_dict` keyed by name."""
from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from psgrad.client.parameter_client import ParameterClient, shard_status
from psgrad.config import ClientConfig
from psgrad.core.sharding import plan_shards
from psgrad.errors import JobMismatchError, NotInitializedError


def export_state_dict(addresses: Sequence[str], timeout_s: float = 30.0) -> tuple[dict[str, torch.Tensor], list[int]]:
    """The job's current weights as {parameter name: tensor of its shape and dtype}, and each
    shard's version. `addresses` lists the servers in shard order, as the workers were given.

    Raises:
        NotInitializedError: a server holds no job yet.
        JobMismatchError: the servers hold different jobs, or are listed out of order.
        ServerUnavailableError: a server does not answer within timeout_s.
    """
    statuses = shard_status(addresses, timeout_s, with_params=True)
    for address, st in zip(addresses, statuses):
        if not st.initialized or st.spec is None:
            raise NotInitializedError(f"server {address} holds no job yet (start worker rank 0 first)")
    first = statuses[0]
    assert first.spec is not None
    for i, (address, st) in enumerate(zip(addresses, statuses)):
        if st.fingerprint != first.fingerprint:
            raise JobMismatchError(f"server {address} serves another job than {addresses[0]} (fingerprints differ)")
        if st.index != i:
            raise JobMismatchError(f"server {address} is shard {st.index}, listed as shard {i}: give --servers in shard order")
    params = list(first.params)
    plan = plan_shards(params, len(addresses))
    backups = any("|" in a for a in addresses)  # a PRIMARY|BACKUP shard: the pull fails over to the one serving
    config = ClientConfig(connect_timeout_s=timeout_s, rpc_timeout_s=timeout_s,
                          reconnect_timeout_s=timeout_s if backups else 0, shared_memory=False)
    flat = torch.empty(plan.total)
    with ParameterClient(addresses, first.spec, params, plan, rank=0, config=config) as client:
        versions = client.pull(flat, clock=0, observe=True)
    state: dict[str, torch.Tensor] = {}
    offset = 0
    for p in params:
        values = flat[offset : offset + p.numel].reshape(p.shape)
        dtype = getattr(torch, p.dtype)
        if not dtype.is_floating_point:  # a counter buffer (num_batches_tracked) travels as float32
            values = values.round()
        state[p.name] = values.to(dtype).clone()
        offset += p.numel
    return state, versions


def write_state_dict(state: Mapping[str, torch.Tensor], path: str | os.PathLike[str]) -> Path:
    """torch.save(state) to path atomically (a reader never sees half a file); returns the path.

    Raises:
        OSError: the file cannot be written.
    """
    out = Path(path)
    fd, tmp = tempfile.mkstemp(dir=out.parent if str(out.parent) else ".", prefix=f".{out.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(dict(state), f)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out
