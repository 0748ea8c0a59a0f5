"""Ops on plain Python values (not tensors) run for real, even in a Scan: each
is bounded before it computes, so no graph freezes or exhausts the process."""

from __future__ import annotations

import pytest
import torch

from nnd_daemon import errors
from nnd_daemon.engine import ops


@pytest.mark.parametrize(
    ("name", "a", "b"),
    [
        ("pow", 2, 10**9),
        ("ipow", 10, 10**6),
        ("lshift", 1, 2**40),
        ("mul", "x", 2**33),
        ("mul", 2**33, "x"),
        ("imul", [0], 2**30),
        ("mul", 2**100, 2**40),
        ("add", "x" * 2**21, "y" * (2**21 + 1)),
        ("iadd", [0] * 2**22, [1]),
        ("mod", "%*d", (10**9, 1)),
    ],
)
def test_oversized_plain_results_are_refused_before_computing(name, a, b):
    with pytest.raises(errors.InvalidArgument, match=f"^{name}: "):
        ops.lookup(name).fn(a, b)


def test_bounded_ops_still_compute_ordinary_values():
    assert ops.lookup("pow").fn(3, 80) == 3**80
    assert ops.lookup("lshift").fn(1, 100) == 2**100
    assert ops.lookup("mul").fn("ab", 3) == "ababab"
    assert ops.lookup("add").fn([1], [2]) == [1, 2]
    assert ops.lookup("mod").fn(17, 5) == 2
    assert ops.lookup("pow").fn(2.0, 0.5) == pytest.approx(2**0.5)
    # Tensors are not plain values: their sizes are bounded elsewhere (and faked in a Scan).
    assert torch.equal(ops.lookup("mul").fn(torch.ones(2), 2**40), torch.full((2,), 2.0**40))
