from trainguard.proto.trainguard.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeCommand(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_COMMAND_UNSPECIFIED: _ClassVar[NodeCommand]
    NODE_COMMAND_NONE: _ClassVar[NodeCommand]
    NODE_COMMAND_START: _ClassVar[NodeCommand]
    NODE_COMMAND_RESTART: _ClassVar[NodeCommand]
    NODE_COMMAND_STOP: _ClassVar[NodeCommand]
    NODE_COMMAND_WAIT: _ClassVar[NodeCommand]

class RestoreSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESTORE_SOURCE_UNSPECIFIED: _ClassVar[RestoreSource]
    RESTORE_SOURCE_LOCAL_MEMORY: _ClassVar[RestoreSource]
    RESTORE_SOURCE_PEER_MEMORY: _ClassVar[RestoreSource]
    RESTORE_SOURCE_STORAGE: _ClassVar[RestoreSource]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_FORMING: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_RECOVERING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]

class RecoveryLevel(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RECOVERY_LEVEL_UNSPECIFIED: _ClassVar[RecoveryLevel]
    RECOVERY_LEVEL_NONE: _ClassVar[RecoveryLevel]
    RECOVERY_LEVEL_PROCESS: _ClassVar[RecoveryLevel]
    RECOVERY_LEVEL_NODE: _ClassVar[RecoveryLevel]
    RECOVERY_LEVEL_JOB: _ClassVar[RecoveryLevel]

class NodeHealthVerdict(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_HEALTH_VERDICT_UNSPECIFIED: _ClassVar[NodeHealthVerdict]
    NODE_HEALTH_VERDICT_HEALTHY: _ClassVar[NodeHealthVerdict]
    NODE_HEALTH_VERDICT_DEGRADED: _ClassVar[NodeHealthVerdict]
    NODE_HEALTH_VERDICT_FATAL: _ClassVar[NodeHealthVerdict]
NODE_COMMAND_UNSPECIFIED: NodeCommand
NODE_COMMAND_NONE: NodeCommand
NODE_COMMAND_START: NodeCommand
NODE_COMMAND_RESTART: NodeCommand
NODE_COMMAND_STOP: NodeCommand
NODE_COMMAND_WAIT: NodeCommand
RESTORE_SOURCE_UNSPECIFIED: RestoreSource
RESTORE_SOURCE_LOCAL_MEMORY: RestoreSource
RESTORE_SOURCE_PEER_MEMORY: RestoreSource
RESTORE_SOURCE_STORAGE: RestoreSource
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_FORMING: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_RECOVERING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
RECOVERY_LEVEL_UNSPECIFIED: RecoveryLevel
RECOVERY_LEVEL_NONE: RecoveryLevel
RECOVERY_LEVEL_PROCESS: RecoveryLevel
RECOVERY_LEVEL_NODE: RecoveryLevel
RECOVERY_LEVEL_JOB: RecoveryLevel
NODE_HEALTH_VERDICT_UNSPECIFIED: NodeHealthVerdict
NODE_HEALTH_VERDICT_HEALTHY: NodeHealthVerdict
NODE_HEALTH_VERDICT_DEGRADED: NodeHealthVerdict
NODE_HEALTH_VERDICT_FATAL: NodeHealthVerdict

class RegisterNodeRequest(_message.Message):
    __slots__ = ("job", "node", "free_port", "agent_instance", "qualification")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    FREE_PORT_FIELD_NUMBER: _ClassVar[int]
    AGENT_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    QUALIFICATION_FIELD_NUMBER: _ClassVar[int]
    job: str
    node: _common_pb2.NodeInfo
    free_port: int
    agent_instance: str
    qualification: NodeQualification
    def __init__(self, job: _Optional[str] = ..., node: _Optional[_Union[_common_pb2.NodeInfo, _Mapping]] = ..., free_port: _Optional[int] = ..., agent_instance: _Optional[str] = ..., qualification: _Optional[_Union[NodeQualification, _Mapping]] = ...) -> None: ...

class RegisterNodeResponse(_message.Message):
    __slots__ = ("generation", "lease_id")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    generation: int
    lease_id: str
    def __init__(self, generation: _Optional[int] = ..., lease_id: _Optional[str] = ...) -> None: ...

class NodeHeartbeatRequest(_message.Message):
    __slots__ = ("job", "node_id", "lease_id", "generation", "workers_running", "last_step", "workers_succeeded", "free_port", "timings", "qualification", "link_probe_port", "link_results", "memory", "replica_address", "replica_bytes", "replica_holds_none")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WORKERS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    WORKERS_SUCCEEDED_FIELD_NUMBER: _ClassVar[int]
    FREE_PORT_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    QUALIFICATION_FIELD_NUMBER: _ClassVar[int]
    LINK_PROBE_PORT_FIELD_NUMBER: _ClassVar[int]
    LINK_RESULTS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLICA_HOLDS_NONE_FIELD_NUMBER: _ClassVar[int]
    job: str
    node_id: str
    lease_id: str
    generation: int
    workers_running: int
    last_step: int
    workers_succeeded: bool
    free_port: int
    timings: _containers.RepeatedCompositeFieldContainer[RankTiming]
    qualification: NodeQualification
    link_probe_port: int
    link_results: _containers.RepeatedCompositeFieldContainer[LinkProbeResult]
    memory: _containers.RepeatedCompositeFieldContainer[MemoryHolding]
    replica_address: str
    replica_bytes: int
    replica_holds_none: bool
    def __init__(self, job: _Optional[str] = ..., node_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., generation: _Optional[int] = ..., workers_running: _Optional[int] = ..., last_step: _Optional[int] = ..., workers_succeeded: _Optional[bool] = ..., free_port: _Optional[int] = ..., timings: _Optional[_Iterable[_Union[RankTiming, _Mapping]]] = ..., qualification: _Optional[_Union[NodeQualification, _Mapping]] = ..., link_probe_port: _Optional[int] = ..., link_results: _Optional[_Iterable[_Union[LinkProbeResult, _Mapping]]] = ..., memory: _Optional[_Iterable[_Union[MemoryHolding, _Mapping]]] = ..., replica_address: _Optional[str] = ..., replica_bytes: _Optional[int] = ..., replica_holds_none: _Optional[bool] = ...) -> None: ...

class NodeQualification(_message.Message):
    __slots__ = ("passed", "reason", "duration_s", "checks", "echo_port", "peer_s")
    PASSED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    CHECKS_FIELD_NUMBER: _ClassVar[int]
    ECHO_PORT_FIELD_NUMBER: _ClassVar[int]
    PEER_S_FIELD_NUMBER: _ClassVar[int]
    passed: bool
    reason: str
    duration_s: float
    checks: _containers.RepeatedCompositeFieldContainer[QualificationCheck]
    echo_port: int
    peer_s: float
    def __init__(self, passed: _Optional[bool] = ..., reason: _Optional[str] = ..., duration_s: _Optional[float] = ..., checks: _Optional[_Iterable[_Union[QualificationCheck, _Mapping]]] = ..., echo_port: _Optional[int] = ..., peer_s: _Optional[float] = ...) -> None: ...

class QualifyPeersRequest(_message.Message):
    __slots__ = ("job", "node_id", "count")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    job: str
    node_id: str
    count: int
    def __init__(self, job: _Optional[str] = ..., node_id: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class QualifyPeer(_message.Message):
    __slots__ = ("node_id", "address", "port")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    port: int
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., port: _Optional[int] = ...) -> None: ...

class QualifyPeersResponse(_message.Message):
    __slots__ = ("peers", "reference_s", "history")
    PEERS_FIELD_NUMBER: _ClassVar[int]
    REFERENCE_S_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    peers: _containers.RepeatedCompositeFieldContainer[QualifyPeer]
    reference_s: float
    history: int
    def __init__(self, peers: _Optional[_Iterable[_Union[QualifyPeer, _Mapping]]] = ..., reference_s: _Optional[float] = ..., history: _Optional[int] = ...) -> None: ...

class QualificationCheck(_message.Message):
    __slots__ = ("name", "status", "detail", "duration_s")
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    status: str
    detail: str
    duration_s: float
    def __init__(self, name: _Optional[str] = ..., status: _Optional[str] = ..., detail: _Optional[str] = ..., duration_s: _Optional[float] = ...) -> None: ...

class LinkProbeAsk(_message.Message):
    __slots__ = ("probe_id", "peer_node", "peer_address", "peer_port", "bytes", "timeout_s")
    PROBE_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_NODE_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PEER_PORT_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    probe_id: str
    peer_node: str
    peer_address: str
    peer_port: int
    bytes: int
    timeout_s: float
    def __init__(self, probe_id: _Optional[str] = ..., peer_node: _Optional[str] = ..., peer_address: _Optional[str] = ..., peer_port: _Optional[int] = ..., bytes: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class LinkProbeResult(_message.Message):
    __slots__ = ("probe_id", "peer_node", "bytes", "up_s", "down_s", "error")
    PROBE_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_NODE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    UP_S_FIELD_NUMBER: _ClassVar[int]
    DOWN_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    probe_id: str
    peer_node: str
    bytes: int
    up_s: float
    down_s: float
    error: str
    def __init__(self, probe_id: _Optional[str] = ..., peer_node: _Optional[str] = ..., bytes: _Optional[int] = ..., up_s: _Optional[float] = ..., down_s: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...

class MemoryHolding(_message.Message):
    __slots__ = ("step", "world_size", "ranks", "replica_ranks")
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_RANKS_FIELD_NUMBER: _ClassVar[int]
    step: int
    world_size: int
    ranks: _containers.RepeatedScalarFieldContainer[int]
    replica_ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, step: _Optional[int] = ..., world_size: _Optional[int] = ..., ranks: _Optional[_Iterable[int]] = ..., replica_ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class RankRestore(_message.Message):
    __slots__ = ("rank", "source", "peer_node", "peer_address", "alternates")
    RANK_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PEER_NODE_FIELD_NUMBER: _ClassVar[int]
    PEER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ALTERNATES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    source: RestoreSource
    peer_node: str
    peer_address: str
    alternates: _containers.RepeatedCompositeFieldContainer[PeerCopy]
    def __init__(self, rank: _Optional[int] = ..., source: _Optional[_Union[RestoreSource, str]] = ..., peer_node: _Optional[str] = ..., peer_address: _Optional[str] = ..., alternates: _Optional[_Iterable[_Union[PeerCopy, _Mapping]]] = ...) -> None: ...

class PeerCopy(_message.Message):
    __slots__ = ("node_id", "address")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class ReplicaTarget(_message.Message):
    __slots__ = ("node_id", "address")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class MemoryRestorePlan(_message.Message):
    __slots__ = ("step", "memory_steps", "ranks")
    STEP_FIELD_NUMBER: _ClassVar[int]
    MEMORY_STEPS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    step: int
    memory_steps: _containers.RepeatedScalarFieldContainer[int]
    ranks: _containers.RepeatedCompositeFieldContainer[RankRestore]
    def __init__(self, step: _Optional[int] = ..., memory_steps: _Optional[_Iterable[int]] = ..., ranks: _Optional[_Iterable[_Union[RankRestore, _Mapping]]] = ...) -> None: ...

class RankTiming(_message.Message):
    __slots__ = ("rank", "step", "step_s", "wait_s", "compute_s", "steps")
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    step: int
    step_s: float
    wait_s: float
    compute_s: float
    steps: int
    def __init__(self, rank: _Optional[int] = ..., step: _Optional[int] = ..., step_s: _Optional[float] = ..., wait_s: _Optional[float] = ..., compute_s: _Optional[float] = ..., steps: _Optional[int] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("at_step", "reason", "request_id", "generation")
    AT_STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    at_step: int
    reason: str
    request_id: str
    generation: int
    def __init__(self, at_step: _Optional[int] = ..., reason: _Optional[str] = ..., request_id: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class NodeHeartbeatResponse(_message.Message):
    __slots__ = ("command", "rank_table", "interval_s", "job_state", "message", "forming_missing", "checkpoint", "failslow", "stacks", "link_probes", "restore_plan", "replica_targets")
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    RANK_TABLE_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    JOB_STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FORMING_MISSING_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    FAILSLOW_FIELD_NUMBER: _ClassVar[int]
    STACKS_FIELD_NUMBER: _ClassVar[int]
    LINK_PROBES_FIELD_NUMBER: _ClassVar[int]
    RESTORE_PLAN_FIELD_NUMBER: _ClassVar[int]
    REPLICA_TARGETS_FIELD_NUMBER: _ClassVar[int]
    command: NodeCommand
    rank_table: _common_pb2.RankTable
    interval_s: float
    job_state: JobState
    message: str
    forming_missing: int
    checkpoint: CheckpointRequest
    failslow: _common_pb2.FailSlowStatus
    stacks: StackRequest
    link_probes: _containers.RepeatedCompositeFieldContainer[LinkProbeAsk]
    restore_plan: MemoryRestorePlan
    replica_targets: _containers.RepeatedCompositeFieldContainer[ReplicaTarget]
    def __init__(self, command: _Optional[_Union[NodeCommand, str]] = ..., rank_table: _Optional[_Union[_common_pb2.RankTable, _Mapping]] = ..., interval_s: _Optional[float] = ..., job_state: _Optional[_Union[JobState, str]] = ..., message: _Optional[str] = ..., forming_missing: _Optional[int] = ..., checkpoint: _Optional[_Union[CheckpointRequest, _Mapping]] = ..., failslow: _Optional[_Union[_common_pb2.FailSlowStatus, _Mapping]] = ..., stacks: _Optional[_Union[StackRequest, _Mapping]] = ..., link_probes: _Optional[_Iterable[_Union[LinkProbeAsk, _Mapping]]] = ..., restore_plan: _Optional[_Union[MemoryRestorePlan, _Mapping]] = ..., replica_targets: _Optional[_Iterable[_Union[ReplicaTarget, _Mapping]]] = ...) -> None: ...

class StackRequest(_message.Message):
    __slots__ = ("request_id", "generation")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    generation: int
    def __init__(self, request_id: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...

class ReportEventRequest(_message.Message):
    __slots__ = ("job", "node_id", "lease_id", "generation", "event", "proposed_level", "failed_rank", "exit_code")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_LEVEL_FIELD_NUMBER: _ClassVar[int]
    FAILED_RANK_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    job: str
    node_id: str
    lease_id: str
    generation: int
    event: _common_pb2.HealthEvent
    proposed_level: RecoveryLevel
    failed_rank: int
    exit_code: int
    def __init__(self, job: _Optional[str] = ..., node_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., generation: _Optional[int] = ..., event: _Optional[_Union[_common_pb2.HealthEvent, _Mapping]] = ..., proposed_level: _Optional[_Union[RecoveryLevel, str]] = ..., failed_rank: _Optional[int] = ..., exit_code: _Optional[int] = ...) -> None: ...

class ReportEventResponse(_message.Message):
    __slots__ = ("decided_level", "new_generation", "message")
    DECIDED_LEVEL_FIELD_NUMBER: _ClassVar[int]
    NEW_GENERATION_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    decided_level: RecoveryLevel
    new_generation: int
    message: str
    def __init__(self, decided_level: _Optional[_Union[RecoveryLevel, str]] = ..., new_generation: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class GetRankTableRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class CommitCheckpointRequest(_message.Message):
    __slots__ = ("job", "node_id", "step", "lease_id")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    job: str
    node_id: str
    step: int
    lease_id: str
    def __init__(self, job: _Optional[str] = ..., node_id: _Optional[str] = ..., step: _Optional[int] = ..., lease_id: _Optional[str] = ...) -> None: ...

class CommitCheckpointResponse(_message.Message):
    __slots__ = ("last_committed_step",)
    LAST_COMMITTED_STEP_FIELD_NUMBER: _ClassVar[int]
    last_committed_step: int
    def __init__(self, last_committed_step: _Optional[int] = ...) -> None: ...

class NodeHealthReportRequest(_message.Message):
    __slots__ = ("job", "node_id", "host", "verdict", "reason", "risk", "agent_instance", "cause")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RISK_FIELD_NUMBER: _ClassVar[int]
    AGENT_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    job: str
    node_id: str
    host: str
    verdict: NodeHealthVerdict
    reason: str
    risk: float
    agent_instance: str
    cause: _common_pb2.HealthEvent
    def __init__(self, job: _Optional[str] = ..., node_id: _Optional[str] = ..., host: _Optional[str] = ..., verdict: _Optional[_Union[NodeHealthVerdict, str]] = ..., reason: _Optional[str] = ..., risk: _Optional[float] = ..., agent_instance: _Optional[str] = ..., cause: _Optional[_Union[_common_pb2.HealthEvent, _Mapping]] = ...) -> None: ...

class NodeHealthReportResponse(_message.Message):
    __slots__ = ("cordoned", "message", "interval_s")
    CORDONED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    cordoned: bool
    message: str
    interval_s: float
    def __init__(self, cordoned: _Optional[bool] = ..., message: _Optional[str] = ..., interval_s: _Optional[float] = ...) -> None: ...

class UncordonNodeRequest(_message.Message):
    __slots__ = ("job", "node_id", "reason")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job: str
    node_id: str
    reason: str
    def __init__(self, job: _Optional[str] = ..., node_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class UncordonNodeResponse(_message.Message):
    __slots__ = ("uncordoned", "message")
    UNCORDONED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    uncordoned: bool
    message: str
    def __init__(self, uncordoned: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class LeaveNodeRequest(_message.Message):
    __slots__ = ("job", "node_id", "lease_id", "reason")
    JOB_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job: str
    node_id: str
    lease_id: str
    reason: str
    def __init__(self, job: _Optional[str] = ..., node_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class LeaveNodeResponse(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: str
    def __init__(self, message: _Optional[str] = ...) -> None: ...
