"""Long lists of numbers (engine/numlists.py, nnd/_codec.py): the fast encoding is byte for byte
what protobuf writes item by item, and decodes to the same list."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from nnd.v1 import values_pb2
from nnd.wire import _codec
from nnd_daemon.engine import numlists, wire


def _protobuf(x: list[Any]) -> bytes:
    key = {float: "float", int: "int", bool: "bool"}[type(x[0])]
    return values_pb2.ValueList(items=[values_pb2.Value(**{key: v}) for v in x]).SerializeToString()


rng = random.Random(0)
CASES = {
    "floats": [rng.uniform(-1e6, 1e6) for _ in range(1000)] + [0.0, -0.0, math.inf, -math.inf, 1e-310],
    "ints": [rng.randrange(-(2**63), 2**63) for _ in range(1000)]
    + [0, 1, 127, 128, 16383, 16384, -1, 2**63 - 1, -(2**63)]
    + [2**k for k in range(63)],
    "small ints": list(range(500)),
    "bools": [rng.random() < 0.5 for _ in range(300)],
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_fast_encoding_is_what_protobuf_writes(name: str) -> None:
    x = CASES[name]
    fast = numlists.encode(x)
    assert fast is not None and fast.WhichOneof("kind") == "list"
    assert fast.list.SerializeToString() == _protobuf(x)
    got = _codec.Decoder().value(fast)
    assert got == x and [type(v) for v in got] == [type(v) for v in x]


def test_a_tuple_stays_a_tuple() -> None:
    fast = numlists.encode(tuple(range(100)))
    assert fast is not None and _codec.Decoder().value(fast) == tuple(range(100))


def test_nan_round_trips() -> None:
    fast = numlists.encode([math.nan] * 100)
    assert fast is not None
    got = _codec.Decoder().value(fast)
    assert len(got) == 100 and all(math.isnan(v) for v in got)


@pytest.mark.parametrize(
    "x", [[1.0] * 10, [1.0] * 100 + [1], [True] + [1] * 100, [2**64] * 100, ["a"] * 100, [None] * 100]
)
def test_other_lists_take_the_slow_path(x: list[Any]) -> None:
    assert numlists.encode(x) is None
    if not any(isinstance(v, int) and v >= 2**63 for v in x):
        assert _codec.Decoder().value(wire.Encoder().value(x)) == x
