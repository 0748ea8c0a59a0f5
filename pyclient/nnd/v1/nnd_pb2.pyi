from nnd.v1 import graph_pb2 as _graph_pb2
from nnd.v1 import values_pb2 as _values_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_STATE_UNSPECIFIED: _ClassVar[ModelState]
    META: _ClassVar[ModelState]
    DISPATCHING: _ClassVar[ModelState]
    DISPATCHED: _ClassVar[ModelState]
MODEL_STATE_UNSPECIFIED: ModelState
META: ModelState
DISPATCHING: ModelState
DISPATCHED: ModelState

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("version", "protocol", "ops", "attributes", "limits", "libraries", "devices")
    class LibrariesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    LIBRARIES_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    version: str
    protocol: str
    ops: _containers.RepeatedScalarFieldContainer[str]
    attributes: _containers.RepeatedScalarFieldContainer[str]
    limits: Limits
    libraries: _containers.ScalarMap[str, str]
    devices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[str] = ..., protocol: _Optional[str] = ..., ops: _Optional[_Iterable[str]] = ..., attributes: _Optional[_Iterable[str]] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., libraries: _Optional[_Mapping[str, str]] = ..., devices: _Optional[_Iterable[str]] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_request_bytes", "max_constant_bytes", "max_saved_bytes", "max_invokes", "max_sequence_length", "max_new_tokens", "default_deadline_s", "max_queue_depth", "max_dispatched_models", "max_upload_bytes", "max_tokenize_bytes", "max_inflight_bytes", "helper_memory_bytes", "helper_cpu_s", "max_pause_s", "max_paused_total_s")
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_CONSTANT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_SAVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_INVOKES_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    MAX_DISPATCHED_MODELS_FIELD_NUMBER: _ClassVar[int]
    MAX_UPLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_INFLIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    HELPER_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HELPER_CPU_S_FIELD_NUMBER: _ClassVar[int]
    MAX_PAUSE_S_FIELD_NUMBER: _ClassVar[int]
    MAX_PAUSED_TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    max_request_bytes: int
    max_constant_bytes: int
    max_saved_bytes: int
    max_invokes: int
    max_sequence_length: int
    max_new_tokens: int
    default_deadline_s: float
    max_queue_depth: int
    max_dispatched_models: int
    max_upload_bytes: int
    max_tokenize_bytes: int
    max_inflight_bytes: int
    helper_memory_bytes: int
    helper_cpu_s: float
    max_pause_s: float
    max_paused_total_s: float
    def __init__(self, max_request_bytes: _Optional[int] = ..., max_constant_bytes: _Optional[int] = ..., max_saved_bytes: _Optional[int] = ..., max_invokes: _Optional[int] = ..., max_sequence_length: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., default_deadline_s: _Optional[float] = ..., max_queue_depth: _Optional[int] = ..., max_dispatched_models: _Optional[int] = ..., max_upload_bytes: _Optional[int] = ..., max_tokenize_bytes: _Optional[int] = ..., max_inflight_bytes: _Optional[int] = ..., helper_memory_bytes: _Optional[int] = ..., helper_cpu_s: _Optional[float] = ..., max_pause_s: _Optional[float] = ..., max_paused_total_s: _Optional[float] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("device", "device_map", "dtype", "compute_dtype", "max_memory", "tp_size")
    class MaxMemoryEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MAP_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_MEMORY_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    device: str
    device_map: str
    dtype: str
    compute_dtype: str
    max_memory: _containers.ScalarMap[str, str]
    tp_size: int
    def __init__(self, device: _Optional[str] = ..., device_map: _Optional[str] = ..., dtype: _Optional[str] = ..., compute_dtype: _Optional[str] = ..., max_memory: _Optional[_Mapping[str, str]] = ..., tp_size: _Optional[int] = ...) -> None: ...

class LoadModelRequest(_message.Message):
    __slots__ = ("model", "revision", "task", "trust_remote_code", "placement", "dispatch", "keep_alive", "rename", "upload", "options", "name")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    TRUST_REMOTE_CODE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    DISPATCH_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_FIELD_NUMBER: _ClassVar[int]
    RENAME_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    model: str
    revision: str
    task: str
    trust_remote_code: bool
    placement: Placement
    dispatch: bool
    keep_alive: str
    rename: _containers.RepeatedCompositeFieldContainer[Rename]
    upload: str
    options: LoadOptions
    name: str
    def __init__(self, model: _Optional[str] = ..., revision: _Optional[str] = ..., task: _Optional[str] = ..., trust_remote_code: _Optional[bool] = ..., placement: _Optional[_Union[Placement, _Mapping]] = ..., dispatch: _Optional[bool] = ..., keep_alive: _Optional[str] = ..., rename: _Optional[_Iterable[_Union[Rename, _Mapping]]] = ..., upload: _Optional[str] = ..., options: _Optional[_Union[LoadOptions, _Mapping]] = ..., name: _Optional[str] = ...) -> None: ...

class LoadOptions(_message.Message):
    __slots__ = ("attn_implementation", "config_json")
    ATTN_IMPLEMENTATION_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    attn_implementation: str
    config_json: str
    def __init__(self, attn_implementation: _Optional[str] = ..., config_json: _Optional[str] = ...) -> None: ...

class Rename(_message.Message):
    __slots__ = ("path", "type", "aliases")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    path: str
    type: str
    aliases: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, path: _Optional[str] = ..., type: _Optional[str] = ..., aliases: _Optional[_Iterable[str]] = ...) -> None: ...

class GetModelRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class DispatchRequest(_message.Message):
    __slots__ = ("model", "placement", "keep_alive")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_FIELD_NUMBER: _ClassVar[int]
    model: str
    placement: Placement
    keep_alive: str
    def __init__(self, model: _Optional[str] = ..., placement: _Optional[_Union[Placement, _Mapping]] = ..., keep_alive: _Optional[str] = ...) -> None: ...

class DispatchProgress(_message.Message):
    __slots__ = ("stage", "done", "total", "unit", "message", "model")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    stage: str
    done: int
    total: int
    unit: str
    message: str
    model: ModelInfo
    def __init__(self, stage: _Optional[str] = ..., done: _Optional[int] = ..., total: _Optional[int] = ..., unit: _Optional[str] = ..., message: _Optional[str] = ..., model: _Optional[_Union[ModelInfo, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("model", "force")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    model: str
    force: bool
    def __init__(self, model: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class ReadLogsRequest(_message.Message):
    __slots__ = ("model", "offset", "max_bytes")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    model: str
    offset: int
    max_bytes: int
    def __init__(self, model: _Optional[str] = ..., offset: _Optional[int] = ..., max_bytes: _Optional[int] = ...) -> None: ...

class ReadLogsResponse(_message.Message):
    __slots__ = ("data", "next_offset", "size", "path")
    DATA_FIELD_NUMBER: _ClassVar[int]
    NEXT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    next_offset: int
    size: int
    path: str
    def __init__(self, data: _Optional[bytes] = ..., next_offset: _Optional[int] = ..., size: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class UnloadRequest(_message.Message):
    __slots__ = ("model", "force")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    model: str
    force: bool
    def __init__(self, model: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class UnloadResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ParameterInfo(_message.Message):
    __slots__ = ("name", "shape", "dtype", "device", "buffer", "tied_to")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    TIED_TO_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    device: str
    buffer: bool
    tied_to: str
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., buffer: _Optional[bool] = ..., tied_to: _Optional[str] = ...) -> None: ...

class ModuleInfo(_message.Message):
    __slots__ = ("path", "type", "parameters", "extra", "aliases", "attributes_json")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_JSON_FIELD_NUMBER: _ClassVar[int]
    path: str
    type: str
    parameters: _containers.RepeatedCompositeFieldContainer[ParameterInfo]
    extra: str
    aliases: _containers.RepeatedScalarFieldContainer[str]
    attributes_json: str
    def __init__(self, path: _Optional[str] = ..., type: _Optional[str] = ..., parameters: _Optional[_Iterable[_Union[ParameterInfo, _Mapping]]] = ..., extra: _Optional[str] = ..., aliases: _Optional[_Iterable[str]] = ..., attributes_json: _Optional[str] = ...) -> None: ...

class DeviceMemory(_message.Message):
    __slots__ = ("device", "bytes")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    device: str
    bytes: int
    def __init__(self, device: _Optional[str] = ..., bytes: _Optional[int] = ...) -> None: ...

class RequestInFlight(_message.Message):
    __slots__ = ("kind", "client", "state", "since", "step", "steps", "position", "paused_since", "user")
    KIND_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    PAUSED_SINCE_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    kind: str
    client: str
    state: str
    since: float
    step: int
    steps: int
    position: int
    paused_since: float
    user: str
    def __init__(self, kind: _Optional[str] = ..., client: _Optional[str] = ..., state: _Optional[str] = ..., since: _Optional[float] = ..., step: _Optional[int] = ..., steps: _Optional[int] = ..., position: _Optional[int] = ..., paused_since: _Optional[float] = ..., user: _Optional[str] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "state", "task", "architecture", "config", "num_parameters", "placement", "dispatched_placement", "modules", "weights", "worker_rss_bytes", "worker_pids", "idle_s", "expires_at", "last_error", "dtype", "estimated_bytes", "tp_size", "ranks", "requests", "route", "worker_requests", "config_json", "loaded_by", "dispatched_by", "dispatched_at")
    class ConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    DISPATCHED_PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    MODULES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    WORKER_RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    WORKER_PIDS_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    WORKER_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    LOADED_BY_FIELD_NUMBER: _ClassVar[int]
    DISPATCHED_BY_FIELD_NUMBER: _ClassVar[int]
    DISPATCHED_AT_FIELD_NUMBER: _ClassVar[int]
    name: str
    state: ModelState
    task: str
    architecture: str
    config: _containers.ScalarMap[str, str]
    num_parameters: int
    placement: Placement
    dispatched_placement: Placement
    modules: _containers.RepeatedCompositeFieldContainer[ModuleInfo]
    weights: _containers.RepeatedCompositeFieldContainer[DeviceMemory]
    worker_rss_bytes: int
    worker_pids: _containers.RepeatedScalarFieldContainer[int]
    idle_s: float
    expires_at: float
    last_error: str
    dtype: str
    estimated_bytes: int
    tp_size: int
    ranks: _containers.RepeatedCompositeFieldContainer[WorkerRank]
    requests: _containers.RepeatedCompositeFieldContainer[RequestInFlight]
    route: Route
    worker_requests: int
    config_json: str
    loaded_by: str
    dispatched_by: str
    dispatched_at: float
    def __init__(self, name: _Optional[str] = ..., state: _Optional[_Union[ModelState, str]] = ..., task: _Optional[str] = ..., architecture: _Optional[str] = ..., config: _Optional[_Mapping[str, str]] = ..., num_parameters: _Optional[int] = ..., placement: _Optional[_Union[Placement, _Mapping]] = ..., dispatched_placement: _Optional[_Union[Placement, _Mapping]] = ..., modules: _Optional[_Iterable[_Union[ModuleInfo, _Mapping]]] = ..., weights: _Optional[_Iterable[_Union[DeviceMemory, _Mapping]]] = ..., worker_rss_bytes: _Optional[int] = ..., worker_pids: _Optional[_Iterable[int]] = ..., idle_s: _Optional[float] = ..., expires_at: _Optional[float] = ..., last_error: _Optional[str] = ..., dtype: _Optional[str] = ..., estimated_bytes: _Optional[int] = ..., tp_size: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[WorkerRank, _Mapping]]] = ..., requests: _Optional[_Iterable[_Union[RequestInFlight, _Mapping]]] = ..., route: _Optional[_Union[Route, _Mapping]] = ..., worker_requests: _Optional[int] = ..., config_json: _Optional[str] = ..., loaded_by: _Optional[str] = ..., dispatched_by: _Optional[str] = ..., dispatched_at: _Optional[float] = ...) -> None: ...

class WorkerRank(_message.Message):
    __slots__ = ("rank", "pid", "rss_bytes", "device")
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    rank: int
    pid: int
    rss_bytes: int
    device: str
    def __init__(self, rank: _Optional[int] = ..., pid: _Optional[int] = ..., rss_bytes: _Optional[int] = ..., device: _Optional[str] = ...) -> None: ...

class RouteRequest(_message.Message):
    __slots__ = ("model", "failed_epoch")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FAILED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    model: str
    failed_epoch: int
    def __init__(self, model: _Optional[str] = ..., failed_epoch: _Optional[int] = ...) -> None: ...

class Route(_message.Message):
    __slots__ = ("address", "epoch", "lost", "fast_address")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    FAST_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    epoch: int
    lost: str
    fast_address: str
    def __init__(self, address: _Optional[str] = ..., epoch: _Optional[int] = ..., lost: _Optional[str] = ..., fast_address: _Optional[str] = ...) -> None: ...

class FastCall(_message.Message):
    __slots__ = ("method", "metadata", "timeout_s", "half_close")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    HALF_CLOSE_FIELD_NUMBER: _ClassVar[int]
    method: str
    metadata: _containers.RepeatedCompositeFieldContainer[FastMetadata]
    timeout_s: float
    half_close: bool
    def __init__(self, method: _Optional[str] = ..., metadata: _Optional[_Iterable[_Union[FastMetadata, _Mapping]]] = ..., timeout_s: _Optional[float] = ..., half_close: _Optional[bool] = ...) -> None: ...

class FastMetadata(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class FastReply(_message.Message):
    __slots__ = ("initial_metadata", "end", "code", "details", "trailing_metadata")
    INITIAL_METADATA_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    TRAILING_METADATA_FIELD_NUMBER: _ClassVar[int]
    initial_metadata: _containers.RepeatedCompositeFieldContainer[FastMetadata]
    end: bool
    code: int
    details: str
    trailing_metadata: _containers.RepeatedCompositeFieldContainer[FastMetadata]
    def __init__(self, initial_metadata: _Optional[_Iterable[_Union[FastMetadata, _Mapping]]] = ..., end: _Optional[bool] = ..., code: _Optional[int] = ..., details: _Optional[str] = ..., trailing_metadata: _Optional[_Iterable[_Union[FastMetadata, _Mapping]]] = ...) -> None: ...

class Invoke(_message.Message):
    __slots__ = ("text", "tokens", "prompts", "args", "kwargs")
    class KwargsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _values_pb2.Value
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_values_pb2.Value, _Mapping]] = ...) -> None: ...
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    KWARGS_FIELD_NUMBER: _ClassVar[int]
    text: str
    tokens: TokenIds
    prompts: Prompts
    args: _containers.RepeatedCompositeFieldContainer[_values_pb2.Value]
    kwargs: _containers.MessageMap[str, _values_pb2.Value]
    def __init__(self, text: _Optional[str] = ..., tokens: _Optional[_Union[TokenIds, _Mapping]] = ..., prompts: _Optional[_Union[Prompts, _Mapping]] = ..., args: _Optional[_Iterable[_Union[_values_pb2.Value, _Mapping]]] = ..., kwargs: _Optional[_Mapping[str, _values_pb2.Value]] = ...) -> None: ...

class Prompts(_message.Message):
    __slots__ = ("text", "tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: _containers.RepeatedScalarFieldContainer[str]
    tokens: _containers.RepeatedCompositeFieldContainer[TokenIds]
    def __init__(self, text: _Optional[_Iterable[str]] = ..., tokens: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateOptions(_message.Message):
    __slots__ = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "seed", "stream_text", "min_new_tokens", "num_beams", "num_return_sequences", "generation_config_json")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STREAM_TEXT_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BEAMS_FIELD_NUMBER: _ClassVar[int]
    NUM_RETURN_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stream_text: bool
    min_new_tokens: int
    num_beams: int
    num_return_sequences: int
    generation_config_json: str
    def __init__(self, max_new_tokens: _Optional[int] = ..., do_sample: _Optional[bool] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stream_text: _Optional[bool] = ..., min_new_tokens: _Optional[int] = ..., num_beams: _Optional[int] = ..., num_return_sequences: _Optional[int] = ..., generation_config_json: _Optional[str] = ...) -> None: ...

class TraceRequest(_message.Message):
    __slots__ = ("model", "invokes", "graph", "generate", "no_auto_dispatch", "keep_alive", "edits", "shm", "shm_region", "one_message")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INVOKES_FIELD_NUMBER: _ClassVar[int]
    GRAPH_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    NO_AUTO_DISPATCH_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_FIELD_NUMBER: _ClassVar[int]
    EDITS_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    SHM_REGION_FIELD_NUMBER: _ClassVar[int]
    ONE_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    model: str
    invokes: _containers.RepeatedCompositeFieldContainer[Invoke]
    graph: _graph_pb2.Graph
    generate: GenerateOptions
    no_auto_dispatch: bool
    keep_alive: str
    edits: _containers.RepeatedScalarFieldContainer[str]
    shm: bool
    shm_region: str
    one_message: bool
    def __init__(self, model: _Optional[str] = ..., invokes: _Optional[_Iterable[_Union[Invoke, _Mapping]]] = ..., graph: _Optional[_Union[_graph_pb2.Graph, _Mapping]] = ..., generate: _Optional[_Union[GenerateOptions, _Mapping]] = ..., no_auto_dispatch: _Optional[bool] = ..., keep_alive: _Optional[str] = ..., edits: _Optional[_Iterable[str]] = ..., shm: _Optional[bool] = ..., shm_region: _Optional[str] = ..., one_message: _Optional[bool] = ...) -> None: ...

class SessionTrace(_message.Message):
    __slots__ = ("request", "generate")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    request: TraceRequest
    generate: bool
    def __init__(self, request: _Optional[_Union[TraceRequest, _Mapping]] = ..., generate: _Optional[bool] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("model", "traces", "no_auto_dispatch", "keep_alive", "scan")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TRACES_FIELD_NUMBER: _ClassVar[int]
    NO_AUTO_DISPATCH_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_FIELD_NUMBER: _ClassVar[int]
    SCAN_FIELD_NUMBER: _ClassVar[int]
    model: str
    traces: _containers.RepeatedCompositeFieldContainer[SessionTrace]
    no_auto_dispatch: bool
    keep_alive: str
    scan: bool
    def __init__(self, model: _Optional[str] = ..., traces: _Optional[_Iterable[_Union[SessionTrace, _Mapping]]] = ..., no_auto_dispatch: _Optional[bool] = ..., keep_alive: _Optional[str] = ..., scan: _Optional[bool] = ...) -> None: ...

class InteractStart(_message.Message):
    __slots__ = ("request", "generate", "want", "pause_timeout_s", "finish", "session", "items")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    WANT_FIELD_NUMBER: _ClassVar[int]
    PAUSE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    request: TraceRequest
    generate: bool
    want: _containers.RepeatedScalarFieldContainer[int]
    pause_timeout_s: float
    finish: bool
    session: SessionRequest
    items: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request: _Optional[_Union[TraceRequest, _Mapping]] = ..., generate: _Optional[bool] = ..., want: _Optional[_Iterable[int]] = ..., pause_timeout_s: _Optional[float] = ..., finish: _Optional[bool] = ..., session: _Optional[_Union[SessionRequest, _Mapping]] = ..., items: _Optional[_Iterable[int]] = ...) -> None: ...

class InteractContinue(_message.Message):
    __slots__ = ("graph", "want", "finish", "traces", "items")
    GRAPH_FIELD_NUMBER: _ClassVar[int]
    WANT_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    TRACES_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    graph: _graph_pb2.Graph
    want: _containers.RepeatedScalarFieldContainer[int]
    finish: bool
    traces: _containers.RepeatedCompositeFieldContainer[SessionTrace]
    items: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, graph: _Optional[_Union[_graph_pb2.Graph, _Mapping]] = ..., want: _Optional[_Iterable[int]] = ..., finish: _Optional[bool] = ..., traces: _Optional[_Iterable[_Union[SessionTrace, _Mapping]]] = ..., items: _Optional[_Iterable[int]] = ...) -> None: ...

class InteractRequest(_message.Message):
    __slots__ = ("start", "more")
    START_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    start: InteractStart
    more: InteractContinue
    def __init__(self, start: _Optional[_Union[InteractStart, _Mapping]] = ..., more: _Optional[_Union[InteractContinue, _Mapping]] = ...) -> None: ...

class Paused(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, nodes: _Optional[_Iterable[int]] = ...) -> None: ...

class CreateEditRequest(_message.Message):
    __slots__ = ("model", "graph", "name", "base", "replace")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    GRAPH_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    REPLACE_FIELD_NUMBER: _ClassVar[int]
    model: str
    graph: _graph_pb2.Graph
    name: str
    base: _containers.RepeatedScalarFieldContainer[str]
    replace: bool
    def __init__(self, model: _Optional[str] = ..., graph: _Optional[_Union[_graph_pb2.Graph, _Mapping]] = ..., name: _Optional[str] = ..., base: _Optional[_Iterable[str]] = ..., replace: _Optional[bool] = ...) -> None: ...

class EditInfo(_message.Message):
    __slots__ = ("id", "model", "graphs", "nodes", "named", "created_by")
    ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    GRAPHS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    NAMED_FIELD_NUMBER: _ClassVar[int]
    CREATED_BY_FIELD_NUMBER: _ClassVar[int]
    id: str
    model: str
    graphs: int
    nodes: int
    named: bool
    created_by: str
    def __init__(self, id: _Optional[str] = ..., model: _Optional[str] = ..., graphs: _Optional[int] = ..., nodes: _Optional[int] = ..., named: _Optional[bool] = ..., created_by: _Optional[str] = ...) -> None: ...

class ListEditsRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ListEditsResponse(_message.Message):
    __slots__ = ("edits",)
    EDITS_FIELD_NUMBER: _ClassVar[int]
    edits: _containers.RepeatedCompositeFieldContainer[EditInfo]
    def __init__(self, edits: _Optional[_Iterable[_Union[EditInfo, _Mapping]]] = ...) -> None: ...

class DeleteEditRequest(_message.Message):
    __slots__ = ("model", "id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    id: str
    def __init__(self, model: _Optional[str] = ..., id: _Optional[str] = ...) -> None: ...

class DeleteEditResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Saved(_message.Message):
    __slots__ = ("node", "value", "value_blob")
    NODE_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    VALUE_BLOB_FIELD_NUMBER: _ClassVar[int]
    node: int
    value: _values_pb2.Value
    value_blob: int
    def __init__(self, node: _Optional[int] = ..., value: _Optional[_Union[_values_pb2.Value, _Mapping]] = ..., value_blob: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("blob", "data")
    BLOB_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    blob: int
    data: bytes
    def __init__(self, blob: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class StepTokens(_message.Message):
    __slots__ = ("step", "ids", "text", "trace")
    STEP_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    step: int
    ids: _containers.RepeatedScalarFieldContainer[int]
    text: _containers.RepeatedScalarFieldContainer[str]
    trace: int
    def __init__(self, step: _Optional[int] = ..., ids: _Optional[_Iterable[int]] = ..., text: _Optional[_Iterable[str]] = ..., trace: _Optional[int] = ...) -> None: ...

class TraceDone(_message.Message):
    __slots__ = ("compute_s",)
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    compute_s: float
    def __init__(self, compute_s: _Optional[float] = ...) -> None: ...

class TraceResults(_message.Message):
    __slots__ = ("saved", "chunk", "step", "done", "paused")
    SAVED_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    saved: _containers.RepeatedCompositeFieldContainer[Saved]
    chunk: _containers.RepeatedCompositeFieldContainer[Chunk]
    step: _containers.RepeatedCompositeFieldContainer[StepTokens]
    done: TraceDone
    paused: Paused
    def __init__(self, saved: _Optional[_Iterable[_Union[Saved, _Mapping]]] = ..., chunk: _Optional[_Iterable[_Union[Chunk, _Mapping]]] = ..., step: _Optional[_Iterable[_Union[StepTokens, _Mapping]]] = ..., done: _Optional[_Union[TraceDone, _Mapping]] = ..., paused: _Optional[_Union[Paused, _Mapping]] = ...) -> None: ...

class Queued(_message.Message):
    __slots__ = ("ahead", "running", "paused_by", "paused_for_at_most_s")
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    PAUSED_BY_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FOR_AT_MOST_S_FIELD_NUMBER: _ClassVar[int]
    ahead: int
    running: bool
    paused_by: str
    paused_for_at_most_s: float
    def __init__(self, ahead: _Optional[int] = ..., running: _Optional[bool] = ..., paused_by: _Optional[str] = ..., paused_for_at_most_s: _Optional[float] = ...) -> None: ...

class TraceResponse(_message.Message):
    __slots__ = ("saved", "chunk", "step", "done", "paused", "results", "queued")
    SAVED_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    saved: Saved
    chunk: Chunk
    step: StepTokens
    done: TraceDone
    paused: Paused
    results: TraceResults
    queued: Queued
    def __init__(self, saved: _Optional[_Union[Saved, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., step: _Optional[_Union[StepTokens, _Mapping]] = ..., done: _Optional[_Union[TraceDone, _Mapping]] = ..., paused: _Optional[_Union[Paused, _Mapping]] = ..., results: _Optional[_Union[TraceResults, _Mapping]] = ..., queued: _Optional[_Union[Queued, _Mapping]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("model", "texts", "no_special_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    NO_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    texts: _containers.RepeatedScalarFieldContainer[str]
    no_special_tokens: bool
    def __init__(self, model: _Optional[str] = ..., texts: _Optional[_Iterable[str]] = ..., no_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedCompositeFieldContainer[TokenIds]
    def __init__(self, ids: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("model", "ids", "skip_special_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    ids: _containers.RepeatedCompositeFieldContainer[TokenIds]
    skip_special_tokens: bool
    def __init__(self, model: _Optional[str] = ..., ids: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("texts",)
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, texts: _Optional[_Iterable[str]] = ...) -> None: ...

class GetSourceRequest(_message.Message):
    __slots__ = ("model", "path")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    model: str
    path: str
    def __init__(self, model: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class SourceInfo(_message.Message):
    __slots__ = ("path", "type", "source", "ops")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    OPS_FIELD_NUMBER: _ClassVar[int]
    path: str
    type: str
    source: str
    ops: _containers.RepeatedCompositeFieldContainer[SourceOp]
    def __init__(self, path: _Optional[str] = ..., type: _Optional[str] = ..., source: _Optional[str] = ..., ops: _Optional[_Iterable[_Union[SourceOp, _Mapping]]] = ...) -> None: ...

class SourceOp(_message.Message):
    __slots__ = ("name", "line")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    name: str
    line: int
    def __init__(self, name: _Optional[str] = ..., line: _Optional[int] = ...) -> None: ...

class TokenizerFiles(_message.Message):
    __slots__ = ("files",)
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    FILES_FIELD_NUMBER: _ClassVar[int]
    files: _containers.ScalarMap[str, bytes]
    def __init__(self, files: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class UploadFile(_message.Message):
    __slots__ = ("name", "size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class UploadHeader(_message.Message):
    __slots__ = ("kind", "sha256", "files")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    kind: str
    sha256: str
    files: _containers.RepeatedCompositeFieldContainer[UploadFile]
    def __init__(self, kind: _Optional[str] = ..., sha256: _Optional[str] = ..., files: _Optional[_Iterable[_Union[UploadFile, _Mapping]]] = ...) -> None: ...

class UploadChunk(_message.Message):
    __slots__ = ("file", "data")
    FILE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    file: int
    data: bytes
    def __init__(self, file: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class UploadRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: UploadHeader
    chunk: UploadChunk
    def __init__(self, header: _Optional[_Union[UploadHeader, _Mapping]] = ..., chunk: _Optional[_Union[UploadChunk, _Mapping]] = ...) -> None: ...

class UploadResponse(_message.Message):
    __slots__ = ("sha256", "received_bytes", "existed")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    received_bytes: int
    existed: bool
    def __init__(self, sha256: _Optional[str] = ..., received_bytes: _Optional[int] = ..., existed: _Optional[bool] = ...) -> None: ...

class HasUploadRequest(_message.Message):
    __slots__ = ("sha256", "total_bytes")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    total_bytes: int
    def __init__(self, sha256: _Optional[str] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class HasUploadResponse(_message.Message):
    __slots__ = ("present", "max_upload_bytes")
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    MAX_UPLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    present: bool
    max_upload_bytes: int
    def __init__(self, present: _Optional[bool] = ..., max_upload_bytes: _Optional[int] = ...) -> None: ...
