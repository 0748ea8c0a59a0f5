"""Printing a module tree the way torch prints modules."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class Node(Protocol):
    _type: str
    _extra: str

    def _child_items(self) -> Iterable[tuple[str, Node]]: ...


def _indent(text: str, spaces: int) -> str:
    lines = text.split("\n")
    if len(lines) == 1:
        return text
    return lines[0] + "\n" + "\n".join(" " * spaces + line for line in lines[1:])


def render(node: Node) -> str:
    """torch's `Module.__repr__`: extra_repr then `(name): child`; a
    ModuleList collapses runs of identical children to `(0-11): 12 x Block(...)`."""
    children = list(node._child_items())
    if node._type == "ModuleList" and children:
        return _render_list(node._type, [render(child) for _, child in children])
    extra = node._extra.split("\n") if node._extra else []
    child_lines = [f"({name}): {_indent(render(child), 2)}" for name, child in children]
    lines = extra + child_lines
    out = node._type + "("
    if lines:
        if len(extra) == 1 and not child_lines:
            out += extra[0]
        else:
            out += "\n  " + "\n  ".join(lines) + "\n"
    return out + ")"


def _render_list(type_name: str, reprs: list[str]) -> str:
    runs: list[tuple[int, int, str]] = []
    for i, text in enumerate(reprs):
        if runs and runs[-1][2] == text:
            start, _, _ = runs[-1]
            runs[-1] = (start, i, text)
        else:
            runs.append((i, i, text))
    lines = []
    for start, end, text in runs:
        line = f"({start}): {text}" if start == end else f"({start}-{end}): {end - start + 1} x {text}"
        lines.append(_indent(line, 2))
    return type_name + "(\n  " + "\n  ".join(lines) + "\n)"
