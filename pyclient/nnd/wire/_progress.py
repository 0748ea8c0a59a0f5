"""Showing a dispatch's progress: the Dispatch RPC's messages as a bar or as lines.

One renderer for the `nnd dispatch` command, `model.dispatch()` and the first
trace of a META model (which dispatches it first): a tqdm bar in a notebook, a
line rewritten in place on a terminal, a few plain lines on stderr otherwise
(a script's log stays readable). Quiet when asked: `progress=False` on the
handle or the call, or for the whole process `nnd.set_progress(False)` /
NND_PROGRESS=0.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

_on: bool | None = None
_OFF = ("0", "false", "no", "off")


def set_progress(on: bool) -> None:
    """Whether dispatches started by this process show their progress (default: yes).

    A handle's or call's own `progress=` keyword wins over this; the
    environment variable NND_PROGRESS=0 sets the same at start-up."""
    global _on
    if not isinstance(on, bool):
        raise TypeError(f"set_progress takes True or False, not {on!r}")
    _on = on


def enabled() -> bool:
    """The process's setting (see `set_progress`)."""
    if _on is not None:
        return _on
    return os.environ.get("NND_PROGRESS", "1").strip().lower() not in _OFF


class Lines:
    """A one-line progress bar on a terminal; plain lines (start, each tenth, end) otherwise."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.last = ""

    def update(self, stage: str, done: int, total: int, unit: str, message: str) -> None:
        if total:
            frac = done / total
            bar = "#" * int(frac * 30)
            line = f"{stage:<9} [{bar:<30}] {done}/{total} {unit}"
        else:
            line = f"{stage:<9} {message}"
        if self.tty:
            self.stream.write("\r" + line.ljust(len(self.last)))
            self.stream.flush()
        elif line != self.last and (not total or done in (1, total) or done % max(1, total // 10) == 0):
            self.stream.write(line + "\n")
            self.stream.flush()
        self.last = line

    def close(self) -> None:
        if self.tty and self.last:
            self.stream.write("\n")
            self.last = ""

    def note(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()


class Notebook:
    """A tqdm bar (the notebook widget where ipywidgets is installed) for the loading stage."""

    def __init__(self, tqdm: Any) -> None:
        self._tqdm = tqdm
        self.bar: Any = None

    def update(self, stage: str, done: int, total: int, unit: str, message: str) -> None:
        if not total:
            if self.bar is not None:
                self.bar.set_description(stage)
            return
        if self.bar is None:
            self.bar = self._tqdm(total=total, unit=f" {unit}" if unit else "it", desc=stage)
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def note(self, text: str) -> None:
        print(text, file=sys.stderr)


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (IPython's ZMQ shell), where tqdm draws a widget."""
    shell = sys.modules.get("IPython")
    if shell is None or "ipykernel" not in sys.modules:
        return False
    try:
        ip = shell.get_ipython()
    except AttributeError:
        return False
    return ip is not None and type(ip).__name__ == "ZMQInteractiveShell"


def display() -> Lines | Notebook:
    """The renderer for this process: tqdm in a notebook (if installed), else lines on stderr."""
    if in_notebook():
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return Lines()
        return Notebook(tqdm)
    return Lines()


def show(
    messages: Iterable[Any],
    name: str,
    progress: bool | Callable[[Any], None] | None = None,
    *,
    on_final: Callable[[Any], None] | None = None,
) -> None:
    """Read a Dispatch stream to its end, rendering it as `progress` says: a callable is given each
    message; True/False shows or hides it; None follows the process's setting. Nothing is drawn
    for a model that was already dispatched (its stream is only the final message)."""
    call = progress if callable(progress) else None
    shown = enabled() if progress is None else bool(progress) and call is None
    view: Lines | Notebook | None = None
    began = time.monotonic()
    try:
        for msg in messages:
            if call is not None:
                call(msg)
            if msg.HasField("model") and on_final is not None:
                on_final(msg.model)
            if not shown or msg.stage == "ready":
                continue
            if view is None:
                view = display()
            view.update(msg.stage, msg.done, msg.total, msg.unit, msg.message)
    finally:
        if view is not None:
            view.close()
    if view is not None:
        view.note(f"{name}: weights loaded in {time.monotonic() - began:.1f} s")
