"""`nnd tree`: a module tree as the daemon describes it (ModuleInfo list), printed
as torch prints the module, by the same printer as `print(model)` (`_printing.py`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from nnd.models import _printing


@dataclass
class _Node:
    """One module, shaped as `_printing.Node`."""

    _type: str
    _extra: str
    children: list[tuple[str, _Node]] = field(default_factory=list)

    def _child_items(self) -> Iterable[tuple[str, _Node]]:
        return self.children


def render(modules: Iterable[Any]) -> str:
    """The tree as text, starting at the root module ("" without one)."""
    nodes: dict[str, _Node] = {}
    for m in modules:  # parents come before their children (named_modules order)
        node = nodes[m.path] = _Node(m.type, m.extra)
        parent, _, name = m.path.rpartition(".")
        if m.path and parent in nodes:
            nodes[parent].children.append((name, node))
    root = nodes.get("")
    return _printing.render(root) if root is not None else ""
