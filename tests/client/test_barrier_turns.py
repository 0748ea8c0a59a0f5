"""`tracer.barrier(n)`: invoke bodies take turns as nnsight's invoke threads do (_interleave.py).
What the recorded graph says: each invoke's write names the value the other invoke bound for that
layer, a body's loop variable stays its own, and a barrier short of participants is an error."""

from __future__ import annotations

import pytest


def _request(service):
    return next(r for method, r in reversed(service.requests) if method == "Trace")


def _module_path(request, node_id):
    nodes = {n.id: n for n in request.graph.nodes}
    node = nodes[node_id]
    while node.WhichOneof("kind") != "module":
        node = nodes[node.op.args[0].ref]
    return node.module.path, node.module.invoke


def test_each_turn_patches_with_that_layers_value(model, fake):
    service, _ = fake
    with model.trace() as tracer:
        barrier = tracer.barrier(2)
        with tracer.invoke("a b c"):
            for layer in range(3):
                clean = model.transformer.h[layer].output
                barrier()
        with tracer.invoke("d e f"):
            for layer in range(3):
                barrier()
                model.transformer.h[layer].output = clean
    # As in nnsight, the names the bodies bound without .save() do not outlive the block.
    assert "layer" not in locals() and "clean" not in locals()
    request = _request(service)
    sets = [n for n in request.graph.nodes if n.WhichOneof("kind") == "set"]
    assert [(s.set.target.path, s.set.target.invoke) for s in sets] == [(f"transformer.h.{i}", 1) for i in range(3)]
    assert [_module_path(request, s.set.value.ref) for s in sets] == [(f"transformer.h.{i}", 0) for i in range(3)]


def test_a_barrier_short_of_participants_fails(model):
    with pytest.raises(ValueError, match="barrier"):
        with model.trace() as tracer:
            barrier = tracer.barrier(3)
            with tracer.invoke("a b c"):
                model.transformer.h[0].output.save()
                barrier()
            with tracer.invoke("d e f"):
                barrier()
                model.transformer.h[0].output.save()


def test_a_failed_barrier_leaves_no_block_open(model):
    from nnd.tracing import _context

    with pytest.raises(ValueError):
        with model.trace() as tracer:
            barrier = tracer.barrier(2)
            with tracer.invoke("a b c"):
                barrier()
    assert _context.current_or_none() is None and not hasattr([], "save")
