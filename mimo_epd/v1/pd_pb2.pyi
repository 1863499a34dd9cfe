from mimo_epd.v1 import encoder_pb2 as _encoder_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PoolLayer(_message.Message):
    __slots__ = ("k_ptr", "v_ptr", "k_row_bytes", "v_row_bytes", "sliding")
    K_PTR_FIELD_NUMBER: _ClassVar[int]
    V_PTR_FIELD_NUMBER: _ClassVar[int]
    K_ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    V_ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLIDING_FIELD_NUMBER: _ClassVar[int]
    k_ptr: int
    v_ptr: int
    k_row_bytes: int
    v_row_bytes: int
    sliding: bool
    def __init__(self, k_ptr: _Optional[int] = ..., v_ptr: _Optional[int] = ..., k_row_bytes: _Optional[int] = ..., v_row_bytes: _Optional[int] = ..., sliding: _Optional[bool] = ...) -> None: ...

class RankPools(_message.Message):
    __slots__ = ("session", "layers")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    session: str
    layers: _containers.RepeatedCompositeFieldContainer[PoolLayer]
    def __init__(self, session: _Optional[str] = ..., layers: _Optional[_Iterable[_Union[PoolLayer, _Mapping]]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("room", "prompt_token_ids", "media", "session", "layers", "decode_prefix", "full_slots", "swa_slots", "temperature", "top_p", "top_k", "seed", "has_seed", "top_logprobs", "page_size", "constraint", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "stop_token_ids", "rank_pools")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    DECODE_PREFIX_FIELD_NUMBER: _ClassVar[int]
    FULL_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SWA_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    HAS_SEED_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RANK_POOLS_FIELD_NUMBER: _ClassVar[int]
    room: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    media: _containers.RepeatedCompositeFieldContainer[_encoder_pb2.MediaItem]
    session: str
    layers: _containers.RepeatedCompositeFieldContainer[PoolLayer]
    decode_prefix: int
    full_slots: _containers.RepeatedScalarFieldContainer[int]
    swa_slots: _containers.RepeatedScalarFieldContainer[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    has_seed: bool
    top_logprobs: int
    page_size: int
    constraint: str
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.RepeatedCompositeFieldContainer[LogitBias]
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    rank_pools: _containers.RepeatedCompositeFieldContainer[RankPools]
    def __init__(self, room: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., media: _Optional[_Iterable[_Union[_encoder_pb2.MediaItem, _Mapping]]] = ..., session: _Optional[str] = ..., layers: _Optional[_Iterable[_Union[PoolLayer, _Mapping]]] = ..., decode_prefix: _Optional[int] = ..., full_slots: _Optional[_Iterable[int]] = ..., swa_slots: _Optional[_Iterable[int]] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., has_seed: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., page_size: _Optional[int] = ..., constraint: _Optional[str] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Iterable[_Union[LogitBias, _Mapping]]] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., rank_pools: _Optional[_Iterable[_Union[RankPools, _Mapping]]] = ...) -> None: ...

class LogitBias(_message.Message):
    __slots__ = ("token_id", "bias")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BIAS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    bias: float
    def __init__(self, token_id: _Optional[int] = ..., bias: _Optional[float] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class PrefillAccepted(_message.Message):
    __slots__ = ("cached_tokens",)
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    cached_tokens: int
    def __init__(self, cached_tokens: _Optional[int] = ...) -> None: ...

class PrefillDone(_message.Message):
    __slots__ = ("first_token", "logprob", "top_logprobs", "kv_bytes", "transfer_s", "prefill_s", "rng_state")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    RNG_STATE_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    kv_bytes: int
    transfer_s: float
    prefill_s: float
    rng_state: bytes
    def __init__(self, first_token: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ..., kv_bytes: _Optional[int] = ..., transfer_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., rng_state: _Optional[bytes] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("room",)
    ROOM_FIELD_NUMBER: _ClassVar[int]
    room: str
    def __init__(self, room: _Optional[str] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("known", "kv_bytes")
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    known: bool
    kv_bytes: int
    def __init__(self, known: _Optional[bool] = ..., kv_bytes: _Optional[int] = ...) -> None: ...

class PrefillEvent(_message.Message):
    __slots__ = ("accepted", "done")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    accepted: PrefillAccepted
    done: PrefillDone
    def __init__(self, accepted: _Optional[_Union[PrefillAccepted, _Mapping]] = ..., done: _Optional[_Union[PrefillDone, _Mapping]] = ...) -> None: ...
