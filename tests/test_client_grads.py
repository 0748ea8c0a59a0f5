"""Client tensors that require grad, through the daemon's frozen model: the blocks of
tests/grad_blocks.py (probes, a DAS rotation, F.linear, an SAE, retain_grad, external tensors,
`requires_grad = True`) run by nnsight 0.8.1 (tests/grad_reference.py, in a process of its own)
and by nnd on the same weights give the same parameters after the same optimizer steps."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import nnd

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))
import grad_blocks  # noqa: E402

if importlib.util.find_spec("nnsight") is None:
    pytest.skip("nnsight 0.8.1 is not installed", allow_module_level=True)

ATOL = 1e-5


@pytest.fixture(scope="module")
def reference(tiny_models, tmp_path_factory):
    out = tmp_path_factory.mktemp("grad_reference") / "ref.pt"
    script = os.path.join(os.path.dirname(__file__), "support", "grad_reference.py")
    subprocess.run([sys.executable, script, tiny_models["gpt2"], str(out)], check=True, capture_output=True, timeout=900)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def model(daemon, tiny_models):
    ours = nnd.TransformersModel(tiny_models["gpt2"], address=daemon.address, device="cpu", dispatch=True)
    yield ours
    ours.release()


def _same(ours, theirs, where):
    assert "nnsight_failed" not in theirs, theirs
    assert ours.keys() == theirs.keys(), where
    for key, expected in theirs.items():
        got = ours[key]
        if isinstance(expected, list):
            assert got == pytest.approx(expected, abs=ATOL), f"{where}[{key}]"
        else:
            assert isinstance(got, torch.Tensor), f"{where}[{key}]: {type(got).__name__}"
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=ATOL, msg=f"{where}[{key}]")


@pytest.mark.parametrize("name", list(grad_blocks.BLOCKS))
def test_same_training_same_parameters(model, reference, name):
    _same(grad_blocks.BLOCKS[name](model), reference[name], name)


@pytest.mark.parametrize("name", list(grad_blocks.NET_BLOCKS))
def test_same_gradients_on_a_wrapped_net(daemon, reference, name):
    made = []

    def wrap(net, example):
        made.append(nnd.NNsight(net, example, address=daemon.address))
        return made[-1]

    try:
        _same(grad_blocks.NET_BLOCKS[name](wrap), reference[name], name)
    finally:
        for m in made:
            m.release()


def test_a_client_tensor_without_grad_mode_gets_no_gradient(model):
    """Under torch.no_grad the client tensor is a plain constant, as in torch: nothing attached."""
    weight = torch.randn(4, grad_blocks.WIDTH, requires_grad=True)
    with torch.no_grad():
        with model.trace(grad_blocks.PROMPT):
            y = torch.nn.functional.linear(model.transformer.h[1].output[:, -1], weight).save()
    assert y.grad_fn is None and weight.grad is None
