"""Graph checks and the static facts the executor needs, all before anything runs.

`build` validates a Graph (ids, refs, scopes, ops, module paths, invokes),
decodes its constants once, and rejects causality errors: a write whose value
is only computed later in the forward than the write's own hook. "Later" uses
what the module tree says for certain (order.py); whatever it cannot tell
the executor checks at run time, before the write happens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from nnd.v1 import graph_pb2

from .. import errors
from . import ops, order, wire
from .failures import where
from .order import POST, PRE, RESULT, HookKey

__all__ = ["POST", "PRE", "RESULT", "Const", "Plan", "PlanNode", "Ref", "Seq", "build"]


@dataclass(frozen=True)
class Ref:
    id: int


@dataclass(frozen=True)
class Const:
    value: Any


@dataclass(frozen=True)
class Seq:
    items: tuple[ArgSpec, ...]
    is_list: bool


ArgSpec = Ref | Const | Seq


@dataclass
class PlanNode:
    proto: graph_pb2.Node
    id: int
    scope: int
    kind: str  # module | constant | op | save | set | skip | stop
    refs: tuple[int, ...] = ()
    args: tuple[ArgSpec, ...] = ()
    kwargs: dict[str, ArgSpec] = field(default_factory=dict)
    op: ops.OpSpec | None = None
    # module / set / skip: the module value read or written, and the hook it happens at.
    target: graph_pb2.ModuleValue | None = None
    hook: str = ""  # PRE | POST | RESULT
    value: Any = None  # constant nodes: the decoded value
    const: bool = False  # derives from constants only (so it moves to where activations live)
    # The module-value nodes this value derives from, and (module nodes) the hook that binds it.
    sources: frozenset[int] = frozenset()
    key: HookKey | None = None
    alias_root: int | None = None  # the module node whose memory this value may share

    @property
    def invoke(self) -> int | None:
        t = self.target
        return t.invoke if t is not None and t.HasField("invoke") else None


@dataclass
class Plan:
    nodes: dict[int, PlanNode]
    scopes: list[graph_pb2.StepSelector]
    paths: set[str]  # modules that need hooks ("" always)
    has_stop: bool

    def scope_nodes(self, scope: int) -> list[int]:
        return [i for i, n in self.nodes.items() if n.scope == scope]


def _arg(arg: graph_pb2.Arg, node: graph_pb2.Node) -> ArgSpec:
    kind = arg.WhichOneof("kind")
    if kind == "ref":
        return Ref(arg.ref)
    if kind == "value":
        return Const(wire.decode_value(arg.value))
    if kind in ("tuple", "list"):
        return Seq(tuple(_arg(a, node) for a in getattr(arg, kind).items), kind == "list")
    raise errors.InvalidArgument(f"{where(node)}\nan argument has no kind set (ref, value, tuple or list)")


def _refs(spec: ArgSpec) -> list[int]:
    if isinstance(spec, Ref):
        return [spec.id]
    if isinstance(spec, Seq):
        return [r for item in spec.items for r in _refs(item)]
    return []


def _constant_bytes(graph: graph_pb2.Graph) -> int:
    total = 0

    def arg_bytes(arg: graph_pb2.Arg) -> int:
        kind = arg.WhichOneof("kind")
        if kind == "value":
            return wire.constant_bytes(arg.value)
        if kind in ("tuple", "list"):
            return sum(arg_bytes(a) for a in getattr(arg, kind).items)
        return 0

    for node in graph.nodes:
        kind = node.WhichOneof("kind")
        if kind == "constant":
            total += wire.constant_bytes(node.constant)
        elif kind == "op":
            total += sum(arg_bytes(a) for a in node.op.args) + sum(arg_bytes(a) for a in node.op.kwargs.values())
        elif kind in ("save", "set", "skip"):
            total += arg_bytes(getattr(node, kind).value)
    return total


class _Builder:
    def __init__(self, graph: graph_pb2.Graph, model: torch.nn.Module, n_invokes: int) -> None:
        self.graph = graph
        self.modules = dict(model.named_modules())
        self.containers = order.ordered_containers(model)
        self.n_invokes = n_invokes
        self.nodes: dict[int, PlanNode] = {}
        self.paths: set[str] = {""}

    def build(self) -> Plan:
        for s, scope in enumerate(self.graph.scopes):
            if scope.steps.WhichOneof("kind") is None:
                raise errors.InvalidArgument(f"scope {s + 1} has no step selector (all, range or steps)")
        last = -1
        for proto in self.graph.nodes:
            if proto.id <= last:
                raise errors.InvalidArgument(
                    f"{where(proto)}\nnode ids must be unique and strictly increasing: {proto.id} follows {last}"
                )
            last = proto.id
            self.nodes[proto.id] = self.node(proto)
        for node in self.nodes.values():
            self.check_causality(node)
        has_stop = any(n.kind == "stop" for n in self.nodes.values())
        return Plan(self.nodes, list(s.steps for s in self.graph.scopes), self.paths, has_stop)

    # -- one node

    def node(self, proto: graph_pb2.Node) -> PlanNode:
        kind = proto.WhichOneof("kind")
        if kind is None:
            raise errors.InvalidArgument(f"{where(proto)}\nnode {proto.id} has no kind set")
        if proto.scope > len(self.graph.scopes):
            raise errors.InvalidArgument(
                f"{where(proto)}\nnode {proto.id} is in scope {proto.scope} but the graph has "
                f"{len(self.graph.scopes)} loop scope(s)"
            )
        node = PlanNode(proto=proto, id=proto.id, scope=proto.scope, kind=kind)
        if kind == "module":
            self.module_value(node, proto.module, write=False)
        elif kind == "constant":
            node.value = wire.decode_value(proto.constant)
        elif kind == "op":
            node.op = ops.lookup(proto.op.name)
            node.args = tuple(_arg(a, proto) for a in proto.op.args)
            node.kwargs = {k: _arg(a, proto) for k, a in sorted(proto.op.kwargs.items())}
            if proto.op.name == "call_module":
                self.check_call_module(node)
        elif kind in ("save", "set", "skip"):
            effect = getattr(proto, kind)
            if not effect.HasField("value"):
                raise errors.InvalidArgument(f"{where(proto)}\n{kind} has no value")
            node.args = (_arg(effect.value, proto),)
            if kind != "save":
                if not effect.HasField("target"):
                    raise errors.InvalidArgument(f"{where(proto)}\n{kind} has no target module value")
                self.module_value(node, effect.target, write=True)
        refs = [r for spec in (*node.args, *node.kwargs.values()) for r in _refs(spec)]
        for r in refs:
            self.check_ref(node, r)
        node.refs = tuple(dict.fromkeys(refs))
        self.static_facts(node)
        return node

    def check_ref(self, node: PlanNode, ref: int) -> None:
        if ref >= node.id or ref not in self.nodes:
            raise errors.InvalidArgument(
                f"{where(node.proto)}\nnode {node.id} refers to node {ref}, which is not an earlier node of the graph"
            )
        scope = self.nodes[ref].scope
        if scope not in (0, node.scope):
            if node.scope == 0:
                detail = "a top-level node cannot use a value from inside a loop"
            else:
                detail = "nodes of one loop cannot use another loop's values"
            raise errors.InvalidArgument(f"{where(node.proto)}\n{detail} (node {ref}, {where(self.nodes[ref].proto)})")

    def module_value(self, node: PlanNode, mv: graph_pb2.ModuleValue, *, write: bool) -> None:
        proto = node.proto
        if mv.path not in self.modules:
            raise errors.NotFound(f"{where(proto)}\nthe model has no module {mv.path!r}")
        if mv.point == graph_pb2.POINT_UNSPECIFIED:
            raise errors.InvalidArgument(f"{where(proto)}\nmodule value of {mv.path!r} has no point set")
        if mv.point == graph_pb2.RESULT:
            if mv.path:
                raise errors.InvalidArgument(f"{where(proto)}\nRESULT is only defined for the root module (path '')")
            if write:
                raise errors.InvalidArgument(f"{where(proto)}\nthe request's result cannot be written")
        if mv.HasField("invoke") and not 0 <= mv.invoke < self.n_invokes:
            raise errors.InvalidArgument(
                f"{where(proto)}\ninvoke {mv.invoke} is out of range: the request has {self.n_invokes} invoke(s)"
            )
        if node.scope == 0 and mv.call < 0:
            raise errors.InvalidArgument(f"{where(proto)}\ncall index {mv.call} is negative")
        if node.kind == "skip" and mv.point != graph_pb2.OUTPUT:
            raise errors.InvalidArgument(f"{where(proto)}\nskip needs a module OUTPUT as its target")
        node.target = mv
        if mv.point == graph_pb2.RESULT:
            node.hook = RESULT
        elif node.kind == "skip":
            # A whole-batch skip replaces the forward, so it is decided at the pre-hook.
            node.hook = POST if mv.HasField("invoke") else PRE
        else:
            node.hook = POST if mv.point == graph_pb2.OUTPUT else PRE
        self.paths.add(mv.path)

    def check_call_module(self, node: PlanNode) -> None:
        first = node.args[0] if node.args else None
        if not isinstance(first, Const) or not isinstance(first.value, str):
            raise errors.InvalidArgument(f"{where(node.proto)}\ncall_module needs a module path string first")
        if first.value not in self.modules:
            raise errors.NotFound(f"{where(node.proto)}\nthe model has no module {first.value!r}")

    # -- static facts: sources, constness, aliasing

    def base_step(self, scope: int) -> int:
        if scope == 0:
            return 0
        sel = self.graph.scopes[scope - 1].steps
        kind = sel.WhichOneof("kind")
        if kind == "range" and sel.range.HasField("start"):
            return max(sel.range.start, 0)
        if kind == "steps" and sel.steps.steps:
            return min(sel.steps.steps)
        return 0

    def hook_key(self, node: PlanNode) -> HookKey:
        """The hook a module value is bound at, or a write happens at (loops: at their first step)."""
        assert node.target is not None
        return (node.target.path, node.hook, node.target.call + self.base_step(node.scope))

    def static_facts(self, node: PlanNode) -> None:
        inputs = [self.nodes[r] for r in node.refs]
        if node.target is not None:
            node.key = self.hook_key(node)
        if node.kind == "module":
            node.sources = frozenset((node.id,))
            node.alias_root = node.id
            return
        node.const = all(n.const for n in inputs) and node.kind in ("constant", "op")
        node.sources = frozenset().union(*(n.sources for n in inputs))
        if node.kind == "save" or (node.op is not None and node.op.aliases):
            first = node.args[0] if node.args else None
            if isinstance(first, Ref):
                node.alias_root = self.nodes[first.id].alias_root

    def later_source(self, node: PlanNode, than: HookKey) -> PlanNode | None:
        """A module value `node` needs that certainly exists only after hook `than`."""
        for s in sorted(node.sources):
            source = self.nodes[s]
            if source.key is not None and order.after(source.key, than, self.containers):
                return source
        return None

    def check_causality(self, node: PlanNode) -> None:
        if node.kind in ("set", "skip"):
            assert node.key is not None
            late = self.later_source(node, node.key)
            if late is not None:
                raise causality(node, late, "writes a value that is only computed later in the forward")
        elif node.op is not None and node.op.mutates and node.alias_root is not None:
            root = self.nodes[node.alias_root]
            if root.key is None or not root.key[0]:  # the model's own output: nothing downstream reads it
                return
            late = self.later_source(node, root.key)
            if late is not None:
                raise causality(
                    node,
                    late,
                    f"writes in place into the output of {root.key[0]!r} ({where(root.proto)}) after that "
                    "module has already run",
                )


def causality(node: PlanNode, late: PlanNode, what: str) -> errors.InvalidArgument:
    return errors.InvalidArgument(
        f"causality error: {where(node.proto)}\n{what}: it needs {where(late.proto)}, which is only "
        "available later in the forward pass. Compute the value from modules that run before the write.",
        exc_type="RuntimeError",
    )


def build(graph: graph_pb2.Graph, model: torch.nn.Module, n_invokes: int, max_constant_bytes: int = 0) -> Plan:
    if max_constant_bytes:
        size = _constant_bytes(graph)
        if size > max_constant_bytes:
            raise errors.ResourceExhausted(
                f"the graph's constants hold {size} bytes, over the limit max_constant_bytes={max_constant_bytes}"
            )
    return _Builder(graph, model, n_invokes).build()
