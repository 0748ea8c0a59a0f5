"""A value the model computes can be one of its weights: `self.A_log.float()` of a float32 weight is the
parameter itself, an operation's input can be a module's bias, a view of a weight shares its memory.
Written in place in a trace, it would change the model every client of the daemon shares, for good
(nnsight in-process raises for a parameter that requires grad, and silently changes a buffer). nnd
refuses the write, naming the user's line and the weight, and the model stays as it was."""

from __future__ import annotations

import pathlib

import archmodels
import pytest
import tinymodels
import torch

import nnd

PROMPT = "The Eiffel Tower is in the city of"


def _logits(model: nnd.TransformersModel) -> torch.Tensor:
    with model.trace(PROMPT):
        out = model.lm_head.output.save()
    return out


@pytest.fixture(scope="module")
def mamba(daemon, tmp_path_factory: pytest.TempPathFactory) -> nnd.TransformersModel:
    path = archmodels.build_config("mamba", tmp_path_factory.mktemp("alias") / "mamba")
    model = nnd.TransformersModel(str(path), address=daemon.address, device="cpu", dispatch=True)
    yield model
    model.release()


@pytest.fixture(scope="module")
def gpt2(daemon, tmp_path_factory: pytest.TempPathFactory) -> nnd.TransformersModel:
    # A copy of its own: were the write to go through, no other test's model would change.
    path = tinymodels.build("gpt2", pathlib.Path(tmp_path_factory.mktemp("alias")) / "gpt2")
    model = nnd.TransformersModel(str(path), address=daemon.address, device="cpu", dispatch=True)
    yield model
    model.release()


def test_an_operation_that_returns_a_weight_itself_is_not_written_in_place(mamba):
    before = _logits(mamba)
    with pytest.raises(RuntimeError) as raised:
        with mamba.trace(PROMPT):
            a_log = mamba.backbone.layers[0].mixer.source.self_A_log_float_0.output
            a_log[:] = 0
    message = str(raised.value)
    assert "backbone.layers.0.mixer.A_log" in message and "a_log[:] = 0" in message
    assert torch.equal(_logits(mamba), before)  # and the model every client shares is unchanged


def test_an_operations_input_that_is_a_bias_is_not_written_in_place(gpt2):
    before = _logits(gpt2)
    with pytest.raises(RuntimeError) as raised:
        with gpt2.trace(PROMPT):
            bias = gpt2.transformer.h[0].mlp.c_fc.source.torch_addmm_0.input
            bias *= 0
    assert "transformer.h.0.mlp.c_fc.bias" in str(raised.value) and "bias *= 0" in str(raised.value)
    assert torch.equal(_logits(gpt2), before)


def test_a_copy_of_a_weight_given_to_an_operation_changes_this_trace_alone(gpt2, tmp_path):
    # What the error asks for: a copy, edited, given to the operation in place of the weight. Checked
    # against the same edit in plain PyTorch: the module's bias set in a copy of the model.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    before = _logits(gpt2)
    with gpt2.trace(PROMPT):
        op = gpt2.transformer.h[0].mlp.c_fc.source.torch_addmm_0
        bias = op.input.clone()
        bias[:] = 1  # (GPT-2 starts its biases at 0)
        op.input = bias
        edited = gpt2.lm_head.output.save()
    reference = AutoModelForCausalLM.from_pretrained(gpt2.name).eval()
    with torch.no_grad():
        reference.transformer.h[0].mlp.c_fc.bias.fill_(1)
        want = reference(**AutoTokenizer.from_pretrained(gpt2.name)(PROMPT, return_tensors="pt")).logits
    torch.testing.assert_close(edited, want, atol=1e-5, rtol=0)
    assert not torch.equal(edited, before)
    assert torch.equal(_logits(gpt2), before)
