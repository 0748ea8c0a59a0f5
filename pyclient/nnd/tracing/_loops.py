"""Loops over generation steps: `tracer.iter[...]` and `tracer.all()`.

`for step in tracer.iter[...]:` runs its body once per step in Python, as
nnsight does, with `step` the step's number: the generation's length is known
(max_new_tokens), so the loop is unrolled, each pass recorded into a scope of
its own that the daemon runs at that one step. Appends, per-step `if`s and
sync points inside the body behave as in nnsight. A step the generation never
reaches (it stopped early) runs nothing; the block warns, as nnsight does.

`with tracer.all():` / `with tracer.iter[...]:` (nnsight's deprecated form)
runs its body once per step too, as nnsight does (see _withbody.py); where the
body's source cannot be found it is recorded once into a scope the daemon runs
at every selected step.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from nnd.tracing import _withbody
from nnd.tracing._usage import value_not_known
from nnd.v1 import graph_pb2, values_pb2
from nnd.v1.contract import steps_of

if TYPE_CHECKING:
    from nnd.tracing._tracer import Tracer


def selector(key: Any) -> graph_pb2.StepSelector:
    """A StepSelector for `iter[:]`, `iter[1:3]`, `iter[[0, 2]]` or `iter[2]`."""
    sel = graph_pb2.StepSelector()
    if isinstance(key, slice):
        if key.start is None and key.stop is None and key.step is None:
            sel.all.SetInParent()
            return sel
        for field in ("start", "stop", "step"):
            bound = getattr(key, field)
            if bound is not None:
                setattr(sel.range, field, int(bound))
        sel.range.SetInParent()
    elif isinstance(key, int) and not isinstance(key, bool):
        sel.steps.steps.append(key)
    elif isinstance(key, Sequence) and all(isinstance(s, int) for s in key):
        sel.steps.steps.extend(key)
    else:
        raise TypeError(f"select steps with a slice, an int or a list of ints, not {key!r}")
    return sel


class PastTheEnd(BaseException):  # noqa: N818 - a control signal: no user `except Exception` may take it
    """Raised at a module access (or a sync point) in the pass after an open-ended loop's last step."""


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Step:
    """The step a loop body runs at. The body is recorded once for all
    selected steps, so its number is not a Python int; choose steps with
    `tracer.iter[...]` rather than branching on it."""

    __slots__ = ("scope",)

    def __init__(self, scope: int) -> None:
        self.scope = scope

    def _refuse(self, what: str) -> Any:
        raise value_not_known(
            f"{what} of a loop step (the body runs once per step on the daemon; select steps "
            "with tracer.iter[[...]] instead)",
            "",
        )

    def __bool__(self) -> bool:
        return self._refuse("`bool()`")

    def __int__(self) -> int:
        return self._refuse("`int()`")

    def __index__(self) -> int:
        return self._refuse("the number")

    def __eq__(self, other: object) -> bool:
        return self._refuse("comparing")

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"<nnd step of loop scope {self.scope}>"


class Loop:
    """One loop scope: iterate it (`for step in ...`) or enter it (`with ...`)."""

    def __init__(self, tracer: Tracer, steps: graph_pb2.StepSelector) -> None:
        self._tracer = tracer
        self._steps = steps
        self._scope = 0
        self._per_step = False
        self._trace_before: Any = None

    def __iter__(self) -> Iterator[Any]:
        yield from self._passes()
        tracer = self._tracer
        if tracer.backend.unroll_loops and tracer.backend.generates and self._steps.WhichOneof("kind") == "all":
            # The `for` statement asks for one more item: as nnsight, run its body once more, past the last
            # step, up to its first module access (the streamer there holds the last generated token).
            self._past_the_end(sys._getframe(1))

    def _passes(self) -> Iterator[Any]:
        tracer = self._tracer
        if not tracer.backend.unroll_loops:  # a stored edit: its loop runs at the steps of every later generation
            scope = tracer._builder.push_scope(self._steps)
            try:
                yield Step(scope)
            finally:
                tracer._builder.pop_scope()
            return
        for step in steps_of(self._steps, tracer._steps_known()):
            with self._pass(step):
                yield step

    @contextlib.contextmanager
    def _pass(self, step: int, *, past_the_end: bool = False) -> Iterator[None]:
        one = graph_pb2.StepSelector()
        one.steps.steps.append(step)
        builder = self._tracer._builder
        scope = builder.push_scope(one)
        self._tracer._unrolled[scope] = step
        if past_the_end:
            self._tracer._past_the_end.add(scope)
        try:
            yield
        finally:
            builder.pop_scope()
            if past_the_end:
                self._drop_if_unused(scope)

    def _drop_if_unused(self, scope: int) -> None:
        """A pass past the end that recorded nothing (it ended at its first module access): the daemon
        need not hear of its scope."""
        tracer = self._tracer
        graph = tracer._builder.graph
        if scope != len(graph.scopes) or any(n.scope == scope for n in graph.nodes):
            return
        if any(read == scope for _, read in [*tracer._client_scopes.values(), *tracer._client_saves]):
            return
        del graph.scopes[-1]
        del tracer._unrolled[scope]
        tracer._past_the_end.discard(scope)

    def _past_the_end(self, frame: Any) -> None:
        """nnsight 0.8 ends an open-ended loop with one more pass that is cut at its first module access
        (what the generation never makes): Python before it runs, and a streamer read there gets the
        last generated token. The pass runs here, from the `for` statement's source, so the statements
        after the loop still run (nnsight skips them)."""
        if frame is None or frame.f_code.co_filename.startswith(_PACKAGE):
            return  # not a user's `for` statement (`with tracer.all()` drives the passes itself)
        with self._pass(self._tracer._steps_known(), past_the_end=True):
            _withbody.run_for_body_once(frame, self._tracer._steps_known(), PastTheEnd)

    def __enter__(self) -> Any:
        warnings.warn(
            "The `with tracer.iter[...]:` / `with tracer.all():` block form is deprecated; use "
            "`for step in tracer.iter[...]:` instead.",
            FutureWarning,  # nnsight's deprecations are FutureWarnings, shown by default
            stacklevel=2,
        )
        self._per_step = False
        if self._tracer.backend.unroll_loops:
            # As nnsight: the body runs once per step (see _withbody.py); Python then skips it.
            frame = sys._getframe(1)
            self._per_step, self._trace_before = _withbody.run_per_step(frame, self._passes())
            if self._per_step:
                return None
        self._scope = self._tracer._builder.push_scope(self._steps)
        return Step(self._scope)

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> bool:
        if self._per_step:
            self._per_step = False
            return _withbody.finish(exc_type, self._trace_before)
        self._tracer._builder.pop_scope()
        return False


class StepIter:
    """`tracer.iter`: index it with the steps to run a loop body at."""

    def __init__(self, tracer: Tracer) -> None:
        self._tracer = tracer

    def __getitem__(self, key: Any) -> Loop:
        return Loop(self._tracer, selector(key))

    def __iter__(self) -> Iterator[Step]:
        return iter(self[:])


def every_step(tracer: Tracer) -> Loop:
    sel = graph_pb2.StepSelector()
    sel.all.CopyFrom(values_pb2.Empty())
    return Loop(tracer, sel)
