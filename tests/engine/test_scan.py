"""Scan: the same graph under FakeTensorMode on the meta model — shapes and dtypes, no data."""

from __future__ import annotations

import pytest
import torch
from graphs import Graph, S, idx

from nnd_daemon import errors

PROMPT = "The Eiffel Tower is in the city of"


@pytest.mark.parametrize("kind, path", [("gpt2", "transformer.h.1"), ("llama", "model.layers.1")])
def test_scan_shapes(models, kind, path):
    m = models[kind]
    g = Graph()
    h = g.module(path)
    g.op("setitem", h, idx(S, -1, S), g.op("add", g.op("getitem", h, idx(S, -1, S)), torch.ones(64)))
    hs = g.save(h)
    shape = g.save(g.op("getattr", h, "shape"))
    logits = g.save(g.op("getattr", g.module(""), "logits"))
    lens = g.save(g.op("call_module", "lm_head", h))
    got = m.run(g.request(PROMPT, "Hello"), mode="scan")
    n = len(m.tokenizer(PROMPT)["input_ids"])
    assert got[hs.id].device.type == "meta" and got[hs.id].shape == (2, n, 64)
    assert got[hs.id].dtype == torch.float32
    assert got[shape.id] == torch.Size([2, n, 64])  # shapes are real values
    assert got[logits.id].shape == (2, n, 320)
    assert got[lens.id].shape == (2, n, 320)


def test_scan_saved_message_is_meta(gpt2):
    g = Graph()
    h = g.save(g.module("transformer.h.0"))
    msgs = gpt2.stream(g.request(PROMPT), mode="scan")
    saved = next(r.saved for r in msgs if r.WhichOneof("kind") == "saved" and r.saved.node == h.id)
    assert saved.value.tensor.meta and not saved.value.tensor.data and saved.value.tensor.device == "meta"


def test_scan_broadcast_error(gpt2):
    g = Graph()
    h = g.module("transformer.h.0")
    g.op("iadd", h, torch.ones(1024), line=3, text="model.transformer.h[0].output += v")
    with pytest.raises(errors.InvalidArgument) as e:
        gpt2.run(g.request(PROMPT), mode="scan")
    assert e.value.exc_type == "RuntimeError"
    assert "line 3" in e.value.message


def test_scan_data_dependent_op_named(gpt2):
    g = Graph()
    g.save(g.op("nonzero", g.module("transformer.h.0"), line=4))
    with pytest.raises(errors.InvalidArgument) as e:
        gpt2.run(g.request(PROMPT), mode="scan")
    assert "'nonzero'" in e.value.message and "line 4" in e.value.message


def test_scan_constants_become_fake(gpt2):
    g = Graph()
    c = g.save(g.const(torch.arange(5.0)))
    got = gpt2.run(g.request(PROMPT), mode="scan")
    assert got[c.id].device.type == "meta" and got[c.id].shape == (5,)


def test_scan_leaves_meta_model_clean(gpt2):
    g = Graph()
    g.skip("transformer.h.1", g.module("transformer.h.0"))
    g.save(g.module(""))
    gpt2.run(g.request(PROMPT), mode="scan")
    for mod in gpt2.meta.modules():
        assert not mod._forward_hooks and not mod._forward_pre_hooks and "forward" not in mod.__dict__
