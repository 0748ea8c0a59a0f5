"""What is open on this thread: one stack of blocks (traces and sessions), innermost last."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, TypeVar

from nnd.tracing._usage import OutsideTrace

if TYPE_CHECKING:
    from nnd.tracing._session import Session
    from nnd.tracing._tracer import Tracer

T = TypeVar("T")

_local = threading.local()


def _stack() -> list[Any]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def push(block: Tracer | Session) -> None:
    _stack().append(block)


def pop(block: Tracer | Session) -> None:
    stack = _stack()
    if stack and stack[-1] is block:
        stack.pop()
    elif block in stack:
        stack.remove(block)


def _innermost(kind: type[T]) -> T | None:
    for block in reversed(_stack()):
        if isinstance(block, kind):
            return block
    return None


def current_or_none() -> Tracer | None:
    """The innermost open trace (a session around it is skipped)."""
    from nnd.tracing._tracer import Tracer

    return _innermost(Tracer)


def innermost_session() -> Session | None:
    """The innermost open `with model.session():`."""
    from nnd.tracing._session import Session

    return _innermost(Session)


def current(what: str) -> Tracer:
    """The innermost open trace; `what` names the access for the error."""
    tracer = current_or_none()
    if tracer is None:
        raise OutsideTrace(
            f"{what} only exists inside a `with model.trace(...)`, `model.scan(...)` or "
            "`model.generate(...)` block; open one and access it there"
        )
    return tracer


def snapshot() -> list[Any]:
    """This thread's open blocks, for a thread that records into them (_interleave.py)."""
    return list(_stack())


def restore(blocks: list[Any]) -> None:
    """Open `blocks` on this thread (one that records for another's block)."""
    _local.stack = list(blocks)
