from nnd.v1 import graph_pb2 as _graph_pb2
from nnd.v1 import nnd_pb2 as _nnd_pb2
from nnd.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HelperModel(_message.Message):
    __slots__ = ("key", "source", "revision", "task", "trust_remote_code", "exported", "options")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    TRUST_REMOTE_CODE_FIELD_NUMBER: _ClassVar[int]
    EXPORTED_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    key: str
    source: str
    revision: str
    task: str
    trust_remote_code: bool
    exported: bool
    options: _nnd_pb2.LoadOptions
    def __init__(self, key: _Optional[str] = ..., source: _Optional[str] = ..., revision: _Optional[str] = ..., task: _Optional[str] = ..., trust_remote_code: _Optional[bool] = ..., exported: _Optional[bool] = ..., options: _Optional[_Union[_nnd_pb2.LoadOptions, _Mapping]] = ...) -> None: ...

class MetaDescription(_message.Message):
    __slots__ = ("architecture", "task", "summary", "num_parameters", "modules", "estimated_bytes", "default_dtype", "has_tokenizer", "tp_config_json", "config_json")
    class SummaryEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class EstimatedBytesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    MODULES_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    TP_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    architecture: str
    task: str
    summary: _containers.ScalarMap[str, str]
    num_parameters: int
    modules: _containers.RepeatedCompositeFieldContainer[_nnd_pb2.ModuleInfo]
    estimated_bytes: _containers.ScalarMap[str, int]
    default_dtype: str
    has_tokenizer: bool
    tp_config_json: str
    config_json: str
    def __init__(self, architecture: _Optional[str] = ..., task: _Optional[str] = ..., summary: _Optional[_Mapping[str, str]] = ..., num_parameters: _Optional[int] = ..., modules: _Optional[_Iterable[_Union[_nnd_pb2.ModuleInfo, _Mapping]]] = ..., estimated_bytes: _Optional[_Mapping[str, int]] = ..., default_dtype: _Optional[str] = ..., has_tokenizer: _Optional[bool] = ..., tp_config_json: _Optional[str] = ..., config_json: _Optional[str] = ...) -> None: ...

class HelperScanRequest(_message.Message):
    __slots__ = ("model", "limits", "request", "session", "edits", "aliases")
    class EditsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _worker_pb2.EditStack
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_worker_pb2.EditStack, _Mapping]] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    EDITS_FIELD_NUMBER: _ClassVar[int]
    ALIASES_FIELD_NUMBER: _ClassVar[int]
    model: HelperModel
    limits: _nnd_pb2.Limits
    request: bytes
    session: bool
    edits: _containers.MessageMap[str, _worker_pb2.EditStack]
    aliases: _containers.RepeatedCompositeFieldContainer[_worker_pb2.AliasBinding]
    def __init__(self, model: _Optional[_Union[HelperModel, _Mapping]] = ..., limits: _Optional[_Union[_nnd_pb2.Limits, _Mapping]] = ..., request: _Optional[bytes] = ..., session: _Optional[bool] = ..., edits: _Optional[_Mapping[str, _worker_pb2.EditStack]] = ..., aliases: _Optional[_Iterable[_Union[_worker_pb2.AliasBinding, _Mapping]]] = ...) -> None: ...

class HelperScanResponse(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[_nnd_pb2.TraceResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[_nnd_pb2.TraceResponse, _Mapping]]] = ...) -> None: ...

class HelperEditRequest(_message.Message):
    __slots__ = ("model", "graph")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    GRAPH_FIELD_NUMBER: _ClassVar[int]
    model: HelperModel
    graph: _graph_pb2.Graph
    def __init__(self, model: _Optional[_Union[HelperModel, _Mapping]] = ..., graph: _Optional[_Union[_graph_pb2.Graph, _Mapping]] = ...) -> None: ...

class HelperTokenizeRequest(_message.Message):
    __slots__ = ("model", "request")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    model: HelperModel
    request: _nnd_pb2.TokenizeRequest
    def __init__(self, model: _Optional[_Union[HelperModel, _Mapping]] = ..., request: _Optional[_Union[_nnd_pb2.TokenizeRequest, _Mapping]] = ...) -> None: ...

class HelperDecodeRequest(_message.Message):
    __slots__ = ("model", "request")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    model: HelperModel
    request: _nnd_pb2.DecodeRequest
    def __init__(self, model: _Optional[_Union[HelperModel, _Mapping]] = ..., request: _Optional[_Union[_nnd_pb2.DecodeRequest, _Mapping]] = ...) -> None: ...

class HelperSourceRequest(_message.Message):
    __slots__ = ("model", "path")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    model: HelperModel
    path: str
    def __init__(self, model: _Optional[_Union[HelperModel, _Mapping]] = ..., path: _Optional[str] = ...) -> None: ...

class HelperUploadRequest(_message.Message):
    __slots__ = ("kind", "folder")
    KIND_FIELD_NUMBER: _ClassVar[int]
    FOLDER_FIELD_NUMBER: _ClassVar[int]
    kind: str
    folder: str
    def __init__(self, kind: _Optional[str] = ..., folder: _Optional[str] = ...) -> None: ...

class HelperEmpty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HelperCapabilities(_message.Message):
    __slots__ = ("ops", "attributes", "libraries")
    class LibrariesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    OPS_FIELD_NUMBER: _ClassVar[int]
    ATTRIBUTES_FIELD_NUMBER: _ClassVar[int]
    LIBRARIES_FIELD_NUMBER: _ClassVar[int]
    ops: _containers.RepeatedScalarFieldContainer[str]
    attributes: _containers.RepeatedScalarFieldContainer[str]
    libraries: _containers.ScalarMap[str, str]
    def __init__(self, ops: _Optional[_Iterable[str]] = ..., attributes: _Optional[_Iterable[str]] = ..., libraries: _Optional[_Mapping[str, str]] = ...) -> None: ...

class HelperStatus(_message.Message):
    __slots__ = ("rss_bytes", "models")
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    rss_bytes: int
    models: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rss_bytes: _Optional[int] = ..., models: _Optional[_Iterable[str]] = ...) -> None: ...
