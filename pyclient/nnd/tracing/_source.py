"""Where in the user's program a node was recorded."""

from __future__ import annotations

import functools
import linecache
import os
import sys
from types import CodeType, FrameType

from nnd.v1 import graph_pb2
from nnd.wire import _torchmod

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the nnd package, above this layer
_skip: tuple[str, ...] = (_PKG,)
_torch_seen = False


def _skipped() -> tuple[str, ...]:
    # torch's override machinery (torch/overrides.py, torch/nn/functional.py)
    # sits between a user's `F.softmax(p)` and our __torch_function__.
    global _skip, _torch_seen
    if not _torch_seen:
        torch = _torchmod.loaded()
        torch_file = getattr(torch, "__file__", None) if torch is not None else None
        if torch_file:
            _skip = (_PKG, os.path.dirname(os.path.abspath(torch_file)) + os.sep)
            _torch_seen = True
    return _skip


def user_frame(depth: int = 1) -> FrameType | None:
    """The innermost frame outside nnd (and torch's dispatch code)."""
    skip = _skipped()
    frame: FrameType | None = sys._getframe(depth)
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame = frame.f_back
    return frame


# (code, line) -> its SourceLocation, worked out once per call site (a block in a loop records the
# same lines every time). Keyed by the code object, not the file name: a re-run notebook cell or a
# reloaded module is new code and reads its lines afresh. Never handed out: callers get copies.
_locations: dict[tuple[CodeType, int], graph_pb2.SourceLocation] = {}
_NOWHERE = graph_pb2.SourceLocation()


def _location_of(frame: FrameType | None) -> graph_pb2.SourceLocation:
    if frame is None:
        return _NOWHERE
    code, line = frame.f_code, frame.f_lineno
    key = (code, line)
    loc = _locations.get(key)
    if loc is None:
        file = code.co_filename
        text = linecache.getline(file, line).strip()
        loc = graph_pb2.SourceLocation(file=display_name(file), line=line, text=text)
        if len(_locations) > 4096:  # a notebook's cells come and go: keep the cache bounded
            _locations.clear()
        _locations[key] = loc
    return loc


def location() -> graph_pb2.SourceLocation:
    """The user's file, line and line text, for a node being recorded."""
    out = graph_pb2.SourceLocation()
    out.CopyFrom(_location_of(user_frame(2)))
    return out


def fill_location(loc: graph_pb2.SourceLocation) -> None:
    """Set `loc` (a node's) to the user's file, line and line text, as `location()` gives them."""
    loc.CopyFrom(_location_of(user_frame(2)))


def display_name(file: str) -> str:
    """A file name as the user knows it: a notebook cell's temporary file reads as IPython writes it in its
    own tracebacks ("Cell In[11]"), anything else unchanged."""
    shell = sys.modules.get("IPython")
    if shell is None:
        return file
    try:
        ip = shell.get_ipython()
        kind, name = ip.compile.format_code_name(file) if ip is not None else (None, None)
    except Exception:  # noqa: BLE001 - an older or unusual IPython: keep the real name
        return file
    return f"{kind} {name}" if kind and name else file


_WITH_OPS = frozenset({"BEFORE_WITH", "SETUP_WITH", "BEFORE_ASYNC_WITH", "SETUP_ASYNC_WITH"})


def called_in_with(frame: FrameType) -> bool:
    """Whether the call `frame` is making now opens a `with` block (the next
    instruction enters the context), as in `with model.generate(...) as t:`.
    Unknown: True (the block form)."""
    return _opens_with(frame.f_code, frame.f_lasti)


@functools.lru_cache(maxsize=1024)
def _opens_with(code: CodeType, lasti: int) -> bool:
    # Per call site: disassembling the caller's code cost ~0.3 ms a call, paid by every block in a loop.
    import dis

    # f_lasti is the call (or, 3.11+, its last inline cache): the next instruction follows it.
    for ins in dis.get_instructions(code):
        if ins.offset > lasti:
            return ins.opname in _WITH_OPS
    return True
