"""The same interventions through nnd and through nnsight 0.8.1 on the same
local weights: the numbers must agree. nnsight runs in a subprocess
(tests/nnsight_reference.py) so its patches to torch stay out of this one."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch
import warmfork

import nnd

if importlib.util.find_spec("nnsight") is None:
    pytest.skip("nnsight 0.8.1 is not installed", allow_module_level=True)

PROMPT = "The Eiffel Tower is in the city of"
OTHER = "Hello world, this is"
ATOL = 1e-5


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def pair(request, daemon, tiny_models, tmp_path_factory):
    kind = request.param
    path = tiny_models[kind]
    out = tmp_path_factory.mktemp("nnsight") / f"{kind}.pt"
    script = os.path.join(os.path.dirname(__file__), "support", "nnsight_reference.py")
    warmfork.run([sys.executable, script, kind, path, str(out)], check=True, timeout=600)
    ref = torch.load(out)
    ours = nnd.TransformersModel(path, address=daemon.address, device="cpu", dispatch=True)
    yield kind, ours, ref
    ours.release()


def _layers(model, kind):
    return model.transformer.h if kind == "gpt2" else model.model.layers


def _close(a, b):
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_read(pair):
    kind, ours, ref = pair
    with ours.trace(PROMPT):
        a = _layers(ours, kind)[1].output.save()
        la = ours.lm_head.output.save()
    _close(a, ref["read_layer"])
    _close(la, ref["read_logits"])


def test_zero_ablation(pair):
    kind, ours, ref = pair
    with ours.trace(PROMPT):
        _layers(ours, kind)[0].output[:] = 0
        a = ours.lm_head.output.save()
    _close(a, ref["ablation"])


def test_steering(pair):
    kind, ours, ref = pair
    v = ref["steering_vector"]
    with ours.trace(PROMPT):
        _layers(ours, kind)[1].output[:, -1, :] += 4 * v
        a = ours.lm_head.output.save()
    _close(a, ref["steering"])


def test_activation_patching_across_invokes(pair):
    kind, ours, ref = pair
    with ours.trace() as tracer:
        with tracer.invoke(PROMPT):
            clean = _layers(ours, kind)[0].output[:, -1, :]
        with tracer.invoke(OTHER):
            _layers(ours, kind)[0].output[:, -1, :] = clean
            a = ours.lm_head.output[:, -1, :].save()
    _close(a, ref["patching"])


def test_logit_lens(pair):
    kind, ours, ref = pair
    norm = ours.transformer.ln_f if kind == "gpt2" else ours.model.norm
    with ours.trace(PROMPT):
        a = torch.softmax(ours.lm_head(norm(_layers(ours, kind)[0].output)), dim=-1).save()
    _close(a, ref["logit_lens"])


def test_skip(pair):
    kind, ours, ref = pair
    with ours.trace(PROMPT):
        layer = _layers(ours, kind)[1]
        layer.skip(layer.input)
        a = ours.lm_head.output.save()
    _close(a, ref["skip"])


def test_reads_in_reverse_order_match_forward_order(pair):
    """nnd takes reads in any order (nnsight needs forward order): the values
    equal nnsight's forward-order reads."""
    kind, ours, ref = pair
    with ours.trace(PROMPT):
        late = ours.lm_head.output.save()
        _layers(ours, kind)[0].output[:, -1, :] *= 2
        early = _layers(ours, kind)[0].output.save()
    _close(early, ref["reverse_early"])
    _close(late, ref["reverse_late"])


def test_stop(pair):
    kind, ours, ref = pair
    with ours.trace(PROMPT) as tracer:
        a = _layers(ours, kind)[0].output.save()
        tracer.stop()
    _close(a, ref["stop"])


def test_a_layer_edited_after_a_sync_point_inside_it(pair):
    """The layer runs still when its MLP's value reaches the client; editing the layer's output then
    changes what the next layer gets, as in nnsight."""
    kind, ours, ref = pair
    with ours.trace(PROMPT):
        seen = _layers(ours, kind)[0].mlp.output.norm().save()
        if _layers(ours, kind)[0].mlp.output.norm().item() > 0:
            _layers(ours, kind)[0].output[:] = _layers(ours, kind)[0].output * 0.5
        halved = _layers(ours, kind)[1].output.save()
    _close(seen, ref["inner_sync_norm"])
    _close(halved, ref["inner_sync_halved"])


def test_model_output_to_tuple_alone_and_per_invoke(pair):
    """`model.output.to_tuple()` gives the output's set fields, logits first, as nnsight's; per invoke
    too, where the worker holds an invoke's share of the output as a dict of its fields."""
    kind, ours, ref = pair
    with ours.trace(PROMPT):
        whole = ours.output.to_tuple()[0].save()
    with ours.trace() as tracer:
        with tracer.invoke(PROMPT):
            first = ours.output.to_tuple()[0].save()
        with tracer.invoke(PROMPT):
            second = ours.output.to_tuple()[0].save()
    for logits in (whole, first, second):
        _close(logits, ref["read_logits"])


def test_to_tuple_of_a_tensor_is_refused_naming_the_line(pair):
    """A tensor has no to_tuple: AttributeError, as in nnsight, naming the line."""
    _kind, ours, _ref = pair
    with pytest.raises(AttributeError, match="to_tuple applies to a model output") as info:
        with ours.trace(PROMPT):
            ours.lm_head.output.to_tuple().save()
    assert "lm_head.output.to_tuple()" in str(info.value)
