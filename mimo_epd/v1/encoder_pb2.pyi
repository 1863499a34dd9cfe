from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Modality(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODALITY_UNSPECIFIED: _ClassVar[Modality]
    IMAGE: _ClassVar[Modality]
    VIDEO: _ClassVar[Modality]
MODALITY_UNSPECIFIED: Modality
IMAGE: Modality
VIDEO: Modality

class MediaItem(_message.Message):
    __slots__ = ("url", "data", "path", "modality", "content_hash")
    URL_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    url: str
    data: bytes
    path: str
    modality: Modality
    content_hash: str
    def __init__(self, url: _Optional[str] = ..., data: _Optional[bytes] = ..., path: _Optional[str] = ..., modality: _Optional[_Union[Modality, str]] = ..., content_hash: _Optional[str] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("items", "request_id")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[MediaItem]
    request_id: str
    def __init__(self, items: _Optional[_Iterable[_Union[MediaItem, _Mapping]]] = ..., request_id: _Optional[str] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("data", "shape", "dtype")
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, data: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class StageTimings(_message.Message):
    __slots__ = ("fetch_ms", "decode_ms", "preprocess_ms", "queue_ms", "encode_ms")
    FETCH_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_MS_FIELD_NUMBER: _ClassVar[int]
    PREPROCESS_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    ENCODE_MS_FIELD_NUMBER: _ClassVar[int]
    fetch_ms: float
    decode_ms: float
    preprocess_ms: float
    queue_ms: float
    encode_ms: float
    def __init__(self, fetch_ms: _Optional[float] = ..., decode_ms: _Optional[float] = ..., preprocess_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., encode_ms: _Optional[float] = ...) -> None: ...

class ItemEmbedding(_message.Message):
    __slots__ = ("content_key", "embedding", "grid_thw", "num_tokens", "cache_hit", "timings")
    CONTENT_KEY_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    content_key: str
    embedding: Tensor
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    cache_hit: bool
    timings: StageTimings
    def __init__(self, content_key: _Optional[str] = ..., embedding: _Optional[_Union[Tensor, _Mapping]] = ..., grid_thw: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., cache_hit: _Optional[bool] = ..., timings: _Optional[_Union[StageTimings, _Mapping]] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("items", "model")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ItemEmbedding]
    model: str
    def __init__(self, items: _Optional[_Iterable[_Union[ItemEmbedding, _Mapping]]] = ..., model: _Optional[str] = ...) -> None: ...
