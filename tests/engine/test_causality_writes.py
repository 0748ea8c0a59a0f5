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


def _late_write(g: Graph, kind: str, late, line: int) -> None:
    """Write into transformer.h.0's output, one way per `kind`, from `late` (a later layer's value)."""
    early = g.module("transformer.h.0", invoke=0, line=line)
    if kind == "set":
        g.set("transformer.h.0", late, invoke=0, line=line)
    elif kind == "skip":
        node = g.skip("transformer.h.0", late, invoke=0)
        g.g.nodes[-1].loc.line = line
        assert node is not None
    elif kind == "setitem":
        g.op("setitem", early, idx(slice(None), 1), g.op("getitem", late, idx(slice(None), 1)), line=line)
    elif kind == "iadd":
        g.op("iadd", early, late, line=line)
    elif kind == "chunk":  # a write through a view the chunk gives
        part = g.op("getitem", g.op("chunk", early, 2, -1), 0)
        g.op("setitem", part, idx(Ellipsis), 0.0, line=line)
        g.op("iadd", part, g.op("getitem", g.op("chunk", late, 2, -1), 0), line=line)


@pytest.mark.parametrize("kind", ["set", "skip", "setitem", "iadd", "chunk"])
def test_every_kind_of_write_from_a_later_value_is_refused(gpt2, kind):
    """Never a write that silently did not happen: each kind is refused, naming both lines."""
    g = Graph()
    late = g.module("transformer.h.1", invoke=0, line=40, text="late = model.transformer.h[1].output")
    _late_write(g, kind, late, 41)
    g.save(g.module("lm_head", invoke=0))
    with pytest.raises(errors.InvalidArgument) as e:
        gpt2.run(g.request(PROMPT))
    assert "causality" in e.value.message and "line 40" in e.value.message and "line 41" in e.value.message


@pytest.mark.parametrize("kind", ["set", "skip", "setitem", "iadd", "chunk"])
def test_every_kind_of_write_from_an_earlier_value_takes_effect(gpt2, kind):
    """The same writes from a value that exists in time change the result (none is dropped)."""
    plain = Graph()
    logits = plain.save(plain.module("lm_head", invoke=0))
    before = gpt2.run(plain.request(PROMPT))[logits.id]
    g = Graph()
    early = g.op("mul", g.module("transformer.wte", invoke=0, line=40), 3.0)
    _late_write(g, kind, early, 41)
    saved = g.save(g.module("lm_head", invoke=0))
    after = gpt2.run(g.request(PROMPT))[saved.id]
    assert (after - before).abs().max() > 1e-3
