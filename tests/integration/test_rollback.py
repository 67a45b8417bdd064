"""The sync roll-back through real gRPC servers in process: a shard restarted from an older
checkpoint refuses the worker, and the worker's client agrees with every shard on the newest
iteration they all have, returns them to it, or names what each shard has when none is common."""
from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from psgrad.client.parameter_client import ParameterClient
from psgrad.config import ClientConfig, JobSpec, ServerConfig
from psgrad.core.sharding import ParamSpec, plan_shards
from psgrad.errors import CheckpointError, RollbackError
from psgrad.server import checkpoint
from psgrad.server.runtime import RunningServer, start_server

pytestmark = pytest.mark.timeout(90)

PARAMS = [ParamSpec("w", (64,), "float32")]
SPEC = JobSpec(mode="sync", lr=0.5, momentum=0.5, num_shards=2, num_workers=1)
PLAN = plan_shards(PARAMS, 2)


def _server(directory: Path, port: int = 0) -> RunningServer:
    return start_server(ServerConfig(port=port, threads=8, checkpoint_dir=str(directory), checkpoint_every_versions=2))


def _grad(clock: int) -> torch.Tensor:
    return torch.randn(64, generator=torch.Generator().manual_seed(clock))


def _train(c: ParameterClient, clocks: range, flat: torch.Tensor) -> None:
    for clock in clocks:
        c.exchange(_grad(clock), clock, flat)


def _job(tmp_path: Path, iterations: int) -> tuple[list[RunningServer], ParameterClient, dict[int, torch.Tensor]]:
    """A sync job trained `iterations` iterations, checkpointed every 2; returns the weights the
    worker pulled after each iteration as well."""
    servers = [_server(tmp_path / f"shard{i}") for i in range(2)]
    config = ClientConfig(connect_timeout_s=5, rpc_timeout_s=10, reconnect_timeout_s=30, shared_memory=False)
    c = ParameterClient([s.address for s in servers], SPEC, PARAMS, PLAN, 0, config)
    c.join(lambda: torch.linspace(-1, 1, 64))
    flat = torch.zeros(64)
    c.pull(flat, 0)
    seen = {0: flat.clone()}
    for clock in range(iterations):
        c.exchange(_grad(clock), clock, flat)
        seen[clock + 1] = flat.clone()
        if (clock + 1) % 2 == 0:
            _written(tmp_path, clock + 1)
    for s in servers:  # their checkpoints are on disk
        assert s.checkpointer is not None
        s.checkpointer.stop(timeout_s=30)
    return servers, c, seen


def _written(tmp_path: Path, version: int, timeout_s: float = 30.0) -> None:
    """Wait until both shards' checkpoints of `version` are on disk: a writer that falls behind
    writes only the newest snapshot offered, and these tests need every one of them."""
    deadline = time.monotonic() + timeout_s
    while not all(version in checkpoint.versions(tmp_path / f"shard{i}") for i in range(2)):
        assert time.monotonic() < deadline, f"checkpoint {version} not written within {timeout_s} s"
        time.sleep(0.01)


def _restart(servers: list[RunningServer], index: int, directory: Path) -> None:
    port = int(servers[index].address.rsplit(":", 1)[1])
    servers[index].stop(0)
    servers[index] = _server(directory, port)


def test_a_worker_rolls_every_shard_back_to_the_newest_iteration_they_all_have(tmp_path: Path) -> None:
    servers, c, seen = _job(tmp_path, 5)
    try:
        assert checkpoint.versions(tmp_path / "shard0") == [4, 2]
        # shard 0 loses its newest checkpoint and restarts from iteration 2; shard 1 is at 5
        for f in (tmp_path / "shard0").glob("ckpt-v000000000004.*"):
            f.unlink()
        _restart(servers, 0, tmp_path / "shard0")
        flat = seen[5].clone()
        with pytest.raises(RollbackError, match="shard is at iteration 2"):
            c.exchange(_grad(5), 5, flat)
        assert c.rollback() == 2
        status = [s.shard.status() for s in servers]
        # shard 1 took the push of iteration 5 (the only worker): it was at 6
        assert [st.version for st in status] == [2, 2] and [st.rolled_back for st in status] == [0, 4]
        assert c.pull(flat, 2) == [2, 2] and torch.equal(flat, seen[2])
        assert c.rollback() == 2  # again: nothing changes
        assert servers[1].shard.status().rolled_back == 4
        _train(c, range(2, 5), flat)  # momentum state came back too: the same weights, exactly
        assert torch.equal(flat, seen[5])
    finally:
        c.close()
        for s in servers:
            s.stop(0)


def test_without_an_iteration_common_to_every_shard_the_roll_back_names_what_each_has(tmp_path: Path) -> None:
    servers, c, _ = _job(tmp_path, 5)
    try:
        for f in (tmp_path / "shard1").glob("ckpt-v000000000004.*"):
            f.unlink()
        for f in (tmp_path / "shard0").glob("ckpt-v000000000002.*"):
            f.unlink()
        _restart(servers, 0, tmp_path / "shard0")  # at 4, can go nowhere else; shard 1: 5 or 2
        with pytest.raises(CheckpointError) as info:
            c.rollback()
        message = str(info.value)
        assert "no iteration that every shard can return to" in message
        assert f"{servers[0].address}: [4]" in message and f"{servers[1].address}: [5, 2]" in message
        assert [s.shard.version for s in servers] == [4, 5]  # nothing was rolled back
    finally:
        c.close()
        for s in servers:
            s.stop(0)


def _pipelined_job(tmp_path: Path, batches: list, restart_at: int | None, indexed: bool = True) -> tuple[torch.Tensor, ...]:
    """A sync job of one worker with an embedding table, trained through opt.pipeline over
    `batches`; with restart_at, shard 0 restarts from an older checkpoint (its newest one lost) once
    the job is past iteration restart_at. Returns the table's touched rows and the head's weights."""
    import psgrad
    from torch import nn

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = psgrad.EmbeddingBag(200, 4, mode="sum", std=0.1, seed=2)
            torch.manual_seed(0)
            self.head = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(x)).squeeze(-1)

    servers = [_server(tmp_path / f"shard{i}") for i in range(2)]
    client = ClientConfig(connect_timeout_s=5, rpc_timeout_s=20, reconnect_timeout_s=30, shared_memory=False)
    model, rolled = Model(), []
    try:
        with psgrad.connect([s.address for s in servers], mode="sync", optimizer=psgrad.SGD(lr=0.5), client=client) as ps:
            opt = ps.optimizer(model)
            source = batches if indexed else iter(batches)
            for x, y in opt.pipeline(source, lambda b: {model.emb: b[0]}):
                opt.zero_grad()
                nn.functional.binary_cross_entropy_with_logits(model(x), y).backward()
                stats = opt.step()
                if stats.rolled_back_to is not None:
                    rolled.append(stats.rolled_back_to)
                if restart_at is not None and not rolled and opt.clock % 2 == 0 and opt.clock <= restart_at:
                    _written(tmp_path, opt.clock)  # every one (a writer behind skips to the newest offered)
                if restart_at is not None and opt.clock == restart_at and not rolled:
                    port = int(servers[0].address.rsplit(":", 1)[1])
                    servers[0].stop(0)  # (its checkpoint writer stopped with it: nothing written after this)
                    for f in (tmp_path / "shard0").glob(f"ckpt-v{restart_at:012d}.*"):
                        f.unlink()  # shard 0 comes back at iteration restart_at - 2
                    assert checkpoint.versions(tmp_path / "shard0")[0] == restart_at - 2
                    servers[0] = _server(tmp_path / "shard0", port)
            snaps = [s.shard.core.state.tables["emb"].snapshot().tensors for s in servers]
            ids = torch.cat([t["ids"] for t in snaps])
            table = torch.cat([t["values"] for t in snaps])[torch.argsort(ids)]  # (by id: a restore stores them anew)
            return table, model.head.weight.detach().clone(), torch.tensor(rolled), torch.tensor(opt.clock)
    finally:
        for s in servers:
            s.stop(0)


def test_a_pipeline_recomputes_the_iterations_a_roll_back_undid(tmp_path: Path) -> None:
    """opt.pipeline over a list: after a roll-back (StepStats.rolled_back_to) it goes on from the
    batch of the iteration the job went back to, so the sync job ends bit for bit as the one never
    interrupted; over an iterator, which cannot go back, the roll-back is raised, naming what to do."""
    gen = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(8):
        x = torch.randint(0, 200, (8, 3), generator=gen)
        batches.append((x, (x[:, 0] % 2).float()))
    clean = _pipelined_job(tmp_path / "clean", batches, None)
    again = _pipelined_job(tmp_path / "again", batches, 6)
    assert again[2].tolist() == [4] and int(again[3]) == int(clean[3]) == 8
    assert torch.equal(again[0], clean[0]) and torch.equal(again[1], clean[1])
    with pytest.raises(RollbackError, match="rolled back to iteration 4.*cannot go back \\(an iterator\\).*opt.clock"):
        _pipelined_job(tmp_path / "iterator", batches, 6, indexed=False)
