from trainguard.proto.trainguard.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DetectorState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DETECTOR_STATE_UNSPECIFIED: _ClassVar[DetectorState]
    DETECTOR_STATE_OK: _ClassVar[DetectorState]
    DETECTOR_STATE_DEGRADED: _ClassVar[DetectorState]
    DETECTOR_STATE_FAILED: _ClassVar[DetectorState]
    DETECTOR_STATE_NO_HARDWARE: _ClassVar[DetectorState]
    DETECTOR_STATE_ERROR: _ClassVar[DetectorState]

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_STARTING: _ClassVar[WorkerState]
    WORKER_STATE_RUNNING: _ClassVar[WorkerState]
    WORKER_STATE_SUCCEEDED: _ClassVar[WorkerState]
    WORKER_STATE_FAILED: _ClassVar[WorkerState]
    WORKER_STATE_STOPPED: _ClassVar[WorkerState]
    WORKER_STATE_HUNG: _ClassVar[WorkerState]

class AdvisoryKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ADVISORY_KIND_UNSPECIFIED: _ClassVar[AdvisoryKind]
    ADVISORY_KIND_CHECKPOINT_NOW: _ClassVar[AdvisoryKind]
    ADVISORY_KIND_STOP: _ClassVar[AdvisoryKind]
DETECTOR_STATE_UNSPECIFIED: DetectorState
DETECTOR_STATE_OK: DetectorState
DETECTOR_STATE_DEGRADED: DetectorState
DETECTOR_STATE_FAILED: DetectorState
DETECTOR_STATE_NO_HARDWARE: DetectorState
DETECTOR_STATE_ERROR: DetectorState
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_STARTING: WorkerState
WORKER_STATE_RUNNING: WorkerState
WORKER_STATE_SUCCEEDED: WorkerState
WORKER_STATE_FAILED: WorkerState
WORKER_STATE_STOPPED: WorkerState
WORKER_STATE_HUNG: WorkerState
ADVISORY_KIND_UNSPECIFIED: AdvisoryKind
ADVISORY_KIND_CHECKPOINT_NOW: AdvisoryKind
ADVISORY_KIND_STOP: AdvisoryKind

class GetHealthRequest(_message.Message):
    __slots__ = ("max_events",)
    MAX_EVENTS_FIELD_NUMBER: _ClassVar[int]
    max_events: int
    def __init__(self, max_events: _Optional[int] = ...) -> None: ...

class DetectorStatus(_message.Message):
    __slots__ = ("name", "state", "detail", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: DetectorState
    detail: str
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, name: _Optional[str] = ..., state: _Optional[_Union[DetectorState, str]] = ..., detail: _Optional[str] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("rank", "local_rank", "pid", "state", "step", "last_heartbeat_age_s", "exit_code")
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    local_rank: int
    pid: int
    state: WorkerState
    step: int
    last_heartbeat_age_s: float
    exit_code: int
    def __init__(self, rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., pid: _Optional[int] = ..., state: _Optional[_Union[WorkerState, str]] = ..., step: _Optional[int] = ..., last_heartbeat_age_s: _Optional[float] = ..., exit_code: _Optional[int] = ...) -> None: ...

class NodeHealth(_message.Message):
    __slots__ = ("node_id", "version", "uptime_s", "detectors", "recent_events", "predictor_score", "predictor_threshold", "workers", "job", "generation", "last_checkpoint_step", "failslow", "replica_bytes", "replica_limit_bytes", "replica_buddies", "subsystem_details")
    class SubsystemDetailsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    DETECTORS_FIELD_NUMBER: _ClassVar[int]
    RECENT_EVENTS_FIELD_NUMBER: _ClassVar[int]
    PREDICTOR_SCORE_FIELD_NUMBER: _ClassVar[int]
    PREDICTOR_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    FAILSLOW_FIELD_NUMBER: _ClassVar[int]
    REPLICA_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLICA_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLICA_BUDDIES_FIELD_NUMBER: _ClassVar[int]
    SUBSYSTEM_DETAILS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    version: str
    uptime_s: float
    detectors: _containers.RepeatedCompositeFieldContainer[DetectorStatus]
    recent_events: _containers.RepeatedCompositeFieldContainer[_common_pb2.HealthEvent]
    predictor_score: float
    predictor_threshold: float
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    job: str
    generation: int
    last_checkpoint_step: int
    failslow: _common_pb2.FailSlowStatus
    replica_bytes: int
    replica_limit_bytes: int
    replica_buddies: _containers.RepeatedScalarFieldContainer[str]
    subsystem_details: _containers.ScalarMap[str, str]
    def __init__(self, node_id: _Optional[str] = ..., version: _Optional[str] = ..., uptime_s: _Optional[float] = ..., detectors: _Optional[_Iterable[_Union[DetectorStatus, _Mapping]]] = ..., recent_events: _Optional[_Iterable[_Union[_common_pb2.HealthEvent, _Mapping]]] = ..., predictor_score: _Optional[float] = ..., predictor_threshold: _Optional[float] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., job: _Optional[str] = ..., generation: _Optional[int] = ..., last_checkpoint_step: _Optional[int] = ..., failslow: _Optional[_Union[_common_pb2.FailSlowStatus, _Mapping]] = ..., replica_bytes: _Optional[int] = ..., replica_limit_bytes: _Optional[int] = ..., replica_buddies: _Optional[_Iterable[str]] = ..., subsystem_details: _Optional[_Mapping[str, str]] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("replay", "min_severity")
    REPLAY_FIELD_NUMBER: _ClassVar[int]
    MIN_SEVERITY_FIELD_NUMBER: _ClassVar[int]
    replay: int
    min_severity: _common_pb2.Severity
    def __init__(self, replay: _Optional[int] = ..., min_severity: _Optional[_Union[_common_pb2.Severity, str]] = ...) -> None: ...

class WorkerHeartbeatRequest(_message.Message):
    __slots__ = ("rank", "pid", "generation", "step", "step_time_s", "finished", "section_s", "acked_advisory_ids", "acks_advisories")
    class SectionSEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    SECTION_S_FIELD_NUMBER: _ClassVar[int]
    ACKED_ADVISORY_IDS_FIELD_NUMBER: _ClassVar[int]
    ACKS_ADVISORIES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    pid: int
    generation: int
    step: int
    step_time_s: float
    finished: bool
    section_s: _containers.ScalarMap[str, float]
    acked_advisory_ids: _containers.RepeatedScalarFieldContainer[str]
    acks_advisories: bool
    def __init__(self, rank: _Optional[int] = ..., pid: _Optional[int] = ..., generation: _Optional[int] = ..., step: _Optional[int] = ..., step_time_s: _Optional[float] = ..., finished: _Optional[bool] = ..., section_s: _Optional[_Mapping[str, float]] = ..., acked_advisory_ids: _Optional[_Iterable[str]] = ..., acks_advisories: _Optional[bool] = ...) -> None: ...

class Advisory(_message.Message):
    __slots__ = ("kind", "reason", "advisory_id", "at_step")
    KIND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ADVISORY_ID_FIELD_NUMBER: _ClassVar[int]
    AT_STEP_FIELD_NUMBER: _ClassVar[int]
    kind: AdvisoryKind
    reason: str
    advisory_id: str
    at_step: int
    def __init__(self, kind: _Optional[_Union[AdvisoryKind, str]] = ..., reason: _Optional[str] = ..., advisory_id: _Optional[str] = ..., at_step: _Optional[int] = ...) -> None: ...

class WorkerHeartbeatResponse(_message.Message):
    __slots__ = ("advisories", "generation")
    ADVISORIES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    advisories: _containers.RepeatedCompositeFieldContainer[Advisory]
    generation: int
    def __init__(self, advisories: _Optional[_Iterable[_Union[Advisory, _Mapping]]] = ..., generation: _Optional[int] = ...) -> None: ...

class CheckpointReport(_message.Message):
    __slots__ = ("rank", "step", "tier", "bytes", "stall_s", "persist_s")
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    STALL_S_FIELD_NUMBER: _ClassVar[int]
    PERSIST_S_FIELD_NUMBER: _ClassVar[int]
    rank: int
    step: int
    tier: str
    bytes: int
    stall_s: float
    persist_s: float
    def __init__(self, rank: _Optional[int] = ..., step: _Optional[int] = ..., tier: _Optional[str] = ..., bytes: _Optional[int] = ..., stall_s: _Optional[float] = ..., persist_s: _Optional[float] = ...) -> None: ...

class CheckpointReportResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AttachJobRequest(_message.Message):
    __slots__ = ("job", "coordinator", "node_id", "launcher_pid", "arena_root", "token", "tls_ca_file", "tls_cert_file", "tls_key_file", "launcher_lock", "tls_ca_pem", "tls_cert_pem", "tls_key_pem", "tls_server_name")
    JOB_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LAUNCHER_PID_FIELD_NUMBER: _ClassVar[int]
    ARENA_ROOT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TLS_CA_FILE_FIELD_NUMBER: _ClassVar[int]
    TLS_CERT_FILE_FIELD_NUMBER: _ClassVar[int]
    TLS_KEY_FILE_FIELD_NUMBER: _ClassVar[int]
    LAUNCHER_LOCK_FIELD_NUMBER: _ClassVar[int]
    TLS_CA_PEM_FIELD_NUMBER: _ClassVar[int]
    TLS_CERT_PEM_FIELD_NUMBER: _ClassVar[int]
    TLS_KEY_PEM_FIELD_NUMBER: _ClassVar[int]
    TLS_SERVER_NAME_FIELD_NUMBER: _ClassVar[int]
    job: str
    coordinator: str
    node_id: str
    launcher_pid: int
    arena_root: str
    token: str
    tls_ca_file: str
    tls_cert_file: str
    tls_key_file: str
    launcher_lock: str
    tls_ca_pem: bytes
    tls_cert_pem: bytes
    tls_key_pem: bytes
    tls_server_name: str
    def __init__(self, job: _Optional[str] = ..., coordinator: _Optional[str] = ..., node_id: _Optional[str] = ..., launcher_pid: _Optional[int] = ..., arena_root: _Optional[str] = ..., token: _Optional[str] = ..., tls_ca_file: _Optional[str] = ..., tls_cert_file: _Optional[str] = ..., tls_key_file: _Optional[str] = ..., launcher_lock: _Optional[str] = ..., tls_ca_pem: _Optional[bytes] = ..., tls_cert_pem: _Optional[bytes] = ..., tls_key_pem: _Optional[bytes] = ..., tls_server_name: _Optional[str] = ...) -> None: ...

class AttachJobResponse(_message.Message):
    __slots__ = ("node_id", "arena_kept", "arena_ttl_s")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ARENA_KEPT_FIELD_NUMBER: _ClassVar[int]
    ARENA_TTL_S_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    arena_kept: bool
    arena_ttl_s: float
    def __init__(self, node_id: _Optional[str] = ..., arena_kept: _Optional[bool] = ..., arena_ttl_s: _Optional[float] = ...) -> None: ...

class DetachJobRequest(_message.Message):
    __slots__ = ("job", "ended", "launcher_pid", "launcher_lock")
    JOB_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    LAUNCHER_PID_FIELD_NUMBER: _ClassVar[int]
    LAUNCHER_LOCK_FIELD_NUMBER: _ClassVar[int]
    job: str
    ended: bool
    launcher_pid: int
    launcher_lock: str
    def __init__(self, job: _Optional[str] = ..., ended: _Optional[bool] = ..., launcher_pid: _Optional[int] = ..., launcher_lock: _Optional[str] = ...) -> None: ...

class DetachJobResponse(_message.Message):
    __slots__ = ("arena_removed",)
    ARENA_REMOVED_FIELD_NUMBER: _ClassVar[int]
    arena_removed: bool
    def __init__(self, arena_removed: _Optional[bool] = ...) -> None: ...
