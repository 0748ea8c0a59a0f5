"""Concrete shapes while recording: scan what has been recorded so far.

`proxy.shape` inside a block asks the daemon to Scan the graph so far plus a
save of that proxy (on the META model: no weights, no dispatch). Answers are
cached per model by the proxy's structural key, the writes recorded before it
and the inputs, so reading the same shape again costs nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from nnd.v1 import graph_pb2, nnd_pb2
from nnd.wire import _results

if TYPE_CHECKING:
    from nnd.tracing._proxy import Proxy
    from nnd.tracing._tracer import Tracer

_CACHE_SIZE = 512


class ShapeCache:
    """A small LRU of scanned values, one per model handle."""

    def __init__(self) -> None:
        self._items: OrderedDict[Hashable, Any] = OrderedDict()

    def get(self, key: Hashable) -> Any:
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        return None

    def put(self, key: Hashable, value: Any) -> None:
        self._items[key] = value
        if len(self._items) > _CACHE_SIZE:
            self._items.popitem(last=False)


def scan_graph(graph: graph_pb2.Graph, target: int) -> tuple[graph_pb2.Graph, int]:
    """The graph a shape query sends: every node but the saves, flattened to
    one forward (a Scan has no generation steps, so loop bodies are scanned as
    at the first step), plus a save of `target`."""
    out = graph_pb2.Graph()
    for node in graph.nodes:
        if node.WhichOneof("kind") == "save":
            continue
        copy = out.nodes.add()
        copy.CopyFrom(node)
        copy.scope = 0
    save = out.nodes.add()
    save.id = max((n.id for n in graph.nodes), default=target) + 1
    save.save.value.ref = target
    return out, save.id


def from_the_run(tracer: Tracer) -> bool:
    """Whether a shape read in this block must come from the run itself (a sync point) rather than a scan.
    A scan runs one plain forward of the prompt; a generation's forwards differ: each step after the first
    sees one new token per row, transformers computes the logits of the last position only
    (`logits_to_keep`), and beam search multiplies the rows. Only the run knows those shapes."""
    return bool(tracer.backend.generates)


def query(tracer: Tracer, proxy: Proxy) -> Any:
    """The scanned value of `proxy`: a MetaTensor, or a tuple/list/dict of them."""
    ref = proxy._ref()
    builder = tracer._builder
    known = builder.known.get(ref)
    if known is not None:
        return known
    if not tracer._invokes:
        raise ValueError("a shape is known only once the trace has an input; read it inside `tracer.invoke(...)`")
    invokes = tuple(i.SerializeToString(deterministic=True) for i in tracer._invokes)
    session = tracer.backend.session
    # In a session the graph may use values of earlier blocks: scan them too (they are fixed once closed).
    context = (id(session), len(session.blocks)) if session is not None else None
    key = (invokes, builder.keys[ref], tuple(builder.writes), tuple(tracer.model._edits), context)
    cache = tracer.model._shape_cache
    hit = cache.get(key)
    if hit is not None:
        return hit
    graph, save_id = scan_graph(builder.graph, ref)
    request = nnd_pb2.TraceRequest(model=tracer.model.name, invokes=tracer._invokes, graph=graph)
    request.edits.extend(tracer.model._edits)
    if session is not None:
        stream = tracer.model._conn.stream("Session", session.request(scan_tail=request))
    else:
        stream = tracer.model._conn.stream("Scan", request)
    try:
        results = _results.collect(stream, use_torch=False)
    except Exception:
        # The value asked about cannot exist (a module that never runs, a shape error): forget it and what was
        # built on it, so the rest of the block, and its exit, go on as if it had never been recorded.
        builder.discard(ref)
        raise
    if save_id not in results.saved:
        raise RuntimeError("the daemon's scan returned no value for this shape query")
    value = results.saved[save_id]
    cache.put(key, value)
    return value
