"""Round trips against a real `nnd serve` with tiny models."""

from __future__ import annotations

import pytest
import torch

import nnd


@pytest.fixture(scope="module")
def gpt2(daemon, tiny_models):
    model = nnd.TransformersModel(tiny_models["gpt2"], address=daemon.address, device="cpu")
    yield model
    model.release()


@pytest.fixture(scope="module")
def reference(tiny_models):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_models["gpt2"]).eval()


PROMPT = "The Eiffel Tower is in the city of"


def test_scan_gives_shapes_without_dispatching(daemon, tiny_models):
    model = nnd.TransformersModel(tiny_models["gpt2"], address=daemon.address, device="cpu")
    model.release()
    with model.scan(PROMPT):
        hidden = nnd.save(model.transformer.h[0].output.shape[-1])
        shape = model.transformer.h[0].output.shape.save()
        dim = nnd.save(model.lm_head.output.shape[-1])
        hs = model.transformer.h[-1].output.save()
    n = len(model.tokenizer(PROMPT)["input_ids"])
    assert shape == torch.Size([1, n, hidden]) and dim == model.config.vocab_size  # a transformers config
    assert hs.device.type == "meta" and hs.shape == (1, n, hidden)
    assert not model.dispatched


def test_trace_matches_transformers(gpt2, reference):
    with gpt2.trace(PROMPT):
        logits = gpt2.lm_head.output.save()
        out = gpt2.output.logits.save()
    ids = torch.tensor([gpt2.tokenizer(PROMPT)["input_ids"]])
    with torch.no_grad():
        expected = reference(ids).logits
    assert torch.allclose(logits, expected, atol=1e-4)
    assert torch.equal(logits, out)
    assert gpt2.dispatched


def test_steering_changes_only_what_it_should(gpt2):
    with gpt2.trace(PROMPT):
        base = gpt2.lm_head.output.save()
    with gpt2.trace(PROMPT):
        resid = gpt2.transformer.h[1].output
        resid[:, -1, :] += 10 * torch.ones(resid.shape[-1])
        steered = gpt2.lm_head.output.save()
    assert not torch.allclose(steered[:, -1], base[:, -1])
    assert torch.allclose(steered[:, :-1], base[:, :-1], atol=1e-5)


def test_invokes_and_patching(gpt2):
    with gpt2.trace() as tracer:
        with tracer.invoke("Hello world"):
            clean = gpt2.transformer.h[0].output.save()
        with tracer.invoke("Hello there"):
            gpt2.transformer.h[0].output[:, -1, :] = clean[:, -1, :]
            patched = gpt2.transformer.h[0].output.save()
    assert torch.allclose(patched[:, -1], clean[:, -1])


def test_ops_torch_functions_and_logit_lens(gpt2):
    with gpt2.trace(PROMPT):
        h = gpt2.transformer.h[0].output
        probs = torch.softmax(gpt2.lm_head(gpt2.transformer.ln_f(h)), dim=-1).save()
        top = probs[0, -1].argmax(dim=-1).save()
        both = torch.cat([h, 2 * h], dim=0).save()
    assert torch.allclose(probs.sum(-1), torch.ones(probs.shape[:-1]), atol=1e-4)
    assert top.ndim == 0 and both.shape[0] == 2
    assert torch.allclose(both[1], 2 * both[0], atol=1e-5)


def test_shape_error_is_a_runtime_error_quoting_the_line(gpt2):
    with pytest.raises(RuntimeError) as info:
        with gpt2.trace(PROMPT):
            gpt2.transformer.h[1].output[:, -1, :] += torch.ones(7)  # wrong size
    assert isinstance(info.value, nnd.NndError)
    assert "wrong size" in str(info.value) or "torch.ones(7)" in str(info.value)


def test_generate_loops_and_tokens(gpt2):
    with gpt2.generate(PROMPT, max_new_tokens=3) as tracer:
        picks = [].save()  # made in the block: saved, or its name does not outlive it (as in nnsight)
        for _ in tracer.iter[:]:  # the body runs once per step (nnsight's semantics)
            picks.append(gpt2.lm_head.output[:, -1].argmax(-1).save())
            last = gpt2.lm_head.output[:, -1].argmax(-1).save()
        ids = tracer.result.save()
    n = len(gpt2.tokenizer(PROMPT)["input_ids"])
    assert ids.shape == (1, n + 3)
    assert isinstance(picks, list) and len(picks) == 3
    assert [int(p) for p in picks] == ids[0, n:].tolist()
    assert int(last) == ids[0, -1]  # a name bound in the loop holds the last step's value
    assert [t.id for t in tracer.tokens] == ids[0, n:].tolist()


def test_stream(gpt2):
    tokens = list(gpt2.stream(PROMPT, max_new_tokens=4))
    assert [t.step for t in tokens] == [0, 1, 2, 3] and all(isinstance(t.text, str) for t in tokens)
    it = gpt2.stream(PROMPT, max_new_tokens=50)
    first = next(it)
    it.close()
    assert first.step == 0


def test_llama_trace(daemon, tiny_models):
    model = nnd.TransformersModel(tiny_models["llama"], address=daemon.address, device="cpu")
    try:
        with model.trace("Hello world"):
            layer = model.model.layers[-1].output.save()
            logits = model.lm_head.output.save()
        assert layer.ndim == 3 and logits.shape[:2] == layer.shape[:2]
    finally:
        model.release()
