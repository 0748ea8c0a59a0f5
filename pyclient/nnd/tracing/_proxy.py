"""Proxies: stand-ins for values that exist only while the daemon runs the model.

Every Python operation on a proxy records an op node instead of computing.
After the block, a saved proxy holds its real value (`.value`), and further
operations on it simply compute on that value. In a session, a proxy of an
earlier trace stays usable in the later traces until the session ends; what
it records goes to the trace being recorded.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from nnd.tracing import _concrete, _source
from nnd.tracing._usage import ValueNotKnown, value_not_known
from nnd.wire import _meta, _torchmod

if TYPE_CHECKING:
    from nnd.tracing._tracer import Tracer

_UNSET: Any = object()

# Python's dunder names -> the `operator` module's names used as op names.
_BINARY = {
    "add": "add", "sub": "sub", "mul": "mul", "truediv": "truediv", "floordiv": "floordiv",
    "mod": "mod", "pow": "pow", "matmul": "matmul", "and": "and_", "or": "or_", "xor": "xor",
    "lshift": "lshift", "rshift": "rshift",
}  # fmt: skip
_COMPARE = ("lt", "le", "eq", "ne", "gt", "ge")
_UNARY = {"neg": "neg", "pos": "pos", "abs": "abs", "invert": "invert"}
# Methods whose answer is a Python value, not a tensor: they need the real value now.
_CONCRETE_METHODS = frozenset({"item", "tolist", "numpy"})
_INPLACE = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "and", "or", "xor")


FUNCTIONAL_PREFIX = "nn.functional."  # the daemon's ops for `torch.nn.functional.<name>`
_functional_names: dict[int, str] | None = None


def _functional_name(func: Any) -> str | None:
    """`torch.nn.functional`'s own name for `func` (F.logsigmoid's __name__ is "log_sigmoid"), if it is one."""
    global _functional_names
    functional = sys.modules.get("torch.nn.functional")
    if functional is None:
        return None
    if _functional_names is None:
        _functional_names = {
            id(f): n for n in dir(functional) if not n.startswith("_") and callable(f := getattr(functional, n))
        }
    return _functional_names.get(id(func))


def op_name(func: Any) -> tuple[str, bool]:
    """The op name of a torch function or Tensor method, and whether its
    arguments are reflected (`Tensor.__radd__`). A `torch.nn.functional`
    function is "nn.functional.<name>": `F.softmax(x, dim=-1)` is not
    `x.softmax(...)` (it passes its own keywords)."""
    functional = _functional_name(func)
    if functional is not None:
        return FUNCTIONAL_PREFIX + functional, False
    name = getattr(func, "__name__", None) or str(func)
    if name.startswith("__") and name.endswith("__"):
        core = name[2:-2]
        if core in ("getitem", "setitem"):
            return core, False
        if core == "div":
            return "truediv", False
        if core.startswith("r") and core[1:] in _BINARY:
            return _BINARY[core[1:]], True
        if core.startswith("i") and core[1:] in _BINARY:
            return "i" + _BINARY[core[1:]].rstrip("_"), False
        if core in _BINARY:
            return _BINARY[core], False
        if core in _UNARY or core in _COMPARE:
            return core, False
    return name, False


class Proxy:
    """A value of the traced model, known only once the daemon has run the block.

    Use it like a tensor inside the block: index it, do arithmetic, call tensor
    methods and torch functions on it; each use records one node. Call
    `.save()` on what you want back; after the block its name holds the real
    value (also at `.value`).
    """

    __slots__ = ("_tracer", "_node", "_pending", "_value", "__weakref__")

    def __init__(self, tracer: Tracer, node: int | None, pending: tuple[Proxy, str] | None = None) -> None:
        self._tracer = tracer
        self._node = node
        self._pending = pending
        self._value = _UNSET

    # -- identity in the graph
    def _ref(self) -> int:
        """The node id, recording a pending attribute read as a `getattr` op."""
        if self._node is None:
            if self._pending is None:
                raise ValueNotKnown("this value has no node in the graph")
            base, name = self._pending
            self._node = self._tracer._recorder()._builder.op("getattr", [base, name])
        return self._node

    @property
    def _resolved(self) -> bool:
        return self._value is not _UNSET

    def _live(self) -> bool:
        """True while its block (or the session it belongs to) is being recorded."""
        return self._tracer._live()

    # -- the user API
    def save(self) -> Proxy:
        """Return this value after the block: the name it is bound to is rebound
        to the real value (a list with one entry per step inside a loop)."""
        if not self._live():
            return self
        self._tracer._recorder()._save(self)
        return self

    @property
    def value(self) -> Any:
        """The real value, once the block has run (only for saved values)."""
        if self._value is _UNSET:
            if self._live():
                raise value_not_known("`.value`", _source.location().text)
            if self._tracer.backend.between_blocks():  # a session's Python between its blocks: run up to it
                if self._node is None and self._pending is not None:
                    base, name = self._pending
                    return getattr(base.value, name)
                self._value = self._tracer.backend.ended_value(self._tracer, self._ref())
                return self._value
            failure = getattr(self._tracer, "_failure", None)
            if failure:
                raise ValueNotKnown(f"the block did not complete ({failure}), so this value has none")
            raise ValueNotKnown("this value was not saved; call `.save()` on it inside the block")
        return self._value

    @property
    def shape(self) -> Any:
        """The shape, known at once: the daemon scans the graph recorded so far
        (cached, so repeated reads cost no extra RPC). In a generate block the
        shape is read from the run itself, a sync point, as nnsight reads it:
        a step after the first sees one new token per row, and transformers
        keeps the logits of the last position only."""
        if not self._live():
            return self.value.shape
        if _concrete.from_the_run(self._tracer._recorder()):
            return _meta.Size(int(d) for d in Proxy(self._tracer, None, pending=(self, "shape"))._real())
        return _meta.Size(self._scanned_shape("shape"))

    def _scanned_shape(self, what: str) -> Any:
        meta = self._tracer._recorder()._concrete(self)
        if not hasattr(meta, "shape"):
            raise TypeError(f"this value is a {type(meta).__name__}, which has no {what}")
        return meta.shape

    @property
    def dtype(self) -> Any:
        """The element type, known at once (see `shape`)."""
        if not self._live():
            return self.value.dtype
        meta = self._tracer._recorder()._concrete(self)
        if not hasattr(meta, "dtype"):
            raise TypeError(f"this value is a {type(meta).__name__}, which has no dtype")
        torch = _torchmod.available()
        return getattr(torch, meta.dtype) if torch is not None else meta.dtype

    @property
    def ndim(self) -> int:
        """The number of dimensions, known at once (see `shape`; a generation's steps keep it, so the
        scan's answer holds for every step)."""
        return len(self._scanned_shape("ndim")) if self._live() else self.value.ndim

    def __len__(self) -> int:
        if not self._live():
            return len(self.value)
        meta = self._tracer._recorder()._concrete(self)
        if hasattr(meta, "shape") and meta.shape and _concrete.from_the_run(self._tracer._recorder()):
            return self.shape[0]  # a generation's tensor: its own length (see `shape`)
        return len(meta)

    def __contains__(self, item: Any) -> bool:
        """`"attention_mask" in kwargs`: a dict's keys are known from the scan in a trace; anything else
        (a tensor's values, a generation step's inputs) is read from the run, a sync point."""
        if not self._live():
            return item in self.value
        recorder = self._tracer._recorder()
        if not _concrete.from_the_run(recorder):
            meta = recorder._concrete(self)
            if isinstance(meta, dict):
                return item in meta
        return bool(_record(self, "contains", [self, item])._real(item=True))

    def _is_dict(self) -> bool:
        try:
            return isinstance(self._tracer._recorder()._concrete(self), dict)
        except Exception:  # noqa: BLE001 - not scannable here: not known to be a dict, recorded as a method call
            return False

    def _get(self, key: Any, default: Any = None) -> Any:
        """`kwargs.get(name, default)` on a dict (a module's keyword inputs)."""
        return self[key] if key in self else default

    def __iter__(self) -> Iterator[Any]:
        if not self._live():
            yield from self.value
            return
        for i in range(len(self)):
            yield self[i]

    # -- attribute reads and method calls
    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        if not self._live():
            return getattr(self.value, name)
        if name == "item":  # a sync point whose one element may come as a number: nothing to decode or call
            return lambda *args, **kwargs: _item(self._real(item=True), *args, **kwargs)
        if name == "get" and self._is_dict():
            return self._get
        if name in _CONCRETE_METHODS:  # `.tolist()`, `.numpy()`: a sync point
            return lambda *args, **kwargs: getattr(self._real(), name)(*args, **kwargs)
        return Proxy(self._tracer, None, pending=(self, name))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._pending is None or self._node is not None:
            raise TypeError("a traced value is not callable")
        base, name = self._pending
        return base._tracer._recorder()._record(name, [base, *args], kwargs)

    # -- gradients
    def backward(self, gradient: Any = None, **kwargs: Any) -> Any:
        """Run the backward pass from this value (a scalar unless `gradient` is
        given) once it exists: `with loss.backward():` opens a block in which
        `x.grad` reads, and `x.grad = g` replaces, the gradient flowing through
        any value `x` of the trace. Gradients arrive in reverse forward order;
        the daemon refuses gradients that cannot exist before anything runs.
        Only a trace (not a generate) can run a backward pass."""
        from nnd.tracing._grad import BackwardBlock

        if not self._live():
            return self.value.backward(gradient, **kwargs)
        if kwargs.keys() - {"retain_graph", "create_graph", "inputs"}:
            raise TypeError(f"backward() got unexpected arguments {sorted(kwargs)}")
        if kwargs.get("create_graph") or kwargs.get("inputs") is not None:
            raise NotImplementedError("nnd's backward pass takes no create_graph or inputs")
        tracer = self._tracer._recorder()
        node = tracer._builder.backward(self, gradient)
        for kept in tracer._retained:  # `x.retain_grad()` before: x.grad is this pass's gradient after the block
            grad = Proxy(tracer, tracer._builder.grad(kept._ref(), node))
            tracer._save(grad)
            tracer._retained_grads.append((kept, grad))
        return BackwardBlock(tracer, node)

    def retain_grad(self) -> None:
        """Keep this value's gradient: after the block, the saved value's `.grad` holds the gradient of
        every backward pass the block runs after this call (as torch's `retain_grad()`)."""
        if not self._live():
            self.value.retain_grad()
            return
        tracer = self._tracer._recorder()
        tracer._record("retain_grad", [self], {})
        tracer._retained.append(self)

    @property
    def requires_grad(self) -> Any:
        """Whether the value requires grad (inside the block, a value known once the daemon runs)."""
        if not self._live():
            return self.value.requires_grad
        return Proxy(self._tracer, None, pending=(self, "requires_grad"))

    @requires_grad.setter
    def requires_grad(self, flag: bool) -> None:
        # nnsight's `x.requires_grad = True`, so that a gradient flows back to x: recorded as
        # `x.requires_grad_(flag)` (the daemon also makes every value whose gradient is read require it).
        if not self._live():
            self.value.requires_grad = flag
            return
        self._tracer._recorder()._record("requires_grad_", [self, bool(flag)], {})

    @property
    def grad(self) -> Any:
        """Inside `with loss.backward():`, the gradient of the loss with respect
        to this value (a new proxy); set it to replace the gradient that flows on."""
        if not self._live():
            return getattr(self.value, "grad", None)
        tracer = self._tracer._recorder()
        return Proxy(tracer, tracer._builder.grad(self._ref(), tracer._current_backward("`.grad`")))

    @grad.setter
    def grad(self, value: Any) -> None:
        if not self._live():
            raise AttributeError("the block has ended: gradients can only be set inside `with loss.backward():`")
        tracer = self._tracer._recorder()
        tracer._builder.set_grad(self._ref(), tracer._current_backward("setting `.grad`"), value)

    def __getitem__(self, key: Any) -> Any:
        return _record(self, "getitem", [self, key])

    def __setitem__(self, key: Any, value: Any) -> None:
        if not self._live():
            self.value[key] = value
            return
        self._tracer._recorder()._record("setitem", [self, key, value], {})

    # -- value-dependent Python: a sync point while recording (_interact.py)
    def _real(self, *, item: bool = False) -> Any:
        """The real value: after the block the saved one; inside it, fetched mid-run (`item`: Python reads
        it as one number, so a tensor of one element may come as that number)."""
        if not self._live():
            return self.value
        return self._tracer._recorder()._sync(self, item=item)

    def __bool__(self) -> bool:
        return bool(self._real(item=True))

    def __float__(self) -> float:
        return float(self._real(item=True))

    def __int__(self) -> int:
        return int(self._real(item=True))

    def __index__(self) -> int:
        return operator.index(self._real())

    def __complex__(self) -> complex:
        return complex(self._real())

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        import numpy as np

        value = self._real()
        if hasattr(value, "detach"):  # a torch tensor
            value = value.detach().cpu().numpy()
        return np.asarray(value, *args, **kwargs)

    def __str__(self) -> str:
        if self._value is _UNSET and self._live():
            return str(self._real())
        return repr(self)

    def __format__(self, spec: str) -> str:
        if self._value is _UNSET and self._live():
            return format(self._real(), spec)
        return format(self._value, spec) if self._value is not _UNSET else format(repr(self), spec)

    # numpy: defer `ndarray + proxy` to our reflected operators
    __array_ufunc__ = None
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        if self._value is not _UNSET:
            return repr(self._value)
        if self._node is None and self._pending is not None:
            return f"<nnd.Proxy .{self._pending[1]}>"
        builder = self._tracer._builder
        node = next((n for n in builder.graph.nodes if n.id == self._node), None) if self._node else None
        if node is None:
            return "<nnd.Proxy>"
        kind = node.WhichOneof("kind")
        what = node.op.name if kind == "op" else f"{node.module.path or 'model'}.{_point(node.module.point)}"
        state = "" if self._live() else " (not saved)"
        return f"<nnd.Proxy %{node.id} {what}{state}>"

    # -- torch functions: torch.softmax(p, -1), F.gelu(p), torch.cat([p, q])
    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        tracer = _find_tracer(args, kwargs)
        name, reflected = op_name(func)
        args = list(args)
        if reflected and len(args) == 2:
            args.reverse()
        if tracer is None or not tracer._live():
            # After the block: compute on the real values.
            return func(*_values(args), **_values(kwargs or {}))
        return tracer._recorder()._record(name, args, kwargs or {}, func=func)


def _point(point: int) -> str:
    return {1: "output", 2: "input", 3: "inputs", 4: "result"}.get(point, "?")


def _find_tracer(args: Any, kwargs: Any) -> Tracer | None:
    stack = [args, kwargs]
    while stack:
        item = stack.pop()
        if isinstance(item, Proxy):
            return item._tracer
        if isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return None


def _values(obj: Any) -> Any:
    if isinstance(obj, Proxy):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return type(obj)(_values(i) for i in obj)
    if isinstance(obj, dict):
        return {k: _values(v) for k, v in obj.items()}
    return obj


def _record(proxy: Proxy, name: str, args: list[Any]) -> Any:
    if not proxy._live():
        return getattr(operator, name)(*_values(args))
    return proxy._tracer._recorder()._record(name, args, {})


def _binary(name: str, *, reflected: bool = False) -> Any:
    def method(self: Proxy, other: Any) -> Any:
        return _record(self, name, [other, self] if reflected else [self, other])

    return method


for _dunder, _name in _BINARY.items():
    setattr(Proxy, f"__{_dunder}__", _binary(_name))
    setattr(Proxy, f"__r{_dunder}__", _binary(_name, reflected=True))
for _dunder in _INPLACE:
    setattr(Proxy, f"__i{_dunder}__", _binary("i" + _BINARY[_dunder].rstrip("_")))
for _cmp in _COMPARE:
    setattr(Proxy, f"__{_cmp}__", _binary(_cmp))
for _dunder, _name in _UNARY.items():
    setattr(Proxy, f"__{_dunder}__", lambda self, _n=_name: _record(self, _n, [self]))


def _item(value: Any, *args: Any, **kwargs: Any) -> Any:
    """`.item()` of a sync point's value: a number as it came (the worker read its one element), else the
    tensor's own item(), which raises where torch would (more than one element)."""
    if isinstance(value, (bool, int, float)) and not args and not kwargs:
        return value
    return value.item(*args, **kwargs)
