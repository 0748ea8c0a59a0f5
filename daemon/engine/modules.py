"""Per-model lookups every request needs, computed once per model.

A loaded model's module tree does not change while nnd holds it (placement,
quantization and sharding happen before the first request), so the path →
module table and what derives from it are kept per model object instead of
walking `named_modules()` several times a request (~0.2 ms on a 2-layer GPT-2,
a third of its forward). The tables are shared: callers must not mutate them.
"""

from __future__ import annotations

import inspect
import weakref

import torch

_tables: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, torch.nn.Module]] = weakref.WeakKeyDictionary()
_containers: weakref.WeakKeyDictionary[torch.nn.Module, frozenset[str]] = weakref.WeakKeyDictionary()
_paths: weakref.WeakKeyDictionary[torch.nn.Module, dict[torch.nn.Module, str]] = weakref.WeakKeyDictionary()
_params: weakref.WeakKeyDictionary[torch.nn.Module, frozenset[str] | None] = weakref.WeakKeyDictionary()
_ancestors: weakref.WeakKeyDictionary[torch.nn.Module, dict[torch.nn.Module, frozenset[torch.nn.Module]]] = (
    weakref.WeakKeyDictionary()
)


def table(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Every module of `model` by dotted path ("" is the model)."""
    found = _tables.get(model)
    if found is None:
        found = _tables[model] = dict(model.named_modules())
    return found


def paths(model: torch.nn.Module) -> dict[torch.nn.Module, str]:
    """Each module of `model` -> its path in `table` (named_modules lists a module shared by two
    parents once, so each has one path). Not to be changed by the caller."""
    found = _paths.get(model)
    if found is None:
        found = _paths[model] = {m: p for p, m in table(model).items()}
    return found


def ancestors(model: torch.nn.Module) -> dict[torch.nn.Module, frozenset[torch.nn.Module]]:
    """Each module of `model` -> every module above it, through each parent that registers it (a module
    shared by two parents has the ancestors of both)."""
    found = _ancestors.get(model)
    if found is None:
        parents: dict[torch.nn.Module, set[torch.nn.Module]] = {m: set() for m in table(model).values()}
        for parent in parents:
            for child in parent.children():
                parents[child].add(parent)
        found = {}

        def above(m: torch.nn.Module) -> frozenset[torch.nn.Module]:
            if m not in found:
                found[m] = frozenset()  # a cycle of registrations ends here
                found[m] = frozenset().union(*({p} | above(p) for p in parents[m]))
            return found[m]

        for m in parents:
            above(m)
        _ancestors[model] = found
    return found


def containers(model: torch.nn.Module) -> frozenset[str]:
    """Paths of containers whose numbered children run in index order."""
    found = _containers.get(model)
    if found is None:
        found = _containers[model] = frozenset(
            path for path, m in table(model).items() if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential))
        )
    return found


def accepts(model: torch.nn.Module, name: str) -> bool:
    """Whether `model.forward` takes a parameter called `name`."""
    if model not in _params:
        try:
            _params[model] = frozenset(inspect.signature(model.forward).parameters)
        except (TypeError, ValueError):
            _params[model] = None
    params = _params[model]
    return params is not None and name in params
