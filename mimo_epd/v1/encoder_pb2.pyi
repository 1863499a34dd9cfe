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
    AUDIO: _ClassVar[Modality]
MODALITY_UNSPECIFIED: Modality
IMAGE: Modality
VIDEO: Modality
AUDIO: Modality

class MediaItem(_message.Message):
    __slots__ = ("url", "data", "path", "modality", "content_hash", "video")
    URL_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FIELD_NUMBER: _ClassVar[int]
    url: str
    data: bytes
    path: str
    modality: Modality
    content_hash: str
    video: VideoOptions
    def __init__(self, url: _Optional[str] = ..., data: _Optional[bytes] = ..., path: _Optional[str] = ..., modality: _Optional[_Union[Modality, str]] = ..., content_hash: _Optional[str] = ..., video: _Optional[_Union[VideoOptions, _Mapping]] = ...) -> None: ...

class VideoOptions(_message.Message):
    __slots__ = ("fps", "max_frames", "min_frames")
    FPS_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MIN_FRAMES_FIELD_NUMBER: _ClassVar[int]
    fps: float
    max_frames: int
    min_frames: int
    def __init__(self, fps: _Optional[float] = ..., max_frames: _Optional[int] = ..., min_frames: _Optional[int] = ...) -> None: ...

class VideoInfo(_message.Message):
    __slots__ = ("duration_s", "fps", "frames_total", "frames_sampled", "width", "height")
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    FRAMES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    FRAMES_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    duration_s: float
    fps: float
    frames_total: int
    frames_sampled: int
    width: int
    height: int
    def __init__(self, duration_s: _Optional[float] = ..., fps: _Optional[float] = ..., frames_total: _Optional[int] = ..., frames_sampled: _Optional[int] = ..., width: _Optional[int] = ..., height: _Optional[int] = ...) -> None: ...

class AudioInfo(_message.Message):
    __slots__ = ("duration_s", "sample_rate", "channels", "codec", "decoded_s")
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    DECODED_S_FIELD_NUMBER: _ClassVar[int]
    duration_s: float
    sample_rate: int
    channels: int
    codec: str
    decoded_s: float
    def __init__(self, duration_s: _Optional[float] = ..., sample_rate: _Optional[int] = ..., channels: _Optional[int] = ..., codec: _Optional[str] = ..., decoded_s: _Optional[float] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("items", "request_id", "hold")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[MediaItem]
    request_id: str
    hold: bool
    def __init__(self, items: _Optional[_Iterable[_Union[MediaItem, _Mapping]]] = ..., request_id: _Optional[str] = ..., hold: _Optional[bool] = ...) -> None: ...

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
    __slots__ = ("content_key", "embedding", "grid_thw", "num_tokens", "cache_hit", "timings", "timestamps_s", "video", "audio", "window_tokens", "end_s", "held")
    CONTENT_KEY_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMPS_S_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    END_S_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    content_key: str
    embedding: Tensor
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    cache_hit: bool
    timings: StageTimings
    timestamps_s: _containers.RepeatedScalarFieldContainer[float]
    video: VideoInfo
    audio: AudioInfo
    window_tokens: _containers.RepeatedScalarFieldContainer[int]
    end_s: float
    held: HeldRows
    def __init__(self, content_key: _Optional[str] = ..., embedding: _Optional[_Union[Tensor, _Mapping]] = ..., grid_thw: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., cache_hit: _Optional[bool] = ..., timings: _Optional[_Union[StageTimings, _Mapping]] = ..., timestamps_s: _Optional[_Iterable[float]] = ..., video: _Optional[_Union[VideoInfo, _Mapping]] = ..., audio: _Optional[_Union[AudioInfo, _Mapping]] = ..., window_tokens: _Optional[_Iterable[int]] = ..., end_s: _Optional[float] = ..., held: _Optional[_Union[HeldRows, _Mapping]] = ...) -> None: ...

class HeldRows(_message.Message):
    __slots__ = ("encoder", "id", "bytes")
    ENCODER_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    encoder: str
    id: int
    bytes: int
    def __init__(self, encoder: _Optional[str] = ..., id: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class TransferRequest(_message.Message):
    __slots__ = ("session", "ids", "addresses")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    session: str
    ids: _containers.RepeatedScalarFieldContainer[int]
    addresses: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session: _Optional[str] = ..., ids: _Optional[_Iterable[int]] = ..., addresses: _Optional[_Iterable[int]] = ...) -> None: ...

class TransferReply(_message.Message):
    __slots__ = ("bytes", "seconds")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    seconds: float
    def __init__(self, bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("items", "model")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[ItemEmbedding]
    model: str
    def __init__(self, items: _Optional[_Iterable[_Union[ItemEmbedding, _Mapping]]] = ..., model: _Optional[str] = ...) -> None: ...
