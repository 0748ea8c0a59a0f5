"""The static hook order: certain answers only."""

from __future__ import annotations

from nnd_daemon.engine.order import POST, PRE, RESULT, after

C = {"transformer.h"}


def test_layers_in_index_order():
    assert after(("transformer.h.1", POST, 0), ("transformer.h.0", POST, 0), C)
    assert after(("transformer.h.1.mlp", PRE, 0), ("transformer.h.0.attn", POST, 0), C)
    assert not after(("transformer.h.0", POST, 0), ("transformer.h.1", PRE, 0), C)


def test_parents_children_calls_and_result():
    assert after(("transformer.h.0", POST, 0), ("transformer.h.0.mlp", POST, 0), C)
    assert not after(("transformer.h.0", PRE, 0), ("transformer.h.0.mlp", PRE, 0), C)
    assert after(("transformer.h.0.mlp", PRE, 0), ("transformer.h.0", PRE, 0), C)
    assert after(("x", POST, 0), ("x", PRE, 0), C) and not after(("x", PRE, 0), ("x", POST, 0), C)
    assert after(("transformer.h.0", PRE, 1), ("transformer.h.1", POST, 0), C)
    assert after(("", RESULT, 0), ("lm_head", POST, 3), C)


def test_unordered_siblings_are_unknown():
    assert not after(("mlp.act_fn", POST, 0), ("mlp.down_proj", PRE, 0), C)
    assert not after(("mlp.down_proj", PRE, 0), ("mlp.act_fn", POST, 0), C)
