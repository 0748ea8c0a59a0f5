"""A model's weight outside a block, as nnsight hands out a dispatched model's parameter.

`model.lm_head.weight` read outside a block is a torch tensor whose shape,
dtype and size are known at once (the module tree carries them) and whose
values are fetched from the daemon the first time Python computes with them
(one small request: the weight is saved and the forward stops at its first
hook). A block it is passed into reads the model's own tensor there, never an
uploaded copy: a computation on it inside a block is recorded on the weight's
graph node. Values are cached per model handle (a few weights at most, the
largest first to go), since the daemon's weights never change.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from nnd.tracing import _context
from nnd.tracing._graph import WEIGHT_TAG, weight_of
from nnd.wire import _torchmod

if TYPE_CHECKING:
    from nnd.models._model import TransformersModel
    from nnd.v1 import nnd_pb2

_CACHED = 4  # weights a handle keeps fetched
_class: Any = None


def outside(model: TransformersModel, path: str, info: nnd_pb2.ParameterInfo) -> Any:
    """The lazily fetched tensor for the weight `info` of the module at `path`."""
    torch = _torchmod.available()
    from nnd.wire import _dtypes

    try:
        dtype = getattr(torch, _dtypes.canonical(info.dtype))
    except (AttributeError, KeyError, ValueError):
        dtype = torch.float32
    return _weight_class()(model, path, info.name, tuple(info.shape), dtype)


def _weight_class() -> Any:
    global _class
    if _class is None:
        _class = _define()
    return _class


def _define() -> Any:
    import torch

    metadata = {
        torch.Tensor.shape.__get__,  # type: ignore[attr-defined]
        torch.Tensor.dtype.__get__,  # type: ignore[attr-defined]
        torch.Tensor.device.__get__,  # type: ignore[attr-defined]
        torch.Tensor.ndim.__get__,  # type: ignore[attr-defined]
        torch.Tensor.requires_grad.__get__,  # type: ignore[attr-defined]
        torch.Tensor.is_leaf.__get__,  # type: ignore[attr-defined]
        torch.Tensor.size,
        torch.Tensor.dim,
        torch.Tensor.numel,
        torch.Tensor.nelement,
        torch.Tensor.element_size,
        torch.Tensor.is_floating_point,
        torch.Tensor.is_complex,
        torch.Tensor.__len__,
    }

    class Weight(torch.Tensor):
        """A model's weight: metadata here, values on the daemon until first used."""

        @staticmethod
        def __new__(cls, model: Any, path: str, name: str, shape: tuple[int, ...], dtype: Any) -> Any:
            out = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device="cpu", requires_grad=False)
            out.__dict__.update({WEIGHT_TAG: (path, name), "_nnd_model": model})
            return out

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def _real(self) -> Any:
            return _fetch(self.__dict__["_nnd_model"], *self.__dict__[WEIGHT_TAG])

        @classmethod
        def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            if func in metadata:
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)
            tracer = _context.current_or_none()
            if tracer is not None and tracer._live() and _same_model(tracer, args, kwargs):
                return _record(tracer, func, args, kwargs)  # inside a block: computed on the weight's node
            return func(*_swap(args, Weight._real), **_swap(kwargs, Weight._real))

        @classmethod
        def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            return func(*_swap(args, Weight._real), **_swap(kwargs or {}, Weight._real))

    return Weight


def _swap(value: Any, fn: Any) -> Any:
    """`value` with every Weight in it (nested in lists, tuples, dicts) replaced by fn(weight)."""
    if isinstance(value, _class):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_swap(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _swap(v, fn) for k, v in value.items()}
    return value


def _same_model(tracer: Any, args: Any, kwargs: Any) -> bool:
    found: list[Any] = []
    _swap((args, kwargs), lambda w: found.append(w) or w)
    return bool(found) and all(weight_of(w) is not None for w in found)


def _record(tracer: Any, func: Any, args: Any, kwargs: Any) -> Any:
    from nnd.tracing._proxy import Proxy

    args, kwargs = _swap(args, lambda w: _node(tracer, w)), _swap(kwargs, lambda w: _node(tracer, w))
    if getattr(func, "__name__", "") == "__get__":  # a property (`w.T`): the proxy's own attribute
        return getattr(args[0], func.__self__.__name__)
    return Proxy.__torch_function__(func, (), args, kwargs)


def _node(tracer: Any, weight: Any) -> Any:
    from nnd.tracing._proxy import Proxy

    path, name = weight.__dict__[WEIGHT_TAG]
    return Proxy(tracer, tracer._recorder()._builder.tensor(path, name))


def _fetch(model: Any, path: str, name: str) -> Any:
    cache: OrderedDict[tuple[str, str], Any] = model.__dict__.setdefault("_weight_values", OrderedDict())
    key = (path, name)
    if key in cache:
        cache.move_to_end(key)
        return cache[key]
    from nnd.v1 import nnd_pb2
    from nnd.wire import _results

    request = nnd_pb2.TraceRequest(model=model.name)
    request.invokes.add().tokens.ids.append(_any_token(model))
    node = request.graph.nodes.add(id=1)
    node.tensor.path, node.tensor.name = path, name
    save = request.graph.nodes.add(id=2)
    save.save.value.ref = 1
    request.graph.nodes.add(id=3).stop.SetInParent()  # the forward stops at its first hook
    where = f"{path}.{name}" if path else name
    try:
        results = _results.collect(model._conn.stream("Trace", request), use_torch=True)
    except Exception as exc:
        raise RuntimeError(
            f"could not read {where} from the daemon ({exc}); read it inside a `with model.trace(...)` block"
        ) from exc
    value = results.saved[2]
    cache[key] = value
    while len(cache) > _CACHED:
        cache.popitem(last=False)
    return value


def _any_token(model: Any) -> int:
    """A token id the model accepts: the forward is stopped before it computes anything with it."""
    config = getattr(model, "config", None)
    for field in ("bos_token_id", "pad_token_id", "eos_token_id"):
        value = getattr(config, field, None)
        if isinstance(value, int) and value >= 0:
            return value
    return 0
