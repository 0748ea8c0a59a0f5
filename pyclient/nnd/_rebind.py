"""Rebinding the user's names from saved proxies to their real values."""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Mapping
from types import FrameType
from typing import Any

# id(proxy) -> (proxy, value). The proxy is kept so an id cannot be reused.
_CO_OPTIMIZED = 0x0001

Replacements = Mapping[int, tuple[Any, Any]]


def rebind(frame: FrameType, replacements: Replacements) -> list[str]:
    """Point every name in `frame` (its locals, and its globals) that is bound to
    one of the proxies at that proxy's value. Returns the names changed."""
    if not replacements:
        return []
    changed = []
    if frame.f_code.co_flags & _CO_OPTIMIZED:  # a function: fast locals
        changed += _rebind_locals(frame, replacements)
    elif frame.f_locals is not frame.f_globals:  # a class body: a plain dict
        changed += _rebind_dict(frame.f_locals, replacements)
    return changed + _rebind_dict(frame.f_globals, replacements)


def _match(value: Any, replacements: Replacements) -> tuple[bool, Any]:
    hit = replacements.get(id(value))
    if hit is not None and hit[0] is value:
        return True, hit[1]
    return False, None


def _rebind_dict(namespace: dict[str, Any], replacements: Replacements) -> list[str]:
    changed = []
    for name, value in list(namespace.items()):
        hit, new = _match(value, replacements)
        if hit:
            namespace[name] = new
            changed.append(name)
    return changed


def _rebind_locals(frame: FrameType, replacements: Replacements) -> list[str]:
    local_vars = frame.f_locals
    if sys.version_info >= (3, 13):
        # PEP 667: f_locals is a write-through proxy of the fast locals.
        return _rebind_dict(local_vars, replacements)  # type: ignore[arg-type]
    changed = _rebind_dict(local_vars, replacements)
    if changed:
        # Before 3.13 f_locals is a snapshot: copy it back into the fast slots.
        ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(frame), ctypes.c_int(0))
    return changed
