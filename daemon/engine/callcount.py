"""Per-model counters of module calls, for runs that pause at sync points (hooks.py `count_all`).

A node added at a sync point may name any module, so a pausable run must know how many times every
module has been called so far. torch's `Module.__call__` calls an instance's `_compiled_call_impl`
instead of `_call_impl` when one is set (`Module.compile()` sets it); here each module gets an
uncached `functools.lru_cache` wrapper of what it called before. With maxsize 0 that wrapper is C
(`_functools`): it counts its calls and passes them on, so a module call costs no Python frame. The
wrapper nnd used before (a Python function on `nn.Module._call_impl`) cost a frame per call: on GPT-2
12x768 in-process ~0.4 ms of a paused trace, 4x64 ~0.15 ms, and while mounted every other request
paid it too. The counters stay mounted once a model has seen a pausable run (~0.1 us a call).

One run at a time owns a model's counters (`take`: reset to 0), and a run that lends the model to
others while suppressed (a generation between steps) first banks what it counted (`release`), so a
lent run can take them meanwhile. `cache_info` is set to return the count alone (no namedtuple), so
reading or banking every counter is a C loop over C calls. A copy or pickle of a module leaves the
counter behind (`Module.__getstate__` drops `_compiled_call_impl`), so a copy runs its own forward.
"""

from __future__ import annotations

import collections
import functools
import operator
import weakref
from typing import Any

import torch

from . import modules as model_modules

_Counter = functools._lru_cache_wrapper  # type: ignore[attr-defined]


def _misses(_hits: int, misses: int, _maxsize: int, _currsize: int) -> int:
    return misses


_read = operator.methodcaller("cache_info")
_clear = operator.methodcaller("cache_clear")
_mounted_fn = operator.attrgetter("_compiled_call_impl")


class Counters:
    """A model's call counters, one per module, mounted on the modules."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.modules = list(model_modules.paths(model))
        self.index = {m: i for i, m in enumerate(self.modules)}
        self.counters: list[Any] = [_mount(m) for m in self.modules]
        self.owner: object | None = None

    def take(self, owner: object) -> None:
        """`owner` counts from 0 now. Counters that something replaced since (a module compiled, say)
        are mounted again around what replaced them."""
        if self.owner is not None and self.owner is not owner:
            raise RuntimeError("two pausable runs of one model counted its module calls at once")
        self.owner = owner
        if not all(map(operator.is_, map(_mounted_fn, self.modules), self.counters)):  # C: the usual case
            pairs = zip(self.modules, self.counters, strict=True)
            self.counters = [c if _is_ours(_mounted_fn(m), c) else _mount(m) for m, c in pairs]
        collections.deque(map(_clear, self.counters), maxlen=0)

    def release(self, owner: object, *, bank: bool = False) -> list[int] | None:
        """`owner` stops counting; with `bank`, its counts so far (per module, in `modules` order). None
        when it did not own the counters."""
        if self.owner is not owner:
            return None
        self.owner = None
        return list(map(_read, self.counters)) if bank else None

    def count(self, module: torch.nn.Module) -> int:
        """Calls of `module` since the owner took the counters."""
        i = self.index[module]
        counter = self.counters[i]
        if not _is_ours(_mounted_fn(module), counter):
            raise RuntimeError(f"module {type(module).__name__} was re-wrapped while nnd counted its calls")
        return int(_read(counter))


def _mount(module: torch.nn.Module) -> Any:
    before = module.__dict__.get("_compiled_call_impl")
    counter = _Counter(before if before is not None else module._call_impl, 0, False, _misses)
    module.__dict__["_compiled_call_impl"] = counter
    return counter


def _is_ours(mounted: Any, counter: Any) -> bool:
    """Whether `counter` still sees the calls: mounted itself, or inside the trackers runs put over it."""
    while mounted is not counter:
        mounted = getattr(mounted, "_nnd_inner", None)
        if mounted is None:
            return False
    return True


_counters: weakref.WeakKeyDictionary[torch.nn.Module, Counters] = weakref.WeakKeyDictionary()


def of(model: torch.nn.Module) -> Counters:
    """`model`'s counters, mounted on its first call."""
    found = _counters.get(model)
    if found is None:
        found = _counters[model] = Counters(model)
    return found
