"""Fast protobuf encoding of long lists of plain numbers (a `tolist()` of a tensor).

Built as the ValueList message's bytes with numpy, which protobuf then parses
in C, instead of one Python-made Value message per number, which for a
million numbers takes many seconds. (The client reads long float lists back
the same way: nnd/_codec.py.) The bytes are exactly what protobuf
would write for `ValueList(items=[Value(float=...), ...])`:
each item is field 1 (length-delimited) holding one Value whose `float`
(field 3, fixed64), `int` (field 2, varint) or `bool` (field 4, varint) is set.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nnd.v1 import values_pb2

MIN_ITEMS = 64  # shorter lists are encoded item by item: not worth it
_ITEM = 0x0A  # ValueList.items: field 1, length-delimited
_FLOAT, _INT, _BOOL = 0x19, 0x10, 0x20  # Value.float (fixed64), Value.int, Value.bool (varints)


def encode(x: list[Any] | tuple[Any, ...]) -> values_pb2.Value | None:
    """The Value of `x` (its `list`, or `tuple` for a tuple) when it is a long list of floats, ints or
    bools alone; else None."""
    if len(x) < MIN_ITEMS:
        return None
    kind = type(x[0])
    if kind not in (float, int, bool) or not all(type(v) is kind for v in x):
        return None
    if kind is float:
        out = np.empty(len(x), dtype=[("head", "u1", 3), ("value", "<f8")])
        out["head"] = (_ITEM, 9, _FLOAT)
        out["value"] = x
        raw = out.tobytes()
    else:
        try:
            ints = np.array(x, dtype=np.int64)
        except OverflowError:  # beyond int64: the message cannot hold it either; item by item says so
            return None
        raw = _varints(ints.view(np.uint64), _BOOL if kind is bool else _INT)
    # Value.list is field 9, Value.tuple field 10, both length-delimited: one parse, no copy.
    return values_pb2.Value.FromString(bytes([0x52 if isinstance(x, tuple) else 0x4A]) + varint(len(raw)) + raw)


def varint(n: int) -> bytes:
    """`n` as a protobuf base-128 varint (the one encoder: wire.py's frames, the worker's joined messages)."""
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _varints(u: np.ndarray, tag: int) -> bytes:
    """Items whose Value holds one varint field `tag` (int64 as protobuf writes it: 10 bytes if negative)."""
    groups = np.ones(len(u), dtype=np.int64)  # 7-bit groups of each value
    for k in range(1, 10):
        groups += u >= np.uint64(1 << (7 * k))
    size = 3 + groups  # item tag, Value length, field tag, the varint
    starts = np.concatenate(([0], np.cumsum(size)[:-1]))
    out = np.empty(int(size.sum()), dtype=np.uint8)
    out[starts] = _ITEM
    out[starts + 1] = 1 + groups
    out[starts + 2] = tag
    for k in range(10):
        has = groups > k
        byte = ((u[has] >> np.uint64(7 * k)) & np.uint64(0x7F)).astype(np.uint8)
        byte |= np.where(groups[has] > k + 1, 0x80, 0).astype(np.uint8)  # more groups follow
        out[starts[has] + 3 + k] = byte
    return out.tobytes()
