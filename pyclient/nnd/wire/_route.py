"""Routes: send a model's Trace, Generate, Session and Interact straight to its worker.

The daemon says where a model's worker listens (GetRoute: a unix socket and an
epoch); a client on the daemon's host sends its data requests there, one hop
instead of two. When the route is stale (the worker ended, was re-dispatched,
or the daemon restarted) the call fails before anything ran: the client asks
the daemon again and resends, once. A call the worker had accepted is never
resent; it fails with UNAVAILABLE saying whether it had started, as the
daemon says it. With no route (the model is not dispatched) the request goes
to the daemon, which dispatches the model first; so does one whose fresh route
cannot be reached (the daemon then forwards its bytes). Where the route offers
a fast socket, Trace, TraceOnce, Generate, Session and Interact go there as
framed messages (_fast.py), the same requests and answers without gRPC's
per-call cost. (protos/nnd/v1/nnd.proto, Route.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from nnd.errors import DaemonUnavailable
from nnd.v1 import contract, nnd_pb2, nnd_pb2_grpc
from nnd.wire import _chunks, _fast

# gRPC's words when no connection could be made: the request never left the client.
_NOT_CONNECTED = ("failed to connect", "No such file or directory", "Connection refused", "connections to all backends")


@dataclass
class Route:
    address: str
    epoch: int
    channel: grpc.Channel
    stub: _chunks.DataStub
    once: bool = True  # the worker serves TraceOnce (an older one answers UNIMPLEMENTED)
    fast: _fast.FastChannel | None = None  # the route's fast socket; None: none, or it refused us


class Router:
    """The routes of one connection's models, fetched on first use and when stale."""

    def __init__(
        self,
        daemon: nnd_pb2_grpc.NndStub,
        metadata: Callable[[], list[tuple[str, str]]],
        options: Any,
        on_forget: Callable[[str], None] | None = None,
    ):
        self._daemon = daemon
        self._on_forget = on_forget  # told when a model's route went stale or its worker was lost
        self._metadata = metadata
        self._options = options
        self._lock = threading.Lock()
        self._routes: dict[str, Route] = {}
        self.direct_calls = 0  # calls that went to a worker (tests and benchmarks read it)
        self.once_calls = 0  # ... of which answered as TraceOnce (one unary message)
        self.fast_calls = 0  # ... of which went by the route's fast socket
        self.fallbacks = 0  # routes found unreachable, whose calls went through the daemon
        self._unreachable: set[tuple[str, int]] = set()  # (model, epoch): follow the daemon, not the route

    def stream(
        self,
        method: str,
        request: Any,
        timeout: float | None,
        via_daemon: Callable[[float | None], Iterator[Any]],
        translate: Callable[[grpc.RpcError], Exception],
    ) -> Iterator[Any]:
        # A trace read as one message goes as one unary call where the worker takes it (TraceOnce).
        once = method == "Trace" and bool(getattr(request, "one_message", False))
        yield from self.follow(method, request.model, lambda: request, timeout, via_daemon, translate, once=once)

    def follow(
        self,
        method: str,
        model: str,
        argument: Callable[[], Any],
        timeout: float | None,
        via_daemon: Callable[[float | None], Iterator[Any]],
        translate: Callable[[grpc.RpcError], Exception],
        *,
        once: bool = False,
    ) -> Iterator[Any]:
        """Call `method` of `model`'s worker with `argument()` (called once per attempt: a
        request, or a fresh iterator of an Interact stream's messages). `once`: a Trace that may go
        as TraceOnce; refused so (`nnd-route: stream`, or an older worker), it goes as Trace."""
        deadline = None if timeout is None else time.monotonic() + timeout
        attempt = 0
        while attempt < 2:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            route = self._route(model, translate)
            if route is None:  # no worker (or none this client can reach): the daemon runs the request
                yield from via_daemon(left)
                return
            meta = [*self._metadata(), (contract.EPOCH_KEY, str(route.epoch))]
            unary = once and route.once
            call: Any = None
            answered = False  # a response came: the request had begun, whatever the metadata says
            fast = route.fast if method in _FAST_METHODS else None
            try:
                if fast is not None:
                    try:
                        if method == "Interact":  # the start now; the block's later messages as it sends them
                            messages = argument()
                            first = next(messages).SerializeToString()
                            sent = fast.call(method, first, meta, left, more=messages)
                        else:
                            name = contract.TRACE_ONCE if unary else method
                            sent = fast.call(name, argument().SerializeToString(), meta, left)
                    except _fast.Unreachable:
                        route.fast = None  # nothing was sent: this route's calls take gRPC from now on
                        fast.close()
                        continue
                    self.direct_calls += 1
                    self.fast_calls += 1
                    if unary:
                        try:
                            response = _fast.unary(sent, _chunks.response)
                        finally:
                            sent.cancel()
                        answered = True
                        self.once_calls += 1
                        yield response
                        return
                    call = sent
                    for raw in sent:
                        answered = True
                        yield _chunks.response(raw)
                    return
                if unary:
                    self.direct_calls += 1
                    response = route.stub.TraceOnce(argument(), timeout=left, metadata=meta)
                    answered = True
                    self.once_calls += 1
                    yield response
                    return
                call = getattr(route.stub, method)(argument(), timeout=left, metadata=meta)
                self.direct_calls += 1
                for response in call:
                    answered = True
                    yield response
                return
            except grpc.RpcError as err:
                if unary and _stream_instead(err):
                    # Nothing was answered: the same attempt goes as a stream (an older worker's route
                    # never again).
                    if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                        route.once = False
                    once = False
                    continue
                if _never_ran(err):
                    self._forget(model, route)
                    attempt += 1
                    if attempt < 2:
                        continue
                    if _not_connected(err):
                        # The fresh route cannot be reached either (a socket out of this client's
                        # sight: another mount namespace, a container): this epoch goes through the
                        # daemon, which forwards the bytes. Nothing ran, so nothing runs twice.
                        with self._lock:
                            self._unreachable.add((model, route.epoch))
                        self.fallbacks += 1
                        break
                    raise translate(err) from None
                if _at_capacity(err) and not answered:
                    # The worker's socket takes no more calls now (gRPC refused before anything ran):
                    # this call goes through the daemon, which reaches the worker by its own socket.
                    self.fallbacks += 1
                    break
                if err.code() == grpc.StatusCode.UNAVAILABLE:
                    # A unary call keeps one header only, which cannot say queued-then-started: taken to have run.
                    lost = self._lost(model, route, call if not answered else None, err, translate)
                    self._forget(model, route)  # after reading the call's metadata: closing ends it
                    raise lost from None
                raise translate(err) from None
            finally:
                if call is not None:
                    call.cancel()
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        yield from via_daemon(left)

    def _route(self, model: str, translate: Callable[[grpc.RpcError], Exception]) -> Route | None:
        with self._lock:
            route = self._routes.get(model)
        if route is not None:
            return route
        try:
            answer = self._daemon.GetRoute(nnd_pb2.RouteRequest(model=model), metadata=self._metadata(), timeout=30)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:  # an older daemon: no routes
                return None
            raise translate(err) from None
        if not answer.address:
            return None
        with self._lock:
            if (model, answer.epoch) in self._unreachable:
                return None
        channel = grpc.insecure_channel(answer.address, options=self._options)
        route = Route(answer.address, answer.epoch, channel, _chunks.DataStub(channel))
        fast_path = answer.fast_address.removeprefix("unix://")
        if fast_path and answer.fast_address.startswith("unix://") and _fast.enabled():
            route.fast = _fast.FastChannel(fast_path)
        with self._lock:
            old = self._routes.get(model)
            if old is not None and old.epoch == route.epoch:
                channel.close()
                return old
            self._routes[model] = route
        return route

    def _forget(self, model: str, route: Route) -> None:
        with self._lock:
            if self._routes.get(model) is route:
                del self._routes[model]
        route.channel.close()
        if route.fast is not None:
            route.fast.close()
        if self._on_forget is not None:
            self._on_forget(model)

    def _lost(
        self, model: str, route: Route, call: Any, err: grpc.RpcError, translate: Callable[[grpc.RpcError], Exception]
    ) -> Exception:
        """The worker went away with the request in it: say why and whether it ran, as the daemon would."""
        started: bool | None = True
        if call is not None:
            try:
                started = contract.started_from(call.initial_metadata())
            except Exception:  # noqa: BLE001 - only a hint for the message
                started = None
        try:
            reason = self._daemon.GetRoute(
                nnd_pb2.RouteRequest(model=model, failed_epoch=route.epoch), metadata=self._metadata(), timeout=10
            ).lost
        except grpc.RpcError:
            reason = ""
        if not reason:
            return translate(err)
        if started is False:
            when = "before this request ran (it was queued behind another one): none of it ran, so it is safe to retry"
        else:
            when = "while running this request"
        # "hung ...", "died: ...", or "was released by USER at TIME" (another user's `nnd release --force`).
        what = reason if reason.startswith(("hung", "died", "was ")) else f"died: {reason}"
        lost = DaemonUnavailable(
            f"the worker of {model} {what}; this happened {when}; "
            "the next request dispatches the model again (`nnd ps` shows why it stopped)"
        )
        lost.code = grpc.StatusCode.UNAVAILABLE  # as the daemon's answer for the same loss carries
        return lost

    def close(self) -> None:
        with self._lock:
            routes, self._routes = list(self._routes.values()), {}
        for route in routes:
            route.channel.close()
            if route.fast is not None:
                route.fast.close()


# What the fast route serves (nnd.proto, Route.fast_address).
_FAST_METHODS = frozenset({"Trace", "Generate", "Session", "Interact"})


def _stream_instead(err: grpc.RpcError) -> bool:
    """The worker will not answer this Trace in one message (TraceOnce), or knows no TraceOnce."""
    if err.code() == grpc.StatusCode.UNIMPLEMENTED:
        return True
    return err.code() == grpc.StatusCode.FAILED_PRECONDITION and (
        contract.trailer(err.trailing_metadata(), contract.ROUTE_KEY) == contract.STREAM
    )


def _never_ran(err: grpc.RpcError) -> bool:
    """The worker refused the call for its epoch, or no connection was made: nothing ran."""
    if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
        return any(k == contract.ROUTE_KEY and v == contract.STALE for k, v in err.trailing_metadata() or ())
    return _not_connected(err)


# Trailing metadata of a worker's refusal before anything ran: this caller has as many calls open
# there, still waiting for their request, as the worker takes from one caller.
BUSY_KEY = "nnd-busy"


def _at_capacity(err: grpc.RpcError) -> bool:
    """The route's socket refused the call before it started: gRPC's own call limit
    (maximum_concurrent_rpcs), or the worker's bound on one caller's calls still waiting for their request."""
    if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return False
    if "Concurrent RPC limit exceeded" in (err.details() or ""):
        return True
    return any(k == BUSY_KEY for k, _ in err.trailing_metadata() or ())


def _not_connected(err: grpc.RpcError) -> bool:
    details = err.details() or ""
    return err.code() == grpc.StatusCode.UNAVAILABLE and any(text in details for text in _NOT_CONNECTED)
