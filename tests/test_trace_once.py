"""TraceOnce (nnd.proto) against a real daemon: a route-following client's one-message Trace is one
unary call to the worker, with the numbers of a plain forward, whatever the size of its results;
a trace that must wait behind a paused run is refused before it ran (`nnd-route: stream`) and sent
as a streamed Trace, which says where it waits; the daemon itself knows no TraceOnce."""

from __future__ import annotations

import queue
import threading
import time

import grpc
import pytest
import tinymodels
import torch
from graphs import Graph

import nnd
from nnd.v1 import contract, nnd_pb2, nnd_pb2_grpc

PROMPT = "Hello world"


@pytest.fixture(scope="module")
def path(tiny_models, tmp_path_factory):
    """A model of this module's own: a run another module left ending on the shared daemon's worker
    would make a trace wait, and a waiting trace is (rightly) refused as TraceOnce."""
    return tinymodels.private_copy(tiny_models["gpt2"], tmp_path_factory.mktemp("trace-once"))


@pytest.fixture(scope="module")
def gpt2(daemon, path):
    model = nnd.TransformersModel(path, address=daemon.address, device="cpu", dispatch=True)
    yield model
    model.release()


@pytest.fixture(scope="module")
def reference(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def _logits(reference, prompts):
    model, tokenizer = reference
    ids = torch.tensor([tokenizer(p)["input_ids"] for p in prompts])
    with torch.no_grad():
        return model(ids).logits


def _traced(model, prompts):
    with model.trace(prompts):
        out = model.lm_head.output.save()
    return out


def test_a_trace_is_one_unary_call_on_the_route_with_a_plain_forwards_numbers(gpt2, reference):
    router = gpt2._conn.router
    once, direct = router.once_calls, router.direct_calls
    got = _traced(gpt2, PROMPT)
    torch.testing.assert_close(got, _logits(reference, [PROMPT]), rtol=1e-5, atol=1e-5)
    assert (router.once_calls, router.direct_calls) == (once + 1, direct + 1)


def test_results_past_the_streams_joining_bound_still_come_in_the_one_message(gpt2, reference):
    prompts = ["the cat sat on the mat " * 10] * 3  # logits of 3 x ~114 tokens x 320: over 256 KiB
    router = gpt2._conn.router
    once = router.once_calls
    got = _traced(gpt2, prompts)
    want = _logits(reference, prompts)
    assert want.numel() * 4 > 256 * 1024
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert router.once_calls == once + 1


class _Pauser:
    """A raw Interact stream that pauses at h[0] and holds the model until closed."""

    def __init__(self, address: str, model: str) -> None:
        g = Graph()
        total = g.op("sum", g.module("transformer.h.0"))
        request = g.request(PROMPT)
        request.model = model
        start = nnd_pb2.InteractStart(request=request, want=[total.id], pause_timeout_s=120)
        self.channel = grpc.insecure_channel(address)
        call = self.channel.stream_stream(
            "/nnd.v1.Nnd/Interact", request_serializer=lambda b: b, response_deserializer=nnd_pb2.TraceResponse.FromString
        )
        self.outbox: queue.Queue = queue.Queue()
        self.outbox.put(nnd_pb2.InteractRequest(start=start).SerializeToString())
        self.responses = call(iter(self.outbox.get, None))
        for msg in self.responses:
            if msg.WhichOneof("kind") == "paused":
                return
        raise AssertionError("the stream ended without a pause")

    def close(self) -> None:
        self.outbox.put(None)  # the client's half-close ends the paused run (CANCELLED)
        try:
            for _ in self.responses:
                pass
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.CANCELLED, err
        self.channel.close()


def _queued(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        models = nnd_pb2_grpc.NndStub(channel).ListModels(nnd_pb2.ListModelsRequest(), timeout=30).models
    return sum(1 for m in models for r in m.requests if r.state == "queued")


def test_a_trace_behind_a_paused_run_is_refused_unrun_and_streams_its_place_in_line(
    daemon, gpt2, reference, path, capsys
):
    name = path
    want = _logits(reference, [PROMPT])
    router = gpt2._conn.router
    once, direct = router.once_calls, router.direct_calls
    pauser = _Pauser(daemon.address, name)
    try:
        # On the wire: the worker refuses a TraceOnce it would have to keep waiting without a word.
        with grpc.insecure_channel(daemon.address) as channel:
            route = nnd_pb2_grpc.NndStub(channel).GetRoute(nnd_pb2.RouteRequest(model=name), timeout=30)
        g = Graph()
        g.save(g.module("lm_head"))
        request = g.request(PROMPT)
        request.model = name
        with grpc.insecure_channel(route.address) as channel:
            call = channel.unary_unary("/nnd.v1.Nnd/TraceOnce", response_deserializer=nnd_pb2.TraceResponse.FromString)
            with pytest.raises(grpc.RpcError) as refused:
                call(request.SerializeToString(), metadata=[(contract.EPOCH_KEY, str(route.epoch))], timeout=60)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert contract.trailer(refused.value.trailing_metadata(), contract.ROUTE_KEY) == contract.STREAM
        assert _queued(daemon.address) == 0  # nothing of it waits or ran

        # The client sends the same trace as a stream: it queues, says why, and runs once the pause ends.
        got: list[torch.Tensor] = []
        bystander = threading.Thread(target=lambda: got.append(_traced(gpt2, PROMPT)))
        bystander.start()
        deadline = time.monotonic() + 60
        while _queued(daemon.address) == 0:
            assert time.monotonic() < deadline, "the bystander's trace never queued"
            time.sleep(0.05)
    finally:
        pauser.close()
    bystander.join(60)
    assert got, "the bystander's trace did not finish after the pause ended"
    torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-5)
    assert "paused at a sync point by another client" in capsys.readouterr().err
    assert router.once_calls == once  # refused as TraceOnce, answered as Trace
    assert router.direct_calls == direct + 2


def test_the_daemon_itself_knows_no_trace_once(daemon, tiny_models):
    request = nnd_pb2.TraceRequest(model=tiny_models["gpt2"])
    with grpc.insecure_channel(daemon.address) as channel:
        call = channel.unary_unary("/nnd.v1.Nnd/TraceOnce", response_deserializer=nnd_pb2.TraceResponse.FromString)
        with pytest.raises(grpc.RpcError) as err:
            call(request.SerializeToString(), timeout=60)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
