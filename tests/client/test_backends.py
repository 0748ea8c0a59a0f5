"""Each block kind runs through its backend (_backends.py), chosen when the block is created:
what reaches the (fake) daemon, and what comes back to the user's names, per kind."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fakedaemon import FakeNnd

import nnd
from nnd.tracing import _backends, _context
from nnd.tracing._tracer import GenerateTracer, Tracer
from nnd.v1 import nnd_pb2
from nnd.wire import _results


def methods(fake: tuple[FakeNnd, str]) -> list[str]:
    return [method for method, _ in fake[0].requests]


class Recording(_backends.RemoteTrace):
    """A trace backend that keeps the request its block hands over and answers every save with 7."""

    runs: list[tuple[Tracer, nnd_pb2.TraceRequest]] = []

    def run(self, tracer: Tracer) -> bool:
        request = tracer.request()
        Recording.runs.append((tracer, request))
        saves = [n.id for n in request.graph.nodes if n.WhichOneof("kind") == "save"]
        tracer.deliver(_results.Results(saved=dict.fromkeys(saves, 7)))
        return True


def test_a_trace_hands_its_request_to_the_backend_chosen_when_it_was_created(model, fake, monkeypatch):
    monkeypatch.setattr(_backends, "RemoteTrace", Recording)
    Recording.runs = []
    with model.trace("hi", keep_alive=30) as tracer:
        h = model.transformer.h[0].output.save()
    assert isinstance(tracer.backend, Recording)
    [(ran, request)] = Recording.runs
    assert ran is tracer and request.model == model.name and request.keep_alive == "30s"
    assert [n.WhichOneof("kind") for n in request.graph.nodes] == ["module", "save"]
    assert h == 7  # the exit sequence rebound the name to what the backend delivered
    assert methods(fake) == []  # the injected backend ran it: nothing reached the daemon


def test_each_block_kind_sends_its_own_rpc(model, fake):
    with model.trace("hi") as trace:
        a = model.transformer.h[0].output.save()
    with model.scan("hi") as scan:
        b = model.transformer.h[0].output.save()
    with model.generate("hi", max_new_tokens=2, min_new_tokens=2) as generate:
        c = model.transformer.h[0].output.save()
    assert [type(t.backend) for t in (trace, scan, generate)] == [
        _backends.RemoteTrace,
        _backends.Scan,
        _backends.RemoteGenerate,
    ]
    assert methods(fake) == ["Trace", "Scan", "Generate"]
    requests = [request for _, request in fake[0].requests]
    assert [r.HasField("generate") for r in requests] == [False, False, True]
    assert requests[2].generate.max_new_tokens == 2 and requests[2].generate.min_new_tokens == 2
    assert isinstance(a, torch.Tensor) and a.device.type == "cpu" and list(a.shape) == [1, 4, 16]
    from torch._subclasses.fake_tensor import FakeTensor

    assert isinstance(b, FakeTensor) and list(b.shape) == [1, 4, 16]  # the scan backend's delivery
    assert isinstance(c, torch.Tensor) and not isinstance(c, FakeTensor)


def test_generation_options_belong_to_the_generate_kind(model):
    # A trace ignores generation settings, as nnsight's trace does; a generate sends them.
    with pytest.raises(TypeError, match="nnsight option"):
        model.trace("hi", backend="ndif")  # remote= is accepted (this daemon); NDIF's backends are not
    trace = model.trace("hi", max_new_tokens=5)
    assert "max_new_tokens" not in trace.options and not trace.request().HasField("generate")
    generate = GenerateTracer(model, "hi", max_new_tokens=5, temperature=0.5, do_sample=True)
    assert generate.request().generate.temperature == pytest.approx(0.5)


def test_session_blocks_queue_into_the_session_and_run_as_one_request(model, fake):
    blocks = []  # the inner blocks' `as` names do not outlive the session (as in nnsight): keep them here
    with model.session() as session:
        assert _context.current_or_none() is None and _context.innermost_session() is session
        with model.trace("a") as first:
            assert _context.current_or_none() is first
            h = model.transformer.h[0].output
            x = h.sum(dim=-1).save()
        with model.generate("b", max_new_tokens=2) as second:
            y = (model.transformer.h[1].output + h).save()
        assert methods(fake) == []  # nothing sent until the session ends
        assert session.blocks == [first, second]
        blocks.extend([first, second])
    first, second = blocks
    assert isinstance(first.backend, _backends.SessionMember) and first.backend.session is session
    assert isinstance(first.backend.kind, _backends.RemoteTrace)
    assert isinstance(second.backend.kind, _backends.RemoteGenerate)
    [(method, request)] = fake[0].requests
    assert method == "Session" and [t.generate for t in request.traces] == [False, True]
    assert request.traces[1].request.generate.max_new_tokens == 2
    # Ids are the session's: the second block refers to the first block's node.
    ids = [{n.id for n in t.request.graph.nodes} for t in request.traces]
    assert not ids[0] & ids[1]
    assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)  # one exit sequence rebound both blocks


@pytest.mark.parametrize("block", ["scan", "edit"])
def test_a_scan_or_an_edit_cannot_join_a_session(model, fake, block):
    with model.session():
        with pytest.raises(ValueError, match=f"{'a scan' if block == 'scan' else 'an edit'} cannot be part"):
            model.scan("hi") if block == "scan" else model.edit()
        with model.trace("a"):
            model.transformer.h[0].output.save()
    assert methods(fake) == ["Session"]


def test_an_edit_is_stored_and_applies_to_the_edited_handles_later_traces(model, fake):
    with model.edit() as (tracer, edited):
        edited.transformer.h[0].output[:] = 0
    assert isinstance(tracer.backend, _backends.EditBackend)
    [(method, request)] = fake[0].requests
    assert method == "CreateEdit" and request.model == model.name and len(request.graph.nodes) > 0
    assert tracer.edit_id == "edit-1" and edited._edits == ["edit-1"]
    with edited.trace("hi"):
        model_output: Any = edited.transformer.h[1].output.save()
    with model.trace("hi"):
        model.transformer.h[1].output.save()
    assert [list(r.edits) for _, r in fake[0].requests[1:]] == [["edit-1"], []]
    assert list(model_output.shape) == [1, 4, 16]


def test_a_block_that_fails_while_recording_sends_nothing(model, fake):
    with pytest.raises(ZeroDivisionError):
        with model.trace("hi"):
            h = model.transformer.h[0].output.save()
            raise ZeroDivisionError
    with pytest.raises(nnd.ValueNotKnown, match="ZeroDivisionError inside the block"):
        h.value  # noqa: B018
    with pytest.raises(ZeroDivisionError):
        with model.session():
            with model.trace("a"):
                model.transformer.h[0].output.save()
            raise ZeroDivisionError
    assert methods(fake) == []


def test_a_session_takes_nnsights_remote_option_and_refuses_unknown_ones(model):
    """`llm.session(remote=REMOTE)` is how nnsight code opens sessions (remote=False: in process, here the
    daemon); any other unknown option is still an error naming it."""
    with model.session(remote=False):
        pass
    with pytest.raises(TypeError, match="bogus"):
        model.session(bogus=1)
