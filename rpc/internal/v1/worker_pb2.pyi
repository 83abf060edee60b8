from rpc.internal.v1 import kv_pb2 as _kv_pb2
from rpc.v1 import gateway_pb2 as _gateway_pb2
from rpc.v1 import logprobs_pb2 as _logprobs_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerSampling(_message.Message):
    __slots__ = ("max_new_tokens", "distribution", "stop_token_ids", "ignore_eos", "logprobs", "speculative", "block_size", "prompt_logprobs", "structured_output")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTION_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    distribution: _gateway_pb2.SamplingParams
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    speculative: bool
    block_size: int
    prompt_logprobs: int
    structured_output: _gateway_pb2.StructuredOutput
    def __init__(self, max_new_tokens: _Optional[int] = ..., distribution: _Optional[_Union[_gateway_pb2.SamplingParams, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., speculative: _Optional[bool] = ..., block_size: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., structured_output: _Optional[_Union[_gateway_pb2.StructuredOutput, _Mapping]] = ...) -> None: ...

class WorkerPlacement(_message.Message):
    __slots__ = ("node_id", "tp_size", "device", "kv_pool")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    tp_size: int
    device: str
    kv_pool: str
    def __init__(self, node_id: _Optional[str] = ..., tp_size: _Optional[int] = ..., device: _Optional[str] = ..., kv_pool: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "destination")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: WorkerSampling
    destination: _kv_pb2.KVDestination
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[WorkerSampling, _Mapping]] = ..., destination: _Optional[_Union[_kv_pb2.KVDestination, _Mapping]] = ...) -> None: ...

class PrefillTiming(_message.Message):
    __slots__ = ("queue_ms", "prefill_ms", "transfer_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    prefill_ms: float
    transfer_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "first_logprob", "num_prompt_tokens", "timing", "prompt_logprobs", "num_cached_tokens")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    first_logprob: _logprobs_pb2.TokenLogprob
    num_prompt_tokens: int
    timing: PrefillTiming
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_logprobs_pb2.TokenLogprob]
    num_cached_tokens: int
    def __init__(self, first_token: _Optional[int] = ..., first_logprob: _Optional[_Union[_logprobs_pb2.TokenLogprob, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., timing: _Optional[_Union[PrefillTiming, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_logprobs_pb2.TokenLogprob, _Mapping]]] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class PrefillStreamRequest(_message.Message):
    __slots__ = ("request", "timeout_ms", "trace_id")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    request: PrefillRequest
    timeout_ms: int
    trace_id: str
    def __init__(self, request: _Optional[_Union[PrefillRequest, _Mapping]] = ..., timeout_ms: _Optional[int] = ..., trace_id: _Optional[str] = ...) -> None: ...

class PrefillStreamError(_message.Message):
    __slots__ = ("code", "message", "status_details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STATUS_DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    status_details: bytes
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., status_details: _Optional[bytes] = ...) -> None: ...

class PrefillStreamResponse(_message.Message):
    __slots__ = ("request_id", "response", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    response: PrefillResponse
    error: PrefillStreamError
    def __init__(self, request_id: _Optional[str] = ..., response: _Optional[_Union[PrefillResponse, _Mapping]] = ..., error: _Optional[_Union[PrefillStreamError, _Mapping]] = ...) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: bool
    def __init__(self, dropped: _Optional[bool] = ...) -> None: ...

class GetPrefillLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetPrefillLoadResponse(_message.Message):
    __slots__ = ("queued_requests", "queued_tokens", "requests_total", "placement", "free_state_slots", "total_state_slots", "checkpoints", "checkpoint_slots")
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    FREE_STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    queued_requests: int
    queued_tokens: int
    requests_total: int
    placement: WorkerPlacement
    free_state_slots: int
    total_state_slots: int
    checkpoints: int
    checkpoint_slots: int
    def __init__(self, queued_requests: _Optional[int] = ..., queued_tokens: _Optional[int] = ..., requests_total: _Optional[int] = ..., placement: _Optional[_Union[WorkerPlacement, _Mapping]] = ..., free_state_slots: _Optional[int] = ..., total_state_slots: _Optional[int] = ..., checkpoints: _Optional[int] = ..., checkpoint_slots: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "num_prompt_tokens", "max_new_tokens", "transport", "standing", "prompt_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    STANDING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_prompt_tokens: int
    max_new_tokens: int
    transport: _kv_pb2.Transport
    standing: bool
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., transport: _Optional[_Union[_kv_pb2.Transport, str]] = ..., standing: _Optional[bool] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("destination",)
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    destination: _kv_pb2.KVDestination
    def __init__(self, destination: _Optional[_Union[_kv_pb2.KVDestination, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "lease_id", "token_ids", "first_token", "sampling", "stream_interval", "prefill_locally")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LOCALLY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token: int
    sampling: WorkerSampling
    stream_interval: int
    prefill_locally: bool
    def __init__(self, request_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., first_token: _Optional[int] = ..., sampling: _Optional[_Union[WorkerSampling, _Mapping]] = ..., stream_interval: _Optional[int] = ..., prefill_locally: _Optional[bool] = ...) -> None: ...

class DecodeStreamRequest(_message.Message):
    __slots__ = ("request", "cancel_request_id", "timeout_ms", "trace_id")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    CANCEL_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    TRACE_ID_FIELD_NUMBER: _ClassVar[int]
    request: DecodeRequest
    cancel_request_id: str
    timeout_ms: int
    trace_id: str
    def __init__(self, request: _Optional[_Union[DecodeRequest, _Mapping]] = ..., cancel_request_id: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., trace_id: _Optional[str] = ...) -> None: ...

class DecodeStreamUpdate(_message.Message):
    __slots__ = ("request_id", "token_ids", "logprobs", "finished", "finish_reason", "decode_steps")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_logprobs_pb2.TokenLogprob]
    finished: bool
    finish_reason: str
    decode_steps: int
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_logprobs_pb2.TokenLogprob, _Mapping]]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., decode_steps: _Optional[int] = ...) -> None: ...

class DecodeStreamError(_message.Message):
    __slots__ = ("request_id", "code", "message", "status_details")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STATUS_DETAILS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    code: int
    message: str
    status_details: bytes
    def __init__(self, request_id: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ..., status_details: _Optional[bytes] = ...) -> None: ...

class DecodeStreamResponse(_message.Message):
    __slots__ = ("updates", "errors")
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[DecodeStreamUpdate]
    errors: _containers.RepeatedCompositeFieldContainer[DecodeStreamError]
    def __init__(self, updates: _Optional[_Iterable[_Union[DecodeStreamUpdate, _Mapping]]] = ..., errors: _Optional[_Iterable[_Union[DecodeStreamError, _Mapping]]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetDecodeLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetDecodeLoadResponse(_message.Message):
    __slots__ = ("free_pages", "total_pages", "running", "waiting", "leases", "leased_pages", "page_size", "headroom_pages", "requests_total", "free_state_slots", "total_state_slots", "placement", "standing_leases", "standing_pages", "standing_state_slots", "checkpoints", "checkpoint_slots", "cached_pages", "prefix_queried_tokens", "prefix_hit_tokens")
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    LEASED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    HEADROOM_PAGES_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    FREE_STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    STANDING_LEASES_FIELD_NUMBER: _ClassVar[int]
    STANDING_PAGES_FIELD_NUMBER: _ClassVar[int]
    STANDING_STATE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_SLOTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    free_pages: int
    total_pages: int
    running: int
    waiting: int
    leases: int
    leased_pages: int
    page_size: int
    headroom_pages: int
    requests_total: int
    free_state_slots: int
    total_state_slots: int
    placement: WorkerPlacement
    standing_leases: int
    standing_pages: int
    standing_state_slots: int
    checkpoints: int
    checkpoint_slots: int
    cached_pages: int
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    def __init__(self, free_pages: _Optional[int] = ..., total_pages: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., leases: _Optional[int] = ..., leased_pages: _Optional[int] = ..., page_size: _Optional[int] = ..., headroom_pages: _Optional[int] = ..., requests_total: _Optional[int] = ..., free_state_slots: _Optional[int] = ..., total_state_slots: _Optional[int] = ..., placement: _Optional[_Union[WorkerPlacement, _Mapping]] = ..., standing_leases: _Optional[int] = ..., standing_pages: _Optional[int] = ..., standing_state_slots: _Optional[int] = ..., checkpoints: _Optional[int] = ..., checkpoint_slots: _Optional[int] = ..., cached_pages: _Optional[int] = ..., prefix_queried_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ...) -> None: ...

class WatchKVEventsRequest(_message.Message):
    __slots__ = ("instance_id", "after_sequence")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    after_sequence: int
    def __init__(self, instance_id: _Optional[str] = ..., after_sequence: _Optional[int] = ...) -> None: ...

class KVPageStored(_message.Message):
    __slots__ = ("key", "parent_key", "num_tokens", "has_draft")
    KEY_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HAS_DRAFT_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    parent_key: bytes
    num_tokens: int
    has_draft: bool
    def __init__(self, key: _Optional[bytes] = ..., parent_key: _Optional[bytes] = ..., num_tokens: _Optional[int] = ..., has_draft: _Optional[bool] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("sequence", "stored", "removed", "checkpoint_stored", "checkpoint_removed", "cleared")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STORED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    stored: KVPageStored
    removed: bytes
    checkpoint_stored: bytes
    checkpoint_removed: bytes
    cleared: KVCleared
    def __init__(self, sequence: _Optional[int] = ..., stored: _Optional[_Union[KVPageStored, _Mapping]] = ..., removed: _Optional[bytes] = ..., checkpoint_stored: _Optional[bytes] = ..., checkpoint_removed: _Optional[bytes] = ..., cleared: _Optional[_Union[KVCleared, _Mapping]] = ...) -> None: ...

class KVCleared(_message.Message):
    __slots__ = ("root_key", "page_size", "needs_checkpoints")
    ROOT_KEY_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NEEDS_CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    root_key: bytes
    page_size: int
    needs_checkpoints: bool
    def __init__(self, root_key: _Optional[bytes] = ..., page_size: _Optional[int] = ..., needs_checkpoints: _Optional[bool] = ...) -> None: ...

class KVSnapshot(_message.Message):
    __slots__ = ("sequence", "root_key", "page_size", "pages", "checkpoint_keys", "needs_checkpoints")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ROOT_KEY_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_KEYS_FIELD_NUMBER: _ClassVar[int]
    NEEDS_CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    root_key: bytes
    page_size: int
    pages: _containers.RepeatedCompositeFieldContainer[KVPageStored]
    checkpoint_keys: _containers.RepeatedScalarFieldContainer[bytes]
    needs_checkpoints: bool
    def __init__(self, sequence: _Optional[int] = ..., root_key: _Optional[bytes] = ..., page_size: _Optional[int] = ..., pages: _Optional[_Iterable[_Union[KVPageStored, _Mapping]]] = ..., checkpoint_keys: _Optional[_Iterable[bytes]] = ..., needs_checkpoints: _Optional[bool] = ...) -> None: ...

class WatchKVEventsResponse(_message.Message):
    __slots__ = ("instance_id", "snapshot", "events")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    snapshot: KVSnapshot
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    def __init__(self, instance_id: _Optional[str] = ..., snapshot: _Optional[_Union[KVSnapshot, _Mapping]] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ...) -> None: ...
