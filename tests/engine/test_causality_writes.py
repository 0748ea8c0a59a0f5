"""A write whose value is only computed later in the same forward is a causality error naming both
lines (never a silent no-op): a slice written in place, in one invoke or across two."""

from __future__ import annotations

import pytest
from graphs import Graph, idx

from nnd_daemon import errors

PROMPT = "The Eiffel Tower is in the city of"


@pytest.mark.parametrize("invokes", [1, 2])
def test_a_slice_written_from_a_later_layer_is_refused(gpt2, invokes):
    g = Graph()
    late = g.module("transformer.h.1", invoke=0, line=30, text="late = model.transformer.h[1].output")
    part = g.op("getitem", late, idx(slice(None), 1), line=31)
    early = g.module("transformer.h.0", invoke=invokes - 1, line=31)
    g.op("setitem", early, idx(slice(None), 1), part, line=31, text="h[0].output[:, 1] = late[:, 1]")
    g.save(g.module("lm_head", invoke=invokes - 1))
    with pytest.raises(errors.InvalidArgument) as e:
        gpt2.run(g.request(*[PROMPT] * invokes))
    assert "causality" in e.value.message
    assert "line 30" in e.value.message and "line 31" in e.value.message
