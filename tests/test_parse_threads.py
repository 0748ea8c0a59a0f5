"""Parsing source from several threads at once (client: the caller's block; daemon: a module's
forward, a size expression) never fails on CPython's shared AST-converter state.

The interleaving is forced, not hoped for: the first garbage collection while thread A's parse
builds the tree's objects (collections run on every allocation here) waits for thread B to parse
a whole file.
Without a lock that leaves A's recursion counter where B's ended and A raises
`SystemError: AST constructor recursion depth mismatch` (CPython < 3.13); with the lock B waits
for A instead, and A's wait ends after a second.
"""

from __future__ import annotations

import ast
import gc
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest

from nnd.tracing import _pyast as client_pyast
from nnd_daemon import pyast as daemon_pyast

SOURCE = open(__file__).read()


def _deeper(depth: int, fn: Callable[[], Any]) -> Any:
    # B parses from a deeper Python stack than A, so the counter it leaves differs from A's.
    return fn() if depth == 0 else _deeper(depth - 1, fn)


def _interleaved(parse: Callable[[str], Any], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    results: dict[str, Any] = {}
    b_may_run, b_done = threading.Event(), threading.Event()
    armed = [False]  # a plain flag: the callback may run inside an Event's own lock
    a_thread: list[threading.Thread] = []
    real_parse = ast.parse

    def arming_parse(*args: Any, **kwargs: Any) -> Any:
        # Armed in ast.parse itself, so the collection that waits is one inside the C parse.
        if threading.current_thread() is a_thread[0]:
            armed[0] = True
        return real_parse(*args, **kwargs)

    monkeypatch.setattr(ast, "parse", arming_parse)

    def on_gc(phase: str, _info: dict[str, Any]) -> None:
        if phase != "start" or not armed[0] or threading.current_thread() is not a_thread[0]:
            return
        # Only a collection in the middle of building the tree's objects (the parser proper makes none).
        if any(isinstance(o, ast.AST) for o in gc.get_objects(generation=0)):
            armed[0] = False
            b_may_run.set()
            b_done.wait(1.0)  # without a lock B parses to its end here, inside A's parse

    def run(name: str, before: Callable[[], None], after: Callable[[], None], depth: int) -> None:
        before()
        try:
            _deeper(depth, lambda: parse(SOURCE))
            results[name] = "ok"
        except SystemError as exc:
            results[name] = exc
        finally:
            after()

    a = threading.Thread(target=run, args=("a", lambda: None, lambda: armed.__setitem__(0, False), 0))
    b = threading.Thread(target=run, args=("b", b_may_run.wait, b_done.set, 40))
    a_thread.append(a)
    threshold = gc.get_threshold()
    gc.collect()
    gc.callbacks.append(on_gc)
    gc.set_threshold(1)
    try:
        b.start()
        a.start()
        a.join(30)
        b_may_run.set()  # if A's parse saw no collection at all
        b.join(30)
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(on_gc)
    return results


@pytest.mark.skipif(sys.version_info >= (3, 13), reason="CPython 3.13 keeps the converter's state per thread")
def test_the_interleaving_breaks_a_bare_ast_parse(monkeypatch: pytest.MonkeyPatch):
    # The harness's own check: the interleaving it forces is the one that breaks ast.parse.
    results = _interleaved(lambda source: ast.parse(source), monkeypatch)
    assert isinstance(results.get("a"), SystemError), results


@pytest.mark.parametrize("parse", [client_pyast.parse, daemon_pyast.parse], ids=["client", "daemon"])
def test_parses_from_two_threads_both_succeed(parse: Callable[[str], Any], monkeypatch: pytest.MonkeyPatch):
    assert _interleaved(parse, monkeypatch) == {"a": "ok", "b": "ok"}
