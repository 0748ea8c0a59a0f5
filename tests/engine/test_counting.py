"""The wrapper that counts every module call of a pausable run: mounted by such a run, taken off
again after a run of requests that count nothing, and exact again once a pausable run remounts it."""

from __future__ import annotations

import pytest
import torch
import wire_results
from graphs import Graph
from reference import capture, forward
from torch.testing import assert_close

from nnd.v1 import graph_pb2, nnd_pb2
from nnd_daemon import errors
from nnd_daemon.engine import hooks, interact

PROMPT = "The Eiffel Tower is in the city of"


def _paused_run(gpt2, pause_path: str, later_path: str) -> dict:
    """`pause_path`'s output summed at a sync point, then `later_path`'s output saved as the client's next
    nodes."""
    g = Graph()
    total = g.op("sum", g.module(pause_path))
    later = Graph()
    later.next = 100
    saved = later.save(later.module(later_path))
    start = nnd_pb2.InteractStart(request=g.request(PROMPT), want=[total.id])

    def receive(_timeout: float, more: graph_pb2.Graph = later.g) -> nnd_pb2.InteractContinue:
        return nnd_pb2.InteractContinue(graph=more, finish=True)

    out = gpt2.stream(g.request(PROMPT), interaction=interact.Interaction(start, receive))
    values = wire_results.collect(out)
    return {"total": values[total.id], "saved": values[saved.id]}


def _plain_run(gpt2) -> torch.Tensor:
    g = Graph()
    saved = g.save(g.module("transformer.h.0"))
    return gpt2.run(g.request(PROMPT))[saved.id]


def _mounted() -> bool:
    return bool(getattr(torch.nn.Module._call_impl, "_nnd_counter", False))


def test_the_counter_comes_off_after_runs_that_count_nothing_and_counts_exactly_once_back(gpt2, monkeypatch):
    monkeypatch.setattr(hooks, "UNMOUNT_AFTER", 3)
    store: dict = {}
    forward(gpt2.model, gpt2.tokenizer, [PROMPT], transformer__h__0=capture(store, "h0"),
            transformer__h__1=capture(store, "h1"))

    got = _paused_run(gpt2, "transformer.h.0", "transformer.h.1")
    assert _mounted()
    assert_close(got["total"], store["h0"].sum())
    assert_close(got["saved"], store["h1"])

    for i in range(3):  # plain traces: the third in a row takes the wrapper off
        assert_close(_plain_run(gpt2), store["h0"])
        assert _mounted() == (i < 2)

    # A pausable run mounts it again, and its counts are exact: block 0 ran before a pause at block 1
    # (out of order: only the counts say so), block 1 had not run at a pause at block 0.
    with pytest.raises(errors.InvalidArgument, match="already ran past"):
        _paused_run(gpt2, "transformer.h.1", "transformer.h.0")
    assert _mounted()
    got = _paused_run(gpt2, "transformer.h.0", "transformer.h.1")
    assert_close(got["saved"], store["h1"])


@pytest.mark.parametrize("own_hook", [False, True], ids=["no-hooks", "a-hook-of-its-own"])
@pytest.mark.parametrize("read_at", [hooks.LOG_READ_AT, 3], ids=["log-read-when-named", "log-read-every-few-calls"])
def test_counts_from_the_log_tell_a_running_module_from_one_that_ran(gpt2, monkeypatch, read_at, own_hook):
    """The wrapper logs calls and the counts are read from the log when a node first names a module
    (or, in a long run, every LOG_READ_AT entries): either way a module running at the pause binds its
    call now running, and one that already ran is refused. A module with no hooks when its call began
    runs torch's fast path, which never runs a post hook added meanwhile (the wrapper ends that call);
    one with a hook of its own (as libraries add) runs the new post hook itself: bound once either way."""
    monkeypatch.setattr(hooks, "LOG_READ_AT", read_at)
    store: dict = {}
    forward(gpt2.model, gpt2.tokenizer, [PROMPT], transformer__h__0=capture(store, "h0"),
            transformer__h__0__mlp=capture(store, "mlp0"), transformer__h__1=capture(store, "h1"))
    handle = gpt2.model.transformer.h[0].register_forward_hook(lambda *_: None) if own_hook else None
    try:
        # Paused inside block 0 (its MLP's output): block 0 runs still, block 1 is to come.
        got = _paused_run(gpt2, "transformer.h.0.mlp", "transformer.h.0")
        assert_close(got["total"], store["mlp0"].sum())
        assert_close(got["saved"], store["h0"])
        assert_close(_paused_run(gpt2, "transformer.h.0.mlp", "transformer.h.1")["saved"], store["h1"])
        # Block 0's attention ended before its MLP ran.
        with pytest.raises(errors.InvalidArgument, match="already ran past"):
            _paused_run(gpt2, "transformer.h.0.mlp", "transformer.h.0.attn")
    finally:
        if handle is not None:
            handle.remove()


def test_a_module_named_while_it_runs_can_have_its_output_replaced(gpt2):
    """Set after a pause inside the module: the wrapper that ends the call returns the new value, so the
    rest of the forward runs on it (checked against a plain hook that returns the same)."""
    store: dict = {}

    def halved(module, args, output):
        return output * 0.5

    forward(gpt2.model, gpt2.tokenizer, [PROMPT], transformer__h__0=halved, transformer__h__1=capture(store, "h1"))
    g = Graph()
    total = g.op("sum", g.module("transformer.h.0.mlp"))
    later = Graph()
    later.next = 100
    later.set("transformer.h.0", later.op("mul", later.module("transformer.h.0"), 0.5))
    saved = later.save(later.module("transformer.h.1"))
    start = nnd_pb2.InteractStart(request=g.request(PROMPT), want=[total.id])

    def receive(_timeout: float) -> nnd_pb2.InteractContinue:
        return nnd_pb2.InteractContinue(graph=later.g, finish=True)

    values = wire_results.collect(gpt2.stream(g.request(PROMPT), interaction=interact.Interaction(start, receive)))
    assert_close(values[saved.id], store["h1"])
