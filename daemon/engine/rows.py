"""Structure walks over module values: invoke row views, row writes, constant placement."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from .. import errors


def rows(value: Any, start: int, stop: int, batch: int) -> Any:
    """A view of rows [start, stop) of every tensor whose dim 0 is the batch; other leaves as they are."""
    if isinstance(value, torch.Tensor):
        if value.dim() >= 1 and value.shape[0] == batch:
            return value[start:stop]
        return value
    if isinstance(value, Mapping):  # dicts and ModelOutputs; a plain dict keeps "getattr logits" working
        return {k: rows(v, start, stop, batch) for k, v in value.items()}
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(rows(v, start, stop, batch) for v in value)
    if isinstance(value, list):
        return [rows(v, start, stop, batch) for v in value]
    return value


def write_rows(current: Any, new: Any, start: int, stop: int, batch: int) -> None:
    """Copy `new` into rows [start, stop) of `current`, leaf by leaf, in place."""
    if new is current or (
        not isinstance(new, torch.Tensor) and not isinstance(current, torch.Tensor) and _same(new, current)
    ):
        return  # a leaf given back as it was (None, a flag, the KV cache object): nothing to write
    if isinstance(current, torch.Tensor):
        if current.dim() >= 1 and current.shape[0] == batch:
            current[start:stop] = new
            return
        raise errors.InvalidArgument(
            f"cannot write one invoke's rows into a value of shape {list(current.shape)}: it has no batch dimension"
        )
    if isinstance(current, Mapping) and isinstance(new, Mapping):
        for key, item in new.items():
            write_rows(current[key], item, start, stop, batch)
        return
    if isinstance(current, (tuple, list)) and isinstance(new, (tuple, list)) and len(current) == len(new):
        for c, n in zip(current, new, strict=True):
            write_rows(c, n, start, stop, batch)
        return
    if isinstance(current, (tuple, list)) and isinstance(new, torch.Tensor) and current:
        # `block.output = h` for a block returning (h, ...): the first element is the hidden state.
        write_rows(current[0], new, start, stop, batch)
        return
    raise errors.InvalidArgument(
        f"cannot write a {type(new).__name__} into one invoke's rows of a {type(current).__name__}"
    )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (Mapping, tuple, list)) or isinstance(b, (Mapping, tuple, list)):
        return False  # containers are walked leaf by leaf
    try:
        return bool(a == b)
    except Exception:
        return False


def concat_rows(parts: list[Any]) -> Any:
    """Invokes' values joined into one batch: tensors concatenated on dim 0, structures leaf by leaf."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        if not all(isinstance(p, torch.Tensor) for p in parts):
            raise errors.InvalidArgument("the invokes' skip values differ in kind: every one must be a tensor")
        return torch.cat(parts, dim=0) if first.dim() >= 1 else first
    if isinstance(first, Mapping):
        return {k: concat_rows([p[k] for p in parts]) for k in first}
    if isinstance(first, (tuple, list)) and all(isinstance(p, (tuple, list)) and len(p) == len(first) for p in parts):
        joined = [concat_rows(list(items)) for items in zip(*parts, strict=True)]
        return tuple(joined) if isinstance(first, tuple) else joined
    return first


def first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    items: Any = value.values() if isinstance(value, Mapping) else value if isinstance(value, (tuple, list)) else ()
    for item in items:
        found = first_tensor(item)
        if found is not None:
            return found
    return None


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, list):
        return [map_tensors(v, fn) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: map_tensors(v, fn) for k, v in value.items()}
    return value


def placer(target: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """Moves a constant tensor to `target`'s device, and floating constants to its floating dtype."""
    if target is None:
        return lambda t: t

    def place(t: torch.Tensor) -> torch.Tensor:
        dtype = target.dtype if t.is_floating_point() and target.is_floating_point() else t.dtype
        if t.device == target.device and t.dtype == dtype:
            return t
        return t.to(device=target.device, dtype=dtype)

    return place
