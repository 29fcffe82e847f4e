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
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    UINT8: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT64: _ClassVar[DType]

class BufferKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BUFFER_KIND_UNSPECIFIED: _ClassVar[BufferKind]
    SHM: _ClassVar[BufferKind]
    CUDA_IPC: _ClassVar[BufferKind]
DTYPE_UNSPECIFIED: DType
FLOAT16: DType
BFLOAT16: DType
FLOAT32: DType
UINT8: DType
INT32: DType
INT64: DType
BUFFER_KIND_UNSPECIFIED: BufferKind
SHM: BufferKind
CUDA_IPC: BufferKind

class BufferRef(_message.Message):
    __slots__ = ("buffer_id", "offset")
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    buffer_id: str
    offset: int
    def __init__(self, buffer_id: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("shape", "dtype", "inline", "ref")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    INLINE_FIELD_NUMBER: _ClassVar[int]
    REF_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    inline: bytes
    ref: BufferRef
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., inline: _Optional[bytes] = ..., ref: _Optional[_Union[BufferRef, _Mapping]] = ...) -> None: ...

class OutputRef(_message.Message):
    __slots__ = ("buffer_id", "offset")
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    buffer_id: str
    offset: int
    def __init__(self, buffer_id: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class Geometry(_message.Message):
    __slots__ = ("num_layers", "num_q_heads", "num_kv_heads", "head_dim", "dtype")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_Q_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    def __init__(self, num_layers: _Optional[int] = ..., num_q_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class CacheSpec(_message.Message):
    __slots__ = ("name", "model_id", "geometry", "codec", "num_subvectors", "block_size", "residual", "num_blocks", "pool_bytes", "max_sequences", "share_prefixes_across_tenants", "host_bytes", "low_watermark", "sink_tokens", "layer_windows", "logit_softcap", "layer_chunks", "sink_logits")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    NUM_SUBVECTORS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    RESIDUAL_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SHARE_PREFIXES_ACROSS_TENANTS_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOW_WATERMARK_FIELD_NUMBER: _ClassVar[int]
    SINK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYER_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_SOFTCAP_FIELD_NUMBER: _ClassVar[int]
    LAYER_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    SINK_LOGITS_FIELD_NUMBER: _ClassVar[int]
    name: str
    model_id: str
    geometry: Geometry
    codec: str
    num_subvectors: int
    block_size: int
    residual: int
    num_blocks: int
    pool_bytes: int
    max_sequences: int
    share_prefixes_across_tenants: bool
    host_bytes: int
    low_watermark: float
    sink_tokens: int
    layer_windows: _containers.RepeatedScalarFieldContainer[int]
    logit_softcap: float
    layer_chunks: _containers.RepeatedScalarFieldContainer[int]
    sink_logits: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, name: _Optional[str] = ..., model_id: _Optional[str] = ..., geometry: _Optional[_Union[Geometry, _Mapping]] = ..., codec: _Optional[str] = ..., num_subvectors: _Optional[int] = ..., block_size: _Optional[int] = ..., residual: _Optional[int] = ..., num_blocks: _Optional[int] = ..., pool_bytes: _Optional[int] = ..., max_sequences: _Optional[int] = ..., share_prefixes_across_tenants: _Optional[bool] = ..., host_bytes: _Optional[int] = ..., low_watermark: _Optional[float] = ..., sink_tokens: _Optional[int] = ..., layer_windows: _Optional[_Iterable[int]] = ..., logit_softcap: _Optional[float] = ..., layer_chunks: _Optional[_Iterable[int]] = ..., sink_logits: _Optional[_Iterable[float]] = ...) -> None: ...

class CreateCacheRequest(_message.Message):
    __slots__ = ("spec", "exist_ok")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    EXIST_OK_FIELD_NUMBER: _ClassVar[int]
    spec: CacheSpec
    exist_ok: bool
    def __init__(self, spec: _Optional[_Union[CacheSpec, _Mapping]] = ..., exist_ok: _Optional[bool] = ...) -> None: ...

class GetCacheRequest(_message.Message):
    __slots__ = ("cache",)
    CACHE_FIELD_NUMBER: _ClassVar[int]
    cache: str
    def __init__(self, cache: _Optional[str] = ...) -> None: ...

class CacheInfo(_message.Message):
    __slots__ = ("spec", "has_codebooks", "codebooks_sha256", "fingerprint", "capacity_blocks", "tail_capacity_blocks", "bytes_per_token", "compression_ratio")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    HAS_CODEBOOKS_FIELD_NUMBER: _ClassVar[int]
    CODEBOOKS_SHA256_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TAIL_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_RATIO_FIELD_NUMBER: _ClassVar[int]
    spec: CacheSpec
    has_codebooks: bool
    codebooks_sha256: str
    fingerprint: bytes
    capacity_blocks: int
    tail_capacity_blocks: int
    bytes_per_token: int
    compression_ratio: float
    def __init__(self, spec: _Optional[_Union[CacheSpec, _Mapping]] = ..., has_codebooks: _Optional[bool] = ..., codebooks_sha256: _Optional[str] = ..., fingerprint: _Optional[bytes] = ..., capacity_blocks: _Optional[int] = ..., tail_capacity_blocks: _Optional[int] = ..., bytes_per_token: _Optional[int] = ..., compression_ratio: _Optional[float] = ...) -> None: ...

class SetCodebooksRequest(_message.Message):
    __slots__ = ("cache", "safetensors")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    SAFETENSORS_FIELD_NUMBER: _ClassVar[int]
    cache: str
    safetensors: bytes
    def __init__(self, cache: _Optional[str] = ..., safetensors: _Optional[bytes] = ...) -> None: ...

class TrainCodebooksRequest(_message.Message):
    __slots__ = ("cache", "k_samples", "v_samples", "niter")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    K_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    V_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    NITER_FIELD_NUMBER: _ClassVar[int]
    cache: str
    k_samples: Tensor
    v_samples: Tensor
    niter: int
    def __init__(self, cache: _Optional[str] = ..., k_samples: _Optional[_Union[Tensor, _Mapping]] = ..., v_samples: _Optional[_Union[Tensor, _Mapping]] = ..., niter: _Optional[int] = ...) -> None: ...

class CodebooksReply(_message.Message):
    __slots__ = ("sha256",)
    SHA256_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    def __init__(self, sha256: _Optional[str] = ...) -> None: ...

class DeleteCacheRequest(_message.Message):
    __slots__ = ("cache", "force")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    cache: str
    force: bool
    def __init__(self, cache: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class DeleteCacheReply(_message.Message):
    __slots__ = ("sequences", "leased_sequences", "pinned_sequences", "disk_sequences", "main_blocks", "tail_blocks", "host_blocks", "cached_blocks", "reserved_bytes")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    LEASED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    PINNED_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    DISK_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    MAIN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TAIL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    sequences: int
    leased_sequences: int
    pinned_sequences: int
    disk_sequences: int
    main_blocks: int
    tail_blocks: int
    host_blocks: int
    cached_blocks: int
    reserved_bytes: int
    def __init__(self, sequences: _Optional[int] = ..., leased_sequences: _Optional[int] = ..., pinned_sequences: _Optional[int] = ..., disk_sequences: _Optional[int] = ..., main_blocks: _Optional[int] = ..., tail_blocks: _Optional[int] = ..., host_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., reserved_bytes: _Optional[int] = ...) -> None: ...

class GetCodebooksRequest(_message.Message):
    __slots__ = ("cache",)
    CACHE_FIELD_NUMBER: _ClassVar[int]
    cache: str
    def __init__(self, cache: _Optional[str] = ...) -> None: ...

class GetCodebooksReply(_message.Message):
    __slots__ = ("safetensors", "sha256")
    SAFETENSORS_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    safetensors: bytes
    sha256: str
    def __init__(self, safetensors: _Optional[bytes] = ..., sha256: _Optional[str] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("cache", "sequence_id", "prompt_token_ids", "pinned", "persist")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    PERSIST_FIELD_NUMBER: _ClassVar[int]
    cache: str
    sequence_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    pinned: bool
    persist: bool
    def __init__(self, cache: _Optional[str] = ..., sequence_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., pinned: _Optional[bool] = ..., persist: _Optional[bool] = ...) -> None: ...

class AllocateReply(_message.Message):
    __slots__ = ("cached_tokens", "hit_blocks")
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    cached_tokens: int
    hit_blocks: int
    def __init__(self, cached_tokens: _Optional[int] = ..., hit_blocks: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("cache", "sequence_id", "num_tokens", "sequence_ids", "buffer_id", "known_sealed", "known_epochs")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    KNOWN_SEALED_FIELD_NUMBER: _ClassVar[int]
    KNOWN_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    cache: str
    sequence_id: str
    num_tokens: int
    sequence_ids: _containers.RepeatedScalarFieldContainer[str]
    buffer_id: str
    known_sealed: _containers.RepeatedScalarFieldContainer[int]
    known_epochs: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, cache: _Optional[str] = ..., sequence_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., sequence_ids: _Optional[_Iterable[str]] = ..., buffer_id: _Optional[str] = ..., known_sealed: _Optional[_Iterable[int]] = ..., known_epochs: _Optional[_Iterable[int]] = ...) -> None: ...

class Reservation(_message.Message):
    __slots__ = ("sequence_id", "slot_mapping", "sealed_blocks", "tail_blocks", "length", "sealed_start", "table_epoch")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_MAPPING_FIELD_NUMBER: _ClassVar[int]
    SEALED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TAIL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    SEALED_START_FIELD_NUMBER: _ClassVar[int]
    TABLE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    slot_mapping: _containers.RepeatedScalarFieldContainer[int]
    sealed_blocks: _containers.RepeatedScalarFieldContainer[int]
    tail_blocks: _containers.RepeatedScalarFieldContainer[int]
    length: int
    sealed_start: int
    table_epoch: int
    def __init__(self, sequence_id: _Optional[str] = ..., slot_mapping: _Optional[_Iterable[int]] = ..., sealed_blocks: _Optional[_Iterable[int]] = ..., tail_blocks: _Optional[_Iterable[int]] = ..., length: _Optional[int] = ..., sealed_start: _Optional[int] = ..., table_epoch: _Optional[int] = ...) -> None: ...

class ReserveReply(_message.Message):
    __slots__ = ("slot_mapping", "sealed_blocks", "tail_blocks", "length", "reservations", "gpu_idle", "sealed_start", "table_epoch")
    SLOT_MAPPING_FIELD_NUMBER: _ClassVar[int]
    SEALED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TAIL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    GPU_IDLE_FIELD_NUMBER: _ClassVar[int]
    SEALED_START_FIELD_NUMBER: _ClassVar[int]
    TABLE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    slot_mapping: _containers.RepeatedScalarFieldContainer[int]
    sealed_blocks: _containers.RepeatedScalarFieldContainer[int]
    tail_blocks: _containers.RepeatedScalarFieldContainer[int]
    length: int
    reservations: _containers.RepeatedCompositeFieldContainer[Reservation]
    gpu_idle: bool
    sealed_start: int
    table_epoch: int
    def __init__(self, slot_mapping: _Optional[_Iterable[int]] = ..., sealed_blocks: _Optional[_Iterable[int]] = ..., tail_blocks: _Optional[_Iterable[int]] = ..., length: _Optional[int] = ..., reservations: _Optional[_Iterable[_Union[Reservation, _Mapping]]] = ..., gpu_idle: _Optional[bool] = ..., sealed_start: _Optional[int] = ..., table_epoch: _Optional[int] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AppendRequest(_message.Message):
    __slots__ = ("cache", "sequence_ids", "counts", "layer", "k", "v", "token_ids")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    cache: str
    sequence_ids: _containers.RepeatedScalarFieldContainer[str]
    counts: _containers.RepeatedScalarFieldContainer[int]
    layer: int
    k: Tensor
    v: Tensor
    token_ids: _containers.RepeatedCompositeFieldContainer[TokenIds]
    def __init__(self, cache: _Optional[str] = ..., sequence_ids: _Optional[_Iterable[str]] = ..., counts: _Optional[_Iterable[int]] = ..., layer: _Optional[int] = ..., k: _Optional[_Union[Tensor, _Mapping]] = ..., v: _Optional[_Union[Tensor, _Mapping]] = ..., token_ids: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ...) -> None: ...

class AppendReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AttendRequest(_message.Message):
    __slots__ = ("cache", "layer", "sequence_ids", "q", "scale", "out")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    OUT_FIELD_NUMBER: _ClassVar[int]
    cache: str
    layer: int
    sequence_ids: _containers.RepeatedScalarFieldContainer[str]
    q: Tensor
    scale: float
    out: OutputRef
    def __init__(self, cache: _Optional[str] = ..., layer: _Optional[int] = ..., sequence_ids: _Optional[_Iterable[str]] = ..., q: _Optional[_Union[Tensor, _Mapping]] = ..., scale: _Optional[float] = ..., out: _Optional[_Union[OutputRef, _Mapping]] = ...) -> None: ...

class AppendAttendRequest(_message.Message):
    __slots__ = ("cache", "layer", "sequence_ids", "k", "v", "q", "scale", "out", "token_ids", "query_tokens")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    OUT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    cache: str
    layer: int
    sequence_ids: _containers.RepeatedScalarFieldContainer[str]
    k: Tensor
    v: Tensor
    q: Tensor
    scale: float
    out: OutputRef
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    query_tokens: int
    def __init__(self, cache: _Optional[str] = ..., layer: _Optional[int] = ..., sequence_ids: _Optional[_Iterable[str]] = ..., k: _Optional[_Union[Tensor, _Mapping]] = ..., v: _Optional[_Union[Tensor, _Mapping]] = ..., q: _Optional[_Union[Tensor, _Mapping]] = ..., scale: _Optional[float] = ..., out: _Optional[_Union[OutputRef, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ..., query_tokens: _Optional[int] = ...) -> None: ...

class AttendReply(_message.Message):
    __slots__ = ("out",)
    OUT_FIELD_NUMBER: _ClassVar[int]
    out: Tensor
    def __init__(self, out: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class RetrieveRequest(_message.Message):
    __slots__ = ("cache", "sequence_id", "start", "end", "layer_start", "layer_end", "k_out", "v_out")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    K_OUT_FIELD_NUMBER: _ClassVar[int]
    V_OUT_FIELD_NUMBER: _ClassVar[int]
    cache: str
    sequence_id: str
    start: int
    end: int
    layer_start: int
    layer_end: int
    k_out: OutputRef
    v_out: OutputRef
    def __init__(self, cache: _Optional[str] = ..., sequence_id: _Optional[str] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., k_out: _Optional[_Union[OutputRef, _Mapping]] = ..., v_out: _Optional[_Union[OutputRef, _Mapping]] = ...) -> None: ...

class RetrieveReply(_message.Message):
    __slots__ = ("k", "v")
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    k: Tensor
    v: Tensor
    def __init__(self, k: _Optional[_Union[Tensor, _Mapping]] = ..., v: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ForkRequest(_message.Message):
    __slots__ = ("cache", "sequence_id", "new_sequence_id")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    cache: str
    sequence_id: str
    new_sequence_id: str
    def __init__(self, cache: _Optional[str] = ..., sequence_id: _Optional[str] = ..., new_sequence_id: _Optional[str] = ...) -> None: ...

class ForkReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ("cache", "sequence_ids")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    cache: str
    sequence_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, cache: _Optional[str] = ..., sequence_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class FreeReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OffloadRequest(_message.Message):
    __slots__ = ("cache", "sequence_ids")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    cache: str
    sequence_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, cache: _Optional[str] = ..., sequence_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class OffloadReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("cache", "sequence_ids")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    cache: str
    sequence_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, cache: _Optional[str] = ..., sequence_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class PrefetchReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegisterBufferRequest(_message.Message):
    __slots__ = ("kind", "name", "size", "ipc_handle", "device_uuid", "offset", "ready_event", "done_event")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    READY_EVENT_FIELD_NUMBER: _ClassVar[int]
    DONE_EVENT_FIELD_NUMBER: _ClassVar[int]
    kind: BufferKind
    name: str
    size: int
    ipc_handle: bytes
    device_uuid: str
    offset: int
    ready_event: bytes
    done_event: bytes
    def __init__(self, kind: _Optional[_Union[BufferKind, str]] = ..., name: _Optional[str] = ..., size: _Optional[int] = ..., ipc_handle: _Optional[bytes] = ..., device_uuid: _Optional[str] = ..., offset: _Optional[int] = ..., ready_event: _Optional[bytes] = ..., done_event: _Optional[bytes] = ...) -> None: ...

class RegisterBufferReply(_message.Message):
    __slots__ = ("buffer_id", "doorbell_path", "doorbell_token")
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    DOORBELL_PATH_FIELD_NUMBER: _ClassVar[int]
    DOORBELL_TOKEN_FIELD_NUMBER: _ClassVar[int]
    buffer_id: str
    doorbell_path: str
    doorbell_token: bytes
    def __init__(self, buffer_id: _Optional[str] = ..., doorbell_path: _Optional[str] = ..., doorbell_token: _Optional[bytes] = ...) -> None: ...

class UnregisterBufferRequest(_message.Message):
    __slots__ = ("buffer_id",)
    BUFFER_ID_FIELD_NUMBER: _ClassVar[int]
    buffer_id: str
    def __init__(self, buffer_id: _Optional[str] = ...) -> None: ...

class UnregisterBufferReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MapPoolRequest(_message.Message):
    __slots__ = ("cache", "device_uuid")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    cache: str
    device_uuid: str
    def __init__(self, cache: _Optional[str] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class SharedTensor(_message.Message):
    __slots__ = ("name", "ipc_handle", "offset", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    ipc_handle: bytes
    offset: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    def __init__(self, name: _Optional[str] = ..., ipc_handle: _Optional[bytes] = ..., offset: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ...) -> None: ...

class MapPoolReply(_message.Message):
    __slots__ = ("tensors", "spec", "device_uuid")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[SharedTensor]
    spec: CacheSpec
    device_uuid: str
    def __init__(self, tensors: _Optional[_Iterable[_Union[SharedTensor, _Mapping]]] = ..., spec: _Optional[_Union[CacheSpec, _Mapping]] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("cache",)
    CACHE_FIELD_NUMBER: _ClassVar[int]
    cache: str
    def __init__(self, cache: _Optional[str] = ...) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("capacity", "used", "cached", "free", "evictions")
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    USED_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    capacity: int
    used: int
    cached: int
    free: int
    evictions: int
    def __init__(self, capacity: _Optional[int] = ..., used: _Optional[int] = ..., cached: _Optional[int] = ..., free: _Optional[int] = ..., evictions: _Optional[int] = ...) -> None: ...

class CacheStats(_message.Message):
    __slots__ = ("cache", "main", "tail", "sequences", "tokens", "sealed_tokens", "bytes_per_token", "fp16_bytes_per_token", "compression_ratio", "used_bytes", "effective_bytes_per_token", "prefix_query_tokens", "prefix_hit_tokens", "prefix_hit_rate", "appended_tokens", "sealed_blocks", "dedup_blocks", "attend_calls", "host", "host_tail", "sequences_host", "sequences_disk", "offloads_host", "offloads_disk", "page_ins_host", "page_ins_disk", "bytes_down", "bytes_up", "spilled_blocks", "prefix_hit_blocks_host", "prefix_hit_blocks_disk", "disk_bytes", "disk_entries", "sink_tokens", "disk_used_bytes", "disk_max_bytes", "disk_held_bytes", "disk_evictions", "disk_evicted_bytes", "disk_skipped_spills", "host_metadata_bytes", "host_tier_bytes", "redis_state", "redis_blocks_out", "redis_bytes_out", "prefix_hit_blocks_redis", "redis_bytes_in", "redis_misses", "redis_refused", "redis_dropped_puts", "redis_errors", "redis_last_error", "main_reserved_bytes", "main_used_bytes", "tail_reserved_bytes", "tail_used_bytes", "host_used_bytes", "reserved_bytes", "window_freed_blocks", "bytes_down_host", "bytes_down_disk", "bytes_up_host", "bytes_up_disk")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    MAIN_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEALED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FP16_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_RATIO_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    APPENDED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEALED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEDUP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ATTEND_CALLS_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    HOST_TAIL_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_HOST_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_DISK_FIELD_NUMBER: _ClassVar[int]
    OFFLOADS_HOST_FIELD_NUMBER: _ClassVar[int]
    OFFLOADS_DISK_FIELD_NUMBER: _ClassVar[int]
    PAGE_INS_HOST_FIELD_NUMBER: _ClassVar[int]
    PAGE_INS_DISK_FIELD_NUMBER: _ClassVar[int]
    BYTES_DOWN_FIELD_NUMBER: _ClassVar[int]
    BYTES_UP_FIELD_NUMBER: _ClassVar[int]
    SPILLED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_BLOCKS_HOST_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_BLOCKS_DISK_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    SINK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISK_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    DISK_EVICTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_SKIPPED_SPILLS_FIELD_NUMBER: _ClassVar[int]
    HOST_METADATA_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_BYTES_FIELD_NUMBER: _ClassVar[int]
    REDIS_STATE_FIELD_NUMBER: _ClassVar[int]
    REDIS_BLOCKS_OUT_FIELD_NUMBER: _ClassVar[int]
    REDIS_BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_BLOCKS_REDIS_FIELD_NUMBER: _ClassVar[int]
    REDIS_BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    REDIS_MISSES_FIELD_NUMBER: _ClassVar[int]
    REDIS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    REDIS_DROPPED_PUTS_FIELD_NUMBER: _ClassVar[int]
    REDIS_ERRORS_FIELD_NUMBER: _ClassVar[int]
    REDIS_LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    MAIN_RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAIN_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TAIL_RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TAIL_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FREED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_DOWN_HOST_FIELD_NUMBER: _ClassVar[int]
    BYTES_DOWN_DISK_FIELD_NUMBER: _ClassVar[int]
    BYTES_UP_HOST_FIELD_NUMBER: _ClassVar[int]
    BYTES_UP_DISK_FIELD_NUMBER: _ClassVar[int]
    cache: str
    main: PoolStats
    tail: PoolStats
    sequences: int
    tokens: int
    sealed_tokens: int
    bytes_per_token: int
    fp16_bytes_per_token: int
    compression_ratio: float
    used_bytes: int
    effective_bytes_per_token: float
    prefix_query_tokens: int
    prefix_hit_tokens: int
    prefix_hit_rate: float
    appended_tokens: int
    sealed_blocks: int
    dedup_blocks: int
    attend_calls: int
    host: PoolStats
    host_tail: PoolStats
    sequences_host: int
    sequences_disk: int
    offloads_host: int
    offloads_disk: int
    page_ins_host: int
    page_ins_disk: int
    bytes_down: int
    bytes_up: int
    spilled_blocks: int
    prefix_hit_blocks_host: int
    prefix_hit_blocks_disk: int
    disk_bytes: int
    disk_entries: int
    sink_tokens: int
    disk_used_bytes: int
    disk_max_bytes: int
    disk_held_bytes: int
    disk_evictions: int
    disk_evicted_bytes: int
    disk_skipped_spills: int
    host_metadata_bytes: int
    host_tier_bytes: int
    redis_state: str
    redis_blocks_out: int
    redis_bytes_out: int
    prefix_hit_blocks_redis: int
    redis_bytes_in: int
    redis_misses: int
    redis_refused: int
    redis_dropped_puts: int
    redis_errors: int
    redis_last_error: str
    main_reserved_bytes: int
    main_used_bytes: int
    tail_reserved_bytes: int
    tail_used_bytes: int
    host_used_bytes: int
    reserved_bytes: int
    window_freed_blocks: int
    bytes_down_host: int
    bytes_down_disk: int
    bytes_up_host: int
    bytes_up_disk: int
    def __init__(self, cache: _Optional[str] = ..., main: _Optional[_Union[PoolStats, _Mapping]] = ..., tail: _Optional[_Union[PoolStats, _Mapping]] = ..., sequences: _Optional[int] = ..., tokens: _Optional[int] = ..., sealed_tokens: _Optional[int] = ..., bytes_per_token: _Optional[int] = ..., fp16_bytes_per_token: _Optional[int] = ..., compression_ratio: _Optional[float] = ..., used_bytes: _Optional[int] = ..., effective_bytes_per_token: _Optional[float] = ..., prefix_query_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., prefix_hit_rate: _Optional[float] = ..., appended_tokens: _Optional[int] = ..., sealed_blocks: _Optional[int] = ..., dedup_blocks: _Optional[int] = ..., attend_calls: _Optional[int] = ..., host: _Optional[_Union[PoolStats, _Mapping]] = ..., host_tail: _Optional[_Union[PoolStats, _Mapping]] = ..., sequences_host: _Optional[int] = ..., sequences_disk: _Optional[int] = ..., offloads_host: _Optional[int] = ..., offloads_disk: _Optional[int] = ..., page_ins_host: _Optional[int] = ..., page_ins_disk: _Optional[int] = ..., bytes_down: _Optional[int] = ..., bytes_up: _Optional[int] = ..., spilled_blocks: _Optional[int] = ..., prefix_hit_blocks_host: _Optional[int] = ..., prefix_hit_blocks_disk: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., disk_entries: _Optional[int] = ..., sink_tokens: _Optional[int] = ..., disk_used_bytes: _Optional[int] = ..., disk_max_bytes: _Optional[int] = ..., disk_held_bytes: _Optional[int] = ..., disk_evictions: _Optional[int] = ..., disk_evicted_bytes: _Optional[int] = ..., disk_skipped_spills: _Optional[int] = ..., host_metadata_bytes: _Optional[int] = ..., host_tier_bytes: _Optional[int] = ..., redis_state: _Optional[str] = ..., redis_blocks_out: _Optional[int] = ..., redis_bytes_out: _Optional[int] = ..., prefix_hit_blocks_redis: _Optional[int] = ..., redis_bytes_in: _Optional[int] = ..., redis_misses: _Optional[int] = ..., redis_refused: _Optional[int] = ..., redis_dropped_puts: _Optional[int] = ..., redis_errors: _Optional[int] = ..., redis_last_error: _Optional[str] = ..., main_reserved_bytes: _Optional[int] = ..., main_used_bytes: _Optional[int] = ..., tail_reserved_bytes: _Optional[int] = ..., tail_used_bytes: _Optional[int] = ..., host_used_bytes: _Optional[int] = ..., reserved_bytes: _Optional[int] = ..., window_freed_blocks: _Optional[int] = ..., bytes_down_host: _Optional[int] = ..., bytes_down_disk: _Optional[int] = ..., bytes_up_host: _Optional[int] = ..., bytes_up_disk: _Optional[int] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("caches", "disk")
    CACHES_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    caches: _containers.RepeatedCompositeFieldContainer[CacheStats]
    disk: DiskStats
    def __init__(self, caches: _Optional[_Iterable[_Union[CacheStats, _Mapping]]] = ..., disk: _Optional[_Union[DiskStats, _Mapping]] = ...) -> None: ...

class DiskStats(_message.Message):
    __slots__ = ("bytes", "entries", "used_bytes", "max_bytes", "held_bytes")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    HELD_BYTES_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    entries: int
    used_bytes: int
    max_bytes: int
    held_bytes: int
    def __init__(self, bytes: _Optional[int] = ..., entries: _Optional[int] = ..., used_bytes: _Optional[int] = ..., max_bytes: _Optional[int] = ..., held_bytes: _Optional[int] = ...) -> None: ...

class SequenceInfoRequest(_message.Message):
    __slots__ = ("cache", "sequence_id")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    cache: str
    sequence_id: str
    def __init__(self, cache: _Optional[str] = ..., sequence_id: _Optional[str] = ...) -> None: ...

class SequenceInfoReply(_message.Message):
    __slots__ = ("sequence_id", "length", "sealed_blocks", "sealed_block_refs", "tail_blocks", "tail_block_refs", "pending", "reserved", "known_token_ids", "block_hashes", "owner_session", "pinned", "persist", "tier", "sink_blocks", "window_freed_blocks")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    SEALED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SEALED_BLOCK_REFS_FIELD_NUMBER: _ClassVar[int]
    TAIL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TAIL_BLOCK_REFS_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    KNOWN_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    OWNER_SESSION_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    PERSIST_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SINK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FREED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    length: int
    sealed_blocks: _containers.RepeatedScalarFieldContainer[int]
    sealed_block_refs: _containers.RepeatedScalarFieldContainer[int]
    tail_blocks: _containers.RepeatedScalarFieldContainer[int]
    tail_block_refs: _containers.RepeatedScalarFieldContainer[int]
    pending: _containers.RepeatedScalarFieldContainer[int]
    reserved: int
    known_token_ids: int
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    owner_session: str
    pinned: bool
    persist: bool
    tier: str
    sink_blocks: int
    window_freed_blocks: int
    def __init__(self, sequence_id: _Optional[str] = ..., length: _Optional[int] = ..., sealed_blocks: _Optional[_Iterable[int]] = ..., sealed_block_refs: _Optional[_Iterable[int]] = ..., tail_blocks: _Optional[_Iterable[int]] = ..., tail_block_refs: _Optional[_Iterable[int]] = ..., pending: _Optional[_Iterable[int]] = ..., reserved: _Optional[int] = ..., known_token_ids: _Optional[int] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., owner_session: _Optional[str] = ..., pinned: _Optional[bool] = ..., persist: _Optional[bool] = ..., tier: _Optional[str] = ..., sink_blocks: _Optional[int] = ..., window_freed_blocks: _Optional[int] = ...) -> None: ...

class ListSequencesRequest(_message.Message):
    __slots__ = ("cache",)
    CACHE_FIELD_NUMBER: _ClassVar[int]
    cache: str
    def __init__(self, cache: _Optional[str] = ...) -> None: ...

class ListSequencesReply(_message.Message):
    __slots__ = ("sequences",)
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SequenceInfoReply]
    def __init__(self, sequences: _Optional[_Iterable[_Union[SequenceInfoReply, _Mapping]]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("session_id", "tenant", "lease_timeout_s", "sequences", "instance", "version")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tenant: str
    lease_timeout_s: float
    sequences: int
    instance: str
    version: str
    def __init__(self, session_id: _Optional[str] = ..., tenant: _Optional[str] = ..., lease_timeout_s: _Optional[float] = ..., sequences: _Optional[int] = ..., instance: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...
