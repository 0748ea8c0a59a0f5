"""`ast.parse` and `compile` of a tree, one thread at a time; the caller's source parsed once.

CPython before 3.13 keeps the AST converter's recursion depth in state shared by every
thread; a collection that runs a finalizer in the middle of one thread's parse can let
another thread's parse move it, and the first raises `SystemError: AST constructor
recursion depth mismatch`. Notebooks trace from several threads (a thread pool over
prompts), so the client parses the caller's source under one lock. Re-entrant: a
finalizer that parses on the same thread must not deadlock.
"""

from __future__ import annotations

import ast
import linecache
import threading
from types import CodeType
from typing import Any

_lock = threading.RLock()
# Per file: the lines it was parsed from and the tree. A script's whole file is parsed for a block's
# body (~2 ms for 200 lines, ~20 ms for 2,000), so a loop of traces must not parse it per block.
_trees: dict[str, tuple[tuple[str, ...], ast.Module | None]] = {}


def parse(source: str) -> ast.Module:
    with _lock:
        return ast.parse(source)


def compile_tree(tree: ast.Module, filename: str) -> CodeType:
    with _lock:
        return compile(tree, filename, "exec")


def source_tree(filename: str, module_globals: dict[str, Any]) -> ast.Module | None:
    """The tree of `filename`'s source as linecache holds it (a file, a notebook cell), parsed once
    per version of its text; None when there is no source or it does not parse."""
    lines = tuple(linecache.getlines(filename, module_globals))
    cached = _trees.get(filename)
    if cached is not None and cached[0] == lines:
        return cached[1]
    tree: ast.Module | None = None
    if lines:
        try:
            tree = parse("".join(lines))
        except SyntaxError:
            tree = None
    if len(_trees) > 256:  # a notebook's cells come and go: keep it bounded
        _trees.clear()
    _trees[filename] = (lines, tree)
    return tree
