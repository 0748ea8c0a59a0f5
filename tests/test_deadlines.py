"""Deadlines without a thread per request (issue #28): a request's deadline is a point in time that
the places which already wait or poll compare against (worker/stop.py), in-process.

Each check forces its interleaving (a lock held, an event set) rather than hoping for one."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from nnd.v1 import nnd_pb2
from nnd_daemon import errors
from nnd_daemon.worker.gateway import Gateway
from nnd_daemon.worker.stop import Stop
from nnd_daemon.worker.turns import Turns


class _Context:
    def __init__(self, remaining=None, metadata=()):
        self._remaining = remaining
        self._metadata = metadata

    def time_remaining(self):
        return self._remaining

    def invocation_metadata(self):
        return self._metadata


def _gateway(deadline_s: float) -> Gateway:
    return Gateway(SimpleNamespace(model=None), "m", 0, nnd_pb2.Limits(default_deadline_s=deadline_s))


def test_a_request_starts_no_thread_for_its_deadline(monkeypatch):
    started = []
    real_start = threading.Thread.start

    def counting(self):
        started.append(self.name)
        real_start(self)

    monkeypatch.setattr(threading.Thread, "start", counting)
    seen = []
    for _ in range(20):
        stop, _ = _gateway(600)._stop(_Context())
        seen.append(stop)
    assert started == []
    assert all(590 < s.remaining() <= 600 for s in seen)


def test_a_deadline_that_passes_while_running_ends_the_request_as_deadline_exceeded():
    # What the engine does at its next hook: it finds `cancelled()` true and raises Cancelled.
    def call(context):
        stop, on_error = _gateway(1e-9)._stop(context)
        assert stop.is_set() and stop.expired
        raise on_error(errors.Cancelled("request cancelled"))

    with pytest.raises(errors.DeadlineExceeded, match="--deadline"):
        call(_Context())
    # Forwarded by the daemon for a client without a deadline: the daemon's default, named as such.
    forwarded = _Context(remaining=5.0, metadata=(("nnd-default-deadline", "1"),))
    with pytest.raises(errors.DeadlineExceeded, match="--deadline"):
        call(forwarded)


def test_a_client_deadline_is_kept_as_it_asked():
    stop, _ = _gateway(600)._stop(_Context(remaining=2.0))
    assert 0 < stop.remaining() <= 2.0


def test_a_queued_request_leaves_the_line_at_its_deadline_and_when_cancelled():
    turns = Turns()
    turns.acquire()  # the model is busy for the whole test
    assert turns.acquire(stop=Stop(0.05)) is False
    assert turns.waiting() == 0
    stop = Stop(600)
    result = []
    waiter = threading.Thread(target=lambda: result.append(turns.acquire(stop=stop)))
    waiter.start()
    while turns.waiting() != 1:
        threading.Event().wait(0.001)
    stop.set()  # the client went away
    waiter.join(30)
    assert result == [False] and turns.waiting() == 0
    turns.release()
    assert turns.acquire(stop=Stop(600)) is True  # the model was free: nobody took it on the way


def test_a_waiter_handed_the_model_as_its_deadline_passes_keeps_it():
    turns = Turns()
    turns.acquire()
    stop = Stop(600)
    result = []
    waiter = threading.Thread(target=lambda: result.append(turns.acquire(stop=stop)))
    waiter.start()
    while turns.waiting() != 1:
        threading.Event().wait(0.001)
    turns.release()  # handed over first...
    stop.set()  # ...then cancelled: the turn is the waiter's, to release
    waiter.join(30)
    assert result == [True] and turns.locked()
    turns.release()
    assert not turns.locked()


# ------------------------------------------------------------------ an Interact stream's buffer


class _StreamContext(_Context):
    def __init__(self):
        super().__init__()
        self.callbacks = []

    def add_callback(self, fn):
        self.callbacks.append(fn)
        return True

    def peer(self):
        return "unix:test"

    def send_initial_metadata(self, md):
        pass


def test_a_queued_interact_stream_reads_a_bounded_number_of_continuations_counted_in_the_budget():
    from nnd.v1 import graph_pb2, nnd_pb2, worker_pb2
    from nnd_daemon.inflight import InflightBudget
    from nnd_daemon.worker import service as service_mod

    svc = service_mod.WorkerService()
    svc.model = object()  # never runs: the model stays busy until the stream is cancelled
    budget = InflightBudget(0, holder="the worker")
    big = graph_pb2.Graph()
    big.nodes.add(id=1).loc.text = "x" * 100_000
    pulled = []

    def continuations():
        for i in range(100):
            pulled.append(i)
            yield worker_pb2.WorkerInteractContinue(more=nnd_pb2.InteractContinue(graph=big))

    context = _StreamContext()
    svc._run_lock.acquire()
    start = nnd_pb2.InteractStart(want=[1])
    responses = svc.interact(worker_pb2.WorkerRunRequest(), start, continuations(), context, Stop(600), inflight=budget)
    errors_seen = []
    consumer = threading.Thread(target=lambda: errors_seen.append(_drain(responses)))
    consumer.start()
    while len(pulled) < service_mod.INBOX_SIZE:
        threading.Event().wait(0.01)
    threading.Event().wait(1.0)  # had the reader not stopped, it would have read on by now
    assert len(pulled) <= service_mod.INBOX_SIZE + 1
    assert 0 < budget.held <= service_mod.INBOX_SIZE * 100_100
    for callback in context.callbacks:  # the client goes away
        callback()
    consumer.join(30)
    assert isinstance(errors_seen[0], errors.Cancelled)
    assert budget.held == 0  # what the run never read was given back
    svc._run_lock.release()


def _drain(responses):
    try:
        for _ in responses:
            pass
    except BaseException as exc:  # noqa: BLE001 - the test looks at it
        return exc
    return None
