"""What saved results become: torch tensors if the user's code imported torch, else numpy arrays.

Each case runs in a fresh process (this test process has torch imported) and
sends the result's bytes back, compared here with the same trace read as torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import nnd

PROMPT = "The Eiffel Tower is in the city of"

CLIENT = """
import json, sys
{prelude}
import nnd
{setting}
model = nnd.LanguageModel(sys.argv[1], address=sys.argv[2])
with model.trace({prompt!r}):
    h = model.transformer.h[0].output.save()
print(json.dumps({{
    "type": type(h).__module__ + "." + type(h).__name__,
    "torch_imported": "torch" in sys.modules,
    "values": (h.numpy() if hasattr(h, "numpy") else h).ravel().tolist(),
}}))
"""


@pytest.fixture(scope="module")
def expected(daemon, tiny_models):
    model = nnd.TransformersModel(tiny_models["gpt2"], address=daemon.address, device="cpu", dispatch=True)
    with model.trace(PROMPT):
        h = model.transformer.h[0].output.save()
    assert isinstance(h, torch.Tensor)  # this process imported torch
    return h


def _client(daemon, tiny_models, *, prelude="", setting="", env=None):
    code = CLIENT.format(prelude=prelude, setting=setting, prompt=PROMPT)
    out = subprocess.run(
        [sys.executable, "-c", code, tiny_models["gpt2"], daemon.address],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_without_torch_imported_results_are_numpy_and_torch_stays_unloaded(daemon, tiny_models, expected):
    got = _client(daemon, tiny_models)
    assert got["type"] == "numpy.ndarray"
    assert not got["torch_imported"]
    np.testing.assert_array_equal(np.array(got["values"], dtype=np.float32), expected.numpy().ravel())


def test_with_torch_imported_results_are_torch(daemon, tiny_models, expected):
    got = _client(daemon, tiny_models, prelude="import torch")
    assert got["type"] == "torch.Tensor"
    np.testing.assert_array_equal(np.array(got["values"], dtype=np.float32), expected.numpy().ravel())


def test_nnd_tensors_torch_imports_torch_for_results(daemon, tiny_models, expected):
    got = _client(daemon, tiny_models, env={"NND_TENSORS": "torch"})
    assert got["type"] == "torch.Tensor" and got["torch_imported"]


def test_set_tensor_type_numpy_even_with_torch_imported(daemon, tiny_models, expected):
    got = _client(daemon, tiny_models, prelude="import torch", setting="nnd.set_tensor_type('numpy')")
    assert got["type"] == "numpy.ndarray"
    np.testing.assert_array_equal(np.array(got["values"], dtype=np.float32), expected.numpy().ravel())


def test_unknown_tensor_type_is_refused():
    with pytest.raises(ValueError, match="auto, torch, numpy"):
        nnd.set_tensor_type("jax")
