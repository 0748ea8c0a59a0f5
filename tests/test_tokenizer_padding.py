"""`model.tokenizer` is set up as nnsight's is: a batch a user tokenizes with `padding=True` for a
model that generates is padded on the left (as nnsight's LanguageModel pads it, and as nnd's own
invokes are), so ids built by hand mean at the last position what nnsight's do."""

from __future__ import annotations

import pytest

import nnd

pytest.importorskip("transformers")

PROMPTS = ["When John and Mary went to the shops, John gave the bag to", "Hello world"]


def test_a_causal_models_tokenizer_pads_on_the_left(daemon, tiny_models):
    from transformers import AutoTokenizer

    model = nnd.TransformersModel(tiny_models["gpt2"], address=daemon.address)
    ids = model.tokenizer(PROMPTS, return_tensors="pt", padding=True)["input_ids"]

    plain = AutoTokenizer.from_pretrained(tiny_models["gpt2"])
    plain.padding_side = "left"
    assert model.tokenizer.padding_side == "left"
    assert ids.tolist() == plain(PROMPTS, return_tensors="pt", padding=True)["input_ids"].tolist()
    assert ids[1, 0].item() == model.tokenizer.pad_token_id  # the short prompt's padding comes first
