"""Validation before anything runs, error messages that quote the client's line, and no residue."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from graphs import Graph, N, S, idx

from nnd.v1 import values_pb2
from nnd_daemon import errors, intake
from nnd_daemon.engine import EngineLimits

PROMPT = "The Eiffel Tower is in the city of"


def _logits(m) -> torch.Tensor:
    g = Graph()
    saved = g.save(g.op("getattr", g.module(""), "logits"))
    return m.run(g.request(PROMPT))[saved.id]


def _clean(model: torch.nn.Module) -> None:
    for name, mod in model.named_modules():
        assert not mod._forward_hooks and not mod._forward_pre_hooks, name
        assert "forward" not in mod.__dict__, name


def test_causality_set_names_both_lines(gpt2):
    g = Graph()
    late = g.module("transformer.h.1", line=20, text="h1 = model.transformer.h[1].output")
    g.set("transformer.h.0", late, line=21, text="model.transformer.h[0].output = h1")
    with pytest.raises(errors.InvalidArgument) as e:
        gpt2.run(g.request(PROMPT))
    assert "causality" in e.value.message
    assert "line 20" in e.value.message and "line 21" in e.value.message


def test_causality_inplace_names_both_lines(gpt2):
    g = Graph()
    h0 = g.module("transformer.h.0", line=5)
    h1 = g.module("transformer.h.1", line=6)
    g.op("iadd", h0, h1, line=7, text="model.transformer.h[0].output += h1")
    with pytest.raises(errors.InvalidArgument) as e:
        gpt2.run(g.request(PROMPT))
    assert "line 7" in e.value.message and "line 6" in e.value.message


def test_unknown_op_rejected_by_name(gpt2):
    g = Graph()
    g.save(g.op("xyz", g.module("transformer.h.0")))
    with pytest.raises(errors.InvalidArgument, match="unknown op 'xyz'"):
        gpt2.run(g.request(PROMPT))


def test_getattr_outside_allow_list(gpt2):
    g = Graph()
    g.save(g.op("getattr", g.module("transformer.h.0"), "__class__"))
    with pytest.raises(errors.InvalidArgument, match="not allowed"):
        gpt2.run(g.request(PROMPT))


def test_bad_path_not_found(gpt2):
    g = Graph()
    g.save(g.module("transformer.h.9", line=33))
    with pytest.raises(errors.NotFound) as e:
        gpt2.run(g.request(PROMPT))
    assert "transformer.h.9" in e.value.message and "line 33" in e.value.message


def test_wrong_byte_length(gpt2):
    g = Graph()
    c = g.const(torch.zeros(4))
    g.g.nodes[-1].constant.tensor.data = b"\0" * 15
    g.save(c)
    with pytest.raises(errors.InvalidArgument, match="15 bytes"):
        gpt2.run(g.request(PROMPT))


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda g: setattr(g.g.nodes[1], "id", 1), "strictly increasing"),
        (lambda g: g.g.nodes[1].save.value.__setattr__("ref", 9), "not an earlier node"),
        (lambda g: g.g.nodes[0].ClearField("module"), "no kind"),
        (lambda g: g.g.nodes[0].module.__setattr__("invoke", 3), "invoke 3 is out of range"),
        (lambda g: g.g.nodes[0].__setattr__("scope", 2), "scope 2"),
    ],
)
def test_graph_validation(gpt2, mutate, match):
    g = Graph()
    g.save(g.module("transformer.h.0"))
    mutate(g)
    with pytest.raises(errors.InvalidArgument, match=match):
        gpt2.run(g.request(PROMPT))


def test_top_level_cannot_use_loop_node(gpt2):
    g = Graph()
    scope = g.loop()
    inner = g.module("transformer.h.0", scope=scope)
    g.save(inner)  # scope 0
    with pytest.raises(errors.InvalidArgument, match="inside a loop"):
        gpt2.run(g.request(PROMPT))


def test_torch_error_quotes_line(gpt2):
    g = Graph()
    h = g.module("transformer.h.0")
    g.save(g.op("getitem", h, idx(0, 99), line=12, text="h[0, 99]"))
    with pytest.raises(errors.InvalidArgument) as e:
        gpt2.run(g.request(PROMPT))
    assert e.value.exc_type == "IndexError"
    assert e.value.message.startswith('File "nb.py", line 12, in: h[0, 99]\nIndexError: ')


def test_failed_run_leaves_model_bit_identical(gpt2):
    before = _logits(gpt2)
    g = Graph()
    g.op("setitem", g.module("transformer.h.0"), idx(S), 0.0)  # an edit that happens...
    g.skip("transformer.h.1", g.module("transformer.h.0"))
    g.op("add", g.module("transformer.h.1"), torch.zeros(3), line=9)  # ...then a failure mid-forward
    with pytest.raises(errors.InvalidArgument) as e:
        gpt2.run(g.request(PROMPT))
    assert e.value.exc_type == "RuntimeError" and "line 9" in e.value.message
    _clean(gpt2.model)
    assert torch.equal(_logits(gpt2), before)


def test_failure_in_model_forward_quotes_the_write(gpt2):
    before = _logits(gpt2)
    g = Graph()
    g.set("transformer.h.0", torch.zeros(1, 3, 7), line=44, text="model.transformer.h[0].output = bad")
    with pytest.raises(errors.InvalidArgument) as e:
        gpt2.run(g.request(PROMPT))
    assert "line 44" in e.value.message and e.value.exc_type == "RuntimeError"
    _clean(gpt2.model)
    assert torch.equal(_logits(gpt2), before)


def test_cancelled(gpt2):
    g = Graph()
    g.save(g.module("transformer.h.0"))
    with pytest.raises(errors.Cancelled):
        gpt2.run(g.request(PROMPT), cancelled=lambda: True)
    _clean(gpt2.model)


def test_never_called_module(gpt2):
    g = Graph()
    g.save(g.module("transformer.h.0", call=3, line=8))
    with pytest.raises(errors.InvalidArgument, match="called 1 time"):
        gpt2.run(g.request(PROMPT))


def test_limits(gpt2):
    g = Graph()
    g.save(g.module("transformer.h.0"))
    with pytest.raises(errors.ResourceExhausted, match="max_saved_bytes=100"):
        gpt2.run(g.request(PROMPT), limits=EngineLimits(max_saved_bytes=100))
    # The number of invokes is the request's own: checked once, before it runs (not by the engine).
    request_limits = SimpleNamespace(**{**dict.fromkeys(intake.REQUEST_LIMIT_FIELDS, 0), "max_invokes": 1})
    with pytest.raises(errors.ResourceExhausted, match="max_invokes=1"):
        intake.check(g.request(PROMPT, PROMPT), request_limits, generate=False)
    assert "max_invokes" not in intake.ENGINE_LIMIT_FIELDS
    with pytest.raises(errors.ResourceExhausted, match="max_sequence_length=3"):
        gpt2.run(g.request(PROMPT), limits=EngineLimits(max_sequence_length=3))
    g.save(g.const(torch.zeros(100)))
    with pytest.raises(errors.ResourceExhausted, match="max_constant_bytes=64"):
        gpt2.run(g.request(PROMPT), limits=EngineLimits(max_constant_bytes=64))


def test_no_invokes(gpt2):
    g = Graph()
    g.save(g.module("transformer.h.0"))
    with pytest.raises(errors.InvalidArgument, match="no invoke"):
        gpt2.run(g.request())


def test_value_kind_unset(gpt2):
    g = Graph()
    g.const(1)
    g.g.nodes[-1].constant.CopyFrom(values_pb2.Value())
    g.save(N(1))
    with pytest.raises(errors.InvalidArgument, match="no kind"):
        gpt2.run(g.request(PROMPT))


def test_sibling_order_is_not_guessed(llama):
    """Llama's MLP registers act_fn after down_proj but calls it first: a valid write must not be rejected."""
    mlp = "model.layers.0.mlp"
    g = Graph()
    act = g.module(f"{mlp}.act_fn")
    up = g.module(f"{mlp}.up_proj")
    g.set(f"{mlp}.down_proj", g.op("mul", g.op("mul", act, up), 2.0), "input")
    logits = g.save(g.op("getattr", g.module(""), "logits"))
    got = llama.run(g.request(PROMPT))[logits.id]
    down = llama.model.model.layers[0].mlp.down_proj
    handle = down.register_forward_pre_hook(lambda mod, a: (a[0] * 2,))
    try:
        with torch.no_grad():
            ref = llama.model(**llama.tokenizer(PROMPT, return_tensors="pt")).logits
    finally:
        handle.remove()
    torch.testing.assert_close(got, ref)


def test_causality_found_at_run_time(llama):
    """Siblings whose order the tree cannot tell: the write is rejected when its hook fires, with no residue."""
    before = _logits(llama)
    mlp = "model.layers.0.mlp"
    g = Graph()
    down = g.module(f"{mlp}.down_proj", line=50)
    g.set(f"{mlp}.act_fn", down, "input", line=51)
    with pytest.raises(errors.InvalidArgument) as e:
        llama.run(g.request(PROMPT))
    assert "causality" in e.value.message and "line 50" in e.value.message and "line 51" in e.value.message
    _clean(llama.model)
    assert torch.equal(_logits(llama), before)
