"""Hooks on the modules a graph names, installed for one request and always removed.

Calls are counted per module from 0. A module whose output a graph may skip
gets a wrapped `forward` (an instance attribute) for the request; removing it
restores the class's forward. While `suppressed()` (call_module), hooks do
nothing and calls are not counted.

`count_all` (a run paused at sync points, whose later nodes may name any
module): the other modules' calls are counted too, by two process-wide hooks
(cheap: registering hooks on every module for each request is not), and
`watch` gives a module its own hooks mid-run when a node first names it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .modules import table as module_table

PreHandler = Callable[[str, int, tuple[Any, ...], dict[str, Any]], "tuple[tuple[Any, ...], dict[str, Any]] | None"]
PostHandler = Callable[[str, int, Any], Any]
SkipLookup = Callable[[str], "tuple[bool, Any]"]


class HookSet:
    def __init__(
        self,
        model: torch.nn.Module,
        paths: set[str],
        skip_paths: set[str],
        on_pre: PreHandler,
        on_post: PostHandler,
        take_skip: SkipLookup,
        *,
        count_all: bool = False,
    ) -> None:
        modules = module_table(model)
        self.table = modules
        self.modules = {p: modules[p] for p in paths}
        self.skip_paths = skip_paths
        self.on_pre = on_pre
        self.on_post = on_post
        self.take_skip = take_skip
        counted = modules if count_all else paths
        self.calls: dict[str, int] = dict.fromkeys(counted, 0)
        self.active: dict[str, list[int]] = {p: [] for p in counted}
        # Modules counted only (count_all), by identity: the global hooks see every module of the process.
        self._counted: dict[torch.nn.Module, str] = (
            {m: p for p, m in modules.items() if p not in self.modules} if count_all else {}
        )
        self._count_all = count_all
        self._installed = False
        self.suppress = 0
        self._handles: list[Any] = []
        self._patched: list[tuple[torch.nn.Module, Any]] = []

    @contextlib.contextmanager
    def installed(self) -> Iterator[HookSet]:
        try:
            self._installed = True
            if self._count_all:
                self._handles.append(torch.nn.modules.module.register_module_forward_pre_hook(self._count_pre))
                self._handles.append(torch.nn.modules.module.register_module_forward_hook(self._count_post))
            for path, module in self.modules.items():
                self._hook(path, module)
            yield self
        finally:
            self.remove()

    def _hook(self, path: str, module: torch.nn.Module) -> None:
        self._handles.append(module.register_forward_pre_hook(self._pre(path), with_kwargs=True))
        self._handles.append(module.register_forward_hook(self._post(path)))
        if path in self.skip_paths:
            self._patch(path, module)

    def watch(self, path: str) -> None:
        """Hook `path` from now on (count_all: its calls so far were counted). A module running now
        gets its post hook at its end (torch reads a module's hooks after its forward)."""
        if path in self.modules:
            return
        module = self.table[path]
        self.modules[path] = module
        self._counted.pop(module, None)
        if self._installed:
            self._hook(path, module)

    def _count_pre(self, module: torch.nn.Module, args: Any) -> None:
        path = self._counted.get(module)
        if path is None or self.suppress:
            return
        call = self.calls[path]
        self.calls[path] = call + 1
        self.active[path].append(call)

    def _count_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        path = self._counted.get(module)
        if path is None or self.suppress:
            return
        self.active[path].pop()

    def remove(self) -> None:
        self._installed = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module, previous in reversed(self._patched):
            if previous is None:
                del module.forward
            else:
                module.forward = previous
        self._patched.clear()

    @contextlib.contextmanager
    def suppressed(self) -> Iterator[None]:
        self.suppress += 1
        try:
            yield
        finally:
            self.suppress -= 1

    def _pre(self, path: str) -> Callable[..., Any]:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if self.suppress:
                return None
            call = self.calls[path]
            self.calls[path] = call + 1
            self.active[path].append(call)
            return self.on_pre(path, call, args, kwargs)

        return hook

    def _post(self, path: str) -> Callable[..., Any]:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            if self.suppress:
                return None
            call = self.active[path].pop()
            return self.on_post(path, call, output)

        return hook

    def _patch(self, path: str, module: torch.nn.Module) -> None:
        previous = module.__dict__.get("forward")
        original = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not self.suppress:
                skipped, value = self.take_skip(path)
                if skipped:
                    return value
            return original(*args, **kwargs)

        module.forward = forward
        self._patched.append((module, previous))
