"""`ast.parse` and `compile` of a tree, one thread at a time.

CPython before 3.13 keeps the AST converter's recursion depth in state shared by every
thread; a collection that runs a finalizer in the middle of one thread's parse can let
another thread's parse move it, and the first raises `SystemError: AST constructor
recursion depth mismatch`. Notebooks trace from several threads (a thread pool over
prompts), so the client parses the caller's source under one lock. Re-entrant: a
finalizer that parses on the same thread must not deadlock.
"""

from __future__ import annotations

import ast
import threading
from types import CodeType

_lock = threading.RLock()


def parse(source: str) -> ast.Module:
    with _lock:
        return ast.parse(source)


def compile_tree(tree: ast.Module, filename: str) -> CodeType:
    with _lock:
        return compile(tree, filename, "exec")
