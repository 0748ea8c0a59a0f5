"""A module's parameters and buffers as graph values (ModuleTensor), against the same
computation in plain PyTorch on the same weights: a logit lens through lm_head.weight, an
embedding lookup through wte.weight, a buffer, a scan's shapes; and what must not happen: a
write into a weight (every client shares it), a gradient of one, an unknown name."""

from __future__ import annotations

import pytest
import torch
import wire_results
from graphs import Graph, S, idx
from reference import capture, forward
from torch.testing import assert_close

from nnd_daemon import engine, errors

PROMPT = "The Eiffel Tower is in the city of"


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed"


def test_saved_weight_is_the_parameter(gpt2):
    g = Graph()
    w = g.save(g.tensor("lm_head", "weight"))
    b = g.save(g.op("getattr", g.tensor("transformer.h.0.attn.c_attn", "bias"), "data"))
    got = gpt2.run(g.request(PROMPT))
    assert_close(got[w.id], gpt2.model.lm_head.weight.detach(), atol=0, rtol=0)
    assert_close(got[b.id], gpt2.model.transformer.h[0].attn.c_attn.bias.detach(), atol=0, rtol=0)


def test_logit_lens_through_lm_head_weight(gpt2):
    g = Graph()
    h = g.module("transformer.h.0")
    normed = g.op("call_module", "transformer.ln_f", h)
    lens = g.save(g.op("matmul", normed, g.op("getattr", g.tensor("lm_head", "weight"), "T")))
    got = gpt2.run(g.request(PROMPT))[lens.id]
    store: dict = {}
    forward(gpt2.model, gpt2.tokenizer, [PROMPT], transformer__h__0=capture(store, "h"))
    with torch.no_grad():
        ref = gpt2.model.transformer.ln_f(store["h"]) @ gpt2.model.lm_head.weight.T
    assert_close(got, ref)


def test_embedding_lookup_through_wte_weight(gpt2):
    ids = torch.tensor([3, 17, 40])
    g = Graph()
    rows = g.save(g.op("getitem", g.tensor("transformer.wte", "weight"), ids))
    got = gpt2.run(g.request(PROMPT))[rows.id]
    assert_close(got, gpt2.model.transformer.wte.weight.detach()[ids], atol=0, rtol=0)


def test_weight_times_activation_and_a_buffer_on_llama(models):
    llama = models["llama"]
    g = Graph()
    h = g.module("model.layers.0")
    scaled = g.save(g.op("mul", g.tensor("model.norm", "weight"), h))
    (name, buffer), *_ = llama.model.named_buffers()
    path, _, attr = name.rpartition(".")
    buf = g.save(g.tensor(path, attr))
    got = llama.run(g.request(PROMPT))
    store: dict = {}
    forward(llama.model, llama.tokenizer, [PROMPT], model__layers__0=capture(store, "h"))
    assert_close(got[scaled.id], llama.model.model.norm.weight.detach() * store["h"])
    assert_close(got[buf.id], buffer, atol=0, rtol=0)


def test_scan_gives_the_weights_shapes(models):
    for kind, path, shape in (("gpt2", "transformer.wte", (320, 64)), ("llama", "model.embed_tokens", None)):
        m = models[kind]
        shape = shape or tuple(m.model.model.embed_tokens.weight.shape)
        g = Graph()
        w = g.tensor(path, "weight")
        whole = g.save(w)
        lens = g.save(g.op("matmul", g.module(LAST[kind]), g.op("getattr", w, "T")))
        got = m.run(g.request(PROMPT), mode="scan")
        assert tuple(got[whole.id].shape) == shape
        assert got[whole.id].device.type == "meta"
        assert tuple(got[lens.id].shape)[-1] == shape[0]


LAST = {"gpt2": "transformer.h.1", "llama": "model.layers.1"}


@pytest.mark.parametrize(
    "write",
    [
        lambda g, w: g.op("setitem", w, idx(S), 0.0, text="model.transformer.ln_f.weight[:] = 0"),
        lambda g, w: g.op("imul", w, 2.0, text="model.transformer.ln_f.weight *= 2"),
        lambda g, w: g.op("setitem", g.op("getitem", w, idx(slice(0, 4))), idx(S), 1.0, text="w[:4][:] = 1"),
        lambda g, w: g.op("iadd", g.op("getattr", w, "T"), 1.0, text="w.T += 1"),
        lambda g, w: g.op("add", 1.0, 2.0, out=w, text="torch.add(1, 2, out=w)"),
        lambda g, w: g.op("setitem", g.op("getattr", w, "data"), idx(S), 0.0, text="w.data[:] = 0"),
    ],
    ids=["setitem", "imul", "view_setitem", "transpose_iadd", "out_kwarg", "data_setitem"],
)
def test_a_write_into_a_weight_is_refused_before_anything_runs(gpt2, write):
    before = _snapshot(gpt2.model)
    g = Graph()
    w = g.tensor("transformer.ln_f", "weight", text="w = model.transformer.ln_f.weight")
    write(g, w)
    g.save(g.module("lm_head"))
    with pytest.raises(errors.InvalidArgument, match="weight transformer.ln_f.weight") as info:
        gpt2.run(g.request(PROMPT))
    assert info.value.exc_type == "RuntimeError"
    assert "nb.py" in info.value.message
    _unchanged(gpt2.model, before)


def test_a_weight_written_as_a_module_output_is_a_copy(gpt2):
    # `h.output = w[None, :n]` then an in-place edit of that output: the weight stays as it was.
    before = _snapshot(gpt2.model)
    n = len(gpt2.tokenizer(PROMPT)["input_ids"])
    g = Graph()
    w = g.tensor("transformer.wpe", "weight")
    g.set("transformer.h.0", g.op("getitem", w, idx(None, slice(0, n))))
    g.op("setitem", g.module("transformer.h.0"), idx(S), 5.0)
    g.op("call_module", "transformer.h.1.mlp.act", w)
    out = g.save(g.module("lm_head"))
    got = gpt2.run(g.request(PROMPT))[out.id]
    _unchanged(gpt2.model, before)
    ref = forward(
        gpt2.model, gpt2.tokenizer, [PROMPT], transformer__h__0=lambda mod, a, o: torch.full_like(o, 5.0)
    )
    assert_close(got, ref.logits)


def test_unknown_tensor_name_is_not_found(gpt2):
    g = Graph()
    g.save(g.tensor("lm_head", "bias"))
    with pytest.raises(errors.NotFound, match="no parameter or buffer 'bias'.*weight"):
        gpt2.run(g.request(PROMPT))
    g = Graph()
    g.save(g.tensor("lm_hed", "weight"))
    with pytest.raises(errors.NotFound, match="no module 'lm_hed'"):
        gpt2.run(g.request(PROMPT))


def test_a_gradient_of_a_weight_is_refused(gpt2):
    g = Graph()
    w = g.tensor("lm_head", "weight")
    loss = g.op("sum", g.op("matmul", g.module("transformer.h.1"), g.op("getattr", w, "T")))
    back = g.backward(loss)
    g.save(g.grad(w, back))
    with pytest.raises(errors.InvalidArgument, match="weights never receive gradients"):
        gpt2.run(g.request(PROMPT))


@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantized_weight_is_the_dequantized_matrix(models, bits):
    # Not the packed storage (a 4-bit weight is stored as uint8 of shape [n/2, 1]): the matrix the
    # model computes with, in the model's dtype, within the quantization's error of the original.
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    llama = models["llama"]
    config = (
        BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
        if bits == 4
        else BitsAndBytesConfig(load_in_8bit=True)
    )
    quantized = AutoModelForCausalLM.from_pretrained(llama.path, quantization_config=config, device_map="cpu")
    path = "model.layers.0.mlp.gate_proj"
    g = Graph()
    w = g.save(g.tensor(path, "weight"))
    out: list = []
    engine.run(quantized, llama.tokenizer, g.request(PROMPT), mode="trace", emit=out.append)
    got = wire_results.collect(out)[w.id]
    original = llama.model.get_submodule(path).weight.detach()
    stored = quantized.get_submodule(path).weight
    assert stored.shape != original.shape or stored.dtype != original.dtype  # packed or int8 storage
    assert got.shape == original.shape and got.dtype == original.dtype
    tolerance = 0.2 if bits == 4 else 0.02  # of the largest weight
    assert (got - original).abs().max() <= tolerance * original.abs().max()


def test_a_stop_after_only_weights_never_runs_the_forward(gpt2):
    calls = []
    handle = gpt2.model.register_forward_pre_hook(lambda mod, args: calls.append(1))
    try:
        g = Graph()
        w = g.save(g.tensor("lm_head", "weight"))
        g.stop()
        got = gpt2.run(g.request(PROMPT))
        assert not calls and torch.equal(got[w.id], gpt2.model.lm_head.weight.detach())
        g = Graph()  # with a module value, the forward runs up to it
        h = g.save(g.module("transformer.h.0"))
        g.stop()
        assert gpt2.run(g.request(PROMPT))[h.id].shape[-1] == 64 and calls
    finally:
        handle.remove()
