"""`nnd tree` prints what `print(model)` prints: torch's repr of the module, one printer for both."""

from __future__ import annotations

import pytest
import torch
from fakedaemon import module_infos

from nnd.cli import tree


@pytest.mark.parametrize(
    "make",
    [
        lambda: __import__("transformers").GPT2LMHeadModel(
            __import__("transformers").GPT2Config(n_layer=3, n_embd=16, n_head=2, vocab_size=64)
        ),
        # Numbered children outside a ModuleList: torch lists each one (no `(0-1): 2 x`).
        lambda: torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.ModuleList(
            [torch.nn.ReLU(), torch.nn.ReLU(), torch.nn.Linear(2, 3)]
        )),
    ],
)
def test_nnd_tree_prints_torchs_repr(make):
    with torch.device("meta"):
        model = make()
    assert tree.render(module_infos(model)) == repr(model)


def test_no_root_prints_nothing():
    assert tree.render([]) == ""
