"""A complete schema walk of a serialized `torch.export` program (the archive's `models/model.json`).

torch's deserializer trusts its input: it resolves any `torch.*` attribute a
node or an argument names as an operator (`{"as_operator": ...}` included), lets
higher-order operators call whatever they are handed, `sympify`s shape
expressions (Python's `eval` under the hood), ignores fields it does not know,
and keeps `guards_code`, which `ExportedProgram.module()` compiles and runs.
So before torch sees the JSON, `check_program` walks all of it against torch's
own schema (`torch._export.serde.schema`, trusted code: the field sets are
derived from its dataclasses at import time):

- every object's fields are known and typed as the schema says; an unknown
  field, a wrong type or an int outside int64 is a refusal, never a skip;
- every operator reference is allow-listed: node targets are ATen operators
  (see `_aten_overload`), size arithmetic or the control-flow operators;
  operators as argument values (`as_operator`) and custom objects are refused;
- a control-flow operator's callable operands must be subgraphs (`as_graph`),
  which the same walk checks; a subgraph anywhere else is refused;
- code-bearing fields are refused (`guards_code`), node metadata is limited to
  the keys torch writes (and may not close the triple-quoted string FX puts it
  in with FX_GRAPH_SHOW_META=1), names are identifiers or module paths (FX
  writes them into generated source), and shape expressions must pass
  `sym_expr.why_not` (bounded in form and in cost).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import types
import typing
from enum import IntEnum
from typing import Any

import torch
from torch._export.serde import schema as S
from torch._export.serde.union import _Union

from nnd_daemon import errors
from nnd_daemon.export import sym_expr

_MAX_DEPTH = 400  # JSON nesting; a HOP subgraph costs ~8 levels
_MAX_STRING = 1 << 20
_INT64 = 1 << 63
_FLOAT_WORDS = ("Infinity", "-Infinity", "NaN")

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PATH = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")
_SYMBOL = re.compile(r"[a-z]{1,4}[0-9]{1,9}")
_STACK_KEY = re.compile(r"[A-Za-z0-9_.@]{0,300}")
_DOCSTRING_END = '"""'
_TYPE_NAME = re.compile(r"[A-Za-z0-9_.<>]{0,300}")
_VERIFIERS = {"", "ATEN", "TRAINING"}
_DEVICES = {"cpu", "cuda", "meta"}
# Node metadata torch.export writes (serialize_metadata); torch reads these back as strings or JSON.
_NODE_METADATA = {"stack_trace", "nn_module_stack", "torch_fn", "custom", "from_node"}
_GRAPH_MODULE_METADATA = {"custom"}

# Control-flow operators and the positions of their callable operands, which must be subgraphs.
_HIGHER_ORDER: dict[str, frozenset[int]] = {
    "cond": frozenset({1, 2}),  # cond(pred, true_fn, false_fn, operands)
    "while_loop": frozenset({0, 1}),  # while_loop(cond_fn, body_fn, carried, additional)
    "map_impl": frozenset({0}),  # map_impl(f, xs, pos_args)
    "scan": frozenset({0}),  # scan(combine_fn, init, xs, additional)
    "wrap_with_set_grad_enabled": frozenset({1}),  # (enabled, fn, *args)
    "wrap_with_autocast": frozenset({4}),  # (device_type, dtype, enabled, cache_enabled, fn, *args)
}
# Size arithmetic torch.export writes as Python callables (serialize._SYM_OPS and friends).
_PYTHON_TARGETS = {
    *(
        f"_operator.{n}"
        for n in (
            "getitem add sub mul floordiv truediv mod pow neg pos abs eq ne lt le gt ge and_ or_ xor not_ invert "
            "lshift rshift"
        ).split()
    ),
    *(f"math.{n}" for n in ("ceil", "floor", "trunc", "sqrt")),
    *(
        f"torch.{n}"
        for n in ("sym_float", "sym_int", "sym_max", "sym_min", "sym_not", "sym_ite", "sym_sum", "sym_sqrt")
    ),
    "torch._sym_sqrt",
    "torch._C._set_grad_enabled",
}
_ATEN_TARGET = re.compile(r"torch\.ops\.aten\.([A-Za-z0-9_]+)\.([A-Za-z0-9_]+)")

# ATen operators that export writes but torch's Python API names differently (or not at all).
# Each was read: tensors in, tensors or sizes out, no file, storage or pointer.
_EXPORT_INTERNAL_ATEN = {
    "slice",
    "alias",
    "lift_fresh_copy",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
    "sym_constrain_range",
    "sym_constrain_range_for_size",
    "_assert_scalar",
    "_assert_async",
    "_assert_tensor_metadata",
    "_to_copy",
    "_unsafe_view",
    "_softmax",
    "_log_softmax",
    "_safe_softmax",
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training",
    "_native_batch_norm_legit_functional",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention",
    "_prelu_kernel",
    "_local_scalar_dense",
    "_adaptive_avg_pool2d",
    "_adaptive_avg_pool3d",
    "_weight_norm",
    "_weight_norm_interface",
    "__and__",
    "__or__",
    "__xor__",
    "__lshift__",
    "__rshift__",
    "__iand__",
    "__ior__",
    "__ixor__",
    "__ilshift__",
    "__irshift__",
}
# ATen operators taking only scalars (sizes): allowed though no tensor passes through them.
_SCALAR_ATEN = {"sym_constrain_range", "sym_constrain_range_for_size", "_assert_scalar"}
# Operator families whose tensors carry index buffers torch does not check by default (sparse,
# nested, quantized), unchecked indexing, and raw memory: not part of the allow-list even where public.
# (Files are refused by schema property below: from_file's `filename`.)
_FAMILY_OUT = re.compile(r"sparse|nested|quantize|quantized|_unsafe_index|storage|data_ptr")
# Argument types an allowed overload may have (Optional[...] and List[...] of these included).
_ARG_TYPES = {"Tensor", "int", "float", "bool", "number", "complex", "str", "Device", "Generator", "Layout"}
# An argument whose name has one of these words is a path, a file or a pointer.
_PATH_WORDS = {"file", "filename", "filepath", "path", "dir", "directory", "fd", "ptr", "pointer", "address", "addr"}


def _refuse(what: str) -> errors.InvalidArgument:
    return errors.InvalidArgument(f"the exported program is refused: {what}")


@functools.cache
def _public_aten() -> frozenset[str]:
    """ATen operator names torch's own Python API exposes for dense tensors, and the export internals above."""
    names: set[str] = set(_EXPORT_INTERNAL_ATEN)
    for space in (
        torch.Tensor,
        torch._C._VariableFunctions,
        torch._C._nn,
        torch._C._linalg,
        torch._C._fft,
        torch._C._special,
    ):
        names.update(n for n in dir(space) if not n.startswith("_"))
    return frozenset(n for n in names if not _FAMILY_OUT.search(n))


def _type_ok(text: str) -> bool:
    while True:
        m = re.fullmatch(r"(?:Optional|List)\[(.*)\]", text)
        if m is None:
            return text in _ARG_TYPES
        text = m.group(1)


@functools.lru_cache(maxsize=4096)  # bounded: the keys are client text
def _aten_overload(packet: str, overload: str) -> str:
    """'' when torch.ops.aten.<packet>.<overload> may run in an uploaded program, else why not."""
    if packet not in _public_aten():
        return "is not an allowed ATen operator (no files, storages, pointers, sparse or nested tensors)"
    ops = getattr(torch.ops.aten, packet, None)  # `packet` is one of torch's own names by now
    if not isinstance(ops, torch._ops.OpOverloadPacket) or overload not in ops.overloads():
        return "is not an ATen operator of this torch"
    schema = getattr(ops, overload)._schema
    typed = [*schema.arguments, *schema.returns]
    tensors = False
    for arg in typed:
        text = str(arg.type)
        if not _type_ok(text):
            return f"takes or returns {text} ({arg.name or 'result'}); only tensors and plain values are allowed"
        if _PATH_WORDS & set(arg.name.lower().split("_")):
            return f"has an argument {arg.name!r} that names a file or a pointer"
        tensors = tensors or "Tensor" in text
    if not tensors and packet not in _SCALAR_ATEN:
        return "does not compute with tensors"
    return ""


def check_target(target: Any) -> None:
    """Refuse a node target that is not an allowed operator."""
    if not isinstance(target, str):
        raise _refuse("a node has no operator name")
    m = _ATEN_TARGET.fullmatch(target)
    if m is not None:
        why = _aten_overload(m.group(1), m.group(2))
        if why:
            raise _refuse(f"operator {target} {why}")
        return
    if target.startswith("torch.ops.higher_order.") and target.removeprefix("torch.ops.higher_order.") in _HIGHER_ORDER:
        return
    if target in _PYTHON_TARGETS:
        return
    raise _refuse(
        f"operator {target[:120]!r} is not allowed (ATen operators, control flow and size arithmetic are); "
        "custom operators cannot be uploaded"
    )


def _name(value: Any, what: str) -> None:
    if not isinstance(value, str) or not _IDENT.fullmatch(value) or value.startswith("__"):
        raise _refuse(f"{what} {str(value)[:80]!r} is not an identifier")


def _path(value: Any, what: str) -> None:
    if not isinstance(value, str) or (value and not _PATH.fullmatch(value)):
        raise _refuse(f"{what} {str(value)[:80]!r} is not a module path")
    if any(part.startswith("__") for part in value.split(".")):
        raise _refuse(f"{what} {value[:80]!r} names a private attribute")


def _json_text(value: Any, what: str) -> Any:
    try:
        return json.loads(value)
    except (ValueError, TypeError, RecursionError):
        raise _refuse(f"{what} is not JSON") from None


def _split3(item: str) -> list[str]:
    """torch's metadata_split: 'key,path,type' with commas inside brackets kept."""
    out, start, depth = [], 0, 0
    for i, c in enumerate(item):
        if c in "[(":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif c == "," and depth == 0:
            out.append(item[start:i])
            start = i + 1
    out.append(item[start:])
    return out


def _node_metadata(metadata: dict[str, Any]) -> None:
    unknown = set(metadata) - _NODE_METADATA
    if unknown:
        raise _refuse(f"node metadata {sorted(unknown)[0][:80]!r} is not one torch.export writes")
    if stack := metadata.get("nn_module_stack"):
        for item in stack.split(";"):
            parts = _split3(item)
            if len(parts) != 3:
                raise _refuse("nn_module_stack is malformed")
            # unflatten builds the module tree from these: attribute paths, and names it shows
            if not _STACK_KEY.fullmatch(parts[0]) or not _TYPE_NAME.fullmatch(parts[2]):
                raise _refuse(f"nn_module_stack entry {item[:80]!r} is malformed")
            _path(parts[1].split("@")[0], "nn_module_stack path")
    # FX writes node metadata into the module's generated source inside """...""" when
    # FX_GRAPH_SHOW_META=1, so no value, decoded or not, may close that string.
    texts: list[str] = list(metadata.values())
    for key in ("custom", "from_node"):
        if key in metadata and metadata[key]:
            texts += _strings(_json_text(metadata[key], f"node metadata {key!r}"))
    if any(_DOCSTRING_END in t for t in texts):
        raise _refuse("node metadata holds a triple quote")


def _strings(value: Any) -> list[str]:
    """Every string (keys included) in decoded JSON."""
    out, stack = [], [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return out


@functools.cache
def _fields(cls: type) -> dict[str, tuple[Any, bool]]:
    """field -> (type, required) of a schema dataclass."""
    hints = typing.get_type_hints(cls, globalns=vars(S))
    out = {}
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        out[f.name] = (hints[f.name], required and not issubclass(cls, _Union))
    return out


class _Walk:
    def __init__(self) -> None:
        self.graphs_allowed: set[int] = set()  # id() of the Argument objects that may be subgraphs
        self.nodes = 0

    def value(self, tp: Any, data: Any, where: str, depth: int) -> None:
        if depth > _MAX_DEPTH:
            raise _refuse(f"it nests deeper than {_MAX_DEPTH} levels")
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            tp, origin = typing.get_args(tp)[0], typing.get_origin(typing.get_args(tp)[0])
        if origin in (typing.Union, types.UnionType):
            if data is None and type(None) in typing.get_args(tp):
                return
            (tp,) = [a for a in typing.get_args(tp) if a is not type(None)]
            origin = typing.get_origin(tp)
        if origin is list:
            if not isinstance(data, list):
                raise _refuse(f"{where} is not a list")
            (item,) = typing.get_args(tp)
            for i, x in enumerate(data):
                self.value(item, x, f"{where}[{i}]", depth + 1)
        elif origin is dict:
            if not isinstance(data, dict):
                raise _refuse(f"{where} is not an object")
            _, item = typing.get_args(tp)
            for k, x in data.items():
                self.value(item, x, f"{where}.{str(k)[:40]}", depth + 1)
        elif tp is str:
            if not isinstance(data, str) or len(data) > _MAX_STRING:
                raise _refuse(f"{where} is not a string of at most {_MAX_STRING} characters")
        elif tp is bool:
            if not isinstance(data, bool):
                raise _refuse(f"{where} is not a boolean")
        elif tp is int:
            if not isinstance(data, int) or isinstance(data, bool) or not -_INT64 <= data < _INT64:
                raise _refuse(f"{where} is not a 64-bit integer")
        elif tp is float:
            # torch writes inf and nan as these strings (a mask filled with -inf); an int must convert to a float
            if data not in _FLOAT_WORDS and (
                not isinstance(data, (int, float))
                or isinstance(data, bool)
                or (type(data) is int and abs(data) >= _INT64)
            ):
                raise _refuse(f"{where} is not a number")
        elif isinstance(tp, type) and issubclass(tp, IntEnum):
            if not isinstance(data, int) or isinstance(data, bool) or data not in tp._value2member_map_:
                raise _refuse(f"{where} is not a {tp.__name__}")
        elif isinstance(tp, type) and dataclasses.is_dataclass(tp):
            self.obj(tp, data, where, depth)
        else:  # a schema type this walk does not know: torch changed; refuse rather than pass it through
            raise _refuse(f"{where} has a type this daemon cannot check ({tp})")

    def obj(self, cls: type, data: Any, where: str, depth: int) -> None:
        if not isinstance(data, dict):
            raise _refuse(f"{where} is not an object")
        fields = _fields(cls)
        unknown = [k for k in data if k not in fields]
        if unknown:
            raise _refuse(f"{where} has a field {str(unknown[0])[:80]!r} that {cls.__name__} does not have")
        if issubclass(cls, _Union) and len(data) != 1:
            raise _refuse(f"{where} must hold exactly one of {', '.join(fields)}")
        for k, (_, required) in fields.items():
            if required and k not in data:
                raise _refuse(f"{where} lacks {k!r}")
        if cls in _BEFORE:  # what must be known before the fields are walked (which operands may be subgraphs)
            _BEFORE[cls](self, data, where)
        for k, x in data.items():
            self.value(fields[k][0], x, f"{where}.{k}", depth + 1)
        if cls in _AFTER:  # the fields' types are checked by now
            _AFTER[cls](self, data, where)

    # ------------------------------------------------------------ per-type checks

    def program(self, data: dict[str, Any], where: str) -> None:
        if data.get("guards_code"):
            raise _refuse("it carries guards_code (Python source torch would compile); re-export with this client")
        for v in data.get("verifiers") or []:
            if v not in _VERIFIERS:
                raise _refuse(f"verifier {str(v)[:40]!r} is not one this daemon knows")
        for k in data.get("range_constraints") or {}:
            if not _SYMBOL.fullmatch(k):
                raise _refuse(f"range constraint {k[:40]!r} is not a size symbol")
        for k in data.get("opset_version") or {}:
            _name(k, "opset")

    def graph_module(self, data: dict[str, Any], where: str) -> None:
        metadata = data.get("metadata") or {}
        if not isinstance(metadata, dict) or set(metadata) - _GRAPH_MODULE_METADATA:
            raise _refuse("the graph module's metadata holds keys torch.export does not write")
        if "custom" in metadata:
            _json_text(metadata["custom"], "graph metadata 'custom'")
        for k, v in (data.get("treespec_namedtuple_fields") or {}).items():
            if not isinstance(k, str) or len(k) > 300:
                raise _refuse("a namedtuple name is not a short string")
            for name in v.get("field_names", []) if isinstance(v, dict) else []:
                _name(name, "namedtuple field")

    def graph(self, data: dict[str, Any], where: str) -> None:
        if data.get("custom_obj_values"):
            raise _refuse("it holds custom objects (opaque, pickled); only tensors are accepted")
        for key in ("tensor_values", "sym_int_values", "sym_bool_values", "sym_float_values"):
            for k in data.get(key) or {}:
                _name(k, "value name")

    def node(self, data: dict[str, Any], where: str) -> None:
        _node_metadata(data["metadata"])
        if data.get("name") is not None:
            _name(data["name"], "node name")

    def node_operands(self, data: dict[str, Any], where: str) -> None:
        target = data.get("target")
        check_target(target)
        self.nodes += 1
        inputs = data.get("inputs")
        hop = str(target).removeprefix("torch.ops.higher_order.")
        if not isinstance(inputs, list) or hop == target:
            return
        positional = [
            i
            for i in inputs
            if isinstance(i, dict) and (i.get("kind") == S.ArgumentKind.POSITIONAL or i.get("name") == "")
        ]
        for pos in _HIGHER_ORDER[hop]:
            arg = positional[pos].get("arg") if pos < len(positional) else None
            if not isinstance(arg, dict) or set(arg) != {"as_graph"}:
                raise _refuse(f"{hop}'s operand {pos} must be a subgraph")
            self.graphs_allowed.add(id(arg))

    def argument(self, data: dict[str, Any], where: str) -> None:
        (kind,) = data  # exactly one, checked above
        if kind == "as_operator":
            raise _refuse(f"{where} passes an operator as a value ({str(data[kind])[:80]!r})")
        if kind == "as_custom_obj":
            raise _refuse(f"{where} is a custom object; only tensors are accepted")
        if kind == "as_graph" and id(data) not in self.graphs_allowed:
            raise _refuse(f"{where} is a subgraph outside a control-flow operand")
        if kind == "as_layout" and data[kind] != S.Layout.Strided:
            raise _refuse(f"{where} asks for a non-strided layout")

    def sym_expr(self, data: dict[str, Any], where: str) -> None:
        why = sym_expr.why_not(data.get("expr_str"))
        if why:
            raise _refuse(f"shape expression at {where} {why}")

    def tensor_meta(self, data: dict[str, Any], where: str) -> None:
        if data.get("layout") != S.Layout.Strided:
            raise _refuse(f"{where} is not a strided (dense) tensor")

    def device(self, data: dict[str, Any], where: str) -> None:
        if data.get("type") not in _DEVICES:
            raise _refuse(f"{where} names device type {str(data.get('type'))[:40]!r}")

    def named_argument(self, data: dict[str, Any], where: str) -> None:
        if data.get("name") != "":
            _name(data.get("name"), "argument name")

    def tensor_name(self, data: dict[str, Any], where: str) -> None:
        _name(data.get("name"), "tensor name")

    def graph_argument(self, data: dict[str, Any], where: str) -> None:
        _name(data.get("name"), "subgraph name")

    def sym_name(self, data: dict[str, Any], where: str) -> None:
        if "as_name" in data:
            _name(data["as_name"], "size name")

    def input_spec(self, data: dict[str, Any], where: str) -> None:
        if "custom_obj" in data:
            raise _refuse("an input is a custom object; only tensors are accepted")

    def fqn(self, data: dict[str, Any], where: str) -> None:
        for key in ("parameter_name", "buffer_name", "tensor_constant_name", "fqn"):
            if key in data:
                _path(data[key], key)

    def call_signature(self, data: dict[str, Any], where: str) -> None:
        for name in data.get("forward_arg_names") or []:
            _name(name, "argument name")


_BEFORE: dict[type, Any] = {S.Node: _Walk.node_operands, S.Argument: _Walk.argument}
_AFTER: dict[type, Any] = {
    S.ExportedProgram: _Walk.program,
    S.GraphModule: _Walk.graph_module,
    S.Graph: _Walk.graph,
    S.Node: _Walk.node,
    S.SymExpr: _Walk.sym_expr,
    S.TensorMeta: _Walk.tensor_meta,
    S.Device: _Walk.device,
    S.NamedArgument: _Walk.named_argument,
    S.TensorArgument: _Walk.tensor_name,
    S.TokenArgument: _Walk.tensor_name,
    S.GraphArgument: _Walk.graph_argument,
    S.SymIntArgument: _Walk.sym_name,
    S.SymFloatArgument: _Walk.sym_name,
    S.SymBoolArgument: _Walk.sym_name,
    S.InputSpec: _Walk.input_spec,
    S.InputToParameterSpec: _Walk.fqn,
    S.InputToBufferSpec: _Walk.fqn,
    S.InputToTensorConstantSpec: _Walk.fqn,
    S.ParameterMutationSpec: _Walk.fqn,
    S.BufferMutationSpec: _Walk.fqn,
    S.GradientToParameterSpec: _Walk.fqn,
    S.ModuleCallEntry: _Walk.fqn,
    S.ModuleCallSignature: _Walk.call_signature,
}


def check_program(program: Any) -> None:
    """Refuse a serialized ExportedProgram (parsed JSON) that could do more than compute with tensors."""
    walk = _Walk()
    try:
        walk.value(S.ExportedProgram, program, "program", 0)
    except RecursionError:
        raise _refuse("it nests too deeply") from None
    graph = program["graph_module"]["graph"]
    if walk.nodes == 0 and not graph["outputs"]:
        raise _refuse("the graph is empty")
