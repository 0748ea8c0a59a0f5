"""`with loss.backward():` — the block in which `.grad` reads and writes gradients."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nnd.wire import _codec, _torchmod

if TYPE_CHECKING:
    from nnd.tracing._tracer import Tracer


class BackwardBlock:
    """A backward pass recorded in the graph (returned by `proxy.backward()`).

    The pass itself is recorded when `backward()` is called; entering the
    block makes `x.grad` (read or assigned) refer to this pass's gradients:

        with model.trace(prompt):
            h = model.transformer.h[0].output
            loss = model.lm_head.output[0, -1, token]
            with loss.backward():
                attribution = (h * h.grad).sum(-1).save()
    """

    def __init__(self, tracer: Tracer, node: int) -> None:
        self._tracer = tracer
        self.node = node
        """The id of the Backward node in the graph."""

    def __enter__(self) -> BackwardBlock:
        self._tracer._backwards.append(self.node)
        return self

    def __exit__(self, *exc: object) -> None:
        stack = self._tracer._backwards
        if stack and stack[-1] == self.node:
            stack.pop()

    def __repr__(self) -> str:
        return f"<nnd backward pass %{self.node}>"


# ---------------------------------------------------------------- client tensors that require grad
#
# A client tensor that requires grad (a probe's weight, a DAS rotation, a steering vector being
# trained) travels as a Param node: a leaf of autograd in the daemon. Two ways its gradient
# comes back, as in nnsight where the block's autograd graph reaches the client's tensors:
# - the block runs a backward pass (`loss.backward()` inside it): the daemon returns each
#   Param's accumulated gradient, and `accumulate` hands it to torch, which adds it to `.grad`
#   (through the client's own autograd graph when the tensor was computed, e.g. a parametrized
#   weight), so `optimizer.step()` works;
# - the block saves values and the backward pass runs after it (`loss = f(saved); loss.backward()`):
#   the saved values come back attached to the client's autograd graph (`attach`); when torch
#   reaches them it replays the block with a backward pass from sum(saved * incoming gradient),
#   the vector-Jacobian product, and passes the Params' gradients on. The model is frozen and
#   deterministic in a trace, so the replay computes the same forward.


def has_backward(graph: Any) -> bool:
    return any(node.WhichOneof("kind") == "backward" for node in graph.nodes)


def _as_tensor(torch: Any, value: Any, like: Any) -> Any:
    t = value if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    return t.to(device=like.device, dtype=like.dtype)


def accumulate(params: dict[int, tuple[Any, int]], saved: dict[int, Any]) -> None:
    """Add the gradients the daemon computed for client tensors to their `.grad`."""
    torch = _torchmod.loaded()
    if torch is None or not params:
        return
    tensors, grads = [], []
    for tensor, node_id in params.values():
        grad = saved.get(node_id)
        if grad is not None:
            tensors.append(tensor)
            grads.append(_as_tensor(torch, grad, tensor))
    if tensors:
        torch.autograd.backward(tensors, grads)


class _Replay:
    """What a replay needs: the request as it was sent, its saved tensors and its Params."""

    def __init__(self, conn: Any, request: Any, saves: list[tuple[int, Any]], params: list[tuple[Any, int]]) -> None:
        self.conn = conn
        self.request = request
        self.saves = saves  # (Save node id, the Arg it saved)
        self.params = params

    def gradients(self, grad_outputs: tuple[Any, ...]) -> list[Any]:
        from nnd.v1 import graph_pb2
        from nnd.wire import _results

        torch = _torchmod.loaded()
        request = type(self.request)()
        request.CopyFrom(self.request)
        request.shm = False  # the replay returns only gradients: over the stream, no shared region
        request.shm_region = ""
        graph = request.graph
        next_id = max((n.id for n in graph.nodes), default=0) + 1
        loc = next((n.loc for n in graph.nodes if n.id == self.saves[0][0]), None)

        def add(name: str, args: list[Any]) -> int:
            nonlocal next_id
            node = graph.nodes.add()
            node.id, next_id = next_id, next_id + 1
            if loc is not None:
                node.loc.CopyFrom(loc)
            node.op.name = name
            node.op.args.extend(args)
            return node.id

        total = None
        for (_, arg), grad in zip(self.saves, grad_outputs, strict=True):
            if grad is None:
                continue
            value = _codec.encode(grad.detach())
            term = add("sum", [graph_pb2.Arg(ref=add("mul", [arg, graph_pb2.Arg(value=value)]))])
            total = term if total is None else add("add", [graph_pb2.Arg(ref=total), graph_pb2.Arg(ref=term)])
        if total is None:
            return [None] * len(self.params)
        node = graph.nodes.add()
        node.id = next_id
        if loc is not None:
            node.loc.CopyFrom(loc)
        node.backward.loss.CopyFrom(graph_pb2.Arg(ref=total))
        saved = _results.collect(self.conn.stream("Trace", request), use_torch=True).saved
        out = []
        for tensor, node_id in self.params:
            grad = saved.get(node_id)
            out.append(None if grad is None else _as_tensor(torch, grad, tensor))
        return out


def _function() -> Any:
    torch = _torchmod.loaded()
    cached = globals().get("_REPLAY_FN")
    if cached is not None:
        return cached

    class ReplayBlock(torch.autograd.Function):
        """The saved values of an nnd block, as outputs of the client tensors it used."""

        @staticmethod
        def forward(ctx: Any, replay: _Replay, values: tuple[Any, ...], *params: Any) -> Any:
            ctx.replay = replay
            return tuple(v.detach().clone() for v in values)

        @staticmethod
        def backward(ctx: Any, *grad_outputs: Any) -> Any:
            return (None, None, *ctx.replay.gradients(grad_outputs))

    globals()["_REPLAY_FN"] = ReplayBlock
    return ReplayBlock


def attach(conn: Any, request: Any, saved: list[tuple[int, Any, Any]], params: dict[int, tuple[Any, int]]) -> list[Any]:
    """The saved floating tensors (Save node id, its Arg, value), made outputs of the block's client
    tensors in torch's autograd graph; returns their new values in the same order."""
    replay = _Replay(conn, request, [(i, arg) for i, arg, _ in saved], list(params.values()))
    values = tuple(v for _, _, v in saved)
    tensors = [t for t, _ in params.values()]
    return list(_function().apply(replay, values, *tensors))
