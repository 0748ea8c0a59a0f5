"""Scan through the real daemon: shapes without weights, errors where a real
trace would fail, and concrete shapes inside any block (nnsight 0.8's Scan
page, adapted)."""

from __future__ import annotations

import json

import pytest
import torch

import nnd

PROMPT = "The Eiffel Tower is in the city of"


@pytest.fixture
def gpt2(daemon, tiny_models):
    model = nnd.TransformersModel(tiny_models["gpt2"], address=daemon.address, device="cpu")
    model.release()  # start undispatched whatever earlier tests did
    yield model
    model.release()


def _n_tokens(model, text=PROMPT):
    return len(model.tokenizer(text)["input_ids"])


def test_shapes_without_dispatch(gpt2):
    with gpt2.scan(PROMPT):
        emb = nnd.save(gpt2.transformer.wte.output.shape)
        layer = nnd.save(gpt2.transformer.h[-1].output.shape)
        vocab = nnd.save(gpt2.lm_head.output.shape[-1])
        seq = nnd.save(gpt2.transformer.h[0].output.shape[1])
    n = _n_tokens(gpt2)
    assert emb == torch.Size([1, n, 64]) and layer == torch.Size([1, n, 64])
    assert vocab == 320 and isinstance(vocab, int) and seq == n
    assert gpt2.dispatched is False


def test_broadcast_error_caught_and_right_size_passes(gpt2):
    with pytest.raises(RuntimeError) as info:
        with gpt2.scan(PROMPT):
            gpt2.transformer.h[1].output[:, -1, :] += torch.randn(1024)
    text = str(info.value)
    assert "1024" in text and "torch.randn(1024)" in text  # torch's reason and the user's line
    with gpt2.scan(PROMPT):
        gpt2.transformer.h[1].output[:, -1, :] += torch.randn(64)
        ok = nnd.save(gpt2.lm_head.output.shape)
    assert ok[-1] == 320 and not gpt2.dispatched


def test_scanned_width_builds_a_steering_vector_that_changes_the_prediction(gpt2):
    with gpt2.scan("test"):
        dim = nnd.save(gpt2.transformer.h[0].output.shape[-1])
    assert not gpt2.dispatched
    torch.manual_seed(0)
    vector = 50 * torch.randn(dim)
    with gpt2.trace(PROMPT):
        base = gpt2.lm_head.output[0, -1].argmax(-1).save()
    with gpt2.trace(PROMPT):
        gpt2.transformer.h[1].output[:, -1, :] += vector
        steered = gpt2.lm_head.output[0, -1].save()
    assert gpt2.dispatched
    assert int(steered.argmax()) != int(base)


def test_scan_on_a_dispatched_model_and_several_invokes(gpt2):
    gpt2.dispatch()
    with gpt2.scan() as tracer:
        with tracer.invoke("Hello world"):
            a = gpt2.transformer.h[0].output.save()
        with tracer.invoke(PROMPT):
            b = gpt2.transformer.h[0].output.save()
    assert gpt2.dispatched
    # invokes are batch rows, left-padded to the longest prompt
    n = max(_n_tokens(gpt2, "Hello world"), _n_tokens(gpt2))
    assert a.shape == (1, n, 64) and b.shape == (1, n, 64)
    assert a.device.type == "meta"


def test_concrete_shapes_inside_a_trace(gpt2):
    with gpt2.trace(PROMPT):
        h = gpt2.transformer.h[0].output
        shape = nnd.save(h.shape)  # a real torch.Size, mid-block (saved: only saved names outlive the block)
        noise = torch.randn(h.shape[-1])
        h[:, -1, :] += noise
        out = h.save()
    # torch.Size cannot be subclassed: mid-block shapes are tuples that print like it
    assert shape == out.shape and repr(shape).startswith("torch.Size([1, ")


def test_value_dependent_python_says_what_to_do(gpt2):
    with pytest.raises(Exception) as info:
        with gpt2.scan(PROMPT):
            if gpt2.transformer.h[0].output.sum() > 0:
                pass
    text = str(info.value)
    assert "save" in text and "torch.where" in text


def test_cli_scan_prints_every_module(daemon, tiny_models):
    path = tiny_models["gpt2"]
    daemon.cli("load", path)
    out = daemon.cli("scan", path, "Hello world").stdout
    assert "transformer.h.0" in out and "GPT2Block" in out and "[1, " in out and "float32" in out
    rows = json.loads(daemon.cli("scan", path, "Hello world", "--json").stdout)
    by_module = {r["module"]: r for r in rows}
    assert by_module["lm_head"]["output"].endswith("320] float32")
    assert len(rows) >= 20


def test_inputs_of_a_block_come_back_with_unsendable_parts_as_none(gpt2):
    """`.inputs` is (args, kwargs); a KV cache object among them cannot travel
    and arrives as None, the hidden state as a tensor."""
    with gpt2.trace(PROMPT):
        inputs = gpt2.transformer.h[0].inputs.save()
        first = gpt2.transformer.h[0].input.save()
    args, kwargs = inputs
    assert isinstance(args, tuple) and torch.equal(args[0], first)
    assert isinstance(kwargs, dict)
