"""Tab completion of the module tree in IPython: `model.transformer.h[0].<TAB>`.

IPython's default completer is jedi, which never calls a `__getitem__` of a
live object that is not a builtin container; its fallback evaluator (the
`Completer.evaluation = "limited"` policy) walks `a.b[0].c` only through
objects whose `__getattr__`/`__getitem__` are Python's own. An envoy has
both, so neither reaches `h[0]`'s children. This matcher does the walk itself,
and only through envoys: a name from the user's namespace, then child, alias
and index steps looked up in the envoys' own tables. Nothing else is evaluated
(no properties, no calls, no other objects' code), so it is as side-effect
free as the "limited" policy, and it honours `evaluation = "minimal"` and
`"forbidden"` (no completion from the user's namespace).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable, Mapping
from typing import Any

from nnd.models._envoy import Envoy

# `name(.attr | [int] | ["key"])* .prefix` at the end of the text before the cursor, not itself
# the attribute of something else (`f(x).model.`, `"s".model.`).
_TAIL = re.compile(r"(?<![\w.)\]'\"])([A-Za-z_]\w*)((?:\.[A-Za-z_]\w*|\[[^\[\]]*\])*)\.(\w*)$")
_STEP = re.compile(r"\.([A-Za-z_]\w*)|\[\s*(-?\d+)\s*\]|\[\s*(?:'([^'\\]*)'|\"([^\"\\]*)\")\s*\]")
_NO_NAMESPACE = frozenset({"forbidden", "minimal"})  # IPython's policies that may not read the user's names


def _named(env: Envoy, name: str) -> Envoy | None:
    """`env.name` when that is a module: children, then aliases, as `Envoy.__getattr__` finds them (only
    when the class and the instance have no such attribute: `h.output` is the property, not a child)."""
    if hasattr(type(env), name) or name in vars(env):
        return None
    child = env._children.get(name)  # not `or`: an envoy without children is falsy (len 0)
    return child if child is not None else env._aliases.get(name)


def _step(env: Envoy, match: re.Match[str]) -> Envoy | None:
    name, index, key1, key2 = match.groups()
    if name is not None:
        return _named(env, name)
    if index is not None:
        children = list(env._children.values())
        i = int(index)
        return children[i] if -len(children) <= i < len(children) else None
    key = key1 if key1 is not None else key2
    child = env._children.get(key)
    return child if child is not None else _named(env, key)  # as `Envoy.__getitem__` with a str


def resolve(root: str, steps: str, namespaces: Iterable[Mapping[str, Any]]) -> Envoy | None:
    """The envoy that `root` + `steps` (".transformer.h[0]") names, or None."""
    for namespace in namespaces:
        if root in namespace:
            obj = namespace[root]
            break
    else:
        return None
    if not issubclass(type(obj), Envoy):  # type(), not isinstance: not even a proxy's `__class__` runs
        return None
    env: Envoy | None = obj
    pos = 0
    while env is not None and pos < len(steps):
        match = _STEP.match(steps, pos)
        if match is None:
            return None
        env, pos = _step(env, match), match.end()
    return env


def _kind(env: Envoy, name: str) -> str:
    attr = inspect.getattr_static(type(env), name, None)
    if attr is None:
        return "instance"  # a module
    return "property" if isinstance(attr, property) else "function" if callable(attr) else "instance"


def complete(text_before_cursor: str, namespaces: Iterable[Mapping[str, Any]]) -> tuple[str, list[tuple[str, str]]]:
    """(the prefix typed after the last dot, [(name, kind)]) for an envoy expression; ("", []) otherwise.
    Private names are left to IPython's own completion."""
    match = _TAIL.search(text_before_cursor)
    if match is None:
        return "", []
    root, steps, prefix = match.groups()
    if prefix.startswith("_"):
        return "", []
    env = resolve(root, steps, namespaces)
    if env is None:
        return "", []
    return prefix, [(name, _kind(env, name)) for name in dir(env) if name.startswith(prefix)]


def matcher(completer: Any) -> Any:
    """An IPython (>= 8.6) completion matcher, API v2, for `completer` (the shell's IPCompleter)."""
    from IPython.core.completer import SimpleCompletion, completion_matcher

    @completion_matcher(identifier="nnd.envoys", api_version=2)
    def nnd_envoys(context: Any) -> dict[str, Any]:
        if getattr(completer, "evaluation", "limited") in _NO_NAMESPACE:
            return {"completions": []}
        namespaces = [ns for ns in (completer.namespace, completer.global_namespace) if ns is not None]
        prefix, names = complete(context.text_until_cursor, namespaces)
        return {
            "completions": [SimpleCompletion(name, type=kind) for name, kind in names],
            "matched_fragment": prefix,
            # What jedi and IPython's evaluator offer here is wrong (a list's methods, file names for "."), or
            # a subset of this (the class's methods without the children).
            "suppress": bool(names),
        }

    return nnd_envoys
