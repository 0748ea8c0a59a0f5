"""`nnd.save`: keep a value after the block."""

from __future__ import annotations

from typing import TypeVar

from nnd.tracing import _context
from nnd.tracing._proxy import Proxy
from nnd.wire import _meta

T = TypeVar("T")


def save(value: T) -> T:
    """Keep `value` after the block: a proxy's name is rebound to its real
    value. Values already known while recording (shapes, ints) are recorded as
    a save of a constant and returned as they are. Between a session's blocks
    `value` is returned unchanged; outside any block it is a ValueError, as in
    nnsight."""
    if isinstance(value, Proxy):
        return value.save()  # type: ignore[return-value]
    tracer = _context.current_or_none()
    if tracer is None:
        session = _context.innermost_session()
        if session is not None:
            session.saved_objects.append(value)  # it outlives the session, as nnsight's saved values do
            return value
        raise ValueError(
            "save() was called outside a block: it marks a value to return from a `with model.trace(...):` "
            "block, so call it inside one"
        )
    if isinstance(value, _meta.Size):
        value.save()
    if type(value) in (list, dict, tuple):  # a container: the block's values inside it come back
        tracer._saved_objects.append(value)
        return value
    tracer._kept.append(value)  # the name bound to it outlives the block (_unsaved.py)
    try:
        tracer._save_constant(value)
    except TypeError:
        pass  # a Python value the wire cannot carry is kept on the client as it is
    return value
