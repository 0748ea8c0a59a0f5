"""One intake for every way a request arrives (daemon/intake.py): a Trace, Generate or Session, an
Interact stream's first and later messages, a stored edit; and one derivation of a run's kind."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from nnd.v1 import contract, graph_pb2, nnd_pb2
from nnd_daemon import errors, intake

LIMITS = SimpleNamespace(max_request_bytes=10_000, max_invokes=4, max_new_tokens=50)


def _request(model: str = "m", nodes: int = 1) -> nnd_pb2.TraceRequest:
    request = nnd_pb2.TraceRequest(model=model, invokes=[nnd_pb2.Invoke(text="hi")])
    for i in range(nodes):
        request.graph.nodes.add(id=i + 1, module=graph_pb2.ModuleValue(path="h.0"))
    return request


def _prepare_start(start: nnd_pb2.InteractStart, rewritten: list) -> object:
    return intake.prepare_start(start, LIMITS, rewrite=rewritten.extend, stacks=lambda ids: {})


def test_an_interact_start_is_taken_in_as_the_same_trace_or_generate_would_be():
    for generate in (False, True):
        request = _request()
        request.generate.max_new_tokens = 7 if generate else 0
        via_trace = intake.prepare(
            "Generate" if generate else "Trace", request.SerializeToString(), LIMITS, rewrite=lambda g: None,
            stacks=lambda ids: {},
        )
        rewritten: list = []
        via_start = _prepare_start(nnd_pb2.InteractStart(request=request, generate=generate), rewritten)
        assert via_start == via_trace
        assert len(rewritten) == 1
        assert intake.kind_of(via_start) == ("generate" if generate else "trace")
        assert intake.steps_of(via_start) == (7 if generate else 0)


def test_an_interact_session_is_taken_in_as_a_session_would_be():
    session = nnd_pb2.SessionRequest(model="m")
    session.traces.add(request=nnd_pb2.TraceRequest(invokes=[nnd_pb2.Invoke(text="a")]))
    session.traces.add(request=nnd_pb2.TraceRequest(invokes=[nnd_pb2.Invoke(text="b")]), generate=True)
    via_session = intake.prepare(
        "Session", session.SerializeToString(), LIMITS, rewrite=lambda g: None, stacks=lambda ids: {}
    )
    via_start = _prepare_start(nnd_pb2.InteractStart(session=session), [])
    assert via_start == via_session
    assert [t.request.model for t in via_start.session.traces] == ["m", "m"]  # the session's model filled in
    assert intake.kind_of(via_start) == intake.kind_of(nnd_pb2.InteractStart(session=session)) == "session"
    with pytest.raises(errors.InvalidArgument, match="runs no scans"):
        _prepare_start(nnd_pb2.InteractStart(session=nnd_pb2.SessionRequest(model="m", scan=True)), [])


def test_a_generate_that_names_no_length_counts_the_protocols_default_steps():
    run = intake.prepare("Generate", _request().SerializeToString(), LIMITS, rewrite=lambda g: None, stacks=dict)
    assert intake.steps_of(run) == contract.DEFAULT_MAX_NEW_TOKENS == 20


def test_a_continuation_is_held_to_the_limits_of_a_request():
    run = _prepare_start(nnd_pb2.InteractStart(request=_request()), [])
    more = nnd_pb2.InteractContinue(graph=_request(nodes=3).graph)
    rewritten: list = []
    part = intake.prepare_continue(more, more.ByteSize(), run, LIMITS, rewrite=rewritten.extend, stacks=dict)
    assert part.more == more and len(rewritten) == 1
    with pytest.raises(errors.ResourceExhausted, match="max_request_bytes=10000"):
        intake.prepare_continue(more, 10_001, run, LIMITS, rewrite=rewritten.extend, stacks=dict)
    with pytest.raises(errors.ResourceExhausted, match="max_graph_nodes"):
        huge = nnd_pb2.InteractContinue(graph=_request(nodes=intake.MAX_GRAPH_NODES + 1).graph)
        intake.prepare_continue(huge, 0, run, SimpleNamespace(max_request_bytes=0), rewrite=list, stacks=dict)
    more.traces.add(request=_request())
    with pytest.raises(errors.InvalidArgument, match="only an interactive session"):
        intake.prepare_continue(more, 0, run, LIMITS, rewrite=list, stacks=dict)


def test_a_sessions_later_traces_are_checked_and_bring_their_edits():
    session = nnd_pb2.SessionRequest(model="m")
    session.traces.add(request=_request())
    run = _prepare_start(nnd_pb2.InteractStart(session=session), [])
    more = nnd_pb2.InteractContinue()
    later = more.traces.add(request=nnd_pb2.TraceRequest(invokes=[nnd_pb2.Invoke(text="x")], edits=["e1"]))
    asked: list = []
    part = intake.prepare_continue(more, 0, run, LIMITS, rewrite=list, stacks=lambda ids: asked.extend(ids) or {})
    assert part.more.traces[0].request.model == "m" and asked == ["e1"]
    del later.request.invokes[:]
    with pytest.raises(errors.InvalidArgument, match="no input"):
        intake.prepare_continue(more, 0, run, LIMITS, rewrite=list, stacks=dict)


def _declared_depth(msg, depth: int = 1) -> int:
    """How deep `msg` nests, walking every declared field (no shortcuts): the reference for check_depth."""
    if msg.DESCRIPTOR.full_name in intake._LEAVES:
        return depth
    deepest = depth
    for fd in msg.DESCRIPTOR.fields:
        if fd.message_type is None:
            continue
        if fd.message_type.GetOptions().map_entry:
            if fd.message_type.fields_by_name["value"].message_type is not None:
                for v in getattr(msg, fd.name).values():
                    deepest = max(deepest, _declared_depth(v, depth + 2))
        elif intake._repeated(fd):
            for v in getattr(msg, fd.name):
                deepest = max(deepest, _declared_depth(v, depth + 1))
        elif msg.HasField(fd.name):
            deepest = max(deepest, _declared_depth(getattr(msg, fd.name), depth + 1))
    return deepest


def _nest(value, levels: int) -> None:
    """Make `value` (a values_pb2.Value in place: copying a deep one would hit protobuf's own parse
    depth) a list of a list ... of an int, `levels` lists deep."""
    for _ in range(levels):
        value = value.list.items.add()
    value.int = 1


@pytest.mark.parametrize("where", ["op_arg", "op_kwarg", "invoke_kwarg"])
def test_check_depth_refuses_exactly_the_requests_nested_past_the_limit(where):
    """check_depth walks only the fields a message has set: it must refuse exactly what a walk over every
    declared field finds too deep, through lists, repeated fields and maps of messages alike, also
    when it sits among shallow nodes that are big (a long source line) or small (skipped by size)."""
    seen = set()
    for levels in range(intake.MAX_DEPTH // 2 - 6, intake.MAX_DEPTH // 2 + 2):  # a list level is 2 deep
        request = nnd_pb2.TraceRequest(model="m")
        invoke = request.invokes.add(text="x")
        for i in range(20):
            shallow = request.graph.nodes.add(id=100 + i)
            shallow.op.name = "add"
            shallow.op.args.add().value.str = "s" * (400 if i % 2 else 2)
            shallow.loc.text = "x" * (400 if i % 3 else 0)
        node = request.graph.nodes.add(id=1)
        if where == "op_arg":
            node.op.name = "add"
            _nest(node.op.args.add().value, levels)
        elif where == "op_kwarg":
            node.op.name = "add"
            _nest(node.op.kwargs["x"].value, levels)
        else:
            _nest(invoke.kwargs["x"], levels)
        too_deep = _declared_depth(request) > intake.MAX_DEPTH
        seen.add(too_deep)
        if too_deep:
            with pytest.raises(errors.InvalidArgument, match="levels deep"):
                intake.check_depth(request)
        else:
            intake.check_depth(request)
    assert seen == {True, False}  # the sweep crossed the limit
