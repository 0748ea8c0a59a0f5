"""Only saved values leave a block, as in nnsight 0.8.

nnsight runs a block's body in a namespace of its own and, when the outermost
block ends, copies back into the caller's frame only the names bound to a saved
value (`.save()`, `nnsight.save(x)`, a cache). Any other name the body bound
is, after the block, what it was before: unbound (a NameError) if it did not
exist, its old value if it did (`x = 1` before, `x = h.output` inside: `x` is
1 after). nnd runs the body in the caller's frame itself, so at the block's end
it puts back what the body bound without saving: `snapshot` notes, when the
block opens, the old values of the names the body binds (_blocknames.py), and
`settle` restores them, keeping the names whose value the block saved.

Attribute and item targets (`obj.h = ...`, `out["h"] = ...`) are not names:
the object is shared, so they keep what the body put there, as in nnsight. The
`with ... as x` target of the block itself is bound by the `with` statement,
not by the body, and stays.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

from nnd.tracing._blocknames import BlockNames

_CO_OPTIMIZED = 0x0001
_MISSING = object()


class Before:
    """The names a block's body binds and what each held when the block opened."""

    __slots__ = ("frame", "local", "glob", "every")

    def __init__(self, frame: FrameType, local: dict[str, Any], glob: dict[str, Any], every: bool) -> None:
        self.frame = frame
        self.local = local  # a function's (or class body's) own names -> old value (_MISSING: unbound)
        self.glob = glob  # module-level names -> old value (_MISSING: unbound)
        self.every = every  # the body's source was unknown: the names are every name the frame held


def _locals_of(frame: FrameType) -> dict[str, Any] | None:
    """The namespace a function's or class body's own names live in; None at module level."""
    if frame.f_code.co_flags & _CO_OPTIMIZED or frame.f_locals is not frame.f_globals:
        return frame.f_locals
    return None


def _own_names(frame: FrameType) -> set[str]:
    code = frame.f_code
    return set(code.co_varnames) | set(code.co_cellvars) | set(code.co_freevars)


def snapshot(frame: FrameType | None, names: BlockNames | None) -> Before | None:
    """What the names `names.bound` (less the block's own `as` targets) hold as the block opens.
    `names` None (the body's source is unknown): every name of the frame, compared by identity at
    the end. Cheap: a few dictionary reads per name the body binds."""
    if frame is None:
        return None
    own = _locals_of(frame)
    if names is None:
        local = dict(own) if own is not None else {}
        return Before(frame, local, dict(frame.f_globals), every=True)
    wanted = names.bound - names.targets
    local: dict[str, Any] = {}
    glob: dict[str, Any] = {}
    if own is not None:
        in_function = bool(frame.f_code.co_flags & _CO_OPTIMIZED)
        mine = _own_names(frame) if in_function else None
        for name in wanted:
            if mine is None or name in mine:
                local[name] = own.get(name, _MISSING)
            else:  # `global x` in a function's body
                glob[name] = frame.f_globals.get(name, _MISSING)
    else:
        for name in wanted:
            glob[name] = frame.f_globals.get(name, _MISSING)
    return Before(frame, local, glob, every=False)


def settle(before: Before | None, kept: Callable[[Any], bool]) -> list[str]:
    """Give every name the body bound to a value `kept` does not accept its old value back (or
    unbind it). Returns the names changed."""
    if before is None:
        return []
    frame = before.frame
    own = _locals_of(frame)
    glob = frame.f_globals
    if before.every:  # unknown source: every name the frame held then or holds now (a function's: its own)
        local_names = set(before.local) | set(own) if own is not None else set()
        glob_names = set(before.glob) | set(glob) if own is None else set()
    else:
        local_names, glob_names = set(before.local), set(before.glob)
    changed: list[str] = []
    if own is not None and local_names:
        local_changed = _settle(own, local_names, before.local, before.every, kept)
        if local_changed:
            changed += local_changed
            _write_locals(frame)
    return changed + _settle(glob, glob_names, before.glob, before.every, kept)


def _settle(
    namespace: Any, names: Iterable[str], old: dict[str, Any], every: bool, kept: Callable[[Any], bool]
) -> list[str]:
    changed = []
    for name in names:
        was = old.get(name, _MISSING)
        now = namespace.get(name, _MISSING)
        if now is was:
            continue
        if now is not _MISSING and kept(now):
            continue
        if every and now is not _MISSING and name.startswith("__"):  # the interpreter's own (`__builtins__`)
            continue
        if was is _MISSING:
            try:
                namespace.pop(name, None)
            except (TypeError, ValueError, KeyError):  # 3.13's frame proxy cannot unbind a fast local
                continue
        else:
            namespace[name] = was
        changed.append(name)
    return changed


def _write_locals(frame: FrameType) -> None:
    if not frame.f_code.co_flags & _CO_OPTIMIZED:  # a class body's namespace is the dict itself
        return
    if sys.version_info >= (3, 13):  # PEP 667: f_locals writes through (a removed key unbinds)
        return
    # Before 3.13 f_locals is a snapshot: copy it back, clearing the fast slots of removed names.
    ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(frame), ctypes.c_int(1))
