import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Severity(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SEVERITY_UNSPECIFIED: _ClassVar[Severity]
    SEVERITY_INFO: _ClassVar[Severity]
    SEVERITY_WARNING: _ClassVar[Severity]
    SEVERITY_ERROR: _ClassVar[Severity]
    SEVERITY_CRITICAL: _ClassVar[Severity]

class Action(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACTION_UNSPECIFIED: _ClassVar[Action]
    ACTION_NONE: _ClassVar[Action]
    ACTION_WATCH: _ClassVar[Action]
    ACTION_CHECKPOINT_NOW: _ClassVar[Action]
    ACTION_RESTART_PROCESS: _ClassVar[Action]
    ACTION_DRAIN_NODE: _ClassVar[Action]
    ACTION_RESTART_JOB: _ClassVar[Action]
SEVERITY_UNSPECIFIED: Severity
SEVERITY_INFO: Severity
SEVERITY_WARNING: Severity
SEVERITY_ERROR: Severity
SEVERITY_CRITICAL: Severity
ACTION_UNSPECIFIED: Action
ACTION_NONE: Action
ACTION_WATCH: Action
ACTION_CHECKPOINT_NOW: Action
ACTION_RESTART_PROCESS: Action
ACTION_DRAIN_NODE: Action
ACTION_RESTART_JOB: Action

class HealthEvent(_message.Message):
    __slots__ = ("event_id", "node_id", "source", "kind", "severity", "action", "subject", "message", "evidence", "time")
    class EvidenceEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SEVERITY_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    EVIDENCE_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    event_id: str
    node_id: str
    source: str
    kind: str
    severity: Severity
    action: Action
    subject: str
    message: str
    evidence: _containers.ScalarMap[str, str]
    time: _timestamp_pb2.Timestamp
    def __init__(self, event_id: _Optional[str] = ..., node_id: _Optional[str] = ..., source: _Optional[str] = ..., kind: _Optional[str] = ..., severity: _Optional[_Union[Severity, str]] = ..., action: _Optional[_Union[Action, str]] = ..., subject: _Optional[str] = ..., message: _Optional[str] = ..., evidence: _Optional[_Mapping[str, str]] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class Topology(_message.Message):
    __slots__ = ("pod_id", "node_index", "host", "device_count", "labels")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    POD_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_INDEX_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    DEVICE_COUNT_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    pod_id: str
    node_index: int
    host: str
    device_count: int
    labels: _containers.ScalarMap[str, str]
    def __init__(self, pod_id: _Optional[str] = ..., node_index: _Optional[int] = ..., host: _Optional[str] = ..., device_count: _Optional[int] = ..., labels: _Optional[_Mapping[str, str]] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "topology", "address", "agent_port", "spare", "replaces")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    AGENT_PORT_FIELD_NUMBER: _ClassVar[int]
    SPARE_FIELD_NUMBER: _ClassVar[int]
    REPLACES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    topology: Topology
    address: str
    agent_port: int
    spare: bool
    replaces: str
    def __init__(self, node_id: _Optional[str] = ..., topology: _Optional[_Union[Topology, _Mapping]] = ..., address: _Optional[str] = ..., agent_port: _Optional[int] = ..., spare: _Optional[bool] = ..., replaces: _Optional[str] = ...) -> None: ...

class NodeRanks(_message.Message):
    __slots__ = ("node_id", "group_rank", "first_rank", "local_world_size", "address")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_RANK_FIELD_NUMBER: _ClassVar[int]
    FIRST_RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    group_rank: int
    first_rank: int
    local_world_size: int
    address: str
    def __init__(self, node_id: _Optional[str] = ..., group_rank: _Optional[int] = ..., first_rank: _Optional[int] = ..., local_world_size: _Optional[int] = ..., address: _Optional[str] = ...) -> None: ...

class RankTable(_message.Message):
    __slots__ = ("job", "generation", "world_size", "master_addr", "master_port", "nodes", "restart_count", "max_restarts", "node_count")
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    RESTART_COUNT_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    NODE_COUNT_FIELD_NUMBER: _ClassVar[int]
    job: str
    generation: int
    world_size: int
    master_addr: str
    master_port: int
    nodes: _containers.RepeatedCompositeFieldContainer[NodeRanks]
    restart_count: int
    max_restarts: int
    node_count: int
    def __init__(self, job: _Optional[str] = ..., generation: _Optional[int] = ..., world_size: _Optional[int] = ..., master_addr: _Optional[str] = ..., master_port: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[NodeRanks, _Mapping]]] = ..., restart_count: _Optional[int] = ..., max_restarts: _Optional[int] = ..., node_count: _Optional[int] = ...) -> None: ...

class SlowRank(_message.Message):
    __slots__ = ("rank", "node_id", "ratio", "excess_s", "since", "basis", "individual")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RATIO_FIELD_NUMBER: _ClassVar[int]
    EXCESS_S_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    BASIS_FIELD_NUMBER: _ClassVar[int]
    INDIVIDUAL_FIELD_NUMBER: _ClassVar[int]
    rank: int
    node_id: str
    ratio: float
    excess_s: float
    since: float
    basis: str
    individual: float
    def __init__(self, rank: _Optional[int] = ..., node_id: _Optional[str] = ..., ratio: _Optional[float] = ..., excess_s: _Optional[float] = ..., since: _Optional[float] = ..., basis: _Optional[str] = ..., individual: _Optional[float] = ...) -> None: ...

class HangFinding(_message.Message):
    __slots__ = ("generation", "outlier_ranks", "outlier_nodes", "outlier_frame", "majority_frame", "ranks_seen", "groups", "repeats", "time")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    OUTLIER_RANKS_FIELD_NUMBER: _ClassVar[int]
    OUTLIER_NODES_FIELD_NUMBER: _ClassVar[int]
    OUTLIER_FRAME_FIELD_NUMBER: _ClassVar[int]
    MAJORITY_FRAME_FIELD_NUMBER: _ClassVar[int]
    RANKS_SEEN_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    REPEATS_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    generation: int
    outlier_ranks: _containers.RepeatedScalarFieldContainer[int]
    outlier_nodes: _containers.RepeatedScalarFieldContainer[str]
    outlier_frame: str
    majority_frame: str
    ranks_seen: int
    groups: int
    repeats: int
    time: float
    def __init__(self, generation: _Optional[int] = ..., outlier_ranks: _Optional[_Iterable[int]] = ..., outlier_nodes: _Optional[_Iterable[str]] = ..., outlier_frame: _Optional[str] = ..., majority_frame: _Optional[str] = ..., ranks_seen: _Optional[int] = ..., groups: _Optional[int] = ..., repeats: _Optional[int] = ..., time: _Optional[float] = ...) -> None: ...

class FailSlowStatus(_message.Message):
    __slots__ = ("slow", "job_step_s", "job_slowdown", "action", "message", "hang", "ranks_observed", "link_probe")
    SLOW_FIELD_NUMBER: _ClassVar[int]
    JOB_STEP_S_FIELD_NUMBER: _ClassVar[int]
    JOB_SLOWDOWN_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    HANG_FIELD_NUMBER: _ClassVar[int]
    RANKS_OBSERVED_FIELD_NUMBER: _ClassVar[int]
    LINK_PROBE_FIELD_NUMBER: _ClassVar[int]
    slow: _containers.RepeatedCompositeFieldContainer[SlowRank]
    job_step_s: float
    job_slowdown: float
    action: str
    message: str
    hang: HangFinding
    ranks_observed: int
    link_probe: str
    def __init__(self, slow: _Optional[_Iterable[_Union[SlowRank, _Mapping]]] = ..., job_step_s: _Optional[float] = ..., job_slowdown: _Optional[float] = ..., action: _Optional[str] = ..., message: _Optional[str] = ..., hang: _Optional[_Union[HangFinding, _Mapping]] = ..., ranks_observed: _Optional[int] = ..., link_probe: _Optional[str] = ...) -> None: ...
