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
its own hooks mid-run when a node first names it. The counting is a wrapper on
`nn.Module._call_impl`, mounted for the process by the first such run and
a no-op while no run counts. The wrapper only logs (the module as a call
starts, None as it ends: `HookSet.log`); the counts are read from the log when
something needs them (`watch`, `add_op`), which most runs never do: logging
costs a module call ~0.5 µs, counting in place ~2 µs (GPT-2 4×64 in-process:
+0.06 against +0.18 ms a forward over a wrapper that does nothing).
Why not torch's process-wide hooks: any global hook sends every module call
down torch's slow path (measured in-process on a GPT-2 4×64 forward: +1.1 to
+1.5 ms, against +0.1 to +0.2 ms for this wrapper counting); per-module
hooks or `forward` wrappers cost more to install and remove per request; and
mounting the wrapper per run would invalidate CPython's attribute caches for
every module class each time (+1.2 to +1.9 ms).
Mounted, it costs every module call a Python frame, so it comes off again after
UNMOUNT_AFTER runs in a row that count nothing (`note_uncounted_run`).
Only workers (and the tests' in-process engine) run the engine, so no user
process gets the wrapper. The wrapper sits inside `__call__`, so subclasses that
override `__call__` and call up are counted too.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from . import source
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
        # Modules counted only (count_all), by identity: the counting wrapper sees every module call of the process.
        self._counted: dict[torch.nn.Module, str] = {}
        if count_all:
            self._counted = dict(module_paths(model))
            for module in self.modules.values():
                self._counted.pop(module, None)
        self._count_all = count_all
        # count_all: counted modules' calls as the wrapper saw them (the module as a call starts, None as
        # it ends), not yet read into `calls` and `active`; `_open`, the calls the log read so far left open.
        self.log: list[torch.nn.Module | None] = []
        self._open: list[torch.nn.Module] = []
        # Modules first named while calls of them ran: their path, and those calls (`ended_watched`).
        self._running: dict[torch.nn.Module, tuple[str, list[int]]] = {}
        self._installed = False
        self.suppress = 0
        self._handles: list[Any] = []
        self._patched: list[tuple[torch.nn.Module, str, Any]] = []

    @contextlib.contextmanager
    def installed(self) -> Iterator[HookSet]:
        try:
            self._installed = True
            if self._count_all:
                _start_counting(self)
            else:
                note_uncounted_run()
            for site in self.ops:  # before skips: a skip wraps the instrumented forward
                self.add_op(site, self.ops[site])
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
        """Hook `path` from now on (count_all: its calls so far were counted). A call running now ends
        through its post hook, or `ended_watched` where torch does not run it."""
        if path in self.modules or path not in self.table:  # not a module: an operation site (add_op)
            return
        module = self.table[path]
        self.modules[path] = module
        self.read_log()  # its calls so far, while the log still counts them
        if self._counted.pop(module, None) is not None and self.active[path]:
            self._running[module] = (path, list(self.active[path]))
        if self._installed:
            self._hook(path, module)

    def ended_watched(self, module: torch.nn.Module, output: Any) -> Any:
        """A call of `module` that began before a node first named it ends (the counting wrapper calls
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

    def read_log(self) -> None:
        """Bring `calls` and `active` of the counted modules up to date with the wrapper's log. Calls
        nest, so an end (None) ends the latest call still open. A module watched since a call of it
        began is no longer counted here: its own post hook ends that call."""
        log = self.log
        if not log:
            return
        counted, calls, active, opened = self._counted, self.calls, self.active, self._open
        for module in log:
            if module is None:
                path = counted.get(opened.pop())
                if path is not None:
                    active[path].pop()
                continue
            opened.append(module)
            path = counted.get(module)
            if path is not None:
                call = calls[path]
                calls[path] = call + 1
                active[path].append(call)
        log.clear()

    def stop_counting(self) -> None:
        """No node can name a module any more (the client's last message came): the wrapper stops counting
        this run's calls, so a sync point halfway through a forward leaves half of it uncounted. A call
        that began before still ends through `ended_watched` where it must: the wrapper took this HookSet
        as the call began."""
        if self._count_all:
            _stop_counting(self)
            self._count_all = False
            self.log.clear()
            self._open.clear()

    def remove(self) -> None:
        self._installed = False
        if self._count_all:
            _stop_counting(self)
            self.log.clear()  # what no one read is not needed once the run ends
            self._open.clear()
            self._running.clear()
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

    def add_op(self, site: str, where: tuple[str, str]) -> None:
        """Hook operation `where` = (module path, name) under `site`; the first of a module
        installs its instrumented forward (also while running, for nodes added at a sync point).
        A nested name "a.b" hooks operation b inside the function operation a calls."""
        path, name = where
        self.ops[site] = where
        self.read_log()  # `since` below reads its module's calls
        self.calls.setdefault(site, 0)
        self.active.setdefault(site, [])
        tree = self._sites.get(path)
        fresh = tree is None
        if tree is None:
            tree = self._sites[path] = _OpTree()
            self.since[site] = self.calls.get(path, 0)
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


# The HookSets counting every module call now (count_all), read by the mounted wrapper without a lock:
# it is replaced, never changed in place.
_counting: tuple[HookSet, ...] = ()
_counting_lock = threading.Lock()


# A counting run's log is read into its counts once it holds this many entries.
LOG_READ_AT = 8192

# Runs in a row that counted nothing; past UNMOUNT_AFTER of them, the counting wrapper comes off.
UNMOUNT_AFTER = 64
_uncounted_runs = 0


def _start_counting(hooks: HookSet) -> None:
    global _counting, _uncounted_runs
    with _counting_lock:
        _mount_counter()
        _counting = (*_counting, hooks)
        _uncounted_runs = 0


def note_uncounted_run() -> None:
    """A run that counts nothing starts. After UNMOUNT_AFTER of them in a row, with no run counting,
    the wrapper comes off `nn.Module._call_impl`: mounted, it costs every module call of every request
    a Python frame (~0.13 ms a GPT-2 4×64 forward), and a worker that saw one sync block would pay
    that for good. Taking it off, as putting it on, makes CPython re-warm its attribute caches once
    (~1.2-1.9 ms), so not after every pausable run."""
    global _uncounted_runs
    _uncounted_runs += 1  # unlocked: a count off by one under a race only moves the moment
    if _uncounted_runs < UNMOUNT_AFTER:
        return
    with _counting_lock:
        _uncounted_runs = 0
        inner = getattr(torch.nn.Module._call_impl, "_nnd_inner", None)
        if _counting or inner is None:  # a run counts now, or not mounted (or another wrapper sits on ours)
            return
        torch.nn.Module._call_impl = inner  # type: ignore[method-assign]


def _stop_counting(hooks: HookSet) -> None:
    global _counting
    with _counting_lock:
        _counting = tuple(h for h in _counting if h is not hooks)


def _mount_counter() -> None:
    """Wrap `nn.Module._call_impl` once for the process (under _counting_lock)."""
    inner = torch.nn.Module._call_impl
    if getattr(inner, "_nnd_counter", False):
        return

    def _call_impl(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        counting = _counting
        if not counting:
            return inner(module, *args, **kwargs)
        if len(counting) == 1:  # the usual case, one pausable run: the loop below, inlined
            hooks = counting[0]
            if hooks.suppress or module not in hooks._counted:
                return inner(module, *args, **kwargs)
            log = hooks.log
            if len(log) >= LOG_READ_AT:  # a long generation: read it now, not hold every call
                hooks.read_log()
            log.append(module)
            try:
                output = inner(module, *args, **kwargs)
            finally:
                log.append(None)
            if module in hooks._counted:
                return output
            return hooks.ended_watched(module, output)  # named while this call ran
        entered = []
        for h in counting:
            if not h.suppress and module in h._counted:
                if len(h.log) >= LOG_READ_AT:
                    h.read_log()
                h.log.append(module)
                entered.append(h)
        try:
            output = inner(module, *args, **kwargs)
        finally:
            for h in entered:
                h.log.append(None)
        for h in entered:
            if module not in h._counted:
                output = h.ended_watched(module, output)
        return output

    _call_impl._nnd_counter = True  # type: ignore[attr-defined]
    _call_impl._nnd_inner = inner  # type: ignore[attr-defined]
    torch.nn.Module._call_impl = _call_impl  # type: ignore[method-assign]
