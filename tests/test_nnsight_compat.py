"""nnsight code runs unchanged: the blocks of tests/compat_blocks.py, run by
nnsight 0.8.1 (tests/support/nnsight_blocks_reference.py, in a process of its own so
its patches stay out of this one) and by nnd on the same weights, give equal
results: loops with appends over generate steps, branches on values, `.item()`,
f-strings, numpy, outer containers, `.save()` on any object, a sync inside
generation and inside a session, and an out-of-order access after a sync."""

from __future__ import annotations

import importlib.util
import os
import sys

import nnsight_blocks_reference
import numpy as np
import pytest
import torch

import nnd

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))
import compat_blocks  # noqa: E402

if importlib.util.find_spec("nnsight") is None:
    pytest.skip("nnsight 0.8.1 is not installed", allow_module_level=True)

ATOL = 1e-5


@pytest.fixture(scope="module")
def pair(daemon, tiny_models, tmp_path_factory):
    path = tiny_models["gpt2"]
    ref = nnsight_blocks_reference.results("compat_blocks", path, tmp_path_factory.mktemp("nnsight_compat"))
    ours = nnd.TransformersModel(path, address=daemon.address, device="cpu", dispatch=True)
    yield ours, ref
    ours.release()


def _equal(ours, theirs, where="result"):
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor), f"{where}: nnd gave {type(ours).__name__}, nnsight a tensor"
        torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0, msg=where)
    elif isinstance(theirs, np.ndarray):
        assert isinstance(ours, np.ndarray), f"{where}: nnd gave {type(ours).__name__}, nnsight an ndarray"
        np.testing.assert_allclose(ours, theirs, atol=ATOL, rtol=0, err_msg=where)
    elif isinstance(theirs, float):
        assert ours == pytest.approx(theirs, abs=ATOL), where
    elif isinstance(theirs, (list, tuple)):
        assert isinstance(ours, (list, tuple)) and len(ours) == len(theirs), f"{where}: {ours!r} vs {theirs!r}"
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            _equal(a, b, f"{where}[{i}]")
    elif isinstance(theirs, dict):
        assert isinstance(ours, dict) and ours.keys() == theirs.keys(), f"{where}: keys {list(ours)} vs {list(theirs)}"
        for k in theirs:
            _equal(ours[k], theirs[k], f"{where}[{k!r}]")
    else:
        assert ours == theirs, f"{where}: {ours!r} vs {theirs!r}"


@pytest.mark.parametrize("name", list(compat_blocks.BLOCKS))
def test_same_block_same_results(pair, name):
    ours, ref = pair
    theirs = ref[name]
    assert "nnsight_failed" not in theirs, f"nnsight itself failed this block: {theirs}"
    _equal(compat_blocks.BLOCKS[name](ours), theirs, name)


def test_the_out_of_order_block_does_fail(pair):
    # Equality above could hold with both sides silent; the error must be nnsight's own class.
    ours, ref = pair
    assert ref["out_of_order_after_a_sync"] == {"error": "OutOfOrderError"}
    assert compat_blocks.out_of_order_after_a_sync(ours) == {"error": "OutOfOrderError"}


def test_an_nnsight_module_moved_with_to_runs_on_the_daemon(daemon):
    # nnsight's `NNsight(net).to(device)`: the handle comes back and traces on the daemon match torch here.
    from collections import OrderedDict

    torch.manual_seed(0)
    net = torch.nn.Sequential(OrderedDict([("first", torch.nn.Linear(5, 10)), ("second", torch.nn.Linear(10, 2))]))
    wrapped = nnd.NNsight(net, address=daemon.address)
    assert wrapped.to("cpu") is wrapped
    x = torch.rand(1, 5)
    with wrapped.trace(x):
        hidden = wrapped.first.output.save()
        out = wrapped.output.save()
    with torch.no_grad():
        torch.testing.assert_close(hidden, net.first(x), atol=ATOL, rtol=0)
        torch.testing.assert_close(out, net(x), atol=ATOL, rtol=0)
