"""Test helpers that decode the engine's response stream with the engine's own decoders
(the client's `_results.collect` is the production reader)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from nnd.v1 import nnd_pb2, values_pb2
from nnd_daemon.engine import wire


def tensor_bytes(t: torch.Tensor) -> bytes:
    """Little-endian element bytes of `t`, as bytes."""
    return wire.tensor_view(t).tobytes()



def collect(responses: Iterable[nnd_pb2.TraceResponse]) -> dict[int, Any]:
    """Decode a response stream into {node id: value}, joining chunked blobs."""
    saved: dict[int, values_pb2.Value] = {}
    serialized: dict[int, int] = {}  # node -> the blob holding its serialized value
    chunks: dict[int, list[bytes]] = {}
    for r in responses:
        kind = r.WhichOneof("kind")
        if kind == "saved":
            if r.saved.value_blob:
                serialized[r.saved.node] = r.saved.value_blob
            else:
                saved[r.saved.node] = r.saved.value
        elif kind == "chunk":
            chunks.setdefault(r.chunk.blob, []).append(r.chunk.data)
    joined = {k: b"".join(v) for k, v in chunks.items()}
    for node, blob in serialized.items():
        saved[node] = values_pb2.Value.FromString(joined.pop(blob, b""))
    return {k: decode_result(v, joined.get) for k, v in saved.items()}


def decode_result(msg: values_pb2.Value, blob: Callable[[int], bytes | None]) -> Any:
    """Like decode_value, but tensors may name blobs whose bytes `blob(id)` returns."""
    kind = msg.WhichOneof("kind")
    if kind == "tensor":
        t = msg.tensor
        data = blob(t.blob) if t.blob else None
        return wire.decode_tensor(t, data)
    if kind in ("list", "tuple"):
        items = [decode_result(v, blob) for v in getattr(msg, kind).items]
        return items if kind == "list" else tuple(items)
    if kind == "map":
        return {k: decode_result(v, blob) for k, v in msg.map.items.items()}
    return wire.decode_value(msg)
