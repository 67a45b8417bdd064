"""The wire fuzzed: malformed frames, headers and metadata sent to a mutual-TLS + token server by a
caller holding a valid credential; every reply must be a clear error, and the shard unchanged and
still serving.

Settings: derandomized with PSGRAD_FUZZ_EXAMPLES cases (default 300) in CI. A longer, random run
(new cases each time; hypothesis keeps failures in .hypothesis/ and replays them first):

    PSGRAD_FUZZ_PROFILE=nightly PSGRAD_FUZZ_EXAMPLES=20000 python -m pytest -q -s tests/integration/test_fuzz_wire.py
"""
from __future__ import annotations

import collections
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from psgrad.client.parameter_client import ParameterClient
from psgrad.config import AuthConfig, ClientConfig, JobSpec, ServerConfig, TlsConfig
from psgrad.core.credentials import derive_token
from psgrad.core.sharding import ParamSpec, plan_shards
from psgrad.launch.certs import write_job_certs
from psgrad.proto import ps_pb2 as pb
from psgrad.server.runtime import RunningServer, start_server
from psgrad.wire import shm
from psgrad.wire.protocol import CLIENT_CHANNEL_OPTIONS, METHOD_PREFIX
from psgrad.wire.security import open_channel

EXAMPLES = int(os.environ.get("PSGRAD_FUZZ_EXAMPLES", "300"))
NIGHTLY = os.environ.get("PSGRAD_FUZZ_PROFILE") == "nightly"
pytestmark = pytest.mark.timeout(120 if not NIGHTLY else 24 * 3600)

NUMEL = 3000
SPEC = JobSpec(mode="async", num_workers=2, num_shards=1, lr=0.1)
PARAMS = [ParamSpec("w", (NUMEL,), "float32")]
SECRET = b"fuzzing-secret-0123456789abcdef"
# What a malformed call may get: a status that names the problem (never INTERNAL or UNKNOWN).
CLEAR = {"INVALID_ARGUMENT", "FAILED_PRECONDITION", "PERMISSION_DENIED", "UNAUTHENTICATED", "OUT_OF_RANGE"}
UNKNOWN_FIELD = b"\xf8\x07\x01"  # field 127 (varint) = 1: no message of ps.proto has it


@dataclass
class Target:
    server: RunningServer
    channel: grpc.Channel  # worker 0's certificate; the token goes in each call's metadata
    fingerprint: str
    chief: ParameterClient
    seen: collections.Counter[str] = field(default_factory=collections.Counter)

    def state(self) -> tuple[Any, ...]:
        st = self.server.shard.status()
        weights = self.server.shard.weights_copy()
        assert weights is not None
        digest = hashlib.sha256(weights.numpy().tobytes()).hexdigest()
        return st.version, digest, tuple((w.rank, w.clock, w.state, w.pushes) for w in st.workers)

    @property
    def clock(self) -> int:  # worker 0's next clock, as the shard sees it
        return next(w.clock for w in self.server.shard.status().workers if w.rank == 0)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    files = write_job_certs(tmp_path_factory.mktemp("fuzz") / "tls", 2)
    cert, key = files.pair("server")
    server = start_server(ServerConfig(port=0, threads=8, lease_s=600, tls=TlsConfig(cert=str(cert), key=str(key),
                                                                                    ca=str(files.ca)),
                                       auth=AuthConfig(secret=SECRET)))
    w0 = TlsConfig(ca=str(files.ca), cert=str(files.pair("worker-0")[0]), key=str(files.pair("worker-0")[1]))
    chief = ParameterClient([server.address], SPEC, PARAMS, plan_shards(PARAMS, 1), 0,
                            ClientConfig(tls=w0, auth=AuthConfig(secret=SECRET), shared_memory=False))
    try:
        clock = chief.join(initial_weights=lambda: torch.linspace(-1, 1, NUMEL))
        flat = torch.empty(NUMEL)
        for k in range(3):
            chief.exchange(torch.full((NUMEL,), 0.01), clock + k, flat)
        channel = open_channel(server.address, w0, None, CLIENT_CHANNEL_OPTIONS)
        yield Target(server, channel, chief.fingerprint, chief)
    finally:
        chief.close()
        server.stop(0)


# --------------------------------------------------------------------------- malformed calls
ascii_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=60)
garbage = st.binary(max_size=300)


@st.composite
def push_case(draw: st.DrawFn) -> dict[str, Any]:
    """A push, Step or gated push from worker 0 with one to three defects, each enough to refuse it."""
    defects = draw(st.lists(st.sampled_from([
        "numel", "dtype", "truncated", "overlong", "garbage_frame", "garbage_header", "data_first", "empty",
        "fingerprint", "future_base", "forged_clock", "other_rank", "nonfinite", "shm_metadata", "huge_numel",
    ]), min_size=1, max_size=3, unique=True))
    return {"kind": draw(st.sampled_from(["Push", "PushGated", "Step"])), "defects": defects,
            "unknown_fields": draw(st.booleans()), "numel": draw(st.sampled_from([0, NUMEL - 1, NUMEL + 1, 2 * NUMEL])),
            "dtype": draw(st.sampled_from(["float64", "int8", "", "bfloat17"]) | ascii_text),
            "cut": draw(st.integers(0, 4 * NUMEL - 1)), "extra": draw(st.integers(1, 5000)),
            "garbage": draw(garbage), "fingerprint": draw(ascii_text), "ahead": draw(st.integers(1, 2**62)),
            "rank": draw(st.sampled_from([1, 2, 7, 2**31])), "shm": draw(ascii_text),
            "huge": draw(st.sampled_from([2**31, 2**40, 2**63 - 1]))}


@st.composite
def other_case(draw: st.DrawFn) -> dict[str, Any]:
    """Init, Join, Pull, Heartbeat, Leave, Rollback and replication calls that must be refused, and
    garbage or forged credentials in the metadata."""
    kind = draw(st.sampled_from(["Init", "Join", "Pull", "Heartbeat", "Leave", "Rollback", "Replica", "Token",
                                 "Garbage"]))
    return {"kind": kind, "garbage": draw(garbage), "start": draw(st.integers(0, 2**40)),
            "end": draw(st.integers(0, 2**40)), "index": draw(st.integers(1, 2**31)), "rank": draw(st.integers(1, 2**31)),
            "token": draw(ascii_text | st.sampled_from(["Bearer ", "Bearer psgrad1:worker-0:00", "psgrad1:admin:zz"])),
            "method": draw(st.sampled_from(["Join", "Init", "Push", "PushGated", "Step", "Pull", "ReplicaApply"])),
            "version": draw(st.integers(1, 2**62)), "numel": draw(st.integers(0, 2**40))}


def _header(t: Target, case: dict[str, Any]) -> pb.PushHeader:
    d = case["defects"]
    return pb.PushHeader(
        rank=case["rank"] if "other_rank" in d else 0,
        clock=t.clock + case["ahead"] if "forged_clock" in d else t.clock,
        base_version=t.server.shard.version + 10**6 if "future_base" in d else t.server.shard.version,
        numel=case["huge"] if "huge_numel" in d else case["numel"] if "numel" in d else NUMEL,
        dtype=case["dtype"] if "dtype" in d else "float32",
        fingerprint=case["fingerprint"] if "fingerprint" in d else t.fingerprint,
    )


def _payload(case: dict[str, Any]) -> bytes:
    d = case["defects"]
    data = torch.full((NUMEL,), float("nan") if "nonfinite" in d else 0.5).numpy().tobytes()
    if "truncated" in d:
        data = data[: case["cut"]]
    if "overlong" in d:
        data += bytes(case["extra"])
    return data


def call_push(t: Target, case: dict[str, Any], metadata: list[tuple[str, str]]) -> Any:
    d, kind = case["defects"], case["kind"]
    head = _header(t, case).SerializeToString() + (UNKNOWN_FIELD if case["unknown_fields"] else b"")
    data = _payload(case)
    if "shm_metadata" in d:
        metadata = [*metadata, (shm.METADATA_KEY, case["shm"])]
    if kind == "Step":
        request = pb.StepRequest(push=pb.PushHeader.FromString(head), data=data).SerializeToString()
        if "garbage_header" in d or "empty" in d or "data_first" in d or "garbage_frame" in d:
            request = case["garbage"] + request[: len(case["garbage"]) % 7]  # a message that may not parse
            request = request if "data_first" not in d else bytes([0x12]) + request  # a data field first
        return t.channel.unary_unary(METHOD_PREFIX + "Step")(request, timeout=10, metadata=metadata)
    frames = [pb.PushFrame(header=pb.PushHeader.FromString(head)).SerializeToString() + (UNKNOWN_FIELD if case["unknown_fields"] else b"")]
    frames += [pb.PushFrame(data=data[i : i + 4096]).SerializeToString() for i in range(0, len(data), 4096)]
    if "garbage_header" in d:
        frames[0] = case["garbage"]
    if "data_first" in d:
        frames = frames[1:] or [pb.PushFrame(data=b"x").SerializeToString()]
    if "garbage_frame" in d:
        frames.insert(min(len(frames), 1 + case["cut"] % 3), case["garbage"] + b"\x08")  # (b"\x08": never a data frame)
    if "empty" in d:
        frames = []
    if kind == "Push":
        return t.channel.stream_unary(METHOD_PREFIX + "Push")(iter(frames), timeout=10, metadata=metadata)
    replies = t.channel.stream_stream(METHOD_PREFIX + "PushGated")(iter(frames), timeout=10, metadata=metadata)
    return [pb.PushProgress.FromString(r) for r in replies]


def call_other(t: Target, case: dict[str, Any], metadata: list[tuple[str, str]]) -> Any:
    kind, fp = case["kind"], t.fingerprint
    layout = t.chief._join_request(0, wait=False)
    unary = lambda method, request: t.channel.unary_unary(METHOD_PREFIX + method)(request, timeout=10, metadata=metadata)
    if kind in ("Join", "Init"):  # offsets past the shard, another index, sizes that do not fit
        layout.shard.start, layout.shard.end = case["start"], max(case["end"], NUMEL + 1)
        layout.shard.index = case["index"] if case["start"] % 2 else 0
        if kind == "Join":
            return unary("Join", layout.SerializeToString() + UNKNOWN_FIELD)
        head = pb.InitFrame(header=pb.InitHeader(join=layout, numel=case["numel"])).SerializeToString()
        frames = [head, pb.InitFrame(data=case["garbage"]).SerializeToString()]
        return t.channel.stream_unary(METHOD_PREFIX + "Init")(iter(frames), timeout=10, metadata=metadata)
    if kind == "Pull":  # another rank's weights, or another job's fingerprint
        rank = case["rank"] if case["start"] % 2 else 0
        req = pb.PullRequest(rank=rank, clock=t.clock, fingerprint=fp if rank else fp + "x", observe=case["end"] % 2 == 1)
        return list(t.channel.unary_stream(METHOD_PREFIX + "Pull")(req.SerializeToString(), timeout=10, metadata=metadata))
    if kind in ("Heartbeat", "Leave"):
        request = {"Heartbeat": pb.HeartbeatRequest, "Leave": pb.LeaveRequest}[kind](rank=case["rank"], fingerprint=fp)
        return unary(kind, request.SerializeToString())
    if kind == "Rollback":  # to an iteration that never was, as worker 0 (async has no roll-back)
        return unary("Rollback", pb.RollbackRequest(rank=0, fingerprint=fp, version=case["version"],
                                                     execute=True).SerializeToString())
    if kind == "Replica":  # a worker speaking for a server
        return t.channel.stream_unary(METHOD_PREFIX + "ReplicaApply")(iter([case["garbage"]]), timeout=10, metadata=metadata)
    if kind == "Token":  # a forged, garbled or missing token on an otherwise valid-looking call
        bad = [(k, v) for k, v in metadata if k != "authorization"] + ([("authorization", case["token"])] if case["token"] else [])
        return t.channel.unary_unary(METHOD_PREFIX + "Status")(b"", timeout=10, metadata=bad)
    # Garbage bytes as the whole request of a method whose garbage cannot be a valid request
    if case["method"] in ("Join", "Step"):
        return unary(case["method"], case["garbage"] + b"\x22\x01")  # (params field, truncated: never parses whole)
    if case["method"] == "Pull":
        return list(t.channel.unary_stream(METHOD_PREFIX + "Pull")(b"\x0a\xff", timeout=10, metadata=metadata))
    return t.channel.stream_unary(METHOD_PREFIX + case["method"])(iter([case["garbage"] + b"\x0a\xff"]), timeout=10,
                                                                 metadata=metadata)


FUZZ = settings(max_examples=EXAMPLES, derandomize=not NIGHTLY, deadline=None, database=None if not NIGHTLY else
                settings.default.database, suppress_health_check=list(HealthCheck), print_blob=True)


@FUZZ
@given(case=push_case() | other_case())
def test_malformed_calls_get_clear_errors_and_change_nothing(target: Target, case: dict[str, Any]) -> None:
    t = target
    metadata = [("authorization", "Bearer " + derive_token(SECRET, "worker-0"))]
    before = t.state()
    try:
        reply = call_push(t, case, metadata) if "defects" in case else call_other(t, case, metadata)
        code, details = "OK", repr(reply)[:200]
    except grpc.RpcError as exc:
        code, details = exc.code().name, exc.details() or ""
    t.seen[f"{case['kind']} -> {code}"] += 1
    assert code in CLEAR and details, (case, code, details)
    assert t.state() == before, (case, code, details)
    status = t.channel.unary_unary(METHOD_PREFIX + "Status")(b"", timeout=10, metadata=metadata)  # still serves
    assert pb.StatusReply.FromString(status).version == before[0]


def test_after_the_fuzz_the_job_goes_on(target: Target) -> None:
    """Runs after the fuzz (same module): nothing is left locked, the next real step is applied."""
    t = target
    if not t.seen:  # the fuzz ran in another xdist worker (worksteal splits a module): fuzz this server first
        test_malformed_calls_get_clear_errors_and_change_nothing(target=target)
    total = sum(t.seen.values())
    print(f"\nfuzz: {total} cases ({'random' if NIGHTLY else 'derandomized'}), by call and status:")
    for key, n in sorted(t.seen.items()):
        print(f"  {key}: {n}")
    assert total >= min(EXAMPLES, 50)
    version = t.server.shard.version
    flat = torch.empty(NUMEL)
    replies, _ = t.chief.exchange(torch.full((NUMEL,), 0.01), t.clock, flat)
    assert replies[0].applied and t.server.shard.version == version + 1
