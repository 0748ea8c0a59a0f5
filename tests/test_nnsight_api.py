"""The API surface of real nnsight code (issue #27): the blocks of
tests/compat_api_blocks.py give nnsight 0.8.1's results under nnd, on the same
weights; and where nnd must refuse (an unknown generate() keyword, a setting
that is not plain data), it says which."""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings

import nnsight_blocks_reference
import pytest
import torch

import nnd

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))
if importlib.util.find_spec("nnsight") is None or importlib.util.find_spec("einops") is None:
    pytest.skip("nnsight 0.8.1 and einops are needed", allow_module_level=True)

import compat_api_blocks  # noqa: E402
from test_nnsight_compat import _equal  # noqa: E402

PROMPT = compat_api_blocks.PROMPT


@pytest.fixture(scope="module")
def pair(daemon, tiny_models, tmp_path_factory):
    path = tiny_models["gpt2"]
    ref = nnsight_blocks_reference.results("compat_api_blocks", path, tmp_path_factory.mktemp("nnsight_api"))
    ours = nnd.TransformersModel(path, address=daemon.address, device="cpu", dispatch=True)
    yield ours, ref
    ours.release()


@pytest.mark.parametrize("name", list(compat_api_blocks.BLOCKS))
def test_same_block_same_results(pair, name):
    ours, ref = pair
    theirs = ref[name]
    assert "nnsight_failed" not in theirs, f"nnsight itself failed this block: {theirs}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the deprecated .all() aliases and steps never reached warn, as nnsight's
        mine = compat_api_blocks.BLOCKS[name](ours)
    _equal(mine, theirs, name)


def test_generate_keywords_change_the_generation(pair):
    # Equality with nnsight could hold with both ignoring the keyword: the penalised ids must differ.
    ours, ref = pair
    with ours.generate(PROMPT, max_new_tokens=6) as tracer:
        plain = tracer.result.save()
    assert not torch.equal(plain, ref["generate_keywords_reach_generation"]["penalised"])


def test_an_unknown_generate_keyword_is_an_error_naming_it(pair):
    ours, _ = pair
    with pytest.raises(ValueError, match="frobnicate"):  # not sent as a model input
        with ours.generate(PROMPT, max_new_tokens=2, frobnicate=3):
            pass
    with pytest.raises(ValueError, match="custom_generate"):  # a string names code: never taken
        ours.generate(PROMPT, max_new_tokens=2, custom_generate="someone/repo")
    with pytest.raises(ValueError, match="watermarking_config"):
        ours.generate(PROMPT, max_new_tokens=2, watermarking_config={"greenlist_ratio": 0.5})


def test_stream_takes_generate_keywords(pair):
    ours, ref = pair
    pad = ours.tokenizer.eos_token_id
    tokens = [t.id for t in ours.stream(PROMPT, max_new_tokens=6, repetition_penalty=1.8, no_repeat_ngram_size=2,
                                           pad_token_id=pad)]
    assert tokens == ref["generate_keywords_reach_generation"]["penalised"][0, -6:].tolist()


def test_remote_true_means_this_daemon_said_once(pair):
    ours, _ = pair
    import nnd.tracing._tracer as tracer_module

    tracer_module._remote_noted = False
    with pytest.warns(UserWarning, match="daemon"):
        with ours.trace(PROMPT, remote=True):
            a = ours.lm_head.output.save()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ours.trace(PROMPT, remote=True):
            b = ours.lm_head.output.save()
    torch.testing.assert_close(a, b)


def test_model_output_fields_read_as_attributes_not_positions(pair):
    ours, _ = pair
    out = ours(PROMPT)
    assert torch.equal(out.logits, out["logits"])
    with pytest.raises(TypeError, match="field name"):
        out[0]  # noqa: B018 - transformers' order is not on the wire: refused, not guessed
    assert ours.train() is ours and ours.eval() is ours


def test_tokenizer_kwargs_on_the_constructor_load_the_tokenizer(daemon, tiny_models):
    # nnsight's LanguageModel(..., tokenizer_kwargs=...): how the tokenizer is loaded.
    for side in ("left", "right"):
        model = nnd.TransformersModel(tiny_models["gpt2"], address=daemon.address, tokenizer_kwargs={"padding_side": side})
        assert model.tokenizer.padding_side == side
