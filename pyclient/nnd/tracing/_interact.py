"""Sync points: real values inside a block, over one Interact stream.

The recorded graph is the fast path (one Trace call at the end of the block).
The first time Python needs a real value (`if h.sum() > 0:`, `print(h)`,
`.item()`, numpy), the block's request starts as an Interact stream with the
graph so far; the worker runs until that value exists, pauses, and sends it.
Every later sync sends only the nodes recorded since; the block's end sends
the rest with `finish` and reads the saved values as a Trace would. The stream
follows the model's route to its worker, as a Trace does (connection.py).

In a session the stream belongs to the session: it starts with the blocks
recorded so far (the last one the block asking), a sync in a later block sends
the blocks in between with it, and the session's end sends the rest.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from nnd.v1 import graph_pb2, nnd_pb2
from nnd.wire import _results

if TYPE_CHECKING:
    from nnd.tracing._session import Session
    from nnd.tracing._tracer import Tracer

_END: Any = object()


class _Requests:
    """An Interact stream's messages: the start, then what the block puts in `outbox` until _END.
    Iterating waits for each (gRPC's request thread does); `ready()` takes what is there without
    waiting, for a caller that writes them itself before it reads (the fast route: no thread)."""

    def __init__(self, start: nnd_pb2.InteractRequest, outbox: queue.SimpleQueue[Any]) -> None:
        self._first: nnd_pb2.InteractRequest | None = start
        self._outbox = outbox
        self.ended = False

    def __iter__(self) -> _Requests:
        return self

    def __next__(self) -> nnd_pb2.InteractRequest:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        if self.ended:
            raise StopIteration
        msg = self._outbox.get()
        if msg is _END:
            self.ended = True
            raise StopIteration
        return msg  # type: ignore[no-any-return]

    def ready(self) -> list[nnd_pb2.InteractRequest]:
        """The messages put so far and not taken; `ended` says whether _END came after them."""
        out: list[nnd_pb2.InteractRequest] = []
        if self._first is not None:
            out.append(self._first)
            self._first = None
        while not self.ended:
            try:
                msg = self._outbox.get_nowait()
            except queue.Empty:
                break
            if msg is _END:
                self.ended = True
            else:
                out.append(msg)
        return out


class Interaction:
    """The running request of one block (or session), paused at its latest sync point."""

    def __init__(self, tracer: Tracer, session: Session | None = None) -> None:
        self.tracer = tracer  # the block the run stands in (a session's: the last one sent)
        self.session = session
        # SimpleQueue: gRPC's request thread waits on it once per sync point (cheaper to wake than Queue).
        self.outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.start: nnd_pb2.InteractRequest | None = None
        self.sent = 0  # how many of the block's nodes the worker has
        self.scopes = 0
        self.responses: Iterator[Any] | None = None
        self.syncs = 0

    def _requests(self) -> Iterator[nnd_pb2.InteractRequest]:
        """The stream's messages: the start, then what the block sends. A new call (a stale route
        resent) gets a new outbox; the old call's reader is told to end."""
        self.outbox.put(_END)
        self.outbox = outbox = queue.SimpleQueue()
        assert self.start is not None
        return _Requests(self.start, outbox)

    def _new_nodes(self) -> graph_pb2.Graph:
        graph = self.tracer.graph
        part = graph_pb2.Graph(nodes=graph.nodes[self.sent :])
        if len(graph.scopes) > self.scopes:
            part.scopes.extend(graph.scopes[self.scopes :])
        return part

    def _now_in(self, tracer: Tracer) -> None:
        self.tracer = tracer
        self.sent = len(tracer.graph.nodes)
        self.scopes = len(tracer.graph.scopes)

    def _on_step(self, step: _results.StepToken) -> None:
        if self.session is None:
            self.tracer.tokens.append(step)
            return
        traces = self.session.blocks
        if 0 <= step.trace < len(traces):
            traces[step.trace].tokens.append(step)
        elif step.trace == len(traces):  # the block still being recorded
            self.tracer.tokens.append(step)

    def value(self, ref: int, tracer: Tracer | None = None, *, item: bool = False) -> Any:
        """The real value of node `ref` of `tracer` (default: this run's block), now: the run goes
        on until it exists and pauses there. `item`: Python reads it as one number (`.item()`,
        `bool(...)`), so a tensor of one element comes as that number (InteractStart.items)."""
        tracer = tracer or self.tracer
        items = [ref] if item else []
        # A value of a session's block that has ended (Python between the blocks): every block that
        # ended is already in the session's request, so none is added again.
        ended = self.session is not None and tracer in self.session.blocks
        if self.responses is None:
            first = nnd_pb2.InteractRequest()
            start = first.start  # filled in place: the request is copied once, not again into its message
            start.want.append(ref)
            start.items.extend(items)
            if self.session is not None:
                start.session.CopyFrom(self.session.request())
                if not ended:
                    start.session.traces.add(request=tracer.request(), generate=tracer.backend.generates)
                if start.session.traces:  # each pause's values and the end's as one message (nnd.proto)
                    start.session.traces[0].request.one_message = True
            else:
                start.request.CopyFrom(tracer.request())
                start.generate = tracer.backend.generates
                start.request.one_message = True
            self._now_in(self.session.blocks[-1] if ended and self.session is not None else tracer)
            timeout = tracer.options.get("pause_timeout")
            if timeout is not None:
                start.pause_timeout_s = float(timeout)
            self.start = first
            model = start.session.model if self.session is not None else start.request.model
            self.responses = tracer.model._conn.bidi(
                "Interact", model, self._requests, timeout=tracer.options.get("timeout")
            )
        elif ended:
            assert self.session is not None
            more = self._next_traces(want=[ref], items=items)
            self._now_in(self.session.blocks[-1])
            self.outbox.put(nnd_pb2.InteractRequest(more=more))
        elif tracer is self.tracer:
            more = nnd_pb2.InteractContinue(graph=self._new_nodes(), want=[ref], items=items)
            self._now_in(tracer)
            self.outbox.put(nnd_pb2.InteractRequest(more=more))
        else:  # a later block of the session: the blocks recorded since go with it
            more = self._next_traces(want=[ref], items=items)
            more.traces.add(request=tracer.request(), generate=tracer.backend.generates)
            self._now_in(tracer)
            self.outbox.put(nnd_pb2.InteractRequest(more=more))
        self.syncs += 1
        got = _results.collect(self.responses, on_step=self._on_step, until_paused=True)
        if ref not in got.saved:
            raise RuntimeError("the daemon ended the run without sending the value this sync point asked for")
        return got.saved[ref]

    def _next_traces(self, **fields: Any) -> nnd_pb2.InteractContinue:
        """The rest of the block running now, and the session's blocks that ended after it."""
        more = nnd_pb2.InteractContinue(graph=self._new_nodes(), **fields)
        assert self.session is not None
        traces = self.session.blocks
        after = traces[traces.index(self.tracer) + 1 :] if self.tracer in traces else []
        for tracer in after:
            more.traces.add(request=tracer.request(), generate=tracer.backend.generates)
        return more

    def finish(self) -> _results.Results:
        """Send what was recorded since the last sync, run to the end, read the saved values."""
        assert self.responses is not None
        if self.session is not None:
            more = self._next_traces(finish=True)
        else:
            more = nnd_pb2.InteractContinue(graph=self._new_nodes(), finish=True)
        self.outbox.put(nnd_pb2.InteractRequest(more=more))
        self.outbox.put(_END)
        return _results.collect(self.responses, on_step=self._on_step)

    def cancel(self) -> None:
        """The block failed: end the run (the worker frees the model at once)."""
        self.outbox.put(_END)
        if self.responses is not None:
            close = getattr(self.responses, "close", None)
            if close is not None:
                close()
