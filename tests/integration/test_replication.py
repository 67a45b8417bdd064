"""Hot standby in process: a backup holds its primary's state bit for bit (weights, optimizer state,
version, clocks) in every mode; workers fail over to it and every push is applied exactly once; a
promoted backup fences its former primary; a restarted server rejoins as the new backup."""
from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence

import pytest
import torch

from conftest import health, hold_port, run_in_threads, wait_for
from psgrad.client.export import export_state_dict
from psgrad.client.parameter_client import ParameterClient, shard_status
from psgrad.config import ClientConfig, JobSpec, ServerConfig
from psgrad.core.sharding import ParamSpec, plan_shards
from psgrad.errors import NotPrimaryError, ServerStartError, ServerUnavailableError, StaleEpochError
from psgrad.core.status import EVICTED
from psgrad.server.replication import NONE, Record
from psgrad.server.runtime import RunningServer, start_server

pytestmark = pytest.mark.timeout(120)

NUMEL = 3000
PARAMS = [ParamSpec("w", (NUMEL,), "float32")]
SPECS = {
    "async-sgd-staged": JobSpec(lr=0.1, num_workers=2),
    "async-momentum-decay": JobSpec(lr=0.05, momentum=0.9, weight_decay=0.01, num_workers=2),
    "async-adam": JobSpec(optimizer="adam", lr=0.01, weight_decay=0.01, num_workers=2),
    "ssp-adamw": JobSpec(mode="ssp", staleness=1, optimizer="adamw", lr=0.01, weight_decay=0.1, num_workers=2),
    "sync-sgd": JobSpec(mode="sync", lr=0.1, weight_decay=0.01, num_workers=2),
    "sync-adam": JobSpec(mode="sync", optimizer="adam", lr=0.01, num_workers=2),
    "staleness-lr": JobSpec(lr=0.1, staleness_lr=True, num_workers=2),
    "async-topk": JobSpec(lr=0.1, num_workers=2, compress="topk:0.05"),  # the backup applies the decoded gradient
    "sync-sign": JobSpec(mode="sync", lr=0.1, num_workers=2, compress="sign"),
}
CONFIG = ClientConfig(connect_timeout_s=5, rpc_timeout_s=10, reconnect_timeout_s=10, shared_memory=False)


@pytest.fixture
def servers() -> Callable[..., RunningServer]:  # type: ignore[misc]
    """servers(**ServerConfig fields) -> a started in-process server, stopped at teardown."""
    running: list[RunningServer] = []

    def start(**kw: object) -> RunningServer:
        s = start_server(ServerConfig(**{"port": 0, "threads": 16, **kw}))  # type: ignore[arg-type]
        running.append(s)
        return s

    yield start
    for s in running:
        s.stop(0)


def grad(rank: int, clock: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(1000 * rank + clock))


def train(address: str, spec: JobSpec, clocks: Sequence[int], ranks: int = 2,
          between: Callable[[], None] | None = None, config: ClientConfig = CONFIG,
          chief_lr: Callable[[int], float] | None = None) -> list[ParameterClient]:
    """Each rank (a thread) joins `address` and pushes clocks[:half], then (after `between` ran
    once) the rest, rank 0 with the lr chief_lr(clock) if given; returns the clients, closed."""
    half = len(clocks) // 2
    barrier = threading.Barrier(ranks, action=between)
    clients = [ParameterClient([address], spec, PARAMS, plan_shards(PARAMS, 1), r, config) for r in range(ranks)]

    def work(rank: int) -> None:
        c = clients[rank]
        c.join((lambda: torch.linspace(-1, 1, NUMEL)) if rank == 0 else None)
        flat = torch.empty(NUMEL)
        c.pull(flat, clocks[0])
        for i, clock in enumerate(clocks):
            if i == half:
                barrier.wait()
            c.exchange(grad(rank, clock), clock, flat, chief_lr(clock) if chief_lr and rank == 0 else None)

    try:
        run_in_threads(ranks, work)
    finally:
        for c in clients:
            c.close()
    return clients


def assert_same_state(a: RunningServer, b: RunningServer) -> None:
    sa, sb = a.shard.snapshot(), b.shard.snapshot()
    assert sa.version == sb.version and sa.members == sb.members and sa.layout == sb.layout
    assert torch.equal(sa.weights, sb.weights)
    assert sa.optimizer.keys() == sb.optimizer.keys()
    for key, value in sa.optimizer.items():
        other = sb.optimizer[key]
        assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, key


@pytest.mark.parametrize("name", SPECS)
def test_the_backup_holds_the_primarys_state_bit_for_bit(name: str, servers: Callable[..., RunningServer]) -> None:
    primary = servers()
    backup = servers(replica_of=primary.address)
    train(primary.address, SPECS[name], range(8))
    expected = 8 if SPECS[name].mode == "sync" else 16
    assert primary.shard.version == expected
    assert_same_state(primary, backup)
    st = primary.shard.status().replica
    assert (st.role, st.backup, st.replicated_version, st.epoch) == ("primary", backup.address, expected, 0)
    assert backup.shard.status().replica.role == "backup" and backup.shard.status().replica.primary == primary.address


def test_the_chiefs_lr_is_the_jobs_on_the_backup_too(servers: Callable[..., RunningServer]) -> None:
    """async: the chief's pushes carry a decaying lr, the other worker's none; the backup applies
    every push with the primary's lr and keeps the job's lr (it takes over with the schedule)."""
    primary = servers()
    backup = servers(replica_of=primary.address)
    train(primary.address, JobSpec(optimizer="adam", lr=0.01, num_workers=2), range(6), chief_lr=lambda c: 0.01 / (1 + c))
    status = primary.shard.status()
    assert (status.job_lr, status.job_lr_clock) == (pytest.approx(0.01 / 6), 5)
    assert_same_state(primary, backup)  # weights, moments, and the job's lr
    assert (backup.shard.status().job_lr, backup.shard.status().job_lr_clock) == (status.job_lr, 5)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_stale_pushes_replicate_with_their_scaled_step_size(optimizer: str, servers: Callable[..., RunningServer]) -> None:
    primary = servers()
    backup = servers(replica_of=primary.address)
    spec = JobSpec(optimizer=optimizer, lr=0.1, staleness_lr=True)
    with ParameterClient([primary.address], spec, PARAMS, plan_shards(PARAMS, 1), 0, CONFIG) as c:
        c.join(lambda: torch.linspace(-1, 1, NUMEL))
        replies = [c.push(grad(0, clock), clock)[0] for clock in range(5)]  # all computed on version 0
    assert [r.staleness for r in replies] == [0, 1, 2, 3, 4]
    assert_same_state(primary, backup)


def test_a_backup_attached_mid_run_takes_the_state_and_keeps_in_step(servers: Callable[..., RunningServer]) -> None:
    primary = servers()
    backups: list[RunningServer] = []
    train(primary.address, SPECS["async-adam"], range(10), between=lambda: backups.append(servers(replica_of=primary.address)))
    assert primary.shard.version == 20
    assert_same_state(primary, backups[0])


def test_a_backup_attached_mid_run_that_takes_over_continues_the_counters_its_snapshot_kept(
        servers: Callable[..., RunningServer]) -> None:
    """The snapshot a backup attaches with carries the shard's counters (as a checkpoint's does):
    one that takes over before any record reached it continues them (before: from 0)."""
    primary = servers()
    train(primary.address, SPECS["async-adam"], range(10))
    counted = primary.shard.status()
    assert counted.pushes_applied == 20
    backup = servers(replica_of=primary.address)
    wait_for("the backup's snapshot", lambda: backup.shard.version == primary.shard.version)
    primary.stop(0)
    backup.shard.serving()  # a worker's call promotes it
    st = backup.shard.status()
    assert st.replica.role == "primary"
    assert (st.pushes_applied, st.staleness, st.pulls, st.bytes_in) == \
        (counted.pushes_applied, counted.staleness, counted.pulls, counted.bytes_in)


@pytest.mark.parametrize("name", ["sync-sgd", "async-sgd-staged", "async-adam"])
def test_workers_fail_over_to_the_backup_and_every_push_is_applied_once(
    name: str, servers: Callable[..., RunningServer]
) -> None:
    primary = servers()
    backup = servers(replica_of=primary.address)
    spec = SPECS[name]
    reference = servers()  # the same job without a failure
    train(reference.address, spec, range(10))
    train(f"{primary.address}|{backup.address}", spec, range(10), between=lambda: primary.stop(0))
    st = backup.shard.status()
    assert (st.replica.role, st.replica.epoch) == ("primary", 1)
    assert st.version == reference.shard.version  # nothing lost, nothing applied twice
    assert {w.rank: w.clock for w in st.workers} == {0: 10, 1: 10}
    if spec.mode == "sync":  # (async: the order in which two workers' pushes apply differs from run to run)
        assert torch.equal(backup.shard.weights_copy(), reference.shard.weights_copy())


def test_a_retried_push_the_primary_had_applied_is_a_duplicate_on_the_backup(servers: Callable[..., RunningServer]) -> None:
    primary = servers()
    backup = servers(replica_of=primary.address)
    spec = JobSpec(lr=0.1)
    with ParameterClient([f"{primary.address}|{backup.address}"], spec, PARAMS, plan_shards(PARAMS, 1), 0, CONFIG) as c:
        c.join(lambda: torch.zeros(NUMEL))
        [first] = c.push(grad(0, 0), 0)
        primary.stop(0)  # as if its reply had been lost: the worker sends the push again
        [again] = c.push(grad(0, 0), 0)
        [second] = c.push(grad(0, 1), 1)
    assert first.applied and not again.applied and "duplicate" in again.reason and second.applied
    assert backup.shard.version == 2 and backup.shard.status().pushes_duplicate == 1


def test_a_promoted_backup_fences_its_former_primary(servers: Callable[..., RunningServer]) -> None:
    primary = servers()
    backup = servers(replica_of=primary.address)
    spec = JobSpec(lr=0.1, num_workers=2)
    plan = plan_shards(PARAMS, 1)
    with ParameterClient([f"{primary.address}|{backup.address}"], spec, PARAMS, plan, 0, CONFIG) as a, \
            ParameterClient([backup.address], spec, PARAMS, plan, 1, CONFIG) as b:
        assert health(primary.address) == health(backup.address) == "NOT_SERVING"  # no state yet
        a.join(lambda: torch.zeros(NUMEL))
        assert a.push(grad(0, 0), 0)[0].applied
        assert health(primary.address) == "SERVING"
        health(backup.address, wait_for="SERVING")  # a backup with its primary's state is ready to take over
        b.join(None)  # a worker's call at the backup (as if it had lost the primary): it takes over
        assert backup.shard.status().replica.epoch == 1
        assert backup.shard.core.took_over and not primary.shard.core.took_over  # (its tables' base versions: unbounded)
        assert primary.shard.wait_until(lambda s: s.replica.role == "fenced", 10)
        health(primary.address, wait_for="NOT_SERVING")  # a readiness probe takes the fenced one out
        assert health(backup.address) == "SERVING"
        with pytest.raises(NotPrimaryError):
            primary.shard.serving()
        # the old epoch's records are refused: a late message from the former primary changes nothing
        with pytest.raises(StaleEpochError, match="epoch 0"):
            backup.shard.apply_record(0, Record(NONE, backup.shard.version + 1))
        [pushed] = a.push(grad(0, 1), 1)  # the fenced primary refuses; the worker fails over
        assert pushed.applied and a.shards[0].address == backup.address
    assert backup.shard.version == 2 and primary.shard.version == 1


def test_a_restarted_server_rejoins_as_the_backup_and_can_take_over(servers: Callable[..., RunningServer]) -> None:
    first = servers()
    second = servers(replica_of=first.address)
    port = int(first.address.rsplit(":", 1)[1])
    spec = SPECS["async-momentum-decay"]
    reference = servers()
    train(reference.address, spec, range(12), ranks=1)
    steps = iter([lambda: first.stop(0), lambda: rejoined.append(servers(port=port, replica_of=second.address)),
                  lambda: second.stop(0)])
    rejoined: list[RunningServer] = []
    shard = f"{first.address}|{second.address}"
    with ParameterClient([shard], spec, PARAMS, plan_shards(PARAMS, 1), 0, CONFIG) as c:
        c.join(lambda: torch.linspace(-1, 1, NUMEL))
        flat = torch.empty(NUMEL)
        c.pull(flat, 0)
        for clock in range(12):
            if clock in (3, 6, 9):
                next(steps)()
            c.exchange(grad(0, clock), clock, flat)
    st = rejoined[0].shard.status()
    assert (st.replica.role, st.replica.epoch, st.version) == ("primary", 2, 12)
    assert torch.equal(rejoined[0].shard.weights_copy(), reference.shard.weights_copy())
    [seen] = shard_status([shard], 5.0)  # the status of a PRIMARY|BACKUP shard: the one serving it
    assert seen.replica.role == "primary" and seen.version == 12
    exported, versions = export_state_dict([f"{second.address}|{first.address}"], 5.0)  # the first listed is dead
    assert versions == [12] and torch.equal(exported["w"], reference.shard.weights_copy())


def test_a_backup_without_state_refuses_workers_and_neither_answering_is_named(servers: Callable[..., RunningServer]) -> None:
    primary = servers()
    backup = servers(replica_of=primary.address)
    with pytest.raises(NotPrimaryError, match="no state"):
        backup.shard.serving()
    primary.stop(0)
    backup.stop(0)
    held = [hold_port(s.address) for s in (primary, backup)]  # refused, and no other test's server gets them
    config = ClientConfig(connect_timeout_s=1, rpc_timeout_s=1, reconnect_timeout_s=1, shared_memory=False)
    with held[0], held[1], ParameterClient([f"{primary.address}|{backup.address}"], JobSpec(), PARAMS,
                                           plan_shards(PARAMS, 1), 0, config) as c:
        c.shards[0].rejoin = lambda t: None
        with pytest.raises(ServerUnavailableError, match="neither server of the shard") as info:
            c.push(grad(0, 0), 0)
    assert primary.address in str(info.value) and backup.address in str(info.value)
    assert re.search(r"came back for \d+\.\d s of --reconnect-timeout-s [\d.]+; the last one tried: server \S+ "
                     r"refused the connection \(nothing listens on that port", str(info.value)), info.value


def test_a_join_that_neither_server_serves_names_what_each_answered(servers: Callable[..., RunningServer]) -> None:
    """The primary died before any worker joined, and its backup has no state yet: the join names
    both, the dead primary's refused connection and the backup's missing state (it named the
    primary alone, and a user could not tell that the backup was there but empty)."""
    primary = servers()
    backup = servers(replica_of=primary.address)
    primary.stop(0)
    config = ClientConfig(connect_timeout_s=2, rpc_timeout_s=2, reconnect_timeout_s=2, shared_memory=False)
    with hold_port(primary.address), ParameterClient([f"{primary.address}|{backup.address}"], JobSpec(), PARAMS,
                                                    plan_shards(PARAMS, 1), 0, config) as c:
        with pytest.raises((ServerUnavailableError, NotPrimaryError), match="neither server of the shard served") as info:
            c.join(lambda: torch.zeros(NUMEL))
    message = str(info.value)
    assert f"server {primary.address} refused the connection" in message, message
    assert backup.address in message and "no state from its primary" in message, message


def test_a_backup_whose_primary_does_not_answer_does_not_start() -> None:
    dead = start_server(ServerConfig(port=0, threads=4))
    dead.stop(0)
    with hold_port(dead.address), pytest.raises(ServerStartError, match=f"cannot become the backup of {dead.address}") as info:
        start_server(ServerConfig(port=0, threads=4, replica_of=dead.address, replica_timeout_s=1))
    # nothing listens there: said so, not "did not answer" (gRPC waiting for it reports a deadline)
    assert f"server {dead.address} refused the connection (nothing listens on that port" in str(info.value), info.value
    assert "throughout 1 s (--replica-timeout-s)" in str(info.value)


def test_a_sync_push_buffered_on_a_primary_that_dies_is_taken_again_by_the_backup(
    servers: Callable[..., RunningServer],
) -> None:
    """Pushes too large for one Step call go as Push then Pull; a buffered sync gradient lives on
    the primary alone, so its push is answered only once the iteration is replicated."""
    numel = 300_000  # > one 1 MiB chunk: push and pull apart (no shared memory)
    params = [ParamSpec("w", (numel,), "float32")]
    spec = JobSpec(mode="sync", lr=0.1, num_workers=2)
    primary = servers()
    backup = servers(replica_of=primary.address)
    shard = f"{primary.address}|{backup.address}"
    clients = [ParameterClient([shard], spec, params, plan_shards(params, 1), r, CONFIG) for r in range(2)]
    replies: list[object] = []
    try:
        run_in_threads(2, lambda r: clients[r].join((lambda: torch.zeros(numel)) if r == 0 else None))
        # joins reach the backup lazily (a known gap: see docs/operations/fault-tolerance.md, "Hot standby"): wait until it knows both
        assert backup.shard.wait_until(lambda s: {w.rank for w in s.workers} == {0, 1}, 30)
        flat = torch.empty(numel)
        first = threading.Thread(target=lambda: replies.append(clients[0].exchange(torch.ones(numel), 0, flat)))
        first.start()
        assert primary.shard.replication is not None
        assert primary.shard.replication.wait_for_waiting(1, 30)  # rank 0's gradient, buffered: its reply is held
        assert primary.shard.status().pending == 1
        primary.stop(0)
        [pushed], _ = clients[1].exchange(torch.full((numel,), 3.0), 0, torch.empty(numel))
        first.join(30)
        assert not first.is_alive() and replies
    finally:
        for c in clients:
            c.close()
    # rank 0's push went again to the backup, before or after rank 1's: whichever came second
    # completed the iteration, once, with both gradients
    [first_pushed], _ = replies[0]  # type: ignore[misc]
    assert sorted([pushed.applied, first_pushed.applied]) == [False, True]
    assert backup.shard.version == 1
    assert torch.equal(backup.shard.weights_copy(), torch.full((numel,), -0.2))  # 0 - 0.1 * mean(1, 3)


def test_joins_and_leaves_reach_the_backup(servers: Callable[..., RunningServer]) -> None:
    primary = servers()
    backup = servers(replica_of=primary.address)
    spec = JobSpec(lr=0.1, num_workers=2)
    plan = plan_shards(PARAMS, 1)
    with ParameterClient([primary.address], spec, PARAMS, plan, 0, CONFIG) as a, \
            ParameterClient([primary.address], spec, PARAMS, plan, 1, CONFIG) as b:
        a.join(lambda: torch.zeros(NUMEL))
        b.join(None)
        a.push(grad(0, 0), 0)
        b.leave()  # no update follows: the backup learns it from a members record
        states = {1: "left", 0: "live"}
        assert backup.shard.wait_until(lambda s: {w.rank: w.state for w in s.workers} == states, 10)
    assert_same_state(primary, backup)


def test_a_worker_joining_after_the_failover_finds_the_backup(servers: Callable[..., RunningServer]) -> None:
    primary = servers()
    backup = servers(replica_of=primary.address)
    spec = JobSpec(lr=0.1, num_workers=2)
    shard = f"{primary.address}|{backup.address}"
    plan = plan_shards(PARAMS, 1)
    with ParameterClient([shard], spec, PARAMS, plan, 0, CONFIG) as a:
        a.join(lambda: torch.zeros(NUMEL))
        a.push(grad(0, 0), 0)
        primary.stop(0)
        with ParameterClient([shard], spec, PARAMS, plan, 1, CONFIG) as late:  # lists the dead primary first
            assert late.join(None) == 0
            [pushed] = late.push(grad(1, 0), 0)
    assert pushed.applied and backup.shard.version == 2 and backup.shard.status().replica.epoch == 1


def test_a_worker_joining_while_the_primarys_port_takes_connections_but_is_silent_finds_the_backup(
    servers: Callable[..., RunningServer]
) -> None:
    """The dead primary's port is taken by something that never speaks gRPC (a stopped process:
    the kernel completes the TCP handshake): a connection attempt to it runs on (up to 10 s), so the
    join gives the first server a couple of seconds, not its whole connect timeout (here 9 s, which
    it would spend waiting for that attempt), before trying the backup."""
    primary = servers()
    backup = servers(replica_of=primary.address)
    spec = JobSpec(lr=0.1, num_workers=2)
    shard = f"{primary.address}|{backup.address}"
    plan = plan_shards(PARAMS, 1)
    config = ClientConfig(connect_timeout_s=9, rpc_timeout_s=10, reconnect_timeout_s=10, shared_memory=False)
    with ParameterClient([shard], spec, PARAMS, plan, 0, config) as a:
        a.join(lambda: torch.zeros(NUMEL))
        a.push(grad(0, 0), 0)
        primary.stop(0)
        with hold_port(primary.address) as silent:
            silent.listen(8)
            with ParameterClient([shard], spec, PARAMS, plan, 1, config) as late:  # lists the silent port first
                assert late.join(None) == 0
                [pushed] = late.push(grad(1, 0), 0)
    assert pushed.applied and backup.shard.version == 2


def test_a_dropped_backup_forgets_its_stale_state_and_attaches_again(servers: Callable[..., RunningServer]) -> None:
    from psgrad.server.replica_servicer import send_fence

    primary = servers()
    backup = servers(replica_of=primary.address)
    train(primary.address, SPECS["async-adam"], range(4))
    assert primary.shard.replication is not None
    send_fence(backup.address, 0, dropped=True)  # what a primary sends a backup it gave up on
    # it takes the state again: a new attach (the same address) and a fresh snapshot
    assert primary.shard.wait_until(lambda s: s.replica.backup == backup.address, 10)
    assert backup.shard.wait_until(lambda s: s.initialized and s.version == 8, 10)
    assert_same_state(primary, backup)
    send_fence(backup.address, 7, dropped=True)  # not from its primary's epoch: ignored
    assert backup.shard.status().initialized


def test_a_promoted_backup_evicts_a_worker_that_died_with_its_primary(servers: Callable[..., RunningServer]) -> None:
    # Before: the backup's lease reaper, started with no member to watch, waited to be woken, and
    # taking over did not wake it: a worker that never called the new primary stayed live until
    # some other call happened to look (the reaper exists so that nobody has to).
    primary = servers(lease_s=1.0)
    backup = servers(replica_of=primary.address, lease_s=1.0)
    spec = JobSpec(lr=0.1, num_workers=2)
    plan = plan_shards(PARAMS, 1)
    with ParameterClient([f"{primary.address}|{backup.address}"], spec, PARAMS, plan, 0, CONFIG) as a, \
            ParameterClient([primary.address], spec, PARAMS, plan, 1, CONFIG) as dead:
        a.join(lambda: torch.zeros(NUMEL))
        dead.join(None)
        a.push(grad(0, 0), 0)
        assert backup.shard.wait_until(lambda s: {w.rank for w in s.workers} == {0, 1}, 10)
        primary.stop(0)
        a.push(grad(0, 1), 1)  # a fails over; the backup takes over, with fresh leases for both
        assert backup.shard.status().replica.epoch == 1
        a.close()  # leaves: no call reaches the backup from now on (a's heartbeats would evict on their own)
        members = backup.shard.core.members.members  # read without a call
        wait_for("the dead worker's eviction", lambda: members[1].state == EVICTED, 20)


def test_a_skipped_step_reaches_the_backup_which_goes_on_from_it(servers: Callable[..., RunningServer]) -> None:
    """Sync, 2 workers, a primary and its backup. Worker 1's gradient of iteration 0 is buffered;
    worker 0 skips its step 0 (PushHeader.skip: other shards of its job applied it, it dropped
    it): the iteration completes with worker 1's gradient alone, and the skip is answered once the
    backup has it: the same weights, and worker 0's clock past the skipped step. The primary dies;
    both workers push iteration 1 to the backup, which applies it (no duplicate, no wait for a
    skipped step)."""
    from psgrad.proto import ps_pb2 as pb

    primary = servers()
    backup = servers(replica_of=primary.address)
    spec = JobSpec(mode="sync", lr=0.1, num_workers=2)
    shard = f"{primary.address}|{backup.address}"
    clients = [ParameterClient([shard], spec, PARAMS, plan_shards(PARAMS, 1), r, CONFIG) for r in range(2)]
    held: list[object] = []
    try:
        run_in_threads(2, lambda r: clients[r].join((lambda: torch.zeros(NUMEL)) if r == 0 else None))
        assert backup.shard.wait_until(lambda s: {w.rank for w in s.workers} == {0, 1}, 30)
        first = threading.Thread(target=lambda: held.append(clients[1].push(grad(1, 0), 0)))
        first.start()
        assert primary.shard.replication is not None
        assert primary.shard.replication.wait_for_waiting(1, 30)  # worker 1's gradient, buffered
        reply = clients[0].shards[0].skip(pb.PushHeader(rank=0, clock=0, fingerprint=clients[0].fingerprint, skip=True))
        first.join(30)
        assert not first.is_alive() and held
        assert (reply.applied, reply.version) == (False, 1) and reply.reason.startswith("skipped")
        assert_same_state(primary, backup)
        assert {w.rank: w.clock for w in backup.shard.status().workers} == {0: 1, 1: 1}
        primary.stop(0)
        run_in_threads(2, lambda r: clients[r].push(grad(r, 1), 1))
    finally:
        for c in clients:
            c.close()
    st = backup.shard.status()
    assert (st.version, st.pushes_skipped, st.pushes_duplicate) == (2, 1, 0)  # (the primary's skip: its counters continue)
    expected = -0.1 * grad(1, 0) - 0.1 * (grad(0, 1) + grad(1, 1)) / 2
    torch.testing.assert_close(backup.shard.weights_copy(), expected)
