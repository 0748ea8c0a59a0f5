"""Running the body of a `with tracer.iter[...]:` block once per step, as nnsight does.

Python runs a `with` body once, but nnsight 0.8 runs the deprecated
`with tracer.iter[...]:` / `with tracer.all():` body once per selected step
(appends collect one value per step, `if step == 1:` branches per step). The
loop's `__enter__` finds the body in the caller's source (ast of the file
linecache holds), runs it per step itself in a namespace built from the
caller's names, copies the names it set back into the caller's frame, and
makes Python skip the body it would have run once (a trace function raises
`SkipBody` on the body's first line; `__exit__` swallows it). This is the
client's own code running in the client; nothing here reaches the daemon.

When the source cannot be found (code typed at a bare `python` prompt) or the
body cannot run outside its statement (`break`, `return`, `yield`), the body
runs once as before, recorded into a scope the daemon runs at every step.
"""

from __future__ import annotations

import ast
import ctypes
import sys
from collections.abc import Iterable
from types import CodeType, FrameType
from typing import Any

from nnd.tracing import _pyast

_CO_OPTIMIZED = 0x0001


class SkipBody(Exception):  # noqa: N818 - a control signal, not an error the user sees
    """Raised on the first line of a `with` body that has already run per step."""


# Per call site (code, line, kind): the statement found there, and per statement its compiled body.
# A loop of traces over prompts opens the same block again and again: finding it walks the whole
# file's tree (~1 ms for 200 lines), compiling its body ~0.3 ms.
_statements: dict[tuple[CodeType, int, type[Any]], Any] = {}
_codes: dict[tuple[ast.AST, str], CodeType | None] = {}  # (statement, what was compiled of it)
_BOUND = 4096  # entries of each before it is emptied (a notebook's cells come and go)


def _statement_at(frame: FrameType, kind: type[Any]) -> Any:
    """The innermost `kind` statement (`with`, `for`) whose header holds the frame's current line."""
    key = (frame.f_code, frame.f_lineno, kind)
    try:
        return _statements[key]
    except KeyError:
        pass
    tree = _pyast.source_tree(frame.f_code.co_filename, frame.f_globals)
    found = None if tree is None else _enclosing(tree, frame.f_lineno, kind)
    if len(_statements) > _BOUND:
        _statements.clear()
    _statements[key] = found
    return found


def _compiled(node: ast.AST, how: str, build: Any) -> CodeType | None:
    """`build()`'s code for `node` (None: it does not compile there), once per statement."""
    key = (node, how)
    try:
        return _codes[key]
    except KeyError:
        pass
    code = build()
    if len(_codes) > _BOUND:
        _codes.clear()
    _codes[key] = code
    return code


def with_statement(frame: FrameType) -> ast.With | None:
    """The innermost `with` statement whose header holds the frame's current line (a block opening
    there); None when the source cannot be read or shows none. Found once per call site."""
    return _statement_at(frame, ast.With)


def _enclosing(tree: ast.AST, line: int, kind: type[Any]) -> Any:
    """The innermost `kind` statement of `tree` whose header holds `line`."""
    found = None
    for node in ast.walk(tree):
        if isinstance(node, kind) and node.body and node.lineno <= line < node.body[0].lineno:
            if found is None or node.lineno >= found.lineno:
                found = node
    return found


def _target(node: ast.With, frame: FrameType) -> str | None:
    """The `as` name of the loop's item (the one on the frame's line), if a plain name."""
    for item in node.items:
        if item.context_expr.lineno <= frame.f_lineno <= (item.context_expr.end_lineno or item.context_expr.lineno):
            var = item.optional_vars
            return var.id if isinstance(var, ast.Name) else None
    return None


def _compile(node: ast.With, filename: str) -> CodeType | None:
    def build() -> CodeType | None:
        module = ast.Module(body=node.body, type_ignores=[])
        try:
            return _pyast.compile_tree(module, filename)
        except SyntaxError:  # break/continue/return/yield only mean something inside the original statement
            return None

    return _compiled(node, "body", build)


def run_per_step(frame: FrameType, steps: Iterable[Any]) -> tuple[bool, Any]:
    """Run the `with` body at `frame`'s line once per item of `steps` (a generator that
    opens each step's scope around the yield). (False, None): the body could not be found and
    nothing ran; else (True, the trace function to give back to `finish`)."""
    node = with_statement(frame)
    # A one-line `with x: body` gives Python no new line to stop the body on: it runs once, as before.
    if node is None or len(node.items) != 1 or node.body[0].lineno == frame.f_lineno:
        return False, None
    code = _compile(node, frame.f_code.co_filename)
    if code is None:
        return False, None
    target = _target(node, frame)
    function, before, namespace = _namespace(frame)
    iterator = iter(steps)
    try:
        for step in iterator:
            if target is not None:
                namespace[target] = step
            exec(code, namespace)  # noqa: S102 - the user's own block, in the user's process, as Python would run it
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            close()  # a step's scope is closed even when the body raised
    if function:
        _write_back(frame, namespace, before)
    return True, _skip_body(frame)


def run_for_body_once(frame: FrameType, value: Any, stop: type[BaseException]) -> bool:
    """Run the body of the `for` statement at `frame`'s line once more, its target bound to `value`,
    until `stop` is raised in it (nnsight's pass past an open-ended loop's end, _loops.py). False when
    the body cannot be found or cannot run outside its statement (`break`, `continue`): nothing ran."""
    node: ast.For | None = _statement_at(frame, ast.For)
    if node is None or node.orelse or not isinstance(node.target, ast.Name) or node.body[0].lineno == node.lineno:
        return False
    if not _steps_loop(node.iter):  # `for x in list(tracer.iter[:])`: the loop is not the one that asked
        return False
    filename = frame.f_code.co_filename

    def build() -> CodeType | None:
        # Inside a loop of one item of its own, so `break` and `continue` end this pass as they would the loop's.
        once = ast.For(
            target=ast.Name(id="_nnd_pass", ctx=ast.Store()),
            iter=ast.Tuple(elts=[ast.Constant(value=None)], ctx=ast.Load()),
            body=node.body,
            orelse=[],
        )
        ast.copy_location(once, node)
        ast.fix_missing_locations(once)
        try:
            return _pyast.compile_tree(ast.Module(body=[once], type_ignores=[]), filename)
        except SyntaxError:  # `return` or `yield` only mean something inside the original function
            return None

    code = _compiled(node, "pass", build)
    if code is None:
        return False
    function, before, namespace = _namespace(frame)
    namespace[node.target.id] = value
    try:
        exec(code, namespace)  # noqa: S102 - the user's own loop body, in the user's process
    except stop:
        pass
    finally:
        namespace.pop("_nnd_pass", None)  # the wrapper's own name (a notebook's namespace is its globals)
    if function:
        _write_back(frame, namespace, before)
    return True


def _steps_loop(expr: ast.expr) -> bool:
    """Whether a `for` statement iterates a tracer's steps itself: `tracer.iter[...]`, `tracer.iter`,
    `tracer.all()` (any object's, as written)."""
    if isinstance(expr, ast.Call) and not expr.args and not expr.keywords:
        return isinstance(expr.func, ast.Attribute) and expr.func.attr == "all"
    if isinstance(expr, ast.Subscript):
        expr = expr.value
    return isinstance(expr, ast.Attribute) and expr.attr == "iter"


def _namespace(frame: FrameType) -> tuple[bool, dict[str, Any], dict[str, Any]]:
    """Where a body taken out of `frame` runs: (the frame is a function's, its locals before, the namespace).
    A function's names join its globals in one namespace, so comprehensions and lambdas in the body see
    them (`_write_back` returns what it rebinds); module code (a notebook cell) runs in its globals."""
    function = bool(frame.f_code.co_flags & _CO_OPTIMIZED)
    before = dict(frame.f_locals) if function else {}
    return function, before, ({**frame.f_globals, **before} if function else frame.f_globals)


def _write_back(frame: FrameType, namespace: dict[str, Any], before: dict[str, Any]) -> None:
    """Copy the names the body (re)bound into the function's frame."""
    local_names = set(frame.f_code.co_varnames) | set(frame.f_code.co_cellvars) | set(frame.f_code.co_freevars)
    changed = {k: v for k, v in namespace.items() if k in local_names and (k not in before or before[k] is not v)}
    if not changed:
        return
    if sys.version_info >= (3, 13):  # PEP 667: f_locals writes through to the fast locals
        for name, value in changed.items():
            frame.f_locals[name] = value
        return
    snapshot = frame.f_locals
    snapshot.update(changed)
    ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(frame), ctypes.c_int(0))


def _skip_body(frame: FrameType) -> Any:
    """Make the frame raise SkipBody on its next line (the body's first); returns the trace
    function that was set before, for `finish`."""
    previous = sys.gettrace()

    def skip(_frame: FrameType, _event: str, _arg: Any) -> Any:
        raise SkipBody

    if previous is None:
        sys.settrace(lambda *_: None)  # frame-local trace functions run only while some trace is set
    frame.f_trace = skip
    return previous


def finish(exc_type: type[BaseException] | None, previous: Any) -> bool:
    """In the loop's `__exit__` after run_per_step: restore tracing; True to swallow the skip signal."""
    if previous is None:
        sys.settrace(None)
    return exc_type is SkipBody
