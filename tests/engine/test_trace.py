"""Trace patterns against the same intervention written with plain PyTorch hooks."""

from __future__ import annotations

import pytest
import torch
import wire_results
from graphs import Graph, S, idx
from reference import capture, forward
from torch.testing import assert_close

PROMPT = "The Eiffel Tower is in the city of"
OTHER = "Hello world"
LAYER = {"gpt2": "transformer.h.{}", "llama": "model.layers.{}", "bert": "bert.encoder.layer.{}"}


def _logits(g: Graph):
    return g.save(g.op("getattr", g.module(""), "logits"))


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_read_layer_output(models, kind):
    m = models[kind]
    path = LAYER[kind].format(1)
    g = Graph()
    saved = g.save(g.module(path))
    got = m.run(g.request(PROMPT))[saved.id]
    store: dict = {}
    forward(m.model, m.tokenizer, [PROMPT], **{path.replace(".", "__"): capture(store, "h")})
    assert_close(got, store["h"])


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_zero_ablation(models, kind):
    m = models[kind]
    mlp = LAYER[kind].format(0) + ".mlp"
    g = Graph()
    g.op("setitem", g.module(mlp), idx(S), 0.0, text=f"model.{mlp}.output[:] = 0")
    logits = _logits(g)
    got = m.run(g.request(PROMPT))[logits.id]
    ref = forward(m.model, m.tokenizer, [PROMPT], **{mlp.replace(".", "__"): lambda mod, a, o: torch.zeros_like(o)})
    assert_close(got, ref.logits)


def test_steering_add_last_position(gpt2):
    vec = torch.randn(64, generator=torch.Generator().manual_seed(1)).double()  # float64: the engine casts it
    g = Graph()
    h = g.module("transformer.h.0")
    part = g.op("getitem", h, idx(S, -1, S))
    part = g.op("iadd", part, vec)
    g.op("setitem", h, idx(S, -1, S), part, text="model.transformer.h[0].output[:, -1, :] += v")
    logits = _logits(g)
    got = gpt2.run(g.request(PROMPT))[logits.id]

    def steer(mod, args, out):
        out = out.clone()
        out[:, -1, :] += vec.float()
        return out

    ref = forward(gpt2.model, gpt2.tokenizer, [PROMPT], transformer__h__0=steer)
    assert_close(got, ref.logits)
    plain = forward(gpt2.model, gpt2.tokenizer, [PROMPT])
    assert not torch.allclose(got, plain.logits)


def test_constant_tensors_move_to_the_activations_dtype_inside_sequences_and_through_constant_nodes(gpt2):
    """A float64 constant meets a float32 activation as float32 wherever it sits: in a tuple argument beside
    the activation, or computed by a node of constants only (whose value is known only when it runs)."""
    vec = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(2)).double()
    g = Graph()
    h = g.module("transformer.h.0")
    joined = g.save(g.op("cat", (h, vec), dim=1))
    doubled = g.op("mul", vec, 2.0)  # constants only: a constant node
    shifted = g.save(g.op("add", h, doubled))
    got = gpt2.run(g.request(PROMPT))
    store: dict = {}
    forward(gpt2.model, gpt2.tokenizer, [PROMPT], transformer__h__0=capture(store, "h"))
    assert got[joined.id].dtype == got[shifted.id].dtype == torch.float32
    assert_close(got[joined.id], torch.cat((store["h"], vec.float()), dim=1))
    assert_close(got[shifted.id], store["h"] + 2 * vec.float())


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_activation_patching_across_invokes(models, kind):
    m = models[kind]
    path = LAYER[kind].format(0)
    g = Graph()
    clean = g.op("getitem", g.module(path, invoke=0), idx(S, -1, S))
    g.op("setitem", g.module(path, invoke=1), idx(S, -1, S), clean, text="patch")
    out = g.save(g.op("getattr", g.module("", invoke=1), "logits"))
    got = m.run(g.request(PROMPT, OTHER))[out.id]
    assert got.shape[0] == 1

    def patch(mod, args, o):
        o = o.clone()
        o[1, -1] = o[0, -1]
        return o

    ref = forward(m.model, m.tokenizer, [PROMPT, OTHER], **{path.replace(".", "__"): patch})
    assert_close(got, ref.logits[1:])
    unpatched = forward(m.model, m.tokenizer, [PROMPT, OTHER])
    assert not torch.allclose(got[0, -1], unpatched.logits[1, -1])


def test_logit_lens_call_module(gpt2):
    g = Graph()
    h = g.module("transformer.h.0")
    lens = g.op("call_module", "lm_head", g.op("call_module", "transformer.ln_f", h))
    saved = g.save(lens)
    final = _logits(g)
    got = gpt2.run(g.request(PROMPT))
    store: dict = {}
    ref = forward(gpt2.model, gpt2.tokenizer, [PROMPT], transformer__h__0=capture(store, "h"))
    with torch.no_grad():
        expected = gpt2.model.lm_head(gpt2.model.transformer.ln_f(store["h"]))
    assert_close(got[saved.id], expected)
    # The out-of-place calls did not count as calls of ln_f/lm_head: the final logits are untouched.
    assert_close(got[final.id], ref.logits)


def test_skip_layer(gpt2):
    g = Graph()
    g.skip("transformer.h.1", g.module("transformer.h.0"))
    logits = _logits(g)
    calls = []
    handle = gpt2.model.transformer.h[1].attn.register_forward_hook(lambda *a: calls.append(1))
    try:
        got = gpt2.run(g.request(PROMPT))[logits.id]
    finally:
        handle.remove()
    assert calls == []  # the skipped block's children never ran
    ref = forward(gpt2.model, gpt2.tokenizer, [PROMPT], transformer__h__1=lambda mod, a, o: a[0])
    assert_close(got, ref.logits)
    assert "forward" not in gpt2.model.transformer.h[1].__dict__


def test_skip_one_invoke(gpt2):
    g = Graph()
    g.skip("transformer.h.1", g.module("transformer.h.0", invoke=1), invoke=1)
    logits = _logits(g)
    got = gpt2.run(g.request(PROMPT, OTHER))[logits.id]

    def skip_row(mod, args, o):
        o = o.clone()
        o[1] = args[0][1]
        return o

    ref = forward(gpt2.model, gpt2.tokenizer, [PROMPT, OTHER], transformer__h__1=skip_row)
    assert_close(got, ref.logits)


def test_stop_early(gpt2):
    g = Graph()
    h = g.save(g.module("transformer.h.0"))
    g.stop()
    calls = []
    handle = gpt2.model.lm_head.register_forward_hook(lambda *a: calls.append(1))
    try:
        got = gpt2.run(g.request(PROMPT))[h.id]
    finally:
        handle.remove()
    assert calls == []
    store: dict = {}
    forward(gpt2.model, gpt2.tokenizer, [PROMPT], transformer__h__0=capture(store, "h"))
    assert_close(got, store["h"])


def test_reads_written_in_reverse_order(gpt2):
    g = Graph()
    later = g.save(g.module("transformer.h.1"))  # written first, runs second
    g.op("setitem", g.module("transformer.h.0"), idx(S), 0.0)
    got = gpt2.run(g.request(PROMPT))[later.id]
    store: dict = {}
    forward(
        gpt2.model,
        gpt2.tokenizer,
        [PROMPT],
        transformer__h__0=lambda mod, a, o: torch.zeros_like(o),
        transformer__h__1=capture(store, "h1"),
    )
    assert_close(got, store["h1"])


def test_set_output(gpt2):
    g = Graph()
    h = g.module("transformer.h.0")
    g.set("transformer.h.0", g.op("mul", h, 2.0), text="model.transformer.h[0].output = h * 2")
    after = g.save(g.module("transformer.h.0"))  # after the set (by id): sees the new value
    logits = _logits(g)
    got = gpt2.run(g.request(PROMPT))
    store: dict = {}
    ref = forward(gpt2.model, gpt2.tokenizer, [PROMPT], transformer__h__0=lambda mod, a, o: o * 2)
    forward(gpt2.model, gpt2.tokenizer, [PROMPT], transformer__h__0=capture(store, "h"))
    assert_close(got[logits.id], ref.logits)
    assert_close(got[after.id], store["h"] * 2)


def test_set_input(gpt2):
    g = Graph()
    x = g.module("transformer.h.1", "input")
    g.set("transformer.h.1", g.op("mul", x, 0.5), "input")
    logits = _logits(g)
    got = gpt2.run(g.request(PROMPT))[logits.id]
    modules = dict(gpt2.model.named_modules())
    handle = modules["transformer.h.1"].register_forward_pre_hook(lambda mod, a: (a[0] * 0.5, *a[1:]))
    try:
        ref = forward(gpt2.model, gpt2.tokenizer, [PROMPT])
    finally:
        handle.remove()
    assert_close(got, ref.logits)


def test_batched_equals_single(gpt2):
    prompts = [PROMPT, OTHER, "A daemon keeps models"]
    g = Graph()
    per = [g.save(g.op("getattr", g.module("", invoke=i), "logits")) for i in range(len(prompts))]
    batched = gpt2.run(g.request(*prompts))
    for i, prompt in enumerate(prompts):
        g1 = Graph()
        single = _logits(g1)
        alone = gpt2.run(g1.request(prompt))[single.id]
        n = alone.shape[1]
        assert_close(batched[per[i].id][:, -n:], alone, atol=1e-5, rtol=1e-4)


def test_ops_and_values(gpt2):
    g = Graph()
    h = g.module("transformer.h.0")
    shape = g.save(g.op("getattr", h, "shape"))
    top = g.save(g.op("topk", g.op("getitem", g.op("getattr", g.module(""), "logits"), idx(0, -1)), 3))
    mean = g.save(g.op("item", g.op("mean", h)))
    soft = g.save(g.op("sum", g.op("softmax", h, dim=-1), dim=-1))
    noise = g.save(g.op("randn", 4, seed=7))
    got = gpt2.run(g.request(PROMPT))
    n = len(gpt2.tokenizer(PROMPT)["input_ids"])
    assert got[shape.id] == torch.Size([1, n, 64])
    assert isinstance(got[top.id], tuple) and got[top.id][0].shape == (3,)
    assert isinstance(got[mean.id], float)
    assert_close(got[soft.id], torch.ones(1, n))
    assert_close(got[noise.id], torch.randn(4, generator=torch.Generator().manual_seed(7)))


def test_tensor_args_plain_module():
    from nnd_daemon import engine

    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    a, b = torch.randn(2, 4), torch.randn(3, 4)
    g = Graph()
    first = g.save(g.module("0", invoke=1))
    out = g.save(g.module("", invoke=0))
    msgs: list = []
    engine.run(net, None, g.request(a, b), mode="trace", emit=msgs.append)
    got = wire_results.collect(msgs)
    with torch.no_grad():
        assert_close(got[first.id], net[0](b))
        assert_close(got[out.id], net(a))


def test_set_one_invoke_from_another(gpt2):
    """`.output = x` inside invoke 1 with x from invoke 0: only invoke 1's rows change."""
    g = Graph()
    src = g.op("getitem", g.module("transformer.h.0", invoke=0), idx(S, slice(-2, None), S))
    dst = g.op("getitem", g.module("transformer.h.0", invoke=1), idx(S, slice(None, -2), S))
    g.set("transformer.h.0", g.op("cat", [dst, src], dim=1), invoke=1)
    logits = _logits(g)
    got = gpt2.run(g.request(PROMPT, OTHER))[logits.id]

    def patch(mod, args, o):
        o = o.clone()
        o[1, -2:] = o[0, -2:]
        return o

    ref = forward(gpt2.model, gpt2.tokenizer, [PROMPT, OTHER], transformer__h__0=patch)
    assert_close(got, ref.logits)
