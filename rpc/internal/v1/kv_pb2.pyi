from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_UNSPECIFIED: _ClassVar[Transport]
    TRANSPORT_SHM: _ClassVar[Transport]
    TRANSPORT_GRPC: _ClassVar[Transport]
    TRANSPORT_MOONCAKE: _ClassVar[Transport]
    TRANSPORT_DEVICE: _ClassVar[Transport]

class KVSegmentKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_SEGMENT_KIND_UNSPECIFIED: _ClassVar[KVSegmentKind]
    KV_SEGMENT_KIND_TARGET: _ClassVar[KVSegmentKind]
    KV_SEGMENT_KIND_DRAFT: _ClassVar[KVSegmentKind]
    KV_SEGMENT_KIND_STATE: _ClassVar[KVSegmentKind]

class KVChecksumAlgorithm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_CHECKSUM_ALGORITHM_UNSPECIFIED: _ClassVar[KVChecksumAlgorithm]
    KV_CHECKSUM_ALGORITHM_XXH3_64: _ClassVar[KVChecksumAlgorithm]
    KV_CHECKSUM_ALGORITHM_CRC32: _ClassVar[KVChecksumAlgorithm]
TRANSPORT_UNSPECIFIED: Transport
TRANSPORT_SHM: Transport
TRANSPORT_GRPC: Transport
TRANSPORT_MOONCAKE: Transport
TRANSPORT_DEVICE: Transport
KV_SEGMENT_KIND_UNSPECIFIED: KVSegmentKind
KV_SEGMENT_KIND_TARGET: KVSegmentKind
KV_SEGMENT_KIND_DRAFT: KVSegmentKind
KV_SEGMENT_KIND_STATE: KVSegmentKind
KV_CHECKSUM_ALGORITHM_UNSPECIFIED: KVChecksumAlgorithm
KV_CHECKSUM_ALGORITHM_XXH3_64: KVChecksumAlgorithm
KV_CHECKSUM_ALGORITHM_CRC32: KVChecksumAlgorithm

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "latent_dim", "rope_dim", "page_size", "dtype", "draft_layers", "draft_dim", "hash", "state_layers", "conv_width", "conv_channels", "state_heads", "head_k_dim", "head_v_dim", "conv_dtype", "ssm_dtype")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    LATENT_DIM_FIELD_NUMBER: _ClassVar[int]
    ROPE_DIM_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DIM_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    STATE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    CONV_WIDTH_FIELD_NUMBER: _ClassVar[int]
    CONV_CHANNELS_FIELD_NUMBER: _ClassVar[int]
    STATE_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_K_DIM_FIELD_NUMBER: _ClassVar[int]
    HEAD_V_DIM_FIELD_NUMBER: _ClassVar[int]
    CONV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SSM_DTYPE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    latent_dim: int
    rope_dim: int
    page_size: int
    dtype: str
    draft_layers: int
    draft_dim: int
    hash: str
    state_layers: int
    conv_width: int
    conv_channels: int
    state_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_dtype: str
    ssm_dtype: str
    def __init__(self, num_layers: _Optional[int] = ..., latent_dim: _Optional[int] = ..., rope_dim: _Optional[int] = ..., page_size: _Optional[int] = ..., dtype: _Optional[str] = ..., draft_layers: _Optional[int] = ..., draft_dim: _Optional[int] = ..., hash: _Optional[str] = ..., state_layers: _Optional[int] = ..., conv_width: _Optional[int] = ..., conv_channels: _Optional[int] = ..., state_heads: _Optional[int] = ..., head_k_dim: _Optional[int] = ..., head_v_dim: _Optional[int] = ..., conv_dtype: _Optional[str] = ..., ssm_dtype: _Optional[str] = ...) -> None: ...

class KVDestination(_message.Message):
    __slots__ = ("transport", "layout_hash", "page_ids", "targets", "request_id", "lease_id", "lease_deadline_unix_ms", "num_tokens", "pool_num_pages", "completion_slot", "completion_sequence", "data_addresses", "record_addresses", "state_slot", "lease_page_ids", "lease_num_tokens", "cached_tokens", "checkpoint_tokens")
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    POOL_NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_SLOT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    RECORD_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOT_FIELD_NUMBER: _ClassVar[int]
    LEASE_PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    transport: Transport
    layout_hash: str
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    targets: _containers.RepeatedScalarFieldContainer[str]
    request_id: str
    lease_id: str
    lease_deadline_unix_ms: int
    num_tokens: int
    pool_num_pages: int
    completion_slot: int
    completion_sequence: int
    data_addresses: _containers.RepeatedScalarFieldContainer[int]
    record_addresses: _containers.RepeatedScalarFieldContainer[int]
    state_slot: int
    lease_page_ids: _containers.RepeatedScalarFieldContainer[int]
    lease_num_tokens: int
    cached_tokens: int
    checkpoint_tokens: int
    def __init__(self, transport: _Optional[_Union[Transport, str]] = ..., layout_hash: _Optional[str] = ..., page_ids: _Optional[_Iterable[int]] = ..., targets: _Optional[_Iterable[str]] = ..., request_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., lease_deadline_unix_ms: _Optional[int] = ..., num_tokens: _Optional[int] = ..., pool_num_pages: _Optional[int] = ..., completion_slot: _Optional[int] = ..., completion_sequence: _Optional[int] = ..., data_addresses: _Optional[_Iterable[int]] = ..., record_addresses: _Optional[_Iterable[int]] = ..., state_slot: _Optional[int] = ..., lease_page_ids: _Optional[_Iterable[int]] = ..., lease_num_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., checkpoint_tokens: _Optional[int] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("request_id", "lease_id", "layout_hash", "rank", "sequence", "kind", "layer", "page_ids", "first_page_offset", "payload", "checksum", "checksum_algorithm")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_PAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease_id: str
    layout_hash: str
    rank: int
    sequence: int
    kind: KVSegmentKind
    layer: int
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    first_page_offset: int
    payload: bytes
    checksum: int
    checksum_algorithm: KVChecksumAlgorithm
    def __init__(self, request_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., layout_hash: _Optional[str] = ..., rank: _Optional[int] = ..., sequence: _Optional[int] = ..., kind: _Optional[_Union[KVSegmentKind, str]] = ..., layer: _Optional[int] = ..., page_ids: _Optional[_Iterable[int]] = ..., first_page_offset: _Optional[int] = ..., payload: _Optional[bytes] = ..., checksum: _Optional[int] = ..., checksum_algorithm: _Optional[_Union[KVChecksumAlgorithm, str]] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("ok", "bytes", "error", "chunks")
    OK_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    bytes: int
    error: str
    chunks: int
    def __init__(self, ok: _Optional[bool] = ..., bytes: _Optional[int] = ..., error: _Optional[str] = ..., chunks: _Optional[int] = ...) -> None: ...
