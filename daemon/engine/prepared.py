"""A trace request as an object the engine can merge with others and split back, in the
manner of text-generation-inference's `Batch.from_pb` / `concatenate` (TGI's `filter` has no
counterpart: the batcher drops a request that leaves before it merges the others).

`PreparedTrace.from_pb` reads a TraceRequest once: each invoke's token ids (text tokenized
as the engine tokenizes it), its graph (nodes and loop scopes). `concatenate` merges several
into one whose invokes are all of theirs: each part's node ids, invoke indices and scopes move
past those of the parts before it (nodeids.shift, the one list of the fields that hold them).
`split` is the inverse on the merged run's responses: a Saved message goes to the part that
owns its node (id moved back), the blob ids inside it are renumbered per part (1, 2, ... as the
engine numbers them for a request alone), and each Chunk follows the blob it carries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nnd.v1 import graph_pb2, nnd_pb2, values_pb2

from . import inputs, nodeids

MAX_ID = 2**32 - 1  # node ids are uint32 on the wire


class Unmergeable(ValueError):
    """The request cannot be part of a merged one (an input other than text or token ids, ids that do not fit)."""


@dataclass(frozen=True)
class Part:
    """Where one original request sits in a (merged) request."""

    at: nodeids.Offsets  # its first node id, first invoke, first scope
    end: int  # one past its last node id, as numbered in the merged request
    invokes: int  # how many invokes it has


@dataclass
class PreparedTrace:
    """One request, or several merged into one: what the engine runs, and where each part sits."""

    model: str
    tokens: list[tuple[int, ...]]  # each invoke's token ids
    graph: graph_pb2.Graph
    parts: list[Part]  # one per original request, in order

    @classmethod
    def from_pb(cls, request: nnd_pb2.TraceRequest, tokenizer: object) -> PreparedTrace:
        """`request`'s inputs as token ids, and its graph; Unmergeable if an input is not text or token ids."""
        tokens: list[tuple[int, ...]] = []
        for inv in request.invokes:
            which = inv.WhichOneof("input")
            if inv.args or inv.kwargs:  # tensors, keyword inputs (T5's decoder_input_ids)
                raise Unmergeable("an invoke has tensor or keyword inputs")
            if which == "tokens":
                tokens.append(tuple(int(i) for i in inv.tokens.ids))
            elif which == "text" and tokenizer is not None:
                tokens.append(tuple(inputs.text_ids(tokenizer, inv.text)))
            else:
                raise Unmergeable(f"an invoke's input is {which!r}, not text or token ids")
        end = max((n.id for n in request.graph.nodes), default=-1) + 1
        return cls(request.model, tokens, request.graph, [Part(nodeids.Offsets(), end, len(tokens))])

    @property
    def end(self) -> int:
        """One past the largest node id."""
        return self.parts[-1].end if self.parts else 0

    @property
    def length(self) -> int | None:
        """The tokenized length every invoke has; None if they differ (or one is empty)."""
        lengths = {len(t) for t in self.tokens}
        return next(iter(lengths)) if len(lengths) == 1 and 0 not in lengths else None

    @classmethod
    def concatenate(cls, traces: Sequence[PreparedTrace]) -> PreparedTrace:
        """One request holding every trace's invokes and graph, in order; Unmergeable if the ids would not fit."""
        graph = graph_pb2.Graph()
        tokens: list[tuple[int, ...]] = []
        parts: list[Part] = []
        base = nodeids.Offsets()
        for t in traces:
            end = base.ids + t.end
            if end > MAX_ID:
                raise Unmergeable(f"the merged request's node ids would pass {MAX_ID}")
            graph.scopes.extend(t.graph.scopes)
            for src in t.graph.nodes:
                node = graph.nodes.add()
                node.CopyFrom(src)
                nodeids.shift(node, base)
            for p in t.parts:
                at = nodeids.Offsets(base.ids + p.at.ids, base.invokes + p.at.invokes, base.scopes + p.at.scopes)
                parts.append(Part(at, base.ids + p.end, p.invokes))
            tokens.extend(t.tokens)
            base = nodeids.Offsets(end, base.invokes + len(t.tokens), base.scopes + len(t.graph.scopes))
        return cls(traces[0].model if traces else "", tokens, graph, parts)

    def invokes_pb(self) -> list[nnd_pb2.Invoke]:
        out = []
        for ids in self.tokens:
            inv = nnd_pb2.Invoke()
            inv.tokens.ids.extend(ids)
            out.append(inv)
        return out

    def to_pb(self) -> nnd_pb2.TraceRequest:
        """The TraceRequest the engine runs (inputs as token ids)."""
        return nnd_pb2.TraceRequest(model=self.model, invokes=self.invokes_pb(), graph=self.graph)

    def split(self) -> Split:
        """A router for the responses of running this request, to the parts it was merged from."""
        return Split(self.parts)


Routed = list[tuple[int, nnd_pb2.TraceResponse]]


class Split:
    """Sends each response of a merged run to the part it belongs to, with that part's own ids.
    Holds which merged blob id belongs to which part, so Chunks follow their Saved message."""

    def __init__(self, parts: Sequence[Part]) -> None:
        self.parts = list(parts)
        self._blobs = [0] * len(self.parts)  # local blob ids handed out so far, per part
        self._owner: dict[int, tuple[int, int]] = {}  # merged blob id -> (part, local blob id)

    def owner(self, node: int) -> int:
        for i, p in enumerate(self.parts):
            if p.at.ids <= node < p.end:
                return i
        raise RuntimeError(f"the merged run emitted node {node}, which no part owns")

    def _blob(self, part: int, blob: int) -> int:
        self._blobs[part] += 1
        self._owner[blob] = (part, self._blobs[part])
        return self._blobs[part]

    def _renumber(self, value: values_pb2.Value, part: int) -> None:
        kind = value.WhichOneof("kind")
        if kind == "tensor":
            if value.tensor.blob:
                value.tensor.blob = self._blob(part, value.tensor.blob)
        elif kind in ("list", "tuple"):
            for item in getattr(value, kind).items:
                self._renumber(item, part)
        elif kind == "map":
            for item in value.map.items.values():
                self._renumber(item, part)

    def __call__(self, response: nnd_pb2.TraceResponse) -> Routed:
        """(part index, response) pairs for one response of the merged run (edited in place)."""
        kind = response.WhichOneof("kind")
        if kind == "saved":
            part = self.owner(response.saved.node)
            response.saved.node -= self.parts[part].at.ids
            if response.saved.value_blob:  # a serialized value: its tensors are inline, one blob to renumber
                response.saved.value_blob = self._blob(part, response.saved.value_blob)
            self._renumber(response.saved.value, part)
            return [(part, response)]
        if kind == "chunk":
            part, local = self._owner[response.chunk.blob]
            response.chunk.blob = local
            return [(part, response)]
        if kind == "done":
            compute_s = response.done.compute_s
            return [
                (i, nnd_pb2.TraceResponse(done=nnd_pb2.TraceDone(compute_s=compute_s))) for i in range(len(self.parts))
            ]
        raise RuntimeError(f"a merged run emitted an unexpected {kind!r} response")  # nothing else comes out of a trace
