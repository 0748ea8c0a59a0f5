"""Errors every part of the daemon raises, each tied to one gRPC status code,
and the one place they become statuses: `ErrorInterceptor`, installed on every
server (the daemon's, a worker's two, the helper's). Methods only raise.

`exc_type` names the Python exception a user would have seen had the code run
in-process (RuntimeError for a shape error), so the client can raise that same
type.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from nnd.v1 import contract
from nnd.v1.contract import EXC_TYPE_KEY

# Longest status message sent, in bytes as gRPC percent-encodes them. gRPC
# clients refuse metadata over 8 KiB (a status message is metadata) and report
# RESOURCE_EXHAUSTED instead of the real status, so an error quoting a huge
# client string (a module path, a model name) must be cut.
MAX_MESSAGE_BYTES = 4096


class NndError(Exception):
    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, exc_type: str = "", trailers: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.exc_type = exc_type
        # More trailing metadata for the client (e.g. a stale route's marker).
        self.trailers = trailers


class InvalidArgument(NndError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(NndError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(NndError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(NndError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(NndError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(NndError):
    code = grpc.StatusCode.UNAVAILABLE


class Unimplemented(NndError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Cancelled(NndError):
    code = grpc.StatusCode.CANCELLED


class DeadlineExceeded(NndError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class PermissionDenied(NndError):
    code = grpc.StatusCode.PERMISSION_DENIED


def relayed(code: grpc.StatusCode | int, message: str, exc_type: str = "") -> NndError:
    """The error another nnd process answered with (a worker, the helper, a tensor-parallel group's
    rank 0), to pass on unchanged: its status code (or the code's number), message and exception type.
    A plain NndError, never one of the subclasses: the daemon's own hooks (events.on_error) count only
    refusals it made itself."""
    if isinstance(code, int):
        code = next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
    err = NndError(message, exc_type=exc_type)
    err.code = code
    return err


def from_rpc(err: grpc.RpcError) -> NndError:
    """`relayed` for a failed call to another nnd process: the status it ended with, as it said it."""
    code = err.code()
    return relayed(code, err.details() or str(code), contract.exc_type_of(err))


def limit_name(message: str) -> str:
    """The limit a RESOURCE_EXHAUSTED message names (they say `max_queue_depth=64`), for the
    refusals metric; "other" where none is named (a full helper, a memory budget)."""
    import re

    m = re.search(r"\b((?:max|helper)_[a-z_]+)=", message)
    return m.group(1) if m else "other"


class Malformed:
    """What a server's deserializer returns for bytes that do not parse (gRPC answers
    INTERNAL when a deserializer raises; a client's garbage is its own error). A method
    never sees one in place of its request: `ErrorInterceptor` refuses it; a stream's
    reader raises `error` when it meets one."""

    def __init__(self, message_type: str, error: Exception) -> None:
        self.error = InvalidArgument(
            f"the request is not a valid nnd.v1.{message_type} message ({error}); nothing ran"
        )


def abort(context: grpc.ServicerContext, err: NndError) -> None:
    """End an RPC with `err`'s status, message and exception type."""
    trailers = err.trailers + (((EXC_TYPE_KEY, err.exc_type[:100]),) if err.exc_type else ())
    if trailers:
        context.set_trailing_metadata(trailers)
    context.abort(err.code, fit(err.message))


# gRPC's handler makers by (request streaming, response streaming).
MAKERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def same_shape(handler: grpc.RpcMethodHandler | None, behavior: Callable[..., Any]) -> grpc.RpcMethodHandler:
    """A handler running `behavior`, of `handler`'s shape and with its (de)serializers."""
    shape = (bool(handler and handler.request_streaming), bool(handler and handler.response_streaming))
    return MAKERS[shape](
        behavior,
        request_deserializer=handler.request_deserializer if handler else None,
        response_serializer=handler.response_serializer if handler else None,
    )


_WRAPPED_KEPT = 512


class ErrorInterceptor(grpc.ServerInterceptor):
    """Every method's failure becomes its status here: an NndError its own code, message
    and trailers; a request that did not parse INVALID_ARGUMENT; anything else INTERNAL,
    logged with its traceback. Errors raised mid-stream map the same way.

    `translate` may turn a failure that is no NndError into one (the helper: MemoryError
    at its address-space limit). Behind a token interceptor, never in front of it: a
    refused call's own abort would otherwise read as a failure. Methods must raise, not
    call `context.abort` (its exception would read as a failure too)."""

    def __init__(
        self,
        log: logging.Logger,
        *,
        internal: str = "internal error",
        translate: Callable[[BaseException], NndError | None] = lambda exc: None,
        on_error: Callable[[str, NndError], None] | None = None,
    ) -> None:
        self._log = log
        self._internal = internal
        self._translate = translate
        # Told of every failure as it becomes a status (the daemon's metrics count refusals).
        self._on_error = on_error
        # The wrapped handler of each (handler, method) seen: the servers' handlers live as long as they
        # do, so a call need not build two closures and a handler again (the handler is kept, so its
        # id is never another's).
        self._wrapped: dict[tuple[int, str], tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None:  # unknown method: gRPC answers UNIMPLEMENTED
            return None
        method = details.method or "?"
        key = (id(handler), method)
        kept = self._wrapped.get(key)
        if kept is not None and kept[0] is handler:
            return kept[1]
        wrapped = self._wrap(handler, method)
        if len(self._wrapped) >= _WRAPPED_KEPT:  # handlers made per call (none of nnd's): no growth
            self._wrapped.clear()
        self._wrapped[key] = (handler, wrapped)
        return wrapped

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        behavior: Callable[..., Any] = (
            handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream
        )

        def unary(request: Any, context: grpc.ServicerContext) -> Any:
            try:
                _refuse_malformed(request)
                return behavior(request, context)
            except GeneratorExit:
                raise
            except BaseException as exc:  # noqa: BLE001 - every failure becomes a status
                self._abort(context, method, exc)

        def streaming(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                _refuse_malformed(request)
                yield from behavior(request, context)
            except GeneratorExit:  # gRPC closed the stream (the client went away): nothing to answer
                raise
            except BaseException as exc:  # noqa: BLE001 - every failure becomes a status
                self._abort(context, method, exc)

        return same_shape(handler, streaming if handler.response_streaming else unary)

    def _abort(self, context: grpc.ServicerContext, method: str, exc: BaseException) -> None:
        err = exc if isinstance(exc, NndError) else self._translate(exc)
        if err is None:
            self._log.error("%s failed", method, exc_info=exc)
            err = NndError(f"{self._internal}: {type(exc).__name__}: {exc}")
        if self._on_error is not None:
            try:
                self._on_error(method, err)
            except Exception:  # noqa: BLE001 - counting must never change the answer
                self._log.exception("error hook failed")
        abort(context, err)


def _refuse_malformed(request: Any) -> None:
    if isinstance(request, Malformed):
        raise request.error


def _encoded_size(text: str) -> int:
    # grpc-message is percent-encoded: printable ASCII but '%' stays one byte, the rest three per byte.
    return sum(1 if 0x20 <= b < 0x7F and b != 0x25 else 3 for b in text.encode("utf-8"))


def fit(message: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """`message`, with its middle cut out if it would exceed `limit` bytes on the wire."""
    if _encoded_size(message) <= limit:
        return message
    budget = (limit - 64) // 2
    head = _take(message, budget)
    tail = _take(message[::-1], budget)[::-1]
    return f"{head} [... {len(message) - len(head) - len(tail)} characters cut ...] {tail}"


def _take(text: str, budget: int) -> str:
    """The longest prefix of `text` whose encoded size fits `budget`."""
    used = 0
    for i, ch in enumerate(text):
        used += _encoded_size(ch)
        if used > budget:
            return text[:i]
    return text
