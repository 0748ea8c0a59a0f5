"""A gRPC server on which a call costs a thread only once its request has arrived.

gRPC's synchronous server gives every call a pool thread as it opens, and the
thread then waits for the request: a few hundred calls that open and never
send take every thread, and health checks time out. `Server` serves the same
synchronous handlers (and interceptors) on a `grpc.aio` server running on a
loop thread of its own. Each call first waits, on the loop, for its request
(the first message of a stream): at most `per_client` calls of one caller may
wait so, `total` of all callers, and one whose request has not come within
`idle_s` is cut off with DEADLINE_EXCEEDED. Only then does the handler run on
a pool thread, as before; `quick` methods (health, listings) have a small pool
of their own, so that calls holding the main pool's threads cannot delay them.

Every call is served as a stream on this side (the wire does not say how many
messages a call carries), which is what lets the loop read the first message
with a timeout. The handlers see `Context`, a synchronous servicer context
whose `caller` says who the call is from (`caller_of`, computed once as it opened).

The daemon's socket and a worker's route socket use this; neither imports the other.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

log = logging.getLogger("nnd.serve")

# Trailing metadata of a refusal before anything ran (a caller's waiting calls at their bound): the
# Python client takes it, like gRPC's own concurrency refusal, as "go through the daemon instead".
BUSY_KEY = "nnd-busy"
# Calls never bounded per caller: a health probe from an unidentified local user must always get in
# (it costs only the wait for its request, which `idle_s` still bounds).
UNBOUNDED_PREFIXES = ("/grpc.health.v1.Health/",)

Caller = tuple[str, str]  # (verified identity, the client's own name within it)


class Aborted(Exception):
    """A handler thread called `abort`: the loop sends the status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _CallEnded(grpc.RpcError):
    """Raised to a handler reading requests from a call that has ended (cancelled, timed out)."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.CANCELLED

    def details(self) -> str:
        return "the call ended"


class Waiting:
    """Calls whose request has not come yet, counted per caller identity."""

    def __init__(self, per_client: int, total: int) -> None:
        self.per_client = per_client
        self.total = total
        self._counts: dict[str, int] = {}
        self._all = 0

    def enter(self, who: str) -> str | None:
        """None if the call may wait for its request, else why not. Loop thread only: no lock."""
        mine = self._counts.get(who, 0)
        if self.per_client and mine >= self.per_client:
            return (
                f"this client ({who}) already has {mine} calls open that have not sent their request "
                f"(max_waiting_calls={self.per_client}, --max-waiting-calls); send or close them first"
            )
        if self.total and self._all >= self.total:
            return (
                f"{self._all} calls are open without their request (the server's limit, all clients); try again shortly"
            )
        self._counts[who] = mine + 1
        self._all += 1
        return None

    def leave(self, who: str) -> None:
        self._all -= 1
        left = self._counts[who] - 1
        if left:
            self._counts[who] = left
        else:
            del self._counts[who]

    def of(self, who: str) -> int:
        return self._counts.get(who, 0)


class CallState:
    """What a servicer context knows of its call's life: its deadline, whether it has ended, and the
    callbacks its end runs once (`add_callback`; the subclass's `finish` ends it). This module's
    Context and the fast route's (worker/fastroute.py) share it."""

    def __init__(self, deadline: float | None) -> None:
        self._deadline = deadline
        self._lock = threading.Lock()
        self._done = False
        self._callbacks: list[Callable[[], None]] = []

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def is_active(self) -> bool:
        return not self._done

    def add_callback(self, callback: Callable[[], None]) -> bool:
        with self._lock:
            if self._done:
                return False
            self._callbacks.append(callback)
            return True

    @staticmethod
    def run_callbacks(callbacks: list[Callable[[], None]]) -> None:
        for callback in callbacks:
            try:
                callback()
            except Exception:  # noqa: BLE001 - one callback's failure must not skip the others
                log.exception("a call's end callback failed")


class Context(CallState):
    """The synchronous servicer context handlers see (the part of grpc.ServicerContext nnd uses),
    over a grpc.aio call; called from pool threads, it reaches the loop where it must."""

    def __init__(self, call: Any, loop: asyncio.AbstractEventLoop, caller: Caller) -> None:
        # Pool threads never touch the aio call object itself (it is not thread-safe: its core call
        # may be freed on the loop under a thread reading it, a segfault): what they read is copied
        # here, on the loop, and what they set is applied on the loop (`apply`, or via the loop).
        remaining = call.time_remaining()
        super().__init__(None if remaining is None else time.monotonic() + remaining)
        self._call = call
        self._loop = loop
        self.caller = caller
        self._metadata = tuple(call.invocation_metadata() or ())
        self._peer = call.peer() or ""
        self._trailers: tuple[Any, ...] | None = None
        self._code: grpc.StatusCode | None = None
        self._details: str | None = None
        self._read: concurrent.futures.Future[Any] | None = None
        # The last write `post` handed the loop: at most one is in flight, so a run never queues more
        # than one message ahead of what the client takes.
        self._posted: concurrent.futures.Future[Any] | None = None
        self.task: asyncio.Task[Any] | None = None

    # -- what the call says -------------------------------------------------------------
    def invocation_metadata(self) -> Any:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    # -- how it ends ------------------------------------------------------------------------
    def cancel(self) -> None:
        """End the call now (CANCELLED to the client); a handler blocked reading it wakes."""
        self._loop.call_soon_threadsafe(self._cancel_on_loop)

    def _cancel_on_loop(self) -> None:
        if self._done:
            return
        self._loop.create_task(self._end(grpc.StatusCode.CANCELLED, "the server cancelled the call"))
        self.finish()

    async def _end(self, code: grpc.StatusCode, details: str) -> None:
        try:
            await self._call.abort(code, details)
        except BaseException:  # noqa: BLE001 - abort raises once the status is sent; nothing else to do
            pass

    def finish(self) -> None:
        """The call is over: run the callbacks (once), wake a blocked read. On the loop thread."""
        with self._lock:
            if self._done:
                return
            self._done = True
            callbacks, self._callbacks = self._callbacks, []
            read = self._read
        if read is not None:
            read.cancel()
        self.run_callbacks(callbacks)

    def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise Aborted(code, details)

    def set_trailing_metadata(self, metadata: Any) -> None:
        self._trailers = tuple(metadata)

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def apply(self) -> None:
        """Hand what the handler set to the call. On the loop, before the status is sent."""
        if self._trailers is not None:
            self._call.set_trailing_metadata(self._trailers)
        if self._code is not None:
            self._call.set_code(self._code)
        if self._details is not None:
            self._call.set_details(self._details)

    def send_initial_metadata(self, metadata: Any) -> None:
        self._await(self._call.send_initial_metadata(tuple(metadata)))

    # -- from a pool thread ---------------------------------------------------------------------
    def _await(self, coroutine: Any) -> Any:
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result()
        except Exception as exc:  # noqa: BLE001 - a write to a call that has ended, however aio says so
            future.cancel()
            log.debug("a call ended under a write: %r", exc)
            raise _CallEnded() from None

    def write(self, message: Any) -> None:
        if self._done:
            raise _CallEnded()
        self._await(self._call.write(message))

    # -- a stream driven from its handler thread (Interact: the run writes and reads its own stream) ---
    def _chain(self, before: concurrent.futures.Future[Any] | None, step: Callable[[], Any]) -> Any:
        """Run `step()` (a coroutine) on the loop once `before` is done: in order, and a failed write
        fails what follows it."""

        async def run() -> Any:
            if before is not None:
                await asyncio.wrap_future(before)
            return await step()

        return asyncio.run_coroutine_threadsafe(run(), self._loop)

    def post(self, message: Any = None, *, initial_metadata: Any = None) -> None:
        """Write `message` (or send `initial_metadata`) without waiting for it to go out: the run goes
        on while the loop writes. Waits only for the write posted before it."""
        if self._done:
            raise _CallEnded()
        before, self._posted = self._posted, None
        if before is not None:
            self._settle(before)
        if initial_metadata is not None:
            metadata = tuple(initial_metadata)
            self._posted = self._chain(None, lambda: self._call.send_initial_metadata(metadata))
        else:
            self._posted = self._chain(None, lambda: self._call.write(message))

    def flush(self) -> None:
        """Wait until everything posted has been written."""
        posted, self._posted = self._posted, None
        if posted is not None:
            self._settle(posted)

    def _settle(self, future: concurrent.futures.Future[Any]) -> None:
        try:
            future.result()
        except Exception as exc:  # noqa: BLE001 - a write to a call that has ended, however aio says so
            log.debug("a call ended under a write: %r", exc)
            raise _CallEnded() from None

    def exchange(self, timeout: float, message: Any = None) -> Any:
        """The stream's next request, read once what was posted (and `message`, if given) has been
        written: one trip to the loop for the write and the read. Returns the message, grpc.aio.EOF when the client closed its side (a cancelled call may read so
        too), None when none came within `timeout` seconds. Raises grpc.RpcError (CANCELLED) when the
        call has ended."""
        posted, self._posted = self._posted, None
        with self._lock:
            if self._done:
                raise _CallEnded()
            self._read = read = self._chain(posted, lambda: self._write_then_read(message))
        try:
            return read.result(timeout=max(0.0, timeout))
        except concurrent.futures.TimeoutError:
            read.cancel()  # the run ends now (its pause ran out): nothing reads this stream again
            return None
        except Exception:  # noqa: BLE001 - cancelled, reset, a failed write: the call has ended
            raise _CallEnded() from None
        finally:
            with self._lock:
                self._read = None

    async def _write_then_read(self, message: Any) -> Any:
        if message is not None:
            await self._call.write(message)
        return await self._call.read()

    def requests(self, first: Any) -> Iterator[Any]:
        """A stream's requests: `first` (already read), then the rest as they come."""
        if first is grpc.aio.EOF:
            return
        yield first
        while True:
            with self._lock:
                if self._done:
                    raise _CallEnded()
                self._read = asyncio.run_coroutine_threadsafe(self._call.read(), self._loop)
                read = self._read
            try:
                message = read.result()
            except Exception:  # noqa: BLE001 - cancelled, timed out, reset: the call has ended
                raise _CallEnded() from None
            finally:
                with self._lock:
                    self._read = None
            if message is grpc.aio.EOF:
                return
            yield message


class Lookup:
    """The synchronous handlers and interceptors, applied per call as the sync server would."""

    def __init__(self, interceptors: Sequence[grpc.ServerInterceptor]) -> None:
        self.interceptors = list(interceptors)
        self.generic: list[grpc.GenericRpcHandler] = []

    def _find(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        for generic in self.generic:
            handler = generic.service(details)
            if handler is not None:
                return handler
        return None

    def __call__(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None] = self._find
        for interceptor in reversed(self.interceptors):
            continuation = _chain(interceptor, continuation)
        return continuation(details)


def _chain(interceptor: grpc.ServerInterceptor, then: Callable[..., Any]) -> Callable[..., Any]:
    return lambda details: interceptor.intercept_service(then, details)


class Server:
    """A grpc.Server look-alike (add handlers and ports, start, stop) serving sync handlers on grpc.aio.

    `caller_of(metadata, peer)`: who a call is from, for `per_client`; `quick`: full method names
    (/pkg.Service/Method) run on their own `quick_threads` pool."""

    def __init__(
        self,
        *,
        threads: int,
        options: Sequence[tuple[str, Any]] = (),
        interceptors: Sequence[grpc.ServerInterceptor] = (),
        caller_of: Callable[[Any, str], Caller] = lambda metadata, peer: (peer, ""),
        idle_s: float = 5.0,
        per_client: int = 64,
        total: int = 4096,
        quick: frozenset[str] = frozenset(),
        quick_threads: int = 8,
        max_calls: int = 0,
        on_refusal: Callable[[str, grpc.StatusCode, str], None] | None = None,
        name: str = "grpc",
    ) -> None:
        self.idle_s = idle_s
        self.waiting = Waiting(per_client, total)
        self._caller_of = caller_of
        self._lookup = Lookup(interceptors)
        self._quick = quick
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
        self._quick_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=quick_threads, thread_name_prefix=name + "-quick"
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name + "-loop", daemon=True)
        self._thread.start()
        self._stopped = threading.Event()
        # Calls open at once (0: no cap); beyond it a call is refused before anything runs. Our own count:
        # grpc.aio's maximum_concurrent_rpcs stops taking calls instead, so a client would wait, not fall back.
        self.max_calls = max_calls
        self._calls = 0
        self._on_refusal = on_refusal
        self._server: Any = self._on_loop(self._make, list(options))

    async def _make(self, options: list[tuple[str, Any]]) -> Any:
        server = grpc.aio.server(options=options)
        server.add_generic_rpc_handlers((_Dispatch(self),))
        return server

    def _on_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn` (a coroutine function) on the loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(fn(*args), self._loop).result()

    # -- the grpc.Server surface nnd uses ------------------------------------------------------
    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._lookup.generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        """Generated code adds these beside a generic handler for the same methods: that one serves."""

    def add_insecure_port(self, address: str) -> int:
        async def add() -> int:
            return self._server.add_insecure_port(address)

        return self._on_loop(add)

    def add_secure_port(self, address: str, credentials: grpc.ServerCredentials) -> int:
        async def add() -> int:
            return self._server.add_secure_port(address, credentials)

        return self._on_loop(add)

    def start(self) -> None:
        self._on_loop(self._server.start)

    def stop(self, grace: float | None) -> threading.Event:
        """Refuse new calls, cancel the rest after `grace` seconds; the event is set once all have ended."""
        done = threading.Event()

        async def stop() -> None:
            await self._server.stop(grace)

        def finish(_: Any) -> None:
            self._stopped.set()
            done.set()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).add_done_callback(finish)
        return done

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)

    # -- one call ---------------------------------------------------------------------------------
    def handler_for(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = self._lookup(details)
        if handler is None:
            return None
        method = details.method or ""
        pool = self._quick_pool if method in self._quick else self._pool
        bounded = not method.startswith(UNBOUNDED_PREFIXES)

        async def serve(_requests: Any, call: Any) -> Any:
            if self.max_calls and self._calls >= self.max_calls:
                await self._refuse(
                    call,
                    method,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{self._calls} calls are open on this socket (its limit); nothing ran",
                )
            self._calls += 1
            try:
                return await self._serve(handler, pool, bounded, call, method)
            finally:
                self._calls -= 1

        make = (
            grpc.stream_stream_rpc_method_handler
            if handler.response_streaming
            else grpc.stream_unary_rpc_method_handler
        )
        return make(
            serve, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )

    async def _refuse(self, call: Any, method: str, code: grpc.StatusCode, message: str) -> None:
        """End a call that never ran (RESOURCE_EXHAUSTED: with BUSY_KEY, so a client may go elsewhere)."""
        if self._on_refusal is not None:
            try:
                self._on_refusal(method, code, message)
            except Exception:  # noqa: BLE001 - counting must never change the answer
                log.exception("refusal hook failed")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            call.set_trailing_metadata(((BUSY_KEY, "1"),))
        await call.abort(code, message)

    async def _serve(
        self, handler: grpc.RpcMethodHandler, pool: Any, bounded: bool, call: Any, method: str = ""
    ) -> Any:
        context = Context(call, self._loop, self._caller_of(call.invocation_metadata() or (), call.peer() or ""))
        context.task = asyncio.current_task()
        try:
            first = await self._first(call, method, context.caller[0] if bounded else None)
            if handler.request_streaming:
                request: Any = context.requests(first)
            elif first is grpc.aio.EOF:
                await call.abort(grpc.StatusCode.INTERNAL, "the call ended before its request was sent")
            else:
                request = first
            behavior = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
            run = contextvars.copy_context().run
            loop = asyncio.get_running_loop()
            try:
                if handler.response_streaming:
                    await loop.run_in_executor(pool, run, _drive, behavior, request, context)
                    context.apply()
                    return None
                response = await loop.run_in_executor(pool, run, behavior, request, context)
                context.apply()
                return response
            except Aborted as aborted:
                if context.is_active():
                    context.apply()
                    await call.abort(aborted.code, aborted.details)
            except _CallEnded:
                return None
        finally:
            context.finish()

    async def _first(self, call: Any, method: str, who: str | None) -> Any:
        """The call's first message, once it comes: bounded per caller and cut off after `idle_s`."""
        if who is not None:
            refused = self.waiting.enter(who)
            if refused is not None:
                await self._refuse(call, method, grpc.StatusCode.RESOURCE_EXHAUSTED, refused)
        try:
            if self.idle_s <= 0:
                return await call.read()
            try:
                return await _within(self.idle_s, call.read())
            except asyncio.TimeoutError:
                await self._refuse(
                    call,
                    method,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"the call sent no request within {self.idle_s:g} s of opening (--request-idle-timeout); "
                    "it was cut off",
                )
        finally:
            if who is not None:
                self.waiting.leave(who)


_TIMEOUT = getattr(asyncio, "timeout", None)  # 3.11+


async def _within(seconds: float, awaitable: Any) -> Any:
    """`await awaitable`, TimeoutError after `seconds`. asyncio.timeout (3.11+) sets one timer on the
    running task; wait_for makes a task, a future and a timer per call (~30 µs a call here)."""
    if _TIMEOUT is None:  # Python 3.10
        return await asyncio.wait_for(awaitable, seconds)
    async with _TIMEOUT(seconds):
        return await awaitable


def _drive(behavior: Callable[..., Iterator[Any]], request: Any, context: Context) -> None:
    """Run a streaming handler on a pool thread, writing each response as the client takes it."""
    responses = behavior(request, context)
    try:
        for response in responses:
            context.write(response)
    finally:
        close = getattr(responses, "close", None)
        if close is not None:
            close()  # a generator stopped early (the client went away) runs its cleanup now


class _Dispatch(grpc.GenericRpcHandler):
    def __init__(self, server: Server) -> None:
        self._server = server

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        return self._server.handler_for(details)
