"""Load options -> Placement and keep-alive strings."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from nnd.v1 import nnd_pb2
from nnd.wire import _dtypes


def keep_alive_string(value: Any) -> str:
    """Durations such as "5m", "1h", "-1" (forever) and "0" pass through; a number is seconds."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        raise TypeError("keep_alive takes a duration such as '5m', a number of seconds, or -1")
    if isinstance(value, (int, float)):
        return "-1" if value < 0 else f"{value:g}s"
    if hasattr(value, "total_seconds"):  # datetime.timedelta
        return f"{value.total_seconds():g}s"
    raise TypeError(f"keep_alive must be a duration string or seconds, not {value!r}")


def _device(value: Any) -> str:
    return str(value) if value is not None else ""


def placement(
    *,
    device: Any = None,
    device_map: Any = None,
    dtype: Any = None,
    tp_size: int | None = None,
    compute_dtype: Any = None,
    max_memory: Mapping[Any, Any] | None = None,
) -> nnd_pb2.Placement:
    """A Placement from transformers-style arguments. dtypes may be torch
    dtypes or names ("bfloat16", "auto", "nf4")."""
    p = nnd_pb2.Placement(device=_device(device))
    if isinstance(device_map, Mapping):
        p.device_map = json.dumps({str(k): _device(v) if not isinstance(v, int) else v for k, v in device_map.items()})
    elif device_map is not None:
        p.device_map = str(device_map)
    if dtype is not None:
        p.dtype = _dtypes.canonical(dtype)
    if compute_dtype is not None:
        p.compute_dtype = _dtypes.canonical(compute_dtype)
    for key, cap in (max_memory or {}).items():
        p.max_memory[str(key)] = str(cap)
    if tp_size:
        p.tp_size = int(tp_size)
    return p
