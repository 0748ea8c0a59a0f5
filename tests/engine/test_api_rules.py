"""The rules behind the API surface of issue #27, without a daemon: which
generation settings the daemon takes (GenerationConfig's own fields, plain
data only), which `torch.nn.functional` functions a graph may call (torch's
tensor functions, no in-place variant), and which module attributes travel
(plain, bounded)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import GenerationConfig

from nnd_daemon import errors
from nnd_daemon.engine import generation, ops
from nnd_daemon.helper import attributes


def test_every_plain_generation_config_field_is_taken():
    fields = {k for k in vars(GenerationConfig()) if not k.startswith("_") and k != "transformers_version"}
    assert generation.config_fields() == fields  # read off transformers, no hand list
    taken = generation._config(json.dumps({"repetition_penalty": 1.3, "no_repeat_ngram_size": 2, "pad_token_id": 0,
                                           "bad_words_ids": [[1, 2], [3]], "eos_token_id": [4, 5]}))
    assert taken["bad_words_ids"] == [[1, 2], [3]]


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"frobnicate": 1}, "frobnicate"),
        ({"custom_generate": "someone/repo"}, "custom_generate"),  # a string names code
        ({"watermarking_config": {"greenlist_ratio": 0.5}}, "watermarking_config"),  # an object
        ({"suppress_tokens": list(range(generation.MAX_CONFIG_ITEMS + 1))}, "suppress_tokens"),
        ({"bad_words_ids": [[[1]]]}, "bad_words_ids"),  # deeper than lists of token ids
    ],
)
def test_generation_settings_that_are_not_plain_fields_are_refused(settings, named):
    with pytest.raises(errors.InvalidArgument, match=named):
        generation._config(json.dumps(settings))


def test_functional_ops_are_torch_tensor_functions_and_run_as_torch():
    names = ops.functional_names()
    for wanted in ("kl_div", "log_softmax", "cross_entropy", "cosine_similarity", "normalize", "pad", "gelu", "softmax"):
        assert wanted in names and ops.FUNCTIONAL_PREFIX + wanted in ops.TABLE
    for never in ("relu_", "has_torch_function", "handle_torch_function", "boolean_dispatch", "Tensor", "torch"):
        assert never not in names and ops.FUNCTIONAL_PREFIX + never not in ops.TABLE
    x = torch.randn(3, 5)
    run = ops.lookup("nn.functional.softmax").fn
    assert torch.equal(run(x, dim=-1, _stacklevel=5), F.softmax(x, dim=-1))  # torch's plumbing keyword dropped
    with pytest.raises(errors.InvalidArgument, match="inplace"):
        ops.lookup("nn.functional.relu").fn(x, inplace=True)
    with pytest.raises(errors.InvalidArgument, match="unknown op"):
        ops.lookup("nn.functional.__import__")


def test_module_attributes_are_plain_and_bounded():
    class Thing(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config = config
            self.head_dim = 16
            self.scaling = 0.25
            self.is_causal = True
            self.name = "attn"
            self.window = (4, 4)
            self.long = "x" * (attributes.MAX_STRING + 1)
            self.many = tuple(range(attributes.MAX_ITEMS + 1))
            self.fn = print
            self.nan = float("nan")
            self.proj = torch.nn.Linear(2, 2)
            self.register_buffer("table", torch.zeros(2))

    config = object()
    out = json.loads(attributes.of_module(Thing(config), config))
    assert out == {"config": {"$config": True}, "head_dim": 16, "scaling": 0.25, "is_causal": True, "name": "attn",
                   "window": [4, 4]}
