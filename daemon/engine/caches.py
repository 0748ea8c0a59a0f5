"""Cache nodes: module values recorded at the end of each hook, after the graph's
writes there, one entry per call (run inside the executor's dataflow loop)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from nnd.v1 import graph_pb2

from . import rows, wire
from .order import POST, PRE

if TYPE_CHECKING:
    from .plan import Plan


def _sanitize(value: Any) -> Any:
    """What the wire can carry: tensors, plain values and containers of them; anything else is None."""
    if isinstance(value, torch.Tensor) or value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (torch.Size, torch.dtype)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _sanitize(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_sanitize(v) for v in value]
        return items if isinstance(value, list) else tuple(items)
    return None


class Caches:
    """The Cache nodes of a plan and what they have recorded so far."""

    def __init__(
        self, plan: Plan, modules: list[str], invoke_rows: list[tuple[int, int]] | None = None, batch_size: int = 0
    ) -> None:
        self.rows = invoke_rows or []
        self.batch_size = batch_size
        self.by_path: dict[str, list[tuple[int, graph_pb2.Cache]]] = {}
        # cache node -> path -> call -> {"output": ..., "inputs": ...}
        self.entries: dict[int, dict[str, dict[int, dict[str, Any]]]] = {}
        for node in plan.nodes.values():
            if node.kind != "cache":
                continue
            spec = node.proto.cache
            self.entries[node.id] = {}
            for path in spec.modules or modules:
                self.by_path.setdefault(path, []).append((node.id, spec))

    def wants(self, path: str) -> bool:
        return path in self.by_path

    def record(self, path: str, hook: str, call: int, value: Any) -> None:
        for cache_id, spec in self.by_path.get(path, ()):
            if hook == PRE and spec.inputs:
                args, kwargs = value
                item, slot = (tuple(args), dict(kwargs)), "inputs"
            elif hook == POST and spec.outputs:
                item, slot = value, "output"
            else:
                continue
            if spec.HasField("invoke") and spec.invoke < len(self.rows):
                # A cache opened inside an invoke sees that invoke's rows, as its module values do.
                start, stop = self.rows[spec.invoke]
                item = rows.rows(item, start, stop, self.batch_size)
            entry = self.entries[cache_id].setdefault(path, {}).setdefault(call, {})
            entry[slot] = _sanitize(_transform(item, spec))

    def result(self, cache_id: int) -> dict[str, list[dict[str, Any]]]:
        return {path: [calls[c] for c in sorted(calls)] for path, calls in self.entries.get(cache_id, {}).items()}


def _transform(value: Any, spec: graph_pb2.Cache) -> Any:
    dtype = wire.to_torch_dtype(spec.dtype) if spec.dtype else None
    device = spec.device or None

    def fix(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        return t.to(device) if device is not None else t

    return _map(value, fix)


def _map(value: Any, fn: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        return {k: _map(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map(v, fn) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_map(v, fn) for v in value)
    return value
