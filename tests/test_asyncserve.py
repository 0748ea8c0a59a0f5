"""daemon/asyncserve.py on its own (a real gRPC server on a unix socket, in this process): calls
waiting for their request cost no pool thread, the bounds on them (per caller, in all) and the
idle cut-off, the socket's call cap refusing (not queueing) with the `nnd-busy` trailer, and the
synchronous context the handlers see (abort with trailers, cancel, callbacks, is_active), and a
stream its handler thread writes and reads itself (post, exchange: Interact's run)."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from nnd_daemon import asyncserve


def _echo(request: bytes, context: Any) -> bytes:
    return b"echo:" + request


def _lines(request: bytes, context: Any) -> Iterator[bytes]:
    for i in range(3):
        yield b"%d" % i


def _collect(requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
    for r in requests:
        yield b"got:" + r


class Steer:
    """A stream driven from its handler thread as an Interact run drives it: what it posted goes out,
    then it waits for the client's next message (`exchange`), with a bound."""

    def __init__(self) -> None:
        self.seen: list[Any] = []
        self.ended = threading.Event()

    def __call__(self, requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
        try:
            next(requests)  # the first message: already read on the loop
            context.post(initial_metadata=(("x-started", "1"),))
            context.post(b"paused")
            self.seen.append(context.exchange(30))
            context.post(b"again")
            self.seen.append(context.exchange(0.2))  # the client sends nothing: None after the bound
            context.post(b"bound")
            try:
                self.seen.append(context.exchange(30))  # the client ends its side, or cancels
            except grpc.RpcError as err:
                self.seen.append(err.code())
            context.flush()
        finally:
            self.ended.set()
        return
        yield


def _refuse(request: bytes, context: Any) -> None:
    context.set_trailing_metadata((("x-why", "because"),))
    context.abort(grpc.StatusCode.NOT_FOUND, "no such thing")


class Hold:
    """A handler that holds its thread until released, telling when it started and ended."""

    def __init__(self) -> None:
        self.started = threading.Semaphore(0)
        self.release = threading.Event()
        self.ended: list[bool] = []
        self.called_back = threading.Event()

    def __call__(self, request: bytes, context: Any) -> bytes:
        context.add_callback(self.called_back.set)
        self.started.release()
        while not self.release.wait(0.01):
            if not context.is_active():
                self.ended.append(False)
                return b""
        self.ended.append(True)
        return b"held"


@pytest.fixture
def serve(tmp_path):
    servers = []

    def make(**kwargs: Any) -> tuple[grpc.Channel, Hold]:
        hold = Hold()
        steer = kwargs.pop("steer", Steer())
        handlers = {
            "Echo": grpc.unary_unary_rpc_method_handler(_echo),
            "Lines": grpc.unary_stream_rpc_method_handler(_lines),
            "Collect": grpc.stream_stream_rpc_method_handler(_collect),
            "Refuse": grpc.unary_unary_rpc_method_handler(_refuse),
            "Hold": grpc.unary_unary_rpc_method_handler(hold),
            "Steer": grpc.stream_stream_rpc_method_handler(steer),
        }
        kwargs.setdefault("caller_of", lambda metadata, peer: (dict(metadata).get("who", "anon"), ""))
        server = asyncserve.Server(**kwargs)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", handlers),))
        address = f"unix://{tmp_path}/s{len(servers)}.sock"
        server.add_insecure_port(address)
        server.start()
        channel = grpc.insecure_channel(address)
        servers.append((server, channel))
        return channel, hold

    yield make
    for server, channel in servers:
        channel.close()
        server.stop(0).wait(10)


def _stalled(channel: grpc.Channel, release: threading.Event, n: int, who: str = "anon") -> list[Any]:
    def never() -> Iterator[bytes]:
        release.wait()
        return
        yield

    call = channel.stream_stream("/t.T/Echo")
    return [call(never(), metadata=(("who", who),)) for _ in range(n)]


def _code(call: Any) -> grpc.StatusCode:
    try:
        next(call)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_shapes_and_the_sync_context(serve):
    channel, _ = serve(threads=2, idle_s=10)
    assert channel.unary_unary("/t.T/Echo")(b"x", timeout=10) == b"echo:x"
    assert list(channel.unary_stream("/t.T/Lines")(b"", timeout=10)) == [b"0", b"1", b"2"]
    assert list(channel.stream_stream("/t.T/Collect")(iter([b"a", b"b"]), timeout=10)) == [b"got:a", b"got:b"]
    with pytest.raises(grpc.RpcError) as err:
        channel.unary_unary("/t.T/Refuse")(b"", timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and err.value.details() == "no such thing"
    assert ("x-why", "because") in [(m.key, m.value) for m in err.value.trailing_metadata()]


def test_calls_waiting_for_their_request_take_no_thread(serve):
    channel, hold = serve(threads=2, idle_s=0, per_client=0)
    release = threading.Event()
    try:
        stalled = _stalled(channel, release, 100)  # fifty times the pool
        assert channel.unary_unary("/t.T/Echo")(b"y", timeout=30) == b"echo:y"  # after them, same connection
        assert not any(call.done() for call in stalled)
    finally:
        release.set()
        for call in stalled:
            call.cancel()


def test_waiting_calls_are_bounded_per_caller_and_in_all_and_cut_off_when_idle(serve):
    channel, _ = serve(threads=2, idle_s=2, per_client=5, total=8)
    release = threading.Event()
    try:
        mallory = _stalled(channel, release, 12, who="mallory")
        # Another caller is served meanwhile (and, on the same connection, shows the server has them all).
        assert channel.unary_unary("/t.T/Echo")(b"z", timeout=30, metadata=(("who", "carol"),)) == b"echo:z"
        others = _stalled(channel, release, 5, who="bob")
        mine = Counter(_code(call) for call in mallory)
        theirs = Counter(_code(call) for call in others)
    finally:
        release.set()
    # Mallory: 5 wait (cut off after 2 s), 7 refused; bob: 3 more fit under the total of 8.
    assert mine == {grpc.StatusCode.DEADLINE_EXCEEDED: 5, grpc.StatusCode.RESOURCE_EXHAUSTED: 7}
    assert theirs == {grpc.StatusCode.DEADLINE_EXCEEDED: 3, grpc.StatusCode.RESOURCE_EXHAUSTED: 2}


def test_the_call_cap_refuses_with_the_busy_trailer_instead_of_queueing(serve):
    channel, hold = serve(threads=4, idle_s=10, max_calls=2)
    held = [channel.unary_unary("/t.T/Hold").future(b"", timeout=60) for _ in range(2)]
    for _ in held:
        assert hold.started.acquire(timeout=30)
    with pytest.raises(grpc.RpcError) as err:
        channel.unary_unary("/t.T/Echo")(b"", timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert any(m.key == asyncserve.BUSY_KEY for m in err.value.trailing_metadata())
    hold.release.set()
    assert [f.result(timeout=30) for f in held] == [b"held", b"held"]
    assert channel.unary_unary("/t.T/Echo")(b"again", timeout=30) == b"echo:again"


def test_a_cancelled_call_runs_its_callbacks_and_its_handler_sees_it(serve):
    channel, hold = serve(threads=2, idle_s=10)
    future = channel.unary_unary("/t.T/Hold").future(b"", timeout=60)
    assert hold.started.acquire(timeout=30)
    future.cancel()
    assert hold.called_back.wait(30)
    for _ in range(3000):
        if hold.ended:
            break
        threading.Event().wait(0.01)
    assert hold.ended == [False]  # is_active() turned False: the handler stopped early


@pytest.mark.parametrize("ends", ["closes", "cancels"])
def test_a_stream_its_handler_writes_and_reads_itself(serve, ends):
    import queue

    steer = Steer()
    channel, _ = serve(threads=2, idle_s=10, steer=steer)
    outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
    outbox.put(b"start")
    call = channel.stream_stream("/t.T/Steer")(iter(outbox.get, None), timeout=60)
    assert next(call) == b"paused"  # posted, then written while the handler waits for the answer
    assert ("x-started", "1") in [(m.key, m.value) for m in call.initial_metadata()]
    outbox.put(b"more")
    assert next(call) == b"again"
    assert next(call) == b"bound"  # its next wait ran out first
    if ends == "closes":
        outbox.put(None)
        assert list(call) == []
    else:
        call.cancel()
    assert steer.ended.wait(30)
    assert steer.seen[:2] == [b"more", None]
    # A cancelled call may read as the stream's end: either way the wait ends at once.
    assert steer.seen[2] in ((grpc.aio.EOF,) if ends == "closes" else (grpc.aio.EOF, grpc.StatusCode.CANCELLED))
