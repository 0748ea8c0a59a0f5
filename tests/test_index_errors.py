"""An index out of range inside a block raises what the line raises in-process
under nnsight 0.8.1 (and plain torch): IndexError, naming the user's line, for
a write (`h[:, seq_len] = 0`, the function-vectors tutorial's check) and a read."""

from __future__ import annotations

import pytest
import torch

import nnd

PROMPT = "The Eiffel Tower is in the city of"


@pytest.fixture(scope="module")
def gpt2(daemon, tiny_models):
    model = nnd.TransformersModel(tiny_models["gpt2"], address=daemon.address, device="cpu", dispatch=True)
    yield model
    model.release()


def _in_process(seq_len: int, write: bool) -> type[BaseException]:
    h = torch.zeros(1, seq_len, 4)
    try:
        if write:
            h[:, seq_len] = 0
        else:
            h[:, seq_len]  # noqa: B018
    except Exception as e:  # noqa: BLE001 - the type is the point
        return type(e)
    raise AssertionError("torch accepted an out-of-range index")


def test_an_out_of_range_write_is_an_index_error_naming_the_line(gpt2):
    seq_len = len(gpt2.tokenizer.encode(PROMPT))
    assert _in_process(seq_len, write=True) is IndexError
    with pytest.raises(IndexError) as info:
        with gpt2.trace(PROMPT):
            gpt2.transformer.h[-1].output[:, seq_len] = 0
            gpt2.transformer.h[-1].output.save()
    assert "output[:, seq_len] = 0" in str(info.value) and "out of bounds" in str(info.value)


def test_an_out_of_range_read_is_an_index_error_naming_the_line(gpt2):
    seq_len = len(gpt2.tokenizer.encode(PROMPT))
    assert _in_process(seq_len, write=False) is IndexError
    with pytest.raises(IndexError) as info:
        with gpt2.trace(PROMPT):
            gpt2.transformer.h[0].output[:, seq_len].save()
    assert "output[:, seq_len].save()" in str(info.value)


def test_a_slice_bound_that_is_not_an_integer_is_refused_naming_the_line(gpt2):
    # A traced bound is built into a slice on the daemon (`h[:, : h.size(1) - 1]`); a float one is refused
    # there, as Python refuses `x[: 2.5]`, with the user's line, instead of being rounded.
    with pytest.raises(nnd.InvalidRequest) as info:
        with gpt2.trace(PROMPT):
            gpt2.lm_head.output[:, :, : gpt2.transformer.h[0].output.norm()].save()
    assert "output.norm()].save()" in str(info.value) and "slice bound must be an integer" in str(info.value)
    with gpt2.trace(PROMPT):  # an integer one reads the same rows as the constant would
        h = gpt2.transformer.h[0].output
        traced = h[:, 1 : h.size(1) - 1].save()
        whole = gpt2.transformer.h[0].output.save()
    assert torch.equal(traced, whole[:, 1:-1])
