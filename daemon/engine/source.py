"""Operations inside a module's forward (nnsight's `.source`), for the daemon's own module classes.

A graph may name a value inside a module's forward: the module path plus an
operation name, e.g. `transformer.h.0.attn` + `attention_interface_1`. The
forward's source is parsed with `ast` and every call `f(a, b)` is rewritten
into `__nnd_op__("f_0", f, a, b)`, every assignment `x = e` into
`x = __nnd_op__("x_0", __nnd_bind__, e)`. Names follow nnsight 0.8.1 exactly
(the called function's dotted path joined with `_`, a per-name counter in
evaluation order, nested calls first), so notebooks move over unchanged.

Only library code is instrumented: module classes defined in transformers or
torch.nn (`TRUSTED`), whose source files the daemon's own environment holds;
never a class a client sent. The rewrite is compiled once per forward (cached
by code object). A request that names an operation gets a function built from
that code with its own `__nnd_op__` (a closure over the request's hooks) and
installs it as the module's instance `forward` for that request only (hooks.py);
unused operations call straight through. A module no request instruments runs
its class forward, untouched.

A nested name "a.b" (nnsight's `op.source`) is operation b inside the
function operation a calls: the callee is a value of the running forward, so
it is instrumented when the call runs (transformers and torch functions only).
"""

from __future__ import annotations

import ast
import difflib
import inspect
import textwrap
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import CellType, CodeType, FunctionType, MethodType
from typing import Any

import torch

from nnd.v1 import nnd_pb2

from .. import errors, pyast

OP = "__nnd_op__"
BIND = "__nnd_bind__"
_SHELL = "__nnd_shell__"
# Where a module class must come from to be instrumented: libraries the daemon runs anyway.
TRUSTED = ("transformers.", "torch.nn.")
# The infix of an operation's internal path ("transformer.h.0.attn.source.attention_interface_1"),
# as nnsight spells the address; used in error messages and for the hook tables.
INFIX = ".source."


def bind(value: Any) -> Any:
    """The callee of an instrumented assignment: the assigned value is the operation's output."""
    return value


@dataclass(frozen=True)
class Compiled:
    code: CodeType  # the instrumented forward
    names: tuple[str, ...]  # operation names, in evaluation order
    lines: dict[str, int]  # name -> 1-based line within `source`
    source: str  # the forward's dedented source text (decorator lines included, as nnsight shows it)


class _Instrument(ast.NodeTransformer):
    """nnsight 0.8.1's naming rules: calls and assignments share one counter per name; a node's
    operands are visited before the node takes its number."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.names: list[str] = []
        self.lines: dict[str, int] = {}

    @staticmethod
    def dotted(expr: ast.expr) -> tuple[list[str], bool]:
        parts: list[str] = []
        while True:
            if isinstance(expr, ast.Attribute):
                parts.append(expr.attr)
                expr = expr.value
            elif isinstance(expr, ast.Subscript):  # x[i].y names x.y: the index says where, not what
                expr = expr.value
            elif isinstance(expr, ast.Name):
                parts.append(expr.id)
                return parts[::-1], True
            else:
                return parts[::-1], False

    def wrap(self, name: str, fn: ast.expr, args: list[ast.expr], keywords: list[ast.keyword], at: ast.AST) -> ast.Call:
        n = self.counts.get(name, 0)
        self.counts[name] = n + 1
        label = f"{name}_{n}"
        self.names.append(label)
        self.lines[label] = at.lineno  # type: ignore[attr-defined]
        call = ast.Call(
            func=ast.Name(id=OP, ctx=ast.Load()), args=[ast.Constant(value=label), fn, *args], keywords=keywords
        )
        return ast.copy_location(call, at)

    def visit_Call(self, node: ast.Call) -> ast.AST:
        if isinstance(node.func, ast.Name) and node.func.id == "super" and not (node.args or node.keywords):
            return node  # zero-argument super() reads its frame: it must stay a direct call
        self.generic_visit(node)
        parts, _ = self.dotted(node.func)
        return self.wrap("_".join(parts) or "call", node.func, node.args, node.keywords, node)

    def bound(self, target: ast.expr, value: ast.expr, at: ast.AST) -> ast.expr:
        if isinstance(target, (ast.Tuple, ast.List)) and isinstance(value, (ast.Tuple, ast.List)):
            items = [*target.elts, *value.elts]
            if len(target.elts) == len(value.elts) and not any(isinstance(e, ast.Starred) for e in items):
                value.elts = [self.bound(t, v, at) for t, v in zip(target.elts, value.elts, strict=True)]
            return value
        parts, rooted = self.dotted(target)
        if not rooted:
            return value
        return self.wrap("_".join(parts), ast.Name(id=BIND, ctx=ast.Load()), [value], [], at)

    def visit_Assign(self, node: ast.Assign) -> ast.AST:
        node.value = self.visit(node.value)  # the value is evaluated before the targets
        node.targets = [self.visit(t) for t in node.targets]
        if len(node.targets) == 1:
            node.value = self.bound(node.targets[0], node.value, node)
        return node

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST:
        if node.value is not None:
            node.value = self.bound(node.target, self.visit(node.value), node)
        return node


_cache: dict[CodeType, Compiled] = {}
_lock = threading.Lock()


def _compile(func: FunctionType) -> Compiled:
    code = func.__code__
    try:
        lines, start = inspect.getsourcelines(code)
    except (OSError, TypeError) as e:
        raise errors.InvalidArgument(f"the forward of {func.__qualname__} has no Python source to instrument") from e
    text = textwrap.dedent("".join(lines))
    tree = pyast.parse(text)
    definition = tree.body[0]
    if not isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise errors.InvalidArgument(f"the forward of {func.__qualname__} is not a plain function")
    definition.decorator_list = []  # decorators are rebuilt around the result (`_rewrap`)
    rewriter = _Instrument()
    rewriter.visit(tree)
    # Compiled inside a shell whose parameters are the function's free variables, so they stay
    # free variables (bound to the original cells) instead of becoming globals.
    shell = ast.FunctionDef(
        name=_SHELL,
        args=ast.arguments(
            posonlyargs=[],
            args=[ast.arg(arg=name) for name in code.co_freevars],
            kwonlyargs=[],
            kw_defaults=[],
            defaults=[],
        ),
        body=[definition, ast.Return(value=ast.Name(id=definition.name, ctx=ast.Load()))],
        decorator_list=[],
    )
    tree.body[0] = ast.copy_location(shell, definition)
    ast.increment_lineno(tree, start - 1)  # tracebacks point at the library's real lines
    ast.fix_missing_locations(tree)
    module = pyast.compile_tree(tree, code.co_filename)
    shell_code = next(c for c in module.co_consts if isinstance(c, CodeType) and c.co_name == _SHELL)
    inner = next(c for c in shell_code.co_consts if isinstance(c, CodeType) and c.co_name == code.co_name)
    return Compiled(inner, tuple(rewriter.names), dict(rewriter.lines), text)


def _peel_index(wrapper: Any) -> int | None:
    """The closure cell of a decorator's wrapper that holds the function it calls, if exactly one."""
    code = getattr(wrapper, "__code__", None)
    if code is None or not code.co_freevars:
        return None
    try:
        lines, _ = inspect.getsourcelines(code)
        tree = pyast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return None
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    found = [
        i
        for i, (name, cell) in enumerate(zip(code.co_freevars, wrapper.__closure__, strict=True))
        if name in called and isinstance(_cell(cell), FunctionType)
    ]
    return found[0] if len(found) == 1 else None


def _cell(cell: CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


_peeled: dict[FunctionType, tuple[FunctionType, list[tuple[FunctionType, int]]]] = {}


def _peel(func: FunctionType) -> tuple[FunctionType, list[tuple[FunctionType, int]]]:
    """The function a (decorated) forward wraps, and the chain of wrappers; parsed once per forward."""
    found = _peeled.get(func)
    if found is None:
        found = _peeled[func] = _unwrap(func)
    return found


def _unwrap(func: FunctionType) -> tuple[FunctionType, list[tuple[FunctionType, int]]]:
    chain: list[tuple[FunctionType, int]] = []
    seen = {func}
    while (index := _peel_index(func)) is not None:
        chain.append((func, index))
        assert func.__closure__ is not None
        func = func.__closure__[index].cell_contents
        if func in seen:
            break
        seen.add(func)
    return func, chain


def _like(fn: FunctionType, code: CodeType, closure: tuple[CellType, ...] | None, glob: dict[str, Any]) -> FunctionType:
    new = FunctionType(code, glob, fn.__name__, fn.__defaults__, closure)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = fn.__qualname__
    return new


def _rewrap(chain: list[tuple[FunctionType, int]], inner: FunctionType) -> FunctionType:
    # Fresh closures: the wrappers belong to the class, shared by every instance.
    for wrapper, index in reversed(chain):
        assert wrapper.__closure__ is not None
        cells = list(wrapper.__closure__)
        cells[index] = CellType(inner)
        inner = _like(wrapper, wrapper.__code__, tuple(cells), wrapper.__globals__)
    return inner


def trusted(module: torch.nn.Module) -> bool:
    return type(module).__module__.startswith(TRUSTED)


def _forward(module: torch.nn.Module, where: str) -> FunctionType:
    cls = type(module)
    if not trusted(module):
        raise errors.InvalidArgument(
            f"{where}: `.source` instruments only module classes of transformers and torch.nn; "
            f"{cls.__module__}.{cls.__qualname__} is not one",
            exc_type="NotImplementedError",
        )
    forward = inspect.getattr_static(cls, "forward", None)
    if not isinstance(forward, FunctionType):
        raise errors.InvalidArgument(f"{where}: {cls.__qualname__}.forward is not a Python function")
    return forward


def compiled(module: torch.nn.Module, where: str = "this module") -> Compiled:
    """The module's instrumented forward (cached per forward's code object)."""
    inner, _ = _peel(_forward(module, where))
    return _compiled_function(inner, where)


OpCall = Callable[[str, Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]


def _compiled_function(inner: FunctionType, where: str) -> Compiled:
    with _lock:
        found = _cache.get(inner.__code__)
    if found is None:
        found = _compile(inner)
        with _lock:
            _cache[inner.__code__] = found
    return found


def _build(outer: FunctionType, on_op: OpCall, where: str) -> FunctionType:
    inner, chain = _peel(outer)
    result = _compiled_function(inner, where)

    def op(name: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        return on_op(name, fn, args, kwargs)

    cells = dict(zip(inner.__code__.co_freevars, inner.__closure__ or (), strict=True))
    closure = tuple(cells[name] for name in result.code.co_freevars) or None
    glob = {**inner.__globals__, OP: op, BIND: bind}
    return _rewrap(chain, _like(inner, result.code, closure, glob))


def instrumented(module: torch.nn.Module, on_op: OpCall, where: str = "this module") -> Callable[..., Any]:
    """The module's forward, bound to it, calling `on_op(name, fn, args, kwargs)` at every operation."""
    return MethodType(_build(_forward(module, where), on_op, where), module)


def _callee(fn: Any, where: str) -> tuple[FunctionType, Any]:
    """The library function an operation calls (and the object a method is bound to), for a nested
    `.source`: only plain Python functions of transformers or torch, never a module (it has its own)."""
    receiver = None
    if isinstance(fn, MethodType):
        fn, receiver = fn.__func__, fn.__self__
    if isinstance(fn, torch.nn.Module) or not isinstance(fn, FunctionType):
        raise errors.InvalidArgument(
            f"{where} calls {type(fn).__name__}, which has no Python source to instrument (a builtin, or a module: "
            "address a module's operations through its own path)",
            exc_type="NotImplementedError",
        )
    if not (getattr(fn, "__module__", None) or "").startswith(("transformers.", "torch.")):
        raise errors.InvalidArgument(
            f"{where} calls {fn.__module__}.{fn.__qualname__}; nested operations are available only inside "
            "functions of transformers and torch",
            exc_type="NotImplementedError",
        )
    return fn, receiver


def instrumented_call(fn: Any, on_op: OpCall, names: Iterable[str], where: str) -> Callable[..., Any]:
    """`fn` (the callee of an operation) instrumented like a forward (nnsight's `op.source`), after checking
    that it has the operations `names`."""
    func, receiver = _callee(fn, where)
    inner, _ = _peel(func)
    result = _compiled_function(inner, where)
    for name in names:
        if name not in result.names:
            close = difflib.get_close_matches(name, result.names, n=5, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise errors.NotFound(
                f"{where} calls {func.__qualname__}, which has no operation {name!r}{hint} "
                f"(its operations: {', '.join(result.names)})",
                exc_type="AttributeError",
            )
    built = _build(func, on_op, where)
    return MethodType(built, receiver) if receiver is not None else built


def site(path: str, op: str) -> str:
    """The internal path of an operation, as nnsight spells its address ("a.b", an operation b inside the
    function operation a calls, is "<path>.source.a.source.b")."""
    chain = INFIX.join(op.split("."))
    return f"{path}{INFIX}{chain}" if path else f"source.{chain}"


def check(module: torch.nn.Module, path: str, op: str, where: str) -> None:
    """Refuse an operation the module's forward does not have, naming the close ones. Of a nested
    operation ("a.b") only the first name is known before the call runs (the callee is a value)."""
    names = compiled(module, where).names
    op = op.split(".")[0]
    if op in names:
        return
    close = difflib.get_close_matches(op, names, n=5, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise errors.NotFound(
        f"{where}\nthe forward of {path or 'the model'!r} ({type(module).__name__}) has no operation {op!r}{hint} "
        f"(print `{path or 'model'}.source` for every name)",
        exc_type="AttributeError",
    )


def listing(module: torch.nn.Module, path: str) -> nnd_pb2.SourceInfo:
    """What a client prints as `module.source`: the forward's text and its operations."""
    found = compiled(module, repr(path))
    info = nnd_pb2.SourceInfo(path=path, type=type(module).__name__, source=found.source)
    for name in found.names:
        info.ops.add(name=name, line=found.lines[name])
    return info
