from nnd.v1 import values_pb2 as _values_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Point(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POINT_UNSPECIFIED: _ClassVar[Point]
    OUTPUT: _ClassVar[Point]
    INPUT: _ClassVar[Point]
    INPUTS: _ClassVar[Point]
    RESULT: _ClassVar[Point]
POINT_UNSPECIFIED: Point
OUTPUT: Point
INPUT: Point
INPUTS: Point
RESULT: Point

class SourceLocation(_message.Message):
    __slots__ = ("file", "line", "text")
    FILE_FIELD_NUMBER: _ClassVar[int]
    LINE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    file: str
    line: int
    text: str
    def __init__(self, file: _Optional[str] = ..., line: _Optional[int] = ..., text: _Optional[str] = ...) -> None: ...

class ModuleValue(_message.Message):
    __slots__ = ("path", "point", "invoke", "call", "op")
    PATH_FIELD_NUMBER: _ClassVar[int]
    POINT_FIELD_NUMBER: _ClassVar[int]
    INVOKE_FIELD_NUMBER: _ClassVar[int]
    CALL_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    path: str
    point: Point
    invoke: int
    call: int
    op: str
    def __init__(self, path: _Optional[str] = ..., point: _Optional[_Union[Point, str]] = ..., invoke: _Optional[int] = ..., call: _Optional[int] = ..., op: _Optional[str] = ...) -> None: ...

class Arg(_message.Message):
    __slots__ = ("ref", "value", "tuple", "list")
    REF_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    TUPLE_FIELD_NUMBER: _ClassVar[int]
    LIST_FIELD_NUMBER: _ClassVar[int]
    ref: int
    value: _values_pb2.Value
    tuple: ArgList
    list: ArgList
    def __init__(self, ref: _Optional[int] = ..., value: _Optional[_Union[_values_pb2.Value, _Mapping]] = ..., tuple: _Optional[_Union[ArgList, _Mapping]] = ..., list: _Optional[_Union[ArgList, _Mapping]] = ...) -> None: ...

class ArgList(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[Arg]
    def __init__(self, items: _Optional[_Iterable[_Union[Arg, _Mapping]]] = ...) -> None: ...

class Op(_message.Message):
    __slots__ = ("name", "args", "kwargs")
    class KwargsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Arg
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Arg, _Mapping]] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    KWARGS_FIELD_NUMBER: _ClassVar[int]
    name: str
    args: _containers.RepeatedCompositeFieldContainer[Arg]
    kwargs: _containers.MessageMap[str, Arg]
    def __init__(self, name: _Optional[str] = ..., args: _Optional[_Iterable[_Union[Arg, _Mapping]]] = ..., kwargs: _Optional[_Mapping[str, Arg]] = ...) -> None: ...

class Save(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: Arg
    def __init__(self, value: _Optional[_Union[Arg, _Mapping]] = ...) -> None: ...

class SetModuleValue(_message.Message):
    __slots__ = ("target", "value")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    target: ModuleValue
    value: Arg
    def __init__(self, target: _Optional[_Union[ModuleValue, _Mapping]] = ..., value: _Optional[_Union[Arg, _Mapping]] = ...) -> None: ...

class Skip(_message.Message):
    __slots__ = ("target", "value")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    target: ModuleValue
    value: Arg
    def __init__(self, target: _Optional[_Union[ModuleValue, _Mapping]] = ..., value: _Optional[_Union[Arg, _Mapping]] = ...) -> None: ...

class Stop(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Node(_message.Message):
    __slots__ = ("id", "loc", "scope", "module", "constant", "op", "save", "set", "skip", "stop", "backward", "grad", "set_grad", "cache", "param", "tensor")
    ID_FIELD_NUMBER: _ClassVar[int]
    LOC_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    MODULE_FIELD_NUMBER: _ClassVar[int]
    CONSTANT_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    SAVE_FIELD_NUMBER: _ClassVar[int]
    SET_FIELD_NUMBER: _ClassVar[int]
    SKIP_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_FIELD_NUMBER: _ClassVar[int]
    GRAD_FIELD_NUMBER: _ClassVar[int]
    SET_GRAD_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    PARAM_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    id: int
    loc: SourceLocation
    scope: int
    module: ModuleValue
    constant: _values_pb2.Value
    op: Op
    save: Save
    set: SetModuleValue
    skip: Skip
    stop: Stop
    backward: Backward
    grad: Grad
    set_grad: SetGrad
    cache: Cache
    param: Param
    tensor: ModuleTensor
    def __init__(self, id: _Optional[int] = ..., loc: _Optional[_Union[SourceLocation, _Mapping]] = ..., scope: _Optional[int] = ..., module: _Optional[_Union[ModuleValue, _Mapping]] = ..., constant: _Optional[_Union[_values_pb2.Value, _Mapping]] = ..., op: _Optional[_Union[Op, _Mapping]] = ..., save: _Optional[_Union[Save, _Mapping]] = ..., set: _Optional[_Union[SetModuleValue, _Mapping]] = ..., skip: _Optional[_Union[Skip, _Mapping]] = ..., stop: _Optional[_Union[Stop, _Mapping]] = ..., backward: _Optional[_Union[Backward, _Mapping]] = ..., grad: _Optional[_Union[Grad, _Mapping]] = ..., set_grad: _Optional[_Union[SetGrad, _Mapping]] = ..., cache: _Optional[_Union[Cache, _Mapping]] = ..., param: _Optional[_Union[Param, _Mapping]] = ..., tensor: _Optional[_Union[ModuleTensor, _Mapping]] = ...) -> None: ...

class ModuleTensor(_message.Message):
    __slots__ = ("path", "name")
    PATH_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    path: str
    name: str
    def __init__(self, path: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class Param(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: _values_pb2.Value
    def __init__(self, value: _Optional[_Union[_values_pb2.Value, _Mapping]] = ...) -> None: ...

class Backward(_message.Message):
    __slots__ = ("loss", "gradient")
    LOSS_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_FIELD_NUMBER: _ClassVar[int]
    loss: Arg
    gradient: Arg
    def __init__(self, loss: _Optional[_Union[Arg, _Mapping]] = ..., gradient: _Optional[_Union[Arg, _Mapping]] = ...) -> None: ...

class Grad(_message.Message):
    __slots__ = ("value", "backward")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_FIELD_NUMBER: _ClassVar[int]
    value: int
    backward: int
    def __init__(self, value: _Optional[int] = ..., backward: _Optional[int] = ...) -> None: ...

class SetGrad(_message.Message):
    __slots__ = ("value", "backward", "grad")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    BACKWARD_FIELD_NUMBER: _ClassVar[int]
    GRAD_FIELD_NUMBER: _ClassVar[int]
    value: int
    backward: int
    grad: Arg
    def __init__(self, value: _Optional[int] = ..., backward: _Optional[int] = ..., grad: _Optional[_Union[Arg, _Mapping]] = ...) -> None: ...

class Cache(_message.Message):
    __slots__ = ("modules", "outputs", "inputs", "dtype", "device", "invoke")
    MODULES_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    INVOKE_FIELD_NUMBER: _ClassVar[int]
    modules: _containers.RepeatedScalarFieldContainer[str]
    outputs: bool
    inputs: bool
    dtype: _values_pb2.DType
    device: str
    invoke: int
    def __init__(self, modules: _Optional[_Iterable[str]] = ..., outputs: _Optional[bool] = ..., inputs: _Optional[bool] = ..., dtype: _Optional[_Union[_values_pb2.DType, str]] = ..., device: _Optional[str] = ..., invoke: _Optional[int] = ...) -> None: ...

class StepSelector(_message.Message):
    __slots__ = ("all", "range", "steps")
    ALL_FIELD_NUMBER: _ClassVar[int]
    RANGE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    all: _values_pb2.Empty
    range: _values_pb2.Slice
    steps: StepList
    def __init__(self, all: _Optional[_Union[_values_pb2.Empty, _Mapping]] = ..., range: _Optional[_Union[_values_pb2.Slice, _Mapping]] = ..., steps: _Optional[_Union[StepList, _Mapping]] = ...) -> None: ...

class StepList(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, steps: _Optional[_Iterable[int]] = ...) -> None: ...

class Scope(_message.Message):
    __slots__ = ("steps",)
    STEPS_FIELD_NUMBER: _ClassVar[int]
    steps: StepSelector
    def __init__(self, steps: _Optional[_Union[StepSelector, _Mapping]] = ...) -> None: ...

class Graph(_message.Message):
    __slots__ = ("nodes", "scopes")
    NODES_FIELD_NUMBER: _ClassVar[int]
    SCOPES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[Node]
    scopes: _containers.RepeatedCompositeFieldContainer[Scope]
    def __init__(self, nodes: _Optional[_Iterable[_Union[Node, _Mapping]]] = ..., scopes: _Optional[_Iterable[_Union[Scope, _Mapping]]] = ...) -> None: ...
