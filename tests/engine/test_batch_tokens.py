"""Many short invokes pass; the padded batch is bounded by tokens (rows x longest row), not by the
number of invokes (daemon/engine/inputs.py)."""

from __future__ import annotations

import pytest

from nnd.v1 import nnd_pb2
from nnd_daemon import errors
from nnd_daemon.engine import inputs


def _invokes(n: int, length: int) -> list[nnd_pb2.Invoke]:
    return [nnd_pb2.Invoke(tokens=nnd_pb2.TokenIds(ids=[1 + i % 7] * length)) for i in range(n)]


def test_230_short_invokes_make_one_batch(gpt2):
    batch = inputs.build(gpt2.model, gpt2.tokenizer, _invokes(230, 5), max_sequence_length=64)
    assert batch.kwargs["input_ids"].shape == (230, 5)


def test_a_batch_over_its_token_bound_is_refused(gpt2):
    rows = inputs.BATCH_TOKENS_PER_LENGTH + 1
    inputs.build(gpt2.model, gpt2.tokenizer, _invokes(rows - 1, 8), max_sequence_length=8)  # at the bound
    with pytest.raises(errors.ResourceExhausted, match="padded batch"):
        inputs.build(gpt2.model, gpt2.tokenizer, _invokes(rows, 8), max_sequence_length=8)
