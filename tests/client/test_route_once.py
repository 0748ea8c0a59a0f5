"""A route-following client sends a one-message Trace as TraceOnce (nnd.proto), and sends it as a
streamed Trace instead when the worker says it cannot answer so (`nnd-route: stream`) or knows no
TraceOnce (an older worker: then never again on that route). Against a fake daemon that is also its
own model's worker; the real worker's side is tests/process/test_trace_once.py."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator

import grpc
import pytest
import torch
from fakedaemon import FakeNnd, saves, serve

import nnd
from nnd.v1 import nnd_pb2, values_pb2

VALUES = torch.arange(64, dtype=torch.float32).reshape(1, 4, 16) / 7


class RoutedFake(FakeNnd):
    """A fake daemon whose models' route leads back to itself; `once` says how it answers TraceOnce
    ("answer", "stream": refuse with the trailer, None: UNIMPLEMENTED as an older worker)."""

    address = ""
    once: str | None = None

    def GetRoute(self, request, context):  # noqa: N802
        return nnd_pb2.Route(address=self.address, epoch=1)

    def TraceOnce(self, request, context):  # noqa: N802
        self.requests.append(("TraceOnce", request))
        if self.once is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not implemented!")
        if self.once == "stream":
            context.set_trailing_metadata((("nnd-route", "stream"),))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this trace would wait; send it as Trace")
        results = nnd_pb2.TraceResults(done=nnd_pb2.TraceDone(compute_s=0.01))
        for node in saves(request):
            results.saved.add(node=node, value=_tensor())
        return nnd_pb2.TraceResponse(results=results)


def _tensor() -> values_pb2.Value:
    return values_pb2.Value(
        tensor=values_pb2.Tensor(dtype=values_pb2.FLOAT32, shape=[1, 4, 16], data=VALUES.numpy().tobytes())
    )


def _streamed(method: str, request: nnd_pb2.TraceRequest) -> Iterator[nnd_pb2.TraceResponse]:
    for node in saves(request):
        yield nnd_pb2.TraceResponse(saved=nnd_pb2.Saved(node=node, value=_tensor()))
    yield nnd_pb2.TraceResponse(done=nnd_pb2.TraceDone(compute_s=0.01))


@pytest.fixture
def routed(_gpt2_modules) -> Iterator[RoutedFake]:
    service = RoutedFake(modules=_gpt2_modules, reply=_streamed)
    folder = tempfile.mkdtemp(prefix="nnd-fake-")
    service.address = f"unix://{folder}/nnd.sock"
    server = serve(service, f"{folder}/nnd.sock")
    yield service
    server.stop(None)


def _trace(model: nnd.TransformersModel) -> torch.Tensor:
    with model.trace("hi"):
        out = model.transformer.h[0].output[0].save()
    return out


def _methods(service: RoutedFake) -> list[str]:
    return [m for m, _ in service.requests]


def test_a_trace_is_one_unary_call_to_the_worker(routed):
    routed.once = "answer"
    model = nnd.TransformersModel("tiny-gpt2", address=routed.address)
    assert torch.equal(_trace(model), VALUES)
    assert _methods(routed) == ["TraceOnce"]
    assert model._conn.router.once_calls == 1


def test_a_refusal_to_answer_in_one_message_sends_that_trace_as_a_stream(routed):
    routed.once = "stream"
    model = nnd.TransformersModel("tiny-gpt2", address=routed.address)
    assert torch.equal(_trace(model), VALUES)
    assert torch.equal(_trace(model), VALUES)
    # Each trace asks again: the refusal was about that trace (it would wait), not about the worker.
    assert _methods(routed) == ["TraceOnce", "Trace", "TraceOnce", "Trace"]
    assert model._conn.router.once_calls == 0


def test_an_older_worker_without_trace_once_gets_streams_from_then_on(routed):
    routed.once = None
    model = nnd.TransformersModel("tiny-gpt2", address=routed.address)
    assert torch.equal(_trace(model), VALUES)
    assert torch.equal(_trace(model), VALUES)
    assert _methods(routed) == ["TraceOnce", "Trace", "Trace"]
