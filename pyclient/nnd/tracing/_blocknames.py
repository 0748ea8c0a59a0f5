"""Which of the caller's names a `with` block's body can hand a value to.

After a block, saved proxies held by the user's names become real values. Walking
every name and container of the caller's frame for them makes a block's cost grow
with the notebook (a global list of 10^5 floats made a trace 15x slower), so the
client reads the body's code once per call site instead: the names it binds
(`h = ...save()`, `for`, `as`, `:=`, augmented assignments) are rebound, and the
names whose containers it fills (`hs.append(h)`, `out["h"] = h`,
`table["a"].extend(...)`) are the outer containers whose new items are replaced.
Nothing else the frame holds is looked at.

A list the body only appends to or extends (directly: `hs.append(...)`) is walked
from the length it had when the block opened: its older items are data the block
did not create.

When the source cannot be read (code typed at a bare prompt, `exec` of a string)
or shows no `with` at the frame's line, the caller falls back to looking at
every name, as before.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from types import CodeType, FrameType

from nnd.tracing._withbody import with_statement

# Methods that put a value into the container they are called on.
_FILLING = frozenset({"append", "extend", "insert", "update", "setdefault", "add", "__setitem__"})
_APPENDING = frozenset({"append", "extend"})


@dataclass(frozen=True)
class BlockNames:
    """What one `with` statement's body does to the caller's names."""

    bound: frozenset[str]
    """Names the body (re)binds: rebound to real values after the block."""
    filled: frozenset[str]
    """Names of containers the body puts values into: their new items are replaced after the block."""
    append_only: frozenset[str]
    """Of `filled`, those the body only appends to or extends (walked from their length at the open)."""
    targets: frozenset[str] = frozenset()
    """The `with` statement's own `as` names (bound by the statement, not by its body)."""
    attributes: tuple[tuple[str, str], ...] = ()
    """(name, attribute) of each `name.attribute = ...` in the body: the object's attribute is filled."""


_cache: dict[tuple[CodeType, int], BlockNames | None] = {}


def of(frame: FrameType) -> BlockNames | None:
    """The names of the `with` statement `frame` is entering now (its current line is in the
    header); None when the source cannot be read or shows no `with` there (a block nnd opens
    itself, a file changed since it was imported): then every name is looked at. Cached per
    call site."""
    key = (frame.f_code, frame.f_lineno)
    try:
        return _cache[key]
    except KeyError:
        pass
    names = _compute(frame)
    if len(_cache) > 4096:  # a notebook's cells come and go: keep the cache bounded
        _cache.clear()
    _cache[key] = names
    return names


def _compute(frame: FrameType) -> BlockNames | None:
    found = with_statement(frame)
    return None if found is None else _names(found)


def _root(node: ast.expr) -> str | None:
    """`results` of `results`, `results["a"]`, `results.x[0]`."""
    while isinstance(node, ast.Subscript | ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _names(statement: ast.With) -> BlockNames:
    bound: set[str] = set()
    filled: set[str] = set()
    other_fill: set[str] = set()
    targets: set[str] = set()
    attributes: set[tuple[str, str]] = set()
    for item in statement.items:  # `with model.trace() as tracer`: the tracer, not a value, but harmless
        if item.optional_vars is not None:
            targets.update(n.id for n in ast.walk(item.optional_vars) if isinstance(n, ast.Name))
    bound |= targets
    for stmt in statement.body:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store | ast.Del):
                bound.add(node.id)
            elif isinstance(node, ast.Import | ast.ImportFrom):
                bound.update((alias.asname or alias.name).partition(".")[0] for alias in node.names)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                bound.add(node.name)
            elif isinstance(node, ast.Subscript | ast.Attribute) and isinstance(node.ctx, ast.Store | ast.Del):
                root = _root(node)
                if root is not None:
                    filled.add(root)
                    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                        attributes.add((node.value.id, node.attr))
                    other_fill.add(root)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _FILLING:
                root = _root(node.func.value)
                if root is None:
                    continue
                filled.add(root)
                direct = isinstance(node.func.value, ast.Name)
                if not (direct and node.func.attr in _APPENDING):
                    other_fill.add(root)
            elif isinstance(node, ast.Global | ast.Nonlocal):
                bound.update(node.names)
    return BlockNames(
        frozenset(bound),
        frozenset(filled),
        frozenset(filled - other_fill - bound),
        frozenset(targets),
        tuple(sorted(attributes)),
    )
