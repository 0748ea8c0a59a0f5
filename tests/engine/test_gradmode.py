"""Which autograd mode a request's forward runs in (engine/gradmode.py), and that inference mode,
used where nothing outlives the request, leaves nothing behind that a later request trips on."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import wire_results
from graphs import Graph
from torch.testing import assert_close

from nnd.v1 import nnd_pb2
from nnd_daemon import engine
from nnd_daemon.engine import gradmode

PROMPT = "The Eiffel Tower is in the city of"


def _modes_seen(m: Any, run: Any) -> list[bool]:
    """`torch.is_inference_mode_enabled()` inside the forward, at each call of block 0 during `run()`."""
    seen: list[bool] = []
    handle = m.model.transformer.h[0].register_forward_hook(lambda *_: seen.append(torch.is_inference_mode_enabled()))
    try:
        run()
    finally:
        handle.remove()
    return seen


def _grad_request() -> tuple[nnd_pb2.TraceRequest, Any]:
    g = Graph()
    h0 = g.module("transformer.h.0")
    back = g.backward(g.op("sum", g.op("getattr", g.module(""), "logits")))
    grad = g.save(g.grad(h0, back))
    return g.request(PROMPT), grad


def test_only_a_request_that_keeps_nothing_and_needs_no_gradient_runs_in_inference_mode(gpt2):
    g = Graph()
    saved = g.save(g.module("transformer.h.1"))
    plain_request = g.request(PROMPT)
    got: dict[int, Any] = {}
    assert _modes_seen(gpt2, lambda: got.update(gpt2.run(plain_request))) == [True]
    with torch.no_grad():  # the same numbers as a plain forward
        ref: dict[str, torch.Tensor] = {}
        handle = gpt2.model.transformer.h[1].register_forward_hook(lambda m, a, o: ref.setdefault("h", o))
        try:
            gpt2.model(**gpt2.tokenizer(PROMPT, return_tensors="pt"))
        finally:
            handle.remove()
    assert_close(got[saved.id], ref["h"], atol=0, rtol=0)
    assert not torch.is_inference_mode_enabled()  # nothing leaks out of the request

    grad_request, _ = _grad_request()
    assert _modes_seen(gpt2, lambda: gpt2.run(grad_request)) == [False]

    session = nnd_pb2.SessionRequest(model="tiny")
    session.traces.add(request=plain_request)
    out: list[nnd_pb2.TraceResponse] = []
    assert _modes_seen(gpt2, lambda: engine.run_session(gpt2.model, gpt2.tokenizer, session, emit=out.append)) == [False]
    assert_close(wire_results.collect(out)[saved.id], ref["h"], atol=0, rtol=0)


@pytest.mark.parametrize("kept_as", ["buffer", "attribute"])
def test_a_tensor_a_module_kept_from_an_inference_mode_run_does_not_break_a_later_backward(gpt2, kept_as):
    """A model that makes a tensor in its forward and keeps it (a lazily built buffer, a cached tensor
    attribute) made it in inference mode during a plain trace; a later backward through it would raise
    "Inference tensors cannot be saved for backward". The engine gives the module a normal copy first."""
    block = gpt2.model.transformer.h[1]

    def scaled(mod: Any, args: Any, out: Any) -> Any:
        hidden = out[0] if isinstance(out, tuple) else out
        if getattr(mod, "kept_scale", None) is None:
            scale = torch.full((hidden.shape[-1],), 0.5)
            if kept_as == "buffer":
                mod.register_buffer("kept_scale", scale)
            else:
                mod.kept_scale = scale
        hidden = hidden * mod.kept_scale  # saved for the backward when `hidden` needs a gradient
        return (hidden, *out[1:]) if isinstance(out, tuple) else hidden

    handle = block.register_forward_hook(scaled)
    try:
        g = Graph()
        g.save(g.module("transformer.h.1"))
        gpt2.run(g.request(PROMPT))  # a plain trace: the scale is made in inference mode
        assert block.kept_scale.is_inference()

        request, grad = _grad_request()
        got = gpt2.run(request)[grad.id]
        assert not block.kept_scale.is_inference()

        # The same backward in plain autograd, the scale made outside inference mode.
        del block.kept_scale
        if kept_as == "buffer":
            block._buffers.pop("kept_scale", None)
        store: dict[str, torch.Tensor] = {}

        def keep(mod: Any, args: Any, out: Any) -> None:
            hidden = out[0] if isinstance(out, tuple) else out
            hidden.retain_grad()
            store["h0"] = hidden

        keeper = gpt2.model.transformer.h[0].register_forward_hook(keep)
        try:
            gpt2.model(**gpt2.tokenizer(PROMPT, return_tensors="pt")).logits.sum().backward()
        finally:
            keeper.remove()
            gpt2.model.zero_grad(set_to_none=True)
        assert_close(got, store["h0"].grad)
    finally:
        handle.remove()
        block._buffers.pop("kept_scale", None)
        vars(block).pop("kept_scale", None)


def test_weights_that_are_not_plain_parameters_never_run_in_inference_mode():
    """bitsandbytes' parameters keep quantization state they fill during a forward; a tensor-parallel
    model's are DTensors: such a model runs under no_grad."""

    class Packed(torch.nn.Parameter):
        pass

    plain, packed = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    packed.weight = Packed(packed.weight.detach())
    assert gradmode._plain_weights(plain) and not gradmode._plain_weights(packed)


def test_what_a_fast_run_keeps_after_a_request_it_lent_the_model_to_is_copied_before_the_next_backward():
    """A generation (fast) lends the model between its steps; a backward run meanwhile copies what was kept
    so far, and what the generation's later steps keep must still be copied before the next backward."""
    module = torch.nn.Linear(2, 2)
    with contextlib.ExitStack() as generation:
        gradmode.enter(module, generation, needs_grad=False, may_be_fast=True)
        with contextlib.ExitStack() as lent:  # another client's backward, between two steps
            with torch.inference_mode(False):
                gradmode.enter(module, lent, needs_grad=True, may_be_fast=True)
        module.kept = torch.ones(2)  # a later step of the generation keeps a tensor
    assert module.kept.is_inference()
    with contextlib.ExitStack() as backward:
        gradmode.enter(module, backward, needs_grad=True, may_be_fast=True)
        assert not module.kept.is_inference()
