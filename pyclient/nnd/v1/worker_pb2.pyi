from nnd.v1 import graph_pb2 as _graph_pb2
from nnd.v1 import nnd_pb2 as _nnd_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerConfig(_message.Message):
    __slots__ = ("set_aliases", "aliases", "edits", "deleted_edits", "replace_edits")
    class EditsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: EditStack
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[EditStack, _Mapping]] = ...) -> None: ...
    SET_ALIASES_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    EDITS_FIELD_NUMBER: _ClassVar[int]
    DELETED_EDITS_FIELD_NUMBER: _ClassVar[int]
    REPLACE_EDITS_FIELD_NUMBER: _ClassVar[int]
    set_aliases: bool
    aliases: _containers.RepeatedCompositeFieldContainer[AliasBinding]
    edits: _containers.MessageMap[str, EditStack]
    deleted_edits: _containers.RepeatedScalarFieldContainer[str]
    replace_edits: bool
    def __init__(self, set_aliases: _Optional[bool] = ..., aliases: _Optional[_Iterable[_Union[AliasBinding, _Mapping]]] = ..., edits: _Optional[_Mapping[str, EditStack]] = ..., deleted_edits: _Optional[_Iterable[str]] = ..., replace_edits: _Optional[bool] = ...) -> None: ...

class AliasBinding(_message.Message):
    __slots__ = ("host", "alias", "target")
    HOST_FIELD_NUMBER: _ClassVar[int]
    ALIAS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    host: str
    alias: str
    target: str
    def __init__(self, host: _Optional[str] = ..., alias: _Optional[str] = ..., target: _Optional[str] = ...) -> None: ...

class WorkerConfigured(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerLoadRequest(_message.Message):
    __slots__ = ("model", "revision", "placement", "trust_remote_code", "task", "options")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    TRUST_REMOTE_CODE_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    model: str
    revision: str
    placement: _nnd_pb2.Placement
    trust_remote_code: bool
    task: str
    options: _nnd_pb2.LoadOptions
    def __init__(self, model: _Optional[str] = ..., revision: _Optional[str] = ..., placement: _Optional[_Union[_nnd_pb2.Placement, _Mapping]] = ..., trust_remote_code: _Optional[bool] = ..., task: _Optional[str] = ..., options: _Optional[_Union[_nnd_pb2.LoadOptions, _Mapping]] = ...) -> None: ...

class WorkerRunRequest(_message.Message):
    __slots__ = ("request", "generate", "edits", "session")
    class EditsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: EditStack
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[EditStack, _Mapping]] = ...) -> None: ...
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    EDITS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    request: _nnd_pb2.TraceRequest
    generate: bool
    edits: _containers.MessageMap[str, EditStack]
    session: _nnd_pb2.SessionRequest
    def __init__(self, request: _Optional[_Union[_nnd_pb2.TraceRequest, _Mapping]] = ..., generate: _Optional[bool] = ..., edits: _Optional[_Mapping[str, EditStack]] = ..., session: _Optional[_Union[_nnd_pb2.SessionRequest, _Mapping]] = ...) -> None: ...

class WorkerInteractContinue(_message.Message):
    __slots__ = ("more", "edits")
    class EditsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: EditStack
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[EditStack, _Mapping]] = ...) -> None: ...
    MORE_FIELD_NUMBER: _ClassVar[int]
    EDITS_FIELD_NUMBER: _ClassVar[int]
    more: _nnd_pb2.InteractContinue
    edits: _containers.MessageMap[str, EditStack]
    def __init__(self, more: _Optional[_Union[_nnd_pb2.InteractContinue, _Mapping]] = ..., edits: _Optional[_Mapping[str, EditStack]] = ...) -> None: ...

class WorkerInteract(_message.Message):
    __slots__ = ("run", "start")
    RUN_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    run: WorkerRunRequest
    start: _nnd_pb2.InteractStart
    def __init__(self, run: _Optional[_Union[WorkerRunRequest, _Mapping]] = ..., start: _Optional[_Union[_nnd_pb2.InteractStart, _Mapping]] = ...) -> None: ...

class EditStack(_message.Message):
    __slots__ = ("graphs",)
    GRAPHS_FIELD_NUMBER: _ClassVar[int]
    graphs: _containers.RepeatedCompositeFieldContainer[_graph_pb2.Graph]
    def __init__(self, graphs: _Optional[_Iterable[_Union[_graph_pb2.Graph, _Mapping]]] = ...) -> None: ...

class WorkerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("rss_bytes", "weights", "dtype", "devices", "ranks", "requests", "idle_since", "active", "accepted", "keep_alive", "stats")
    class DevicesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    IDLE_SINCE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    rss_bytes: int
    weights: _containers.RepeatedCompositeFieldContainer[_nnd_pb2.DeviceMemory]
    dtype: str
    devices: _containers.ScalarMap[str, str]
    ranks: _containers.RepeatedCompositeFieldContainer[_nnd_pb2.WorkerRank]
    requests: _containers.RepeatedCompositeFieldContainer[_nnd_pb2.RequestInFlight]
    idle_since: float
    active: int
    accepted: int
    keep_alive: str
    stats: WorkerStats
    def __init__(self, rss_bytes: _Optional[int] = ..., weights: _Optional[_Iterable[_Union[_nnd_pb2.DeviceMemory, _Mapping]]] = ..., dtype: _Optional[str] = ..., devices: _Optional[_Mapping[str, str]] = ..., ranks: _Optional[_Iterable[_Union[_nnd_pb2.WorkerRank, _Mapping]]] = ..., requests: _Optional[_Iterable[_Union[_nnd_pb2.RequestInFlight, _Mapping]]] = ..., idle_since: _Optional[float] = ..., active: _Optional[int] = ..., accepted: _Optional[int] = ..., keep_alive: _Optional[str] = ..., stats: _Optional[_Union[WorkerStats, _Mapping]] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("requests", "latency", "tokens_generated", "refusals")
    class RefusalsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_FIELD_NUMBER: _ClassVar[int]
    TOKENS_GENERATED_FIELD_NUMBER: _ClassVar[int]
    REFUSALS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[RequestCount]
    latency: _containers.RepeatedCompositeFieldContainer[KindLatency]
    tokens_generated: int
    refusals: _containers.ScalarMap[str, int]
    def __init__(self, requests: _Optional[_Iterable[_Union[RequestCount, _Mapping]]] = ..., latency: _Optional[_Iterable[_Union[KindLatency, _Mapping]]] = ..., tokens_generated: _Optional[int] = ..., refusals: _Optional[_Mapping[str, int]] = ...) -> None: ...

class RequestCount(_message.Message):
    __slots__ = ("kind", "status", "count")
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    kind: str
    status: str
    count: int
    def __init__(self, kind: _Optional[str] = ..., status: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class Histogram(_message.Message):
    __slots__ = ("bounds", "counts", "sum", "count")
    BOUNDS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    bounds: _containers.RepeatedScalarFieldContainer[float]
    counts: _containers.RepeatedScalarFieldContainer[int]
    sum: float
    count: int
    def __init__(self, bounds: _Optional[_Iterable[float]] = ..., counts: _Optional[_Iterable[int]] = ..., sum: _Optional[float] = ..., count: _Optional[int] = ...) -> None: ...

class KindLatency(_message.Message):
    __slots__ = ("kind", "queue_wait", "run")
    KIND_FIELD_NUMBER: _ClassVar[int]
    QUEUE_WAIT_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    kind: str
    queue_wait: Histogram
    run: Histogram
    def __init__(self, kind: _Optional[str] = ..., queue_wait: _Optional[_Union[Histogram, _Mapping]] = ..., run: _Optional[_Union[Histogram, _Mapping]] = ...) -> None: ...
