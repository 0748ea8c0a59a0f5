"""Graph checks and the static facts the executor needs, all before anything runs.

`build` validates a Graph (ids, refs, scopes, ops, module paths, invokes),
decodes its constants once, and rejects causality errors: a write whose value
is only computed later in the forward than the write's own hook. "Later" uses
what the module tree says for certain (order.py); whatever it cannot tell
the executor checks at run time, before the write happens.

Stored edits are planned as a prefix of the graph: their nodes get negative
ids (in order), so they run before the request's own nodes at every hook and
the request's ids (and saved values) stay as the client wrote them. In a
session, nodes of earlier traces the graph refers to are "external" nodes:
values that exist from the start, placed like constants.

Gradients: a Backward node runs once its loss exists; Grad nodes are bound,
and SetGrad nodes applied, when autograd reaches their value. Before anything
runs the plan rejects gradients that cannot exist (of a value computed from
constants, or after / from the loss) and SetGrads that need a gradient only
computed later in the backward pass.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from nnd.v1 import graph_pb2

from .. import errors
from . import modules, nodeids, ops, order, rows, source, weights, wire
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
    kind: str  # module | tensor | constant | op | save | set | skip | stop | backward | grad | set_grad | cache | external
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
    weight: int | None = None  # the tensor node (a model weight) whose memory this value may share
    # grad / set_grad: the node whose gradient, and the Backward node; other nodes: the Grad nodes they derive from.
    grad_of: int | None = None
    backward: int | None = None
    grads: frozenset[int] = frozenset()
    # op nodes: an argument may hold a constant tensor, which the executor moves beside the activations.
    places: bool = False

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
    # Backward node -> {node whose gradient: [Grad and SetGrad node ids, in id order]}.
    grads: dict[int, dict[int, list[int]]] = field(default_factory=dict)
    # Module nodes whose tensors must require grad (the sources of every gradient asked for).
    grad_sources: set[int] = field(default_factory=set)
    # What planned it: a running interactive request adds nodes through it (`extend`).
    builder: Any = None
    # Operations inside a forward the graph names: internal path -> (module path, operation name).
    ops: dict[str, tuple[str, str]] = field(default_factory=dict)
    _by_scope: tuple[int, dict[int, tuple[tuple[int, ...], tuple[int, ...]]]] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    # Held by the plan cache and handed to every run of its graph: never changed (`extended` forks it).
    shared: bool = field(default=False, init=False, repr=False, compare=False)
    # A shared plan's additions after a sync point, planned once: (graph bytes, constant limit) -> (plan, nodes).
    _extensions: dict[tuple[bytes, int], tuple[Plan, list[PlanNode]]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _pauses: int = field(default=0, init=False, repr=False, compare=False)  # shared additions it was grown by
    # The cached plan a shared fork grew from (None: this is it), and how many forks that one shares in all.
    _root: Plan | None = field(default=None, init=False, repr=False, compare=False)
    _shared_forks: int = field(default=0, init=False, repr=False, compare=False)

    def extended(self, graph: graph_pb2.Graph, max_constant_bytes: int = 0) -> tuple[Plan, list[PlanNode]]:
        """This plan with the nodes a sync point's message adds, and those nodes. A plan of one run grows in
        place. A shared plan stays as it is: the run goes on with a fork that has them, and the same
        addition to it (a block repeated with its sync point: a sweep) is planned once, the fork shared
        in turn (its nodes hold no tensor a run could change)."""
        if not self.shared:
            return self, self.extend(graph, max_constant_bytes)
        key = (graph.SerializeToString(deterministic=True), max_constant_bytes)
        found = self._extensions.get(key)
        if found is not None:
            return found
        grown = self.fork()
        added = grown.extend(graph, max_constant_bytes)
        grown._pauses = self._pauses + 1
        # Each shared fork holds its own tables for as long as the cached plan stays cached: a block pausing
        # at every step of a long generation would keep one per step, and clients sending ever other
        # additions one per addition. So only a block's first few pauses are shared, and a few forks in all.
        root = self._root or self
        if (
            grown._pauses <= MAX_SHARED_PAUSES
            and root._shared_forks < MAX_EXTENSIONS
            and len(key[0]) <= MAX_SHARED_GRAPH_BYTES
            and reusable(added)
        ):
            root._shared_forks += 1
            grown.shared, grown._root = True, root
            self._extensions[key] = (grown, added)
        return grown, added

    def extend(self, graph: graph_pb2.Graph, max_constant_bytes: int = 0) -> list[PlanNode]:
        """Validate and plan nodes added to a running request (after a sync point)."""
        assert self.builder is not None
        if max_constant_bytes:
            size = _constant_bytes(graph)
            if size > max_constant_bytes:
                raise errors.ResourceExhausted(
                    f"the added nodes' constants hold {size} bytes, over the limit "
                    f"max_constant_bytes={max_constant_bytes}"
                )
        added = self.builder.extend(graph)
        self.has_stop = self.has_stop or any(n.kind == "stop" for n in added)
        return added

    def fork(self) -> Plan:
        """A copy that `extend` may add to while this plan stays as it is (a cached plan handed to a
        run that may pause: its sync points add nodes). The nodes themselves are shared: nothing
        changes a node once it is planned."""
        builder = copy.copy(self.builder)
        builder.nodes = dict(self.nodes)
        builder.scopes = list(self.scopes)
        builder.paths = set(self.paths)
        builder.ops = dict(self.ops)
        builder.grads = {b: {t: list(ids) for t, ids in of.items()} for b, of in self.grads.items()}
        builder.grad_sources = set(self.grad_sources)
        builder._depends = dict(builder._depends)
        return Plan(
            builder.nodes, builder.scopes, builder.paths, self.has_stop, builder.grads, builder.grad_sources, builder,
            builder.ops,
        )

    @property
    def backwards(self) -> int:
        """How many backward passes the request runs."""
        return sum(1 for n in self.nodes.values() if n.kind == "backward")

    @property
    def needs_grad(self) -> bool:
        # A gradient is read or replaced, or a backward pass reaches client tensors (Param nodes).
        return bool(self.grads) or (self.backwards > 0 and any(n.kind == "param" for n in self.nodes.values()))

    def frame_nodes(self, scope: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """What a frame of `scope` starts with: the nodes it waits for (all but stops, caches and
        externals), and of those the ones it runs itself (RUNNABLE), in id order. Grouped once per
        plan size and kept with the plan, which a repeated request reuses: every step of a generation
        asks for its loops' nodes, and nodes are only ever added (`extend`)."""
        memo = self._by_scope
        if memo is None or memo[0] != len(self.nodes):
            by: dict[int, list[int]] = {}
            for i, n in self.nodes.items():
                by.setdefault(n.scope, []).append(i)
            memo = self._by_scope = (len(self.nodes), {s: self._frame_nodes(ids) for s, ids in by.items()})
        return memo[1].get(scope, ((), ()))

    def _frame_nodes(self, ids: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        pending = tuple(i for i in ids if self.nodes[i].kind not in ("stop", "cache", "external"))
        return pending, tuple(sorted(i for i in pending if self.nodes[i].kind in RUNNABLE))


# Node kinds the executor runs itself once their inputs exist (the others are bound at hooks, or are effects).
RUNNABLE = ("tensor", "constant", "param", "op", "save", "backward")
# A cached plan and the forks it shares keep at most this many additions in all (a block's sync points add
# the same nodes each run), each of a graph at most this big, for a block's first MAX_SHARED_PAUSES pauses.
MAX_EXTENSIONS = 8
MAX_SHARED_GRAPH_BYTES = 1 << 20
MAX_SHARED_PAUSES = 4


def reusable(nodes: Iterable[PlanNode]) -> bool:
    """Whether runs may share these planned nodes: none is an earlier trace's value (a session's), and
    no constant holds a tensor (an in-place op on it would change the next run's constant)."""
    for node in nodes:
        if node.kind == "external" or rows.first_tensor(node.value) is not None:
            return False
        specs = (*node.args, *node.kwargs.values())
        if any(_spec_tensor(spec) for spec in specs):
            return False
    return True


def _spec_tensor(spec: ArgSpec) -> bool:
    if isinstance(spec, Const):
        return rows.first_tensor(spec.value) is not None
    if isinstance(spec, Seq):
        return any(_spec_tensor(item) for item in spec.items)
    return False


IdMap = Callable[[int], int]
_NOWHERE = -(2**62)  # where an edit's reference to a node it does not hold points: no node


def _same(i: int) -> int:
    return i


def _arg(arg: graph_pb2.Arg, node: graph_pb2.Node, ids: IdMap = _same) -> ArgSpec:
    kind = arg.WhichOneof("kind")
    if kind == "ref":
        return Ref(ids(arg.ref))
    if kind == "value":
        return Const(wire.decode_value(arg.value))
    if kind in ("tuple", "list"):
        return Seq(tuple(_arg(a, node, ids) for a in getattr(arg, kind).items), kind == "list")
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
        elif kind == "param":
            total += wire.constant_bytes(node.param.value)
        elif kind == "op":
            total += sum(arg_bytes(a) for a in node.op.args) + sum(arg_bytes(a) for a in node.op.kwargs.values())
        elif kind in ("save", "set", "skip"):
            total += arg_bytes(getattr(node, kind).value)
    return total


class _Builder:
    def __init__(
        self,
        graph: graph_pb2.Graph,
        model: torch.nn.Module,
        n_invokes: int,
        edits: Sequence[graph_pb2.Graph] = (),
        external: Mapping[int, Any] | None = None,
    ) -> None:
        self.graph = graph
        self.edits = list(edits)
        self.external = dict(external or {})
        self.modules = modules.table(model)
        self.containers = modules.containers(model)
        self.n_invokes = n_invokes
        self.nodes: dict[int, PlanNode] = {}
        self.paths: set[str] = {""}
        self.ops: dict[str, tuple[str, str]] = {}
        # Every part's loop scopes, edits' first; a part's scope k is scopes[offset + k - 1].
        self.scopes: list[graph_pb2.StepSelector] = []
        self.grads: dict[int, dict[int, list[int]]] = {}
        self.grad_sources: set[int] = set()
        self._depends: dict[int, frozenset[int]] = {}
        self.request_offset = 0  # the request's scope k is scopes[request_offset + k - 1]

    def build(self) -> Plan:
        for ext_id, value in sorted(self.external.items()):
            proto = graph_pb2.Node(id=ext_id)
            self.nodes[ext_id] = PlanNode(
                proto=proto, id=ext_id, scope=0, kind="external", value=value, const=True, alias_root=None
            )
        next_edit_id = -sum(len(g.nodes) for g in self.edits)
        for graph in self.edits:
            ids: dict[int, int] = {}
            for proto in graph.nodes:
                ids[proto.id] = next_edit_id
                next_edit_id += 1
            self.add_part(graph, lambda i, m=ids: m.get(i, _NOWHERE), edit=True)  # type: ignore[misc]
        self.add_part(self.graph, _same, edit=False)
        self.whole_skips()
        for node in self.nodes.values():
            self.check_causality(node)
        has_stop = any(n.kind == "stop" for n in self.nodes.values())
        return Plan(self.nodes, self.scopes, self.paths, has_stop, self.grads, self.grad_sources, self, self.ops)

    def extend(self, graph: graph_pb2.Graph) -> list[PlanNode]:
        """Nodes (and loop scopes, numbered after the request's earlier ones) added to a running request."""
        top = max(self.nodes, default=0)
        for s, scope in enumerate(graph.scopes):
            if scope.steps.WhichOneof("kind") is None:
                raise errors.InvalidArgument(f"added scope {s + 1} has no step selector (all, range or steps)")
            self.scopes.append(scope.steps)
        request_scopes = len(self.scopes) - self.request_offset
        added: list[PlanNode] = []
        for proto in graph.nodes:
            if proto.id <= top:
                raise errors.InvalidArgument(
                    f"{where(proto)}\nnodes added to a running request need ids above every earlier node's "
                    f"({proto.id} follows {top})"
                )
            top = proto.id
            if proto.scope > request_scopes:
                raise errors.InvalidArgument(
                    f"{where(proto)}\nnode {proto.id} is in scope {proto.scope} but the request has "
                    f"{request_scopes} loop scope(s)"
                )
            scope = proto.scope + self.request_offset if proto.scope else 0
            node = self.node(proto, proto.id, scope)
            self.nodes[node.id] = node
            added.append(node)
        for node in added:
            self.check_causality(node)
        return added

    def whole_skips(self) -> None:
        """Per-invoke skips of one call that cover every invoke skip the forward itself (nnsight's
        batched skip): they move to the pre-hook, and the module and its children never run.
        Skips of only some invokes stay row writes at the post-hook (the module runs)."""
        groups: dict[tuple[int, str, int], list[PlanNode]] = {}
        for node in self.nodes.values():
            if node.kind == "skip" and node.invoke is not None and node.target is not None:
                groups.setdefault((node.scope, node.target.path, node.target.call), []).append(node)
        for nodes in groups.values():
            if {n.invoke for n in nodes} == set(range(self.n_invokes)):
                for n in nodes:
                    n.hook = PRE

    def add_part(self, graph: graph_pb2.Graph, ids: IdMap, *, edit: bool) -> None:
        offset = len(self.scopes)
        if not edit:
            self.request_offset = offset
        for s, scope in enumerate(graph.scopes):
            if scope.steps.WhichOneof("kind") is None:
                raise errors.InvalidArgument(f"scope {s + 1} has no step selector (all, range or steps)")
            self.scopes.append(scope.steps)
        last: int | None = None
        for proto in graph.nodes:
            if last is not None and proto.id <= last:
                raise errors.InvalidArgument(
                    f"{where(proto)}\nnode ids must be unique and strictly increasing: {proto.id} follows {last}"
                )
            if not edit and proto.id in self.external:
                raise errors.InvalidArgument(
                    f"{where(proto)}\nnode id {proto.id} is already used by an earlier trace of the session"
                )
            last = proto.id
            if proto.scope > len(graph.scopes):
                raise errors.InvalidArgument(
                    f"{where(proto)}\nnode {proto.id} is in scope {proto.scope} but the graph has "
                    f"{len(graph.scopes)} loop scope(s)"
                )
            scope = proto.scope + offset if proto.scope else 0
            node = self.node(proto, ids(proto.id), scope, ids)
            self.nodes[node.id] = node

    # -- one node

    def node(self, proto: graph_pb2.Node, node_id: int, scope: int, ids: IdMap = _same) -> PlanNode:
        kind = proto.WhichOneof("kind")
        if kind is None:
            raise errors.InvalidArgument(f"{where(proto)}\nnode {proto.id} has no kind set")
        node = PlanNode(proto=proto, id=node_id, scope=scope, kind=kind)
        if kind == "module":
            self.module_value(node, proto.module, write=False)
        elif kind == "tensor":
            weights.check(self.modules, proto.tensor, where(proto))
        elif kind == "constant":
            node.value = wire.decode_value(proto.constant)
        elif kind == "param":
            node.value = wire.decode_value(proto.param.value)
            if not isinstance(node.value, torch.Tensor) or not node.value.is_floating_point():
                raise errors.InvalidArgument(f"{where(proto)}\na param must be a floating tensor")
            if node.scope != 0:
                raise errors.InvalidArgument(f"{where(proto)}\na param is a top-level node (not in a loop scope)")
        elif kind == "op":
            node.op = ops.lookup(proto.op.name)
            node.args = tuple(_arg(a, proto, ids) for a in proto.op.args)
            node.kwargs = {k: _arg(a, proto, ids) for k, a in sorted(proto.op.kwargs.items())}
            if proto.op.name == "call_module":
                self.check_call_module(node)
        elif kind in ("save", "set", "skip"):
            effect = getattr(proto, kind)
            if not effect.HasField("value"):
                raise errors.InvalidArgument(f"{where(proto)}\n{kind} has no value")
            node.args = (_arg(effect.value, proto, ids),)
            if kind != "save":
                if not effect.HasField("target"):
                    raise errors.InvalidArgument(f"{where(proto)}\n{kind} has no target module value")
                self.module_value(node, effect.target, write=True)
        elif kind == "backward":
            if not proto.backward.HasField("loss"):
                raise errors.InvalidArgument(f"{where(proto)}\nbackward has no loss")
            node.args = (_arg(proto.backward.loss, proto, ids),)
            if proto.backward.HasField("gradient"):
                node.args += (_arg(proto.backward.gradient, proto, ids),)
        elif kind in ("grad", "set_grad"):
            msg = getattr(proto, kind)
            node.grad_of, node.backward = ids(msg.value), ids(msg.backward)
            if kind == "set_grad":
                if not msg.HasField("grad"):
                    raise errors.InvalidArgument(f"{where(proto)}\nsetting a gradient needs a value")
                node.args = (_arg(msg.grad, proto, ids),)
        elif kind == "cache":
            self.cache(node)
        refs = [r for spec in (*node.args, *node.kwargs.values()) for r in _refs(spec)]
        if node.grad_of is not None and node.backward is not None:
            refs = [node.grad_of, node.backward, *refs]
        for r in refs:
            self.check_ref(node, r)
        node.refs = tuple(dict.fromkeys(refs))
        if kind in ("backward", "grad", "set_grad") and scope != 0:
            raise errors.InvalidArgument(
                f"{where(proto)}\ngradients exist only in a trace: a backward pass cannot run inside a loop "
                "over generation steps"
            )
        if kind in ("grad", "set_grad"):
            self.grad_node(node)
        self.static_facts(node)
        return node

    def cache(self, node: PlanNode) -> None:
        spec = node.proto.cache
        if node.scope != 0:
            raise errors.InvalidArgument(
                f"{where(node.proto)}\na cache records the whole request; open it at top level"
            )
        for path in spec.modules:
            if path not in self.modules:
                raise errors.NotFound(f"{where(node.proto)}\nthe model has no module {path!r} to cache")
        if not spec.outputs and not spec.inputs:
            raise errors.InvalidArgument(f"{where(node.proto)}\na cache needs outputs, inputs or both")
        if spec.dtype:
            wire.to_torch_dtype(spec.dtype)
        if spec.device:
            try:
                torch.device(spec.device)
            except (RuntimeError, ValueError):
                raise errors.InvalidArgument(f"{where(node.proto)}\nunknown device {spec.device!r}") from None
        self.paths.update(spec.modules or self.modules)

    def grad_node(self, node: PlanNode) -> None:
        assert node.grad_of is not None and node.backward is not None
        backward = self.nodes[node.backward]
        if backward.kind != "backward":
            raise errors.InvalidArgument(
                f"{where(node.proto)}\nnode {node.backward} is not a backward pass ({where(backward.proto)})"
            )
        target = self.nodes[node.grad_of]
        self.grads.setdefault(backward.id, {}).setdefault(target.id, []).append(node.id)
        self.grad_sources.update(target.sources)

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
        if mv.point not in graph_pb2.Point.values():  # proto3 keeps unknown enum numbers
            raise errors.InvalidArgument(f"{where(proto)}\nmodule value of {mv.path!r} has an unknown point {mv.point}")
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
        if mv.op:
            mv = self.op_value(node, mv)
        node.target = mv
        if mv.point == graph_pb2.RESULT:
            node.hook = RESULT
        elif node.kind == "skip":
            # A whole-batch skip replaces the forward, so it is decided at the pre-hook.
            node.hook = POST if mv.HasField("invoke") else PRE
        else:
            node.hook = POST if mv.point == graph_pb2.OUTPUT else PRE
        self.paths.add(mv.path)

    def op_value(self, node: PlanNode, mv: graph_pb2.ModuleValue) -> graph_pb2.ModuleValue:
        """An operation inside a forward becomes a value at its own hook, under its internal path
        (inside the module's, for the ordering rules)."""
        if mv.point == graph_pb2.RESULT:
            raise errors.InvalidArgument(f"{where(node.proto)}\nan operation has no RESULT; use OUTPUT")
        site = source.site(mv.path, mv.op)
        if site in self.modules:
            raise errors.InvalidArgument(
                f"{where(node.proto)}\n{site!r} is both a module and an operation of {mv.path!r}: the address is ambiguous"
            )
        source.check(self.modules[mv.path], mv.path, mv.op, where(node.proto))
        self.ops[site] = (mv.path, mv.op)
        out = graph_pb2.ModuleValue()
        out.CopyFrom(mv)
        out.path = site
        out.ClearField("op")
        return out

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
        sel = self.scopes[scope - 1]  # `scope` counts the edits' scopes too
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
        if node.kind == "tensor":  # a weight: no hook binds it, it exists from the start
            node.weight = node.id
            return
        node.const = all(n.const for n in inputs) and node.kind in ("constant", "param", "op")
        node.places = node.op is not None and any(self.placed(a) for a in (*node.args, *node.kwargs.values()))
        node.sources = frozenset().union(*(n.sources for n in inputs))
        node.grads = frozenset().union(*(n.grads for n in inputs))
        if node.kind == "grad":
            node.grads = frozenset((node.id,))
            node.alias_root = node.id
            return
        # A mutating op writes into what its first argument aliases even when its own result does
        # not (setitem returns None): the causality checks need that root.
        if node.kind == "save" or (node.op is not None and (node.op.aliases or node.op.mutates)):
            first = node.args[0] if node.args else None
            if isinstance(first, Ref):
                node.alias_root = self.nodes[first.id].alias_root
                node.weight = self.nodes[first.id].weight
        self.check_weight_write(node)

    def placed(self, spec: ArgSpec) -> bool:
        """Whether an argument may hold a constant tensor (a constant node's value is known only when it runs)."""
        if isinstance(spec, Ref):
            return self.nodes[spec.id].const
        if isinstance(spec, Seq):
            return any(self.placed(s) for s in spec.items)
        return rows.first_tensor(spec.value) is not None

    def check_weight_write(self, node: PlanNode) -> None:
        """No op writes into a model's weight: it is shared by every client of the model and
        outlives the request (torch refuses the same write into a parameter that requires grad)."""
        if node.op is None:
            return
        first = node.args[0] if node.args else None
        written = [first] if node.op.mutates else []
        written += [v for k, v in node.kwargs.items() if k == "out"]
        for spec in written:
            weight = self.nodes[spec.id].weight if isinstance(spec, Ref) else None
            if weight is not None:
                raise errors.InvalidArgument(
                    f"{where(node.proto)}\nwrites in place into the model's weight "
                    f"{_tensor_name(self.nodes[weight].proto.tensor)} ({where(self.nodes[weight].proto)}): the model's "
                    "weights are shared by every client of the daemon and never change. Compute on a copy "
                    "(`w = w.clone()`) or change the module's output instead.",
                    exc_type="RuntimeError",
                )

    # -- gradients

    def depends(self, node_id: int) -> frozenset[int]:
        """Every node `node_id` derives from (not itself)."""
        found = self._depends.get(node_id)
        if found is None:
            node = self.nodes[node_id]
            out: set[int] = set()
            for r in node.refs:
                out.add(r)
                out |= self.depends(r)
            found = self._depends[node_id] = frozenset(out)
        return found

    def certainly_before(self, a: PlanNode, b: PlanNode) -> bool:
        """Value `a` is complete in the forward before any part of `b` exists."""
        ka = [self.nodes[s].key for s in a.sources]
        kb = [self.nodes[s].key for s in b.sources]
        if not ka or not kb or any(k is None for k in ka + kb):
            return False
        return all(order.after(y, x, self.containers) for x in ka for y in kb)  # type: ignore[arg-type]

    def check_gradient(self, node: PlanNode) -> None:
        assert node.grad_of is not None and node.backward is not None
        target = self.nodes[node.grad_of]
        backward = self.nodes[node.backward]
        loss = backward.args[0]
        loss_node = self.nodes[loss.id] if isinstance(loss, Ref) else None
        what = f"the gradient of {where(target.proto)}"
        if not target.sources and any(self.nodes[d].kind == "tensor" for d in (target.id, *self.depends(target.id))):
            raise errors.InvalidArgument(
                f"{where(node.proto)}\n{what} does not exist here: the model's weights never receive gradients "
                "(they are shared and frozen); take the gradient of a module value, or of a client tensor "
                "that requires grad",
                exc_type="NotImplementedError",
            )
        if target.const or not target.sources:
            raise errors.InvalidArgument(
                f"{where(node.proto)}\n{what} does not exist: that value is computed from constants only, "
                "so the loss cannot depend on it"
            )
        if loss_node is None or loss_node.const:
            raise errors.InvalidArgument(
                f"{where(node.proto)}\nthe loss of {where(backward.proto)} is a constant: it has no gradients"
            )
        if target.id == loss_node.id or target.id in self.depends(loss_node.id):
            return
        if loss_node.id in self.depends(target.id):
            raise errors.InvalidArgument(
                f"{where(node.proto)}\n{what} does not exist: that value is computed from the loss, "
                "so the loss cannot depend on it"
            )
        if self.certainly_before(loss_node, target):
            raise errors.InvalidArgument(
                f"{where(node.proto)}\n{what} does not exist: the loss ({where(loss_node.proto)}) is computed "
                "before that value in the forward pass, so it cannot depend on it"
            )

    def check_set_grad(self, node: PlanNode) -> None:
        """A SetGrad's value must exist when autograd reaches its value: no gradient of an earlier value."""
        assert node.grad_of is not None
        target = self.nodes[node.grad_of]
        for g in sorted(node.grads):
            other = self.nodes[g]
            assert other.grad_of is not None
            if other.grad_of == target.id:
                continue
            source = self.nodes[other.grad_of]
            if source.id in self.depends(target.id) or self.certainly_before(source, target):
                raise causality(
                    node,
                    other,
                    "sets a gradient from a gradient that is only computed later in the backward pass "
                    f"(gradients arrive in reverse forward order, and {where(source.proto)} comes before "
                    f"{where(target.proto)})",
                    backward=True,
                )

    def later_source(self, node: PlanNode, than: HookKey) -> PlanNode | None:
        """A module value `node` needs that certainly exists only after hook `than`."""
        for s in sorted(node.sources):
            source = self.nodes[s]
            if source.key is not None and order.after(source.key, than, self.containers):
                return source
        return None

    def check_causality(self, node: PlanNode) -> None:
        if node.kind in ("grad", "set_grad"):
            self.check_gradient(node)
            if node.kind == "set_grad":
                self.check_set_grad(node)
            return
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


def _tensor_name(ref: graph_pb2.ModuleTensor) -> str:
    return f"{ref.path}.{ref.name}" if ref.path else ref.name


def causality(node: PlanNode, late: PlanNode, what: str, *, backward: bool = False) -> errors.InvalidArgument:
    when = "backward" if backward else "forward"
    return errors.InvalidArgument(
        f"causality error: {where(node.proto)}\n{what}: it needs {where(late.proto)}, which is only "
        f"available later in the {when} pass. Compute the value from modules that run before the write.",
        exc_type="RuntimeError",
    )


def build(
    graph: graph_pb2.Graph,
    model: torch.nn.Module,
    n_invokes: int,
    max_constant_bytes: int = 0,
    *,
    edits: Sequence[graph_pb2.Graph] = (),
    external: Mapping[int, Any] | None = None,
) -> Plan:
    """Validate `graph` (after the `edits` graphs, which run first) and plan it.

    `external` holds values of earlier traces of a session the graph may refer to, by node id."""
    if max_constant_bytes:
        size = _constant_bytes(graph)
        if size > max_constant_bytes:
            raise errors.ResourceExhausted(
                f"the graph's constants hold {size} bytes, over the limit max_constant_bytes={max_constant_bytes}"
            )
    return _Builder(graph, model, n_invokes, edits, external).build()


def check_edit(graph: graph_pb2.Graph, model: torch.nn.Module) -> None:
    """Refuse what a stored edit cannot hold: saves, caches, invokes; then plan it like a request."""
    for node in graph.nodes:
        kind = node.WhichOneof("kind")
        if kind in ("save", "cache"):
            raise errors.InvalidArgument(
                f"{where(node)}\nan edit cannot {'save' if kind == 'save' else 'cache'}: it applies to later "
                "requests, which save what they need themselves"
            )
        target = node.module if kind == "module" else getattr(node, kind).target if kind in ("set", "skip") else None
        if target is not None and target.HasField("invoke"):
            raise errors.InvalidArgument(
                f"{where(node)}\nan edit applies to every invoke of later requests; it cannot name invoke "
                f"{target.invoke}"
            )
    _Builder(graph, model, 1).build()


def referenced(graph: graph_pb2.Graph) -> set[int]:
    """Every node id `graph` refers to (arguments, gradients)."""
    return {r for node in graph.nodes for r in nodeids.refs(node)}
