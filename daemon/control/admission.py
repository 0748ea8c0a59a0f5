"""Which calls the daemon's handler threads take on, so that none can starve the rest.

gRPC runs every call on one finite thread pool (server.HANDLER_THREADS). A
call that can hold its thread for long (an Upload whose client stalls, a
Trace queued behind a dispatch) passes a gate first: beyond `slow_slots` at
once, or `uploads_per_client`/`uploads_total` Uploads, it is refused with
RESOURCE_EXHAUSTED, so threads are always left for the quick calls of
`ALWAYS` (`nnd ps`, ListModels, GetModel, GetServerInfo; health is a service
of its own and never gated). An Upload whose client sends nothing for
`upload_idle_s` is cancelled, which frees its thread. No client holds more
than its share of the slots (`client_share`, a quarter by default): a client
that floods is refused RESOURCE_EXHAUSTED while others still find slots. A
client is its verified identity (`caller_of`): the `nnd-client` names a caller
sends are its own choice, so fifty of them are still one share.

Every call but ListModels and GetModel (they only read the registry) also
waits until the start-up imports are done (`Admission.ready`): two threads
importing transformers at once can fail with ImportError.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

import grpc

from nnd_daemon import errors, identity

log = logging.getLogger("nnd.admission")

# Quick, read-only calls that never wait on a model or a client: not gated (an allow-list).
ALWAYS = frozenset({"GetServerInfo", "ListModels", "GetModel"})
# Calls that only read the registry (models in it were built after the imports, or
# before them by the restore): they answer at once, even during the warm-up.
NO_IMPORTS = frozenset({"ListModels", "GetModel"})
UPLOAD = "Upload"
# How long a call waits for the start-up imports before it runs anyway.
READY_WAIT_S = 300.0


def client_of(peer: str) -> str:
    """The client a call comes from: the host for TCP (any port), one key for the unix socket."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return kind + ":" + rest.rsplit(":", 1)[0]
    return kind


def caller_of(context: grpc.ServicerContext) -> tuple[str, str]:
    """Who a call is from: (its verified identity, the client's own name within it), as the server
    worked it out when the call opened (asyncserve.Context.caller: the uid of a ticket from the
    `.who` socket, a token's or host's name over TCP). A context without it (a test's fake) counts
    as the unverified identity of its transport."""
    caller = getattr(context, "caller", None)
    if caller is not None:
        return caller
    return identity.caller_of(context.invocation_metadata() or (), context.peer() or "", None)


def _identity(caller: tuple[str, str] | str) -> str:
    return caller if isinstance(caller, str) else caller[0]


class Admission:
    def __init__(
        self,
        *,
        slow_slots: int,
        uploads_total: int,
        uploads_per_client: int,
        upload_idle_s: float,
        client_share: float = 0.25,
    ) -> None:
        self.ready = threading.Event()
        self.slow_slots = slow_slots
        # Slots one caller may hold at once (at least 4, so a client's ordinary concurrency always fits).
        self.per_client = max(4, int(slow_slots * client_share))
        self._callers: dict[str, int] = {}
        self.uploads_total = uploads_total
        self.uploads_per_client = uploads_per_client
        self.upload_idle_s = upload_idle_s
        self._lock = threading.Lock()
        self._slow = 0
        self._uploads: dict[str, int] = {}

    # -- slots ----------------------------------------------------------------
    def _enter(self, method: str, peer: str, caller: tuple[str, str] | str = "") -> None:
        """Take a slot for `caller`; its share goes by its identity alone, whatever client names it sends."""
        who = _identity(caller)
        with self._lock:
            held = self._callers.get(who, 0)
            if held >= self.per_client:
                raise errors.ResourceExhausted(
                    f"this client ({who}) has {held} calls running or waiting, its share of the daemon's "
                    f"{self.slow_slots} slots; wait for some to finish"
                )
            if self._slow >= self.slow_slots:
                raise errors.ResourceExhausted(
                    f"the daemon is busy: {self._slow} calls are running or waiting (its limit); try again shortly"
                )
            if method == UPLOAD:
                client = client_of(peer)
                mine = self._uploads.get(client, 0)
                if sum(self._uploads.values()) >= self.uploads_total:
                    raise errors.ResourceExhausted(
                        f"{self.uploads_total} uploads are in progress (the daemon's limit); try again when one ends"
                    )
                if mine >= self.uploads_per_client:
                    raise errors.ResourceExhausted(
                        f"this client has {mine} uploads in progress (the limit per client); finish one first"
                    )
                self._uploads[client] = mine + 1
            self._slow += 1
            self._callers[who] = held + 1

    def _leave(self, method: str, peer: str, caller: tuple[str, str] | str = "") -> None:
        who = _identity(caller)
        with self._lock:
            self._slow -= 1
            self._callers[who] -= 1
            if not self._callers[who]:
                del self._callers[who]
            if method == UPLOAD:
                client = client_of(peer)
                self._uploads[client] -= 1
                if not self._uploads[client]:
                    del self._uploads[client]

    # -- handler wrappers -------------------------------------------------------
    def wrap(self, method: str, fn: Callable[..., Any], *, streaming: bool) -> Callable[..., Any]:
        """`fn`, waiting for the imports and (unless in ALWAYS) holding a slot while it runs."""
        gated = method not in ALWAYS
        wait = method not in NO_IMPORTS

        def unary(request: Any, context: grpc.ServicerContext) -> Any:
            if wait:
                self._await_ready(context)
            if not gated:
                return fn(request, context)
            peer, caller = context.peer(), caller_of(context)
            self._enter(method, peer, caller)
            guarded = self._idle_guarded(request, context) if method == UPLOAD else None
            try:
                return fn(guarded if guarded is not None else request, context)
            finally:
                if guarded is not None:
                    guarded.close()  # stops its idle watch now, not at garbage collection
                self._leave(method, peer, caller)

        def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            if wait:
                self._await_ready(context)
            if not gated:
                yield from fn(request, context)
                return
            peer, caller = context.peer(), caller_of(context)
            self._enter(method, peer, caller)
            try:
                yield from fn(request, context)
            finally:
                self._leave(method, peer, caller)

        return stream if streaming else unary

    def _await_ready(self, context: grpc.ServicerContext) -> None:
        """Wait for the start-up imports, but not for a caller that has gone (its deadline passed):
        clients polling a starting daemon must not pile up waiting threads."""
        deadline = time.monotonic() + READY_WAIT_S
        while not self.ready.wait(0.1):
            if not context.is_active():
                raise errors.Cancelled("the call ended while the daemon was starting")
            if time.monotonic() > deadline:
                return  # run anyway: a failed warm-up costs speed, not service

    def _idle_guarded(self, messages: Iterator[Any], context: grpc.ServicerContext) -> Generator[Any, None, None]:
        """The Upload's messages; the call is cancelled once none came for `upload_idle_s`."""
        idle = self.upload_idle_s
        last = [time.monotonic()]
        done = threading.Event()
        expired = threading.Event()

        def watch() -> None:
            while not done.wait(min(1.0, idle / 4)):
                if time.monotonic() - last[0] > idle:
                    expired.set()
                    log.info("cancelling an upload from %s: nothing sent for %.0f s", context.peer(), idle)
                    context.cancel()  # wakes the handler's blocked read
                    return

        def read() -> Iterator[Any]:
            threading.Thread(target=watch, name="upload-idle", daemon=True).start()
            try:
                while True:
                    try:
                        message = next(messages)
                    except StopIteration:
                        return
                    except grpc.RpcError:
                        if expired.is_set():
                            raise errors.DeadlineExceeded(
                                f"the upload sent nothing for {idle:.0f} s and was cancelled"
                            ) from None
                        raise errors.Cancelled("the upload was cancelled") from None
                    last[0] = time.monotonic()
                    yield message
            finally:
                done.set()

        if idle <= 0:
            yield from messages
            return
        yield from read()
