"""Who may talk to the daemon.

Two parts: `Access`, the listening policy, checked before anything binds
(TCP needs a token, mTLS, or an explicit `--insecure` on loopback), and
`TokenInterceptor`, the one place a bearer token is checked on every call.
The unix socket is guarded by its file mode; with a token configured it needs
the token too, so one rule covers both listeners.
"""

from __future__ import annotations

import hmac
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from nnd import _address

log = logging.getLogger("nnd.auth")

# Health checks pass without a token so that load balancers and `grpc_health_probe`
# need no secret; they reveal only SERVING / NOT_SERVING per model name.
_OPEN_PREFIXES = ("/grpc.health.v1.Health/",)


class AccessError(ValueError):
    """A listening setup that `nnd serve` refuses to start with."""


@dataclass(frozen=True)
class Tls:
    cert: bytes
    key: bytes
    client_ca: bytes | None = None  # set: clients must present a certificate it signed


@dataclass(frozen=True)
class Access:
    """How the daemon may be reached besides its unix socket."""

    listen: str | None = None  # TCP host:port
    token: str | None = None
    insecure: bool = False
    tls: Tls | None = None

    @classmethod
    def build(
        cls,
        *,
        listen: str | None = None,
        token_file: str | None = None,
        insecure: bool = False,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_client_ca: str | None = None,
    ) -> Access:
        """Read the files and check the combination; raises AccessError with a
        one-line reason."""
        if listen and _address.unix_path(_address.normalize(listen)):
            raise AccessError(f"--listen takes HOST:PORT, not a socket path ({listen}); use --address for the socket")
        if (tls_cert or tls_key or tls_client_ca) and not listen:
            raise AccessError("--tls-cert/--tls-key/--tls-client-ca apply to --listen HOST:PORT; add --listen")
        if bool(tls_cert) != bool(tls_key):
            raise AccessError("TLS needs both --tls-cert and --tls-key")
        if tls_client_ca and not tls_cert:
            raise AccessError("--tls-client-ca (mTLS) needs --tls-cert and --tls-key")
        token = load_token(token_file) if token_file else None
        tls = None
        if tls_cert and tls_key:
            tls = Tls(_read(tls_cert, "--tls-cert"), _read(tls_key, "--tls-key"))
            if tls_client_ca:
                tls = Tls(tls.cert, tls.key, _read(tls_client_ca, "--tls-client-ca"))
        if listen:
            loopback = _address.is_loopback(listen)
            if insecure and not loopback:
                raise AccessError(
                    f"--insecure is only allowed on a loopback address (127.0.0.1, ::1, localhost), not {listen}"
                )
            # mTLS authenticates every connection by certificate, so it stands in for a token.
            authenticated = token is not None or (tls is not None and tls.client_ca is not None)
            if not authenticated and not insecure:
                hint = " (or --insecure, on loopback only)" if loopback else ""
                raise AccessError(f"refusing to listen on {listen} without authentication: give --token-file{hint}")
            if token is not None and tls is None and not loopback:
                log.warning(
                    "listening on %s in plaintext: the token and every request can be read on the network; "
                    "add --tls-cert/--tls-key",
                    listen,
                )
        return cls(listen=listen, token=token, insecure=insecure, tls=tls)

    def credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials for the TCP port; None means plaintext."""
        if self.tls is None:
            return None
        return grpc.ssl_server_credentials(
            [(self.tls.key, self.tls.cert)],
            root_certificates=self.tls.client_ca,
            require_client_auth=self.tls.client_ca is not None,
        )

    def interceptors(self) -> list[grpc.ServerInterceptor]:
        return [TokenInterceptor(self.token)] if self.token else []


def _read(path: str, option: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise AccessError(f"cannot read {option} {path}: {exc.strerror}") from None


def load_token(path: str) -> str:
    """The token in `path`, surrounding whitespace removed."""
    token = _read(path, "--token-file").decode("utf-8", "replace").strip()
    if not token:
        raise AccessError(f"--token-file {path} is empty")
    if any(c.isspace() for c in token):
        raise AccessError(f"--token-file {path} must hold one token without spaces")
    if os.stat(path).st_mode & stat.S_IROTH:
        log.warning("token file %s is readable by every user; chmod 0640 or 0600 it", path)
    return token


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


_MAKERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _deny(handler: grpc.RpcMethodHandler | None, method: str, reason: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only aborts. It has no
    deserializer, so an unauthenticated caller's bytes are never parsed; an
    unknown method is refused the same way, so methods cannot be probed."""

    def abort(request: Any, context: grpc.ServicerContext) -> None:
        _REFUSALS.note(method, context.peer(), reason.split(":")[0])
        context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    shape = (bool(handler and handler.request_streaming), bool(handler and handler.response_streaming))
    return _MAKERS[shape](abort)
