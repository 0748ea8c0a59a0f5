"""A worker's sockets: the private one only the daemon can reach (the Worker
service, and the data methods for bytes the daemon forwards), the public one
clients reach by the model's route (the data methods only, behind the daemon's
token when one is configured, in a directory of the daemon's group), and beside
it the route's fast socket (fastroute.py: the same handlers and checks, framed
messages instead of gRPC calls)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc

from nnd.v1 import contract
from nnd_daemon import asyncserve, errors, identity, intake
from nnd_daemon.bearer_tokens import TokenInterceptor
from nnd_daemon.worker.fastroute import FastRoute
from nnd_daemon.worker.gateway import Gateway

# The daemon hands a worker its token here, not on the command line (which `ps` shows).
TOKEN_ENV = "NND_WORKER_TOKEN"
# gRPC threads per server. Every request waiting for the model holds one, and
# the daemon sends at most one per handler thread of its own (control/server.py,
# 256); Status pings must always find one more: a watchdog ping stuck behind
# queued requests would make a busy worker look hung. Threads start on demand.
RPC_THREADS = 320
# Calls the public socket (clients following the route) takes at once, beyond which gRPC refuses new
# ones itself with RESOURCE_EXHAUSTED (the Python client then goes through the daemon, whose calls use
# the private socket's own pool). A call whose client has not sent its request costs no thread
# (daemon/asyncserve.py): it waits on the server's loop, at most WAITING_PER_CLIENT of one caller's
# (its verified identity; --max-waiting-calls) and at most the request idle timeout
# (--request-idle-timeout), so one client cannot take the socket's calls or threads.
PUBLIC_CALLS = 256
WAITING_PER_CLIENT = 32
REQUEST_IDLE_S = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--public", default="", help="unix socket clients reach by the model's route")
    parser.add_argument("--fast", default="", help="unix socket of the route's fast path (framed calls)")
    parser.add_argument("--epoch", type=int, default=0, help="the route's epoch (the daemon's count of workers)")
    parser.add_argument("--queue-share", type=float, default=0.0, help="one user's share of the queue (0: none)")
    parser.add_argument("--request-idle-timeout", type=float, default=REQUEST_IDLE_S, help="cut off a call whose request has not arrived")
    parser.add_argument("--max-waiting-calls", type=int, default=WAITING_PER_CLIENT, help="per caller, calls not yet sent")
    parser.add_argument("--log-requests", action="store_true", help="log one line per finished request")
    parser.add_argument("--log-format", default="text", choices=("text", "json"))


def start(
    service: Any,
    ns: argparse.Namespace,
    add_worker: Callable[[Any, grpc.Server], None],
    *,
    token: str | None = None,
    identity_key: str | None = None,
) -> list[Any]:
    """Serve `service` (add_worker adds its Worker servicer) and its data path; returns the servers.
    `token`: the one clients must present; None: the daemon's, from TOKEN_ENV (taken out of the
    environment, so nothing this process starts inherits it). `identity_key`: the users' ticket key
    (hex); None: from identity.KEY_ENV, likewise."""
    tickets = identity.Tickets.from_env() if identity_key is None else identity.Tickets.of_hex(identity_key)
    limits = intake.limits_of_arg(ns.limits)
    gateway = Gateway(service, ns.name, ns.epoch, limits, tickets, queue_share=ns.queue_share)
    service.gateway = gateway
    service.activity.model = ns.name
    service.activity.log_requests = ns.log_requests
    servers = []
    if token is None:
        token = os.environ.pop(TOKEN_ENV, "")
    # Errors become statuses in one place (behind the token check, on the public socket).
    mapped = errors.ErrorInterceptor(logging.getLogger("nnd.worker"), internal="internal error in worker")
    if ns.public:
        interceptors = [TokenInterceptor(token), mapped] if token else [mapped]
        public = asyncserve.Server(
            threads=RPC_THREADS,
            options=contract.GRPC_OPTIONS,
            max_calls=PUBLIC_CALLS,
            interceptors=interceptors,
            caller_of=lambda metadata, peer: identity.caller_of(metadata, peer, tickets),
            idle_s=ns.request_idle_timeout,
            per_client=ns.max_waiting_calls,
            total=PUBLIC_CALLS,
            name="route",
        )
        public.add_generic_rpc_handlers((gateway.handler(route=True),))
        old = os.umask(0o117)  # 0660: the daemon's group may connect, as to the daemon's own socket
        try:
            public.add_insecure_port("unix://" + ns.public)
        finally:
            os.umask(old)
        public.start()
        servers.append(public)
    if ns.public and ns.fast:
        fast = FastRoute(
            ns.fast,
            threads=RPC_THREADS,
            interceptors=interceptors,
            idle_s=ns.request_idle_timeout,
            per_uid=ns.max_waiting_calls,
            total=PUBLIC_CALLS,
            max_reading=int(limits.max_inflight_bytes),
        )
        fast.add_generic_rpc_handlers((gateway.handler(route=True),))
        try:
            fast.start(mode=0o660)
        except OSError as exc:  # clients then take the gRPC route, as they do when they cannot connect
            logging.getLogger("nnd.worker").warning("no fast route at %s: %s", ns.fast, exc)
        else:
            servers.append(fast)
    private = grpc.server(
        futures.ThreadPoolExecutor(max_workers=RPC_THREADS), options=contract.GRPC_OPTIONS, interceptors=[mapped]
    )
    add_worker(service, private)
    private.add_generic_rpc_handlers((gateway.handler(),))
    private.add_insecure_port("unix://" + ns.socket)
    private.start()  # last: the daemon waits for this socket, so the public one is ready by then
    servers.append(private)
    return servers


def stop(servers: list[Any], grace: float) -> list[threading.Event]:
    """Stop every server at once (each drains its calls for up to `grace` s); the events say when."""
    return [server.stop(grace=grace) for server in servers]


def serve_until_terminated(servers: list[Any], grace: float) -> None:
    """Serve until SIGTERM, then stop the servers and wait until all have ended. Blocking waits (a
    signal interrupts them): gRPC's `wait_for_termination` wakes the process ten times a second to
    look, ~1.5 ms of CPU a second for each idle worker on a 2-core VM."""
    terminated = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: terminated.set())
    terminated.wait()
    for stopped in stop(servers, grace):
        stopped.wait()
