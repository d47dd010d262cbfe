from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    INT64: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT8: _ClassVar[DType]
    UINT8: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT64: DType
FLOAT16: DType
BFLOAT16: DType
INT64: DType
INT32: DType
INT8: DType
UINT8: DType

class PartSpec(_message.Message):
    __slots__ = ("name", "full_shape", "dtype", "row_start", "row_end")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FULL_SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ROW_START_FIELD_NUMBER: _ClassVar[int]
    ROW_END_FIELD_NUMBER: _ClassVar[int]
    name: str
    full_shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    row_start: int
    row_end: int
    def __init__(self, name: _Optional[str] = ..., full_shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., row_start: _Optional[int] = ..., row_end: _Optional[int] = ...) -> None: ...

class OptimizerSettings(_message.Message):
    __slots__ = ("name", "lr", "momentum", "dampening", "nesterov", "weight_decay", "beta1", "beta2", "eps", "amsgrad", "lr_decay", "initial_accumulator_value", "warmup_steps", "decay_steps", "min_lr_ratio")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    DAMPENING_FIELD_NUMBER: _ClassVar[int]
    NESTEROV_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    AMSGRAD_FIELD_NUMBER: _ClassVar[int]
    LR_DECAY_FIELD_NUMBER: _ClassVar[int]
    INITIAL_ACCUMULATOR_VALUE_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    DECAY_STEPS_FIELD_NUMBER: _ClassVar[int]
    MIN_LR_RATIO_FIELD_NUMBER: _ClassVar[int]
    name: str
    lr: float
    momentum: float
    dampening: float
    nesterov: bool
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    amsgrad: bool
    lr_decay: float
    initial_accumulator_value: float
    warmup_steps: int
    decay_steps: int
    min_lr_ratio: float
    def __init__(self, name: _Optional[str] = ..., lr: _Optional[float] = ..., momentum: _Optional[float] = ..., dampening: _Optional[float] = ..., nesterov: _Optional[bool] = ..., weight_decay: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., amsgrad: _Optional[bool] = ..., lr_decay: _Optional[float] = ..., initial_accumulator_value: _Optional[float] = ..., warmup_steps: _Optional[int] = ..., decay_steps: _Optional[int] = ..., min_lr_ratio: _Optional[float] = ...) -> None: ...

class ConsistencySettings(_message.Message):
    __slots__ = ("mode", "staleness", "backup_workers", "stale_policy")
    MODE_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    BACKUP_WORKERS_FIELD_NUMBER: _ClassVar[int]
    STALE_POLICY_FIELD_NUMBER: _ClassVar[int]
    mode: str
    staleness: int
    backup_workers: int
    stale_policy: str
    def __init__(self, mode: _Optional[str] = ..., staleness: _Optional[int] = ..., backup_workers: _Optional[int] = ..., stale_policy: _Optional[str] = ...) -> None: ...

class TableSpec(_message.Message):
    __slots__ = ("name", "num_rows", "dim", "optimizer", "init", "init_scale", "seed")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    INIT_FIELD_NUMBER: _ClassVar[int]
    INIT_SCALE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_rows: int
    dim: int
    optimizer: OptimizerSettings
    init: str
    init_scale: float
    seed: int
    def __init__(self, name: _Optional[str] = ..., num_rows: _Optional[int] = ..., dim: _Optional[int] = ..., optimizer: _Optional[_Union[OptimizerSettings, _Mapping]] = ..., init: _Optional[str] = ..., init_scale: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class RowBlock(_message.Message):
    __slots__ = ("table", "ids", "values")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    values: bytes
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ..., values: _Optional[bytes] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker_name", "shard_index", "num_shards", "placement_digest", "parts", "optimizer", "job_fingerprint", "consistency", "session", "tables")
    WORKER_NAME_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    JOB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CONSISTENCY_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    worker_name: str
    shard_index: int
    num_shards: int
    placement_digest: str
    parts: _containers.RepeatedCompositeFieldContainer[PartSpec]
    optimizer: OptimizerSettings
    job_fingerprint: str
    consistency: ConsistencySettings
    session: bytes
    tables: _containers.RepeatedCompositeFieldContainer[TableSpec]
    def __init__(self, worker_name: _Optional[str] = ..., shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., placement_digest: _Optional[str] = ..., parts: _Optional[_Iterable[_Union[PartSpec, _Mapping]]] = ..., optimizer: _Optional[_Union[OptimizerSettings, _Mapping]] = ..., job_fingerprint: _Optional[str] = ..., consistency: _Optional[_Union[ConsistencySettings, _Mapping]] = ..., session: _Optional[bytes] = ..., tables: _Optional[_Iterable[_Union[TableSpec, _Mapping]]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("worker_id", "generation", "must_initialize", "version", "clock", "consistency", "lease_seconds", "data", "bulk_port", "session", "workers_live")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    MUST_INITIALIZE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    CONSISTENCY_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    BULK_PORT_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    WORKERS_LIVE_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    generation: int
    must_initialize: bool
    version: int
    clock: int
    consistency: ConsistencySettings
    lease_seconds: float
    data: DataPosition
    bulk_port: int
    session: bytes
    workers_live: int
    def __init__(self, worker_id: _Optional[int] = ..., generation: _Optional[int] = ..., must_initialize: _Optional[bool] = ..., version: _Optional[int] = ..., clock: _Optional[int] = ..., consistency: _Optional[_Union[ConsistencySettings, _Mapping]] = ..., lease_seconds: _Optional[float] = ..., data: _Optional[_Union[DataPosition, _Mapping]] = ..., bulk_port: _Optional[int] = ..., session: _Optional[bytes] = ..., workers_live: _Optional[int] = ...) -> None: ...

class DataPosition(_message.Message):
    __slots__ = ("step", "epoch", "position")
    STEP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    step: int
    epoch: int
    position: int
    def __init__(self, step: _Optional[int] = ..., epoch: _Optional[int] = ..., position: _Optional[int] = ...) -> None: ...

class TensorHeader(_message.Message):
    __slots__ = ("worker_id", "generation", "sequence", "base_version", "parts", "clock", "base_clock", "data", "wire_dtype", "session", "rows")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    BASE_CLOCK_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    generation: int
    sequence: int
    base_version: int
    parts: _containers.RepeatedCompositeFieldContainer[PartSpec]
    clock: int
    base_clock: int
    data: DataPosition
    wire_dtype: DType
    session: bytes
    rows: _containers.RepeatedCompositeFieldContainer[RowBlock]
    def __init__(self, worker_id: _Optional[int] = ..., generation: _Optional[int] = ..., sequence: _Optional[int] = ..., base_version: _Optional[int] = ..., parts: _Optional[_Iterable[_Union[PartSpec, _Mapping]]] = ..., clock: _Optional[int] = ..., base_clock: _Optional[int] = ..., data: _Optional[_Union[DataPosition, _Mapping]] = ..., wire_dtype: _Optional[_Union[DType, str]] = ..., session: _Optional[bytes] = ..., rows: _Optional[_Iterable[_Union[RowBlock, _Mapping]]] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("part_index", "offset", "data")
    PART_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    part_index: int
    offset: int
    data: bytes
    def __init__(self, part_index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class TensorMessage(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: TensorHeader
    chunk: TensorChunk
    def __init__(self, header: _Optional[_Union[TensorHeader, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class InlinePush(_message.Message):
    __slots__ = ("header", "data", "bulk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    BULK_FIELD_NUMBER: _ClassVar[int]
    header: TensorHeader
    data: _containers.RepeatedScalarFieldContainer[bytes]
    bulk: BulkRef
    def __init__(self, header: _Optional[_Union[TensorHeader, _Mapping]] = ..., data: _Optional[_Iterable[bytes]] = ..., bulk: _Optional[_Union[BulkRef, _Mapping]] = ...) -> None: ...

class BulkRef(_message.Message):
    __slots__ = ("lane", "token", "nbytes")
    LANE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    lane: int
    token: int
    nbytes: int
    def __init__(self, lane: _Optional[int] = ..., token: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class InitializeResponse(_message.Message):
    __slots__ = ("applied", "version")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    applied: bool
    version: int
    def __init__(self, applied: _Optional[bool] = ..., version: _Optional[int] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("version", "staleness", "action")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    version: int
    staleness: int
    action: str
    def __init__(self, version: _Optional[int] = ..., staleness: _Optional[int] = ..., action: _Optional[str] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("worker_id", "generation", "session")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    generation: int
    session: bytes
    def __init__(self, worker_id: _Optional[int] = ..., generation: _Optional[int] = ..., session: _Optional[bytes] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("checkpoint_id",)
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: int
    def __init__(self, checkpoint_id: _Optional[int] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("checkpoint_id", "path", "version", "complete")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: int
    path: str
    version: int
    complete: bool
    def __init__(self, checkpoint_id: _Optional[int] = ..., path: _Optional[str] = ..., version: _Optional[int] = ..., complete: _Optional[bool] = ...) -> None: ...

class EndJobRequest(_message.Message):
    __slots__ = ("checkpoint_id", "job_fingerprint")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: int
    job_fingerprint: str
    def __init__(self, checkpoint_id: _Optional[int] = ..., job_fingerprint: _Optional[str] = ...) -> None: ...

class EndJobResponse(_message.Message):
    __slots__ = ("ended", "job_fingerprint", "version", "workers_live", "checkpoint_path", "checkpoint_complete")
    ENDED_FIELD_NUMBER: _ClassVar[int]
    JOB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    WORKERS_LIVE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_PATH_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    ended: bool
    job_fingerprint: str
    version: int
    workers_live: int
    checkpoint_path: str
    checkpoint_complete: bool
    def __init__(self, ended: _Optional[bool] = ..., job_fingerprint: _Optional[str] = ..., version: _Optional[int] = ..., workers_live: _Optional[int] = ..., checkpoint_path: _Optional[str] = ..., checkpoint_complete: _Optional[bool] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "generation", "session")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    generation: int
    session: bytes
    def __init__(self, worker_id: _Optional[int] = ..., generation: _Optional[int] = ..., session: _Optional[bytes] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_seconds",)
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    lease_seconds: float
    def __init__(self, lease_seconds: _Optional[float] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("worker_id", "generation", "known_versions", "clock", "wire_dtype", "bulk", "session")
    class KnownVersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    KNOWN_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BULK_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    generation: int
    known_versions: _containers.ScalarMap[str, int]
    clock: int
    wire_dtype: DType
    bulk: BulkRef
    session: bytes
    def __init__(self, worker_id: _Optional[int] = ..., generation: _Optional[int] = ..., known_versions: _Optional[_Mapping[str, int]] = ..., clock: _Optional[int] = ..., wire_dtype: _Optional[_Union[DType, str]] = ..., bulk: _Optional[_Union[BulkRef, _Mapping]] = ..., session: _Optional[bytes] = ...) -> None: ...

class PulledPart(_message.Message):
    __slots__ = ("spec", "version", "included")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INCLUDED_FIELD_NUMBER: _ClassVar[int]
    spec: PartSpec
    version: int
    included: bool
    def __init__(self, spec: _Optional[_Union[PartSpec, _Mapping]] = ..., version: _Optional[int] = ..., included: _Optional[bool] = ...) -> None: ...

class PullHeader(_message.Message):
    __slots__ = ("version", "clock", "parts", "wire_dtype")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    version: int
    clock: int
    parts: _containers.RepeatedCompositeFieldContainer[PulledPart]
    wire_dtype: DType
    def __init__(self, version: _Optional[int] = ..., clock: _Optional[int] = ..., parts: _Optional[_Iterable[_Union[PulledPart, _Mapping]]] = ..., wire_dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class PullMessage(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PullHeader
    chunk: TensorChunk
    def __init__(self, header: _Optional[_Union[PullHeader, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class PullRowsRequest(_message.Message):
    __slots__ = ("worker_id", "generation", "session", "clock", "rows")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    generation: int
    session: bytes
    clock: int
    rows: _containers.RepeatedCompositeFieldContainer[RowBlock]
    def __init__(self, worker_id: _Optional[int] = ..., generation: _Optional[int] = ..., session: _Optional[bytes] = ..., clock: _Optional[int] = ..., rows: _Optional[_Iterable[_Union[RowBlock, _Mapping]]] = ...) -> None: ...

class PullRowsResponse(_message.Message):
    __slots__ = ("version", "clock", "rows")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    version: int
    clock: int
    rows: _containers.RepeatedCompositeFieldContainer[RowBlock]
    def __init__(self, version: _Optional[int] = ..., clock: _Optional[int] = ..., rows: _Optional[_Iterable[_Union[RowBlock, _Mapping]]] = ...) -> None: ...

class TableStatus(_message.Message):
    __slots__ = ("spec", "rows_held", "rows_written", "rows_pushed", "rows_pulled", "step", "bytes_resident")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    ROWS_HELD_FIELD_NUMBER: _ClassVar[int]
    ROWS_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    ROWS_PUSHED_FIELD_NUMBER: _ClassVar[int]
    ROWS_PULLED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    BYTES_RESIDENT_FIELD_NUMBER: _ClassVar[int]
    spec: TableSpec
    rows_held: int
    rows_written: int
    rows_pushed: int
    rows_pulled: int
    step: int
    bytes_resident: int
    def __init__(self, spec: _Optional[_Union[TableSpec, _Mapping]] = ..., rows_held: _Optional[int] = ..., rows_written: _Optional[int] = ..., rows_pushed: _Optional[int] = ..., rows_pulled: _Optional[int] = ..., step: _Optional[int] = ..., bytes_resident: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "worker_name", "generation", "pushes", "last_seen_unix", "clock", "live", "evicted")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_NAME_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_UNIX_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    worker_name: str
    generation: int
    pushes: int
    last_seen_unix: float
    clock: int
    live: bool
    evicted: bool
    def __init__(self, worker_id: _Optional[int] = ..., worker_name: _Optional[str] = ..., generation: _Optional[int] = ..., pushes: _Optional[int] = ..., last_seen_unix: _Optional[float] = ..., clock: _Optional[int] = ..., live: _Optional[bool] = ..., evicted: _Optional[bool] = ...) -> None: ...

class StalenessBucket(_message.Message):
    __slots__ = ("staleness", "count")
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    staleness: int
    count: int
    def __init__(self, staleness: _Optional[int] = ..., count: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("address", "shard_index", "num_shards", "state", "version", "num_variables", "bytes_held", "optimizer_state_bytes", "optimizer", "workers", "pushes_applied", "pushes_rejected", "pulls_served", "max_staleness", "job_fingerprint", "parts", "uptime_seconds", "placement_digest", "pushes_received", "consistency", "clock", "pushes_dropped", "pushes_scaled", "staleness_histogram", "pulls_waiting", "pull_wait_seconds", "workers_evicted", "lease_seconds", "last_checkpoint_id", "last_checkpoint_path", "checkpoint_dir", "push_bytes_in_flight", "push_bytes_in_flight_peak", "max_inflight_bytes", "updates_nonfinite", "data", "tables")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_VARIABLES_FIELD_NUMBER: _ClassVar[int]
    BYTES_HELD_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    PUSHES_APPLIED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    PULLS_SERVED_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    JOB_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PUSHES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    CONSISTENCY_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    PUSHES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    PUSHES_SCALED_FIELD_NUMBER: _ClassVar[int]
    STALENESS_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    PULLS_WAITING_FIELD_NUMBER: _ClassVar[int]
    PULL_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_EVICTED_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_PATH_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_DIR_FIELD_NUMBER: _ClassVar[int]
    PUSH_BYTES_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    PUSH_BYTES_IN_FLIGHT_PEAK_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    UPDATES_NONFINITE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    address: str
    shard_index: int
    num_shards: int
    state: str
    version: int
    num_variables: int
    bytes_held: int
    optimizer_state_bytes: int
    optimizer: OptimizerSettings
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    pushes_applied: int
    pushes_rejected: int
    pulls_served: int
    max_staleness: int
    job_fingerprint: str
    parts: _containers.RepeatedCompositeFieldContainer[PartSpec]
    uptime_seconds: float
    placement_digest: str
    pushes_received: int
    consistency: ConsistencySettings
    clock: int
    pushes_dropped: int
    pushes_scaled: int
    staleness_histogram: _containers.RepeatedCompositeFieldContainer[StalenessBucket]
    pulls_waiting: int
    pull_wait_seconds: float
    workers_evicted: int
    lease_seconds: float
    last_checkpoint_id: int
    last_checkpoint_path: str
    checkpoint_dir: str
    push_bytes_in_flight: int
    push_bytes_in_flight_peak: int
    max_inflight_bytes: int
    updates_nonfinite: int
    data: DataQueueStatus
    tables: _containers.RepeatedCompositeFieldContainer[TableStatus]
    def __init__(self, address: _Optional[str] = ..., shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., state: _Optional[str] = ..., version: _Optional[int] = ..., num_variables: _Optional[int] = ..., bytes_held: _Optional[int] = ..., optimizer_state_bytes: _Optional[int] = ..., optimizer: _Optional[_Union[OptimizerSettings, _Mapping]] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., pushes_applied: _Optional[int] = ..., pushes_rejected: _Optional[int] = ..., pulls_served: _Optional[int] = ..., max_staleness: _Optional[int] = ..., job_fingerprint: _Optional[str] = ..., parts: _Optional[_Iterable[_Union[PartSpec, _Mapping]]] = ..., uptime_seconds: _Optional[float] = ..., placement_digest: _Optional[str] = ..., pushes_received: _Optional[int] = ..., consistency: _Optional[_Union[ConsistencySettings, _Mapping]] = ..., clock: _Optional[int] = ..., pushes_dropped: _Optional[int] = ..., pushes_scaled: _Optional[int] = ..., staleness_histogram: _Optional[_Iterable[_Union[StalenessBucket, _Mapping]]] = ..., pulls_waiting: _Optional[int] = ..., pull_wait_seconds: _Optional[float] = ..., workers_evicted: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., last_checkpoint_id: _Optional[int] = ..., last_checkpoint_path: _Optional[str] = ..., checkpoint_dir: _Optional[str] = ..., push_bytes_in_flight: _Optional[int] = ..., push_bytes_in_flight_peak: _Optional[int] = ..., max_inflight_bytes: _Optional[int] = ..., updates_nonfinite: _Optional[int] = ..., data: _Optional[_Union[DataQueueStatus, _Mapping]] = ..., tables: _Optional[_Iterable[_Union[TableStatus, _Mapping]]] = ...) -> None: ...

class DataPlan(_message.Message):
    __slots__ = ("examples", "task_size", "seed", "total")
    EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    TASK_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    examples: int
    task_size: int
    seed: int
    total: int
    def __init__(self, examples: _Optional[int] = ..., task_size: _Optional[int] = ..., seed: _Optional[int] = ..., total: _Optional[int] = ...) -> None: ...

class DataTask(_message.Message):
    __slots__ = ("epoch", "start", "end", "trained")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    TRAINED_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    start: int
    end: int
    trained: int
    def __init__(self, epoch: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., trained: _Optional[int] = ...) -> None: ...

class DataRequest(_message.Message):
    __slots__ = ("worker_id", "generation", "session", "plan", "finished", "want")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    WANT_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    generation: int
    session: bytes
    plan: DataPlan
    finished: _containers.RepeatedCompositeFieldContainer[DataTask]
    want: int
    def __init__(self, worker_id: _Optional[int] = ..., generation: _Optional[int] = ..., session: _Optional[bytes] = ..., plan: _Optional[_Union[DataPlan, _Mapping]] = ..., finished: _Optional[_Iterable[_Union[DataTask, _Mapping]]] = ..., want: _Optional[int] = ...) -> None: ...

class DataResponse(_message.Message):
    __slots__ = ("tasks", "plan", "queue")
    TASKS_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[DataTask]
    plan: DataPlan
    queue: DataQueueStatus
    def __init__(self, tasks: _Optional[_Iterable[_Union[DataTask, _Mapping]]] = ..., plan: _Optional[_Union[DataPlan, _Mapping]] = ..., queue: _Optional[_Union[DataQueueStatus, _Mapping]] = ...) -> None: ...

class DataHolder(_message.Message):
    __slots__ = ("worker_name", "generation", "task")
    WORKER_NAME_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    worker_name: str
    generation: int
    task: DataTask
    def __init__(self, worker_name: _Optional[str] = ..., generation: _Optional[int] = ..., task: _Optional[_Union[DataTask, _Mapping]] = ...) -> None: ...

class DataQueueStatus(_message.Message):
    __slots__ = ("active", "epoch", "tasks_done", "tasks_leased", "tasks_queued", "examples_done", "examples_total", "finished", "holders", "tasks_requeued", "plan")
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TASKS_DONE_FIELD_NUMBER: _ClassVar[int]
    TASKS_LEASED_FIELD_NUMBER: _ClassVar[int]
    TASKS_QUEUED_FIELD_NUMBER: _ClassVar[int]
    EXAMPLES_DONE_FIELD_NUMBER: _ClassVar[int]
    EXAMPLES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    TASKS_REQUEUED_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    active: bool
    epoch: int
    tasks_done: int
    tasks_leased: int
    tasks_queued: int
    examples_done: int
    examples_total: int
    finished: bool
    holders: _containers.RepeatedCompositeFieldContainer[DataHolder]
    tasks_requeued: int
    plan: DataPlan
    def __init__(self, active: _Optional[bool] = ..., epoch: _Optional[int] = ..., tasks_done: _Optional[int] = ..., tasks_leased: _Optional[int] = ..., tasks_queued: _Optional[int] = ..., examples_done: _Optional[int] = ..., examples_total: _Optional[int] = ..., finished: _Optional[bool] = ..., holders: _Optional[_Iterable[_Union[DataHolder, _Mapping]]] = ..., tasks_requeued: _Optional[int] = ..., plan: _Optional[_Union[DataPlan, _Mapping]] = ...) -> None: ...

class InlinePull(_message.Message):
    __slots__ = ("header", "data", "bulk_bytes")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    BULK_BYTES_FIELD_NUMBER: _ClassVar[int]
    header: PullHeader
    data: _containers.RepeatedScalarFieldContainer[bytes]
    bulk_bytes: int
    def __init__(self, header: _Optional[_Union[PullHeader, _Mapping]] = ..., data: _Optional[_Iterable[bytes]] = ..., bulk_bytes: _Optional[int] = ...) -> None: ...

class PushPullRequest(_message.Message):
    __slots__ = ("push", "pull", "rows", "data")
    PUSH_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    push: InlinePush
    pull: PullRequest
    rows: PullRowsRequest
    data: DataRequest
    def __init__(self, push: _Optional[_Union[InlinePush, _Mapping]] = ..., pull: _Optional[_Union[PullRequest, _Mapping]] = ..., rows: _Optional[_Union[PullRowsRequest, _Mapping]] = ..., data: _Optional[_Union[DataRequest, _Mapping]] = ...) -> None: ...

class DataRefusal(_message.Message):
    __slots__ = ("code", "details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class PushPullResponse(_message.Message):
    __slots__ = ("push", "pull", "rows", "data", "data_refused")
    PUSH_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DATA_REFUSED_FIELD_NUMBER: _ClassVar[int]
    push: PushResponse
    pull: InlinePull
    rows: PullRowsResponse
    data: DataResponse
    data_refused: DataRefusal
    def __init__(self, push: _Optional[_Union[PushResponse, _Mapping]] = ..., pull: _Optional[_Union[InlinePull, _Mapping]] = ..., rows: _Optional[_Union[PullRowsResponse, _Mapping]] = ..., data: _Optional[_Union[DataResponse, _Mapping]] = ..., data_refused: _Optional[_Union[DataRefusal, _Mapping]] = ...) -> None: ...
