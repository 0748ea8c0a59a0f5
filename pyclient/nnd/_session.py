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

from nnd import _context, _interact, _objects, _rebind, _results, _source
from nnd.errors import NndError
from nnd.v1 import nnd_pb2

if TYPE_CHECKING:
    from nnd._model import TransformersModel
    from nnd._tracer import Tracer

_sessions: _context.ThreadStack[Session] = _context.ThreadStack()


def _open() -> list[Session]:
    return _sessions.items()


def join(tracer: Tracer) -> None:
    """Make `tracer` part of the innermost open session, if there is one."""
    from nnd._graph import GraphBuilder

    stack = _open()
    session = stack[-1] if stack else None
    if session is None or not session._recording:
        return
    if tracer.model._family is not session.model._family:
        raise ValueError(
            f"this session runs on {session.model.name}; a block of {tracer.model.name} cannot be part of it"
        )
    if not tracer._sessionable:
        what = "a scan" if tracer._method == "Scan" else "an edit"
        raise ValueError(f"{what} cannot be part of a session; open it outside the `with model.session():`")
    tracer._session = session
    tracer._builder = GraphBuilder(counter=session._counter, keys=session._keys)


class Session:
    """The block `model.session()` opens. After it, `.compute_s` is the
    daemon's time for all its blocks."""

    def __init__(self, model: TransformersModel, **options: Any) -> None:
        unknown = set(options) - {"keep_alive"}
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(sorted(unknown))}; a session takes: keep_alive")
        self.model = model
        self._options = options
        self._traces: list[Tracer] = []
        self._recording = False
        self._counter = [1]
        self._keys: dict[int, Hashable] = {}
        self.compute_s = 0.0
        """Wall time the daemon spent running every block of the session."""
        self._interaction: _interact.Interaction | None = None  # open once a block needed a real value

    def __enter__(self) -> Session:
        if self._recording:
            raise RuntimeError("this session is already open")
        self._recording = True
        _open().append(self)
        _objects.mount()  # `[].save()` between the session's blocks, as in nnsight
        return self

    def _current(self) -> Tracer:
        tracer = _context.current_or_none()
        if tracer is None or tracer._session is not self or not tracer._recording:
            raise RuntimeError(
                "a value of a session's block can be used only inside a block of the same session "
                "(between blocks there is nothing to compute on until the session has run)"
            )
        return tracer

    def _add(self, tracer: Tracer) -> None:
        self._traces.append(tracer)

    def _sync(self, tracer: Tracer, ref: int) -> Any:
        """A real value inside one of the session's blocks: the session runs as an Interact stream
        from here on (_interact.py), its earlier blocks first."""
        if self._interaction is None:
            self._interaction = _interact.Interaction(tracer, self)
        return self._interaction.value(ref, tracer)

    def _request(self, scan_tail: nnd_pb2.TraceRequest | None = None) -> nnd_pb2.SessionRequest:
        from nnd._tracer import GenerateTracer

        request = nnd_pb2.SessionRequest(model=self.model.name)
        for tracer in self._traces:
            request.traces.add(request=tracer._request(), generate=isinstance(tracer, GenerateTracer))
        if scan_tail is not None:
            request.scan = True
            request.traces.add(request=scan_tail)
        keep_alive = self._options.get("keep_alive")
        if keep_alive is not None:
            from nnd._placement import keep_alive_string

            request.keep_alive = keep_alive_string(keep_alive)
        return request

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        __tracebackhide__ = True  # noqa: F841
        stack = _open()
        if self in stack:
            stack.remove(self)
            _objects.unmount()
        self._recording = False
        if exc_type is not None or not self._traces:
            if self._interaction is not None:
                self._interaction.cancel()  # frees the paused model at once
            return
        try:
            self._run()
        except NndError as err:
            raise err.with_traceback(None) from None
        frame = _source.user_frame()
        if frame is not None:
            replacements: dict[int, tuple[Any, Any]] = {}
            for tracer in self._traces:
                replacements.update(tracer._replacements())
            _rebind.rebind(frame, replacements)
            for tracer in self._traces:
                _objects.fill(tracer._holders, replacements)
        for tracer in self._traces:
            tracer._saved.clear()  # see Tracer.__exit__
            tracer._holders = []

    def _run(self) -> None:
        traces = self._traces

        def on_step(step: _results.StepToken) -> None:
            if 0 <= step.trace < len(traces):
                traces[step.trace].tokens.append(step)

        if self._interaction is not None:
            results = self._interaction.finish()
        else:
            stream = self.model._conn.stream("Session", self._request())
            results = _results.collect(stream, on_step=on_step)
        self.compute_s = results.compute_s
        for tracer in traces:
            tracer._deliver(results)
