"""How a block runs, chosen once when the block is created (as nnsight's backends).

A tracer only records. Its backend says what the block is (which options it
takes, what its request carries, how many forward passes it makes) and what
its end does: send the request now and deliver the values (RemoteTrace,
RemoteGenerate, Scan), queue it into the open session (SessionMember), or
store it on the daemon as an edit (EditBackend). A sync point (a real value
mid-block) goes to the backend too: a lone block's run turns interactive
(_interact.py), a session member's asks its session, a scan has none.

`settle` is the one exit sequence of a block and of a session: run, map the
daemon's errors, then rebind the user's names to the values.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from nnd.errors import NndError
from nnd.tracing import _blocknames, _context, _interact, _objects, _rebind, _source, _unsaved
from nnd.tracing._generation import GENERATE_OPTIONS
from nnd.tracing._graph import GraphBuilder
from nnd.v1 import nnd_pb2
from nnd.wire import _results

if TYPE_CHECKING:
    from nnd.models._model import TransformersModel
    from nnd.tracing._proxy import Proxy
    from nnd.tracing._session import Session
    from nnd.tracing._tracer import Tracer

# shm=True: big saved tensors come back through shared memory (same host, unix socket; _shm.py).
# pause_timeout: seconds the daemon keeps a run paused at a sync point waiting for this client.
_TRACE_OPTIONS = frozenset({"keep_alive", "shm", "timeout", "pause_timeout"})
# on_token: called with each step's token as it arrives (the stream API has its own iterator).
_GENERATE_OPTIONS = _TRACE_OPTIONS | GENERATE_OPTIONS | {"on_token"}


class Backend:
    """What a block is and what its end does. Subclasses are the block kinds."""

    what = "a trace"  # the block, in messages
    generates = False  # its request generates (SessionTrace.generate, InteractStart.generate)
    sessionable = True  # may be part of `with model.session():`
    delivers_values = True  # values placed in saved objects / outer containers come back (not an edit)
    unroll_loops = True  # `for step in tracer.iter[...]` runs per step in Python (not in an edit)
    options_allowed: frozenset[str] = _TRACE_OPTIONS
    # Generation settings a trace accepts and ignores, as nnsight's trace does (one forward).
    options_ignored: frozenset[str] = frozenset(
        {"max_new_tokens", "min_new_tokens", "do_sample", "num_beams", "num_return_sequences", "generation_config"}
    )
    session: Session | None = None  # the session the block is part of

    def builder(self) -> GraphBuilder:
        """The recorder of the block's graph (a session's blocks share ids and keys)."""
        return GraphBuilder()

    def live(self) -> bool:
        """True while the block's values may still be recorded on after the block closed (a session's)."""
        return False

    def recorder(self, tracer: Tracer) -> Tracer:
        """The block that records an operation on a value of `tracer` once `tracer` is closed."""
        return tracer

    def takes_option(self, name: str, value: Any) -> bool:
        """Whether keyword `name` of the block is an option of it (else a model input)."""
        return name in self.options_allowed

    def complete(self, request: nnd_pb2.TraceRequest, options: dict[str, Any]) -> None:
        """Add what this kind of block adds to its TraceRequest."""

    def steps_known(self, options: dict[str, Any]) -> int:
        """How many forward passes the block makes (a trace: one)."""
        return 1

    def delivered(self, tracer: Tracer, resolved: list[Proxy]) -> None:
        """After the values arrived: what this kind does to them."""

    def client_value(self, tracer: Tracer, scope: int) -> Any:
        """A value the client itself holds (`model.generator.streamer.output`)."""
        return None

    def progress(self, tracer: Tracer) -> str:
        """How far an interrupted request got."""
        return "cancelled before its results came back"

    # -- what the block's end and its sync points do
    def run(self, tracer: Tracer) -> bool:
        """Run the closed block; True when its values were delivered now."""
        raise NotImplementedError

    def sync(self, tracer: Tracer, ref: int, *, item: bool = False) -> Any:
        """The real value of node `ref` now, mid-block (`item`: read as one number, so a tensor of one
        element may come as that number)."""
        raise NotImplementedError

    def cancel(self) -> None:
        """The block failed while recording: end whatever run it started."""

    def invoke_added(self, tracer: Tracer) -> None:
        """`tracer.invoke(...)` added batch rows while the block records."""

    def between_blocks(self) -> bool:
        """True when the block has ended but its values can still be computed now (a session's, between its blocks)."""
        return False

    def ended_value(self, tracer: Tracer, ref: int) -> Any:
        """The real value of node `ref` of the ended block `tracer`, now (see `between_blocks`)."""
        raise NotImplementedError


class RemoteTrace(Backend):
    """`model.trace(...)`: one request on exit (Trace), or an Interact stream once a sync point needs a value."""

    method = "Trace"

    def __init__(self) -> None:
        self.interaction: _interact.Interaction | None = None  # open once a sync point needed a value

    def sync(self, tracer: Tracer, ref: int, *, item: bool = False) -> Any:
        if self.interaction is None:
            self.interaction = _interact.Interaction(tracer)
        return self.interaction.value(ref, item=item)

    def cancel(self) -> None:
        if self.interaction is not None:
            self.interaction.cancel()

    def invoke_added(self, tracer: Tracer) -> None:
        # A run paused at a sync point has its batch fixed: a later invoke cannot join it. End it; the
        # next sync point (or the block's end) runs the whole block again with every invoke, and the
        # values earlier sync points gave Python come out of that run the same (the forward is replayed).
        if self.interaction is not None:
            self.interaction.cancel()
            self.interaction = None
            tracer.tokens.clear()

    def run(self, tracer: Tracer) -> bool:
        from nnd.wire import _shm

        if self.interaction is not None:
            tracer.deliver(self.interaction.finish())
            return True
        request = tracer.request()
        watch = tracer.options.get("on_token")  # generate(..., on_token=print): each step's tokens, live
        # Small results come back as one message (fewer writes and wake-ups on both ends): a plain
        # trace's, and a generation's when no one watches its steps as they come.
        request.one_message = self.method == "Trace" or (self.method == "Generate" and watch is None)
        tracer.sent = request
        conn = tracer.model._conn
        # Into a region of this process's pool when one is free (_shm.py); `collect` settles the lease.
        lease = _shm.attach(request, conn.address) if request.shm else None
        stream = conn.stream(self.method, request, timeout=tracer.options.get("timeout"))

        def on_step(token: Any) -> None:
            tracer.tokens.append(token)
            if watch is not None:
                watch(token)

        tracer.deliver(_results.collect(stream, on_step=on_step, lease=lease))
        return True


class RemoteGenerate(RemoteTrace):
    """`model.generate(...)`: the graph runs during generation; loop bodies run at their steps."""

    method = "Generate"
    what = "a generate"
    generates = True
    options_allowed = _GENERATE_OPTIONS

    def takes_option(self, name: str, value: Any) -> bool:
        # Any keyword that is not a tensor is a setting of transformers' generate (the daemon checks it).
        from nnd.tracing._generation import is_model_input

        return name in self.options_allowed or not is_model_input(name, value)

    def complete(self, request: nnd_pb2.TraceRequest, options: dict[str, Any]) -> None:
        from nnd.tracing._generation import generate_options

        settings = {k: v for k, v in options.items() if k not in _GENERATE_OPTIONS - GENERATE_OPTIONS}
        request.generate.CopyFrom(generate_options(**settings))

    def steps_known(self, options: dict[str, Any]) -> int:
        from nnd.v1.contract import DEFAULT_MAX_NEW_TOKENS

        return int(options.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS)

    def delivered(self, tracer: Tracer, resolved: list[Proxy]) -> None:
        reached = len(tracer.tokens)
        missed = sorted({step for step in tracer.loop_steps() if step >= reached})
        if missed:
            import warnings

            # Under nnsight a step the generation never makes runs no Python: what the loop body put in
            # the user's lists and dicts at such steps is not there (one value per step made).
            _drop_unreached(tracer, reached)

            warnings.warn(
                f"step(s) {missed} of a `tracer.iter` loop were never reached: the generation stopped after "
                f"{reached} step(s), so that part of the loop did not run and values saved there are missing. "
                "To hold a generation to the loop's count, pass `min_new_tokens=`.",
                stacklevel=_user_stacklevel(),
            )

    def client_value(self, tracer: Tracer, scope: int) -> Any:
        """The streamed ids: in a pass of an iter loop that step's, at the block's top the first value
        (the prompt's ids, as nnsight's streamer holds them), in a loop not unrolled one tensor per step."""
        from nnd.wire import _torchmod

        torch = _torchmod.available()
        rows = [list(step.ids) for step in tracer.tokens]
        if scope in tracer._unrolled:  # one pass of a `tracer.iter` loop: what nnsight's streamer holds then
            return _streamed_at(tracer, tracer._unrolled[scope], rows, torch)
        if scope:
            return [torch.tensor(r) if torch is not None else r for r in rows]
        return _streamed_at(tracer, 0, rows, torch)

    def progress(self, tracer: Tracer) -> str:
        total = tracer.options.get("max_new_tokens")
        return f"cancelled after {len(tracer.tokens)} of {total or 'its'} steps"


class Scan(RemoteTrace):
    """`model.scan(...)`: the graph runs on the META model with fake tensors. Saved tensors come back as
    FakeTensors on the "meta" device, as nnsight's, or `nnd.MetaTensor` without torch."""

    method = "Scan"
    what = "a scan"
    sessionable = False

    def sync(self, tracer: Tracer, ref: int, *, item: bool = False) -> Any:
        from nnd.tracing._usage import value_not_known

        raise value_not_known("a real value in a scan (it runs on fake tensors)", _source.location().text)

    def delivered(self, tracer: Tracer, resolved: list[Proxy]) -> None:
        from nnd.wire import _torchmod

        torch = _torchmod.available()  # FakeTensors when results are torch tensors, as nnsight's scan gives
        if torch is None:
            return
        from torch._subclasses.fake_tensor import FakeTensorMode

        # One mode per block, as nnsight's scan has one: its values may be combined with each other.
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        for proxy in resolved:
            proxy._value = _fake(proxy._value, mode, torch)


def _drop_unreached(tracer: Tracer, reached: int) -> None:
    """Take out of the block's containers the values recorded at loop steps >= `reached`."""
    from nnd.tracing import _objects
    from nnd.tracing._proxy import Proxy

    scopes = {scope for scope, step in tracer._unrolled.items() if step >= reached}
    node_scope = {n.id: n.scope for n in tracer._builder.graph.nodes}

    def unreached(item: Any) -> bool:
        if not isinstance(item, Proxy):
            return False
        if item._node is None and item._pending is None:  # the streamer's ids: handed over before each step,
            # so the first step not made still has its value (the last token), and only later ones have none
            read = tracer._client_scopes.get(id(item))
            return read is not None and tracer._unrolled.get(read[1], -1) > reached
        return not item._resolved and node_scope.get(item._node) in scopes

    def walk(holder: Any, depth: int = 0) -> None:
        if depth > 8:
            return
        if type(holder) is _objects.Tail:  # an outer list the block appended to: only its new items
            holder.items[holder.start :] = [item for item in holder.items[holder.start :] if not unreached(item)]
            items = holder.items[holder.start :]
        elif type(holder) is list:
            holder[:] = [item for item in holder if not unreached(item)]
            items = list(holder)
        elif type(holder) is dict:
            for key in [k for k, v in holder.items() if unreached(v)]:
                del holder[key]
            items = list(holder.values())
        else:
            return
        for item in items:
            walk(item, depth + 1)

    for holder in tracer.holders:
        walk(holder)


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


def _streamed_at(tracer: Tracer, step: int, rows: list[list[int]], torch: Any) -> Any:
    """The streamer's value at generation step `step`, as transformers hands it to a streamer: at step 0
    the prompt's ids ([invokes, prompt length], the result's first columns), at step k the ids step k-1
    chose (one per invoke); None past the last step."""
    if step == 0:
        result = tracer._streamed_result
        if result is None or not result._resolved:
            return None
        ids = result._value
        prompt = ids[:, : ids.shape[1] - len(rows)]
        return prompt if torch is None or isinstance(prompt, torch.Tensor) else torch.as_tensor(prompt)
    if step - 1 >= len(rows):
        return None
    return torch.tensor(rows[step - 1]) if torch is not None else rows[step - 1]


class EditBackend(Backend):
    """`model.edit()`: the block is stored on the daemon (CreateEdit) and applies to every later
    request of the edited handle."""

    what = "an edit"
    sessionable = False
    delivers_values = False  # an edit saves nothing
    unroll_loops = False  # its loops run at the steps of later generations, whose length it cannot know

    def __init__(self, edited: TransformersModel, name: str, replace: bool) -> None:
        self.edited = edited
        self.name = name
        self.replace = replace
        self.edit_id = ""

    def sync(self, tracer: Tracer, ref: int, *, item: bool = False) -> Any:
        from nnd.tracing._usage import value_not_known

        raise value_not_known("a real value in an edit (it runs in later traces)", _source.location().text)

    def run(self, tracer: Tracer) -> bool:
        request = nnd_pb2.CreateEditRequest(
            model=tracer.model.name, graph=tracer.graph, name=self.name, base=self.edited._edits, replace=self.replace
        )
        info: nnd_pb2.EditInfo = tracer.model._conn.call("CreateEdit", request)
        self.edit_id = info.id
        # The new edit holds its whole stack (the handle's earlier edits first).
        self.edited._edits[:] = [info.id]
        if not info.named:
            self.edited._owned_edits.append(info.id)
        return True


class SessionMember(Backend):
    """A trace or generate inside `with model.session():`: its end queues it into the session, which
    sends every block at once when it ends. What the block is stays its kind's."""

    def __init__(self, session: Session, kind: Backend) -> None:
        self.session = session
        self.kind = kind
        self.what = kind.what
        self.generates = kind.generates
        self.delivers_values = kind.delivers_values
        self.unroll_loops = kind.unroll_loops
        self.options_allowed = kind.options_allowed
        self.options_ignored = kind.options_ignored

    def takes_option(self, name: str, value: Any) -> bool:
        return self.kind.takes_option(name, value)

    def builder(self) -> GraphBuilder:
        return self.session.builder()  # ids and keys shared with the session's other blocks

    def live(self) -> bool:
        # Between the session's blocks its values are not recorded on: Python computes on their real values.
        return self.session.recording and self.session.recording_block() is not None

    def recorder(self, tracer: Tracer) -> Tracer:
        return self.session.current()

    def between_blocks(self) -> bool:
        return self.session.recording and self.session.recording_block() is None

    def ended_value(self, tracer: Tracer, ref: int) -> Any:
        return self.session.sync(tracer, ref)

    def complete(self, request: nnd_pb2.TraceRequest, options: dict[str, Any]) -> None:
        self.kind.complete(request, options)

    def steps_known(self, options: dict[str, Any]) -> int:
        return self.kind.steps_known(options)

    def delivered(self, tracer: Tracer, resolved: list[Proxy]) -> None:
        self.kind.delivered(tracer, resolved)

    def client_value(self, tracer: Tracer, scope: int) -> Any:
        return self.kind.client_value(tracer, scope)

    def run(self, tracer: Tracer) -> bool:
        self.session.add(tracer)  # sent with the session's other blocks when it ends
        return False

    def sync(self, tracer: Tracer, ref: int, *, item: bool = False) -> Any:
        # The session's run, which the earlier blocks are part of.
        return self.session.sync(tracer, ref, item=item)


def place(model: TransformersModel, kind: Backend) -> Backend:
    """The backend of a new block of `kind`: a session member inside `with model.session():`."""
    session = _context.innermost_session()
    if session is None or not session.recording:
        return kind
    if model._family is not session.model._family:
        raise ValueError(f"this session runs on {session.model.name}; a block of {model.name} cannot be part of it")
    if not kind.sessionable:
        raise ValueError(f"{kind.what} cannot be part of a session; open it outside the `with model.session():`")
    return SessionMember(session, kind)


def settle(
    blocks: Sequence[Tracer],
    run: Callable[[], bool],
    progress: Callable[[], str],
    names: _blocknames.BlockNames | None | bool = True,
    before: _unsaved.Before | None = None,
    saved: Sequence[Any] = (),
) -> None:
    """The end of a block or session that recorded cleanly: run it, then hand the values of `blocks` to
    the user's names and containers. An error names the user's `with` line, not nnd's internals.
    `names`: what the session's body binds (None: unknown); True: the blocks' own. `before`: the
    names the body binds as they were when it opened; those not bound to a saved value (of `blocks`, or
    one of `saved`) get their old value back, as nnsight leaves them (_unsaved.py)."""
    __tracebackhide__ = True  # noqa: F841  (pytest/IPython hide this frame)
    kept: set[int] = {id(value) for value in saved}
    for block in blocks:
        kept |= block.saved_ids()
    try:
        delivered = _run(blocks, run, progress)
    except BaseException:
        # A saved name stays, its value saying why the block did not complete (nnsight's is unbound).
        _unsaved.settle(before, lambda value: id(value) in kept)
        raise
    if delivered:
        _unsaved.settle(before, lambda value: id(value) in kept)
    _deliver(blocks, delivered, names)


def _deliver(blocks: Sequence[Tracer], delivered: bool, names: _blocknames.BlockNames | None | bool) -> None:
    """Hand the values of `blocks` to the user's names and containers."""
    if delivered:
        frame = _source.user_frame()
        replacements: dict[int, tuple[Any, Any]] = {}
        for block in blocks:
            replacements.update(block.replacements())
        if frame is not None:
            _rebind.rebind(frame, replacements, _bound(blocks, names))
        for block in blocks:
            _objects.fill(block.holders, replacements)
            block.release()


def _run(blocks: Sequence[Tracer], run: Callable[[], bool], progress: Callable[[], str]) -> bool:
    __tracebackhide__ = True  # noqa: F841  (pytest/IPython hide this frame)
    try:
        return run()
    except NndError as err:
        why = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        for block in blocks:
            block.fail(why)
        # The daemon's message quotes the user's line; point the traceback at the `with`.
        raise err.with_traceback(None) from None
    except KeyboardInterrupt:
        # Ctrl-C while the daemon works: the call is cancelled there (connection.stream); say how far it
        # got in one line instead of gRPC's internals.
        why = "interrupted: " + progress()
        for block in blocks:
            block.fail(why)
        raise KeyboardInterrupt(f"nnd: {why}; the daemon stopped the request") from None


def _bound(blocks: Sequence[Tracer], names: _blocknames.BlockNames | None | bool) -> set[str] | None:
    """The names to rebind after `blocks`; None: every name (some body's source was unknown)."""
    if names is not True:
        return None if names is None or names is False else set(names.bound)
    bound: set[str] = set()
    for block in blocks:
        if block.names is None:
            return None
        bound |= block.names.bound
    return bound


def _user_stacklevel() -> int:
    """warnings' stacklevel of the user's line, for a warning raised by this function's caller."""
    target = _source.user_frame()
    level, frame = 1, sys._getframe(1)
    while frame is not None and frame is not target:
        frame = frame.f_back
        level += 1
    return level if frame is not None else 1
