"""Shapes and dtypes without data: scan results when torch is not installed,
and the concrete sizes a proxy's `.shape` returns while recording."""

from __future__ import annotations

import math
from typing import Any

from nnd.wire import _torchmod


class Size(tuple):
    """A tensor shape read while recording: a tuple of ints (torch.Size cannot be
    subclassed), printed like `torch.Size([1, 10, 768])`.

    `.save()` exists so `x.shape.save()` reads as in nnsight; the shape is
    already concrete, so after the block the saved name holds a real
    `torch.Size` (or a plain tuple without torch).
    """

    __slots__ = ()

    def save(self) -> Size:
        """Keep this shape after the block (it is already known)."""
        from nnd.tracing import _context

        tracer = _context.current_or_none()
        if tracer is not None:
            tracer._save_concrete(self)
        return self

    def numel(self) -> int:
        return math.prod(self)

    def real(self) -> Any:
        """A torch.Size when results are torch tensors (`nnd.set_tensor_type`), else a plain tuple."""
        torch = _torchmod.available()
        return torch.Size(self) if torch is not None else tuple(self)

    def __repr__(self) -> str:
        return f"torch.Size({list(self)})" if _torchmod.available() is not None else repr(tuple(self))

    def __getitem__(self, key: Any) -> Any:  # a slice of a Size is a Size, as in torch
        out = tuple.__getitem__(self, key)
        return Size(out) if isinstance(key, slice) else out


class MetaTensor:
    """A tensor that has a shape and a dtype but no data: what a scan returns
    when torch is not installed (with torch you get a tensor on the "meta"
    device instead). `dtype` is the canonical name, e.g. "float32"."""

    __slots__ = ("shape", "dtype", "device")

    def __init__(self, shape: tuple[int, ...], dtype: str, device: str = "meta") -> None:
        self.shape = tuple(shape)
        self.dtype = dtype
        self.device = device

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return math.prod(self.shape)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MetaTensor) and (self.shape, self.dtype) == (other.shape, other.dtype)

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"MetaTensor(shape={self.shape}, dtype={self.dtype})"


def parameter(shape: list[int], dtype: str) -> Any:
    """A parameter's shape and dtype without its data: a torch.nn.Parameter on
    the "meta" device when torch is in use, else a MetaTensor."""
    torch = _torchmod.available()
    if torch is None:
        return MetaTensor(tuple(shape), dtype)
    from nnd.wire import _dtypes

    try:
        torch_dtype = getattr(torch, _dtypes.canonical(dtype))
    except (AttributeError, KeyError, ValueError):
        torch_dtype = torch.float32
    return torch.nn.Parameter(torch.empty(shape, dtype=torch_dtype, device="meta"))
