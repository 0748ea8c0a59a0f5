"""Envoys: the model's module tree on the client, built from the daemon's
description. Inside a block, `.output`, `.input` and `.inputs` are proxies of
the values seen at that module; outside, envoys are only for navigation."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from nnd.models import _printing
from nnd.tracing import _context
from nnd.tracing._proxy import Proxy
from nnd.v1 import graph_pb2, nnd_pb2
from nnd.wire import _torchmod

if TYPE_CHECKING:
    from nnd.models._model import TransformersModel
    from nnd.tracing._tracer import Tracer


# nnsight's name for a submodule called after a value every module serves (`output`, `input`...): the value
# keeps the name, the submodule is reached as `E_<name>`.
OVERLOAD_PREFIX = "E_"


def _serves(name: str) -> bool:
    return bool(name) and not name.startswith("_") and isinstance(getattr(Envoy, name, None), property)


class Envoy:
    """One module of the model. Reach children as attributes
    (`model.transformer.h`) or by index (`h[5]`, `h[-1]`, `h[2:4]`), iterate
    a ModuleList with `for layer in model.transformer.h`."""

    _SELF_ATTRS = frozenset({"output", "input", "inputs"})
    _model: TransformersModel | None
    _path: str
    _type: str
    _extra: str
    _children: dict[str, Envoy]
    _aliases: dict[str, Envoy]
    _parameters: list[nnd_pb2.ParameterInfo]

    def __init__(self, model: TransformersModel | None, path: str, type_name: str, extra: str = "") -> None:
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_type", type_name)
        object.__setattr__(self, "_extra", extra)
        object.__setattr__(self, "_children", {})
        object.__setattr__(self, "_aliases", {})
        object.__setattr__(self, "_parameters", [])
        object.__setattr__(self, "_attributes", {})

    # -- tree
    def _child_items(self) -> Iterable[tuple[str, Envoy]]:
        return self._children.items()

    def __getattr__(self, name: str) -> Envoy:
        children = self.__dict__.get("_children")
        if children is not None and name in children:
            return children[name]
        aliases = self.__dict__.get("_aliases")
        if aliases and name in aliases:  # rename= and the daemon's standard names
            return aliases[name]
        served = name[len(OVERLOAD_PREFIX) :] if name.startswith(OVERLOAD_PREFIX) else ""
        if children is not None and served in children and _serves(served):
            return children[served]  # BERT's `output` module: `.output` is the value, `.E_output` the module
        info = self._tensor_info(name)
        if info is not None:  # a parameter or buffer (`lm_head.weight`)
            return self._tensor(info)
        attributes = self.__dict__.get("_attributes")
        if attributes and name in attributes:  # the module's plain attributes (`attn.head_dim`)
            return self._attribute(name, attributes[name])
        if name.startswith("__") or children is None:
            raise AttributeError(name)
        where = self._path or "the model"
        valid = ", ".join([*children, *(aliases or ())]) or "none"
        raise AttributeError(f"{where} ({self._type}) has no module {name!r}; its children are: {valid}")

    def _attribute(self, name: str, value: Any) -> Any:
        if isinstance(value, dict) and value.get("$config") and self._model is not None:
            return self._model.config  # the module holds the model's config (as transformers modules do)
        return tuple(value) if isinstance(value, list) else value  # tuples travel as JSON lists

    def _tensor_info(self, name: str) -> nnd_pb2.ParameterInfo | None:
        for info in self.__dict__.get("_parameters") or ():
            if info.name == name:
                return info
        return None

    def _tensor(self, info: nnd_pb2.ParameterInfo) -> Any:
        """Inside a block of this model, a proxy of the module's real tensor on the daemon (its
        shape and dtype known at once); elsewhere a tensor whose values come from the daemon when
        first used (_weights.py), or without torch its shape and dtype."""
        from nnd.wire import _meta

        tracer = _context.current_or_none()
        model_family = getattr(self._model, "_family", None)
        if tracer is not None and tracer._live() and getattr(tracer.model, "_family", None) is model_family:
            meta = _meta.MetaTensor(tuple(info.shape), info.dtype)
            return Proxy(tracer, tracer._recorder()._builder.tensor(self._path, info.name, meta))
        if self._model is None or _torchmod.available() is None:
            return _meta_weight(self._model, self._path, info)
        from nnd.models import _weights

        return _weights.outside(self._model, self._path, info)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._SELF_ATTRS or name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        if self._tensor_info(name) is not None:
            where = f"{self._path}.{name}" if self._path else name
            raise RuntimeError(
                f"cannot change {where}: the daemon's model is shared by every client and its weights never "
                "change (nnsight would change the model for good, or refuse an in-place write as torch does). "
                f"Change what the module computes instead: set `{self._path or 'model'}.output` inside a trace"
            )
        raise AttributeError(f"cannot assign {name!r} on a module of the model; set `.output` inside a trace")

    def __getitem__(self, key: int | slice | str) -> Any:
        children = list(self._children.values())
        if isinstance(key, str):
            if key not in self._children:
                return getattr(self, key)
            return self._children[key]
        if isinstance(key, slice):
            return children[key]
        try:
            return children[key]
        except IndexError:
            raise IndexError(
                f"{self._path or 'the model'} has {len(children)} modules; index {key} is out of range"
            ) from None

    def __len__(self) -> int:
        return len(self._children)

    def __iter__(self) -> Iterator[Envoy]:
        return iter(list(self._children.values()))

    def __dir__(self) -> list[str]:
        """The public API, the modules reachable as attributes and the module's own parameters
        and buffers: no private names, and not a ModuleList's "0", "1" (`h[0]`, not `h.0`)."""
        api = {name for name in super().__dir__() if not name.startswith("_")}
        tensors = [info.name for info in self._parameters]  # `lm_head.weight` completes too
        return sorted(api | {name for name in (*self._children, *self._aliases, *tensors) if name.isidentifier()})

    def __repr__(self) -> str:
        return _printing.render(self)

    def modules(self) -> Iterator[Envoy]:
        """This module and every module below it, in `named_modules()` order."""
        yield self
        for child in self._children.values():
            yield from child.modules()

    def named_modules(self) -> Iterator[tuple[str, Envoy]]:
        """(dotted path, envoy) pairs, as torch's `named_modules()`."""
        for env in self.modules():
            yield env._path, env

    @property
    def path(self) -> str:
        """The dotted module path ("" is the root)."""
        return self._path

    def named_parameters(self, prefix: str = "", recurse: bool = True) -> Iterator[tuple[str, Any]]:
        """(name, parameter) pairs as torch's `named_parameters()` (tied weights
        once): shapes and dtypes, no data — the weights stay in the daemon. Each
        is a `torch.nn.Parameter` on the "meta" device (an `nnd.MetaTensor`
        without torch)."""

        base = len(self._path) + 1 if self._path else 0
        for env in self.modules() if recurse else iter([self]):
            for info in env._parameters:
                if info.buffer or info.tied_to:
                    continue
                full = f"{env._path}.{info.name}" if env._path else info.name
                name = full[base:]
                yield (f"{prefix}.{name}" if prefix else name), _meta_weight(self._model, env._path, info)

    def parameters(self, recurse: bool = True) -> Iterator[Any]:
        """The parameters of `named_parameters()`."""
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    # -- values inside a block
    def _tracer(self, what: str) -> Tracer:
        tracer = _context.current(f"`{self._path or 'model'}.{what}`")
        if self._model is not None and getattr(tracer.model, "_family", None) is not self._model._family:
            raise ValueError(f"`{self._path}.{what}` belongs to another model than the one being traced")
        return tracer

    @property
    def output(self) -> Proxy:
        """What this module returned (a new node on each read)."""
        return self._tracer("output")._module(self._path, graph_pb2.OUTPUT)

    @output.setter
    def output(self, value: Any) -> None:
        self._tracer("output")._set(self._path, graph_pb2.OUTPUT, value)

    @property
    def input(self) -> Proxy:
        """The first positional argument this module was called with."""
        return self._tracer("input")._module(self._path, graph_pb2.INPUT)

    @input.setter
    def input(self, value: Any) -> None:
        self._tracer("input")._set(self._path, graph_pb2.INPUT, value)

    @property
    def inputs(self) -> Proxy:
        """All arguments: a tuple (args tuple, kwargs dict)."""
        return self._tracer("inputs")._module(self._path, graph_pb2.INPUTS)

    @inputs.setter
    def inputs(self, value: Any) -> None:
        self._tracer("inputs")._set(self._path, graph_pb2.INPUTS, value)

    @property
    def iter(self) -> Any:
        """Deprecated alias of `tracer.iter`, on any module (as nnsight 0.8's `envoy.iter`)."""
        import warnings

        warnings.warn("model.iter is deprecated; use tracer.iter instead.", FutureWarning, stacklevel=2)
        return _context.current("`.iter`").iter

    def all(self) -> Any:
        """Deprecated alias of `tracer.all()`, on any module (as nnsight 0.8's `envoy.all()`)."""
        import warnings

        warnings.warn("model.all() is deprecated; use tracer.all() instead.", FutureWarning, stacklevel=2)
        return _context.current("`.all()`").all()

    def skip(self, value: Any) -> None:
        """Do not run this module; use `value` as its output."""
        self._tracer("skip()")._skip(self._path, value)

    @property
    def source(self) -> Any:
        """The operations inside this module's forward (nnsight's `.source`): print it for their
        names; `source.<name>.output` / `.input` / `.inputs` inside a block (_opsource.py)."""
        from nnd.models import _opsource

        return _opsource.fetch(self)

    def __call__(self, *args: Any, **kwargs: Any) -> Proxy:
        """Run this module out of place on traced values (a logit lens:
        `model.lm_head(h)`), recorded as a "call_module" op."""
        return self._tracer("()")._record("call_module", [self._path, *args], kwargs)


def _meta_weight(model: TransformersModel | None, path: str, info: nnd_pb2.ParameterInfo) -> Any:
    """A weight's shape and dtype on the "meta" device, tagged with where it lives so that a block
    of its model it is passed into reads the real tensor (tracing/_graph.weight_of)."""
    from nnd.tracing._graph import WEIGHT_TAG
    from nnd.wire import _meta

    value = _meta.parameter(list(info.shape), info.dtype)
    if not isinstance(value, _meta.MetaTensor):
        value.__dict__.update({WEIGHT_TAG: (path, info.name), "_nnd_model": model})
    return value


def build_tree(model: TransformersModel | None, modules: Iterable[nnd_pb2.ModuleInfo], root: Envoy) -> None:
    """Attach envoys for `modules` (in `named_modules()` order) below `root`."""
    by_path: dict[str, Envoy] = {"": root}
    for info in modules:
        if info.path == "":
            object.__setattr__(root, "_type", info.type or root._type)
            object.__setattr__(root, "_extra", info.extra)
            object.__setattr__(root, "_parameters", list(info.parameters))
            object.__setattr__(root, "_attributes", _attributes(info))
            continue
        parent_path, _, name = info.path.rpartition(".")
        parent = by_path.get(parent_path)
        if parent is None:
            raise ValueError(f"module {info.path!r} arrived before its parent")
        env = Envoy(model, info.path, info.type, info.extra)
        object.__setattr__(env, "_parameters", list(info.parameters))
        object.__setattr__(env, "_attributes", _attributes(info))
        parent._children[name] = env
        by_path[info.path] = env
    for info in modules:  # aliases: "<host path>.<alias>" names this module on the host
        for alias in getattr(info, "aliases", ()):
            host_path, _, name = alias.rpartition(".")
            host, target = by_path.get(host_path), by_path.get(info.path)
            if host is not None and target is not None and name not in host._children:
                host._aliases[name] = target
    from nnd.models import _ipython

    _ipython.install()  # a model's tree exists: in a notebook, it completes with <TAB> (_completion.py)


def _attributes(info: nnd_pb2.ModuleInfo) -> dict[str, Any]:
    import json

    text = getattr(info, "attributes_json", "")
    return json.loads(text) if text else {}
