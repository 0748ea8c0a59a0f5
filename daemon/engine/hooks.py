"""Hooks on the modules a graph names, installed for one request and always removed.

Calls are counted per module from 0. A module whose output a graph may skip
gets a wrapped `forward` (an instance attribute) for the request; removing it
restores the class's forward. While `suppressed()` (call_module), hooks do
nothing and calls are not counted.

Operations inside a forward (source.py) are hooked like modules, under their
internal path ("h.0.attn.source.split_0"): the module gets an instrumented
`forward` for the request, whose named operations run the same pre/skip/post
handlers and are counted the same way.

`count_all` (a run paused at sync points, whose later nodes may name any
module): the other modules' calls are counted too, and `watch` gives a module
its own hooks mid-run when a node first names it. Counting is callcount.py's
C counters on every module (no Python frame per module call), read when a node
first names a module. A module named while one of its calls runs needs that
call's end, which torch's fast path never reports to a hook added meanwhile:
the modules that contain a hooked module (its ancestors, through every parent
that registers it; the root always) get a Python `_compiled_call_impl` for the
run (`_track`) that counts them and ends such a call (`ended_watched`). Calls
nest the way modules contain each other in the models nnd serves, so a run
pauses only inside calls of tracked modules; a module that runs at a pause
without being tracked (called from outside the modules that contain it) and is
then named is refused, unless torch runs its hooks anyway (it had hooks of its
own as the call began).
Why not torch's process-wide hooks: any global hook sends every module call
down torch's slow path (measured in-process on a GPT-2 4x64 forward: +1.1 to
+1.5 ms); per-module hooks or `forward` wrappers on every module cost more to
install and remove per request.
"""

from __future__ import annotations

import collections
import contextlib
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from .. import errors
from . import callcount, source
from .modules import ancestors as module_ancestors
from .modules import paths as module_paths
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
        ops: Mapping[str, tuple[str, str]] | None = None,
        *,
        count_all: bool = False,
    ) -> None:
        modules = module_table(model)
        self.model = model
        self.table = modules
        # Operation sites -> (module path, operation name); every other path is a module.
        self.ops = dict(ops or {})
        self.modules = {p: modules[p] for p in paths if p not in self.ops}
        self._sites: dict[str, dict[str, str]] = {}  # module path -> {operation name: site}
        # Operation site -> how many calls its module had made when its forward was instrumented.
        self.since: dict[str, int] = {}
        self.skip_paths = skip_paths
        self.on_pre = on_pre
        self.on_post = on_post
        self.take_skip = take_skip
        counted = modules if count_all else paths
        self.calls: dict[str, int] = dict.fromkeys(counted, 0)
        # Per path, the calls running now (innermost last); a list made at a path's first call.
        self.active: dict[str, list[int]] = collections.defaultdict(list)
        # Modules counted only (count_all), by identity, with their paths.
        self._counted: dict[torch.nn.Module, str] = {}
        if count_all:
            self._counted = dict(module_paths(model))
            for module in self.modules.values():
                self._counted.pop(module, None)
        self._count_all = count_all
        # count_all: the model's counters while this run owns them, and what it banked of them while it
        # lent the model (suppressed); `calls` of a module counted only are read from them when needed.
        self._counters: callcount.Counters | None = None
        self._banked: list[int] | None = None
        # Counted modules this run tracks (`_track`) -> the `_compiled_call_impl` its tracker replaced.
        self._tracked: dict[torch.nn.Module, Any] = {}
        # Modules first named while calls of them ran: their path, and those calls (`ended_watched`).
        self._running: dict[torch.nn.Module, tuple[str, list[int]]] = {}
        self._installed = False
        self._live = False  # installed, and the model may have run since: counts can be past 0
        self.suppress = 0
        self._handles: list[Any] = []
        self._patched: list[tuple[torch.nn.Module, str, Any]] = []

    @contextlib.contextmanager
    def installed(self) -> Iterator[HookSet]:
        try:
            self._installed = True
            if self._count_all:
                self._counters = callcount.of(self.model)
                self._counters.take(self)
                self._track_above([self.model, *self.modules.values()])
            for site in self.ops:  # before skips: a skip wraps the instrumented forward
                self.add_op(site, self.ops[site])
            for path, module in self.modules.items():
                self._hook(path, module)
            self._live = True
            yield self
        finally:
            self.remove()

    def _hook(self, path: str, module: torch.nn.Module) -> None:
        self._handles.append(module.register_forward_pre_hook(self._pre(path), with_kwargs=True))
        self._handles.append(module.register_forward_hook(self._post(path)))
        if path in self.skip_paths:
            self._patch(path, module)

    def watch(self, path: str) -> None:
        """Hook `path` from now on (count_all: its calls so far were counted). A call running now ends
        through its post hook, or `ended_watched` where torch does not run it."""
        if path in self.modules or path not in self.table:  # not a module: an operation site (add_op)
            return
        module = self.table[path]
        self.modules[path] = module
        if self._count_all and module in self._counted:
            if module not in self._tracked:
                self._catch_up(module, path, ends=True)
            del self._counted[module]
            if self.active[path]:
                self._running[module] = (path, list(self.active[path]))
            self._track_above([module])
        if self._installed:
            self._hook(path, module)

    def ended_watched(self, module: torch.nn.Module, output: Any) -> Any:
        """A call of `module` that began before a node first named it ends (the run's tracker on it calls
        this). torch runs a post hook added during a call only if the module had hooks when the call
        began (else it took its fast path): when it did not run ours, the call's end is handled here."""
        entry = self._running.get(module)
        if entry is None:  # the run has ended (its hooks were removed)
            return output
        path, calls = entry
        call = calls.pop()  # calls nest: the innermost of them ends first
        if not calls:
            del self._running[module]
        active = self.active[path]
        if self.suppress or call not in active:  # torch ran the post hook
            return output
        active.remove(call)
        replaced = self.on_post(path, call, output)
        return output if replaced is None else replaced

    def calls_of(self, path: str) -> int:
        """Calls of the module or operation site `path` so far in this run."""
        module = self.table.get(path)
        counters = self._counters
        if (
            module is not None
            and counters is not None
            and counters.owner is self
            and module in self._counted
            and module not in self._tracked
        ):
            return self._count(module)
        return self.calls.get(path, 0)

    def _count(self, module: torch.nn.Module) -> int:
        """Calls of `module` (counted only, not tracked) in this run so far."""
        assert self._counters is not None
        made = self._counters.count(module)
        return made + (self._banked[self._counters.index[module]] if self._banked is not None else 0)

    def _catch_up(self, module: torch.nn.Module, path: str, *, ends: bool) -> None:
        """Bring `calls` and `active` of `module`, counted by its counter so far, up to date. A call of it
        running now is open only once (calls of one module nesting is not followed); with `ends`, its end
        is needed, which torch gives only if the module had hooks of its own as the call began."""
        made = self._count(module)
        self.calls[path] = made
        running = _running_calls(module)
        self.active[path] = [made - 1] if running else []
        if running > 1 or (running and ends and not _runs_hooks(module)):
            raise errors.Unimplemented(
                f"{path!r} was running when the run paused, called from outside the modules that contain it, "
                "so nnd cannot follow that call to its end: name it before the first sync point"
            )

    def _track_above(self, named: list[torch.nn.Module]) -> None:
        """Track the counted modules that contain those of `named` (and `named` themselves where counted
        only) and are not running now: a later pause inside one of their calls can name them."""
        above = module_ancestors(self.model)
        todo = [m for n in named for m in (n, *above.get(n, ())) if m in self._counted and m not in self._tracked]
        for module in dict.fromkeys(todo):
            if self._live and _running_calls(module):
                continue  # its call began untracked: counted by its counter, refused if named while it runs
            self._track(module)

    def _track(self, module: torch.nn.Module) -> None:
        path = self._counted[module]
        if self._live:
            self._catch_up(module, path, ends=False)
        inner = module.__dict__.get("_compiled_call_impl") or module._call_impl
        self._tracked[module] = module.__dict__.get("_compiled_call_impl")
        calls, active, counted = self.calls, self.active, self._counted  # changed in place, never rebound

        def tracker(*args: Any, **kwargs: Any) -> Any:
            if self.suppress or not self._count_all or module not in counted:
                return inner(*args, **kwargs)
            call = calls[path]
            calls[path] = call + 1
            opened = active[path]
            opened.append(call)
            try:
                output = inner(*args, **kwargs)
            except BaseException:
                if module in counted:
                    opened.pop()
                raise
            if module in counted:
                opened.pop()
                return output
            return self.ended_watched(module, output)  # named while this call ran

        tracker._nnd_inner = inner  # type: ignore[attr-defined]
        module.__dict__["_compiled_call_impl"] = tracker

    def stop_counting(self) -> None:
        """No node can name a module any more (the client's last message came): the run gives up the
        counters and its trackers stop counting, so a sync point halfway through a forward leaves half of
        it uncounted. A call that began before still ends through `ended_watched` where it must: its
        tracker chose to count it as the call began."""
        if self._count_all:
            self._count_all = False
            if self._counters is not None:
                self._counters.release(self)

    def remove(self) -> None:
        self._installed = self._live = False
        if self._counters is not None:
            self._counters.release(self)
            self._count_all = False
            self._running.clear()
        for module, before in reversed(self._tracked.items()):
            if before is None:
                module.__dict__.pop("_compiled_call_impl", None)
            else:
                module.__dict__["_compiled_call_impl"] = before
        self._tracked.clear()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for module, attr, previous in reversed(self._patched):
            if previous is None:
                delattr(module, attr)
            else:
                setattr(module, attr, previous)
        self._patched.clear()
        self._sites.clear()

    @contextlib.contextmanager
    def suppressed(self) -> Iterator[None]:
        """Calls meanwhile are not this run's: not hooked, not counted. A counting run banks its counts
        and gives the counters up (a generation lends the model to other runs between its steps)."""
        lent = self.suppress == 0 and self._count_all and self._counters is not None
        if lent:
            assert self._counters is not None
            counted = self._counters.release(self, bank=True) or []
            self._banked = counted if self._banked is None else list(map(int.__add__, self._banked, counted))
        self.suppress += 1
        try:
            yield
        finally:
            self.suppress -= 1
            if lent and self._count_all and self._counters is not None:
                self._counters.take(self)

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

    def add_op(self, site: str, where: tuple[str, str]) -> None:
        """Hook operation `where` = (module path, name) under `site`; the first of a module
        installs its instrumented forward (also while running, for nodes added at a sync point).
        A nested name "a.b" hooks operation b inside the function operation a calls."""
        path, name = where
        self.ops[site] = where
        self.calls.setdefault(site, 0)
        self.active.setdefault(site, [])
        tree = self._sites.get(path)
        fresh = tree is None
        if tree is None:
            if self._count_all:  # `since` and executor.passed read its module's calls from now on
                self._track_above([self.table[path]])
            tree = self._sites[path] = _OpTree()
            self.since[site] = self.calls_of(path)
        else:
            self.since[site] = self.since[tree.first]
        tree.add(name.split("."), site)
        if not fresh:
            return
        module = self.table[path]
        forward = source.instrumented(module, self._on_op(tree, path or "model"), repr(path))
        # accelerate keeps the real forward in `_old_forward` and calls it between its device moves.
        attr = "_old_forward" if "_hf_hook" in module.__dict__ and "_old_forward" in module.__dict__ else "forward"
        self._patched.append((module, attr, module.__dict__.get(attr)))
        setattr(module, attr, forward)

    def _on_op(self, tree: _OpTree, where: str) -> source.OpCall:
        def on_op(op: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if self.suppress:
                return fn(*args, **kwargs)
            inner = tree.children.get(op)
            if inner is not None:  # operations inside the function this one calls
                at = f"{where}.source.{op}"
                fn = source.instrumented_call(fn, self._on_op(inner, at), inner.names(), at)
            hooked = tree.sites.get(op)
            if hooked is None:
                return fn(*args, **kwargs)
            return self._run_op(hooked, fn, args, kwargs)

        return on_op

    def _run_op(self, site: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        call = self.calls[site]
        self.calls[site] = call + 1
        self.active[site].append(call)
        changed = self.on_pre(site, call, args, kwargs)
        if changed is not None:
            args, kwargs = changed
        skipped, output = self.take_skip(site) if site in self.skip_paths else (False, None)
        if not skipped:
            output = fn(*args, **kwargs)
        self.active[site].pop()
        replaced = self.on_post(site, call, output)
        return output if replaced is None else replaced

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
        self._patched.append((module, "forward", previous))


class _OpTree:
    """The operations hooked in one forward: sites by name, and per name the operations hooked inside
    the function that operation calls."""

    def __init__(self) -> None:
        self.sites: dict[str, str] = {}
        self.children: dict[str, _OpTree] = {}
        self.first = ""

    def add(self, chain: list[str], site: str) -> None:
        self.first = self.first or site
        if len(chain) == 1:
            self.sites[chain[0]] = site
        else:
            self.children.setdefault(chain[0], _OpTree()).add(chain[1:], site)

    def names(self) -> list[str]:
        return [*self.sites, *self.children]


def _running_calls(module: torch.nn.Module) -> int:
    """How many calls of `module` are on this thread's stack (`_call_impl` frames with it as self)."""
    code = getattr(type(module)._call_impl, "__code__", None)
    found = 0
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code and frame.f_locals.get("self") is module:
            found += 1
        frame = frame.f_back
    return found


def _runs_hooks(module: torch.nn.Module) -> bool:
    """Whether a call of `module` takes torch's slow path, which runs forward hooks added during it."""
    from torch.nn.modules import module as torch_module

    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or torch_module._global_forward_hooks
        or torch_module._global_forward_pre_hooks
        or torch_module._global_backward_hooks
        or torch_module._global_backward_pre_hooks
    )
