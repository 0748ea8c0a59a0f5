"""Module parameters and buffers as values inside a block (`model.lm_head.weight`,
`embed_tokens.weight.shape[0]`, `wte.weight[tokens]`, `ln_f.weight * x`): the blocks of
tests/support/weight_blocks.py, run by nnsight 0.8.1 (in a process of its own) and by nnd on
the same weights, give equal results on GPT-2 and Llama, a scan included. Then what nnd does
on its own: the shape of a weight costs no round trip, a weight read outside the block is the
model's own inside it, assigning a parameter is refused and the shared model never changes."""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest
import torch
import warmfork

import nnd

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))
import weight_blocks  # noqa: E402

if importlib.util.find_spec("nnsight") is None:
    pytest.skip("nnsight 0.8.1 is not installed", allow_module_level=True)

ATOL = 1e-5
REFERENCE = os.path.join(os.path.dirname(__file__), "support", "nnsight_weights_reference.py")


def _reference(kind: str, path: str, folder) -> dict:
    out = folder / f"{kind}.pt"
    warmfork.run([sys.executable, REFERENCE, kind, path, str(out)], check=True, timeout=900)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def handles(daemon, tiny_models):
    made = {
        kind: nnd.TransformersModel(tiny_models[kind], address=daemon.address, device="cpu", dispatch=True)
        for kind in ("gpt2", "llama")
    }
    yield made
    for handle in made.values():
        handle.release()


@pytest.fixture(scope="module")
def references(tiny_models, tmp_path_factory):
    folder = tmp_path_factory.mktemp("nnsight_weights")
    return {kind: _reference(kind, tiny_models[kind], folder) for kind in ("gpt2", "llama")}


def _equal(ours, theirs, where="result"):
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor), f"{where}: nnd gave {type(ours).__name__}, nnsight a tensor"
        torch.testing.assert_close(ours, theirs.detach(), atol=ATOL, rtol=0, msg=where)
    elif isinstance(theirs, np.ndarray):
        np.testing.assert_allclose(ours, theirs, atol=ATOL, rtol=0, err_msg=where)
    elif isinstance(theirs, (list, tuple)):
        assert isinstance(ours, (list, tuple)) and len(ours) == len(theirs), f"{where}: {ours!r} vs {theirs!r}"
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            _equal(a, b, f"{where}[{i}]")
    elif isinstance(theirs, dict):
        assert isinstance(ours, dict) and ours.keys() == theirs.keys(), f"{where}: {ours!r} vs {theirs!r}"
        for k in theirs:
            _equal(ours[k], theirs[k], f"{where}[{k!r}]")
    else:
        assert ours == theirs and type(ours) is type(theirs), f"{where}: {ours!r} vs {theirs!r}"


BLOCKS = [("gpt2", name) for name in weight_blocks.GPT2] + [("llama", name) for name in weight_blocks.LLAMA]


@pytest.mark.parametrize(("kind", "name"), BLOCKS, ids=[name for _, name in BLOCKS])
def test_same_block_same_results(handles, references, kind, name):
    theirs = references[kind][name]
    assert "raised" not in theirs, f"nnsight itself failed this block: {theirs}"
    blocks = weight_blocks.GPT2 if kind == "gpt2" else weight_blocks.LLAMA
    _equal(blocks[name](handles[kind]), theirs, name)


def test_a_weight_shape_costs_no_round_trip(handles, monkeypatch):
    from nnd.tracing import _concrete

    model = handles["gpt2"]
    asked = []
    monkeypatch.setattr(_concrete, "scan_graph", lambda *a: asked.append(a) or pytest.fail("a scan was sent"))
    with model.trace(weight_blocks.PROMPT):
        vocab = nnd.save(model.transformer.wte.weight.shape[0])
        dtype = nnd.save(model.lm_head.weight.dtype)
        logits = model.lm_head.output.save()
    assert (vocab, dtype) == (320, torch.float32) and not asked
    assert logits.shape[-1] == vocab


def test_a_weight_read_outside_the_block_is_the_models_tensor(handles):
    # As nnsight hands out a dispatched model's parameter: shape and dtype at once, values when
    # Python computes with it (fetched once), and inside a block the model's own tensor.
    model = handles["gpt2"]
    model.__dict__.pop("_weight_values", None)
    outside = model.lm_head.weight
    assert isinstance(outside, torch.Tensor) and tuple(outside.shape) == (320, 64) and outside.dtype == torch.float32
    assert outside.shape[0] == 320 and outside.ndim == 2 and len(outside) == 320 and outside.numel() == 320 * 64
    assert not model.__dict__.get("_weight_values"), "metadata must not fetch the values"
    with model.trace(weight_blocks.PROMPT):
        h = model.transformer.ln_f.output
        direct = torch.nn.functional.linear(h, outside).save()
        through_t = (h @ outside.T).save()
        first = torch.matmul(outside, h[0, -1]).save()
        inside = model.lm_head.weight.save()
        hidden = h.save()
        logits = model.lm_head.output.save()
    assert not model.__dict__.get("_weight_values"), "inside a block the weight is the model's node, not a copy"
    torch.testing.assert_close(direct, logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(through_t, logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(first, logits[0, -1], atol=ATOL, rtol=0)
    # Outside a block: real numbers, fetched once per handle.
    torch.testing.assert_close(outside.detach().clone(), inside, atol=0, rtol=0)
    torch.testing.assert_close(hidden @ outside.T, logits, atol=ATOL, rtol=0)
    assert np.array_equal(model.transformer.wte.weight.numpy(), inside.numpy())  # tied: the same tensor
    assert len(model.__dict__["_weight_values"]) == 2


def test_assigning_a_parameter_is_refused_and_the_model_never_changes(handles):
    model = handles["gpt2"]
    with model.trace(weight_blocks.PROMPT):
        before = model.lm_head.output.save()
    with pytest.raises(RuntimeError, match="transformer.ln_f.weight.*shared"):
        with model.trace(weight_blocks.PROMPT):
            model.transformer.ln_f.weight = torch.nn.Parameter(torch.zeros(64))
    with pytest.raises(RuntimeError, match="transformer.ln_f.weight.*shared"):
        with model.trace(weight_blocks.PROMPT):
            model.transformer.ln_f.weight *= 2
    with pytest.raises(RuntimeError, match=r"test_weights_vs_nnsight.py.*\n.*weight transformer.ln_f.weight"):
        with model.trace(weight_blocks.PROMPT):
            w = model.transformer.ln_f.weight
            w *= 2  # the daemon refuses it before anything runs, naming this line
    with model.trace(weight_blocks.PROMPT):
        after = model.lm_head.output.save()
    torch.testing.assert_close(after, before, atol=0, rtol=0)


def test_a_missing_bias_is_none_and_an_unknown_name_raises(handles):
    llama = handles["llama"]
    assert llama.model.layers[0].self_attn.q_proj.bias is None
    assert "weight" in dir(llama.lm_head) and "bias" not in dir(llama.lm_head)  # tab completion
    with pytest.raises(AttributeError, match="has no module 'weights'"):
        llama.lm_head.weights  # noqa: B018


def test_weights_in_generation_steps_and_at_a_sync_point(handles):
    model = handles["gpt2"]
    lens, logits = [], []
    with model.generate(weight_blocks.PROMPT, max_new_tokens=3, min_new_tokens=3) as tracer:
        for _ in tracer.iter[0:3]:
            lens.append((model.transformer.ln_f.output[:, -1] @ model.lm_head.weight.T).save())
            logits.append(model.lm_head.output[:, -1].save())
    assert len(lens) == 3
    for a, b in zip(lens, logits, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    with model.trace(weight_blocks.PROMPT):
        one = nnd.save(model.lm_head.weight[3, 5].item())  # a sync point on a weight: no module has run yet
        whole = model.lm_head.weight.save()
        if one > 0:
            model.transformer.h[0].output[:] = 0
        zeroed = model.transformer.h[0].output.save()
    assert one == whole[3, 5].item()
    assert bool((zeroed == 0).all()) == (one > 0)


def test_the_weights_of_a_wrapped_torch_module(daemon):
    # nnsight's `NNsight(net)`: its parameters inside a block are the module's own.
    from collections import OrderedDict

    torch.manual_seed(0)
    net = torch.nn.Sequential(OrderedDict([("first", torch.nn.Linear(5, 10)), ("second", torch.nn.Linear(10, 2))]))
    wrapped = nnd.NNsight(net, address=daemon.address)
    x = torch.rand(1, 5)
    with wrapped.trace(x):
        weight = wrapped.first.weight.save()
        by_hand = (wrapped.first.input @ wrapped.first.weight.T + wrapped.first.bias).save()
        hidden = wrapped.first.output.save()
    torch.testing.assert_close(weight, net.first.weight.detach(), atol=0, rtol=0)
    torch.testing.assert_close(by_hand, hidden, atol=ATOL, rtol=0)
    torch.testing.assert_close(wrapped.second.bias + 0, net.second.bias.detach(), atol=0, rtol=0)  # outside: fetched


def test_the_shape_of_a_value_computed_from_a_weight_inside_a_trace(handles):
    model = handles["llama"]
    n = len(model.tokenizer(weight_blocks.PROMPT)["input_ids"])
    with model.trace(weight_blocks.PROMPT):
        lens = model.model.layers[0].output @ model.lm_head.weight.T
        shape = nnd.save(tuple(lens.shape))  # the helper scans a graph holding the weight's node
        kept = lens.save()
    assert shape == (1, n, 320) == tuple(kept.shape)
