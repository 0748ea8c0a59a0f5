"""Invoke bodies that take turns at `tracer.barrier(n)`, as nnsight's invoke threads do.

nnsight runs each invoke's body in its own thread beside the forward: a thread
blocks when it asks for a module value until the forward reaches that module,
and at a barrier until every participant has arrived. A name one invoke rebinds
in a loop (`clean = h[layer].output; barrier()`) therefore means, in another
invoke's matching turn, that layer's value. nnd records instead of running, so
it reproduces the turns: once a block has a barrier, each invoke's body is
taken from the caller's source (_withbody.py) and deferred, with the names it
reads as they are then (nnsight captures them when the invoke opens: a loop
variable of the block's own Python means, in each body, its value at that
invoke); when the block's own Python has ended (as nnsight starts the invoke
threads only then) they run, each in a thread of its own but one at a time,
all recording into the block's one graph and sharing what they bind (as the
threads share one store of names). A thread gives up its turn
at a barrier and at each module access; the next turn goes first to bodies that
can run without a module value, then to the one waiting for the module the
forward reaches first (the module tree's order, a module's output after its
children's), earlier invokes first on a tie. This is the client's own Python;
nothing here reaches the daemon.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Any

from nnd.tracing import _context, _withbody
from nnd.v1 import graph_pb2

if TYPE_CHECKING:
    from nnd.tracing._tracer import Tracer

_READY, _ACCESS, _BARRIER, _DONE = "ready", "access", "barrier", "done"


class Barrier:
    """What `tracer.barrier(n)` gives: `barrier()` inside an invoke waits for `n` invokes to call it."""

    def __init__(self, tracer: Tracer, participants: int) -> None:
        self._tracer = tracer
        self.participants = participants
        self._arrived: list[Body] = []

    def __call__(self) -> None:
        turns = self._tracer._turns
        body = turns.current() if turns is not None else None
        if body is None:  # not inside a deferred body (no invoke, or its source was not found)
            return
        turns.arrive(body, self)


@dataclass
class Body:
    """One deferred invoke body."""

    invoke: int
    code: CodeType
    snapshot: dict[str, Any] = field(default_factory=dict)  # the caller's names it reads, as the invoke opened
    state: str = _READY
    key: tuple[int, ...] = (0,)
    barrier: Barrier | None = None
    error: BaseException | None = None
    go: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None


class Turns:
    """The deferred invoke bodies of one block and whose turn it is."""

    def __init__(self, tracer: Tracer, participants: int) -> None:
        self.tracer = tracer
        self.participants = participants
        self.bodies: list[Body] = []
        self.frame: FrameType | None = None
        self._running: Body | None = None
        self._idle = threading.Event()  # set when no body holds the turn (the block's thread may go on)
        self._order: dict[str, tuple[int, int]] | None = None

    # -- deferring
    def defer(self, frame: FrameType, invoke: int) -> Any:
        """Take the invoke body at `frame`'s line; None when its source cannot be found (it then runs
        inline, and barriers in it do nothing). Else the trace function for `_withbody.finish`."""
        node = _withbody.with_statement(frame)
        if node is None or node.body[0].lineno == frame.f_lineno:
            raise NotImplementedError(
                "tracer.barrier() makes invoke bodies take turns, which needs the block's source "
                "(a file or a notebook cell, not a bare python prompt) and each invoke's body on lines of its own"
            )
        code = _withbody._compile(node, frame.f_code.co_filename)
        if code is None:
            raise NotImplementedError("an invoke body with break/continue/return/yield cannot take turns at a barrier")
        self.frame = frame
        self.bodies.append(Body(invoke, code, _snapshot(frame, code)))
        return _withbody._skip_body(frame)

    # -- running
    def run(self) -> None:
        """Run every deferred body to its end, taking turns; names they bind go back to the caller."""
        frame, bodies = self.frame, [b for b in self.bodies if b.state != _DONE]
        if frame is None or not bodies:
            return
        function = bool(frame.f_code.co_flags & _withbody._CO_OPTIMIZED)
        before = dict(frame.f_locals) if function else {}
        shared: dict[str, Any] = {}
        stack = _context.snapshot()
        for body in bodies:
            names = _Names(body.snapshot, shared, frame.f_globals)
            body.thread = threading.Thread(target=self._main, args=(body, names, stack), daemon=True)
            body.thread.start()
        previous = self.tracer._invoke
        try:
            while True:
                nxt = self._next(bodies)
                if nxt is None:
                    break
                self._give(nxt)
        finally:
            self.tracer._invoke = previous
            self._running = None
            self.bodies = []
        for body in bodies:
            if body.error is not None:
                raise body.error
        stuck = [b for b in bodies if b.state == _BARRIER]
        if stuck:
            for body in stuck:  # let their threads end
                body.error = _Abandoned()
                body.go.set()
            barrier = stuck[0].barrier
            assert barrier is not None
            raise ValueError(
                f"tracer.barrier({barrier.participants}): only {len(barrier._arrived)} invoke(s) reached it and "
                "the others ended; every participant must call it the same number of times"
            )
        if function:
            _withbody._write_back(frame, {**before, **shared}, before)
        else:
            frame.f_globals.update(shared)

    def _next(self, bodies: list[Body]) -> Body | None:
        if any(b.error is not None and not isinstance(b.error, _Abandoned) for b in bodies):
            return None
        ready = [b for b in bodies if b.state == _READY]
        if ready:
            return ready[0]
        waiting = [b for b in bodies if b.state == _ACCESS]
        if waiting:
            return min(waiting, key=lambda b: (b.key, b.invoke))
        return None

    def _give(self, body: Body) -> None:
        self._idle.clear()
        self._running = body
        self.tracer._invoke = body.invoke
        body.state = "running"
        body.go.set()
        self._idle.wait()

    def _main(self, body: Body, namespace: dict[str, Any], stack: Any) -> None:
        body.go.wait()
        body.go.clear()
        _context.restore(stack)
        try:
            if body.error is None:
                exec(body.code, namespace)  # noqa: S102 - the user's own invoke body, in the user's process
        except _Abandoned:
            pass
        except Exception as e:  # noqa: BLE001 - tracer.stop() ends this body only; else the block's thread raises it
            from nnd.tracing._tracer import StopBlock

            if not isinstance(e, StopBlock):
                body.error = e
        except BaseException as e:  # noqa: BLE001 - handed to the block's thread, which raises it
            body.error = e
        body.state = _DONE
        self._running = None
        self._idle.set()

    def _yield(self, body: Body, state: str) -> None:
        body.state = state
        self._running = None
        self._idle.set()
        body.go.wait()
        body.go.clear()
        if body.error is not None:
            raise body.error

    # -- what bodies call
    def current(self) -> Body | None:
        running = self._running
        if running is not None and running.thread is threading.current_thread():
            return running
        return None

    def arrive(self, body: Body, barrier: Barrier) -> None:
        barrier._arrived.append(body)
        if len(barrier._arrived) < barrier.participants:
            body.barrier = barrier
            self._yield(body, _BARRIER)
            return
        for other in barrier._arrived:  # the last to arrive releases them all
            if other is not body:
                other.state, other.barrier = _READY, None
        barrier._arrived = []
        self._yield(body, _READY)

    def access(self, path: str, point: int) -> None:
        """A body asks for a module value: its turn ends until the forward would reach that module."""
        body = self.current()
        if body is None:
            return
        body.key = self._key(path, point)
        self._yield(body, _ACCESS)

    def _key(self, path: str, point: int) -> tuple[int, ...]:
        order = self._order
        if order is None:
            order = self._order = _forward_order(list(_paths(self.tracer.model)))
        first, last = order.get(path, (len(order), len(order)))
        if point == graph_pb2.RESULT:
            return (len(order) + 1,)
        if point in (graph_pb2.INPUT, graph_pb2.INPUTS):
            return (first, 0)
        return (last, 1, -path.count(".") - bool(path))  # a module's output after its children's


class _Names(dict):  # type: ignore[type-arg]
    """One body's names, looked up as nnsight's invoke threads look them up: what it bound itself,
    else the caller's names as its invoke opened, else what any body bound last (`shared`), else
    the caller's globals. A body's loop variable stays its own; a name another body binds (before
    a barrier) is seen by all."""

    def __init__(self, snapshot: dict[str, Any], shared: dict[str, Any], globals_: dict[str, Any]) -> None:
        super().__init__()
        self._shared, self._snapshot, self._globals = shared, snapshot, globals_
        dict.__setitem__(self, "__builtins__", globals_.get("__builtins__", __builtins__))

    def __missing__(self, name: str) -> Any:
        for names in (self._snapshot, self._shared, self._globals):
            if name in names:
                return names[name]
        raise KeyError(name)

    def __setitem__(self, name: str, value: Any) -> None:
        dict.__setitem__(self, name, value)
        self._shared[name] = value

    def __delitem__(self, name: str) -> None:
        dict.__delitem__(self, name)
        self._shared.pop(name, None)


def _snapshot(frame: FrameType, code: CodeType) -> dict[str, Any]:
    """The caller's names a deferred body reads, as they are now (a function's: all its locals)."""
    if frame.f_code.co_flags & _withbody._CO_OPTIMIZED:
        return dict(frame.f_locals)
    namespace = frame.f_locals  # module level: the globals; a class body: its own dict
    return {name: namespace[name] for name in _read_names(code) if name in namespace}


def _read_names(code: CodeType) -> set[str]:
    names = set(code.co_names) | set(code.co_freevars) | set(code.co_varnames)
    for const in code.co_consts:
        if isinstance(const, CodeType):  # a comprehension, lambda or def in the body
            names |= _read_names(const)
    return names


class _Abandoned(BaseException):
    """Ends a body left waiting at a barrier no one else will reach."""


def _paths(envoy: Any) -> Any:
    """The module paths below `envoy`, in the order the module tree lists them (named_modules order)."""
    yield envoy._path
    for child in envoy._children.values():
        yield from _paths(child)


def _forward_order(paths: list[str]) -> dict[str, tuple[int, int]]:
    """For each module path (in `named_modules()` order): where its input and its output come."""
    order: dict[str, tuple[int, int]] = {}
    for i, path in enumerate(paths):
        order[path] = (i, i)
        parent = path
        while parent:
            parent = parent.rpartition(".")[0]
            if parent in order:
                order[parent] = (order[parent][0], i)
    return order
