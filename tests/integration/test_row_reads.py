"""Reads of sparse rows within the servers' budget before any work: a read stores no row (a row never
updated reads as its computed initial value; only an update stores it), so reads never charge
--memory-budget-mb, and the admin's read-only credential cannot grow a table; a read whose reply
would be too large to send is refused from its request alone, before a byte of the reply is built;
the replies to reads in flight hold at most --max-read-mb at once (reads past it wait their turn,
one larger than all of it is refused naming the flag). In-process servers, or real server processes
where the server's flags are what is tested; real gRPC channels."""
from __future__ import annotations

import resource
import threading

import grpc
import pytest
import torch
from torch import nn

import psgrad
from psgrad.client.parameter_client import ParameterClient, shard_status
from psgrad.config import AuthConfig, ClientConfig
from psgrad.core.credentials import ADMIN, derive_token
from psgrad.errors import InvalidRequestError, MemoryBudgetError
from psgrad.proto import ps_pb2 as pb
from psgrad.server.rows_path import REPLY_ROWS_MAX_BYTES
from psgrad.wire.protocol import CHANNEL_OPTIONS, METHOD_PREFIX

from conftest import run_in_threads, wait_for

pytestmark = pytest.mark.timeout(120)

# (rows through calls: a read in place builds no reply, which --max-read-mb bounds)
CLIENT = ClientConfig(connect_timeout_s=10, rpc_timeout_s=60, reconnect_timeout_s=0, shared_memory=False,
                      rows_in_place=False)
SECRET = b"a job secret of at least 32 bytes, for tests"


class Ctr(nn.Module):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.emb = psgrad.Embedding(rows, 32)
        self.head = nn.Linear(32, 1)


def table_status(address: str, auth: AuthConfig | None = None):  # type: ignore[no-untyped-def]
    (status,) = shard_status([address], 10, client=ClientConfig(auth=auth or AuthConfig()))
    (emb,) = [t for t in status.tables if t.kind == "sparse"]
    return emb


def test_reads_store_no_rows_and_never_charge_the_budget_and_only_updates_do(make_servers) -> None:  # type: ignore[no-untyped-def]
    # A budget that holds the table's row index (100,000 x 8 bytes) and a few thousand rows, not
    # 60,000: reads of 60,000 new ids went through before only while the budget lasted.
    (server,) = make_servers(1, memory_budget_mb=1.5, auth=AuthConfig(secret=SECRET))
    model = Ctr(100_000)
    worker = ClientConfig(**{**CLIENT.__dict__, "auth": AuthConfig(secret=SECRET)})
    admin = ClientConfig(**{**CLIENT.__dict__, "auth": AuthConfig(token=derive_token(SECRET, "admin"))})
    with psgrad.connect([server.address], optimizer=psgrad.SGD(lr=0.5), client=worker) as ps:
        opt = ps.optimizer(model)
        client = opt.client
        table = model.emb.table
        assert table
        many = torch.arange(0, 60_000, dtype=torch.int64)
        first = client.pull_rows(table, many)
        assert torch.equal(client.pull_rows(table, many), first)  # computed again, the same
        assert table_status(server.address, admin.auth).rows_touched == 0
        # the admin's read-only pulls (as `psgrad export` and fetch_state_dict make them) store nothing either
        observer = ParameterClient([server.address], client.spec, client.params, client.plan, 0, admin, role=ADMIN,
                                   tables=list(client.tables.values()), frozen=client.frozen)
        try:
            assert torch.equal(observer.pull_rows(table, many[::7].contiguous(), observe=True), first[::7])
        finally:
            observer.close()
        assert table_status(server.address, admin.auth).rows_touched == 0
        # an update of a few rows stores them; one of 60,000 would pass the budget and changes nothing
        x = torch.tensor([[5, 17, 99_999]])
        model.emb(x).sum().backward()
        model.head.weight.grad = torch.zeros_like(model.head.weight)
        opt.step()
        assert table_status(server.address, admin.auth).rows_touched == 3
        with pytest.raises(MemoryBudgetError, match="--memory-budget-mb"):
            client.push(torch.zeros(client.plan.total), opt.clock,
                        rows={table: (many, torch.ones(many.numel(), 32))})
        assert table_status(server.address, admin.auth).rows_touched == 3
        after = client.pull_rows(table, torch.tensor([5, 6]))
        assert torch.equal(after[1], first[6]) and not torch.equal(after[0], first[5])


def test_a_read_whose_reply_would_be_too_large_is_refused_before_it_is_built(make_servers) -> None:  # type: ignore[no-untyped-def]
    """Before: 8M copies of one id in a 64 MB PullRows made the server build a 1 GB reply before gRPC
    refused to send it (272 -> 3,543 MB after two such calls)."""
    (server,) = make_servers(1)
    model = Ctr(1_000)
    with psgrad.connect([server.address], client=CLIENT) as ps:
        opt = ps.optimizer(model)
        table, client = model.emb.table, opt.client
        assert table
        n = 4_000_000  # 32 MB of ids; the reply would be 4M x 32 x 4 = 512 MB
        assert n * 32 * 4 > REPLY_ROWS_MAX_BYTES
        request = pb.RowsRequest(rank=0, fingerprint=client.fingerprint,
                                 block=pb.RowBlock(tables=[table], counts=[n],
                                                   ids=torch.full((n,), 7).numpy().tobytes()))
        channel = grpc.insecure_channel(server.address, options=CHANNEL_OPTIONS)
        try:
            call = channel.unary_unary(METHOD_PREFIX + "PullRows", request_serializer=pb.RowsRequest.SerializeToString,
                                       response_deserializer=None)
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB: this process serves the call
            for _ in range(2):
                with pytest.raises(grpc.RpcError) as refused:
                    call(request, timeout=60)
                assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                details = str(refused.value.details())
                assert "would make a reply of 512,000,000 bytes, more than the" in details
                assert "give the step fewer distinct ids (a smaller batch), more servers" in details  # (what a user can do)
            grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) / 1024
            print(f"peak memory grew {grown_mb:.0f} MB over two refused reads of {n:,} ids")
            assert grown_mb < 400  # the request's copies (32 MB of ids), never the 512 MB reply
        finally:
            channel.close()
        with pytest.raises(InvalidRequestError, match="would make a reply of"):  # through the client too
            client.pull_rows(table, torch.zeros(REPLY_ROWS_MAX_BYTES // 128 + 1, dtype=torch.int64))
        assert client.pull_rows(table, torch.tensor([7])).shape == (1, 32)  # the shard serves on


class WithFrozen(nn.Module):
    """A table, a trained head and a frozen layer (kept on the servers: a frozen table of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = psgrad.Embedding(100, 8)
        self.head = nn.Linear(8, 1)
        self.backbone = nn.Linear(4, 4)
        self.backbone.requires_grad_(False)


def test_a_workers_read_from_a_rank_that_never_joined_is_refused_and_every_reader_that_joins_nothing_reads(
        start_servers) -> None:  # type: ignore[no-untyped-def]
    """Before: without --job-secret-file a PullRows (or a read of the frozen table, or of a table's
    updated rows) that named any rank was answered, though that rank never joined: the dense pull
    alone asked. Now a worker's read (not marked observe) from a rank that has not joined the
    shard is refused by name (FAILED_PRECONDITION), while the read-only ones (observe: psgrad
    export, fetch_state_dict, an evaluation after leave), `psgrad status`, and a joiner past
    num_workers (how a running job takes a new worker) read as before. A real server process."""
    (address,) = start_servers(1)
    model = WithFrozen()
    with psgrad.connect([address], optimizer=psgrad.SGD(lr=0.5), client=CLIENT) as ps:
        opt = ps.optimizer(model)
        client, table = opt.client, model.emb.table
        assert table
        model.head(model.emb(torch.tensor([[3, 7]])).sum(1)).sum().backward()
        opt.step()
        ids = torch.tensor([3, 7, 9])
        rows = client.pull_rows(table, ids)  # rank 0 joined: its reads are answered
        block = pb.RowBlock(tables=[table], counts=[3], ids=ids.numpy().tobytes())
        channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        try:
            pull_rows = channel.unary_unary(METHOD_PREFIX + "PullRows", request_serializer=pb.RowsRequest.SerializeToString,
                                            response_deserializer=pb.RowsReply.FromString)
            pull = channel.unary_stream(METHOD_PREFIX + "Pull", request_serializer=pb.PullRequest.SerializeToString,
                                        response_deserializer=pb.PullFrame.FromString)
            reads = {
                "a read of rows": lambda observe: pull_rows(pb.RowsRequest(
                    rank=5, fingerprint=client.fingerprint, block=block, observe=observe), timeout=30),
                "a read of updated rows": lambda observe: pull_rows(pb.RowsRequest(
                    rank=5, fingerprint=client.fingerprint, table=table, updated=True, limit=10, observe=observe),
                    timeout=30),
                "a read of the frozen parameters": lambda observe: list(pull(pb.PullRequest(
                    rank=5, fingerprint=client.fingerprint, table="frozen", observe=observe), timeout=30)),
            }
            for what, read in reads.items():
                with pytest.raises(grpc.RpcError) as refused:
                    read(False)
                assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, what
                assert (f"{what} as worker rank 5 refused: worker rank 5 has not joined this shard"
                        in str(refused.value.details())), refused.value.details()
                read(True)  # the same read marked read-only (observe) joins nothing and is answered
            reply = pull_rows(pb.RowsRequest(rank=5, fingerprint=client.fingerprint, block=block, observe=True),
                              timeout=30)
            assert torch.equal(torch.frombuffer(bytearray(reply.rows), dtype=torch.float32).view(3, 8), rows)
        finally:
            channel.close()
        # A joiner past num_workers (1) joins and reads as any worker.
        joiner = ParameterClient([address], client.spec, client.params, client.plan, 3, CLIENT,
                                 tables=list(client.tables.values()), frozen=client.frozen)
        try:
            joiner.join(initial_weights=None)
            assert torch.equal(joiner.pull_rows(table, ids), rows)
            frozen = torch.empty(sum(p.numel for p in client.frozen))
            joiner.pull_frozen(frozen)
            assert torch.equal(frozen, torch.cat([p.reshape(-1) for p in model.backbone.parameters()]))
        finally:
            joiner.close()
        # The readers that join nothing: the status client (`psgrad status`), fetch_state_dict / export.
        (status,) = shard_status([address], 10)
        assert status.initialized and status.version == 1
        state = psgrad.fetch_state_dict([address])
        assert torch.equal(state["emb.rows"], client.pull_rows(table, state["emb.ids"]))
        assert state["emb.ids"].tolist() == [3, 7]
        assert torch.equal(state["backbone.weight"], model.backbone.weight)
        ps.leave()
        with torch.no_grad():  # a worker that left evaluates: read-only reads
            assert torch.equal(model.emb(ids.view(1, 3))[0], rows)


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = psgrad.Embedding(200_000, 64)  # 256 bytes a row
        self.head = nn.Linear(64, 1)


def transfers(address: str):  # type: ignore[no-untyped-def]
    (status,) = shard_status([address], 10)
    return status.transfers


def test_concurrent_reads_of_rows_hold_at_most_max_read_mb_and_one_larger_than_it_is_refused(start_servers) -> None:  # type: ignore[no-untyped-def]
    """Before: reads were under no bound (--memory-budget-mb counts stored rows, and reads store
    none): 16 concurrent PullRows of 61 MB took one server to 1.5 GB. A real server with
    --max-read-mb 8: 16 concurrent reads of 3 MiB each (at most two fit at once) all get their rows,
    the bytes in flight (the status' gauge, counted until each reply was sent) never passed 8 MiB,
    and a read of 9 MiB is refused naming the flag and the value it needs."""
    (address,) = start_servers(1, "--max-read-mb", "8")
    model = Wide()
    with psgrad.connect([address], optimizer=psgrad.SGD(lr=0.5), client=CLIENT) as ps:
        opt = ps.optimizer(model)
        table, client = model.emb.table, opt.client
        assert table
        for step in range(3):  # a worker's steps (rows read in its Step calls) within the bound as before
            opt.zero_grad()
            model.head(model.emb(torch.tensor([[step, 1000 + step, 7]]))).sum().backward()
            opt.step()
        n = 3 * 2**20 // 256  # 3 MiB of rows a read
        asks = [torch.arange(k, 200_000, 16, dtype=torch.int64)[:n] for k in range(16)]
        expected = [client.pull_rows(table, ids) for ids in asks]  # one at a time
        assert transfers(address).reads_queued == 0
        channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        try:
            call = channel.unary_unary(METHOD_PREFIX + "PullRows", request_serializer=pb.RowsRequest.SerializeToString,
                                       response_deserializer=pb.RowsReply.FromString)

            def request(ids: torch.Tensor) -> pb.RowsRequest:
                return pb.RowsRequest(rank=0, fingerprint=client.fingerprint, observe=True,
                                      block=pb.RowBlock(tables=[table], counts=[ids.numel()], ids=ids.numpy().tobytes()))

            start = threading.Barrier(16)

            def read(k: int) -> None:
                start.wait(30)
                reply = call(request(asks[k]), timeout=60)
                got = torch.frombuffer(bytearray(reply.rows), dtype=torch.float32).view(n, 64)
                assert torch.equal(got, expected[k]), f"read {k} got other rows"

            rounds = 0
            while transfers(address).reads_queued == 0:  # (16 at once wait for their turn, at the latest in a few rounds)
                assert rounds < 10, "16 concurrent reads of 3 MiB never waited for their turn under --max-read-mb 8"
                run_in_threads(16, read)
                rounds += 1
            wait_for("the reads' bytes to be given back", lambda: transfers(address).read_bytes == 0)
            after = transfers(address)
            print(f"{rounds} round(s) of 16 reads: peak {after.read_bytes_peak:,} bytes in flight, "
                  f"{after.reads_queued} reads waited for their turn")
            assert after.read_limit_bytes == 8 * 2**20
            assert n * 256 <= after.read_bytes_peak <= 8 * 2**20  # the bound held
            assert after.reads_queued >= 1 and after.reads_expired == 0 and after.reads_waiting == 0

            with pytest.raises(grpc.RpcError) as refused:  # larger than all of it: refused, whatever is in flight
                call(request(torch.arange(0, 9 * 2**20 // 256, dtype=torch.int64)), timeout=60)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            details = str(refused.value.details())
            assert "a read of 36,864 rows would make a reply of 9,437,184 bytes (9.0 MiB), more than the 8.0 MiB this " \
                   "server lets the replies to reads hold at once (--max-read-mb 8)" in details, details
            assert "start the servers with --max-read-mb 9 or more" in details
        finally:
            channel.close()
        assert transfers(address).reads_refused == 1
        with pytest.raises(InvalidRequestError, match="--max-read-mb 9 or more"):  # a worker's read, through the client
            client.pull_rows(table, torch.arange(0, 9 * 2**20 // 256, dtype=torch.int64))
        # an export reads its pages within the bound (pages of at most 8 MiB), and training goes on
        ids, rows = client.updated_rows(table)
        assert ids.tolist() == [0, 1, 2, 7, 1000, 1001, 1002]
        assert torch.equal(rows, client.pull_rows(table, ids))
        opt.zero_grad()
        model.head(model.emb(torch.tensor([[5]]))).sum().backward()
        opt.step()


class Dense(nn.Module):
    def __init__(self, inputs: int) -> None:
        super().__init__()
        self.fc = nn.Linear(inputs, 768, bias=False)  # inputs x 3 KiB of weights


def test_concurrent_pulls_of_the_weights_hold_at_most_max_read_mb_and_a_shard_larger_than_it_goes_alone(start_servers) -> None:  # type: ignore[no-untyped-def]
    """Before: a dense reply (a Pull's frames, a Step's reply with the weights, which exists about
    three times over as it is built and sent) was under no bound, only reads of rows were. Real
    servers with --max-read-mb 8: 16 concurrent pulls of 3 MiB of weights through gRPC (at most two
    fit at once) all get the weights, the bytes in flight never passed 8 MiB; a shard of 9 MiB of
    weights (no call can ask for less of them) trains, each reply with its weights going alone, so
    four pulls of it at once hold 9 MiB at most, and none is refused."""
    small, large = start_servers(2, "--max-read-mb", "8")
    model = Dense(1024)  # 3 MiB of weights
    with psgrad.connect([small], optimizer=psgrad.SGD(lr=0.5), client=CLIENT) as ps:
        opt = ps.optimizer(model)
        client = opt.client
        for step in range(3):  # a worker's steps (the weights in each Step's reply) within the bound
            opt.zero_grad()
            model.fc(torch.full((1, 1024), float(step))).sum().backward()
            opt.step()
        after_steps = transfers(small)
        assert 3 * 2**20 <= after_steps.read_bytes_peak <= 8 * 2**20  # (the Step replies were counted)
        expected = torch.empty(client.plan.total)
        client.pull(expected, opt.clock, observe=True)
        assert torch.equal(expected, model.fc.weight.detach().reshape(-1))
        readers = [ParameterClient([small], client.spec, client.params, client.plan, 0, CLIENT) for _ in range(16)]
        try:
            start = threading.Barrier(16)

            def read(k: int) -> None:
                flat = torch.empty(client.plan.total)
                start.wait(30)
                readers[k].pull(flat, 0, observe=True)
                assert torch.equal(flat, expected), f"pull {k} got other weights"

            rounds = 0
            while transfers(small).reads_queued == 0:  # (16 at once wait for their turn, at the latest in a few rounds)
                assert rounds < 10, "16 concurrent pulls of 3 MiB never waited for their turn under --max-read-mb 8"
                run_in_threads(16, read)
                rounds += 1
        finally:
            for r in readers:
                r.close()
        wait_for("the pulls' bytes to be given back", lambda: transfers(small).read_bytes == 0)
        after = transfers(small)
        print(f"{rounds} round(s) of 16 pulls: peak {after.read_bytes_peak:,} bytes in flight, "
              f"{after.reads_queued} pulls waited for their turn")
        assert after.read_limit_bytes == 8 * 2**20
        assert 3 * 2**20 <= after.read_bytes_peak <= 8 * 2**20  # the bound held
        assert after.reads_queued >= 1 and after.reads_expired == 0 and after.reads_waiting == 0
        opt.zero_grad()  # and training goes on
        model.fc(torch.ones(1, 1024)).sum().backward()
        opt.step()

    # A shard whose weights alone pass the bound (9 MiB under 8): no call can ask for less of them, so
    # each reply with them goes alone, once nothing else is in flight; the job trains, and pulls of
    # it at once take turns (the peak is one reply's).
    big = Dense(3072)
    with psgrad.connect([large], optimizer=psgrad.SGD(lr=0.5), client=CLIENT) as ps:
        opt = ps.optimizer(big)
        for step in range(2):
            opt.zero_grad()
            big.fc(torch.full((1, 3072), float(step + 1))).sum().backward()
            opt.step()
        client = opt.client
        want = torch.empty(client.plan.total)
        client.pull(want, opt.clock, observe=True)
        assert torch.equal(want, big.fc.weight.detach().reshape(-1))
        readers = [ParameterClient([large], client.spec, client.params, client.plan, 0, CLIENT) for _ in range(4)]
        try:
            def read_big(k: int) -> None:
                flat = torch.empty(client.plan.total)
                readers[k].pull(flat, 0, observe=True)
                assert torch.equal(flat, want), f"pull {k} got other weights"

            run_in_threads(4, read_big)
        finally:
            for r in readers:
                r.close()
    wait_for("the big pulls' bytes to be given back", lambda: transfers(large).read_bytes == 0)
    after = transfers(large)
    assert after.read_bytes_peak == 9 * 2**20 and after.reads_refused == 0 and after.reads_expired == 0


class FrozenBackbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(1024, 3072, bias=False)  # 12 MiB, frozen: kept on the servers
        self.backbone.requires_grad_(False)
        self.head = nn.Linear(3072, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def test_pulls_of_the_frozen_parameters_hold_at_most_max_read_mb(start_servers) -> None:  # type: ignore[no-untyped-def]
    """Before: a read of the frozen table (a worker's at join, and each time the values moved) was
    under no bound: its copy and its frames held its whole range outside --max-read-mb. A real
    server with --max-read-mb 8 holding a 12 MiB frozen backbone: the worker joins and trains;
    4 concurrent reads of the range (no call can ask for less of it) go alone, one after another,
    all get the values, and the bytes in flight never passed one range's."""
    (address,) = start_servers(1, "--max-read-mb", "8")
    model = FrozenBackbone()
    with psgrad.connect([address], optimizer=psgrad.SGD(lr=0.5), client=CLIENT) as ps:
        opt = ps.optimizer(model)  # (the chief's values go to the server; it reads them back as it joins)
        opt.zero_grad()
        model(torch.ones(1, 1024)).sum().backward()
        opt.step()
        client = opt.client
        assert transfers(address).read_bytes_peak >= 12 * 2**20  # (the join's read was counted)
        want = model.backbone.weight.detach().reshape(-1).clone()
        start = threading.Barrier(4)

        def read(k: int) -> None:  # (4 calls at once on the worker's channel)
            dest = torch.empty(want.numel())
            start.wait(30)
            client.pull_frozen(dest, observe=True)
            assert torch.equal(dest, want), f"read {k} got other values"

        run_in_threads(4, read)
        wait_for("the reads' bytes to be given back", lambda: transfers(address).read_bytes == 0)
        after = transfers(address)
        assert after.read_bytes_peak == 12 * 2**20, after  # one range at a time: it goes alone
        assert after.reads_refused == 0 and after.reads_expired == 0
        opt.zero_grad()  # and training goes on
        model(torch.ones(1, 1024)).sum().backward()
        opt.step()
