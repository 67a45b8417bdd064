"""The model a running job holds, read from its servers without joining it and without its job
spec: every shard's tensors as of now (ungated snapshots), at one version where the mode has one,
laid out as a `state_dict` keyed by name. psgrad.fetch_state_dict and `psgrad export` use it."""
from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from psgrad.client.parameter_client import ParameterClient
from psgrad.client.status_client import credentials, shard_status
from psgrad.config import ClientConfig
from psgrad.core.addresses import parse_servers
from psgrad.core.credentials import ADMIN
from psgrad.core.modes import mode_of
from psgrad.core import rows as row_init
from psgrad.core.sharding import ParamSpec, TableSpec, frozen_tensors, frozen_words, plan_shards
from psgrad.errors import ConfigError, JobMismatchError, NotInitializedError, StalledError

# Between reads while a sync job's shards are at different iterations (one shard's update of an
# iteration applied, another's just arriving): up to this long.
MAX_RETRY_S = 0.2


@dataclass(frozen=True)
class ModelSnapshot:
    """A job's model as its servers hold it: every named tensor (model order, each its shape and
    dtype), the version each shard's part was read at, and the job's mode.

    What "one version" means: in sync mode the shards are read again until every one is at the same
    iteration, so `state_dict` is exactly the model after that iteration (consistent is True). In
    async and ssp mode each shard applies pushes on its own and no iteration spans the shards: each
    shard's part is exactly its weights at the version given (never torn), and the parts agree
    once no push is in flight (a finished job, or all workers left); `consistent` says whether the
    versions are equal.
    """

    state_dict: dict[str, torch.Tensor]
    versions: list[int]
    mode: str

    @property
    def consistent(self) -> bool:
        return len(set(self.versions)) == 1


def named_tensors(specs: Sequence[ParamSpec], flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """The flat float32 space (weights, then synchronized buffers) cut into {name: tensor of its
    shape and dtype}, in order."""
    state: dict[str, torch.Tensor] = {}
    offset = 0
    for p in specs:
        values = flat[offset : offset + p.numel].reshape(p.shape)
        dtype = getattr(torch, p.dtype)
        if not dtype.is_floating_point:  # a counter buffer (num_batches_tracked) travels as float32
            values = values.round()
        state[p.name] = values.to(dtype).clone()
        for alias in p.aliases:  # a tied weight: the state_dict names it under each module
            state[alias] = state[p.name]
        offset += p.numel
    return state


# The table kinds an export reads: "dense", the shard's range of the flat space (pulled whole),
# "sparse", the rows of an embedding table (those updated at least once, read in pages), and
# "frozen", the shard's range of the frozen parameters (pulled whole).
READABLE_TABLES = ("dense", "sparse", "frozen")


def sparse_entries(spec: TableSpec, ids: torch.Tensor, rows: torch.Tensor, materialize: bool) -> dict[str, torch.Tensor]:
    """A sparse table's entries of an export: the rows updated at least once and how to make the
    others (`NAME.ids` [n] int64, `NAME.rows` [n, dim], `NAME.init` [num_embeddings, dim, seed] int64,
    `NAME.init_std`, and `NAME.table`, the name the others are drawn under (TableSpec.draw_name), UTF-8 as uint8: what a
    module's state_dict() holds, so a model that loads it under another prefix, a wrapper's
    `module.` stripped, still draws them as the job did), or, materialized, the whole table as
    torch.nn.Embedding's `NAME.weight`."""
    if materialize and spec.num_embeddings == row_init.DYNAMIC:
        raise ConfigError(f"table {spec.name!r} is dynamic (any int64 id): it has no whole table to materialize; "
                          "export without materializing (its updated rows by id, NAME.ids and NAME.rows)")
    if materialize:
        key = row_init.table_key(spec.seed, spec.draw_name)
        return {f"{spec.name}.weight": row_init.materialize(key, spec.num_embeddings, spec.dim, spec.std, ids, rows)}
    return {f"{spec.name}.ids": ids, f"{spec.name}.rows": rows,
            f"{spec.name}.init": torch.tensor([spec.num_embeddings, spec.dim, spec.seed], dtype=torch.int64),
            f"{spec.name}.init_std": torch.tensor(spec.std, dtype=torch.float64),
            f"{spec.name}.table": torch.tensor(list(spec.draw_name.encode()), dtype=torch.uint8)}


def fetch_model(
    servers: str | Sequence[str], timeout_s: float = 30.0, client: ClientConfig | None = None, materialize: bool = False,
) -> ModelSnapshot:
    """Read a running (or finished) job's model from its servers: joins nothing, needs no job spec
    or model (the servers describe the tensors), and waits for nobody but, in sync mode, for the
    shards to agree on an iteration (see ModelSnapshot). `servers` lists the shards in order, as
    the workers were given them (a list, or "HOST:PORT,..."; PRIMARY|BACKUP entries fail over).
    client: its credentials are used (the admin's: read-only pulls as any rank; see docs/operations/security.md).
    Sparse (embedding) tables are read as the rows updated at least once plus how to make the
    others (see sparse_entries), read after the dense weights, under each of the table's names in
    the model (one module registered under several); materialize=True writes each whole table
    instead (its full size in memory). The frozen parameters the servers keep (ps.optimizer's
    frozen="servers", the default) are read too, under their names (and their tied names).

    Raises:
        ConfigError: a malformed address.
        NotInitializedError: a server holds no job yet.
        JobMismatchError: the servers hold different jobs, or are listed out of order.
        StalledError: sync mode, and the shards stayed at different iterations for timeout_s.
        ServerUnavailableError: a server does not answer within timeout_s.
    """
    addresses = parse_servers(servers if isinstance(servers, str) else ",".join(servers))
    deadline = time.monotonic() + timeout_s
    statuses = shard_status(addresses, timeout_s, with_params=True, client=client)
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
        for table in st.tables:  # what each table holds is read by its kind
            if table.kind not in READABLE_TABLES:
                raise JobMismatchError(
                    f"server {address} holds table {table.name!r} of kind {table.kind!r}, which this psgrad cannot "
                    f"export (it reads {', '.join(READABLE_TABLES)} tables): upgrade psgrad on this machine"
                )
    params = list(first.params)
    plan = plan_shards(params, len(addresses), tables=bool(first.table_specs))
    backups = any("|" in a for a in addresses)  # a PRIMARY|BACKUP shard: the pull fails over to the one serving
    config = ClientConfig(connect_timeout_s=timeout_s, rpc_timeout_s=timeout_s,
                          reconnect_timeout_s=timeout_s if backups else 0, shared_memory=False, **credentials(client))
    flat = torch.empty(plan.total)
    tables = list(first.table_specs)
    frozen = list(first.frozen_params)
    with ParameterClient(addresses, first.spec, params, plan, rank=0, config=config, role=ADMIN,
                         tables=tables, frozen=frozen) as reader:
        # Each shard's first call is a status, which waits for the connection (through a handshake
        # a busy server answers late, as the status read above did): the reads that follow do not,
        # and a connection attempt's first try is given a fraction of a second. (Shards with a
        # backup: their reads retry, on either server, for timeout_s.)
        for shard in [] if backups else reader.shards:
            shard.status(max(0.01, deadline - time.monotonic()))
        wait_s = 0.005
        while True:
            versions = reader.pull(flat, clock=0, observe=True)  # no gate, no lease: joins nothing
            if not mode_of(first.spec).synchronous or len(set(versions)) == 1:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                raise StalledError(
                    f"the shards stayed at different iterations ({versions}) for {timeout_s:g} s: in sync mode the "
                    "model exists only once every shard applied an iteration; is a worker stuck between its pushes "
                    "to the shards, or a shard restored from an older checkpoint?"
                )
            time.sleep(min(wait_s, left))  # a shard whose update of the iteration is still arriving
            wait_s = min(2 * wait_s, MAX_RETRY_S)
        state = named_tensors(params, flat)
        if frozen:  # (they move only when written: read once, at any time)
            frozen_flat = torch.empty(sum(frozen_words(p) for p in frozen))
            reader.pull_frozen(frozen_flat, observe=True)
            state.update(frozen_tensors(frozen, frozen_flat))
        for spec in tables:
            entries = sparse_entries(spec, *reader.updated_rows(spec.name), materialize)
            state.update(entries)
            for alias in spec.aliases:  # a table under several names in the model: its entries under each
                state.update({alias + key[len(spec.name):]: value for key, value in entries.items()})
    return ModelSnapshot(state, versions, first.spec.mode)


def fetch_state_dict(
    servers: str | Sequence[str], timeout_s: float = 30.0, client: ClientConfig | None = None
) -> dict[str, torch.Tensor]:
    """The job's current model as a state_dict keyed by name: `model.load_state_dict(...)` takes it.
    See fetch_model (which also gives the versions) for what it waits for and guarantees."""
    return fetch_model(servers, timeout_s, client).state_dict


def export_state_dict(
    addresses: Sequence[str], timeout_s: float = 30.0, client: ClientConfig | None = None, materialize: bool = False,
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """fetch_model's state_dict and versions (`psgrad export`)."""
    snap = fetch_model(addresses, timeout_s, client, materialize)
    return snap.state_dict, snap.versions


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
