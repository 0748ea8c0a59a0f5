"""Element types: the wire enum, their names, and numpy/torch equivalents."""

from __future__ import annotations

import sys
from typing import Any

from nnd.v1 import values_pb2

DType = values_pb2.DType

# name -> (wire enum, itemsize, numpy dtype string used to view the raw bytes)
_TABLE: dict[str, tuple[int, int, str]] = {
    "float32": (values_pb2.FLOAT32, 4, "<f4"),
    "float16": (values_pb2.FLOAT16, 2, "<f2"),
    # numpy has no bfloat16: the bytes are viewed as uint16 (see codec).
    "bfloat16": (values_pb2.BFLOAT16, 2, "<u2"),
    "float64": (values_pb2.FLOAT64, 8, "<f8"),
    "int64": (values_pb2.INT64, 8, "<i8"),
    "int32": (values_pb2.INT32, 4, "<i4"),
    "int16": (values_pb2.INT16, 2, "<i2"),
    "int8": (values_pb2.INT8, 1, "i1"),
    "uint8": (values_pb2.UINT8, 1, "u1"),
    "bool": (values_pb2.BOOL, 1, "?"),
}
_BY_ENUM = {enum: name for name, (enum, _, _) in _TABLE.items()}

# Spellings users write for a dtype, all mapped to the canonical name.
_ALIASES = {
    "float": "float32",
    "half": "float16",
    "double": "float64",
    "long": "int64",
    "int": "int32",
    "short": "int16",
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp32": "float32",
}


def name_of(enum: int) -> str:
    """Canonical name ("float32") of a wire dtype."""
    try:
        return _BY_ENUM[enum]
    except KeyError:
        raise ValueError(f"unknown tensor dtype {enum} on the wire") from None


def enum_of(name: str) -> values_pb2.DType:
    """Wire dtype of a canonical name."""
    return values_pb2.DType.Value(name_upper(canonical(name)))


def name_upper(name: str) -> str:
    """The enum's own spelling ("FLOAT32") of a canonical name."""
    if name not in _TABLE:
        raise TypeError(f"{name} is not an element type the wire carries")
    return name.upper()


def itemsize(name: str) -> int:
    return _TABLE[name][1]


def numpy_view(name: str) -> str:
    """The numpy dtype that reads this type's raw little-endian bytes."""
    return _TABLE[name][2]


def canonical(dtype: Any) -> str:
    """The canonical name of a dtype given as a string, a torch dtype or a numpy dtype.

    Names that are not element types (quantizations such as "nf4", "auto") are
    returned unchanged so placements can carry them.
    """
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.").lower()
        return _ALIASES.get(name, name)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    np = sys.modules.get("numpy")
    if np is not None:
        try:
            return str(np.dtype(dtype))
        except TypeError:
            pass
    raise TypeError(f"not a dtype: {dtype!r}")


def is_element_type(name: str) -> bool:
    return name in _TABLE


def torch_dtype(name: str) -> Any:
    """The torch dtype of a canonical name (torch must be imported)."""
    import torch

    return getattr(torch, name)
