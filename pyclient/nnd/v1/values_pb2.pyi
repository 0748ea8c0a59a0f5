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
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    INT64: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT16: _ClassVar[DType]
    INT8: _ClassVar[DType]
    UINT8: _ClassVar[DType]
    BOOL: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
FLOAT64: DType
INT64: DType
INT32: DType
INT16: DType
INT8: DType
UINT8: DType
BOOL: DType

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data", "blob", "meta", "device", "shm", "shm_offset")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    BLOB_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    SHM_OFFSET_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    blob: int
    meta: bool
    device: str
    shm: str
    shm_offset: int
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., blob: _Optional[int] = ..., meta: _Optional[bool] = ..., device: _Optional[str] = ..., shm: _Optional[str] = ..., shm_offset: _Optional[int] = ...) -> None: ...

class Slice(_message.Message):
    __slots__ = ("start", "stop", "step")
    START_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    start: int
    stop: int
    step: int
    def __init__(self, start: _Optional[int] = ..., stop: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ValueList(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[Value]
    def __init__(self, items: _Optional[_Iterable[_Union[Value, _Mapping]]] = ...) -> None: ...

class Shape(_message.Message):
    __slots__ = ("dims",)
    DIMS_FIELD_NUMBER: _ClassVar[int]
    dims: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dims: _Optional[_Iterable[int]] = ...) -> None: ...

class Value(_message.Message):
    __slots__ = ("tensor", "int", "float", "bool", "str", "slice", "ellipsis", "none", "list", "tuple", "size", "dtype", "map")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    INT_FIELD_NUMBER: _ClassVar[int]
    FLOAT_FIELD_NUMBER: _ClassVar[int]
    BOOL_FIELD_NUMBER: _ClassVar[int]
    STR_FIELD_NUMBER: _ClassVar[int]
    SLICE_FIELD_NUMBER: _ClassVar[int]
    ELLIPSIS_FIELD_NUMBER: _ClassVar[int]
    NONE_FIELD_NUMBER: _ClassVar[int]
    LIST_FIELD_NUMBER: _ClassVar[int]
    TUPLE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAP_FIELD_NUMBER: _ClassVar[int]
    tensor: Tensor
    int: int
    float: float
    bool: bool
    str: str
    slice: Slice
    ellipsis: Empty
    none: Empty
    list: ValueList
    tuple: ValueList
    size: Shape
    dtype: DType
    map: ValueMap
    def __init__(self, tensor: _Optional[_Union[Tensor, _Mapping]] = ..., int: _Optional[int] = ..., float: _Optional[float] = ..., bool: _Optional[bool] = ..., str: _Optional[str] = ..., slice: _Optional[_Union[Slice, _Mapping]] = ..., ellipsis: _Optional[_Union[Empty, _Mapping]] = ..., none: _Optional[_Union[Empty, _Mapping]] = ..., list: _Optional[_Union[ValueList, _Mapping]] = ..., tuple: _Optional[_Union[ValueList, _Mapping]] = ..., size: _Optional[_Union[Shape, _Mapping]] = ..., dtype: _Optional[_Union[DType, str]] = ..., map: _Optional[_Union[ValueMap, _Mapping]] = ...) -> None: ...

class ValueMap(_message.Message):
    __slots__ = ("items",)
    class ItemsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Value
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Value, _Mapping]] = ...) -> None: ...
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.MessageMap[str, Value]
    def __init__(self, items: _Optional[_Mapping[str, Value]] = ...) -> None: ...
