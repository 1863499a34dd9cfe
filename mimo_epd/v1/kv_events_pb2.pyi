from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PollRequest(_message.Message):
    __slots__ = ("epoch", "since_seq", "wait_ms")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SINCE_SEQ_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    since_seq: int
    wait_ms: int
    def __init__(self, epoch: _Optional[str] = ..., since_seq: _Optional[int] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("queued_tokens", "running_tokens", "waiting", "running")
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    queued_tokens: int
    running_tokens: int
    waiting: int
    running: int
    def __init__(self, queued_tokens: _Optional[int] = ..., running_tokens: _Optional[int] = ..., waiting: _Optional[int] = ..., running: _Optional[int] = ...) -> None: ...

class PollReply(_message.Message):
    __slots__ = ("epoch", "seq", "reset", "hashes", "states", "load", "block_size", "model", "time_s", "role")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    seq: int
    reset: bool
    hashes: _containers.RepeatedScalarFieldContainer[int]
    states: _containers.RepeatedScalarFieldContainer[int]
    load: WorkerLoad
    block_size: int
    model: str
    time_s: float
    role: str
    def __init__(self, epoch: _Optional[str] = ..., seq: _Optional[int] = ..., reset: _Optional[bool] = ..., hashes: _Optional[_Iterable[int]] = ..., states: _Optional[_Iterable[int]] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., block_size: _Optional[int] = ..., model: _Optional[str] = ..., time_s: _Optional[float] = ..., role: _Optional[str] = ...) -> None: ...
