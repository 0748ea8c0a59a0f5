"""Rebinding the user's names from saved proxies to their real values."""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterable, Mapping
from types import FrameType
from typing import Any

# id(proxy) -> (proxy, value). The proxy is kept so an id cannot be reused.
_CO_OPTIMIZED = 0x0001

Replacements = Mapping[int, tuple[Any, Any]]

_MAX_DEPTH = 4
_MAX_ITEMS = 100_000

walked = [0]
"""Names and container items looked at so far (what the tests count: a block's cost must not
follow what the user's frame holds)."""


def rebind(frame: FrameType, replacements: Replacements, names: Iterable[str] | None = None) -> list[str]:
    """Point every name in `frame` (its locals, and its globals) that is bound to
    one of the proxies at that proxy's value, and replace the proxies held in
    lists, dicts and tuples bound to names (`[h.save() for h in layers]`).
    `names`: only these (what the blocks' bodies bind: _blocknames.py); None:
    every name the frame holds (the blocks' source could not be read).
    Returns the names changed."""
    if not replacements:
        return []
    changed = []
    if frame.f_code.co_flags & _CO_OPTIMIZED:  # a function: fast locals
        changed += _rebind_locals(frame, replacements, names)
        if names is not None:  # its other names are globals (or builtins)
            code = frame.f_code
            local_names = set(code.co_varnames) | set(code.co_cellvars) | set(code.co_freevars)
            names = [n for n in names if n not in local_names]
    elif frame.f_locals is not frame.f_globals:  # a class body: a plain dict
        changed += _rebind_dict(frame.f_locals, replacements, names)
    return changed + _rebind_dict(frame.f_globals, replacements, names)


def _match(value: Any, replacements: Replacements) -> tuple[bool, Any]:
    hit = replacements.get(id(value))
    if hit is not None and hit[0] is value:
        return True, hit[1]
    return False, None


def _item(item: Any, replacements: Replacements, depth: int) -> tuple[bool, Any]:
    hit, new = _match(item, replacements)
    if not hit:
        hit, new = _inside(item, replacements, depth + 1)
    return hit, new


def _inside(value: Any, replacements: Replacements, depth: int) -> tuple[bool, Any]:
    """Replace proxies inside a list/dict (in place) or tuple (a new one); (changed, value)."""
    if depth > _MAX_DEPTH:
        return False, value
    if isinstance(value, list) and len(value) <= _MAX_ITEMS:
        return replace_from(value, 0, replacements, depth), value
    if type(value) is dict and len(value) <= _MAX_ITEMS:
        walked[0] += len(value)
        changed = False
        for key, item in list(value.items()):
            hit, new = _item(item, replacements, depth)
            if hit:
                value[key] = new
                changed = True
        return changed, value
    if type(value) is tuple and len(value) <= _MAX_ITEMS:
        walked[0] += len(value)
        items = []
        changed = False
        for item in value:
            hit, new = _item(item, replacements, depth)
            changed = changed or hit
            items.append(new if hit else item)
        return changed, tuple(items) if changed else value
    return False, value


def replace_from(value: list[Any], start: int, replacements: Replacements, depth: int = 1) -> bool:
    """Replace the proxies in `value[start:]` (and in the containers there), in place."""
    walked[0] += max(0, len(value) - start)
    changed = False
    for i in range(start, len(value)):
        hit, new = _item(value[i], replacements, depth)
        if hit:
            value[i] = new
            changed = True
    return changed


def replace_item(item: Any, replacements: Replacements) -> tuple[bool, Any]:
    """(True, its value) for a delivered proxy, or a list/dict/tuple holding some (filled in)."""
    return _item(item, replacements, 1)


def replace_inside(container: Any, replacements: Replacements) -> None:
    """Replace the proxies inside a list or dict (and the tuples it holds), in place."""
    _inside(container, replacements, 1)


def _rebind_dict(namespace: Any, replacements: Replacements, names: Iterable[str] | None) -> list[str]:
    if names is None:
        pairs = list(namespace.items())
    else:
        pairs = [(name, namespace[name]) for name in names if name in namespace]
    walked[0] += len(pairs)
    changed = []
    for name, value in pairs:
        hit, new = _match(value, replacements)
        if hit:
            namespace[name] = new
            changed.append(name)
            continue
        hit, new = _inside(value, replacements, 1)
        if hit and new is not value:  # a tuple was rebuilt: rebind the name
            namespace[name] = new
            changed.append(name)
    return changed


def _rebind_locals(frame: FrameType, replacements: Replacements, names: Iterable[str] | None) -> list[str]:
    local_vars = frame.f_locals
    if sys.version_info >= (3, 13):
        # PEP 667: f_locals is a write-through proxy of the fast locals.
        return _rebind_dict(local_vars, replacements, names)
    changed = _rebind_dict(local_vars, replacements, names)
    if changed:
        # Before 3.13 f_locals is a snapshot: copy it back into the fast slots.
        ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(frame), ctypes.c_int(0))
    return changed
