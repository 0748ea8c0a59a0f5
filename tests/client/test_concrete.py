"""Shapes read inside a block: a Scan of the graph so far, cached."""

from __future__ import annotations

import grpc
import pytest
import torch
from fakedaemon import Abort, meta, saves

import nnd
from nnd.v1 import nnd_pb2, values_pb2


def scans(fake) -> list[nnd_pb2.TraceRequest]:
    return [r for m, r in fake[0].requests if m == "Scan"]


def test_shape_is_concrete_and_cached(model, fake):
    seen = []
    keep = seen.append  # the test looks at the unsaved proxy after the block (its name does not outlive it)
    with model.trace("hi"):
        out = model.transformer.h[0].output
        keep(out)
        shape = out.shape
        assert isinstance(shape, tuple) and shape == torch.Size([1, 4, 16])
        assert repr(shape) == "torch.Size([1, 4, 16])"
        assert shape[-1] == 16 and out.ndim == 3 and len(out) == 1
        assert out.dtype == torch.float32
        # a later read of the same module value (a new node) hits the cache
        assert model.transformer.h[0].output.shape[1] == 4
        steer = torch.zeros(out.shape[-1])
        out[:, -1] += steer
        assert out.shape == (1, 4, 16)  # after a write: asks again
    requests = scans(fake)
    assert len(requests) == 2
    first = requests[0]
    assert first.invokes[0].text == "hi"
    save = first.graph.nodes[-1]
    assert save.save.value.ref == seen[0]._node
    assert not any(n.WhichOneof("kind") == "save" for n in first.graph.nodes[:-1])


def test_shape_save_and_nnd_save_in_a_scan(model, fake):
    with model.scan("hello"):
        shape = model.transformer.h[0].output.shape.save()
        dim = nnd.save(model.transformer.h[0].output.shape[-1])
        hs = model.transformer.h[-1].output.save()
    assert type(shape) is torch.Size and shape == torch.Size([1, 4, 16])
    assert dim == 16
    assert hs.device.type == "meta" and hs.shape == (1, 4, 16) and hs.dtype == torch.float32


def test_iterating_a_tuple_output(model, fake):
    def reply(method, request):
        for node in saves(request):
            tup = values_pb2.Value(tuple=values_pb2.ValueList(items=[meta([1, 4, 16]), meta([1, 2, 4, 8])]))
            yield nnd_pb2.TraceResponse(saved=nnd_pb2.Saved(node=node, value=tup))

    fake[0].reply = reply
    with model.trace("hi"):
        hidden, attn = model.transformer.h[0].attn.output
        assert hidden is not attn
    graph = [r for m, r in fake[0].requests if m == "Trace"][0].graph
    gets = [n for n in graph.nodes if n.WhichOneof("kind") == "op"]
    assert [n.op.name for n in gets] == ["getitem", "getitem"]


def test_shape_errors_surface_at_the_line(model, fake):
    def reply(method, request):
        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "shape mismatch at test line", "RuntimeError")
        yield

    fake[0].reply = reply
    with pytest.raises(RuntimeError, match="shape mismatch") as info:
        with model.trace("hi"):
            model.lm_head.output.shape  # noqa: B018
    assert isinstance(info.value, nnd.InvalidRequest)
