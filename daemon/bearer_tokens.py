"""The bearer-token check, the one place a token is compared: the daemon's
listeners and a worker's public socket use the same interceptor."""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from nnd_daemon.errors import MAKERS

log = logging.getLogger("nnd.auth")

# Health checks pass without a token so that load balancers and `grpc_health_probe`
# need no secret; they reveal only SERVING / NOT_SERVING per model name.
_OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


def bearer(metadata: Any) -> str | None:
    """The token of an `authorization: Bearer <token>` header, if any."""
    for key, value in metadata or ():
        if key == "authorization":
            if isinstance(value, bytes):
                value = value.decode("latin-1")
            scheme, _, token = value.strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


class TokenInterceptor(grpc.ServerInterceptor):
    """UNAUTHENTICATED unless the call carries the daemon's bearer token."""

    def __init__(self, token: str) -> None:
        self._token = token.encode()

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        method = details.method or ""
        if method.startswith(_OPEN_PREFIXES):
            return continuation(details)
        sent = bearer(details.invocation_metadata)
        if sent is not None and hmac.compare_digest(sent.encode(), self._token):
            return continuation(details)
        if sent is None:
            reason = "this daemon needs a token: set NND_TOKEN or pass --token (sent as `authorization: Bearer ...`)"
        else:
            reason = "the token was refused: check NND_TOKEN / --token against the daemon's --token-file"
        return _deny(continuation(details), method, reason)


class RefusalLog:
    """Refused calls, logged at most once per `window_s` (with the count since the last line),
    so unauthenticated callers cannot flood the log."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._lock = threading.Lock()
        self._next = 0.0
        self._quiet = 0

    def note(self, method: str, peer: str, reason: str) -> None:
        with self._lock:
            now = time.monotonic()
            if now < self._next:
                self._quiet += 1
                return
            quiet, self._quiet, self._next = self._quiet, 0, now + self.window_s
        more = f" ({quiet} more refused since the last such line)" if quiet else ""
        log.warning("refused %s from %s: %s%s", method, peer, reason, more)


_REFUSALS = RefusalLog()


def _deny(handler: grpc.RpcMethodHandler | None, method: str, reason: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only aborts. It has no
    deserializer, so an unauthenticated caller's bytes are never parsed; an
    unknown method is refused the same way, so methods cannot be probed."""

    def abort(request: Any, context: grpc.ServicerContext) -> None:
        _REFUSALS.note(method, context.peer(), reason.split(":")[0])
        context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    shape = (bool(handler and handler.request_streaming), bool(handler and handler.response_streaming))
    return MAKERS[shape](abort)
