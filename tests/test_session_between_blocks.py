"""Python between a session's blocks computes on an earlier block's values (every session of
nnsight's LLM-depth tutorial does): the session runs its ended blocks far enough to produce the
value, as a sync point does inside a block, and a later block uses what Python made of it. Checked
against the same steps done with plain PyTorch hooks."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import nnd

PROMPT = "The Eiffel Tower is in the city of"


@pytest.fixture(scope="module")
def pair(daemon, tiny_models):
    path = tiny_models["gpt2"]
    ours = nnd.TransformersModel(path, address=daemon.address, device="cpu", dispatch=True)
    plain = AutoModelForCausalLM.from_pretrained(path).eval()
    yield ours, plain, AutoTokenizer.from_pretrained(path)
    ours.release()


def _plain(model, tokenizer):
    inputs = tokenizer(PROMPT, return_tensors="pt")
    seen = []
    handle = model.transformer.h[0].register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    with torch.no_grad():
        model(**inputs)
    handle.remove()
    h = seen[0]
    scale = h.norm()
    delta = h[:, -1] / scale

    def add(module, args, out):
        out = out.clone()
        out[:, -1] += delta
        return out

    handle = model.transformer.h[1].register_forward_hook(add)
    with torch.no_grad():
        logits = model(**inputs).logits
    handle.remove()
    return scale, delta, logits


def test_python_between_blocks_computes_on_an_earlier_blocks_value(pair):
    ours, plain, tokenizer = pair
    with ours.session():
        with ours.trace(PROMPT):
            h = ours.transformer.h[0].output.save()
        scale = h.norm().save()  # a real value now: the first block ran as far as it needed
        delta = (h[:, -1] / scale).save()  # saved: only saved names outlive the session, as in nnsight
        assert isinstance(scale, torch.Tensor) and isinstance(delta, torch.Tensor)
        with ours.trace(PROMPT):
            ours.transformer.h[1].output[:, -1] += delta
            logits = ours.lm_head.output.save()
    want_scale, want_delta, want_logits = _plain(plain, tokenizer)
    torch.testing.assert_close(scale, want_scale, atol=1e-5, rtol=0)
    torch.testing.assert_close(delta, want_delta, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=0)


def test_an_unsaved_value_between_blocks_and_several_blocks(pair):
    ours, plain, tokenizer = pair
    with ours.session():
        with ours.trace(PROMPT):
            h = ours.transformer.h[0].output  # not saved: still computable between the blocks
        with ours.trace(PROMPT):
            other = ours.transformer.h[1].output.save()
        scale = h.norm().save()
        with ours.trace(PROMPT):
            ours.transformer.h[1].output[:, -1] += h[:, -1] / scale
            logits = ours.lm_head.output.save()
    want_scale, _, want_logits = _plain(plain, tokenizer)
    torch.testing.assert_close(scale, want_scale, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=0)
    assert other.shape == want_logits.shape[:2] + (other.shape[-1],)
