"""What saved results become: torch tensors (as nnsight's) unless numpy is asked for, whatever was imported.

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


def test_results_are_torch_tensors_by_default_without_the_user_importing_torch(daemon, tiny_models, expected):
    # nnsight returns torch tensors: code written for it must get them whatever it imported.
    got = _client(daemon, tiny_models)
    assert got["type"] == "torch.Tensor"
    assert got["torch_imported"]
    np.testing.assert_array_equal(np.array(got["values"], dtype=np.float32), expected.numpy().ravel())


def test_with_torch_imported_results_are_torch(daemon, tiny_models, expected):
    got = _client(daemon, tiny_models, prelude="import torch")
    assert got["type"] == "torch.Tensor"
    np.testing.assert_array_equal(np.array(got["values"], dtype=np.float32), expected.numpy().ravel())


def test_nnd_tensors_numpy_gives_numpy_and_never_imports_torch(daemon, tiny_models, expected):
    got = _client(daemon, tiny_models, env={"NND_TENSORS": "numpy"})
    assert got["type"] == "numpy.ndarray" and not got["torch_imported"]
    np.testing.assert_array_equal(np.array(got["values"], dtype=np.float32), expected.numpy().ravel())


def test_set_tensor_type_numpy_even_with_torch_imported(daemon, tiny_models, expected):
    got = _client(daemon, tiny_models, prelude="import torch", setting="nnd.set_tensor_type('numpy')")
    assert got["type"] == "numpy.ndarray"
    np.testing.assert_array_equal(np.array(got["values"], dtype=np.float32), expected.numpy().ravel())


def test_set_tensor_type_wins_over_the_environment(daemon, tiny_models, expected):
    got = _client(daemon, tiny_models, setting="nnd.set_tensor_type('torch')", env={"NND_TENSORS": "numpy"})
    assert got["type"] == "torch.Tensor"


def test_auto_follows_the_import_when_asked_for(daemon, tiny_models, expected):
    got = _client(daemon, tiny_models, setting="nnd.set_tensor_type('auto')")
    assert got["type"] == "numpy.ndarray" and not got["torch_imported"]
    got = _client(daemon, tiny_models, prelude="import torch", env={"NND_TENSORS": "auto"})
    assert got["type"] == "torch.Tensor"


def test_without_torch_installed_results_are_numpy(daemon, tiny_models, expected):
    # sys.modules["torch"] = None makes torch unimportable, as on a machine without it.
    got = _client(daemon, tiny_models, prelude="sys.modules['torch'] = None")
    assert got["type"] == "numpy.ndarray"
    np.testing.assert_array_equal(np.array(got["values"], dtype=np.float32), expected.numpy().ravel())


def test_unknown_tensor_type_is_refused():
    with pytest.raises(ValueError, match="torch, numpy, auto"):
        nnd.set_tensor_type("jax")
