"""Pure tests of psgrad.wire.serde: proto <-> Python conversions, and the status JSON they feed."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from psgrad.wire import serde
from psgrad.config import JobSpec
from psgrad.proto import ps_pb2 as pb
from psgrad.core.push_outcome import PushOutcome
from psgrad.core.sharding import ParamSpec
from psgrad.core.status import ShardStatus, TableStatus, TransferStatus, WorkerStatus

pytestmark = pytest.mark.timeout(60)

# Every field differs from its default in one of these specs (the optimizer settings each in a spec
# of an optimizer that reads it), so a dropped or swapped field cannot go unnoticed.
SPEC = JobSpec(
    mode="ssp",
    staleness=3,
    num_workers=4,
    optimizer="sgd",
    lr=0.05,
    momentum=0.9,
    weight_decay=1e-4,
    wire_dtype="bfloat16",
    num_shards=2,
    staleness_lr=True,
    nesterov=True,
)
OTHER_SPECS = [
    JobSpec(optimizer="adam", beta1=0.8, beta2=0.95, eps=1e-6),
    JobSpec(optimizer="adagrad", lr_decay=0.01, initial_accumulator_value=0.25, eps=1e-10),
    JobSpec(optimizer="rmsprop", alpha=0.0, centered=True, momentum=0.5),  # alpha 0.0: proto3's default value
    JobSpec(optimizer="adadelta", lr=1.0, rho=0.0, eps=1e-6),
    JobSpec(dc_asgd=0.5, dc_asgd_adaptive=True),
    JobSpec(optimizer="sgd", mode="sync", num_workers=3, backup_workers=1, tables_mode="async"),
    JobSpec(optimizer="sgd", mode="ssp", wire_dtype="float16", staleness_max=5),
    JobSpec(optimizer="sgd", compress="topk:0.01", error_feedback=False),
]


def _through_wire(msg):  # type: ignore[no-untyped-def]
    return type(msg).FromString(msg.SerializeToString())


def test_the_specs_set_every_field() -> None:
    default = JobSpec()
    unset = {f.name for f in dataclasses.fields(JobSpec)}
    for spec in (SPEC, *OTHER_SPECS):
        unset -= {name for name, _, _ in default.differences(spec)}
    assert not unset


@pytest.mark.parametrize("spec", [SPEC, *OTHER_SPECS], ids=lambda s: s.optimizer)
def test_job_spec_round_trip(spec: JobSpec) -> None:
    msg = serde.job_spec_to_proto(spec)
    assert isinstance(msg, pb.JobSpec)
    for f in dataclasses.fields(JobSpec):
        if f.name == "error_feedback":  # on the wire as no_error_feedback (proto3's absent false: on)
            assert msg.no_error_feedback == (not spec.error_feedback)
            continue
        assert getattr(msg, f.name) == getattr(spec, f.name), f.name
    back = serde.job_spec_from_proto(_through_wire(msg))
    assert back == spec
    assert back.differences(spec) == []


def test_job_spec_round_trip_defaults() -> None:
    assert serde.job_spec_from_proto(_through_wire(serde.job_spec_to_proto(JobSpec()))) == JobSpec()


@pytest.mark.parametrize(
    "spec",
    [
        JobSpec(optimizer="adam", lr=1e-3, beta1=0.0, beta2=0.0, eps=1e-12, weight_decay=0.1),
        JobSpec(optimizer="adamw", beta1=0.999999, beta2=0.5, eps=3.0),
    ],
    ids=["adam-zero-betas", "adamw"],
)
def test_job_spec_round_trip_adam(spec: JobSpec) -> None:
    # beta 0.0 is proto3's default value: it must still arrive as 0.0, not as psgrad's default 0.9.
    assert serde.job_spec_from_proto(_through_wire(serde.job_spec_to_proto(spec))) == spec


def test_job_spec_absent_adam_fields_mean_the_defaults() -> None:
    # A sender built from an older ps.proto (no fields 11-13) gets psgrad's defaults, not zeros.
    msg = pb.JobSpec(mode="async", num_workers=1, optimizer="adam", lr=1e-3, wire_dtype="float32", num_shards=1)
    assert not msg.HasField("eps")
    spec = serde.job_spec_from_proto(_through_wire(msg))
    assert (spec.beta1, spec.beta2, spec.eps) == (0.9, 0.999, 1e-8)
    assert spec == JobSpec(optimizer="adam", lr=1e-3)


def test_job_spec_proto_is_what_the_contract_says() -> None:
    # A hand-built proto (as another language's client would send) decodes to the same spec.
    msg = pb.JobSpec(
        mode="ssp", staleness=3, num_workers=4, optimizer="sgd", lr=0.05, momentum=0.9,
        weight_decay=1e-4, wire_dtype="bfloat16", num_shards=2, staleness_lr=True, nesterov=True,
    )
    assert serde.job_spec_from_proto(msg) == SPEC
    msg = pb.JobSpec(mode="async", num_workers=1, optimizer="rmsprop", lr=0.1, wire_dtype="float32", num_shards=1,
                     centered=True)
    assert not msg.HasField("alpha")  # absent: psgrad's (torch's) 0.99, not proto3's 0
    assert serde.job_spec_from_proto(msg) == JobSpec(optimizer="rmsprop", centered=True)


PARAMS = [
    ParamSpec("scale", (), "float32"),
    ParamSpec("emb.weight", (50_000, 512), "float32"),
    ParamSpec("conv.weight", (8, 3, 5, 5), "float16"),
    ParamSpec("huge", (2**40,), "bfloat16"),  # int64 shape entries
    ParamSpec("bn.num_batches_tracked", (), "int64", buffer=True),
]


@pytest.mark.parametrize(
    "outcome",
    [
        PushOutcome(applied=True, version=7, staleness=2, lr=0.05, staleness_bound=3),
        PushOutcome(applied=True, lr=0.0),  # lr 0.0 said (proto3's default value) is not lr left out
        PushOutcome(applied=False, reason="late: iteration 4 is complete"),
        PushOutcome(applied=False, deferred=True, version=1),
    ],
)
def test_push_outcome_round_trip(outcome: PushOutcome) -> None:
    assert serde.push_outcome_from_proto(_through_wire(serde.push_outcome_to_proto(outcome))) == outcome


def test_push_outcome_from_proto_reads_every_field() -> None:
    fields = {f.name for f in pb.PushReply.DESCRIPTOR.fields}
    assert fields == {f.name for f in dataclasses.fields(PushOutcome)}
    outcome = serde.push_outcome_from_proto(pb.PushReply(applied=True, deferred=True, reason="r", version=3, staleness=1))
    assert (outcome.lr, outcome.accepted, outcome.late) == (None, True, False)
    assert serde.push_outcome_from_proto(pb.PushReply(reason="late: 2")).late


def test_params_round_trip() -> None:
    msgs = serde.params_to_proto(PARAMS)
    assert [m.name for m in msgs] == [p.name for p in PARAMS]
    assert list(msgs[2].shape) == [8, 3, 5, 5]
    request = pb.JoinRequest(params=msgs)
    back = serde.params_from_proto(_through_wire(request).params)
    assert back == PARAMS
    assert all(isinstance(p.shape, tuple) for p in back)
    assert serde.params_from_proto([]) == []


@pytest.mark.parametrize("index, start, end", [(0, 0, 10), (3, 123, 456), (7, 2**33, 2**34 + 5)])
def test_shard_range_round_trip(index: int, start: int, end: int) -> None:
    msg = serde.shard_range_to_proto(index, start, end)
    assert (msg.index, msg.start, msg.end) == (index, start, end)
    assert serde.shard_range_from_proto(_through_wire(msg)) == (index, start, end)


def _status_reply(initialized: bool = True) -> pb.StatusReply:
    reply = pb.StatusReply(
        initialized=initialized,
        version=7,
        pushes_applied=10,
        pushes_duplicate=2,
        pushes_rejected=1,
        pulls=12,
        evictions=3,
        pending=2,
        bytes_in=4000,
        bytes_out=4800,
        uptime_s=12.34567,
        workers=[
            pb.WorkerStatus(rank=0, clock=5, state="live", last_seen_s=0.12345, pushes=5),
            pb.WorkerStatus(rank=1, clock=4, state="evicted", last_seen_s=30.0, pushes=4),
        ],
        staleness=[
            pb.StalenessBucket(staleness=0, count=5),
            pb.StalenessBucket(staleness=2, count=3),
            pb.StalenessBucket(staleness=1, count=2),
        ],
    )
    if initialized:
        reply.shard.CopyFrom(pb.ShardRange(index=1, start=10, end=30))
        reply.spec.CopyFrom(serde.job_spec_to_proto(SPEC))
        reply.fingerprint = "abc123"
    return _through_wire(reply)


def test_status_to_dict() -> None:
    d = serde.status_from_proto(_status_reply()).to_dict()
    assert d["initialized"] is True
    assert d["shard"] == 1
    assert d["range"] == [10, 30]
    assert d["numel"] == 20
    assert d["version"] == 7
    assert (d["pushes_applied"], d["pushes_duplicate"], d["pushes_rejected"]) == (10, 2, 1)
    assert (d["pulls"], d["bytes_in"], d["bytes_out"]) == (12, 4000, 4800)
    assert (d["evictions"], d["pending"]) == (3, 2)
    assert d["uptime_s"] == pytest.approx(12.346)
    assert d["fingerprint"] == "abc123"
    assert d["spec"] == SPEC.as_dict()
    assert d["workers"] == [
        {"rank": 0, "clock": 5, "state": "live", "last_seen_s": 0.123, "pushes": 5},
        {"rank": 1, "clock": 4, "state": "evicted", "last_seen_s": 30.0, "pushes": 4},
    ]
    # Histogram {0: 5, 1: 2, 2: 3}: 10 pushes, max staleness 2, mean (0*5 + 1*2 + 2*3) / 10 = 0.8.
    assert d["staleness"]["histogram"] == {0: 5, 1: 2, 2: 3}
    assert d["staleness"]["max"] == 2
    assert d["staleness"]["mean"] == pytest.approx(0.8)
    json.dumps(d)  # JSON-ready


def test_status_to_dict_uninitialized_and_empty() -> None:
    d = serde.status_from_proto(_through_wire(pb.StatusReply())).to_dict()
    assert d["initialized"] is False
    assert d["spec"] is None
    assert d["workers"] == []
    assert d["staleness"] == {"histogram": {}, "max": 0, "mean": 0.0}
    json.dumps(d)


def test_status_to_dict_single_bucket() -> None:
    reply = pb.StatusReply(staleness=[pb.StalenessBucket(staleness=4, count=6)])
    s = serde.status_from_proto(reply).to_dict()["staleness"]
    assert s == {"histogram": {4: 6}, "max": 4, "mean": 4.0}


def _status(initialized: bool = True) -> ShardStatus:
    return ShardStatus(
        initialized=initialized,
        index=1 if initialized else 0,
        start=10 if initialized else 0,
        end=26 if initialized else 0,
        fingerprint="fp" if initialized else "",
        spec=SPEC if initialized else None,
        version=7,
        pushes_applied=8,
        pushes_duplicate=2,
        pushes_rejected=1,
        pulls=9,
        bytes_in=1000,
        bytes_out=2000,
        evictions=3,
        updates_lost=6,
        pending=1,
        waiting=2,
        uptime_s=12.5,
        workers=(WorkerStatus(0, 5, "live", 0.25, 5), WorkerStatus(3, 2, "evicted", 11.0, 2)),
        staleness={0: 4, 3: 2},
        transfers=TransferStatus(1, 2, 3, True, 4, 5),
        params=(ParamSpec("fc.weight", (4, 3), "float32"), ParamSpec("fc.bias", (4,), "bfloat16")) if initialized else (),
        tables=(TableStatus("dense", "dense", 16, 64, 64), TableStatus("emb", "sparse", 96, 384, 384, 500, 3))
        if initialized else (),
    )


@pytest.mark.parametrize("initialized", [True, False])
def test_shard_status_round_trip(initialized: bool) -> None:
    status = _status(initialized)
    assert serde.status_from_proto(_through_wire(serde.status_to_proto(status))) == status


def test_shard_status_round_trip_default() -> None:
    assert serde.status_from_proto(_through_wire(serde.status_to_proto(ShardStatus(False)))) == ShardStatus(False)


def test_status_json_is_the_typed_status_as_dict() -> None:
    d = _status().to_dict()
    assert d["shard"] == 1 and d["range"] == [10, 26] and d["numel"] == 16
    assert d["workers"][1] == {"rank": 3, "clock": 2, "state": "evicted", "last_seen_s": 11.0, "pushes": 2}
    assert d["staleness"] == {"histogram": {0: 4, 3: 2}, "max": 3, "mean": pytest.approx(6 / 6)}
    assert d["transfers"]["waiting_for_buffer"] == 5 and d["transfers"]["staged_updates"] is True
    assert d == serde.status_from_proto(serde.status_to_proto(_status())).to_dict()
    json.dumps(d)


def test_a_push_head_travels_as_the_message_built_with_its_rows() -> None:
    # PushHead writes the rows' bytes straight into the call (copied once, by the join); what goes
    # out must parse as the PushHeader (and PushFrame, StepRequest) that protobuf would have built.
    import torch

    from psgrad.client.transport import step_request
    from psgrad.core.codecs import WireBuffer
    from psgrad.errors import InvalidRequestError
    from psgrad.wire.frames import DETACHED_KEY, PushHead
    from psgrad.wire.rows import RowBlock

    g = torch.Generator().manual_seed(0)
    wide = torch.randn(6, 5, generator=g).t()  # [5, 6], not contiguous: sent as its values in row order
    narrow = torch.randn(3, 4, generator=g)
    rows = RowBlock.of([("a", torch.tensor([2, 9, 40])), ("b", torch.arange(5) * 3),
                        ("empty", torch.empty(0, dtype=torch.int64))],
                       [narrow, wide, torch.empty(0, 8)], [7, 0, 3])
    head = PushHead(pb.PushHeader(rank=3, clock=11, base_version=4, numel=6, dtype="float32", fingerprint="fp",
                                  lr=0.5, compress="int8"), rows)
    whole = head.message()
    block = whole.row_block
    assert list(block.tables) == ["a", "b", "empty"] and list(block.counts) == [3, 5, 0]
    assert list(block.widths) == [4, 6, 8] and list(block.base_versions) == [7, 0, 3]
    grads = torch.frombuffer(bytearray(block.grads), dtype=torch.float32)
    assert torch.equal(grads[:12].view(3, 4), narrow) and torch.equal(grads[12:].view(5, 6), wide)
    assert pb.PushFrame.FromString(head.frame()) == pb.PushFrame(header=whole)
    parsed = RowBlock.from_proto(block, "push", push=True)  # what the server reads: each table a view
    updates = parsed.updates()
    assert list(updates) == ["a", "b"] and updates["b"][2] == 0 and torch.equal(updates["b"][1], wide)
    assert updates.flat(["a", "b"]) is None  # (two widths: no one tensor of them)
    reads = RowBlock.of([("a", torch.tensor([1, 2])), ("b", torch.tensor([0]))])
    payload = memoryview(bytes(range(24)))
    request = pb.StepRequest.FromString(head.step_request(step_request(reads, WireBuffer(6, "float32")), payload))
    assert request == pb.StepRequest(push=whole, read_block=reads.message(), data=bytes(payload))
    in_segment = pb.StepRequest.FromString(head.step_request(step_request(reads, WireBuffer(6, "float32")), None))
    assert in_segment == pb.StepRequest(push=whole, read_block=reads.message()) and not in_segment.data
    assert [(t, i.tolist()) for t, i in RowBlock.from_proto(request.read_block, "step").lookups()] == \
        [("a", [1, 2]), ("b", [0])]
    # Over a server's socket the gradients go first, beside the message, which holds none of them;
    # the server's block from the two is the same, its gradients a view of the bytes that came.
    pieces, metadata = head.step_socket_request(step_request(reads, WireBuffer(6, "float32")), payload)
    body = bytearray(b"".join(pieces))
    (key, count), = metadata
    assert key == DETACHED_KEY and int(count) == 4 * (12 + 30) == len(pieces[0])
    beside = pb.StepRequest.FromString(memoryview(body)[int(count):])
    assert not beside.push.row_block.grads and beside.push.row_block.ids == block.ids
    beside.push.row_block.grads = block.grads
    assert beside == request
    arrived = memoryview(body)[: int(count)]
    message = pb.StepRequest.FromString(memoryview(body)[int(count):]).push.row_block
    rebuilt = RowBlock.from_proto(message, "push", push=True, grads=arrived)
    assert torch.equal(rebuilt.grads, parsed.grads) and rebuilt.grads.data_ptr() == torch.frombuffer(body, dtype=torch.uint8).data_ptr()
    with pytest.raises(InvalidRequestError, match="both in the message and beside it"):
        RowBlock.from_proto(block, "push", push=True, grads=arrived)
    with pytest.raises(InvalidRequestError, match="17 gradient values"):
        RowBlock.from_proto(message, "push", push=True, grads=arrived[:-100])
    no_rows = PushHead(pb.PushHeader(rank=3, clock=11))  # (nothing to put beside: the plain request)
    assert no_rows.step_socket_request(pb.StepRequest(), None) == (no_rows.step_request_pieces(pb.StepRequest(), None), ())


def test_gradients_beside_a_push_without_rows_are_refused() -> None:
    from psgrad.errors import InvalidRequestError
    from psgrad.server.servicer import _row_gradients

    with pytest.raises(InvalidRequestError, match="8 bytes of row gradients for a push that carries no rows"):
        _row_gradients(pb.PushHeader(rank=1), "push from worker rank 1", memoryview(bytes(8)))
    assert _row_gradients(pb.PushHeader(rank=1), "push from worker rank 1") is None


def test_a_push_block_hands_its_tables_rows_over_whole_only_in_its_own_order() -> None:
    import torch

    from psgrad.wire.rows import RowBlock

    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(2, 3, generator=g), torch.randn(0, 3), torch.randn(4, 3, generator=g)]
    msg = RowBlock.of([("a", torch.tensor([1, 5])), ("none", torch.empty(0, dtype=torch.int64)),
                       ("b", torch.tensor([0, 2, 4, 6]))], grads, [3, 0, 9]).message()
    updates = RowBlock.from_proto(pb.RowBlock.FromString(msg.SerializeToString()), "push", push=True).updates()
    assert list(updates) == ["a", "b"] and [updates[t][2] for t in updates] == [3, 9]
    whole = updates.flat(["a", "b"])
    assert whole is not None and whole[0].tolist() == [1, 5, 0, 2, 4, 6]
    assert torch.equal(whole[1], torch.cat([grads[0], grads[2]]))
    assert whole[1].data_ptr() == updates["a"][1].data_ptr()  # the block itself, not a copy
    assert updates.flat(["b", "a"]) is None and updates.flat(["a"]) is None


@pytest.mark.parametrize("change, refusal", [
    (lambda m: m.counts.append(1), "2 counts of row ids for 1 tables"),
    (lambda m: (m.tables.append("a"), m.counts.append(0)), "rows of table 'a' twice"),
    (lambda m: setattr(m, "ids", m.ids[:-8]), "1 row ids for counts summing to 2"),
    (lambda m: m.widths.append(2), "2 row widths and 1 base versions for 1 tables"),
    (lambda m: setattr(m, "grads", m.grads[:-4]), "7 gradient values for row ids and widths that make 8"),
    (lambda m: setattr(m, "ids", m.ids[:-3]), "13 bytes is not a whole number"),
    # rows of width 0 and no gradients (0 values make 2 x 0): a crash in reshaping them before
    (lambda m: (m.widths.__setitem__(0, 0), setattr(m, "grads", b"")), "table 'a' has rows of width 0"),
])
def test_a_row_block_whose_parts_disagree_is_refused_by_name(change: Any, refusal: str) -> None:
    import torch

    from psgrad.errors import InvalidRequestError
    from psgrad.wire.rows import RowBlock

    msg = RowBlock.of([("a", torch.tensor([4, 8]))], [torch.ones(2, 4)], [1]).message()
    assert RowBlock.from_proto(msg, "push", push=True).updates()["a"][1].shape == (2, 4)
    change(msg)
    with pytest.raises(InvalidRequestError, match=refusal):
        RowBlock.from_proto(msg, "push", push=True)


def test_a_tables_aliases_reach_the_servers_standbys_and_checkpoints_without_changing_the_job() -> None:
    """A table registered under several names in the model (a two-tower model's shared items) names
    them to the servers, which tell an export (StatusReply's table specs) to write its entries
    under each; they are names, not what the job is: the fingerprint and the layouts' comparison
    leave them out, and a checkpoint writes them only where a table has some."""
    from psgrad.core.layout import Layout
    from psgrad.core.sharding import TableSpec, fingerprint
    from psgrad.server import checkpoint

    shared = TableSpec("user_items", 20, 4, aliases=("cand_items",))
    plain = TableSpec("user_items", 20, 4)
    assert serde.tables_from_proto(serde.tables_to_proto([shared])) == [shared]
    assert serde.tables_from_proto(serde.tables_to_proto([shared]))[0].aliases == ("cand_items",)
    assert shared == plain and fingerprint([], SPEC, [shared]) == fingerprint([], SPEC, [plain])
    layout = Layout(SPEC, (), 0, 0, 0, "f", tables=(shared, TableSpec("b", 5, 2)))
    as_json = checkpoint._layout_to_json(layout)
    assert [("aliases" in t) for t in as_json["tables"]] == [True, False]
    assert checkpoint._layout_from_json(json.loads(json.dumps(as_json))).tables[0].aliases == ("cand_items",)


def test_a_tables_drawn_as_reaches_the_servers_standbys_and_checkpoints_and_its_rows_are_drawn_under_it() -> None:
    """TableSpec.drawn_as (a loaded state's name for its rows, where the chief's model loaded it
    under another prefix) travels in the Join/Init and the servers' status, and a checkpoint (and a
    standby's snapshot, the same encoding) keeps it; the shard draws the table's initial rows under
    it, grouped with another table of its width or not, and so does one restored from a snapshot.
    Like aliases it is not what the job is: left out of the comparison and the fingerprint (only
    the chief loads the state)."""
    import dataclasses

    import torch

    from psgrad.config import ServerConfig
    from psgrad.core import rows
    from psgrad.core.sharding import TableSpec, fingerprint
    from psgrad.server import checkpoint
    from psgrad.server.shard import Shard
    from test_shard import make_layout, weights_for

    renamed = TableSpec("inner.emb", 20, 4, seed=3, std=0.5, drawn_as="emb")
    plain = TableSpec("inner.emb", 20, 4, seed=3, std=0.5)
    assert TableSpec("emb", 20, 4, drawn_as="emb").drawn_as == ""  # (its own name: nothing to say)
    assert serde.tables_from_proto(serde.tables_to_proto([renamed]))[0].drawn_as == "emb"
    assert renamed == plain and fingerprint([], SPEC, [renamed]) == fingerprint([], SPEC, [plain])
    layout = dataclasses.replace(make_layout(JobSpec(lr=0.1, num_shards=1, num_workers=1)),
                                 tables=(renamed, TableSpec("other", 7, 4, seed=3, std=0.5), TableSpec("alone", 9, 2)))
    as_json = checkpoint._layout_to_json(layout)
    assert [("drawn_as" in t) for t in as_json["tables"]] == [True, False, False]
    assert checkpoint._layout_from_json(json.loads(json.dumps(as_json))).tables[0].drawn_as == "emb"
    ids = torch.arange(20)
    drawn = rows.initial_rows(rows.table_key(3, "emb"), ids, 4, 0.5)
    assert not torch.equal(drawn, rows.initial_rows(rows.table_key(3, "inner.emb"), ids, 4, 0.5))
    shard = Shard(ServerConfig())
    shard.initialize(0, layout, weights_for(layout))
    restored = Shard(ServerConfig())
    restored.restore(checkpoint.decode(*checkpoint.encode(shard.snapshot())))
    for s in (shard, restored):
        tables = s.core.state.tables
        assert torch.equal(tables["inner.emb"].rows(ids), drawn)
        assert torch.equal(tables["other"].rows(torch.arange(7)),
                           rows.initial_rows(rows.table_key(3, "other"), torch.arange(7), 4, 0.5))
