"""Gradients, run inside the executor's dataflow loop.

Gradients. A Backward node runs as soon as its loss exists. Before calling
autograd it finds, for every value whose gradient the graph reads or
replaces, the tensor autograd will reach: the value itself when the loss
depends on it, else (an invoke's rows, a slice) the storage-owning base the
model computed with, whose gradient is sliced by the view's own geometry. A
value the loss does not depend on is INVALID_ARGUMENT before the backward
pass runs. Autograd then runs single-threaded, so every tensor hook fires on
this thread; a hook binds the Grad nodes of its value, runs whatever became
ready, and applies the SetGrad nodes (a SetGrad whose value does not exist yet
is a causality error: gradients arrive in reverse forward order). Gradients
are served as copies, so editing one never touches another value's gradient.

Module values whose gradient is needed are made to require grad at their hook
(a copy of a fresh leaf: the model's weights never require grad, so nothing
else would), and only in requests that run a backward pass.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any

import torch

from nnd.v1 import graph_pb2

from .. import errors
from .failures import where, wrap
from .order import POST

if TYPE_CHECKING:
    from .executor import Executor, Frame
    from .plan import PlanNode

# ------------------------------------------------------------------ requiring grad


def _leaf(t: torch.Tensor) -> torch.Tensor:
    # A copy of a fresh leaf: it requires grad, and in-place edits of it are allowed.
    return t.detach().requires_grad_(True).clone()


def _require(value: Any, changed: list[bool]) -> Any:
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() and not value.requires_grad:
            changed[0] = True
            return _leaf(value)
        return value
    if isinstance(value, list):
        for i, item in enumerate(value):
            value[i] = _require(item, changed)
        return value
    if isinstance(value, tuple):
        items = [_require(item, changed) for item in value]
        if all(a is b for a, b in zip(items, value, strict=True)):
            return value
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, MutableMapping):  # dicts and model outputs, changed in place
        for key in list(value.keys()):
            value[key] = _require(value[key], changed)
        return value
    return value


def require_grad(state: list[Any]) -> bool:
    """Make the floating tensors of state[0] require grad; True if any changed."""
    changed = [False]
    state[0] = _require(state[0], changed)
    return changed[0]


def require_grad_pre(point: int, state: list[Any]) -> bool:
    """Same for a pre-hook's [args, kwargs]: the first argument (INPUT) or all of them (INPUTS)."""
    args, kwargs = state
    changed = [False]
    if point == graph_pb2.INPUTS:
        _require(args, changed)
        _require(kwargs, changed)
    elif args:
        args[0] = _require(args[0], changed)
    elif kwargs:
        first = next(iter(kwargs))
        kwargs[first] = _require(kwargs[first], changed)
    return changed[0]


# ------------------------------------------------------------------ client tensors (Param nodes)


def param_leaf(ex: Executor, node: PlanNode) -> Any:
    """A Param's value: a fresh leaf that requires grad, so that every backward pass of the
    request accumulates the client tensor's gradient into it (a Scan: its fake value)."""
    value = ex.constant(node.value)
    if ex.scan or not isinstance(value, torch.Tensor):
        return value
    leaf = value.detach().clone().requires_grad_(True)
    ex.params[node.id] = leaf
    return leaf


def param_grads(ex: Executor) -> dict[int, Any]:
    """Param node id -> the gradient its backward passes accumulated (those no pass reached: absent)."""
    return {i: leaf.grad for i, leaf in ex.params.items() if leaf.grad is not None}


# ------------------------------------------------------------------ backward


def _reachable(fn: Any) -> set[Any]:
    seen: set[Any] = set()
    stack = [fn]
    while stack:
        f = stack.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        stack.extend(n for n, _ in f.next_functions)
    return seen


class Backward:
    """One Backward node's run: hooks on every value whose gradient the graph uses, then autograd."""

    def __init__(self, executor: Executor, frame: Frame, node: PlanNode) -> None:
        self.ex = executor
        self.frame = frame
        self.node = node
        self.targets = executor.plan.grads.get(node.id, {})

    def run(self) -> None:
        ex, frame, node = self.ex, self.frame, self.node
        frame.values[node.id] = None  # Grad/SetGrad nodes refer to it: it "exists" from now on
        if not self.targets and not ex.params:
            return  # nothing reads a gradient of this pass, and no client tensor receives one
        loss = ex.resolve(frame, node.args[0])
        gradient = ex.resolve(frame, node.args[1]) if len(node.args) > 1 else None
        if not isinstance(loss, torch.Tensor):
            raise errors.InvalidArgument(f"{where(node.proto)}\nthe loss is a {type(loss).__name__}, not a tensor")
        if gradient is None and loss.numel() != 1:
            raise errors.InvalidArgument(
                f"{where(node.proto)}\nbackward needs a scalar loss, and this one has shape {list(loss.shape)}; "
                "reduce it first (e.g. `.sum()`) or pass the loss's gradient",
                exc_type="RuntimeError",
            )
        if ex.scan:
            self.fake()
            return
        if not loss.requires_grad and not self.targets:
            raise errors.InvalidArgument(
                f"{where(node.proto)}\nthe loss does not depend on any client tensor that requires grad, nor on the model",
                exc_type="RuntimeError",
            )
        if not loss.requires_grad:
            target = ex.plan.nodes[min(self.targets)]
            raise errors.InvalidArgument(
                f"{where(node.proto)}\nthe loss does not depend on any value whose gradient is asked for "
                f"(e.g. {where(target.proto)})"
            )
        reach = _reachable(loss.grad_fn)
        handles: list[Any] = []
        try:
            for target_id, ids in sorted(self.targets.items()):
                handles.append(self.hook(target_id, ids, reach, loss))
            with torch.autograd.set_multithreading_enabled(False):
                if isinstance(gradient, torch.Tensor):
                    gradient = gradient.to(device=loss.device, dtype=loss.dtype)
                torch.autograd.backward(loss, gradient, retain_graph=ex.plan.backwards > 1)
        except errors.NndError:
            raise
        except Exception as e:
            raise wrap(e, node.proto) from None
        finally:
            for handle in handles:
                handle.remove()
        for ids in self.targets.values():
            for i in ids:
                if i in frame.pending:
                    grad_node = ex.plan.nodes[i]
                    raise errors.InvalidArgument(
                        f"{where(grad_node.proto)}\nautograd never computed this gradient: the loss of "
                        f"{where(node.proto)} does not depend on that value"
                    )

    def hook(self, target_id: int, ids: list[int], reach: set[Any], loss: torch.Tensor) -> Any:
        ex = self.ex
        target = ex.plan.nodes[target_id]
        tensor = ex.get(self.frame, target_id)
        first = ex.plan.nodes[ids[0]]
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            kind = type(tensor).__name__ if not isinstance(tensor, torch.Tensor) else f"{tensor.dtype} tensor"
            raise errors.InvalidArgument(
                f"{where(first.proto)}\nonly floating tensors have gradients; {where(target.proto)} is a {kind}"
                + ("; index the tensor you mean (e.g. `.output[0]`)" if isinstance(tensor, (tuple, list)) else "")
            )
        if tensor.grad_fn is not None and tensor.grad_fn in reach:
            return tensor.register_hook(lambda grad: self.serve(ids, grad, None))
        base = tensor._base
        if base is not None and base.grad_fn is not None and base.grad_fn in reach:
            # The view's gradient is the base's gradient laid out as the base is (its strides, which
            # need not be contiguous: an invoke's rows of a transposed value), viewed as the view is.
            geometry = (
                tensor.size(),
                tensor.stride(),
                tensor.storage_offset() - base.storage_offset(),
                base.size(),
                base.stride(),
            )
            return base.register_hook(lambda grad: self.serve(ids, grad, geometry))
        raise errors.InvalidArgument(
            f"{where(first.proto)}\nthe gradient of {where(target.proto)} does not exist: the loss of "
            f"{where(self.node.proto)} does not depend on that value"
        )

    def serve(self, ids: list[int], grad: torch.Tensor, geometry: tuple[Any, ...] | None) -> torch.Tensor:
        """Inside autograd: bind Grad nodes, run what became ready, apply SetGrads; the gradient to pass on."""
        ex, frame = self.ex, self.frame
        ex.poll()
        full = _laid_out(grad, geometry[3], geometry[4]) if geometry is not None else None
        g = full.as_strided(*geometry[:3]) if full is not None and geometry is not None else grad.clone()
        key = (f"<grad {ids[0]}>", POST, 0)
        previous, ex.current = ex.current, key
        for i in ids:
            node = ex.plan.nodes[i]
            if node.kind == "grad":
                ex.bind(frame, node, key, g)
                continue
            value = self.set_value(node)
            if full is None:  # the gradient itself: a fresh tensor (autograd may reuse the one it gave)
                g = torch.empty_like(g)
            _copy_into(ex, node, g, value)  # a view of the base's gradient: written through
        # Autograd runs hooks with grad mode off; a node that becomes ready here (a later
        # backward's loss, say) must still record its graph, as it would outside the pass.
        with torch.enable_grad():
            ex.run_ready()
        ex.completed.add(key)
        ex.current = previous
        return full if full is not None else g

    def set_value(self, node: PlanNode) -> Any:
        ex, frame = self.ex, self.frame
        with torch.enable_grad():
            ex.run_ready()
        if not ex.ready(frame, node):
            late = ex.missing_input(frame, node)
            assert node.grad_of is not None
            raise errors.InvalidArgument(
                f"causality error: {where(node.proto)}\nsets the gradient of {where(ex.plan.nodes[node.grad_of].proto)} "
                f"from a value that does not exist yet when autograd reaches it: it needs {where(late.proto)}, "
                "which is only computed later (gradients arrive in reverse forward order).",
                exc_type="RuntimeError",
            )
        value = ex.resolve(frame, node.args[0])
        ex.writes.append(node)
        frame.pending.discard(node.id)
        return value

    def fake(self) -> None:
        """A Scan: gradients are zeros shaped like their values; no autograd."""
        ex, frame = self.ex, self.frame
        sets: list[tuple[PlanNode, torch.Tensor]] = []
        for target_id, ids in sorted(self.targets.items()):
            tensor = ex.get(frame, target_id)
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                self.hook(target_id, ids, set(), tensor)  # raises the same error as a Trace
            g = torch.zeros_like(tensor)
            for i in ids:
                node = ex.plan.nodes[i]
                if node.kind == "grad":
                    ex.bind(frame, node, (f"<grad {i}>", POST, 0), g)
                else:
                    sets.append((node, g))
        for node, g in sets:
            _copy_into(ex, node, torch.empty_like(g), self.set_value(node))


def _laid_out(grad: torch.Tensor, size: torch.Size, stride: tuple[int, ...]) -> torch.Tensor:
    """A copy of `grad` with the base's own strides, so the view's geometry applies to it."""
    out = torch.empty_strided(size, stride, dtype=grad.dtype, device=grad.device)
    out.copy_(grad)
    return out


def _copy_into(ex: Executor, node: PlanNode, target: torch.Tensor, value: Any) -> None:
    """target[...] = value (broadcast, cast), failing with the node's line."""

    def copy() -> None:
        target.copy_(value)

    ex.guard(node, copy)
