"""Which fields of a graph node (graph.proto's Node) name other things of its request: node ids
(its own id, its arguments' refs, a gradient's value and backward), invoke indices (module
values, caches) and loop scopes.

This is the one list of them: reading a graph's references (`refs`) and moving a graph into a
merged request (`shift`, prepared.py) both walk it, so a new id-bearing field is added here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from nnd.v1 import graph_pb2


@dataclass(frozen=True)
class Offsets:
    """How far one request's numbers move in a merged request."""

    ids: int = 0
    invokes: int = 0
    scopes: int = 0


def args(node: graph_pb2.Node) -> Iterator[graph_pb2.Arg]:
    """The node's top-level arguments (each may hold refs, nested in tuples and lists)."""
    kind = node.WhichOneof("kind")
    if kind == "op":
        yield from node.op.args
        yield from node.op.kwargs.values()
    elif kind in ("save", "set", "skip"):
        yield getattr(node, kind).value
    elif kind == "backward":
        yield node.backward.loss
        if node.backward.HasField("gradient"):
            yield node.backward.gradient
    elif kind == "set_grad":
        yield node.set_grad.grad


def _arg_refs(arg: graph_pb2.Arg) -> Iterator[int]:
    kind = arg.WhichOneof("kind")
    if kind == "ref":
        yield arg.ref
    elif kind in ("tuple", "list"):
        for item in getattr(arg, kind).items:
            yield from _arg_refs(item)


def refs(node: graph_pb2.Node) -> Iterator[int]:
    """Every node id `node` refers to (arguments, gradients)."""
    kind = node.WhichOneof("kind")
    if kind in ("grad", "set_grad"):
        msg = getattr(node, kind)
        yield msg.value
        yield msg.backward
    for arg in args(node):
        yield from _arg_refs(arg)


def _shift_arg(arg: graph_pb2.Arg, by: int) -> None:
    kind = arg.WhichOneof("kind")
    if kind == "ref":
        arg.ref += by
    elif kind in ("tuple", "list"):
        for item in getattr(arg, kind).items:
            _shift_arg(item, by)


def _invoke_holders(node: graph_pb2.Node) -> Iterator[graph_pb2.ModuleValue | graph_pb2.Cache]:
    """The messages of `node` with an optional `invoke` (unset: every invoke)."""
    kind = node.WhichOneof("kind")
    if kind == "module":
        yield node.module
    elif kind in ("set", "skip"):
        yield getattr(node, kind).target
    elif kind == "cache":
        yield node.cache


def invokes(node: graph_pb2.Node) -> list[int | None]:
    """The invoke each of `node`'s module values (or its cache) names; None: every invoke."""
    return [h.invoke if h.HasField("invoke") else None for h in _invoke_holders(node)]


def shift(node: graph_pb2.Node, by: Offsets) -> None:
    """Move `node` (in place) to where its request starts in a merged one: ids, refs, invokes, scope."""
    node.id += by.ids
    if node.scope:  # 0 is the top level, shared by every request
        node.scope += by.scopes
    kind = node.WhichOneof("kind")
    if kind in ("grad", "set_grad"):
        msg = getattr(node, kind)
        msg.value += by.ids
        msg.backward += by.ids
    for arg in args(node):
        _shift_arg(arg, by.ids)
    for holder in _invoke_holders(node):
        if holder.HasField("invoke"):  # unset stays unset: it means the whole batch
            holder.invoke += by.invokes
