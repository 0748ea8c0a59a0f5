"""`tracer.cache()`: every selected module's values, navigable like nnsight's CacheView."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nnd.tracing._usage import ValueNotKnown

if TYPE_CHECKING:
    from nnd.models._envoy import Envoy


@dataclass
class Entry:
    """One call of a module: its output and/or its inputs ((args, kwargs))."""

    output: Any = None
    inputs: tuple[tuple[Any, ...], dict[str, Any]] | None = None

    @property
    def input(self) -> Any:
        """The first input: the first positional argument, else the first keyword argument."""
        if self.inputs is None:
            return None
        args, kwargs = self.inputs
        values = list(args) + list(kwargs.values())
        return values[0] if values else None


ROOT = "model"  # nnsight's name of the root module: its cache keys are "model", "model.transformer.h.0"


def key_of(path: str) -> str:
    """The cache key of module `path` as nnsight 0.8 spells it ("" -> "model", "h.0" -> "model.h.0")."""
    return f"{ROOT}.{path}" if path else ROOT


class Cache:
    """What a cache recorded: cache key (nnsight's spelling, `key_of`) -> one Entry per call
    (filled after the block)."""

    def __init__(self, model: Envoy) -> None:
        self.model = model
        self.entries: dict[str, list[Entry]] = {}
        self.filled = False
        self._rank: dict[str, int] | None = None  # module path -> index in the tree (pre-order)

    def fill(self, raw: Any) -> None:
        self.entries = {}
        for path, calls in sorted((raw or {}).items(), key=lambda item: self._order(item[0])):
            items = []
            for call in calls:
                inputs = call.get("inputs")
                if isinstance(inputs, (list, tuple)) and len(inputs) == 2:
                    inputs = (tuple(inputs[0] or ()), dict(inputs[1] or {}))
                items.append(Entry(output=call.get("output"), inputs=inputs))
            self.entries[key_of(path)] = items
        self.filled = True

    def _order(self, path: str) -> tuple[int, ...]:
        """Where `path` comes among the modules' outputs in a forward, as nnsight's cache lists them: the
        module tree in post-order (a module's children, in order, before the module itself). The wire's
        map keeps no order; a path the tree does not know goes last."""
        rank = self._rank
        if rank is None:  # the envoy tree (a dispatch's ModelInfo carries no module list)
            rank = self._rank = {env.path: i for i, env in enumerate(self.model.modules())}
        if path not in rank:
            return (len(rank) + 1,)
        parts = path.split(".") if path else []
        chain = [".".join(parts[:n]) for n in range(len(parts) + 1)]
        return (*(rank.get(a, len(rank)) for a in chain), len(rank))


class CacheView:
    """The value `tracer.cache()` returns; it fills in when the block has run.

    Select a module by path (`cache["model.transformer.h.0"]`, the leading
    "model." optional, aliases allowed: `cache["model.layers.0"]`) or by
    navigation (`cache.model.layers[0]`, `cache.transformer.h[0]`), then read
    `.output`, `.inputs` or `.input`: one value, or a list with one value per
    call when the module ran several times (one per generation step).
    """

    _cache: Cache
    _envoy: Envoy | None
    _path: str | None

    def __init__(self, cache: Cache, envoy: Envoy | None, path: str | None = None) -> None:
        object.__setattr__(self, "_cache", cache)
        object.__setattr__(self, "_envoy", envoy)
        object.__setattr__(self, "_path", path)

    def save(self) -> CacheView:
        """nnsight's `tracer.cache().save()`: a cache always comes back after its block."""
        return self

    # -- values
    def _node_path(self) -> str | None:
        """This node's cache key (nnsight's spelling); None at the virtual root."""
        if self._path is not None:
            return self._path
        return key_of(self._envoy.path) if self._envoy is not None else None

    def _entries(self) -> list[Entry]:
        if not self._cache.filled:
            raise ValueNotKnown("the cache fills in when its block has run; read it after the `with`")
        path = self._node_path()
        if path is None:
            raise KeyError("the cache root is not a module; select one, e.g. cache['model.transformer.h.0']")
        if path not in self._cache.entries:
            raise KeyError(f"{path!r} was not cached (not selected, or it never ran)")
        return self._cache.entries[path]

    def _values(self, attr: str) -> Any:
        values = [getattr(entry, attr) for entry in self._entries()]
        return values[0] if len(values) == 1 else values

    @property
    def output(self) -> Any:
        """The module's output (a list, one per call, if it ran several times)."""
        return self._values("output")

    @property
    def inputs(self) -> Any:
        """The module's (args, kwargs) (a list, one per call, if it ran several times)."""
        return self._values("inputs")

    @property
    def input(self) -> Any:
        """The module's first input (a list, one per call, if it ran several times)."""
        return self._values("input")

    def keys(self) -> list[str]:
        """The cached modules at or below this node, keyed as nnsight keys them
        ("model" is the root, "model.transformer.h.0" a layer)."""
        prefix = self._node_path()
        if prefix is None:
            return list(self._cache.entries)
        return [k for k in self._cache.entries if k == prefix or k.startswith(prefix + ".")]

    # -- navigation
    def _child(self, name: str) -> Any:
        if self._envoy is None:
            model = self._cache.model
            return model if name == "model" else getattr(model, name)
        if name.lstrip("-").isdigit():
            return self._envoy[int(name)]
        return getattr(self._envoy, name)

    def _navigate(self, node: Any) -> CacheView:
        from nnd.models._envoy import Envoy

        if not isinstance(node, Envoy):
            raise AttributeError(f"{node!r} is not a module")
        return CacheView(self._cache, node)

    def __getattr__(self, name: str) -> CacheView:
        if name.startswith("_"):
            raise AttributeError(name)
        return self._navigate(self._child(name))

    def __getitem__(self, key: str | int) -> CacheView:
        if isinstance(key, int):
            if self._envoy is None:
                raise KeyError("index a module list, e.g. cache.transformer.h[0]")
            return self._navigate(self._envoy[key])
        if self._envoy is None and key in self._cache.entries:
            return CacheView(self._cache, None, path=key)
        view: CacheView = self
        for part in key.split("."):
            view = view._navigate(view._child(part))
        return view

    def __contains__(self, key: str) -> bool:
        try:
            node = self[key]
        except (AttributeError, IndexError, KeyError):
            return False
        path = node._node_path()
        return path is not None and path in self._cache.entries

    def __len__(self) -> int:
        return len(self._entries())

    def __repr__(self) -> str:
        path = self._node_path()
        at = "root" if path is None else repr(path)
        if not self._cache.filled:
            return f"CacheView({at}, not run yet)"
        return f"CacheView({at}, cached={len(self.keys())} modules)"
