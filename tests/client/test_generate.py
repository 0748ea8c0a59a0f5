"""Generation: loop scopes, per-step saves, streamed tokens, model.stream()."""

from __future__ import annotations

import threading

import pytest
import torch
from fakedaemon import saves

import nnd
from nnd.v1 import graph_pb2, nnd_pb2, values_pb2


def gen_reply(steps: int = 3):
    def reply(method, request):
        for s in range(steps):
            ids = [10 + s + i for i in range(len(request.invokes))]
            yield nnd_pb2.TraceResponse(step=nnd_pb2.StepTokens(step=s, ids=ids, text=[f"t{i}" for i in ids]))
        scoped = {n.id for n in request.graph.nodes if n.scope}
        for node in saves(request):
            if node in scoped:
                items = [values_pb2.Value(int=s) for s in range(steps)]
                value = values_pb2.Value(list=values_pb2.ValueList(items=items))
            else:
                value = values_pb2.Value(int=-1)
            yield nnd_pb2.TraceResponse(saved=nnd_pb2.Saved(node=node, value=value))

    return reply


def last_generate(fake) -> nnd_pb2.TraceRequest:
    return [r for m, r in fake[0].requests if m == "Generate"][-1]


def test_iter_records_the_body_once_into_a_scope(model, fake):
    fake[0].reply = gen_reply()
    with model.generate("hi", max_new_tokens=3, do_sample=True, temperature=0.7, top_k=5, seed=1) as tracer:
        first = model.lm_head.output.argmax(-1).save()
        bodies = 0
        for step in tracer.iter[1:3]:  # noqa: B007
            bodies += 1
            per_step = model.lm_head.output.argmax(-1).save()
            model.transformer.h[0].output[:] *= 0.5
        tokens = model.generator.streamer.output.save()
        out = tracer.result.save()
    assert bodies == 1
    req = last_generate(fake)
    opts = req.generate
    assert (opts.max_new_tokens, opts.do_sample, opts.top_k, opts.seed) == (3, True, 5, 1)
    assert abs(opts.temperature - 0.7) < 1e-9
    g = req.graph
    assert len(g.scopes) == 1
    rng = g.scopes[0].steps.range
    assert rng.start == 1 and rng.stop == 3 and not rng.HasField("step")
    scopes = [n.scope for n in g.nodes]
    assert scopes[:3] == [0, 0, 0] and set(scopes[3:-3]) == {1} and scopes[-2:] == [0, 0]
    assert all(n.module.call == 0 for n in g.nodes if n.WhichOneof("kind") == "module")
    assert first == -1 and per_step == [0, 1, 2] and out == -1
    assert isinstance(step, nnd._loops.Step)
    assert [t.id for t in tracer.tokens] == [10, 11, 12] and tracer.tokens[0].text == "t10"
    assert tokens.tolist() == [[10, 11, 12]]


def test_step_selectors(model, fake):
    fake[0].reply = gen_reply()
    with model.generate("hi", max_new_tokens=3) as tracer:
        for _ in tracer.iter[:]:
            model.lm_head.output.save()
        for _ in tracer.iter[[0, 2]]:
            model.lm_head.output.save()
        with tracer.all():
            model.lm_head.output.save()
        for _ in tracer.iter:
            pass
    scopes = last_generate(fake).graph.scopes
    assert scopes[0].steps.HasField("all") and scopes[2].steps.HasField("all") and scopes[3].steps.HasField("all")
    assert list(scopes[1].steps.steps.steps) == [0, 2]


def test_branching_on_a_step_refuses(model, fake):
    with pytest.raises(TypeError, match="tracer.iter"):
        with model.generate("hi") as tracer:
            for step in tracer.iter[:]:
                if step == 2:
                    pass


def test_stream_yields_tokens_and_cancels(model, fake):
    started = threading.Event()

    def reply(method, request):
        assert request.generate.stream_text and request.generate.max_new_tokens == 50
        for s in range(50):
            started.set()
            yield nnd_pb2.TraceResponse(step=nnd_pb2.StepTokens(step=s, ids=[s], text=[str(s)]))

    fake[0].reply = reply
    got = []
    it = model.stream("hi", max_new_tokens=50)
    for token in it:
        got.append((token.step, token.id, token.text))
        if len(got) == 2:
            break
    it.close()
    assert got == [(0, 0, "0"), (1, 1, "1")]
    assert fake[0].cancelled.wait(5)


def test_generated_ids_as_tensor(model, fake):
    def reply(method, request):
        for node in saves(request):
            ids = torch.tensor([[1, 2, 3]])
            t = values_pb2.Tensor(dtype=values_pb2.INT64, shape=[1, 3], data=ids.numpy().tobytes())
            yield nnd_pb2.TraceResponse(saved=nnd_pb2.Saved(node=node, value=values_pb2.Value(tensor=t)))

    fake[0].reply = reply
    with model.generate("hi", max_new_tokens=3):
        out = model.generator.output.save()
    assert out.tolist() == [[1, 2, 3]]
    node = last_generate(fake).graph.nodes[0]
    assert node.module.point == graph_pb2.RESULT
