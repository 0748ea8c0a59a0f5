"""Only saved values leave a block, as in nnsight 0.8.1: after the outermost
block a name its body bound without `.save()` is unbound (NameError) if it did
not exist before, or holds its value from before the block; a saved name holds
its value. The blocks of tests/support/unsaved_blocks.py (functions, loops,
tuple unpacking, attribute and item targets, invoke targets, `del`, a failed
block, a session, a generate loop, a notebook-like cell run in a globals dict)
are run by nnsight 0.8.1 in a process of its own and by nnd, and must leave
the same names behind."""

from __future__ import annotations

import importlib.util
import os
import sys

import nnsight_blocks_reference
import pytest
import torch

import nnd

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))
import unsaved_blocks  # noqa: E402

if importlib.util.find_spec("nnsight") is None:
    pytest.skip("nnsight 0.8.1 is not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def pair(daemon, tiny_models, tmp_path_factory):
    path = tiny_models["gpt2"]
    ref = nnsight_blocks_reference.results("unsaved_blocks", path, tmp_path_factory.mktemp("nnsight_unsaved"))
    ours = nnd.TransformersModel(path, address=daemon.address, device="cpu", dispatch=True)
    yield ours, ref
    ours.release()


@pytest.mark.parametrize("name", list(unsaved_blocks.BLOCKS))
def test_the_same_names_are_left_after_the_block(pair, name):
    ours, ref = pair
    theirs = ref[name]
    assert "nnsight_failed" not in theirs, f"nnsight itself failed this block: {theirs}"
    found = unsaved_blocks.BLOCKS[name](ours)
    assert found.keys() == theirs.keys()
    for key, value in theirs.items():
        if isinstance(value, float):
            assert found[key] == pytest.approx(value, abs=1e-5), key
        else:
            assert found[key] == value, f"{name}: {key} is {found[key]!r} under nnd, {value!r} under nnsight"


def test_a_block_whose_source_is_unknown_still_keeps_only_saved_names(daemon, tiny_models):
    # exec of a string not in linecache: nnsight refuses it (no source); nnd compares the whole namespace.
    model = nnd.TransformersModel(tiny_models["gpt2"], address=daemon.address, device="cpu", dispatch=True)
    code = (
        "with model.trace('hello'):\n"
        "    fresh = model.transformer.h[0].output\n"
        "    old = model.transformer.h[0].output\n"
        "    kept = model.transformer.h[1].output.save()\n"
    )
    scope = {"model": model, "old": "before"}
    exec(compile(code, "<no source>", "exec"), scope)  # noqa: S102
    assert "fresh" not in scope
    assert scope["old"] == "before"
    assert isinstance(scope["kept"], torch.Tensor)
    assert scope["model"] is model
