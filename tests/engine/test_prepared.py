"""The engine's request object (engine/prepared.py): merging requests and splitting the merged
run's responses gives each request what it gets alone, under its own node and blob ids."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import wire_results
from graphs import Graph

from nnd.v1 import graph_pb2, nnd_pb2
from nnd.wire import _results
from nnd_daemon.engine import nodeids, prepared, wire

# Batching changes the matmul's batch size; float32 kernels may block the work differently.
ATOL = 1e-5


def _first(first: int) -> nnd_pb2.TraceRequest:
    """Two invokes; a write into invoke 1 (target invoke moves), refs in a nested list (refs move),
    a value that travels as a blob (the next requests' blob ids move)."""
    g = Graph()
    h0 = g.module("transformer.h.0", invoke=0)
    h1 = g.module("transformer.h.0", invoke=1)
    g.set("transformer.h.0", g.op("mul", h1, 2.0), invoke=1)
    after = g.module("transformer.h.1", invoke=1)
    g.save(after)
    g.save(g.op("cat", [h0, after], dim=0))
    g.save(g.op("contiguous", g.op("expand", h0, 100, -1, -1)))
    return g.request(range(first, first + 4), range(first + 4, first + 8))


def _second() -> nnd_pb2.TraceRequest:
    """A loop scope (its number moves) and a value big enough to travel in chunks (blob ids renumbered)."""
    g = Graph()
    loop = g.loop()
    g.save(g.module("transformer.h.1", invoke=0, scope=loop), scope=loop)
    h = g.module("transformer.h.0", invoke=0)
    g.save(g.op("contiguous", g.op("expand", h, 400, -1, -1)))
    g.save(g.op("sum", h))
    return g.request([30, 31, 32, 33])


def _kinds(responses: list[nnd_pb2.TraceResponse]) -> list[tuple[str, int]]:
    """The shape of a stream: each message's kind and the node or blob id it names."""
    out = []
    for r in responses:
        kind = r.WhichOneof("kind")
        out.append((kind, r.saved.node if kind == "saved" else r.chunk.blob if kind == "chunk" else 0))
    return out


def _close(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=ATOL)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _close(x, y)
    else:
        assert a == b


def test_merge_then_split_gives_each_request_its_own_results(gpt2: Any) -> None:
    requests = [_first(5), _second(), _first(40)]  # different tokens: a row read from the wrong invoke shows
    alone = [gpt2.stream(r) for r in requests]
    merged = prepared.PreparedTrace.concatenate([prepared.PreparedTrace.from_pb(r, gpt2.tokenizer) for r in requests])
    assert [p.at for p in merged.parts] == [
        nodeids.Offsets(0, 0, 0),
        nodeids.Offsets(12, 2, 0),
        nodeids.Offsets(21, 3, 1),
    ]
    assert len(merged.tokens) == 5 and len(merged.graph.scopes) == 1
    split = merged.split()
    parts: list[list[nnd_pb2.TraceResponse]] = [[] for _ in requests]
    for response in gpt2.stream(merged.to_pb()):
        for i, routed in split(response):
            parts[i].append(routed)
    assert [r.chunk.blob for r in parts[1] if r.WhichOneof("kind") == "chunk"] == [1]  # merged: blob 2
    for got, want in zip(parts, alone, strict=True):
        assert _kinds(got) == _kinds(want)  # same node ids, same blob ids, same order
        values, expected = wire_results.collect(got), wire_results.collect(want)
        assert values.keys() == expected.keys()
        for node in expected:
            _close(values[node], expected[node])


def test_split_routes_serialized_values_to_their_parts() -> None:
    """A saved value too big for one message travels serialized (`Saved.value_blob`): each part
    gets its own value back, under its own node and blob ids."""
    a = prepared.PreparedTrace("m", [(1,)], graph_pb2.Graph(), [prepared.Part(nodeids.Offsets(), 10, 1)])
    merged = prepared.PreparedTrace.concatenate([a, a])
    split = merged.split()
    values = {3: [float(i) for i in 200_000 * [1]], 13: list(range(300_000))}  # both over 1 MiB encoded
    encoder = wire.Encoder()
    parts: list[list[nnd_pb2.TraceResponse]] = [[], []]
    for node, value in values.items():
        msg, raw = encoder.saved(value)
        assert raw is not None
        blob = encoder.next_blob
        encoder.next_blob += 1
        for response in wire.saved_messages(node, msg, [(blob, raw)], blob):
            for i, routed in split(response):
                parts[i].append(routed)
    for i, routed in split(nnd_pb2.TraceResponse(done=nnd_pb2.TraceDone())):
        parts[i].append(routed)
    assert _results.collect(iter(parts[0])).saved == {3: values[3]}
    assert _results.collect(iter(parts[1])).saved == {3: values[13]}
    with pytest.raises(RuntimeError, match="no part owns"):
        split(nnd_pb2.TraceResponse(saved=nnd_pb2.Saved(node=20)))


def _id_fields(desc: Any, seen: set[str]) -> set[str]:
    """graph.proto's uint32 fields and `invoke` fields reachable from `desc` (values are data, not ids)."""
    out: set[str] = set()
    if desc.full_name in seen or desc.file.name != "nnd/v1/graph.proto":
        return out
    seen.add(desc.full_name)
    for f in desc.fields:
        if f.message_type is not None:
            out |= _id_fields(f.message_type, seen)
        elif f.type == f.TYPE_UINT32 or f.name == "invoke":
            out.add(f"{desc.name}.{f.name}")
    return out


def test_every_id_bearing_field_moves() -> None:
    """nodeids.shift moves every field of a node that names a node, invoke or scope; a new such
    field in graph.proto fails here until nodeids.py handles it."""
    assert _id_fields(graph_pb2.Node.DESCRIPTOR, set()) == {
        "Node.id", "Node.scope", "Arg.ref", "Grad.value", "Grad.backward", "SetGrad.value", "SetGrad.backward",
        "ModuleValue.invoke", "Cache.invoke",
    }  # fmt: skip
    g = Graph()
    loop = g.loop()
    m = g.module("a", invoke=0, scope=loop)
    g.save(g.op("cat", [m, (m, m)], dim=g.module("b", invoke=1)), scope=loop)
    g.set("a", m, invoke=1, scope=loop)
    g.skip("a", m, invoke=0)
    back = g.backward(m, m)
    g.grad(m, back)
    g.set_grad(m, back, m)
    g.cache(["a"])
    g.g.nodes[-1].cache.invoke = 1
    by = nodeids.Offsets(ids=100, invokes=10, scopes=3)
    for src in g.g.nodes:
        node = graph_pb2.Node()
        node.CopyFrom(src)
        nodeids.shift(node, by)
        assert node.id == src.id + 100
        assert node.scope == (src.scope + 3 if src.scope else 0)
        assert list(nodeids.refs(node)) == [r + 100 for r in nodeids.refs(src)]
        assert nodeids.invokes(node) == [i + 10 if i is not None else None for i in nodeids.invokes(src)]
    # Every kind that holds refs or invokes was built (and checked above).
    with_refs = {n.WhichOneof("kind") for n in g.g.nodes if list(nodeids.refs(n))}
    assert with_refs == {"op", "save", "set", "skip", "backward", "grad", "set_grad"}
    assert {n.WhichOneof("kind") for n in g.g.nodes if nodeids.invokes(n)} == {"module", "set", "skip", "cache"}
