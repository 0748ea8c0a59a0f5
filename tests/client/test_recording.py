"""The graph a block records, checked against the request the (fake) daemon receives."""

from __future__ import annotations

import pytest
import torch
from fakedaemon import FakeNnd

import nnd
from nnd.v1 import graph_pb2, nnd_pb2


def last(fake: tuple[FakeNnd, str], method: str = "Trace") -> nnd_pb2.TraceRequest:
    service, _ = fake
    for got, request in reversed(service.requests):
        if got == method:
            return request
    raise AssertionError(f"no {method} request")


def kind(node: graph_pb2.Node) -> str:
    return node.WhichOneof("kind")


def ops(graph: graph_pb2.Graph) -> list[str]:
    return [n.op.name for n in graph.nodes if kind(n) == "op"]


def value_of(arg: graph_pb2.Arg):
    from nnd.wire import _codec

    return _codec.Decoder().value(arg.value)


def test_steering_records_getitem_iadd_setitem(model, fake):
    v = torch.ones(16)
    with model.trace("The Eiffel Tower is in"):
        model.transformer.h[2].output[:, -1, :] += v
    g = last(fake).graph
    mv, get, add, put = g.nodes
    assert kind(mv) == "module"
    assert (mv.module.path, mv.module.point, mv.module.invoke, mv.module.call) == (
        "transformer.h.2",
        graph_pb2.OUTPUT,
        0,
        0,
    )
    assert [get.op.name, add.op.name, put.op.name] == ["getitem", "iadd", "setitem"]
    index = (slice(None), -1, slice(None))
    assert get.op.args[0].ref == mv.id and value_of(get.op.args[1]) == index
    assert add.op.args[0].ref == get.id and torch.equal(value_of(add.op.args[1]), v)
    assert put.op.args[0].ref == mv.id and value_of(put.op.args[1]) == index and put.op.args[2].ref == add.id
    assert last(fake).invokes[0].text == "The Eiffel Tower is in"


def test_whole_output_inplace_records_a_set(model, fake):
    with model.trace("hi"):
        model.transformer.h[0].output += 1
    g = last(fake).graph
    assert [kind(n) for n in g.nodes] == ["module", "op", "set"]
    assert g.nodes[1].op.name == "iadd"
    assert g.nodes[2].set.target.path == "transformer.h.0" and g.nodes[2].set.value.ref == 2


def test_reflected_and_unary_ops(model, fake):
    with model.trace("hi"):
        x = model.lm_head.output
        _ = 2 * x
        _ = 1 - x
        _ = x / 4
        _ = -x
        _ = x @ x
        _ = x > 0
        _ = abs(x)
        _ = ~(x == 1)
    g = last(fake).graph
    assert ops(g) == ["mul", "sub", "truediv", "neg", "matmul", "gt", "abs", "eq", "invert"]
    mul, sub = g.nodes[1], g.nodes[2]
    assert value_of(mul.op.args[0]) == 2 and mul.op.args[1].ref == 1
    assert value_of(sub.op.args[0]) == 1 and sub.op.args[1].ref == 1


def test_torch_functions_and_methods(model, fake):
    with model.trace("hi"):
        p = model.lm_head.output
        q = model.transformer.h[0].output
        torch.softmax(p, -1)
        torch.nn.functional.softmax(p, dim=-1)
        torch.cat([p, q], dim=0)
        torch.ones(16) + p
        p.sum(dim=-1)
        p.logits  # noqa: B018
        p.argmax(-1).float()
    g = last(fake).graph
    # torch.nn.functional is its own namespace of ops: F.softmax passes keywords Tensor.softmax lacks.
    assert ops(g) == ["softmax", "nn.functional.softmax", "cat", "add", "sum", "argmax", "float"]
    by_name = {n.op.name: n for n in g.nodes if kind(n) == "op"}
    cat = by_name["cat"]
    assert [a.ref for a in cat.op.args[0].list.items] == [1, 2] and value_of(cat.op.kwargs["dim"]) == 0
    add = by_name["add"]
    assert torch.equal(value_of(add.op.args[0]), torch.ones(16)) and add.op.args[1].ref == 1
    assert value_of(by_name["sum"].op.kwargs["dim"]) == -1
    # an attribute that is never used records nothing; `.logits` was not used


def test_getattr_recorded_when_used(model, fake):
    with model.trace("hi"):
        logits = model.output.logits.save()
        t = model.lm_head.output.T
        t + 1
    g = last(fake).graph
    getattrs = [n for n in g.nodes if kind(n) == "op" and n.op.name == "getattr"]
    assert [value_of(n.op.args[1]) for n in getattrs] == ["logits", "T"]
    assert g.nodes[0].module.path == "" and g.nodes[0].module.point == graph_pb2.OUTPUT
    assert isinstance(logits, torch.Tensor)


def test_every_output_access_is_a_fresh_node(model, fake):
    with model.trace("hi"):
        model.lm_head.output.save()
        model.lm_head.output.save()
    g = last(fake).graph
    modules = [n for n in g.nodes if kind(n) == "module"]
    assert len(modules) == 2 and modules[0].id != modules[1].id


def test_invokes_and_rows(model, fake):
    with model.trace() as tracer:
        with tracer.invoke("first"):
            a = model.transformer.h[0].output.save()
        with tracer.invoke([1, 2, 3]):
            model.transformer.h[0].output[:] = a
        everything = model.lm_head.output.save()
    req = last(fake)
    assert req.invokes[0].text == "first" and list(req.invokes[1].tokens.ids) == [1, 2, 3]
    modules = [n.module for n in req.graph.nodes if kind(n) == "module"]
    assert [m.invoke if m.HasField("invoke") else None for m in modules] == [0, 1, None]
    assert everything is not None


def test_batch_at_once_is_all_rows(model, fake):
    with model.trace(["a", "b"]):
        model.lm_head.output.save()
    req = last(fake)
    assert [i.text for i in req.invokes] == ["a", "b"]
    assert not req.graph.nodes[0].module.HasField("invoke")


def test_tensor_of_ids_input(model, fake):
    with model.trace(torch.tensor([[5, 6, 7]])):
        pass
    assert list(last(fake).invokes[0].tokens.ids) == [5, 6, 7]


def test_effects_result_stop_and_call_module(model, fake):
    seen = []
    keep = seen.append  # the test reads the unsaved proxy's node after the block, where its name is gone
    with model.trace("hi") as tracer:
        h = model.transformer.h[1].output
        keep(h)
        model.lm_head(h).save()
        model.transformer.h[0].mlp.skip(h)
        model.transformer.h[0].attn.output = h * 0
        tracer.result.save()
        tracer.stop()
    g = last(fake).graph
    [h] = seen
    call = next(n for n in g.nodes if kind(n) == "op" and n.op.name == "call_module")
    assert value_of(call.op.args[0]) == "lm_head" and call.op.args[1].ref == h._node
    skip = next(n for n in g.nodes if kind(n) == "skip")
    assert skip.skip.target.path == "transformer.h.0.mlp" and skip.skip.value.ref == h._node
    assert next(n for n in g.nodes if kind(n) == "set").set.target.path == "transformer.h.0.attn"
    result = next(n for n in g.nodes if kind(n) == "module" and n.module.point == graph_pb2.RESULT)
    # The result belongs to the block's invoke, like its module values (one prompt: every row).
    assert result.module.path == "" and result.module.invoke == 0
    assert kind(g.nodes[-1]) == "stop"


def test_source_locations_point_at_this_file(model, fake):
    with model.trace("hi"):
        y = torch.nn.functional.gelu(model.lm_head.output)  # the line
        y.save()
    g = last(fake).graph
    gelu = next(n for n in g.nodes if kind(n) == "op")
    assert gelu.loc.file == __file__
    assert gelu.loc.text == "y = torch.nn.functional.gelu(model.lm_head.output)  # the line"
    assert all(n.loc.file == __file__ for n in g.nodes)
    assert g.nodes[-1].loc.line == gelu.loc.line + 1


def test_values_are_not_known_in_a_scan(model, fake):
    # In a trace a real value is a sync point (tests/test_sync.py); a scan runs on fake tensors.
    with pytest.raises(nnd.ValueNotKnown, match="not known while recording"):
        with model.scan("hi"):
            if model.lm_head.output.sum() > 0:
                pass


def test_outside_a_block(model):
    with pytest.raises(nnd.OutsideTrace, match="inside a `with model.trace"):
        model.lm_head.output  # noqa: B018


def test_a_failed_block_sends_nothing(model, fake):
    with pytest.raises(ZeroDivisionError):
        with model.trace("hi"):
            model.lm_head.output.save()
            1 / 0  # noqa: B018
    assert fake[0].requests == []


def test_nnd_save_of_a_constant(model, fake):
    with model.trace("hi"):
        n = nnd.save(7)
    assert n == 7
    save = last(fake).graph.nodes[-1]
    assert kind(save) == "save" and value_of(save.save.value) == 7


def test_proxy_after_block_computes_on_its_value(model, fake):

    seen: list = []
    keep = seen.append  # a place nnd does not look into after the block: the proxy stays a proxy there
    with model.trace("hi"):
        keep(model.lm_head.output.save())
    [proxy] = seen
    assert isinstance(proxy, nnd.Proxy) and isinstance(proxy.value, torch.Tensor)
    assert torch.equal(proxy + 1, proxy.value + 1)
    assert proxy.shape == (1, 4, 16) and proxy.sum().item() == 0.0


def test_unknown_block_options_are_refused(model):
    with pytest.raises(TypeError, match="blocking"):
        model.trace("hi", blocking=False)  # NDIF's execution options; remote= itself means this daemon
    model.trace("hi", max_new_tokens=3)  # nnsight's trace takes generation settings and ignores them
    with model.generate("hi", max_new_tokens=3, keep_alive="5m"):
        pass


def test_saved_values_in_lists_dicts_and_tuples_are_rebound(model, fake):
    with model.trace("hi"):
        # Containers made in the block are saved too, or their names do not outlive it (as in nnsight).
        layers = [model.transformer.h[i].output.save() for i in range(2)].save()
        named = {"head": model.lm_head.output.save()}.save()
        pair = (model.transformer.h[0].output.save(), 3).save()
    assert all(isinstance(x, torch.Tensor) for x in layers)
    assert isinstance(named["head"], torch.Tensor)
    assert isinstance(pair, tuple) and isinstance(pair[0], torch.Tensor) and pair[1] == 3


def test_equal_constants_of_other_types_record_their_own_values(model, fake):
    """A loop records the same constants every iteration (encoded once per process): constants that compare
    equal but encode differently stay apart, and a repeated one records the same value each time."""
    consts = [True, 1, 1.0, 0.0, -0.0, (slice(None), -1), (slice(None), True), [1, 2], (1, 2), "a", None, ...]
    with model.trace("hi"):
        for _ in range(2):
            for c in consts:
                model.transformer.h[0].output.add(c)
    args = [n.op.args[1] for n in last(fake).graph.nodes if kind(n) == "op"]
    assert len(args) == 2 * len(consts)
    got = [value_of(a) for a in args]
    for want, seen in zip(consts * 2, got, strict=True):
        assert type(seen) is type(want) and seen == want, (want, seen)
        if isinstance(want, float):
            assert str(seen) == str(want)  # -0.0 stays negative
        if isinstance(want, tuple):
            assert [type(v) for v in seen] == [type(v) for v in want]
