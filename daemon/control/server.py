"""`nnd serve`: build the gRPC server, bind the socket, restore the registry,
and drain on SIGTERM."""

from __future__ import annotations

import grp
import logging
import os
import signal
import socket
import stat
import threading
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from nnd.v1 import address as _address
from nnd.v1 import contract, nnd_pb2
from nnd_daemon import asyncserve, errors, identity, modelfiles
from nnd_daemon.bearer_tokens import RefusalLog
from nnd_daemon.control import health, modelroots, statedir
from nnd_daemon.control.admission import Admission
from nnd_daemon.control.auth import Access
from nnd_daemon.control.registry import Processes, Registry
from nnd_daemon.control.servicer import NndServicer
from nnd_daemon.control.settings import Settings

log = logging.getLogger("nnd.server")
_REFUSALS = RefusalLog()

SERVICE = "nnd.v1.Nnd"
OPTIONS = [*contract.GRPC_OPTIONS, ("grpc.so_reuseport", 0)]
# gRPC handler threads. A call takes one only once its request has arrived (daemon/asyncserve.py:
# until then it waits on the server's loop, bounded per caller and cut off when idle). Every request
# waiting for a model holds one, so with too few, requests queued behind a long one leave none for
# a Release. More than a model's default queue (64) several times over; threads start on demand.
HANDLER_THREADS = 256
# Health and the listings `nnd ps` reads run on a small pool of their own: whatever holds the
# handler threads, they answer.
QUICK_METHODS = frozenset(
    {
        "/grpc.health.v1.Health/Check",
        "/grpc.health.v1.Health/List",
        f"/{SERVICE}/ListModels",
        f"/{SERVICE}/GetModel",
    }
)
QUICK_THREADS = 8
# Threads no gated call may take: they keep `nnd ps`, ListModels, GetModel,
# GetServerInfo and health answering whatever else runs (control/admission.py).
RESERVED_THREADS = 32
# These stream serialized responses through unchanged (a worker's, forwarded).
_RAW_RESPONSES = {"Scan", "Interact", *contract.DATA_METHODS}
# These take the request's bytes: the daemon forwards them unparsed (to the model's
# worker; a Scan to the helper), reading only the fields it steers by (forward.py).
_RAW_REQUESTS = {"Scan", *contract.DATA_METHODS}


def _handlers(servicer: NndServicer, admission: Admission) -> grpc.GenericRpcHandler:
    service = nnd_pb2.DESCRIPTOR.services_by_name["Nnd"]
    handlers = {}
    for method in service.methods:
        req = getattr(nnd_pb2, method.input_type.name)
        resp = getattr(nnd_pb2, method.output_type.name)
        serialize = _pass_bytes if method.name in _RAW_RESPONSES else resp.SerializeToString
        fn = getattr(servicer, method.name, None)
        if fn is None:  # not implemented yet: gRPC answers UNIMPLEMENTED
            continue
        if method.client_streaming and method.server_streaming:  # Interact: bytes both ways (the worker parses)
            # Admitted like a forwarded Trace once its first message came (asyncserve reads that on its loop).
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                admission.wrap(method.name, fn, streaming=True),
                request_deserializer=None,
                response_serializer=serialize,
            )
            continue
        if method.client_streaming:  # Upload: messages in, one answer out (control/uploads.py refuses malformed ones)
            handlers[method.name] = grpc.stream_unary_rpc_method_handler(
                admission.wrap(method.name, fn, streaming=False),
                request_deserializer=_parser(req),
                response_serializer=serialize,
            )
            continue
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        if method.name in _RAW_REQUESTS:  # forwarded unparsed, but still admitted (slots, warm-up)
            handlers[method.name] = make(
                admission.wrap(method.name, fn, streaming=method.server_streaming),
                request_deserializer=None,
                response_serializer=serialize,
            )
            continue
        handlers[method.name] = make(
            admission.wrap(method.name, fn, streaming=method.server_streaming),
            request_deserializer=_parser(req),
            response_serializer=serialize,
        )
    return grpc.method_handlers_generic_handler(SERVICE, handlers)


def _pass_bytes(message: Any) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def _parser(message: Any) -> Callable[[bytes], Any]:
    # gRPC answers INTERNAL when a deserializer raises; the error interceptor refuses a Malformed.
    def parse(data: bytes) -> Any:
        try:
            return message.FromString(data)
        except (DecodeError, RecursionError, ValueError) as exc:
            return errors.Malformed(message.__name__, exc)

    return parse


def _prepare_socket(path: str, group: str | None) -> None:
    directory = os.path.dirname(path)
    created = not os.path.isdir(directory)
    os.makedirs(directory, mode=0o750, exist_ok=True)
    # Tighten only a directory that is ours: one just made, or a dedicated
    # `nnd` one (systemd's RuntimeDirectory, $XDG_RUNTIME_DIR/nnd), never a
    # shared parent such as /tmp or /run that a socket path happens to name.
    if created or (os.path.basename(directory) == "nnd" and os.stat(directory).st_uid == os.getuid()):
        os.chmod(directory, 0o750)
        if group:
            os.chown(directory, -1, grp.getgrnam(group).gr_gid)
    elif os.stat(directory).st_mode & stat.S_IWOTH:
        log.warning("the socket's directory %s is writable by everyone; prefer a private one", directory)
    if os.path.lexists(path):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise SystemExit(f"nnd: {path} exists and is not a socket; refusing to replace it")
        if _answers(path):
            raise SystemExit(f"nnd: another daemon is already listening on {path}")
        os.unlink(path)  # a stale socket from a previous run


def _answers(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


class Daemon:
    def __init__(
        self,
        settings: Settings,
        access: Access | None = None,
        *,
        workers: int = HANDLER_THREADS,
        processes: Processes | None = None,
    ) -> None:
        self.settings = settings
        self.access = access or Access()
        try:
            statedir.prepare(settings.state_dir)
            # One daemon per state directory: a second one would re-dispatch the first's models and,
            # on exit, overwrite its registry. Held until this process ends.
            self._state_lock = statedir.lock(settings.state_dir, settings.address)
        except (statedir.StateDirError, OSError) as exc:
            raise SystemExit(f"nnd: {exc}") from None
        os.environ[modelfiles.ENV] = modelroots.policy(settings, self.access).to_json()
        self.registry = Registry(settings, token=self.access.token, processes=processes)
        self.servicer = NndServicer(settings, self.registry)
        self.admission = Admission(
            slow_slots=max(1, workers - RESERVED_THREADS),
            uploads_total=settings.max_concurrent_uploads,
            uploads_per_client=settings.max_uploads_per_client,
            upload_idle_s=settings.upload_idle_timeout_s,
        )
        tickets, token = self.registry.tickets, self.registry.token_required
        self.server = asyncserve.Server(
            threads=workers,
            options=OPTIONS,
            # The token check first: a refused call never reaches a method (errors.ErrorInterceptor).
            interceptors=[
                *self.access.interceptors(),
                errors.ErrorInterceptor(logging.getLogger("nnd.servicer"), on_error=self.registry.events.on_error),
            ],
            caller_of=lambda metadata, peer: identity.caller_of(metadata, peer, tickets, token=token),
            idle_s=settings.request_idle_timeout_s,
            per_client=settings.max_waiting_calls,
            quick=QUICK_METHODS,
            quick_threads=QUICK_THREADS,
            on_refusal=self._refused,
            name="nnd",
        )
        self.tcp_port = 0
        self.server.add_generic_rpc_handlers((_handlers(self.servicer, self.admission),))
        self._add_health_and_reflection()
        self._stopped = threading.Event()
        self.who: identity.WhoServer | None = None
        self.metrics: Any = None

    def _refused(self, method: str, code: grpc.StatusCode, message: str) -> None:
        """A call asyncserve refused before it ran (waiting-call bounds, the idle cut-off): counted
        in the refusals metric, and logged at most once a minute (tokens.RefusalLog)."""
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            self.registry.events.on_error(method, errors.ResourceExhausted(message))
        _REFUSALS.note(method, "a caller", message.split(";")[0])

    def _start_metrics(self) -> None:
        """--metrics HOST:PORT: Prometheus text and /healthz, on a thread of their own (control/metrics.py)."""
        if not self.settings.metrics:
            return
        from nnd_daemon.control import metrics

        collector = metrics.Collector(self.registry, self.registry.events)
        self.metrics = metrics.MetricsServer(self.settings.metrics, collector, lambda: not self._stopped.is_set())
        self.metrics.start()
        host = self.settings.metrics.rpartition(":")[0]
        log.info("metrics on http://%s:%d/metrics (and /healthz)", host, self.metrics.port)

    def _start_who(self, path: str) -> None:
        """The `.who` socket beside the daemon's (identity.py): how a local client learns its ticket."""
        gid = grp.getgrnam(self.settings.socket_group).gr_gid if self.settings.socket_group else -1
        self.who = identity.WhoServer(path + identity.SUFFIX, self.registry.tickets)
        try:
            self.who.start(0o660, gid)
        except OSError as exc:  # requests still work; they are then logged without their user
            log.warning("cannot serve %s%s (requests will not name their user): %s", path, identity.SUFFIX, exc)
            self.who = None

    def _add_health_and_reflection(self) -> None:
        self.health = health.add(self.server, (SERVICE,))  # None without the optional extras
        if self.health is not None:
            from grpc_health.v1 import health_pb2

            self._health_pb2 = health_pb2

    def _health_loop(self) -> None:
        if self.health is None:
            return
        pb = self._health_pb2
        self.health.set("", pb.HealthCheckResponse.SERVING)
        self.health.set(SERVICE, pb.HealthCheckResponse.SERVING)
        known: dict[str, int] = {}
        while not self._stopped.wait(0.2):
            current = {e.name: e.state for e in self.registry.entries()}
            for name, state in current.items():
                serving = (
                    pb.HealthCheckResponse.SERVING
                    if state == nnd_pb2.DISPATCHED
                    else pb.HealthCheckResponse.NOT_SERVING
                )
                if known.get(name) != serving:
                    self.health.set(name, serving)
                    known[name] = serving
            for name in set(known) - set(current):
                self.health.set(name, pb.HealthCheckResponse.SERVICE_UNKNOWN)
                del known[name]

    def bind(self) -> str:
        """Bind the unix socket (mode 0660 in a 0750 directory) and, with
        --listen, the TCP port; exits with a one-line reason on failure."""
        address = self.settings.address
        path = _address.unix_path(address)
        if not path:
            raise SystemExit(f"nnd: {address} is not a unix socket; listen on TCP with --listen HOST:PORT")
        try:
            _prepare_socket(path, self.settings.socket_group)
        except OSError as exc:  # e.g. /run/nnd for a user without $XDG_RUNTIME_DIR
            raise SystemExit(f"nnd: cannot make the socket {path}: {exc.strerror}; choose one with --address") from None
        old = os.umask(0o117)  # the socket is created 0660
        try:
            self.server.add_insecure_port(address)
        finally:
            os.umask(old)
        listen = self.access.listen
        if listen:
            creds = self.access.credentials()
            try:
                port = self.server.add_secure_port(listen, creds) if creds else self.server.add_insecure_port(listen)
            except RuntimeError:  # grpc raises, or returns 0, when it cannot bind
                port = 0
            if port == 0:
                raise SystemExit(f"nnd: cannot listen on {listen} (in use, or not an address of this host)")
            self.tcp_port = port
        return address

    def start(self) -> None:
        # Bind first, so a daemon that cannot (another one listens there) exits
        # before starting a helper. Restored models are known (META) before the
        # first call is answered; their re-dispatch runs in the background.
        try:
            address = self.bind()
            self._start_metrics()  # a metrics port that cannot be bound stops the start here too
        except BaseException:
            self.registry.shutdown()
            raise
        self.registry.restore(lambda name, exc: log.error("could not restore %s: %s", name, exc))
        path = _address.unix_path(address)
        if path:
            self._start_who(path)  # before the first call is answered: a client's first call has its ticket
        self.server.start()
        if path:
            os.chmod(path, 0o660)  # whatever umask other threads saw meanwhile
            if self.settings.socket_group:
                os.chown(path, -1, grp.getgrnam(self.settings.socket_group).gr_gid)
        threading.Thread(target=self._health_loop, name="health", daemon=True).start()
        threading.Thread(target=_warm_up, args=(self.admission.ready,), name="warm-up", daemon=True).start()
        log.info("nnd %s listening on %s (state in %s)", nnd_version(), address, self.settings.state_dir)
        if self.access.listen:
            host = self.access.listen.rsplit(":", 1)[0]
            log.info("also listening on %s:%d (%s)", host, self.tcp_port, self._describe_tcp())

    def _describe_tcp(self) -> str:
        tls = self.access.tls
        kind = "mTLS" if tls and tls.client_ca else "TLS" if tls else "plaintext"
        return f"{kind}, token required" if self.access.token else kind

    def stop(self, grace: float) -> None:
        """Refuse new calls, let in-flight ones finish for `grace` seconds, then
        end every worker."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        log.info("stopping: draining in-flight requests for up to %.0f s", grace)
        if self.health is not None:
            self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()
        if self.metrics is not None:
            self.metrics.stop()
        if self.who is not None:
            self.who.close()
        workers = sum(1 for e in self.registry.entries() if e.worker is not None)
        log.info("no calls left; stopping %d worker(s)", workers)
        self.registry.shutdown()
        path = _address.unix_path(self.settings.address)
        if path and os.path.exists(path):
            os.unlink(path)
        log.info("stopped")

    @property
    def stopping(self) -> bool:
        return self._stopped.is_set()

    def cut_short(self) -> None:
        """Cancel the calls still draining (a second SIGTERM / Ctrl-C)."""
        log.warning("cancelling in-flight requests now")
        self.server.stop(None)


def _warm_up(ready: threading.Event) -> None:
    """Import the daemon's own deferred modules while it is idle. Calls wait for
    `ready` (control/admission.py): two threads importing the same package at
    once can fail with `ImportError: cannot import name ...`. The daemon never
    imports torch or transformers: models are built in the helper and workers."""
    try:
        _import_everything()
    except Exception:  # a failed warm-up costs speed, not service: requests import what they need
        log.exception("warm-up imports failed")
    finally:
        ready.set()


def _import_everything() -> None:
    from nnd_daemon.control import tplaunch  # noqa: F401 - the first dispatch's


def nnd_version() -> str:
    from nnd import __version__

    return __version__


def serve(
    settings: Settings, access: Access | None = None, *, grace: float = 30.0, processes: Processes | None = None
) -> None:
    """Run until SIGTERM/SIGINT, then drain for `grace` seconds and return
    (exit status 0); a second signal cancels what is still draining. `processes`: see registry.Processes."""
    daemon = Daemon(settings, access, processes=processes)
    daemon.start()
    done = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        # Stopping blocks for up to `grace`; the handler itself must not.
        if daemon.stopping:
            threading.Thread(target=daemon.cut_short, daemon=True).start()
            return
        log.info("received %s", signal.Signals(signum).name)
        threading.Thread(target=lambda: (daemon.stop(grace), done.set()), name="drain", daemon=True).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while not done.wait(1.0):
        pass
