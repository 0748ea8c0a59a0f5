"""The worker's private gRPC service: load once, then run requests one at a
time through the engine."""

from __future__ import annotations

import contextlib
import gc
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import psutil

from nnd.v1 import contract, nnd_pb2, worker_pb2, worker_pb2_grpc
from nnd_daemon import errors, intake
from nnd_daemon.worker import activity, loader, onemessage, spares, turns
from nnd_daemon.worker.stop import Stop

log = logging.getLogger("nnd.worker")
_END = object()
# A queued request's turn has come (the daemon reads it as STARTED_KEY: from here on it may have run).
RUNNING = nnd_pb2.TraceResponse(queued=nnd_pb2.Queued(running=True))
_STARTED = object()  # the request has the model: tell the daemon it is no longer queued
# Continuations of one Interact stream read ahead of its run (each at most max_request_bytes).
INBOX_SIZE = 4
# A trace with at most this many requests ahead of it, all while a trace holds the model, is not told it
# waits (a Queued message): it waits a few forwards. Behind a generation, a session or a paused run it is.
QUIET_AHEAD = 8


class WorkerService(worker_pb2_grpc.WorkerServicer):
    def __init__(self) -> None:
        self.model: Any = None
        self.tokenizer: Any = None
        self.dtype = ""
        # One forward at a time: the daemon queues, the worker runs.
        self._run_lock = turns.Turns()  # fair, and lent between generation steps
        self.limits: Any = None
        # Requests clients sent (directly or through the daemon): `nnd ps`, keep-alive and LRU read it.
        self.activity = activity.Activity()
        # Cross-client batching of compatible Traces (batching.py); None: every request runs alone.
        self.batcher: Any = None
        # The data path (gateway.py), set when the sockets open (listen.py).
        self.gateway: Any = None
        # While a run is paused at a sync point holding the model: (its client, monotonic time the pause
        # must end by). A request that queues behind it is told so.
        self.paused: tuple[str, float] | None = None
        # The kind of request that last got the model ("trace", "generate", "session", "interact"): a trace
        # queued behind a trace hears no Queued message (QUIET_AHEAD).
        self.holder = ""
        # The threads streams run on, kept between requests (spares.py): a start per request costs more.
        self._spares = spares.Spares()

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
                raise item if isinstance(item, errors.NndError) else _load_error(item)
            yield item
        yield nnd_pb2.DispatchProgress(stage="ready", message="weights loaded")

    def _load(self, request: worker_pb2.WorkerLoadRequest, report: loader.Report) -> None:
        self.model, self.tokenizer, self.dtype = loader.load(request, report)
        # The model lives as long as the worker: frozen with what was imported (the fork server froze
        # that already, forkserver/__main__.py), so that collections walk only what requests make. Unfrozen,
        # each full collection walked ~400,000 objects (100-250 ms), a few hundred µs a request on average.
        gc.collect()
        gc.freeze()

    # -- Run (Trace, Generate, Session: the gateway parses them, gateway.py) ---
    def run(
        self,
        request: worker_pb2.WorkerRunRequest,
        context: grpc.ServicerContext,
        stop: Stop | None = None,
        on_error: Callable[[BaseException], BaseException] = lambda exc: exc,
    ) -> Iterator[Any]:
        """Run `request` for `context`; `stop` ends it early (the call's end always does; so does its
        deadline, stop.py); `on_error` may turn a failure into another one before it becomes the status."""
        if self.model is None:
            raise errors.FailedPrecondition("worker has no model loaded")
        stop = stop or Stop()
        context.add_callback(stop.set)
        kind, steps = intake.kind_of(request), intake.steps_of(request)
        # Tell a client whose request must wait why nothing happens yet (its place in line). Its turn is then
        # announced by a message too (initial metadata has gone out with the first one).
        ahead = self._ahead()
        # A quiet one (`_quiet`) says nnd-queued all the same (whether it ran, if the worker dies), but
        # sends no Queued message.
        quiet = self._quiet(kind, ahead)
        if ahead:
            # "It waits" goes out with the message; a request that did not wait sends no header at all
            # (contract.started_from: one write fewer per trace).
            context.send_initial_metadata(((contract.QUEUED_KEY, "1"),))
            if not quiet:
                yield self._queued(ahead)
        who = dict(user=self._user(context), rows=max(1, len(request.request.invokes)))
        with self.activity.track(kind, _client(context), steps, **who) as tracked, _log_if_cancelled(stop, tracked):

            def started() -> None:
                # If the worker dies from here on, the daemon tells the client its request was running
                # (a queued one hears RUNNING; one that never said nnd-queued is taken to have run).
                tracked.running = True
                self.holder = kind

            if kind != "trace" or ahead:  # a queued trace streams too: its turn is a message
                # A Generate whose client watches no step live reads one message too: its steps'
                # tokens and saves, otherwise two writes and two wake-ups a step on each end.
                join = kind in ("trace", "generate") and request.request.one_message

                def seen(item: Any) -> None:  # `nnd ps` shows a generation's step even while its steps wait
                    if isinstance(item, nnd_pb2.TraceResponse) and item.WhichOneof("kind") == "step":
                        tracked.step = item.step.step + 1

                yield from self._run_streaming(
                    request, context, stop, started, on_error, announce_turn=bool(ahead), join=join, seen=seen
                )
                return
            # A Trace answers only when it is done, so it runs on this gRPC thread: no thread or
            # queue of its own (a per-request cost that bounds how many small traces a second fit).
            out: list[Any] = []
            try:
                self._work(request, out.append, stop, started)
            except BaseException as exc:  # noqa: BLE001 - every failure becomes a status (errors.ErrorInterceptor)
                raise on_error(exc) from None
        whole = onemessage.join(out) if request.request.one_message else None
        if whole is not None:
            yield whole  # bytes: the gateway's serializer passes them as they are
            return
        yield from out

    def run_once(
        self,
        request: worker_pb2.WorkerRunRequest,
        context: grpc.ServicerContext,
        stop: Stop,
        on_error: Callable[[BaseException], BaseException] = lambda exc: exc,
    ) -> bytes:
        """A TraceOnce: `request` (a Trace) run on this gRPC thread, its whole answer returned as one
        serialized `TraceResponse{results}`. One that would first have to say it waits, or whose answer
        does not fit in one message, is refused with `nnd-route: stream` (nnd.proto): send it as Trace."""
        if self.model is None:
            raise errors.FailedPrecondition("worker has no model loaded")
        context.add_callback(stop.set)
        ahead = self._ahead()
        if ahead and not self._quiet("trace", ahead):
            raise errors.FailedPrecondition(
                f"this trace would wait behind {ahead} request(s) held by a {self.holder or 'run'}; "
                "send it as Trace, which says its place in line; nothing ran",
                trailers=((contract.ROUTE_KEY, contract.STREAM),),
            )
        # A trace queued behind a few traces says nothing (QUIET_AHEAD); with one header only, the client
        # cannot tell queued from running if the worker dies, and takes it to have run.
        who = dict(user=self._user(context), rows=max(1, len(request.request.invokes)))
        out: list[Any] = []
        answered: list[Any] = []  # the one message (bytes, or onemessage.Gathered), once it went out

        def answer() -> None:
            """Send the results as one message, if they fit. A merged run's leader calls this before it
            wakes this thread (the client then has its answer without waiting for this thread to get the
            GIL back); otherwise this thread does, once the request is counted and logged."""
            whole = onemessage.join(out, limit=onemessage.MAX_ONE, gather=True)
            if whole is not None:
                self._answer(context, whole)
                answered.append(whole)

        with self.activity.track("trace", _client(context), intake.steps_of(request), **who) as tracked, _log_if_cancelled(stop, tracked):

            def started() -> None:
                tracked.running = True
                self.holder = "trace"

            try:
                self._work(request, out.append, stop, started, answer)
            except BaseException as exc:  # noqa: BLE001 - every failure becomes a status (errors.ErrorInterceptor)
                raise on_error(exc) from None
        if not answered:
            answer()  # only the admission's end comes after
        if not answered:
            raise errors.FailedPrecondition(
                "the trace's results do not fit in one message; send it as Trace, which streams them "
                "(a trace changes nothing: it runs again)",
                trailers=((contract.ROUTE_KEY, contract.STREAM),),
            )
        return answered[0]

    def _answer(self, context: grpc.ServicerContext, whole: Any) -> None:
        """Where the call can answer before its handler returns (the fast route's `Context.answer`), the
        client has its results (`whole`, the call's last message) and the call's OK now, and what its
        call does after (its admission's end, the gateway's and the socket's unwinding) runs while it
        reads them. Status waits for that (Activity.hold_status)."""
        answer = getattr(context, "answer", None)
        if answer is None:
            return
        release = self.activity.hold_status()
        if not context.add_callback(release):  # the call ended (its client went away)
            release()
            return
        answer(whole)

    def _ahead(self) -> int:
        """Requests that run or wait before one arriving now."""
        return self._run_lock.waiting() + self._run_lock.locked()

    def _quiet(self, kind: str, ahead: int) -> bool:
        """A trace behind a few other traces waits a few forwards: nothing a person needs to be told (with
        many clients it is every trace, and batching merges it into the next forward anyway)."""
        return kind == "trace" and 0 < ahead <= QUIET_AHEAD and self.holder == "trace" and self.paused is None

    def _queued(self, ahead: int) -> nnd_pb2.TraceResponse:
        """The message a request that must wait gets first: its place in line, and whether the model is
        held by another client's run paused at a sync point (and for how long at most)."""
        queued = nnd_pb2.Queued(ahead=ahead)
        paused = self.paused
        if paused is not None:
            queued.paused_by = paused[0]
            queued.paused_for_at_most_s = max(0.0, paused[1] - time.monotonic())
        return nnd_pb2.TraceResponse(queued=queued)

    def _turn(self, stop: Stop) -> None:
        """Wait for the model; raises if the request is cancelled or reaches its deadline first (the wait
        ends then, so a queued request that has ended holds nothing)."""
        if not self._run_lock.acquire(stop=stop):
            raise errors.Cancelled("request cancelled before it ran")
        if stop.is_set():
            self._run_lock.release()
            raise errors.Cancelled("request cancelled before it ran")

    def _run_streaming(
        self,
        request: worker_pb2.WorkerRunRequest,
        context: grpc.ServicerContext,
        stop: Stop,
        started: Callable[[], None],
        on_error: Callable[[BaseException], BaseException],
        *,
        announce_turn: bool = False,
        join: bool = False,
        seen: Callable[[Any], None] = lambda item: None,
    ) -> Iterator[Any]:
        """A Generate or a Session: responses (e.g. each step's tokens) go out while the run goes on.
        `announce_turn`: say `Queued{running}` when the request gets the model. `join`: a client that
        reads one message (TraceRequest.one_message: a queued Trace, a Generate): its results go out
        joined, at its end, unless they outgrow one message (then what waited goes, and the rest streams).
        `seen`: told of each response as the run makes it, whether it goes out now or waits."""
        out: queue.Queue[Any] = queue.Queue()
        # While joining, the run's own thread keeps its responses (`held`, its alone until it puts _END):
        # this thread wakes for the start, the end, a failure, or the overflow, not once per step (a
        # wake-up and a GIL hand-off each, ~0.1 ms a step on 2 cores).
        held: list[Any] = []
        size = 0
        joining = join

        def emit(item: Any) -> None:
            nonlocal size, joining
            seen(item)
            if not joining:
                out.put(item)
                return
            held.append(item)
            size += item.ByteSize()
            if size > onemessage.MAX_BYTES:  # no longer one message: hold nothing more than a stream would
                joining = False
                for waited in held:
                    out.put(waited)
                held.clear()

        def work() -> None:
            try:
                self._work(request, emit, stop, lambda: out.put(_STARTED))
                out.put(_END)
            except BaseException as exc:  # noqa: BLE001 - every failure becomes a status
                out.put(exc)

        self._spares.run(work, "run")
        while True:
            item = out.get()
            if item is _END:
                whole = onemessage.join(held) if held else None
                if whole is not None:
                    yield whole
                else:
                    yield from held
                return
            if item is _STARTED:
                started()
                if announce_turn:
                    yield RUNNING
                continue
            if isinstance(item, BaseException):
                raise on_error(item)
            yield item

    def _work(
        self,
        request: worker_pb2.WorkerRunRequest,
        emit: Callable[[Any], None],
        stop: Stop,
        started: Callable[[], None],
        answer: Callable[[], None] | None = None,
    ) -> None:
        """Run `request` merged with concurrent ones (batching.py) or alone, one forward at a time.
        `answer`: sends the emitted results to the client, for a merged run's leader to call."""
        if self.batcher is not None and self.batcher.offer(
            request, self.tokenizer, emit, stop.is_set, started, stop, answer=answer
        ):
            return
        self._turn(stop)
        try:
            started()
            self._execute(request, emit, stop.is_set)
        finally:
            self._run_lock.release()

    def _execute(
        self, request: worker_pb2.WorkerRunRequest, emit: Callable[[Any], None], cancelled: Callable[[], bool]
    ) -> None:
        from nnd_daemon import engine
        from nnd_daemon.worker import shm

        # A Trace, a Generate or a Session, with the graphs of the edits it names; with
        # `request.shm`, big saved tensors go to shared-memory segments (shm.py).
        with shm.results(request):
            engine.run_worker(
                self.model, self.tokenizer, request, emit=emit, cancelled=cancelled, limits=self.limits,
                lend=self._run_lock.lend,
            )

    # -- Interact -------------------------------------------------------------
    def interact(
        self,
        run: worker_pb2.WorkerRunRequest,
        start: nnd_pb2.InteractStart,
        messages: Iterator[worker_pb2.WorkerInteractContinue | errors.NndError],
        context: grpc.ServicerContext,
        stop: Stop,
        on_error: Callable[[BaseException], BaseException] = lambda exc: exc,
        caps: dict[str, Any] | None = None,
        inflight: Any = None,
        parse: Callable[[bytes], Any] | None = None,
    ) -> Iterator[Any]:
        """A run the client steers at sync points (gateway.py parses the stream): it runs alone
        (never batched) and holds the model while paused. `messages` ends when the client does.
        `caps`: the server's bounds on its pauses (engine/interact.py's PauseCaps); `inflight`: the
        worker's byte budget (daemon/inflight.py) the continuations it has not read yet count in.
        `parse`: how gateway.py checks one raw later message; given it, on a stream its handler thread
        may write and read itself (asyncserve.Context: the route socket), the run happens right here
        (`_interact_here`) instead of on threads of its own."""
        from nnd_daemon.engine import interact

        if self.model is None:
            raise errors.FailedPrecondition("worker has no model loaded")
        client = _client(context)
        held: list[activity.Request] = []  # the tracked request, once it is

        def on_pause(since: float) -> None:
            # `nnd ps` shows the run as paused, and a request that queues meanwhile hears who holds the model.
            for tracked in held:
                tracked.paused_since = time.time() if since else 0.0
            if since:
                self.paused = (client, since + interaction.bound()[0])
            else:
                self.paused = None

        here = parse is not None and hasattr(context, "exchange")
        ending: list[Any] = []  # the pause's last message, held back to go out with the read (`_interact_here`)

        def receive_here(timeout: float) -> Any:
            # The pause's message goes out and the client's answer comes back in one trip to the
            # server's loop; nothing is read ahead, so gRPC's flow control bounds the client.
            try:
                raw = context.exchange(timeout, ending.pop() if ending else None)  # type: ignore[attr-defined]
            except grpc.RpcError:  # the call ended (cancelled, reset): `gone` has set `stop`
                return interact.GONE
            if raw is None:
                return None
            if raw is grpc.aio.EOF:
                return interact.GONE
            assert parse is not None
            return parse(raw)

        # A stream its handler cannot read where the run pauses (gRPC's, without `exchange`) is read ahead.
        ahead = None if here else _ReadAhead(messages, inflight)
        context.add_callback(stop.set if ahead is None else lambda: ahead.gone(stop))
        interaction = interact.Interaction(
            start, receive_here if ahead is None else ahead.receive, caps=interact.PauseCaps(**(caps or {})),
            on_pause=on_pause,
        )
        kind, steps = intake.kind_of(run), intake.steps_of(run)
        if ahead is None:
            who_here = dict(user=self._user(context), rows=max(1, len(run.request.invokes)))
            with self.activity.track(kind, client, steps, **who_here) as tracked, _log_if_cancelled(stop, tracked):
                held.append(tracked)
                self._interact_here(run, context, stop, interaction, tracked, on_error, ending)
            if ending:  # the run's last message, with the call's OK, now that the run is counted and logged
                self._answer(context, ending.pop())
            return
        out: queue.Queue[Any] = queue.Queue()

        def work() -> None:
            # A client that asked for one message gets a pause's values with its Paused, and the end's
            # with TraceDone, as one message each (onemessage.py): one write and wake-up fewer per sync.
            emit = onemessage.Joiner(out.put) if _one_message(run) else out.put
            try:
                self._interact_alone(run, emit, stop, interaction, lambda: out.put(_STARTED))
                out.put(_END)
            except BaseException as exc:  # noqa: BLE001 - every failure becomes a status
                out.put(exc)
            finally:
                ahead.close()

        who = dict(user=self._user(context), rows=max(1, len(run.request.invokes)))
        with self.activity.track(kind, client, steps, **who) as tracked, _log_if_cancelled(stop, tracked):
            held.append(tracked)
            self._spares.run(ahead.read, "interact-read")
            self._spares.run(work, "interact")
            while True:
                item = out.get()
                if item is _END:
                    return
                if item is _STARTED:
                    tracked.running = True  # no header: an Interact never says nnd-queued (_interact_alone)
                    continue
                if isinstance(item, BaseException):
                    raise on_error(item)
                if isinstance(item, nnd_pb2.TraceResponse) and item.WhichOneof("kind") == "step":
                    tracked.step = item.step.step + 1
                yield item

    def _interact_here(
        self,
        run: worker_pb2.WorkerRunRequest,
        context: Any,
        stop: Stop,
        interaction: Any,
        tracked: activity.Request,
        on_error: Callable[[BaseException], BaseException],
        ending: list[Any],
    ) -> None:
        """An Interact run on its stream's handler thread, writing its messages itself (`context.post`:
        the run goes on while the loop writes) and reading the client's next one where it pauses: no
        thread hand-off either way, one trip to the server's loop per sync point. A pause's (or the
        end's) last message waits in `ending` for the read that follows it (receive_here) or the end."""

        def post(item: Any) -> None:
            try:
                context.post(item)
            except grpc.RpcError:  # the call ended: the run stops at its next hook, not inside one
                stop.set()

        def put(item: Any) -> None:
            kind = item.WhichOneof("kind") if isinstance(item, nnd_pb2.TraceResponse) else "results"
            if kind == "step":
                tracked.step = item.step.step + 1
            if ending:
                post(ending.pop())
            if kind in ("results", "paused", "done"):  # joined (bytes: onemessage.py) or a stream's last
                ending.append(item)
            else:
                post(item)

        def send_ending() -> None:
            if ending:
                post(ending.pop())
            context.flush()

        emit = onemessage.Joiner(put) if _one_message(run) else put
        def started() -> None:
            tracked.running = True

        try:
            self._interact_alone(run, emit, stop, interaction, started)
        except BaseException as exc:  # noqa: BLE001 - every failure becomes a status
            with contextlib.suppress(grpc.RpcError):
                send_ending()  # what the run sent before it failed goes out before the status
            raise on_error(exc) from None
        if not hasattr(context, "answer"):
            send_ending()  # the status goes out after the last message
        # else the last message stays in `ending`: `interact` sends it with the call's OK (Context.answer)

    def _interact_alone(
        self, run: worker_pb2.WorkerRunRequest, emit: Callable[[Any], None], stop: Stop, interaction: Any,
        started: Callable[[], None],
    ) -> None:
        """An Interact run with the model held by it alone (a paused run must not hold other clients'
        rows); `started` says it has the model; a one-message client's last joined message goes out.
        No header says it started: an Interact never says nnd-queued, so a client or daemon that
        sees it fail takes it to have run either way (contract.started_from), and a header would be
        one more write and read before every sync block's first value."""
        self._turn(stop)
        self.holder = "interact"
        try:
            started()
            self._interact(run, emit, stop.is_set, interaction)
        finally:
            self.paused = None
            self._run_lock.release()
        if isinstance(emit, onemessage.Joiner):
            emit.flush()

    def _interact(
        self, run: worker_pb2.WorkerRunRequest, emit: Callable[[Any], None], cancelled: Callable[[], bool],
        interaction: Any,
    ) -> None:
        from nnd_daemon import engine
        from nnd_daemon.worker import shm

        with shm.results(run):
            engine.run_worker(
                self.model, self.tokenizer, run, emit=emit, cancelled=cancelled, limits=self.limits,
                interaction=interaction,
            )

    def _user(self, context: grpc.ServicerContext) -> str:
        return self.gateway.user_of(context) if self.gateway is not None else ""

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


class _ReadAhead:
    """An Interact stream's later messages read on a thread of their own, for a run that cannot read its
    stream where it pauses (a gRPC stream without `exchange`): (message, bytes counted in `inflight`).
    At most INBOX_SIZE continuations are read off the stream ahead of the run; beyond that the reader
    waits and gRPC's flow control holds the client back, so a queued stream cannot grow the worker."""

    def __init__(self, messages: Iterator[Any], inflight: Any) -> None:
        from nnd_daemon.engine import interact

        self._gone = interact.GONE
        self._messages = messages
        self._inflight = inflight
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._slots = threading.Semaphore(INBOX_SIZE)
        self._closed = threading.Event()

    def gone(self, stop: Stop) -> None:
        """The client went away: the run stops, and a paused one wakes at once."""
        stop.set()
        self._inbox.put((self._gone, 0))

    def read(self) -> None:
        pending = iter(self._messages)
        inflight = self._inflight
        try:
            while True:
                while not self._slots.acquire(timeout=0.5):  # no room: wait for the run to read one
                    if self._closed.is_set():
                        return
                msg = next(pending, None)
                if msg is None or self._closed.is_set():
                    break
                n = msg.ByteSize() if isinstance(msg, worker_pb2.WorkerInteractContinue) else 0
                if inflight is not None and n:
                    try:
                        inflight.acquire(n, "a continuation of this Interact stream")
                    except errors.NndError as err:  # the paused run fails with it
                        self._inbox.put((err, 0))
                        return
                self._inbox.put((msg, n))
                if self._closed.is_set():  # the run ended as this arrived: give its bytes back too
                    self.close()
                    return
        except Exception:  # noqa: BLE001 - the stream broke: same as the client going away
            pass
        self._inbox.put((self._gone, 0))

    def receive(self, timeout: float) -> Any:
        try:
            msg, n = self._inbox.get(timeout=timeout)
        except queue.Empty:
            return None
        if n and self._inflight is not None:
            self._inflight.release(n)
        if isinstance(msg, worker_pb2.WorkerInteractContinue):
            self._slots.release()
        return msg

    def close(self) -> None:
        """The run is over: stop reading, and give back what it never read."""
        self._closed.set()
        while True:
            try:
                msg, n = self._inbox.get_nowait()
            except queue.Empty:
                return
            if n and self._inflight is not None:
                self._inflight.release(n)


@contextlib.contextmanager
def _log_if_cancelled(stop: Stop, tracked: activity.Request) -> Iterator[None]:
    """One INFO line when a request ends because its client cancelled or went away (an interrupted cell,
    a restarted kernel): who, what, and how far it got."""
    try:
        yield
    finally:
        if stop.is_set() and not stop.expired:
            where = f" after {tracked.step} of {tracked.steps} steps" if tracked.steps else ""
            state = "while running" if tracked.running else "before it ran"
            log.info("%s from %s%s cancelled %s%s (the client cancelled or went away)", tracked.kind, tracked.client,
                     f" ({tracked.user})" if tracked.user else "", state, where)


def _one_message(run: worker_pb2.WorkerRunRequest) -> bool:
    """Whether the client reads `TraceResponse.results` (TraceRequest.one_message; a session: its first trace's)."""
    if run.HasField("session"):
        return bool(run.session.traces) and run.session.traces[0].request.one_message
    return run.request.one_message


def _client(context: grpc.ServicerContext) -> str:
    """Who sent a request: the client's own `nnd-client` metadata (free text, shortened), else the peer."""
    for key, value in context.invocation_metadata() or ():
        if key == contract.CLIENT_KEY and isinstance(value, str):
            return value[:80]
    return context.peer() or "?"


def _load_error(exc: BaseException) -> errors.NndError:
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, MemoryError) or "out of memory" in str(exc).lower():
        return errors.ResourceExhausted(f"out of memory while loading: {text}")
    if isinstance(exc, (OSError, FileNotFoundError)):
        return errors.NotFound(f"cannot load weights: {text}")
    if isinstance(exc, (ValueError, TypeError, ImportError)):
        return errors.InvalidArgument(f"cannot load weights: {text}")
    return errors.NndError(f"loading failed: {text}")
