"""The op table: the documented names exist, and only whitelisted things run."""

from __future__ import annotations

import pytest
import torch

from nnd_daemon import errors
from nnd_daemon.engine import ATTRIBUTES, OPS, ops

DOCUMENTED = (
    "add sub mul truediv floordiv mod pow matmul neg pos abs invert and_ or_ xor lt le eq ne gt ge getitem setitem "
    "iadd isub imul itruediv ifloordiv ipow getattr softmax log_softmax argmax argmin topk max min mean sum prod norm "
    "einsum cat stack clone detach to float half bfloat16 double long int bool reshape view transpose permute squeeze "
    "unsqueeze flatten expand repeat contiguous cpu zeros_like ones_like full_like randn rand randn_like rand_like "
    "zeros ones full arange where exp log sqrt tanh sigmoid relu gelu cosine_similarity gather index_select sort "
    "argsort size item tolist dot outer cumsum var std clamp nonzero call_module"
).split()


def test_documented_ops_exist():
    assert set(DOCUMENTED) <= set(OPS)
    assert {"shape", "dtype", "T", "ndim", "device", "requires_grad", "logits"} <= set(ATTRIBUTES)


def test_reflected_and_inplace():
    x = torch.ones(3)
    assert torch.equal(ops.TABLE["sub"].fn(2, x), torch.ones(3))  # 2 - x arrives as sub(2, x)
    y = ops.TABLE["iadd"].fn(x, 1)
    assert y is x and torch.equal(x, torch.full((3,), 2.0))
    assert ops.TABLE["iadd"].mutates and ops.TABLE["getitem"].aliases


def test_functional_and_seeded():
    x = torch.randn(2, 5)
    torch.testing.assert_close(ops.TABLE["softmax"].fn(x, dim=-1), torch.softmax(x, -1))
    torch.testing.assert_close(ops.TABLE["gelu"].fn(x), torch.nn.functional.gelu(x))
    assert ops.TABLE["cosine_similarity"].fn(x, x, dim=-1).shape == (2,)
    a = ops.TABLE["randn_like"].fn(x, seed=3)
    assert torch.equal(a, ops.TABLE["randn_like"].fn(x, seed=3)) and a.shape == x.shape
    assert torch.equal(ops.TABLE["where"].fn(x > 0, x, 0.0), torch.where(x > 0, x, 0.0))


def test_getattr_allow_list():
    with pytest.raises(errors.InvalidArgument):
        ops.TABLE["getattr"].fn(torch.ones(1), "data_ptr")
    assert ops.TABLE["getattr"].fn(torch.ones(2, 3), "shape") == (2, 3)
    assert ops.TABLE["getattr"].fn({"logits": 1}, "logits") == 1


def test_unknown_op():
    with pytest.raises(errors.InvalidArgument, match="unknown op 'eval'"):
        ops.lookup("eval")
