"""Python values <-> `nnd.v1.Value`: constants going out, results coming back.

Tensors travel as raw little-endian bytes. bfloat16 travels as its 16 bits
(torch's own storage); without torch such a result is widened to float32,
since numpy has no bfloat16.
"""

from __future__ import annotations

import math
import mmap
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from nnd.v1 import values_pb2
from nnd.wire import _dtypes, _meta, _torchmod
from nnd.wire._output import ModelOutput

_LITTLE = sys.byteorder == "little"


# ------------------------------------------------------------------ encoding


def encode(obj: Any) -> values_pb2.Value:
    """Encode a constant. Raises TypeError for a value the wire cannot carry."""
    v = values_pb2.Value()
    _fill(v, obj)
    return v


def _fill(v: values_pb2.Value, obj: Any) -> None:
    # bool before int: bool is an int subclass.
    if obj is None:
        v.none.SetInParent()
    elif obj is Ellipsis:
        v.ellipsis.SetInParent()
    elif isinstance(obj, (bool, np.bool_)):
        v.bool = bool(obj)
    elif isinstance(obj, (int, np.integer)):
        v.int = int(obj)
    elif isinstance(obj, (float, np.floating)):
        v.float = float(obj)
    elif isinstance(obj, str):
        v.str = obj
    elif isinstance(obj, slice):
        v.slice.SetInParent()  # `slice(None)` has no field set but is still a slice
        _fill_slice(v.slice, obj)
    elif isinstance(obj, np.ndarray):
        _fill_numpy(v.tensor, obj)
    elif _is_torch(obj, "Tensor"):
        _fill_torch(v.tensor, obj)
    elif isinstance(obj, _meta.Size) or _is_torch(obj, "Size"):
        v.size.dims.extend(int(d) for d in obj)
    elif _is_torch(obj, "dtype") or isinstance(obj, np.dtype):
        v.dtype = _dtypes.enum_of(_dtypes.canonical(obj))
    elif _is_torch(obj, "device"):
        v.str = str(obj)
    elif isinstance(obj, tuple):
        for item in obj:
            _fill(v.tuple.items.add(), item)
        v.tuple.SetInParent()
    elif isinstance(obj, (list, range)):  # a range indexes as the list of its ints (`h[:, range(3)]`)
        for item in obj:
            _fill(v.list.items.add(), item)
        v.list.SetInParent()
    elif isinstance(obj, Mapping):
        v.map.SetInParent()
        for key, item in obj.items():
            if not isinstance(key, str):
                raise TypeError(f"only str keys can be sent, not {key!r}")
            _fill(v.map.items[key], item)
    else:
        raise TypeError(f"cannot send a {type(obj).__name__} to the daemon: {obj!r:.80}")


def _fill_slice(s: values_pb2.Slice, obj: slice) -> None:
    for field in ("start", "stop", "step"):
        bound = getattr(obj, field)
        if bound is None:
            continue
        if not isinstance(bound, (int, np.integer)) or isinstance(bound, bool):
            raise TypeError(
                f"slice bounds must be ints known while recording, not {type(bound).__name__}; "
                "compute the index with a tensor op (e.g. torch.narrow or a mask) instead"
            )
        setattr(s, field, int(bound))


def _is_torch(obj: Any, name: str) -> bool:
    torch = _torchmod.loaded()
    return torch is not None and isinstance(obj, getattr(torch, name))


def _fill_numpy(t: values_pb2.Tensor, arr: np.ndarray) -> None:
    name = _dtypes.canonical(arr.dtype)
    if not _dtypes.is_element_type(name) or name == "bfloat16":
        raise TypeError(f"numpy arrays of dtype {arr.dtype} cannot be sent")
    t.dtype = _dtypes.enum_of(name)
    t.shape.extend(arr.shape)
    t.data = np.ascontiguousarray(arr, dtype=np.dtype(_dtypes.numpy_view(name))).tobytes()


def _fill_torch(t: values_pb2.Tensor, tensor: Any) -> None:
    import torch

    tensor = tensor.detach()
    if tensor.device.type == "meta":
        raise TypeError(
            "a tensor on the meta device has no data to send (outside a block a model's weight has only its "
            "shape and dtype: compute with `model.<module>.weight` inside the block)"
        )
    name = _dtypes.canonical(tensor.dtype)
    if not _dtypes.is_element_type(name):
        raise TypeError(f"tensors of dtype {tensor.dtype} cannot be sent")
    tensor = tensor.cpu().contiguous()
    if name == "bfloat16":  # numpy cannot hold bf16: ship its 16 bits
        tensor = tensor.view(torch.int16)
    t.dtype = _dtypes.enum_of(name)
    t.shape.extend(tensor.shape)
    arr = tensor.numpy()
    t.data = arr.tobytes() if _LITTLE else arr.byteswap().tobytes()


# ------------------------------------------------------------------ decoding


class Decoder:
    """Turns result Values into Python objects.

    `blobs` maps a chunked tensor's blob id to its reassembled bytes. Tensors
    become what `_torchmod.set_tensor_type` says (torch tensors when torch is
    installed, by default; `use_torch=False` forces numpy), else
    numpy arrays; meta tensors become tensors on the "meta" device or `MetaTensor`.
    """

    def __init__(
        self,
        blobs: Mapping[int, Any] | None = None,
        *,
        use_torch: bool | None = None,
        regions: Mapping[str, Any] | None = None,
    ) -> None:
        self.blobs = blobs or {}
        self.torch = _torchmod.available() if use_torch is None or use_torch else None
        # Shared-memory regions this request's results may lie in, by name (`_shm.Lease`s).
        self.regions = regions or {}
        # Bytes the big results (shared memory or chunked) take in a region, for sizing the next one.
        self.big_bytes = 0

    def value(self, v: values_pb2.Value) -> Any:
        kind = v.WhichOneof("kind")
        if kind is None or kind == "none":
            return None
        if kind == "tensor":
            return self.tensor(v.tensor)
        if kind in ("int", "float", "bool", "str"):
            return getattr(v, kind)
        if kind == "slice":
            s = v.slice
            return slice(*(getattr(s, f) if s.HasField(f) else None for f in ("start", "stop", "step")))
        if kind == "ellipsis":
            return Ellipsis
        if kind == "list":
            floats = _floats(v.list)  # a tolist() of a float tensor: at once
            return floats if floats is not None else [self.value(i) for i in v.list.items]
        if kind == "tuple":
            return tuple(self.value(i) for i in v.tuple.items)
        if kind == "size":
            dims = tuple(v.size.dims)
            return self.torch.Size(dims) if self.torch is not None else dims
        if kind == "dtype":
            name = _dtypes.name_of(v.dtype)
            return getattr(self.torch, name) if self.torch is not None else name
        if kind == "map":  # a model output's fields also read as attributes (`out.logits`)
            return ModelOutput((k, self.value(i)) for k, i in v.map.items.items())
        raise ValueError(f"unknown value kind {kind!r}")

    def tensor(self, t: values_pb2.Tensor) -> Any:
        name = _dtypes.name_of(t.dtype)
        shape = tuple(t.shape)
        if t.meta:
            if self.torch is not None:
                return self.torch.empty(shape, dtype=getattr(self.torch, name), device="meta")
            return _meta.MetaTensor(shape, name)
        expected = math.prod(shape) * _dtypes.itemsize(name)
        data: Any
        if t.shm or t.blob:
            self.big_bytes += -(-expected // 64) * 64  # aligned as in a region (_shm.ALIGN)
        if t.shm:  # results through shared memory: zero-copy views (_shm.py)
            from nnd.wire import _shm

            lease = self.regions.get(t.shm)
            if lease is not None:
                data = lease.view(t.shm_offset, expected)
            else:
                data = _shm.take_fresh(t.shm, t.shm_offset, expected)
        else:
            data = self.blobs.get(t.blob, b"") if t.blob else t.data
        if len(data) != expected:
            raise ValueError(f"tensor of shape {list(shape)} {name} needs {expected} bytes, got {len(data)}")
        view = np.dtype(_dtypes.numpy_view(name))
        if isinstance(data, np.ndarray):  # a uint8 view of a region: the region's array stays the base
            arr = data.view(view)
        else:
            # A bytearray makes the array writable (torch warns on read-only buffers).
            # (Buffers already writable and owned here, reassembled blobs and segments, are used as they are.)
            buf = data if isinstance(data, (bytearray, mmap.mmap)) else bytearray(data)
            arr = np.frombuffer(buf, dtype=view, count=math.prod(shape))
        arr = arr.reshape(shape)
        if not _LITTLE:
            arr = arr.byteswap()
        if self.torch is not None:
            torch = self.torch
            if name == "bfloat16":
                return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
            return torch.from_numpy(arr)
        if name == "bfloat16":
            return (arr.astype(np.uint32) << 16).view(np.float32)
        return arr


def _floats(items: values_pb2.ValueList) -> list[float] | None:
    """The numbers of a long ValueList of floats alone, read at once from its bytes (each item is 11:
    field 1, length 9, Value.float's tag, 8 bytes little-endian); None if it holds anything else."""
    n = len(items.items)
    if n < 64:
        return None
    raw = items.SerializeToString()
    if len(raw) != 11 * n:
        return None
    arr = np.frombuffer(raw, dtype=[("head", "u1", 3), ("value", "<f8")])
    head = arr["head"]
    if not ((head[:, 0] == 0x0A) & (head[:, 1] == 9) & (head[:, 2] == 0x19)).all():
        return None
    return arr["value"].tolist()
