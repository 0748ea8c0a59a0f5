"""`nnd.save`: keep a value after the block."""

from __future__ import annotations

from typing import TypeVar

from nnd import _context, _meta
from nnd._proxy import Proxy

T = TypeVar("T")


def save(value: T) -> T:
    """Keep `value` after the block: a proxy's name is rebound to its real
    value. Values already known while recording (shapes, ints) are recorded as
    a save of a constant and returned as they are; outside a block, `value` is
    returned unchanged."""
    if isinstance(value, Proxy):
        return value.save()  # type: ignore[return-value]
    tracer = _context.current_or_none()
    if tracer is None:
        return value
    if isinstance(value, _meta.Size):
        value.save()
    if type(value) in (list, dict, tuple):  # a container: the block's values inside it come back
        tracer._saved_objects.append(value)
        return value
    try:
        tracer._save_constant(value)
    except TypeError:
        pass  # a Python value the wire cannot carry is kept on the client as it is
    return value
