"""What docs/protocol.md §8a and nnd.proto say an Interact stream's messages mean, as the engine reads
them: an empty `want` ends the run whatever `finish` says, the pause timeout's error names the
field a client sets (`pause_timeout_s`), and a value the client reads as one number (`items`) comes as
that number when its tensor has one element of a dtype a number holds exactly."""

from __future__ import annotations

import pytest
import torch
import wire_results
from graphs import Graph

from nnd.v1 import nnd_pb2
from nnd_daemon import errors
from nnd_daemon.engine import interact, wire


def test_an_empty_want_in_the_first_message_runs_to_the_end_even_without_finish():
    run = interact.Interaction(nnd_pb2.InteractStart(finish=False), receive=lambda _timeout: None)
    assert run.finished and run.want == []


def test_an_empty_want_in_a_later_message_runs_to_the_end_even_without_finish():
    later = nnd_pb2.InteractContinue(finish=False)
    run = interact.Interaction(nnd_pb2.InteractStart(want=[1]), receive=lambda _timeout: later)
    assert not run.finished
    run.wait()
    assert run.finished and run.want == []


def test_the_pause_timeout_error_names_the_field_a_client_sets():
    start = nnd_pb2.InteractStart(want=[1], pause_timeout_s=0.01)
    run = interact.Interaction(start, receive=lambda _timeout: None)
    with pytest.raises(errors.DeadlineExceeded, match=r"`pause_timeout_s`"):
        run.wait()


@pytest.mark.parametrize(
    "value, kind",
    [
        (torch.tensor(1.5, dtype=torch.bfloat16), "float"),
        (torch.tensor([[0.1]], dtype=torch.float32), "float"),
        (torch.tensor(-7, dtype=torch.int64), "int"),
        (torch.tensor([200], dtype=torch.uint8), "int"),
        (torch.tensor(True), "bool"),
        (torch.tensor([1.0, 2.0]), "tensor"),  # two elements: .item() must fail in the client, as torch's does
        (torch.tensor(1 + 2j), None),  # no number on the wire holds it: as it is (the wire then says so)
    ],
)
def test_a_value_read_as_one_number_goes_as_torchs_item_of_it(value, kind):
    run = interact.Interaction(nnd_pb2.InteractStart(want=[3, 4], items=[3]), receive=lambda _timeout: None)
    assert run.sent_as(4, value) is value  # not among `items`: the tensor as it is
    if kind is None:
        assert run.sent_as(3, value) is value
        return
    sent = wire.Encoder().value(run.sent_as(3, value))
    assert sent.WhichOneof("kind") == kind
    if kind != "tensor":
        assert getattr(sent, kind) == value.item() and type(getattr(sent, kind)) is type(value.item())


def test_a_paused_run_sends_an_item_as_a_number_and_the_rest_as_tensors(gpt2):
    g = Graph()
    h = g.module("transformer.h.0")
    total, first = g.op("sum", h), g.op("getitem", h, 0)
    request = g.request("Hello world")
    start = nnd_pb2.InteractStart(request=request, want=[total.id, first.id], items=[total.id, first.id])
    done = nnd_pb2.InteractContinue(finish=True)
    out = gpt2.stream(request, interaction=interact.Interaction(start, receive=lambda _timeout: done))
    sent = {m.saved.node: m.saved.value for m in out if m.WhichOneof("kind") == "saved"}
    assert sent[total.id].WhichOneof("kind") == "float"
    assert sent[first.id].WhichOneof("kind") == "tensor"  # (seq, width): not one element
    got = wire_results.collect(out)
    assert got[total.id] == pytest.approx(got[first.id].sum().item(), rel=1e-5)
