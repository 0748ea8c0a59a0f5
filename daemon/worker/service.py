"""The worker's private gRPC service: load once, then run requests one at a
time through the engine."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import psutil

from nnd.v1 import nnd_pb2, worker_pb2, worker_pb2_grpc
from nnd_daemon import errors
from nnd_daemon.worker import loader

log = logging.getLogger("nnd.worker")
_END = object()
_STARTED = object()  # the request has the model: tell the daemon it is no longer queued


class WorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(self) -> None:
        self.model: Any = None
        self.tokenizer: Any = None
        self.dtype = ""
        # One forward at a time: the daemon queues, the worker runs.
        self._run_lock = threading.Lock()
        self.limits: Any = None
        # Cross-client batching of compatible Traces (batching.py); None: every request runs alone.
        self.batcher: Any = None
        # Requests clients sent (directly or through the daemon): keep-alive, LRU and `nnd ps` read it.
        self.activity = Activity()
        # The data path (gateway.py), set when the sockets open (listen.py).
        self.gateway: Any = None

    # -- Load ---------------------------------------------------------------
    def Load(self, request: worker_pb2.WorkerLoadRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        events: queue.Queue[Any] = queue.Queue()

        def report(done: int, total: int, unit: str) -> None:
            events.put(nnd_pb2.DispatchProgress(stage="loading", done=done, total=total, unit=unit))

        def work() -> None:
            try:
                self._load(request, report)
                events.put(_END)
            except BaseException as exc:  # noqa: BLE001 - reported to the daemon
                events.put(exc)

        threading.Thread(target=work, name="load", daemon=True).start()
        yield nnd_pb2.DispatchProgress(stage="loading", message=f"loading weights of {request.model}")
        while True:
            item = events.get()
            if item is _END:
                break
            if isinstance(item, BaseException):
                err = item if isinstance(item, errors.NndError) else _load_error(item)
                errors.abort(context, err)
            yield item
        yield nnd_pb2.DispatchProgress(stage="ready", message="weights loaded")

    def _load(self, request: worker_pb2.WorkerLoadRequest, report: loader.Report) -> None:
        self.model, self.tokenizer, self.dtype = loader.load(request, report)

    # -- Run ----------------------------------------------------------------
    def Run(self, request: worker_pb2.WorkerRunRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        yield from self.run(request, context)

    def run(
        self,
        request: worker_pb2.WorkerRunRequest,
        context: grpc.ServicerContext,
        stop: threading.Event | None = None,
        on_error: Callable[[BaseException], BaseException] = lambda exc: exc,
    ) -> Iterator[Any]:
        """Run `request` for `context`; `stop` ends it early (the call's end always does);
        `on_error` may turn a failure into another one before it becomes the status."""
        if self.model is None:
            errors.abort(context, errors.FailedPrecondition("worker has no model loaded"))
        stop = stop or threading.Event()
        context.add_callback(stop.set)

        def started() -> None:
            # If the worker dies from here on, the daemon tells the client its request was running.
            context.send_initial_metadata(((errors.STARTED_KEY, "1"),))

        if request.generate or request.HasField("session"):
            yield from self._run_streaming(request, context, stop, started, on_error)
            return
        # A Trace answers only when it is done, so it runs on this gRPC thread: no thread or
        # queue of its own (a per-request cost that bounds how many small traces a second fit).
        out: list[Any] = []
        try:
            self._work(request, out.append, stop, started)
        except BaseException as exc:  # noqa: BLE001 - every failure becomes a status
            _abort(context, on_error(exc))
        yield from out

    def _run_streaming(
        self,
        request: worker_pb2.WorkerRunRequest,
        context: grpc.ServicerContext,
        stop: threading.Event,
        started: Callable[[], None],
        on_error: Callable[[BaseException], BaseException],
    ) -> Iterator[Any]:
        """A Generate or a Session: responses (e.g. each step's tokens) go out while the run goes on."""
        out: queue.Queue[Any] = queue.Queue()

        def work() -> None:
            try:
                self._work(request, out.put, stop, lambda: out.put(_STARTED))
                out.put(_END)
            except BaseException as exc:  # noqa: BLE001 - every failure becomes a status
                out.put(exc)

        threading.Thread(target=work, name="run", daemon=True).start()
        while True:
            item = out.get()
            if item is _END:
                return
            if item is _STARTED:
                started()
                continue
            if isinstance(item, BaseException):
                _abort(context, on_error(item))
            yield item

    def _work(
        self,
        request: worker_pb2.WorkerRunRequest,
        emit: Callable[[Any], None],
        stop: threading.Event,
        started: Callable[[], None],
    ) -> None:
        """Run `request` merged with concurrent ones (batching.py) or alone, one forward at a time."""
        if self.batcher is not None and self.batcher.offer(request, self.tokenizer, emit, stop.is_set, started):
            return
        with self._run_lock:
            if stop.is_set():
                raise errors.Cancelled("request cancelled before it ran")
            started()
            self._execute(request, emit, stop.is_set)

    def _execute(
        self, request: worker_pb2.WorkerRunRequest, emit: Callable[[Any], None], cancelled: Callable[[], bool]
    ) -> None:
        from nnd_daemon import engine
        from nnd_daemon.worker import shm

        # A Trace, a Generate or a Session, with the graphs of the edits it names; with
        # `request.shm`, big saved tensors go to shared-memory segments (shm.py).
        with shm.results(request):
            engine.run_worker(self.model, self.tokenizer, request, emit=emit, cancelled=cancelled, limits=self.limits)

    # -- Configure ----------------------------------------------------------
    def Configure(self, request: worker_pb2.WorkerConfig, context: grpc.ServicerContext) -> Any:
        self.gateway.configure(request)
        return worker_pb2.WorkerConfigured()

    # -- Status -------------------------------------------------------------
    def Status(self, request: worker_pb2.WorkerStatusRequest, context: grpc.ServicerContext) -> Any:
        status = worker_pb2.WorkerStatus(rss_bytes=psutil.Process().memory_info().rss, dtype=self.dtype)
        self.activity.fill(status)
        if self.model is not None:
            for device, nbytes in sorted(loader.weight_bytes(self.model).items()):
                status.weights.add(device=device, bytes=nbytes)
            status.devices.update(loader.devices(self.model))
        return status


class Activity:
    """How busy the worker is, for the daemon's keep-alive, LRU and `nnd ps` (Status)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.active = 0
        self.requests = 0
        self._last_end = 0.0
        self.keep_alive = ""

    def begin(self, keep_alive: str, depth: int, model: str) -> None:
        """Count a request in; RESOURCE_EXHAUSTED if `depth` (0: no limit) are already in."""
        with self._lock:
            if depth and self.active >= depth:
                raise errors.ResourceExhausted(f"the queue of {model} is full (max_queue_depth={depth})")
            self.active += 1
            self.requests += 1
            if keep_alive:
                self.keep_alive = keep_alive

    def end(self) -> None:
        with self._lock:
            self.active -= 1
            self._last_end = time.monotonic()

    def fill(self, status: worker_pb2.WorkerStatus) -> None:
        with self._lock:
            status.active = self.active
            status.requests = self.requests
            status.keep_alive = self.keep_alive
            if not self.active and self._last_end:
                status.idle_s = time.monotonic() - self._last_end


def _abort(context: grpc.ServicerContext, exc: BaseException) -> None:
    if not isinstance(exc, errors.NndError):
        log.exception("engine failure", exc_info=exc)
        exc = errors.NndError(f"internal error in worker: {type(exc).__name__}: {exc}")
    errors.abort(context, exc)


def _load_error(exc: BaseException) -> errors.NndError:
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, MemoryError) or "out of memory" in str(exc).lower():
        return errors.ResourceExhausted(f"out of memory while loading: {text}")
    if isinstance(exc, (OSError, FileNotFoundError)):
        return errors.NotFound(f"cannot load weights: {text}")
    if isinstance(exc, (ValueError, TypeError, ImportError)):
        return errors.InvalidArgument(f"cannot load weights: {text}")
    return errors.NndError(f"loading failed: {text}")
