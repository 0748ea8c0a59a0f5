"""Which trace is being recorded on this thread."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Generic, TypeVar

from nnd._usage import OutsideTrace

if TYPE_CHECKING:
    from nnd._tracer import Tracer

T = TypeVar("T")


class ThreadStack(Generic[T]):
    """What is open on the calling thread, innermost last (traces here, sessions in _session.py)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def items(self) -> list[T]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack


_tracers: ThreadStack[Tracer] = ThreadStack()


def _stack() -> list[Tracer]:
    return _tracers.items()


def push(tracer: Tracer) -> None:
    _stack().append(tracer)


def pop(tracer: Tracer) -> None:
    stack = _stack()
    if stack and stack[-1] is tracer:
        stack.pop()
    elif tracer in stack:
        stack.remove(tracer)


def current_or_none() -> Tracer | None:
    stack = _stack()
    return stack[-1] if stack else None


def current(what: str) -> Tracer:
    """The innermost open trace; `what` names the access for the error."""
    tracer = current_or_none()
    if tracer is None:
        raise OutsideTrace(
            f"{what} only exists inside a `with model.trace(...)`, `model.scan(...)` or "
            "`model.generate(...)` block; open one and access it there"
        )
    return tracer
