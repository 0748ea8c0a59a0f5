"""A tiny graph builder for engine tests: the protobuf a client would send, without the client."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import wire_results

from nnd.v1 import graph_pb2, nnd_pb2, values_pb2
from nnd_daemon.engine import wire

POINTS = {"output": graph_pb2.OUTPUT, "input": graph_pb2.INPUT, "inputs": graph_pb2.INPUTS, "result": graph_pb2.RESULT}


@dataclass(frozen=True)
class N:
    """A reference to a node."""

    id: int


def value(x: Any) -> values_pb2.Value:
    """A constant Value (tensors always inline, as a client sends them)."""
    if isinstance(x, torch.Tensor):
        t = values_pb2.Tensor(dtype=wire.from_torch_dtype(x.dtype), shape=list(x.shape), data=wire_results.tensor_bytes(x))
        return values_pb2.Value(tensor=t)
    if isinstance(x, (list, tuple)) and not isinstance(x, torch.Size):
        items = values_pb2.ValueList(items=[value(v) for v in x])
        return values_pb2.Value(list=items) if isinstance(x, list) else values_pb2.Value(tuple=items)
    return wire.Encoder().value(x)


def arg(x: Any) -> graph_pb2.Arg:
    if isinstance(x, N):
        return graph_pb2.Arg(ref=x.id)
    if isinstance(x, (list, tuple)) and any(isinstance(i, N) for i in x):
        items = graph_pb2.ArgList(items=[arg(i) for i in x])
        return graph_pb2.Arg(list=items) if isinstance(x, list) else graph_pb2.Arg(tuple=items)
    return graph_pb2.Arg(value=value(x))


class Graph:
    def __init__(self) -> None:
        self.g = graph_pb2.Graph()
        self.next = 1

    def _node(self, scope: int, line: int | None, text: str) -> graph_pb2.Node:
        node = self.g.nodes.add(id=self.next, scope=scope)
        node.loc.file = "nb.py"
        node.loc.line = line if line is not None else self.next
        node.loc.text = text
        self.next += 1
        return node

    def mv(self, path: str, point: str = "output", invoke: int | None = None, call: int = 0) -> graph_pb2.ModuleValue:
        m = graph_pb2.ModuleValue(path=path, point=POINTS[point], call=call)
        if invoke is not None:
            m.invoke = invoke
        return m

    def module(
        self,
        path: str,
        point: str = "output",
        *,
        invoke: int | None = None,
        call: int = 0,
        scope: int = 0,
        line: int | None = None,
        text: str = "",
    ) -> N:
        node = self._node(scope, line, text or f"model.{path}.{point}")
        node.module.CopyFrom(self.mv(path, point, invoke, call))
        return N(node.id)

    def tensor(self, path: str, name: str, *, scope: int = 0, line: int | None = None, text: str = "") -> N:
        """A module's parameter or buffer (`model.lm_head.weight`)."""
        node = self._node(scope, line, text or f"model.{path}.{name}")
        node.tensor.path, node.tensor.name = path, name
        return N(node.id)

    def const(self, x: Any, *, scope: int = 0, line: int | None = None, text: str = "") -> N:
        node = self._node(scope, line, text)
        node.constant.CopyFrom(value(x))
        return N(node.id)

    def op(self, name: str, *args: Any, scope: int = 0, line: int | None = None, text: str = "", **kwargs: Any) -> N:
        node = self._node(scope, line, text or name)
        node.op.name = name
        node.op.args.extend(arg(a) for a in args)
        for k, v in kwargs.items():
            node.op.kwargs[k].CopyFrom(arg(v))
        return N(node.id)

    def save(self, x: Any, *, scope: int = 0, line: int | None = None) -> N:
        node = self._node(scope, line, "save")
        node.save.value.CopyFrom(arg(x))
        return N(node.id)

    def set(
        self,
        path: str,
        x: Any,
        point: str = "output",
        *,
        invoke: int | None = None,
        call: int = 0,
        scope: int = 0,
        line: int | None = None,
        text: str = "",
    ) -> N:
        node = self._node(scope, line, text or f"model.{path}.{point} = ...")
        node.set.target.CopyFrom(self.mv(path, point, invoke, call))
        node.set.value.CopyFrom(arg(x))
        return N(node.id)

    def skip(self, path: str, x: Any, *, invoke: int | None = None, call: int = 0, scope: int = 0) -> N:
        node = self._node(scope, None, f"model.{path}.skip(...)")
        node.skip.target.CopyFrom(self.mv(path, "output", invoke, call))
        node.skip.value.CopyFrom(arg(x))
        return N(node.id)

    def stop(self) -> N:
        node = self._node(0, None, "tracer.stop()")
        node.stop.SetInParent()
        return N(node.id)

    def backward(self, loss: Any, gradient: Any = None, *, line: int | None = None, text: str = "") -> N:
        node = self._node(0, line, text or "with loss.backward():")
        node.backward.loss.CopyFrom(arg(loss))
        if gradient is not None:
            node.backward.gradient.CopyFrom(arg(gradient))
        return N(node.id)

    def grad(self, x: N, backward: N, *, line: int | None = None, text: str = "") -> N:
        node = self._node(0, line, text or "x.grad")
        node.grad.value, node.grad.backward = x.id, backward.id
        return N(node.id)

    def set_grad(self, x: N, backward: N, value: Any, *, line: int | None = None, text: str = "") -> N:
        node = self._node(0, line, text or "x.grad = ...")
        node.set_grad.value, node.set_grad.backward = x.id, backward.id
        node.set_grad.grad.CopyFrom(arg(value))
        return N(node.id)

    def cache(
        self,
        modules: Any = (),
        *,
        outputs: bool = True,
        inputs: bool = False,
        dtype: torch.dtype | None = None,
        device: str = "",
    ) -> N:
        node = self._node(0, None, "tracer.cache()")
        node.cache.modules.extend(modules)
        node.cache.outputs, node.cache.inputs, node.cache.device = outputs, inputs, device
        if dtype is not None:
            node.cache.dtype = wire.from_torch_dtype(dtype)  # type: ignore[assignment]
        return N(node.id)

    def loop(self, steps: Any = None) -> int:
        """A loop scope: steps None = all, a slice = range, a list = explicit steps. Returns its scope number."""
        scope = self.g.scopes.add()
        if steps is None:
            scope.steps.all.SetInParent()
        elif isinstance(steps, slice):
            scope.steps.range.CopyFrom(value(steps).slice)
        else:
            scope.steps.steps.steps.extend(steps)
        return len(self.g.scopes)

    def request(self, *invokes: Any, generate: nnd_pb2.GenerateOptions | None = None) -> nnd_pb2.TraceRequest:
        req = nnd_pb2.TraceRequest(model="tiny", graph=self.g)
        for inv in invokes:
            if isinstance(inv, str):
                req.invokes.add(text=inv)
            elif isinstance(inv, torch.Tensor):
                req.invokes.add().args.append(value(inv))
            else:
                req.invokes.add(tokens=nnd_pb2.TokenIds(ids=list(inv)))
        if generate is not None:
            req.generate.CopyFrom(generate)
        return req


S = slice(None)  # `:` in an index


def idx(*parts: Any) -> tuple[Any, ...]:
    """An index tuple such as x[:, -1, :] -> idx(S, -1, S)."""
    return tuple(parts)
