"""`.save()` on any object, and values a block puts into containers outside it.

nnsight gives every object a `.save()` while it is imported (`[].save()`,
`dict().save()`), and delivers the values a block places into containers that
existed before it (`results["h"] = h`) without `.save()`. nnd does both. `save`
is mounted on `object` while a block is open and taken off when the last open one
closes: outside a block `dir(object)` is what it was before, so a library imported
after a block that walks every attribute of its classes (anyio's `TypedAttributeSet`,
hence httpx, huggingface_hub and transformers) finds nothing foreign. Mounting and
unmounting stay cheap because they do not invalidate every class: what is mounted is
a descriptor (`save_any`) that answers only while a block is open, so unmounting needs
no invalidation at all and mounting clears only the global method cache (`_forget`).
Outside a block, `obj.save()` is an AttributeError (nnsight's raises ValueError), or
the `save` mounted before nnd's answers (nnsight's, when a process uses both). At a block's end the proxies found in saved objects
and in the containers its frame held when it opened are saved, then replaced by
their values in place.
"""

from __future__ import annotations

import gc
import sys
import threading
from collections.abc import Iterator
from types import MethodType
from typing import TYPE_CHECKING, Any

from nnd.tracing import _blocknames, _context, _rebind
from nnd.tracing._proxy import Proxy

if TYPE_CHECKING:
    from types import FrameType

    from nnd.tracing._tracer import Tracer

_MAX_DEPTH = 4
_MAX_ITEMS = 100_000  # as _rebind: a container this big holds data, not a block's values
_CONTAINERS = (list, dict, tuple)
_lock = threading.Lock()
_open = 0
_previous: Any = None  # the `object.save` nnd's replaced (nnsight's), called outside nnd's blocks


def _save(self: Any, _: Any = None) -> Any:
    """`obj.save()` inside a block: keep `obj`, and the block's values inside it, after the block.
    (The unused default argument is for code that reads the signatures of every method a class
    lists, as torch's inductor does: a method with only `self` would make it generate bad code.)"""
    tracer = _context.current_or_none()
    if tracer is None:
        session = _context.innermost_session()
        if session is not None:  # a session's own Python (between its blocks): the object outlives the session
            session.saved_objects.append(self)
            return self
        if _previous is not None:  # nnsight's, in a process that uses both: its blocks' values
            return _previous(self)
        raise ValueError("`.save()` marks a value to return from a `with model.trace(...):` block; call it inside one")
    tracer._saved_objects.append(self)
    return self


class _Mounted:
    """What `object.save` is while a block is open: `obj.save` is `_save` bound to `obj`, `cls.save`
    is `_save` itself, as a function in `object`'s dict would give.

    A descriptor rather than the function, so that taking it off needs no invalidation. The
    interpreter's global method cache may still map a class's `save` to it after the last block
    closed (it keeps borrowed pointers: this object lives as long as the process); looked up then,
    it answers as `object` does now: no attribute (an AttributeError, so `hasattr` is False and a
    class's `__getattr__` runs), or the `save` mounted before nnd's (nnsight's). The interpreter never
    specialises a call site on a descriptor of this kind, so no call site remembers it either."""

    __slots__ = ()

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if not _open:  # a stale cache entry: `object` has no nnd `save` now
            previous = _previous
            if previous is None:
                if obj is None:
                    name = owner.__name__ if owner is not None else "object"
                    raise AttributeError(f"type object {name!r} has no attribute 'save'")
                raise AttributeError(f"{type(obj).__name__!r} object has no attribute 'save'")
            get = getattr(type(previous), "__get__", None)
            return previous if get is None else get(previous, obj, owner)
        if obj is None:
            return _save
        return MethodType(_save, obj)

    def __call__(self, obj: Any, _: Any = None) -> Any:
        # Callable as the function it stands for (code that calls `object.__dict__["save"](x)`).
        return _save(obj)


save_any = _Mounted()
"""The `save` nnd mounts on `object` (see `_Mounted`)."""


def _object_dict() -> dict[str, Any]:
    # The real dict behind `object.__dict__` (a read-only mappingproxy), as nnsight's C extension reaches it.
    return gc.get_referents(object.__dict__)[0]  # type: ignore[no-any-return]


_namespace: dict[str, Any] | None = None  # object's dict: the same one for the process's life
_bound_save = False  # `nnd.save` bound (once per process)


def _forget() -> None:
    """Make attribute lookups see `object`'s dict as it is now (a `save` added), without invalidating
    every class.

    `PyType_Modified(object)` would reset the version tag of every class in the process (and undo
    every specialised attribute load), ~1-2 ms with torch loaded. Adding a name that no class defines
    needs less: the global method cache, which also remembers misses (a `hasattr(x, "save")` between
    blocks), is cleared. Taking `save_any` off needs nothing (`_Mounted`)."""
    sys._clear_type_cache()


def mount() -> None:
    """A block opens: `object.save` is nnd's while any block is open (see the module's docstring)."""
    global _open, _previous, _namespace, _bound_save
    with _lock:
        _open += 1
        namespace = _namespace
        if namespace is None:
            namespace = _namespace = _object_dict()
        current = namespace.get("save")
        if current is save_any:
            return
        if not _bound_save:
            # `nnd.save` is a lazy module attribute: bind it first, or `object.save` would answer for it.
            import nnd

            nnd.__getattr__("save")
            _bound_save = True
        if "torch" not in sys.modules:
            # Results will be torch tensors (the default setting): import torch now, while `object` has
            # no `save` of ours. torch's C module refuses to load beside one, so a first result arriving
            # at a sync point inside the block (`.item()`) could not import it then. (Once torch is
            # loaded there is nothing to do: this is the check `available()` makes first.)
            from nnd.wire import _torchmod

            _torchmod.available()
        _previous = current if callable(current) else None  # another library's, mounted since
        namespace["save"] = save_any
        _forget()


def unmount() -> None:
    """A block closes: the last one open gives `object` back its `save` from before (none, or another library's)."""
    global _open
    with _lock:
        _open = max(0, _open - 1)
        namespace = _namespace if _namespace is not None else _object_dict()
        if _open or namespace.get("save") is not save_any:
            return
        if _previous is None:
            namespace.pop("save", None)
        else:
            namespace["save"] = _previous


class Tail:
    """An outer list the block only appends to: its items from `start` (its length when the block
    opened) are the block's; the ones before are data it did not create, and are not walked."""

    __slots__ = ("items", "start")

    def __init__(self, items: list[Any]) -> None:
        self.items = items
        self.start = len(items)


class Attributes:
    """An object outside the block whose attributes the body sets (`holder.h = ...`): the block's
    values placed there are delivered, as nnsight's (the object is the caller's, not a copy)."""

    __slots__ = ("obj", "names")

    def __init__(self, obj: Any, names: list[str]) -> None:
        self.obj = obj
        self.names = names

    def items(self) -> list[Any]:
        # The instance's own dict only: a property (an envoy's `.output`) is never run after the block.
        own = _instance_dict(self.obj)
        return [own.get(name) for name in self.names]


def _instance_dict(obj: Any) -> dict[str, Any]:
    try:
        own = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        return {}
    return own if type(own) is dict else {}


def containers_of(frame: FrameType | None, names: _blocknames.BlockNames | None) -> list[Any]:
    """The outer containers of a block opening in the user's frame: the lists and dicts its body
    fills (`names`; None: every list and dict the frame's locals hold, the body being unknown)."""
    if frame is None:
        return []
    if names is None:
        return [v for v in list(frame.f_locals.values()) if type(v) in (list, dict)]
    if not names.filled:
        return []
    local_vars = frame.f_locals
    outer: list[Any] = []
    for name in names.filled:
        value = local_vars[name] if name in local_vars else frame.f_globals.get(name)
        if type(value) is list and name in names.append_only:
            outer.append(Tail(value))
        elif type(value) in (list, dict):
            outer.append(value)
    attributes: dict[str, list[str]] = {}
    for name, attribute in names.attributes:
        attributes.setdefault(name, []).append(attribute)
    for name, wanted in attributes.items():
        value = local_vars[name] if name in local_vars else frame.f_globals.get(name)
        # A plain object of the user's (nnd's own, such as an envoy whose `.output` the body sets, are not).
        if value is None or isinstance(value, (type, Proxy)) or type(value).__module__.startswith("nnd"):
            continue
        if isinstance(getattr(value, "__dict__", None), dict):
            outer.append(Attributes(value, wanted))
    return outer


def proxies_in(obj: Any, depth: int = 0) -> Iterator[Proxy]:
    if isinstance(obj, Proxy):
        yield obj
    elif type(obj) is Attributes:
        for item in obj.items():
            yield from proxies_in(item, depth + 1)
    elif type(obj) is Tail:
        _rebind.walked[0] += max(0, len(obj.items) - obj.start)
        for item in obj.items[obj.start :]:
            yield from proxies_in(item, depth + 1)
    elif depth < _MAX_DEPTH and type(obj) in _CONTAINERS and len(obj) <= _MAX_ITEMS:  # big data is not walked
        _rebind.walked[0] += len(obj)
        items = obj.values() if isinstance(obj, dict) else obj
        for item in list(items):
            yield from proxies_in(item, depth + 1)


def save_held(tracer: Tracer, holders: list[Any]) -> None:
    """Save the block's unsaved values found in `holders` (saved objects, outer containers)."""
    saved = {id(p) for p in tracer._saved.values()}
    builder = tracer._builder
    scopes: dict[int, int] | None = None
    for holder in holders:
        for proxy in proxies_in(holder):
            if proxy._tracer is not tracer or not proxy._live() or proxy._resolved or id(proxy) in saved:
                continue
            if proxy._node is None and proxy._pending is None:  # a client-side value: saved where it was read
                tracer._save(proxy)
                saved.add(id(proxy))
                continue
            if scopes is None:
                scopes = {n.id: n.scope for n in builder.graph.nodes}
            # The save goes where the value lives (a loop pass's scope: that step's value).
            builder._scopes.append(scopes.get(proxy._ref(), 0))
            try:
                proxy.save()
            finally:
                builder._scopes.pop()
            saved.add(id(proxy))


def fill(holders: list[Any], replacements: _rebind.Replacements) -> None:
    """Replace the proxies inside `holders` by their values, in place."""
    for holder in holders:
        if type(holder) is Tail:
            _rebind.replace_from(holder.items, holder.start, replacements)
        elif type(holder) in (list, dict):
            _rebind.replace_inside(holder, replacements)
        elif type(holder) is Attributes:
            for name, item in zip(holder.names, holder.items(), strict=True):
                hit, new = _rebind.replace_item(item, replacements)
                if hit:
                    setattr(holder.obj, name, new)
