"""Trace, scan and generate blocks: record a graph, send it on exit, hand back values.

Inside `with model.session():` a block does not run on exit: the session
sends all its blocks at once when it ends (see _session.py)."""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Any

from nnd import _concrete, _context, _inputs, _interact, _meta, _objects, _rebind, _results, _source
from nnd._cache import Cache, CacheView
from nnd._graph import GraphBuilder
from nnd._loops import Loop, StepIter, every_step
from nnd._proxy import Proxy
from nnd.errors import NndError
from nnd.v1 import graph_pb2, nnd_pb2

if TYPE_CHECKING:
    from nnd._model import TransformersModel
    from nnd._session import Session

_NO_INPUT: Any = object()
# nnsight's execution options (NDIF remote execution, backends): refused, never sent as model inputs.
_NNSIGHT_ONLY = frozenset({"remote", "backend", "blocking", "callback", "debug"})


class Invoker:
    """`with tracer.invoke(input):` — module values read inside belong to this
    input's batch rows. With no input, they cover every row."""

    def __init__(self, tracer: Tracer, data: Any, inputs: dict[str, Any] | None = None) -> None:
        self._tracer = tracer
        self._data = data
        self._inputs = inputs or {}
        self._previous: int | None = None
        self.index: int | None = None

    def __enter__(self) -> Invoker:
        tracer = self._tracer
        if self._data is not _NO_INPUT or self._inputs:
            invokes = tracer._to_invokes(self._data, self._inputs)
            # Several prompts in one invoke are one batched invoke (its rows padded with the batch).
            self.index = len(tracer._invokes)
            tracer._invokes.append(_inputs.merge(invokes))
        self._previous = tracer._invoke
        tracer._invoke = self.index
        return self

    def __exit__(self, *exc: object) -> None:
        self._tracer._invoke = self._previous


class _Barrier:
    """What `tracer.barrier(n)` gives: calling it inside an invoke does nothing."""

    def __call__(self) -> None:
        return None


class StopBlock(Exception):  # noqa: N818 - a control signal, swallowed by the block's __exit__
    """Raised by `tracer.stop()`: the rest of the block's Python is skipped, as in nnsight."""


class Tracer:
    """A `with` block being recorded. On a clean exit the graph goes to the
    daemon; saved values come back and the block's names are rebound to them.

    Inside the block: `tracer.invoke(input)` adds a prompt, `tracer.result`
    is the whole request's result, `tracer.stop()` ends the forward early.
    """

    _method = "Trace"
    # shm=True: big saved tensors come back through shared memory (same host, unix socket; _shm.py).
    # pause_timeout: seconds the daemon keeps a run paused at a sync point waiting for this client.
    _options_allowed: frozenset[str] = frozenset({"keep_alive", "shm", "timeout", "pause_timeout"})
    # Generation settings a trace accepts and ignores, as nnsight's trace does (one forward).
    _options_ignored: frozenset[str] = frozenset(
        {"max_new_tokens", "min_new_tokens", "do_sample", "num_beams", "num_return_sequences", "generation_config"}
    )
    _sessionable = True  # may be part of `with model.session():`
    _delivers_values = True  # values placed in saved objects / outer containers come back (not an edit)
    _unroll_loops = True  # `for step in tracer.iter[...]` runs per step in Python (not in an edit)

    def __init__(self, model: TransformersModel, data: Any = _NO_INPUT, **options: Any) -> None:
        self._tokenizer_kwargs: dict[str, Any] | None = options.pop("tokenizer_kwargs", None)
        for name in self._options_ignored - self._options_allowed:
            options.pop(name, None)
        remote = sorted(set(options) & _NNSIGHT_ONLY)
        if remote:
            raise TypeError(
                f"nnsight option(s) {', '.join(remote)} do not apply to nnd: the daemon is the remote; "
                f"this block takes: {', '.join(sorted(self._options_allowed))}"
            )
        # Any other keyword is an input of the model's forward (input_ids=, decoder_input_ids=...), as in nnsight.
        inputs = {k: options.pop(k) for k in list(options) if k not in self._options_allowed}
        self.model = model
        self._session: Session | None = None
        from nnd._session import join

        join(self)  # inside `with model.session():`, ids and keys are shared with the session's traces
        if self._session is None:
            self._builder = GraphBuilder()
        self._backwards: list[int] = []
        self._caches: dict[int, Cache] = {}
        self._invokes: list[nnd_pb2.Invoke] = []
        self._invoke: int | None = None
        self._saved: dict[int, Proxy] = {}
        self._concrete_saves: list[_meta.Size] = []
        self._client_saves: list[tuple[Proxy, int]] = []
        self._recording = False
        self._interaction: _interact.Interaction | None = None  # open once a sync point needed a value
        # Unrolled loop passes: scope -> its step; saves made in them -> their scope (one value, not a list).
        self._unrolled: dict[int, int] = {}
        self._unrolled_saves: dict[int, int] = {}
        # `obj.save()` on any object, and the containers the user's frame held when the block opened:
        # the block's values inside them are delivered (_objects.py).
        self._saved_objects: list[Any] = []
        self._outer: list[Any] = []
        self._holders: list[Any] = []
        self._options = options
        self.tokens: list[_results.StepToken] = []
        self._failure: str | None = None  # why the block did not complete, for its values' errors
        """Tokens streamed per generation step (Generate only)."""
        self.compute_s = 0.0
        """Wall time the daemon spent running the block."""
        if data is not _NO_INPUT or inputs:
            self._invokes.extend(self._to_invokes(data, inputs))
            # One prompt is invoke 0; a batch given at once is read as all its rows.
            self._invoke = 0 if len(self._invokes) == 1 else None

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

    def barrier(self, participants: int) -> Any:
        """nnsight's `tracer.barrier(n)`: nnd needs none (a value of one invoke
        may be used in another anywhere: the graph runs in dataflow order), so
        calling it does nothing."""
        if not isinstance(participants, int) or participants < 1:
            raise ValueError("barrier(n) needs the number of invokes that meet at it")
        return _Barrier()

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
        from nnd import _dtypes

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
        return CacheView(cache, None)

    def _cache_path(self, module: Any) -> str:
        from nnd._envoy import Envoy

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
        return self._recording or (self._session is not None and self._session._recording)

    def _recorder(self) -> Tracer:
        """The block that records an operation on one of this block's values now."""
        if self._recording or self._session is None:
            return self
        return self._session._current()

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
        return 1

    def all(self) -> Loop:
        """`with tracer.all():` — run the body at every generation step."""
        return every_step(self)

    # -- used by envoys and proxies
    def _module(self, path: str, point: int, *, invoke: Any = _NO_INPUT, op: str = "") -> Proxy:
        which = self._invoke if invoke is _NO_INPUT else invoke
        return Proxy(self, self._builder.module(path, point, which, 0, op))

    def _set(self, path: str, point: int, value: Any, *, op: str = "") -> None:
        self._builder.set(path, point, self._invoke, 0, value, op)

    def _skip(self, path: str, value: Any, *, op: str = "") -> None:
        self._builder.skip(path, self._invoke, 0, value, op)

    def _record(self, name: str, args: list[Any], kwargs: dict[str, Any], func: Any = None) -> Proxy:
        return Proxy(self, self._builder.op(name, args, kwargs))

    def _save(self, proxy: Proxy) -> None:
        if proxy._node is None and proxy._pending is None:  # client-side value (streamer tokens)
            self._client_saves.append((proxy, self._builder.scope))
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

    def _sync(self, proxy: Proxy) -> Any:
        """The real value of `proxy` now, mid-run (a sync point; _interact.py)."""
        ref = proxy._ref()
        if self._session is not None:  # the session's run, which the earlier blocks are part of
            return self._session._sync(self, ref)
        if self._interaction is None:
            self._interaction = _interact.Interaction(self)
        return self._interaction.value(ref)

    # -- running
    def __enter__(self) -> Tracer:
        from nnd import _ipython

        _ipython.install()  # in a notebook, the daemon's errors show the user's cell and line (once per shell)
        self._recording = True
        self._outer = _objects.containers_of(_source.user_frame())
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
        _objects.unmount()
        holders = self._saved_objects + self._outer
        self._holders = holders  # filled after the block (a session's: after the session)
        self._outer = []
        if exc_type is None and self._delivers_values:
            _objects.save_held(self, holders)
        _context.pop(self)
        self._recording = False
        if exc_type is not None:
            self._failure = f"{exc_type.__name__} inside the block, before it ran"
            if self._interaction is not None:
                self._interaction.cancel()
            return
        if self._session is not None:
            self._session._add(self)  # sent with the session's other blocks when it ends
            return
        try:
            self._run()
        except NndError as err:
            self._failure = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            # The daemon's message quotes the user's line; point the traceback at the `with`.
            raise err.with_traceback(None) from None
        except KeyboardInterrupt:
            # Ctrl-C while the daemon works: the call is cancelled there (connection.stream); say how far it
            # got in one line instead of gRPC's internals.
            self._failure = "interrupted: " + self._progress()
            raise KeyboardInterrupt(f"nnd: {self._failure}; the daemon stopped the request") from None
        frame = _source.user_frame()
        replacements = self._replacements()
        if frame is not None:
            _rebind.rebind(frame, replacements)
        _objects.fill(holders, replacements)
        self._saved_objects.clear()
        self._holders = []
        # Tracer -> proxy -> tracer is a cycle: without this, results (and the shared-memory
        # regions or buffers they view) would live until a full garbage collection, not until `del`.
        self._saved.clear()

    def _progress(self) -> str:
        """How far a request got: 'cancelled after 3 of 20 steps' for a generation."""
        total = self._options.get("max_new_tokens")
        if self._method == "Generate":
            return f"cancelled after {len(self.tokens)} of {total or 'its'} steps"
        return "cancelled before its results came back"

    def _request(self) -> nnd_pb2.TraceRequest:
        if not self._invokes:
            raise ValueError("nothing to run: pass an input to the block or open `tracer.invoke(input)`")
        request = nnd_pb2.TraceRequest(model=self.model.name, invokes=self._invokes, graph=self._builder.graph)
        request.edits.extend(self.model._edits)
        keep_alive = self._options.get("keep_alive")
        if keep_alive is not None:
            from nnd._placement import keep_alive_string

            request.keep_alive = keep_alive_string(keep_alive)
        if self._options.get("shm"):
            from nnd import _shm

            if not _shm.available(self.model._conn.address):
                raise ValueError("shm=True needs a daemon on this host's unix socket (and Linux's /dev/shm)")
            request.shm = True
        return request

    def _run(self) -> None:
        from nnd import _shm

        if self._interaction is not None:
            self._deliver(self._interaction.finish())
            return
        request = self._request()
        # Into a region of this process's pool when one is free (_shm.py); `collect` settles the lease.
        lease = _shm.attach(request, self.model._conn.address) if request.shm else None
        stream = self.model._conn.stream(self._method, request, timeout=self._options.get("timeout"))
        watch = self._options.get("on_token")  # generate(..., on_token=print): each step's tokens, live

        def on_step(token: Any) -> None:
            self.tokens.append(token)
            if watch is not None:
                watch(token)

        results = _results.collect(stream, on_step=on_step, lease=lease)
        self._deliver(results)

    def _deliver(self, results: _results.Results) -> None:
        self.compute_s = results.compute_s
        for node, proxy in self._saved.items():
            if node not in results.saved:
                continue
            value = results.saved[node]
            if node in self._unrolled_saves:  # one pass of an unrolled loop: its step's value, if reached
                if not value:
                    continue
                value = value[0]
            proxy._value = value
        for node, cache in self._caches.items():
            cache.fill(results.saved.get(node))
        for proxy, scope in self._client_saves:
            proxy._value = self._client_value(scope)

    def _client_value(self, scope: int) -> Any:
        return None

    def _replacements(self) -> dict[int, tuple[Any, Any]]:
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

    _method = "Scan"
    _sessionable = False

    def _sync(self, proxy: Proxy) -> Any:
        from nnd._usage import value_not_known

        raise value_not_known("a real value in a scan (it runs on fake tensors)", _source.location().text)

    def _deliver(self, results: _results.Results) -> None:
        super()._deliver(results)
        from nnd import _torchmod

        torch = _torchmod.loaded()
        if torch is None:
            return
        from torch._subclasses.fake_tensor import FakeTensorMode

        # One mode per block, as nnsight's scan has one: its values may be combined with each other.
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        for proxy in self._saved.values():
            if proxy._resolved:
                proxy._value = _fake(proxy._value, mode, torch)


def _fake(value: Any, mode: Any, torch: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return mode.from_tensor(value) if value.device.type == "meta" else value
    if isinstance(value, dict):
        return {k: _fake(v, mode, torch) for k, v in value.items()}
    if isinstance(value, list):
        return [_fake(v, mode, torch) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_fake(v, mode, torch) for v in value)
    return value


class GenerateTracer(Tracer):
    """A generate block: the graph runs during generation. Module values at
    top level are read at step 0 (the prompt's forward); bodies of
    `tracer.iter[...]` / `tracer.all()` run at each selected step, and their
    saves come back as lists."""

    _method = "Generate"
    _options_allowed = frozenset(
        {
            "keep_alive",
            "shm",
            "timeout",
            "pause_timeout",
            "max_new_tokens",
            "min_new_tokens",
            "do_sample",
            "temperature",
            "top_k",
            "top_p",
            "seed",
            "stream_text",
            "on_token",
            "num_beams",
            "num_return_sequences",
            "generation_config",
        }
    )

    def _request(self) -> nnd_pb2.TraceRequest:
        from nnd._generation import generate_options

        request = super()._request()
        request.generate.CopyFrom(generate_options(**self._options))
        return request

    def _steps_known(self) -> int:
        from nnd._generation import DEFAULT_MAX_NEW_TOKENS

        return int(self._options.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS)

    def _deliver(self, results: _results.Results) -> None:
        super()._deliver(results)
        reached = len(self.tokens)
        missed = sorted({step for step in self._unrolled.values() if step >= reached})
        if missed:
            import warnings

            warnings.warn(
                f"step(s) {missed} of a `tracer.iter` loop were never reached: the generation stopped after "
                f"{reached} step(s), so that part of the loop did not run and values saved there are missing. "
                "To hold a generation to the loop's count, pass `min_new_tokens=`.",
                stacklevel=4,
            )

    def _client_value(self, scope: int) -> Any:
        """`model.generator.streamer.output`: the streamed ids, per step inside
        a loop, else one [invokes, steps] table."""
        from nnd import _torchmod

        torch = _torchmod.available()
        rows = [list(step.ids) for step in self.tokens]
        if scope:
            return [torch.tensor(r) if torch is not None else r for r in rows]
        table = [list(col) for col in zip(*rows, strict=True)] if rows else []
        return torch.tensor(table) if torch is not None else table
