"""DC-ASGD (Zheng et al., ICML 2017) on real in-process servers against a reference written here from
the paper's formulas: scripted async interleavings of pulls and pushes by several workers of a
linear model over two shards give the reference's weights; lambda 0 is plain ASGD bit for bit; a hot
standby holds the compensated state bit for bit; copies go with their workers."""
from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from collections.abc import Callable

import pytest
import torch

from conftest import run_in_threads

from psgrad.cli.status import format_status
from psgrad.client.parameter_client import ParameterClient, shard_status
from psgrad.config import ClientConfig, JobSpec
from psgrad.core.sharding import ParamSpec, plan_shards
from psgrad.core.status import DelayStatus
from psgrad.errors import ConfigError
from psgrad.server.runtime import RunningServer

pytestmark = pytest.mark.timeout(120)

FEATURES, BATCH, WORKERS, LR = 12, 16, 3, 0.05
PARAMS = [ParamSpec("w", (FEATURES,), "float32"), ParamSpec("b", (1,), "float32")]
NUMEL = FEATURES + 1
Servers = Callable[..., list[RunningServer]]  # conftest's make_servers
CONFIG = ClientConfig(connect_timeout_s=5, rpc_timeout_s=10, reconnect_timeout_s=5, shared_memory=False)


def initial() -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(7))


def gradient(rank: int, step: int, flat: torch.Tensor) -> torch.Tensor:
    """Worker `rank`'s gradient of its step's least-squares batch, 0.5 * mean((Xw + b - y)^2), at flat."""
    gen = torch.Generator().manual_seed(100 * rank + step)
    x, y = torch.randn(BATCH, FEATURES, generator=gen), torch.randn(BATCH, generator=gen)
    err = x @ flat[:FEATURES] + flat[FEATURES] - y
    return torch.cat([x.T @ err / BATCH, err.mean().reshape(1)])


def schedule(seed: int, events: int = 36) -> list[tuple[str, int]]:
    """An async interleaving: ("pull" | "push" | "exchange", rank). Rank 0 (the chief) pushes first
    on its initial weights; the others pull before their first push; some push twice on one pull."""
    rng = random.Random(seed)
    out, pulled = [("push", 0)], {0}
    while len(out) < events:
        rank = rng.randrange(WORKERS)
        kind = rng.choice(("pull", "push", "push", "exchange")) if rank in pulled else "pull"
        pulled.add(rank)
        out.append((kind, rank))
    return out


class Reference:
    """DC-ASGD as the paper writes it, for one parameter server applying SGD: the server keeps w_bak(m),
    the model worker m last pulled, and applies w <- w - lr * (g + lambda * g (.) g (.) (w - w_bak(m))).
    DC-ASGD-a: MeanSquare <- 0.95 * MeanSquare + 0.05 * g (.) g, lambda = lambda0 / sqrt(MeanSquare + 1e-7)."""

    def __init__(self, w0: torch.Tensor, lam: float, adaptive: bool) -> None:
        self.w, self.lam, self.adaptive = w0.clone(), lam, adaptive
        self.bak = {0: w0.clone()}  # the chief starts from its initial weights
        self.mean_square = torch.zeros_like(w0)

    def pull(self, rank: int) -> None:
        self.bak[rank] = self.w.clone()

    def push(self, rank: int, g: torch.Tensor) -> None:
        lam: float | torch.Tensor = self.lam
        if self.adaptive:
            self.mean_square = 0.95 * self.mean_square + 0.05 * g * g
            lam = self.lam / torch.sqrt(self.mean_square + 1e-7)
        compensated = g + lam * g * g * (self.w - self.bak[rank])
        self.w = torch.add(self.w, compensated, alpha=-LR)  # SGD

    def run(self, events: list[tuple[str, int]]) -> torch.Tensor:
        steps = [0] * WORKERS
        for kind, rank in events:
            if kind != "pull":
                self.push(rank, gradient(rank, steps[rank], self.bak[rank]))
                steps[rank] += 1
            if kind != "push":
                self.pull(rank)
        return self.w


def run_psgrad(shards: list[str], spec: JobSpec, events: list[tuple[str, int]], config: ClientConfig = CONFIG,
               leave: bool = True) -> list[ParameterClient]:
    """Play the schedule on real servers, one worker (ParameterClient) per rank, in this thread."""
    plan = plan_shards(PARAMS, len(shards))
    clients = [ParameterClient(shards, spec, PARAMS, plan, r, config) for r in range(WORKERS)]
    flats = [initial() if r == 0 else torch.empty(NUMEL) for r in range(WORKERS)]
    clocks = [0] * WORKERS
    # ssp starts once every worker joined: the joins wait for each other
    run_in_threads(WORKERS, lambda r: clients[r].join(initial if r == 0 else None), timeout_s=30)
    for kind, rank in events:
        c, flat = clients[rank], flats[rank]
        if kind == "pull":
            c.pull(flat, clocks[rank])
            continue
        g = gradient(rank, clocks[rank], flat)
        if kind == "push":
            assert all(r.applied for r in c.push(g, clocks[rank]))
        else:
            replies, _ = c.exchange(g, clocks[rank], flat)
            assert all(r.applied for r in replies)
        clocks[rank] += 1
    if leave:
        for c in clients:
            c.leave()
            c.close()
    return clients


def weights(servers: list[RunningServer]) -> torch.Tensor:
    parts = [s.shard.weights_copy() for s in servers]
    assert all(p is not None for p in parts)
    return torch.cat([p for p in parts if p is not None])


CASES = {  # lambda, adaptive, mode (ssp with a bound no interleaving reaches: its gate never parks a pull)
    "constant": (0.8, False, "async"),
    "adaptive": (0.3, True, "async"),
    "ssp": (0.8, False, "ssp"),
}


@pytest.mark.parametrize("shared_memory", [False, True], ids=["grpc", "shm"])
@pytest.mark.parametrize("case", CASES)
def test_the_servers_apply_the_papers_update(case: str, shared_memory: bool,
                                             make_servers: Servers) -> None:
    lam, adaptive, mode = CASES[case]
    events = schedule(seed=len(case) + shared_memory)
    spec = JobSpec(mode=mode, staleness=100 if mode == "ssp" else 0, lr=LR, num_workers=WORKERS, num_shards=2,
                   dc_asgd=lam, dc_asgd_adaptive=adaptive)
    shards = make_servers(2)
    config = dataclasses.replace(CONFIG, shared_memory=shared_memory)
    run_psgrad([s.address for s in shards], spec, events, config)
    got = weights(shards)
    expected = Reference(initial(), lam, adaptive).run(events)
    plain = Reference(initial(), 0.0, False).run(events)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert (expected - plain).abs().max() > 1e-2  # the compensation changed the run, far beyond the tolerance
    assert all(s.shard.version == sum(k != "pull" for k, _ in events) for s in shards)
    for s in shards:
        dc = s.shard.dc
        assert dc is not None and dc.uncompensated == 0 and dc.compensated == s.shard.version
        assert dc.copies == 0  # every worker left: its copy went with it


def test_lambda_0_is_plain_asgd_bit_for_bit(make_servers: Servers) -> None:
    events = schedule(seed=3)
    shards = make_servers(2)
    run_psgrad([s.address for s in shards], JobSpec(lr=LR, num_workers=WORKERS, num_shards=2), events)
    assert torch.equal(weights(shards), Reference(initial(), 0.0, False).run(events))
    assert all(s.shard.dc is None for s in shards)  # off: no copies, no compensation, staged SGD as before


def test_without_delay_dc_asgd_changes_nothing(make_servers: Servers) -> None:
    """Each worker pushes on the newest weights: w_now = w_bak, so g is applied as it came (bitwise
    the staged plain-SGD path's result)."""
    events = [("push", 0), ("pull", 1), ("push", 1), ("pull", 2), ("push", 2), ("pull", 0), ("exchange", 0)]
    runs = []
    for lam in (0.0, 0.8):
        shards = make_servers(2)
        spec = JobSpec(lr=LR, num_workers=WORKERS, num_shards=2, dc_asgd=lam)
        run_psgrad([s.address for s in shards], spec, events)
        runs.append(weights(shards))
    assert torch.equal(runs[0], runs[1])


def test_a_backup_applies_the_compensated_update_bit_for_bit(make_servers: Servers) -> None:
    [primary] = make_servers(1)
    [backup] = make_servers(1, replica_of=primary.address)
    spec = JobSpec(lr=LR, momentum=0.9, num_workers=WORKERS, dc_asgd=0.8, dc_asgd_adaptive=True)
    run_psgrad([primary.address], spec, schedule(seed=5))
    a, b = primary.shard.snapshot(), backup.shard.snapshot()
    assert a.version == b.version == primary.shard.status().replica.replicated_version
    assert torch.equal(a.weights, b.weights)
    assert a.optimizer.keys() == b.optimizer.keys()
    for key, value in a.optimizer.items():
        assert torch.equal(value, b.optimizer[key]) if isinstance(value, torch.Tensor) else value == b.optimizer[key]


def test_a_worker_that_pulls_again_replaces_its_copy_and_one_that_leaves_drops_it(
    make_servers: Servers,
) -> None:
    [server] = make_servers(1)
    spec = JobSpec(lr=LR, num_workers=WORKERS, dc_asgd=0.5)
    clients = run_psgrad([server.address], spec, [("push", 0), ("pull", 1), ("pull", 2), ("pull", 1)], leave=False)
    dc = server.shard.dc
    assert dc is not None and dc.copies == 3 and dc.nbytes == 4 * NUMEL * (3 + 1)  # the copies and a scratch tensor
    version = server.shard.version
    clients[2].base_versions = [0]  # a gradient of weights older than its copy's (as with overlap)
    clients[2].push(gradient(2, 0, initial()), 0)
    assert dc.uncompensated == 1 and server.shard.version == version + 1  # applied as it came
    [status] = shard_status([server.address], 5.0)  # through the Status RPC
    assert status.delay == DelayStatus(copies=3, nbytes=4 * NUMEL * 4, compensated=1, uncompensated=1)
    table = format_status([{**status.to_dict(), "address": server.address}])
    [line] = [x for x in table.splitlines() if "DC-ASGD" in x]
    assert "lambda 0.5: copies of pulled weights for 3 workers" in line and "compensated 1, uncompensated 1" in line
    clients[1].leave()
    assert dc.copies == 2
    for c in clients:
        c.close()
    assert dc.copies == 2
    server.shard.core.members.lease_s = 0.0  # leases end now (as if the workers had died): evicted
    assert server.shard.live_ranks() == set() and dc.copies == 0


def test_a_restored_shard_compensates_a_worker_again_once_it_pulled(make_servers: Servers, tmp_path: Path) -> None:
    """Copies are not checkpointed: after a restart a push is applied as it came (w_bak = w_now) until
    its worker pulls from the restored server."""
    spec = JobSpec(lr=LR, num_workers=WORKERS, dc_asgd=0.8)
    [first] = make_servers(1, checkpoint_dir=str(tmp_path))
    clients = run_psgrad([first.address], spec, schedule(seed=9, events=12), leave=False)
    for c in clients:
        c.close()
    first.stop(0)  # a last checkpoint
    [restored] = make_servers(1, checkpoint_dir=str(tmp_path))
    version = restored.shard.version
    with ParameterClient([restored.address], spec, PARAMS, plan_shards(PARAMS, 1), 1, CONFIG) as c:
        clock = c.join(None)
        flat = torch.empty(NUMEL)
        c.base_versions = [version]  # as if it had pulled this version from the server before the restart
        c.push(gradient(1, clock, flat.zero_()), clock)
        assert restored.shard.status().delay == DelayStatus(compensated=0, uncompensated=1)
        c.pull(flat, clock + 1)
        c.push(gradient(1, clock + 1, flat), clock + 1)
        c.exchange(gradient(1, clock + 2, flat), clock + 2, flat)  # pushes on the first pull's weights, one behind
    delay = restored.shard.status().delay
    assert (delay.compensated, delay.uncompensated, delay.copies) == (2, 1, 1)


def test_a_promoted_backup_compensates_a_worker_once_it_pulled_from_it(make_servers: Servers) -> None:
    [primary] = make_servers(1)
    [backup] = make_servers(1, replica_of=primary.address)
    spec = JobSpec(lr=LR, num_workers=1, dc_asgd=0.8)
    with ParameterClient([f"{primary.address}|{backup.address}"], spec, PARAMS, plan_shards(PARAMS, 1), 0, CONFIG) as c:
        c.join(initial)
        flat = initial()
        c.push(gradient(0, 0, flat), 0)
        c.pull(flat, 1)
        primary.stop(0)
        c.push(gradient(0, 1, flat), 1)  # fails over: the backup holds no copy of the pulled weights
        assert backup.shard.status().delay == DelayStatus(uncompensated=1)
        c.exchange(gradient(0, 2, flat), 2, flat)  # still on the primary's pull: applied as it came
        c.push(gradient(0, 3, flat), 3)  # on the backup's pull: compensated
    delay = backup.shard.status().delay
    assert (delay.compensated, delay.uncompensated) == (1, 2) and backup.shard.status().replica.role == "primary"


def test_the_api_takes_dc_asgd_and_refuses_it_with_overlap() -> None:
    import psgrad
    from psgrad.core.job import check_overlap

    session = psgrad.connect("127.0.0.1:1", dc_asgd=2.0, dc_asgd_adaptive=True)  # nothing is sent yet
    assert (session.spec.dc_asgd, session.spec.dc_asgd_adaptive) == (2.0, True)
    with pytest.raises(ConfigError, match="mode 'sync' applies every gradient"):
        psgrad.connect("127.0.0.1:1", mode="sync", dc_asgd=0.04)
    with pytest.raises(ConfigError, match="overlap and --dc-asgd"):
        check_overlap(JobSpec(dc_asgd=0.1), overlap=True)
    check_overlap(JobSpec(dc_asgd=0.1), overlap=False)
