"""Sync points: real values inside a block, over one Interact stream.

The recorded graph is the fast path (one Trace call at the end of the block).
The first time Python needs a real value (`if h.sum() > 0:`, `print(h)`,
`.item()`, numpy), the block's request starts as an Interact stream with the
graph so far; the worker runs until that value exists, pauses, and sends it.
Every later sync sends only the nodes recorded since; the block's end sends
the rest with `finish` and reads the saved values as a Trace would. The stream
follows the model's route to its worker, as a Trace does (connection.py).
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from nnd import _results
from nnd.v1 import graph_pb2, nnd_pb2

if TYPE_CHECKING:
    from nnd._tracer import Tracer

_END: Any = object()


class Interaction:
    """The running request of one block, paused at its latest sync point."""

    def __init__(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self.outbox: queue.Queue[Any] = queue.Queue()
        self.start: nnd_pb2.InteractRequest | None = None
        self.sent = 0  # how many of the builder's nodes the worker has
        self.scopes = 0
        self.responses: Iterator[Any] | None = None
        self.syncs = 0

    def _requests(self) -> Iterator[nnd_pb2.InteractRequest]:
        """The stream's messages: the start, then what the block sends. A new call (a stale route
        resent) gets a new outbox; the old call's reader is told to end."""
        self.outbox.put(_END)
        self.outbox = outbox = queue.Queue()
        assert self.start is not None
        return self._read(self.start, outbox)

    @staticmethod
    def _read(start: nnd_pb2.InteractRequest, outbox: queue.Queue[Any]) -> Iterator[nnd_pb2.InteractRequest]:
        yield start
        while True:
            msg = outbox.get()
            if msg is _END:
                return
            yield msg

    def _new_nodes(self) -> graph_pb2.Graph:
        graph = self.tracer._builder.graph
        part = graph_pb2.Graph(nodes=graph.nodes[self.sent :])
        if len(graph.scopes) > self.scopes:
            part.scopes.extend(graph.scopes[self.scopes :])
        self.sent = len(graph.nodes)
        self.scopes = len(graph.scopes)
        return part

    def value(self, ref: int) -> Any:
        """The real value of node `ref`, now: the run goes on until it exists and pauses there."""
        tracer = self.tracer
        if self.responses is None:
            request = tracer._request()
            self.sent = len(request.graph.nodes)
            self.scopes = len(request.graph.scopes)
            start = nnd_pb2.InteractStart(request=request, generate=tracer._method == "Generate", want=[ref])
            timeout = tracer._options.get("pause_timeout")
            if timeout is not None:
                start.pause_timeout_s = float(timeout)
            self.start = nnd_pb2.InteractRequest(start=start)
            self.responses = tracer.model._conn.bidi(
                "Interact", request.model, self._requests, timeout=tracer._options.get("timeout")
            )
        else:
            more = nnd_pb2.InteractContinue(graph=self._new_nodes(), want=[ref])
            self.outbox.put(nnd_pb2.InteractRequest(more=more))
        self.syncs += 1
        got = _results.collect(self.responses, on_step=tracer.tokens.append, until_paused=True)
        if ref not in got.saved:
            raise RuntimeError("the daemon ended the run without sending the value this sync point asked for")
        return got.saved[ref]

    def finish(self) -> _results.Results:
        """Send what was recorded since the last sync, run to the end, read the saved values."""
        assert self.responses is not None
        more = nnd_pb2.InteractContinue(graph=self._new_nodes(), finish=True)
        self.outbox.put(nnd_pb2.InteractRequest(more=more))
        self.outbox.put(_END)
        return _results.collect(self.responses, on_step=self.tracer.tokens.append)

    def cancel(self) -> None:
        """The block failed: end the run (the worker frees the model at once)."""
        self.outbox.put(_END)
        if self.responses is not None:
            close = getattr(self.responses, "close", None)
            if close is not None:
                close()
