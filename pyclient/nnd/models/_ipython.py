"""nnd inside IPython: daemon errors shown as IPython shows its own, and tab
completion of the module tree.

An error the daemon reports is raised when a block ends, so Python's traceback
points at the `with` line and walks through nnd's and gRPC's frames. Under
IPython, nnd registers a handler for its own exceptions (`set_custom_exc`,
IPython's hook for rendering chosen exception types) that drops those frames:
the user's cells remain, then the message, which quotes the cell and line of
the statement that failed ("Cell In[11], line 4") and, in a generation, the
step. Completion of `model.transformer.h[0].<TAB>` is a matcher added to the
shell's completer (`_completion.py` says why IPython's own cannot do it).
Outside IPython nothing changes.
"""

from __future__ import annotations

import os
import sys
from types import TracebackType
from typing import Any

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the nnd package, above this layer


def _internal(tb: TracebackType) -> bool:
    file = tb.tb_frame.f_code.co_filename
    return file.startswith(_PKG) or f"{os.sep}grpc{os.sep}" in file


def user_traceback(tb: TracebackType | None) -> TracebackType | None:
    """`tb` without nnd's and gRPC's frames (rebuilt, the original untouched)."""
    kept = []
    while tb is not None:
        if not _internal(tb):
            kept.append(tb)
        tb = tb.tb_next
    out = None
    for frame in reversed(kept):
        out = TracebackType(out, frame.tb_frame, frame.tb_lasti, frame.tb_lineno)
    return out


def _render(shell: Any, etype: type[BaseException], value: BaseException, tb: TracebackType | None,
            tb_offset: int | None = None) -> Any:
    stb = shell.InteractiveTB.structured_traceback(etype, value, user_traceback(tb), tb_offset=tb_offset)
    shell._showtraceback(etype, value, stb)
    return stb


def install() -> None:
    """Register nnd's handler and completion in the running IPython shell, once; a no-op anywhere else."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return
    try:
        shell = ipython.get_ipython()
    except Exception:  # noqa: BLE001 - not inside a shell
        return
    if shell is None:
        return
    _install_errors(shell)
    _install_completion(shell)


def _install_errors(shell: Any) -> None:
    if getattr(shell, "_nnd_errors", False):
        return
    from nnd.errors import NndError

    existing = tuple(getattr(shell, "custom_exceptions", ()) or ())
    if existing:  # someone else's handler: leave theirs in place rather than replace it
        return
    shell.set_custom_exc((NndError,), _render)
    shell._nnd_errors = True


def _install_completion(shell: Any) -> None:
    completer = getattr(shell, "Completer", None)
    matchers = getattr(completer, "custom_matchers", None)
    if getattr(shell, "_nnd_completion", False) or not isinstance(matchers, list):
        return
    try:
        from nnd.models import _completion

        matchers.append(_completion.matcher(completer))
    except ImportError:  # an IPython before the matcher API v2 (8.6): its own completion stays
        return
    shell._nnd_completion = True
