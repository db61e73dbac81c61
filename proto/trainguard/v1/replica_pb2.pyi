from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ReplicaChunk(_message.Message):
    __slots__ = ("job", "rank", "step", "manifest", "from_node", "offset", "data")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    step: int
    manifest: bytes
    from_node: str
    offset: int
    data: bytes
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., manifest: _Optional[bytes] = ..., from_node: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReplicaAck(_message.Message):
    __slots__ = ("ok", "error", "bytes")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    bytes: int
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., bytes: _Optional[int] = ...) -> None: ...

class FetchReplicaRequest(_message.Message):
    __slots__ = ("job", "rank", "min_step")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    MIN_STEP_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    min_step: int
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., min_step: _Optional[int] = ...) -> None: ...
