"""The same interventions through nnd and through nnsight 0.8.1 in-process,
on the same local weights: the numbers must agree."""

from __future__ import annotations

import pytest
import torch

import nnd

nnsight = pytest.importorskip("nnsight")

PROMPT = "The Eiffel Tower is in the city of"
OTHER = "Hello world, this is"
ATOL = 1e-5


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def pair(request, daemon, tiny_models):
    from transformers import AutoTokenizer

    kind = request.param
    path = tiny_models[kind]
    ours = nnd.TransformersModel(path, address=daemon.address, device="cpu", dispatch=True)
    theirs = nnsight.LanguageModel(path, tokenizer=AutoTokenizer.from_pretrained(path), device_map="cpu", dispatch=True)
    yield kind, ours, theirs
    ours.release()


def _layers(model, kind):
    return model.transformer.h if kind == "gpt2" else model.model.layers


def _lm_head(model):
    return model.lm_head


def test_read(pair):
    kind, ours, theirs = pair
    with ours.trace(PROMPT):
        a = _layers(ours, kind)[1].output.save()
        la = ours.lm_head.output.save()
    with theirs.trace(PROMPT):
        b = _layers(theirs, kind)[1].output.save()
        lb = theirs.lm_head.output.save()
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    torch.testing.assert_close(la, lb, atol=ATOL, rtol=0)


def test_zero_ablation(pair):
    kind, ours, theirs = pair
    with ours.trace(PROMPT):
        _layers(ours, kind)[0].output[:] = 0
        a = ours.lm_head.output.save()
    with theirs.trace(PROMPT):
        _layers(theirs, kind)[0].output[:] = 0
        b = theirs.lm_head.output.save()
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_steering(pair):
    kind, ours, theirs = pair
    torch.manual_seed(0)
    width = ours.config["hidden_size"] if "hidden_size" in ours.config else ours.config["n_embd"]
    v = torch.randn(int(width))
    with ours.trace(PROMPT):
        _layers(ours, kind)[1].output[:, -1, :] += 4 * v
        a = ours.lm_head.output.save()
    with theirs.trace(PROMPT):
        _layers(theirs, kind)[1].output[:, -1, :] += 4 * v
        b = theirs.lm_head.output.save()
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_activation_patching_across_invokes(pair):
    kind, ours, theirs = pair
    with ours.trace() as tracer:
        with tracer.invoke(PROMPT):
            clean = _layers(ours, kind)[0].output[:, -1, :]
        with tracer.invoke(OTHER):
            _layers(ours, kind)[0].output[:, -1, :] = clean
            a = ours.lm_head.output[:, -1, :].save()
    with theirs.trace() as tracer:
        barrier = tracer.barrier(2)
        with tracer.invoke(PROMPT):
            clean_ref = _layers(theirs, kind)[0].output[:, -1, :]
            barrier()
        with tracer.invoke(OTHER):
            barrier()
            _layers(theirs, kind)[0].output[:, -1, :] = clean_ref
            b = theirs.lm_head.output[:, -1, :].save()
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_logit_lens(pair):
    kind, ours, theirs = pair
    norm = (lambda m: m.transformer.ln_f) if kind == "gpt2" else (lambda m: m.model.norm)
    with ours.trace(PROMPT):
        a = torch.softmax(ours.lm_head(norm(ours)(_layers(ours, kind)[0].output)), dim=-1).save()
    with theirs.trace(PROMPT):
        b = torch.softmax(theirs.lm_head(norm(theirs)(_layers(theirs, kind)[0].output)), dim=-1).save()
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_skip(pair):
    kind, ours, theirs = pair
    with ours.trace(PROMPT):
        layer = _layers(ours, kind)[1]
        layer.skip(layer.input)
        a = ours.lm_head.output.save()
    with theirs.trace(PROMPT):
        layer = _layers(theirs, kind)[1]
        layer.skip(layer.input)
        b = theirs.lm_head.output.save()
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_reads_in_reverse_order_match_forward_order(pair):
    """nnd takes reads in any order (nnsight needs forward order): the values
    equal nnsight's forward-order reads."""
    kind, ours, theirs = pair
    with ours.trace(PROMPT):
        late = ours.lm_head.output.save()
        _layers(ours, kind)[0].output[:, -1, :] *= 2
        early = _layers(ours, kind)[0].output.save()
    with theirs.trace(PROMPT):
        _layers(theirs, kind)[0].output[:, -1, :] *= 2
        early_ref = _layers(theirs, kind)[0].output.save()
        late_ref = theirs.lm_head.output.save()
    torch.testing.assert_close(early, early_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(late, late_ref, atol=ATOL, rtol=0)


def test_stop(pair):
    kind, ours, theirs = pair
    with ours.trace(PROMPT) as tracer:
        a = _layers(ours, kind)[0].output.save()
        tracer.stop()
    with theirs.trace(PROMPT) as tracer:
        b = _layers(theirs, kind)[0].output.save()
        tracer.stop()
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
