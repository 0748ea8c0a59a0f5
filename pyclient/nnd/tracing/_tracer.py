"""Trace, scan and generate blocks: record a graph; on exit the block's backend runs it.

How a block runs (sent now, queued into a session, stored as an edit) is its
backend's, chosen once when the block is created (_backends.py)."""

from __future__ import annotations

import sys
from types import TracebackType
from typing import TYPE_CHECKING, Any

from nnd.tracing import (
    _backends,
    _blocknames,
    _concrete,
    _context,
    _inputs,
    _interleave,
    _objects,
    _source,
    _unsaved,
    _withbody,
)
from nnd.tracing._cache import Cache, CacheView
from nnd.tracing._loops import Loop, PastTheEnd, StepIter, every_step
from nnd.tracing._proxy import Proxy
from nnd.v1 import graph_pb2, nnd_pb2
from nnd.wire import _meta, _results, _torchmod

if TYPE_CHECKING:
    from nnd.models._model import TransformersModel

_NO_INPUT: Any = object()
# nnsight's execution options (NDIF remote execution, backends): refused, never sent as model inputs.
_NNSIGHT_ONLY = frozenset({"remote", "backend", "blocking", "callback", "debug"})


_remote_noted = False


def _remote_note(remote: Any) -> None:
    """nnsight's `remote=`: False is where nnd runs anyway (the daemon); True, NDIF's remote, means
    this daemon too, said once per process."""
    global _remote_noted
    if remote and not _remote_noted:
        import warnings

        _remote_noted = True
        warnings.warn(
            "remote=True: nnd runs every block on its daemon (the one this handle is connected to), not on NDIF",
            UserWarning,
            stacklevel=4,
        )


class Invoker:
    """`with tracer.invoke(input):` — module values read inside belong to this
    input's batch rows. With no input, they cover every row."""

    def __init__(self, tracer: Tracer, data: Any, inputs: dict[str, Any] | None = None) -> None:
        self._tracer = tracer
        self._data = data
        self._inputs = inputs or {}
        self._previous: int | None = None
        self.index: int | None = None
        self._deferred = False
        self._trace_fn: Any = None

    def __enter__(self) -> Invoker:
        tracer = self._tracer
        if self._data is not _NO_INPUT or self._inputs:
            invokes = tracer._to_invokes(self._data, self._inputs)
            # Several prompts in one invoke are one batched invoke (its rows padded with the batch).
            self.index = len(tracer._invokes)
            tracer._invokes.append(_inputs.merge(invokes))
            tracer.backend.invoke_added(tracer)
        self._previous = tracer._invoke
        tracer._invoke = self.index
        turns = tracer._turns
        if turns is not None and turns.current() is None and self.index is not None:
            # After tracer.barrier(n): the body runs later, taking turns with the other invokes' (_interleave.py).
            self._trace_fn = turns.defer(sys._getframe(1), self.index)
            self._deferred = True
            tracer._invoke = self._previous
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> bool | None:
        self._tracer._invoke = self._previous
        if self._deferred:
            return _withbody.finish(exc_type, self._trace_fn)
        if exc_type is not None and issubclass(exc_type, StopBlock) and self.index is not None:
            # tracer.stop() in one invoke ends that invoke's body; its siblings are still recorded and
            # served, as nnsight serves the invokes parked where the stop fires.
            return True
        return None


class StopBlock(Exception):  # noqa: N818 - a control signal, swallowed by the block's __exit__
    """Raised by `tracer.stop()`: the rest of the block's Python is skipped, as in nnsight."""


class Tracer:
    """A `with` block being recorded. On a clean exit the graph goes to the
    daemon; saved values come back and the block's names are rebound to them.

    Inside the block: `tracer.invoke(input)` adds a prompt, `tracer.result`
    is the whole request's result, `tracer.stop()` ends the forward early.
    """

    def __init__(self, model: TransformersModel, data: Any = _NO_INPUT, **options: Any) -> None:
        kind = self._kind()
        self._tokenizer_kwargs: dict[str, Any] | None = None
        inputs: dict[str, Any] = {}
        if options:  # (most blocks pass none: `model.trace(prompt)`)
            self._tokenizer_kwargs = options.pop("tokenizer_kwargs", None)
            for name in kind.options_ignored - kind.options_allowed:
                options.pop(name, None)
            _remote_note(options.pop("remote", False))
            remote = sorted(set(options) & _NNSIGHT_ONLY)
            if remote:
                raise TypeError(
                    f"nnsight option(s) {', '.join(remote)} do not apply to nnd: the daemon is the remote; "
                    f"this block takes: {', '.join(sorted(kind.options_allowed))}"
                )
            # Any other keyword is an input of the model's forward (input_ids=, decoder_input_ids=...), as in nnsight.
            inputs = {k: options.pop(k) for k in list(options) if not kind.takes_option(k, options[k])}
        self.model = model
        self.backend = _backends.place(model, kind)
        """How the block runs (_backends.py): chosen here, once; inside a session, a member of it."""
        self._builder = self.backend.builder()
        self._backwards: list[int] = []
        # `x.retain_grad()`: the values, and (value, its gradient's saved proxy) per backward pass after it.
        self._retained: list[Proxy] = []
        self._retained_grads: list[tuple[Proxy, Proxy]] = []
        self._caches: dict[int, Cache] = {}
        self._touched: set[int | None] = set()  # invokes that have read or changed a module value
        self._invokes: list[nnd_pb2.Invoke] = []
        self._invoke: int | None = None
        self._turns: _interleave.Turns | None = None  # once the block has a barrier (_interleave.py)
        self._saved: dict[int, Proxy] = {}
        self._concrete_saves: list[_meta.Size] = []
        self._client_saves: list[tuple[Proxy, int]] = []
        # Client-side values (`model.generator.streamer.output`): id -> (proxy, the scope it was read in).
        self._client_scopes: dict[int, tuple[Proxy, int]] = {}
        self._streamed_result: Proxy | None = None  # the generated ids, for the streamer's step 0
        self._recording = False
        # Unrolled loop passes: scope -> its step; saves made in them -> their scope (one value, not a list).
        self._unrolled: dict[int, int] = {}
        self._past_the_end: set[int] = set()  # the pass after an open-ended loop's last step (_loops.py)
        self._unrolled_saves: dict[int, int] = {}
        # `obj.save()` on any object, and the containers the user's frame held when the block opened:
        # the block's values inside them are delivered (_objects.py).
        self._saved_objects: list[Any] = []
        self._outer: list[Any] = []
        self.names: _blocknames.BlockNames | None = None
        """The names the block's body binds and fills (None: its source could not be read)."""
        # What those names held when the block opened (an outermost block's: _unsaved.py).
        self._before: _unsaved.Before | None = None
        self._kept: list[Any] = []  # what survives the block without `.save()` (its caches, as nnsight's)
        self.holders: list[Any] = []
        """Saved objects and outer containers whose values are filled in once the block has run."""
        self.options = options
        """The block's options (keep_alive=, timeout=, generation settings...)."""
        self._failure: str | None = None  # why the block did not complete, for its values' errors
        self.sent: nnd_pb2.TraceRequest | None = None
        """The request as a one-shot Trace sent it (a replay for client gradients starts from it)."""
        self.tokens: list[_results.StepToken] = []
        """Tokens streamed per generation step (Generate only)."""
        self.compute_s = 0.0
        """Wall time the daemon spent running the block."""
        if data is not _NO_INPUT or inputs:
            self._invokes.extend(self._to_invokes(data, inputs))
            # One prompt is invoke 0; a batch given at once is read as all its rows.
            self._invoke = 0 if len(self._invokes) == 1 else None

    def _kind(self) -> _backends.Backend:
        """The backend of this kind of block, before a session claims it."""
        return _backends.RemoteTrace()

    def _to_invokes(self, data: Any, inputs: dict[str, Any]) -> list[nnd_pb2.Invoke]:
        if not inputs and self._tokenizer_kwargs is None:
            return _inputs.to_invokes(data)
        tokenize = None
        if self._tokenizer_kwargs is not None:
            tokenizer, extra = self.model.tokenizer, self._tokenizer_kwargs
            tokenize = lambda text: tokenizer(text, **extra)["input_ids"]  # noqa: E731
        return _inputs.keyword_invokes(None if data is _NO_INPUT else data, inputs, tokenize)

    # -- recording API
    def invoke(self, data: Any = _NO_INPUT, **inputs: Any) -> Invoker:
        """Add a prompt (text, token ids or a tensor of ids) as its own batch rows;
        a list of prompts is one invoke of several rows. Keywords are forward
        inputs, as for `model.trace(...)`."""
        return Invoker(self, data, inputs)

    def barrier(self, participants: int) -> _interleave.Barrier:
        """nnsight's `tracer.barrier(n)`: `barrier()` inside `n` invokes makes them
        meet there. nnd needs no barrier to pass values between invokes (the graph
        runs in dataflow order), but once a block has one, its invoke bodies take
        turns as nnsight's threads do (_interleave.py), so a name one invoke
        rebinds in a loop means in the others what it means under nnsight."""
        if not isinstance(participants, int) or participants < 1:
            raise ValueError("barrier(n) needs the number of invokes that meet at it")
        if self._turns is None:
            self._turns = _interleave.Turns(self, participants)
        self._turns.participants = max(self._turns.participants, participants)
        return _interleave.Barrier(self, participants)

    @property
    def result(self) -> Proxy:
        """The request's result: the model output (trace/scan) or the
        generated token ids (generate); inside `tracer.invoke(...)`, that
        invoke's rows of it (as nnsight narrows it)."""
        return self._module("", graph_pb2.RESULT)

    def stop(self) -> None:
        """Stop the forward pass once everything recorded has run. As in nnsight,
        the rest of the block does not run (names it would bind stay unbound)."""
        self._builder.stop()
        raise StopBlock

    def cache(
        self,
        modules: Any = None,
        device: Any = "cpu",
        dtype: Any = None,
        detach: bool = True,
        include_output: bool = True,
        include_inputs: bool = False,
        non_blocking: bool = False,
    ) -> CacheView:
        """Record every selected module's values as the model runs, after this
        block's interventions, one entry per call (per step in a generate).

        `modules`: envoys or paths (aliases allowed); None records every module.
        `device`/`dtype`: where and as what the daemon keeps the values until
        they are sent (default "cpu"; None leaves them). `non_blocking` is
        accepted for nnsight's sake: the daemon copies when it sends. After the block:
        `cache["model.transformer.h.0"].output`, `cache.model.layers[0].output`.
        """
        from nnd.wire import _dtypes

        if self._invoke in self._touched:
            # nnsight 0.8's rule (its cache sees the run from where it is declared): the same error.
            raise ValueError("tracer.cache() must be declared before reading or modifying a model value")
        if not detach:
            raise NotImplementedError("cached values always come back detached (they travel as bytes)")
        if not (include_output or include_inputs):
            raise ValueError("a cache needs include_output, include_inputs or both")
        paths = [] if modules is None else [self._cache_path(m) for m in modules]
        code = 0 if dtype is None else _dtypes.enum_of(_dtypes.canonical(dtype))
        node = self._builder.cache(
            paths,
            outputs=include_output,
            inputs=include_inputs,
            dtype=code,
            device="" if device is None else str(device),
            invoke=self._invoke,  # inside an invoke: that invoke's rows only, as nnsight narrows them
        )
        cache = Cache(self.model)
        self._caches[node] = cache
        view = CacheView(cache, None)
        self._kept.append(view)  # a cache is delivered without `.save()`, as nnsight's
        return view

    def _cache_path(self, module: Any) -> str:
        from nnd.models._envoy import Envoy

        if isinstance(module, Envoy):
            return module.path
        if not isinstance(module, str):
            raise TypeError(f"cache modules are envoys or path strings, not {type(module).__name__}")
        parts = module.split(".") if module else []
        # nnsight's paths start at the root, named "model"; a plain module path works too.
        attempts = [parts[1:], parts] if parts[:1] == ["model"] else [parts]
        for attempt in attempts:
            node: Any = self.model
            try:
                for part in attempt:
                    node = node[int(part)] if part.lstrip("-").isdigit() else getattr(node, part)
            except (AttributeError, IndexError):
                continue
            return str(node.path)
        raise AttributeError(f"the model has no module {module!r} to cache")

    # -- sessions and backward blocks
    def _live(self) -> bool:
        """True while this block, or the session it belongs to, is being recorded."""
        return self._recording or self.backend.live()

    def _recorder(self) -> Tracer:
        """The block that records an operation on one of this block's values now."""
        return self if self._recording else self.backend.recorder(self)

    def _current_backward(self, what: str) -> int:
        if not self._backwards:
            raise RuntimeError(f"{what} exists only inside a `with loss.backward():` block of the trace")
        return self._backwards[-1]

    @property
    def iter(self) -> StepIter:
        """Select generation steps: `for step in tracer.iter[:]:` (all),
        `tracer.iter[1:3]`, `tracer.iter[[0, 2]]`. The body runs once per
        selected step, with `step` its number (see _loops.py)."""
        return StepIter(self)

    def _steps_known(self) -> int:
        """How many forward passes the block makes (a trace: one)."""
        return self.backend.steps_known(self.options)

    def all(self) -> Loop:
        """`with tracer.all():` — run the body at every generation step."""
        return every_step(self)

    # -- used by envoys and proxies
    def _past_end(self) -> None:
        if self._past_the_end and self._builder.scope in self._past_the_end:
            raise PastTheEnd  # the generation makes no such step: the pass ends here, as in nnsight

    def _module(self, path: str, point: int, *, invoke: Any = _NO_INPUT, op: str = "") -> Proxy:
        self._past_end()
        if self._turns is not None:
            self._turns.access(path, point)
        which = self._invoke if invoke is _NO_INPUT else invoke
        self._touched.add(self._invoke)
        return Proxy(self, self._builder.module(path, point, which, 0, op))

    def _set(self, path: str, point: int, value: Any, *, op: str = "") -> None:
        self._past_end()
        if self._turns is not None:
            self._turns.access(path, point)
        self._touched.add(self._invoke)
        self._builder.set(path, point, self._invoke, 0, value, op)

    def _skip(self, path: str, value: Any, *, op: str = "") -> None:
        self._past_end()
        if self._turns is not None:
            self._turns.access(path, graph_pb2.INPUT)
        self._touched.add(self._invoke)
        self._builder.skip(path, self._invoke, 0, value, op)

    def _record(self, name: str, args: list[Any], kwargs: dict[str, Any], func: Any = None) -> Proxy:
        return Proxy(self, self._builder.op(name, args, kwargs))

    def _save(self, proxy: Proxy) -> None:
        if proxy._node is None and proxy._pending is None:  # client-side value (streamer tokens)
            read = self._client_scopes.get(id(proxy))
            self._client_saves.append((proxy, read[1] if read is not None else self._builder.scope))
            return
        node = self._builder.save(proxy)
        self._saved[node] = proxy
        if self._builder.scope in self._unrolled:
            self._unrolled_saves[node] = self._builder.scope

    def _save_constant(self, value: Any) -> None:
        self._builder.save(value)

    def _save_concrete(self, size: _meta.Size) -> None:
        self._concrete_saves.append(size)

    def _concrete(self, proxy: Proxy) -> Any:
        return _concrete.query(self, proxy)

    def _sync(self, proxy: Proxy, *, item: bool = False) -> Any:
        """The real value of `proxy` now, mid-run (a sync point; _interact.py). `item`: Python reads it as
        one number, which a tensor of one element then comes as."""
        self._past_end()
        return self.backend.sync(self, proxy._ref(), item=item)

    # -- running
    def __enter__(self) -> Tracer:
        from nnd.models import _ipython
        from nnd.tracing import _einops

        _ipython.install()  # in a notebook, the daemon's errors show the user's cell and line (once per shell)
        _einops.register()  # einops on this block's values, if the process uses einops
        self._recording = True
        frame = _source.user_frame()
        # What the body binds and fills, read once per call site: only those names are looked at after it.
        self.names = _blocknames.of(frame) if frame is not None else None
        self._outer = _objects.containers_of(frame, self.names)
        # Only the outermost block leaves just its saved values behind; a session's blocks hand theirs on.
        if self.backend.session is None and not _context.snapshot():
            self._before = _unsaved.snapshot(frame, self.names)
        _context.push(self)
        _objects.mount()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        __tracebackhide__ = True  # noqa: F841  (pytest/IPython hide this frame)
        if exc_type is not None and issubclass(exc_type, StopBlock):  # tracer.stop(): the block still runs
            self.__exit__(None, None, None)
            return True
        if self._turns is not None and exc_type is None:
            try:
                self._turns.run()  # bodies still waiting for more participants: run them (a barrier short of them fails)
            except BaseException:
                _objects.unmount()
                _context.pop(self)
                self._recording = False
                self.backend.cancel()
                self._forget_unsaved()
                raise
        _objects.unmount()
        self.holders = self._saved_objects + self._outer  # filled after the block (a session's: after the session)
        self._outer = []
        if exc_type is None and self.backend.delivers_values:
            _objects.save_held(self, self.holders)
        _context.pop(self)
        self._recording = False
        if exc_type is not None:
            self.fail(f"{exc_type.__name__} inside the block, before it ran")
            self.backend.cancel()
            self._forget_unsaved()
            return
        _backends.settle(
            [self], lambda: self.backend.run(self), lambda: self.backend.progress(self), before=self._before
        )

    # -- what backends and sessions use (_backends.py, _session.py, _interact.py)
    @property
    def graph(self) -> graph_pb2.Graph:
        """The graph recorded so far."""
        return self._builder.graph

    def request(self) -> nnd_pb2.TraceRequest:
        """The block's request as the daemon runs it (a Trace, Scan or Generate)."""
        if not self._invokes:
            raise ValueError("nothing to run: pass an input to the block or open `tracer.invoke(input)`")
        request = nnd_pb2.TraceRequest(model=self.model.name, invokes=self._invokes, graph=self._builder.graph)
        request.edits.extend(self.model._edits)
        keep_alive = self.options.get("keep_alive")
        if keep_alive is not None:
            from nnd.models._placement import keep_alive_string

            request.keep_alive = keep_alive_string(keep_alive)
        if self.options.get("shm"):
            from nnd.wire import _shm

            if not _shm.available(self.model._conn.address):
                raise ValueError("shm=True needs a daemon on this host's unix socket (and Linux's /dev/shm)")
            request.shm = True
        self.backend.complete(request, self.options)
        return request

    def loop_steps(self) -> list[int]:
        """The steps of the unrolled `tracer.iter` passes recorded (not the pass past an open loop's end)."""
        return [step for scope, step in self._unrolled.items() if scope not in self._past_the_end]

    def fail(self, why: str) -> None:
        """The block did not complete: its values' errors say why."""
        self._failure = why

    def release(self) -> None:
        """The values are with the user: drop the block's hold on them."""
        self._saved_objects.clear()
        self._kept.clear()
        self.holders = []
        # Tracer -> proxy -> tracer is a cycle: without this, results (and the shared-memory
        # regions or buffers they view) would live until a full garbage collection, not until `del`.
        self._saved.clear()

    def deliver(self, results: _results.Results) -> None:
        """Place the values that came back in the block's proxies, caches and client-side saves."""
        self.compute_s = results.compute_s
        resolved: list[Proxy] = []
        for node, proxy in self._saved.items():
            if node not in results.saved:
                continue
            value = results.saved[node]
            if node in self._unrolled_saves:  # one pass of an unrolled loop: its step's value, if reached
                if not value:
                    continue
                value = value[0]
            proxy._value = value
            resolved.append(proxy)
        for node, cache in self._caches.items():
            cache.fill(results.saved.get(node))
        for proxy, scope in self._client_saves:
            proxy._value = self.backend.client_value(self, scope)
        for kept, grad in self._retained_grads:
            if kept._resolved and grad._resolved and hasattr(kept._value, "grad"):
                g = grad._value
                kept._value.grad = g if kept._value.grad is None else kept._value.grad + g
        if self._builder.params:
            self.client_gradients(results)
        self.backend.delivered(self, resolved)

    def client_gradients(self, results: _results.Results) -> None:
        """Client tensors that require grad were used (_grad.py): add the gradients of the block's
        backward passes to their `.grad`, or, without one, attach the saved tensors to them."""
        from nnd.tracing import _grad

        params = self._builder.params
        if _grad.has_backward(self._builder.graph):
            _grad.accumulate(params, results.saved)
            return
        torch = _torchmod.loaded()
        if torch is None or not torch.is_grad_enabled() or self.sent is None:
            return
        nodes = {n.id: n for n in self._builder.graph.nodes}
        saves = [
            (node_id, nodes[node_id].save.value, proxy)
            for node_id, proxy in self._saved.items()
            if proxy._resolved
            and nodes[node_id].scope == 0
            and isinstance(proxy._value, torch.Tensor)
            and proxy._value.is_floating_point()
        ]
        if not saves:
            return
        values = _grad.attach(self.model._conn, self.sent, [(i, arg, p._value) for i, arg, p in saves], params)
        for (_, _, proxy), value in zip(saves, values, strict=True):
            proxy._value = value

    def _forget_unsaved(self) -> None:
        """The block failed: its unsaved names go as under nnsight; a saved one stays, its value saying
        that the block did not complete (nnsight leaves it unbound too)."""
        kept = self.saved_ids()
        _unsaved.settle(self._before, lambda value: id(value) in kept)

    def saved_ids(self) -> set[int]:
        """id() of every value the block saved (what a name may stay bound to after it)."""
        ids = {id(proxy) for proxy in self._saved.values()}
        ids.update(id(proxy) for proxy, _ in self._client_saves)
        ids.update(id(size) for size in self._concrete_saves)
        ids.update(id(obj) for obj in self._saved_objects)
        ids.update(id(obj) for obj in self._kept)
        return ids

    def replacements(self) -> dict[int, tuple[Any, Any]]:
        """id(placeholder) -> (placeholder, value) for every value the block delivered."""
        out: dict[int, tuple[Any, Any]] = {}
        for proxy in self._saved.values():
            if proxy._resolved:
                out[id(proxy)] = (proxy, proxy._value)
        for proxy, _ in self._client_saves:
            out[id(proxy)] = (proxy, proxy._value)
        for size in self._concrete_saves:
            out[id(size)] = (size, size.real())
        return out


class ScanTracer(Tracer):
    """A scan block: the graph runs on the META model with fake tensors.
    Saved tensors come back as FakeTensors on the "meta" device, as nnsight's
    (`isinstance(v, FakeTensor)`; ops on them give fake tensors, mixing them
    with real ones raises), or `nnd.MetaTensor` without torch: shapes and
    dtypes, no data."""

    def _kind(self) -> _backends.Backend:
        return _backends.Scan()


class GenerateTracer(Tracer):
    """A generate block: the graph runs during generation. Module values at
    top level are read at step 0 (the prompt's forward); bodies of
    `tracer.iter[...]` / `tracer.all()` run at each selected step, and their
    saves come back as lists."""

    def _kind(self) -> _backends.Backend:
        return _backends.RemoteGenerate()
