"""Render a module tree (ModuleInfo list from the daemon) as torch prints a
module, with repeated ModuleList entries collapsed: `(0-11): 12 x GPT2Block(`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def _children(modules: Iterable[Any]) -> tuple[dict[str, Any], dict[str, list[str]]]:
    by_path = {m.path: m for m in modules}
    kids: dict[str, list[str]] = {p: [] for p in by_path}
    for path in by_path:
        if path:
            parent = path.rpartition(".")[0]
            kids.setdefault(parent, []).append(path)
    return by_path, kids


def render(modules: Iterable[Any]) -> str:
    """The tree as text, starting at the root module."""
    by_path, kids = _children(modules)
    if "" not in by_path:
        return ""

    def body(path: str) -> list[str]:
        mod = by_path[path]
        children = kids.get(path, [])
        if not children:
            return [f"{mod.type}({mod.extra})"]
        lines = [f"{mod.type}("]
        rendered = [(c.rpartition(".")[2], body(c)) for c in children]
        i = 0
        while i < len(rendered):
            name, text = rendered[i]
            j = i
            # Collapse runs of identical numbered children, as torch does.
            while (
                name.isdigit() and j + 1 < len(rendered) and rendered[j + 1][1] == text and rendered[j + 1][0].isdigit()
            ):
                j += 1
            label = f"({name}-{rendered[j][0]}): {j - i + 1} x " if j > i else f"({name}): "
            lines.append("  " + label + text[0])
            lines.extend("  " + line for line in text[1:])
            i = j + 1
        lines.append(")")
        return lines

    return "\n".join(body(""))
