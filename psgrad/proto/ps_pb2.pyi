from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JobSpec(_message.Message):
    __slots__ = ("mode", "staleness", "num_workers", "optimizer", "lr", "momentum", "weight_decay", "wire_dtype", "num_shards", "staleness_lr", "beta1", "beta2", "eps", "nesterov", "lr_decay", "initial_accumulator_value", "alpha", "centered", "rho", "dc_asgd", "dc_asgd_adaptive", "backup_workers", "staleness_max", "compress", "no_error_feedback", "tables_mode")
    MODE_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    STALENESS_LR_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    NESTEROV_FIELD_NUMBER: _ClassVar[int]
    LR_DECAY_FIELD_NUMBER: _ClassVar[int]
    INITIAL_ACCUMULATOR_VALUE_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    CENTERED_FIELD_NUMBER: _ClassVar[int]
    RHO_FIELD_NUMBER: _ClassVar[int]
    DC_ASGD_FIELD_NUMBER: _ClassVar[int]
    DC_ASGD_ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    BACKUP_WORKERS_FIELD_NUMBER: _ClassVar[int]
    STALENESS_MAX_FIELD_NUMBER: _ClassVar[int]
    COMPRESS_FIELD_NUMBER: _ClassVar[int]
    NO_ERROR_FEEDBACK_FIELD_NUMBER: _ClassVar[int]
    TABLES_MODE_FIELD_NUMBER: _ClassVar[int]
    mode: str
    staleness: int
    num_workers: int
    optimizer: str
    lr: float
    momentum: float
    weight_decay: float
    wire_dtype: str
    num_shards: int
    staleness_lr: bool
    beta1: float
    beta2: float
    eps: float
    nesterov: bool
    lr_decay: float
    initial_accumulator_value: float
    alpha: float
    centered: bool
    rho: float
    dc_asgd: float
    dc_asgd_adaptive: bool
    backup_workers: int
    staleness_max: int
    compress: str
    no_error_feedback: bool
    tables_mode: str
    def __init__(self, mode: _Optional[str] = ..., staleness: _Optional[int] = ..., num_workers: _Optional[int] = ..., optimizer: _Optional[str] = ..., lr: _Optional[float] = ..., momentum: _Optional[float] = ..., weight_decay: _Optional[float] = ..., wire_dtype: _Optional[str] = ..., num_shards: _Optional[int] = ..., staleness_lr: _Optional[bool] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., nesterov: _Optional[bool] = ..., lr_decay: _Optional[float] = ..., initial_accumulator_value: _Optional[float] = ..., alpha: _Optional[float] = ..., centered: _Optional[bool] = ..., rho: _Optional[float] = ..., dc_asgd: _Optional[float] = ..., dc_asgd_adaptive: _Optional[bool] = ..., backup_workers: _Optional[int] = ..., staleness_max: _Optional[int] = ..., compress: _Optional[str] = ..., no_error_feedback: _Optional[bool] = ..., tables_mode: _Optional[str] = ...) -> None: ...

class ParamSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype", "buffer", "aliases", "lr_scale", "weight_decay")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    LR_SCALE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    buffer: bool
    aliases: _containers.RepeatedScalarFieldContainer[str]
    lr_scale: float
    weight_decay: float
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., buffer: _Optional[bool] = ..., aliases: _Optional[_Iterable[str]] = ..., lr_scale: _Optional[float] = ..., weight_decay: _Optional[float] = ...) -> None: ...

class TableSpec(_message.Message):
    __slots__ = ("name", "num_embeddings", "dim", "seed", "std", "lr_scale", "settings", "min_count", "ttl", "evict", "optimizer", "aliases", "drawn_as")
    class SettingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STD_FIELD_NUMBER: _ClassVar[int]
    LR_SCALE_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    MIN_COUNT_FIELD_NUMBER: _ClassVar[int]
    TTL_FIELD_NUMBER: _ClassVar[int]
    EVICT_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    DRAWN_AS_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_embeddings: int
    dim: int
    seed: int
    std: float
    lr_scale: float
    settings: _containers.ScalarMap[str, float]
    min_count: int
    ttl: int
    evict: bool
    optimizer: str
    aliases: _containers.RepeatedScalarFieldContainer[str]
    drawn_as: str
    def __init__(self, name: _Optional[str] = ..., num_embeddings: _Optional[int] = ..., dim: _Optional[int] = ..., seed: _Optional[int] = ..., std: _Optional[float] = ..., lr_scale: _Optional[float] = ..., settings: _Optional[_Mapping[str, float]] = ..., min_count: _Optional[int] = ..., ttl: _Optional[int] = ..., evict: _Optional[bool] = ..., optimizer: _Optional[str] = ..., aliases: _Optional[_Iterable[str]] = ..., drawn_as: _Optional[str] = ...) -> None: ...

class ShardRange(_message.Message):
    __slots__ = ("index", "start", "end")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    index: int
    start: int
    end: int
    def __init__(self, index: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("rank", "spec", "params", "shard", "fingerprint", "wait_for_init", "tables", "frozen", "incarnation")
    RANK_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOR_INIT_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    FROZEN_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    rank: int
    spec: JobSpec
    params: _containers.RepeatedCompositeFieldContainer[ParamSpec]
    shard: ShardRange
    fingerprint: str
    wait_for_init: bool
    tables: _containers.RepeatedCompositeFieldContainer[TableSpec]
    frozen: _containers.RepeatedCompositeFieldContainer[ParamSpec]
    incarnation: int
    def __init__(self, rank: _Optional[int] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., params: _Optional[_Iterable[_Union[ParamSpec, _Mapping]]] = ..., shard: _Optional[_Union[ShardRange, _Mapping]] = ..., fingerprint: _Optional[str] = ..., wait_for_init: _Optional[bool] = ..., tables: _Optional[_Iterable[_Union[TableSpec, _Mapping]]] = ..., frozen: _Optional[_Iterable[_Union[ParamSpec, _Mapping]]] = ..., incarnation: _Optional[int] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("initialized", "version", "lease_s", "ready", "joined", "start_clock", "joined_ranks", "frozen_version", "last_push_clock", "drawn_as")
    class DrawnAsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    START_CLOCK_FIELD_NUMBER: _ClassVar[int]
    JOINED_RANKS_FIELD_NUMBER: _ClassVar[int]
    FROZEN_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_PUSH_CLOCK_FIELD_NUMBER: _ClassVar[int]
    DRAWN_AS_FIELD_NUMBER: _ClassVar[int]
    initialized: bool
    version: int
    lease_s: float
    ready: bool
    joined: int
    start_clock: int
    joined_ranks: _containers.RepeatedScalarFieldContainer[int]
    frozen_version: int
    last_push_clock: int
    drawn_as: _containers.ScalarMap[str, str]
    def __init__(self, initialized: _Optional[bool] = ..., version: _Optional[int] = ..., lease_s: _Optional[float] = ..., ready: _Optional[bool] = ..., joined: _Optional[int] = ..., start_clock: _Optional[int] = ..., joined_ranks: _Optional[_Iterable[int]] = ..., frozen_version: _Optional[int] = ..., last_push_clock: _Optional[int] = ..., drawn_as: _Optional[_Mapping[str, str]] = ...) -> None: ...

class InitHeader(_message.Message):
    __slots__ = ("join", "numel", "frozen_numel", "row_block")
    JOIN_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    FROZEN_NUMEL_FIELD_NUMBER: _ClassVar[int]
    ROW_BLOCK_FIELD_NUMBER: _ClassVar[int]
    join: JoinRequest
    numel: int
    frozen_numel: int
    row_block: RowBlock
    def __init__(self, join: _Optional[_Union[JoinRequest, _Mapping]] = ..., numel: _Optional[int] = ..., frozen_numel: _Optional[int] = ..., row_block: _Optional[_Union[RowBlock, _Mapping]] = ...) -> None: ...

class InitFrame(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: InitHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[InitHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class InitReply(_message.Message):
    __slots__ = ("already_initialized", "version")
    ALREADY_INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    already_initialized: bool
    version: int
    def __init__(self, already_initialized: _Optional[bool] = ..., version: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("rank", "clock", "fingerprint", "observe", "table", "delta")
    RANK_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    OBSERVE_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    rank: int
    clock: int
    fingerprint: str
    observe: bool
    table: str
    delta: DeltaAsk
    def __init__(self, rank: _Optional[int] = ..., clock: _Optional[int] = ..., fingerprint: _Optional[str] = ..., observe: _Optional[bool] = ..., table: _Optional[str] = ..., delta: _Optional[_Union[DeltaAsk, _Mapping]] = ...) -> None: ...

class DeltaAsk(_message.Message):
    __slots__ = ("codec", "holds", "resync_every", "resync_error")
    CODEC_FIELD_NUMBER: _ClassVar[int]
    HOLDS_FIELD_NUMBER: _ClassVar[int]
    RESYNC_EVERY_FIELD_NUMBER: _ClassVar[int]
    RESYNC_ERROR_FIELD_NUMBER: _ClassVar[int]
    codec: str
    holds: int
    resync_every: int
    resync_error: float
    def __init__(self, codec: _Optional[str] = ..., holds: _Optional[int] = ..., resync_every: _Optional[int] = ..., resync_error: _Optional[float] = ...) -> None: ...

class PullHeader(_message.Message):
    __slots__ = ("version", "numel", "dtype", "evicted", "restored_version", "compress", "copy", "drift")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    RESTORED_VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPRESS_FIELD_NUMBER: _ClassVar[int]
    COPY_FIELD_NUMBER: _ClassVar[int]
    DRIFT_FIELD_NUMBER: _ClassVar[int]
    version: int
    numel: int
    dtype: str
    evicted: _containers.RepeatedCompositeFieldContainer[Eviction]
    restored_version: int
    compress: str
    copy: int
    drift: float
    def __init__(self, version: _Optional[int] = ..., numel: _Optional[int] = ..., dtype: _Optional[str] = ..., evicted: _Optional[_Iterable[_Union[Eviction, _Mapping]]] = ..., restored_version: _Optional[int] = ..., compress: _Optional[str] = ..., copy: _Optional[int] = ..., drift: _Optional[float] = ...) -> None: ...

class PullFrame(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PullHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PullHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("rank", "clock", "base_version", "numel", "dtype", "fingerprint", "lr", "compress", "row_block", "unused", "unused_tables", "incarnation", "skip")
    RANK_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    COMPRESS_FIELD_NUMBER: _ClassVar[int]
    ROW_BLOCK_FIELD_NUMBER: _ClassVar[int]
    UNUSED_FIELD_NUMBER: _ClassVar[int]
    UNUSED_TABLES_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SKIP_FIELD_NUMBER: _ClassVar[int]
    rank: int
    clock: int
    base_version: int
    numel: int
    dtype: str
    fingerprint: str
    lr: float
    compress: str
    row_block: RowBlock
    unused: bytes
    unused_tables: _containers.RepeatedScalarFieldContainer[str]
    incarnation: int
    skip: bool
    def __init__(self, rank: _Optional[int] = ..., clock: _Optional[int] = ..., base_version: _Optional[int] = ..., numel: _Optional[int] = ..., dtype: _Optional[str] = ..., fingerprint: _Optional[str] = ..., lr: _Optional[float] = ..., compress: _Optional[str] = ..., row_block: _Optional[_Union[RowBlock, _Mapping]] = ..., unused: _Optional[bytes] = ..., unused_tables: _Optional[_Iterable[str]] = ..., incarnation: _Optional[int] = ..., skip: _Optional[bool] = ...) -> None: ...

class PushFrame(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PushHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PushHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("applied", "reason", "version", "staleness", "deferred", "lr", "staleness_bound", "evicted", "restored_version")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    DEFERRED_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    STALENESS_BOUND_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    RESTORED_VERSION_FIELD_NUMBER: _ClassVar[int]
    applied: bool
    reason: str
    version: int
    staleness: int
    deferred: bool
    lr: float
    staleness_bound: int
    evicted: _containers.RepeatedCompositeFieldContainer[Eviction]
    restored_version: int
    def __init__(self, applied: _Optional[bool] = ..., reason: _Optional[str] = ..., version: _Optional[int] = ..., staleness: _Optional[int] = ..., deferred: _Optional[bool] = ..., lr: _Optional[float] = ..., staleness_bound: _Optional[int] = ..., evicted: _Optional[_Iterable[_Union[Eviction, _Mapping]]] = ..., restored_version: _Optional[int] = ...) -> None: ...

class Eviction(_message.Message):
    __slots__ = ("rank", "clock", "lease_s", "live")
    RANK_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    clock: int
    lease_s: float
    live: int
    def __init__(self, rank: _Optional[int] = ..., clock: _Optional[int] = ..., lease_s: _Optional[float] = ..., live: _Optional[int] = ...) -> None: ...

class PushProgress(_message.Message):
    __slots__ = ("ready", "reply")
    READY_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    reply: PushReply
    def __init__(self, ready: _Optional[bool] = ..., reply: _Optional[_Union[PushReply, _Mapping]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("push", "data", "delta", "read_block")
    PUSH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    READ_BLOCK_FIELD_NUMBER: _ClassVar[int]
    push: PushHeader
    data: bytes
    delta: DeltaAsk
    read_block: RowBlock
    def __init__(self, push: _Optional[_Union[PushHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., delta: _Optional[_Union[DeltaAsk, _Mapping]] = ..., read_block: _Optional[_Union[RowBlock, _Mapping]] = ...) -> None: ...

class StepReply(_message.Message):
    __slots__ = ("push", "pull", "data", "rows", "row_versions", "rows_in_segment")
    PUSH_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ROW_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    ROWS_IN_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    push: PushReply
    pull: PullHeader
    data: bytes
    rows: bytes
    row_versions: _containers.RepeatedScalarFieldContainer[int]
    rows_in_segment: int
    def __init__(self, push: _Optional[_Union[PushReply, _Mapping]] = ..., pull: _Optional[_Union[PullHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., rows: _Optional[bytes] = ..., row_versions: _Optional[_Iterable[int]] = ..., rows_in_segment: _Optional[int] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("rank", "clock", "state", "last_seen_s", "pushes")
    RANK_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_S_FIELD_NUMBER: _ClassVar[int]
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    clock: int
    state: str
    last_seen_s: float
    pushes: int
    def __init__(self, rank: _Optional[int] = ..., clock: _Optional[int] = ..., state: _Optional[str] = ..., last_seen_s: _Optional[float] = ..., pushes: _Optional[int] = ...) -> None: ...

class StalenessBucket(_message.Message):
    __slots__ = ("staleness", "count")
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    staleness: int
    count: int
    def __init__(self, staleness: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("with_params",)
    WITH_PARAMS_FIELD_NUMBER: _ClassVar[int]
    with_params: bool
    def __init__(self, with_params: _Optional[bool] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("initialized", "shard", "spec", "version", "pushes_applied", "pushes_duplicate", "pushes_rejected", "pulls", "bytes_in", "bytes_out", "workers", "staleness", "uptime_s", "fingerprint", "evictions", "pending", "waiting", "transfers", "updates_lost", "params", "table_specs", "frozen_params", "rolled_back", "job_lr", "job_lr_clock", "replica", "delay", "late_dropped", "staleness_bound", "published", "tables", "checkpoint", "pushes_plain", "delta", "pushes_skipped")
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PUSHES_APPLIED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    PUSHES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    UPDATES_LOST_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    TABLE_SPECS_FIELD_NUMBER: _ClassVar[int]
    FROZEN_PARAMS_FIELD_NUMBER: _ClassVar[int]
    ROLLED_BACK_FIELD_NUMBER: _ClassVar[int]
    JOB_LR_FIELD_NUMBER: _ClassVar[int]
    JOB_LR_CLOCK_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    DELAY_FIELD_NUMBER: _ClassVar[int]
    LATE_DROPPED_FIELD_NUMBER: _ClassVar[int]
    STALENESS_BOUND_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    PUSHES_PLAIN_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    PUSHES_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    initialized: bool
    shard: ShardRange
    spec: JobSpec
    version: int
    pushes_applied: int
    pushes_duplicate: int
    pushes_rejected: int
    pulls: int
    bytes_in: int
    bytes_out: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    staleness: _containers.RepeatedCompositeFieldContainer[StalenessBucket]
    uptime_s: float
    fingerprint: str
    evictions: int
    pending: int
    waiting: int
    transfers: TransferStatus
    updates_lost: int
    params: _containers.RepeatedCompositeFieldContainer[ParamSpec]
    table_specs: _containers.RepeatedCompositeFieldContainer[TableSpec]
    frozen_params: _containers.RepeatedCompositeFieldContainer[ParamSpec]
    rolled_back: int
    job_lr: float
    job_lr_clock: int
    replica: ReplicaStatus
    delay: DelayStatus
    late_dropped: int
    staleness_bound: int
    published: PublishedStatus
    tables: _containers.RepeatedCompositeFieldContainer[TableStatus]
    checkpoint: CheckpointStatus
    pushes_plain: int
    delta: DeltaStatus
    pushes_skipped: int
    def __init__(self, initialized: _Optional[bool] = ..., shard: _Optional[_Union[ShardRange, _Mapping]] = ..., spec: _Optional[_Union[JobSpec, _Mapping]] = ..., version: _Optional[int] = ..., pushes_applied: _Optional[int] = ..., pushes_duplicate: _Optional[int] = ..., pushes_rejected: _Optional[int] = ..., pulls: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., staleness: _Optional[_Iterable[_Union[StalenessBucket, _Mapping]]] = ..., uptime_s: _Optional[float] = ..., fingerprint: _Optional[str] = ..., evictions: _Optional[int] = ..., pending: _Optional[int] = ..., waiting: _Optional[int] = ..., transfers: _Optional[_Union[TransferStatus, _Mapping]] = ..., updates_lost: _Optional[int] = ..., params: _Optional[_Iterable[_Union[ParamSpec, _Mapping]]] = ..., table_specs: _Optional[_Iterable[_Union[TableSpec, _Mapping]]] = ..., frozen_params: _Optional[_Iterable[_Union[ParamSpec, _Mapping]]] = ..., rolled_back: _Optional[int] = ..., job_lr: _Optional[float] = ..., job_lr_clock: _Optional[int] = ..., replica: _Optional[_Union[ReplicaStatus, _Mapping]] = ..., delay: _Optional[_Union[DelayStatus, _Mapping]] = ..., late_dropped: _Optional[int] = ..., staleness_bound: _Optional[int] = ..., published: _Optional[_Union[PublishedStatus, _Mapping]] = ..., tables: _Optional[_Iterable[_Union[TableStatus, _Mapping]]] = ..., checkpoint: _Optional[_Union[CheckpointStatus, _Mapping]] = ..., pushes_plain: _Optional[int] = ..., delta: _Optional[_Union[DeltaStatus, _Mapping]] = ..., pushes_skipped: _Optional[int] = ...) -> None: ...

class CheckpointStatus(_message.Message):
    __slots__ = ("enabled", "version", "age_s", "writes", "failures", "failing", "last_error", "error_age_s")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    WRITES_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    FAILING_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_AGE_S_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    version: int
    age_s: float
    writes: int
    failures: int
    failing: bool
    last_error: str
    error_age_s: float
    def __init__(self, enabled: _Optional[bool] = ..., version: _Optional[int] = ..., age_s: _Optional[float] = ..., writes: _Optional[int] = ..., failures: _Optional[int] = ..., failing: _Optional[bool] = ..., last_error: _Optional[str] = ..., error_age_s: _Optional[float] = ...) -> None: ...

class TableStatus(_message.Message):
    __slots__ = ("name", "kind", "numel", "nbytes", "state_bytes", "rows", "rows_touched", "updates", "staleness_max", "staleness_mean", "admitted", "expired", "evicted", "dropped", "capacity")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ROWS_TOUCHED_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    STALENESS_MAX_FIELD_NUMBER: _ClassVar[int]
    STALENESS_MEAN_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    numel: int
    nbytes: int
    state_bytes: int
    rows: int
    rows_touched: int
    updates: int
    staleness_max: int
    staleness_mean: float
    admitted: int
    expired: int
    evicted: int
    dropped: int
    capacity: int
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., numel: _Optional[int] = ..., nbytes: _Optional[int] = ..., state_bytes: _Optional[int] = ..., rows: _Optional[int] = ..., rows_touched: _Optional[int] = ..., updates: _Optional[int] = ..., staleness_max: _Optional[int] = ..., staleness_mean: _Optional[float] = ..., admitted: _Optional[int] = ..., expired: _Optional[int] = ..., evicted: _Optional[int] = ..., dropped: _Optional[int] = ..., capacity: _Optional[int] = ...) -> None: ...

class TableRows(_message.Message):
    __slots__ = ("table", "ids", "grads", "base_version", "lr", "removed", "expired", "sighted", "made")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    SIGHTED_FIELD_NUMBER: _ClassVar[int]
    MADE_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    grads: bytes
    base_version: int
    lr: float
    removed: bool
    expired: bool
    sighted: bool
    made: bool
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ..., grads: _Optional[bytes] = ..., base_version: _Optional[int] = ..., lr: _Optional[float] = ..., removed: _Optional[bool] = ..., expired: _Optional[bool] = ..., sighted: _Optional[bool] = ..., made: _Optional[bool] = ...) -> None: ...

class RowBlock(_message.Message):
    __slots__ = ("tables", "counts", "ids", "widths", "base_versions", "grads")
    TABLES_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    WIDTHS_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedScalarFieldContainer[str]
    counts: _containers.RepeatedScalarFieldContainer[int]
    ids: bytes
    widths: _containers.RepeatedScalarFieldContainer[int]
    base_versions: _containers.RepeatedScalarFieldContainer[int]
    grads: bytes
    def __init__(self, tables: _Optional[_Iterable[str]] = ..., counts: _Optional[_Iterable[int]] = ..., ids: _Optional[bytes] = ..., widths: _Optional[_Iterable[int]] = ..., base_versions: _Optional[_Iterable[int]] = ..., grads: _Optional[bytes] = ...) -> None: ...

class RowsRequest(_message.Message):
    __slots__ = ("rank", "fingerprint", "table", "observe", "updated", "from_id", "limit", "block")
    RANK_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    OBSERVE_FIELD_NUMBER: _ClassVar[int]
    UPDATED_FIELD_NUMBER: _ClassVar[int]
    FROM_ID_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    rank: int
    fingerprint: str
    table: str
    observe: bool
    updated: bool
    from_id: int
    limit: int
    block: RowBlock
    def __init__(self, rank: _Optional[int] = ..., fingerprint: _Optional[str] = ..., table: _Optional[str] = ..., observe: _Optional[bool] = ..., updated: _Optional[bool] = ..., from_id: _Optional[int] = ..., limit: _Optional[int] = ..., block: _Optional[_Union[RowBlock, _Mapping]] = ...) -> None: ...

class RowsReply(_message.Message):
    __slots__ = ("version", "rows", "ids", "versions")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    version: int
    rows: bytes
    ids: bytes
    versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, version: _Optional[int] = ..., rows: _Optional[bytes] = ..., ids: _Optional[bytes] = ..., versions: _Optional[_Iterable[int]] = ...) -> None: ...

class PublishedStatus(_message.Message):
    __slots__ = ("slots", "nbytes", "leased", "copies", "leases", "pinned")
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    LEASED_FIELD_NUMBER: _ClassVar[int]
    COPIES_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    slots: int
    nbytes: int
    leased: int
    copies: int
    leases: int
    pinned: int
    def __init__(self, slots: _Optional[int] = ..., nbytes: _Optional[int] = ..., leased: _Optional[int] = ..., copies: _Optional[int] = ..., leases: _Optional[int] = ..., pinned: _Optional[int] = ...) -> None: ...

class DeltaStatus(_message.Message):
    __slots__ = ("copies", "nbytes", "compressed", "exact", "resyncs", "drift", "drift_max")
    COPIES_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    COMPRESSED_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    RESYNCS_FIELD_NUMBER: _ClassVar[int]
    DRIFT_FIELD_NUMBER: _ClassVar[int]
    DRIFT_MAX_FIELD_NUMBER: _ClassVar[int]
    copies: int
    nbytes: int
    compressed: int
    exact: int
    resyncs: int
    drift: float
    drift_max: float
    def __init__(self, copies: _Optional[int] = ..., nbytes: _Optional[int] = ..., compressed: _Optional[int] = ..., exact: _Optional[int] = ..., resyncs: _Optional[int] = ..., drift: _Optional[float] = ..., drift_max: _Optional[float] = ...) -> None: ...

class DelayStatus(_message.Message):
    __slots__ = ("copies", "nbytes", "compensated", "uncompensated")
    COPIES_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    COMPENSATED_FIELD_NUMBER: _ClassVar[int]
    UNCOMPENSATED_FIELD_NUMBER: _ClassVar[int]
    copies: int
    nbytes: int
    compensated: int
    uncompensated: int
    def __init__(self, copies: _Optional[int] = ..., nbytes: _Optional[int] = ..., compensated: _Optional[int] = ..., uncompensated: _Optional[int] = ...) -> None: ...

class TransferStatus(_message.Message):
    __slots__ = ("streaming_pulls", "waiting_updates", "buffers_lent", "staged_updates", "retired_buffers", "waiting_for_buffer", "streams_open", "streams_cancelled", "streams_refused", "read_limit_bytes", "read_bytes", "read_bytes_peak", "reads_waiting", "reads_queued", "reads_expired", "reads_refused")
    STREAMING_PULLS_FIELD_NUMBER: _ClassVar[int]
    WAITING_UPDATES_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_LENT_FIELD_NUMBER: _ClassVar[int]
    STAGED_UPDATES_FIELD_NUMBER: _ClassVar[int]
    RETIRED_BUFFERS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_BUFFER_FIELD_NUMBER: _ClassVar[int]
    STREAMS_OPEN_FIELD_NUMBER: _ClassVar[int]
    STREAMS_CANCELLED_FIELD_NUMBER: _ClassVar[int]
    STREAMS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    READ_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    READ_BYTES_FIELD_NUMBER: _ClassVar[int]
    READ_BYTES_PEAK_FIELD_NUMBER: _ClassVar[int]
    READS_WAITING_FIELD_NUMBER: _ClassVar[int]
    READS_QUEUED_FIELD_NUMBER: _ClassVar[int]
    READS_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    READS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    streaming_pulls: int
    waiting_updates: int
    buffers_lent: int
    staged_updates: bool
    retired_buffers: int
    waiting_for_buffer: int
    streams_open: int
    streams_cancelled: int
    streams_refused: int
    read_limit_bytes: int
    read_bytes: int
    read_bytes_peak: int
    reads_waiting: int
    reads_queued: int
    reads_expired: int
    reads_refused: int
    def __init__(self, streaming_pulls: _Optional[int] = ..., waiting_updates: _Optional[int] = ..., buffers_lent: _Optional[int] = ..., staged_updates: _Optional[bool] = ..., retired_buffers: _Optional[int] = ..., waiting_for_buffer: _Optional[int] = ..., streams_open: _Optional[int] = ..., streams_cancelled: _Optional[int] = ..., streams_refused: _Optional[int] = ..., read_limit_bytes: _Optional[int] = ..., read_bytes: _Optional[int] = ..., read_bytes_peak: _Optional[int] = ..., reads_waiting: _Optional[int] = ..., reads_queued: _Optional[int] = ..., reads_expired: _Optional[int] = ..., reads_refused: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("rank", "fingerprint", "incarnation")
    RANK_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    rank: int
    fingerprint: str
    incarnation: int
    def __init__(self, rank: _Optional[int] = ..., fingerprint: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("rank", "fingerprint", "incarnation")
    RANK_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    rank: int
    fingerprint: str
    incarnation: int
    def __init__(self, rank: _Optional[int] = ..., fingerprint: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RollbackRequest(_message.Message):
    __slots__ = ("rank", "fingerprint", "version", "execute")
    RANK_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    fingerprint: str
    version: int
    execute: bool
    def __init__(self, rank: _Optional[int] = ..., fingerprint: _Optional[str] = ..., version: _Optional[int] = ..., execute: _Optional[bool] = ...) -> None: ...

class RollbackReply(_message.Message):
    __slots__ = ("version", "points")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    POINTS_FIELD_NUMBER: _ClassVar[int]
    version: int
    points: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, version: _Optional[int] = ..., points: _Optional[_Iterable[int]] = ...) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("role", "epoch", "backup", "replicated_version", "primary")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BACKUP_FIELD_NUMBER: _ClassVar[int]
    REPLICATED_VERSION_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_FIELD_NUMBER: _ClassVar[int]
    role: str
    epoch: int
    backup: str
    replicated_version: int
    primary: str
    def __init__(self, role: _Optional[str] = ..., epoch: _Optional[int] = ..., backup: _Optional[str] = ..., replicated_version: _Optional[int] = ..., primary: _Optional[str] = ...) -> None: ...

class ReplicaAttachRequest(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...

class ReplicaAttachReply(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...

class ReplicaHeader(_message.Message):
    __slots__ = ("epoch", "version", "kind", "lr_scale", "members", "nbytes", "manifest", "primary", "lr", "job_lr", "job_lr_clock", "rows", "counters", "unused", "unused_tables")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LR_SCALE_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    JOB_LR_FIELD_NUMBER: _ClassVar[int]
    JOB_LR_CLOCK_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    UNUSED_FIELD_NUMBER: _ClassVar[int]
    UNUSED_TABLES_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    version: int
    kind: str
    lr_scale: float
    members: bytes
    nbytes: int
    manifest: bytes
    primary: str
    lr: float
    job_lr: float
    job_lr_clock: int
    rows: _containers.RepeatedCompositeFieldContainer[TableRows]
    counters: bytes
    unused: bytes
    unused_tables: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, epoch: _Optional[int] = ..., version: _Optional[int] = ..., kind: _Optional[str] = ..., lr_scale: _Optional[float] = ..., members: _Optional[bytes] = ..., nbytes: _Optional[int] = ..., manifest: _Optional[bytes] = ..., primary: _Optional[str] = ..., lr: _Optional[float] = ..., job_lr: _Optional[float] = ..., job_lr_clock: _Optional[int] = ..., rows: _Optional[_Iterable[_Union[TableRows, _Mapping]]] = ..., counters: _Optional[bytes] = ..., unused: _Optional[bytes] = ..., unused_tables: _Optional[_Iterable[str]] = ...) -> None: ...

class ReplicaFrame(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: ReplicaHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[ReplicaHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReplicaReply(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class FenceRequest(_message.Message):
    __slots__ = ("epoch", "dropped")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    dropped: bool
    def __init__(self, epoch: _Optional[int] = ..., dropped: _Optional[bool] = ...) -> None: ...

class FenceReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
