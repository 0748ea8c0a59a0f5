"""`with model.session():` — several blocks sent to the daemon as one request.

Inside a session a trace (or generate) block records as usual but does not run
when it ends; values of a block stay usable in the later blocks without
`.save()`. When the session ends every block runs in order, in one request
on one worker, and only saved values come back.
"""

from __future__ import annotations

from collections.abc import Hashable
from types import TracebackType
from typing import TYPE_CHECKING, Any

from nnd.tracing import _backends, _blocknames, _context, _interact, _objects, _source, _unsaved
from nnd.tracing._graph import GraphBuilder
from nnd.v1 import nnd_pb2
from nnd.wire import _results

if TYPE_CHECKING:
    from nnd.models._model import TransformersModel
    from nnd.tracing._tracer import Tracer


class Session:
    """The block `model.session()` opens. After it, `.compute_s` is the
    daemon's time for all its blocks."""

    def __init__(self, model: TransformersModel, **options: Any) -> None:
        from nnd.tracing._tracer import _remote_note

        _remote_note(options.pop("remote", False))  # nnsight's remote=: as on a trace, this daemon runs it
        unknown = set(options) - {"keep_alive"}
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(sorted(unknown))}; a session takes: keep_alive, remote")
        self.model = model
        self._options = options
        self.blocks: list[Tracer] = []
        """The session's blocks that have ended, in order (what it sends)."""
        self.recording = False
        self._counter = [1]
        self._keys: dict[int, Hashable] = {}
        self.compute_s = 0.0
        """Wall time the daemon spent running every block of the session."""
        self._names: _blocknames.BlockNames | None = None
        self._before: _unsaved.Before | None = None  # what those names held when it opened
        self.saved_objects: list[Any] = []
        """Objects `.save()`d in the session's own Python, between its blocks: they outlive it."""
        self._interaction: _interact.Interaction | None = None  # open once a block needed a real value

    def __enter__(self) -> Session:
        if self.recording:
            raise RuntimeError("this session is already open")
        self.recording = True
        frame = _source.user_frame()
        # The names its body binds: those rebound when it ends (_blocknames.py).
        self._names = _blocknames.of(frame) if frame is not None else None
        if not _context.snapshot():  # the outermost block: only saved values leave it (_unsaved.py)
            self._before = _unsaved.snapshot(frame, self._names)
        _context.push(self)
        _objects.mount()  # `[].save()` between the session's blocks, as in nnsight
        return self

    # -- what its blocks' backends use (_backends.SessionMember)
    def builder(self) -> GraphBuilder:
        """A graph recorder for a new block: node ids and keys are the session's, so a block may use an
        earlier block's values."""
        return GraphBuilder(counter=self._counter, keys=self._keys)

    def recording_block(self) -> Tracer | None:
        """The session's block being recorded now, if any."""
        tracer = _context.current_or_none()
        if tracer is None or tracer.backend.session is not self or not tracer._recording:
            return None
        return tracer

    def current(self) -> Tracer:
        """The session's block being recorded now."""
        tracer = _context.current_or_none()
        if tracer is None or tracer.backend.session is not self or not tracer._recording:
            raise RuntimeError(
                "a value of a session's block can be used only inside a block of the same session "
                "(between blocks there is nothing to compute on until the session has run)"
            )
        return tracer

    def add(self, tracer: Tracer) -> None:
        """A block ended: it runs when the session does."""
        self.blocks.append(tracer)

    def sync(self, tracer: Tracer, ref: int, *, item: bool = False) -> Any:
        """A real value inside one of the session's blocks, or of an ended block between blocks: the
        session runs as an Interact stream from here on (_interact.py), its earlier blocks first."""
        if self._interaction is None:
            self._interaction = _interact.Interaction(tracer, self)
        return self._interaction.value(ref, tracer, item=item)

    def request(self, scan_tail: nnd_pb2.TraceRequest | None = None) -> nnd_pb2.SessionRequest:
        """Every ended block, in order; `scan_tail`: a shape query scanned after them."""
        request = nnd_pb2.SessionRequest(model=self.model.name)
        for tracer in self.blocks:
            request.traces.add(request=tracer.request(), generate=tracer.backend.generates)
        if scan_tail is not None:
            request.scan = True
            request.traces.add(request=scan_tail)
        keep_alive = self._options.get("keep_alive")
        if keep_alive is not None:
            from nnd.models._placement import keep_alive_string

            request.keep_alive = keep_alive_string(keep_alive)
        return request

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        __tracebackhide__ = True  # noqa: F841
        _context.pop(self)
        if self.recording:
            _objects.unmount()
        self.recording = False
        if exc_type is not None or not self.blocks:
            if self._interaction is not None:
                self._interaction.cancel()  # frees the paused model at once
            saved = {id(obj) for obj in self.saved_objects} if exc_type is None else set()
            _unsaved.settle(self._before, lambda value: id(value) in saved)
            self.saved_objects = []
            return
        _backends.settle(
            self.blocks,
            self._run,
            lambda: "cancelled before its results came back",
            names=self._names,
            before=self._before,
            saved=self.saved_objects,
        )
        self.saved_objects = []

    def _run(self) -> bool:
        blocks = self.blocks

        def on_step(step: _results.StepToken) -> None:
            if 0 <= step.trace < len(blocks):
                blocks[step.trace].tokens.append(step)

        if self._interaction is not None:
            results = self._interaction.finish()
        else:
            stream = self.model._conn.stream("Session", self.request())
            results = _results.collect(stream, on_step=on_step)
        self.compute_s = results.compute_s
        for tracer in blocks:
            tracer.deliver(results)
        return True
