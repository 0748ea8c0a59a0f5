"""daemon/worker/fastroute.py on its own (a real FastRoute on a unix socket, in this process), for what
keeps a call's wake-ups few: a call answered before its handler returns (`Context.answer`: the client
has its last message and OK, and its connection takes the next call, while the handler finishes), and the
pool thread that served a call waiting on its connection for the next one (`_linger`), with the
socket's guards kept on a call taken that way: the idle bound on a frame sent in part, and the
cancellation of a call whose client goes away. And the worker's Status, which waits for the
bookkeeping of a call answered before it ran (Activity.hold_status)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from nnd.v1 import nnd_pb2, worker_pb2
from nnd_daemon.worker import activity, fastroute
from tests.support.fastframes import frame, reply

IDLE_S = 0.5


class Handlers:
    """TraceOnce as a test drives it: echo a request, or (for b"block") wait to be released or cancelled;
    b"answer-then-fail" answers, waits to be released, then fails."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.cancelled = threading.Event()
        self.finished = threading.Event()
        self.threads: list[int] = []

    def __call__(self, request: bytes, context: Any) -> bytes:
        self.threads.append(threading.get_ident())
        if request == b"block":
            context.add_callback(self.cancelled.set)
            self.started.set()
            assert self.cancelled.wait(30)
            return b"never read"
        if request == b"answer-then-hold":  # answers, then runs on until released
            context.answer(b"answered")
            self.started.set()
            assert self.release.wait(30)
            return b"never read"
        if request == b"answer-then-fail":
            self.started.set()  # before the answer: the client may read it before this thread runs on
            context.answer(b"answered")
            try:
                assert self.release.wait(30)
                raise RuntimeError("after the answer")
            finally:
                self.finished.set()
        return b"echo:" + request

    def steer(self, requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
        """Interact as a run drives it: pause (post, then read the client's next message), then answer
        with its last message, and go on (its bookkeeping) until released."""
        assert next(requests) == b"start"
        context.post(b"paused")
        got = context.exchange(30)
        self.started.set()  # before the answer (as above)
        context.answer(b"done:" + got)
        try:
            assert self.release.wait(30)
        finally:
            self.finished.set()
        return
        yield


@pytest.fixture
def route(tmp_path) -> Iterator[tuple[fastroute.FastRoute, Handlers]]:
    handlers = Handlers()
    served = fastroute.FastRoute(str(tmp_path / "fast.sock"), threads=8, idle_s=IDLE_S)
    served.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "nnd.v1.Nnd",
                {
                    "TraceOnce": grpc.unary_unary_rpc_method_handler(handlers),
                    "Interact": grpc.stream_stream_rpc_method_handler(handlers.steer),
                },
            ),
        )
    )
    served.start()
    yield served, handlers
    handlers.cancelled.set()
    handlers.release.set()
    served.stop()


def _connect(served: fastroute.FastRoute) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(served.path)
    assert sock.recv(1) == b"\x01"
    return sock


def _send(sock: socket.socket, body: bytes, method: str = "TraceOnce", **fields: Any) -> None:
    sock.sendall(frame(nnd_pb2.FastCall(method=method, **fields).SerializeToString(), body))


def _answer(sock: socket.socket) -> bytes:
    """A unary call's reply: its response, then its end, which must be OK."""
    header, body = reply(sock)
    assert not header.end, header
    end, _ = reply(sock)
    assert end.end and end.code == grpc.StatusCode.OK.value[0], end
    return body


def _until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def _waited_on(served: fastroute.FastRoute) -> None:
    """Until the thread that served the last call waits on its connection for the next."""
    _until(lambda: served.waiting == 1, "no pool thread waited on the connection")


@contextlib.contextmanager
def _served_once(served: fastroute.FastRoute) -> Iterator[socket.socket]:
    """A connection that has had one call answered, its thread now waiting on it for the next."""
    with contextlib.closing(_connect(served)) as sock:
        _send(sock, b"one")
        assert _answer(sock) == b"echo:one"
        _waited_on(served)
        yield sock


def _free_while_it_runs(sock: socket.socket, handlers: Handlers) -> None:
    """After an answer: its handler still runs, and the connection takes the next call meanwhile (once
    the call has waited HAND_OVER_S for that handler's thread, another serves it); once
    the handler ends (failing, or not), nothing more of its call reaches the client."""
    assert handlers.started.is_set() and not handlers.finished.is_set()
    _send(sock, b"next")
    assert _answer(sock) == b"echo:next"
    handlers.release.set()
    assert handlers.finished.wait(30)
    _send(sock, b"last")
    assert _answer(sock) == b"echo:last"


def test_the_next_call_on_a_connection_is_taken_by_the_thread_that_waited_for_it(route):
    served, handlers = route
    with _served_once(served) as sock:
        _send(sock, b"two")
        assert _answer(sock) == b"echo:two"
        assert served.lingered == 1 and handlers.threads[0] == handlers.threads[1]
        # Left alone, the thread gives the connection back to the loop, which serves it as before.
        time.sleep(fastroute.LINGER_S * 2)
        _until(lambda: served.waiting == 0, "the waiting thread never gave the connection back")
        _send(sock, b"three")
        assert _answer(sock) == b"echo:three"


def test_a_call_sent_before_the_thread_that_answered_the_last_has_unwound_waits_for_that_thread(route, monkeypatch):
    # Batched runs answer their members before the members' threads wake: the clients send again at once.
    # The call goes to the thread still serving the connection once it unwinds, not to a new pool thread.
    monkeypatch.setattr(fastroute, "HAND_OVER_S", 30.0)  # (the interleaving forced: it waits for the thread)
    served, handlers = route
    with contextlib.closing(_connect(served)) as sock:
        _send(sock, b"answer-then-hold")
        assert _answer(sock) == b"answered"
        _send(sock, b"next")
        _until(lambda: served.parked == 1, "the loop did not leave the call for the connection's thread")
        assert handlers.threads == [handlers.threads[0]]  # not served meanwhile
        handlers.release.set()
        assert _answer(sock) == b"echo:next"
        assert handlers.threads[1] == handlers.threads[0] and served.handed == 1 and served.parked == 0


def test_a_refused_requests_body_is_dropped_and_the_connection_serves_the_next_call(tmp_path):
    # A request over the socket's bound is refused before its body is read; the client sends the frame
    # whole all the same. Those bytes are dropped, not read as frames (before: the loop took them for a
    # second call mid-call and closed the connection, the refusal sometimes lost with it).
    handlers = Handlers()
    served = fastroute.FastRoute(str(tmp_path / "small.sock"), threads=4, idle_s=30, max_body=1000)
    served.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("nnd.v1.Nnd", {"TraceOnce": grpc.unary_unary_rpc_method_handler(handlers)}),)
    )
    served.start()
    try:
        with contextlib.closing(_connect(served)) as sock:
            _send(sock, b"x" * 300_000)  # more than a socket buffer: sent only as the worker drops it
            header, _ = reply(sock)
            assert header.end and header.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], header
            assert "nothing ran" in header.details
            _send(sock, b"next")
            assert _answer(sock) == b"echo:next"
            assert handlers.threads and len(handlers.threads) == 1  # the refused request never ran
    finally:
        served.stop()


def test_a_frame_begun_while_a_thread_waited_is_still_cut_off_at_the_idle_bound(route):
    served, _ = route
    with _served_once(served) as sock:
        sock.sendall(b"\x10\x00")  # two bytes of a header's length, and no more
        started = time.monotonic()
        assert sock.recv(1) == b""  # closed by the worker (within the socket's 30 s timeout)
        assert time.monotonic() - started >= IDLE_S * 0.9


def test_a_call_taken_by_a_waiting_thread_is_cancelled_when_its_client_goes(route):
    served, handlers = route
    with _served_once(served) as sock:
        _send(sock, b"block")
        assert handlers.started.wait(30)
        assert served.lingered == 1
    assert handlers.cancelled.wait(30), "the call went on after its client went away"


def test_an_answer_goes_out_before_its_handler_returns_and_frees_the_connection(route):
    served, handlers = route
    sock = _connect(served)
    try:
        _send(sock, b"answer-then-fail")
        assert _answer(sock) == b"answered"  # its handler still runs
        _free_while_it_runs(sock, handlers)
    finally:
        sock.close()


def test_a_stream_answers_with_its_last_message_and_frees_the_connection(route):
    served, handlers = route
    sock = _connect(served)
    try:
        _send(sock, b"start", method="Interact")
        header, body = reply(sock)
        assert not header.end and body == b"paused"
        _send(sock, b"more", method="")  # a later message of the stream: no method
        assert _answer(sock) == b"done:more"  # its last message and OK, while its handler runs on
        _send(sock, b"", method="", half_close=True)  # the client's last word after the end: nothing
        _free_while_it_runs(sock, handlers)
    finally:
        sock.close()


def test_status_waits_for_the_bookkeeping_of_a_call_answered_before_it():
    acts = activity.Activity()
    acts.begin("", 0, "m")
    with acts.track("trace", "client"):
        pass
    release = acts.hold_status()  # the answer goes out here, before the request's admission ends
    filled = threading.Event()
    status = worker_pb2.WorkerStatus()

    def read() -> None:
        acts.fill(status)
        filled.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert not filled.wait(0.2)  # Status waits (it can only be later, never sooner, under load)
    acts.end()
    release()
    assert filled.wait(30)
    reader.join()
    assert status.active == 0 and status.idle_since > 0 and not status.requests
    assert [(r.kind, r.status, r.count) for r in status.stats.requests] == [("trace", "ok", 1)]
