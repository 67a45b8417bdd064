"""Pure tests of psgrad.config: validation messages, JobSpec.differences, to_argv, parse_servers."""
from __future__ import annotations

import dataclasses
import math

import pytest

from psgrad.config import ClientConfig, JobSpec, ServerConfig, TlsConfig, WorkerConfig, parse_address, parse_servers
from psgrad.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

NAN = float("nan")
INF = float("inf")


def _shown(value: object) -> list[str]:
    """Ways a bad value may legitimately be shown in a message."""
    if isinstance(value, float) and math.isnan(value):
        return ["nan"]
    return [repr(value), str(value)]


def _assert_names(exc: BaseException, field: str, value: object) -> None:
    msg = str(exc)
    assert field in msg, f"message does not name the field {field!r}: {msg}"
    assert any(s in msg for s in _shown(value)), f"message does not show the bad value {value!r}: {msg}"


JOB_BAD = [
    ("mode", "bogus"),
    ("mode", ""),
    ("staleness", -1),
    ("num_workers", 0),
    ("num_workers", -3),
    ("num_shards", 0),
    ("lr", 0.0),
    ("lr", -0.1),
    ("lr", NAN),
    ("lr", INF),
    ("momentum", -0.5),
    ("momentum", 1.0),
    ("momentum", 1.5),
    ("momentum", NAN),
    ("weight_decay", -1e-4),
    ("weight_decay", INF),
    ("weight_decay", NAN),
    ("wire_dtype", "int8"),
    ("wire_dtype", "fp16"),
    ("beta1", -0.1),
    ("beta1", 1.0),
    ("beta1", NAN),
    ("beta2", 1.0),
    ("beta2", -1e-9),
    ("beta2", INF),
    ("eps", 0.0),
    ("eps", -1e-8),
    ("eps", INF),
    ("eps", NAN),
    ("lr_decay", -0.1),
    ("lr_decay", INF),
    ("initial_accumulator_value", -1.0),
    ("initial_accumulator_value", NAN),
    ("alpha", 1.0),
    ("alpha", -0.5),
    ("rho", 1.5),
    ("rho", NAN),
    ("dc_asgd", -0.1),
    ("dc_asgd", NAN),
    ("dc_asgd", INF),
]


@pytest.mark.parametrize("field, value", JOB_BAD, ids=[f"{f}={v!r}" for f, v in JOB_BAD])
def test_job_spec_refuses(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        JobSpec(**{field: value})  # type: ignore[arg-type]
    _assert_names(info.value, field, value)


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_job_spec_refuses_momentum_with_adam(optimizer: str) -> None:
    with pytest.raises(ConfigError) as info:
        JobSpec(optimizer=optimizer, momentum=0.9)
    _assert_names(info.value, "momentum", 0.9)
    assert repr(optimizer) in str(info.value)
    assert "beta1" in str(info.value)  # where Adam's momentum lives
    assert JobSpec(optimizer=optimizer, momentum=0.0).optimizer == optimizer


def test_job_spec_adam_boundaries() -> None:
    spec = JobSpec(optimizer="adam", beta1=0.0, beta2=0.0, eps=1e-300)
    assert (spec.beta1, spec.beta2, spec.eps) == (0.0, 0.0, 1e-300)
    spec = JobSpec(optimizer="adamw", beta1=0.999999, beta2=0.999999, eps=10.0)
    assert spec.beta2 == 0.999999
    assert (JobSpec().beta1, JobSpec().beta2, JobSpec().eps) == (0.9, 0.999, 1e-8)  # torch.optim.Adam's


def test_job_spec_adam_fields_reach_fingerprint_and_mismatch_message() -> None:
    from psgrad.core.layout import Layout, explain_mismatch
    from psgrad.core.sharding import ParamSpec, fingerprint

    params = (ParamSpec("w", (10,), "float32"),)
    base = JobSpec(optimizer="adam")
    prints = {fingerprint(params, base)}
    for field, value in (("beta1", 0.8), ("beta2", 0.99), ("eps", 1e-6), ("optimizer", "adamw")):
        other = dataclasses.replace(base, **{field: value})
        prints.add(fingerprint(params, other))
        mine = Layout(base, params, 0, 0, 10, fingerprint(params, base))
        theirs = Layout(other, params, 0, 0, 10, fingerprint(params, other))
        msg = explain_mismatch(mine, theirs, rank=3)
        assert msg is not None and field in msg and repr(value) in msg, msg
    assert len(prints) == 5


def test_a_table_that_differs_is_named_with_the_fields_that_differ() -> None:
    """A worker whose table differs only in a setting its description does not show (admission,
    expiry, eviction, its group's lr or optimizer) is told which setting, not two equal descriptions."""
    from psgrad.core.layout import Layout, explain_mismatch
    from psgrad.core.sharding import ParamSpec, TableSpec

    params = (ParamSpec("w", (10,), "float32"),)
    base = TableSpec("t", 100, 4)
    for field, value in (("min_count", 2), ("ttl", 5), ("evict", True), ("lr_scale", 0.5),
                         ("optimizer", "adagrad"), ("settings", (("momentum", 0.5),))):
        other = dataclasses.replace(base, **{field: value})
        mine = Layout(JobSpec(), params, 0, 0, 10, "f", tables=(TableSpec("u", 5, 2), base))
        theirs = Layout(JobSpec(), params, 0, 0, 10, "f", tables=(TableSpec("u", 5, 2), other))
        msg = explain_mismatch(mine, theirs, rank=1)
        assert msg is not None and f"sparse table 't' differs" in msg and field in msg and repr(value) in msg, msg
    # other tables altogether: both lists, as before
    msg = explain_mismatch(Layout(JobSpec(), params, 0, 0, 10, "f", tables=(base,)),
                           Layout(JobSpec(), params, 0, 0, 10, "f", tables=(TableSpec("v", 100, 4),)), rank=1)
    assert msg is not None and "sparse tables differ" in msg and "t [100, 4]" in msg and "v [100, 4]" in msg, msg


def test_ints_in_float_fields_are_the_same_job_as_their_floats() -> None:
    """psgrad.SGD(lr=20) (pytorch/examples' word_language_model) and `--lr 20.0` are one job: the
    fingerprint hashes the values as JSON, where 20 and 20.0 differ."""
    import psgrad
    from psgrad.core.sharding import ParamSpec, fingerprint

    params = (ParamSpec("w", (10,), "float32"),)
    as_ints = JobSpec(lr=20, dc_asgd=1, mode="async", weight_decay=0)
    as_floats = JobSpec(lr=20.0, dc_asgd=1.0, mode="async", weight_decay=0.0)
    assert fingerprint(params, as_ints) == fingerprint(params, as_floats)
    assert type(as_ints.lr) is float and type(as_ints.weight_decay) is float and as_ints.staleness_lr is False
    assert type(JobSpec(staleness=2, mode="ssp").staleness) is int  # int fields stay ints
    for cls, kw in ((psgrad.SGD, {"lr": 20, "momentum": 0}), (psgrad.Adam, {"lr": 1, "betas": (0, 0.5)}),
                    (psgrad.Adagrad, {"lr": 1}), (psgrad.RMSprop, {"lr": 1}), (psgrad.Adadelta, {"lr": 2})):
        ints = JobSpec(**cls(**kw).job_fields())
        floats = JobSpec(**cls(**{k: float(v) if isinstance(v, int) else tuple(map(float, v)) for k, v in kw.items()}
                              ).job_fields())
        assert fingerprint(params, ints) == fingerprint(params, floats), cls
    assert psgrad.SGD(lr=20) == psgrad.SGD(lr=20.0) and repr(psgrad.SGD(lr=20)).startswith("SGD(lr=20.0,")


def test_job_spec_lists_valid_choices() -> None:
    with pytest.raises(ConfigError) as info:
        JobSpec(wire_dtype="int8")
    for name in ("float32", "bfloat16", "float16"):
        assert name in str(info.value)
    with pytest.raises(ConfigError) as info:
        JobSpec(mode="bogus")
    assert "async" in str(info.value)


def test_job_spec_accepts_boundaries() -> None:
    spec = JobSpec(
        staleness=0, num_workers=1, num_shards=1, lr=1e-12, momentum=0.0, weight_decay=0.0, wire_dtype="float16"
    )
    assert spec.lr == 1e-12
    assert JobSpec(momentum=0.999).momentum == 0.999
    for dtype in ("float32", "bfloat16", "float16"):
        assert JobSpec(wire_dtype=dtype).wire_dtype == dtype


def test_job_spec_is_frozen_and_replace_validates() -> None:
    spec = JobSpec()
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.lr = 1.0  # type: ignore[misc]
    with pytest.raises(ConfigError, match="lr"):
        dataclasses.replace(spec, lr=-1.0)


def test_job_spec_differences() -> None:
    a = JobSpec(lr=0.1, num_workers=2)
    assert a.differences(JobSpec(lr=0.1, num_workers=2)) == []
    b = JobSpec(lr=0.2, num_workers=3, wire_dtype="bfloat16")
    assert a.differences(b) == [
        ("num_workers", 2, 3),
        ("lr", 0.1, 0.2),
        ("wire_dtype", "float32", "bfloat16"),
    ]
    assert b.differences(a) == [
        ("num_workers", 3, 2),
        ("lr", 0.2, 0.1),
        ("wire_dtype", "bfloat16", "float32"),
    ]


def test_job_spec_as_dict_has_every_field() -> None:
    spec = JobSpec(mode="ssp", staleness=2, lr=0.5)
    d = spec.as_dict()
    assert set(d) == {f.name for f in dataclasses.fields(JobSpec)}
    assert d["staleness"] == 2 and d["lr"] == 0.5
    assert JobSpec(**d) == spec


SERVER_BAD = [
    ("port", -1),
    ("port", 65536),
    ("lease_s", 0.0),
    ("lease_s", -2.0),
    ("lease_s", NAN),
    ("nonfinite", "ignore"),
    ("nonfinite", "Reject"),
    ("threads", 1),
    ("threads", 0),
    ("chunk_bytes", 1023),
    ("chunk_bytes", 0),
    ("grace_s", -1.0),
    ("grace_s", INF),
    ("grace_s", NAN),
]


@pytest.mark.parametrize("field, value", SERVER_BAD, ids=[f"{f}={v!r}" for f, v in SERVER_BAD])
def test_server_config_refuses(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        ServerConfig(**{field: value})  # type: ignore[arg-type]
    _assert_names(info.value, field, value)


def test_server_config_refuses_empty_host() -> None:
    with pytest.raises(ConfigError) as info:
        ServerConfig(host="")
    assert "host" in str(info.value) and "empty" in str(info.value)


def test_server_config_lists_nonfinite_policies() -> None:
    with pytest.raises(ConfigError) as info:
        ServerConfig(nonfinite="ignore")
    for policy in ("reject", "skip", "allow"):
        assert policy in str(info.value)


def test_server_config_accepts_boundaries() -> None:
    for port in (0, 1, 65535):
        assert ServerConfig(port=port).port == port
    assert ServerConfig(threads=2, chunk_bytes=1024, grace_s=0.0, lease_s=0.001).threads == 2
    for policy in ("reject", "skip", "allow"):
        assert ServerConfig(nonfinite=policy).nonfinite == policy


CLIENT_BAD = [
    ("connect_timeout_s", 0.0),
    ("connect_timeout_s", -1.0),
    ("rpc_timeout_s", -0.5),
    ("rpc_timeout_s", INF),
    ("init_timeout_s", NAN),
    ("init_timeout_s", 0.0),
    ("reconnect_timeout_s", -1.0),
    ("reconnect_timeout_s", float("inf")),
    ("chunk_bytes", 1000),
]


@pytest.mark.parametrize("field, value", CLIENT_BAD, ids=[f"{f}={v!r}" for f, v in CLIENT_BAD])
def test_client_config_refuses(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        ClientConfig(**{field: value})  # type: ignore[arg-type]
    _assert_names(info.value, field, value)


def test_client_config_accepts_boundaries() -> None:
    c = ClientConfig(reconnect_timeout_s=0, chunk_bytes=1024, connect_timeout_s=0.01)
    assert c.reconnect_timeout_s == 0 and c.chunk_bytes == 1024


WORKER_BAD = [
    ("rank", -1),
    ("steps", -1),
    ("batch_size", 0),
    ("eval_every", -1),
    ("log_every", -2),
    ("device", "tpu"),
    ("device", "gpu"),
    ("device", ""),
    ("table_optimizer", "rmsprop"),  # no row form
    ("table_optimizer", "adagard"),
    ("table_lr", 0.0),
    ("table_lr", float("nan")),
]


@pytest.mark.parametrize("field, value", WORKER_BAD, ids=[f"{f}={v!r}" for f, v in WORKER_BAD])
def test_worker_config_refuses(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        WorkerConfig(servers=("127.0.0.1:7000",), **{field: value})  # type: ignore[arg-type]
    _assert_names(info.value, field, value)


def test_worker_config_servers_must_be_a_tuple_of_addresses() -> None:
    assert WorkerConfig(servers=()).servers == ()  # the all-reduce baseline has no servers
    with pytest.raises(ConfigError) as info:
        WorkerConfig(servers="127.0.0.1:7000")  # type: ignore[arg-type]
    assert "servers" in str(info.value)
    with pytest.raises(ConfigError, match="malformed server address"):
        WorkerConfig(servers=("nope",))


def test_worker_config_accepts_boundaries() -> None:
    for device in ("auto", "cpu", "cuda", "cuda:1"):
        assert WorkerConfig(servers=("a:1",), device=device).device == device
    w = WorkerConfig(servers=("a:1", "b:2"), rank=0, steps=0, batch_size=1, eval_every=0, log_every=0)
    assert w.servers == ("a:1", "b:2")
    assert isinstance(w.client, ClientConfig)


# ----------------------------------------------------------------------------- to_argv
def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def test_to_argv_has_a_flag_for_every_field_a_worker_can_be_given() -> None:
    # Without a flag a field silently takes its default in a launched worker; those left out say why.
    spec = JobSpec(mode="ssp", staleness=1, staleness_lr=True, momentum=0.9, nesterov=True, dc_asgd=0.5,
                   dc_asgd_adaptive=True).to_argv()
    spec += JobSpec(optimizer="rmsprop", centered=True).to_argv()  # boolean flags appear only when set
    spec += JobSpec(mode="ssp", staleness_max=4).to_argv()  # --staleness auto --staleness-max 4
    spec += JobSpec(mode="sync", num_workers=2, backup_workers=1, tables_mode="async").to_argv()  # only when set
    spec += JobSpec(compress="sign", error_feedback=False).to_argv()  # --compress, --no-error-feedback: when set
    assert "--no-error-feedback" in spec and "--no-error-feedback" not in JobSpec(compress="sign").to_argv()
    # --num-shards: from --servers; error_feedback's flag is --no-error-feedback (above)
    assert {_flag(f.name) for f in dataclasses.fields(JobSpec)} - set(spec) == {"--num-shards", "--error-feedback"}
    flags_when_set = {"--staleness-lr", "--nesterov", "--centered", "--dc-asgd", "--dc-asgd-adaptive"}
    assert not flags_when_set & set(JobSpec().to_argv())
    client = ClientConfig().to_argv()
    assert "--wait-for-servers" not in client and "--wait-for-servers" in ClientConfig(wait_for_servers=True).to_argv()
    assert {_flag(f.name) for f in dataclasses.fields(ClientConfig)} - set(client) == {
        "--wait-for-servers",  # a boolean flag: only when set (above)
        "--compress-same-host",  # the same (below)
        "--duplex",  # the same (below)
        "--local-socket",  # on by default: --no-local-socket when off (below)
        "--rows-in-place",  # the same
        "--step-socket",  # the same
        "--compress-pull", "--pull-resync-every", "--pull-resync-error",  # with compressed pulls (below)
        "--chunk-bytes",  # no flag: a worker has the default
        "--tls",  # its files' flags (--tls-ca, ...), when given: below
        "--auth",  # secrets never go on a command line (a launcher passes files or the environment)
    }
    ca = __file__  # any file passes TlsConfig's check
    assert ClientConfig(tls=TlsConfig(ca=ca, server_name="n")).to_argv()[-4:] == ["--tls-ca", ca, "--tls-server-name", "n"]
    assert "--no-shared-memory" in ClientConfig(shared_memory=False).to_argv()
    assert "--no-local-socket" in ClientConfig(local_socket=False).to_argv() and "--no-local-socket" not in client
    assert "--no-step-socket" in ClientConfig(step_socket=False).to_argv() and "--no-step-socket" not in client
    assert "--no-rows-in-place" in ClientConfig(rows_in_place=False).to_argv() and "--no-rows-in-place" not in client
    assert "--compress-same-host" in ClientConfig(compress_same_host=True).to_argv()
    assert "--duplex" in ClientConfig(duplex=True).to_argv()
    pulls = ClientConfig(compress_pull="topk:0.01", pull_resync_every=50, pull_resync_error=0.2).to_argv()
    assert pulls[-6:] == ["--compress-pull", "topk:0.01", "--pull-resync-every", "50", "--pull-resync-error", "0.2"]
    worker = WorkerConfig(servers=("a:1",), metrics_out="m.jsonl", metrics_append=True, overlap=True, save_model="m.pt",
                          local_rank=1, bind_cores=True, local_workers=2, data_dir="d", table_optimizer="adagrad",
                          table_lr=0.05).to_argv()
    assert {_flag(f.name) for f in dataclasses.fields(WorkerConfig)} - set(worker) == {
        "--client",
        "--straggler-model",  # its flags, when set: --straggler-dist, --slow-node-rotate (test_stragglers.py)
    }
    assert worker[-len(client):] == client
    assert worker[:2] == ["--servers", "a:1"] and "--servers" not in WorkerConfig(servers=()).to_argv()
    assert not {"--metrics-out", "--metrics-append", "--overlap", "--save-model", "--local-rank", "--bind-cores",
                "--local-workers", "--table-optimizer", "--table-lr"} & \
        set(WorkerConfig(servers=()).to_argv())
    assert worker[worker.index("--table-optimizer"):][:4] == ["--table-optimizer", "adagrad", "--table-lr", "0.05"]


# ----------------------------------------------------------------------------- parse_servers
@pytest.mark.parametrize(
    "text, expected",
    [
        ("127.0.0.1:7000,localhost:7001", ("127.0.0.1:7000", "localhost:7001")),
        ("[::1]:7000", ("[::1]:7000",)),
        ("[::1]:7000,[::1]:7001", ("[::1]:7000", "[::1]:7001")),
        (" host-a:1 , host-b:65535 ", ("host-a:1", "host-b:65535")),
        ("localhost:7000", ("localhost:7000",)),
    ],
)
def test_parse_servers_accepts(text: str, expected: tuple[str, ...]) -> None:
    assert parse_servers(text) == expected


EXAMPLE = "127.0.0.1:7000"


@pytest.mark.parametrize(
    "text",
    ["", "   ", "a", "host:", "host:abc", "host:70000", "host:0", "host:-1", ":7000", "a:1,,b:2", "a:1,", ",a:1"],
)
def test_parse_servers_refuses_malformed(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_servers(text)
    msg = str(info.value)
    assert EXAMPLE in msg, f"no example of the right form in: {msg}"
    assert repr(text) in msg or repr(text.strip()) in msg or any(
        repr(part) in msg for part in text.split(",")
    ), f"message does not quote the input: {msg}"


@pytest.mark.parametrize("text", ["a:1,a:1", "127.0.0.1:7000,127.0.0.1:7001, 127.0.0.1:7000"])
def test_parse_servers_refuses_duplicates(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_servers(text)
    msg = str(info.value)
    assert "twice" in msg or "duplicate" in msg
    assert text.split(",")[0] in msg


def test_parse_address_refuses_unbalanced_brackets() -> None:
    with pytest.raises(ConfigError, match="bracket"):
        parse_address("[::1:7000")
    assert parse_address(" [::1]:80 ") == "[::1]:80"


def test_parse_servers_duplicate_message_shows_example() -> None:
    with pytest.raises(ConfigError) as info:
        parse_servers("a:1,a:1")
    assert EXAMPLE in str(info.value)


# ----------------------------------------------------------------------------- PRIMARY|BACKUP shards
@pytest.mark.parametrize(
    "text, expected",
    [
        ("a:1|b:2,c:3", ("a:1|b:2", "c:3")),
        (" a:1 | b:2 ", ("a:1|b:2",)),
        ("[::1]:7000|[::1]:7001", ("[::1]:7000|[::1]:7001",)),
    ],
)
def test_parse_servers_accepts_a_backup_per_shard(text: str, expected: tuple[str, ...]) -> None:
    assert parse_servers(text) == expected
    assert WorkerConfig(servers=expected).servers == expected


@pytest.mark.parametrize("text, problem", [("a:1|b:2|c:3", "one backup at most"), ("a:1|", "malformed server address ''"),
                                           ("a:1|b:x", "'b:x'"), ("a:1|b:2,b:2", "twice")])
def test_parse_servers_refuses_malformed_backups(text: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        parse_servers(text)


def test_server_config_replica_of_is_an_address() -> None:
    assert ServerConfig(replica_of="127.0.0.1:7000").replica_of == "127.0.0.1:7000"
    with pytest.raises(ConfigError, match="malformed server address"):
        ServerConfig(replica_of="nowhere")
    with pytest.raises(ConfigError, match="replica_timeout_s"):
        ServerConfig(replica_timeout_s=0)


def test_a_server_is_reached_at_its_advertised_or_routed_address() -> None:
    from psgrad.server.runtime import reachable_address

    assert reachable_address(ServerConfig(host="127.0.0.1"), 81) == "127.0.0.1:81"
    assert reachable_address(ServerConfig(host="0.0.0.0", advertise_host="node-3", insecure=True), 81) == "node-3:81"
    # bound to every interface, a backup names the address its primary sees it from
    every = ServerConfig(host="0.0.0.0", replica_of="127.0.0.1:9", insecure=True)
    assert reachable_address(every, 81) == "127.0.0.1:81"
    assert reachable_address(ServerConfig(host="::1"), 81) == "[::1]:81"
    with pytest.raises(ConfigError, match="advertise_host"):
        ServerConfig(advertise_host=" ")


# The optimizer-specific fields: each with an optimizer that reads it and one that does not.
OPTIMIZER_FIELDS = [
    ("momentum", 0.9, "rmsprop", "adagrad"),
    ("nesterov", True, "sgd", "rmsprop"),
    ("beta1", 0.8, "adamw", "sgd"),
    ("beta2", 0.99, "adam", "adadelta"),
    ("eps", 1e-6, "adagrad", "sgd"),
    ("lr_decay", 0.01, "adagrad", "sgd"),
    ("initial_accumulator_value", 0.1, "adagrad", "adam"),
    ("alpha", 0.9, "rmsprop", "adagrad"),
    ("centered", True, "rmsprop", "sgd"),
    ("rho", 0.8, "adadelta", "rmsprop"),
]


@pytest.mark.parametrize("field, value, reader, other", OPTIMIZER_FIELDS, ids=[f[0] for f in OPTIMIZER_FIELDS])
def test_an_optimizer_field_is_refused_where_it_would_be_ignored(field: str, value: object, reader: str, other: str) -> None:
    extra = {"momentum": 0.9} if field == "nesterov" else {}
    assert getattr(JobSpec(optimizer=reader, **{field: value}, **extra), field) == value  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as info:
        JobSpec(optimizer=other, **{field: value})  # type: ignore[arg-type]
    _assert_names(info.value, field, value)
    assert repr(reader) in str(info.value) and repr(other) in str(info.value)


def test_nesterov_needs_momentum() -> None:
    with pytest.raises(ConfigError, match=r"nesterov needs momentum > 0 .* got momentum 0.0"):
        JobSpec(nesterov=True)


API_OPTIMIZER_CASES = [
    ("SGD", {"lr": "0.1"}, TypeError, "psgrad.SGD: lr must be a number, got '0.1' (str)"),
    ("SGD", {"lr": -0.1}, ConfigError, "psgrad.SGD: lr must be a finite number > 0, got -0.1"),
    ("SGD", {"lr": 1e39}, ConfigError, "psgrad.SGD: lr must be at most 3.403e+38 (the servers apply it in float32), got 1e+39"),
    ("SGD", {"momentum": -0.5}, ConfigError, "psgrad.SGD: momentum must be in [0, 1), got -0.5"),
    ("SGD", {"weight_decay": -1}, ConfigError, "psgrad.SGD: weight_decay must be a finite number >= 0, got -1.0"),
    ("SGD", {"nesterov": True}, ConfigError, "psgrad.SGD: nesterov needs momentum > 0 (like torch.optim.SGD), got momentum 0.0"),
    ("SGD", {"nesterov": "yes", "momentum": 0.9}, TypeError, "psgrad.SGD: nesterov must be True or False, got 'yes'"),
    ("Adam", {"betas": (0.9, 1.0)}, ConfigError, "psgrad.Adam: betas[1] must be in [0, 1), got 1.0"),
    ("Adam", {"betas": 0.9}, TypeError, "psgrad.Adam: betas must be a pair of numbers (beta1, beta2), got 0.9"),
    ("Adam", {"eps": 0.0}, ConfigError, "psgrad.Adam: eps must be a finite number > 0, got 0.0"),
    ("Adam", {"lr": NAN}, ConfigError, "psgrad.Adam: lr must be a finite number > 0, got nan"),
    ("Adagrad", {"lr_decay": -1.0}, ConfigError, "psgrad.Adagrad: lr_decay must be a finite number >= 0, got -1.0"),
    ("Adagrad", {"initial_accumulator_value": None}, TypeError,
     "psgrad.Adagrad: initial_accumulator_value must be a number, got None (NoneType)"),
    ("RMSprop", {"alpha": 1.5}, ConfigError, "psgrad.RMSprop: alpha must be in [0, 1), got 1.5"),
    ("Adadelta", {"rho": INF}, ConfigError, "psgrad.Adadelta: rho must be in [0, 1), got inf"),
]


@pytest.mark.parametrize("cls, kwargs, error, message", API_OPTIMIZER_CASES,
                         ids=[f"{c[0]}-{next(iter(c[1]))}-{i}" for i, c in enumerate(API_OPTIMIZER_CASES)])
def test_the_apis_optimizers_check_their_settings_as_they_are_built(cls: str, kwargs: dict[str, object],
                                                                    error: type[Exception], message: str) -> None:
    """psgrad.SGD(lr='0.1') was taken, and connect() failed later with a TypeError naming nothing; as
    torch.optim's constructors do, the settings are checked at once, by JobSpec's own rules."""
    import psgrad

    with pytest.raises(error) as info:
        getattr(psgrad, cls)(**kwargs)
    assert str(info.value) == message and type(info.value) is error


def test_a_job_specs_optimizer_settings_are_type_checked_by_name() -> None:
    with pytest.raises(TypeError, match=r"^lr must be a number, got '0.1' \(str\)$"):
        JobSpec(lr="0.1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^momentum must be a number, got None \(NoneType\)$"):
        JobSpec(momentum=None)  # type: ignore[arg-type]


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw", "adagrad", "rmsprop", "adadelta"])
def test_eps_left_out_on_the_command_line_is_torchs_default_for_the_optimizer(optimizer: str) -> None:
    from psgrad.cli.flags import apply_recipe, job_spec
    from psgrad.cli.parser import build_parser
    from psgrad.core.optimizer_settings import DEFAULT_EPS

    ns = build_parser().parse_args(["worker", "--servers", "a:1", "--optimizer", optimizer])
    apply_recipe(ns)  # the settings left out take the task's recipe (digits)
    assert job_spec(ns, 1, 1).eps == DEFAULT_EPS.get(optimizer, JobSpec.eps)
    assert DEFAULT_EPS.get(optimizer) == {"adagrad": 1e-10, "adadelta": 1e-6, "sgd": None}.get(optimizer, 1e-8)


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw", "adagrad", "rmsprop", "adadelta"])
def test_weight_decay_left_out_is_torchs_default_for_the_optimizer(optimizer: str) -> None:
    """AdamW's weight decay left out was 0 (torch.optim.AdamW's is 0.01): on the command line, in
    psgrad.Adam(decoupled=True) and in a task's Recipe; the others' is 0, as in torch."""
    import inspect

    import torch

    import psgrad
    from psgrad.cli.flags import apply_recipe, job_spec
    from psgrad.cli.parser import build_parser
    from psgrad.core.optimizer_settings import DECLS, SERVER_OPTIMIZERS
    from psgrad.tasks.recipes import Recipe

    torch_default = inspect.signature(getattr(torch.optim, DECLS[optimizer].torch)).parameters["weight_decay"].default
    assert torch_default == (0.01 if optimizer == "adamw" else 0)
    ns = build_parser().parse_args(["worker", "--servers", "a:1", "--optimizer", optimizer])
    apply_recipe(ns)  # digits' recipe is sgd's, without weight decay
    assert job_spec(ns, 1, 1).weight_decay == torch_default
    assert Recipe(optimizer=optimizer).weight_decay == torch_default
    api = {c.__name__.lower(): c() for c in SERVER_OPTIMIZERS}
    api["adamw"] = psgrad.Adam(decoupled=True)
    fields = api[optimizer].job_fields()
    assert (fields["optimizer"], fields["weight_decay"]) == (optimizer, torch_default)
    assert psgrad.Adam(weight_decay=0, decoupled=True).job_fields()["weight_decay"] == 0.0  # given: kept
    given = build_parser().parse_args(["worker", "--servers", "a:1", "--optimizer", optimizer, "--weight-decay", "0"])
    apply_recipe(given)
    assert job_spec(given, 1, 1).weight_decay == 0.0


def test_the_optimizer_classes_defaults_are_torchs() -> None:
    """Every setting of psgrad.SGD, Adam (and AdamW: decoupled=True), Adagrad, RMSprop and Adadelta left out
    is torch.optim's default for it, but SGD's lr (0.1; torch's 1e-3)."""
    import inspect

    import torch

    import psgrad
    from psgrad.core.optimizer_settings import SERVER_OPTIMIZERS

    cases = [(c(), c.__name__) for c in SERVER_OPTIMIZERS] + [(psgrad.Adam(decoupled=True), "AdamW")]
    for ours, name in cases:
        theirs = {k: p.default for k, p in inspect.signature(getattr(torch.optim, name)).parameters.items()}
        for field, value in dataclasses.asdict(ours).items():
            if field == "decoupled":
                continue
            want = 0.1 if (name, field) == ("SGD", "lr") else theirs[field]
            assert value == want, (name, field, value, theirs[field])


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_dc_asgd_is_a_setting_of_the_modes_with_stale_gradients(mode: str) -> None:
    spec = JobSpec(mode=mode, dc_asgd=0.04, dc_asgd_adaptive=True)
    assert spec.to_argv()[-3:] == ["--dc-asgd", "0.04", "--dc-asgd-adaptive"]
    with pytest.raises(ConfigError, match="mode 'sync' applies every gradient to the weights it was computed on"):
        JobSpec(mode="sync", dc_asgd=0.04)
    with pytest.raises(ConfigError, match="--dc-asgd-adaptive .* give --dc-asgd > 0"):
        JobSpec(mode=mode, dc_asgd_adaptive=True)


@pytest.mark.parametrize("kind, twin", [("SGD", "psgrad.SGD(lr="), ("AdamW", "psgrad.Adam(lr=..., ...) with decoupled=True"),
                                        ("LBFGS", "only these rules")])
def test_a_torch_optim_optimizer_is_refused_naming_the_ones_to_use(kind: str, twin: str) -> None:
    """psgrad.connect(optimizer=torch.optim.SGD(...)) raised AttributeError ('job_fields')."""
    import torch

    import psgrad

    torch_optimizer = getattr(torch.optim, kind)(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ConfigError) as info:
        psgrad.connect("127.0.0.1:1", optimizer=torch_optimizer)  # nothing is sent: refused before
    message = str(info.value)
    assert ("optimizer must be psgrad.SGD, psgrad.Adam, psgrad.Adagrad, psgrad.RMSprop or psgrad.Adadelta" in message
            and f"got a torch.optim.{kind}" in message and twin in message), message
    with pytest.raises(ConfigError, match="got 'sgd'"):
        psgrad.connect("127.0.0.1:1", optimizer="sgd")  # type: ignore[arg-type]


def test_an_unknown_tables_mode_is_named_as_the_tables_mode() -> None:
    """(It said "unknown mode 'bogus'", as if the job's mode were wrong.)"""
    with pytest.raises(ConfigError, match=r"unknown tables_mode 'bogus' \(--tables-mode\); valid: async, ssp, sync"):
        JobSpec(mode="sync", tables_mode="bogus")
