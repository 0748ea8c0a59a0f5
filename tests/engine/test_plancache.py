"""A graph shape seen before is not planned again (the sweep: one block, many prompts), and reusing a
plan never changes a result: each run matches plain PyTorch hooks."""

from __future__ import annotations

import torch
import wire_results
from graphs import Graph, N, S, idx
from reference import capture, forward
from torch.testing import assert_close

from nnd.v1 import graph_pb2, nnd_pb2
from nnd_daemon.engine import interact, plan, plancache

PROMPTS = ["The Eiffel Tower is in the city of", "Hello world", "A third prompt, longer than the others"]


def _sweep_graph() -> tuple[Graph, object]:
    g = Graph()
    h = g.module("transformer.h.1")
    g.op("setitem", g.module("transformer.h.0.mlp"), idx(S, -1, S), 0.0, text="model.transformer.h[0].mlp.output[:, -1] = 0")
    return g, g.save(g.op("mul", h, 2.0))


def test_a_repeated_graph_is_planned_once_and_each_run_is_right(gpt2):
    plancache.clear()
    got = []
    before = list(plancache.hits)
    for prompt in PROMPTS:
        g, saved = _sweep_graph()  # a fresh graph each time, as a client sends one per block
        got.append(gpt2.run(g.request(prompt))[saved.id])
    assert plancache.hits[1] - before[1] == 1  # planned once
    assert plancache.hits[0] - before[0] == len(PROMPTS) - 1  # then reused

    def zero_last(mod, args, out):
        out = out.clone()
        out[:, -1] = 0
        return out

    for prompt, value in zip(PROMPTS, got, strict=True):
        store: dict = {}
        forward(
            gpt2.model, gpt2.tokenizer, [prompt], transformer__h__0__mlp=zero_last, transformer__h__1=capture(store, "h")
        )
        assert_close(value, store["h"] * 2.0)


def test_a_tensor_constant_changed_in_place_is_planned_afresh(gpt2):
    """`c = torch.zeros(64); c += h[0, -1]`: the constant is the run's own, so every run starts from zeros."""
    plancache.clear()
    outs = []
    for _ in range(3):
        g = Graph()
        c = g.const(torch.zeros(64))
        row = g.op("getitem", g.module("transformer.h.0"), idx(0, -1))
        g.op("iadd", c, row)
        saved = g.save(c)
        outs.append(gpt2.run(g.request(PROMPTS[0]))[saved.id])
    store: dict = {}
    forward(gpt2.model, gpt2.tokenizer, [PROMPTS[0]], transformer__h__0=capture(store, "h"))
    for out in outs:
        assert_close(out, store["h"][0, -1])


def _sync_block(g: Graph) -> tuple[N, graph_pb2.Graph, N]:
    """`h0.sum().item()` at a sync point, then, after it, `h1.save()` sent as the client's next nodes."""
    total = g.op("sum", g.module("transformer.h.0"))
    later = Graph()
    later.next = 100
    saved = later.save(later.module("transformer.h.1"))
    return total, later.g, saved


def test_a_paused_run_adds_its_nodes_to_its_own_copy_of_a_cached_plan(gpt2):
    """A sync block repeated over prompts reuses its plan; the nodes each pause adds stay that run's:
    the next run (paused or not) starts from the plan as first planned."""
    plancache.clear()
    before = list(plancache.hits)
    for prompt in PROMPTS:
        g = Graph()
        total, more, saved = _sync_block(g)
        start = nnd_pb2.InteractStart(request=g.request(prompt), want=[total.id])

        def receive(_timeout: float, more: graph_pb2.Graph = more) -> nnd_pb2.InteractContinue:
            return nnd_pb2.InteractContinue(graph=more, finish=True)

        out = gpt2.stream(g.request(prompt), interaction=interact.Interaction(start, receive))
        paused = wire_results.collect(out)
        store: dict = {}
        forward(
            gpt2.model, gpt2.tokenizer, [prompt], transformer__h__0=capture(store, "h0"), transformer__h__1=capture(store, "h1")
        )
        assert_close(paused[total.id], store["h0"].sum())
        assert_close(paused[saved.id], store["h1"])
    assert plancache.hits[1] - before[1] == 1  # planned once
    assert plancache.hits[0] - before[0] == len(PROMPTS) - 1  # then reused, each run extending a copy

    g = Graph()
    _sync_block(g)
    cached = plancache.build(g.request(PROMPTS[0]).graph, gpt2.model, 1)  # as first planned: nothing added
    assert sorted(cached.nodes) == [n.id for n in g.g.nodes]
    # What the pause added was planned in the first run and shared by the others.
    assert [sorted(grown.nodes) for grown, _ in cached._extensions.values()] == [[*sorted(cached.nodes), 100, 101]]


def _paused_run(gpt2, prompt: str, later: graph_pb2.Graph) -> dict:
    """`h0.sum().item()` at a sync point, then `later` as the client's next nodes."""
    g = Graph()
    total = g.op("sum", g.module("transformer.h.0"))
    start = nnd_pb2.InteractStart(request=g.request(prompt), want=[total.id])

    def receive(_timeout: float) -> nnd_pb2.InteractContinue:
        return nnd_pb2.InteractContinue(graph=later, finish=True)

    return wire_results.collect(gpt2.stream(g.request(prompt), interaction=interact.Interaction(start, receive)))


def test_what_one_sync_point_added_never_reaches_a_run_that_added_something_else(gpt2):
    """The nodes a pause adds to a cached plan are planned once and shared by the runs that add the same
    ones; a run of the same block that adds other nodes gets its own, and each run's numbers are its own."""
    plancache.clear()
    store: dict = {}
    forward(
        gpt2.model, gpt2.tokenizer, [PROMPTS[0]], transformer__h__1=capture(store, "transformer.h.1"),
        transformer__ln_f=capture(store, "transformer.ln_f"),
    )
    for _ in range(2):
        for path, scale in (("transformer.h.1", 2.0), ("transformer.ln_f", 3.0), ("transformer.h.1", 5.0)):
            later = Graph()
            later.next = 100
            saved = later.save(later.op("mul", later.module(path), scale))
            got = _paused_run(gpt2, PROMPTS[0], later.g)
            assert len(got) == 2  # the pause's value and this run's save (another run's save has the same id)
            assert_close(got[saved.id], store[path] * scale)


def test_a_tensor_constant_added_after_a_sync_point_is_each_runs_own(gpt2):
    """`c = torch.zeros(64); c += h1[0, -1]` sent after a pause, three times: every run starts from zeros."""
    plancache.clear()
    outs = []
    for _ in range(3):
        later = Graph()
        later.next = 100
        c = later.const(torch.zeros(64))
        later.op("iadd", c, later.op("getitem", later.module("transformer.h.1"), idx(0, -1)))
        saved = later.save(c)
        outs.append(_paused_run(gpt2, PROMPTS[0], later.g)[saved.id])
    store: dict = {}
    forward(gpt2.model, gpt2.tokenizer, [PROMPTS[0]], transformer__h__1=capture(store, "h"))
    for out in outs:
        assert_close(out, store["h"][0, -1])


def test_a_block_pausing_many_times_shares_only_its_first_pauses_and_each_run_is_right(gpt2):
    """Eight sync points in a block (as a loop over steps with an `.item()` each): every value right in
    every run, and the cached plan keeps the additions of the first few pauses only (a fork per pause
    of a long generation would be kept for good otherwise)."""
    plancache.clear()
    store: dict = {}
    forward(gpt2.model, gpt2.tokenizer, [PROMPTS[0]], transformer__h__0=capture(store, "h0"))
    total_want = store["h0"].sum()
    for _ in range(2):
        g = Graph()
        total = g.op("sum", g.module("transformer.h.0"))
        request = g.request(PROMPTS[0])
        later = []
        for k in range(1, 9):
            step = Graph()
            step.next = 100 * k
            later.append((step.op("mul", total, float(k)), step.g))

        pending = iter(later)

        def receive(_timeout: float, pending=pending) -> nnd_pb2.InteractContinue:
            node, graph = next(pending, (None, None))
            if node is None:
                return nnd_pb2.InteractContinue(finish=True)
            return nnd_pb2.InteractContinue(graph=graph, want=[node.id])

        start = nnd_pb2.InteractStart(request=request, want=[total.id])
        got = wire_results.collect(gpt2.stream(request, interaction=interact.Interaction(start, receive)))
        assert_close(got[total.id], total_want)
        for k, (node, _) in enumerate(later, start=1):
            assert_close(got[node.id], total_want * k)
    shared, depth = plancache.build(request.graph, gpt2.model, 1), 0
    while shared._extensions:
        (shared, _), = shared._extensions.values()
        depth += 1
    assert depth == plan.MAX_SHARED_PAUSES < len(later)


def test_a_cached_plan_shares_a_bounded_number_of_additions_whatever_clients_send(gpt2):
    """Twenty runs of one block pausing twice, each adding something else at its second pause (a client
    varying what it sends): each run is right, and the cached plan and its shared forks keep at most
    MAX_EXTENSIONS additions in all, however they nest."""
    plancache.clear()
    store: dict = {}
    forward(gpt2.model, gpt2.tokenizer, [PROMPTS[0]], transformer__h__0=capture(store, "h0"),
            transformer__h__1=capture(store, "h1"))
    for k in range(20):
        g = Graph()
        total = g.op("sum", g.module("transformer.h.0"))
        request = g.request(PROMPTS[0])
        first = Graph()
        first.next = 100
        scaled = first.op("mul", total, float(k % 3 + 1))  # three different first additions
        second = Graph()
        second.next = 200
        saved = second.save(second.op("mul", second.module("transformer.h.1"), float(k)))  # twenty second ones
        replies = iter([
            nnd_pb2.InteractContinue(graph=first.g, want=[scaled.id]),
            nnd_pb2.InteractContinue(graph=second.g, finish=True),
        ])
        start = nnd_pb2.InteractStart(request=request, want=[total.id])
        got = wire_results.collect(
            gpt2.stream(request, interaction=interact.Interaction(start, lambda _timeout, r=replies: next(r)))
        )
        assert_close(got[scaled.id], store["h0"].sum() * (k % 3 + 1))
        assert_close(got[saved.id], store["h1"] * k)
    pending, shared = [plancache.build(request.graph, gpt2.model, 1)], 0
    while pending:
        grown = [fork for fork, _ in pending.pop()._extensions.values()]
        shared += len(grown)
        pending += grown
    assert shared == plan.MAX_EXTENSIONS
