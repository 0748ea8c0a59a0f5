"""Stalled calls (opened, their request never sent) cost no thread and are bounded per caller (issue
#26), on the daemon's own socket and on a worker's route socket, against real daemons: health and
the listings answer throughout, a bystander's trace is served with the same numbers, one caller's
waiting calls are bounded by its verified identity (not the `nnd-client` names it sends), a call
whose request does not come is cut off, and the Python client goes through the daemon when its
route refuses it."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch

import nnd
from nnd.v1 import nnd_pb2, nnd_pb2_grpc
from nnd.wire._identity import fetch_ticket
from tests.support.daemonproc import Daemon, start_daemon

PROMPT = "Hello world"
# Methods a stalled call opens, as streams whose request never comes: unary ones and Interact.
METHODS = ("ListModels", "GetServerInfo", "Dispatch", "Tokenize", "LoadModel", "Interact")
WAITING = 8  # --max-waiting-calls of the bounded daemon
IDLE_S = 15  # its --request-idle-timeout


def _stall(channel: grpc.Channel, method: str, release: threading.Event, metadata: Any = ()) -> Any:
    def never() -> Iterator[bytes]:  # the request never comes (until the test ends)
        release.wait()
        return
        yield

    call = channel.stream_stream(f"/nnd.v1.Nnd/{method}", request_serializer=bytes, response_deserializer=bytes)
    return call(never(), metadata=metadata)


def _health(channel: grpc.Channel, timeout: float) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout).status


def _outcome(call: Any) -> tuple[grpc.StatusCode, str]:
    try:
        next(call)
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


def _refused_at_once(calls: list[Any], n: int) -> list[Any]:
    """Wait until `n` of `calls` have ended (refusals end at once; waiting calls do not), then
    return the ones that ended, checking that they were refused and that no more than `n` did."""
    ended: list[Any] = []
    deadline = threading.Event()
    timer = threading.Timer(120, deadline.set)
    timer.start()
    try:
        while len(ended) < n and not deadline.is_set():
            ended = [call for call in calls if call.done()]
            deadline.wait(0.05)
    finally:
        timer.cancel()
    assert len(ended) == n, f"{len(ended)} of {len(calls)} calls ended, not {n}"
    assert {_outcome(call)[0] for call in ended} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    return ended


def test_hundreds_of_stalled_calls_on_the_daemons_socket_take_no_thread(tmp_path, tiny_models):
    from grpc_health.v1 import health_pb2

    # No per-caller bound and no cut-off here: the 300 calls all wait, and must cost no handler thread
    # (the daemon has 256; gRPC's sync server gave each call one while it waited for the request).
    d = start_daemon(tmp_path, "--max-waiting-calls", "0", "--request-idle-timeout", "0")
    release = threading.Event()
    attacker = grpc.insecure_channel(d.address)
    try:
        model = nnd.TransformersModel(tiny_models["gpt2"], address=d.address, device="cpu", dispatch=True)
        with model.trace(PROMPT):
            want = model.lm_head.output.save()
        stalled = [_stall(attacker, METHODS[i % len(METHODS)], release) for i in range(300)]
        # A call on the same connection after them: once it is answered, the daemon has all 300 open.
        assert _health(attacker, timeout=60) == health_pb2.HealthCheckResponse.SERVING
        with grpc.insecure_channel(d.address) as channel:
            stub = nnd_pb2_grpc.NndStub(channel)
            for _ in range(5):
                assert _health(channel, timeout=1) == health_pb2.HealthCheckResponse.SERVING
                assert model.name in [m.name for m in stub.ListModels(nnd_pb2.ListModelsRequest(), timeout=5).models]
            stub.GetServerInfo(nnd_pb2.GetServerInfoRequest(), timeout=30)
        with model.trace(PROMPT, timeout=120):
            got = model.lm_head.output.save()
        assert torch.equal(got, want)
        assert all(not call.done() for call in stalled)  # still open: nothing cut them off meanwhile
    finally:
        release.set()
        for call in stalled:
            call.cancel()
        attacker.close()
        d.stop()


@pytest.fixture(scope="module")
def bounded(tmp_path_factory, tiny_models) -> Iterator[tuple[Daemon, Any]]:
    d = start_daemon(
        tmp_path_factory.mktemp("bounded"),
        "--max-waiting-calls",
        str(WAITING),
        "--request-idle-timeout",
        str(IDLE_S),
    )
    model = nnd.TransformersModel(tiny_models["gpt2"], address=d.address, device="cpu", dispatch=True)
    yield d, model
    d.stop()


def test_one_identitys_waiting_calls_are_bounded_whatever_client_names_it_sends_and_cut_off(bounded):
    d, model = bounded
    ticket = fetch_ticket(d.address)
    assert ticket, "the daemon's .who socket gave no ticket"
    release = threading.Event()
    attacker = grpc.insecure_channel(d.address)
    try:
        # One user, fifty client names: one identity, so WAITING calls wait and the rest are refused.
        stalled = [
            _stall(attacker, METHODS[i % len(METHODS)], release, (("nnd-user", ticket), ("nnd-client", f"c{i}")))
            for i in range(50)
        ]
        _health(attacker, timeout=60)  # the daemon has them all (same connection, after them)
        # Another identity (no ticket: the unverified local one) is not refused meanwhile.
        with grpc.insecure_channel(d.address) as channel:
            nnd_pb2_grpc.NndStub(channel).ListModels(nnd_pb2.ListModelsRequest(), timeout=10)
        outcomes = [_outcome(call) for call in stalled]
    finally:
        release.set()
        attacker.close()
    codes = Counter(code for code, _ in outcomes)
    assert codes == {grpc.StatusCode.RESOURCE_EXHAUSTED: 50 - WAITING, grpc.StatusCode.DEADLINE_EXCEEDED: WAITING}
    refusal = next(text for code, text in outcomes if code == grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert "--max-waiting-calls" in refusal
    cut = next(text for code, text in outcomes if code == grpc.StatusCode.DEADLINE_EXCEEDED)
    assert f"no request within {IDLE_S} s" in cut and "--request-idle-timeout" in cut
    # The bound is free again once they are gone.
    with model.trace(PROMPT, timeout=120):
        model.lm_head.output.save()


def test_stalled_calls_on_a_route_are_bounded_per_identity_and_the_client_falls_back(bounded, monkeypatch):
    d, model = bounded
    # The route's gRPC socket is the subject: the client's calls take it, not the fast socket (whose own
    # bounds tests/process/test_fast_route.py checks).
    monkeypatch.setenv("NND_FAST", "0")
    model._conn.router.close()
    with model.trace(PROMPT):
        want = model.lm_head.output.save()
    with grpc.insecure_channel(d.address) as channel:
        route = nnd_pb2_grpc.NndStub(channel).GetRoute(nnd_pb2.RouteRequest(model=model.name), timeout=60)
    release = threading.Event()
    attacker = grpc.insecure_channel(route.address)
    stalled: list[Any] = []
    try:
        # 330 calls without a ticket (more than the socket's 256 calls and 320 threads): one identity,
        # so WAITING of them wait and the rest are refused at once; a bystander's trace goes by the route.
        stalled += [_stall(attacker, ("Trace", "Interact")[i % 2], release) for i in range(330)]
        refused = _refused_at_once(stalled, 330 - WAITING)
        assert any(k == "nnd-busy" for k, _ in refused[0].trailing_metadata())  # what the client falls back on
        before = model._conn.router.fallbacks
        with model.trace(PROMPT, timeout=120):
            got = model.lm_head.output.save()
        assert torch.equal(got, want)
        assert model._conn.router.fallbacks == before  # served by the route itself
        # Now the bystander's own identity has its waiting calls at the bound on the route: its trace is
        # refused there before anything ran, and goes through the daemon (same numbers).
        ticket = fetch_ticket(d.address)
        mine = [_stall(attacker, "Trace", release, (("nnd-user", ticket),)) for _ in range(WAITING + 1)]
        stalled += mine
        over = _refused_at_once(mine, 1)  # the bound is reached now
        with model.trace(PROMPT, timeout=120):
            got = model.lm_head.output.save()
        assert torch.equal(got, want)
        assert model._conn.router.fallbacks == before + 1
        # The waiting ones are cut off once the idle bound passes.
        for call in [c for c in mine if c not in over]:
            code, text = _outcome(call)
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "--request-idle-timeout" in text, (code, text)
    finally:
        release.set()
        for call in stalled:
            call.cancel()
        attacker.close()
