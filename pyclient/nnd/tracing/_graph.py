"""Recording graph.proto nodes: ids, scopes, arguments and structural keys.

Every node also gets a *structural key*: a hashable summary of what it
computes, with references replaced by the referenced node's key. Two reads of
`h[0].output.shape` made with no write in between have the same key, so the
concrete-shape cache answers the second without an RPC.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from nnd.tracing import _context, _source
from nnd.v1 import graph_pb2, values_pb2
from nnd.wire import _codec, _torchmod

# Ops that change a value in place: a write, for the shape cache.
_INPLACE = frozenset(
    {"setitem", "iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "imatmul", "iand", "ior", "ixor"}
)


def is_write_op(name: str) -> bool:
    return name in _INPLACE or (name.endswith("_") and not name.endswith("__") and name not in ("and_", "or_"))


class GraphBuilder:
    """An SSA list of nodes plus loop scopes, appended to while recording.

    In a session the traces' builders share `keys` and draw ids from one
    counter (a one-item list), so ids are unique across the session and a
    node may refer to a node of an earlier trace."""

    def __init__(self, *, counter: list[int] | None = None, keys: dict[int, Hashable] | None = None) -> None:
        self.graph = graph_pb2.Graph()
        self.keys: dict[int, Hashable] = keys if keys is not None else {}
        # Structural keys of every write so far (writes can change later shapes).
        self.writes: list[Hashable] = []
        self._scopes: list[int] = [0]
        self._counter = counter if counter is not None else [1]  # ids start at 1: 0 reads as "unset"
        # Client tensors that require grad, used by the graph: id(tensor) -> (tensor, Param node id).
        self.params: dict[int, tuple[Any, int]] = {}
        # What the client knows of a node without asking the daemon: a model weight's shape and dtype
        # (the module tree carries them), so `model.lm_head.weight.shape` costs no round trip.
        self.known: dict[int, Any] = {}

    # -- scopes
    @property
    def scope(self) -> int:
        return self._scopes[-1]

    def push_scope(self, steps: graph_pb2.StepSelector) -> int:
        self.graph.scopes.add().steps.CopyFrom(steps)
        index = len(self.graph.scopes)  # scope k is Graph.scopes[k - 1]
        self._scopes.append(index)
        return index

    def pop_scope(self) -> None:
        if len(self._scopes) > 1:
            self._scopes.pop()

    # -- nodes
    def _node(self, key: Hashable) -> graph_pb2.Node:
        node = self.graph.nodes.add()
        node.id = self._counter[0]
        self._counter[0] += 1
        node.scope = self.scope
        _source.fill_location(node.loc)
        self.keys[node.id] = (key, node.scope)
        return node

    def discard(self, node_id: int) -> list[int]:
        """Take `node_id` and every node that uses it, directly or not, out of the graph (a failed
        shape query's value can never exist, so nothing recorded on top of it can run). Returns their ids."""
        gone = {node_id}
        keep = []
        for node in self.graph.nodes:  # SSA order: a node's inputs come before it
            if node.id in gone or gone.intersection(_refs(node)):
                gone.add(node.id)
            else:
                keep.append(node)
        if len(keep) == len(self.graph.nodes):
            return []
        kept = [graph_pb2.Node() for _ in keep]
        for new, old in zip(kept, keep, strict=True):
            new.CopyFrom(old)
        del self.graph.nodes[:]
        self.graph.nodes.extend(kept)
        for i in gone:
            self.keys.pop(i, None)
        return sorted(gone)

    def module(self, path: str, point: int, invoke: int | None, call: int = 0, op: str = "") -> int:
        node = self._node(("module", path, point, invoke, call, op))
        _fill_module(node.module, path, point, invoke, call, op)
        return node.id

    def tensor(self, path: str, name: str, meta: Any = None) -> int:
        """A ModuleTensor node: the parameter or buffer `name` of the module at `path`."""
        node = self._node(("tensor", path, name))
        node.tensor.path, node.tensor.name = path, name
        if meta is not None:
            self.known[node.id] = meta
        return node.id

    def op(self, name: str, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> int:
        arg_msgs, arg_keys = zip(*(self.arg(a) for a in args), strict=True) if args else ((), ())
        kw = {k: self.arg(v) for k, v in (kwargs or {}).items()}
        key = ("op", name, arg_keys, tuple(sorted((k, v[1]) for k, v in kw.items())))
        node = self._node(key)
        node.op.name = name
        node.op.args.extend(arg_msgs)
        for k, (msg, _) in kw.items():
            node.op.kwargs[k].CopyFrom(msg)
        if is_write_op(name):
            self.writes.append(key)
        return node.id

    def param(self, tensor: Any) -> int:
        """The Param node of a client tensor that requires grad (one per tensor per graph)."""
        held = self.params.get(id(tensor))
        if held is not None and held[0] is tensor:
            return held[1]
        node = self._node(("param", self._counter[0]))
        node.scope = 0  # a leaf of the whole request, also when first used inside a loop
        self.keys[node.id] = (("param", node.id), 0)
        node.param.value.CopyFrom(_codec.encode(tensor.detach()))
        self.params[id(tensor)] = (tensor, node.id)
        return node.id

    def save(self, value: Any) -> int:
        msg, key = self.arg(value)
        node = self._node(("save", key))
        node.save.value.CopyFrom(msg)
        return node.id

    def set(self, path: str, point: int, invoke: int | None, call: int, value: Any, op: str = "") -> int:
        msg, key = self.arg(value)
        node = self._node(("set", path, point, invoke, call, key, op))
        _fill_module(node.set.target, path, point, invoke, call, op)
        node.set.value.CopyFrom(msg)
        self.writes.append(self.keys[node.id])
        return node.id

    def skip(self, path: str, invoke: int | None, call: int, value: Any, op: str = "") -> int:
        msg, key = self.arg(value)
        node = self._node(("skip", path, invoke, call, key, op))
        _fill_module(node.skip.target, path, graph_pb2.OUTPUT, invoke, call, op)
        node.skip.value.CopyFrom(msg)
        self.writes.append(self.keys[node.id])
        return node.id

    def backward(self, loss: Any, gradient: Any = None) -> int:
        loss_msg, loss_key = self.arg(loss)
        node = self._node(("backward", loss_key, self.arg(gradient)[1] if gradient is not None else None))
        node.backward.loss.CopyFrom(loss_msg)
        if gradient is not None:
            node.backward.gradient.CopyFrom(self.arg(gradient)[0])
        return node.id

    def grad(self, value: int, backward: int) -> int:
        node = self._node(("grad", self.keys[value], backward))
        node.grad.value, node.grad.backward = value, backward
        return node.id

    def set_grad(self, value: int, backward: int, grad: Any) -> int:
        msg, key = self.arg(grad)
        node = self._node(("set_grad", self.keys[value], backward, key))
        node.set_grad.value, node.set_grad.backward = value, backward
        node.set_grad.grad.CopyFrom(msg)
        return node.id

    def cache(
        self, modules: Sequence[str], *, outputs: bool, inputs: bool, dtype: int, device: str, invoke: int | None = None
    ) -> int:
        node = self._node(("cache", tuple(modules), outputs, inputs, dtype, device, invoke))
        spec = node.cache
        spec.modules.extend(modules)
        spec.outputs, spec.inputs, spec.device = outputs, inputs, device
        if invoke is not None:
            spec.invoke = invoke
        spec.dtype = dtype  # type: ignore[assignment]
        return node.id

    def stop(self) -> int:
        node = self._node(("stop",))
        node.stop.SetInParent()
        self.writes.append(self.keys[node.id])
        return node.id

    # -- arguments
    def arg(self, obj: Any) -> tuple[graph_pb2.Arg, Hashable]:
        """An Arg for a proxy, a constant, or a tuple/list holding proxies."""
        from nnd.tracing._proxy import Proxy

        if isinstance(obj, Proxy):
            ref = obj._ref()
            return graph_pb2.Arg(ref=ref), ("r", self.keys[ref])
        if isinstance(obj, slice) and _holds_proxy([obj.start, obj.stop, obj.step]):
            # `h[:, : n - 1]` with n read from a traced value: the daemon builds the slice when n is known.
            ref = self.op("slice", [obj.start, obj.stop, obj.step])
            return graph_pb2.Arg(ref=ref), ("r", self.keys[ref])
        plain = _plain_key(obj, _PLAIN_DEPTH)
        if plain is not None:  # `[:, -1]` in a loop over prompts or steps: encoded once (callers copy the Arg)
            known = _plain_args.get(plain)
            if known is None:
                known = _value_arg(obj)
                if len(_plain_args) >= _PLAIN_ARGS:
                    _plain_args.clear()
                _plain_args[plain] = known
            return known
        if isinstance(obj, (tuple, list)) and _holds_proxy(obj):
            items = [self.arg(item) for item in obj]
            lst = graph_pb2.ArgList(items=[m for m, _ in items])
            kind = "tuple" if isinstance(obj, tuple) else "list"
            arg = graph_pb2.Arg(tuple=lst) if kind == "tuple" else graph_pb2.Arg(list=lst)
            return arg, (kind, tuple(k for _, k in items))
        weight = _weight_of(obj)
        if weight is not None:  # `model.lm_head.weight` read outside the block: the model's own tensor
            ref = self.tensor(*weight)
            return graph_pb2.Arg(ref=ref), ("r", self.keys[ref])
        if _wants_grad(obj):  # a client tensor autograd must reach: one leaf, its gradient comes back
            ref = self.param(obj)
            return graph_pb2.Arg(ref=ref), ("r", self.keys[ref])
        if isinstance(obj, Mapping) and _holds_proxy(list(obj.values())):
            raise TypeError("a dict holding traced values cannot be an argument; pass them separately")
        return _value_arg(obj)


def _value_arg(obj: Any) -> tuple[graph_pb2.Arg, Hashable]:
    """A constant's Arg and structural key (its deterministic encoding)."""
    value: values_pb2.Value = _codec.encode(obj)
    return graph_pb2.Arg(value=value), ("v", value.SerializeToString(deterministic=True))


# Plain constants (numbers, short strings, slices, None, ..., small tuples and lists of them) -> their
# Arg and structural key: what a block records in every iteration of a loop is encoded once.
_plain_args: dict[Hashable, tuple[graph_pb2.Arg, Hashable]] = {}
_PLAIN_ARGS = 1024
_PLAIN_DEPTH = 3
_PLAIN_ITEMS = 16
_PLAIN_STR = 256


def _plain_key(obj: Any, depth: int) -> Hashable | None:
    """A key that tells apart every plain constant whose encoding differs (True from 1, 1 from 1.0,
    0.0 from -0.0), or None for anything else."""
    t = type(obj)
    if t is int or t is bool or obj is None or obj is Ellipsis:
        return (t, obj)
    if t is float:
        return (t, obj.hex())
    if t is str:
        return (t, obj) if len(obj) <= _PLAIN_STR else None
    if depth <= 0:
        return None
    if t is slice:
        parts = tuple(_plain_key(p, 0) for p in (obj.start, obj.stop, obj.step))
        return None if None in parts else (t, parts)
    if (t is tuple or t is list) and len(obj) <= _PLAIN_ITEMS:
        items = tuple(_plain_key(v, depth - 1) for v in obj)
        return None if None in items else (t, items)
    return None


def _refs(msg: Any) -> set[int]:
    """Ids of the earlier nodes a node (or any message inside it) uses."""
    out: set[int] = set()
    stack = [msg]
    while stack:
        m = stack.pop()
        name = m.DESCRIPTOR.name
        if name == "Arg" and m.WhichOneof("kind") == "ref":
            out.add(m.ref)
        elif name in ("Grad", "SetGrad"):
            out.update((m.value, m.backward))
        for field, value in m.ListFields():
            if field.type != field.TYPE_MESSAGE:
                continue
            if field.is_repeated:
                items = value.values() if hasattr(value, "values") and callable(value.values) else value
                stack.extend(v for v in items if hasattr(v, "DESCRIPTOR"))
            else:
                stack.append(value)
    return out


def _fill_module(
    msg: graph_pb2.ModuleValue, path: str, point: int, invoke: int | None, call: int, op: str = ""
) -> None:
    msg.path = path
    msg.op = op
    msg.point = point  # type: ignore[assignment]
    if invoke is not None:
        msg.invoke = invoke
    msg.call = call


# (path, name) on a tensor that stands for a model's weight (models/_weights.py makes them).
WEIGHT_TAG = "_nnd_weight"


def _weight_of(obj: Any) -> tuple[str, str] | None:
    return weight_of(obj) if _torchmod.loaded() is not None else None


def weight_of(obj: Any) -> tuple[str, str] | None:
    """(path, name) when `obj` stands for a weight of the model being traced now (a tensor from
    `model.x.weight` or `named_parameters()` read outside the block): the graph reads the
    model's own tensor for it. A weight of another model is only a tensor here."""
    tag = getattr(obj, "__dict__", {}).get(WEIGHT_TAG)
    if not isinstance(tag, tuple):
        return None
    tracer = _context.current_or_none()
    model = obj.__dict__.get("_nnd_model")
    if tracer is None or model is None or getattr(tracer.model, "_family", None) is not model._family:
        return None
    return tag


def _wants_grad(obj: Any) -> bool:
    """A floating torch tensor that requires grad, recorded while grad mode is on."""
    torch = _torchmod.loaded()
    return (
        torch is not None
        and isinstance(obj, torch.Tensor)
        and obj.requires_grad
        and obj.is_floating_point()
        and torch.is_grad_enabled()
    )


def _holds_proxy(items: Sequence[Any]) -> bool:
    from nnd.tracing._proxy import Proxy

    return any(
        isinstance(i, Proxy)
        or (isinstance(i, (tuple, list)) and _holds_proxy(i))
        or (isinstance(i, slice) and _holds_proxy([i.start, i.stop, i.step]))
        for i in items
    )
