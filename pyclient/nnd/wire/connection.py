"""One gRPC channel to the daemon, shared by every model handle of a process,
and the routes to its models' workers (_route.py)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from nnd.errors import DaemonUnavailable, NndError, from_rpc_error
from nnd.v1 import contract, nnd_pb2_grpc
from nnd.wire import _address, _chunks, _identity, _route

try:  # imported up front: a process that has changed user may no longer read the module's file
    import grp
except ImportError:  # not on Windows
    grp = None  # type: ignore[assignment]

# The contract's message-size limit, as the daemon's servers have it.
CHANNEL_OPTIONS = [
    *contract.GRPC_OPTIONS,
    # Streamed results are read on the caller's thread: no helper thread per call.
    ("SingleThreadedUnaryStream", 1),
]


_TLS_SCHEMES = ("tls://", "https://")


def _client_name() -> str:
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = str(os.getuid())
    return f"{user}@{socket.gethostname()}:{os.getpid()}"


_CLIENT = _client_name()


def _read(path: str | None) -> bytes | None:
    if not path:
        return None
    try:
        with open(os.path.expanduser(path), "rb") as f:
            return f.read()
    except OSError as exc:
        raise NndError(f"cannot read TLS file {path}: {exc.strerror}") from None


class Connection:
    """A channel and stub to one daemon, with errors mapped to nnd exceptions.

    `token` (default `$NND_TOKEN`) is sent as `authorization: Bearer <token>`
    on every call.

    TLS is chosen by the address: `tls://host:port` (or `https://host:port`)
    dials over TLS and checks the daemon's certificate against `tls_ca`, a PEM
    file (default `$NND_TLS_CA`, else the system's roots). A CA given for a
    plain `host:port` turns TLS on as well, since it has no other use. For a
    daemon that wants client certificates (mTLS), `tls_cert`/`tls_key`
    (default `$NND_TLS_CERT`/`$NND_TLS_KEY`) name the client's PEM files.
    Unix sockets never use TLS.

    Over a unix socket, Trace, Generate and Session go straight to the model's
    worker by its route (`direct`; `$NND_DIRECT=0` turns that off): the
    daemon only steers. Over TCP they go through the daemon.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        token: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ) -> None:
        self.address = _address.normalize(address) if address else _address.default_address()
        token = token if token is not None else os.environ.get("NND_TOKEN")
        self.token = token.strip() if token else None
        tls_ca = tls_ca or os.environ.get("NND_TLS_CA")
        target = self.address
        if target.startswith(_TLS_SCHEMES):
            target = target.split("://", 1)[1]
        self.tls = target != self.address or bool(tls_ca and not _address.unix_path(self.address))
        if self.tls:
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read(tls_ca),
                private_key=_read(tls_key or os.environ.get("NND_TLS_KEY")),
                certificate_chain=_read(tls_cert or os.environ.get("NND_TLS_CERT")),
            )
            self.channel = grpc.secure_channel(target, creds, options=CHANNEL_OPTIONS)
        else:
            self.channel = grpc.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        self.stub = nnd_pb2_grpc.NndStub(self.channel)
        self.data = _chunks.DataStub(self.channel)  # the streams that carry results
        self.direct = (
            not self.tls and _address.unix_path(self.address) is not None and os.environ.get("NND_DIRECT") != "0"
        )
        self.router = _route.Router(self.stub, self._metadata, CHANNEL_OPTIONS, on_forget=self.forget_dispatched)
        # Models this process saw dispatched (their first data request dispatched them with progress),
        # and each handle's `progress=` choice by model name (_progress.show).
        self._dispatched: set[str] = set()
        self.progress: dict[str, Any] = {}
        # The daemon's word for this process's user (ownership, `nnd ps`, logs); None over TCP.
        self._ticket = _identity.fetch_ticket(self.address) if not self.tls else None

    def _metadata(self) -> list[tuple[str, str]]:
        who = [(contract.CLIENT_KEY, _CLIENT)]  # shown by `nnd ps` beside this process's requests
        if self._ticket:
            who.append((contract.USER_KEY, self._ticket))
        return [("authorization", f"Bearer {self.token}"), *who] if self.token else who

    def call(self, method: str, request: Any, *, timeout: float | None = None) -> Any:
        """A unary call; raises nnd exceptions."""
        try:
            return getattr(self.stub, method)(request, timeout=timeout, metadata=self._metadata())
        except grpc.RpcError as err:
            raise self._translate(err) from None

    def stream(self, method: str, request: Any, *, timeout: float | None = None) -> Iterator[Any]:
        """A server-streaming call; iterating raises nnd exceptions. Closing the
        iterator cancels the call on the daemon."""
        data = method in contract.DATA_METHODS and not getattr(request, "scan", False)
        if data and not request.no_auto_dispatch:
            self.ensure_dispatched(request.model, request.keep_alive)
        if self.direct and data:
            yield from self.router.stream(
                method, request, timeout, lambda left: self._stream(method, request, left), self._translate
            )
            return
        yield from self._stream(method, request, timeout)

    def _stream(self, method: str, request: Any, timeout: float | None) -> Iterator[Any]:
        stub = self.data if hasattr(self.data, method) else self.stub
        call = getattr(stub, method)(request, timeout=timeout, metadata=self._metadata())
        try:
            yield from call
        except grpc.RpcError as err:
            raise self._translate(err) from None
        finally:
            call.cancel()

    def bidi(
        self, method: str, model: str, requests: Callable[[], Iterator[Any]], *, timeout: float | None = None
    ) -> Iterator[Any]:
        """A bidirectional stream (Interact) to `model`'s worker by its route, else through the
        daemon. `requests()` gives the messages (read by gRPC as it goes; called again if a stale
        route is refused before anything ran); iterating the answer raises nnd exceptions;
        closing it cancels the call."""
        self.ensure_dispatched(model)
        if self.direct:
            yield from self.router.follow(
                method, model, requests, timeout, lambda left: self._bidi(method, requests(), left), self._translate
            )
            return
        yield from self._bidi(method, requests(), timeout)

    def _bidi(self, method: str, requests: Iterator[Any], timeout: float | None) -> Iterator[Any]:
        call = getattr(self.data, method)(requests, timeout=timeout, metadata=self._metadata())
        try:
            yield from call
        except grpc.RpcError as err:
            raise self._translate(err) from None
        finally:
            call.cancel()

    def ensure_dispatched(self, model: str, keep_alive: str = "") -> None:
        """Before a data request: dispatch a META model here, showing the weights' progress as
        `nnd dispatch` does, instead of leaving the daemon to dispatch it silently (a large model
        takes minutes). One GetRoute per model and process while it stays dispatched; the
        dispatch uses the placement the model was loaded with, as the daemon's own would."""
        if model in self._dispatched:
            return
        from nnd.v1 import nnd_pb2
        from nnd.wire import _progress

        try:
            route = self.stub.GetRoute(nnd_pb2.RouteRequest(model=model), metadata=self._metadata(), timeout=30)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNIMPLEMENTED:  # an older daemon: it dispatches by itself
                self._dispatched.add(model)
                return
            raise self._translate(err) from None
        if not route.address:
            request = nnd_pb2.DispatchRequest(model=model, keep_alive=keep_alive)
            _progress.show(self.stream("Dispatch", request), model, self.progress.get(model))
        self._dispatched.add(model)

    def forget_dispatched(self, model: str) -> None:
        """The model's worker ended (released, lost, re-dispatched): its next request checks again."""
        self._dispatched.discard(model)

    def _translate(self, err: grpc.RpcError) -> Exception:
        exc = from_rpc_error(err)
        # gRPC's own words for "nothing listens there" (a daemon's UNAVAILABLE,
        # e.g. a worker's death, quotes logs and must pass through unchanged).
        text = str(exc)
        if isinstance(exc, DaemonUnavailable) and text.startswith(("failed to connect", "DNS resolution failed")):
            path = _address.unix_path(self.address)
            if path and "Permission denied" in text:
                return DaemonUnavailable(_permission_denied(path))
            return DaemonUnavailable(f"cannot reach the nnd daemon at {self.address} (is `nnd serve` running?)")
        return exc

    def close(self) -> None:
        self.router.close()
        self.channel.close()


def _permission_denied(path: str) -> str:
    """The socket exists but this user may not use it: say so, and which group may."""
    group = ""
    for where in (path, os.path.dirname(path)):  # the socket, else its 0750 directory
        try:
            gid = os.stat(where).st_gid
        except OSError:
            continue
        try:
            group = grp.getgrgid(gid).gr_name if grp is not None else f"gid {gid}"
        except KeyError:
            group = f"gid {gid}"
        break
    who = f"members of the group {group!r}" if group else "the members of its group"
    return (
        f"permission denied on the nnd daemon's socket {path}: only {who} may use it; "
        "ask the daemon's admin to add you to that group (then log in again)"
    )


_shared: dict[tuple[str | None, str | None], Connection] = {}
_lock = threading.Lock()


def connect(address: str | None = None, *, token: str | None = None) -> Connection:
    """The process-wide connection to `address` (default: the usual socket)."""
    key = (address, token)
    with _lock:
        if key not in _shared:
            _shared[key] = Connection(address, token=token)
        return _shared[key]
