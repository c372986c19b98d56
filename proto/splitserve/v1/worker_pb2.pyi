from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]
    ROLE_BOTH: _ClassVar[Role]
ROLE_UNSPECIFIED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role
ROLE_BOTH: Role

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "max_tokens", "min_tokens", "ignore_eos", "stop_token_ids", "stop", "logprobs", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "resumed_tokens", "top_logprobs", "logit_bias", "prompt_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_tokens: int
    min_tokens: int
    ignore_eos: bool
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    logprobs: bool
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    resumed_tokens: int
    top_logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    prompt_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[str]] = ..., logprobs: _Optional[bool] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., resumed_tokens: _Optional[int] = ..., top_logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class TopLogprobs(_message.Message):
    __slots__ = ("token_ids", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("logprobs", "top_logprobs", "ranks")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class CompatInfo(_message.Message):
    __slots__ = ("hash", "model", "dtype", "block_size", "num_layers", "kv_heads", "head_dim", "kv_layout")
    HASH_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    hash: str
    model: str
    dtype: str
    block_size: int
    num_layers: int
    kv_heads: int
    head_dim: int
    kv_layout: str
    def __init__(self, hash: _Optional[str] = ..., model: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., kv_layout: _Optional[str] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "num_prompt_tokens", "compat", "lease_seconds", "kv_backend")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_BACKEND_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_prompt_tokens: int
    compat: CompatInfo
    lease_seconds: float
    kv_backend: str
    def __init__(self, request_id: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., compat: _Optional[_Union[CompatInfo, _Mapping]] = ..., lease_seconds: _Optional[float] = ..., kv_backend: _Optional[str] = ...) -> None: ...

class TransferHandle(_message.Message):
    __slots__ = ("request_id", "decode_address", "block_ids", "lease_id", "lease_expires_unix", "kv_backend", "backend_metadata", "compat", "num_prompt_tokens", "kv_ranks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_UNIX_FIELD_NUMBER: _ClassVar[int]
    KV_BACKEND_FIELD_NUMBER: _ClassVar[int]
    BACKEND_METADATA_FIELD_NUMBER: _ClassVar[int]
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_RANKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    decode_address: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    lease_id: str
    lease_expires_unix: float
    kv_backend: str
    backend_metadata: bytes
    compat: CompatInfo
    num_prompt_tokens: int
    kv_ranks: _containers.RepeatedCompositeFieldContainer[KVRank]
    def __init__(self, request_id: _Optional[str] = ..., decode_address: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., lease_id: _Optional[str] = ..., lease_expires_unix: _Optional[float] = ..., kv_backend: _Optional[str] = ..., backend_metadata: _Optional[bytes] = ..., compat: _Optional[_Union[CompatInfo, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., kv_ranks: _Optional[_Iterable[_Union[KVRank, _Mapping]]] = ...) -> None: ...

class KVRank(_message.Message):
    __slots__ = ("rank", "kv_head_start", "kv_head_stop", "backend_metadata")
    RANK_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_STOP_FIELD_NUMBER: _ClassVar[int]
    BACKEND_METADATA_FIELD_NUMBER: _ClassVar[int]
    rank: int
    kv_head_start: int
    kv_head_stop: int
    backend_metadata: bytes
    def __init__(self, rank: _Optional[int] = ..., kv_head_start: _Optional[int] = ..., kv_head_stop: _Optional[int] = ..., backend_metadata: _Optional[bytes] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("handle",)
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    handle: TransferHandle
    def __init__(self, handle: _Optional[_Union[TransferHandle, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released", "blocks_freed")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FREED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    blocks_freed: int
    def __init__(self, released: _Optional[bool] = ..., blocks_freed: _Optional[int] = ...) -> None: ...

class KVLayer(_message.Message):
    __slots__ = ("request_id", "lease_id", "layer", "start_token", "num_tokens", "data", "crc32", "compat_hash", "kv_head_start", "kv_head_count")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    START_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_START_FIELD_NUMBER: _ClassVar[int]
    KV_HEAD_COUNT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease_id: str
    layer: int
    start_token: int
    num_tokens: int
    data: bytes
    crc32: int
    compat_hash: str
    kv_head_start: int
    kv_head_count: int
    def __init__(self, request_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., layer: _Optional[int] = ..., start_token: _Optional[int] = ..., num_tokens: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ..., compat_hash: _Optional[str] = ..., kv_head_start: _Optional[int] = ..., kv_head_count: _Optional[int] = ...) -> None: ...

class PushKVAck(_message.Message):
    __slots__ = ("layers_received", "bytes_received")
    LAYERS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    layers_received: int
    bytes_received: int
    def __init__(self, layers_received: _Optional[int] = ..., bytes_received: _Optional[int] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("request_id", "lease_id", "first_token", "first_token_logprob", "layers_sent", "layer_crc32", "first_top_logprobs", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    LAYERS_SENT_FIELD_NUMBER: _ClassVar[int]
    LAYER_CRC32_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease_id: str
    first_token: int
    first_token_logprob: float
    layers_sent: int
    layer_crc32: _containers.RepeatedScalarFieldContainer[int]
    first_top_logprobs: TopLogprobs
    prompt_logprobs: PromptLogprobs
    def __init__(self, request_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., first_token: _Optional[int] = ..., first_token_logprob: _Optional[float] = ..., layers_sent: _Optional[int] = ..., layer_crc32: _Optional[_Iterable[int]] = ..., first_top_logprobs: _Optional[_Union[TopLogprobs, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[PromptLogprobs, _Mapping]] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("admitted",)
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    admitted: bool
    def __init__(self, admitted: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "expect_remote_kv", "recompute_prompt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    EXPECT_REMOTE_KV_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_PROMPT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    expect_remote_kv: bool
    recompute_prompt: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., expect_remote_kv: _Optional[bool] = ..., recompute_prompt: _Optional[bool] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "finish_reason", "error", "num_prompt_tokens", "num_cached_tokens", "top_logprobs", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: str
    error: str
    num_prompt_tokens: int
    num_cached_tokens: int
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprobs]
    prompt_logprobs: PromptLogprobs
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[str] = ..., error: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Union[PromptLogprobs, _Mapping]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "handle")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    handle: TransferHandle
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., handle: _Optional[_Union[TransferHandle, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token", "first_token_logprob", "prefill_seconds", "transfer_seconds", "exposed_transfer_seconds", "bytes_sent", "num_cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXPOSED_TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token: int
    first_token_logprob: float
    prefill_seconds: float
    transfer_seconds: float
    exposed_transfer_seconds: float
    bytes_sent: int
    num_cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., first_token: _Optional[int] = ..., first_token_logprob: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., transfer_seconds: _Optional[float] = ..., exposed_transfer_seconds: _Optional[float] = ..., bytes_sent: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("role", "compat", "free_blocks", "total_blocks", "running", "waiting", "tokens_in_flight", "version", "kv_backends", "leases", "prefilling", "instance_id", "switchable", "switching", "switching_to", "switches")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    COMPAT_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    TOKENS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    KV_BACKENDS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    PREFILLING_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SWITCHABLE_FIELD_NUMBER: _ClassVar[int]
    SWITCHING_FIELD_NUMBER: _ClassVar[int]
    SWITCHING_TO_FIELD_NUMBER: _ClassVar[int]
    SWITCHES_FIELD_NUMBER: _ClassVar[int]
    role: Role
    compat: CompatInfo
    free_blocks: int
    total_blocks: int
    running: int
    waiting: int
    tokens_in_flight: int
    version: str
    kv_backends: _containers.RepeatedScalarFieldContainer[str]
    leases: int
    prefilling: int
    instance_id: str
    switchable: bool
    switching: bool
    switching_to: Role
    switches: int
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., compat: _Optional[_Union[CompatInfo, _Mapping]] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., tokens_in_flight: _Optional[int] = ..., version: _Optional[str] = ..., kv_backends: _Optional[_Iterable[str]] = ..., leases: _Optional[int] = ..., prefilling: _Optional[int] = ..., instance_id: _Optional[str] = ..., switchable: _Optional[bool] = ..., switching: _Optional[bool] = ..., switching_to: _Optional[_Union[Role, str]] = ..., switches: _Optional[int] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("kind", "block_hashes", "seq")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[KVEvent.Kind]
        STORED: _ClassVar[KVEvent.Kind]
        EVICTED: _ClassVar[KVEvent.Kind]
        CLEARED: _ClassVar[KVEvent.Kind]
    KIND_UNSPECIFIED: KVEvent.Kind
    STORED: KVEvent.Kind
    EVICTED: KVEvent.Kind
    CLEARED: KVEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    kind: KVEvent.Kind
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    seq: int
    def __init__(self, kind: _Optional[_Union[KVEvent.Kind, str]] = ..., block_hashes: _Optional[_Iterable[int]] = ..., seq: _Optional[int] = ...) -> None: ...

class EventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SwitchRoleRequest(_message.Message):
    __slots__ = ("role", "drain_seconds")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    role: Role
    drain_seconds: float
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., drain_seconds: _Optional[float] = ...) -> None: ...

class SwitchRoleResponse(_message.Message):
    __slots__ = ("role", "previous", "seconds", "migrated", "leases_released")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    MIGRATED_FIELD_NUMBER: _ClassVar[int]
    LEASES_RELEASED_FIELD_NUMBER: _ClassVar[int]
    role: Role
    previous: Role
    seconds: float
    migrated: int
    leases_released: int
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., previous: _Optional[_Union[Role, str]] = ..., seconds: _Optional[float] = ..., migrated: _Optional[int] = ..., leases_released: _Optional[int] = ...) -> None: ...
