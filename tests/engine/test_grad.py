"""Gradients in the graph, against torch.autograd on the same model."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from graphs import Graph, N, idx, value
from reference import hooks, inputs
from torch.testing import assert_close

from nnd_daemon import errors

PROMPT = "The Eiffel Tower is in the city of"
CORRUPT = "The Colosseum is in the city of"
LAYERS = 2


def _reference(m: Any, texts: list[str], loss_fn: Any, grad_hooks: dict[int, Any] | None = None) -> dict[int, Any]:
    """Block outputs and their gradients from plain autograd (retain_grad on each block's output)."""
    store: dict[int, torch.Tensor] = {}

    def keep(i: int) -> Any:
        def hook(mod: Any, args: Any, out: torch.Tensor) -> None:
            out.retain_grad()
            if grad_hooks and i in grad_hooks:
                out.register_hook(grad_hooks[i])
            store[i] = out

        return hook

    handles = [m.model.transformer.h[i].register_forward_hook(keep(i)) for i in range(LAYERS)]
    try:
        out = m.model(**inputs(m.tokenizer, texts))
        loss_fn(out.logits).backward()
    finally:
        for h in handles:
            h.remove()
        m.model.zero_grad(set_to_none=True)
    return store


def _metric(g: Graph, logits: N, row: int = 0) -> N:
    last = g.op("getitem", logits, idx(row, -1))
    return g.op("sub", g.op("getitem", last, 5), g.op("getitem", last, 7), text="loss = logits[-1, 5] - logits[-1, 7]")


def test_attribution_patching_every_layer(gpt2):
    """activation x gradient at every layer, in one request."""
    g = Graph()
    acts = [g.module(f"transformer.h.{i}") for i in range(LAYERS)]
    loss = _metric(g, g.op("getattr", g.module(""), "logits"))
    back = g.backward(loss)
    grads = [g.grad(a, back) for a in acts]
    attrs = [g.save(g.op("sum", g.op("mul", a, d), dim=-1)) for a, d in zip(acts, grads, strict=True)]
    saved_grads = [g.save(d) for d in grads]
    got = gpt2.run(g.request(PROMPT))

    ref = _reference(gpt2, [PROMPT], lambda logits: logits[0, -1, 5] - logits[0, -1, 7])
    for i in range(LAYERS):
        assert_close(got[saved_grads[i].id], ref[i].grad)
        assert_close(got[attrs[i].id], (ref[i] * ref[i].grad).sum(-1).detach())


def test_attribution_patching_clean_vs_corrupt_invokes(gpt2):
    """The textbook form: (clean - corrupt) * grad of the corrupt run's metric, one batched request."""
    g = Graph()
    clean = [g.module(f"transformer.h.{i}", invoke=0) for i in range(LAYERS)]
    corrupt = [g.module(f"transformer.h.{i}", invoke=1) for i in range(LAYERS)]
    logits = g.op("getattr", g.module("", invoke=1), "logits")
    back = g.backward(_metric(g, logits))
    attrs = []
    for c, k in zip(clean, corrupt, strict=True):
        delta = g.op("sub", c, k)
        attrs.append(g.save(g.op("sum", g.op("mul", delta, g.grad(k, back)), dim=-1)))
    got = gpt2.run(g.request(PROMPT, CORRUPT))

    ref = _reference(gpt2, [PROMPT, CORRUPT], lambda lg: lg[1, -1, 5] - lg[1, -1, 7])
    for i in range(LAYERS):
        want = ((ref[i][0:1] - ref[i][1:2]) * ref[i].grad[1:2]).sum(-1).detach()
        assert_close(got[attrs[i].id], want)


def test_set_grad_scales_what_flows_upstream(gpt2):
    g = Graph()
    h0, h1 = g.module("transformer.h.0"), g.module("transformer.h.1")
    back = g.backward(_metric(g, g.op("getattr", g.module(""), "logits")))
    g.set_grad(h1, back, g.op("mul", g.grad(h1, back), 2.0), text="h1.grad = h1.grad * 2")
    d0 = g.save(g.grad(h0, back))
    d1 = g.save(g.grad(h1, back))
    got = gpt2.run(g.request(PROMPT))

    ref = _reference(gpt2, [PROMPT], lambda lg: lg[0, -1, 5] - lg[0, -1, 7], {1: lambda grad: grad * 2})
    assert_close(got[d0.id], ref[0].grad)
    # A read recorded after the write sees the new gradient (retain_grad, too, runs after the hook).
    assert_close(got[d1.id], ref[1].grad)
    assert not torch.allclose(ref[1].grad, ref[1].grad / 2)


def test_gradients_only_for_requests_that_use_them(gpt2):
    weights = {k: v.clone() for k, v in gpt2.model.state_dict().items()}
    flags = {k: p.requires_grad for k, p in gpt2.model.named_parameters()}
    g = Graph()
    plain = g.save(g.op("getattr", g.module("transformer.h.0"), "requires_grad"))
    assert gpt2.run(g.request(PROMPT))[plain.id] is False

    g = Graph()
    h0 = g.module("transformer.h.0")
    flag = g.save(g.op("getattr", h0, "requires_grad"))
    back = g.backward(g.op("sum", g.module("transformer.h.1")))
    g.save(g.grad(h0, back))
    assert gpt2.run(g.request(PROMPT))[flag.id] is True
    assert all(p.grad is None for p in gpt2.model.parameters())
    assert {k: p.requires_grad for k, p in gpt2.model.named_parameters()} == flags
    for k, v in gpt2.model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    assert torch.is_grad_enabled()  # the engine's grad mode does not leak


def test_grad_of_value_after_the_loss_is_refused_before_running(gpt2):
    g = Graph()
    h0, h1 = g.module("transformer.h.0", line=3), g.module("transformer.h.1", line=4)
    back = g.backward(g.op("sum", h0), line=5)
    g.save(g.grad(h1, back, line=6, text="h1.grad"))
    with pytest.raises(errors.InvalidArgument) as info:
        gpt2.run(g.request(PROMPT))
    assert "line 6" in info.value.message and "cannot depend on it" in info.value.message


def test_grad_of_value_the_loss_does_not_use_is_refused_before_backward(gpt2):
    """Not decidable from the graph alone: autograd's graph is searched before the backward pass runs."""
    g = Graph()
    h0 = g.module("transformer.h.0")
    other = g.op("mul", h0, 2.0, line=4)
    back = g.backward(g.op("sum", h0), line=5)
    g.save(g.grad(other, back, line=6))
    with pytest.raises(errors.InvalidArgument) as info:
        gpt2.run(g.request(PROMPT))
    assert "line 6" in info.value.message and "does not depend on that value" in info.value.message


def test_grad_of_a_constant_is_refused(gpt2):
    g = Graph()
    c = g.const(torch.ones(3))
    back = g.backward(g.op("sum", g.module("transformer.h.1")))
    g.save(g.grad(c, back, line=9))
    with pytest.raises(errors.InvalidArgument, match="constants only"):
        gpt2.run(g.request(PROMPT))


def test_set_grad_from_a_later_gradient_is_a_causality_error(gpt2):
    g = Graph()
    h0, h1 = g.module("transformer.h.0"), g.module("transformer.h.1")
    back = g.backward(_metric(g, g.op("getattr", g.module(""), "logits")))
    g.set_grad(h1, back, g.grad(h0, back), line=12, text="h1.grad = h0.grad")
    with pytest.raises(errors.InvalidArgument) as info:
        gpt2.run(g.request(PROMPT))
    assert info.value.message.startswith("causality error") and "line 12" in info.value.message
    assert info.value.exc_type == "RuntimeError"


def test_loss_must_be_scalar(gpt2):
    g = Graph()
    h0 = g.module("transformer.h.0")
    back = g.backward(g.module("transformer.h.1"))
    g.save(g.grad(h0, back))
    with pytest.raises(errors.InvalidArgument, match="scalar"):
        gpt2.run(g.request(PROMPT))


def test_generate_refuses_gradients(gpt2):
    from nnd.v1 import nnd_pb2

    g = Graph()
    h0 = g.module("transformer.h.0")
    back = g.backward(g.op("sum", g.module("transformer.h.1")))
    g.save(g.grad(h0, back))
    with pytest.raises(errors.InvalidArgument, match="gradients need a trace"):
        gpt2.run(g.request(PROMPT, generate=nnd_pb2.GenerateOptions(max_new_tokens=2)), mode="generate")


def test_scan_gives_gradient_shapes(gpt2):
    g = Graph()
    h0 = g.module("transformer.h.0")
    back = g.backward(g.op("sum", g.module("transformer.h.1")))
    d = g.save(g.grad(h0, back))
    got = gpt2.run(g.request(PROMPT), mode="scan")[d.id]
    n = len(gpt2.tokenizer(PROMPT)["input_ids"])
    assert got.device.type == "meta" and tuple(got.shape) == (1, n, 64)


def _strided_owner(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
    """The block's output as a tensor that owns its storage with transposed (non-contiguous) strides,
    as an op on a transposed value leaves it: the next block's input then has a non-contiguous base."""
    b, s, d = out.shape
    owner = torch.empty_strided((b, s, d), (s * d, 1, s), dtype=out.dtype)
    owner.copy_(out)
    return owner


def test_gradient_of_an_invokes_rows_of_an_input_with_a_non_contiguous_base(gpt2):
    """Invoke 1's rows of h.1's input, whose batch tensor is not contiguous: the gradient is the
    base's gradient (kept in the base's layout) viewed as the rows are, equal to plain autograd's."""
    g = Graph()
    x = g.module("transformer.h.1", "input", invoke=1)
    logits = g.op("getattr", g.module("", invoke=1), "logits")
    back = g.backward(_metric(g, logits))
    saved = g.save(g.grad(x, back))
    with hooks(gpt2.model, transformer__h__0=_strided_owner):
        got = gpt2.run(g.request(PROMPT, CORRUPT))

    seen: dict[str, torch.Tensor] = {}

    def keep(module: Any, args: Any) -> None:
        args[0].retain_grad()
        seen["x"] = args[0]

    handle = gpt2.model.transformer.h[1].register_forward_pre_hook(keep)
    try:
        with hooks(gpt2.model, transformer__h__0=_strided_owner):
            out = gpt2.model(**inputs(gpt2.tokenizer, [PROMPT, CORRUPT]))
        (out.logits[1, -1, 5] - out.logits[1, -1, 7]).backward()
    finally:
        handle.remove()
        gpt2.model.zero_grad(set_to_none=True)
    assert not seen["x"].is_contiguous()
    assert_close(got[saved.id], seen["x"].grad[1:2])


def test_a_param_is_a_leaf_whose_gradient_comes_back(gpt2):
    """A Param (a client tensor that requires grad) combined with a module value: after the backward
    pass its gradient is in the results under its id, equal to plain autograd's."""
    torch.manual_seed(0)
    w = torch.randn(64, 3)
    g = Graph()
    node = g._node(0, None, "probe = torch.randn(64, 3, requires_grad=True)")
    node.param.value.CopyFrom(value(w))
    param = N(node.id)
    h = g.op("getitem", g.module("transformer.h.1"), idx(0, -1))
    loss = g.op("sum", g.op("pow", g.op("matmul", h, param), 2))
    g.backward(loss)
    got = gpt2.run(g.request(PROMPT))

    store: dict[str, torch.Tensor] = {}
    with hooks(gpt2.model, transformer__h__1=lambda m, a, out: store.setdefault("h", out)):
        gpt2.model(**inputs(gpt2.tokenizer, [PROMPT]))
    leaf = w.clone().requires_grad_(True)
    ((store["h"][0, -1].detach() @ leaf) ** 2).sum().backward()
    assert_close(got[param.id], leaf.grad)
