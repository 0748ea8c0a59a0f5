"""`.source`: operations inside a module's forward, through a real daemon, against nnsight 0.8.1's
`.source` on the same weights (run in a subprocess: tests/nnsight_source_reference.py)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch
import warmfork
from nnsight_source_reference import PROMPT, SITES, envoy

import nnd
from nnd.v1 import graph_pb2

if importlib.util.find_spec("nnsight") is None:
    pytest.skip("nnsight 0.8.1 is not installed", allow_module_level=True)

ATOL = 1e-5


@pytest.fixture(scope="module")
def references(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("nnsight_source") / "ref.pt"
    script = os.path.join(os.path.dirname(__file__), "support", "nnsight_source_reference.py")
    models = [f"{kind}={tiny_models[kind]}" for kind in SITES]
    warmfork.run([sys.executable, script, str(out), *models], check=True, timeout=600)
    return torch.load(out)


@pytest.fixture(scope="module", params=list(SITES))
def pair(request, daemon, tiny_models, references):
    kind = request.param
    ours = nnd.TransformersModel(tiny_models[kind], address=daemon.address, device="cpu", dispatch=True)
    yield kind, ours, references[kind]
    ours.release()


def _close(a, b):
    torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def test_listing_and_printing_match_nnsight(pair):
    kind, ours, ref = pair
    attn_path, mlp_path, _, _ = SITES[kind]
    attn = envoy(ours, attn_path)
    assert list(attn.source.names) == ref["attn_names"]
    assert list(envoy(ours, mlp_path).source.names) == ref["mlp_names"]
    assert repr(attn.source) == ref["attn_repr"]
    assert repr(attn.source.attention_interface_1) == ref["op_repr"]
    assert [op.name for op in attn.source] == ref["attn_names"]
    every = {path: list(env.source.names) for path, env in ours.named_modules()}
    assert every == ref["every"]


def test_reading_operations_matches_nnsight(pair):
    kind, ours, ref = pair
    attn_path, _, _, proj = SITES[kind]
    attn = envoy(ours, attn_path)
    with ours.trace(PROMPT):
        out_attn = attn.source.attention_interface_1.output[0].save()
        proj_in = getattr(attn.source, proj).input.save()
        logits = ours.lm_head.output.save()
    _close(out_attn, ref["attention"])
    _close(proj_in, ref["proj_input"])
    _close(logits, ref["logits"])  # reading changes nothing


def test_zeroing_an_operation_in_place_matches_nnsight(pair):
    kind, ours, ref = pair
    _, mlp_path, act, _ = SITES[kind]
    with ours.trace(PROMPT):
        getattr(envoy(ours, mlp_path).source, act).output[:] = 0
        zeroed = ours.lm_head.output.save()
    assert not torch.allclose(zeroed, ref["logits"], atol=1e-3)
    _close(zeroed, ref["zeroed"])


def test_replacing_an_operations_output_and_input_matches_nnsight(pair):
    kind, ours, ref = pair
    attn_path, _, _, proj = SITES[kind]
    attn = envoy(ours, attn_path)
    with ours.trace(PROMPT):
        op = getattr(attn.source, proj)
        op.output = op.output * 0.5
        replaced = ours.lm_head.output.save()
    _close(replaced, ref["replaced"])
    with ours.trace(PROMPT):
        op = getattr(attn.source, proj)
        op.input = op.input * 2
        reinput = ours.lm_head.output.save()
    _close(reinput, ref["reinput"])
    with ours.trace(PROMPT):  # no residue: the instrumented forward left with its request
        plain = ours.lm_head.output.save()
    _close(plain, ref["logits"])


def test_skip_inputs_and_scan(pair):
    kind, ours, ref = pair
    attn_path, mlp_path, act, proj = SITES[kind]
    attn, mlp = envoy(ours, attn_path), envoy(ours, mlp_path)
    with ours.trace(PROMPT):
        args, kwargs = getattr(attn.source, proj).inputs
        first = args[0].save()
        # Skipping the activation with zeros is the in-place zeroing above, done without the call.
        activation = getattr(mlp.source, act)
        activation.skip(activation.input * 0)
        act_out = activation.output.save()
        skipped = ours.lm_head.output.save()
    _close(first, ref["proj_input"])
    assert act_out.abs().sum() == 0 and act_out.ndim == 3
    _close(skipped, ref["zeroed"])
    with ours.scan(PROMPT):
        shape = attn.source.attention_interface_1.output[0].shape.save()
    assert tuple(shape) == tuple(ref["attention"].shape)


def test_unknown_operation_names_close_ones(pair):
    kind, ours, _ = pair
    attn = envoy(ours, SITES[kind][0])
    with pytest.raises(AttributeError, match=r"attention_interface_9.*did you mean attention_interface_1"):
        attn.source.attention_interface_9  # noqa: B018
    # The daemon checks names too, for any client: a graph naming an operation the forward lacks.
    with pytest.raises(Exception, match=r"no operation 'attention_interfce_1'.*attention_interface_1") as err:
        with ours.trace(PROMPT) as tracer:
            tracer._module(attn.path, graph_pb2.OUTPUT, op="attention_interfce_1").save()
    assert "NOT_FOUND" in repr(err.value) or isinstance(err.value, AttributeError)


def test_sync_point_then_operations_and_out_of_order(pair):
    kind, ours, ref = pair
    attn_path, mlp_path, act, _ = SITES[kind]
    layers = attn_path.split(".")[:-2]  # "transformer.h" / "model.layers"
    second = envoy(ours, ".".join([*layers, "1", attn_path.split(".")[-1]]))
    with ours.trace(PROMPT):
        float(envoy(ours, ".".join([*layers, "0"])).output[0].sum())  # a sync point: the run pauses
        # Named only now, in a module the forward has not reached: instrumented mid-run.
        late = second.source.attention_interface_1.output[0].save()
    assert late.shape == ref["attention"].shape
    with pytest.raises(Exception, match="already ran past") as err:
        with ours.trace(PROMPT):
            float(envoy(ours, ".".join([*layers, "1"])).output[0].sum())
            getattr(envoy(ours, mlp_path).source, act).output.save()  # layer 0's MLP is long done
    assert type(err.value).__name__ == "OutOfOrderError"


def test_stored_edit_and_generation_steps(pair):
    kind, ours, ref = pair
    attn_path, mlp_path, act, _ = SITES[kind]
    with ours.edit() as (_, edited):
        getattr(envoy(edited, mlp_path).source, act).output[:] = 0
    with edited.trace(PROMPT):
        zeroed = edited.lm_head.output.save()
    _close(zeroed, ref["zeroed"])
    with ours.generate(PROMPT, max_new_tokens=3) as tracer:
        outs = list().save()
        for _ in tracer.iter[:]:
            outs.append(envoy(ours, attn_path).source.attention_interface_1.output[0])
    prompt_len = ref["attention"].shape[1]
    assert [o.shape[1] for o in outs] == [prompt_len, 1, 1]  # the prompt, then one token per step (KV cache)
    _close(outs[0], ref["attention"])


def test_operations_inside_a_called_function(pair):
    kind, ours, ref = pair
    attn = envoy(ours, SITES[kind][0])
    with ours.trace(PROMPT):
        inner = attn.source.attention_interface_1.source
        kernel = inner.torch_nn_functional_scaled_dot_product_attention_0.output.save()
        inner.torch_nn_functional_scaled_dot_product_attention_0.output[:] *= 0.5
        nested = ours.lm_head.output.save()
    _close(kernel, ref["kernel"])
    _close(nested, ref["nested"])
    assert not torch.allclose(nested, ref["logits"], atol=1e-3)
    with pytest.raises(Exception, match=r"no operation 'torch_nn_functional_sdpa_0'.*did you mean"):
        with ours.trace(PROMPT):
            attn.source.attention_interface_1.source.torch_nn_functional_sdpa_0.output.save()
